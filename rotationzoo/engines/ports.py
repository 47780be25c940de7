"""``vllm`` (the unmerged OSCAR port) and ``llamacpp`` (the authors' llama.cpp branch).

- ``vllm``: ``VLLM_OSCAR_*`` variables and ``--kv-cache-dtype oscar_int2``. It has no BF16
  sink/recent windows (it keeps the first and last two layers unquantised instead), so the windows
  are not used, and no Lloyd-Max setting. It reads one ``[d, d]`` rotation per layer.
- ``llamacpp``: the ``q2_0`` cache type and ``LLAMA_KV_*`` variables; the rotations are GGUF tensors
  inside the model GGUF it loads (``rotationzoo export`` writes them: one ``[d, d]`` per layer).
"""

from __future__ import annotations

import os

from ..int2kv import Int2KVConfig
from .common import Launch, LaunchInput, rank_notes, ratio


def vllm_env(config: Int2KVConfig, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str],
             head_dim: int | None = None) -> dict[str, str]:
    """Environment of the vLLM port (``VLLM_OSCAR_*``); the port has no sink/recent windows."""
    group = config.group_size if config.group_size is not None else head_dim
    env = {
        "VLLM_OSCAR_K_ROTATION_PATH": str(k_path),
        "VLLM_OSCAR_V_ROTATION_PATH": str(v_path),
        "VLLM_OSCAR_K_CLIP_RATIO": ratio(config.k_clip_ratio),
        "VLLM_OSCAR_V_CLIP_RATIO": ratio(config.v_clip_ratio),
    }
    if group is not None:
        env["VLLM_OSCAR_GROUP_SIZE"] = str(int(group))
    return env


def vllm_args(model_path: str, tp_size: int = 1) -> list[str]:
    args = ["vllm", "serve", model_path, "--kv-cache-dtype", "oscar_int2"]
    if tp_size > 1:
        args += ["--tensor-parallel-size", str(tp_size)]
    return args


def vllm_notes(config: Int2KVConfig) -> list[str]:
    s = config
    notes = ["the vLLM port is unmerged; it keeps the first and last 2 layers unquantised and has no BF16 "
             f"sink/recent windows (the registry's {s.prefix_tokens}/{s.recent_tokens} are not applied)",
             "the port stores fp16 scale/zero and falls back to identity for a missing layer"]
    if s.lloyd_max:
        notes.append("this entry was published with Lloyd-Max INT2 levels; the vLLM port has no setting for them")
    return notes


def build_vllm(inp: LaunchInput) -> Launch:
    assert inp.paths is not None  # the table refuses calibration
    env = vllm_env(inp.config, inp.paths["k"], inp.paths["v"], inp.head_dims.default if inp.head_dims else None)
    return Launch(env, vllm_args(inp.model, inp.launch.tp_size), vllm_notes(inp.config) + rank_notes(inp))


def llamacpp_env(config: Int2KVConfig) -> dict[str, str]:
    """Environment of the llama.cpp branch.

    The branch has one clip ratio for both caches (``LLAMA_KV_CLIP_RATIO``); the K ratio is
    used, as in the branch's own runs (0.96). Windows are the configuration's sink/recent sizes.
    """
    return {
        "LLAMA_KV_NO_HADAMARD": "1",
        "LLAMA_KV_CLIP_RATIO": ratio(config.k_clip_ratio),
        "LLAMA_KV_HP_SINK": str(int(config.prefix_tokens)),
        "LLAMA_KV_HP_RECENT": str(int(config.recent_tokens)),
    }


def llamacpp_args(model_gguf: str) -> list[str]:
    return ["llama-server", "-m", model_gguf, "--cache-type-k", "q2_0", "--cache-type-v", "q2_0"]


def llamacpp_notes(config: Int2KVConfig) -> list[str]:
    s = config
    notes: list[str] = []
    if s.v_clip_ratio != s.k_clip_ratio:
        notes.append(f"the branch has one clip ratio for K and V: using K's {s.k_clip_ratio} "
                     f"(the registry's V ratio is {s.v_clip_ratio})")
    if s.lloyd_max:
        notes.append("this entry was published with Lloyd-Max INT2 levels; the branch's q2_0 cache has no setting "
                     "for them")
    notes.append("the branch was validated on CPU; its runs used LLAMA_KV_HP_SINK=512 LLAMA_KV_HP_RECENT=2048")
    notes.append("the branch quantises with its own q2_0 blocks (32 elements, fp16 scale/min), not SGLang's layout")
    return notes


def build_llamacpp(inp: LaunchInput) -> Launch:
    """The env and notes; the argv and the GGUF step are made by :mod:`rotationzoo.serving` (it writes a file)."""
    return Launch(llamacpp_env(inp.config), llamacpp_args("MODEL-rot-kv.gguf"), llamacpp_notes(inp.config))
