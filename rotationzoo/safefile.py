"""Regular files only, and lock waits with a deadline: the checks made before any file is opened.

Every file rotationzoo reads from a place a user or another process can write to (the cache, its
markers, the pin file, a dump, a text, a model) goes through :func:`check_regular` /
:func:`open_regular`: a FIFO, a device, a socket, a folder or a kernel pseudo-file (``/proc``,
``/sys``, ``/dev``) is refused by its type, with one line, before it could block a read or feed it
endless bytes. :func:`open_regular` opens with ``O_NONBLOCK`` and checks the descriptor again
(``fstat``), so a FIFO swapped in between the check and the open is refused too, never waited on.

:func:`file_lock` takes a lock file with a deadline: a lock file that cannot be created is an
error at once (never a retry loop), and a lock another process holds past the deadline is an error
that says so.

Example::

    from rotationzoo.safefile import open_regular
    with open_regular(path, what="pin file", error=ConfigError, hint="fix ROTATIONZOO_PINS") as f:
        data = f.read(1 << 20)
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from .errors import ConfigError, ModelLoadError, RotationZooError

#: Kernel pseudo-filesystems: their "regular" files are endless or change on every read.
PSEUDO_ROOTS: tuple[str, ...] = ("/proc", "/sys", "/dev")

_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

ErrorType = type[RotationZooError]


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``"a FIFO"``, ``"a character device"``, ``"a folder"``, …"""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISLNK, "a symlink"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a plain file"


def _pseudo_devices() -> set[int]:
    devs = set()
    for root in PSEUDO_ROOTS:
        with contextlib.suppress(OSError):
            devs.add(os.stat(root).st_dev)
    return devs


def pseudo_file(path: str | os.PathLike[str], st: os.stat_result | None = None) -> str | None:
    """``"a /proc pseudo-file"`` (or ``/sys``, ``/dev``) when ``path`` resolves there or lies on the
    same filesystem, else ``None``."""
    real = os.path.realpath(path)
    for root in PSEUDO_ROOTS:
        if real == root or real.startswith(root + os.sep):
            return f"a {root} pseudo-file"
    if st is not None and st.st_dev in _pseudo_devices():
        return "a kernel pseudo-file"
    return None


def _refusal(path: str | os.PathLike[str], kind: str, what: str, hint: str | None) -> str:
    return (f"{path}: {kind}, not a regular file; the {what} must be a regular file, so nothing was read from it"
            + (f"; {hint}" if hint else ""))


def _checked(path: str | os.PathLike[str], st: os.stat_result, what: str, error: ErrorType,
             hint: str | None, shown: str | None = None) -> os.stat_result:
    if not stat.S_ISREG(st.st_mode):
        raise error(_refusal(shown or path, file_kind(st.st_mode), what, hint))
    pseudo = pseudo_file(path, st)
    if pseudo is not None:
        raise error(_refusal(shown or path, pseudo, what, hint))
    return st


def check_regular(path: str | os.PathLike[str], *, what: str = "file", error: ErrorType = ConfigError,
                  hint: str | None = None, follow_symlinks: bool = True) -> os.stat_result:
    """``os.stat`` of ``path`` after checking that it is a regular file outside ``/proc``, ``/sys``
    and ``/dev`` (links followed unless ``follow_symlinks`` is false, then a link is refused).

    Raises:
        error: it is not (one line naming the path, what it is, and ``hint``).
        OSError: it cannot be stat'ed (``FileNotFoundError`` when missing), as ``os.stat`` raises.
    """
    st = os.stat(path, follow_symlinks=follow_symlinks)
    return _checked(path, st, what, error, hint)


def open_regular(path: str | os.PathLike[str], *, what: str = "file", error: ErrorType = ConfigError,
                 hint: str | None = None, follow_symlinks: bool = True) -> BinaryIO:
    """Open a regular file for reading in binary mode, never blocking on what it turns out to be.

    The path is checked (:func:`check_regular`), opened with ``O_NONBLOCK`` (a FIFO swapped in is
    not waited on) and the descriptor checked again with ``fstat``.

    Raises:
        error: not a regular file, or a kernel pseudo-file.
        OSError: it cannot be opened, as ``os.open`` raises.
    """
    check_regular(path, what=what, error=error, hint=hint, follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | _NONBLOCK | _CLOEXEC | (0 if follow_symlinks else _NOFOLLOW)
    fd = os.open(path, flags)
    try:
        _checked(path, os.fstat(fd), what, error, hint)
        if _NONBLOCK:  # a regular file reads the same either way; later readers expect blocking reads
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], max_bytes: int, *, what: str = "file",
                 error: ErrorType = ConfigError, hint: str | None = None) -> bytes:
    """The bytes of a regular file of at most ``max_bytes`` (see :func:`open_regular`).

    Raises:
        error: not a regular file, or larger than ``max_bytes``.
        OSError: it cannot be read.
    """
    with open_regular(path, what=what, error=error, hint=hint) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{path}: more than the {max_bytes} B a {what} may hold" + (f"; {hint}" if hint else ""))
    return data


def copy_regular(path: str | os.PathLike[str], out: BinaryIO, max_bytes: int, *, what: str = "file",
                 error: ErrorType = ConfigError) -> int:
    """Copy a regular file of at most ``max_bytes`` (see :func:`open_regular`) into ``out``; the bytes copied.

    A file whose size is over the bound is refused before a byte is copied, and one that grows while
    it is copied as soon as it passes the bound.

    Raises:
        error: not a regular file, missing or unreadable (one line with the reason), or larger than
            ``max_bytes``.
        OSError: ``out`` cannot be written.
    """
    too_big = f"{path}: more than the {max_bytes} B a {what} may hold; nothing was copied"
    try:
        f = open_regular(path, what=what, error=error)
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    with f:
        if os.fstat(f.fileno()).st_size > max_bytes:
            raise error(too_big)
        copied = 0
        while True:
            try:
                block = f.read(1 << 20)
            except OSError as exc:
                raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
            if not block:
                return copied
            copied += len(block)
            if copied > max_bytes:
                raise error(too_big)
            out.write(block)  # an OSError here is the destination's: the caller's to say


#: Most files and folders a model folder may hold (its subfolders' included), and how deep they may nest.
MAX_MODEL_ENTRIES, MAX_MODEL_DEPTH = 100_000, 8


def check_model_files(path: str | os.PathLike[str], *, option: str | None = None) -> Path:
    """A local model (a GGUF file, or a transformers folder) whose files are all regular files.

    A file is checked as a regular file outside ``/proc``, ``/sys`` and ``/dev``; a folder's entries
    (``config.json``, weights, tokenizer files, and those of its subfolders up to :data:`MAX_MODEL_DEPTH`
    deep; links followed; hidden ones skipped) likewise, without opening any of them. Call it before a model is loaded: a FIFO or a device given as a model would block the
    loader or feed it endless bytes.

    Args:
        path: the model file or folder.
        option: how the caller names it in messages (``--model``).

    Raises:
        ModelLoadError: missing, or it (or a file in the folder) is not a regular file, or the folder holds
            more than :data:`MAX_MODEL_ENTRIES` entries or nests deeper than :data:`MAX_MODEL_DEPTH`.
    """
    p = Path(path).expanduser()
    label = f"{option} {p}" if option else str(p)
    hint = "give a GGUF file or a transformers model folder"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise ModelLoadError(f"{label}: no such file or folder; {hint}") from None
    except OSError as exc:
        raise ModelLoadError(f"{label}: cannot be read ({exc.strerror or exc}); {hint}") from None
    if not stat.S_ISDIR(st.st_mode):
        _checked(p, st, "model", ModelLoadError, hint, label)
        return p
    folders, seen = [(p, label, 0)], 0
    while folders:  # subfolders too (an index may name sub/model.safetensors), to a bounded depth and count
        folder, shown_as, depth = folders.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            raise ModelLoadError(f"{shown_as}: cannot list the folder ({exc.strerror or exc}); {hint}") from None
        for e in entries:
            if e.name.startswith("."):
                continue
            seen += 1
            if seen > MAX_MODEL_ENTRIES:
                raise ModelLoadError(f"{label}: more than {MAX_MODEL_ENTRIES} files and folders; {hint}")
            name = os.path.join(shown_as, e.name)
            try:
                est = os.stat(e.path)
            except OSError as exc:
                raise ModelLoadError(f"{name} cannot be read ({exc.strerror or exc})") from None
            if not stat.S_ISDIR(est.st_mode):
                _checked(e.path, est, "model's file", ModelLoadError, "a model folder holds regular files only", name)
            elif depth + 1 > MAX_MODEL_DEPTH:
                raise ModelLoadError(f"{name}: folders nested more than {MAX_MODEL_DEPTH} deep in a model; {hint}")
            else:
                folders.append((Path(e.path), name, depth + 1))
    return p


def temp_beside(path: str | os.PathLike[str], *, suffix: str = ".tmp") -> tuple[int, str]:
    """A new hidden file ``.NAME.XXXXXXXX<suffix>`` in ``path``'s folder, open for writing, to be renamed
    onto ``path``: created with the permissions ``open(path, "w")`` would give (0666 less the umask),
    where ``tempfile.mkstemp``'s 0600 would leave a user's output unreadable to the others it was for.

    Returns:
        ``(fd, name)``; the caller closes ``fd`` and renames or removes ``name``.
    """
    import secrets

    p = Path(path)
    for _ in range(100):
        tmp = p.with_name(f".{p.name}.{secrets.token_hex(4)}{suffix}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _NOFOLLOW, 0o666), str(tmp)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {p}")


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (``/proc``), else by setting and
    restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_default_mode(path: str | os.PathLike[str]) -> None:
    """Give a file written by a library that creates it 0600 (safetensors) the permissions ``open(path, "w")``
    would give: 0666 less the umask, as every other output of the project."""
    os.chmod(path, 0o666 & ~current_umask())


def check_output_path(path: str | os.PathLike[str], *, what: str, error: ErrorType) -> Path:
    """Refuse, before any long work, an output path that cannot be written: an existing folder, or a
    parent that is a file or a folder this process cannot write to (the nearest existing one is judged
    when the parent does not exist yet). A link at the path is replaced on writing, never written through.

    Raises:
        error: one line naming the path and what to do.
    """
    p = Path(path)
    check_replaceable(p, what=what, error=error)
    return check_writable_parent(p, what=what, error=error)


def check_replaceable(path: str | os.PathLike[str], *, what: str, error: ErrorType) -> None:
    """Refuse a path that exists as something a file renamed onto it would destroy rather than replace: a
    folder, a device (``/dev/null``), a pipe or a socket. A regular file is replaced; a link is replaced
    itself, never written through.

    Raises:
        error: one line naming the path and what to do.
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # nothing there (yet)
        return
    if stat.S_ISLNK(mode):  # replaced itself; but not a link to a device (/dev/stdout, as root)
        try:
            target = os.stat(path).st_mode
        except OSError:  # a link to nothing
            return
        if not (stat.S_ISREG(target) or stat.S_ISDIR(target)):
            raise error(f"{what} {path} is a link to a device, a pipe or a socket, which writing a file there "
                        f"would replace; give the name of a file")
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise error(f"{what} {path} is a folder; give a file name")
    raise error(f"{what} {path} is a device, a pipe or a socket, which writing a file there would replace; give "
                f"the name of a file")


def replace_with(tmp: str | os.PathLike[str], path: str | os.PathLike[str], *, what: str = "output",
                 error: ErrorType = ConfigError) -> None:
    """Rename the finished file ``tmp`` onto ``path`` (:func:`check_replaceable` first, at the moment of
    writing: what is at ``path`` may have changed since the command began)."""
    check_replaceable(path, what=what, error=error)
    os.replace(tmp, path)


def check_not_input(out: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str]], *, what: str,
                    error: ErrorType) -> None:
    """Refuse an output that is one of the files a run reads, or inside a folder it reads (a report written
    over its text; an export written over the pair it exports). Inputs that do not exist are skipped.

    Raises:
        error: one line naming the output, the input and what to do.
    """
    target = Path(out).expanduser().resolve()
    for given in inputs:
        src = Path(given).expanduser()
        if not src.exists():
            continue
        src = src.resolve()
        if target == src or (src.is_dir() and src in target.parents):
            kind = f"is {given}, a file" if target == src else f"is inside {given}, a folder"
            raise error(f"{what} {out} {kind} this run reads; give another file name")


def check_writable_parent(path: Path, *, what: str, error: ErrorType) -> Path:
    """``path``, after checking that a file or folder can be made there: its nearest existing parent is a
    folder this process can write to (the outputs' shared check: :func:`check_output_path`, and the fit's
    output folder).

    Raises:
        error: one line naming the path and what to do.
    """
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise error(f"{what} {path}: {parent} is not a folder; give a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise error(f"{what} {path}: the folder {parent} is not writable; give a path in a writable folder")
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all (a temporary file beside it, then a rename: a link
    at ``path`` is replaced, never written through); the parent folder is created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(p)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        replace_with(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str], *, timeout: float, what: str, error: ErrorType,
              hint: str | None = None, busy_hint: str | None = None) -> Iterator[None]:
    """Hold the ``filelock`` lock file ``path`` for the block, waiting at most ``timeout`` seconds.

    ``hint`` ends every error line; ``busy_hint``, when given, ends the one of a lock held past the
    deadline instead (``""``: nothing), where a hint about creating the lock file would mislead.

    The lock file is created (or opened) first, without following a link and without blocking: one
    that cannot be created, or that is not a regular file, is an error at once.

    Raises:
        error: the lock file cannot be created or is not a regular file, or another process held
            the lock for ``timeout`` seconds.
    """
    from filelock import FileLock, Timeout

    p = os.fspath(path)
    tail = f"; {hint}" if hint else ""
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | _NONBLOCK | _CLOEXEC | _NOFOLLOW, 0o644)
    except OSError as exc:
        raise error(f"cannot create the lock file {p} of the {what} ({exc.strerror or exc}){tail}") from None
    try:
        _checked(p, os.fstat(fd), f"lock file of the {what}", error, hint)
    finally:
        os.close(fd)
    lock = FileLock(p, timeout=timeout)
    try:
        lock.acquire()
    except Timeout:
        raise error(f"the {what} is locked by another process ({p}) and was not released within {timeout:g} s; "
                    f"try again once it is done{tail if busy_hint is None else f'; {busy_hint}' if busy_hint else ''}"
                    ) from None
    except OSError as exc:
        raise error(f"cannot take the lock file {p} of the {what} ({exc.strerror or exc}){tail}") from None
    try:
        yield
    finally:
        lock.release()
