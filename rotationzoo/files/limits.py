"""The bounds a rotation file must keep, and the tensor records checked against them before loading.

:class:`Limits` (sizes, layers, KV heads, bytes), :class:`TensorMeta` (what a tensor would be: dtype,
shape, stride, storage, with no data) and :func:`check_view` (empty, over-large, stride-0 or
overlapping views refused) are shared by every reader that inspects before it loads: the ``.pt``
archive (:mod:`rotationzoo.files.archive`), the safetensors header (:mod:`rotationzoo.files.stheader`),
the pair files and the Q/K/V dump chunks (:mod:`rotationzoo.fit.dump_schema`). The registry bounds its
numbers by the same maxima. :func:`parse_layer_ids` reads the layer ids a caller names (``--layers``,
``layers=``). Imports: the standard library, errors and numbers only.
"""

from __future__ import annotations

import itertools
import re
import reprlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import ConfigError, RotationFileError, RotationZooError
from ..numbers import check_int, shown

#: Largest ``d`` (rotation size) a file may declare; published files use 64 … 256.
MAX_HEAD_DIM = 4096
#: Most layers a file may hold; published files hold 8 … 36.
MAX_LAYERS = 1024
#: Most bytes reading and validating one file may take: its tensors as stored, plus as loaded in fp32,
#: plus the fp64 working set of validation (:func:`rotationzoo.files.schema.memory_need`); the largest
#: published file (2.6 MB) needs 16.4 MB. Expectations passed to :func:`read_rotation` tighten it.
MAX_BYTES = 256 << 20
#: Largest layer id a caller may name (``layers``, ``--layers``): any id an int32 holds.
MAX_LAYER_ID = 2**31 - 1
#: Most KV heads a per-KV-head file (``source_grouping: "kv_head"``) may hold per layer.
MAX_KV_HEADS = 256

#: Element type and size of each storage class a ``torch.save`` pickle names.
STORAGE_TYPES: dict[str, tuple[str, int]] = {
    "FloatStorage": ("float32", 4), "DoubleStorage": ("float64", 8), "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2), "ByteStorage": ("uint8", 1), "CharStorage": ("int8", 1),
    "ShortStorage": ("int16", 2), "IntStorage": ("int32", 4), "LongStorage": ("int64", 8),
    "BoolStorage": ("bool", 1), "ComplexFloatStorage": ("complex64", 8), "ComplexDoubleStorage": ("complex128", 16),
}
FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})

#: No size, stride, offset or dict key in a sane file comes near this.
BIG_INT = 1 << 62
_DECIMAL = re.compile(r"(0|[1-9][0-9]{0,17})\Z")  # ASCII digits only, canonical
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 2, 40, 40, 4, 4


def safe_repr(x: Any) -> str:
    """A short ``repr`` that is safe on deep, huge or self-referencing values from a hostile file."""
    try:
        return _repr.repr(x)
    except Exception:  # a repr that fails is itself hostile; say what it is instead
        return f"<{type(x).__name__}>"


def exc_line(exc: BaseException) -> str:
    """The first line of an exception message (or its type), for a one-line typed error."""
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def parse_index(x: Any) -> int | None:
    """``x`` as a non-negative int if it is one or its plain ASCII decimal string, else ``None``."""
    if type(x) is int and 0 <= x < BIG_INT:
        return x
    if isinstance(x, str) and _DECIMAL.match(x):
        return int(x)
    return None


_LAYER_PART = re.compile(r"([0-9]{1,18})(?:\s*-\s*([0-9]{1,18}))?")


def parse_layer_ids(value: Any, what: str = "layers", *, error: type[RotationZooError] = ConfigError,
                    empty_ok: bool = False) -> list[int]:
    """The layer ids ``value`` names, in the order given: text as ``--layers`` takes it (``"0,1,2"``, ``"3-7"``,
    ``"0-3,8"``; parsed, never iterated per character) or an iterable of integers (a list, a range, ...).

    At most :data:`MAX_LAYERS` ids, each from 0 to :data:`MAX_LAYER_ID`; none only with ``empty_ok``.

    Raises:
        error: one line naming ``what``: not such text or integers, an empty or reversed range, a range
            spanning more than :data:`MAX_LAYERS` layers, no ids at all, or too many.
    """
    ids: list[int] = []
    if isinstance(value, str):
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            m = _LAYER_PART.fullmatch(part)
            if m is None:
                raise error(f"{what}: {shown(part)} is not a layer id or range (e.g. 0,1,2 or 3-7)")
            low, high = int(m[1]), int(m[2] or m[1])
            if high < low:
                raise error(f"{what}: {part} is a reversed range; write the lower id first (e.g. 3-7)")
            if high - low >= MAX_LAYERS:  # before the range is built
                raise error(f"{what}: {part} spans more than {MAX_LAYERS:,} layers; give the model's layer ids")
            if high > MAX_LAYER_ID:
                raise error(f"{what}: layer id {high:,} is beyond {MAX_LAYER_ID:,}; give the model's layer ids")
            ids.extend(range(low, high + 1))
            if len(ids) > MAX_LAYERS:
                break
    elif isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise error(f"{what} must be layer ids: integers (a list, a range) or text such as '0,1,2' or '3-7', got "
                    f"{type(value).__name__} {shown(value)}")
    else:
        for x in itertools.islice(value, MAX_LAYERS + 1):  # check_int takes numpy / torch integers too
            ids.append(check_int(x, f"a layer id of {what}", low=0, high=MAX_LAYER_ID, error=error))
    if not ids and not empty_ok:
        raise error(f"{what} names no layer id; give e.g. 0,1,2 or 3-7 (or leave it unset for every layer)")
    if len(ids) > MAX_LAYERS:
        raise error(f"{what} names more than {MAX_LAYERS:,} layer ids, more than a rotation file holds")
    return ids


@dataclass(frozen=True)
class Limits:
    """Bounds a file must respect before it is loaded (see :data:`MAX_HEAD_DIM`)."""

    max_head_dim: int
    max_layers: int
    max_bytes: int
    note: str = ""  # appended to refusals, e.g. "; the model's head_dim is 128"
    max_kv_heads: int = MAX_KV_HEADS  # first dim of a per-KV-head [H, d, d] rotation
    max_bytes_kv_head: int = MAX_BYTES  # the byte cap of a per-KV-head file
    what: str = "rotation file"  # the kind of file checked, in refusals (also "Q/K/V dump file")

    @property
    def max_bytes_any(self) -> int:
        """The byte cap before the grouping is known (the schema check then applies the exact one)."""
        return max(self.max_bytes, self.max_bytes_kv_head)

    @property
    def max_tensors(self) -> int:
        return 6 * self.max_layers  # per layer: rotation, eigenvalues, 2 companion matrices, 2 means

    @property
    def max_members(self) -> int:
        return 16 + self.max_tensors  # the tensor records plus data.pkl, version, byteorder, ...

    @property
    def max_pickle_bytes(self) -> int:
        return 64 * 1024 + 1024 * self.max_layers  # published files: ~150 B per layer

    @property
    def max_pickle_ops(self) -> int:
        return 1024 + 512 * self.max_layers  # published files: ~68 opcodes per layer

    @property
    def max_header_bytes(self) -> int:
        return 64 * 1024 + 512 * self.max_tensors  # safetensors JSON header


class StorageRef:
    """A storage named by the pickle: record ``data/<key>`` of ``numel`` elements of ``dtype``."""

    __slots__ = ("key", "dtype", "itemsize", "numel")

    def __init__(self, key: str, dtype: str, itemsize: int, numel: int) -> None:
        self.key, self.dtype, self.itemsize, self.numel = key, dtype, itemsize, numel


class TensorMeta:
    """What a tensor would be, without its data: dtype, shape, stride and where it lies."""

    __slots__ = ("dtype", "shape", "stride", "offset", "storage")

    def __init__(self, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], offset: int = 0,
                 storage: StorageRef | None = None) -> None:
        self.dtype, self.shape, self.stride, self.offset, self.storage = dtype, shape, stride, offset, storage

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        return f"TensorMeta({self.dtype}, {self.shape})"


def refuse(name: str, what: str) -> RotationFileError:
    """The error for a file refused before loading: ``<file>: refused before loading: <what>``."""
    return RotationFileError(f"{name}: refused before loading: {what}")


def check_view(name: str, t: TensorMeta, limits: Limits) -> None:
    """Refuse empty, over-large, >3-D, stride-0, negative-stride or overlapping views."""
    shape, stride = t.shape, t.stride
    if len(shape) > 3:
        raise refuse(name, f"a tensor of shape {shape}; rotation files hold [d, d], [H, d, d], [d] and [H, d] tensors")
    if len(shape) == 3 and shape[0] > limits.max_kv_heads:
        raise refuse(name, f"a tensor of shape {shape}: {shape[0]} KV heads exceeds max_kv_heads={limits.max_kv_heads}{limits.note}")
    if any(n < 1 for n in shape):
        raise refuse(name, f"an empty tensor of shape {shape}")
    dims = sorted((s, n) for s, n in zip(stride, shape) if n > 1)
    reach = 0  # furthest element offset reached by the smaller-stride dims
    for s, n in dims:
        if s < 1:
            raise refuse(name, f"a view with stride {stride} (stride-0 or negative: it repeats memory)")
        if s <= reach:
            raise refuse(name, f"a view with overlapping strides {stride} for shape {shape}")
        reach += s * (n - 1)
    if any(n > limits.max_head_dim for n in shape):
        raise refuse(name, f"a tensor of shape {shape} exceeds max_head_dim={limits.max_head_dim}{limits.note}")
    if t.storage is not None and t.offset + reach + 1 > t.storage.numel:
        raise refuse(name, f"a view (offset {t.offset}, shape {shape}, stride {stride}) beyond its storage "
                            f"of {t.storage.numel} elements")
