"""Building blocks of the authors' fitter (``compute_kv_rotation.py``), written independently of
rotationzoo in plain fp64 torch. The fitter tests compare against them, and ``tools/bench_fit.py``
times a straightforward implementation of the authors' method built from them."""

from __future__ import annotations

from pathlib import Path

import torch


def load_chunks(root: Path, layer: int, kind: str, keep_first: bool = False) -> torch.Tensor:
    """Every chunk of ``layer_<layer>/<kind>/`` (but the warm-up chunk 0) as ``.float().double()``, concatenated."""
    folder = root / f"layer_{layer}" / kind
    ids = sorted(int(p.stem) for p in folder.glob("*.pt"))
    if not keep_first:
        ids = [i for i in ids if i != 0]
    return torch.cat([torch.load(folder / f"{i}.pt", weights_only=True).float().double() for i in ids], dim=0)


def build_hadamard(n: int) -> torch.Tensor:
    """Sylvester Hadamard / √n in fp64, built as ``[[H, H], [H, -H]] / √2``."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0) / 2**0.5
    return h


def br_perm_matrix(eigvals: torch.Tensor) -> torch.Tensor:
    """Eigenvalue-sorted bit-reversal permutation: the i-th largest eigenvalue goes to column ``br[i]``."""
    d = eigvals.shape[0]
    bits = d.bit_length() - 1
    br = [int(format(i, f"0{bits}b")[::-1], 2) for i in range(d)]
    sorted_idx = torch.argsort(eigvals, descending=True)
    perm = [0] * d
    for i in range(d):
        perm[br[i]] = int(sorted_idx[i])
    return torch.eye(d, dtype=torch.float64)[:, perm]
