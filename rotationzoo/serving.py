"""Launch settings for the engines that serve OSCAR INT2 KV caches.

:func:`launch_spec` resolves rotations (a registry entry, fetched and verified if needed, or any
source :func:`~rotationzoo.pair.resolve_pair` accepts), takes the INT2-KV settings from the entry's
``serving`` block, and assembles the environment, command line, preparation steps and caveats
of one engine (see :mod:`rotationzoo.engines` for each engine's variables). For llama.cpp it also
exports a rotations GGUF into the cache's derived area (``rotationzoo cache ls`` lists it) and
prints the step that appends it to a model GGUF.

Example::

    from rotationzoo.serving import launch_spec
    spec = launch_spec("Qwen3-8B", engine="sglang")
    print(spec.render("shell"))          # env prefix + python -m sglang.launch_server ...
    spec.env["SGLANG_OSCAR_K_ROTATION_PATH"]

    pair = rotationzoo.load("Qwen3-8B")
    pair.serve_env("vllm")               # {"VLLM_OSCAR_K_ROTATION_PATH": ..., ...}
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from .engines import (
    ENGINES,
    check_engine,
    engine_notes,
    llamacpp_args,
    llamacpp_env,
    serve_env,
    sglang_args,
    sglang_env,
    sglang_page_size,
    vllm_args,
    vllm_env,
)
from .errors import RotationZooError, ServingError
from .export import export_gguf
from .hub import derived_hit, derived_path, record_derived
from .pair import RotationPair, resolve_pair

OutputFormat = Literal["shell", "env", "json"]
OUTPUT_FORMATS: tuple[str, ...] = get_args(OutputFormat)
#: Name of the rotations GGUF kept in the cache's derived area (this project's choice).
ROTATIONS_GGUF_NAME = "oscar-rot-kv.gguf"


@dataclass
class LaunchSpec:
    """Everything needed to start one engine with one rotation pair.

    Attributes:
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        model: registry model id (e.g. ``"Qwen/Qwen3-8B"``), or the pair's source when not from the registry.
        tag: calibration tag (``None`` when not from the registry).
        env: environment variables, in launch order.
        args: the command line (``argv``).
        files: local files the launch uses: ``k``, ``v`` (and ``gguf`` for llama.cpp).
        prepare: commands (``argv`` lists) to run once before ``args`` (llama.cpp: build the
            model GGUF with the rotations appended).
        notes: caveats for this engine and entry.
    """

    engine: str
    model: str
    tag: str | None
    env: dict[str, str]
    args: list[str]
    files: dict[str, str]
    prepare: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The launch as one shell line: ``K=V … argv`` (shell-quoted)."""
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
        }

    def render(self, fmt: str = "shell") -> str:
        """Text for ``fmt``:

        - ``shell``: copy-pasteable; preparation commands joined with ``&&``, one variable per line;
        - ``env``: ``KEY=VALUE`` lines (values shell-quoted only when needed), for ``set -a; source``;
        - ``json``: :meth:`to_json`, indented.
        """
        if fmt == "json":
            return json.dumps(self.to_json(), indent=2)
        if fmt == "env":
            return "\n".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        if fmt == "shell":
            lines = [shlex.join(c) + " && \\" for c in self.prepare]
            lines += [f"{k}={shlex.quote(v)} \\" for k, v in self.env.items()]
            lines.append(shlex.join(self.args))
            return "\n".join(lines)
        raise ServingError(f"unknown output format {fmt!r}; expected one of {', '.join(OUTPUT_FORMATS)}")


def rotations_gguf_path(pair: RotationPair, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the rotations GGUF of ``pair`` is kept: the cache's derived area, under the entry (or,
    for local files, under an id made from the sha256 of the bytes they were read from)."""
    return derived_path(ROTATIONS_GGUF_NAME, entry=pair.entry, inputs=pair.sha256, cache_dir=cache_dir)


def ensure_rotations_gguf(pair: RotationPair, *, cache_dir: str | os.PathLike[str] | None = None,
                          force: bool = False) -> Path:
    """The rotations GGUF of ``pair`` in the derived area, exported unless one is already there that
    was built from the same bytes (its marker records the sha256 of the K and V files read,
    :attr:`RotationPair.sha256`) and holds exactly ``pair``'s rotations (read back and compared).

    Raises:
        ServingError: the pair has no K or V file read from disk, or the GGUF just written does
            not hold its rotations.
    """
    if not all(pair.sha256.get(s) for s in ("k", "v")):
        raise ServingError(f"{pair.source}: the llama.cpp launch needs both rotation files with known sha256")
    out = rotations_gguf_path(pair, cache_dir)
    inputs = {s: pair.sha256[s] for s in ("k", "v")}
    if not force and derived_hit(out, inputs) and _holds(out, pair):
        return out
    export_gguf(pair, out)
    if not _holds(out, pair):
        raise ServingError(f"{out}: the rotations GGUF just written does not read back as {pair.source}; "
                           "check the disk and the cache (rotationzoo cache verify)")
    record_derived(out, inputs=inputs, entry=pair.entry)
    return out


def _holds(path: Path, pair: RotationPair) -> bool:
    """Whether the GGUF at ``path`` holds exactly ``pair``'s K and V rotations (as exported: fp32)."""
    import torch

    from .pairfile import read_gguf

    try:
        sets, _ = read_gguf(path)
    except RotationZooError:
        return False
    return sets.keys() == {"k", "v"} and all(
        sets[s].layer_ids == rs.layer_ids
        and torch.equal(sets[s].rotations, rs.rotations.detach().to("cpu", torch.float64).to(torch.float32))
        for s, rs in pair)


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
    prepare = [["rotationzoo", "export", str(gguf_path), "--to", "gguf", "--base-gguf", str(base), "--out", merged]]
    return llamacpp_env(pair.config()), llamacpp_args(merged), prepare


def launch_spec(
    model: Any,
    tag: str | None = None,
    *,
    engine: str,
    model_path: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    source: str = "auto",
    revision: str | None = None,
) -> LaunchSpec:
    """Resolve rotations (fetching and verifying registry files if needed) and build a launch.

    Args:
        model: a registry id or alias (``MODEL[@TAG]``), a :class:`~rotationzoo.pair.RotationPair`,
            or any source :func:`~rotationzoo.pair.resolve_pair` accepts (a folder, ``k.pt,v.pt``).
        tag: calibration tag (the model's default when ``None``).
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        model_path: what the engine loads instead of the registry model id: a local checkpoint
            folder (SGLang, vLLM), or for llama.cpp the model's GGUF file (without rotations);
            the launch then uses ``<stem>-rot-kv.gguf`` beside it, built by the ``prepare`` step.
        cache_dir, offline, source, revision: as for :func:`rotationzoo.fetch`.

    Returns:
        A :class:`LaunchSpec`; ``render("shell" | "env" | "json")`` prints it.
    """
    e = check_engine(engine)
    if e == "llamacpp" and model_path and Path(model_path).suffix.lower() != ".gguf":
        raise ServingError(f"--model-path for llamacpp is the model's GGUF file, got {model_path!r}")
    pair = resolve_pair(model, tag, cache_dir=cache_dir, offline=offline, hub_source=source, revision=revision)
    if pair.per_head:
        raise ServingError(f"{pair.source}: per-KV-head rotations ([L, H_kv, d, d]) cannot be served by {e}, which reads "
                           "one [d, d] rotation per layer; serve them with rotationzoo.integrations.transformers, or "
                           "fit with --grouping layer")
    missing = [s for s in ("k", "v") if s not in pair.sets or s not in pair.paths]
    if missing:
        raise ServingError(f"{pair.source}: a launch needs local K and V rotation files (missing {', '.join(missing)})")
    files = {s: str(pair.paths[s]) for s in ("k", "v")}
    cfg = pair.config()
    name = pair.model or pair.source
    prepare: list[list[str]] = []
    if e == "sglang":
        env, args = sglang_env(cfg, files["k"], files["v"]), sglang_args(cfg, model_path or name, pair.head_dim)
    elif e == "vllm":
        env, args = vllm_env(cfg, files["k"], files["v"], pair.head_dim), vllm_args(model_path or name)
    else:
        env, args, prepare = _llamacpp_launch(pair, model_path, cache_dir, files)
    notes = engine_notes(e, cfg, pair.head_dim)
    if pair.entry is None:
        notes.insert(0, "these rotations are not from the registry: default INT2-KV settings "
                        f"({cfg.label(pair.head_dim)}) were used")
    if e == "llamacpp" and not model_path:
        notes.insert(0, "replace MODEL.gguf with the model's GGUF file (or pass --model-path)")
    return LaunchSpec(engine=e, model=name, tag=pair.tag, env=env, args=args, files=files, prepare=prepare, notes=notes)


__all__ = [
    "ENGINES",
    "OUTPUT_FORMATS",
    "LaunchSpec",
    "ServingError",
    "ensure_rotations_gguf",
    "launch_spec",
    "llamacpp_env",
    "rotations_gguf_path",
    "serve_env",
    "sglang_env",
    "sglang_page_size",
    "vllm_env",
]
