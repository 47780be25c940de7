"""MLA latent rotation sets: a folder of ``layer_<id>.pt`` files, read as safely as K/V rotation files.

MLA models (GLM-5.2, GLM-5.3, Kimi-K3) cache one compressed latent ``c_kv`` per token and layer;
OSCAR quantises it after a per-layer ``[rank, rank]`` rotation (``rank`` = ``kv_lora_rank``, 512).
The authors write each layer's rotation to its own file, in one of two layouts:

- a bare ``[rank, rank]`` fp32 tensor (``rotation/compute_mla_oscar_rotation.py``: ``Rcov · P · H_block``),
  orthogonal; the server applies ``c @ R`` and ``R.T`` back;
- the OSCAR-2 dict (``rotation/tools/fit_mla_joint_latent.py``): ``rotation`` ``[rank, rank]``, ``mean``
  ``[rank]`` (subtracted before the rotation), ``eigenvalues`` ``[rank]``, ``transform`` (``latent``,
  ``centered``, ``orthogonal``, …) and, for a non-orthogonal transform, ``q_rotation = R^{-T}``.

Both are inspected before anything is loaded (:mod:`rotationzoo.files.limits`: no code runs, sizes are
bounded, one layer per file), loaded with ``torch.load(weights_only=True)``, and validated: square,
finite, ``[rank, rank]``, orthogonal unless the file says otherwise and carries ``q_rotation``,
which must then invert it. A folder must cover exactly the model's latent layers: the authors'
server replaces a missing ``layer_<id>.pt`` by the identity without a word, which at 2 bits is
collapse, so a missing layer is an error that names it. A high-precision subspace folder holds
``[k, rank]`` files with orthonormal rows. Other files the authors write beside rotations (PQ
codebooks, K/V rotation files, calibration dumps) are refused with what they are.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .limits import Limits, TensorMeta, parse_index, safe_repr
from .archive import inspect_torch_zip, refuse_legacy_pickle
from .schema import FLOAT_DTYPES, _meta, holds_tensor, precision_problem
from ..errors import InvalidRotationError, RotationFileError
from .format import _inspect_named, _is_zip, _torch_load_safe, check_torch_version, regular_file
from ..safefile import open_regular
from .validation import DEFAULT_ATOL, DEFAULT_INVERSE_ATOL, inverse_errors, measure_matrices

#: Largest latent width a file may declare (published latents are 512 wide).
MAX_LATENT_RANK = 2048
#: Most layer files a latent folder may hold.
MAX_LATENT_LAYERS = 1024
#: File name of one layer's latent rotation (or subspace): ``layer_<id>.pt``, ``id`` in plain decimal.
LAYER_FILE = re.compile(r"^layer_(0|[1-9][0-9]{0,5})\.pt$")
_LOOSE_LAYER_FILE = re.compile(r"^layer_.*\.pt$")
#: Keys an OSCAR-2 latent dict may hold (tensors first). Another key holding a tensor is refused; other values
#: are metadata and ignored, as in a K/V rotation file (:data:`~rotationzoo.files.schema.TOP_KEYS`).
TENSOR_KEYS = ("rotation", "mean", "eigenvalues", "q_rotation")
META_KEYS = ("transform", "layer_id")
_PQ_KEYS = frozenset({"codebooks_per_layer", "codebooks_stage1", "codebooks_stage2"})


@dataclass
class LatentLayer:
    """One layer's latent transform, as read (fp32 tensors on the CPU).

    ``layout`` is ``"tensor"`` (a bare ``[rank, rank]`` file) or ``"dict"`` (the OSCAR-2 dict). ``coarse``: why the
    rotation, stored in 16 bits, cannot be orthogonal (validation names it beside "not orthogonal"), else ``None``.
    """

    layer_id: int
    rotation: torch.Tensor
    layout: str = "tensor"
    mean: torch.Tensor | None = None
    eigenvalues: torch.Tensor | None = None
    q_rotation: torch.Tensor | None = None
    transform: dict[str, Any] | None = None
    path: Path | None = None
    coarse: str | None = None

    @property
    def rank(self) -> int:
        return int(self.rotation.shape[-1])

    @property
    def orthogonal(self) -> bool:
        """Whether ``rotation`` must be orthogonal: no ``q_rotation`` and the transform does not say otherwise."""
        return self.q_rotation is None and (self.transform or {}).get("orthogonal", True) is not False


@dataclass
class LatentRotations:
    """A latent set: one :class:`LatentLayer` per layer id, sorted, all of one ``rank``."""

    layers: dict[int, LatentLayer]
    folder: Path | None = None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.layers))

    @property
    def rank(self) -> int:
        return next(iter(self.layers.values())).rank

    @property
    def layouts(self) -> tuple[str, ...]:
        return tuple(sorted({lay.layout for lay in self.layers.values()}))

    @property
    def companions(self) -> bool:
        """Whether some layer carries a ``mean`` or a ``q_rotation`` (the OSCAR-2 dict's companions)."""
        return any(lay.mean is not None or lay.q_rotation is not None for lay in self.layers.values())

    def to_json(self) -> dict[str, Any]:
        return {"folder": str(self.folder) if self.folder else None, "rank": self.rank,
                "layers": len(self.layers), "layer_ids": list(self.layer_ids), "layouts": list(self.layouts),
                "companions": self.companions}


@dataclass
class LatentReport:
    """Outcome of :func:`validate_latent`: ``ok`` is ``not problems``."""

    folder: str | None
    ok: bool
    rank: int | None = None
    layer_ids: list[int] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    max_orthogonality_error: float | None = None
    max_inverse_error: float | None = None
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "mla_latent", "folder": self.folder, "ok": self.ok, "rank": self.rank,
                "num_layers": len(self.layer_ids), "layer_ids": self.layer_ids, "layouts": self.layouts,
                "max_orthogonality_error": self.max_orthogonality_error,
                "max_inverse_error": self.max_inverse_error, "problems": self.problems}


def _limits(rank: int | None, what: str) -> Limits:
    d = rank or MAX_LATENT_RANK
    # rotation + q_rotation as stored and loaded (fp32), vectors, and the fp64 orthogonality check
    cap = 4 * (4 * d * d + 8 * d) + 17 * d * d + (1 << 16)
    return Limits(max_head_dim=d, max_layers=1, max_bytes=cap, max_kv_heads=1, max_bytes_kv_head=cap, what=what,
                  note=f"; the latent rank is {rank}" if rank else "")


def _what_else(obj: Mapping[str, Any], name: str) -> None:
    """Refuse, with what they are, files the authors write that are not latent rotations."""
    if "layers" in obj:
        raise RotationFileError(f"{name}: a K/V rotation file ('layers' of per-layer rotations), not one layer of an "
                                f"MLA latent set; serve it as a K/V pair")
    if _PQ_KEYS & set(obj):
        raise RotationFileError(f"{name}: a PQ codebook file (codebooks_per_layer), not a latent rotation; codebooks "
                                f"are bound to the rotation they were trained against and served by the authors' tree "
                                f"through SGLANG_OSCAR_PQ_K_CODEBOOK / _V_CODEBOOK")
    if {"c_kv", "k_pe"} & set(obj):
        raise RotationFileError(f"{name}: a latent calibration dump (c_kv / k_pe rows), not a latent rotation; fit "
                                f"rotations from it")


def _check_plan(obj: Any, name: str, rank: int | None) -> str:
    """Check the inspected structure (tensor records only); return the layout."""
    if isinstance(obj, TensorMeta):
        tensors: dict[str, TensorMeta] = {"rotation": obj}
        layout = "tensor"
    elif isinstance(obj, Mapping):
        _what_else(obj, name)
        if "rotation" not in obj:
            keys = ", ".join(safe_repr(k) for k in list(obj)[:6]) or "none"
            raise RotationFileError(f"{name}: expected a [rank, rank] tensor or a dict with a 'rotation' tensor (keys: "
                                    f"{keys}); not an MLA latent rotation file")
        unknown = [k for k in obj if k not in TENSOR_KEYS and k not in META_KEYS and holds_tensor(obj[k])]
        if unknown:  # other values are metadata, ignored as in a K/V file
            raise RotationFileError(f"{name}: holds a tensor {safe_repr(unknown[0])}, which a latent rotation file "
                                    f"does not (known: {', '.join(TENSOR_KEYS + META_KEYS)}); refusing to load it "
                                    f"without it")
        tensors = {k: obj[k] for k in TENSOR_KEYS if obj.get(k) is not None}
        for k, t in tensors.items():
            if not isinstance(t, TensorMeta):
                raise RotationFileError(f"{name}: '{k}' is {type(t).__name__}, not a tensor")
        layout = "dict"
    else:
        raise RotationFileError(f"{name}: expected a [rank, rank] tensor or an OSCAR-2 latent dict, got "
                                f"{type(obj).__name__}")
    r = tensors["rotation"]
    if len(r.shape) != 2 or r.shape[0] != r.shape[1]:
        raise RotationFileError(f"{name}: the latent rotation must be [rank, rank], got {list(r.shape)}")
    d = r.shape[0]
    if rank is not None and d != rank:
        raise RotationFileError(f"{name}: a [{d}, {d}] latent rotation, but the model's latent rank is {rank}")
    for k, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:
            raise RotationFileError(f"{name}: '{k}' has dtype {t.dtype}, not floating point")
        want = (d, d) if k in ("rotation", "q_rotation") else (d,)
        if tuple(t.shape) != want:
            raise RotationFileError(f"{name}: '{k}' must be {list(want)}, got {list(t.shape)}")
    return layout


def read_latent_file(path: str | os.PathLike[str], *, rank: int | None = None, layer_id: int | None = None) -> LatentLayer:
    """Read one ``layer_<id>.pt`` latent rotation file without running any code from it.

    Raises:
        RotationFileError: not a regular file, not a torch archive, beyond the bounds, a shape that is not
            ``[rank, rank]``, or another kind of file (named).
        UnsafeRotationFileError: its pickle references anything but tensors and plain data.
    """
    p = Path(path)
    name = str(p)
    regular_file(p, "latent rotation file")
    limits = _limits(rank, "latent rotation file")
    check_torch_version()
    if not _is_zip(p):
        refuse_legacy_pickle(p, limits)
    plan = _inspect_named(p, limits)
    layout = _check_plan(plan, name, rank)
    obj = _torch_load_safe(p)
    orthogonal = layout == "tensor" or (obj.get("q_rotation") is None
                                        and (_meta(obj, "transform", name) or {}).get("orthogonal", True) is not False)
    coarse = precision_problem(obj if layout == "tensor" else obj["rotation"]) if orthogonal else None
    if layout == "tensor":
        return LatentLayer(-1 if layer_id is None else layer_id, obj.detach().to(torch.float32), path=p, coarse=coarse)
    lid = obj.get("layer_id")
    if lid is not None and layer_id is not None and parse_index(lid) != layer_id:
        raise RotationFileError(f"{name}: layer_id {safe_repr(lid)} disagrees with its file name (layer {layer_id})")
    fields = {k: obj[k].detach().to(torch.float32) for k in TENSOR_KEYS if obj.get(k) is not None}
    transform = _meta(obj, "transform", name)
    return LatentLayer(-1 if layer_id is None else layer_id, fields.pop("rotation"), "dict", transform=transform,
                       path=p, coarse=coarse, **fields)


def layer_files(folder: str | os.PathLike[str], what: str = "latent rotation folder") -> dict[int, Path]:
    """The ``layer_<id>.pt`` files of ``folder`` by layer id (other files are ignored).

    Raises:
        RotationFileError: not a folder, a file named ``layer_*.pt`` without a plain decimal id, or more
            than :data:`MAX_LATENT_LAYERS` of them.
    """
    d = Path(folder)
    if not d.is_dir():
        raise RotationFileError(f"{d}: not a folder; an MLA latent set is a folder of layer_<id>.pt files")
    out: dict[int, Path] = {}
    for entry in sorted(os.scandir(d), key=lambda e: e.name):
        if not _LOOSE_LAYER_FILE.match(entry.name):
            continue
        m = LAYER_FILE.match(entry.name)
        if m is None:
            raise RotationFileError(f"{d}: {safe_repr(entry.name)} is not layer_<id>.pt with a plain decimal id")
        out[int(m[1])] = d / entry.name
        if len(out) > MAX_LATENT_LAYERS:
            raise RotationFileError(f"{d}: more than {MAX_LATENT_LAYERS} layer files")
    if not out:
        raise RotationFileError(f"{d}: no layer_<id>.pt files; not an MLA {what}")
    return out


def is_latent_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder holding ``layer_<id>.pt`` files (and no K/V rotation files)."""
    d = Path(path)
    try:
        return d.is_dir() and any(_LOOSE_LAYER_FILE.match(e.name) for e in os.scandir(d))
    except OSError:
        return False


def check_coverage(found: Iterable[int], where: str, *, layer_ids: Iterable[int] | None = None,
                   layer_count: int | None = None) -> None:
    """The folder's layer ids against the model's latent layers: a missing layer or a stray one is an error.

    With neither ``layer_ids`` nor ``layer_count`` known, the ids must run from 0 without a gap.

    Raises:
        InvalidRotationError: naming the first missing layers (or the stray ones).
    """
    have = sorted(set(found))
    if layer_ids is not None:
        want = sorted(set(layer_ids))
    elif layer_count is not None:
        if len(have) != layer_count:
            raise InvalidRotationError(f"{where}: holds {len(have)} layer files, the model has {layer_count} latent "
                                       f"layers (their ids are not in the registry, so the missing ones cannot be "
                                       f"named); every latent layer needs its layer_<id>.pt")
        return
    else:
        want = list(range(max(have) + 1))
    missing = [i for i in want if i not in set(have)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InvalidRotationError(f"{where}: no layer_{missing[0]}.pt for layer {missing[0]}{more}; the server would "
                                   f"replace a missing layer by the identity (collapse at 2 bits); every latent layer "
                                   f"needs its file")
    stray = [i for i in have if i not in set(want)]
    if stray:
        raise InvalidRotationError(f"{where}: layer_{stray[0]}.pt is not a latent layer of the model (its latent "
                                   f"layers are {_ids(want)}); these rotations belong to another model")


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:6])) + (f" … {ids[-1]}" if len(ids) > 6 else "")


def read_latent_folder(folder: str | os.PathLike[str], *, rank: int | None = None,
                       layer_ids: Iterable[int] | None = None, layer_count: int | None = None) -> LatentRotations:
    """Read every ``layer_<id>.pt`` of ``folder`` (coverage checked first, see :func:`check_coverage`).

    Raises:
        RotationFileError: a file cannot be read safely; layers of different ranks.
        InvalidRotationError: a layer missing or stray.
    """
    files = layer_files(folder)
    check_coverage(files, str(folder), layer_ids=layer_ids, layer_count=layer_count)
    layers: dict[int, LatentLayer] = {}
    for lid, p in sorted(files.items()):
        lay = read_latent_file(p, rank=rank, layer_id=lid)
        if rank is None:
            rank = lay.rank
        layers[lid] = lay
    return LatentRotations(layers, Path(folder))


def validate_latent(lr: LatentRotations, *, layer_ids: Iterable[int] | None = None, layer_count: int | None = None,
                    rank: int | None = None, atol: float = DEFAULT_ATOL,
                    inverse_atol: float = DEFAULT_INVERSE_ATOL) -> LatentReport:
    """Finite, ``[rank, rank]``, orthogonal (or inverted by ``q_rotation``), and the model's layers exactly.

    Every problem is listed, one line each, naming the layer.
    """
    where = str(lr.folder) if lr.folder else "latent set"
    report = LatentReport(where, True, lr.rank, list(lr.layer_ids), list(lr.layouts))
    try:
        check_coverage(lr.layer_ids, where, layer_ids=layer_ids, layer_count=layer_count)
    except InvalidRotationError as exc:
        report.problems.append(str(exc))
    ortho, inverse = 0.0, 0.0
    for lid, lay in sorted(lr.layers.items()):
        if rank is not None and lay.rank != rank:
            report.problems.append(f"{where}: layer {lid}: [{lay.rank}, {lay.rank}], the model's latent rank is {rank}")
            continue
        bad, err = measure_matrices(lay.rotation)
        for name, t in (("mean", lay.mean), ("eigenvalues", lay.eigenvalues), ("q_rotation", lay.q_rotation)):
            if t is not None and not bool(torch.isfinite(t).all()):
                report.problems.append(f"{where}: layer {lid}: {name} holds NaN or inf")
        if int(bad):
            report.problems.append(f"{where}: layer {lid}: the rotation holds {int(bad)} NaN or inf values")
            continue
        if lay.orthogonal:
            ortho = max(ortho, float(err))
            if float(err) > atol:
                why = f": {lay.coarse}" if lay.coarse else ""
                report.problems.append(f"{where}: layer {lid}: not orthogonal, max|RRᵀ−I| = {float(err):.3e} > {atol:.0e}"
                                       f"{why}")
        elif lay.q_rotation is None:
            report.problems.append(f"{where}: layer {lid}: the transform is not orthogonal and the file has no "
                                   f"q_rotation to invert it")
        else:
            e = float(inverse_errors(lay.rotation, lay.q_rotation))
            inverse = max(inverse, e)
            if e > inverse_atol:
                report.problems.append(f"{where}: layer {lid}: q_rotation does not invert the rotation, "
                                       f"max|QᵀR−I| = {e:.3e} > {inverse_atol:.0e}")
    report.max_orthogonality_error = ortho
    report.max_inverse_error = inverse if any(not lay.orthogonal for lay in lr.layers.values()) else None
    report.ok = not report.problems
    return report


def read_subspace_file(path: str | os.PathLike[str], *, rank: int, atol: float = 1e-4) -> torch.Tensor:
    """One high-precision subspace file: a bare ``[k, rank]`` float tensor of orthonormal rows (``k ≤ rank``).

    Raises:
        RotationFileError: not such a tensor (inspected before loading, as a rotation file).
        InvalidRotationError: rows that are not orthonormal.
    """
    p = Path(path)
    check_torch_version()
    if not _is_zip(p):
        refuse_legacy_pickle(p, _limits(rank, "high-precision subspace file"))
    with open_regular(p, what="subspace file", error=RotationFileError) as f:
        plan, _ = inspect_torch_zip(p, _limits(rank, "high-precision subspace file"), fileobj=f)
    if not isinstance(plan, TensorMeta) or len(plan.shape) != 2 or plan.shape[1] != rank \
            or plan.shape[0] > rank or plan.dtype not in FLOAT_DTYPES:
        raise RotationFileError(f"{p}: expected a [k, {rank}] float tensor of orthonormal rows (a high-precision "
                                f"subspace file)")
    u = _torch_load_safe(p).detach().to(torch.float64)
    err = float((u @ u.T - torch.eye(u.shape[0], dtype=torch.float64)).abs().max())
    if not err <= atol:
        raise InvalidRotationError(f"{p}: the subspace rows are not orthonormal, max|UUᵀ−I| = {err:.3e} > {atol:.0e}")
    return u.to(torch.float32)


def read_subspace_folder(folder: str | os.PathLike[str], *, rank: int,
                         layer_ids: Iterable[int] | None = None, atol: float = 1e-4) -> dict[int, torch.Tensor]:
    """Read a high-precision subspace folder (``layer_<id>.pt`` files, :func:`read_subspace_file`); the
    server skips a layer without one, so only stray layers are errors.

    Raises:
        RotationFileError, InvalidRotationError: as :func:`read_subspace_file`; a layer outside ``layer_ids``.
    """
    files = layer_files(folder, what="high-precision subspace folder")
    if layer_ids is not None:
        stray = sorted(set(files) - set(layer_ids))
        if stray:
            raise InvalidRotationError(f"{folder}: layer_{stray[0]}.pt is not a latent layer of the model")
    return {lid: read_subspace_file(p, rank=rank, atol=atol) for lid, p in sorted(files.items())}


__all__ = ["LAYER_FILE", "MAX_LATENT_LAYERS", "MAX_LATENT_RANK", "LatentLayer", "LatentReport", "LatentRotations",
           "check_coverage", "is_latent_folder", "layer_files", "read_latent_file", "read_latent_folder",
           "read_subspace_file", "read_subspace_folder", "validate_latent"]
