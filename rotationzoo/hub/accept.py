"""Taking a download into the cache: a bounded copy out of the client's cache, checked before it is kept.

The copy is made into a temporary file beside the file's place in the cache (never more bytes than
the registry's size, or :data:`~.sources.MAX_DOWNLOAD_BYTES` for an unpinned file), and that copy —
not the client's file, which may change meanwhile — is checked (size, sha256, structure); only a good
copy gets its marker and is renamed into place (see :mod:`.fetch`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import CacheError
from ..registry import FileEntry, TagEntry
from ..safefile import open_regular
from .checks import check_downloaded as _check
from .layout import inside, remove_inside
from .network import Unavailable
from .sources import Download, download_cap


def _copy_at_most(src: BinaryIO, out: BinaryIO, cap: int) -> int:
    """Copy ``src`` into ``out``, stopping once more than ``cap`` bytes were read; the bytes read."""
    total = 0
    while block := src.read(min(1 << 20, cap + 1 - total)):
        total += len(block)
        if total > cap:
            break
        out.write(block)
    return total


def inside_download(root: Path, got: Download) -> None:
    """Refuse a download whose file (or what it links to) lies outside the cache root: a link planted
    in a hub client's cache is never read, and what it points to is never removed."""
    for p in [got.path, *got.purge]:
        try:
            inside(root, p)
        except CacheError:
            raise CacheError(f"the downloaded file {got.path} resolves to {p.resolve()}, outside the cache root "
                             f"{root.resolve()}; refusing to read or remove it; remove the link") from None


def accept(got: Download, target: Path, f: FileEntry, entry: TagEntry, root: Path,
           place: Callable[[Path, str], dict]) -> tuple[str | None, str, dict | None]:
    """Copy a download out of the client's cache into a temporary file beside ``target`` (never more
    than the registry's size, or :data:`~.sources.MAX_DOWNLOAD_BYTES` unpinned: ``Unavailable``, kind ``too_large``),
    check the copy, and when it is good call ``place(copy, sha256)`` (pin check, marker from the copy)
    and only then rename the copy to ``target``. Returns (problem or None, sha256, the marker written)."""
    inside_download(root, got)
    cap = download_cap(f)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{f.filename}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, open_regular(got.path, what="downloaded file", error=CacheError) as src:
            if os.fstat(src.fileno()).st_size > cap or _copy_at_most(src, out, cap) > cap:
                raise Unavailable(f"the downloaded file has more than the expected {cap} B", "too_large")
        problem, sha = _check(tmp, f, entry)
        marker = None
        if problem is None:
            marker = place(tmp, sha)
            os.replace(tmp, target)
        return problem, sha, marker
    finally:
        remove_inside(root, [tmp])
