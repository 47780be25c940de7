"""Fetching one entry's files: sources in order with failover, verification, atomic cache writes.

Every downloaded file is copied into a temporary file beside its place in the cache, and that copy
is checked against the registry (size, sha256) and structurally validated; its marker is written
from the copy's sha256 and only then is the copy renamed into place (:mod:`.accept`). A file that
fails is removed from every cache involved and downloaded once more; failing again, the source is
skipped for the next one (:class:`~rotationzoo.errors.BadBytesError`). Files the registry does not pin are compared with
the user's pin file (:mod:`.pins`, trust on first use): a different file is refused at once.

A source that cannot serve the file (host unreachable, 404, a 5xx or a dropped connection after
``ROTATIONZOO_RETRIES`` retries, a wrong declared size, more bytes than expected: see :mod:`.network`
and :func:`.sources.download`) is skipped for the next one; when all fail,
:class:`~rotationzoo.errors.FetchError` lists one line per source and a hint
(:class:`~rotationzoo.errors.IntegrityError` when one served bad bytes). A file the disk cannot hold
is a :class:`~rotationzoo.errors.CacheError` at once (:mod:`.localdisk`). Downloads of one entry are
serialised by a lock file waited on for at most :data:`LOCK_WAIT_S` seconds.

A warm hit re-hashes the cached file (a few milliseconds for a rotation file: see
docs/performance.md) and never follows a symlink: a swapped or linked file is not served.
"""

from __future__ import annotations

import logging
import os
import shlex
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import config
from ..errors import (BadBytesError, CacheError, ConfigError, FetchError, IntegrityError, OfflineError, RegistryError,
                      RotationZooError)
from ..hashing import sha256_file
from ..registry import SIDES, FileEntry, Source, TagEntry
from ..safefile import file_lock
from ..registry.safety import check_revision
from ..vocab import SOURCE_CHOICES
from . import network, pins
from .layout import (HUB_AREA, cache_root, check_links, entry_dir, lock_path, partial_files, read_marker,
                     regular_file, remove_inside, write_marker)
from .accept import accept
from .checks import check_downloaded as _check
from .discover import resolve
from .localdisk import check_room, disk_error, local_write_error
from .sources import (MAX_DOWNLOAD_BYTES, Download, bundled_path, check_endpoint, describe_exc, download,
                      hf_endpoint, ms_endpoint)

log = logging.getLogger("rotationzoo")

#: Called with one line of human-readable status (source chosen, failover, retries).
Reporter = Callable[[str], None]
#: Longest wait, in seconds, for another process's download of the same entry (its lock).
LOCK_WAIT_S = 60.0


class UnpinnedEntryWarning(UserWarning):
    """The registry has no sha256 for a file: it was validated structurally only."""


_warned_unpinned: set[str] = set()


@dataclass
class CachedFile:
    """A verified file in the cache."""

    side: str
    path: Path
    sha256: str
    size: int
    source: str
    revision: str | None = None
    from_cache: bool = False


@dataclass
class EntryFiles:
    entry: TagEntry
    files: dict[str, CachedFile] = field(default_factory=dict)


def warm_hit(path: Path, expected_sha256: str | None) -> dict | None:
    """The marker of ``path`` if it is a regular file (not a symlink) whose bytes hash to the sha256
    its marker recorded and, when given, to ``expected_sha256`` (the registry's, or the local pin)."""
    marker = read_marker(path)
    if marker is None or not regular_file(path):
        return None
    try:
        if path.stat().st_size != marker["size"]:
            return None
        sha = sha256_file(path, error=CacheError)  # a FIFO swapped in is refused, never waited on
    except (OSError, CacheError):
        return None
    if sha != marker["sha256"] or (expected_sha256 is not None and sha != expected_sha256):
        return None
    return marker


def _hit(side: str, path: Path, marker: dict) -> CachedFile:
    return CachedFile(side, path, marker["sha256"], marker["size"], marker.get("source", "cache"),
                      marker.get("revision"), from_cache=True)


def cached_copy(entry: TagEntry, side: str, root: Path, revision: str | None = None) -> CachedFile | None:
    """The verified cached copy of one file, or ``None`` when there is none to serve.

    A pinned file must hash to the registry's sha256. An unpinned one must hash to the local pin of the
    source and revision its marker names; a copy no pin covers yet (a shared cache, another pin file) is
    validated as a rotation file and pinned now, like a first download.

    A copy that differs from its pin is not a hit: the download that follows is compared with the pin.

    Raises:
        ConfigError: the pin file is malformed or cannot be written.
    """
    f = entry.files[side]
    target = entry_dir(root, entry, revision) / f.filename
    if f.sha256 is not None:
        marker = warm_hit(target, f.sha256)
        return _hit(side, target, marker) if marker is not None else None
    marker = read_marker(target)
    label = marker.get("source") if marker is not None else None
    if not label:
        return None
    pin = pins.pin_for(entry, side, label)
    marker = warm_hit(target, pin["sha256"] if pin is not None else None)
    if marker is None:
        return None
    if pin is None:
        problem, sha = _check(target, f, entry)
        if problem is not None or sha != marker["sha256"]:
            return None
        if pins.check_or_pin(entry, side, sha, source=label, revision=marker.get("revision"),
                             commit=marker.get("commit")) == "new":
            _warn_unpinned(entry, side, sha)
    return _hit(side, target, marker)


def _select_sources(f: FileEntry, source: str) -> list[Source]:
    if source not in SOURCE_CHOICES:
        raise ConfigError(f"source must be one of {', '.join(SOURCE_CHOICES)}, got {source!r}")
    if source == "auto":
        return list(f.sources)
    chosen = [s for s in f.sources if s.type == source]
    if not chosen:
        have = ", ".join(s.type for s in f.sources)
        raise FetchError(f"{f.path}: the registry lists no {source} source for this file (it has: {have})")
    return chosen


def record_verified(path: Path, entry: TagEntry, side: str, *, sha: str, source: str,
                    revision: str | None = None, commit: str | None = None, of: Path | None = None) -> dict:
    """Write the marker that makes ``path`` a verified cached file of ``entry``'s ``side``.

    Only call it for bytes checked against the registry (size, sha256, structure); ``of``: the checked
    copy that is about to be renamed to ``path`` (see :func:`~rotationzoo.hub.layout.write_marker`).
    """
    return write_marker(path, {
        "model": entry.model_id, "tag": entry.name, "side": side, "sha256": sha,
        "registry_sha256": entry.files[side].sha256, "source": source, "revision": revision, "commit": commit,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, of=of)


def _fetch_bundled(entry: TagEntry, side: str, src: Source) -> CachedFile:
    """Bundled data needs no cache: it ships with the package and is checked on use (it is small)."""
    f = entry.files[side]
    p = bundled_path(src)
    if not p.is_file():
        raise FetchError(f"{f.path}: bundled file {p} is missing; reinstall rotationzoo")
    sha = sha256_file(p)
    if f.sha256 is not None and sha != f.sha256:
        raise IntegrityError(f"{p}: bundled file sha256 {sha} differs from the registry's {f.sha256}; "
                             f"reinstall rotationzoo")
    return CachedFile(side, p, sha, p.stat().st_size, src.describe(), None, from_cache=True)


def _preflight(src: Source, f: FileEntry, rev: str | None, say: Reporter) -> tuple[str | None, int | None]:
    """Ask the hub about the file before its client does (see :mod:`.network`): fail fast, check what
    it declares (size and, for an LFS file on Hugging Face and any file on ModelScope, sha256) against
    the registry. Returns the commit and the size declared, where known."""
    if not src.is_hub or rev is None or src.repo is None:
        return None, None
    endpoint = hf_endpoint() if src.type == "huggingface" else ms_endpoint()
    url, method, headers = network.file_url(src.type, src.repo, f.source_path(src), rev, endpoint)
    answer = network.ask(url, method=method, headers=headers, read_body=src.type == "modelscope", say=say)
    size, sha, commit = answer.size, answer.sha256, None
    if src.type == "modelscope":
        record = network.listed_file(answer.body, f.source_path(src))
        listed_size, listed_sha, listed_rev = record.get("Size"), record.get("Sha256"), record.get("Revision")
        size = listed_size if type(listed_size) is int else None
        sha = listed_sha if isinstance(listed_sha, str) else None
        commit = listed_rev if isinstance(listed_rev, str) else None
    if size is not None and f.size is not None and size != f.size:
        raise network.Unavailable(f"declares {size} B, the registry expects {f.size} B", "wrong_size")
    if sha and f.sha256 is not None and sha != f.sha256:
        raise network.Unavailable(f"lists sha256 {sha[:12]}…, the registry expects {f.sha256[:12]}…", "wrong_size")
    if size is not None and f.size is None and size > MAX_DOWNLOAD_BYTES:
        raise network.Unavailable(f"declares {size} B, more than the {MAX_DOWNLOAD_BYTES} B limit", "too_large")
    return commit, size


def _from_source(entry: TagEntry, side: str, src: Source, *, root: Path, revision: str | None, force: bool,
                 accept_new: bool, say: Reporter) -> CachedFile:
    """Download one file from one source, verified; one retry after bad bytes.

    ``revision`` is the caller's override (it also selects the cache folder).

    Raises:
        BadBytesError: the bytes failed verification twice (the caller fails over).
        IntegrityError: the bytes differ from the local pin.
        CacheError: the cache cannot hold the file (no room, a file size limit, a write refused).
        network.Unavailable: the source cannot serve the file (the caller fails over).
        Exception: whatever else the client raised (the caller fails over).
    """
    f = entry.files[side]
    rev = (revision or src.revision) if src.is_hub else None
    label = f"{src.type}:{src.repo}@{rev}" if src.is_hub else src.describe()
    target = entry_dir(root, entry, revision) / f.filename
    bad_hashes: list[str] = []
    problem = None
    if src.is_hub:
        check_endpoint(src.type)
    got_f = resolve(src, f, rev, say) if src.is_hub and rev is not None else f  # a '*' path: the one match
    listed_commit, declared = _preflight(src, got_f, rev, say)
    size = f.size if f.size is not None else declared
    if size is not None:  # a file that cannot fit is the disk's failure, found before any download
        check_room([target.parent, root / HUB_AREA], size, f"{entry.key} {side.upper()} file {f.filename}")
    for attempt in (1, 2):
        got: Download | None = None
        if src.is_hub:  # the client writes there: no link in it may lead out of the cache
            check_links(root, HUB_AREA, src.type)

        def place(copy: Path, sha: str) -> dict:
            """The copy is good: compare it with the pin (unpinned files), then mark it (before the rename)."""
            assert got is not None
            commit = got.commit or listed_commit
            if f.sha256 is None and pins.check_or_pin(entry, side, sha, source=label, revision=rev, commit=commit,
                                                      accept_new=accept_new) == "new":
                _warn_unpinned(entry, side, sha)
            return record_verified(target, entry, side, sha=sha, source=label, revision=rev, commit=commit, of=copy)

        try:
            with network.quiet_clients():
                got = download(src, got_f, hub_cache=root / HUB_AREA, dest_dir=target.parent, revision=rev,
                               force=force or attempt > 1, say=say)
            problem, sha, marker = accept(got, target, f, entry, root, place)
        except BaseException as exc:
            # a url download is ours to remove; a hub client's copy goes too when its bytes were refused (the
            # local pin, too many bytes): the client would keep serving them otherwise
            refused = isinstance(exc, IntegrityError) or getattr(exc, "kind", None) == "too_large"
            if got is not None and (src.type == "url" or refused):
                remove_inside(root, got.purge)
            raise
        if problem is None and marker is not None:
            if src.type == "url":
                remove_inside(root, got.purge)
            say(f"{side.upper()} {f.filename}: verified from {label}")
            return CachedFile(side, target, sha, marker["size"], label, rev)
        # bad bytes: remove them from every cache involved (never put in place), then try once more
        remove_inside(root, got.purge)
        bad_hashes.append(sha)
        if attempt == 1:
            say(f"{label}: {f.filename}: {problem}; removed the bad copy, downloading again")
    reason = f"failed verification twice: {problem} (sha256 of the copies: {', '.join(bad_hashes)})"
    raise BadBytesError(
        f"{entry.key} {side.upper()} file {f.filename} from {label} {reason}. No bad copy was kept. The source "
        f"may be corrupted or tampered with; try another source (--source) or report it.", reason, str(problem))


def _attempt(src: Source, rev: str | None, kind: str, reason: str, limit: int = 120) -> dict[str, str]:
    label = f"{src.type}:{src.repo}@{rev}" if src.is_hub else src.describe()
    return {"source": label, "kind": kind, "reason": network.shorten(reason, limit)}


def _all_failed(entry: TagEntry, side: str, attempts: list[dict[str, str]], bad: list[BadBytesError]) -> Exception:
    """The error after every source failed: one line per source. ``IntegrityError`` when a source served
    bad bytes (the one source's own error when it was the only one tried), else ``FetchError``."""
    f = entry.files[side]
    if bad and len(attempts) == 1:
        return bad[0]
    lines = "\n".join(f"  {a['source']}: {a['reason']}" for a in attempts) or "  no usable source"
    head = f"could not fetch {entry.key} {side.upper()} file {f.filename} from {len(attempts)} source(s)"
    if bad:
        return IntegrityError(f"{head}, {len(bad)} of which served bytes that failed verification "
                              f"({network.shorten(bad[0].problem, 100)}):\n{lines}\nhint: no bad copy was kept; "
                              f"a source serving such bytes may be corrupted or tampered with: report it")
    return FetchError(f"{head}:\n{lines}\n{FETCH_HINT}", attempts)


FETCH_HINT = ("hint: check the network or use a mirror (HF_ENDPOINT=..., MODELSCOPE_ENDPOINT=...); "
              "files already cached work with --offline (see `rotationzoo cache ls`)")


def _writable(folder: Path) -> None:
    """Create ``folder`` (inside the cache) or say in one line why it cannot be used."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}.tmp"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise CacheError(f"cache folder {folder} is not writable ({exc.strerror or exc}); set ROTATIONZOO_CACHE "
                         f"or --cache-dir to a writable folder") from None


def _sweep(root: Path, folder: Path) -> None:
    """Remove the download-in-progress files a killed process left (call with the entry's lock held)."""
    remove_inside(root, partial_files(folder))


def fetch_file(
    entry: TagEntry,
    side: str,
    *,
    root: Path,
    source: str = "auto",
    revision: str | None = None,
    offline: bool = False,
    force: bool = False,
    accept_new: bool = False,
    report: Reporter | None = None,
) -> CachedFile:
    """Return the verified local copy of one file of ``entry``, downloading it if needed.

    Call with the entry's lock held (see :func:`fetch_entry`).
    """
    f = entry.files[side]
    say = report or (lambda msg: log.info(msg))
    sources = _select_sources(f, source)
    if sources[0].type == "bundled":
        return _fetch_bundled(entry, side, sources[0])
    target = entry_dir(root, entry, revision) / f.filename
    if not (force or accept_new):
        hit = cached_copy(entry, side, root, revision)
        if hit is not None:
            return hit
    if offline:
        raise OfflineError(
            f"offline mode: {entry.key} {side.upper()} file {f.filename} is not in the cache ({target.parent}); "
            f"run `{fetch_command(entry)}` with network access"
        )
    _writable(target.parent)
    _sweep(root, target.parent)
    usable = [s for s in sources if s.type != "bundled"]
    attempts: list[dict[str, str]] = []
    bad: list[BadBytesError] = []
    for i, src in enumerate(usable):
        rev = (revision or src.revision) if src.is_hub else None
        if src.is_hub and not rev:
            attempts.append(_attempt(src, rev, "error", "no revision given"))
            continue
        try:
            return _from_source(entry, side, src, root=root, revision=revision, force=force,
                                accept_new=accept_new, say=say)
        except BadBytesError as exc:  # this source's bytes are wrong: another source may serve good ones
            bad.append(exc)
            attempts.append(_attempt(src, rev, "integrity", exc.reason, 400))
        except RotationZooError:
            raise
        except network.Unavailable as exc:
            attempts.append(_attempt(src, rev, exc.kind, exc.reason))
        except Exception as exc:  # the client's own errors (HTTP, connection): fail over
            local = local_write_error(exc)
            if local is not None:  # the disk's failure: every source would meet it
                raise disk_error(local, target.parent) from None
            attempts.append(_attempt(src, rev, "error", describe_exc(exc)))
        nxt = usable[i + 1] if i + 1 < len(usable) else None
        say(f"{attempts[-1]['source']}: {attempts[-1]['reason']}" + (f"; trying {nxt.describe()}" if nxt else ""))
    raise _all_failed(entry, side, attempts, bad)


def _warn_unpinned(entry: TagEntry, side: str, sha: str) -> None:
    key = f"{entry.key}:{side}"
    if key in _warned_unpinned:
        return
    _warned_unpinned.add(key)
    warnings.warn(
        f"{entry.key} {side.upper()} file is not pinned in the registry (no sha256); it was validated "
        f"structurally only. Observed sha256 {sha} (recorded in the cache).",
        UnpinnedEntryWarning,
        stacklevel=4,
    )


def _from_package(f: FileEntry, source: str) -> bool:
    """Whether ``f`` is served from the files bundled with the package (no cache, no network) for ``source``."""
    return f.bundled and source in ("auto", "bundled")


def _warm_files(entry: TagEntry, root: Path, source: str, revision: str | None) -> dict[str, CachedFile]:
    """The sides already verified in the cache (bundled sides are left to :func:`fetch_file`)."""
    out: dict[str, CachedFile] = {}
    for side in SIDES:
        f = entry.files[side]
        if _from_package(f, source):
            continue
        hit = cached_copy(entry, side, root, revision)
        if hit is None:
            break
        out[side] = hit
    return out


def fetch_entry(
    entry: TagEntry,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    revision: str | None = None,
    offline: bool | None = None,
    force: bool = False,
    accept_new: bool = False,
    report: Reporter | None = None,
    timeout: float | None = None,
) -> EntryFiles:
    """Both files of ``entry``, verified and cached; one download across processes (file lock).

    Args:
        accept_new: accept (and re-pin) unpinned files that differ from the local pin.
        timeout: seconds each step of a request may take (default ``ROTATIONZOO_TIMEOUT``); see
            :func:`rotationzoo.hub.network.using`.
    """
    root = cache_root(cache_dir)
    offline = config.offline() if offline is None else offline
    if revision is not None:
        try:
            check_revision(revision, "--revision")
        except RegistryError as exc:
            raise ConfigError(str(exc)) from None
    bundled = all(_from_package(f, source) for f in entry.files.values())
    if offline and (force or accept_new) and not bundled:  # bundled files need no network, forced or not
        raise OfflineError(f"offline mode: --{'force' if force else 'accept-new'} downloads {entry.key} again, which "
                           f"needs the network (offline because {offline_reason()}); drop it to use the cached copy")
    if any(f.sha256 is None for f in entry.files.values()):
        pins.read_pins()  # an unusable pin file fails here, before any download or validation
    out = EntryFiles(entry, {} if force or accept_new else _warm_files(entry, root, source, revision))
    missing = [s for s in SIDES if s not in out.files]
    if not missing:
        return out
    if offline:
        need = []  # name every missing file in one message
        for side in missing:
            f = entry.files[side]
            if _from_package(f, source):
                out.files[side] = fetch_file(entry, side, root=root, source=source, offline=True)
            else:
                need.append(f.filename)
        if need:
            raise OfflineError(
                f"offline mode: {entry.key} is not cached (missing {', '.join(need)} in "
                f"{entry_dir(root, entry, revision)}); run `{fetch_command(entry)}` where the network is reachable "
                f"(offline because {offline_reason()})"
            )
        return out
    lp = lock_path(root, entry, revision)
    _writable(lp.parent)
    with file_lock(lp, timeout=LOCK_WAIT_S, what=f"download of {entry.key}", error=CacheError,
                   hint="set ROTATIONZOO_CACHE or --cache-dir to a writable folder", busy_hint=""), \
            network.using(timeout=timeout):
        for side in missing:
            out.files[side] = fetch_file(entry, side, root=root, source=source, revision=revision,
                                         offline=False, force=force, accept_new=accept_new, report=report)
    return out


def offline_reason() -> str:
    """Why offline mode is on, for error messages (see :func:`rotationzoo.config.offline_reason`)."""
    return config.offline_reason()


def fetch_command(entry: TagEntry, *extra: str) -> str:
    """The ``rotationzoo fetch`` command line for ``entry``, shell-quoted, to print in a hint."""
    return shlex.join(["rotationzoo", "fetch", "--model", entry.model_id, "--tag", entry.name, *extra])
