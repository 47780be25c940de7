"""The safetensors header of a rotation file, checked before any tensor is read.

The JSON header (dtypes, shapes, ``data_offsets``, metadata) is parsed with a bound on its size and
depth and without duplicate keys; every entry is checked like a pickle's tensor record
(:func:`rotationzoo.files.limits.check_view`), the offsets must tile the data without overlapping, and
the total stays under the byte cap, before ``safetensors`` reads a single tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .limits import BIG_INT, Limits, TensorMeta, check_view, exc_line, refuse, safe_repr
from ..errors import RotationFileError
from ..safefile import open_regular

#: safetensors dtype codes, mapped to the names :class:`~rotationzoo.files.limits.TensorMeta` uses.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "I32": ("int32", 4), "I64": ("int64", 8),
    "BOOL": ("bool", 1),
}


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
    with open_regular(path, what="rotation file", error=RotationFileError) as f:
        size = os.fstat(f.fileno()).st_size
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
