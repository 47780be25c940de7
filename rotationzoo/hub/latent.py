"""MLA latent sets in the cache: fetched file by file from their sources, or imported from a folder.

A latent set is cached as its entry (:meth:`~rotationzoo.registry.LatentSet.entry`) is: one
``layer_<id>.pt`` per layer under ``files/<model>/<set name>/``, each downloaded, checked as a latent
rotation of the model (:mod:`.checks`), compared with its pin (trust on first use, the authors publish
no checksums), marked and renamed into place by :func:`~rotationzoo.hub.fetch.fetch_file`. A set the
authors did not publish in a hub is imported from a local copy (:func:`import_latent`) with the same
checks, pinned and marked with the folder it came from. Whatever the route, the layers must cover the
model's latent layers exactly (:func:`rotationzoo.files.latent.check_coverage`): a missing layer is an error
that names it, never a silent identity.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import config
from ..errors import CacheError, FetchError, IntegrityError, OfflineError, RotationFileError
from ..files.latent import LAYER_FILE, check_coverage, layer_files
from ..files.limits import MAX_BYTES
from ..registry import ModelEntry, TagEntry
from ..registry.model import LatentSet, latent_file_key
from ..safefile import copy_regular, file_lock
from . import network, pins
from .checks import check_downloaded
from .fetch import LOCK_WAIT_S, CachedFile, Reporter, _writable, cached_copy, fetch_file, record_verified
from .layout import cache_root, entry_dir, lock_path, marker_path, read_marker, remove_inside


@dataclass
class LatentFiles:
    """A verified latent set in the cache: its folder and each layer's file (and the subspace folder)."""

    model: str
    name: str
    folder: Path
    files: dict[int, CachedFile] = field(default_factory=dict)
    subspace: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "latent": self.name, "folder": str(self.folder),
                "subspace": str(self.subspace) if self.subspace else None, "layers": len(self.files),
                "files": {str(i): {"path": str(f.path), "sha256": f.sha256, "size": f.size, "source": f.source,
                                   "from_cache": f.from_cache} for i, f in sorted(self.files.items())}}


def _latent(model: ModelEntry) -> LatentSet:
    if model.mla_latent is None:
        raise FetchError(f"{model.id} has no MLA latent set (it has K/V tags: {', '.join(model.tags)})")
    return model.mla_latent


def cached_layer_ids(model: ModelEntry, root: Path, *, subspace: bool = False) -> tuple[int, ...]:
    """The layer ids of the set's files that sit in the cache with a marker (for sets whose ids are unknown)."""
    folder = entry_dir(root, _latent(model).entry(model.id, (), subspace=subspace))
    if not folder.is_dir():
        return ()
    out = []
    for e in os.scandir(folder):
        m = LAYER_FILE.match(e.name)
        if m and read_marker(folder / e.name) is not None:
            out.append(int(m[1]))
    return tuple(sorted(out))


def latent_entry(model: ModelEntry, root: Path, *, subspace: bool = False) -> TagEntry:
    """The set's entry, its files the registry's layers (or, when it does not know them, those cached)."""
    lat = _latent(model)
    ids = lat.expected_layer_ids
    return lat.entry(model.id, ids if ids is not None else cached_layer_ids(model, root, subspace=subspace),
                     subspace=subspace)


def _not_published(model: ModelEntry, entry: TagEntry, missing: list[str]) -> FetchError | OfflineError:
    lat = _latent(model)
    folder = "a copy of the folder"
    return OfflineError(f"{model.id}: the latent set {lat.name} is not published in a hub (the authors keep it at "
                        f"{lat.location}) and is not in the cache{' (missing ' + ', '.join(missing[:3]) + ')' if missing else ''}; "
                        f"import {folder} with `rotationzoo cache import FOLDER --latent {model.id}`")


def fetch_latent(model: ModelEntry, *, cache_dir: str | os.PathLike[str] | None = None, source: str = "auto",
                 revision: str | None = None, offline: bool | None = None, force: bool = False,
                 accept_new: bool = False, report: Reporter | None = None,
                 timeout: float | None = None) -> LatentFiles:
    """Every layer file of ``model``'s latent set, verified and cached (downloaded when missing).

    Raises:
        OfflineError: offline (or not published) and a layer is not cached.
        FetchError / IntegrityError: as :func:`~rotationzoo.hub.fetch.fetch_file`.
        InvalidRotationError: the layers do not cover the model's latent layers (the first missing one named).
    """
    lat = _latent(model)
    root = cache_root(cache_dir)
    offline = config.offline() if offline is None else offline
    out = LatentFiles(model.id, lat.name, Path())
    for subspace in ((False, True) if lat.hp_subspace else (False,)):
        entry = latent_entry(model, root, subspace=subspace)
        folder = entry_dir(root, entry, revision)
        if not entry.files:
            raise _not_published(model, entry, [])
        if any(f.sha256 is None for f in entry.files.values()):
            pins.read_pins()  # an unusable pin file fails here, before any download
        got: dict[int, CachedFile] = {}
        missing = []
        for side in entry.files:
            hit = None if force or accept_new else cached_copy(entry, side, root, revision)
            if hit is None:
                missing.append(side)
            else:
                got[int(side.split("_")[1])] = hit
        if missing and not lat.published:
            raise _not_published(model, entry, [f"{s}.pt" for s in missing])
        if missing and offline:
            raise OfflineError(f"offline mode: {model.id} latent set {lat.name} is not cached (missing "
                               f"{', '.join(s + '.pt' for s in missing[:3])}{' …' if len(missing) > 3 else ''} in "
                               f"{folder}); run `rotationzoo fetch --model {model.id}` where the network is reachable "
                               f"(offline because {config.offline_reason()})")
        if missing:
            lp = lock_path(root, entry, revision)
            _writable(lp.parent)
            with file_lock(lp, timeout=LOCK_WAIT_S, what=f"download of {entry.key}", error=CacheError,
                           hint="set ROTATIONZOO_CACHE or --cache-dir to a writable folder", busy_hint=""), \
                    network.using(timeout=timeout):
                for side in missing:
                    got[int(side.split("_")[1])] = fetch_file(entry, side, root=root, source=source,
                                                              revision=revision, force=force, accept_new=accept_new,
                                                              report=report)
        if subspace:
            out.subspace = folder
        else:
            check_coverage(got, f"{model.id} latent set {lat.name} ({folder})", layer_ids=lat.expected_layer_ids,
                           layer_count=lat.layer_count)
            out.folder, out.files = folder, got
    return out


def import_latent(folder: str | os.PathLike[str], model: ModelEntry, *,
                  cache_dir: str | os.PathLike[str] | None = None, accept_new: bool = False,
                  subspace: bool = False) -> LatentFiles:
    """Copy a local latent folder (or, ``subspace``, its high-precision subspace folder) into the cache as
    ``model``'s set: the layers checked against the model first, every file copied and checked (and its pin
    compared) before any is replaced, then each pinned to the folder it came from, marked and renamed into
    place; a whole set leaves no layer of the one before beside it (a subspace folder replaces its layers).

    Raises:
        InvalidRotationError: the folder does not cover the model's latent layers, or a file fails its check.
        RotationFileError: a file cannot be read safely.
        IntegrityError: a file differs from what was imported from the same folder before
            (``accept_new`` to replace it).
    """
    lat = _latent(model)
    src = Path(folder).expanduser().resolve()
    files = layer_files(src, what="high-precision subspace folder" if subspace else "latent rotation folder")
    if not subspace:
        check_coverage(files, str(src), layer_ids=lat.expected_layer_ids, layer_count=lat.layer_count)
    root = cache_root(cache_dir)
    entry = lat.entry(model.id, tuple(sorted(files)), subspace=subspace)
    dest = entry_dir(root, entry)
    _writable(dest)
    lp = lock_path(root, entry)
    _writable(lp.parent)
    label = f"import:{src}"
    got: dict[int, CachedFile] = {}
    staged: dict[int, tuple[Path, str]] = {}
    with file_lock(lp, timeout=LOCK_WAIT_S, what=f"import of {entry.key}", error=CacheError,
                   hint="set ROTATIONZOO_CACHE or --cache-dir to a writable folder", busy_hint=""):
        try:
            for lid, p in sorted(files.items()):  # every layer copied and checked before any is replaced
                side = latent_file_key(lid)
                fd, tmp_name = tempfile.mkstemp(prefix=f".layer_{lid}.", suffix=".tmp", dir=dest)
                staged[lid] = (Path(tmp_name), "")
                with os.fdopen(fd, "wb") as out:
                    copy_regular(p, out, MAX_BYTES, what="latent rotation file", error=RotationFileError)
                problem, sha = check_downloaded(staged[lid][0], entry.files[side], entry)
                if problem is not None:
                    raise IntegrityError(f"{p}: {problem}; nothing was imported")
                old = pins.pin_for(entry, side, label)
                if old is not None and old["sha256"] != sha and not accept_new:
                    pins.check_or_pin(entry, side, sha, source=label)  # raises, saying how to accept it
                staged[lid] = (staged[lid][0], sha)
            _place(root, dest, staged, got, entry, label, subspace)  # the set before back in place on a failure
            for lid, (_, sha) in staged.items():  # all in place: pinned
                pins.check_or_pin(entry, latent_file_key(lid), sha, source=label, accept_new=accept_new)
        finally:
            remove_inside(root, [tmp for tmp, _ in staged.values()])
    return LatentFiles(model.id, entry.name, dest, got, None)


def _place(root: Path, dest: Path, staged: dict[int, tuple[Path, str]], got: dict[int, CachedFile],
           entry: TagEntry, label: str, subspace: bool) -> None:
    """Mark and rename the checked copies into place, whole or not at all: the layers they replace (with a whole
    set, every layer of the set before) are moved aside first, removed once every copy is in place, and put
    back, the new ones removed, when one fails (a full disk writing a marker, Ctrl-C).

    Raises:
        OSError: a marker or a rename failed (the set before is back in place).
    """
    names = {f"layer_{lid}.pt" for lid in staged}
    going = sorted(q for q in dest.glob("layer_*.pt") if not subspace or q.name in names)
    aside = Path(tempfile.mkdtemp(prefix=".layers-before.", dir=dest))
    moved: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    try:
        for q in going:
            for x in (q, marker_path(q)):
                if x.exists():
                    os.replace(x, aside / x.name)
                    moved.append((aside / x.name, x))
        for lid, (tmp, sha) in staged.items():
            side = latent_file_key(lid)
            target = dest / f"layer_{lid}.pt"
            placed += [target, marker_path(target)]
            marker = record_verified(target, entry, side, sha=sha, source=label, of=tmp)
            os.replace(tmp, target)
            got[lid] = CachedFile(side, target, sha, marker["size"], label)
    except BaseException:
        got.clear()
        remove_inside(root, placed)
        while moved:  # one that cannot go back stays in the hidden folder, with the ones after it
            os.replace(*moved[-1])
            moved.pop()
        raise
    finally:
        if not moved or got:  # everything back, or the new set in place: the folder aside goes
            remove_inside(root, list(aside.iterdir()))
            aside.rmdir()


__all__ = ["LatentFiles", "cached_layer_ids", "fetch_latent", "import_latent", "latent_entry"]
