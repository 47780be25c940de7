"""Small helpers shared by the tests."""

from __future__ import annotations

import torch


def random_orthogonal(n_layers: int, d: int, seed: int = 0) -> torch.Tensor:
    """``[n_layers, d, d]`` fp32 contiguous random orthogonal matrices (QR of a seeded Gaussian)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n_layers, d, d, dtype=torch.float64, generator=g))
    return q.float().contiguous()
