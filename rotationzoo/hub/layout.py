"""Where things live under the cache root, and the verification markers beside cached files.

Layout under ``ROTATIONZOO_CACHE`` (default: the platform user cache dir)::

    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt          verified file
    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt.verified  marker (sha256, size, mtime, source)
    derived/models--Qwen--Qwen3-8B/<tag>/oscar-rot-kv.gguf                 built from verified files
    derived/models--Qwen--Qwen3-8B/<tag>/oscar-rot-kv.gguf.verified        marker (sha256, size, inputs)
    derived/local/<id>/oscar-rot-kv.gguf                                   built from local files
    hub/huggingface/ , hub/modelscope/                                     the clients' own caches
    locks/models--Qwen--Qwen3-8B--<tag>.lock                               one lock per entry

Every file under ``files/`` and ``derived/`` has a marker; ``rotationzoo cache ls / verify / rm``
know both areas.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import config
from ..registry import TagEntry

MARKER_SUFFIX = ".verified"
FILES_AREA = "files"
DERIVED_AREA = "derived"
HUB_AREA = "hub"
LOCKS_AREA = "locks"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir`` when given, else ``ROTATIONZOO_CACHE`` or the user cache dir."""
    return Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir()


def model_folder(model_id: str) -> str:
    """``Qwen/Qwen3-8B`` → ``models--Qwen--Qwen3-8B``."""
    return "models--" + model_id.replace("/", "--")


def _tag_folder(entry: TagEntry, revision: str | None) -> str:
    return (entry.name + (f"@{revision}" if revision else "")).replace("/", "--")


def entry_dir(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    """Folder of an entry's verified files."""
    return root / FILES_AREA / model_folder(entry.model_id) / _tag_folder(entry, revision)


def derived_dir(root: Path, entry: TagEntry | None = None, local_id: str | None = None) -> Path:
    """Folder of files built from an entry's verified files (or from local files, by ``local_id``)."""
    if entry is not None:
        return root / DERIVED_AREA / model_folder(entry.model_id) / _tag_folder(entry, None)
    if not local_id:
        raise ValueError("derived_dir needs an entry or a local_id")
    return root / DERIVED_AREA / "local" / local_id


def lock_path(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    """The lock held while an entry's files are downloaded."""
    name = f"{model_folder(entry.model_id)}--{entry.name}" + (f"@{revision}" if revision else "")
    return root / LOCKS_AREA / (name.replace("/", "--") + ".lock")


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of ``path`` as a dict, or ``None`` when absent or unreadable."""
    try:
        with open(marker_path(path), encoding="utf-8") as f:
            data = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, OSError):
        return None
    return data if isinstance(data, dict) else None


def write_marker(path: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """Write ``marker`` beside ``path`` atomically (with the file's current size and mtime)."""
    st = path.stat()
    marker = {**marker, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    mp = marker_path(path)
    tmp = mp.with_name(mp.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, mp)
    return marker


def purge(paths: Any) -> None:
    """Remove files (and symlinks), ignoring those already gone."""
    for p in paths:
        try:
            if p.is_symlink() or p.exists():
                p.unlink()
        except OSError:
            pass
