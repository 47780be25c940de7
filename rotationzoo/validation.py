"""Validation of rotation sets: structure, numerics, and expectations from the model.

A set is valid when it has at least one layer, every matrix is square, floating point and finite,
``max|R Rᵀ − I| ≤ atol`` (default 1e-5, computed in fp64), eigenvalues (when present) have length
``d``, and it matches what is expected of the model (layer ids or count, head_dim, and for
per-KV-head sets the number of KV heads). Per-KV-head sets are checked matrix by matrix; messages
name the layer and the head. The fp64 work is done in chunks: :func:`validate` never allocates
more than :func:`~rotationzoo._schema.validation_work_bytes` at once (at most 8 MiB), which the
readers' ``max_bytes`` counts. :func:`pair_disagreement` is the one K/V agreement rule (export,
serving and ``rotationzoo verify`` apply it).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ._inspect import exc_line
from ._schema import validation_chunks
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
    """``max|R Rᵀ − I|`` per matrix, in fp64 (NaN for a matrix with non-finite values).

    ``rotations [..., d, d]`` → ``[...]`` fp64; see :func:`measure_matrices`.
    """
    return measure_matrices(rotations)[1]


def nonfinite_counts(rotations: torch.Tensor) -> torch.Tensor:
    """How many NaN / inf values each ``[d, d]`` matrix holds (``[...]`` int64); see :func:`measure_matrices`."""
    return measure_matrices(rotations)[0]


def measure_matrices(rotations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(non-finite value counts, max|R Rᵀ − I| in fp64)`` of every ``[d, d]`` matrix of ``rotations``.

    Identical matrices (layers that shared one stored tensor, as in a data-free Hadamard file) are
    measured once, so the time is that of the distinct matrices. The work is done chunk by chunk
    (:func:`~rotationzoo._schema.validation_chunks`): whole matrices while they fit, else blocks of
    rows of one matrix, so it never holds more than :func:`~rotationzoo._schema.validation_work_bytes`
    at once.
    """
    r = rotations.detach()
    d = int(r.shape[-1])
    mats = r.reshape(-1, d, d)
    reps, group = _distinct(mats)
    bad = torch.zeros(len(reps), dtype=torch.int64, device=r.device)
    err = torch.empty(len(reps), dtype=torch.float64, device=r.device)
    n, b = validation_chunks(d, len(reps))
    for c in range(0, len(reps), n):
        idx = reps[c:c + n]
        if b < d:  # one large matrix, in blocks of b rows
            m = mats[idx[0]]
            bad[c] = sum(d * min(b, d - i) - int(torch.isfinite(m[i:i + b]).sum()) for i in range(0, d, b))
            err[c] = _blocked_error(m, b)
            continue
        chunk = mats[idx[0]:idx[-1] + 1] if idx[-1] - idx[0] == len(idx) - 1 else mats[idx]
        bad[c:c + len(idx)] = d * d - torch.isfinite(chunk).sum(dim=(-1, -2))
        a = chunk.to(torch.float64)
        del chunk
        prod = a @ a.transpose(-1, -2)
        del a
        prod.diagonal(dim1=-2, dim2=-1).sub_(1)
        err[c:c + len(idx)] = prod.abs_().amax(dim=(-1, -2))
    where = torch.tensor(group, dtype=torch.int64, device=r.device)
    return bad[where].reshape(r.shape[:-2]), err[where].reshape(r.shape[:-2])


def _distinct(mats: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(representatives, group of each matrix)``: identical matrices (equal 256-bit BLAKE2b digests
    of their bytes) are measured once, through the first of them."""
    count = int(mats.shape[0])
    if mats.device.type != "cpu" or not mats.is_contiguous() or count < 2:
        return list(range(count)), list(range(count))
    raw = mats.view(torch.uint8).numpy()  # the bytes, without a copy
    first: dict[bytes, int] = {}
    reps: list[int] = []
    group: list[int] = []
    for m in range(count):
        key = hashlib.blake2b(raw[m].data, digest_size=32).digest()
        if key not in first:
            first[key] = len(reps)
            reps.append(m)
        group.append(first[key])
    return reps, group


def _blocked_error(m: torch.Tensor, b: int) -> torch.Tensor:
    """``max|M Mᵀ − I|`` of one ``[d, d]`` matrix from ``b``-row blocks (``M Mᵀ`` is symmetric: j ≥ i)."""
    d = int(m.shape[-1])
    worst = torch.zeros((), dtype=torch.float64, device=m.device)
    for i in range(0, d, b):
        a = m[i:i + b].to(torch.float64)
        for j in range(i, d, b):
            prod = a @ (a if j == i else m[j:j + b].to(torch.float64)).T
            if j == i:
                prod.diagonal().sub_(1)
            worst = torch.maximum(worst, prod.abs_().amax())
    return worst


def pair_disagreement(k: Any, v: Any) -> str | None:
    """What the K and the V side of one pair disagree on, or ``None``: the rule export, serving and
    ``rotationzoo verify`` apply. ``k`` and ``v`` are :class:`RotationSet` s or :class:`ValidationReport` s
    (anything with ``layer_ids``, ``head_dim`` and ``num_kv_heads``, ``None`` for per-layer sets).

    K and V must cover the same layer ids with the same ``d``; two per-KV-head sides must also
    have the same number of KV heads.
    """
    k_ids, v_ids = tuple(k.layer_ids), tuple(v.layer_ids)
    if k_ids != v_ids or k.head_dim != v.head_dim:
        return (f"K and V disagree: K has {len(k_ids)} layers ({_short(list(k_ids))}) × d {k.head_dim}, "
                f"V has {len(v_ids)} layers ({_short(list(v_ids))}) × d {v.head_dim}")
    if k.num_kv_heads is not None and v.num_kv_heads is not None and k.num_kv_heads != v.num_kv_heads:
        return f"K and V disagree: K has {k.num_kv_heads} KV heads, V has {v.num_kv_heads}"
    return None


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

    nonfinite, errs = measure_matrices(mats)
    finite = nonfinite == 0
    for m in (~finite).nonzero().flatten().tolist():
        problems.append(f"{name}: {where(m)}: {int(nonfinite[m])} non-finite values (NaN or inf)")
    if bool(finite.any()):
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
