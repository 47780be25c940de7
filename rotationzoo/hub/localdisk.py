"""The local disk's failures while fetching: a download that cannot be written is not a source's failure.

A write refused for lack of room or by a limit (``ENOSPC``, ``EDQUOT``, ``EFBIG``: ``ulimit -f``), on
a read-only file system (``EROFS``), or a file the process may not create (``EACCES`` / ``EPERM`` on a
named file) fails every source alike. It is reported as one :class:`~rotationzoo.errors.CacheError`
line naming the folder, the system's reason and what to do (:func:`disk_error`), never retried or
failed over as if the network had dropped it. :func:`check_room` refuses before a download a file
that cannot fit: larger than the free space, or than the process's file size limit.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import CacheError

#: Errors that only a local file system gives.
_DISK = frozenset(getattr(errno, n) for n in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS") if hasattr(errno, n))
#: Errors that are the disk's when they name a file (a socket's never do).
_DENIED = frozenset({errno.EACCES, errno.EPERM})

_WHAT_TO_DO = {
    errno.ENOSPC: "free disk space",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
    errno.EROFS: "the file system is read-only",
    getattr(errno, "EDQUOT", -1): "free space within your disk quota",
}


def local_write_error(exc: BaseException) -> OSError | None:
    """The local file system's error behind ``exc`` (itself, or a cause or context the clients wrapped
    it in), or ``None`` when ``exc`` is something else (a network failure)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(seen) < 8 and all(e is not s for s in seen):
        seen.append(e)
        if isinstance(e, OSError) and (e.errno in _DISK or (e.errno in _DENIED and e.filename)):
            return e
        e = e.__cause__ or e.__context__
    return None


def disk_error(err: OSError, folder: Path) -> CacheError:
    """One line for a write into ``folder`` that the file system refused with ``err``."""
    name = errno.errorcode.get(err.errno or 0, "")
    reason = f"{err.strerror or err}" + (f", {name}" if name else "")
    todo = _WHAT_TO_DO.get(err.errno or 0, "check the folder's permissions")
    return CacheError(f"cannot write into the cache folder {folder} ({reason}); {todo}, or set ROTATIONZOO_CACHE "
                      f"(--cache-dir) to another folder")


def check_room(folders: list[Path], size: int, what: str = "the file") -> None:
    """Refuse ``what``, a file of ``size`` bytes, that cannot be written into ``folders`` (those that
    exist): larger than the process's file size limit, or than the free space.

    Raises:
        CacheError: one line naming the folder, the size and the room there.
    """
    try:
        import resource

        soft, unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)[0], resource.RLIM_INFINITY
    except (ImportError, OSError, ValueError):  # not POSIX
        soft = unlimited = -1
    if soft not in (-1, unlimited) and size > soft:
        raise CacheError(f"{what} needs {size} B, more than this process's file size limit of {soft} B "
                         f"(ulimit -f); raise the limit")
    for folder in folders:
        try:
            st = os.statvfs(folder)
        except (OSError, AttributeError):  # not there yet, or no statvfs
            continue
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise CacheError(f"cannot write into the cache folder {folder}: {what} needs {size} B, and "
                             f"{free} B are free; free disk space, or set ROTATIONZOO_CACHE (--cache-dir) to "
                             f"another folder")
