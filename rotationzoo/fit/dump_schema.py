"""What a Q/K/V dump may hold, and the checks made on its files before any of them is loaded.

A dump comes from a server hook, a colleague or a download, and whoever made it may be hostile or
careless. Every path the reader follows must resolve inside the dump folder; every file it opens
must be a regular file (a FIFO, device or socket is refused without blocking); every chunk must be a
``torch.save`` zip archive whose pickle, inspected by :mod:`rotationzoo.files.limits` without being
executed, describes one dense tensor within :class:`DumpLimits` (no stride-0, negative-stride or
overlapping view, no storage larger or smaller than its view, no record past the end of the file);
``seq_lens`` must be positive integers that sum to the chunk's rows; ``rotationzoo_dump.json`` is
read with a size bound and refused, not crashed on, when it nests too deeply. Only then is a chunk
memory-mapped with ``torch.load(weights_only=True)``, and the tensor it gives must be the one that
was inspected. See ``docs/security.md`` (Q/K/V dumps) for the guarantees and the limits table.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import zipfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any

import torch

from ..files.limits import BIG_INT, FLOAT_DTYPES, MAX_KV_HEADS, MAX_LAYERS, Limits, TensorMeta, exc_line, safe_repr
from ..files.archive import check_zip_directory, inspect_torch_zip
from ..errors import DumpError, RotationFileError
from ..safefile import file_kind, pseudo_file
from ..kernels.layout import MIN_GROUP_SIZE

#: Tensor kinds of a dump, in the order they are written.
KINDS: tuple[str, ...] = ("q", "k", "v")
#: An optional kind (``layer_<L>/g/<chunk>.pt``, ``[n, H_q, d]``, whole-layer dumps only): the gradient of the
#: calibration text's negative log-likelihood with respect to each query's attention output (before
#: ``o_proj``), which the ``"fisher"`` refinement loss weights pairs with. Written by ``calibrate --grads``.
GRAD_KIND = "g"
#: Optional metadata file at the dump root (not part of the SGLang layout; ignored by other readers).
DUMP_INFO_NAME = "rotationzoo_dump.json"
#: Present while a capture writes a dump (removed when it finishes): a dump holding it was interrupted.
DUMP_UNFINISHED_NAME = ".rotationzoo_dump.unfinished"
#: Smallest head_dim fitted: the INT2 kernels' smallest quantization group (a smaller head is not a
#: model's attention head, and its rotation could not be served).
MIN_HEAD_DIM = MIN_GROUP_SIZE
#: Most sequence lengths a ``seq_lens`` file may hold as a pickled list (tensors: up to the chunk's rows).
MAX_SEQ_LENS_LIST = 65536

_INDEX = re.compile(r"[0-9]+", re.ASCII)
_MAX_INDEX_DIGITS = 9  # layer and chunk ids below 10**9
_INT_DTYPES = frozenset({"uint8", "int8", "int16", "int32", "int64"})
_MAX_TEXT = 256  # the model id of rotationzoo_dump.json


@dataclass(frozen=True)
class DumpLimits:
    """Bounds a dump must respect before it is fitted; every one is checked on metadata alone.

    The defaults admit every published calibration by a wide margin (Qwen3-8B: 36 layers, 8 KV and
    32 query heads, d = 128, 20,000 tokens per layer in chunks of at most 4,096; the largest, 150,000
    tokens). Pass ``open_dump(path, limits=DumpLimits(...))`` to loosen or tighten them.

    Attributes:
        max_layers: layer folders fitted (the most a rotation file may hold).
        max_chunks: chunk files per layer and kind.
        max_rows_per_chunk: tokens in one chunk file.
        max_tokens_per_layer: tokens of one layer, over its chunks.
        max_heads: query heads and KV heads (the most a per-KV-head rotation file may hold).
        max_head_dim: ``d``.
        max_chunk_bytes: one chunk's tensor data, as stored and counted at 4 bytes per element.
        max_info_bytes: size of ``rotationzoo_dump.json``.
        max_statistics_bytes: the fp64 statistics a fit keeps for all its layers (every Gram matrix
            and every covariance: ``H_kv·d²`` or ``d²`` values of 8 bytes each).
    """

    max_layers: int = MAX_LAYERS
    max_chunks: int = 16384
    max_rows_per_chunk: int = 1 << 20
    max_tokens_per_layer: int = 1 << 22
    max_heads: int = MAX_KV_HEADS
    max_head_dim: int = 1024
    max_chunk_bytes: int = 16 << 30
    max_info_bytes: int = 1 << 20
    max_statistics_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or not 1 <= value < BIG_INT:
                raise DumpError(f"DumpLimits.{f.name} must be a positive integer, got {safe_repr(value)}")


@dataclass(frozen=True)
class ChunkMeta:
    """What an inspected chunk file holds, before it is loaded.

    Attributes:
        path: the file as named in the dump; ``real`` is where it resolves (inside the dump).
        shape, stride, offset, dtype: the tensor's view (``dtype`` a name such as ``"bfloat16"``).
        storage_bytes: bytes of the storage behind the view.
        ident: ``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file when it was inspected.
    """

    path: Path
    real: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    storage_bytes: int
    ident: tuple[int, int, int, int]

    @property
    def rows(self) -> int:
        """Tokens in the chunk (``n`` of ``[n, H, d]``), or sequences of a ``seq_lens`` file."""
        return self.shape[0]


@dataclass(frozen=True)
class _ChunkFileLimits(Limits):
    """:mod:`rotationzoo.files.limits` limits for one chunk file: a single tensor, a small pickle."""

    pickle_bytes: int = 64 * 1024
    pickle_ops: int = 1024

    @property
    def max_tensors(self) -> int:
        return 1

    @property
    def max_pickle_bytes(self) -> int:
        return self.pickle_bytes

    @property
    def max_pickle_ops(self) -> int:
        return self.pickle_ops


def parse_index(text: str) -> int | None:
    """A layer or chunk id written canonically (ASCII digits, no leading zero, at most 9 digits)."""
    if not _INDEX.fullmatch(text) or len(text) > _MAX_INDEX_DIGITS or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


def layer_folder_id(root: Path, name: str) -> int | None:
    """The id of a ``layer_<L>`` folder name; ``None`` for other names; refused when not canonical."""
    if not name.startswith("layer_"):
        return None
    lid = parse_index(name[6:])
    if lid is None and name[6:].isdigit():
        raise DumpError(f"{root / name}: not a canonical layer folder name (expected layer_<L>, L in ASCII "
                        "digits without leading zeros, below 10**9)")
    return lid


def chunk_file_id(folder: Path, name: str) -> int | None:
    """The id of a ``<chunk>.pt`` file name; ``None`` for other names; refused when not canonical."""
    if not name.endswith(".pt"):
        return None
    chunk = parse_index(name[:-3])
    if chunk is None and name[:-3].isdigit():
        raise DumpError(f"{folder / name}: not a canonical chunk file name (expected <chunk>.pt, chunk in ASCII "
                        "digits without leading zeros, below 10**9)")
    return chunk


def resolve_inside(path: Path, root_real: str, what: str) -> str:
    """Where ``path`` resolves, refused unless it lies inside the dump folder ``root_real``."""
    real = os.path.realpath(path)
    if real != root_real and not real.startswith(root_real.rstrip(os.sep) + os.sep):
        raise DumpError(f"{path}: {what} resolves to {real}, outside the dump folder {root_real}; a dump's "
                        "folders and files must lie inside it (refused)")
    return real


def scan_dir(folder: Path, real: str, max_entries: int) -> list[str]:
    """Names in a dump folder, refusing folders of more than ``max_entries`` entries."""
    names: list[str] = []
    try:
        with os.scandir(real) as it:
            for entry in it:
                if len(names) >= max_entries:
                    raise DumpError(f"{folder}: more than {max_entries} entries; not a dump folder "
                                    "(see DumpLimits.max_layers / max_chunks)")
                names.append(entry.name)
    except OSError as exc:
        raise DumpError(f"{folder}: cannot list ({exc_line(exc)})") from None
    return names


def _refuse_irregular(path: Path, real: str, st: os.stat_result) -> os.stat_result:
    kind = file_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else pseudo_file(real, st)
    if kind is not None:
        raise DumpError(f"{path}: not a regular file ({kind}); a dump holds only files written by torch.save "
                        "(refused without reading it)")
    return st


def check_regular(path: Path, real: str) -> os.stat_result:
    """``os.stat`` of a file that must be a regular file outside ``/proc``, ``/sys`` and ``/dev``
    (never opened if it is not)."""
    try:
        st = os.stat(real)
    except OSError as exc:
        raise DumpError(f"{path}: cannot open ({exc_line(exc)})") from None
    return _refuse_irregular(path, real, st)


def open_regular(path: Path, real: str) -> tuple[IO[bytes], os.stat_result]:
    """Open a regular file without blocking (``O_NONBLOCK``: a FIFO swapped in is never waited on)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise DumpError(f"{path}: cannot open ({exc_line(exc)})") from None
    try:
        st = _refuse_irregular(path, real, os.fstat(fd))
        return os.fdopen(fd, "rb"), st
    except BaseException:
        os.close(fd)
        raise


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_ident(real: str) -> tuple[int, int, int, int] | None:
    """The identity recorded in :class:`ChunkMeta` of the file now, ``None`` if it is gone."""
    try:
        return _ident(os.stat(real))
    except OSError:
        return None


def _file_limits(kind: str, limits: DumpLimits) -> _ChunkFileLimits:
    if kind == "seq_lens":
        cap = 8 * limits.max_rows_per_chunk
        pickle_bytes, ops = 64 * 1024 + 16 * MAX_SEQ_LENS_LIST, 1024 + 2 * MAX_SEQ_LENS_LIST
    else:
        cap, pickle_bytes, ops = limits.max_chunk_bytes, 64 * 1024, 1024
    return _ChunkFileLimits(max_head_dim=BIG_INT, max_layers=1, max_bytes=cap, max_kv_heads=BIG_INT,
                            max_bytes_kv_head=cap, what="Q/K/V dump file", note="; a dump chunk holds one tensor",
                            pickle_bytes=pickle_bytes, pickle_ops=ops)


def _check_records(name: str, f: IO[bytes], size: int) -> None:
    """Every archive member stored (torch.save never compresses) and lying inside the file.

    A record past the end of the file would be memory-mapped anyway and crash the reader on first
    access, so its extent is computed from its local header, as the loader does.
    """
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise DumpError(f"{name}: refused before loading: member {safe_repr(info.filename)} is compressed "
                                f"(method {info.compress_type}); torch.save stores dump tensors uncompressed")
            f.seek(info.header_offset)
            header = f.read(30)
            if len(header) != 30 or header[:4] != b"PK\x03\x04":
                raise DumpError(f"{name}: cannot read: damaged zip archive (no local header for "
                                f"{safe_repr(info.filename)}); the file is truncated or damaged")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            if info.header_offset + 30 + name_len + extra_len + info.compress_size > size:
                raise DumpError(f"{name}: refused before loading: member {safe_repr(info.filename)} extends past the "
                                f"end of the file ({size} bytes); the file is truncated")
    except DumpError:
        raise
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise DumpError(f"{name}: cannot read: damaged zip archive ({exc_line(exc)}); the file is truncated or "
                        "damaged") from None


def inspect_file(path: Path, real: str, kind: str, limits: DumpLimits) -> tuple[Any, os.stat_result]:
    """Open, check and inspect one dump file; returns the pickle rebuilt with :class:`TensorMeta` records.

    Raises:
        DumpError: not a regular file, empty, too large, not a torch zip archive (a text or foreign
            file), more archive members than a chunk holds (counted from the zip's end record before the
            directory is parsed), a compressed or truncated member, or a pickle refused by
            :mod:`rotationzoo.files.limits`.
    """
    f, st = open_regular(path, real)
    with f:
        cap = _file_limits(kind, limits).max_bytes + (1 << 20)
        if st.st_size == 0:
            raise DumpError(f"{path}: empty file; a dump chunk is a tensor written by torch.save")
        if st.st_size > cap:
            raise DumpError(f"{path}: {st.st_size} bytes, more than a {kind} chunk may hold ({cap}; "
                            "DumpLimits.max_chunk_bytes)")
        magic = f.read(4)
        if magic != b"PK\x03\x04":
            raise DumpError(f"{path}: cannot read: not a torch.save archive (it starts with {safe_repr(magic)}; "
                            "a text or foreign file?); dump chunks are tensors written by torch.save")
        try:
            check_zip_directory(f, str(path), _file_limits(kind, limits))  # before zipfile parses the directory
        except RotationFileError as exc:
            raise DumpError(str(exc)) from None
        except OSError as exc:
            raise DumpError(f"{path}: cannot read ({exc_line(exc)})") from None
        _check_records(str(path), f, st.st_size)
        f.seek(0)
        try:
            obj, _ = inspect_torch_zip(path, _file_limits(kind, limits), fileobj=f, check_crc=False)
        except RotationFileError as exc:
            raise DumpError(str(exc)) from None
    return obj, st


def inspect_chunk(path: Path, real: str, kind: str, limits: DumpLimits) -> ChunkMeta:
    """Inspect a ``q``/``k``/``v`` chunk: one dense floating-point ``[n, H, d]`` tensor within ``limits``."""
    obj, st = inspect_file(path, real, kind, limits)
    if not isinstance(obj, TensorMeta):
        raise DumpError(f"{path}: expected a tensor [n, heads, head_dim], got {type(obj).__name__}")
    if len(obj.shape) != 3:
        raise DumpError(f"{path}: expected a tensor [n, heads, head_dim], got shape {obj.shape}")
    if obj.dtype not in FLOAT_DTYPES:
        raise DumpError(f"{path}: expected floating point activations, got dtype {obj.dtype}")
    n, heads, d = obj.shape
    for value, cap, what in ((n, limits.max_rows_per_chunk, "tokens, more than max_rows_per_chunk"),
                             (heads, limits.max_heads, "heads, more than max_heads"),
                             (d, limits.max_head_dim, "head_dim, more than max_head_dim")):
        if value > cap:
            raise DumpError(f"{path}: refused before loading: shape {obj.shape}: {value} {what}={cap} (DumpLimits)")
    if d < MIN_HEAD_DIM:
        raise DumpError(f"{path}: head_dim {d} is below {MIN_HEAD_DIM}, the smallest the INT2 kernels serve; "
                        "not a model's attention heads")
    assert obj.storage is not None
    return ChunkMeta(path=path, real=real, shape=obj.shape, stride=obj.stride, offset=obj.offset, dtype=obj.dtype,
                     storage_bytes=obj.storage.numel * obj.storage.itemsize, ident=_ident(st))


def load_chunk(meta: ChunkMeta) -> torch.Tensor:
    """``torch.load(weights_only=True, mmap=True)`` of an inspected chunk; it must be the tensor inspected."""
    t = torch_load(meta.path, meta.real)
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        raise DumpError(f"{meta.path}: changed while it was read (no longer the tensor inspected); "
                        "is something writing the dump?")
    found = (tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype).replace("torch.", ""),
             t.untyped_storage().nbytes())
    if found != (meta.shape, meta.stride, meta.offset, meta.dtype, meta.storage_bytes):
        raise DumpError(f"{meta.path}: changed while it was read (inspected {meta.shape} {meta.dtype}, loaded "
                        f"{found[0]} {found[3]}); is something writing the dump?")
    return t


def torch_load(path: Path, real: str) -> Any:
    """Memory-map an inspected archive (``weights_only=True``); typed errors only."""
    try:
        return torch.load(real, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types on damaged archives
        raise DumpError(f"{path}: cannot read ({type(exc).__name__}: {exc_line(exc)}); the file is truncated or "
                        "damaged") from None


def read_seq_lens(path: Path, real: str, rows: int, limits: DumpLimits) -> list[int]:
    """A ``seq_lens`` file: a 1-D integer tensor (or a list of ints) of positive lengths summing to ``rows``."""
    obj, _ = inspect_file(path, real, "seq_lens", limits)
    if isinstance(obj, TensorMeta):
        if obj.dtype not in _INT_DTYPES or len(obj.shape) != 1:
            raise DumpError(f"{path}: expected a 1-D integer tensor of sequence lengths, got {obj.dtype} "
                            f"of shape {list(obj.shape)}")
        if obj.shape[0] > rows:
            raise DumpError(f"{path}: {obj.shape[0]} sequence lengths for a chunk of {rows} tokens")
        loaded = torch_load(path, real)
        if not isinstance(loaded, torch.Tensor) or tuple(loaded.shape) != obj.shape or loaded.is_floating_point():
            raise DumpError(f"{path}: changed while it was read; is something writing the dump?")
        values: list[Any] = loaded.tolist()
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    else:
        raise DumpError(f"{path}: expected a tensor or list of sequence lengths, got {type(obj).__name__}")
    if not values:
        raise DumpError(f"{path}: holds no sequence lengths; a chunk has at least one sequence")
    bad = next((v for v in values if type(v) is not int or v < 1), None)
    if bad is not None:
        raise DumpError(f"{path}: sequence lengths must be positive integers, found {safe_repr(bad)} "
                        f"(in {safe_repr(values)})")
    if sum(values) != rows:
        raise DumpError(f"{path}: sequence lengths sum to {sum(values)}, but the chunk has {rows} tokens")
    return values


def read_info(path: Path, root_real: str, limits: DumpLimits) -> dict[str, Any]:
    """``rotationzoo_dump.json``: a JSON object of bounded size; ``model`` a string, ``prompts``,
    ``tokens`` and ``tp_size`` non-negative integers when present."""
    real = resolve_inside(path, root_real, "the dump's metadata file")
    f, st = open_regular(path, real)
    with f:
        if st.st_size > limits.max_info_bytes:
            raise DumpError(f"{path}: {st.st_size} bytes, more than max_info_bytes={limits.max_info_bytes} (DumpLimits)")
        raw = f.read(limits.max_info_bytes + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise DumpError(f"{path}: not valid JSON (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DumpError(f"{path}: not valid JSON ({exc_line(exc)})") from None
    if not isinstance(data, dict):
        raise DumpError(f"{path}: expected a JSON object, got {type(data).__name__}")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= _MAX_TEXT
                              or any(not c.isprintable() for c in model)):
        raise DumpError(f"{path}: 'model' must be a printable string of at most {_MAX_TEXT} characters, "
                        f"got {safe_repr(model)}")
    for key in ("prompts", "tokens", "tp_size"):
        value = data.get(key)
        if value is not None and (type(value) is not int or not 0 <= value < BIG_INT):
            raise DumpError(f"{path}: {key!r} must be a non-negative integer, got {safe_repr(value)}")
    return data
