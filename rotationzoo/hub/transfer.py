"""Deadlines on the byte stream: every socket read of a download is bounded by its transfer's
deadlines, whoever makes it — rotationzoo's own requests, ``huggingface_hub`` (httpx over httpcore)
or ``modelscope`` (requests over urllib3).

A download runs inside :func:`transfer`; the :class:`Transfer` it yields lives in a context
variable, so only reads made by that thread or task, while the block runs, are affected. The hub
clients' reads are reached through three small hooks (:func:`hook_clients`), installed once, that do
nothing outside a transfer:

* httpcore's ``SyncStream.read`` / ``TLSinTLSStream.read``: each read's timeout is cut to the time
  left (and a read past a deadline raises);
* httpx's ``HTTPTransport.handle_request``: marks where a request starts and its headers end;
* urllib3's ``HTTPConnection.getresponse``: the same, and its socket is wrapped in a
  :class:`GuardedSocket` so that ``http.client``'s reads are cut the same way.

A transfer may also cap the bytes of each answer (``max_bytes``): an answer that declares more
(``Content-Length``) is stopped at its headers, one that sends more is stopped at the read that
passes the cap (plus :func:`byte_slack` for chunk framing), whatever the client would have made of
it. A compressed body the client inflates is stopped once what it writes passes the cap: counted by
the client's progress callback (:meth:`Transfer.wrote`, ``huggingface_hub``) or seen by
:func:`watch_files` (ModelScope). ``huggingface_hub``'s Xet transfers read in Rust, past the hooks:
:func:`over_http` switches them off for a download.

The clients run in the calling thread, so when a download returns or raises, nothing of it is left
running. A stopped transfer raises into the client an exception it does not retry on (for
ModelScope, one of its own non-retryable errors), and every later request of the transfer raises at
once; what the client wrote so far is its own partial file, which it removes (huggingface_hub) or
the downloader removes (ModelScope, see :mod:`.sources`).
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import io
import logging
import os
import socket
import stat
import sys
import threading
import time
import urllib.request
from typing import Any, Callable, Iterable, Iterator, TypeVar

from .limits import Limits

log = logging.getLogger("rotationzoo")


class TransferStopped(Exception):
    """A transfer missed a deadline (``kind`` ``"timeout"``), a hub client got an answer it would
    sleep and retry on (``kind`` ``"http"``), or an answer passed the byte cap (``kind``
    ``"too_large"``). ``silent``: nothing at all arrived in time."""

    def __init__(self, reason: str, kind: str = "timeout", silent: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.kind, self.silent = reason, kind, silent


class Transfer:
    """The deadlines of one download (every request made for one file from one source), checked on
    each socket read made while it is active (:func:`transfer`). Once a deadline is missed the
    transfer stays stopped: every later read or request of it raises ``error`` at once, so a client
    that retries or swallows the error cannot go on."""

    def __init__(self, lim: Limits, *, client: bool = False, error: type[TransferStopped] = TransferStopped,
                 max_bytes: int | None = None) -> None:
        self.limits, self.client, self.error, self.max_bytes = lim, client, error, max_bytes
        self.stopped: TransferStopped | None = None
        self._answer_bytes = 0
        self._written = 0
        self._headers_due: float | None = None
        self._in_body = False
        self._body_start: float | None = None
        self._body_bytes = 0
        self._phase_bytes = 0

    def request(self) -> None:
        """A request was sent: its answer's headers are due within ``timeout``."""
        self._check()
        self._headers_due, self._in_body, self._phase_bytes = time.monotonic() + self.limits.timeout, False, 0

    def answered(self, status: int, declared: int | None = None) -> None:
        """The answer's headers arrived (``declared``: its ``Content-Length``, ``None`` for a ``HEAD``).
        A hub client's 408 / 429 / 5xx ends the transfer: the client would sleep (as long as a
        ``Retry-After`` says) and retry, while rotationzoo fails over. So does an answer declaring more
        than ``max_bytes``."""
        self._check()
        self._headers_due, self._in_body, self._phase_bytes, self._answer_bytes = None, True, 0, 0
        if self.client and (status in (408, 429) or status >= 500):
            self._stop(f"HTTP {status} on the download request", "http")
        if self.max_bytes is not None and declared is not None and declared > self.max_bytes:
            self._stop(f"the download declares {declared} B, more than the expected {self.max_bytes} B", "too_large")

    def read_timeout(self, timeout: float | None) -> float:
        """Socket timeout for the next read: ``timeout`` (the caller's), at most ``limits.timeout``,
        never past a deadline. Raises ``error`` when a deadline has passed."""
        self._check()
        now = time.monotonic()
        if self._in_body and self._body_start is None:
            self._body_start = now  # the body's budget runs from its first read
        limit = self.limits.timeout if timeout is None else min(timeout, self.limits.timeout)
        due = self._due()
        if due is not None:
            if due <= now:
                self._expire()
            limit = min(limit, due - now)
        return max(limit, 1e-3)

    def received(self, n: int) -> None:
        """``n`` bytes were read; past ``max_bytes`` (and :func:`byte_slack`) in one answer the transfer stops."""
        self._phase_bytes += n
        if self._in_body:
            self._body_bytes += n
            self._answer_bytes += n
            cap = self.max_bytes
            if cap is not None and self._answer_bytes > cap + byte_slack(cap):
                self._stop(f"sent more than the expected {cap} B; stopped", "too_large")

    def wrote(self, n: int) -> None:
        """The client is about to write ``n`` more bytes of the file (``n < 0``: it dropped some to start
        over); past ``max_bytes`` the transfer stops before they are written."""
        self._check()
        self._written += n
        if self.max_bytes is not None and self._written > self.max_bytes:
            self._stop(f"wrote more than the expected {self.max_bytes} B; stopped", "too_large")

    def trip(self, reason: str, kind: str) -> None:
        """Stop the transfer from another thread (:func:`watch_files`): the client's next read or request
        raises ``error``."""
        if self.stopped is None:
            self.stopped = self.error(reason, kind)

    def timed_out(self) -> None:
        """A read timed out: raise ``error`` if that was a deadline (else it was a silent read, for
        the caller to handle as before)."""
        due = self._due()
        if due is not None and time.monotonic() >= due - 0.01:
            self._expire()

    def _due(self) -> float | None:
        dues = [] if self._headers_due is None else [self._headers_due]
        if self._body_start is not None and self.limits.min_rate:
            dues.append(self._body_start + self.limits.timeout + self._body_bytes / self.limits.min_rate)
        return min(dues, default=None)

    def _expire(self) -> None:
        lim, silent = self.limits, self._phase_bytes == 0
        if not self._in_body:
            reason = (f"no answer within {lim.timeout:g} s" if silent else
                      f"headers not complete {lim.timeout:g} s after the request ({self._phase_bytes} B: dripping)")
        else:
            elapsed = time.monotonic() - (self._body_start or time.monotonic())
            reason = (f"body too slow: {self._body_bytes} B in {elapsed:.1f} s, under the minimum "
                      f"{lim.min_rate:g} B/s (ROTATIONZOO_MIN_RATE)")
        self._stop(reason, "timeout", silent)

    def _stop(self, reason: str, kind: str, silent: bool = False) -> None:
        if self.stopped is None:
            self.stopped = self.error(reason, kind, silent)
        raise self.stopped

    def _check(self) -> None:
        if self.stopped is not None:
            raise self.error(self.stopped.reason, self.stopped.kind, self.stopped.silent)


_active: contextvars.ContextVar[Transfer | None] = contextvars.ContextVar("rotationzoo_transfer", default=None)


def active() -> Transfer | None:
    """The transfer of this thread or task, if one is running."""
    return _active.get()


def byte_slack(cap: int) -> int:
    """Bytes an answer may read past a cap of ``cap`` before it is stopped: chunked encoding's framing."""
    return (64 << 10) + cap // 64


def header_size(value: str | None) -> int | None:
    """A size from an HTTP header: plain ASCII digits (at most 19), else ``None`` (``"²"``, ``"1e9"``, junk)."""
    text = (value or "").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 19 else None


def declared_length(headers: Any, method: str | None) -> int | None:
    """An answer's ``Content-Length`` (:func:`header_size`), ``None`` when absent, malformed or the request a ``HEAD``."""
    if (method or "").upper() == "HEAD":
        return None
    return header_size(str(headers.get("Content-Length") or ""))


@contextlib.contextmanager
def transfer(lim: Limits, *, client: bool = False, error: type[TransferStopped] = TransferStopped,
             max_bytes: int | None = None) -> Iterator[Transfer]:
    """Run a download under ``lim``: socket reads in this block (this thread or task) report to the
    yielded :class:`Transfer`. ``client``: the requests are a hub client's (see
    :meth:`Transfer.answered`); ``error``: the exception type raised into the client; ``max_bytes``:
    the most bytes one answer may bring (see :meth:`Transfer.received`)."""
    t = Transfer(lim, client=client, error=error, max_bytes=max_bytes)
    token = _active.set(t)
    try:
        yield t
    finally:
        _active.reset(token)


@contextlib.contextmanager
def watch_files(t: Transfer, paths: Callable[[], Iterable[os.PathLike[str]]], cap: int,
                interval: float = 0.05) -> Iterator[None]:
    """While the block runs, stop ``t`` (:meth:`Transfer.trip`, kind ``"too_large"``) as soon as a
    regular file among ``paths()`` — the partial files a hub client writes — is larger than ``cap``:
    the byte cap of :meth:`Transfer.received` counts the bytes on the wire, this one what the client
    wrote from them (a compressed body it inflates). Checked every ``interval`` seconds by a thread."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(interval):
            for p in paths():
                with contextlib.suppress(OSError):
                    st = os.lstat(p)
                    if stat.S_ISREG(st.st_mode) and st.st_size > cap:
                        t.trip(f"wrote more than the expected {cap} B; stopped", "too_large")
                        return

    watcher = threading.Thread(target=run, daemon=True, name="rotationzoo-watch")
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


_XET_LOCK = threading.Lock()
_XET_RUNNING = [0]  # downloads running with Xet switched off
_XET_BEFORE: list[Any] = [False]  # huggingface_hub's setting before the first of them


@contextlib.contextmanager
def over_http() -> Iterator[None]:
    """Switch ``huggingface_hub``'s Xet transfers off while the block runs (``constants.HF_HUB_DISABLE_XET``,
    which the client reads at each download): a Xet-backed file then comes over plain HTTP, where the deadlines
    and the byte cap of :mod:`.transfer` see every byte (the Xet client reads in Rust, past both). Rotation
    files are small; nothing is lost but Xet's chunk reuse. Other downloads of the process running meanwhile
    use HTTP too; the setting is restored when the last of these blocks ends."""
    from huggingface_hub import constants

    with _XET_LOCK:
        if _XET_RUNNING[0] == 0:
            _XET_BEFORE[0] = constants.HF_HUB_DISABLE_XET
        _XET_RUNNING[0] += 1
        constants.HF_HUB_DISABLE_XET = True
    try:
        yield
    finally:
        with _XET_LOCK:
            _XET_RUNNING[0] -= 1
            if _XET_RUNNING[0] == 0:
                constants.HF_HUB_DISABLE_XET = _XET_BEFORE[0]


class GuardedSocket:
    """A connected socket (plain or TLS) whose reads through :meth:`makefile` — how ``http.client``
    and ``urllib3`` read answers — honour the active transfer's deadlines; the rest is the socket's."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, value: float | None) -> None:
        self._timeout = value
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._timeout

    def makefile(self, mode: str = "r", buffering: int | None = None, **kwargs: Any) -> Any:
        if mode != "rb":
            return self._sock.makefile(mode, buffering, **kwargs)  # type: ignore[call-overload]
        reader = _GuardedReader(self._sock.makefile("rb", buffering=0), self)
        return reader if buffering == 0 else io.BufferedReader(reader, buffering or io.DEFAULT_BUFFER_SIZE)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _GuardedReader(io.RawIOBase):
    def __init__(self, raw: Any, owner: GuardedSocket) -> None:
        self._raw, self._owner = raw, owner

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def readinto(self, buffer: Any) -> int | None:
        t = _active.get()
        if t is None:
            return self._raw.readinto(buffer)
        sock, base = self._owner._sock, self._owner._timeout
        sock.settimeout(t.read_timeout(base))
        try:
            n = self._raw.readinto(buffer)
        except TimeoutError:
            t.timed_out()
            raise
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(base)
        t.received(n or 0)
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


_R = TypeVar("_R")


def guarded_getresponse(conn: Any, getresponse: Callable[[], _R]) -> _R:
    """``conn.getresponse()`` (an ``http.client`` or ``urllib3`` connection) as a step of the active
    transfer: the socket's reads are guarded, the headers are due within ``timeout``."""
    t = _active.get()
    if t is None:
        return getresponse()
    if conn.sock is not None and not isinstance(conn.sock, GuardedSocket):
        conn.sock = GuardedSocket(conn.sock)
    # the request's method: urllib3 keeps it in its response options, http.client on the connection
    method = getattr(getattr(conn, "_response_options", None), "request_method", None) or getattr(conn, "_method", None)
    t.request()
    response = getresponse()
    try:
        t.answered(int(getattr(response, "status", 0)), declared_length(getattr(response, "headers", {}), method))
    except BaseException:
        response.close()  # type: ignore[attr-defined]
        raise
    return response


class GuardedHTTPConnection(http.client.HTTPConnection):
    """``http.client.HTTPConnection`` whose answers are read under the active transfer."""

    def getresponse(self) -> http.client.HTTPResponse:
        return guarded_getresponse(self, super().getresponse)


class GuardedHTTPSConnection(http.client.HTTPSConnection):
    """``http.client.HTTPSConnection`` whose answers are read under the active transfer."""

    def getresponse(self) -> http.client.HTTPResponse:
        return guarded_getresponse(self, super().getresponse)


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(GuardedHTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(GuardedHTTPSConnection, req)  # the default TLS context, as urlopen's


class _CheckedRedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only after ``check(new_url)`` passed (it raises to refuse one)."""

    def __init__(self, check: Callable[[str], None]) -> None:
        self._check_url = check

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> urllib.request.Request | None:
        try:
            self._check_url(newurl)
        except BaseException:
            fp.close()
            raise
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def opener(check_redirect: Callable[[str], None] | None = None) -> urllib.request.OpenerDirector:
    """A ``urllib`` opener (redirects, proxies from the environment) whose connections honour the
    active transfer's deadlines. ``check_redirect(url)`` is called with every redirect's target before
    it is followed, and raises to refuse it (the exception reaches the caller of ``open``)."""
    handlers: list[Any] = [_HTTPHandler, _HTTPSHandler]
    if check_redirect is not None:
        handlers.append(_CheckedRedirectHandler(check_redirect))
    return urllib.request.build_opener(*handlers)


_hook_lock = threading.Lock()
_hooked: set[str] = set()


def hook_clients() -> None:
    """Put the hub clients' HTTP stacks that are loaded (httpx2/httpcore2 or httpx/httpcore,
    urllib3) under the active transfer's deadlines. Idempotent; no effect outside a transfer."""
    with _hook_lock:
        for httpx_name, core_name in (("httpx2", "httpcore2"), ("httpx", "httpcore")):
            if httpx_name in sys.modules and httpx_name not in _hooked:
                _hook_httpx(httpx_name, core_name)
                _hooked.add(httpx_name)
        if "urllib3" in sys.modules and "urllib3" not in _hooked:
            _hook_urllib3()
            _hooked.add("urllib3")


def _hook_httpx(httpx_name: str, core_name: str) -> None:
    import importlib

    httpx = importlib.import_module(httpx_name)
    core = importlib.import_module(core_name)
    sync = importlib.import_module(f"{core_name}._backends.sync")
    streams = [getattr(sync, n) for n in ("SyncStream", "TLSinTLSStream") if hasattr(sync, n)]
    transport = getattr(httpx, "HTTPTransport", None)
    if not streams or transport is None or not hasattr(core, "ReadTimeout"):
        log.warning("rotationzoo: %s %s has no stream reads to bound; its downloads are not under the "
                    "ROTATIONZOO_TIMEOUT / ROTATIONZOO_MIN_RATE deadlines", core_name,
                    getattr(core, "__version__", "?"))
        return
    read_timeout = core.ReadTimeout
    for cls in streams:
        original_read = cls.read

        def read(self: Any, max_bytes: int, timeout: float | None = None, _read: Any = original_read) -> bytes:
            t = _active.get()
            if t is None:
                return _read(self, max_bytes, timeout)
            try:
                data = _read(self, max_bytes, t.read_timeout(timeout))
            except read_timeout:
                t.timed_out()
                raise
            t.received(len(data))
            return data

        cls.read = read

    original_handle = transport.handle_request

    def handle_request(self: Any, request: Any) -> Any:
        t = _active.get()
        if t is None:
            return original_handle(self, request)
        t.request()
        response = original_handle(self, request)
        try:
            t.answered(response.status_code, declared_length(response.headers, request.method))
        except BaseException:
            response.close()
            raise
        return response

    transport.handle_request = handle_request


def _hook_urllib3() -> None:
    import urllib3.connection

    cls = urllib3.connection.HTTPConnection
    original = cls.getresponse

    def getresponse(self: Any, *args: Any, **kwargs: Any) -> Any:
        return guarded_getresponse(self, lambda: original(self, *args, **kwargs))

    cls.getresponse = getresponse  # type: ignore[method-assign]
