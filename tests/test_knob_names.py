"""One name per knob: every option of a command is the name of a parameter (or a field of a settings type) of
the Python it calls, spelled ``--name-with-dashes``; what only the command line has is listed here with why.
A new option under another name than its Python knob fails this test."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import click
import pytest
import typer

from rotationzoo import api, export, planner, serving
from rotationzoo.cli.main import app
from rotationzoo.evaluate import CopyProbe, EvalProtocol
from rotationzoo.files.calibrated import import_calibrated
from rotationzoo.files.localpair import verify_path
from rotationzoo.hub import cache_records, remove_cached, verify_cache
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.mla import import_latent_folder
from rotationzoo.publish import publish, verify_registry
from rotationzoo.recipe import FitRecipe, KeepRule, Refinement
from rotationzoo.registry import list_models
from rotationzoo.workflows import EvalRequest, calibrate, fit_dump

#: The command line's own: output forms and questions, which Python has as return values.
EVERY_COMMAND = {"json_out", "as_json"}


def _names(*things: Any, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for t in things:
        if dataclasses.is_dataclass(t):
            out |= {prefix + f.name for f in dataclasses.fields(t)}
        else:
            out |= {prefix + p for p in inspect.signature(t).parameters}
    return out


_FETCH = {"source", "revision", "cache_dir", "offline", "timeout"}  # EvalRequest.fetch / verify_path(fetch=)
_FMT = "--format: fmt= in Python (format is a builtin's name)"
_RECIPE = _names(FitRecipe, Refinement) | _names(KeepRule, prefix="keep_") | _names(Int2KVConfig)

#: command → (the Python names its options must be among, {option: why the command line differs}).
COMMANDS: dict[str, tuple[set[str], dict[str, str]]] = {
    "list": (_names(list_models), {"plain_out": "a print form (--plain)"}),
    "fetch": (_names(api.fetch), {"model_arg": "the model as a positional argument, beside --model"}),
    "serve-args": (_names(serving.launch_spec), {"fmt": "a print form of the LaunchSpec (render(fmt))"}),
    "export": (_names(export.export), {}),
    "publish": (_names(publish), {}),
    "plan": (_names(planner.plan) | _names(Int2KVConfig), {
        "model_arg": "the model as a positional argument, beside --model",
        "gpu_memory": "a size with its unit (80GiB), gpu_memory_bytes in Python",
        "weights_gib": "GiB, weights_bytes in Python"}),
    "verify": (_names(verify_path, verify_registry) | _FETCH, {
        "paths": "several paths, verify_path one each", "registry": "verify_registry() instead of verify_path()"}),
    "fit": (_names(fit_dump) | _RECIPE, {
        "refine": "Refinement(steps=...): the option turns refinement on",
        "serving": "Refinement.int2kv from a registry entry's serving settings",
        "keep_text": "KeepRule.texts (repeatable: one text per flag)", "fmt": _FMT}),
    "calibrate": (_names(calibrate) | _RECIPE, {
        "text": "texts (repeatable: one text per flag)",
        "refine": "Refinement(steps=...): the option turns refinement on",
        "serving": "Refinement.int2kv from a registry entry's serving settings",
        "keep_text": "KeepRule.texts (repeatable: one text per flag)", "fmt": _FMT}),
    "eval": (_names(EvalRequest, EvalProtocol, CopyProbe, Int2KVConfig) | _FETCH, {
        "text": "texts (repeatable: one text per flag)",
        "probe": "EvalProtocol.probe = CopyProbe(...) when copy",
        "plot": "plot_report(report, path) after the run"}),
    "cache ls": (_names(cache_records), {}),
    "cache rm": (_names(remove_cached), {"all_": "all= (a Python builtin's name as the variable)",
                                         "dry_run": "removal_plan() instead", "yes": "the question asked first"}),
    "cache verify": (_names(verify_cache), {"keep": "remove_bad=not keep"}),
    "cache import": (_names(import_calibrated, import_latent_folder), {
        "latent": "import_latent_folder(folder, model=...) instead of import_calibrated"}),
}


def _commands() -> dict[str, click.Command]:
    out: dict[str, click.Command] = {}

    def walk(c: click.Command, path: str) -> None:
        if isinstance(c, click.Group):
            for name, sub in c.commands.items():
                walk(sub, f"{path} {name}".strip())
        else:
            out[path] = c

    walk(typer.main.get_command(app), "")
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_is_named_as_its_python_knob(command: str) -> None:
    python, cli_only = COMMANDS[command]
    params = [p for p in _commands()[command].params if p.name not in EVERY_COMMAND]
    assert set(cli_only) <= {p.name for p in params}, f"{command}: listed options it no longer has"
    for p in params:
        if p.name in cli_only:
            continue
        assert p.name in python, f"{command}: option {p.opts[0]} ({p.name}) is no Python parameter or field"
        if isinstance(p, click.Option):  # the flag spells the Python name (aliases may follow it)
            assert p.opts[0] == "--" + p.name.replace("_", "-"), f"{command}: {p.opts[0]} is not --{p.name.replace('_', '-')}"


def test_every_command_with_options_is_listed() -> None:
    """A command whose options are more than its output forms is checked above (info and demo print only)."""
    have = {name for name, c in _commands().items() if {p.name for p in c.params} - EVERY_COMMAND - {"model", "tag"}}
    assert have - set(COMMANDS) <= {"demo"}, sorted(have - set(COMMANDS))  # demo: a fixed example, no library call
