"""rotationzoo's safetensors pair file: the K and V sides of a model in one file.

Layout::

    k.<layer>.rotation      fp32 [d, d]   R_K of model layer <layer>, applied as x_rot = x @ R
                                 [H_kv, d, d] for per-KV-head rotations (the head axis is kept)
    k.<layer>.eigenvalues   fp32 the rotation's leading shape; optional
    k.<layer>.k_mean        fp32 [d] or [H_kv, d]; optional (key centering, V3)
    k.<layer>.q_rotation    fp32 the rotation's shape; optional (= R^{-T}, V3)
    v.<layer>.rotation, v.<layer>.eigenvalues, v.<layer>.o_rotation, v.<layer>.v_mean   likewise
    metadata (strings): format="rotationzoo.rotations", export_format_version="1", model, tag,
        sides="k,v", head_dim (a number, or "256,5:512,…" for per-layer head_dims), layer_ids="0,1,…",
        k.objective, k.format_version, k.source_grouping, k.sha256 (of the file K was read from, when
        known), k.calibration and k.transform (JSON, when the set has them), and the same for v.

The metadata is checked against the tensors before any tensor is read (see
:func:`~rotationzoo.files.pairfile.common.check_metadata`); ``k.sha256`` / ``v.sha256`` are provenance
only: readers hash the file itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ..schema import LAYER_FIELDS, MAX_LAYERS, inspect_safetensors, make_limits, parse
from ..._version import __version__
from ...errors import ExportError
from ..format import RotationSet
from ...headdims import HeadDims
from ...registry.model import SIDES
from ...safefile import check_regular, give_default_mode, open_regular
from .common import EXPORT_FORMAT_VERSION, LAYER_ID, Sets, atomic_path, check_metadata, parse_version, sides_of

#: ``format`` metadata value of a pair file.
SAFETENSORS_FORMAT = "rotationzoo.rotations"


def pair_metadata(sets: Sets, *, model: str | None, tag: str | None, sha256: Mapping[str, str]) -> dict[str, str]:
    """The string metadata of a pair file (see the module docstring)."""
    sides = sides_of(sets)
    first = sets[sides[0]]
    meta = {
        "format": SAFETENSORS_FORMAT,
        "export_format_version": str(EXPORT_FORMAT_VERSION),
        "sides": ",".join(sides),
        "head_dim": str(first.head_dims),
        "layer_ids": ",".join(map(str, first.layer_ids)),
        "rotationzoo_version": __version__,
    }
    if model:
        meta["model"] = model
    if tag:
        meta["tag"] = tag
    for s in sides:
        rs = sets[s]
        meta[f"{s}.objective"] = str(rs.objective)
        meta[f"{s}.format_version"] = str(rs.format_version)
        meta[f"{s}.source_grouping"] = str(rs.source_grouping)
        for key in ("calibration", "transform"):
            if getattr(rs, key) is not None:
                meta[f"{s}.{key}"] = json.dumps(getattr(rs, key), sort_keys=True)
        if sha256.get(s):
            meta[f"{s}.sha256"] = sha256[s]
    return meta


def write_pair_safetensors(sets: Sets, metadata: Mapping[str, str], out: Path) -> Path:
    """Write ``sets`` (fp32 rotations, eigenvalues and companions) with ``metadata`` to ``out``, atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for s in sides_of(sets):
        for lid, fields in sets[s].layers():
            for name, t in fields.items():
                tensors[f"{s}.{lid}.{name}"] = t.detach().to("cpu", torch.float32).contiguous().clone()
    with atomic_path(out) as tmp:
        save_file(tensors, str(tmp), metadata=dict(metadata))
        give_default_mode(tmp)  # safetensors creates 0600
    return out


def is_pair_safetensors(path: Path) -> bool:
    """True when ``path`` is a safetensors file in this layout (its metadata or tensor names say so)."""
    from safetensors import safe_open

    try:
        # a header beyond a pair file's bound: not one (and not parsed)
        with open_regular(path, what="pair file", error=ExportError) as raw:
            if int.from_bytes(raw.read(8), "little") > make_limits(max_layers=2 * MAX_LAYERS).max_header_bytes:
                return False
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
    except Exception:  # noqa: BLE001 - not readable as safetensors: not a pair file
        return False
    return meta.get("format") == SAFETENSORS_FORMAT or any(k.startswith(("k.", "v.")) for k in keys)


def _side_dict(path: Path, meta: Mapping[str, str], side: str, layers: Mapping[int, Any]) -> dict[str, Any]:
    """One side as the authors' dict (tensors or their header records), for :meth:`RotationSet.from_dict`."""
    out: dict[str, Any] = {"format_version": parse_version(meta.get(f"{side}.format_version", "1")),
                           "objective": meta.get(f"{side}.objective", "unknown"),
                           "source_grouping": meta.get(f"{side}.source_grouping", "layer"), "layers": layers}
    for key in ("calibration", "transform"):
        if f"{side}.{key}" in meta:
            try:
                out[key] = json.loads(meta[f"{side}.{key}"])
            except (ValueError, RecursionError):
                raise ExportError(f"{path}: metadata {side}.{key} is not JSON") from None
    return out


def _by_side(path: Path, entries: Mapping[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    layers: dict[str, dict[int, dict[str, Any]]] = {}
    for key, t in entries.items():
        side, layer, kind = key.split(".")
        layers.setdefault(side, {}).setdefault(int(layer), {"layer_id": int(layer)})[kind] = t
    for s, by_id in layers.items():
        for lid, entry in by_id.items():
            if "rotation" not in entry:
                other = next(k for k in entry if k != "layer_id")
                raise ExportError(f"{path}: {s}.{lid}.{other} without {s}.{lid}.rotation")
    return layers


def read_pair_safetensors(path: Path) -> tuple[dict[str, RotationSet], dict[str, str]]:
    """Read a pair file: each side's rotations (as written: per layer, per KV head, ragged), eigenvalues,
    companions and metadata.

    The header (names, dtypes, shapes, offsets), each side's structure and byte needs (bounded as
    a rotation file's are, side by side) and the metadata (:func:`~.common.check_metadata`) are
    checked before any tensor is read.

    Raises:
        ExportError: not such a file, tensors missing or misnamed, or metadata that is malformed or
            disagrees with the tensors.
        RotationFileError: a side beyond the limits of a rotation file.
    """
    from safetensors import SafetensorError, safe_open

    try:
        check_regular(path, what="pair file", error=ExportError)
    except OSError:
        raise ExportError(f"{path}: no such file") from None
    limits = make_limits(max_layers=2 * MAX_LAYERS)  # both sides in one file
    meta, header = inspect_safetensors(path, limits)  # dtypes, shapes, offsets: before any tensor is read
    for key in header:
        parts = key.split(".")
        if (len(parts) != 3 or parts[0] not in SIDES or not LAYER_ID.fullmatch(parts[1])
                or parts[2] not in LAYER_FIELDS):
            raise ExportError(
                f"{path}: unexpected tensor {key[:80]!r}; a pair file holds <side>.<layer>.<field> with side k or v "
                f"and field one of {', '.join(LAYER_FIELDS)}"
            )
    plan = _by_side(path, header)
    if not plan:
        raise ExportError(f"{path}: no rotation tensors")
    side_limits = make_limits()  # each side is bounded as one rotation file is
    layout = {}
    for s in sides_of(plan):
        parsed = parse(_side_dict(path, meta, s, plan[s]), str(path), side_limits)
        dims = HeadDims.of({lid: int(f["rotation"].shape[-1]) for lid, f in parsed.layers})
        layout[s] = (tuple(lid for lid, _ in parsed.layers), str(dims))
    check_metadata(meta, layout, str(path))
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in header}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ExportError(f"{path}: cannot read safetensors ({exc})") from None
    layers = _by_side(path, tensors)
    sets = {s: RotationSet.from_dict(_side_dict(path, meta, s, layers[s]), path=path, limits=side_limits)
            for s in sides_of(layers)}
    return sets, meta
