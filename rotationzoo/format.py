"""Rotation files: the authors' ``.pt`` format and safetensors, read safely and written atomically.

The ``.pt`` schema (format_version 1), as written by the OSCAR fitter and read by its SGLang fork::

    {"format_version": 1,
     "objective": "qqt_r_h_pbr",            # "<target>_<composition>", or "hadamard", ...
     "source_grouping": "layer",
     "layers": {0: {"layer_id": 0,
                    "rotation": fp32 Tensor[d, d],      # orthogonal; applied as x_rot = x @ R
                    "eigenvalues": fp32 Tensor[d]},     # optional, ascending, not permuted
                ...}}

Layer keys are non-negative ``int`` or their plain ASCII decimal ``str`` and equal the entry's
``layer_id`` when it has one. The ``identity-v1`` variant (``format_version`` is that string, no
eigenvalues) is accepted too. Loading never unpickles code: a ``.pt`` archive's directory, declared
sizes and pickle are inspected first (:mod:`rotationzoo._inspect`) and the file is refused unless
it holds only dense tensors within the limits below, in stored (uncompressed) members as
``torch.save`` writes them; only then is it read with ``torch.load(weights_only=True)`` (torch >=
2.6). Safetensors headers are checked the same way.

The safetensors layout holds tensors ``rotation.<layer_id>`` ``[d, d]`` and optionally
``eigenvalues.<layer_id>`` ``[d]``, with string metadata ``format_version``, ``objective``,
``source_grouping`` and ``layer_ids`` (comma-separated).

Per-KV-head rotations (a rotationzoo extension, ``docs/format.md``): ``"source_grouping":
"kv_head"`` and a ``[H_kv, d, d]`` rotation (``[H_kv, d]`` eigenvalues) per layer; head ``h`` of
the layer is rotated as ``x[..., h, :] @ R[h]``. Engines that read only per-layer files refuse them.
"""

from __future__ import annotations

import operator
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from . import _schema
from ._inspect import (
    Limits,
    exc_line,
    inspect_torch_zip,
    parse_index,
    refuse_legacy_pickle,
    safe_repr,
)
from ._schema import (  # noqa: F401  (public names of this module)
    FORMAT_VERSION,
    KV_HEAD,
    MAX_KV_HEADS,
    MAX_BYTES,
    MAX_HEAD_DIM,
    MAX_LAYERS,
    MIN_TORCH,
    STRING_FORMAT_VERSIONS,
    inspect_safetensors,
    make_limits,
)
from .errors import RotationFileError, TorchVersionError, UnsafeRotationFileError

_SAFETENSORS_MAGIC_MAX_HEADER = 100 * 1024 * 1024


@dataclass(eq=False)
class RotationSet:
    """One side (K or V) of a model's rotations: one orthogonal ``[d, d]`` matrix per layer.

    Attributes:
        rotations: ``[L, d, d]`` float tensor; ``rotations[i]`` belongs to ``layer_ids[i]`` and is
            applied as ``x_rot = x @ R`` (``x[..., d]``). Per-KV-head sets
            (``source_grouping="kv_head"``) are ``[L, H_kv, d, d]``: head ``h`` of layer ``i`` is
            rotated by ``rotations[i, h]``.
        layer_ids: model layer index of each matrix, ascending (sparse for hybrid models).
        objective: ``"<target>_<composition>"`` such as ``"qqt_r_h_pbr"``, or ``"hadamard"``.
        eigenvalues: ``[L, d]`` (per KV head ``[L, H_kv, d]``) raw ascending eigenvalues of the
            fitted covariance, or ``None``.
        format_version: ``1`` or ``"identity-v1"``.
        source_grouping: ``"layer"`` for the published files; ``"kv_head"`` for per-KV-head sets.
        path: the file it was read from, if any.
    """

    rotations: torch.Tensor
    layer_ids: tuple[int, ...]
    objective: str = "unknown"
    eigenvalues: torch.Tensor | None = None
    format_version: int | str = FORMAT_VERSION
    source_grouping: str = "layer"
    path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.rotations, torch.Tensor):
            raise RotationFileError(f"{self._name()}: rotations must be a tensor, got {type(self.rotations).__name__}")
        try:
            ids = tuple(self.layer_ids)
            if any(isinstance(i, bool) for i in ids):
                raise TypeError("bool")
            self.layer_ids = tuple(operator.index(i) for i in ids)
        except TypeError:
            raise RotationFileError(f"{self._name()}: layer ids must be integers, got {safe_repr(self.layer_ids)}") from None
        per_head = self.source_grouping == KV_HEAD
        if self.rotations.dim() != (4 if per_head else 3):
            want = "[L, H_kv, d, d] (source_grouping 'kv_head')" if per_head else "[L, d, d]"
            hint = "; per-KV-head rotations need source_grouping='kv_head'" if self.rotations.dim() == 4 else ""
            raise RotationFileError(f"{self._name()}: rotations must be {want}, got {tuple(self.rotations.shape)}"
                                    f"{hint}")
        if self.rotations.shape[0] != len(self.layer_ids):
            raise RotationFileError(
                f"{self._name()}: {self.rotations.shape[0]} matrices but {len(self.layer_ids)} layer ids"
            )
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise RotationFileError(f"{self._name()}: duplicate layer ids {self.layer_ids}")

    def _name(self) -> str:
        return str(self.path) if self.path else "rotation set"

    # -- shape helpers ---------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """``d``, the size of each rotation."""
        return int(self.rotations.shape[-1])

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def per_head(self) -> bool:
        """Whether this set holds one rotation per (layer, KV head) (``source_grouping="kv_head"``)."""
        return self.source_grouping == KV_HEAD

    @property
    def num_kv_heads(self) -> int | None:
        """``H_kv`` of a per-KV-head set; ``None`` for one rotation per layer."""
        return int(self.rotations.shape[1]) if self.per_head else None

    def __len__(self) -> int:
        return len(self.layer_ids)

    def index_of(self, layer_id: int) -> int:
        """Position of ``layer_id`` in :attr:`rotations` (``KeyError`` if absent)."""
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise KeyError(f"{self._name()} has no layer {layer_id}; layers: {_fmt_ids(self.layer_ids)}") from None

    def __getitem__(self, layer_id: int) -> torch.Tensor:
        """The ``[d, d]`` rotation of model layer ``layer_id`` (``[H_kv, d, d]`` per KV head)."""
        return self.rotations[self.index_of(layer_id)]

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "RotationSet":
        """A copy with rotations (and eigenvalues) moved/cast; eigenvalues keep fp32."""
        rot = self.rotations.to(device=device, dtype=dtype)
        eig = self.eigenvalues.to(device=device) if self.eigenvalues is not None else None
        return replace(self, rotations=rot, eigenvalues=eig)

    # -- conversions -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The authors' ``.pt`` dict (int layer keys, fp32 contiguous tensors).

        Each layer gets its own storage (no views of the stacked tensor); identical matrices
        (e.g. a data-free Hadamard set) share one tensor, as the authors' writer does, which keeps
        such files small.
        """
        layers: dict[int, dict[str, Any]] = {}
        seen: list[torch.Tensor] = []
        seen_eig: list[torch.Tensor] = []
        for i, lid in enumerate(self.layer_ids):
            rot = _dedupe(self.rotations[i].detach().to("cpu", torch.float32).contiguous().clone(), seen)
            entry: dict[str, Any] = {"layer_id": lid, "rotation": rot}
            if self.eigenvalues is not None:
                entry["eigenvalues"] = _dedupe(
                    self.eigenvalues[i].detach().to("cpu", torch.float32).contiguous().clone(), seen_eig
                )
            layers[lid] = entry
        return {
            "format_version": self.format_version,
            "objective": self.objective,
            "source_grouping": self.source_grouping,
            "layers": layers,
        }

    @classmethod
    def from_dict(cls, obj: Any, *, path: Path | None = None, max_head_dim: int = MAX_HEAD_DIM,
                  max_layers: int = MAX_LAYERS, max_bytes: int = MAX_BYTES,
                  limits: Limits | None = None) -> "RotationSet":
        """Parse the authors' dict (see module docstring); raises typed errors on anything else.

        Args:
            obj: the dict, as ``torch.load`` returns it.
            path: the file it came from (named in messages).
            max_head_dim: largest accepted ``d``.
            max_layers: most accepted layers.
            max_bytes: most bytes reading and validating may take: the tensors as given, as
                stacked in fp32, and validation's working set.
            limits: the :class:`~rotationzoo._inspect.Limits` to apply instead of the three above.
        """
        name = str(path) if path else "rotation data"
        limits = limits or make_limits(max_head_dim, max_layers, max_bytes)
        version, parsed, objective, grouping = _schema.parse(obj, name, limits)
        # copied layer by layer into one fp32 tensor (no per-layer intermediates: the loaded size
        # is what max_bytes counts); layers that shared one storage become independent matrices
        eigs = [p[2] for p in parsed]
        try:
            rotations = _stack_fp32([p[1] for p in parsed])
            eigenvalues = _stack_fp32(eigs) if all(e is not None for e in eigs) else None
        except RuntimeError as exc:  # e.g. tensors on different devices in a dict built in memory
            raise RotationFileError(f"{name}: cannot stack the layers ({exc_line(exc)})") from None
        return cls(rotations=rotations, layer_ids=tuple(p[0] for p in parsed), objective=objective,
                   eigenvalues=eigenvalues, format_version=version, source_grouping=grouping, path=path)


def _stack_fp32(tensors: list[Any]) -> torch.Tensor:
    """``torch.stack(tensors)`` as fp32, on the first tensor's device, without per-tensor copies."""
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=torch.float32, device=tensors[0].device)
    for i, t in enumerate(tensors):
        out[i].copy_(t.detach())
    return out


def _dedupe(t: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
    for s in seen:
        if s.shape == t.shape and torch.equal(s, t):
            return s
    seen.append(t)
    return t


def _fmt_ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")


# -- reading -------------------------------------------------------------------------------------


def detect_kind(path: Path) -> str:
    """``"pt"`` (a torch zip archive or legacy pickle) or ``"safetensors"``, from the bytes."""
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:4] == b"PK\x03\x04":
        return "pt"
    if len(head) >= 9 and head[8:9] == b"{":
        n = int.from_bytes(head[:8], "little")
        if 0 < n < _SAFETENSORS_MAGIC_MAX_HEADER:
            return "safetensors"
    if head[:1] == b"\x80":  # legacy torch.save pickle
        return "pt"
    raise RotationFileError(
        f"{path}: not a rotation file (expected a torch .pt zip archive or a safetensors file; "
        f"first bytes {head[:8]!r})"
    )


def read_rotation(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device = "cpu",
    max_head_dim: int = MAX_HEAD_DIM,
    max_layers: int = MAX_LAYERS,
    max_bytes: int = MAX_BYTES,
    head_dim: int | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
) -> RotationSet:
    """Read a rotation file (``.pt`` or ``.safetensors``) without running any code from it.

    Before anything is materialised the file is inspected (archive directory, declared sizes, the
    pickle's tensor records or the safetensors header) and refused if it exceeds the limits, holds
    compressed members, stride-0 or overlapping views, storages larger than its tensors, or
    references any global but torch's dense-tensor rebuild. Only then is it loaded with
    ``torch.load(weights_only=True)``.

    Args:
        path: the file.
        map_location: device for the returned tensors.
        max_head_dim: largest ``d`` accepted (default :data:`MAX_HEAD_DIM`).
        max_layers: most layers accepted (default :data:`MAX_LAYERS`).
        max_bytes: most bytes reading and validating the file may take: its tensors as stored,
            as loaded in fp32, and :func:`~rotationzoo.validate`'s working set (default
            :data:`MAX_BYTES`).
        head_dim: the model's head dimension when known: a file with another ``d`` is refused
            before loading, and the limits tighten to it.
        num_layers: how many layers the model has when known: a file with more is refused.
        num_kv_heads: the model's KV heads when known: a per-KV-head file with another count is
            refused before loading.

    Returns:
        A :class:`RotationSet` with fp32 ``rotations [L, d, d]`` (not yet validated; see
        :func:`rotationzoo.validate`).

    Raises:
        RotationFileError: missing, truncated, not a rotation file, or beyond the limits (message
            names the file and the limit).
        UnsafeRotationFileError: the pickle references anything but tensors and plain data (message
            names the global).
        UnsupportedFormatError: a newer or unknown ``format_version``.
        TorchVersionError: a ``.pt`` file and torch older than 2.6.
    """
    p = Path(path)
    if not p.is_file():
        raise RotationFileError(f"{p}: no such file")
    if p.stat().st_size == 0:
        raise RotationFileError(f"{p}: file is empty")
    limits = make_limits(max_head_dim, max_layers, max_bytes, head_dim=head_dim, num_layers=num_layers,
                         num_kv_heads=num_kv_heads)
    expect = (head_dim, num_layers, num_kv_heads)
    kind = detect_kind(p)
    if kind == "safetensors":
        rs = _read_safetensors(p, limits, expect)
    else:
        check_torch_version()
        if not _is_zip(p):
            refuse_legacy_pickle(p, limits)
        plan, _ = inspect_torch_zip(p, limits)
        _check_expected(_schema.parse(plan, str(p), limits), str(p), expect)
        rs = RotationSet.from_dict(_torch_load_safe(p), path=p, limits=limits)
    if str(map_location) != "cpu":
        rs = rs.to(device=map_location)
    return rs


def check_torch_version(version: str | None = None) -> None:
    """Raise :class:`TorchVersionError` if torch (or ``version``) is older than :data:`MIN_TORCH`."""
    v = version or torch.__version__
    m = re.match(r"(\d+)\.(\d+)", str(v))
    if m is None or (int(m[1]), int(m[2])) < MIN_TORCH:
        need = ".".join(map(str, MIN_TORCH))
        raise TorchVersionError(
            f"torch {v} is older than {need}: its torch.load(weights_only=True) can run code from a file "
            f"(CVE-2025-32434), so rotationzoo will not load .pt files with it; pip install -U 'torch>={need}'"
        )


def _is_zip(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _check_expected(parsed: tuple, name: str, expect: tuple[int | None, int | None, int | None]) -> None:
    """The model's ``(head_dim, num_layers, num_kv_heads)``, where known, against the parsed file."""
    head_dim, num_layers, num_kv_heads = expect
    rows, grouping = parsed[1], parsed[3]
    shape = tuple(rows[0][1].shape)
    d = int(shape[-1])
    if head_dim is not None and d != head_dim:
        raise RotationFileError(f"{name}: head_dim {d}, but the model needs {head_dim}")
    if num_layers is not None and len(rows) > num_layers:
        raise RotationFileError(f"{name}: has {len(rows)} layers, the model needs {num_layers}")
    if grouping == KV_HEAD and num_kv_heads is not None and shape[0] != num_kv_heads:
        raise RotationFileError(f"{name}: per-KV-head rotations for {shape[0]} KV heads, but the model has "
                                f"{num_kv_heads}")


def _torch_load_safe(p: Path) -> Any:
    """``torch.load(weights_only=True)`` of an inspected archive; typed errors only."""
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"references '{found[1]}'" if found else "asks for objects other than tensors and plain data"
        raise UnsafeRotationFileError(f"{p}: refused to load: its pickle {what}; do not trust this file") from None
    except Exception as exc:  # torch raises many types on damaged archives
        raise RotationFileError(
            f"{p}: cannot read ({type(exc).__name__}: {exc_line(exc)}); the file is truncated or damaged; re-download it"
        ) from None


def _read_safetensors(p: Path, limits: Limits, expect: tuple[int | None, int | None, int | None]) -> RotationSet:
    from safetensors import safe_open

    meta, metas = inspect_safetensors(p, limits)
    plan = _safetensors_dict(p, meta, metas)
    _check_expected(_schema.parse(plan, str(p), limits), str(p), expect)
    try:
        with safe_open(str(p), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in metas}
    except Exception as exc:  # SafetensorError, OSError, ... on damaged data
        raise RotationFileError(
            f"{p}: cannot read safetensors ({type(exc).__name__}: {exc_line(exc)}); the file is truncated or damaged"
        ) from None
    return RotationSet.from_dict(_safetensors_dict(p, meta, tensors), path=p, limits=limits)


def _safetensors_dict(p: Path, meta: Mapping[str, str], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The authors' dict from safetensors names ``rotation.<layer>`` / ``eigenvalues.<layer>``."""
    layers: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        kind, _, lid_text = key.partition(".")
        lid = parse_index(lid_text)
        if kind not in ("rotation", "eigenvalues") or lid is None:
            raise RotationFileError(
                f"{p}: unexpected tensor {safe_repr(key)} (expected rotation.<layer>, eigenvalues.<layer>)"
            )
        layers.setdefault(lid, {"layer_id": lid})[kind] = t
    for lid, entry in layers.items():
        if "rotation" not in entry:
            raise RotationFileError(f"{p}: layer {lid} has eigenvalues but no rotation")
    version: Any = meta.get("format_version", str(FORMAT_VERSION))
    if parse_index(version) is not None:
        version = int(version)
    return {
        "format_version": version,
        "objective": meta.get("objective", "unknown"),
        "source_grouping": meta.get("source_grouping", "layer"),
        "layers": layers,
    }


# -- writing -------------------------------------------------------------------------------------


def write_rotation(path: str | os.PathLike[str], rotation_set: RotationSet, *, fmt: str | None = None) -> Path:
    """Write ``rotation_set`` atomically (temp file in the same folder, then rename).

    Args:
        path: destination; the format follows the suffix (``.safetensors`` or anything else = ``.pt``)
            unless ``fmt`` is given.
        rotation_set: what to write; rotations and eigenvalues are stored as fp32 contiguous tensors
            with int layer keys, exactly as the authors' fitter writes them.
        fmt: ``"pt"`` or ``"safetensors"``.

    Returns:
        The path written.
    """
    p = Path(path)
    kind = fmt or ("safetensors" if p.suffix == ".safetensors" else "pt")
    if kind not in ("pt", "safetensors"):
        raise RotationFileError(f"unknown rotation file format {kind!r}; expected 'pt' or 'safetensors'")
    p.parent.mkdir(parents=True, exist_ok=True)
    # write into a private temp folder beside the target, under the final file name (torch.save
    # names the archive's inner folder after the file stem, as in the authors' files), then rename
    tmpdir = Path(tempfile.mkdtemp(prefix=f".{p.name}.", dir=p.parent))
    tmp = tmpdir / p.name
    try:
        if kind == "pt":
            torch.save(rotation_set.to_dict(), tmp)
        else:
            from safetensors.torch import save_file

            d = rotation_set.to_dict()
            tensors = {}
            for lid, entry in d["layers"].items():
                tensors[f"rotation.{lid}"] = entry["rotation"].clone()
                if "eigenvalues" in entry:
                    tensors[f"eigenvalues.{lid}"] = entry["eigenvalues"].clone()
            meta = {
                "format_version": str(d["format_version"]),
                "objective": str(d["objective"]),
                "source_grouping": str(d["source_grouping"]),
                "layer_ids": ",".join(map(str, rotation_set.layer_ids)),
            }
            save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, p)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return p

