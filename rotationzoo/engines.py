"""What each OSCAR-enabled engine needs: environment variables, command lines and caveats.

Pure functions of an :class:`~rotationzoo.int2kv.Int2KVConfig` and local file paths (no
fetching, no torch); :mod:`rotationzoo.serving` resolves an entry and assembles a full launch.

- ``sglang``: the authors' SGLang fork (the published serving path). Every variable and argument
  comes from the authors' reference launch. ``--page-size`` is added because the fork requires it
  to equal the quantised page size ``4 · itemsize(hp_dtype)`` (8 for bfloat16).
- ``vllm``: the unmerged vLLM port (``VLLM_OSCAR_*`` variables, ``--kv-cache-dtype oscar_int2``).
  It has no BF16 sink/recent windows (it keeps the first and last two layers unquantised
  instead), so the windows are not used.
- ``llamacpp``: the authors' llama.cpp branch (``q2_0`` cache type, ``LLAMA_KV_*`` variables),
  which reads the rotations from GGUF tensors inside the model GGUF it loads.
"""

from __future__ import annotations

import os
from typing import Mapping

from .errors import ServingError
from .int2kv import Int2KVConfig
from .vocab import ENGINES, Engine
_ENGINE_ALIASES = {"llamacpp": "llamacpp", "llama": "llamacpp", "sglang": "sglang", "vllm": "vllm"}
#: Decode splits over the BF16 windows (the authors' reference launch).
SGLANG_HP_MAX_SPLITS = 8
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def check_engine(engine: str) -> str:
    """The canonical engine name (``llama.cpp``, ``llama-cpp`` … → ``llamacpp``).

    Raises:
        ServingError: an unknown engine.
    """
    e = engine.strip().lower().replace(".", "").replace("-", "").replace("_", "")
    e = _ENGINE_ALIASES.get(e, e)
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


def sglang_env(config: Int2KVConfig, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment of the authors' SGLang fork for one rotation pair (reference launch order)."""
    return {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_OSCAR_ABSORB_V_ROTATION": "1",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(int(config.prefix_tokens)),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(int(config.recent_tokens)),
        "SGLANG_MIXED_KV_HP_MAX_SPLITS": str(SGLANG_HP_MAX_SPLITS),
        "SGLANG_MIXED_KV_HP_DTYPE": config.hp_dtype,
        "SGLANG_MIXED_KV_SCALE_DTYPE": config.scale_dtype,
        "SGLANG_OSCAR_K_ROTATION_PATH": str(k_path),
        "SGLANG_OSCAR_V_ROTATION_PATH": str(v_path),
        "SGLANG_OSCAR_K_CLIP_RATIO": _ratio(config.k_clip_ratio),
        "SGLANG_OSCAR_V_CLIP_RATIO": _ratio(config.v_clip_ratio),
        "SGLANG_LLOYD_MAX": "1" if config.lloyd_max else "0",
    }


def sglang_args(config: Int2KVConfig, model_path: str, head_dim: int) -> list[str]:
    """``python -m sglang.launch_server`` arguments of the reference launch (plus ``--page-size``)."""
    return [
        "python", "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--kv-cache-dtype", "int2",
        "--kv-cache-quant-group-size", str(config.group_for(head_dim)),
        "--prefill-attention-backend", "fa3",
        "--decode-attention-backend", "triton",
        "--page-size", str(sglang_page_size(config.hp_dtype)),
    ]


def vllm_env(config: Int2KVConfig, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str],
             head_dim: int | None = None) -> dict[str, str]:
    """Environment of the vLLM port (``VLLM_OSCAR_*``); the port has no sink/recent windows."""
    group = config.group_size if config.group_size is not None else head_dim
    env = {
        "VLLM_OSCAR_K_ROTATION_PATH": str(k_path),
        "VLLM_OSCAR_V_ROTATION_PATH": str(v_path),
        "VLLM_OSCAR_K_CLIP_RATIO": _ratio(config.k_clip_ratio),
        "VLLM_OSCAR_V_CLIP_RATIO": _ratio(config.v_clip_ratio),
    }
    if group is not None:
        env["VLLM_OSCAR_GROUP_SIZE"] = str(int(group))
    return env


def vllm_args(model_path: str) -> list[str]:
    return ["vllm", "serve", model_path, "--kv-cache-dtype", "oscar_int2"]


def llamacpp_env(config: Int2KVConfig) -> dict[str, str]:
    """Environment of the llama.cpp branch.

    The branch has one clip ratio for both caches (``LLAMA_KV_CLIP_RATIO``); the K ratio is
    used, as in the branch's own runs (0.96). Windows are the configuration's sink/recent sizes.
    """
    return {
        "LLAMA_KV_NO_HADAMARD": "1",
        "LLAMA_KV_CLIP_RATIO": _ratio(config.k_clip_ratio),
        "LLAMA_KV_HP_SINK": str(int(config.prefix_tokens)),
        "LLAMA_KV_HP_RECENT": str(int(config.recent_tokens)),
    }


def llamacpp_args(model_gguf: str) -> list[str]:
    return ["llama-server", "-m", model_gguf, "--cache-type-k", "q2_0", "--cache-type-v", "q2_0"]


def serve_env(config: Int2KVConfig, engine: str, paths: Mapping[str, str | os.PathLike[str]],
              head_dim: int | None = None) -> dict[str, str]:
    """Environment variables for ``engine`` given INT2-KV settings and local ``paths`` ``{"k", "v"}``.

    Args:
        config: the serving settings (``entry.serving`` or ``pair.config()``).
        engine: ``"sglang"``, ``"vllm"`` or ``"llamacpp"``.
        paths: local rotation files ``{"k": path, "v": path}`` (unused for llama.cpp, which
            reads the rotations from the model GGUF).
        head_dim: the model's head_dim, for a configuration whose ``group_size`` is ``None``.

    Returns:
        ``{NAME: value}`` as strings, in the engine's launch order.
    """
    e = check_engine(engine)
    if e == "llamacpp":
        return llamacpp_env(config)
    missing = [s for s in ("k", "v") if s not in paths]
    if missing:
        raise ServingError(f"serve_env needs local paths for k and v (missing {', '.join(missing)})")
    if e == "sglang":
        return sglang_env(config, paths["k"], paths["v"])
    return vllm_env(config, paths["k"], paths["v"], head_dim)


def engine_notes(engine: str, config: Int2KVConfig, head_dim: int) -> list[str]:
    """Caveats of serving ``config`` with ``engine`` (one line each)."""
    s = config
    notes: list[str] = []
    if engine == "sglang":
        nq = sglang_page_size(s.hp_dtype)
        for name, val in (("prefix_tokens", s.prefix_tokens), ("recent_tokens", s.recent_tokens)):
            if val % nq:
                notes.append(f"{name}={val} is not a multiple of the quantised page size {nq}; the fork rejects it")
        if s.group_for(head_dim) != head_dim:
            notes.append(
                f"group size {s.group_for(head_dim)} < head_dim {head_dim}: the fork's generic dequant "
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


__all__ = [
    "ENGINES",
    "Engine",
    "SGLANG_HP_MAX_SPLITS",
    "check_engine",
    "engine_notes",
    "llamacpp_args",
    "llamacpp_env",
    "serve_env",
    "sglang_args",
    "sglang_env",
    "sglang_page_size",
    "vllm_args",
    "vllm_env",
]
