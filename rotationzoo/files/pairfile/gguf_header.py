"""A bounded walk over a GGUF file's header, before ``gguf.GGUFReader`` parses it.

The reader builds Python objects for every key, array item and tensor of a header, so a 16 MB array of
2M empty strings cost it 33 s and 3.4 GB. :func:`scan_gguf_header` reads the header with ordinary
buffered reads, skips values without decoding them, checks every length against the file's size, and
refuses a header that declares more than a model GGUF holds or more than a file of its size may cost
the reader. :mod:`~rotationzoo.files.pairfile.gguf` runs it before every ``GGUFReader`` (pair files and
``--base-gguf`` bases).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import IO

from ..limits import MAX_LAYERS, safe_repr
from ...errors import ExportError, RotationZooError
from ...safefile import open_regular

# Bounds of the GGUF header pre-scan (:func:`scan_gguf_header`), checked before ``gguf.GGUFReader`` parses a file:
# the reader builds Python objects for every key, array item and tensor of the header, about 3 KB per key, 0.7 KB
# per number and 1.6 KB per string in an array, 5 KB per tensor (and 6 to 60 µs each), so a 16 MB array of 2M
# empty strings cost it 33 s and 3.4 GB. Files read here are rotations-only GGUFs (a few keys, ≤ 2 tensors per
# layer) and model GGUFs with rotations appended or given as ``--base-gguf``; the numbers below let the largest
# model GGUFs through several times over.
#: Most metadata keys a GGUF may hold (model files hold 20 … 60; llama.cpp's own tools write under 100).
MAX_GGUF_KEYS = 1 << 16
#: Most tensors a GGUF may describe: a model holds under 32 per layer (:data:`MAX_LAYERS` layers), plus rotations.
MAX_GGUF_TENSORS = 64 * MAX_LAYERS
#: Most items over all metadata arrays: the largest tokenizers hold about 1M (262,144 tokens with scores and
#: types; 200k tokens with 450k BPE merges).
MAX_GGUF_ARRAY_ITEMS = 1 << 22
#: Most bytes of strings (keys, values, array items, tensor names) in a header: tokenizers take 2 … 40 MB.
MAX_GGUF_STRING_BYTES = 128 << 20
#: Most dimensions of a tensor (``GGML_MAX_DIMS``).
MAX_GGUF_DIMS = 4
#: What the header may cost the reader, relative to the file's size: each key counts 4 units, each array number
#: 1, each array string 2, each tensor 8 (about a kilobyte of the reader's memory per unit), and a file may
#: describe :data:`GGUF_UNIT_FLOOR` units plus one per :data:`GGUF_BYTES_PER_UNIT` bytes of its size. A model's
#: tokenizer alone takes 8 … 20 bytes per unit on disk, its weights far more; a hostile header packing keys,
#: empty strings or tensors as densely as GGUF allows (1 … 24 bytes each) exceeds the allowance, so a small
#: file never makes the reader build more than about 2 × GGUF_UNIT_FLOOR units (a few tens of MB, under 0.5 s).
GGUF_BYTES_PER_UNIT = 8
GGUF_UNIT_FLOOR = 1 << 14
_KEY_UNITS, _TENSOR_UNITS = 4, 8
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> size
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
               8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
_SCAN_CHUNK = 1 << 20


class _HeaderScan:
    """Bounded reads over an open GGUF: ordinary buffered reads of at most :data:`_SCAN_CHUNK` bytes at a time,
    every length checked against the file's size before it is skipped; nothing is mapped or decoded."""

    def __init__(self, f: IO[bytes], size: int, path: Path, error: type[RotationZooError] = ExportError) -> None:
        self.f, self.size, self.path, self.error = f, size, path, error
        self.buf, self.i, self.base = b"", 0, 0  # self.buf holds the file's bytes from offset self.base
        self.u32, self.u64 = struct.Struct("<I"), struct.Struct("<Q")

    def fail(self, what: str) -> RotationZooError:
        return self.error(f"{self.path}: cannot read GGUF: {what}")

    def past_end(self, what: str, n: int) -> RotationZooError:
        return self.fail(f"{what} of {n} bytes at byte {self.base + self.i} runs past the end of the file "
                         f"({self.size} bytes); the file is cut short or damaged")

    def read(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes (``n`` small: a number, or the first bytes of a key for messages)."""
        if self.i + n > len(self.buf):
            pos = self.base + self.i
            if pos + n > self.size:
                raise self.past_end(what, n)
            self.f.seek(pos)
            self.buf, self.i, self.base = self.f.read(max(n, _SCAN_CHUNK)), 0, pos
            if len(self.buf) < n:
                raise self.past_end(what, n)
        out = self.buf[self.i:self.i + n]
        self.i += n
        return out

    def number(self, st: struct.Struct, what: str) -> int:
        value: int = st.unpack(self.read(st.size, what))[0]
        return value

    def skip(self, n: int, what: str) -> None:
        pos = self.base + self.i
        if n > self.size - pos:
            raise self.past_end(what, n)
        if self.i + n <= len(self.buf):
            self.i += n
        else:
            self.buf, self.i, self.base = b"", 0, pos + n

    def string(self, what: str, keep: int = 0) -> tuple[int, bytes]:
        """Skip a GGUF string (u64 length, bytes); return its length and its first ``keep`` bytes."""
        n = self.number(self.u64, what)
        if n > self.size:
            raise self.past_end(what, n)
        head = self.read(min(n, keep), what) if keep else b""
        self.skip(n - len(head), what)
        return n, head

    def strings(self, count: int, what: str) -> int:
        """Skip ``count`` strings of an array; return their total length."""
        total = 0
        for _ in range(count):
            total += self.string(what)[0]
        return total


def scan_gguf_header(path: Path, *, error: type[RotationZooError] = ExportError) -> None:
    """Walk a GGUF's header (magic, version, tensor and key counts, every key and value, every tensor's name,
    dimensions, type and offset) without building anything for the values, and refuse one that declares more
    than a model GGUF holds (:data:`MAX_GGUF_KEYS`, :data:`MAX_GGUF_TENSORS`, :data:`MAX_GGUF_ARRAY_ITEMS`,
    :data:`MAX_GGUF_STRING_BYTES`, and what a file of its size may cost the reader: :data:`GGUF_BYTES_PER_UNIT`)
    or whose lengths run past its end. Run before ``gguf.GGUFReader``, which parses all of it into Python objects.

    Raises:
        error: (``ExportError`` unless given) not a regular file, a GGUF version other than 2 or 3, a count or
            length beyond the bounds, an array of arrays or an unknown value type, or a header cut short.
    """
    with open_regular(path, what="GGUF file", error=error) as f:
        size = os.fstat(f.fileno()).st_size
        h = _HeaderScan(f, size, path, error)
        if h.read(4, "the magic") != b"GGUF":
            raise h.fail("no GGUF magic")
        raw = h.read(4, "the version")
        if not int.from_bytes(raw, "little") & 0xFFFF:  # as gguf.GGUFReader decides: a big-endian file
            h.u32, h.u64 = struct.Struct(">I"), struct.Struct(">Q")
        version = h.u32.unpack(raw)[0]
        if version not in (2, 3):
            raise h.fail(f"version {version}; expected 2 or 3")
        tensors, keys = h.number(h.u64, "the tensor count"), h.number(h.u64, "the key count")
        if keys > MAX_GGUF_KEYS or tensors > MAX_GGUF_TENSORS:
            raise h.fail(f"the header declares {keys} metadata keys and {tensors} tensors; a model GGUF holds at most "
                         f"{MAX_GGUF_KEYS} keys and {MAX_GGUF_TENSORS} tensors")
        allowance = GGUF_UNIT_FLOOR + size // GGUF_BYTES_PER_UNIT
        units, items, text = keys * _KEY_UNITS + tensors * _TENSOR_UNITS, 0, 0

        def spend(what: str) -> None:
            if items > MAX_GGUF_ARRAY_ITEMS:
                raise h.fail(f"{what}, more than {MAX_GGUF_ARRAY_ITEMS} array items in all; the largest model "
                             "tokenizers hold about 1M")
            if units > allowance:
                raise h.fail(f"{what}, more metadata than a GGUF of {size} bytes may hold (at most {allowance} units, "
                             f"counting 1 per array number, 2 per array string, {_KEY_UNITS} per key and "
                             f"{_TENSOR_UNITS} per tensor); the file is cut short, damaged or hostile")
            if text > MAX_GGUF_STRING_BYTES:
                raise h.fail(f"{what}, more than {MAX_GGUF_STRING_BYTES} bytes of strings; a model's tokenizer takes "
                             "under 40 MB")

        spend("the header")
        for k in range(keys):
            n, head = h.string(f"key {k}", keep=64)
            key = safe_repr(head.decode("utf-8", "replace") + ("…" if n > len(head) else ""))
            text += n
            kind = h.number(h.u32, f"the type of key {key}")
            if kind in _SCALAR_BYTES:
                h.skip(_SCALAR_BYTES[kind], f"key {key}")
            elif kind == _STRING:
                text += h.string(f"key {key}")[0]
            elif kind == _ARRAY:
                item, count = h.number(h.u32, f"key {key}"), h.number(h.u64, f"key {key}")
                if item not in _SCALAR_BYTES and item != _STRING:
                    raise h.fail(f"key {key} is an array of {_TYPE_NAMES.get(item, f'type {item}')}; GGUF arrays "
                                 "hold numbers or strings")
                items += count
                units += count * (2 if item == _STRING else 1)
                spend(f"key {key} is an array of {count} {_TYPE_NAMES[item]} items")
                if item == _STRING:
                    text += h.strings(count, f"a string of key {key}")
                else:
                    h.skip(count * _SCALAR_BYTES[item], f"key {key}'s array")
            else:
                raise h.fail(f"key {key} has unknown value type {kind}")
            spend(f"key {key}")
        for t in range(tensors):
            n, head = h.string(f"the name of tensor {t}", keep=64)
            text += n
            dims = h.number(h.u32, f"tensor {t}")
            if dims > MAX_GGUF_DIMS:
                raise h.fail(f"tensor {safe_repr(head.decode('utf-8', 'replace'))} has {dims} dimensions; "
                             f"expected at most {MAX_GGUF_DIMS}")
            h.skip(8 * dims + 4 + 8, f"tensor {t}")  # dims, type, offset
        spend("the tensor names")


__all__ = ["GGUF_BYTES_PER_UNIT", "GGUF_UNIT_FLOOR", "MAX_GGUF_ARRAY_ITEMS", "MAX_GGUF_DIMS", "MAX_GGUF_KEYS",
           "MAX_GGUF_STRING_BYTES", "MAX_GGUF_TENSORS", "scan_gguf_header"]
