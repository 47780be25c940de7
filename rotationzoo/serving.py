"""Launch settings for the engines that serve OSCAR INT2 KV caches.

Three engines, each configured through environment variables plus command-line arguments:

- ``sglang``: the authors' SGLang fork (the published serving path). Every variable and argument
  comes from the authors' reference launch; values come from the registry entry (clip ratios,
  sink/recent windows, group size, dtypes, Lloyd-Max flag) and the local verified rotation files.
  ``--page-size`` is added because the fork requires it to equal the quantised page size
  ``4 · itemsize(hp_dtype)`` (8 for bfloat16).
- ``vllm``: the unmerged vLLM port (``VLLM_OSCAR_*`` variables, ``--kv-cache-dtype oscar_int2``).
  It has no BF16 sink/recent windows (it keeps the first and last two layers unquantised
  instead), so the registry's windows are not used.
- ``llamacpp``: the authors' llama.cpp branch (``q2_0`` cache type, ``LLAMA_KV_*`` variables).
  It reads the rotations from GGUF tensors ``blk.{i}.attn_{k,v}_rot.weight`` inside the model
  GGUF it loads; :func:`launch_spec` exports a rotations GGUF next to the cached files and
  prints the step that appends it to a model GGUF (see :mod:`rotationzoo.export`).

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
from typing import TYPE_CHECKING, Any, Literal, Mapping

from .errors import RotationZooError, ServingError
from .registry import Serving, TagEntry

if TYPE_CHECKING:  # pragma: no cover
    from .api import RotationPair

Engine = Literal["sglang", "vllm", "llamacpp"]
ENGINES: tuple[str, ...] = ("sglang", "vllm", "llamacpp")
OutputFormat = Literal["shell", "env", "json"]
OUTPUT_FORMATS: tuple[str, ...] = ("shell", "env", "json")

#: Decode splits over the BF16 windows (the authors' reference launch).
SGLANG_HP_MAX_SPLITS = 8
#: Name of the rotations GGUF written next to the cached rotation files (this project's choice).
ROTATIONS_GGUF_NAME = "oscar-rot-kv.gguf"
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass
class LaunchSpec:
    """Everything needed to start one engine with one rotation pair.

    Attributes:
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        model: registry model id (e.g. ``"Qwen/Qwen3-8B"``).
        tag: calibration tag.
        env: environment variables, in launch order.
        args: the command line (``argv``).
        files: local files the launch uses: ``k``, ``v`` (and ``gguf`` for llama.cpp).
        prepare: commands (``argv`` lists) to run once before ``args`` (llama.cpp: build the
            model GGUF with the rotations appended).
        notes: caveats for this engine and entry.
    """

    engine: str
    model: str
    tag: str
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


# -- per-engine settings ---------------------------------------------------------------------------


def _check_engine(engine: str) -> str:
    e = engine.strip().lower().replace(".", "").replace("-", "").replace("_", "")
    e = {"llamacpp": "llamacpp", "llama": "llamacpp", "sglang": "sglang", "vllm": "vllm"}.get(e, e)
    if e not in ENGINES:
        raise ServingError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    return e


def _ratio(x: float) -> str:
    return repr(float(x))


def sglang_page_size(hp_dtype: str) -> int:
    """The SGLang fork's quantised page size ``N_Q = 4 · itemsize(hp_dtype)`` (8 for bfloat16)."""
    try:
        return 4 * _DTYPE_BYTES[hp_dtype]
    except KeyError:
        raise ServingError(f"unknown hp_dtype {hp_dtype!r}; expected bfloat16, float16 or float32") from None


def sglang_env(serving: Serving, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment of the authors' SGLang fork for one rotation pair (reference launch order)."""
    return {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_OSCAR_ABSORB_V_ROTATION": "1",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(int(serving.prefix_tokens)),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(int(serving.recent_tokens)),
        "SGLANG_MIXED_KV_HP_MAX_SPLITS": str(SGLANG_HP_MAX_SPLITS),
        "SGLANG_MIXED_KV_HP_DTYPE": serving.hp_dtype,
        "SGLANG_MIXED_KV_SCALE_DTYPE": serving.scale_dtype,
        "SGLANG_OSCAR_K_ROTATION_PATH": str(k_path),
        "SGLANG_OSCAR_V_ROTATION_PATH": str(v_path),
        "SGLANG_OSCAR_K_CLIP_RATIO": _ratio(serving.k_clip_ratio),
        "SGLANG_OSCAR_V_CLIP_RATIO": _ratio(serving.v_clip_ratio),
        "SGLANG_LLOYD_MAX": "1" if serving.lloyd_max else "0",
    }


def sglang_args(serving: Serving, model_path: str) -> list[str]:
    """``python -m sglang.launch_server`` arguments of the reference launch (plus ``--page-size``)."""
    return [
        "python", "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--kv-cache-dtype", "int2",
        "--kv-cache-quant-group-size", str(int(serving.group_size)),
        "--prefill-attention-backend", "fa3",
        "--decode-attention-backend", "triton",
        "--page-size", str(sglang_page_size(serving.hp_dtype)),
    ]


def vllm_env(serving: Serving, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment of the vLLM port (``VLLM_OSCAR_*``); the port has no sink/recent windows."""
    return {
        "VLLM_OSCAR_K_ROTATION_PATH": str(k_path),
        "VLLM_OSCAR_V_ROTATION_PATH": str(v_path),
        "VLLM_OSCAR_K_CLIP_RATIO": _ratio(serving.k_clip_ratio),
        "VLLM_OSCAR_V_CLIP_RATIO": _ratio(serving.v_clip_ratio),
        "VLLM_OSCAR_GROUP_SIZE": str(int(serving.group_size)),
    }


def vllm_args(model_path: str) -> list[str]:
    return ["vllm", "serve", model_path, "--kv-cache-dtype", "oscar_int2"]


def llamacpp_env(serving: Serving) -> dict[str, str]:
    """Environment of the llama.cpp branch.

    The branch has one clip ratio for both caches (``LLAMA_KV_CLIP_RATIO``); the K ratio is
    used, as in the branch's own runs (0.96). Windows are the registry's sink/recent sizes.
    """
    return {
        "LLAMA_KV_NO_HADAMARD": "1",
        "LLAMA_KV_CLIP_RATIO": _ratio(serving.k_clip_ratio),
        "LLAMA_KV_HP_SINK": str(int(serving.prefix_tokens)),
        "LLAMA_KV_HP_RECENT": str(int(serving.recent_tokens)),
    }


def llamacpp_args(model_gguf: str) -> list[str]:
    return ["llama-server", "-m", model_gguf, "--cache-type-k", "q2_0", "--cache-type-v", "q2_0"]


def serve_env(
    serving: Serving,
    engine: str,
    paths: Mapping[str, str | os.PathLike[str]],
) -> dict[str, str]:
    """Environment variables for ``engine`` given serving settings and local ``paths`` ``{"k", "v"}``.

    Args:
        serving: the registry entry's serving settings (``entry.serving`` or ``pair.serving``).
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        paths: local rotation files ``{"k": path, "v": path}`` (unused for llama.cpp, which
            reads the rotations from the model GGUF).

    Returns:
        ``{NAME: value}`` as strings, in the engine's launch order.
    """
    e = _check_engine(engine)
    if e == "llamacpp":
        return llamacpp_env(serving)
    missing = [s for s in ("k", "v") if s not in paths]
    if missing:
        raise ServingError(f"serve_env needs local paths for k and v (missing {', '.join(missing)})")
    if e == "sglang":
        return sglang_env(serving, paths["k"], paths["v"])
    return vllm_env(serving, paths["k"], paths["v"])


def pair_serve_env(pair: "RotationPair", engine: str) -> dict[str, str]:
    """``RotationPair.serve_env``: environment for ``engine`` with the pair's local files."""
    return serve_env(pair.serving, engine, {s: str(p) for s, p in pair.paths.items()})


# -- notes -----------------------------------------------------------------------------------------


def _notes(engine: str, entry: TagEntry) -> list[str]:
    s = entry.serving
    notes: list[str] = []
    if engine == "sglang":
        nq = sglang_page_size(s.hp_dtype)
        for name, val in (("prefix_tokens", s.prefix_tokens), ("recent_tokens", s.recent_tokens)):
            if val % nq:
                notes.append(f"{name}={val} is not a multiple of the quantised page size {nq}; the fork rejects it")
        if s.group_size != entry.architecture.head_dim:
            notes.append(
                f"group size {s.group_size} < head_dim {entry.architecture.head_dim}: the fork's generic dequant "
                f"needs head_dim/group_size to be 1 or a multiple of 4"
            )
        notes.append("needs the authors' SGLang fork (sglang-research/ in FutureMLS-Lab/OSCAR)")
        notes.append("SGLANG_OSCAR_ABSORB_V_ROTATION folds R_V into v_proj at load time (implemented for Qwen3 and "
                     "GLM-4-MoE model classes in the fork)")
    elif engine == "vllm":
        notes.append("the vLLM port is unmerged; it keeps the first and last 2 layers unquantised and has no BF16 "
                     f"sink/recent windows (the registry's {s.prefix_tokens}/{s.recent_tokens} are not applied)")
        notes.append("the port stores fp16 scale/zero and falls back to identity for a missing layer")
        if s.lloyd_max:
            notes.append("this entry was published with Lloyd-Max INT2 levels; the vLLM port has no setting for them")
    else:
        if s.v_clip_ratio != s.k_clip_ratio:
            notes.append(f"the branch has one clip ratio for K and V: using K's {s.k_clip_ratio} "
                         f"(the registry's V ratio is {s.v_clip_ratio})")
        notes.append("the branch was validated on CPU; its runs used LLAMA_KV_HP_SINK=512 LLAMA_KV_HP_RECENT=2048")
        notes.append("the branch quantises with its own q2_0 blocks (32 elements, fp16 scale/min), not SGLang's layout")
    return notes


# -- resolve + build -------------------------------------------------------------------------------


def rotations_gguf_path(entry: TagEntry, paths: Mapping[str, Path], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the rotations GGUF of ``entry`` lives: beside the cached K file, or in the entry's
    cache folder when the files are bundled with the package (read-only install)."""
    from .config import package_data_dir
    from .hub import cache_root, entry_dir

    k = Path(paths["k"]).resolve()
    try:
        k.relative_to(package_data_dir().resolve())
        bundled = True
    except ValueError:
        bundled = False
    folder = entry_dir(cache_root(cache_dir), entry) if bundled else k.parent
    return folder / ROTATIONS_GGUF_NAME


def ensure_rotations_gguf(
    pair: "RotationPair",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """The rotations GGUF of ``pair`` (exported if missing or made from other files).

    Reuses an existing file only when its recorded source sha256s equal the pair's.
    """
    from .export import GGUF_KEY_PREFIX, export_gguf, read_exported_gguf

    out = rotations_gguf_path(pair.entry, pair.paths, cache_dir)
    if out.is_file() and not force and all(pair.sha256.get(s) for s in ("k", "v")):
        try:
            meta = read_exported_gguf(out).metadata
        except RotationZooError:
            meta = {}
        if all(meta.get(f"{GGUF_KEY_PREFIX}{s}.sha256") == pair.sha256[s] for s in ("k", "v")):
            return out
    return export_gguf(pair, out)


def launch_spec(
    model: "str | RotationPair",
    tag: str | None = None,
    *,
    engine: str,
    model_path: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    source: str = "auto",
    revision: str | None = None,
) -> LaunchSpec:
    """Resolve a registry entry (fetching and verifying its files if needed) and build a launch.

    Args:
        model: model id or alias, or an already loaded :class:`~rotationzoo.api.RotationPair`.
        tag: calibration tag (the model's default when ``None``).
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        model_path: what the engine loads instead of the registry model id: a local checkpoint
            folder (SGLang, vLLM), or for llama.cpp the model's GGUF file (without rotations);
            the launch then uses ``<stem>-rot-kv.gguf`` beside it, built by the ``prepare`` step.
        cache_dir, offline, source, revision: as for :func:`rotationzoo.fetch`.

    Returns:
        A :class:`LaunchSpec`; ``render("shell" | "env" | "json")`` prints it.
    """
    e = _check_engine(engine)
    if e == "llamacpp" and model_path and Path(model_path).suffix.lower() != ".gguf":
        raise ServingError(f"--model-path for llamacpp is the model's GGUF file, got {model_path!r}")
    pair = None
    if isinstance(model, str):
        if e == "llamacpp":
            from .api import load

            pair = load(model, tag, cache_dir=cache_dir, offline=offline, source=source, revision=revision)
            entry, paths = pair.entry, dict(pair.paths)
        else:
            from .api import fetch

            res = fetch(model, tag, cache_dir=cache_dir, offline=offline, source=source, revision=revision)
            entry, paths = res.entry, dict(res.paths)
    else:
        pair = model
        entry, paths = pair.entry, dict(pair.paths)
    files = {s: str(paths[s]) for s in ("k", "v")}
    s = entry.serving
    prepare: list[list[str]] = []
    if e == "sglang":
        env = sglang_env(s, files["k"], files["v"])
        args = sglang_args(s, model_path or entry.model_id)
    elif e == "vllm":
        env = vllm_env(s, files["k"], files["v"])
        args = vllm_args(model_path or entry.model_id)
    else:
        assert pair is not None
        gguf_path = ensure_rotations_gguf(pair, cache_dir=cache_dir)
        files["gguf"] = str(gguf_path)
        if model_path:
            base = Path(model_path).expanduser()
            merged = str(base.with_name(f"{base.stem}-rot-kv.gguf"))
            files["base_gguf"] = str(base)
        else:
            base = Path("MODEL.gguf")
            merged = "MODEL-rot-kv.gguf"
        files["model_gguf"] = merged
        prepare.append(["rotationzoo", "export", str(gguf_path), "--to", "gguf", "--base-gguf", str(base),
                        "--out", merged])
        env = llamacpp_env(s)
        args = llamacpp_args(merged)
    notes = _notes(e, entry)
    if e == "llamacpp" and not model_path:
        notes.insert(0, "replace MODEL.gguf with the model's GGUF file (or pass --model-path)")
    return LaunchSpec(engine=e, model=entry.model_id, tag=entry.name, env=env, args=args, files=files,
                      prepare=prepare, notes=notes)


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
    "vllm_env",
]
