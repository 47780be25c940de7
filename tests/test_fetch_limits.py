"""What a source may not do to the machine fetching from it, with the real hub clients against the
test hub: send more bytes than the registry's size (declared, undeclared or compressed), redirect a
``url`` source where the registry may not point one, or end the fetch by serving bad bytes while
other sources serve good ones. And the local disk's own failures (a file size limit, a full disk)
are said as such, once, never retried or failed over as if the network had dropped them."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import resource
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import hubserver
from hubserver import fresh_probe_memory, hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, TAG, zoo  # noqa: F401  (fixture)
from test_fetch_deadline import _request_of

import rotationzoo
from rotationzoo.errors import CacheError, FetchError, IntegrityError

HUBS = ("huggingface", "modelscope")
FLOOD = 64 << 20  # what an inflated answer sends: far more than the 8 KiB rotation files here

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("fresh_probe_memory")]


@pytest.fixture
def faults(monkeypatch) -> dict:
    """Two more fault kinds for the test hub, armed like its own (``zoo.server.arm_fault(match, kind, ...)``):

    * ``inflate``: ``size`` bytes of zeros instead of the answer's body, with that ``Content-Length``
      (``body="declared"``), without one, ending it by closing the connection (``"undeclared"``), or as a
      gzip body that inflates to ``size`` bytes (``"gzip"``);
    * ``lie_length``: the answer with ``Content-Length`` and ``X-Linked-Size`` ``length`` (for a ``HEAD``).

    Returns ``{"sent": bytes of zeros sent}``."""
    stats = {"sent": 0}
    gz: dict[int, bytes] = {}
    original = hubserver._Handler._send

    def gzipped(size: int) -> bytes:
        if size not in gz:
            c = zlib.compressobj(9, zlib.DEFLATED, 31)
            block = b"\0" * (1 << 20)
            gz[size] = b"".join(c.compress(block) for _ in range(size >> 20)) + c.flush()
        return gz[size]

    def _send(self, method, response, fault) -> None:
        kind = fault.kind if fault is not None else None
        if kind not in ("inflate", "lie_length") or response.status != 200:
            return original(self, method, response, fault)
        self.send_response(200)
        lie = kind == "lie_length"
        for name, value in {"Content-Type": response.content_type, **response.headers}.items():
            if name.lower() != "content-length" and not (lie and name.lower() == "x-linked-size"):
                self.send_header(name, value)
        if lie:
            for name in ("Content-Length", "X-Linked-Size"):
                self.send_header(name, str(fault.params["length"]))
            self.end_headers()
            if method != "HEAD":
                self.wfile.write(response.body)
            return
        size, body = int(fault.params.get("size", FLOOD)), fault.params.get("body", "declared")
        data = gzipped(size) if body == "gzip" else None
        if body == "gzip":
            self.send_header("Content-Encoding", "gzip")
        if body == "declared":
            self.send_header("Content-Length", str(size))
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        try:
            if data is not None:
                self.wfile.write(data)
                return
            block = b"\0" * (1 << 16)
            while stats["sent"] < size:
                self.wfile.write(block)
                stats["sent"] += len(block)
        except OSError:
            pass

    monkeypatch.setattr(hubserver, "FAULT_KINDS", (*hubserver.FAULT_KINDS, "inflate", "lie_length"))
    monkeypatch.setattr(hubserver, "_BODY_FAULTS", (*hubserver._BODY_FAULTS, "inflate", "lie_length"))
    monkeypatch.setattr(hubserver._Handler, "_send", _send)
    return stats


def _left_in(cache: Path) -> list[Path]:
    """Files a failed fetch left in the cache (lock files and cache tags aside)."""
    return [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock") and p.name != "CACHEDIR.TAG"]


# -- A: no download brings more than the registry's size ---------------------------------------------


@pytest.mark.parametrize("body", ["declared", "undeclared"])
@pytest.mark.parametrize("source", HUBS)
def test_a_hub_download_stops_at_the_pinned_size(zoo, faults, source, body) -> None:
    """The pre-flight sees the right size; the client's GET then sends 64 MiB (announced or not): it is
    stopped at its headers or within a read of the 8 KiB cap, with a typed error and nothing kept
    (before: all of it written into the client's cache, 600 MB in the audit)."""
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "inflate", count=10, method=method, body=body)
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source=source)
    attempt = info.value.attempts[0]
    assert attempt["kind"] == "too_large" and str(len(zoo.files["k"][1])) in attempt["reason"], attempt
    assert faults["sent"] < 16 << 20  # the server was cut off long before its 64 MiB (socket buffers aside)
    assert _left_in(zoo.cache) == []


@pytest.mark.parametrize("source", HUBS)
def test_an_unpinned_hub_download_stops_at_the_documented_maximum(zoo, faults, source) -> None:
    zoo.write_registry(pinned=False)
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "inflate", count=10, method=method, size=300 << 20)
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source=source)
    attempt = info.value.attempts[0]
    assert attempt["kind"] == "too_large" and str(256 << 20) in attempt["reason"], attempt
    assert faults["sent"] < 16 << 20
    assert _left_in(zoo.cache) == []


@pytest.mark.parametrize("source", HUBS)
def test_a_compressed_body_is_stopped_once_the_client_writes_past_the_size(zoo, faults, source) -> None:
    """48 KiB on the wire (within the cap) that the client inflates to 48 MiB: stopped as the file it
    writes passes the registry's size, and removed (before: a size mismatch, retried as bad bytes)."""
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "inflate", count=10, method=method, body="gzip", size=48 << 20)
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source=source)
    attempt = info.value.attempts[0]
    assert attempt["kind"] == "too_large" and "more than the expected 8095 B" in attempt["reason"], attempt
    if source == "huggingface":  # counted chunk by chunk before the client writes it
        assert attempt["reason"].startswith("wrote more than the expected"), attempt
    assert _left_in(zoo.cache) == []


# -- B: a url source's redirects follow the registry's URL rules ---------------------------------------


class _Redirect(http.server.BaseHTTPRequestHandler):
    to = ""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(302)
        self.send_header("Location", type(self).to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _serve(handler: type, host: str = "127.0.0.1") -> http.server.ThreadingHTTPServer:
    httpd = http.server.ThreadingHTTPServer((host, 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _url_only(url_of) -> None:
    reg_path = Path(os.environ["ROTATIONZOO_REGISTRY"])
    reg = json.loads(reg_path.read_text())
    for side, f in reg["models"][0]["tags"][TAG]["files"].items():
        f["sources"] = [{"type": "url", "url": url_of(side)}]
    reg_path.write_text(json.dumps(reg))


@pytest.mark.parametrize("target", ["http://127.0.0.2:{port}/k.pt", "ftp://127.0.0.1/k.pt",
                                    "http://user:pw@127.0.0.1:{port}/k.pt"])
def test_a_url_source_is_not_redirected_where_the_registry_may_not_point(zoo, target) -> None:
    """A registry may not name plain http to a host other than loopback, ftp, or credentials; neither may
    a redirect lead there (before: urllib followed it and the file was taken from there)."""
    hits: list[str] = []

    class _Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    other = _serve(_Other, "127.0.0.2" if "127.0.0.2" in target else "127.0.0.1")
    _Redirect.to = target.format(port=other.server_address[1])
    redirect = _serve(_Redirect)
    try:
        _url_only(lambda side: f"http://127.0.0.1:{redirect.server_address[1]}/{side}.pt")
        with pytest.raises(FetchError) as info:
            rotationzoo.fetch(MODEL)
        attempt = info.value.attempts[0]
        assert attempt["kind"] == "denied" and "refused a redirect to" in attempt["reason"], attempt
        assert hits == []
    finally:
        other.shutdown()
        redirect.shutdown()


def test_a_redirect_the_registry_could_name_is_followed(zoo) -> None:
    _Redirect.to = zoo.server.raw_url(zoo.files["k"][0])
    redirect = _serve(_Redirect)
    try:
        reg_path = Path(os.environ["ROTATIONZOO_REGISTRY"])
        reg = json.loads(reg_path.read_text())
        reg["models"][0]["tags"][TAG]["files"]["k"]["sources"] = [
            {"type": "url", "url": f"http://localhost:{redirect.server_address[1]}/k.pt"}]
        reg_path.write_text(json.dumps(reg))
        res = rotationzoo.fetch(MODEL)
        assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    finally:
        redirect.shutdown()


# -- C: a source serving bad bytes is passed over ------------------------------------------------


def test_a_source_serving_bad_bytes_twice_is_passed_over_for_the_next(zoo) -> None:
    zoo.server.arm_fault("/resolve/", "corrupt", count=100)
    messages: list[str] = []
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert res.source.startswith("modelscope:")
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert any("huggingface:" in m and "failed verification twice" in m and "trying modelscope" in m
               for m in messages), messages


def test_every_source_serving_bad_bytes_names_each_one(zoo) -> None:
    zoo.server.arm_fault("k_rotation", "corrupt", count=100)
    with pytest.raises(IntegrityError) as info:
        rotationzoo.fetch(MODEL)
    lines = str(info.value).splitlines()
    assert [line.split(":")[0].strip() for line in lines[1:4]] == ["huggingface", "modelscope", "url"], lines
    bad = hashlib.sha256(bytes(b ^ 0xFF for b in zoo.files["k"][1])).hexdigest()
    assert all("failed verification twice" in line and bad in line for line in lines[1:4]), lines
    assert lines[-1].startswith("hint:") and len(lines) == 5
    assert not any(p.name.startswith("k_rotation") for p in _left_in(zoo.cache / "files"))


# -- D: the local disk's failures -----------------------------------------------------------------------


def _fetch_with_file_limit(tmp_path: Path, limit: int, *argv: str) -> subprocess.CompletedProcess:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = {**os.environ, "ROTATIONZOO_CACHE": str(tmp_path / "limited")}
    return subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", "--model", MODEL, *argv],
                          capture_output=True, text=True, timeout=90, env=env, preexec_fn=lower)


@pytest.mark.parametrize("source", ["huggingface", "modelscope", "url"])
def test_a_file_over_the_file_size_limit_is_one_local_error(zoo, tmp_path, source) -> None:
    """``ulimit -f 4`` and an 8 KiB file: one line about the limit, at once (before: "connection dropped"
    retried three times, "no answer within 10 s" after 17 s of ModelScope's retries, or a FetchError whose
    hint is about the network)."""
    r = _fetch_with_file_limit(tmp_path, 4096, "--source", source)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "file size limit of 4096 B" in lines[0] and "k_rotation" in lines[0], r.stderr
    assert "network" not in r.stderr and "attempts" not in r.stderr


def test_a_write_refused_mid_download_is_one_local_error(zoo, tmp_path) -> None:
    """A url file of unknown size (unpinned): the write that passes the limit fails the fetch at once."""
    zoo.write_registry(pinned=False)
    r = _fetch_with_file_limit(tmp_path, 4096, "--source", "url")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "cannot write into the cache folder" in lines[0] and "EFBIG" in lines[0] and "ulimit -f" in lines[0]
    assert len([e for e in zoo.server.requests("GET") if "/raw/" in e["target"]]) == 1  # never retried


def test_a_hub_clients_write_refused_is_one_local_error(zoo, faults, tmp_path) -> None:
    """The Hugging Face client writes past the file size limit (the hub said the file is 100 B): the
    client's OSError is the disk's failure, not the source's (before: "OSError: [Errno 27] File too
    large" as the source's line, then the next sources, then a hint about the network)."""
    zoo.write_registry(pinned=False)
    match, _ = _request_of(zoo, "huggingface", "preflight")
    zoo.server.arm_fault(match, "lie_length", count=10, method="HEAD", length=100)
    r = _fetch_with_file_limit(tmp_path, 4096)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "cannot write into the cache folder" in lines[0] and "hub" in lines[0] and "EFBIG" in lines[0]
    assert not [e for e in zoo.server.requests() if "FilePath=" in e["target"] or "/raw/" in e["target"]]


def test_no_room_for_the_file_is_said_before_downloading(zoo, monkeypatch) -> None:
    from rotationzoo.hub import localdisk

    class _Full:
        f_bavail, f_frsize = 1, 4096

    monkeypatch.setattr(localdisk.os, "statvfs", lambda folder: _Full())
    with pytest.raises(CacheError, match=r"k_rotation_qqt_r_h_pbr.pt needs 8095 B, and 4096 B are free"):
        rotationzoo.fetch(MODEL)
    assert not [e for e in zoo.server.requests("GET") if "k_rotation" in e["target"]]


# -- F: a bad endpoint is named --------------------------------------------------------------------------


@pytest.mark.parametrize("name, source", [("HF_ENDPOINT", "huggingface"), ("MODELSCOPE_ENDPOINT", "modelscope")])
def test_an_endpoint_that_is_not_a_url_is_named(zoo, monkeypatch, name, source) -> None:
    monkeypatch.setenv(name, "notaurl")
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source=source)
    reason = info.value.attempts[0]["reason"]
    assert f"{name}='notaurl' is not an http(s) URL" in reason, reason  # before: "cannot reach : DNS lookup failed"
    res = rotationzoo.fetch(MODEL)  # auto: the other sources serve it
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
