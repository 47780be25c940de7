"""Small helpers shared by the tests."""

from __future__ import annotations

import torch


def random_orthogonal(n_layers: int, d: int, seed: int = 0) -> torch.Tensor:
    """``[n_layers, d, d]`` fp32 contiguous random orthogonal matrices (QR of a seeded Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n_layers, d, d, dtype=torch.float64, generator=g))
    return q.float().contiguous()


def int2_config(clip: float = 0.0, group: int | None = None, *, lloyd_max: bool = False,
                scale: torch.dtype = torch.float32, search: str = "exact", side: str = "k") -> "Int2KVConfig":
    """An :class:`~rotationzoo.int2kv.Int2KVConfig` with the clip ratio ``clip`` on ``side`` (the other 0),
    group size, Lloyd-Max, scale dtype (a torch dtype) and clip search: the settings a kernel test
    used to spell as loose keywords."""
    from rotationzoo.dtypes import TORCH_DTYPES
    from rotationzoo.int2kv import Int2KVConfig

    name = next(k for k, v in TORCH_DTYPES.items() if v == scale)
    clips = {"k_clip_ratio": max(float(clip), 0.0) if side == "k" else 0.0,
             "v_clip_ratio": max(float(clip), 0.0) if side == "v" else 0.0}
    return Int2KVConfig(group_size=group, lloyd_max=lloyd_max, scale_dtype=name, clip_search=search,  # type: ignore[arg-type]
                        **clips)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``rotationzoo ARGV...`` in this process: its exit code, stdout and stderr (``capsys`` captures them)."""
    from rotationzoo.cli.main import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def with_cache(cache) -> dict:
    """``cache`` as the keyword the installed transformers takes it by (``cache=`` from 5.24, ``past_key_values=``
    before): ``model(ids, **with_cache(c))``."""
    from rotationzoo.integrations.transformers import cache_argument

    return {cache_argument(): cache}
