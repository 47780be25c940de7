"""Failing fast and quietly: reachability probes, one bounded pre-flight request per source, and the
hub clients' own retry logs kept off the terminal.

Before a hub client is asked for a file, :func:`preflight` checks the source the way the client would
reach it:

1. **reach** the host: DNS lookup, TCP connect and (for ``https``) the TLS handshake, each bounded by
   ``ROTATIONZOO_TIMEOUT``. A DNS failure, a refused connection or a TLS error fails the source at once
   (no retries: they do not heal in seconds), and the host is remembered as unreachable for a minute so
   that other sources and files on it fail at once too;
2. **ask** for the file: ``HEAD`` (Hugging Face) or the folder listing (ModelScope, which also gives
   the file's size, sha256 and commit), without following redirects. ``404`` / ``401`` / ``403`` fail the source at once; ``5xx``, ``408``, ``429`` and
   silent timeouts are retried ``ROTATIONZOO_RETRIES`` times (0.5 s, 1 s, 2 s … apart); a dripping
   answer, a declared size that differs from the registry's or exceeds the download cap fail it.

Only then does the client download, with its log records captured by :func:`quiet_clients` (they are
kept for ``--debug`` / the ``rotationzoo`` logger at DEBUG level, never printed).

Every download — a pre-flight request, a ``url`` stream, everything a hub client sends for one file —
runs as a :class:`~.transfer.Transfer` with two deadlines, checked on each socket read (see
:class:`~.limits.Limits` and :mod:`.transfer`): an answer's headers within ``timeout`` seconds of its request,
and a body that keeps up with ``min_rate`` bytes per second (a body of ``S`` bytes ends within
``timeout + S / min_rate`` seconds). A source that misses one is given up at once, so a server
dripping a byte every few seconds costs about ``timeout`` seconds, not hours.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Iterator

from .. import config
from .limits import Limits, limits, using  # noqa: F401  (public names of this module)
from .transfer import GuardedHTTPConnection, GuardedHTTPSConnection, TransferStopped, header_size, transfer

log = logging.getLogger("rotationzoo")

#: Loggers of the hub clients whose records are captured during a download.
CLIENT_LOGGERS = ("huggingface_hub", "modelscope", "modelscope_hub", "httpx", "httpx2", "urllib3", "filelock")

_UNREACHABLE_TTL_S = 60.0
_unreachable: dict[tuple[str, int], tuple[float, str]] = {}
_lock = threading.Lock()

HF_DEFAULT_ENDPOINT = "https://huggingface.co"
MS_DEFAULT_ENDPOINT = "https://modelscope.cn"


class Unavailable(Exception):
    """A source cannot serve the file now. ``kind`` is one of :data:`KINDS`; ``retryable`` marks
    failures worth another attempt (5xx, 408/429, timeouts)."""

    def __init__(self, reason: str, kind: str, *, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.kind, self.retryable = reason, kind, retryable


KINDS = ("unreachable", "timeout", "http", "not_found", "denied", "wrong_size", "too_large", "error")


@dataclass
class Preflight:
    """What the source said about the file: HTTP status, the size it declares (if any), the body (only
    when asked for, at most :data:`MAX_BODY` bytes) and the sha256 it declares for an LFS file
    (Hugging Face's ``X-Linked-Etag``; ``None`` when absent or not 64 hex digits)."""

    status: int
    size: int | None
    body: bytes = b""
    sha256: str | None = None


MAX_BODY = 4 << 20


def shorten(text: str, limit: int = 120) -> str:
    """One line of at most ``limit`` characters (cut at a word boundary, marked with ``…``)."""
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    cut = line[: limit - 1].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else line[: limit - 1]) + "…"


# -- deadlines ------------------------------------------------------------------------------------


def _resolve(host: str, port: int, timeout: float) -> list[tuple]:
    """``getaddrinfo`` with a deadline (it has none of its own)."""
    result: list = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.extend(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as exc:  # noqa: BLE001 - reported below
            error.append(exc)

    t = threading.Thread(target=run, daemon=True, name="rotationzoo-dns")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Unavailable(f"cannot reach {host}: DNS lookup timed out after {timeout:g} s", "unreachable")
    if error:
        raise Unavailable(f"cannot reach {host}: DNS lookup failed ({shorten(str(error[0]), 60)})", "unreachable")
    return result


def reach(url: str, timeout: float | None = None) -> None:
    """Raise :class:`Unavailable` unless ``url``'s host resolves, accepts a TCP connection and (https)
    completes a TLS handshake. A failure is remembered for a minute."""
    timeout = limits().timeout if timeout is None else timeout
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    key = (host, port)
    with _lock:
        seen = _unreachable.get(key)
        if seen is not None and time.monotonic() - seen[0] < _UNREACHABLE_TTL_S:
            raise Unavailable(seen[1], "unreachable")
    try:
        addrs = _resolve(host, port, timeout)
        last: BaseException | None = None
        for family, kind, proto, _, addr in addrs:
            try:
                with socket.socket(family, kind, proto) as sock:
                    sock.settimeout(timeout)
                    sock.connect(addr)
                    if parts.scheme == "https":
                        ctx = ssl.create_default_context()
                        with ctx.wrap_socket(sock, server_hostname=host):
                            pass
                    return
            except ssl.SSLError as exc:
                raise Unavailable(f"cannot reach {host}: TLS handshake failed ({shorten(str(exc), 60)})",
                                  "unreachable") from None
            except TimeoutError:
                raise Unavailable(f"cannot reach {host}:{port}: connection timed out after {timeout:g} s",
                                  "unreachable") from None
            except OSError as exc:
                last = exc
        reason = f"cannot reach {host}:{port}: {_os_reason(last)}"
        raise Unavailable(reason, "unreachable")
    except Unavailable as exc:
        with _lock:
            _unreachable[key] = (time.monotonic(), exc.reason)
        raise


def _os_reason(exc: BaseException | None) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if exc is None:
        return "no address"
    return shorten(getattr(exc, "strerror", None) or str(exc), 60)


def forget_unreachable() -> None:
    """Clear the memory of unreachable hosts (a new attempt probes them again)."""
    with _lock:
        _unreachable.clear()


def _request(url: str, method: str, headers: dict[str, str], timeout: float, read_body: bool) -> Preflight:
    parts = urllib.parse.urlsplit(url)
    conn_cls = GuardedHTTPSConnection if parts.scheme == "https" else GuardedHTTPConnection
    conn = conn_cls(parts.hostname or "", parts.port, timeout=timeout)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    try:
        with transfer(Limits(timeout, limits().min_rate)):
            conn.request(method, target or "/", headers={"User-Agent": "rotationzoo", **headers})
            resp = conn.getresponse()
            body = resp.read(MAX_BODY) if read_body and resp.status < 300 else b""
        size = _declared_size(resp) if resp.status in (200, 206) and not read_body else None
        linked = header_size(resp.getheader("X-Linked-Size"))
        if linked is not None:  # an LFS file behind a redirect: its real size
            size = linked
        return Preflight(resp.status, size, body, header_sha256(resp.getheader("X-Linked-Etag")))
    except TransferStopped as exc:  # a silent answer is retried like a timeout; a dripping one is not
        raise Unavailable(exc.reason, "timeout", retryable=exc.silent) from None
    except TimeoutError:
        raise Unavailable(f"no answer within {timeout:g} s", "timeout", retryable=True) from None
    except (OSError, http.client.HTTPException) as exc:
        raise Unavailable(f"connection failed ({shorten(str(exc) or type(exc).__name__, 60)})", "error",
                          retryable=True) from None
    finally:
        conn.close()


def _declared_size(resp: http.client.HTTPResponse) -> int | None:
    for name in ("X-Linked-Size", "Content-Range", "Content-Length"):
        value = resp.getheader(name)
        if not value:
            continue
        size = header_size(value.rsplit("/", 1)[-1] if name == "Content-Range" else value)
        if size is not None:
            return size
    return None


def header_sha256(value: str | None) -> str | None:
    """A sha256 from an ETag-like header (``"<64 hex>"``, ``W/`` allowed), lowercase, else ``None``."""
    text = (value or "").strip().removeprefix("W/").strip('"').lower()
    return text if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else None


def ask(url: str, *, method: str = "HEAD", headers: dict[str, str] | None = None, timeout: float | None = None,
        retries: int | None = None, read_body: bool = False, say: Callable[[str], None] | None = None) -> Preflight:
    """One bounded request for ``url`` (after :func:`reach`), retried on 5xx/408/429/timeouts.

    Raises:
        Unavailable: the host is unreachable, the file is missing or refused, or retries ran out.
    """
    timeout = limits().timeout if timeout is None else timeout
    retries = config.retries() if retries is None else retries
    reach(url, timeout)
    for attempt in range(retries + 1):
        try:
            answer = _request(url, method, headers or {}, timeout, read_body)
        except Unavailable as exc:
            failure = exc
            if not failure.retryable:  # a dripping answer: the next source, not another try
                raise
        else:
            status = answer.status
            if status < 400:
                return answer
            if status == 404:
                raise Unavailable("not found (HTTP 404)", "not_found")
            if status in (401, 403):
                raise Unavailable(f"access denied (HTTP {status}); a token may be needed", "denied")
            retryable = status >= 500 or status in (408, 429)
            failure = Unavailable(f"HTTP {status}", "http", retryable=retryable)
            if not retryable:
                raise failure
        if attempt == retries:
            if attempt:
                failure.reason += f" ({attempt + 1} attempts)"
            raise failure
        delay = min(0.5 * 2**attempt, 4.0)
        if say is not None:
            say(f"{shorten(url, 80)}: {failure.reason}; retrying in {delay:g} s")
        time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def file_url(kind: str, repo: str, path: str, revision: str, endpoint: str | None) -> tuple[str, str, dict[str, str]]:
    """``(url, method, headers)`` of the pre-flight request for a file on a hub: the file's ``HEAD``
    on Hugging Face, its folder's listing on ModelScope (see :func:`listed_file`)."""
    q = urllib.parse.quote
    if kind == "huggingface":
        base = (endpoint or HF_DEFAULT_ENDPOINT).rstrip("/")
        return f"{base}/{repo}/resolve/{q(revision, safe='')}/{q(path)}", "HEAD", {"Accept-Encoding": "identity"}
    if kind == "modelscope":
        base = (endpoint or MS_DEFAULT_ENDPOINT).rstrip("/")
        folder = path.rsplit("/", 1)[0] if "/" in path else ""
        query = urllib.parse.urlencode({"Revision": revision, "Root": folder, "Recursive": "False"})
        return f"{base}/api/v1/models/{repo}/repo/files?{query}", "GET", {"Accept": "application/json"}
    raise ValueError(f"no pre-flight request for source type {kind!r}")


def listed_file(body: bytes, path: str) -> dict[str, object]:
    """The ModelScope listing's record of ``path`` (``Size``, ``Sha256``, ``Revision``).

    Raises:
        Unavailable: the listing is not JSON, or does not hold the file.
    """
    try:
        data = json.loads(body)
        files = data["Data"]["Files"]
        record = next(f for f in files if isinstance(f, dict) and f.get("Path") == path)
    except StopIteration:
        raise Unavailable("not found (not in the folder listing)", "not_found") from None
    except (ValueError, KeyError, TypeError):
        raise Unavailable("the folder listing is not ModelScope's JSON", "error") from None
    return record


@contextlib.contextmanager
def quiet_clients() -> Iterator[list[str]]:
    """Capture the hub clients' log records (retry notices, warnings) instead of printing them.

    Yields the list the captured lines are appended to; they are also logged to ``rotationzoo`` at
    DEBUG level.
    """
    lines: list[str] = []

    class _Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            try:
                msg = f"{record.name}: {record.getMessage()}"
            except Exception:  # noqa: BLE001 - a malformed record must not break a download
                msg = f"{record.name}: {record.msg!r}"
            lines.append(msg)
            log.debug("client log: %s", msg)

    handler = _Capture(logging.DEBUG)
    saved = []
    for name in CLIENT_LOGGERS:
        lg = logging.getLogger(name)
        saved.append((lg, lg.handlers[:], lg.propagate))
        lg.handlers = [handler]
        lg.propagate = False
    try:
        yield lines
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers = handlers
            lg.propagate = propagate
