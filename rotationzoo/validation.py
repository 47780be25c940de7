"""Validation of rotation sets: structure, numerics, and expectations from the model.

A set is valid when it has at least one layer, every matrix is square, floating point and finite,
``max|R Rᵀ − I| ≤ atol`` (default 1e-5, computed in fp64), eigenvalues (when present) have length
``d``, and it matches what is expected of the model (layer ids or count, head_dim, and for
per-KV-head sets the number of KV heads). Per-KV-head sets are checked matrix by matrix; messages
name the layer and the head.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ._inspect import exc_line
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
    source_grouping: str | None = None
    num_kv_heads: int | None = None
    has_eigenvalues: bool | None = None
    problems: list[str] = field(default_factory=list)
    sha256: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def orthogonality_errors(rotations: torch.Tensor) -> torch.Tensor:
    """``max|R Rᵀ − I|`` per matrix, in fp64. ``rotations [..., d, d]`` → ``[...]`` fp64."""
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
    num_kv_heads: int | None = None,
    raise_on_error: bool = True,
) -> ValidationReport:
    """Check a rotation set; raise :class:`InvalidRotationError` (or return a failing report).

    Args:
        rotation_set: the set to check (``rotations [L, d, d]``, per KV head ``[L, H_kv, d, d]``).
        atol: tolerance on ``max|R Rᵀ − I|``.
        layer_ids: the exact layer ids the model needs (e.g. sparse ids of a hybrid model).
        num_layers: the number of layers the model needs (ids ``0 … num_layers-1``) when
            ``layer_ids`` is not given.
        head_dim: the model's head dimension ``d``.
        num_kv_heads: the model's KV heads; checked for per-KV-head sets only.
        raise_on_error: raise on the first failing report (default) instead of returning it.

    Returns:
        A :class:`ValidationReport`; messages name the file, the layer and the measured error.
    """
    name = str(rotation_set.path) if rotation_set.path else "rotation set"
    rot = rotation_set.rotations
    ids = list(rotation_set.layer_ids)
    per_head = rotation_set.per_head
    want = "[L, H_kv, d, d]" if per_head else "[L, d, d]"
    is_3d = isinstance(rot, torch.Tensor) and rot.dim() == (4 if per_head else 3)
    report = ValidationReport(
        path=str(rotation_set.path) if rotation_set.path else None,
        ok=False,
        num_layers=len(ids),
        head_dim=int(rot.shape[-1]) if is_3d else None,
        layer_ids=ids,
        objective=rotation_set.objective,
        format_version=rotation_set.format_version,
        has_eigenvalues=rotation_set.eigenvalues is not None,
        source_grouping=rotation_set.source_grouping,
        num_kv_heads=int(rot.shape[1]) if is_3d and per_head else None,
    )
    problems = report.problems
    if not ids:
        problems.append(f"{name}: no layers")
    elif not is_3d or rot.shape[-1] != rot.shape[-2] or rot.shape[0] != len(ids):
        shape = tuple(rot.shape) if isinstance(rot, torch.Tensor) else type(rot).__name__
        problems.append(f"{name}: rotations must be {want} with L = {len(ids)} layers, got {shape}")
    elif rot.layout != torch.strided:
        problems.append(f"{name}: rotations are a {rot.layout} tensor, expected a dense (strided) one")
    elif rot.shape[-1] < 1:
        problems.append(f"{name}: rotations are empty {list(rot.shape)} matrices")
    elif not rot.is_floating_point():
        problems.append(f"{name}: rotations have dtype {rot.dtype}, expected a floating point dtype")
    else:
        try:
            _check_numerics(rotation_set, name, atol, report)
        except Exception as exc:  # a tensor subclass or device that cannot be checked
            problems.append(f"{name}: cannot check the rotations ({type(exc).__name__}: {exc_line(exc)})")
    # expectations from the model
    if head_dim is not None and report.head_dim is not None and report.head_dim != head_dim:
        problems.append(f"{name}: head_dim {report.head_dim}, but the model needs {head_dim}")
    if num_kv_heads is not None and report.num_kv_heads is not None and report.num_kv_heads != num_kv_heads:
        problems.append(f"{name}: per-KV-head rotations for {report.num_kv_heads} KV heads, but the model has "
                        f"{num_kv_heads}")
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


def _check_numerics(rotation_set: RotationSet, name: str, atol: float, report: ValidationReport) -> None:
    """Finiteness and orthogonality of every matrix, shape and finiteness of the eigenvalues."""
    rot, ids, problems = rotation_set.rotations, list(rotation_set.layer_ids), report.problems
    mats = rot.reshape(-1, rot.shape[-2], rot.shape[-1])  # [L·H, d, d]; matrix m is layer m // H, head m % H
    heads = mats.shape[0] // len(ids)

    def where(m: int) -> str:
        return f"layer {ids[m // heads]}, head {m % heads}" if rotation_set.per_head else f"layer {ids[m]}"

    finite = torch.isfinite(mats).flatten(1).all(dim=1)
    for m in (~finite).nonzero().flatten().tolist():
        n_bad = int((~torch.isfinite(mats[m])).sum())
        problems.append(f"{name}: {where(m)}: {n_bad} non-finite values (NaN or inf)")
    if bool(finite.any()):
        errs = orthogonality_errors(mats)
        errs = torch.where(finite, errs, torch.zeros_like(errs))
        worst = int(errs.argmax())
        report.max_orthogonality_error = float(errs[worst])
        report.worst_layer = ids[worst // heads]
        for m in (errs > atol).nonzero().flatten().tolist():
            problems.append(f"{name}: {where(m)}: not orthogonal, max|RRᵀ−I| = {float(errs[m]):.3e} > {atol:.0e}")
    ev = rotation_set.eigenvalues
    if ev is None:
        return
    lead = tuple(rot.shape[:-1])  # (L, d) or (L, H_kv, d)
    if not isinstance(ev, torch.Tensor) or ev.layout != torch.strided or not ev.is_floating_point():
        problems.append(f"{name}: eigenvalues must be a dense floating point tensor")
    elif tuple(ev.shape) != lead:
        problems.append(f"{name}: eigenvalues shape {tuple(ev.shape)}, expected {list(lead)}")
    elif not bool(torch.isfinite(ev).all()):
        bad = [ids[i] for i in (~torch.isfinite(ev).flatten(1).all(dim=1)).nonzero().flatten().tolist()]
        problems.append(f"{name}: eigenvalues of layers {bad[:8]} are not finite")


def _short(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")


def verify_file(
    path: str | os.PathLike[str],
    *,
    atol: float = DEFAULT_ATOL,
    layer_ids: Iterable[int] | None = None,
    num_layers: int | None = None,
    head_dim: int | None = None,
    num_kv_heads: int | None = None,
    with_hash: bool = True,
) -> ValidationReport:
    """Read and validate one file; never raises for a bad file (the report says why).

    The model's expectations (``head_dim``, the number of layers) also bound what is read: a file
    declaring a larger ``d`` or more layers is refused before it is loaded.
    """
    p = Path(path)
    ids = sorted({int(i) for i in layer_ids}) if layer_ids is not None else None
    expected_layers = len(ids) if ids is not None else num_layers
    try:
        rs = read_rotation(p, head_dim=head_dim, num_layers=expected_layers, num_kv_heads=num_kv_heads)
        report = validate(rs, atol=atol, layer_ids=ids, num_layers=num_layers, head_dim=head_dim,
                          num_kv_heads=num_kv_heads, raise_on_error=False)
    except RotationZooError as exc:
        report = ValidationReport(path=str(p), ok=False, problems=[str(exc)])
    except Exception as exc:  # documented never to raise: report anything unforeseen, typed by name
        report = ValidationReport(path=str(p), ok=False,
                                  problems=[f"{p}: cannot verify ({type(exc).__name__}: {exc_line(exc)})"])
    if with_hash and p.is_file():
        try:
            report.sha256 = sha256_file(p)
            report.size = p.stat().st_size
        except OSError as exc:
            report.problems.append(f"{p}: cannot hash ({exc_line(exc)})")
            report.ok = False
    return report
