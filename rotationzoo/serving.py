"""Launch settings for the engines that serve OSCAR INT2 KV caches.

:func:`launch_spec` resolves rotations (a registry entry, fetched and verified if needed, or any
source :func:`~rotationzoo.pair.resolve_pair` accepts), takes the INT2-KV settings from the entry's
``serving`` block and the launch knobs from its ``launch`` block, checks the files against what the
engine target reads, and assembles the environment, command line, preparation steps, caveats, the
KV heads of each tensor-parallel rank and the server log lines to look for (see
:mod:`rotationzoo.engines` for each target). For llama.cpp it also exports a rotations GGUF into
the cache's derived area (``rotationzoo cache ls`` lists it) and prints the step that appends it to
a model GGUF. With ``calibrate=True`` nothing is fetched: the launch makes the authors' server fit
a pair at start-up.

Example::

    from rotationzoo.serving import launch_spec
    spec = launch_spec("Qwen3-30B-A3B")            # the authors' current SGLang tree
    print(spec.render("shell"))          # env prefix + python -m sglang.launch_server ...
    spec.env["SGLANG_OSCAR_K_ROTATION_PATH"], spec.ranks, spec.checks

    pair = rotationzoo.load("Qwen3-8B")
    pair.serve_env("vllm")               # {"VLLM_OSCAR_K_ROTATION_PATH": ..., ...}
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from .engines import (
    ENGINES,
    kv_head_counts,
    llamacpp_args,
    llamacpp_env,
    pair_kinds,
    prepare,
    serve_env,
    sglang_env,
    sglang_page_size,
    target,
    vllm_env,
)
from .derived import ensure_rotation_files, ensure_rotations_gguf, rotations_gguf_path
from .errors import RegistryError, RotationZooError, ServingError
from .launch import LaunchConfig
from .numbers import shown
from .pair import RotationPair, looks_like_path, resolve_pair
from .registry import get_entry, split_model_tag
from .registry.safety import check_model_id
from .sharding import kv_heads_per_rank

OutputFormat = Literal["shell", "env", "json"]
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)
#: Name of the rotations GGUF kept in the cache's derived area (this project's choice).
#: What the launch loads when the rotations name no usable model id and no ``--model-path`` is given.
MODEL_PLACEHOLDER = "MODEL"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _check_printable(value: str, what: str) -> str:
    """``value`` unless it holds a control character (a newline would start a new line of a
    pasted command or of an env file); the launch is then refused rather than printed."""
    if not isinstance(value, str):
        raise ServingError(f"{what} must be a string, got {type(value).__name__}")
    if _CONTROL.search(value):
        raise ServingError(f"{what} {shown(value)} holds a control character (newline, tab, escape …); a launch line "
                           "cannot carry it safely: rename the file or folder, or pass a plain --model-path")
    return value


def _arg_path(path: str | os.PathLike[str]) -> str:
    """A path as a command-line argument: a relative one starting with ``-`` gets ``./`` (never read as an option)."""
    text = str(path)
    return f"./{text}" if text.startswith("-") else text


@dataclass
class LaunchSpec:
    """Everything needed to start one engine with one rotation pair.

    Attributes:
        engine: ``"sglang"``, ``"sglang-legacy"``, ``"vllm"`` or ``"llamacpp"``.
        model: registry model id (e.g. ``"Qwen/Qwen3-8B"``), or the pair's source when not from the registry.
        tag: calibration tag (``None`` when not from the registry).
        env: environment variables, in launch order.
        args: the command line (``argv``).
        files: local files the launch uses: ``k``, ``v`` (and ``gguf`` for llama.cpp); none for a
            start-up calibration launch.
        prepare: commands (``argv`` lists) to run once before ``args`` (llama.cpp: build the
            model GGUF with the rotations appended).
        notes: caveats for this engine and entry.
        ranks: ``{"rank", "kv_heads", "of"}`` per tensor-parallel rank (and per KV-head count of a file
            whose layers differ), when the KV heads are known.
        checks: lines the server's log must show for the rotations to have been read as meant.
    """

    engine: str
    model: str
    tag: str | None
    env: dict[str, str]
    args: list[str]
    files: dict[str, str]
    prepare: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def check(self) -> None:
        """Refuse what cannot be printed into a shell line or an env file safely: variable names
        that are not shell identifiers, and values or arguments holding control characters.

        Raises:
            ServingError: one line naming the bad name or value.
        """
        for k, v in self.env.items():
            if not isinstance(k, str) or not _ENV_NAME.match(k):
                raise ServingError(f"environment variable name {shown(k)} is not a shell identifier ([A-Za-z_][A-Za-z0-9_]*)")
            _check_printable(v, k)
        for i, a in enumerate(self.args):
            _check_printable(a, f"argument {i}")
        for c in self.prepare:
            for a in c:
                _check_printable(a, "preparation argument")

    @property
    def command(self) -> str:
        """The launch as one shell line: ``K=V … argv`` (every value shell-quoted)."""
        self.check()
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.args)

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "model": self.model,
            "tag": self.tag,
            "env": dict(self.env),
            "args": list(self.args),
            "command": self.command,
            "files": dict(self.files),
            "prepare": [shlex.join(c) for c in self.prepare],
            "notes": list(self.notes),
            "ranks": [dict(r) for r in self.ranks],
            "checks": list(self.checks),
        }

    def render(self, fmt: str = "shell") -> str:
        """Text for ``fmt``:

        - ``shell``: copy-pasteable; preparation commands joined with ``&&``, one variable per line;
        - ``env``: ``KEY=VALUE`` lines (values shell-quoted with :func:`shlex.quote` when needed),
          safe to ``set -a; source``: names are shell identifiers, values one line each;
        - ``json``: :meth:`to_json`, indented.

        Every value and argument is quoted with :func:`shlex.quote`; a name that is not a shell
        identifier or a value with a control character is refused (:meth:`check`).
        """
        self.check()
        if fmt == "json":
            return json.dumps(self.to_json(), indent=2)
        if fmt == "env":
            return "\n".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        if fmt == "shell":
            lines = [shlex.join(c) + " && \\" for c in self.prepare]
            lines += [f"{k}={shlex.quote(v)} \\" for k, v in self.env.items()]
            lines.append(shlex.join(self.args))
            return "\n".join(lines)
        raise ServingError(f"unknown output format {shown(fmt)}; expected one of {', '.join(OUTPUT_FORMATS)}")


def _llamacpp_launch(pair: RotationPair, model_path: str | None, cache_dir: Any,
                     files: dict[str, str]) -> tuple[dict[str, str], list[str], list[list[str]]]:
    gguf_path = ensure_rotations_gguf(pair, cache_dir=cache_dir)
    files["gguf"] = str(gguf_path)
    if model_path:
        base = Path(model_path).expanduser()
        merged = str(base.with_name(f"{base.stem}-rot-kv.gguf"))
        files["base_gguf"] = str(base)
    else:
        base, merged = Path("MODEL.gguf"), "MODEL-rot-kv.gguf"
    files["model_gguf"] = merged
    prepare = [["rotationzoo", "export", _arg_path(gguf_path), "--to", "gguf", "--base-gguf", _arg_path(base),
                "--out", _arg_path(merged)]]
    return llamacpp_env(pair.config()), llamacpp_args(_arg_path(merged)), prepare


def _engine_model(pair: RotationPair, model_path: str | None) -> tuple[str, str | None]:
    """What the engine loads, and a note when that is :data:`MODEL_PLACEHOLDER`.

    ``--model-path`` when given (refused if it starts with ``-``, which an engine would read as an
    option); else the registry id; else a ``NAMESPACE/NAME`` model id recorded in the pair file.
    Anything else a file records (a path, ``--model-path /etc; rm -rf ~`` …) never reaches the
    command line: the placeholder does, with a note saying what to put there.
    """
    if model_path is not None:
        if str(model_path).startswith("-"):
            raise ServingError(f"--model-path {shown(model_path)} starts with '-', which the engine would read as an "
                               "option; write ./ before a relative path")
        return _check_printable(str(model_path), "--model-path"), None
    recorded = pair.model
    try:
        return check_model_id(recorded, "model"), None  # the registry's rule for model ids
    except RegistryError:
        pass
    why = (f"the rotations record the model as {shown(recorded)}, which is not a NAMESPACE/NAME model id"
           if recorded else "the rotations do not name their model")
    return MODEL_PLACEHOLDER, f"{why}: replace {MODEL_PLACEHOLDER} with the model's id or checkpoint folder (or pass --model-path)"


def launch_spec(
    model: Any,
    tag: str | None = None,
    *,
    engine: str = "sglang",
    model_path: str | None = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
    tp_size: int | None = None,
    absorb_v_rotation: bool | None = None,
    disable_radix_cache: bool | None = None,
    calibrate: bool = False,
) -> LaunchSpec:
    """Resolve rotations (fetching and verifying registry files if needed) and build a launch.

    Args:
        model: a registry id or alias (``MODEL[@TAG]``), a :class:`~rotationzoo.pair.RotationPair`,
            or any source :func:`~rotationzoo.pair.resolve_pair` accepts (a folder, ``k.pt,v.pt``).
        tag: calibration tag (the model's default when ``None``).
        engine: a target of :data:`rotationzoo.engines.TARGETS`: ``"sglang"`` (the authors' current
            tree, the default), ``"sglang-legacy"`` (their May 2026 fork), ``"vllm"``, ``"llamacpp"``.
        model_path: what the engine loads instead of the registry model id: a local checkpoint
            folder (SGLang, vLLM), or for llama.cpp the model's GGUF file (without rotations);
            the launch then uses ``<stem>-rot-kv.gguf`` beside it, built by the ``prepare`` step.
        source, revision, cache_dir, offline, timeout: the fetch options, as for :func:`rotationzoo.fetch`.
        tp_size: tensor-parallel ranks instead of the entry's (``launch.tp_size``); the KV heads must
            split over them by the authors' rule (:func:`rotationzoo.sharding.kv_heads_per_rank`).
        absorb_v_rotation: ask for V-rotation absorption on (``True``) or off (``False``) instead of
            the entry's setting; on is refused for per-KV-head, centered or non-orthogonal files.
        disable_radix_cache: serve without the prefix cache (SGLang targets).
        calibrate: print the settings that make the authors' current tree fit a pair at start-up
            instead of rotation paths (a registry model; nothing is fetched).

    Returns:
        A :class:`LaunchSpec`; ``render("shell" | "env" | "json")`` prints it.

    Raises:
        ServingError: an unknown engine, rotations or a knob the target cannot take (one line).
        ConfigError: a TP size the KV heads cannot be split over.
    """
    t = target(engine)
    e = t.name
    if e == "llamacpp" and model_path and Path(model_path).suffix.lower() != ".gguf":
        raise ServingError(f"--model-path for llamacpp is the model's GGUF file, got {model_path!r}")
    knobs: dict[str, Any] = {"tp_size": tp_size, "absorb_v_rotation": absorb_v_rotation,
                             "disable_radix_cache": disable_radix_cache}
    if tp_size is not None:
        LaunchConfig(tp_size=tp_size)  # its bounds, before anything is downloaded
        _precheck_heads(model, tag, tp_size)
    if calibrate:
        return _calibration_spec(t, model, tag, model_path, knobs)
    pair = resolve_pair(model, tag, source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                        timeout=timeout)
    missing = [s for s in ("k", "v") if s not in pair.sets or s not in pair.paths]
    if missing:
        raise ServingError(f"{pair.source}: a launch needs local K and V rotation files (missing {', '.join(missing)})")
    files = {s: str(pair.paths[s]) for s in ("k", "v")}
    cfg = pair.config()
    name = pair.model or pair.source
    loads, unnamed = _engine_model(pair, model_path)
    arch = pair.entry.architecture if pair.entry is not None else None
    inp = prepare(t, config=cfg, launch=pair.entry.launch if pair.entry is not None else LaunchConfig(),
                  paths=files, model=loads, head_dims=pair.head_dims, kinds=pair_kinds(pair, cfg),
                  source=pair.source or "rotations", kv_head_counts=kv_head_counts(pair),
                  model_kv_heads=arch.num_kv_heads if arch is not None else None, **knobs)
    if e != "llamacpp" and files["k"] == files["v"]:  # one file holds both sides: the engine reads two
        files.update({s: str(p) for s, p in ensure_rotation_files(pair, cache_dir=cache_dir).items()})
        notes_first = [f"{pair.source} holds K and V in one file; the launch reads the K and V .pt files "
                       f"written from it into the cache's derived area"]
        inp = replace(inp, paths=dict(files))
    else:
        notes_first = []
    built = t.build(inp)
    env, args, prepare_cmds = built.env, built.args, list[list[str]]()
    if e == "llamacpp":
        env, args, prepare_cmds = _llamacpp_launch(pair, model_path, cache_dir, files)
    notes = notes_first + built.notes
    if pair.entry is None:
        notes.insert(0, "these rotations are not from the registry: default INT2-KV settings "
                        f"({cfg.label(pair.head_dims.default)}) were used")
    if e == "llamacpp" and not model_path:
        notes.insert(0, "replace MODEL.gguf with the model's GGUF file (or pass --model-path)")
    elif unnamed:
        notes.insert(0, unnamed)
    return LaunchSpec(engine=e, model=name, tag=pair.tag, env=env, args=args, files=files, prepare=prepare_cmds,
                      notes=notes, ranks=[r.to_json() for r in inp.ranks], checks=built.checks)


def _precheck_heads(model: Any, tag: str | None, tp_size: int) -> None:
    """For a registry model whose KV heads are known, refuse a TP size they cannot be split over before
    its files are downloaded (the files' own heads are checked again once read)."""
    if not isinstance(model, str) or Path(model).expanduser().exists() or looks_like_path(model):
        return
    base, at_tag = split_model_tag(model)
    try:
        arch = get_entry(base, at_tag or tag).architecture
    except RotationZooError:
        return  # resolve_pair reports it, with the same message
    if arch.num_kv_heads:
        kv_heads_per_rank(arch.num_kv_heads, tp_size)


def _calibration_spec(t: Any, model: Any, tag: str | None, model_path: str | None,
                      knobs: dict[str, Any]) -> LaunchSpec:
    """A start-up calibration launch of a registry model: its settings, no rotation paths, nothing fetched."""
    if not isinstance(model, str) or Path(model).expanduser().exists() or looks_like_path(model):
        raise ServingError("--calibrate takes a registry model (MODEL[@TAG]): the server fits the rotations itself, "
                           "so there are no rotation files to give")
    base, at_tag = split_model_tag(model)
    entry = get_entry(base, at_tag or tag)
    arch = entry.architecture
    if not arch.head_dims.uniform:
        raise ServingError(f"{entry.model_id}: layers differ in head_dim ({arch.head_dims}); start-up calibration "
                           "does not run on such two-geometry models: serve the entry's files")
    if model_path is not None and str(model_path).startswith("-"):
        raise ServingError(f"--model-path {shown(model_path)} starts with '-', which the engine would read as an "
                           "option; write ./ before a relative path")
    loads = _check_printable(str(model_path), "--model-path") if model_path is not None else entry.model_id
    kinds = frozenset({"v1", "lloyd_max"} if entry.serving.lloyd_max else {"v1"})
    inp = prepare(t, config=entry.serving, launch=entry.launch, paths=None, model=loads, head_dims=arch.head_dims,
                  kinds=kinds, source=entry.key, model_kv_heads=arch.num_kv_heads, calibrate=True, **knobs)
    built = t.build(inp)
    notes = [_calibration_destination(loads, model_path is None), *built.notes,
             "start-up calibration needs a single node, DP = PP = 1, no HiCache and no torch.compile; "
             "SGLANG_OSCAR_CALIBRATION_PROMPTS_PATH names a JSONL of {\"messages\": …} prompts (empty: GPQA-Diamond)"]
    if entry.grouping == "kv_head":
        notes.insert(0, f"start-up calibration fits one shared rotation per layer, but {entry.key} serves per-KV-head "
                        "rotations: on such models a shared rotation can collapse accuracy (Qwen3-30B-A3B: GPQA 43.9 "
                        "shared against 58.6 per head); serve the entry's files instead")
    return LaunchSpec(engine=t.name, model=entry.model_id, tag=entry.name, env=built.env, args=built.args, files={},
                      notes=notes, ranks=[r.to_json() for r in inp.ranks], checks=built.checks)


def _calibration_destination(loads: str, hub_id: bool) -> str:
    from .calibrated import calibration_folder_name

    folder = calibration_folder_name(loads) if hub_id else f"{Path(loads).name or 'model'}-<digest12>"
    return (f"the server fits the pair at start-up and writes it to $HF_HOME/oscar-rotations/{folder}/ (for the "
            "model's main revision and the printed prompts and tokens); once it is complete, `rotationzoo cache "
            "import` that folder to keep it, serve it or publish it")


__all__ = [
    "ENGINES",
    "MODEL_PLACEHOLDER",
    "OUTPUT_FORMATS",
    "LaunchSpec",
    "ServingError",
    "ensure_rotation_files",
    "ensure_rotations_gguf",
    "launch_spec",
    "llamacpp_env",
    "rotations_gguf_path",
    "serve_env",
    "sglang_env",
    "sglang_page_size",
    "vllm_env",
]
