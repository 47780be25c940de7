"""Data-free building blocks: the normalised Sylvester Hadamard matrix and bit-reversal order.

Both follow the authors' fitter exactly (``build_hadamard`` / ``bit_reversal_perm``):
``H_1 = [[1]]``, ``H_2n = [[H, H], [H, -H]] / sqrt(2)`` in fp64, so ``H_d`` is Sylvester/√d,
symmetric and its own inverse.
"""

from __future__ import annotations

import torch

from .errors import KernelInputError


def _check_power_of_two(d: int, what: str = "d") -> None:
    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise KernelInputError(f"{what} must be a power of two (1, 2, 4, ...), got {d!r}")


def hadamard_matrix(d: int, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix.

    Args:
        d: size, a power of two.
        dtype: output dtype (built in fp64, then cast).

    Returns:
        ``[d, d]`` tensor ``H`` with ``H @ H.T == I`` and ``H == H.T``.
    """
    _check_power_of_two(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    inv_sqrt2 = 1.0 / (2.0**0.5)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0) * inv_sqrt2
    return h.to(dtype)


def bit_reversal_permutation(d: int) -> list[int]:
    """``br[i]`` = i with its ``log2(d)`` bits reversed (d=8: 0, 4, 2, 6, 1, 5, 3, 7)."""
    _check_power_of_two(d)
    bits = d.bit_length() - 1
    return [int(format(i, f"0{bits}b")[::-1], 2) if bits else 0 for i in range(d)]
