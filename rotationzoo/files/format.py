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
sizes and pickle are inspected first (:mod:`rotationzoo.files.limits`) and the file is refused unless
it holds only dense tensors within the limits below, in stored (uncompressed) members as
``torch.save`` writes them; only then is it read with ``torch.load(weights_only=True)`` (torch >=
2.6). Safetensors headers are checked the same way.

The safetensors layout holds tensors ``rotation.<layer_id>`` ``[d, d]`` and optionally
``eigenvalues.<layer_id>`` ``[d]``, with string metadata ``format_version``, ``objective``,
``source_grouping`` and ``layer_ids`` (comma-separated).

The authors' later layouts are read too (``docs/format.md``): V2 (``format_version 2``, one
``[H_kv, d, d]`` rotation per layer and KV head), V3 (``format_version 3``, the OSCAR-2 family with
``k_mean`` / ``q_rotation`` / ``o_rotation`` companions and ``calibration`` / ``transform`` metadata),
V1 with a ``calibration`` dict, and ragged V1 (per-layer head_dims). The kind of a set is decided by
its rotations' shapes; :class:`~rotationzoo.files.rotation_set.RotationSet` holds all of them, and
:func:`write_rotation` writes each in the authors' layout for what it holds.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

from . import schema as _schema
from .limits import Limits, exc_line, parse_index, safe_repr
from .archive import inspect_torch_zip, refuse_legacy_pickle
from .schema import (  # noqa: F401  (public names of this module)
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    KV_HEAD,
    LAYER,
    LAYER_FIELDS,
    MAX_KV_HEADS,
    MAX_BYTES,
    MAX_HEAD_DIM,
    MAX_LAYERS,
    MIN_TORCH,
    STRING_FORMAT_VERSIONS,
    Parsed,
    inspect_safetensors,
    make_limits,
)
from ..errors import RotationFileError, TorchVersionError, UnsafeRotationFileError
from ..headdims import HeadDims
from .rotation_set import RotationFormatWarning, RotationSet, set_from_dict  # noqa: F401  (public names of this module)
from ..safefile import check_regular, give_default_mode, open_regular, replace_with

_SAFETENSORS_MAGIC_MAX_HEADER = 100 * 1024 * 1024


# -- reading -------------------------------------------------------------------------------------


def detect_kind(path: Path) -> str:
    """``"pt"`` (a torch zip archive or legacy pickle) or ``"safetensors"``, from the bytes."""
    with open_regular(path, what="rotation file", error=RotationFileError) as f:
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


def regular_file(p: Path, what: str) -> os.stat_result:
    """``p``'s status if it is a non-empty regular file; a :class:`RotationFileError` otherwise (a FIFO, a
    device or a ``/proc`` file is refused by its type, never opened)."""
    try:
        st = check_regular(p, what=what, error=RotationFileError)
    except FileNotFoundError:
        raise RotationFileError(f"{p}: no such file") from None
    except OSError as exc:
        raise RotationFileError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    if st.st_size == 0:
        raise RotationFileError(f"{p}: file is empty")
    return st


def read_rotation(
    path: str | os.PathLike[str],
    *,
    map_location: str | torch.device = "cpu",
    max_head_dim: int = MAX_HEAD_DIM,
    max_layers: int = MAX_LAYERS,
    max_bytes: int = MAX_BYTES,
    head_dim: int | HeadDims | None = None,
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
        head_dim: the model's head dimension when known (an int, or :class:`~rotationzoo.headdims.HeadDims`
            for per-layer head_dims): a file with another ``d`` is refused before loading, and the
            limits tighten to it.
        num_layers: how many layers the model has when known: a file with more is refused.
        num_kv_heads: the model's KV heads when known: a per-KV-head file with another count is
            refused before loading.

    Returns:
        A :class:`RotationSet` with fp32 ``rotations [L, d, d]`` (``[L, H_kv, d, d]`` per KV head, a
        tuple for ragged files) and any companions (not yet validated; see :func:`rotationzoo.validate`).

    Raises:
        RotationFileError: missing, truncated, not a rotation file, or beyond the limits (message
            names the file and the limit).
        UnsafeRotationFileError: the pickle references anything but tensors and plain data (message
            names the global).
        UnsupportedFormatError: a newer or unknown ``format_version``.
        TorchVersionError: a ``.pt`` file and torch older than 2.6.
    """
    p = Path(path)
    regular_file(p, "rotation file")
    limits = make_limits(max_head_dim, max_layers, max_bytes, head_dim=head_dim, num_layers=num_layers,
                         num_kv_heads=num_kv_heads)
    expect = (HeadDims.of(head_dim), num_layers, num_kv_heads)
    kind = detect_kind(p)
    if kind == "safetensors":
        rs = _read_safetensors(p, limits, expect)
    else:
        check_torch_version()
        if not _is_zip(p):
            refuse_legacy_pickle(p, limits)
        plan = _inspect_named(p, limits)
        _check_expected(_schema.parse(plan, str(p), limits), str(p), expect)
        rs = set_from_dict(_torch_load_safe(p), path=p, limits=limits)
    if str(map_location) != "cpu":
        rs = rs.to(device=map_location)
    return rs


def _inspect_named(p: Path, limits: Limits) -> Any:
    """The inspected pickle of ``p``; a refusal of a file that is a known other artefact (a PQ codebook, a
    calibration dump) says what it is instead (:func:`rotationzoo.files.artefacts.identify_torch_file`)."""
    from .artefacts import identify_torch_file

    try:
        with open_regular(p, what="rotation file", error=RotationFileError) as f:
            return inspect_torch_zip(p, limits, fileobj=f)[0]
    except UnsafeRotationFileError:
        raise
    except RotationFileError:
        kind = identify_torch_file(p)
        if kind is None:
            raise
        raise RotationFileError(f"{p}: {kind}") from None


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
    with open_regular(p, what="rotation file", error=RotationFileError) as f:
        return f.read(4) == b"PK\x03\x04"


def _check_expected(parsed: Parsed, name: str, expect: tuple[HeadDims | None, int | None, int | None]) -> None:
    """The model's ``(head_dims, num_layers, num_kv_heads)``, where known, against the parsed file."""
    head_dims, num_layers, num_kv_heads = expect
    rows = parsed.layers
    if num_layers is not None and len(rows) > num_layers:
        raise RotationFileError(f"{name}: has {len(rows)} layers, the model needs {num_layers}")
    for lid, fields in rows:
        shape = tuple(fields["rotation"].shape)
        if head_dims is not None and shape[-1] != head_dims(lid):
            where = "" if head_dims.uniform else f"layer {lid}: "
            raise RotationFileError(f"{name}: {where}head_dim {shape[-1]}, but the model needs {head_dims(lid)}")
        if parsed.kind == KV_HEAD and num_kv_heads is not None and shape[0] != num_kv_heads:
            raise RotationFileError(f"{name}: per-KV-head rotations for {shape[0]} KV heads, but the model has "
                                    f"{num_kv_heads}")


def _torch_load_safe(p: Path) -> Any:
    """``torch.load(weights_only=True)`` of an inspected archive; typed errors only."""
    try:
        with open_regular(p, what="rotation file", error=RotationFileError) as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except RotationFileError:
        raise
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"references '{found[1]}'" if found else "asks for objects other than tensors and plain data"
        raise UnsafeRotationFileError(f"{p}: refused to load: its pickle {what}; do not trust this file") from None
    except Exception as exc:  # torch raises many types on damaged archives
        raise RotationFileError(
            f"{p}: cannot read ({type(exc).__name__}: {exc_line(exc)}); the file is truncated or damaged; re-download it"
        ) from None


#: Top-level metadata of a safetensors rotation file stored as JSON strings.
_JSON_META = ("calibration", "transform")


def _read_safetensors(p: Path, limits: Limits, expect: tuple[HeadDims | None, int | None, int | None]) -> RotationSet:
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
    return set_from_dict(_safetensors_dict(p, meta, tensors), path=p, limits=limits)


def _safetensors_dict(p: Path, meta: Mapping[str, str], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The authors' dict from safetensors names ``<field>.<layer>`` (``rotation.3``, ``k_mean.3``, …)."""
    layers: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        kind, _, lid_text = key.partition(".")
        lid = parse_index(lid_text)
        if kind not in LAYER_FIELDS or lid is None:
            raise RotationFileError(
                f"{p}: unexpected tensor {safe_repr(key)} (expected <field>.<layer> with field one of "
                f"{', '.join(LAYER_FIELDS)})"
            )
        layers.setdefault(lid, {"layer_id": lid})[kind] = t
    for lid, entry in layers.items():
        if "rotation" not in entry:
            raise RotationFileError(f"{p}: layer {lid} has {', '.join(k for k in entry if k != 'layer_id')} but no "
                                    f"rotation")
    version: Any = meta.get("format_version", "1")
    if parse_index(version) is not None:
        version = int(version)
    out: dict[str, Any] = {
        "format_version": version,
        "objective": meta.get("objective", "unknown"),
        "source_grouping": meta.get("source_grouping", LAYER),
        "layers": layers,
    }
    for key in _JSON_META:
        if key in meta:
            try:
                out[key] = json.loads(meta[key])
            except (ValueError, RecursionError):
                raise RotationFileError(f"{p}: safetensors metadata {key!r} is not JSON") from None
    return out


# -- writing -------------------------------------------------------------------------------------


def write_rotation(path: str | os.PathLike[str], rotation_set: RotationSet, *, fmt: str | None = None) -> Path:
    """Write ``rotation_set`` atomically (temp file in the same folder, then rename).

    Args:
        path: destination; the format follows the suffix (``.safetensors`` or anything else = ``.pt``)
            unless ``fmt`` is given.
        rotation_set: what to write, in the authors' layout for what it holds (V1 per layer, V2 per KV
            head, V3 with companions or a ``transform``: :attr:`RotationSet.layout_version`); tensors are
            stored fp32 contiguous with int layer keys, as the authors' fitters write them.
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
                for f in LAYER_FIELDS:
                    if f in entry:
                        tensors[f"{f}.{lid}"] = entry[f].clone()
            meta = {
                "format_version": str(d["format_version"]),
                "objective": str(d["objective"]),
                "source_grouping": str(d["source_grouping"]),
                "layer_ids": ",".join(map(str, rotation_set.layer_ids)),
            }
            for key in _JSON_META:
                if key in d:
                    meta[key] = json.dumps(d[key], sort_keys=True)
            save_file(tensors, str(tmp), metadata=meta)
            give_default_mode(tmp)  # safetensors creates 0600
        replace_with(tmp, p, what="rotation file", error=RotationFileError)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return p

