"""Rotation files: the authors' ``.pt`` format and safetensors, read safely and written atomically.

The ``.pt`` schema (format_version 1), as written by the OSCAR fitter and read by its SGLang fork::

    {"format_version": 1,
     "objective": "qqt_r_h_pbr",            # "<target>_<composition>", or "hadamard", ...
     "source_grouping": "layer",
     "layers": {0: {"layer_id": 0,
                    "rotation": fp32 Tensor[d, d],      # orthogonal; applied as x_rot = x @ R
                    "eigenvalues": fp32 Tensor[d]},     # optional, ascending, not permuted
                ...}}

Layer keys may be ``int`` or ``str``. The ``identity-v1`` variant (``format_version`` is that
string, no eigenvalues) is accepted too. Loading never unpickles code: ``.pt`` files are read
with ``torch.load(weights_only=True)`` only.

The safetensors layout holds tensors ``rotation.<layer_id>`` ``[d, d]`` and optionally
``eigenvalues.<layer_id>`` ``[d]``, with string metadata ``format_version``, ``objective``,
``source_grouping`` and ``layer_ids`` (comma-separated).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from .errors import RotationFileError, UnsafeRotationFileError, UnsupportedFormatError

#: The newest integer ``format_version`` this release reads and writes.
FORMAT_VERSION = 1
#: String format versions also understood (the authors' VL branch identity files).
STRING_FORMAT_VERSIONS = ("identity-v1",)

_SAFETENSORS_MAGIC_MAX_HEADER = 100 * 1024 * 1024


@dataclass(eq=False)
class RotationSet:
    """One side (K or V) of a model's rotations: one orthogonal ``[d, d]`` matrix per layer.

    Attributes:
        rotations: ``[L, d, d]`` float tensor; ``rotations[i]`` belongs to ``layer_ids[i]`` and is
            applied as ``x_rot = x @ R`` (``x[..., d]``).
        layer_ids: model layer index of each matrix, ascending (sparse for hybrid models).
        objective: ``"<target>_<composition>"`` such as ``"qqt_r_h_pbr"``, or ``"hadamard"``.
        eigenvalues: ``[L, d]`` raw ascending eigenvalues of the fitted covariance, or ``None``.
        format_version: ``1`` or ``"identity-v1"``.
        source_grouping: ``"layer"`` for the published files.
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
        self.layer_ids = tuple(int(i) for i in self.layer_ids)
        if self.rotations.dim() != 3:
            raise RotationFileError(f"{self._name()}: rotations must be [L, d, d], got {tuple(self.rotations.shape)}")
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

    def __len__(self) -> int:
        return len(self.layer_ids)

    def index_of(self, layer_id: int) -> int:
        """Position of ``layer_id`` in :attr:`rotations` (``KeyError`` if absent)."""
        try:
            return self.layer_ids.index(int(layer_id))
        except ValueError:
            raise KeyError(f"{self._name()} has no layer {layer_id}; layers: {_fmt_ids(self.layer_ids)}") from None

    def __getitem__(self, layer_id: int) -> torch.Tensor:
        """The ``[d, d]`` rotation of model layer ``layer_id``."""
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
    def from_dict(cls, obj: Any, *, path: Path | None = None) -> "RotationSet":
        """Parse the authors' dict (see module docstring); raises typed errors on anything else."""
        name = str(path) if path else "rotation data"
        if not isinstance(obj, Mapping):
            raise RotationFileError(
                f"{name}: expected a dict with 'format_version' and 'layers', got {type(obj).__name__}"
            )
        version = obj.get("format_version", FORMAT_VERSION)
        _check_format_version(version, name)
        if "layers" not in obj:
            keys = ", ".join(map(str, list(obj)[:8])) or "none"
            raise RotationFileError(f"{name}: no 'layers' entry (keys: {keys}); not a rotation file")
        layers = obj["layers"]
        if not isinstance(layers, Mapping) or not layers:
            raise RotationFileError(f"{name}: 'layers' must be a non-empty dict of layer id -> entry")
        parsed: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        for key, entry in layers.items():
            try:
                lid = int(key)
            except (TypeError, ValueError):
                raise RotationFileError(f"{name}: layer key {key!r} is not an integer") from None
            if isinstance(entry, torch.Tensor):  # flat {layer: matrix} variant
                rot, eig = entry, None
            elif isinstance(entry, Mapping) and "rotation" in entry:
                rot, eig = entry["rotation"], entry.get("eigenvalues")
            else:
                raise RotationFileError(f"{name}: layer {lid}: expected a dict with a 'rotation' tensor")
            if not isinstance(rot, torch.Tensor):
                raise RotationFileError(f"{name}: layer {lid}: 'rotation' is {type(rot).__name__}, not a tensor")
            if rot.dim() != 2 or rot.shape[0] != rot.shape[1]:
                raise RotationFileError(
                    f"{name}: layer {lid}: rotation must be a square [d, d] matrix, got {tuple(rot.shape)}"
                )
            if not rot.is_floating_point():
                raise RotationFileError(f"{name}: layer {lid}: rotation dtype {rot.dtype} is not floating point")
            if eig is not None and not isinstance(eig, torch.Tensor):
                raise RotationFileError(f"{name}: layer {lid}: 'eigenvalues' is not a tensor")
            parsed.append((lid, rot, eig))
        parsed.sort(key=lambda t: t[0])
        dims = {p[1].shape[0] for p in parsed}
        if len(dims) != 1:
            detail = ", ".join(f"layer {lid}: {rot.shape[0]}" for lid, rot, _ in parsed[:6])
            raise RotationFileError(f"{name}: layers have different head_dims ({detail})")
        d = dims.pop()
        for lid, _, eig in parsed:
            if eig is not None and tuple(eig.shape) != (d,):
                raise RotationFileError(
                    f"{name}: layer {lid}: eigenvalues must have shape [{d}], got {tuple(eig.shape)}"
                )
        # stack copies: layers that shared one storage in the file become independent tensors
        rotations = torch.stack([p[1].to(torch.float32) for p in parsed]).contiguous()
        eigs = [p[2] for p in parsed]
        eigenvalues = (
            torch.stack([e.to(torch.float32) for e in eigs]).contiguous() if all(e is not None for e in eigs) else None
        )
        return cls(
            rotations=rotations,
            layer_ids=tuple(p[0] for p in parsed),
            objective=str(obj.get("objective", "unknown")),
            eigenvalues=eigenvalues,
            format_version=version,
            source_grouping=str(obj.get("source_grouping", "layer")),
            path=path,
        )


def _dedupe(t: torch.Tensor, seen: list[torch.Tensor]) -> torch.Tensor:
    for s in seen:
        if s.shape == t.shape and torch.equal(s, t):
            return s
    seen.append(t)
    return t


def _fmt_ids(ids: tuple[int, ...]) -> str:
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")


def _check_format_version(version: Any, name: str) -> None:
    if isinstance(version, bool):
        raise UnsupportedFormatError(f"{name}: format_version {version!r} is not a version")
    if isinstance(version, int):
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{name}: written by a newer format version ({version}); this rotationzoo reads up to "
                f"{FORMAT_VERSION}; upgrade rotationzoo (pip install -U rotationzoo)"
            )
        if version < 1:
            raise UnsupportedFormatError(f"{name}: format_version {version} is not valid (expected 1)")
        return
    if isinstance(version, str) and version in STRING_FORMAT_VERSIONS:
        return
    raise UnsupportedFormatError(
        f"{name}: unknown format_version {version!r}; expected 1 or one of {', '.join(STRING_FORMAT_VERSIONS)}"
    )


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


def read_rotation(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> RotationSet:
    """Read a rotation file (``.pt`` or ``.safetensors``) without running any code from it.

    Args:
        path: the file.
        map_location: device for the returned tensors.

    Returns:
        A :class:`RotationSet` with fp32 ``rotations [L, d, d]`` (not yet validated; see
        :func:`rotationzoo.validate`).

    Raises:
        RotationFileError: missing, truncated or not a rotation file (message names the file).
        UnsafeRotationFileError: the pickle references anything but tensors and plain data.
        UnsupportedFormatError: a newer or unknown ``format_version``.
    """
    p = Path(path)
    if not p.is_file():
        raise RotationFileError(f"{p}: no such file")
    if p.stat().st_size == 0:
        raise RotationFileError(f"{p}: file is empty")
    kind = detect_kind(p)
    if kind == "safetensors":
        rs = _read_safetensors(p)
    else:
        rs = RotationSet.from_dict(_torch_load_safe(p), path=p)
    if str(map_location) != "cpu":
        rs = rs.to(device=map_location)
    return rs


def _torch_load_safe(p: Path) -> Any:
    if zipfile.is_zipfile(p):
        try:
            with zipfile.ZipFile(p) as zf:
                bad = zf.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise RotationFileError(f"{p}: damaged zip archive ({exc}); re-download the file") from None
        if bad is not None:
            raise RotationFileError(f"{p}: damaged zip member {bad!r} (CRC mismatch); re-download the file")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnsafeRotationFileError(
            f"{p}: refused to load: the file's pickle asks for objects other than tensors and plain "
            f"data ({first}). rotationzoo only loads with weights_only=True; do not trust this file."
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RotationFileError(f"{p}: cannot read ({msg}); the file is truncated or damaged; re-download it") from None


def _read_safetensors(p: Path) -> RotationSet:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise RotationFileError(f"{p}: cannot read safetensors ({exc}); the file is truncated or damaged") from None
    layers: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        kind, _, lid = key.partition(".")
        if kind not in ("rotation", "eigenvalues") or not lid.lstrip("-").isdigit():
            raise RotationFileError(f"{p}: unexpected tensor {key!r} (expected rotation.<layer>, eigenvalues.<layer>)")
        layers.setdefault(int(lid), {"layer_id": int(lid)})[kind] = t
    version: Any = meta.get("format_version", str(FORMAT_VERSION))
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    obj = {
        "format_version": version,
        "objective": meta.get("objective", "unknown"),
        "source_grouping": meta.get("source_grouping", "layer"),
        "layers": layers,
    }
    for lid, entry in layers.items():
        if "rotation" not in entry:
            raise RotationFileError(f"{p}: layer {lid} has eigenvalues but no rotation")
    return RotationSet.from_dict(obj, path=p)


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

