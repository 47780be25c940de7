"""The demo behind ``rotationzoo demo`` / ``make demo``: resolve, verify and load an entry, then
INT2-quantize a K-like tensor with it (the bundled SmolLM2 entry by default: no network)."""

from __future__ import annotations

import time
from typing import Any

import torch

from .numbers import check_int
from .kernels import dequantize_int2, quantize_int2
from .files.pair import load_registered
from .registry import split_model_tag

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

MAX_DEMO_TOKENS = 262_144
"""Most rows of the demo's random tensor (``--tokens``): a few hundred MB at head_dim 128."""


def run_demo(model: str = DEFAULT_MODEL, tag: str | None = None, *, tokens: int = 1024, seed: int = 0) -> dict[str, Any]:
    """Load ``model``'s rotations and quantize a random K-like tensor (a few outlier channels, as
    real keys have) with layer 0's ``R_K``: the relative reconstruction error without rotation,
    rotated, and rotated with the entry's clip ratio.

    Returns:
        A JSON-friendly dict: model, tag, layers, head_dim, file and sha256, load time, the
        entry's group size and clip ratio, code / scale shapes and the three errors.

    Raises:
        ConfigError: ``tokens`` is not from 1 to :data:`MAX_DEMO_TOKENS`.
    """
    check_int(tokens, "tokens", low=1, high=MAX_DEMO_TOKENS, hint=" rows of the random K-like tensor")
    t0 = time.perf_counter()
    name, at_tag = split_model_tag(model)
    pair = load_registered(name, tag or at_tag)
    t_load = time.perf_counter() - t0
    assert pair.entry is not None
    cfg, d = pair.config(), pair.head_dim
    heads = pair.entry.architecture.num_kv_heads or 1
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, d, generator=g)
    x[..., : max(1, d // 32)] *= 8.0
    x = x.to(torch.bfloat16)
    r = pair.k.rotations[0]
    errors, codes, sz = {}, None, None
    for label, rot, clip in (("none", None, 0.0), ("rotated", r, 0.0), ("rotated+clip", r, cfg.k_clip_ratio)):
        run = cfg.replace(k_clip_ratio=clip)  # the entry's settings (Lloyd-Max, scale dtype, ...), this clip
        codes, sz = quantize_int2(x, rotation=rot, config=run, side="k")
        back = dequantize_int2(codes, sz, rotation=rot, config=run, dtype=torch.float32)
        errors[label] = round(float((back - x.float()).norm() / x.float().norm()), 4)
    assert codes is not None and sz is not None
    return {
        "model": pair.entry.model_id, "tag": pair.entry.name, "layers": len(pair.layer_ids), "head_dim": d,
        "heads": heads, "tokens": tokens, "layer": pair.layer_ids[0],
        "k_file": str(pair.paths["k"]), "k_sha256": pair.sha256["k"], "load_seconds": round(t_load, 4),
        "group_size": cfg.group_for(d), "k_clip_ratio": cfg.k_clip_ratio,
        "codes_shape": list(codes.shape), "scales_zeros_shape": list(sz.shape), "relative_error": errors,
    }
