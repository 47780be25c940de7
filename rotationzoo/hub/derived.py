"""Files derived from the cache's verified files (``derived/``): where each is kept, its marker (the sha256 of the
inputs it was built from), whether a kept one can be served, and the lock its writer holds (see
:mod:`rotationzoo.files.derived` for what is derived).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import CacheError
from ..hashing import sha256_file
from ..registry import TagEntry
from .layout import MARKER_SUFFIX, cache_root, derived_dir, hold_entry, read_marker, write_marker

#: How long a writer of a derived file waits for another process that holds its folder's lock.
DERIVED_LOCK_WAIT_S = 60.0


def derived_path(name: str, *, entry: TagEntry | None = None, inputs: Mapping[str, str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a file derived from ``entry``'s verified files (or from local files with ``inputs``
    sha256s) is kept: ``derived/<model>/<tag>/<id>/<name>`` or ``derived/local/<id>/<name>``.

    ``inputs`` maps each side to the sha256 of the bytes it was read from (never to a hash a file
    merely records about itself); ``<id>`` is made from all of them, so other bytes get another folder
    (two revisions of one tag never share a derived file).

    Raises:
        CacheError: no inputs, an input that is not a 64-hex sha256, or a ``name``
            that is not a plain file name.
    """
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", name) or name.endswith(MARKER_SUFFIX):
        raise CacheError(f"derived file name {name!r} must be a plain file name (letters, digits and . _ -)")
    root = cache_root(cache_dir)
    if not inputs:
        raise CacheError("a derived file needs the sha256 of the files it is built from")
    bad = {k: v for k, v in inputs.items() if not (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v))}
    if bad:
        raise CacheError(f"derived file inputs must be 64-hex sha256s, got {bad!r}"[:300])
    local_id = hashlib.sha256(",".join(f"{s}={h}" for s, h in sorted(inputs.items())).encode()).hexdigest()[:16]
    return derived_dir(root, entry, local_id=local_id) / name


def record_derived(path: Path, *, inputs: Mapping[str, str], entry: TagEntry | None = None) -> dict[str, Any]:
    """Write the marker of a derived file: its sha256 and the sha256 of each input it was built from."""
    return write_marker(path, {
        "kind": "derived",
        "model": entry.model_id if entry is not None else None,
        "tag": entry.name if entry is not None else None,
        "sha256": sha256_file(path),
        "inputs": dict(inputs),
        "source": "derived",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })


def derived_hit(path: Path, inputs: Mapping[str, str]) -> bool:
    """True when ``path`` is a regular file (not a link) whose bytes match its marker, built from
    exactly ``inputs`` (the sha256 of each side it was made from)."""
    marker = read_marker(path)
    if marker is None or path.is_symlink() or not path.is_file() or marker.get("inputs") != dict(inputs):
        return False
    try:
        return path.stat().st_size == marker["size"] and sha256_file(path, error=CacheError) == marker.get("sha256")
    except (OSError, CacheError):
        return False


@contextlib.contextmanager
def writing_derived(path: Path, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold the lock of the folder of the derived file ``path`` (of the cache at ``cache_dir``, see
    :func:`derived_path`) while it is written and its marker recorded, so that ``cache verify`` never takes it
    for a file without a marker (or judges it against the marker before).

    Raises:
        CacheError: another process held the lock for :data:`DERIVED_LOCK_WAIT_S` seconds, or it cannot be made.
    """
    root = cache_root(cache_dir)
    with hold_entry(root, path.parent, what=f"write of {path.name} in {path.parent}", timeout=DERIVED_LOCK_WAIT_S):
        yield


__all__ = ["DERIVED_LOCK_WAIT_S", "derived_hit", "derived_path", "record_derived", "writing_derived"]
