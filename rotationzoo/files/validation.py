"""Validation of rotation sets: structure, numerics, and expectations from the model.

A set is valid when it has at least one layer, every matrix is square, floating point and finite,
``max|R Rᵀ − I| ≤ atol`` (default 1e-5, computed in fp64) unless the set says its transform is not
orthogonal, every companion is finite, ``q_rotation`` / ``o_rotation`` are the inverse transpose of the
rotation (``max|Qᵀ R − I| ≤ inverse_atol``, default 1e-4), eigenvalues (when present) have the
rotation's leading shape, and it matches what is expected of the model (layer ids or count, head_dim
per layer, and for per-KV-head sets the number of KV heads). Checks run layer by layer (the working
set is one layer in fp64); messages name the layer and, per KV head, the head.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

import hashlib

from .limits import MAX_LAYERS, exc_line, parse_layer_ids
from .schema import validation_chunks
from ..errors import ConfigError, InvalidRotationError, RotationZooError
from ..numbers import check_real
from .format import RotationFormatWarning, RotationSet, read_rotation
from ..hashing import sha256_file
from ..headdims import HeadDims

#: Default orthogonality tolerance: published files measure 3.6e-7 … 7.2e-7.
DEFAULT_ATOL = 1e-5
#: Default tolerance on ``max|Qᵀ R − I|`` for ``q_rotation`` / ``o_rotation`` (``Q = R^{-T}``): fp32
#: inverses of transforms with condition numbers up to about 100 stay well below it.
DEFAULT_INVERSE_ATOL = 1e-4


@dataclass
class ValidationReport:
    """Outcome of :func:`validate` / :func:`verify_file`. ``ok`` is ``not problems``.

    ``head_dim`` is ``None`` for a ragged set; ``head_dims`` then gives ``d`` per layer
    (``{"default": d, "layers": {...}}``). ``source_grouping`` is ``layer`` or ``kv_head`` (from the
    shapes); ``format_version`` is the file's, ``layout_version`` the one it would be written as.
    """

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
    head_dims: Any = None
    layout_version: int | str | None = None
    companions: list[str] = field(default_factory=list)
    orthogonal: bool | None = None
    max_inverse_error: float | None = None
    calibration: dict[str, Any] | None = None
    transform: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)

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
    (:func:`~rotationzoo.files.schema.validation_chunks`): whole matrices while they fit, else blocks of
    rows of one matrix, so it never holds more than :func:`~rotationzoo.files.schema.validation_work_bytes`
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
        for j in range(len(idx)):  # one matrix at a time: isfinite and its sum take ~10 bytes per value
            bad[c + j] = d * d - int(torch.isfinite(chunk[j]).sum())
        a = chunk.to(torch.float64)
        del chunk
        prod = a @ a.transpose(-1, -2)
        del a
        prod.diagonal(dim1=-2, dim2=-1).sub_(1)
        err[c:c + len(idx)] = prod.abs_().amax(dim=(-1, -2))
        del prod  # else it lives on while the next chunk's copy and product are made
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


def _dims_of(x: Any) -> Any:
    """``d`` per layer of a :class:`RotationSet` or a :class:`ValidationReport` (comparable values)."""
    if isinstance(x, RotationSet):
        try:
            return x.head_dims.to_json()
        except RotationZooError:
            return None
    return x.head_dims if x.head_dims is not None else x.head_dim


def _heads_of(x: Any) -> Any:
    if isinstance(x, RotationSet):
        if not x.per_head:
            return None
        return tuple(int(r.shape[0]) for r in (x.rotations if isinstance(x.rotations, tuple) else x.rotations.unbind(0)))
    return x.num_kv_heads


def pair_disagreement(k: Any, v: Any) -> str | None:
    """What the K and the V side of one pair disagree on, or ``None``: the rule export, serving and
    ``rotationzoo verify`` apply. ``k`` and ``v`` are :class:`RotationSet` s or :class:`ValidationReport` s.

    K and V must cover the same layer ids with the same ``d`` per layer; two per-KV-head sides must
    also have the same number of KV heads per layer.
    """
    k_ids, v_ids = tuple(k.layer_ids), tuple(v.layer_ids)
    kd, vd = _dims_of(k), _dims_of(v)
    show = (lambda dims: dims if not isinstance(dims, dict) else
            ",".join([str(dims["default"]), *(f"{a}:{b}" for a, b in dims["layers"].items())]))
    if k_ids != v_ids or kd != vd:
        return (f"K and V disagree: K has {len(k_ids)} layers ({_short(list(k_ids))}) × d {show(kd)}, "
                f"V has {len(v_ids)} layers ({_short(list(v_ids))}) × d {show(vd)}")
    kh, vh = _heads_of(k), _heads_of(v)
    if kh is not None and vh is not None and kh != vh:
        counts = (lambda h: h if not isinstance(h, tuple) else (h[0] if len(set(h)) == 1 else sorted(set(h))))
        return f"K and V disagree: K has {counts(kh)} KV heads, V has {counts(vh)}"
    return None




def inverse_errors(rotation: torch.Tensor, inverse_t: torch.Tensor) -> torch.Tensor:
    """``max|Qᵀ R − I|`` per matrix, in fp64, for ``Q = R^{-T}`` (``q_rotation`` / ``o_rotation``)."""
    r, q = rotation.detach().to(torch.float64), inverse_t.detach().to(torch.float64)
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return (q.transpose(-1, -2) @ r - eye).abs().amax(dim=(-1, -2))


def validate(
    rotation_set: RotationSet,
    *,
    atol: float = DEFAULT_ATOL,
    inverse_atol: float = DEFAULT_INVERSE_ATOL,
    layer_ids: Iterable[int] | str | None = None,
    num_layers: int | None = None,
    head_dim: int | HeadDims | None = None,
    num_kv_heads: int | None = None,
    raise_on_error: bool = True,
) -> ValidationReport:
    """Check a rotation set; raise :class:`InvalidRotationError` (or return a failing report).

    Args:
        rotation_set: the set to check (any layout: per layer, per KV head, ragged, with companions).
        atol: tolerance on ``max|R Rᵀ − I|`` (orthogonal sets).
        inverse_atol: tolerance on ``max|Qᵀ R − I|`` of ``q_rotation`` / ``o_rotation``.
        layer_ids: the exact layer ids the model needs (e.g. sparse ids of a hybrid model), as integers or
            text as ``--layers`` takes it (``"0-3"``, ``"0,2,4"``).
        num_layers: the number of layers the model needs (ids ``0 … num_layers-1``) when
            ``layer_ids`` is not given.
        head_dim: the model's head dimension ``d`` (or :class:`~rotationzoo.headdims.HeadDims` per layer).
        num_kv_heads: the model's KV heads; checked for per-KV-head sets only.
        raise_on_error: raise on the first failing report (default) instead of returning it.

    Returns:
        A :class:`ValidationReport`; messages name the file, the layer and the measured error.
    """
    if not isinstance(rotation_set, RotationSet):
        raise ConfigError(f"validate() checks a RotationSet, got {type(rotation_set).__name__}; read a file first "
                          f"(rotationzoo.read_rotation(path))")
    for what, tol in (("atol", atol), ("inverse_atol", inverse_atol)):  # NaN would pass every file
        check_real(tol, what, low=0.0, high=1.0, hint=" (a tolerance on max|R Rᵀ − I|)")
    if layer_ids is not None:  # text such as "0-3" is read as --layers reads it, never per character
        layer_ids = parse_layer_ids(layer_ids, "layer_ids", empty_ok=True)
    rs = rotation_set
    name = str(rs.path) if rs.path else "rotation set"
    ids = list(rs.layer_ids)
    try:
        dims: HeadDims | None = rs.head_dims
    except RotationZooError:  # empty matrices: reported below
        dims = None
    report = ValidationReport(
        path=str(rs.path) if rs.path else None, ok=False, num_layers=len(ids),
        head_dim=dims.default if dims is not None and dims.uniform else None,
        head_dims=dims.to_json() if dims is not None else None, layer_ids=ids,
        objective=rs.objective, format_version=rs.format_version, layout_version=rs.layout_version,
        has_eigenvalues=rs.eigenvalues is not None, source_grouping=rs.source_grouping,
        companions=list(rs.companions), orthogonal=rs.orthogonal, calibration=rs.calibration, transform=rs.transform,
    )
    heads = {int(r.shape[0]) for r in _layer_rotations(rs)} if rs.per_head else set()
    report.num_kv_heads = next(iter(heads)) if len(heads) == 1 else None
    problems = report.problems
    if not ids:
        problems.append(f"{name}: no layers")
    else:
        try:
            _check_numerics(rs, name, atol, inverse_atol, report)
        except Exception as exc:  # a tensor subclass or device that cannot be checked
            problems.append(f"{name}: cannot check the rotations ({type(exc).__name__}: {exc_line(exc)})")
    _check_expectations(rs, name, report, layer_ids, num_layers, dims, HeadDims.of(head_dim), num_kv_heads)
    report.ok = not problems
    if problems and raise_on_error:
        raise InvalidRotationError("; ".join(problems) if len(problems) <= 3 else
                                   "; ".join(problems[:3]) + f"; and {len(problems) - 3} more problems",
                                   problems)
    return report


def _layer_rotations(rs: RotationSet) -> list[torch.Tensor]:
    return list(rs.rotations) if isinstance(rs.rotations, tuple) else list(rs.rotations.unbind(0))


def _check_expectations(rs: RotationSet, name: str, report: ValidationReport, layer_ids: Iterable[int] | None,
                        num_layers: int | None, have: HeadDims | None, dims: HeadDims | None,
                        num_kv_heads: int | None) -> None:
    problems, ids = report.problems, list(rs.layer_ids)
    if dims is not None and have is not None:
        wrong = [lid for lid in ids if have(lid) != dims(lid)]
        if wrong and dims.uniform and have.uniform:
            problems.append(f"{name}: head_dim {have.default}, but the model needs {dims.default}")
        elif wrong:
            problems.append(f"{name}: layers {_short(wrong)} have head_dim {have(wrong[0])}{' …' if len(wrong) > 1 else ''}"
                            f", but the model needs {dims(wrong[0])} there (head_dims {dims})")
    if num_kv_heads is not None and rs.per_head:
        counts = sorted({int(r.shape[0]) for r in _layer_rotations(rs)} - {num_kv_heads})
        if counts:
            problems.append(f"{name}: per-KV-head rotations for {counts[0]} KV heads, but the model has {num_kv_heads}")
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or not 1 <= num_layers <= MAX_LAYERS):
        problems.append(f"{name}: the expected number of layers {str(num_layers)[:40]} is not in [1, {MAX_LAYERS}] "
                        f"(the most a rotation file holds)")
        num_layers = None
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
        problems.append(f"{name}: has {len(ids)} layers, the model needs {len(expected_ids)} ({'; '.join(parts)})")


def _dense_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_floating_point()


def _measure_all(rs: RotationSet) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """``(non-finite counts, orthogonality errors)`` per layer, each ``[H]`` (``[1]`` per layer), measured
    over the whole set at once when it is stacked (identical matrices once, in bounded chunks); per
    layer for a ragged set. ``None`` when the rotations cannot be measured here (then per layer)."""
    rot = rs.rotations
    try:
        if isinstance(rot, tuple):
            out = []
            for r in rot:
                bad, err = measure_matrices(r.reshape(-1, r.shape[-2], r.shape[-1]))
                out.append((bad, err))
            return out
        if not _dense_float(rot) or rot.dim() not in (3, 4) or rot.shape[-1] != rot.shape[-2] or rot.shape[-1] < 1:
            return None
        bad, err = measure_matrices(rot.reshape(rot.shape[0], -1, rot.shape[-2], rot.shape[-1]))
        return [(bad[i], err[i]) for i in range(rot.shape[0])]
    except (RuntimeError, TypeError, ValueError):
        return None


def _check_numerics(rs: RotationSet, name: str, atol: float, inverse_atol: float, report: ValidationReport) -> None:
    """Per layer: finiteness, orthogonality (or the companions' inverse), shapes of the other fields."""
    problems = report.problems
    orthogonal = rs.orthogonal
    if not orthogonal and rs.q_rotation is None and rs.o_rotation is None:
        problems.append(f"{name}: its transform is not orthogonal, but it carries no q_rotation / o_rotation (the "
                        f"inverse transpose needed to apply it)")
    worst: tuple[float, int] | None = None
    worst_inv = 0.0
    measured = _measure_all(rs) if orthogonal else None
    for i, (lid, fields) in enumerate(rs.layers()):
        rot = fields["rotation"]
        if isinstance(rot, torch.Tensor) and rot.dim() in (2, 3) and rot.shape[-1] < 1:
            problems.append(f"{name}: layer {lid}: rotations are empty {list(rot.shape)} matrices")
            continue
        if not _dense_float(rot) or rot.dim() not in (2, 3) or rot.shape[-1] != rot.shape[-2]:
            shape = list(rot.shape) if isinstance(rot, torch.Tensor) else type(rot).__name__
            problems.append(f"{name}: layer {lid}: rotation must be a dense floating point [d, d] or [H_kv, d, d] "
                            f"matrix, got {shape} {getattr(rot, 'dtype', '')}".rstrip())
            continue
        mats = rot.reshape(-1, rot.shape[-2], rot.shape[-1])

        def where(m: int) -> str:
            return f"layer {lid}, head {m}" if rs.per_head else f"layer {lid}"

        errs: torch.Tensor | None
        if measured is not None:
            nonfinite, errs = measured[i]
        else:
            nonfinite, errs = measure_matrices(mats)
            errs = errs if orthogonal else None
        finite = nonfinite == 0
        for m in (~finite).nonzero().flatten().tolist():
            problems.append(f"{name}: {where(m)}: {int(nonfinite[m])} non-finite values (NaN or inf)")
        if errs is not None and bool(finite.any()):
            errs = torch.where(finite, errs, torch.zeros_like(errs))
            top = int(errs.argmax())
            if worst is None or float(errs[top]) > worst[0]:
                worst = (float(errs[top]), lid)
            for m in (errs > atol).nonzero().flatten().tolist():
                why = f": {rs.coarse[lid]}" if lid in rs.coarse else ""
                problems.append(f"{name}: {where(m)}: not orthogonal, max|RRᵀ−I| = {float(errs[m]):.3e} > {atol:.0e}{why}")
        for f, t in fields.items():
            if f == "rotation":
                continue
            want = tuple(rot.shape) if f in ("q_rotation", "o_rotation") else tuple(rot.shape[:-1])
            ok_shapes = {want} | ({tuple(rot.shape[-1:])} if f in ("k_mean", "v_mean") else set())
            if not _dense_float(t) or tuple(t.shape) not in ok_shapes:
                problems.append(f"{name}: layer {lid}: {f} must be a dense floating point tensor of shape {list(want)}, "
                                f"got {list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
                continue
            if not bool(torch.isfinite(t).all()):
                problems.append(f"{name}: layer {lid}: {f} is not finite (NaN or inf)")
                continue
            if f in ("q_rotation", "o_rotation") and bool(finite.all()):
                inv = inverse_errors(mats, t.reshape(mats.shape))
                worst_inv = max(worst_inv, float(inv.max()))
                for m in (inv > inverse_atol).nonzero().flatten().tolist():
                    problems.append(f"{name}: {where(m)}: {f} is not the rotation's inverse transpose, "
                                    f"max|QᵀR−I| = {float(inv[m]):.3e} > {inverse_atol:.0e}")
    if worst is not None:
        report.max_orthogonality_error, report.worst_layer = worst
    if rs.q_rotation is not None or rs.o_rotation is not None:
        report.max_inverse_error = worst_inv


def _short(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")


def verify_file(
    path: str | os.PathLike[str],
    *,
    atol: float = DEFAULT_ATOL,
    layer_ids: Iterable[int] | None = None,
    num_layers: int | None = None,
    head_dim: int | HeadDims | None = None,
    num_kv_heads: int | None = None,
    with_hash: bool = True,
) -> ValidationReport:
    """Read and validate one file; never raises for a bad file (the report says why).

    The model's expectations (``head_dim``, the number of layers) also bound what is read: a file
    declaring a larger ``d`` or more layers is refused before it is loaded. Warnings while reading
    (e.g. a ``source_grouping`` label that disagrees with the shapes) go to ``report.warnings``.
    """
    p = Path(path)
    ids = sorted({int(i) for i in layer_ids}) if layer_ids is not None else None
    expected_layers = len(ids) if ids is not None else num_layers
    seen: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always", RotationFormatWarning)
            rs = read_rotation(p, head_dim=head_dim, num_layers=expected_layers, num_kv_heads=num_kv_heads)
        report = validate(rs, atol=atol, layer_ids=ids, num_layers=num_layers, head_dim=head_dim,
                          num_kv_heads=num_kv_heads, raise_on_error=False)
        report.warnings = [str(w.message) for w in seen if issubclass(w.category, RotationFormatWarning)]
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
