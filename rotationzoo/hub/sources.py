"""Downloaders, one per source type, with one signature (like pooch's ``choose_downloader``).

Each returns the downloaded file and every path that must be removed if its bytes turn out bad
(the hub clients keep poisoned blobs otherwise). Bundled data is not downloaded: see
:func:`bundled_path`.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import inspect
import io
import os
import re
import stat
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import config
from ..errors import CacheError, RegistryError
from ..files.limits import MAX_BYTES
from ..registry import FileEntry, Source
from ..registry.safety import bundled_file, check_url
from . import transfer
from .layout import remove_inside
from .localdisk import disk_error, local_write_error
from .network import Unavailable, header_size, limits, reach, shorten


@dataclass
class Download:
    """A downloaded file, what to purge when it fails verification, and the hub commit it came from."""

    path: Path
    purge: list[Path]
    commit: str | None = None


#: ``downloader(source, file, *, hub_cache, dest_dir, revision, force) -> Download``.
Downloader = Callable[..., Download]

#: Most bytes an unpinned file may have (a pinned one stops at its registry size): the reader's limit.
MAX_DOWNLOAD_BYTES = MAX_BYTES


def hf_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def ms_endpoint() -> str | None:
    return os.environ.get("MODELSCOPE_ENDPOINT") or None


def check_endpoint(kind: str) -> None:
    """Refuse, as the source's failure, an ``HF_ENDPOINT`` / ``MODELSCOPE_ENDPOINT`` (for ``kind``) that is
    not an http(s) URL with a host, naming the value (it would fail as "cannot reach" an empty host)."""
    name, value = ("HF_ENDPOINT", hf_endpoint()) if kind == "huggingface" else ("MODELSCOPE_ENDPOINT", ms_endpoint())
    if value is None:
        return
    try:
        parts = urllib.parse.urlsplit(value)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        example = "https://huggingface.co" if kind == "huggingface" else "https://modelscope.cn"
        raise Unavailable(f"{name}={value[:60]!r} is not an http(s) URL with a host (like {example}); "
                          f"fix or unset it", "error")


def user_has_modelscope_home() -> bool:
    """Whether the user keeps a ModelScope client config of their own (``MODELSCOPE_HOME`` or
    ``MODELSCOPE_CREDENTIALS_PATH`` set, or ``~/.modelscope`` there): their login and folders are used."""
    return bool(os.environ.get("MODELSCOPE_HOME") or os.environ.get("MODELSCOPE_CREDENTIALS_PATH")
                or (Path.home() / ".modelscope").exists())


@contextlib.contextmanager
def modelscope_config(folder: Path) -> Iterator[Any]:
    """The ModelScope client's process-wide config for the block (yielded; ``None`` without ``modelscope_hub``).

    The client keeps an SDK install id (``credentials/session``) in its config folder and creates its cache
    folder, ``~/.modelscope`` and ``~/.cache/modelscope`` by default, the first time it is used. A user with
    a ModelScope config of their own (:func:`user_has_modelscope_home`) keeps it, login included; for
    anyone else the client's folders are ``folder`` (inside the cache) for the block, so that nothing is
    written into the home folder, and the config before is put back after it.
    """
    try:
        from modelscope_hub import config as ms_config
    except ImportError:  # an older modelscope: no such config
        yield None
        return
    before = ms_config.get_default_config()
    if user_has_modelscope_home():
        yield before
        return
    import dataclasses

    ms_config.set_default_config(dataclasses.replace(before, config_dir=folder / "config", cache_dir=folder))
    try:
        yield ms_config.get_default_config()
    finally:
        ms_config.set_default_config(before)


def _show_progress() -> bool:
    """Byte progress bars on a terminal only."""
    return sys.stderr.isatty()


def _with_blob(path: str) -> Download:
    p = Path(path)
    # a snapshot entry may be a symlink to a blob; a bad download must remove both
    commit = p.parent.name if re.fullmatch(r"[0-9a-f]{40}", p.parent.name) else None
    parts = p.parts
    if "snapshots" in parts:  # <repo cache>/snapshots/<commit>/<path inside the repo>
        i = parts.index("snapshots")
        commit = parts[i + 1] if i + 1 < len(parts) and re.fullmatch(r"[0-9a-f]{40}", parts[i + 1]) else commit
    return Download(p, [p, Path(os.path.realpath(p))], commit)


@contextlib.contextmanager
def _hf_bars() -> Iterator[None]:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    if not _show_progress():
        disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def _bounded(call: Callable[[], str], hub_cache: Path, cap: int, partials: Callable[[], list[Path]] | None = None,
             error: type[transfer.TransferStopped] = transfer.TransferStopped) -> str:
    """Run a hub client's download under the deadlines and the byte cap (:mod:`.transfer`): no answer
    may bring more than ``cap`` bytes, nor may the client write more (its progress callback reports to
    the transfer, or the files ``partials()`` are watched). A missed deadline or a passed cap is the
    source's failure (``Unavailable``, kind ``timeout`` / ``too_large``), whatever the client made of
    it. An answer the client would sleep and retry on (408, 429, 5xx: kind ``http``) and a dropped
    connection are ``Unavailable`` too, marked retryable (see :func:`download`). A write the local disk
    refused is a ``CacheError`` (:mod:`.localdisk`)."""
    transfer.hook_clients()
    with transfer.transfer(limits(), client=True, error=error, max_bytes=cap) as t, \
            (transfer.watch_files(t, partials, cap) if partials is not None else contextlib.nullcontext()):
        try:
            path = call()
        except Exception as exc:
            if t.stopped is not None:
                raise Unavailable(t.stopped.reason, t.stopped.kind, retryable=t.stopped.kind == "http") from None
            local = local_write_error(exc)
            if local is not None:
                raise disk_error(local, hub_cache) from None
            dropped = dropped_connection(exc)
            if dropped is not None:
                raise Unavailable(f"connection dropped ({dropped})", "error", retryable=True) from None
            raise
    if t.stopped is not None:  # the file passed the cap after the client's last read: it is not kept
        remove_inside(hub_cache, _with_blob(path).purge)
        raise Unavailable(t.stopped.reason, t.stopped.kind)
    return path


def download_cap(f: FileEntry) -> int:
    """The most bytes a download of ``f`` may bring: its registry size, else :data:`MAX_DOWNLOAD_BYTES`."""
    return f.size if f.size is not None else MAX_DOWNLOAD_BYTES


#: Exception types (by name, anywhere in an exception's class hierarchy or its causes) that mean the
#: connection broke before a whole answer arrived: httpx / httpcore, urllib3 / requests, http.client.
_DROPPED = frozenset({
    "ConnectionError", "ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "RemoteDisconnected",
    "IncompleteRead", "RemoteProtocolError", "ReadError", "WriteError", "ConnectError", "NetworkError",
    "ProtocolError", "ChunkedEncodingError",
})


def dropped_connection(exc: BaseException) -> str | None:
    """One line naming the broken connection behind ``exc`` (a reset, a server that hung up, a body
    cut short), or ``None`` when ``exc`` is something else (an HTTP status, a timeout, a local error)."""
    seen: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(seen) < 8 and e not in seen:
        seen.append(e)
        names = {c.__name__ for c in type(e).__mro__}
        if "TimeoutError" in names or "TimeoutException" in names or isinstance(e, transfer.TransferStopped):
            return None
        if names & _DROPPED:
            text = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return shorten(f"{type(e).__name__}: {text}" if text else type(e).__name__, 80)
        e = e.__cause__ or e.__context__
    return None


def download(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None, force: bool,
             say: Callable[[str], None] | None = None) -> Download:
    """Download one file from one source (:data:`DOWNLOADERS`), retrying a 5xx / 408 / 429 answer or a
    dropped connection on any of its requests ``ROTATIONZOO_RETRIES`` times (0.5 s, 1 s, 2 s … apart,
    at most 4 s), each attempt under fresh deadlines. A timeout, a 404 or anything else is not retried.

    Raises:
        Unavailable: the source cannot serve the file (retries included: ``(N attempts)`` in the reason).
        Exception: whatever else the downloader raised.
    """
    retries = config.retries()
    for attempt in range(retries + 1):
        try:
            return DOWNLOADERS[src.type](src, f, hub_cache=hub_cache, dest_dir=dest_dir, revision=revision,
                                         force=force)
        except Unavailable as exc:
            if not exc.retryable or attempt == retries:
                if attempt:
                    exc.reason += f" ({attempt + 1} attempts)"
                raise
            reason = exc.reason
        delay = min(0.5 * 2**attempt, 4.0)
        if say is not None:
            say(f"{src.describe()}: {f.filename}: {reason}; retrying in {delay:g} s")
        time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


@functools.lru_cache(maxsize=1)
def _hf_counting_bar() -> type:
    """``huggingface_hub``'s progress bar, reporting each chunk the client is about to write (decoded: a
    compressed body counts what it inflates to) to the active transfer (:meth:`.transfer.Transfer.wrote`)."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class CountingBar(hf_tqdm):
        def update(self, n: float | None = 1) -> bool | None:
            t = transfer.active()
            if t is not None and n:
                t.wrote(int(n))
            return super().update(n)

    return CountingBar


def download_huggingface(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                         force: bool) -> Download:
    from huggingface_hub import hf_hub_download

    assert src.repo is not None
    repo = src.repo
    # what it writes is counted through its progress bar class (clients before it took one: the byte cap on
    # the wire, and the bounded copy of :mod:`.accept`, still hold)
    counting: dict[str, Any] = {}
    if "tqdm_class" in _parameters(hf_hub_download):
        counting["tqdm_class"] = _hf_counting_bar()
    with _hf_bars(), transfer.over_http():  # a stopped download's ``.incomplete`` file is removed by the client itself
        return _with_blob(_bounded(lambda: hf_hub_download(
            repo_id=repo,
            filename=f.source_path(src),
            revision=revision,
            cache_dir=str(hub_cache / "huggingface"),
            endpoint=hf_endpoint(),
            force_download=force,
            etag_timeout=limits().timeout,
            **counting,
        ), hub_cache, download_cap(f)))


@functools.lru_cache(maxsize=8)
def _parameters(fn: Callable[..., Any]) -> frozenset[str]:
    """The keyword names ``fn`` takes."""
    return frozenset(inspect.signature(fn).parameters)


@functools.lru_cache(maxsize=1)
def _modelscope_stop() -> type[transfer.TransferStopped]:
    """The exception a stopped transfer raises into ModelScope: one of its own non-retryable errors,
    so that it does not sleep and retry (it retries anything else)."""
    try:
        from modelscope_hub.errors import HubError
    except ImportError:  # older modelscope: no retry layer of its own
        return transfer.TransferStopped

    class ModelScopeTransferStopped(transfer.TransferStopped, HubError):
        retryable = False

    return ModelScopeTransferStopped


def _modelscope_copies(hub_cache: Path, repo: str, revision: str | None, path: str, suffix: str = "") -> list[Path]:
    """Where ModelScope keeps a file it downloaded (and, ``suffix=".incomplete"``, a partial download, to
    resume it later): the snapshot layout, and the two older layouts it still reuses."""
    base = hub_cache / "modelscope" / "models"
    owner, _, name = repo.partition("/")
    legacy = name.replace(".", "___")
    folders = [base / repo.replace("/", "--") / "snapshots" / (revision or "master"), base / owner / legacy,
               hub_cache / "modelscope" / "hub" / "models" / owner / legacy]
    return [folder / f"{path}{suffix}" for folder in folders]


def _remove_partials(paths: list[Path], root: Path) -> None:
    """Remove regular files (never a link's target) that lie inside ``root``."""
    top = os.path.realpath(root)
    for p in paths:
        with contextlib.suppress(OSError):
            if os.path.commonpath([os.path.realpath(p.parent), top]) == top and stat.S_ISREG(p.lstat().st_mode):
                p.unlink()


def download_modelscope(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                        force: bool) -> Download:
    from modelscope.hub.file_download import model_file_download

    assert src.repo is not None
    repo = src.repo
    # its tqdm bars cannot be switched off; keep them for terminals, drop them from logs and pipes
    quiet = contextlib.nullcontext() if _show_progress() else contextlib.redirect_stderr(io.StringIO())
    # the client answers from its own copy without asking the hub whether a branch moved (and has no
    # force switch): a download is asked for only when the cache has no verified copy (or --force), so its
    # copy goes first and the bytes come from the hub at the revision asked for
    _remove_partials(_modelscope_copies(hub_cache, repo, revision, f.source_path(src)), hub_cache)
    partials = _modelscope_copies(hub_cache, repo, revision, f.source_path(src), ".incomplete")
    try:
        with quiet, modelscope_config(hub_cache / "modelscope"):
            path = _bounded(lambda: model_file_download(
                model_id=repo,
                file_path=f.source_path(src),
                revision=revision,  # always explicit: None would mean "newest tag"
                cache_dir=str(hub_cache / "modelscope"),
                endpoint=ms_endpoint(),
            ), hub_cache, download_cap(f), lambda: partials, error=_modelscope_stop())
    except BaseException:
        # ModelScope keeps what it got to resume it another time: nothing partial stays in the cache
        _remove_partials(partials, hub_cache)
        raise
    return _with_blob(path)


def download_url(src: Source, f: FileEntry, *, hub_cache: Path, dest_dir: Path, revision: str | None,
                 force: bool) -> Download:
    """Stream ``src.url`` into ``dest_dir/.url-*.part``, never past the expected size (pinned) or
    :data:`MAX_DOWNLOAD_BYTES` (unpinned). One attempt: 5xx, 408, 429, silent timeouts and dropped
    connections raise a retryable :class:`Unavailable` for :func:`download` to retry."""
    assert src.url is not None
    return _stream_url(src.url, f.filename, dest_dir, download_cap(f))


def _stream_url(url: str, name: str, dest_dir: Path, limit: int) -> Download:
    lim = limits()
    with transfer.transfer(lim):
        return _stream_url_in(url, name, dest_dir, limit, lim.timeout)


def _stream_url_in(url: str, name: str, dest_dir: Path, limit: int, timeout: float) -> Download:
    import urllib.error
    import urllib.request

    reach(url, timeout)
    req = urllib.request.Request(url, headers={"User-Agent": "rotationzoo"})
    try:
        resp = transfer.opener(check_redirect).open(req, timeout=timeout)
    except transfer.TransferStopped as exc:  # a silent server is retried like a timeout, a dripping one is not
        raise Unavailable(exc.reason, "timeout", retryable=exc.silent) from None
    except urllib.error.HTTPError as exc:
        exc.close()
        kind = {404: "not_found", 401: "denied", 403: "denied"}.get(exc.code, "http")
        raise Unavailable(f"HTTP {exc.code}", kind, retryable=exc.code >= 500 or exc.code in (408, 429)) from None
    except TimeoutError:
        raise Unavailable(f"no answer within {timeout:g} s", "timeout", retryable=True) from None
    except (OSError, ValueError) as exc:
        raise Unavailable(f"request failed ({shorten(str(exc), 60)})", "error", retryable=True) from None
    with resp:
        declared = header_size(resp.headers.get("Content-Length"))
        if declared is not None and declared > limit:
            raise Unavailable(f"declares {declared} B, more than the expected {limit} B", "too_large")
        fd, tmp = tempfile.mkstemp(prefix=".url-", suffix=".part", dir=dest_dir)
        try:  # unbuffered: a write the disk refuses fails at that write, not at close
            with os.fdopen(fd, "wb", buffering=0) as out, _bar(declared, name) as bar:
                total = 0
                while True:
                    block = resp.read(1 << 20)
                    if not block:
                        break
                    total += len(block)
                    if total > limit:
                        raise Unavailable(f"sent more than the expected {limit} B; stopped", "too_large")
                    _write_all(out, block, dest_dir)
                    bar(len(block))
        except transfer.TransferStopped as exc:
            os.unlink(tmp)
            raise Unavailable(exc.reason, "timeout") from None
        except TimeoutError:
            os.unlink(tmp)
            raise Unavailable(f"stalled for {timeout:g} s mid-download", "timeout", retryable=True) from None
        except CacheError:  # the disk's failure (an OSError too): not a dropped connection
            os.unlink(tmp)
            raise
        except (OSError, http.client.HTTPException) as exc:  # a reset, a body cut short
            os.unlink(tmp)
            raise Unavailable(f"connection dropped mid-download ({shorten(str(exc) or type(exc).__name__, 60)})",
                              "error", retryable=True) from None
        except BaseException:
            os.unlink(tmp)
            raise
    return Download(Path(tmp), [Path(tmp)])


def _write_all(out: Any, block: bytes, folder: Path) -> None:
    """Write ``block`` whole to the unbuffered ``out``; a write the disk refuses is a ``CacheError``."""
    view = memoryview(block)
    try:
        while view:
            view = view[out.write(view):]
    except OSError as exc:
        raise disk_error(exc, folder) from None


def check_redirect(url: str) -> None:
    """Follow a ``url`` source's redirect only to where the registry may point one (``https://``;
    ``http://`` to loopback when allowed: :func:`~rotationzoo.registry.safety.check_url`)."""
    try:
        check_url(url, "redirect")
    except RegistryError:
        raise Unavailable(f"refused a redirect to {shorten(url, 70)}: https:// only (no credentials; http:// only "
                          f"to loopback with ROTATIONZOO_ALLOW_HTTP_LOOPBACK=1)", "denied") from None


@contextlib.contextmanager
def _bar(total: int | None, name: str) -> Iterator[Callable[[int], None]]:
    """A byte progress bar (size, speed, ETA) on a terminal; nothing otherwise."""
    if not _show_progress():
        yield lambda n: None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=name, leave=False) as bar:
        yield bar.update


DOWNLOADERS: dict[str, Downloader] = {
    "huggingface": download_huggingface,
    "modelscope": download_modelscope,
    "url": download_url,
}


def bundled_path(src: Source) -> Path:
    """The package data file a ``bundled`` source names (refused outside the package's data folder)."""
    return bundled_file(str(src.path))


def describe_exc(exc: BaseException) -> str:
    """One line: the exception and the root cause (HTTP status, connection error) the clients wrap."""
    chain: list[BaseException] = []
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
