"""Managing the cache: list, verify and remove what it holds, and record files derived from it.

Two areas hold files (see :mod:`rotationzoo.hub.layout`): ``files/`` (verified downloads) and
``derived/`` (files built from verified inputs, e.g. the rotations GGUF that ``serve-args
--engine llamacpp`` writes). Both carry markers; :func:`verify_cache` checks each file against its
marker (and, for downloads, the registry; for derived files, that their inputs are still the
verified ones) and never removes a file that passes. Hidden download-in-progress files left by a
killed process (``.url-*.part``, ``.*.tmp``) are listed as area ``"partial"``; :func:`verify_cache`
removes those whose entry no download is holding (its lock is free).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import RotationZooError
from ..hashing import sha256_file
from ..registry import TagEntry, get_model, load_registry
from .layout import (
    DERIVED_AREA,
    FILES_AREA,
    HUB_AREA,
    LOCKS_AREA,
    MARKER_SUFFIX,
    cache_root,
    derived_dir,
    inside,
    is_orphan_name,
    marker_path,
    model_folder,
    purge,
    read_marker,
    write_marker,
)

#: The area of download-in-progress files (orphans when no download holds their entry's lock).
PARTIAL_AREA = "partial"


@dataclass
class CacheRecord:
    """One file in the cache, as its marker describes it.

    Attributes:
        area: ``"files"`` (a verified download), ``"derived"`` (built from verified files) or
            ``"partial"`` (a download in progress, or left by a killed process).
        side: ``"k"`` / ``"v"`` for downloads; ``None`` for derived files.
        inputs: for derived files, the sha256 of each input side it was built from.
    """

    path: Path
    area: str
    model: str | None
    tag: str | None
    side: str | None
    size: int
    sha256: str | None
    source: str | None
    inputs: dict[str, str] | None = None
    ok: bool | None = None
    problem: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def _records(root: Path, area: str) -> list[CacheRecord]:
    base = root / area
    out: list[CacheRecord] = []
    if not base.is_dir():
        return out
    for p in sorted(base.rglob("*")):
        if p.is_symlink():
            out.append(CacheRecord(p, area, None, None, None, 0, None, None, problem="a symlink (never served)"))
            continue
        if not p.is_file() or p.name.endswith(MARKER_SUFFIX):
            continue
        if p.name.startswith("."):
            if is_orphan_name(p.name):
                out.append(CacheRecord(p, PARTIAL_AREA, None, None, None, p.stat().st_size, None, None,
                                       problem="download in progress or left by a killed process"))
            continue
        m = read_marker(p) or {}
        out.append(CacheRecord(p, area, m.get("model"), m.get("tag"), m.get("side"), p.stat().st_size,
                               m.get("sha256"), m.get("source"), m.get("inputs")))
    return out


def cache_records(cache_dir: str | os.PathLike[str] | None = None) -> list[CacheRecord]:
    """Every file in the verified-files and derived areas of the cache, with its marker if any."""
    root = cache_root(cache_dir)
    return _records(root, FILES_AREA) + _records(root, DERIVED_AREA)


def _verified_inputs(root: Path) -> dict[tuple[str | None, str | None], dict[str, str]]:
    """``{(model, tag): {side: sha256}}`` of the downloads whose markers are present."""
    out: dict[tuple[str | None, str | None], dict[str, str]] = {}
    for r in _records(root, FILES_AREA):
        if r.side and r.sha256:
            out.setdefault((r.model, r.tag), {})[r.side] = r.sha256
    return out


def _problem(r: CacheRecord, sha: str, registry_sha: str | None, inputs_now: Mapping[str, str] | None) -> str | None:
    if r.sha256 is None:
        return "no verification marker"
    if sha != r.sha256:
        return f"sha256 {sha} differs from the verified {r.sha256} (changed on disk)"
    if registry_sha is not None and sha != registry_sha:
        return f"sha256 {sha} differs from the registry's {registry_sha}"
    if r.area == DERIVED_AREA and r.inputs and inputs_now is not None:
        stale = [s for s, h in r.inputs.items() if s in inputs_now and inputs_now[s] != h]
        if stale:
            return f"built from {'+'.join(stale).upper()} files that are no longer the verified ones (stale)"
    return None


def verify_cache(cache_dir: str | os.PathLike[str] | None = None, *, remove_bad: bool = True) -> list[CacheRecord]:
    """Re-hash every cached file against its marker (downloads also against the registry, derived
    files against the verified inputs they were built from); remove the bad ones."""
    root = cache_root(cache_dir)
    reg = load_registry()
    inputs = _verified_inputs(root)
    records = cache_records(root)
    for r in records:
        if r.area == PARTIAL_AREA:
            r.ok = False
            if remove_bad and _unlocked(root, r.path):
                purge([r.path])
                r.problem = "left by a killed download (removed)"
            continue
        if r.path.is_symlink():
            r.ok = False
            if remove_bad:
                purge([r.path, marker_path(r.path)])
            continue
        registry_sha = None
        if r.area == FILES_AREA and r.model and r.tag and r.side:
            try:
                registry_sha = reg.entry(r.model, r.tag).files[r.side].sha256
            except RotationZooError:
                registry_sha = None
        problem = _problem(r, sha256_file(r.path), registry_sha, inputs.get((r.model, r.tag)))
        r.ok, r.problem = problem is None, problem
        if not r.ok and remove_bad:
            purge([r.path, marker_path(r.path)])
    return records


def _unlocked(root: Path, path: Path) -> bool:
    """True when no download holds the lock of the entry folder ``path`` is in."""
    from filelock import FileLock, Timeout

    folder = path.parent
    lock = root / LOCKS_AREA / f"{folder.parent.name}--{folder.name}.lock"
    if not lock.exists():
        return True
    try:
        with FileLock(str(lock), timeout=0):
            return True
    except Timeout:
        return False


def remove_cached(model: str | None = None, tag: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete cached files (all, one model, or one model+tag), derived files included; returns what was removed."""
    removed: list[Path] = []
    root = cache_root(cache_dir)
    if model is None:
        for sub in (FILES_AREA, DERIVED_AREA, HUB_AREA):
            d = root / sub
            if d.exists():
                removed.extend(p for p in d.rglob("*") if p.is_file())
                shutil.rmtree(d)
        return removed
    m = get_model(model)
    want = None if tag is None else m.tag(tag).name
    for area in (FILES_AREA, DERIVED_AREA):
        base = inside(root, root / area / model_folder(m.id))
        for d in [base] if want is None else [d for d in base.glob("*") if d.name.split("@")[0] == want]:
            if d.exists() and not d.is_symlink():
                removed.extend(p for p in d.rglob("*") if p.is_file())
                shutil.rmtree(d)
    return removed


# -- derived files ---------------------------------------------------------------------------------


def derived_path(name: str, *, entry: TagEntry | None = None, inputs: Mapping[str, str] | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a file derived from ``entry``'s verified files (or from local files with ``inputs``
    sha256s) is kept: ``derived/<model>/<tag>/<name>`` or ``derived/local/<id>/<name>``.

    ``inputs`` maps each side to the sha256 of the bytes it was read from (never to a hash a file
    merely records about itself); ``<id>`` is made from all of them, so other bytes get another folder.

    Raises:
        CacheError: no entry and no inputs, an input that is not a 64-hex sha256, or a ``name``
            that is not a plain file name.
    """
    import hashlib
    import re

    from ..errors import CacheError

    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", name) or name.endswith(MARKER_SUFFIX):
        raise CacheError(f"derived file name {name!r} must be a plain file name (letters, digits and . _ -)")
    root = cache_root(cache_dir)
    if entry is not None:
        return derived_dir(root, entry) / name
    if not inputs:
        raise CacheError("a derived file needs a registry entry or the sha256 of the files it is built from")
    bad = {k: v for k, v in inputs.items() if not (isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v))}
    if bad:
        raise CacheError(f"derived file inputs must be 64-hex sha256s, got {bad!r}"[:300])
    local_id = hashlib.sha256(",".join(f"{s}={h}" for s, h in sorted(inputs.items())).encode()).hexdigest()[:16]
    return derived_dir(root, local_id=local_id) / name


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
    return path.stat().st_size == marker["size"] and sha256_file(path) == marker.get("sha256")
