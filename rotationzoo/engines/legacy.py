"""``sglang-legacy``: the authors' May 2026 SGLang fork (``sglang-research/`` in FutureMLS-Lab/OSCAR).

The launch line of that fork's reference recipe, kept byte for byte: V-rotation absorption on, FA3
prefill, ``SGLANG_LLOYD_MAX`` always passed, ``--page-size`` set to the fork's quantised page
``4 · itemsize(hp_dtype)`` (8 for bfloat16), which the fork requires. It reads one ``[d, d]``
rotation per layer. ``--tensor-parallel-size`` and ``--disable-radix-cache`` are added only when
asked (a TP size above 1, the flag), except for hybrid models (Qwen3.5): there the prefix cache is
always off, as in the authors' hybrid recipe (``rotation/qwen3.5-4B/eval_gpqa.sh@797e39c7`` adds
``--disable-radix-cache``). With it on, the fork's Mamba radix cache (``no_buffer``, its default)
forces ``page_size`` to 1 and the INT2 cache then refuses the launch ("Unified mixed KV requires
--page-size=8"; ``_handle_mamba_radix_cache`` and ``_handle_page_size`` in
``sglang-research/python/sglang/srt/server_args.py@797e39c7``).
"""

from __future__ import annotations

import os

from ..int2kv import Int2KVConfig
from .common import SGLANG_HP_MAX_SPLITS, Launch, LaunchInput, group_size, rank_notes, ratio, sglang_page_size, window_notes


def sglang_legacy_env(config: Int2KVConfig, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str],
                      *, absorb: bool = True) -> dict[str, str]:
    """Environment of the May 2026 fork for one rotation pair (the reference launch's order)."""
    return {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_OSCAR_ABSORB_V_ROTATION": "1" if absorb else "0",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(int(config.prefix_tokens)),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(int(config.recent_tokens)),
        "SGLANG_MIXED_KV_HP_MAX_SPLITS": str(SGLANG_HP_MAX_SPLITS),
        "SGLANG_MIXED_KV_HP_DTYPE": config.hp_dtype,
        "SGLANG_MIXED_KV_SCALE_DTYPE": config.scale_dtype,
        "SGLANG_OSCAR_K_ROTATION_PATH": str(k_path),
        "SGLANG_OSCAR_V_ROTATION_PATH": str(v_path),
        "SGLANG_OSCAR_K_CLIP_RATIO": ratio(config.k_clip_ratio),
        "SGLANG_OSCAR_V_CLIP_RATIO": ratio(config.v_clip_ratio),
        "SGLANG_LLOYD_MAX": "1" if config.lloyd_max else "0",
    }


def sglang_legacy_args(config: Int2KVConfig, model_path: str, head_dim: int | None) -> list[str]:
    """``python -m sglang.launch_server`` arguments of the fork's reference launch (plus ``--page-size``);
    without ``head_dim`` the configuration's ``group_size`` is passed as it is."""
    group = config.group_for(head_dim) if head_dim is not None else group_size(config, None)
    return [
        "python", "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--kv-cache-dtype", "int2",
        "--kv-cache-quant-group-size", str(group),
        "--prefill-attention-backend", "fa3",
        "--decode-attention-backend", "triton",
        "--page-size", str(sglang_page_size(config.hp_dtype)),
    ]


def legacy_notes(config: Int2KVConfig, head_dim: int | None) -> list[str]:
    notes = window_notes(config, "the fork")
    if head_dim is not None and config.group_for(head_dim) != head_dim:
        notes.append(f"group size {config.group_for(head_dim)} < head_dim {head_dim}: the fork's generic dequant "
                     f"needs head_dim/group_size to be 1 or a multiple of 4")
    notes.append("needs the authors' May 2026 SGLang fork (sglang-research/ in FutureMLS-Lab/OSCAR); their current "
                 "tree is --engine sglang")
    notes.append("SGLANG_OSCAR_ABSORB_V_ROTATION folds R_V into v_proj at load time (implemented for Qwen3 and "
                 "GLM-4-MoE model classes in the fork)")
    return notes


def build(inp: LaunchInput) -> Launch:
    assert inp.paths is not None  # the table refuses calibration
    d = inp.head_dims.default if inp.head_dims is not None else None
    env = sglang_legacy_env(inp.config, inp.paths["k"], inp.paths["v"], absorb=inp.absorb)
    args = sglang_legacy_args(inp.config, inp.model, d)
    if inp.launch.tp_size > 1:
        args[5:5] = ["--tensor-parallel-size", str(inp.launch.tp_size)]
    notes = legacy_notes(inp.config, d)
    if inp.launch.disable_radix_cache or inp.hybrid:
        args.append("--disable-radix-cache")
    if inp.hybrid and not inp.launch.disable_radix_cache:
        notes.append(f"hybrid model: --disable-radix-cache, as in the authors' recipe (rotation/qwen3.5-4B/"
                     f"eval_gpqa.sh@797e39c7); with the prefix cache on, the fork's Mamba radix cache forces "
                     f"page_size 1 and its INT2 cache then refuses the launch (it needs --page-size "
                     f"{sglang_page_size(inp.config.hp_dtype)})")
    return Launch(env, args, notes + rank_notes(inp))
