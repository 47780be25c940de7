"""A local hub server for tests: the Hugging Face and ModelScope wire protocols on 127.0.0.1.

The real ``huggingface_hub`` and ``modelscope`` clients talk to this server as if it were the
public hub, so fetch and publish code can be tested end to end without network access.
Only the standard library is used, and the server starts in well under a second.

Script mode::

    python tests/hubserver.py --host 127.0.0.1 --port 0 [--token T] [--data DIR]

prints exactly one line ``HUB_URL=http://127.0.0.1:<port>`` and serves until SIGTERM or SIGINT.

In-process mode::

    with HubServer(token="secret") as hub:
        HfApi(endpoint=hub.url, token=hub.token).create_repo("acme/demo")

Test hooks (Python methods and HTTP endpoints under ``/_test/``): a request log, one-shot
fault injection (``corrupt``, ``truncate``, ``http500``, ``reset``, ``slow``, ``drip_headers``,
``drip_body``) and plain raw
files served under ``/raw/<path>``. See ``docs/test-hub-server.md``.

When pytest is importable, this module also defines the fixtures ``hub_server``,
``hub_server_factory`` and ``hub_env`` (``from hubserver import hub_server, hub_env``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import datetime as _dt
import fnmatch
import hashlib
import hmac
import http.server
import ipaddress
import json
import os
import secrets
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

try:  # advisory file locks for ``--data`` shared between processes (POSIX only)
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX platforms
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_BRANCH",
    "FAULT_KINDS",
    "HubServer",
    "TEST_TOKEN",
    "TEST_USER",
    "HubEnv",
    "configure_clients",
    "git_blob_oid",
    "main",
]

DEFAULT_BRANCH = "main"
"""Default branch of every repository. ModelScope's ``master`` is an alias of it."""

MS_DEFAULT_BRANCH = "master"

TEST_TOKEN = "hub-test-token"
"""Token used by the ``hub_server`` fixture."""

TEST_USER = "testuser"
"""User name reported by whoami endpoints."""

FAULT_KINDS = ("corrupt", "truncate", "http500", "reset", "slow", "drip_headers", "drip_body", "xet")

_BODY_FAULTS = ("corrupt", "truncate", "drip_body")

_REPO_TYPES = ("model", "dataset", "space")

_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"

# The .gitattributes a new Hugging Face repository starts with; its patterns decide LFS uploads.
GITATTRIBUTES = """\
*.7z filter=lfs diff=lfs merge=lfs -text
*.arrow filter=lfs diff=lfs merge=lfs -text
*.bin filter=lfs diff=lfs merge=lfs -text
*.bz2 filter=lfs diff=lfs merge=lfs -text
*.ckpt filter=lfs diff=lfs merge=lfs -text
*.ftz filter=lfs diff=lfs merge=lfs -text
*.gguf filter=lfs diff=lfs merge=lfs -text
*.gz filter=lfs diff=lfs merge=lfs -text
*.h5 filter=lfs diff=lfs merge=lfs -text
*.joblib filter=lfs diff=lfs merge=lfs -text
*.lfs.* filter=lfs diff=lfs merge=lfs -text
*.mlmodel filter=lfs diff=lfs merge=lfs -text
*.model filter=lfs diff=lfs merge=lfs -text
*.msgpack filter=lfs diff=lfs merge=lfs -text
*.npy filter=lfs diff=lfs merge=lfs -text
*.npz filter=lfs diff=lfs merge=lfs -text
*.onnx filter=lfs diff=lfs merge=lfs -text
*.ot filter=lfs diff=lfs merge=lfs -text
*.parquet filter=lfs diff=lfs merge=lfs -text
*.pb filter=lfs diff=lfs merge=lfs -text
*.pickle filter=lfs diff=lfs merge=lfs -text
*.pkl filter=lfs diff=lfs merge=lfs -text
*.pt filter=lfs diff=lfs merge=lfs -text
*.pth filter=lfs diff=lfs merge=lfs -text
*.rar filter=lfs diff=lfs merge=lfs -text
*.safetensors filter=lfs diff=lfs merge=lfs -text
*.tar.* filter=lfs diff=lfs merge=lfs -text
*.tar filter=lfs diff=lfs merge=lfs -text
*.tflite filter=lfs diff=lfs merge=lfs -text
*.tgz filter=lfs diff=lfs merge=lfs -text
*.wasm filter=lfs diff=lfs merge=lfs -text
*.xz filter=lfs diff=lfs merge=lfs -text
*.zip filter=lfs diff=lfs merge=lfs -text
*.zst filter=lfs diff=lfs merge=lfs -text
*tfevents* filter=lfs diff=lfs merge=lfs -text
"""

_LFS_PATTERNS = tuple(line.split()[0] for line in GITATTRIBUTES.splitlines() if "filter=lfs" in line)


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def git_blob_oid(data: bytes) -> str:
    """Return the git blob sha1 of ``data`` (what ``git hash-object`` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return _LFS_POINTER.format(oid=sha256, size=size).encode()


def _now_iso(ts: float | None = None) -> str:
    moment = _dt.datetime.fromtimestamp(time.time() if ts is None else ts, tz=_dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def _is_commit_sha(value: str) -> bool:
    return len(value) == 40 and all(c in "0123456789abcdef" for c in value)


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _parse_range(value: str | None, total: int) -> tuple[int, int] | None | str:
    """Parse a single ``bytes=`` range. Return (start, end_inclusive), None (no range) or "invalid"."""
    if not value:
        return None
    value = value.strip()
    if not value.startswith("bytes=") or "," in value:
        return None  # unsupported forms are ignored, like many servers do
    spec = value[len("bytes="):].strip()
    start_s, _, end_s = spec.partition("-")
    try:
        if start_s == "":
            suffix = int(end_s)
            if suffix <= 0:
                return "invalid"
            start, end = max(total - suffix, 0), total - 1
        else:
            start = int(start_s)
            end = int(end_s) if end_s else total - 1
    except ValueError:
        return None
    if start >= total or start < 0 or end < start:
        return "invalid"
    return start, min(end, total - 1)


class HubError(Exception):
    """An error answered to the client: HTTP status plus hub error code and message."""

    def __init__(
        self,
        status: int,
        message: str,
        error_code: str | None = None,
        *,
        ms_code: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.ms_code = ms_code
        self.headers = dict(headers or {})


@dataclass
class Response:
    """An HTTP response to send: status, headers and the complete body."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    # Total size of the entity when ``body`` is a range of it (for logs and fault decisions).
    is_file: bool = False


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status=status, body=json.dumps(data).encode(), headers=dict(headers or {}))


def _ms_ok(data: Any) -> Response:
    return _json({"Code": 200, "Data": data, "Message": "success", "Success": True, "RequestId": secrets.token_hex(8)})


# ----------------------------------------------------------------------------------------------
# Storage
# ----------------------------------------------------------------------------------------------


class Store:
    """Repository state plus a content-addressed blob store, in memory or under a directory.

    With ``data_dir`` the state lives in ``state.json`` and blobs in ``blobs/<sha256>``; every
    transaction takes an advisory file lock and reloads the state if another process changed it,
    so several server processes can share one directory.
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.RLock()
        self._data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self._blobs: dict[str, bytes] = {}
        self._state: dict[str, Any] = {"repos": {}, "raw": {}, "secret": secrets.token_hex(16)}
        self._stamp: tuple[int, int] | None = None
        if self._data_dir is not None:
            (self._data_dir / "blobs").mkdir(parents=True, exist_ok=True)
            with self.transaction(write=True):
                pass  # creates state.json (keeping an existing one) and loads it

    @property
    def data_dir(self) -> Path | None:
        """The storage directory, or None when the state is in memory."""
        return self._data_dir

    # -- state ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self, write: bool = False) -> Iterator[dict[str, Any]]:
        """Yield the state dict; with ``write=True`` changes are persisted when the block ends."""
        with self._lock:
            if self._data_dir is None:
                yield self._state
                return
            lock_path = self._data_dir / ".lock"
            with open(lock_path, "a+b") as lock_file:
                if fcntl is not None:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX if write else fcntl.LOCK_SH)
                try:
                    self._reload()
                    if not write:
                        yield self._state
                        return
                    snapshot = copy.deepcopy(self._state)
                    try:
                        yield self._state
                    except BaseException:
                        self._state = snapshot
                        raise
                    self._save()
                finally:
                    if fcntl is not None:
                        fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

    def _reload(self) -> None:
        assert self._data_dir is not None
        path = self._data_dir / "state.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._state = json.loads(path.read_text("utf-8"))
            self._stamp = stamp

    def _save(self) -> None:
        assert self._data_dir is not None
        path = self._data_dir / "state.json"
        tmp = path.with_name(f"state.json.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps(self._state), "utf-8")
        os.replace(tmp, path)
        st = path.stat()
        self._stamp = (st.st_mtime_ns, st.st_size)

    # -- blobs ---------------------------------------------------------------------------------
    def put_blob(self, data: bytes) -> str:
        """Store ``data`` and return its sha256."""
        sha = hashlib.sha256(data).hexdigest()
        if self._data_dir is None:
            with self._lock:
                self._blobs[sha] = bytes(data)
            return sha
        path = self._data_dir / "blobs" / sha
        if not path.exists():
            tmp = path.with_name(f"{sha}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return sha

    def get_blob(self, sha: str) -> bytes | None:
        """Return the blob with this sha256, or None."""
        if self._data_dir is None:
            with self._lock:
                return self._blobs.get(sha)
        try:
            return (self._data_dir / "blobs" / sha).read_bytes()
        except (FileNotFoundError, OSError):
            return None

    def has_blob(self, sha: str) -> bool:
        """Whether a blob with this sha256 is stored."""
        if self._data_dir is None:
            with self._lock:
                return sha in self._blobs
        return len(sha) == 64 and (self._data_dir / "blobs" / sha).exists()


# ----------------------------------------------------------------------------------------------
# Repository model (plain JSON-able dicts so the state can be persisted as is)
# ----------------------------------------------------------------------------------------------


def _repo_key(repo_type: str, repo_id: str) -> str:
    return f"{repo_type}:{repo_id}"


def _file_entry(data_sha: str, size: int, lfs: bool, content: bytes | None = None) -> dict[str, Any]:
    if lfs:
        pointer = _lfs_pointer(data_sha, size)
        return {
            "size": size, "sha256": data_sha, "lfs": True, "oid": git_blob_oid(pointer), "pointer_size": len(pointer)
        }
    assert content is not None
    return {"size": size, "sha256": data_sha, "lfs": False, "oid": git_blob_oid(content)}


def _new_commit_sha(repo: dict[str, Any], parents: list[str], files: dict[str, Any], title: str) -> str:
    seed = json.dumps(
        {
            "repo": repo["id"],
            "parents": parents,
            "files": sorted((p, e["oid"]) for p, e in files.items()),
            "title": title,
            "time": time.time_ns(),
            "nonce": secrets.token_hex(8),
        },
        sort_keys=True,
    )
    return hashlib.sha1(seed.encode()).hexdigest()


def _add_commit(
    repo: dict[str, Any], branch: str, files: dict[str, Any], title: str, message: str = "", author: str = TEST_USER
) -> str:
    parent = repo["branches"].get(branch)
    parents = [parent] if parent else []
    sha = _new_commit_sha(repo, parents, files, title)
    repo["commits"][sha] = {
        "parents": parents,
        "files": files,
        "title": title,
        "message": message,
        "date": time.time(),
        "author": author,
    }
    repo["branches"][branch] = sha
    repo["last_modified"] = time.time()
    return sha


def _resolve_rev(repo: dict[str, Any], rev: str, *, ms: bool = False) -> str | None:
    """Resolve a branch, tag or full commit sha to a commit sha (None when unknown)."""
    if rev in repo["branches"]:
        return repo["branches"][rev]
    if rev in repo["tags"]:
        return repo["tags"][rev]["sha"]
    if rev.startswith("refs/heads/") and rev[len("refs/heads/"):] in repo["branches"]:
        return repo["branches"][rev[len("refs/heads/"):]]
    if rev.startswith("refs/tags/") and rev[len("refs/tags/"):] in repo["tags"]:
        return repo["tags"][rev[len("refs/tags/"):]]["sha"]
    if _is_commit_sha(rev) and rev in repo["commits"]:
        return rev
    if ms and rev == MS_DEFAULT_BRANCH and DEFAULT_BRANCH in repo["branches"]:
        return repo["branches"][DEFAULT_BRANCH]
    return None


def _ms_branch(repo: dict[str, Any], rev: str) -> str:
    """Map a ModelScope branch name to the stored branch (``master`` aliases ``main``)."""
    if rev == MS_DEFAULT_BRANCH and rev not in repo["branches"]:
        return DEFAULT_BRANCH
    return rev


def _directories(files: dict[str, Any]) -> set[str]:
    dirs: set[str] = set()
    for path in files:
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    return dirs


def _tree_oid(prefix: str, files: dict[str, Any]) -> str:
    members = sorted((p, e["oid"]) for p, e in files.items() if p.startswith(prefix + "/"))
    return hashlib.sha1(json.dumps([prefix, members]).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Faults and request log
# ----------------------------------------------------------------------------------------------


@dataclass
class Fault:
    """A fault armed for requests whose path matches ``match``."""

    match: str
    kind: str
    count: int = 1
    method: str | None = None
    params: dict[str, Any] = field(default_factory=dict)

    def applies(self, method: str, path: str, target: str, raw_target: str) -> bool:
        """Whether this fault applies to a request."""
        if self.method is not None:
            if method != self.method.upper():
                return False
        elif self.kind in _BODY_FAULTS and method != "GET":
            return False
        if self.match in (path, target, raw_target):
            return True
        return self.match in target or self.match in raw_target

    def as_dict(self) -> dict[str, Any]:
        """JSON-able description."""
        return {"match": self.match, "kind": self.kind, "count": self.count, "method": self.method, **self.params}


# ----------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------


class _ThreadingServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    hub: HubServer


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class HubServer:
    """A Hugging Face + ModelScope compatible hub bound to a loopback address.

    Use as a context manager (``with HubServer() as hub: ...``) or call :meth:`start` and
    :meth:`stop`. ``hub.url`` is the endpoint for both clients (``HfApi(endpoint=hub.url)``,
    ``HubApi(endpoint=hub.url)``); :meth:`raw_url` gives plain file URLs.

    Args:
        host: a loopback address (``127.0.0.1``, ``::1`` or ``localhost``).
        port: TCP port; 0 picks a free one.
        token: when set, write requests must carry it (``Authorization: Bearer`` or the
            ModelScope ``m_session_id`` cookie); reads stay open.
        data_dir: keep repositories on disk there (shared with other server processes).
        lfs_min_size: files at least this large are uploaded through LFS even if their name
            matches no LFS pattern.
        cdn_host: when set (e.g. ``"localhost"``), ``resolve`` answers LFS files with a 302 to
            ``http://<cdn_host>:<port>/_cdn/<sha256>``, which huggingface_hub treats as a CDN.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        lfs_min_size: int = 10 * 1024 * 1024,
        cdn_host: str | None = None,
        user: str = TEST_USER,
    ) -> None:
        if not _is_loopback_host(host):
            raise ValueError(f"refusing to bind to non-loopback host {host!r}: the test hub only serves 127.0.0.1/::1")
        self.host = "127.0.0.1" if host == "localhost" else host
        self.port = port
        self.token = token
        self.user = user
        self.lfs_min_size = lfs_min_size
        self.cdn_host = cdn_host
        self.store = Store(data_dir)
        self._faults: list[Fault] = []
        self._log: list[dict[str, Any]] = []
        self._meta_lock = threading.Lock()
        self._seq = 0
        self._httpd: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()  # wakes dripping answers when the server stops

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> HubServer:
        """Bind and serve in a daemon thread. Returns self."""
        if self._httpd is not None:
            return self
        self._stopping.clear()
        cls = _ThreadingServer6 if ":" in self.host else _ThreadingServer
        httpd = cls((self.host, self.port), _Handler)
        httpd.hub = self
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name=f"hubserver:{self.port}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close open connections and release the port."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        with self._meta_lock:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """Base URL, the endpoint for both huggingface_hub and modelscope."""
        return f"http://{_format_host(self.host)}:{self.port}"

    @property
    def hf_endpoint(self) -> str:
        """Endpoint for huggingface_hub (``HF_ENDPOINT`` / ``endpoint=``); same as :attr:`url`."""
        return self.url

    @property
    def ms_endpoint(self) -> str:
        """Endpoint for modelscope (``MODELSCOPE_ENDPOINT`` / ``endpoint=``); same as :attr:`url`."""
        return self.url

    def raw_url(self, path: str) -> str:
        """URL of a raw file stored with :meth:`put_raw`."""
        return f"{self.url}/raw/{urllib.parse.quote(path.lstrip('/'))}"

    # -- test helpers ----------------------------------------------------------------------------
    def requests(
        self, method: str | None = None, contains: str | None = None, *, include_test: bool = False
    ) -> list[dict[str, Any]]:
        """Return the request log (oldest first), optionally filtered by method and path substring.

        Each entry has ``method``, ``path`` (decoded, no query), ``query``, ``target`` (decoded
        path + query), ``status``, ``range``, ``auth`` (whether credentials were sent), ``fault``
        and ``bytes`` (body bytes sent). ``/_test/`` hook calls are not logged.
        """
        with self._meta_lock:
            entries = [dict(e) for e in self._log]
        if method is not None:
            entries = [e for e in entries if e["method"] == method.upper()]
        if contains is not None:
            entries = [e for e in entries if contains in e["target"] or contains in e["raw_target"]]
        return entries

    def clear_log(self) -> None:
        """Forget all logged requests."""
        with self._meta_lock:
            self._log.clear()

    def arm_fault(self, match: str, kind: str, count: int = 1, *, method: str | None = None, **params: Any) -> Fault:
        """Make the next ``count`` requests whose path matches ``match`` misbehave.

        ``match`` is an exact path or a substring of the request path + query (decoded or raw).
        ``corrupt``, ``truncate`` and ``drip_body`` apply to GET requests only (unless ``method`` is
        given); ``http500``, ``reset``, ``slow`` and ``drip_headers`` apply to any method. Kinds and
        parameters:

        * ``corrupt``: same-size body with every byte flipped (``status`` unchanged).
        * ``truncate``: full ``Content-Length`` announced, then only ``keep`` bytes (default: half)
          are sent and the connection is closed.
        * ``http500``: answer ``status`` (default 500) with a JSON error body.
        * ``reset``: close the connection with a TCP reset before answering.
        * ``slow``: wait ``delay`` seconds (default 1.0) before answering normally.
        * ``drip_headers``: send the status line and headers ``chunk`` bytes (default 1) every
          ``interval`` seconds (default 1.0), then the body at once.
        * ``drip_body``: send the headers at once, then the body ``chunk`` bytes (default 1) every
          ``interval`` seconds (default 1.0).

        * ``xet``: a Hugging Face file answer also names a Xet storage entry (``X-Xet-Hash`` and an
          ``X-Xet-Refresh-Route`` that answers 404, as the Hub does for a Xet-backed file), so a client
          that takes the Xet path fails where plain HTTP succeeds.

        A drip ends when the client closes the connection or the server stops.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {kind!r}; expected one of {FAULT_KINDS}")
        if count < 1:
            raise ValueError("count must be >= 1")
        fault = Fault(match, kind, int(count), method.upper() if method else None, params)
        with self._meta_lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        """Disarm every fault."""
        with self._meta_lock:
            self._faults.clear()

    def faults(self) -> list[dict[str, Any]]:
        """Armed faults (with their remaining counts)."""
        with self._meta_lock:
            return [f.as_dict() for f in self._faults]

    def put_raw(self, path: str, data: bytes) -> str:
        """Serve ``data`` at ``/raw/<path>`` and return its URL."""
        sha = self.store.put_blob(data)
        with self.store.transaction(write=True) as state:
            state["raw"][path.lstrip("/")] = {"sha256": sha, "size": len(data), "mtime": time.time()}
        return self.raw_url(path)

    def create_repo(self, repo_id: str, repo_type: str = "model", *, exist_ok: bool = True) -> None:
        """Create a repository directly (no HTTP), with its initial commit on ``main``."""
        with self.store.transaction(write=True) as state:
            self._create_repo(state, repo_type, repo_id, exist_ok=exist_ok)

    def commit_files(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        repo_type: str = "model",
        branch: str = DEFAULT_BRANCH,
        message: str = "Upload files",
        delete: list[str] | tuple[str, ...] = (),
    ) -> str:
        """Commit ``files`` (path -> bytes) directly (no HTTP) and return the new commit sha.

        The repository is created if missing. LFS or regular storage is chosen like preupload does.
        """
        with self.store.transaction(write=True) as state:
            repo = state["repos"].get(_repo_key(repo_type, repo_id))
            if repo is None:
                repo = self._create_repo(state, repo_type, repo_id)
            head = repo["branches"].get(branch)
            if head is None:
                raise KeyError(f"no branch {branch!r} in {repo_id}")
            tree = dict(repo["commits"][head]["files"])
            for path in delete:
                tree.pop(path, None)
            for path, data in files.items():
                sha = self.store.put_blob(data)
                lfs = self._should_use_lfs(path, len(data), data[:512])
                tree[path] = _file_entry(sha, len(data), lfs, data)
            return _add_commit(repo, branch, tree, message)

    def create_tag(
        self,
        repo_id: str,
        tag: str,
        revision: str = DEFAULT_BRANCH,
        *,
        repo_type: str = "model",
        created_at: float | None = None,
    ) -> str:
        """Tag ``revision`` directly (no HTTP) and return the tagged commit sha.

        ``created_at`` (epoch seconds) back-dates the tag; ModelScope clients given no revision
        pick the newest tag created before their own release date.
        """
        with self.store.transaction(write=True) as state:
            repo = state["repos"][_repo_key(repo_type, repo_id)]
            sha = _resolve_rev(repo, revision)
            if sha is None:
                raise KeyError(f"unknown revision {revision!r}")
            when = time.time() if created_at is None else created_at
            repo["tags"][tag] = {"sha": sha, "message": "", "created_at": when}
            return sha

    def head(self, repo_id: str, branch: str = DEFAULT_BRANCH, *, repo_type: str = "model") -> str:
        """Commit sha at the tip of ``branch``."""
        with self.store.transaction() as state:
            return state["repos"][_repo_key(repo_type, repo_id)]["branches"][branch]

    def resolve(self, repo_id: str, revision: str, *, repo_type: str = "model") -> str | None:
        """Commit sha of a branch, tag or sha (None if unknown)."""
        with self.store.transaction() as state:
            repo = state["repos"].get(_repo_key(repo_type, repo_id))
            return None if repo is None else _resolve_rev(repo, revision)

    def file_bytes(self, repo_id: str, path: str, revision: str = DEFAULT_BRANCH, *, repo_type: str = "model") -> bytes:
        """Content of ``path`` at ``revision`` as stored on the server."""
        with self.store.transaction() as state:
            repo = state["repos"][_repo_key(repo_type, repo_id)]
            sha = _resolve_rev(repo, revision)
            if sha is None:
                raise KeyError(revision)
            entry = repo["commits"][sha]["files"][path]
        data = self.store.get_blob(entry["sha256"])
        assert data is not None
        return data

    def list_files(self, repo_id: str, revision: str = DEFAULT_BRANCH, *, repo_type: str = "model") -> dict[str, dict]:
        """Files at ``revision``: path -> {size, sha256, lfs, oid}."""
        with self.store.transaction() as state:
            repo = state["repos"][_repo_key(repo_type, repo_id)]
            sha = _resolve_rev(repo, revision)
            if sha is None:
                raise KeyError(revision)
            return copy.deepcopy(repo["commits"][sha]["files"])

    def repo_exists(self, repo_id: str, *, repo_type: str = "model") -> bool:
        """Whether the repository exists."""
        with self.store.transaction() as state:
            return _repo_key(repo_type, repo_id) in state["repos"]

    # -- internals used by the handler ---------------------------------------------------------
    def _next_seq(self) -> int:
        with self._meta_lock:
            self._seq += 1
            return self._seq

    def _record(self, entry: dict[str, Any]) -> None:
        with self._meta_lock:
            self._log.append(entry)

    def _take_fault(self, method: str, path: str, target: str, raw_target: str) -> Fault | None:
        with self._meta_lock:
            for fault in self._faults:
                if fault.applies(method, path, target, raw_target):
                    fault.count -= 1
                    if fault.count <= 0:
                        self._faults.remove(fault)
                    return fault
        return None

    def _should_use_lfs(self, path: str, size: int, sample: bytes) -> bool:
        name = path.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, pat) for pat in _LFS_PATTERNS):
            return True
        if size >= self.lfs_min_size:
            return True
        return b"\x00" in sample

    def _create_repo(
        self, state: dict[str, Any], repo_type: str, repo_id: str, *, exist_ok: bool = True, private: bool = False
    ) -> dict[str, Any]:
        key = _repo_key(repo_type, repo_id)
        if key in state["repos"]:
            if not exist_ok:
                raise HubError(409, "You already created this model repo", ms_code=10010101001)
            return state["repos"][key]
        repo: dict[str, Any] = {
            "type": repo_type,
            "id": repo_id,
            "private": private,
            "created_at": time.time(),
            "last_modified": time.time(),
            "branches": {},
            "tags": {},
            "commits": {},
        }
        content = GITATTRIBUTES.encode()
        sha = self.store.put_blob(content)
        files = {".gitattributes": _file_entry(sha, len(content), False, content)}
        _add_commit(repo, DEFAULT_BRANCH, files, "initial commit")
        state["repos"][key] = repo
        return repo

    def _sign(self, oid: str) -> str:
        with self.store.transaction() as state:
            secret = state["secret"]
        return hmac.new(secret.encode(), oid.encode(), hashlib.sha256).hexdigest()[:32]


# ----------------------------------------------------------------------------------------------
# Request handler
# ----------------------------------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rotationzoo-testhub/1.0"
    sys_version = ""
    timeout = 60  # idle keep-alive connections are closed after this many seconds
    server: _ThreadingServer

    # -- plumbing ------------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        with self.hub._meta_lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            with self.hub._meta_lock:
                self.hub._connections.discard(self.connection)

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        pass  # the request log replaces stderr logging

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                line = self.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline(65537)
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _base_url(self) -> str:
        host = self.headers.get("Host") or f"{_format_host(self.hub.host)}:{self.hub.port}"
        return f"http://{host}"

    def _credentials(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        cookie = self.headers.get("Cookie", "")
        for part in cookie.split(";"):
            name, _, value = part.strip().partition("=")
            if name == "m_session_id" and value:
                return value
        return None

    def _require_write(self) -> None:
        """Enforce the write token, if the server has one."""
        if self.hub.token is None:
            return
        given = self._credentials()
        if given is None:
            raise HubError(401, "Authorization header is required for write operations (no token sent)", ms_code=401)
        if not hmac.compare_digest(given, self.hub.token):
            raise HubError(401, "Invalid credentials in Authorization header", ms_code=10010103009)

    def _dispatch(self, method: str) -> None:
        self._entry: dict[str, Any] | None = None
        raw_target = self.path
        raw_path, _, raw_query = raw_target.partition("?")
        self._raw_path = raw_path
        self._query = urllib.parse.parse_qs(raw_query, keep_blank_values=True)
        path = urllib.parse.unquote(raw_path)
        target = path + (("?" + urllib.parse.unquote_plus(raw_query)) if raw_query else "")
        try:
            self._body = self._read_body() if method not in ("GET", "HEAD") else b""
        except (ValueError, OSError):
            self.close_connection = True
            return
        if path.startswith("/_test/"):
            self._send(method, self._handle_test_hook(method, path), fault=None)
            return

        entry: dict[str, Any] = {
            "seq": self.hub._next_seq(),
            "time": time.time(),
            "method": method,
            "path": path,
            "raw_path": raw_path,
            "query": raw_query,
            "target": target,
            "raw_target": raw_target,
            "status": None,
            "range": self.headers.get("Range"),
            "auth": self._credentials() is not None,
            "fault": None,
            "bytes": 0,
        }
        fault = self.hub._take_fault(method, path, target, raw_target)
        if fault is not None:
            entry["fault"] = fault.kind
        self.hub._record(entry)
        self._entry = entry

        if fault is not None and fault.kind == "reset":
            entry["status"] = 0
            self._reset_connection()
            return
        if fault is not None and fault.kind == "slow":
            time.sleep(float(fault.params.get("delay", 1.0)))
        if fault is not None and fault.kind == "http500":
            status = int(fault.params.get("status", 500))
            message = str(fault.params.get("message", "Internal Server Error (injected)"))
            response = _json({"error": message, "Code": status, "Message": message, "Success": False}, status=status)
            self._send(method, response, fault=None)
            return
        try:
            response = self._route(method, path)
        except HubError as err:
            response = self._error_response(err, path)
        except Exception as exc:  # pragma: no cover - a bug in the server shows up as a 500 with details
            response = _json({"error": f"{type(exc).__name__}: {exc}"}, status=500)
        if fault is not None and fault.kind == "xet" and "X-Repo-Commit" in response.headers and response.status < 400:
            response.headers["X-Xet-Hash"] = "0" * 64
            response.headers["X-Xet-Refresh-Route"] = f"{self._base_url()}/api/models/_xet/xet-read-token/none"
        sent = _BODY_FAULTS + ("drip_headers",)
        self._send(method, response, fault=fault if fault is not None and fault.kind in sent else None)

    def _error_response(self, err: HubError, path: str) -> Response:
        headers = dict(err.headers)
        if path.startswith(("/api/v1/", "/openapi/")):
            code = err.ms_code if err.ms_code is not None else err.status
            body: dict[str, Any] = {
                "Code": code, "Message": err.message, "Success": False, "RequestId": secrets.token_hex(8)
            }
            if path.startswith("/openapi/"):
                body = {"success": False, "code": err.error_code or str(err.status), "message": err.message}
            return _json(body, status=err.status, headers=headers)
        if err.error_code:
            headers["X-Error-Code"] = err.error_code
        headers["X-Error-Message"] = err.message
        return _json({"error": err.message}, status=err.status, headers=headers)

    def _reset_connection(self) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            self.connection.close()

    def _send(self, method: str, response: Response, fault: Fault | None) -> None:
        body = response.body
        entry = getattr(self, "_entry", None) if not self.path.startswith("/_test/") else None
        if fault is not None and fault.kind in _BODY_FAULTS and (response.status not in (200, 206) or not body):
            fault = None  # nothing to corrupt, cut or drip; the fault is spent anyway
        if fault is not None and fault.kind == "corrupt":
            body = bytes(b ^ 0xFF for b in body) if len(body) < 1 << 20 else _xor_large(body)
        keep = len(body)
        if fault is not None and fault.kind == "truncate":
            keep = max(0, min(int(fault.params.get("keep", len(body) // 2)), len(body) - 1))
        drip_body = fault is not None and fault.kind == "drip_body"
        if entry is not None:  # filled in before the client can see the response
            entry["status"] = response.status
            entry["bytes"] = 0 if method == "HEAD" or drip_body else keep
        self.send_response(response.status)
        headers = {"Content-Type": response.content_type, **response.headers}
        headers["Content-Length"] = str(len(body))
        for name, value in headers.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        if fault is not None and fault.kind == "drip_headers":
            self._headers_buffer.append(b"\r\n")  # what end_headers() would send at once
            head, self._headers_buffer = b"".join(self._headers_buffer), []
            if not self._drip(head, fault, None):
                return
        else:
            self.end_headers()
        try:
            if method != "HEAD" and body:
                if drip_body:
                    assert fault is not None
                    self._drip(body, fault, entry)
                elif keep < len(body):
                    self.wfile.write(body[:keep])
                    self.wfile.flush()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                else:
                    self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _drip(self, data: bytes, fault: Fault, entry: dict[str, Any] | None) -> bool:
        """Send ``data`` ``chunk`` bytes every ``interval`` seconds. False (and the connection marked
        for closing) when the client went away or the server stops first."""
        chunk = max(1, int(fault.params.get("chunk", 1)))
        interval = float(fault.params.get("interval", 1.0))
        try:
            for start in range(0, len(data), chunk):
                if start and self.hub._stopping.wait(interval):
                    raise ConnectionAbortedError("server stopping")
                self.wfile.write(data[start:start + chunk])
                self.wfile.flush()
                if entry is not None:
                    entry["bytes"] += len(data[start:start + chunk])
        except OSError:
            self.close_connection = True
            return False
        return True

    # -- test hooks ----------------------------------------------------------------------------
    def _handle_test_hook(self, method: str, path: str) -> Response:
        hub = self.hub
        is_json = method == "POST" and self._body.strip()
        try:
            payload = json.loads(self._body) if is_json else {}
        except ValueError:
            return _json({"error": "invalid JSON"}, status=400)
        if path == "/_test/health" and method in ("GET", "HEAD"):
            return _json({"ok": True, "url": hub.url})
        if path == "/_test/log" and method == "GET":
            q = self._query
            return _json(hub.requests(method=q.get("method", [None])[0], contains=q.get("contains", [None])[0]))
        if path == "/_test/log/clear" and method == "POST":
            hub.clear_log()
            return _json({"ok": True})
        if path == "/_test/fault" and method == "POST":
            params = dict(payload)
            try:
                match, kind = params.pop("match"), params.pop("kind")
                count = int(params.pop("count", 1))
                fault_method = params.pop("method", None)
                fault = hub.arm_fault(match, kind, count, method=fault_method, **params)
            except (KeyError, ValueError, TypeError) as exc:
                return _json({"error": f"bad fault: {exc}"}, status=400)
            return _json(fault.as_dict())
        if path == "/_test/faults" and method == "GET":
            return _json(hub.faults())
        if path == "/_test/faults/clear" and method == "POST":
            hub.clear_faults()
            return _json({"ok": True})
        if path.startswith("/_test/raw/") and method == "PUT":
            rel = path[len("/_test/raw/"):]
            return _json({"url": hub.put_raw(rel, self._body)})
        return _json({"error": f"unknown test hook {method} {path}"}, status=404)

    # -- routing -------------------------------------------------------------------------------
    def _route(self, method: str, path: str) -> Response:
        segs = [urllib.parse.unquote(s) for s in self._raw_path.split("/")[1:]]
        if segs and segs[-1] == "" and len(segs) > 1:
            segs = segs[:-1]
        if not segs or segs == [""]:
            return _json({"name": "rotationzoo test hub", "hf_endpoint": self.hub.url, "ms_endpoint": self.hub.url})
        head = segs[0]
        if head == "api" and len(segs) > 1 and segs[1] == "v1":
            return self._route_ms(method, segs[2:])
        if head == "openapi" and len(segs) > 1 and segs[1] == "v1":
            return self._route_ms_openapi(method, segs[2:])
        if head == "api":
            return self._route_hf_api(method, segs[1:])
        if head == "raw":
            return self._serve_raw(method, "/".join(segs[1:]))
        if head == "_lfs":
            return self._route_lfs(method, segs[1:])
        if head == "_cdn" and len(segs) == 2 and method in ("GET", "HEAD"):
            data = self.hub.store.get_blob(segs[1])
            if data is None:
                raise HubError(404, "blob not found", "EntryNotFound")
            return self._file_response(data, {"ETag": f'"{segs[1]}"'})
        return self._route_hf_repo(method, segs)

    # -- Hugging Face: /api/... ------------------------------------------------------------------
    def _route_hf_api(self, method: str, segs: list[str]) -> Response:
        if segs == ["whoami-v2"] and method == "GET":
            return self._hf_whoami()
        if segs == ["agent-harnesses"]:
            return _json({"standardEnvVars": [], "harnesses": {}})
        if segs == ["validate-yaml"] and method == "POST":
            return _json({"errors": [], "warnings": []})
        if segs == ["repos", "create"] and method == "POST":
            return self._hf_create_repo()
        if segs == ["repos", "delete"] and method == "DELETE":
            return self._hf_delete_repo()
        if len(segs) >= 3 and segs[0] in ("models", "datasets", "spaces"):
            repo_type = segs[0][:-1]
            repo_id = f"{segs[1]}/{segs[2]}"
            rest = segs[3:]
            if not rest and method == "GET":
                return self._hf_repo_info(repo_type, repo_id, DEFAULT_BRANCH)
            if len(rest) == 2 and rest[0] == "revision" and method == "GET":
                return self._hf_repo_info(repo_type, repo_id, rest[1])
            if rest == ["refs"] and method == "GET":
                return self._hf_refs(repo_type, repo_id)
            if len(rest) == 2 and rest[0] == "commits" and method == "GET":
                return self._hf_commits(repo_type, repo_id, rest[1])
            if len(rest) >= 2 and rest[0] == "tree" and method == "GET":
                return self._hf_tree(repo_type, repo_id, rest[1], "/".join(rest[2:]).strip("/"))
            if len(rest) == 2 and rest[0] == "paths-info" and method == "POST":
                return self._hf_paths_info(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "preupload" and method == "POST":
                return self._hf_preupload(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "commit" and method == "POST":
                return self._hf_commit(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "tag" and method == "POST":
                return self._hf_create_tag(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "tag" and method == "DELETE":
                return self._hf_delete_tag(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "branch" and method == "POST":
                return self._hf_create_branch(repo_type, repo_id, rest[1])
            if len(rest) == 2 and rest[0] == "branch" and method == "DELETE":
                return self._hf_delete_branch(repo_type, repo_id, rest[1])
        raise HubError(404, f"Not Found: {method} {self._raw_path}")

    def _hf_whoami(self) -> Response:
        given = self._credentials()
        if given is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        if self.hub.token is not None and not hmac.compare_digest(given, self.hub.token):
            raise HubError(401, "Invalid credentials in Authorization header")
        return _json(
            {
                "type": "user",
                "id": hashlib.sha1(self.hub.user.encode()).hexdigest()[:24],
                "name": self.hub.user,
                "fullname": "Test User",
                "email": f"{self.hub.user}@example.invalid",
                "emailVerified": True,
                "isPro": False,
                "orgs": [],
                "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}},
            }
        )

    def _json_body(self) -> dict[str, Any]:
        try:
            data = json.loads(self._body or b"{}")
        except ValueError as exc:
            raise HubError(400, f"invalid JSON body: {exc}") from exc
        if not isinstance(data, dict):
            raise HubError(400, "JSON body must be an object")
        return data

    def _hf_create_repo(self) -> Response:
        self._require_write()
        body = self._json_body()
        name = body.get("name")
        if not name:
            raise HubError(400, "name is required")
        namespace = body.get("organization") or self.hub.user
        repo_type = body.get("type") or "model"
        if repo_type not in _REPO_TYPES:
            raise HubError(400, f"invalid repo type {repo_type!r}")
        repo_id = f"{namespace}/{name}"
        private = body.get("private") is True or body.get("visibility") == "private"
        with self.hub.store.transaction(write=True) as state:
            if _repo_key(repo_type, repo_id) in state["repos"]:
                raise HubError(409, "You already created this model repo", headers={})
            self.hub._create_repo(state, repo_type, repo_id, private=private)
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return _json({"url": f"{self._base_url()}/{prefix}{repo_id}", "name": repo_id, "id": repo_id})

    def _hf_delete_repo(self) -> Response:
        self._require_write()
        body = self._json_body()
        repo_id = f"{body.get('organization') or self.hub.user}/{body.get('name')}"
        repo_type = body.get("type") or "model"
        with self.hub.store.transaction(write=True) as state:
            if state["repos"].pop(_repo_key(repo_type, repo_id), None) is None:
                raise HubError(404, "Repository not found", "RepoNotFound")
        return _json({})

    def _get_repo(self, state: dict[str, Any], repo_type: str, repo_id: str) -> dict[str, Any]:
        repo = state["repos"].get(_repo_key(repo_type, repo_id))
        if repo is None:
            raise HubError(404, "Repository not found", "RepoNotFound", ms_code=10010205002)
        return repo

    def _get_commit(self, repo: dict[str, Any], rev: str, *, ms: bool = False) -> tuple[str, dict[str, Any]]:
        sha = _resolve_rev(repo, rev, ms=ms)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound", ms_code=10010205003)
        return sha, repo["commits"][sha]

    @staticmethod
    def _hf_file_item(
        path: str, entry: dict[str, Any], commit: tuple[str, dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            item["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointer_size"]}
        if commit is not None:
            sha, data = commit
            item["lastCommit"] = {"id": sha, "title": data["title"], "date": _now_iso(data["date"])}
            item["securityFileStatus"] = {"status": "safe"}
        return item

    def _hf_repo_info(self, repo_type: str, repo_id: str, rev: str) -> Response:
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, commit = self._get_commit(repo, rev)
            files = commit["files"]
            siblings = []
            for path in sorted(files):
                entry = files[path]
                sib: dict[str, Any] = {"rfilename": path, "size": entry["size"], "blobId": entry["oid"]}
                if entry["lfs"]:
                    sib["lfs"] = {
                        "sha256": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointer_size"]
                    }
                siblings.append(sib)
            info = {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "author": repo_id.split("/")[0],
                "sha": sha,
                "lastModified": _now_iso(commit["date"]),
                "createdAt": _now_iso(repo["created_at"]),
                "private": repo["private"],
                "gated": False,
                "disabled": False,
                "downloads": 0,
                "likes": 0,
                "tags": [],
                "siblings": siblings,
                "usedStorage": sum(e["size"] for e in files.values()),
            }
            if repo_type == "model":
                info["modelId"] = repo_id
                info["library_name"] = None
            if repo_type == "space":
                info["sdk"] = "static"
                info["runtime"] = {"stage": "RUNNING", "hardware": {"current": None, "requested": None}}
        return _json(info)

    def _hf_refs(self, repo_type: str, repo_id: str) -> Response:
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            data = {
                "branches": [
                    {"name": n, "ref": f"refs/heads/{n}", "targetCommit": s}
                    for n, s in sorted(repo["branches"].items())
                ],
                "tags": [
                    {"name": n, "ref": f"refs/tags/{n}", "targetCommit": t["sha"]}
                    for n, t in sorted(repo["tags"].items())
                ],
                "converts": [],
            }
        if self._query.get("include_prs"):
            data["pullRequests"] = []
        return _json(data)

    def _hf_commits(self, repo_type: str, repo_id: str, rev: str) -> Response:
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, _ = self._get_commit(repo, rev)
            out = []
            current: str | None = sha
            while current:
                c = repo["commits"][current]
                out.append(
                    {
                        "id": current,
                        "authors": [{"user": c["author"]}],
                        "date": _now_iso(c["date"]),
                        "title": c["title"],
                        "message": c["message"],
                    }
                )
                current = c["parents"][0] if c["parents"] else None
        return _json(out)

    def _hf_tree(self, repo_type: str, repo_id: str, rev: str, subpath: str) -> Response:
        recursive = self._query.get("recursive", ["false"])[0].lower() in ("1", "true")
        expand = self._query.get("expand", ["false"])[0].lower() in ("1", "true")
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, commit = self._get_commit(repo, rev)
            files = commit["files"]
            dirs = _directories(files)
            if subpath and subpath not in dirs:
                raise HubError(404, f"Entry not found: {subpath}", "EntryNotFound", headers={"X-Repo-Commit": sha})
            prefix = f"{subpath}/" if subpath else ""
            items: list[dict[str, Any]] = []
            for d in sorted(dirs):
                if d.startswith(prefix) and (recursive or "/" not in d[len(prefix):]):
                    items.append({"type": "directory", "oid": _tree_oid(d, files), "size": 0, "path": d})
            for p in sorted(files):
                if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):]):
                    items.append(self._hf_file_item(p, files[p], (sha, commit) if expand else None))
        return _json(items)

    def _hf_paths_info(self, repo_type: str, repo_id: str, rev: str) -> Response:
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            body = self._json_body()
            paths = body.get("paths") or []
            expand = bool(body.get("expand"))
        else:
            form = urllib.parse.parse_qs(self._body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = form.get("expand", ["False"])[0].lower() in ("1", "true")
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, commit = self._get_commit(repo, rev)
            files = commit["files"]
            dirs = _directories(files)
            out = []
            for p in paths:
                p = p.strip("/")
                if p in files:
                    out.append(self._hf_file_item(p, files[p], (sha, commit) if expand else None))
                elif p in dirs:
                    out.append({"type": "directory", "oid": _tree_oid(p, files), "size": 0, "path": p})
        return _json(out)

    def _hf_preupload(self, repo_type: str, repo_id: str, rev: str) -> Response:
        self._require_write()
        body = self._json_body()
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha = _resolve_rev(repo, rev)
            files = repo["commits"][sha]["files"] if sha else {}
        out = []
        for f in body.get("files", []):
            path = f["path"]
            sample = base64.b64decode(f.get("sample") or "")
            lfs = self.hub._should_use_lfs(path, int(f.get("size", 0)), sample)
            item: dict[str, Any] = {"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
            existing = files.get(path)
            if existing is not None:
                item["oid"] = existing["sha256"] if existing["lfs"] else existing["oid"]
            out.append(item)
        return _json({"files": out, "commitOid": sha})

    def _hf_commit(self, repo_type: str, repo_id: str, rev: str) -> Response:
        self._require_write()
        if self._query.get("create_pr", ["0"])[0] in ("1", "true", "True"):
            raise HubError(400, "pull requests are not supported by the test hub")
        try:
            lines = [json.loads(line) for line in self._body.decode().splitlines() if line.strip()]
        except ValueError as exc:
            raise HubError(400, f"invalid NDJSON: {exc}") from exc
        header = next((ln["value"] for ln in lines if ln.get("key") == "header"), None)
        if header is None:
            raise HubError(400, "missing commit header")
        ops = [ln for ln in lines if ln.get("key") != "header"]
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, repo_type, repo_id)
            branch = rev[len("refs/heads/"):] if rev.startswith("refs/heads/") else rev
            if branch not in repo["branches"]:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            head = repo["branches"][branch]
            parent = header.get("parentCommit")
            if parent and parent != head:
                raise HubError(412, "A commit has happened since. Please refresh and try again.", "PreconditionFailed")
            tree = dict(repo["commits"][head]["files"])
            for op in ops:
                self._apply_hf_op(tree, op)
            sha = _add_commit(repo, branch, tree, header.get("summary") or "", header.get("description") or "")
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return _json(
            {
                "success": True,
                "commitOid": sha,
                "commitUrl": f"{self._base_url()}/{prefix}{repo_id}/commit/{sha}",
                "pullRequestUrl": None,
                "hookOutput": "",
            }
        )

    def _apply_hf_op(self, tree: dict[str, Any], op: dict[str, Any]) -> None:
        key, value = op.get("key"), op.get("value") or {}
        path = str(value.get("path", "")).strip("/")
        if key == "file":
            if value.get("encoding", "base64") != "base64":
                raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
            data = base64.b64decode(value.get("content") or "")
            sha = self.hub.store.put_blob(data)
            tree[path] = _file_entry(sha, len(data), False, data)
        elif key == "lfsFile":
            oid = value.get("oid", "")
            data = self.hub.store.get_blob(oid)
            if data is None:
                raise HubError(422, f"LFS object {oid} for {path} was not uploaded")
            size = value.get("size")
            if size is not None and int(size) != len(data):
                raise HubError(422, f"size mismatch for LFS object {oid}: {size} != {len(data)}")
            tree[path] = _file_entry(oid, len(data), True)
        elif key == "deletedFile":
            if path not in tree:
                raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            del tree[path]
        elif key == "deletedFolder":
            doomed = [p for p in tree if p.startswith(path + "/")]
            if not doomed:
                raise HubError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
            for p in doomed:
                del tree[p]
        else:
            raise HubError(400, f"unsupported commit operation {key!r}")

    def _hf_create_tag(self, repo_type: str, repo_id: str, rev: str) -> Response:
        self._require_write()
        body = self._json_body()
        tag = body.get("tag")
        if not tag:
            raise HubError(400, "tag is required")
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, _ = self._get_commit(repo, rev)
            if tag in repo["tags"]:
                raise HubError(409, f"Tag {tag} already exists")
            repo["tags"][tag] = {"sha": sha, "message": body.get("message") or "", "created_at": time.time()}
        return _json({"name": tag, "ref": f"refs/tags/{tag}", "targetCommit": sha})

    def _hf_delete_tag(self, repo_type: str, repo_id: str, tag: str) -> Response:
        self._require_write()
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, repo_type, repo_id)
            if repo["tags"].pop(tag, None) is None:
                raise HubError(404, f"Invalid rev id: {tag}", "RevisionNotFound")
        return _json({})

    def _hf_create_branch(self, repo_type: str, repo_id: str, branch: str) -> Response:
        self._require_write()
        body = self._json_body()
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, repo_type, repo_id)
            if branch in repo["branches"]:
                raise HubError(409, f"Branch {branch} already exists")
            start = body.get("startingPoint") or DEFAULT_BRANCH
            sha, _ = self._get_commit(repo, start)
            repo["branches"][branch] = sha
        return _json({"name": branch, "ref": f"refs/heads/{branch}", "targetCommit": sha})

    def _hf_delete_branch(self, repo_type: str, repo_id: str, branch: str) -> Response:
        self._require_write()
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, repo_type, repo_id)
            if branch == DEFAULT_BRANCH:
                raise HubError(403, "Cannot delete the default branch")
            if repo["branches"].pop(branch, None) is None:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        return _json({})

    # -- Hugging Face: /{repo}/resolve/... and LFS ---------------------------------------------
    def _route_hf_repo(self, method: str, segs: list[str]) -> Response:
        repo_type = "model"
        if segs[0] in ("datasets", "spaces") and len(segs) > 3:
            repo_type, segs = segs[0][:-1], segs[1:]
        if len(segs) >= 5 and segs[2] in ("resolve", "raw") and method in ("GET", "HEAD"):
            return self._hf_resolve(method, repo_type, f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]))
        if len(segs) == 6 and segs[1].endswith(".git") and segs[2:] == ["info", "lfs", "objects", "batch"]:
            if method == "POST":
                return self._lfs_batch(repo_type, f"{segs[0]}/{segs[1][:-4]}", ms=False)
        raise HubError(404, f"Not Found: {method} {self._raw_path}")

    def _hf_resolve(self, method: str, repo_type: str, repo_id: str, rev: str, path: str) -> Response:
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, repo_type, repo_id)
            sha, commit = self._get_commit(repo, rev)
            entry = commit["files"].get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
            entry = dict(entry)
        headers = {"X-Repo-Commit": sha, "Content-Disposition": f'inline; filename="{path.rsplit("/", 1)[-1]}"'}
        if entry["lfs"]:
            headers["X-Linked-Etag"] = f'"{entry["sha256"]}"'
            headers["X-Linked-Size"] = str(entry["size"])
            headers["ETag"] = f'"{entry["sha256"]}"'
            if self.hub.cdn_host:
                location = f"http://{_format_host(self.hub.cdn_host)}:{self.hub.port}/_cdn/{entry['sha256']}"
                headers["Location"] = location
                return Response(status=302, body=b"", headers=headers, content_type="text/plain")
        else:
            headers["ETag"] = f'"{entry["oid"]}"'
        data = self.hub.store.get_blob(entry["sha256"])
        if data is None:
            raise HubError(500, f"blob {entry['sha256']} is missing from the store")
        return self._file_response(data, headers)

    def _file_response(self, data: bytes, headers: dict[str, str]) -> Response:
        headers = {"Accept-Ranges": "bytes", **headers}
        rng = _parse_range(self.headers.get("Range"), len(data))
        if rng == "invalid":
            raise HubError(416, "Requested range not satisfiable", headers={"Content-Range": f"bytes */{len(data)}"})
        if rng is None:
            return Response(200, data, headers, content_type="application/octet-stream", is_file=True)
        start, end = rng  # type: ignore[misc]
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        return Response(206, data[start : end + 1], headers, content_type="application/octet-stream", is_file=True)

    def _lfs_batch(self, repo_type: str, repo_id: str, *, ms: bool) -> Response:
        self._require_write()
        body = self._json_body()
        if body.get("operation", "upload") != "upload":
            raise HubError(400, "only the upload operation is supported")
        with self.hub.store.transaction() as state:
            self._get_repo(state, repo_type, repo_id)
        base = self._base_url()
        objects = []
        for obj in body.get("objects", []):
            oid, size = str(obj.get("oid", "")), int(obj.get("size", 0))
            item: dict[str, Any] = {"oid": oid, "size": size, "authenticated": True}
            if not self.hub.store.has_blob(oid):
                sig = self.hub._sign(oid)
                item["actions"] = {
                    "upload": {"href": f"{base}/_lfs/upload/{oid}?size={size}&sig={sig}", "header": {}},
                    "verify": {"href": f"{base}/_lfs/verify/{oid}?sig={sig}", "header": {}},
                }
            objects.append(item)
        if ms:
            return _ms_ok({"transfer": "basic", "objects": objects})
        body_out = json.dumps({"transfer": "basic", "objects": objects}).encode()
        return Response(200, body_out, content_type="application/vnd.git-lfs+json")

    def _route_lfs(self, method: str, segs: list[str]) -> Response:
        if len(segs) != 2 or segs[0] not in ("upload", "verify"):
            raise HubError(404, f"Not Found: {method} {self._raw_path}")
        oid = segs[1]
        sig = self._query.get("sig", [""])[0]
        if not hmac.compare_digest(sig, self.hub._sign(oid)):
            raise HubError(403, "invalid or missing upload signature")
        if segs[0] == "upload" and method == "PUT":
            data = self._body
            expected_size = self._query.get("size", [None])[0]
            if expected_size is not None and int(expected_size) != len(data):
                raise HubError(400, f"size mismatch: expected {expected_size} bytes, got {len(data)}")
            actual = hashlib.sha256(data).hexdigest()
            if actual != oid:
                raise HubError(400, f"sha256 mismatch: expected {oid}, got {actual}")
            self.hub.store.put_blob(data)
            return _json({"Code": 200, "Success": True, "Message": "uploaded"})
        if segs[0] == "verify" and method == "POST":
            body = self._json_body()
            data = self.hub.store.get_blob(oid)
            if data is None:
                raise HubError(404, f"object {oid} was not uploaded")
            if "size" in body and int(body["size"]) != len(data):
                raise HubError(422, f"size mismatch for {oid}")
            return _json({"success": True})
        raise HubError(405, f"method {method} not allowed here")

    # -- raw files -----------------------------------------------------------------------------
    def _serve_raw(self, method: str, path: str) -> Response:
        if method not in ("GET", "HEAD"):
            raise HubError(405, "raw files are read-only (use put_raw or PUT /_test/raw/<path>)")
        with self.hub.store.transaction() as state:
            meta = state["raw"].get(path)
        if meta is None:
            raise HubError(404, f"no raw file {path!r}")
        data = self.hub.store.get_blob(meta["sha256"])
        if data is None:
            raise HubError(500, "raw blob is missing")
        last_modified = _dt.datetime.fromtimestamp(meta["mtime"], tz=_dt.timezone.utc)
        return self._file_response(
            data,
            {"ETag": f'"{meta["sha256"]}"', "Last-Modified": last_modified.strftime("%a, %d %b %Y %H:%M:%S GMT")},
        )

    # -- ModelScope: /api/v1/... ---------------------------------------------------------------
    def _route_ms(self, method: str, segs: list[str]) -> Response:
        if segs == ["login"] and method == "POST":
            return self._ms_login()
        if segs == ["repos", "internalAccelerationInfo"]:
            return _json({"Code": 200, "Data": {}, "Message": "success", "Success": True})
        if segs == ["users", "login", "info"] and method == "GET":
            return self._ms_user()
        if segs == ["models"] and method == "POST":
            return self._ms_create_model()
        if len(segs) >= 3 and segs[0] == "models":
            repo_id = f"{segs[1]}/{segs[2]}"
            rest = segs[3:]
            if not rest and method == "GET":
                return self._ms_model_info(repo_id)
            if not rest and method == "DELETE":
                self._require_write()
                with self.hub.store.transaction(write=True) as state:
                    self._get_repo(state, "model", repo_id)
                    del state["repos"][_repo_key("model", repo_id)]
                return _ms_ok({})
            if rest == ["revisions"] and method == "GET":
                return self._ms_revisions(repo_id)
            if rest == ["repo", "files"] and method == "GET":
                return self._ms_files(repo_id)
            if rest == ["repo"] and method in ("GET", "HEAD"):
                return self._ms_file(repo_id)
            if rest == ["repo", "tag"] and method == "POST":
                return self._ms_create_tag(repo_id)
            if rest == ["file"] and method == "DELETE":
                return self._ms_delete_file(repo_id)
        if len(segs) >= 4 and segs[0] == "repos" and segs[1] == "models":
            repo_id = f"{segs[2]}/{segs[3]}"
            rest = segs[4:]
            if rest == ["info", "lfs", "objects", "batch"] and method == "POST":
                return self._lfs_batch("model", repo_id, ms=True)
            if len(rest) == 2 and rest[0] == "commit" and method == "POST":
                return self._ms_commit(repo_id, rest[1])
        raise HubError(404, f"Not Found: {method} {self._raw_path}", ms_code=404)

    def _route_ms_openapi(self, method: str, segs: list[str]) -> Response:
        if segs == ["users", "me"] and method == "GET":
            given = self._credentials()
            if given is None or (self.hub.token is not None and not hmac.compare_digest(given, self.hub.token)):
                raise HubError(401, "Invalid authentication", "InvalidAuthentication")
            return _json(
                {
                    "success": True,
                    "request_id": secrets.token_hex(8),
                    "data": {
                        "username": self.hub.user,
                        "Username": self.hub.user,
                        "name": self.hub.user,
                        "email": f"{self.hub.user}@example.invalid",
                    },
                }
            )
        raise HubError(404, f"Not Found: {method} {self._raw_path}", "ResourceNotFound")

    def _ms_user_data(self) -> dict[str, Any]:
        return {"Username": self.hub.user, "Email": f"{self.hub.user}@example.invalid", "NickName": "Test User"}

    def _ms_login(self) -> Response:
        body = self._json_body()
        token = body.get("AccessToken") or ""
        if not token or (self.hub.token is not None and not hmac.compare_digest(str(token), self.hub.token)):
            raise HubError(400, "AccessToken is invalid or expired", ms_code=10010103009)
        data = {**self._ms_user_data(), "AccessToken": token}
        response = _ms_ok(data)
        response.headers["Set-Cookie"] = f"m_session_id={token}; Path=/; HttpOnly"
        return response

    def _ms_user(self) -> Response:
        if self._credentials() is None:
            raise HubError(401, "user not logged in", ms_code=10010103001)
        return _ms_ok(self._ms_user_data())

    def _ms_create_model(self) -> Response:
        self._require_write()
        body = self._json_body()
        owner, name = body.get("Path") or self.hub.user, body.get("Name")
        if not name:
            raise HubError(400, "Name is required", ms_code=400)
        repo_id = f"{owner}/{name}"
        visibility = body.get("Visibility")
        with self.hub.store.transaction(write=True) as state:
            if _repo_key("model", repo_id) in state["repos"]:
                message = "Repository name already exists. Please choose a different name."
                raise HubError(409, message, ms_code=10010101001)
            self.hub._create_repo(state, "model", repo_id, private=visibility in (1, "1", "private"))
        return _ms_ok({"Path": owner, "Name": name, "Id": hashlib.sha1(repo_id.encode()).hexdigest()[:8]})

    def _ms_model_info(self, repo_id: str) -> Response:
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, "model", repo_id)
            owner, name = repo_id.split("/", 1)
            head_files = repo["commits"][repo["branches"][DEFAULT_BRANCH]]["files"]
            data = {
                "Id": int(hashlib.sha1(repo_id.encode()).hexdigest()[:6], 16),
                "Path": owner,
                "Name": name,
                "ChineseName": name,
                "Visibility": 1 if repo["private"] else 5,
                "CreatedTime": int(repo["created_at"]),
                "LastUpdatedTime": int(repo["last_modified"]),
                "Description": "",
                "License": "Apache License 2.0",
                "Downloads": 0,
                "Stars": 0,
                "IsPublished": 1,
                "IsAccessible": 1,
                "ModelType": [],
                "Tags": [],
                "Revision": MS_DEFAULT_BRANCH,
                "StorageSize": sum(e["size"] for e in head_files.values()),
            }
        return _ms_ok(data)

    def _ms_revisions(self, repo_id: str) -> Response:
        end_time = self._query.get("EndTime", [None])[0]
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, "model", repo_id)
            tags = [
                {"Revision": n, "CommitId": t["sha"], "CreatedAt": int(t["created_at"]), "Message": t["message"]}
                for n, t in sorted(repo["tags"].items(), key=lambda kv: kv[1]["created_at"], reverse=True)
                if end_time is None or int(t["created_at"]) <= int(end_time)
            ]
            branches = [
                {"Revision": n, "CommitId": s, "CreatedAt": int(repo["commits"][s]["date"])}
                for n, s in sorted(repo["branches"].items())
            ]
            if MS_DEFAULT_BRANCH not in repo["branches"] and DEFAULT_BRANCH in repo["branches"]:
                s = repo["branches"][DEFAULT_BRANCH]
                created = int(repo["commits"][s]["date"])
                branches.insert(0, {"Revision": MS_DEFAULT_BRANCH, "CommitId": s, "CreatedAt": created})
        return _ms_ok({"RevisionMap": {"Tags": tags, "Branches": branches}})

    def _ms_files(self, repo_id: str) -> Response:
        q = self._query
        rev = q.get("Revision", [MS_DEFAULT_BRANCH])[0] or MS_DEFAULT_BRANCH
        recursive = q.get("Recursive", ["False"])[0].lower() in ("1", "true")
        root = (q.get("Root", [""])[0] or "").strip("/")
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, "model", repo_id)
            sha, commit = self._get_commit(repo, rev, ms=True)
            files = commit["files"]
            dirs = _directories(files)
            prefix = f"{root}/" if root else ""
            items: list[dict[str, Any]] = []
            for d in sorted(dirs):
                if d.startswith(prefix) and (recursive or "/" not in d[len(prefix):]):
                    items.append(
                        {"Name": d.rsplit("/", 1)[-1], "Path": d, "Type": "tree", "Size": 0, "Sha256": "",
                         "Revision": sha, "IsLFS": False, "Id": _tree_oid(d, files), "Mode": "40000"}
                    )
            for p in sorted(files):
                if p.startswith(prefix) and (recursive or "/" not in p[len(prefix):]):
                    e = files[p]
                    items.append(
                        {"Name": p.rsplit("/", 1)[-1], "Path": p, "Type": "blob", "Size": e["size"],
                         "Sha256": e["sha256"], "Revision": sha, "IsLFS": e["lfs"], "Id": e["oid"], "Mode": "100644",
                         "CommitId": sha, "CommitMessage": commit["title"], "CommittedDate": int(commit["date"])}
                    )
        return _ms_ok({"Files": items, "LatestCommitter": {"Id": sha}})

    def _ms_file(self, repo_id: str) -> Response:
        q = self._query
        rev = q.get("Revision", [MS_DEFAULT_BRANCH])[0] or MS_DEFAULT_BRANCH
        path = (q.get("FilePath", [""])[0] or "").strip("/")
        with self.hub.store.transaction() as state:
            repo = self._get_repo(state, "model", repo_id)
            sha, commit = self._get_commit(repo, rev, ms=True)
            entry = commit["files"].get(path)
            if entry is None:
                raise HubError(404, f"file {path} not found at {rev}", ms_code=10010205004)
            entry = dict(entry)
        data = self.hub.store.get_blob(entry["sha256"])
        if data is None:
            raise HubError(500, "blob is missing from the store")
        return self._file_response(data, {"ETag": f'"{entry["sha256"]}"', "X-Repo-Commit": sha})

    def _ms_create_tag(self, repo_id: str) -> Response:
        self._require_write()
        body = self._json_body()
        tag, ref = body.get("TagName"), body.get("Ref") or MS_DEFAULT_BRANCH
        if not tag:
            raise HubError(400, "Invalid parameter: tag name cannot be empty.", ms_code=400)
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, "model", repo_id)
            sha, _ = self._get_commit(repo, ref, ms=True)
            if tag in repo["tags"]:
                raise HubError(409, f"tag {tag} already exists", ms_code=10010101001)
            repo["tags"][tag] = {"sha": sha, "message": "", "created_at": time.time()}
        return _ms_ok({"TagName": tag, "CommitId": sha})

    def _ms_delete_file(self, repo_id: str) -> Response:
        self._require_write()
        path = (self._query.get("FilePath", [""])[0] or "").strip("/")
        rev = self._query.get("Revision", [MS_DEFAULT_BRANCH])[0] or MS_DEFAULT_BRANCH
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, "model", repo_id)
            branch = _ms_branch(repo, rev)
            if branch not in repo["branches"]:
                raise HubError(404, f"branch {rev} not found", ms_code=10010205003)
            tree = dict(repo["commits"][repo["branches"][branch]]["files"])
            if tree.pop(path, None) is None:
                raise HubError(404, f"file {path} not found", ms_code=10010205004)
            sha = _add_commit(repo, branch, tree, f"delete {path}")
        return _ms_ok({"CommitId": sha})

    def _ms_commit(self, repo_id: str, rev: str) -> Response:
        self._require_write()
        body = self._json_body()
        actions = body.get("actions") or []
        with self.hub.store.transaction(write=True) as state:
            repo = self._get_repo(state, "model", repo_id)
            branch = _ms_branch(repo, rev)
            if branch not in repo["branches"]:
                raise HubError(404, f"branch {rev} not found", ms_code=10010205003)
            tree = dict(repo["commits"][repo["branches"][branch]]["files"])
            for act in actions:
                action, path = act.get("action"), str(act.get("path", "")).strip("/")
                if action == "delete":
                    if tree.pop(path, None) is None:
                        raise HubError(404, f"file {path} not found", ms_code=10010205004)
                    continue
                if action not in ("create", "update"):
                    raise HubError(400, f"unsupported action {action!r}", ms_code=400)
                if act.get("type") == "lfs":
                    oid = act.get("sha256", "")
                    data = self.hub.store.get_blob(oid)
                    if data is None:
                        raise HubError(400, f"LFS object {oid} for {path} was not uploaded", ms_code=400)
                    tree[path] = _file_entry(oid, len(data), True)
                else:
                    data = base64.b64decode(act.get("content") or "")
                    sha = self.hub.store.put_blob(data)
                    tree[path] = _file_entry(sha, len(data), False, data)
            commit_sha = _add_commit(repo, branch, tree, body.get("commit_message") or "Upload files")
        return _ms_ok({"CommitId": commit_sha, "CommitMessage": body.get("commit_message") or "", "Branch": rev})


def _xor_large(body: bytes) -> bytes:
    """Flip every byte of a large body quickly."""
    n = len(body)
    return (int.from_bytes(body, "little") ^ int.from_bytes(b"\xff" * n, "little")).to_bytes(n, "little")


# ----------------------------------------------------------------------------------------------
# Script mode
# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(description="Local Hugging Face + ModelScope test hub (loopback only).")
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    parser.add_argument("--token", default=None, help="require this token for write requests")
    parser.add_argument("--data", default=None, help="store repositories in this directory (shared between processes)")
    parser.add_argument("--cdn-host", default=None, help="redirect LFS downloads to this host name (e.g. localhost)")
    args = parser.parse_args(argv)
    if not _is_loopback_host(args.host):
        print(f"error: refusing to bind to non-loopback host {args.host!r}; use 127.0.0.1 or ::1", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        server = HubServer(args.host, args.port, token=args.token, data_dir=args.data, cdn_host=args.cdn_host).start()
    except OSError as exc:
        print(f"error: cannot start the hub server: {exc}", file=sys.stderr)
        return 1
    print(f"HUB_URL={server.url}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
    return 0


# ----------------------------------------------------------------------------------------------
# pytest fixtures (only when pytest is available; the server itself needs only the stdlib)
# ----------------------------------------------------------------------------------------------

_pytest: Any = None
if __name__ != "__main__":  # script mode starts faster without importing pytest
    try:
        import pytest as _pytest
    except ImportError:  # pragma: no cover - the server works without pytest
        _pytest = None


@dataclass
class HubEnv:
    """What :func:`configure_clients` set up: the endpoint plus the isolated client directories."""

    url: str
    server: HubServer | None
    hf_home: Path
    hf_cache: Path
    ms_cache: Path
    ms_home: Path


def configure_clients(monkeypatch: Any, endpoint: str | HubServer, root: str | os.PathLike[str]) -> HubEnv:
    """Point huggingface_hub and modelscope at ``endpoint``, with caches and credentials under ``root``.

    ``monkeypatch`` is pytest's fixture; everything is undone when the test ends, and nothing is
    read from or written to ``~/.cache``, ``~/.modelscope`` or a stored Hugging Face token.
    Environment variables are set for code that reads them at call time and for subprocesses.
    Both clients also freeze values at import time, which environment variables cannot change
    any more: huggingface_hub copies ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_XET``,
    the cache and token paths into ``huggingface_hub.constants``, and modelscope_hub keeps one
    process-wide ``HubConfig`` (endpoint, cache and credentials directory). Those module values are
    patched too. huggingface_hub would also fetch an "agent harness" registry from the endpoint
    once per process; its in-process cache is pre-filled with the empty registry so that request
    never shows up in a request log.
    """
    server = endpoint if isinstance(endpoint, HubServer) else None
    url = endpoint.url if isinstance(endpoint, HubServer) else str(endpoint).rstrip("/")
    root = Path(root)
    env = HubEnv(url, server, root / "hf-home", root / "hf-home" / "hub", root / "ms-cache", root / "ms-home")
    for p in (env.hf_cache, env.ms_cache, env.ms_home):
        p.mkdir(parents=True, exist_ok=True)
    values = {
        "HF_ENDPOINT": url,
        "HF_HOME": str(env.hf_home),
        "HF_HUB_CACHE": str(env.hf_cache),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "0",
        "MODELSCOPE_ENDPOINT": url,
        "MODELSCOPE_CACHE": str(env.ms_cache),
        "MODELSCOPE_HOME": str(env.ms_home),
        "MODELSCOPE_CREDENTIALS_PATH": str(env.ms_home / "credentials"),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    unset = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN", "MODELSCOPE_DOMAIN", "TRANSFORMERS_OFFLINE")
    for name in unset:
        monkeypatch.delenv(name, raising=False)
    try:
        from huggingface_hub import constants as hf_constants
    except ImportError:
        hf_constants = None
    if hf_constants is not None:
        patched = {
            "ENDPOINT": url,
            "HUGGINGFACE_CO_URL_TEMPLATE": url + "/{repo_id}/resolve/{revision}/{filename}",
            "HF_HOME": str(env.hf_home),
            "HF_HUB_CACHE": str(env.hf_cache),
            "HUGGINGFACE_HUB_CACHE": str(env.hf_cache),
            "HF_TOKEN_PATH": str(env.hf_home / "token"),
            "HF_STORED_TOKENS_PATH": str(env.hf_home / "stored_tokens"),
            "HF_HUB_DISABLE_XET": True,
            "HF_HUB_OFFLINE": False,
            "HF_HUB_DISABLE_TELEMETRY": True,
            "HF_HUB_DISABLE_PROGRESS_BARS": True,
            "AGENT_HARNESSES_PATH": str(env.hf_home / ".agent_harnesses.json"),
        }
        for name, value in patched.items():
            if hasattr(hf_constants, name):
                monkeypatch.setattr(hf_constants, name, value)
        with contextlib.suppress(ImportError, AttributeError):
            from huggingface_hub.utils import _detect_agent

            monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    try:
        from modelscope_hub import config as ms_config
    except ImportError:
        ms_config = None
    if ms_config is not None:
        monkeypatch.setattr(
            ms_config,
            "_default_config",
            ms_config.HubConfig(endpoint=url, cache_dir=env.ms_cache, config_dir=env.ms_home),
        )
    return env


if _pytest is not None:

    @_pytest.fixture
    def hub_server_factory() -> Iterator[Callable[..., HubServer]]:
        """Factory fixture: ``hub_server_factory(token=..., data_dir=...)`` starts extra servers."""
        servers: list[HubServer] = []

        def make(**kwargs: Any) -> HubServer:
            server = HubServer(**kwargs).start()
            servers.append(server)
            return server

        yield make
        for server in servers:
            server.stop()

    @_pytest.fixture
    def hub_server() -> Iterator[HubServer]:
        """A fresh in-memory hub on 127.0.0.1 requiring :data:`TEST_TOKEN` for writes."""
        with HubServer(token=TEST_TOKEN) as server:
            yield server

    @_pytest.fixture
    def fresh_probe_memory() -> Iterator[None]:
        """rotationzoo forgets the hosts it found unreachable before and after the test (every test's hub is new)."""
        from rotationzoo.hub import network

        network.forget_unreachable()
        yield
        network.forget_unreachable()

    @_pytest.fixture
    def hub_env(hub_server: HubServer, tmp_path: Path, monkeypatch: Any) -> HubEnv:
        """``hub_server`` plus both clients pointed at it, with caches under ``tmp_path``."""
        return configure_clients(monkeypatch, hub_server, tmp_path / "clients")


if __name__ == "__main__":
    sys.exit(main())
