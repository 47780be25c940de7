"""Validation of rotation sets: structure, numerics, and expectations from the model.

A set is valid when it has at least one layer, every matrix is square, floating point and finite,
``max|R Rᵀ − I| ≤ atol`` (default 1e-5, computed in fp64), eigenvalues (when present) have length
``d``, and it matches what is expected of the model (layer ids or count, head_dim).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .errors import InvalidRotationError, RotationZooError
from .format import RotationSet, read_rotation
from .hashing import sha256_file

#: Default orthogonality tolerance: published files measure 3.6e-7 … 7.2e-7.
DEFAULT_ATOL = 1e-5


@dataclass
class ValidationReport:
    """Outcome of :func:`validate` / :func:`verify_file`. ``ok`` is ``not problems``."""

    path: str | None
    ok: bool
    num_layers: int | None = None
    head_dim: int | None = None
    layer_ids: list[int] = field(default_factory=list)
    objective: str | None = None
    format_version: int | str | None = None
    max_orthogonality_error: float | None = None
    worst_layer: int | None = None
    has_eigenvalues: bool | None = None
    problems: list[str] = field(default_factory=list)
    sha256: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def orthogonality_errors(rotations: torch.Tensor) -> torch.Tensor:
    """``max|R Rᵀ − I|`` per matrix, in fp64. ``rotations [L, d, d]`` → ``[L]`` fp64."""
    r = rotations.detach().to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return (r @ r.transpose(-1, -2) - eye).abs().amax(dim=(-1, -2))


def validate(
    rotation_set: RotationSet,
    *,
    atol: float = DEFAULT_ATOL,
    layer_ids: Iterable[int] | None = None,
    num_layers: int | None = None,
    head_dim: int | None = None,
    raise_on_error: bool = True,
) -> ValidationReport:
    """Check a rotation set; raise :class:`InvalidRotationError` (or return a failing report).

    Args:
        rotation_set: the set to check (``rotations [L, d, d]``).
        atol: tolerance on ``max|R Rᵀ − I|``.
        layer_ids: the exact layer ids the model needs (e.g. sparse ids of a hybrid model).
        num_layers: the number of layers the model needs (ids ``0 … num_layers-1``) when
            ``layer_ids`` is not given.
        head_dim: the model's head dimension ``d``.
        raise_on_error: raise on the first failing report (default) instead of returning it.

    Returns:
        A :class:`ValidationReport`; messages name the file, the layer and the measured error.
    """
    name = str(rotation_set.path) if rotation_set.path else "rotation set"
    rot = rotation_set.rotations
    ids = list(rotation_set.layer_ids)
    report = ValidationReport(
        path=str(rotation_set.path) if rotation_set.path else None,
        ok=False,
        num_layers=len(ids),
        head_dim=int(rot.shape[-1]) if rot.dim() == 3 else None,
        layer_ids=ids,
        objective=rotation_set.objective,
        format_version=rotation_set.format_version,
        has_eigenvalues=rotation_set.eigenvalues is not None,
    )
    problems = report.problems
    if not ids:
        problems.append(f"{name}: no layers")
    elif rot.dim() != 3 or rot.shape[-1] != rot.shape[-2]:
        problems.append(f"{name}: rotations must be [L, d, d], got {tuple(rot.shape)}")
    elif not rot.is_floating_point():
        problems.append(f"{name}: rotations have dtype {rot.dtype}, expected a floating point dtype")
    else:
        finite = torch.isfinite(rot).flatten(1).all(dim=1)
        for i in (~finite).nonzero().flatten().tolist():
            n_bad = int((~torch.isfinite(rot[i])).sum())
            problems.append(f"{name}: layer {ids[i]}: {n_bad} non-finite values (NaN or inf)")
        if bool(finite.any()):
            errs = orthogonality_errors(rot)
            errs = torch.where(finite, errs, torch.zeros_like(errs))
            worst = int(errs.argmax())
            report.max_orthogonality_error = float(errs[worst])
            report.worst_layer = ids[worst]
            for i in (errs > atol).nonzero().flatten().tolist():
                problems.append(
                    f"{name}: layer {ids[i]}: not orthogonal, max|RRᵀ−I| = {float(errs[i]):.3e} > {atol:.0e}"
                )
        ev = rotation_set.eigenvalues
        if ev is not None:
            if tuple(ev.shape) != (len(ids), rot.shape[-1]):
                problems.append(f"{name}: eigenvalues shape {tuple(ev.shape)}, expected [{len(ids)}, {rot.shape[-1]}]")
            elif not bool(torch.isfinite(ev).all()):
                bad = [ids[i] for i in (~torch.isfinite(ev).all(dim=1)).nonzero().flatten().tolist()]
                problems.append(f"{name}: eigenvalues of layers {bad[:8]} are not finite")
    # expectations from the model
    if head_dim is not None and report.head_dim is not None and report.head_dim != head_dim:
        problems.append(f"{name}: head_dim {report.head_dim}, but the model needs {head_dim}")
    expected_ids = sorted(int(i) for i in layer_ids) if layer_ids is not None else (
        list(range(num_layers)) if num_layers is not None else None
    )
    if expected_ids is not None and ids and sorted(ids) != expected_ids:
        missing = sorted(set(expected_ids) - set(ids))
        extra = sorted(set(ids) - set(expected_ids))
        parts = []
        if missing:
            parts.append(f"missing layers {_short(missing)}")
        if extra:
            parts.append(f"unexpected layers {_short(extra)}")
        problems.append(
            f"{name}: has {len(ids)} layers, the model needs {len(expected_ids)} ({'; '.join(parts)})"
        )
    report.ok = not problems
    if problems and raise_on_error:
        raise InvalidRotationError("; ".join(problems) if len(problems) <= 3 else
                                   "; ".join(problems[:3]) + f"; and {len(problems) - 3} more problems",
                                   problems)
    return report


def _short(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")


def verify_file(
    path: str | os.PathLike[str],
    *,
    atol: float = DEFAULT_ATOL,
    layer_ids: Iterable[int] | None = None,
    num_layers: int | None = None,
    head_dim: int | None = None,
    with_hash: bool = True,
) -> ValidationReport:
    """Read and validate one file; never raises for a bad file (the report says why)."""
    p = Path(path)
    try:
        rs = read_rotation(p)
    except RotationZooError as exc:
        report = ValidationReport(path=str(p), ok=False, problems=[str(exc)])
    else:
        report = validate(rs, atol=atol, layer_ids=layer_ids, num_layers=num_layers, head_dim=head_dim,
                          raise_on_error=False)
    if with_hash and p.is_file():
        report.sha256 = sha256_file(p)
        report.size = p.stat().st_size
    return report
