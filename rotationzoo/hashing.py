"""File hashing shared by the cache, validation, fitting and publishing (no torch import)."""

from __future__ import annotations

import hashlib
import os


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
