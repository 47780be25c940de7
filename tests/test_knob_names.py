"""One name per knob: every option of a command is the name of a parameter (or a field of a settings type) of
the Python it calls, spelled ``--name-with-dashes``; what only the command line has is listed here with why.
A new option under another name than its Python knob fails this test, and for serve-args, export and fetch,
whose options all go to one function, a value that does not reach the parameter of its name fails too."""

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


#: command line → (module and function the command calls, what that function must receive). Every value differs
#: from its default, so an option passed under another name, or not passed, fails.
WIRED = {
    "serve-args": (["serve-args", "Qwen3-8B", "--engine", "vllm", "--tag", "t1", "--model-path", "/m",
                    "--source", "huggingface", "--revision", "abc", "--tp-size", "8", "--ep-size", "4",
                    "--no-absorb-v-rotation", "--disable-radix-cache", "--calibrate", "--block-size", "64",
                    "--k-clip-per-layer", "0.9,0.8", "--k-clip-per-head", "h.json", "--cache-dir", "/c",
                    "--online", "--timeout", "7"],
                   ("rotationzoo.serving", "launch_spec"),
                   {"model": "Qwen3-8B", "engine": "vllm", "tag": "t1", "model_path": "/m", "source": "huggingface",
                    "revision": "abc", "tp_size": 8, "ep_size": 4, "absorb_v_rotation": False,
                    "disable_radix_cache": True, "calibrate": True, "block_size": 64, "k_clip_per_layer": "0.9,0.8",
                    "k_clip_per_head": "h.json", "cache_dir": "/c", "offline": False, "timeout": 7.0}),
    "export": (["export", "Qwen3-8B", "--to", "gguf", "--out", "/o.gguf", "--tag", "t1", "--side", "k",
                "--base-gguf", "/b.gguf", "--source", "modelscope", "--revision", "abc", "--cache-dir", "/c",
                "--offline", "--timeout", "7"],
               ("rotationzoo.export", "export"),
               {"rotations": "Qwen3-8B", "to": "gguf", "out": "/o.gguf", "tag": "t1", "side": "k",
                "base_gguf": "/b.gguf", "source": "modelscope", "revision": "abc", "cache_dir": "/c", "offline": True,
                "timeout": 7.0}),
    "fetch": (["fetch", "--model", "Qwen3-8B", "--tag", "t1", "--source", "huggingface", "--revision", "abc",
               "--cache-dir", "/c", "--online", "--force", "--accept-new", "--timeout", "7"],
              ("rotationzoo.api", "fetch"),
              {"model": "Qwen3-8B", "tag": "t1", "source": "huggingface", "revision": "abc", "cache_dir": "/c",
               "offline": False, "force": True, "accept_new": True, "timeout": 7.0}),
}


@pytest.mark.parametrize("command", sorted(WIRED))
def test_every_option_reaches_its_python_knob(command: str, monkeypatch) -> None:
    """Each option's value arrives at the parameter of its name (a path as the path given)."""
    import importlib
    from pathlib import Path

    from rotationzoo.cli.main import main
    from rotationzoo.errors import RotationZooError

    argv, (module, name), want = WIRED[command]
    got: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> Any:
        params = list(inspect.signature(original).parameters)
        got.update(zip(params, args), **kwargs)
        raise type("Stop", (RotationZooError,), {})("stopped where the library starts")

    original = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(importlib.import_module(module), name, record)
    assert main(argv) == 1
    seen = {k: (str(v) if isinstance(v, Path) else v) for k, v in got.items() if k in want}
    assert seen == want
    names = {p.name for p in _commands()[command].params} - EVERY_COMMAND - set(COMMANDS[command][1])
    assert names - {"model_arg"} <= set(want), f"{command}: options the test does not give: {names - set(want)}"
