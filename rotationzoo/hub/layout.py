"""Where things live under the cache root, and the verification markers beside cached files.

Layout under ``ROTATIONZOO_CACHE`` (default: the platform user cache dir)::

    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt          verified file
    files/models--Qwen--Qwen3-8B/<tag>/k_rotation_qqt_r_h_pbr.pt.verified  marker (sha256, size, mtime, source)
    derived/models--Qwen--Qwen3-8B/<tag>/oscar-rot-kv.gguf                 built from verified files
    derived/models--Qwen--Qwen3-8B/<tag>/oscar-rot-kv.gguf.verified        marker (sha256, size, inputs)
    derived/local/<id>/oscar-rot-kv.gguf                                   built from local files
    imported/<name>/k_rotation_qqt_r_h_pbr.pt (+ .verified)                 imported (``cache import``)
    hub/huggingface/ , hub/modelscope/                                     the clients' own caches
    locks/models--Qwen--Qwen3-8B--<tag>.lock                               one lock per entry

Every file under ``files/`` and ``derived/`` has a marker; ``rotationzoo cache ls / verify / rm``
know both areas. Downloads in progress live beside their target as hidden ``.url-*.part`` /
``.*.tmp`` files; one left by a killed process is an *orphan*, shown by ``cache ls`` and removed by
the next fetch of its entry or by ``cache verify``.

Every path built here is checked to resolve inside the cache root (:func:`inside`), and markers are
read defensively (:func:`read_marker` returns ``None`` for anything but a well-formed marker).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from .. import config
from ..errors import CacheError
from ..safefile import file_kind, file_lock, open_regular
from ..registry import TagEntry

MARKER_SUFFIX = ".verified"
FILES_AREA = "files"
DERIVED_AREA = "derived"
HUB_AREA = "hub"
LOCKS_AREA = "locks"
#: Pairs imported from outside the registry (``rotationzoo cache import``): ``imported/<name>/``.
IMPORTED_AREA = "imported"
#: What a cache root holds: its areas and the compiled CPU kernels (``kernels/``,
#: :data:`rotationzoo.kernels.native.CACHE_AREA`); hidden entries are the cache's own too.
ROOT_ENTRIES = frozenset({FILES_AREA, DERIVED_AREA, HUB_AREA, LOCKS_AREA, IMPORTED_AREA, "kernels", "CACHEDIR.TAG"})


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``cache_dir`` when given (a relative one taken from the working folder), else
    ``ROTATIONZOO_CACHE`` or the user cache dir; an absolute path.

    Raises:
        CacheError: the path is there but is not a folder (a file, a FIFO).
        ConfigError: ``ROTATIONZOO_CACHE`` is a relative path.
    """
    root = Path(cache_dir).expanduser().absolute() if cache_dir is not None else config.cache_dir()
    if root.exists() and not root.is_dir():
        where = "--cache-dir" if cache_dir is not None else "ROTATIONZOO_CACHE (or the user cache dir)"
        raise CacheError(f"the cache root {root} is not a folder; set {where} to a folder")
    return root


def check_cache_root(root: Path) -> None:
    """Refuse to remove anything from a folder that is not a rotationzoo cache (``--cache-dir`` or
    ``ROTATIONZOO_CACHE`` pointed at a project folder): its top level may hold only :data:`ROOT_ENTRIES` and
    hidden entries. Listing and fetching do not need it; ``cache verify`` and ``cache rm`` call it first.

    Raises:
        CacheError: the root holds anything else (nothing was removed).
    """
    try:
        names = sorted(e.name for e in os.scandir(root))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CacheError(f"cannot list the cache root {root} ({exc.strerror or exc}); nothing was removed") from None
    foreign = [n for n in names if n not in ROOT_ENTRIES and not n.startswith(".")]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise CacheError(f"{root} does not look like a rotationzoo cache (it holds {shown}); nothing was removed; "
                         f"give the cache folder (--cache-dir or ROTATIONZOO_CACHE)")
    held = [a for a in (FILES_AREA, DERIVED_AREA, IMPORTED_AREA) if _holds_files(root / a)]
    if held and not (any(_holds_files(root / a, MARKER_SUFFIX) for a in held)
                     or _holds_files(root / LOCKS_AREA, ".lock")):  # what every write into the cache leaves
        raise CacheError(f"{root} does not look like a rotationzoo cache (its {', '.join(held)} folder holds files "
                         f"but neither a {MARKER_SUFFIX} marker, which the cache writes beside each file it keeps, "
                         f"nor a lock of a download); nothing was removed; give the cache folder (--cache-dir or "
                         f"ROTATIONZOO_CACHE)")


def _holds_files(folder: Path, suffix: str = "") -> bool:
    """Whether ``folder`` (not a link) holds a file whose name ends with ``suffix``, at any depth, hidden files and
    folders left out (the cache's own partial downloads and staging folders)."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    for _, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if any(n.endswith(suffix) and not n.startswith(".") for n in names):
            return True
    return False


def inside(root: Path, path: Path) -> Path:
    """``path``, after checking that it resolves inside ``root`` (symlinks followed).

    Raises:
        CacheError: it does not (a hostile name or a symlink that leaves the cache).
    """
    base = root.resolve()
    full = path.resolve()
    if full != base and not full.is_relative_to(base):
        raise CacheError(f"{path} resolves to {full}, outside the cache root {base}; refusing to use it")
    return path


def model_folder(model_id: str) -> str:
    """``Qwen/Qwen3-8B`` → ``models--Qwen--Qwen3-8B``."""
    return "models--" + model_id.replace("/", "--")


def _tag_folder(entry: TagEntry, revision: str | None) -> str:
    return (entry.name + (f"@{revision}" if revision else "")).replace("/", "--")


def entry_dir(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    """Folder of an entry's verified files."""
    return inside(root, area_dir(root, FILES_AREA) / model_folder(entry.model_id) / _tag_folder(entry, revision))


def derived_dir(root: Path, entry: TagEntry | None = None, local_id: str | None = None) -> Path:
    """Folder of files built from the files whose sha256s make ``local_id``: under the entry's folder
    when they are its verified files, else under ``local``."""
    if not local_id or not re.fullmatch(r"[0-9a-f]{1,64}", local_id):
        raise ValueError("derived_dir needs a hex local_id (made from the inputs' sha256)")
    if entry is not None:
        return inside(root, area_dir(root, DERIVED_AREA) / model_folder(entry.model_id) / _tag_folder(entry, None)
                      / local_id)
    return inside(root, area_dir(root, DERIVED_AREA) / "local" / local_id)


def lock_path(root: Path, entry: TagEntry, revision: str | None = None) -> Path:
    """The lock held while an entry's files are downloaded."""
    name = f"{model_folder(entry.model_id)}--{entry.name}" + (f"@{revision}" if revision else "")
    return inside(root, area_dir(root, LOCKS_AREA) / (name.replace("/", "--") + ".lock"))


def entry_lock(root: Path, folder: Path) -> Path:
    """The lock of the entry folder ``folder`` (for a download's folder, the one :func:`lock_path` names), refused
    when the locks area or the lock leads out of the cache root."""
    return inside(root, area_dir(root, LOCKS_AREA) / f"{folder.parent.name}--{folder.name}.lock")


@contextlib.contextmanager
def hold_entry(root: Path, folder: Path, *, what: str, timeout: float, hint: str | None = None) -> Iterator[None]:
    """Hold the lock of the entry folder ``folder`` (the one downloads into it hold) while files and markers in it
    are written, replaced, judged or removed, so that ``cache verify`` never judges a file against another's
    marker and ``cache rm`` never removes what a download writes. ``hint`` ends an error line.

    Raises:
        CacheError: the lock cannot be created, or another process held it for ``timeout`` seconds.
    """
    locks = area_dir(root, LOCKS_AREA)
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        end = f"; {hint}" if hint else ""
        raise CacheError(f"cannot create the locks folder {locks} for the {what} ({exc.strerror or exc}){end}") from None
    with file_lock(entry_lock(root, folder), timeout=timeout, what=what, error=CacheError, hint=hint):
        yield


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MARKER_TYPES: dict[str, Any] = {
    "model": str, "tag": str, "side": str, "source": str, "revision": str, "kind": str,
    "registry_sha256": str, "verified_at": str, "created_at": str, "commit": str,
}
MAX_MARKER_BYTES = 64 << 10


def read_marker(path: Path) -> dict[str, Any] | None:
    """The marker of ``path``, or ``None`` when absent, unreadable or malformed.

    A well-formed marker is a JSON object in a regular file (at most 64 KiB, not a symlink; a FIFO or a
    device is never opened, see :func:`~rotationzoo.safefile.open_regular`) with a 64-hex ``sha256`` and
    an integer ``size``; optional fields of the wrong type are dropped, ``inputs`` must map sides to
    sha256s.
    """
    mp = marker_path(path)
    try:
        with open_regular(mp, what="verification marker", error=CacheError, follow_symlinks=False) as f:
            raw = f.read(MAX_MARKER_BYTES + 1)
        if len(raw) > MAX_MARKER_BYTES:
            return None
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError, CacheError):
        return None
    if not isinstance(data, dict):
        return None
    sha, size = data.get("sha256"), data.get("size")
    if not isinstance(sha, str) or not _SHA256.match(sha) or type(size) is not int or size < 0:
        return None
    out: dict[str, Any] = {"sha256": sha, "size": size}
    if type(data.get("mtime_ns")) is int:
        out["mtime_ns"] = data["mtime_ns"]
    for key, typ in _MARKER_TYPES.items():
        if isinstance(data.get(key), typ):
            out[key] = data[key]
    inputs = data.get("inputs")
    if isinstance(inputs, dict) and all(isinstance(k, str) and isinstance(v, str) and _SHA256.match(v)
                                        for k, v in inputs.items()):
        out["inputs"] = dict(inputs)
    return out


def is_orphan_name(name: str) -> bool:
    """A hidden download-in-progress file (``.url-*.part``, ``.<name>.*.tmp``, a marker's ``.tmp``)."""
    return name.startswith(".") and (name.endswith(".part") or name.endswith(".tmp"))


def partial_files(folder: Path) -> list[Path]:
    """Download-in-progress files directly in ``folder`` (orphans unless a download holds the lock)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if is_orphan_name(p.name) and not p.is_symlink())


def regular_file(path: Path) -> bool:
    """A regular file that is not a symlink (cache hits never follow links)."""
    try:
        return not path.is_symlink() and path.is_file()
    except OSError:
        return False


def write_marker(path: Path, marker: dict[str, Any], *, of: Path | None = None) -> dict[str, Any]:
    """Write ``marker`` beside ``path`` atomically, with the size and mtime of ``of`` (default:
    ``path`` itself). ``of`` is the verified copy that is about to be moved to ``path`` (a rename
    keeps both), so the marker is written from the bytes that were checked, before they are in place."""
    st = os.stat(of if of is not None else path)
    if not stat.S_ISREG(st.st_mode):
        raise CacheError(f"{of or path}: {file_kind(st.st_mode)}, not a regular file; no marker was written for it")
    marker = {**marker, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    mp = marker_path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{mp.name}.", suffix=".tmp", dir=mp.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(marker, indent=1))
        os.replace(tmp, mp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return marker


def remove_inside(root: Path, paths: Iterable[Path]) -> list[Path]:
    """Unlink files and symlinks (never what a link points to) whose folder resolves inside ``root``;
    paths already gone, or that cannot be unlinked (a read-only folder), are skipped. Returns those removed.

    Raises:
        CacheError: a path is a folder, or lies in a folder that resolves outside the cache root
            (nothing more is removed).
    """
    base = root.resolve()
    removed: list[Path] = []
    for p in paths:
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            raise CacheError(f"refusing to remove {p}: a folder where a file was expected")
        folder = p.parent.resolve()
        if folder != base and not folder.is_relative_to(base):
            raise CacheError(f"refusing to remove {p}: its folder resolves to {folder}, outside the cache root {base}")
        try:
            os.unlink(p)
        except OSError:
            continue
        removed.append(p)
    return removed


def _link_target(p: Path) -> str:
    try:
        return os.readlink(p)
    except OSError:
        return "?"


def area_dir(root: Path, area: str) -> Path:
    """``root/area`` (it need not exist yet), refused when it is a symlink or not a folder.

    Every area is a real folder inside the root, so nothing in it is ever read, written or removed
    through a link that leads elsewhere.

    Raises:
        CacheError: the area is a symlink, or a file.
    """
    p = root / area
    if p.is_symlink():
        raise CacheError(f"cache area {p} is a symlink (to {_link_target(p)}); cache areas must be real folders "
                         f"inside the cache root, so nothing was read, written or removed through it; remove the link")
    if p.exists() and not p.is_dir():
        raise CacheError(f"cache area {p} is not a folder; move it away")
    return inside(root, p)


def walk_area(root: Path, area: str) -> list[Path]:
    """Every entry below an area that is not a folder (files, symlinks, anything else), sorted.

    Links are never followed: every folder is checked to resolve inside ``root`` before it is listed, and a
    link (to a file or a folder) that resolves outside ``root`` stops the walk, so that a caller that
    removes what it found never starts.

    Raises:
        CacheError: the area is a symlink (see :func:`area_dir`), or a link under it leads outside the root.
    """
    base = area_dir(root, area)
    if not base.is_dir():
        return []
    resolved_root = root.resolve()
    out: list[Path] = []
    stack = [base]
    while stack:
        folder = stack.pop()
        if folder.is_symlink():  # swapped for a link while we walked
            raise CacheError(f"{folder} became a symlink (to {_link_target(folder)}) while the cache was walked; "
                             f"nothing in it was touched")
        inside(root, folder)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for e in entries:
            p = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                stack.append(p)
                continue
            if e.is_symlink():
                target = p.resolve()
                if target != resolved_root and not target.is_relative_to(resolved_root):
                    raise CacheError(f"{p} is a symlink to {target}, outside the cache root {resolved_root}; nothing "
                                     f"was read or removed through it; remove the link")
            out.append(p)
    return sorted(out)


def check_links(root: Path, area: str, sub: str | None = None) -> Path:
    """Create ``root/area[/sub]`` and refuse any symlink under it that resolves outside ``root``.

    Used before a hub client writes into its own cache (``hub/huggingface``, ``hub/modelscope``): a link
    planted there would make the client write, or rotationzoo read and later remove, files elsewhere.

    Raises:
        CacheError: naming the first such link.
    """
    folder = area_dir(root, area)
    folder.mkdir(parents=True, exist_ok=True)
    if sub is not None:
        folder = folder / sub
        if folder.is_symlink():
            raise CacheError(f"{folder} is a symlink (to {_link_target(folder)}); the hub client's cache must be a "
                             f"real folder inside the cache root; remove the link")
        folder.mkdir(exist_ok=True)
    walk_area(root, str(folder.relative_to(root)))  # refuses links that leave the root
    return folder
