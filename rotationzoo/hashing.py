"""File hashing shared by the cache, validation, fitting and publishing (no torch import)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable, TypeVar

from .errors import RotationFileError, RotationZooError
from .safefile import open_regular

_T = TypeVar("_T")


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20, *,
                error: type[RotationZooError] = RotationFileError) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks.

    Only a regular file is opened (:func:`~rotationzoo.safefile.open_regular`): a FIFO, a device or
    a ``/proc`` file raises ``error`` at once instead of blocking or never ending.
    """
    h = hashlib.sha256()
    with open_regular(path, what="file", error=error) as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def read_hashed(path: str | os.PathLike[str], read: Callable[[Path], _T]) -> tuple[_T, str]:
    """``read(path)`` and the sha256 of the bytes it read.

    The file is hashed once; its identity, size and modification and change times are compared
    before the hash and after the read, so a file written to in between is refused instead of
    being described by bytes it no longer holds.

    Raises:
        RotationFileError: the file changed while it was read.
    """
    p = Path(path)
    before = _stat_key(p)
    sha = sha256_file(p)
    out = read(p)
    if _stat_key(p) != before:
        raise RotationFileError(f"{p}: changed while it was read; read it again once nothing writes to it")
    return out, sha
