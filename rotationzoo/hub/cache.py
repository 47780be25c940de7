"""Managing the cache: list, verify and remove what it holds.

Two areas hold files (see :mod:`rotationzoo.hub.layout`): ``files/`` (verified downloads) and
``derived/`` (files built from verified inputs, :mod:`~rotationzoo.hub.derived`, e.g. the rotations GGUF that ``serve-args
--engine llamacpp`` writes). Both carry markers; :func:`verify_cache` checks each file against its
marker (and, for downloads, the registry; for derived files, that their inputs are still the
verified ones) and never removes a file that passes. Hidden download-in-progress files left by a
killed process (``.url-*.part``, ``.*.tmp``) are listed as area ``"partial"``; :func:`verify_cache`
removes those whose entry no download is holding (its lock is free). A hub client's unfinished download
in ``hub/`` (``*.incomplete``) is listed the same way and removed once it has not been written for an
hour (no entry lock covers a client's blob, which several entries may share).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..errors import CacheError, ConfigError, RotationZooError
from ..hashing import sha256_file
from ..registry import ModelEntry, get_model, load_registry, split_model_tag
from ..safefile import file_kind, file_lock
from .layout import (
    DERIVED_AREA,
    FILES_AREA,
    HUB_AREA,
    IMPORTED_AREA,
    LOCKS_AREA,
    MARKER_SUFFIX,
    area_dir,
    cache_root,
    check_cache_root,
    entry_lock,
    hold_entry,
    inside,
    is_orphan_name,
    marker_path,
    model_folder,
    read_marker,
    remove_inside,
    walk_area,
)

#: The area of download-in-progress files (orphans when no download holds their entry's lock) and of
#: files in a staging folder (a hidden folder an import or a rotation write fills before renaming it).
PARTIAL_AREA = "partial"
#: A staging folder untouched for this long was left by a killed process (the writers hold no lock).
STAGING_GRACE_S = 3600.0
#: How long ``verify_cache`` waits for a writer to release an entry's lock before it leaves the entry unchecked.
VERIFY_LOCK_WAIT_S = 10.0


@dataclass
class CacheRecord:
    """One file in the cache, as its marker describes it.

    Attributes:
        area: ``"files"`` (a verified download), ``"derived"`` (built from verified files),
            ``"imported"`` (``cache import``) or ``"partial"`` (a download in progress, or left by a
            killed process).
        side: ``"k"`` / ``"v"`` for downloads; ``None`` for derived files.
        inputs: for derived files, the sha256 of each input side it was built from.
        ok, problem: set by :func:`verify_cache` (``problem``: why it is bad).
        removed: whether :func:`verify_cache` removed it (a bad file; a partial one only once left alone).
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
    removed: bool = False

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def _staging_folder(root: Path, area: str, path: Path) -> Path | None:
    """The outermost hidden folder ``path`` lies in below its area (an import or a write in progress)."""
    base = area_dir(root, area)
    for i, part in enumerate(path.relative_to(base).parts[:-1]):
        if part.startswith("."):
            return base.joinpath(*path.relative_to(base).parts[:i + 1])
    return None


def _records(root: Path, area: str) -> list[CacheRecord]:
    return [r for r in (_record(root, area, p) for p in walk_area(root, area)) if r is not None]


def _record(root: Path, area: str, p: Path) -> CacheRecord | None:
    """The record of the entry ``p`` of ``area`` as it is now (``None``: a marker, a hidden file that is not a
    download's, or gone)."""
    if _staging_folder(root, area, p) is not None:
        if p.name.endswith(MARKER_SUFFIX):
            return None
        return CacheRecord(p, PARTIAL_AREA, None, None, None, 0, None, None,
                           problem="in a staging folder: an import or write in progress, or left by a killed process")
    if p.is_symlink():
        return CacheRecord(p, area, None, None, None, 0, None, None,
                           problem=f"a symlink (to {os.readlink(p)}; never served or followed)")
    if p.name.endswith(MARKER_SUFFIX):
        return None
    try:
        st = p.stat()
    except OSError:
        return None  # removed while we walked
    if not stat.S_ISREG(st.st_mode):
        return CacheRecord(p, area, None, None, None, 0, None, None, problem="not a regular file")
    if p.name.startswith("."):
        if is_orphan_name(p.name):
            return CacheRecord(p, PARTIAL_AREA, None, None, None, st.st_size, None, None,
                               problem="download in progress or left by a killed process")
        return None
    m = read_marker(p) or {}
    return CacheRecord(p, area, m.get("model"), m.get("tag"), m.get("side"), st.st_size,
                       m.get("sha256"), m.get("source"), m.get("inputs"), problem=_marker_problem(p, m))


def _marker_problem(path: Path, marker: Mapping[str, Any]) -> str | None:
    """Why a file has no usable marker when one is there (a FIFO, a device: never opened), else ``None``."""
    if marker:
        return None
    try:
        st = os.lstat(marker_path(path))
    except OSError:
        return None
    return None if stat.S_ISREG(st.st_mode) else f"its marker is {file_kind(st.st_mode)}, not a regular file (never opened)"


#: What a hub client names a download it has not finished (``huggingface_hub``: ``blobs/<sha>.incomplete``;
#: ModelScope: ``<file>.incomplete``).
CLIENT_PARTIAL_SUFFIX = ".incomplete"


def _client_partials(root: Path) -> list[CacheRecord]:
    """The hub clients' unfinished downloads in the cache's ``hub/`` area (a stopped download's is removed
    by rotationzoo; a killed process leaves its own)."""
    out = []
    for p in walk_area(root, HUB_AREA):
        if p.name.endswith(CLIENT_PARTIAL_SUFFIX) and not p.is_symlink():
            try:
                size = p.stat().st_size
            except OSError:
                continue  # finished or removed while we walked
            out.append(CacheRecord(p, PARTIAL_AREA, None, None, None, size, None, None,
                                   problem="a hub client's download in progress, or left by a killed process"))
    return out


def cache_records(cache_dir: str | os.PathLike[str] | None = None) -> list[CacheRecord]:
    """Every file in the verified-files, derived and imported areas of the cache, with its marker if any,
    and the hub clients' unfinished downloads (area ``partial``)."""
    root = cache_root(cache_dir)
    return (_records(root, FILES_AREA) + _records(root, DERIVED_AREA) + _records(root, IMPORTED_AREA)
            + _client_partials(root))


def _verified_inputs(records: list[CacheRecord]) -> dict[tuple[str | None, str | None], dict[str, set[str]]]:
    """``{(model, tag): {side: {sha256, ...}}}`` of the downloads whose markers are present (one per
    revision cached)."""
    out: dict[tuple[str | None, str | None], dict[str, set[str]]] = {}
    for r in records:
        if r.area != FILES_AREA:
            continue
        if r.side and r.sha256:
            out.setdefault((r.model, r.tag), {}).setdefault(r.side, set()).add(r.sha256)
    return out


def _problem(r: CacheRecord, sha: str, registry_sha: str | None,
             inputs_now: Mapping[str, set[str]] | None) -> str | None:
    if r.sha256 is None:
        return "no verification marker"
    if sha != r.sha256:
        return f"sha256 {sha} differs from the verified {r.sha256} (changed on disk)"
    if registry_sha is not None and sha != registry_sha:
        return f"sha256 {sha} differs from the registry's {registry_sha}"
    if r.area == DERIVED_AREA and r.inputs and inputs_now is not None:
        stale = [s for s, h in r.inputs.items() if s in inputs_now and h not in inputs_now[s]]
        if stale:
            return f"built from {'+'.join(stale).upper()} files that are no longer the verified ones (stale)"
    return None


def verify_cache(cache_dir: str | os.PathLike[str] | None = None, *, remove_bad: bool = True) -> list[CacheRecord]:
    """Re-hash every cached file against its marker (downloads also against the registry, derived
    files against the verified inputs they were built from); remove the bad ones.

    Only entries inside the cache root are removed: a symlink is removed as a link (never its target),
    and an area or folder that is a link leaving the root stops the check before anything is removed.

    Raises:
        CacheError: an area is a symlink or a folder in it leads outside the cache root.
    """
    root = cache_root(cache_dir)
    reg = load_registry()
    records = cache_records(root)  # walks (and checks) both areas before anything is removed
    if remove_bad:
        check_cache_root(root)  # a project folder given as the cache: nothing in it is the cache's to remove
    inputs = _verified_inputs(records)
    left_alone: dict[Path, bool] = {}
    for r in records:
        if r.area == PARTIAL_AREA:
            r.ok = False
            if _area_of(root, r.path) == HUB_AREA:  # no entry lock covers a client's blob: its age decides
                if remove_bad and _left_alone(r.path):
                    r.problem, r.removed = "left by a killed download", bool(remove_inside(root, [r.path]))
                continue
            staging = _staging_folder(root, _area_of(root, r.path), r.path)
            if staging is not None:  # a writer's own folder: removed only once it has long been left alone
                if staging not in left_alone:  # judged once, before this check removes anything from it
                    left_alone[staging] = _left_alone(staging)
                if remove_bad and left_alone[staging]:
                    r.problem = "left by a killed import or write"
                    r.removed = r.path in remove_inside(root, [r.path, marker_path(r.path)])
                continue
            if remove_bad and _unlocked(root, r.path):
                r.problem, r.removed = "left by a killed download", bool(remove_inside(root, [r.path]))
            continue
        if not remove_bad:
            _judge(root, r, reg, inputs, remove=False)
            continue
        try:  # judged again under the entry's lock, from the marker as it is then: a writer holds that lock
            with hold_entry(root, r.path.parent, what=f"check of {r.path.parent}", timeout=VERIFY_LOCK_WAIT_S):
                now = _record(root, r.area, r.path)
                if now is None:  # replaced or removed by another process meanwhile
                    r.ok, r.problem = None, "removed or replaced while the cache was checked: not checked"
                    continue
                _judge(root, now, reg, inputs, remove=True)
                r.__dict__.update(now.__dict__)
        except CacheError as exc:  # held by a writer: left for the next check; no lock can be made: judged, kept
            if os.access(root / LOCKS_AREA if (root / LOCKS_AREA).is_dir() else root, os.W_OK):
                r.ok, r.problem = None, f"not checked: {exc}"
            else:
                _judge(root, r, reg, inputs, remove=False)
    return records


def _judge(root: Path, r: CacheRecord, reg: Any, inputs: Mapping[tuple[str | None, str | None], Any],
           remove: bool) -> None:
    """Set ``r.ok`` / ``r.problem`` from its bytes and marker; remove ``r``'s file and marker when bad and ``remove``."""
    if r.path.is_symlink() or r.sha256 is None and r.problem is not None:
        r.ok = False
    else:
        registry_sha = None
        if r.area == FILES_AREA and r.model and r.tag and r.side:
            try:
                registry_sha = reg.entry(r.model, r.tag).files[r.side].sha256
            except RotationZooError:
                registry_sha = None
        try:
            sha = sha256_file(r.path, error=CacheError)  # a FIFO swapped in is refused, never waited on
        except CacheError:
            r.ok, r.problem = False, "not a regular file (never opened)"
        except OSError as exc:
            r.ok, r.problem = False, f"cannot be read ({exc.strerror or exc})"
            return
        else:
            r.problem = _problem(r, sha, registry_sha, inputs.get((r.model, r.tag)))
            r.ok = r.problem is None
    if not r.ok and remove:
        r.removed = r.path in remove_inside(root, [r.path, marker_path(r.path)])
        if not r.removed and os.path.lexists(r.path):
            r.problem = f"{r.problem}; it could not be removed (check the folder's permissions)"


def _area_of(root: Path, path: Path) -> str:
    return path.relative_to(root).parts[0]


def _left_alone(path: Path) -> bool:
    """True when nothing in the staging folder ``path`` (or the file itself: a hub client's partial download)
    changed for :data:`STAGING_GRACE_S` seconds."""
    try:
        newest = max([os.lstat(path).st_mtime] + [os.lstat(p).st_mtime for p in path.rglob("*")])
    except OSError:  # changed while we looked: in use
        return False
    return time.time() - newest > STAGING_GRACE_S


def _unlocked(root: Path, path: Path) -> bool:
    """True when no download holds the lock of the entry folder ``path`` is in."""
    lock = entry_lock(root, path.parent)
    if not lock.exists():
        return True
    try:
        with file_lock(lock, timeout=0, what="download", error=CacheError):
            return True
    except CacheError:  # held, or a lock file that is not one: keep the file
        return False


def _tree_bytes(root: Path, area: str) -> int:
    total = 0
    for p in walk_area(root, area):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def _model_and_tag(model: str, tag: str | None) -> tuple[ModelEntry, str | None]:
    """The model ``model`` names (``MODEL`` or ``MODEL@TAG``) and the tag asked for: ``tag``, else the one after ``@``
    (:func:`check_removal` refused the two disagreeing: a removal never guesses which)."""
    name, at_tag = split_model_tag(model)
    return get_model(name), tag or at_tag


def check_removal(model: str | None = None, tag: str | None = None, *, all: bool = False) -> None:
    """What :func:`remove_cached` / :func:`removal_plan` check of their arguments before reading the cache: one
    model (and tag) or everything, never neither nor both; ``tag`` and ``MODEL@TAG`` the same tag.

    Raises:
        ConfigError: one line, naming the CLI flags and the Python arguments.
    """
    if not isinstance(all, bool):
        raise ConfigError(f"all= is True (--all) or False, got {all!r}")
    for what, value in (("model", model), ("tag", tag)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{what}= names a registry {what} (--{what}), got {value!r}: an unset shell variable?")
    if model is None and not all:
        raise ConfigError("say what to remove: a model (--model M [--tag T]; model=, tag=) or everything "
                          "(--all; all=True)")
    if model is not None and all:
        raise ConfigError("give a model (--model M [--tag T]) or everything (--all), not both")
    if tag is not None and model is None:
        raise ConfigError("a tag (--tag, tag=) needs its model (--model, model=)")
    try:
        at_tag = split_model_tag(model)[1] if model is not None else None
    except ConfigError:  # a name with nothing on one side of its '@': refused where it is read, as elsewhere
        at_tag = None
    if tag is not None and at_tag is not None and tag != at_tag:
        raise ConfigError(f"--model {model!r} and --tag {tag!r} name different tags; give one")


def removal_plan(model: str | None = None, tag: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, *, all: bool = False) -> tuple[list[CacheRecord], int]:
    """What :func:`remove_cached` with the same arguments removes: the cached files (as
    :func:`cache_records` lists them) and, with ``all=True``, the bytes of the hub clients' caches.
    ``model`` may name a tag as ``MODEL@TAG`` (the same as ``tag``).

    Raises:
        CacheError: an area is a symlink or a folder in it leads outside the cache root.
        ConfigError: neither ``model`` nor ``all=True``, or both; ``tag`` and ``MODEL@TAG`` name different tags.
    """
    check_removal(model, tag, all=all)
    root = cache_root(cache_dir)
    records = cache_records(root)
    if model is None:
        return records, _tree_bytes(root, HUB_AREA)
    m, tag = _model_and_tag(model, tag)
    folder, want = model_folder(m.id), None if tag is None else m.tag(tag).name
    picked = []
    for r in records:
        parts = r.path.relative_to(root).parts
        if (parts[0] in (FILES_AREA, DERIVED_AREA) and len(parts) > 2 and parts[1] == folder
                and (want is None or parts[2].split("@")[0] == want)):
            picked.append(r)
    return picked, 0


def _rmtree(root: Path, folder: Path) -> list[Path]:
    """Remove ``folder`` (inside ``root``, not a link); links in it are removed as links."""
    inside(root, folder)
    if folder.is_symlink() or not folder.is_dir():
        return []
    gone = [p for p in walk_area(root, str(folder.relative_to(root))) if not p.is_symlink() and p.is_file()]
    shutil.rmtree(folder)
    return gone


def remove_cached(model: str | None = None, tag: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None, *, all: bool = False) -> list[Path]:
    """Delete cached files, derived files included: one model, one model+tag (``tag`` or ``MODEL@TAG``), or with
    ``all=True`` everything (imported files and the hub clients' caches too); returns what was removed.
    Naming neither (or both) is refused, as ``cache rm`` refuses it: a forgotten ``model`` never empties the cache.

    Every area and folder is checked before anything is removed: an area that is a symlink, or a folder
    that leads outside the cache root, raises :class:`~rotationzoo.errors.CacheError` with nothing removed.

    Raises:
        ConfigError: neither ``model`` nor ``all=True``, or both; ``tag`` without ``model``.
        CacheError: as above, or a download running into what would be removed; nothing was removed.
    """
    check_removal(model, tag, all=all)
    root = cache_root(cache_dir)
    check_cache_root(root)
    if model is None:
        areas = [area_dir(root, sub) for sub in (FILES_AREA, DERIVED_AREA, IMPORTED_AREA, HUB_AREA)]
        for sub in (FILES_AREA, DERIVED_AREA, IMPORTED_AREA, HUB_AREA):
            walk_area(root, sub)  # refuses links that leave the root, before anything goes
        removed: list[Path] = []
        with _no_download_running(root, [area_dir(root, FILES_AREA)]):
            for d in areas:
                removed.extend(_rmtree(root, d))
        return removed
    m, tag = _model_and_tag(model, tag)
    want = None if tag is None else m.tag(tag).name
    folders = []
    for area in (FILES_AREA, DERIVED_AREA):
        base = inside(root, area_dir(root, area) / model_folder(m.id))
        if base.is_dir():
            folders += [base] if want is None else [d for d in sorted(base.iterdir()) if d.name.split("@")[0] == want]
    for d in folders:
        if d.is_symlink():
            raise CacheError(f"{d} is a symlink (to {os.readlink(d)}); nothing was removed; remove the link")
        walk_area(root, str(d.relative_to(root)))
    removed = []
    with _no_download_running(root, [d for d in folders if d.is_relative_to(area_dir(root, FILES_AREA))]):
        for d in folders:
            removed.extend(_rmtree(root, d))
    return removed


@contextlib.contextmanager
def _no_download_running(root: Path, folders: list[Path]) -> Iterator[None]:
    """Hold the download lock of every entry folder in or below ``folders`` (the files area, a model's
    folder or a tag's), so no download writes into what is being removed.

    Raises:
        CacheError: a download holds one; nothing was removed.
    """
    entries: list[Path] = []
    for d in folders:
        depth = len(d.relative_to(area_dir(root, FILES_AREA)).parts)  # 0: the area, 1: a model, 2: a tag
        if not d.is_dir() or d.is_symlink():
            continue
        if depth == 2:
            entries.append(d)
            continue
        models = sorted(d.iterdir()) if depth == 0 else [d]
        entries += [t for m in models if m.is_dir() and not m.is_symlink() for t in sorted(m.iterdir())
                    if t.is_dir() and not t.is_symlink()]
    with contextlib.ExitStack() as stack:
        for e in entries:
            stack.enter_context(hold_entry(root, e, what=f"download into {e}", timeout=0, hint="nothing was removed"))
        yield
