"""Download, verify and cache rotation files from the entry's sources.

Sources are tried in the entry's order (or only the one asked for): Hugging Face through
``huggingface_hub``, ModelScope through ``modelscope``, a plain ``url``, or data ``bundled`` with
the package. Every downloaded file is checked against the registry (size, sha256) and
structurally validated before it enters the cache; a file that fails is removed from every cache
involved (the hub clients keep poisoned blobs otherwise), downloaded once more, and only then is
an :class:`~rotationzoo.errors.IntegrityError` raised.

Cache layout under ``ROTATIONZOO_CACHE`` (default: the platform user cache dir)::

    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt          verified file
    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt.verified  marker (sha256, size, mtime, source)
    hub/huggingface/ , hub/modelscope/                                     the clients' own caches
    locks/models--Qwen--Qwen3-8B--<tag>.lock                               one lock per entry

A warm hit is two ``stat`` calls and a small JSON read: no hashing and no network.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal

from . import config
from .errors import FetchError, IntegrityError, OfflineError, RotationZooError
from .hashing import sha256_file
from .registry import SIDES, FileEntry, Source, TagEntry

log = logging.getLogger("rotationzoo")

SourceChoice = Literal["auto", "huggingface", "modelscope", "url", "bundled"]
SOURCE_CHOICES = ("auto", "huggingface", "modelscope", "url", "bundled")
MARKER_SUFFIX = ".verified"
#: Called with one line of human-readable status (source chosen, failover, retries).
Reporter = Callable[[str], None]


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
class _Attempt:
    source: Source
    problem: str


# -- layout --------------------------------------------------------------------------------------


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else config.cache_dir()


def _model_folder(model_id: str) -> str:
    return "models--" + model_id.replace("/", "--")


def entry_dir(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    tag = entry.name + (f"@{revision}" if revision else "")
    return root / "files" / _model_folder(entry.model_id) / tag.replace("/", "--")


def lock_path(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    name = f"{_model_folder(entry.model_id)}--{entry.name}" + (f"@{revision}" if revision else "")
    return root / "locks" / (name.replace("/", "--") + ".lock")


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


# -- markers -------------------------------------------------------------------------------------


def read_marker(path: Path) -> dict | None:
    try:
        with open(marker_path(path), encoding="utf-8") as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError, OSError):
        return None


def warm_hit(path: Path, expected_sha256: str | None) -> dict | None:
    """The marker of ``path`` if the file is present, unchanged since verification, and (when the
    registry pins a sha256) verified against that same sha256. No hashing."""
    marker = read_marker(path)
    if marker is None:
        return None
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if st.st_size != marker.get("size") or st.st_mtime_ns != marker.get("mtime_ns"):
        return None
    if expected_sha256 is not None and marker.get("sha256") != expected_sha256:
        return None
    return marker


def _write_marker(path: Path, sha: str, source: str, entry: TagEntry, side: str, revision: str | None) -> dict:
    st = path.stat()
    marker = {
        "model": entry.model_id,
        "tag": entry.name,
        "side": side,
        "sha256": sha,
        "registry_sha256": entry.files[side].sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "source": source,
        "revision": revision,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    mp = marker_path(path)
    tmp = mp.with_name(mp.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, mp)
    return marker


# -- the sources ---------------------------------------------------------------------------------


def _hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def _ms_endpoint() -> str | None:
    return os.environ.get("MODELSCOPE_ENDPOINT") or None


def _download_huggingface(src: Source, f: FileEntry, hub_cache: Path, revision: str, force: bool) -> tuple[Path, list[Path]]:
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(
        repo_id=src.repo,
        filename=f.source_path(src),
        revision=revision,
        cache_dir=str(hub_cache / "huggingface"),
        endpoint=_hf_endpoint(),
        force_download=force,
    )
    p = Path(path)
    # the snapshot entry is a symlink to a blob; a bad download must remove both
    return p, [p, Path(os.path.realpath(p))]


def _download_modelscope(src: Source, f: FileEntry, hub_cache: Path, revision: str, force: bool) -> tuple[Path, list[Path]]:
    from modelscope.hub.file_download import model_file_download

    cache = hub_cache / "modelscope"
    # its tqdm bars cannot be switched off; keep them for terminals, drop them from logs and pipes
    quiet = contextlib.nullcontext() if sys.stderr.isatty() else contextlib.redirect_stderr(io.StringIO())
    with quiet:
        path = model_file_download(
            model_id=src.repo,
            file_path=f.source_path(src),
            revision=revision,  # always explicit: None would mean "newest tag"
            cache_dir=str(cache),
            endpoint=_ms_endpoint(),
        )
    p = Path(path)
    return p, [p, Path(os.path.realpath(p))]


def _download_url(src: Source, dest_dir: Path, timeout: float = 60.0) -> tuple[Path, list[Path]]:
    import urllib.request

    fd, tmp = tempfile.mkstemp(prefix=".url-", suffix=".part", dir=dest_dir)
    req = urllib.request.Request(src.url, headers={"User-Agent": "rotationzoo"})
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(req, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out, 1 << 20)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp), [Path(tmp)]


def _bundled_path(src: Source) -> Path:
    return config.package_data_dir() / src.path


def _describe_exc(exc: BaseException) -> str:
    """One line: the exception and the root cause (HTTP status, connection error) the clients wrap."""
    chain = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 6:
        chain.append(e)
        e = e.__cause__ or e.__context__
    status = next((getattr(getattr(c, "response", None), "status_code", None) for c in chain
                   if getattr(getattr(c, "response", None), "status_code", None) is not None), None)

    def first_line(c: BaseException) -> str:
        text = str(c).strip()
        return text.splitlines()[0] if text else ""

    root = chain[-1]
    parts = [f"{type(exc).__name__}: {first_line(exc)}"]
    if root is not exc:
        parts.append(f"cause {type(root).__name__}: {first_line(root)}")
    if status is not None:
        parts.insert(0, f"HTTP {status}")
    return "; ".join(p for p in parts if p)[:400]


def _purge(paths: Iterable[Path]) -> None:
    for p in paths:
        try:
            if p.is_symlink() or p.exists():
                p.unlink()
        except OSError:
            pass


# -- verification of one downloaded file ---------------------------------------------------------


def _check(path: Path, f: FileEntry, entry: TagEntry) -> tuple[str | None, str]:
    """(problem or None, observed sha256). Size and sha256 against the registry, then structure."""
    size = path.stat().st_size
    if f.size is not None and size != f.size:
        sha = sha256_file(path)
        return f"size {size} B, expected {f.size} B (truncated or wrong file); sha256 {sha}", sha
    sha = sha256_file(path)
    if f.sha256 is not None and sha != f.sha256:
        return f"sha256 mismatch: expected {f.sha256}, got {sha}", sha
    from .format import read_rotation
    from .validation import validate

    try:
        rs = read_rotation(path)
        validate(rs, layer_ids=entry.architecture.expected_layer_ids(), head_dim=entry.architecture.head_dim)
    except RotationZooError as exc:
        return f"not a valid rotation file for {entry.model_id}: {exc}", sha
    return None, sha


# -- fetching ------------------------------------------------------------------------------------


def _select_sources(f: FileEntry, source: str) -> list[Source]:
    if source not in SOURCE_CHOICES:
        raise ValueError(f"source must be one of {', '.join(SOURCE_CHOICES)}, got {source!r}")
    if source == "auto":
        return list(f.sources)
    chosen = [s for s in f.sources if s.type == source]
    if not chosen:
        have = ", ".join(s.type for s in f.sources)
        raise FetchError(f"{f.path}: the registry lists no {source} source for this file (it has: {have})")
    return chosen


def fetch_file(
    entry: TagEntry,
    side: str,
    *,
    root: Path,
    source: str = "auto",
    revision: str | None = None,
    offline: bool = False,
    force: bool = False,
    report: Reporter | None = None,
) -> CachedFile:
    """Return the verified local copy of one file of ``entry``, downloading it if needed.

    Call with the entry's lock held (see :func:`fetch_entry`).
    """
    f = entry.files[side]
    say = report or (lambda msg: log.info(msg))
    sources = _select_sources(f, source)

    # bundled data needs no cache (it ships with the package and is checked on use; it is small)
    if sources[0].type == "bundled":
        src = sources[0]
        p = _bundled_path(src)
        if not p.is_file():
            raise FetchError(f"{f.path}: bundled file {p} is missing; reinstall rotationzoo")
        sha = sha256_file(p)
        if f.sha256 is not None and sha != f.sha256:
            raise IntegrityError(f"{p}: bundled file sha256 {sha} differs from the registry's {f.sha256}; "
                                 f"reinstall rotationzoo")
        return CachedFile(side, p, sha, p.stat().st_size, src.describe(), None, from_cache=True)

    target_dir = entry_dir(root, entry, revision)
    target = target_dir / f.filename
    if not force:
        marker = warm_hit(target, f.sha256)
        if marker is not None:
            return CachedFile(side, target, marker["sha256"], marker["size"], marker["source"],
                              marker.get("revision"), from_cache=True)
    if offline:
        raise OfflineError(
            f"offline mode: {entry.key} {side.upper()} file {f.filename} is not in the cache ({target_dir}); "
            f"run `rotationzoo fetch --model {entry.model_id} --tag {entry.name}` with network access"
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    hub_cache = root / "hub"
    failures: list[_Attempt] = []
    for i, src in enumerate(sources):
        if src.type == "bundled":
            continue
        is_hub = src.type in ("huggingface", "modelscope")
        rev = (revision or src.revision) if is_hub else None
        if is_hub and not rev:
            failures.append(_Attempt(src, "no revision given"))
            continue
        label = f"{src.type}:{src.repo}@{rev}" if is_hub else src.describe()
        bad_hashes: list[str] = []
        for attempt in (1, 2):
            try:
                if src.type == "huggingface":
                    got, purge = _download_huggingface(src, f, hub_cache, rev, force or attempt > 1)
                elif src.type == "modelscope":
                    got, purge = _download_modelscope(src, f, hub_cache, rev, force or attempt > 1)
                else:
                    got, purge = _download_url(src, target_dir)
            except RotationZooError:
                raise
            except Exception as exc:  # network error, 5xx, missing file: fail over
                failures.append(_Attempt(src, _describe_exc(exc)))
                nxt = next((s for s in sources[i + 1:] if s.type != "bundled"), None)
                say(f"{label}: {failures[-1].problem}" + (f"; trying {nxt.describe()}" if nxt else ""))
                break
            # copy out of the client's cache, then check the copy
            fd, tmp_name = tempfile.mkstemp(prefix=f".{f.filename}.", suffix=".tmp", dir=target_dir)
            os.close(fd)
            tmp = Path(tmp_name)
            try:
                if got.resolve() != tmp.resolve():
                    shutil.copyfile(got, tmp)
                problem, sha = _check(tmp, f, entry)
                if problem is None:
                    os.replace(tmp, target)
                    if src.type == "url":
                        _purge(purge)
                    if f.sha256 is None:
                        _warn_unpinned(entry, side, sha)
                    marker = _write_marker(target, sha, label, entry, side, rev)
                    say(f"{side.upper()} {f.filename}: verified from {label}")
                    return CachedFile(side, target, sha, marker["size"], label, rev)
            finally:
                _purge([tmp])
            # bad bytes: remove them from every cache involved, then try once more
            _purge(purge)
            _purge([target, marker_path(target)])
            bad_hashes.append(sha)
            if attempt == 1:
                say(f"{label}: {f.filename}: {problem}; removed the bad copy, downloading again")
                continue
            raise IntegrityError(
                f"{entry.key} {side.upper()} file {f.filename} from {label} failed verification twice: {problem}. "
                f"Expected sha256 {f.sha256 or '(unpinned)'}, got {', '.join(bad_hashes)}. "
                f"No bad copy was kept. The source may be corrupted or tampered with; "
                f"try another source (--source) or report it."
            )
    detail = "; ".join(f"{a.source.describe()}: {a.problem}" for a in failures) or "no usable source"
    raise FetchError(f"could not fetch {entry.key} {side.upper()} file {f.filename}: {detail}")


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


@dataclass
class EntryFiles:
    entry: TagEntry
    files: dict[str, CachedFile] = field(default_factory=dict)


def fetch_entry(
    entry: TagEntry,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    revision: str | None = None,
    offline: bool | None = None,
    force: bool = False,
    report: Reporter | None = None,
) -> EntryFiles:
    """Both files of ``entry``, verified and cached; one download across processes (file lock)."""
    root = cache_root(cache_dir)
    offline = config.offline() if offline is None else offline
    out = EntryFiles(entry)
    # fast path: warm hits need no lock
    if not force:
        for side in SIDES:
            f = entry.files[side]
            if f.sources and f.sources[0].type == "bundled" and source in ("auto", "bundled"):
                continue
            target = entry_dir(root, entry, revision) / f.filename
            marker = warm_hit(target, f.sha256)
            if marker is None:
                break
            out.files[side] = CachedFile(side, target, marker["sha256"], marker["size"], marker["source"],
                                         marker.get("revision"), from_cache=True)
    missing = [s for s in SIDES if s not in out.files]
    if not missing:
        return out
    if offline:
        # name every missing file in one message
        need = []
        for side in missing:
            f = entry.files[side]
            if f.sources and f.sources[0].type == "bundled" and source in ("auto", "bundled"):
                out.files[side] = fetch_file(entry, side, root=root, source=source, offline=True)
                continue
            need.append(f.filename)
        if need:
            raise OfflineError(
                f"offline mode: {entry.key} is not cached (missing {', '.join(need)} in "
                f"{entry_dir(root, entry, revision)}); run `rotationzoo fetch --model {entry.model_id} "
                f"--tag {entry.name}` where the network is reachable (offline because "
                f"{_offline_reason()})"
            )
        return out
    from filelock import FileLock

    lp = lock_path(root, entry, revision)
    lp.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lp)):
        for side in missing:
            out.files[side] = fetch_file(entry, side, root=root, source=source, revision=revision,
                                         offline=False, force=force, report=report)
    return out


def _offline_reason() -> str:
    if config.env_bool("ROTATIONZOO_OFFLINE"):
        return "ROTATIONZOO_OFFLINE is set"
    if config.env_bool("HF_HUB_OFFLINE"):
        return "HF_HUB_OFFLINE is set"
    return "offline=True was passed"


# -- cache management ----------------------------------------------------------------------------


@dataclass
class CacheRecord:
    path: Path
    model: str | None
    tag: str | None
    side: str | None
    size: int
    sha256: str | None
    source: str | None
    ok: bool | None = None
    problem: str | None = None

    def to_json(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


def cache_records(cache_dir: str | os.PathLike[str] | None = None) -> list[CacheRecord]:
    """Every file in the verified-files area of the cache, with its marker if any."""
    root = cache_root(cache_dir) / "files"
    out = []
    if not root.is_dir():
        return out
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name.endswith(MARKER_SUFFIX) or p.name.startswith("."):
            continue
        m = read_marker(p) or {}
        out.append(CacheRecord(p, m.get("model"), m.get("tag"), m.get("side"), p.stat().st_size,
                               m.get("sha256"), m.get("source")))
    return out


def verify_cache(cache_dir: str | os.PathLike[str] | None = None, *, remove_bad: bool = True) -> list[CacheRecord]:
    """Re-hash every cached file against its marker and the registry; remove the bad ones."""
    from .registry import load_registry

    reg = load_registry()
    records = cache_records(cache_dir)
    for r in records:
        sha = sha256_file(r.path)
        expected = r.sha256
        registry_sha = None
        if r.model and r.tag and r.side:
            try:
                registry_sha = reg.entry(r.model, r.tag).files[r.side].sha256
            except RotationZooError:
                registry_sha = None
        if expected is None:
            r.ok, r.problem = False, "no verification marker"
        elif sha != expected:
            r.ok, r.problem = False, f"sha256 {sha} differs from the verified {expected} (changed on disk)"
        elif registry_sha is not None and sha != registry_sha:
            r.ok, r.problem = False, f"sha256 {sha} differs from the registry's {registry_sha}"
        else:
            r.ok = True
        if not r.ok and remove_bad:
            _purge([r.path, marker_path(r.path)])
    return records


def remove_cached(model: str | None = None, tag: str | None = None,
                  cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete cached files (all, one model, or one model+tag); returns what was removed."""
    removed = []
    root = cache_root(cache_dir)
    if model is None:
        for sub in ("files", "hub"):
            d = root / sub
            if d.exists():
                removed.extend(p for p in d.rglob("*") if p.is_file())
                shutil.rmtree(d)
        return removed
    from .registry import get_model

    m = get_model(model)
    base = root / "files" / _model_folder(m.id)
    dirs = [base] if tag is None else [d for d in base.glob("*") if d.name.split("@")[0] == m.tag(tag).name]
    for d in dirs:
        if d.exists():
            removed.extend(p for p in d.rglob("*") if p.is_file())
            shutil.rmtree(d)
    return removed
