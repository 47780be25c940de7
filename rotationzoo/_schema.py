"""What a rotation file may hold: format versions, size limits, and the structure checks.

The checks of the authors' dict (see :mod:`rotationzoo.format`) run twice on every file: first on
the :class:`~rotationzoo._inspect.TensorMeta` records rebuilt from a ``.pt`` pickle or a
safetensors header (before anything is loaded), then on the tensors actually read. They are
written once here, for both. The safetensors header check lives here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from ._inspect import (
    BIG_INT,
    MAX_BYTES,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    FLOAT_DTYPES,
    STORAGE_TYPES,
    Limits,
    TensorMeta,
    check_view,
    exc_line,
    parse_index,
    refuse,
    safe_repr,
)
from .errors import RotationFileError, UnsupportedFormatError

#: The newest integer ``format_version`` this release reads and writes.
FORMAT_VERSION = 1
#: String format versions also understood (the authors' VL branch identity files).
STRING_FORMAT_VERSIONS = ("identity-v1",)

#: Oldest torch allowed to ``torch.load`` a file: ``weights_only=True`` can run code before 2.6
#: (CVE-2025-32434).
MIN_TORCH = (2, 6)

#: safetensors dtype codes, mapped to the same names.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "I32": ("int32", 4), "I64": ("int64", 8),
    "BOOL": ("bool", 1),
}
_MAX_TEXT = 1024  # objective, source_grouping
#: Bytes of each element type, by the names :class:`~rotationzoo._inspect.TensorMeta` uses.
ITEMSIZE: dict[str, int] = {**dict(SAFETENSORS_DTYPES.values()), **dict(STORAGE_TYPES.values())}

#: Most bytes the orthogonality check of :func:`rotationzoo.validate` works in at a time: it measures
#: ``max|R Rᵀ − I|`` in fp64 on chunks of matrices (row blocks of one matrix when ``d`` is large).
VALIDATION_CHUNK_BYTES = 16 << 20


#: ``source_grouping`` of a file holding one rotation per (layer, KV head): ``[H_kv, d, d]`` per layer.
KV_HEAD = "kv_head"


def parse(obj: Any, name: str, limits: Limits) -> tuple[Any, list[tuple[int, Any, Any]], str, str]:
    """Check the dict's structure; works on tensors and on :class:`TensorMeta` records alike.

    Per-layer files hold a ``[d, d]`` rotation (and ``[d]`` eigenvalues) per layer; files with
    ``source_grouping: "kv_head"`` hold ``[H_kv, d, d]`` (and ``[H_kv, d]``), the same ``H_kv`` in
    every layer.

    Returns:
        ``(format_version, [(layer_id, rotation, eigenvalues or None)] sorted by id, objective,
        source_grouping)``.
    """
    if not isinstance(obj, Mapping):
        raise RotationFileError(f"{name}: expected a dict with 'format_version' and 'layers', got {type(obj).__name__}")
    version = obj.get("format_version", FORMAT_VERSION)
    check_format_version(version, name)
    grouping = _text(obj, "source_grouping", "layer", name)
    if "layers" not in obj:
        keys = ", ".join(safe_repr(k) for k in list(obj)[:8]) or "none"
        raise RotationFileError(f"{name}: no 'layers' entry (keys: {keys}); not a rotation file")
    layers = obj["layers"]
    if not isinstance(layers, Mapping) or not layers:
        raise RotationFileError(f"{name}: 'layers' must be a non-empty dict of layer id -> entry")
    if len(layers) > limits.max_layers:
        raise RotationFileError(f"{name}: {len(layers)} layers, more than max_layers={limits.max_layers}{limits.note}")
    parsed: dict[int, tuple[int, Any, Any]] = {}
    for key, entry in layers.items():
        lid = _layer_key(key, entry, name)
        if lid in parsed:
            raise RotationFileError(f"{name}: layer {lid} appears twice (key {safe_repr(key)})")
        if _is_tensor(entry):  # flat {layer: matrix} variant
            rot, eig = entry, None
        elif isinstance(entry, Mapping) and "rotation" in entry:
            rot, eig = entry["rotation"], entry.get("eigenvalues")
        else:
            raise RotationFileError(f"{name}: layer {lid}: expected a dict with a 'rotation' tensor")
        _check_tensor(rot, "rotation", lid, name, limits)
        _check_rotation_shape(tuple(rot.shape), grouping, lid, name)
        if eig is not None:
            _check_tensor(eig, "eigenvalues", lid, name, limits)
        parsed[lid] = (lid, rot, eig)
    rows = sorted(parsed.values(), key=lambda t: t[0])
    _check_same_shape(rows, name)
    _check_loaded_bytes(rows, grouping, name, limits)
    lead = tuple(rows[0][1].shape[:-1])  # (d,) or (H_kv, d)
    for lid, _, eig in rows:
        if eig is not None and tuple(eig.shape) != lead:
            raise RotationFileError(f"{name}: layer {lid}: eigenvalues must have shape {list(lead)}, "
                                    f"got {list(eig.shape)}")
    return version, rows, _text(obj, "objective", "unknown", name), grouping


def _check_rotation_shape(shape: tuple[int, ...], grouping: str, lid: int, name: str) -> None:
    if grouping == KV_HEAD:
        if len(shape) != 3 or shape[1] != shape[2]:
            raise RotationFileError(f"{name}: layer {lid}: source_grouping 'kv_head' needs a [H_kv, d, d] rotation "
                                    f"per layer, got {list(shape)}")
    elif len(shape) != 2 or shape[0] != shape[1]:
        hint = " (a per-KV-head [H_kv, d, d] rotation needs source_grouping 'kv_head')" if len(shape) == 3 else ""
        raise RotationFileError(f"{name}: layer {lid}: rotation must be a square [d, d] matrix, got {shape}{hint}")


def _check_same_shape(rows: list[tuple[int, Any, Any]], name: str) -> None:
    dims = {p[1].shape[-1] for p in rows}
    if len(dims) != 1:
        detail = ", ".join(f"layer {lid}: {rot.shape[-1]}" for lid, rot, _ in rows[:6])
        raise RotationFileError(f"{name}: layers have different head_dims ({detail})")
    heads = {tuple(p[1].shape[:-2]) for p in rows}
    if len(heads) != 1:
        detail = ", ".join(f"layer {lid}: {rot.shape[0]}" for lid, rot, _ in rows[:6])
        raise RotationFileError(f"{name}: layers have different numbers of KV heads ({detail})")


def validation_chunks(d: int, count: int) -> tuple[int, int]:
    """``(matrices per chunk, rows per block)`` of the fp64 orthogonality check of ``count`` ``[d, d]``
    matrices: whole matrices while 17·d² bytes each fit :data:`VALIDATION_CHUNK_BYTES`, else one
    matrix at a time in blocks of rows."""
    per = 17 * d * d  # an fp64 copy, its fp64 product and a bool finiteness mask
    if per <= VALIDATION_CHUNK_BYTES:
        return max(1, min(count, VALIDATION_CHUNK_BYTES // per)), d
    return 1, max(1, VALIDATION_CHUNK_BYTES // (25 * d))


def validation_work_bytes(d: int, count: int) -> int:
    """The most bytes :func:`rotationzoo.validate` allocates at once to check ``count`` ``[d, d]`` matrices."""
    n, b = validation_chunks(d, count)
    return n * 17 * d * d if b == d else 17 * b * d + 8 * b * b  # two fp64 row blocks, their product, a mask


def _stored_bytes(rows: list[tuple[int, Any, Any]]) -> int:
    """Bytes the tensors of ``rows`` occupy as stored (each storage once), as records or as tensors."""
    seen: dict[Any, int] = {}
    for _, rot, eig in rows:
        for t in (rot, eig):
            if t is None:
                continue
            if isinstance(t, TensorMeta):
                key: Any = ("record", t.storage.key) if t.storage is not None else id(t)
                size = (t.storage.numel * t.storage.itemsize if t.storage is not None
                        else t.numel * ITEMSIZE.get(t.dtype, 8))
            else:
                try:
                    st = t.untyped_storage()
                    key, size = ("tensor", st.data_ptr(), t.device), int(st.nbytes())
                except Exception:  # a tensor kind without a plain storage
                    key, size = id(t), t.numel() * t.element_size()
            seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values())


def memory_need(rows: list[tuple[int, Any, Any]]) -> tuple[int, int, int]:
    """``(stored, loaded, validation)`` bytes of reading and validating ``rows``: the tensors as stored
    (what ``torch.load`` / safetensors materialise), as stacked in fp32 (layers that share one stored
    tensor count once per layer), and the fp64 working set of :func:`rotationzoo.validate`."""
    shape = tuple(rows[0][1].shape)
    d, h = int(shape[-1]), (int(shape[0]) if len(shape) == 3 else 1)
    loaded = len(rows) * h * (d * d + d) * 4
    return _stored_bytes(rows), loaded, validation_work_bytes(d, len(rows) * h)


def _check_loaded_bytes(rows: list[tuple[int, Any, Any]], grouping: str, name: str, limits: Limits) -> None:
    stored, loaded, work = memory_need(rows)
    cap = limits.max_bytes_kv_head if grouping == KV_HEAD else limits.max_bytes
    if stored + loaded + work > cap:
        shape = tuple(rows[0][1].shape)
        what = f"{len(rows)} layers of d={shape[-1]}" + (f" and {shape[0]} KV heads" if grouping == KV_HEAD else "")
        raise RotationFileError(f"{name}: {what} need {stored + loaded + work} bytes to read and validate ({stored} "
                                f"stored, {loaded} loaded in fp32, {work} to validate), more than max_bytes={cap}"
                                f"{limits.note}")


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, TensorMeta))


def _layer_key(key: Any, entry: Any, name: str) -> int:
    lid = parse_index(key)
    if lid is None:
        raise RotationFileError(
            f"{name}: layer key {safe_repr(key)} is not an integer layer index (expected a non-negative int "
            "or its ASCII decimal string)"
        )
    if isinstance(entry, Mapping) and "layer_id" in entry and parse_index(entry["layer_id"]) != lid:
        raise RotationFileError(
            f"{name}: layer key {safe_repr(key)} disagrees with its layer_id {safe_repr(entry['layer_id'])}"
        )
    return lid


def _check_tensor(t: Any, what: str, lid: int, name: str, limits: Limits) -> None:
    if not _is_tensor(t):
        raise RotationFileError(f"{name}: layer {lid}: '{what}' is {type(t).__name__}, not a tensor")
    if isinstance(t, TensorMeta):
        floating, dtype = t.dtype in FLOAT_DTYPES, t.dtype
    else:
        if t.layout != torch.strided:
            raise RotationFileError(f"{name}: layer {lid}: '{what}' is a {t.layout} tensor; save dense tensors")
        floating, dtype = t.is_floating_point(), str(t.dtype)
    if not floating:
        raise RotationFileError(f"{name}: layer {lid}: {what} dtype {dtype} is not floating point")
    shape = tuple(t.shape)
    if not shape or len(shape) > 3 or min(shape) < 1:
        raise RotationFileError(f"{name}: layer {lid}: {what} has shape {shape}; expected [d, d] or [d] "
                                "(per KV head: [H, d, d] or [H, d]) with d >= 1")
    if len(shape) == 3 and shape[0] > limits.max_kv_heads:
        raise RotationFileError(f"{name}: layer {lid}: {what} of shape {shape} has more than "
                                f"max_kv_heads={limits.max_kv_heads} KV heads{limits.note}")
    if max(shape) > limits.max_head_dim:
        raise RotationFileError(
            f"{name}: layer {lid}: {what} of shape {shape} exceeds max_head_dim={limits.max_head_dim}{limits.note}"
        )


def _text(obj: Mapping, key: str, default: str, name: str) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise RotationFileError(f"{name}: '{key}' must be a string of at most {_MAX_TEXT} characters, "
                                f"got {safe_repr(value)}")
    return value


def check_format_version(version: Any, name: str) -> None:
    if isinstance(version, bool):
        raise UnsupportedFormatError(f"{name}: format_version {version!r} is not a version")
    if isinstance(version, int):
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{name}: written by a newer format version ({safe_repr(version)}); this rotationzoo reads up to "
                f"{FORMAT_VERSION}; upgrade rotationzoo (pip install -U rotationzoo)"
            )
        if version < 1:
            raise UnsupportedFormatError(f"{name}: format_version {safe_repr(version)} is not valid (expected 1)")
        return
    if isinstance(version, str) and version in STRING_FORMAT_VERSIONS:
        return
    raise UnsupportedFormatError(
        f"{name}: unknown format_version {safe_repr(version)}; expected 1 or one of {', '.join(STRING_FORMAT_VERSIONS)}"
    )


def make_limits(max_head_dim: int = MAX_HEAD_DIM, max_layers: int = MAX_LAYERS, max_bytes: int = MAX_BYTES,
                *, head_dim: int | None = None, num_layers: int | None = None,
                num_kv_heads: int | None = None) -> Limits:
    """The :class:`~rotationzoo._inspect.Limits` in force: the maxima, tightened by expectations.

    Per-layer files get ``min(max_bytes, max_layers·(d² + d)·12 + validation_work_bytes(d,
    max_layers))``: fp64 as stored plus fp32 as loaded, plus validation's working set; per-KV-head
    files the same for ``max_layers·num_kv_heads`` matrices when ``num_kv_heads`` is known, else
    ``max_bytes``.
    """
    note = ""
    if head_dim is not None:
        max_head_dim = min(max_head_dim, int(head_dim))
        note += f"; the model's head_dim is {head_dim}"
    if num_layers is not None:
        max_layers = min(max_layers, int(num_layers))
        note += f"; the model has {num_layers} layers"
    max_kv_heads, kv_bytes = MAX_KV_HEADS, max_bytes
    if num_kv_heads is not None:
        max_kv_heads = min(max_kv_heads, int(num_kv_heads))
        note += f"; the model has {num_kv_heads} KV heads"
    if min(max_head_dim, max_layers, max_bytes, max_kv_heads) < 1:
        raise RotationFileError(f"limits must be positive: max_head_dim={max_head_dim}, max_layers={max_layers}, "
                                f"max_bytes={max_bytes}, max_kv_heads={max_kv_heads}")
    def derived(count: int) -> int:  # `count` matrices of max_head_dim: fp64 stored + fp32 loaded + validation
        return count * (max_head_dim * max_head_dim + max_head_dim) * 12 + validation_work_bytes(max_head_dim, count)

    if num_kv_heads is not None:
        kv_bytes = min(max_bytes, derived(max_layers * max_kv_heads))
    return Limits(max_head_dim=max_head_dim, max_layers=max_layers, max_bytes=min(max_bytes, derived(max_layers)), note=note,
                  max_kv_heads=max_kv_heads, max_bytes_kv_head=kv_bytes)


# -- safetensors header ----------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {safe_repr(k)}")
        out[k] = v
    return out


def inspect_safetensors(path: Path, limits: Limits) -> tuple[dict[str, str], dict[str, TensorMeta]]:
    """Check a safetensors header (dtypes, shapes, data_offsets) before any tensor is read.

    Returns:
        The string metadata and a :class:`TensorMeta` per tensor name.
    """
    name = str(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > limits.max_header_bytes or 8 + n > size:
            raise refuse(name, f"its safetensors header declares {n} bytes (file {size}, limit {limits.max_header_bytes})")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise RotationFileError(f"{name}: damaged safetensors header ({exc_line(exc)}); re-download the file") from None
    if not isinstance(header, dict):
        raise RotationFileError(f"{name}: damaged safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise RotationFileError(f"{name}: safetensors __metadata__ must map strings to strings")
    if len(header) > limits.max_tensors:
        raise refuse(name, f"{len(header)} tensors (max_layers={limits.max_layers})")
    data_len, tensors, spans = size - 8 - n, {}, []
    for key, entry in header.items():
        t, span = _safetensors_entry(name, key, entry, limits, data_len)
        tensors[key] = t
        spans.append(span)
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise refuse(name, "safetensors tensors overlap")
    total = sum(e - s for s, e in spans)
    if max(total, sum(t.numel for t in tensors.values()) * 4) > limits.max_bytes_any:
        raise refuse(name, f"its tensors need more than max_bytes={limits.max_bytes_any}{limits.note}")
    return meta, tensors


def _safetensors_entry(name: str, key: str, entry: Any, limits: Limits, data_len: int) -> tuple[TensorMeta, tuple[int, int]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise RotationFileError(f"{name}: damaged safetensors entry {safe_repr(key)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    ints = (lambda v: isinstance(v, list) and all(type(i) is int and abs(i) < BIG_INT for i in v))
    if dtype not in SAFETENSORS_DTYPES or not ints(shape) or not ints(offsets) or len(offsets) != 2:
        raise RotationFileError(f"{name}: damaged safetensors entry {safe_repr(key)} "
                                f"(dtype {safe_repr(dtype)}, shape {safe_repr(shape)})")
    dname, itemsize = SAFETENSORS_DTYPES[dtype]
    shape_t = tuple(shape)
    stride = tuple(_contiguous_strides(shape_t))
    t = TensorMeta(dname, shape_t, stride)
    check_view(f"{name}: tensor {safe_repr(key)}", t, limits)
    start, end = offsets
    if not 0 <= start <= end <= data_len or end - start != t.numel * itemsize:
        raise refuse(name, f"tensor {safe_repr(key)} has data_offsets {offsets} for {t.numel} elements "
                            f"of {dtype} in {data_len} bytes of data")
    return t, (start, end)


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return strides[::-1]
