"""From a covariance to a rotation: symmetrised fp64 ``eigh`` and the OSCAR compositions.

Every function here reproduces the OSCAR fitter (``rotation/compute_kv_rotation.py``) exactly:

* ``C`` is symmetrised as ``(C + Cᵀ) / 2`` and decomposed with ``torch.linalg.eigh`` in fp64, so
  eigenvalues come **ascending** and eigenvectors are the columns of ``U``.
* ``H`` is the normalised Sylvester Hadamard matrix (Sylvester/√d, :func:`rotationzoo.hadamard.hadamard_matrix`).
* ``P_br`` is the eigenvalue-sorted bit-reversal permutation::

      sorted_idx = argsort(λ, descending=True)      # λ as returned by eigh (ascending)
      perm[br[i]] = sorted_idx[i]                   # br = bit-reversal order of 0..d-1
      P = I[:, perm]                                # (x @ P)[j] = x[perm[j]]

  so the i-th largest eigen-direction lands at output position ``br[i]`` (d=128: largest → 0,
  2nd → 64, 3rd → 32, 4th → 96, ...).

Compositions (the factors, left to right; ``R`` here is ``U``):

=========== ============= ==========================================================
name        matrix        note
=========== ============= ==========================================================
plain       U             the authors' CLI default
pbr         P             permutation only
br          U·P
br_h128     U·P·H         ``H`` is ``H_d`` (equals H_128 for the published d=128)
r_h         U·H
h_pbr       H·P
h_r_pbr     H·U·P
h_pbr_r     H·P·U
r_h_pbr     U·H·P         OSCAR, "validated best"
r_pbr_hg    U·P·H_G       rotationzoo extension, group-aware (see :func:`block_hadamard`)
=========== ============= ==========================================================

``r_pbr_hg`` (opt-in) deals the eigen-directions round-robin across the ``d/G`` contiguous
quantisation groups (the bit-reversal order puts the ``d/G`` largest directions one per group),
then mixes within each group with a block-diagonal Hadamard ``H_G``: every group gets an equal
share of the importance and every channel of a group the same share of its group's energy.
Its label carries the group size, e.g. ``r_pbr_hg32``.

The data-free ``hadamard`` objective (:func:`hadamard_rotations`) uses ``H_d`` for every layer.

Eigenvector signs are not defined by ``eigh``; by default each column of ``U`` is made to have its
largest-magnitude entry positive (:func:`canonicalize_signs`), which makes the result independent
of the LAPACK build and of the device. The eigenvalues, the permutation and the per-channel
importance ``diag(Rᵀ C R)`` do not depend on the signs; the matrix itself does. Pass
``signs="lapack"`` to keep ``eigh``'s own signs, which is what the authors' script does.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..errors import FitError
from ..files.format import RotationSet
from ..hadamard import bit_reversal_permutation, hadamard_matrix
from ..recipe import check_composition

from ..vocab import AUTHOR_COMPOSITIONS, COMPOSITIONS, SignConvention  # noqa: F401 - re-exported


def _check_dim(d: int, what: str) -> None:
    if d < 1 or d & (d - 1):
        raise FitError(f"{what}: head_dim {d} is not a power of two; Hadamard-based compositions need one")


def check_head_dim(composition: str, d: int) -> None:
    """Raise :class:`FitError` for a ``d`` the composition cannot use (all but ``plain`` need a power of two)."""
    if composition != "plain":
        _check_dim(d, f"composition {composition!r}")


def composition_label(composition: str, group_size: int | None = None) -> str:
    """The name used in the objective string and file names (``r_pbr_hg`` gets its group size).

    Args:
        composition: one of :data:`COMPOSITIONS`.
        group_size: the group size ``G`` for ``r_pbr_hg`` (ignored otherwise).

    Returns:
        e.g. ``"r_h_pbr"`` or ``"r_pbr_hg32"``.
    """
    check_composition(composition, group_size)
    if composition == "r_pbr_hg":
        return f"r_pbr_hg{int(group_size)}"  # type: ignore[arg-type]
    return composition


def symmetric_eigh(cov: torch.Tensor, *, what: str = "covariance") -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetrise and eigendecompose in fp64, exactly as the authors do.

    Args:
        cov: ``[d, d]`` covariance (any float dtype; converted to fp64).
        what: name used in error messages (e.g. ``"layer 3 qqt"``).

    Returns:
        ``(eigenvalues [d] fp64 ascending, eigenvectors [d, d] fp64 as columns)``.

    Raises:
        FitError: the matrix is not square or has non-finite entries.
    """
    c = cov.detach().to(torch.float64)
    if c.dim() != 2 or c.shape[0] != c.shape[1]:
        raise FitError(f"{what}: expected a square matrix, got shape {tuple(c.shape)}")
    if not bool(torch.isfinite(c).all()):
        n_bad = int((~torch.isfinite(c)).sum())
        raise FitError(f"{what}: covariance has {n_bad} non-finite entries (NaN or inf); check the dump")
    c = (c + c.T) / 2
    try:
        eigenvalues, eigenvectors = torch.linalg.eigh(c)
    except RuntimeError as exc:  # pragma: no cover - LAPACK failure
        raise FitError(f"{what}: eigh failed ({exc})") from None
    return eigenvalues, eigenvectors


def canonicalize_signs(eigenvectors: torch.Tensor) -> torch.Tensor:
    """Flip columns so that each column's largest-magnitude entry is positive.

    Args:
        eigenvectors: ``[..., d, d]`` with eigenvectors as columns.

    Returns:
        A tensor of the same shape and dtype (ties in magnitude: the first index wins).
    """
    idx = eigenvectors.abs().argmax(dim=-2, keepdim=True)
    pivot = torch.gather(eigenvectors, -2, idx)
    signs = torch.where(pivot < 0, -1.0, 1.0).to(eigenvectors.dtype)
    return eigenvectors * signs


def br_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """The index vector ``perm`` of the eigenvalue-sorted bit-reversal permutation.

    ``perm[br[i]] = argsort(λ, descending=True)[i]``, exactly as the authors' ``make_br_perm_matrix``.

    Args:
        eigenvalues: ``[d]`` eigenvalues as returned by ``eigh`` (fp64, ascending).

    Returns:
        ``[d]`` int64 ``perm`` with ``P = I[:, perm]``.
    """
    d = int(eigenvalues.shape[-1])
    _check_dim(d, "bit-reversal permutation")
    sorted_idx = torch.argsort(eigenvalues, descending=True)
    br = torch.tensor(bit_reversal_permutation(d), dtype=torch.long)
    perm = torch.empty(d, dtype=torch.long)
    perm[br] = sorted_idx.to(torch.long).cpu()
    return perm


def br_permutation_matrix(eigenvalues: torch.Tensor) -> torch.Tensor:
    """``P_br = I_d[:, perm]`` (fp64 ``[d, d]``); see :func:`br_permutation`."""
    d = int(eigenvalues.shape[-1])
    return torch.eye(d, dtype=torch.float64)[:, br_permutation(eigenvalues)]


def block_hadamard(d: int, group_size: int) -> torch.Tensor:
    """Block-diagonal normalised Hadamard ``H_G ⊕ … ⊕ H_G`` (``d/G`` blocks), fp64 ``[d, d]``."""
    _check_dim(d, "block Hadamard")
    check_composition("r_pbr_hg", group_size, d)
    h = hadamard_matrix(group_size, dtype=torch.float64)
    return torch.block_diag(*([h] * (d // group_size)))


def compose(
    eigenvectors: torch.Tensor,
    eigenvalues: torch.Tensor,
    composition: str = "r_h_pbr",
    *,
    group_size: int | None = None,
) -> torch.Tensor:
    """Build the rotation from an eigenbasis, exactly as the authors' ``compose``.

    Args:
        eigenvectors: ``U`` ``[d, d]`` fp64, eigenvectors as columns (order as returned by ``eigh``).
        eigenvalues: ``[d]`` fp64 ascending, used by the ``P_br`` factor.
        composition: one of :data:`COMPOSITIONS`.
        group_size: ``G`` for ``r_pbr_hg``.

    Returns:
        ``R`` ``[d, d]`` fp64, orthogonal, applied as ``x_rot = x @ R``.
    """
    d = int(eigenvectors.shape[-1])
    check_composition(composition, group_size, d)
    u = eigenvectors.to(torch.float64)
    if composition == "plain":
        return u.clone()
    _check_dim(d, f"composition {composition!r}")
    h = hadamard_matrix(d, dtype=torch.float64).to(u.device)
    p = br_permutation_matrix(eigenvalues).to(u.device)
    if composition == "pbr":
        return p
    if composition == "br":
        return u @ p
    if composition == "br_h128":
        return u @ p @ h
    if composition == "r_h":
        return u @ h
    if composition == "h_pbr":
        return h @ p
    if composition == "h_r_pbr":
        return h @ u @ p
    if composition == "h_pbr_r":
        return h @ p @ u
    if composition == "r_h_pbr":
        return u @ h @ p
    # r_pbr_hg
    return u @ p @ block_hadamard(d, int(group_size)).to(u.device)  # type: ignore[arg-type]


def rotation_from_covariance(
    cov: torch.Tensor,
    composition: str = "r_h_pbr",
    *,
    group_size: int | None = None,
    signs: SignConvention = "canonical",
    what: str = "covariance",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` + composition, with an fp64 orthogonality assertion.

    Args:
        cov: ``[d, d]`` covariance target.
        composition: see :func:`compose`.
        group_size: ``G`` for ``r_pbr_hg``.
        signs: ``"canonical"`` (largest entry of each eigenvector positive) or ``"lapack"``.
        what: name used in error messages.

    Returns:
        ``(R [d, d] fp64, eigenvalues [d] fp64 ascending, not permuted)``.

    Raises:
        FitError: non-finite covariance or a rotation that is not orthogonal to 1e-10.
    """
    if signs not in ("canonical", "lapack"):
        raise FitError(f"unknown sign convention {signs!r}; expected 'canonical' or 'lapack'")
    eigenvalues, u = symmetric_eigh(cov, what=what)
    if signs == "canonical":
        u = canonicalize_signs(u)
    r = compose(u, eigenvalues, composition, group_size=group_size)
    err = float((r @ r.T - torch.eye(r.shape[0], dtype=r.dtype, device=r.device)).abs().max())
    if not err <= 1e-10:
        raise FitError(f"{what}: composed rotation is not orthogonal (max|RRᵀ−I| = {err:.3e} in fp64)")
    return r, eigenvalues


def hadamard_rotations(layer_ids: Iterable[int], head_dim: int) -> RotationSet:
    """The data-free baseline: ``H_d`` (Sylvester/√d, built in fp64) for every layer.

    Args:
        layer_ids: model layer indices.
        head_dim: ``d``, a power of two.

    Returns:
        A :class:`RotationSet` with objective ``"hadamard"`` and ``eigenvalues = ones(d)``; all
        layers share one matrix (written once, as the authors' file does).
    """
    ids = tuple(sorted({int(i) for i in layer_ids}))
    if not ids:
        raise FitError("hadamard: no layers (give num_layers / layer ids or a dump)")
    d = int(head_dim)
    if d < 1 or d & (d - 1):
        raise FitError(f"hadamard: head_dim {d} is not a power of two")
    h = hadamard_matrix(d, dtype=torch.float64).to(torch.float32)
    return RotationSet(
        rotations=h.unsqueeze(0).expand(len(ids), d, d).contiguous(),
        layer_ids=ids,
        objective="hadamard",
        eigenvalues=torch.ones(len(ids), d, dtype=torch.float32),
    )
