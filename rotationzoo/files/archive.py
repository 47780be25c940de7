"""The ``torch.save`` archive of a rotation file, inspected before anything in it is materialised.

A hostile file can declare a tiny tensor backed by a huge storage, a stride-0 view that expands to
terabytes, a deflated member that inflates to gigabytes, a million layers, or a pickle that runs
code. Everything here reads only the archive's directory, the declared sizes and the pickle's
opcode stream, so such a file is refused in milliseconds with a bounded amount of memory, before
``torch.load`` allocates a single tensor. (Safetensors headers are checked in
:mod:`rotationzoo.files.stheader` and Q/K/V dump chunks in :mod:`rotationzoo.fit.dump_schema`, with the
same :class:`~rotationzoo.files.limits.Limits` and :func:`~rotationzoo.files.limits.check_view`.)

The pickle in ``data.pkl`` is inspected in two passes: :func:`scan_pickle` walks the opcodes as
:func:`pickletools.genops` does (allowed opcodes only, bounded count and memo indices, globals
checked by name), then the standard library's pure-Python unpickler, whose ``find_class`` returns
only this module's recording functions, rebuilds the plain containers with
:class:`~rotationzoo.files.limits.TensorMeta` records in place of tensors (and refuses dict keys
whose hashes can be made to collide). No object from an arbitrary global is ever constructed.
Imports: the standard library, errors, safefile and :mod:`~rotationzoo.files.limits`.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from ..errors import RotationFileError, UnsafeRotationFileError
from ..safefile import open_regular
from .limits import (
    BIG_INT,
    STORAGE_TYPES,
    Limits,
    StorageRef,
    TensorMeta,
    check_view,
    exc_line,
    parse_index,
    refuse,
    safe_repr,
)

#: Storages may hold this many elements beyond what the tensors viewing them cover.
STORAGE_SLACK = 1024
#: Cap on any archive member other than ``data.pkl`` and the tensor records (``version``, ...).
SMALL_MEMBER_BYTES = 1 << 20
#: Most bytes a zip central-directory entry may take on average: the 46-byte record, its name
#: (``<archive>/data/<key>``, the archive named after the file: under 300 bytes) and any extra field or comment
#: (torch.save writes neither). With the member count, it bounds the directory ``zipfile`` reads and parses.
MAX_ZIP_ENTRY_BYTES = 46 + 1024

_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record: 22 bytes, the last thing in a zip
_EOCD64_LOCATOR_SIZE = 20  # the ZIP64 locator, just before the record above
_EOCD64 = struct.Struct("<4sQ2H2L4Q")  # the ZIP64 end of central directory record, just before its locator
_CD_ENTRY_SIZE = 46  # fixed part of a central-directory entry; name, extra and comment lengths at 28, 30, 32

_TORCH_REBUILD_UNSUPPORTED = frozenset({
    "_rebuild_sparse_tensor", "_rebuild_sparse_csr_tensor", "_rebuild_qtensor", "_rebuild_nested_tensor",
    "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy",
    "_rebuild_device_tensor_from_cpu_tensor", "_rebuild_xla_tensor", "_rebuild_mtia_tensor",
})
# What torch.save (pickle protocol 2) emits and torch.load(weights_only=True) reads, less NEWOBJ,
# BUILD and EMPTY_SET; anything else is refused.
_ALLOWED_OPCODES = frozenset(
    "PROTO STOP MARK NONE NEWTRUE NEWFALSE BININT BININT1 BININT2 LONG1 BINFLOAT BINUNICODE SHORT_BINSTRING "
    "EMPTY_LIST APPEND APPENDS EMPTY_TUPLE TUPLE TUPLE1 TUPLE2 TUPLE3 EMPTY_DICT SETITEM SETITEMS "
    "BINPUT LONG_BINPUT BINGET LONG_BINGET GLOBAL REDUCE BINPERSID".split()
)
# Opcodes that build or call objects beyond the globals seen by name: a sign of a hostile file.
_CODE_OPCODES = frozenset("BUILD NEWOBJ NEWOBJ_EX INST OBJ EXT1 EXT2 EXT4 PERSID".split())
_STRING_OPS = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "SHORT_BINSTRING"})
_NON_PUSHING = frozenset({"PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE", "STOP"})
_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


class _StorageType:
    """Stands in for ``torch.FloatStorage`` and the like."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _Recorder:
    """Stands in for torch while the pickle is rebuilt: records storages and tensor views."""

    def __init__(self, name: str, limits: Limits) -> None:
        self.name, self.limits = name, limits
        self.storages: dict[str, StorageRef] = {}
        self.tensors: list[TensorMeta] = []

    def find(self, module: str, qualname: str) -> Any:
        if module == "torch._utils" and qualname == "_rebuild_tensor_v2":
            return self.rebuild_tensor
        if module == "torch._utils" and qualname == "_rebuild_parameter":
            return self.rebuild_parameter
        if module == "collections" and qualname == "OrderedDict":
            return self.ordered_dict
        if module == "_codecs" and qualname == "encode":  # how protocol 2 pickles bytes
            return _latin1_bytes
        if module == "torch" and qualname in STORAGE_TYPES:
            return _StorageType(qualname)
        if module == "torch._utils" and qualname in _TORCH_REBUILD_UNSUPPORTED:
            raise RotationFileError(
                f"{self.name}: holds a tensor kind {self.limits.what}s do not use ({module}.{qualname}); "
                "save dense tensors (rotation.to_dense().contiguous())"
            )
        raise UnsafeRotationFileError(
            f"{self.name}: refused to load: its pickle references {safe_repr(f'{module}.{qualname}')}, "
            f"which a {self.limits.what} never needs (it holds only tensors and plain data); do not trust this file"
        )

    def persistent_load(self, pid: Any) -> StorageRef:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise refuse(self.name, f"an unexpected persistent id {safe_repr(pid)}")
        _, storage_type, key, location, numel = pid
        dtype, itemsize = STORAGE_TYPES[storage_type.name]
        if parse_index(key) is None or not isinstance(location, str) or type(numel) is not int or not 0 <= numel < BIG_INT:
            raise refuse(self.name, f"a malformed storage reference {safe_repr(pid)}")
        if numel * itemsize > self.limits.max_bytes_any:
            raise refuse(self.name, f"a storage of {numel * itemsize} bytes exceeds max_bytes={self.limits.max_bytes_any}{self.limits.note}")
        seen = self.storages.get(key)
        if seen is None:
            seen = self.storages[key] = StorageRef(key, dtype, itemsize, numel)
        elif (seen.dtype, seen.numel) != (dtype, numel):
            raise refuse(self.name, f"storage {key} declared twice with different types or sizes")
        return seen

    def rebuild_tensor(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                       hooks: Any, metadata: Any = None, *extra: Any) -> TensorMeta:
        """``torch._utils._rebuild_tensor_v2``, same signature, recorded instead of built."""
        ints = (lambda v: type(v) is tuple and all(type(i) is int and abs(i) < BIG_INT for i in v))
        if (not isinstance(storage, StorageRef) or type(offset) is not int or not 0 <= offset < BIG_INT or not ints(size)
                or not ints(stride) or len(size) != len(stride) or extra or metadata not in (None, {})
                or type(requires_grad) is not bool or type(hooks) is not dict):
            raise refuse(self.name, "a malformed tensor record (storage, offset, size, stride)")
        if len(self.tensors) >= self.limits.max_tensors:
            raise refuse(self.name, f"more than {self.limits.max_tensors} tensors (max_layers={self.limits.max_layers}{self.limits.note})")
        t = TensorMeta(storage.dtype, size, stride, offset, storage)
        check_view(self.name, t, self.limits)
        self.tensors.append(t)
        return t

    def rebuild_parameter(self, data: Any, requires_grad: Any, hooks: Any) -> TensorMeta:
        if not isinstance(data, TensorMeta) or type(requires_grad) is not bool or type(hooks) is not dict:
            raise refuse(self.name, "a parameter record without a tensor")
        return data

    def ordered_dict(self, *args: Any) -> dict:
        if args:
            raise refuse(self.name, "an OrderedDict built from arguments")
        return {}


def _latin1_bytes(text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
        raise RotationFileError("malformed bytes record in the pickle")
    return text.encode("latin1")


class _InspectingUnpickler(pickle._Unpickler):  # the stdlib's pure-Python unpickler
    """Rebuilds containers only; globals resolve to :class:`_Recorder` methods; dict keys are checked.

    Keys must be strings, bytes, None, floats or ints below 2**62: the hashes of tuples (and of
    huge ints) can be made to collide at will, which turns building a dict quadratic.
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, recorder: _Recorder) -> None:
        super().__init__(io.BytesIO(data))
        self._rec = recorder

    def find_class(self, module: str, name: str) -> Any:
        return self._rec.find(module, name)

    def persistent_load(self, pid: Any) -> Any:
        return self._rec.persistent_load(pid)

    def _set(self, d: Any, items: list) -> None:
        if type(d) is not dict:
            raise refuse(self._rec.name, f"a dict item set on a {type(d).__name__}")
        for key in items[::2]:
            if not (type(key) in (str, bytes, float, bool) or key is None or (type(key) is int and abs(key) < BIG_INT)):
                raise refuse(self._rec.name, f"a dict key of type {type(key).__name__} ({safe_repr(key)})")
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()  # type: ignore[attr-defined]
        self._set(self.stack[-1], [key, value])  # type: ignore[attr-defined]

    def load_setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self._set(self.stack[-1], items)  # type: ignore[attr-defined]

    dispatch[pickle.SETITEM[0]] = load_setitem  # type: ignore[assignment]
    dispatch[pickle.SETITEMS[0]] = load_setitems  # type: ignore[assignment]


def scan_pickle(data: bytes, name: str, limits: Limits, recorder: _Recorder) -> None:
    """Walk the opcodes without executing any, as :func:`pickletools.genops` does.

    Refuses opcodes that build objects (before reading their argument), memo slots and opcode
    counts beyond the limits, and any global not admitted by :meth:`_Recorder.find`, including
    those a protocol-4 ``STACK_GLOBAL`` names. Opcodes ``torch.load(weights_only=True)`` cannot
    read are refused after the walk, so that a refused global is named first.
    """
    stream, n, op, unsupported = io.BytesIO(data), 0, None, None
    recent: list[Any] = [None, None]  # the last two values pushed, when strings (STACK_GLOBAL's names)
    memo: dict[int, Any] = {}
    while op is None or op.name != "STOP":
        code = stream.read(1)
        op = pickletools.code2op.get(code.decode("latin-1")) if code else None  # type: ignore[attr-defined]
        if op is None:
            raise ValueError(f"unknown opcode {code!r} at byte {stream.tell() - 1}" if code else "no STOP opcode")
        n += 1
        if n > limits.max_pickle_ops:
            raise refuse(name, f"its pickle has more than {limits.max_pickle_ops} opcodes (max_layers={limits.max_layers})")
        if op.name in _CODE_OPCODES:  # refused before its argument is even decoded
            raise UnsafeRotationFileError(
                f"{name}: refused to load: its pickle uses opcode {op.name}, which builds arbitrary objects; "
                f"{limits.what}s hold only tensors and plain data; do not trust this file"
            )
        if op.name not in _ALLOWED_OPCODES:
            unsupported = unsupported or op.name
            if op.name == "STRING":  # a protocol-0 text pickle: not torch's; stop here
                break
        arg = op.arg.reader(stream) if op.arg is not None else None
        if op.name in _MEMO_OPS and not (isinstance(arg, int) and 0 <= arg < limits.max_pickle_ops):
            raise refuse(name, f"its pickle uses memo slot {safe_repr(arg)}")
        if op.name == "GLOBAL":
            module, _, qualname = str(arg).partition(" ")
            recorder.find(module, qualname)
        elif op.name == "STACK_GLOBAL":
            if not all(isinstance(x, str) for x in recent):
                raise UnsafeRotationFileError(f"{name}: refused to load: its pickle computes the name of a global; "
                                              "do not trust this file")
            recorder.find(*recent)
        if op.name in _MEMO_PUT or op.name == "MEMOIZE":
            memo[arg if op.name in _MEMO_PUT else len(memo)] = recent[-1]  # type: ignore[index]
        elif op.name not in _NON_PUSHING:
            pushed = memo.get(arg) if op.name in ("GET", "BINGET", "LONG_BINGET") else arg  # type: ignore[arg-type]
            recent = [recent[-1], pushed if op.name in _STRING_OPS or isinstance(pushed, str) else None]
    if unsupported:
        raise RotationFileError(
            f"{name}: its pickle uses opcode {unsupported}, which torch.load(weights_only=True) does not read; "
            "re-save the file with torch.save's default pickle protocol"
        )


def inspect_pickle(data: bytes, name: str, limits: Limits) -> tuple[Any, _Recorder]:
    """Rebuild ``data.pkl`` with :class:`TensorMeta` records for tensors; typed errors only."""
    rec = _Recorder(name, limits)
    try:
        scan_pickle(data, name, limits, rec)
        obj = _InspectingUnpickler(data, rec).load()
    except RotationFileError:
        raise
    except Exception as exc:  # anything the stdlib raises on malformed bytes
        raise RotationFileError(f"{name}: its pickle is damaged ({type(exc).__name__}: {exc_line(exc)}); "
                                "re-download the file") from None
    return obj, rec


def check_storage_use(name: str, rec: _Recorder, limits: Limits) -> None:
    """Refuse storages much larger than the views on them, and totals beyond ``max_bytes``."""
    covered: dict[str, dict[tuple, int]] = {}
    for t in rec.tensors:
        covered.setdefault(t.storage.key, {})[(t.offset, t.shape, t.stride)] = t.numel  # type: ignore[union-attr]
    total = 0
    for key, s in rec.storages.items():
        used = sum(covered.get(key, {}).values())
        if s.numel > used + STORAGE_SLACK:
            raise refuse(name, f"storage {key} holds {s.numel} elements but its tensors use {used}")
        total += s.numel * s.itemsize
    out = sum(t.numel for t in rec.tensors) * 4  # what loading materialises as fp32
    if max(total, out) > limits.max_bytes_any:
        raise refuse(name, f"its tensors need {max(total, out)} bytes, more than max_bytes={limits.max_bytes_any}{limits.note}")


def _member_kind(rest: str) -> str:
    if rest == "data.pkl":
        return "pickle"
    if rest.startswith("data/") and parse_index(rest[5:]) is not None:
        return "record"
    return "other"


def check_zip_directory(f: IO[bytes], name: str, limits: Limits) -> None:
    """Refuse a zip whose central directory lists more entries than ``limits`` allow, before ``zipfile`` parses it.

    ``zipfile.ZipFile`` builds a ``ZipInfo`` for every entry of the directory, however many there are (a
    55 MB file can list a million). This reads the end of central directory record, and the ZIP64 one
    when present, where ``zipfile`` finds them (the file's last 22 bytes, else the last 64 KiB), checks
    the declared entry count against :attr:`Limits.max_members` and the directory size against that
    count, then walks the directory ``zipfile`` would read, counting its entries (read 64 KiB at a time,
    no object built). A hostile directory is refused in milliseconds with O(1) memory; a file that is not
    a zip, or whose directory is damaged, is left to ``zipfile``'s own error. ``f`` is left at offset 0.

    Raises:
        RotationFileError: more entries declared or listed than ``limits`` allow, or a directory larger
            than its declared entries can take.
    """
    f.seek(0, io.SEEK_END)
    size = f.tell()
    if size < _EOCD.size:
        f.seek(0)
        return
    f.seek(size - _EOCD.size)
    record = f.read(_EOCD.size)
    at = size - _EOCD.size
    if not (record[:4] == b"PK\x05\x06" and record[-2:] == b"\0\0"):  # a comment follows: search as zipfile does
        start = max(size - (1 << 16) - _EOCD.size, 0)
        f.seek(start)
        tail = f.read()  # at most 64 KiB + 22 bytes
        i = tail.rfind(b"PK\x05\x06")
        if i < 0 or len(tail) - i < _EOCD.size:
            f.seek(0)
            return
        at, record = start + i, tail[i:i + _EOCD.size]
    _, _, _, on_disk, total, cd_size, _, _ = _EOCD.unpack(record)
    counts, cd_start = [on_disk, total], at - cd_size
    if at >= _EOCD64_LOCATOR_SIZE + _EOCD64.size:
        f.seek(at - _EOCD64_LOCATOR_SIZE)
        if f.read(4) == b"PK\x06\x07":
            f.seek(at - _EOCD64_LOCATOR_SIZE - _EOCD64.size)
            record64 = f.read(_EOCD64.size)
            if len(record64) == _EOCD64.size and record64[:4] == b"PK\x06\x06":
                *_, on_disk64, total64, cd_size, _ = _EOCD64.unpack(record64)
                counts = [on_disk64, total64] + [n for n in counts if n != 0xFFFF]  # 0xFFFF: "see ZIP64"
                cd_start = at - _EOCD64_LOCATOR_SIZE - _EOCD64.size - cd_size
    declared = max(counts)
    if declared > limits.max_members:
        raise refuse(name, f"the zip archive declares {declared} members, more than the {limits.max_members} a "
                           f"{limits.what} may hold{limits.note}")
    if cd_size > declared * MAX_ZIP_ENTRY_BYTES:
        members = f"{declared} member{'' if declared == 1 else 's'}"
        raise refuse(name, f"its zip central directory of {cd_size} bytes is too large for the {members} it declares "
                           f"(at most {MAX_ZIP_ENTRY_BYTES} bytes each)")
    pos, end, listed, buf, buf_at = cd_start, cd_start + cd_size, 0, b"", 0
    while 0 <= pos < end:  # the entries zipfile will parse, read 64 KiB at a time: O(1) memory
        i = pos - buf_at
        if not 0 <= i <= len(buf) - _CD_ENTRY_SIZE:
            f.seek(pos)
            buf, buf_at, i = f.read(1 << 16), pos, 0
        if len(buf) - i < _CD_ENTRY_SIZE or buf[i:i + 4] != b"PK\x01\x02":
            break  # damaged: zipfile says so
        listed += 1
        if listed > declared:
            raise refuse(name, f"its zip central directory lists more entries than the {declared} it declares")
        name_len, extra_len, comment_len = struct.unpack_from("<3H", buf, i + 28)
        pos += _CD_ENTRY_SIZE + name_len + extra_len + comment_len
    f.seek(0)


def check_members(name: str, infos: list[zipfile.ZipInfo], limits: Limits) -> tuple[str, dict[str, zipfile.ZipInfo]]:
    """Check the archive directory; return ``data.pkl``'s name and the tensor records by key."""
    if len(infos) > limits.max_members:
        raise refuse(name, f"the archive has {len(infos)} members (max_layers={limits.max_layers})")
    prefixes, names, records, pkl, total = set(), set(), {}, None, 0
    for info in infos:
        prefix, sep, rest = info.filename.partition("/")
        if not sep or not rest or prefix in ("", ".", "..") or "\\" in info.filename or "\0" in info.filename:
            raise refuse(name, f"an archive member named {safe_repr(info.filename)}")
        if info.filename in names:
            raise refuse(name, f"the archive holds {safe_repr(info.filename)} twice")
        names.add(info.filename)
        prefixes.add(prefix)
        if info.flag_bits & 0x1 or info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise refuse(name, f"member {safe_repr(rest)} is encrypted or compressed (method {info.compress_type}); torch.save "
                               "stores every member, so a file holds no more than its size; re-save it with torch.save")
        kind = _member_kind(rest)
        cap, label = {"pickle": (limits.max_pickle_bytes, f"limit for max_layers={limits.max_layers}"),
                      "record": (limits.max_bytes_any, "max_bytes"), "other": (SMALL_MEMBER_BYTES, "limit")}[kind]
        if info.file_size > cap:
            raise refuse(name, f"member {safe_repr(rest)} declares {info.file_size} bytes ({label}={cap}{limits.note})")
        if kind == "record":
            records[rest[5:]] = info
            total += info.file_size
        elif kind == "pickle":
            pkl = info.filename
    if len(prefixes) != 1 or pkl is None:
        raise RotationFileError(f"{name}: not a torch archive (expected one folder with data.pkl); re-save it with torch.save")
    if total > limits.max_bytes_any:
        raise refuse(name, f"its tensor records declare {total} bytes, more than max_bytes={limits.max_bytes_any}{limits.note}")
    return pkl, records


def inspect_torch_zip(path: Path, limits: Limits, *, fileobj: IO[bytes] | None = None, check_crc: bool = True) -> tuple[Any, _Recorder]:
    """Check a torch ``.pt`` zip archive (``fileobj`` if given, named ``path``) and its pickle; return the pickle
    rebuilt with metadata only. ``check_crc=False`` skips reading every member for its CRC (large dump chunks).

    Raises:
        UnsafeRotationFileError: the pickle references a global other than torch's dense tensor rebuild.
        RotationFileError: damaged archive, or a declared size, view or count (of members: read from the zip's
            end record before ``zipfile`` parses its directory, :func:`check_zip_directory`) beyond ``limits``.
    """
    name = str(path)
    try:
        with ExitStack() as stack:
            f = fileobj if fileobj is not None else stack.enter_context(open(path, "rb"))
            check_zip_directory(f, name, limits)  # before zipfile parses the directory
            zf = stack.enter_context(zipfile.ZipFile(f))
            if zf.comment or min((i.header_offset for i in zf.infolist()), default=0) != 0:
                # torch.save writes neither; either lets two zip readers disagree on the contents
                raise refuse(name, "a zip with a comment or with data before its first member")
            pkl, records = check_members(name, zf.infolist(), limits)
            data = zf.read(pkl)  # zipfile checks the CRC; size already bounded
            obj, rec = inspect_pickle(data, name, limits)
            for key, s in rec.storages.items():
                info = records.get(key)
                if info is None or info.file_size != s.numel * s.itemsize:
                    found = "missing" if info is None else f"{info.file_size} bytes"
                    raise refuse(name, f"storage {key} declares {s.numel * s.itemsize} bytes, its record is {found}")
            unused = sorted(set(records) - set(rec.storages))
            if unused:
                raise refuse(name, f"the archive holds tensor records no tensor uses ({', '.join(unused[:4])})")
            check_storage_use(name, rec, limits)
            bad = zf.testzip() if check_crc else None  # every remaining member, now that sizes are bounded
    except RotationFileError:
        raise
    except Exception as exc:  # zipfile raises many types on damaged bytes
        raise RotationFileError(f"{name}: damaged zip archive ({type(exc).__name__}: {exc_line(exc)}); "
                                "re-download the file") from None
    if bad is not None:
        raise RotationFileError(f"{name}: damaged zip member {safe_repr(bad)} (CRC mismatch); re-download the file")
    return obj, rec


def refuse_legacy_pickle(path: Path, limits: Limits) -> None:
    """Refuse a pre-zip (legacy) torch file, naming any code it would run; always raises."""
    name = str(path)
    with open_regular(path, what="rotation file", error=RotationFileError) as f:
        data = f.read(limits.max_pickle_bytes)
    try:
        inspect_pickle(data, name, limits)
    except UnsafeRotationFileError:
        raise
    except RotationFileError:
        pass
    raise RotationFileError(
        f"{name}: legacy (non-zip) torch serialization is not supported; re-save it with torch.save "
        "from torch >= 1.6 or write safetensors"
    )
