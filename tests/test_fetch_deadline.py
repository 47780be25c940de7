"""Deadlines on every download: a source that drips its answer's headers or its body (a byte every
fraction of a second, so that no single read ever times out) is given up within the documented
bound and the next source serves the file, with nothing partial kept; a slow but steady source is
not cut. Covers the pre-flight requests, the ``url`` stream and the real hub clients' downloads."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
from hubserver import fresh_probe_memory, hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, TAG, zoo  # noqa: F401  (fixture)

import rotationzoo
from rotationzoo.errors import ConfigError, FetchError
from rotationzoo.hub import network

TIMEOUT = 1.0  # ROTATIONZOO_TIMEOUT here: the headers deadline, and the constant of the body's
DRIP = 0.2  # seconds between dripped bytes: well under TIMEOUT, so only a deadline can stop a drip
SLACK = 2.5  # what failing over costs on a loaded machine (the next source's pre-flight included)

# without deadlines, a drip here lasts for hours
pytestmark = [pytest.mark.timeout(90), pytest.mark.usefixtures("fresh_probe_memory")]


@pytest.fixture
def short_timeout(monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_TIMEOUT", str(TIMEOUT))


def _first(source: str) -> None:
    """List the ``source`` type first in the registry overlay (the others keep their order)."""
    path = Path(os.environ["ROTATIONZOO_REGISTRY"])
    reg = json.loads(path.read_text())
    for f in reg["models"][0]["tags"][TAG]["files"].values():
        f["sources"].sort(key=lambda s: s["type"] != source)
    path.write_text(json.dumps(reg))


def _request_of(zoo, source: str, step: str) -> tuple[str, str]:
    """(match, method) of the K file's ``step`` ("preflight" or "download") on ``source``."""
    path = zoo.files["k"][0]
    if source == "huggingface":
        return f"/resolve/{zoo.commit}/{path}", "HEAD" if step == "preflight" else "GET"
    if source == "modelscope":
        return ("/repo/files", "GET") if step == "preflight" else (f"FilePath={path}", "GET")
    return f"/raw/{path}", "GET"


def _is_first_request_of(entry: dict, source: str) -> bool:
    if source == "huggingface":
        return entry["method"] == "HEAD" and "/resolve/" in entry["target"]
    return entry["target"].startswith("/api/v1/models/") and "/repo/files" in entry["target"]


def _partials(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".incomplete", ".part", ".tmp")) and p.is_file()]


CASES = [
    ("huggingface", "download", "drip_headers"),
    ("huggingface", "download", "drip_body"),
    ("huggingface", "preflight", "drip_headers"),
    ("modelscope", "download", "drip_headers"),
    ("modelscope", "download", "drip_body"),
    ("modelscope", "preflight", "drip_headers"),
    ("modelscope", "preflight", "drip_body"),
    ("url", "download", "drip_headers"),
    ("url", "download", "drip_body"),
]


@pytest.mark.parametrize(("source", "step", "kind"), CASES, ids=["-".join(c) for c in CASES])
def test_a_dripping_source_fails_over_within_the_deadline(zoo, short_timeout, source, step, kind) -> None:
    _first(source)
    match, method = _request_of(zoo, source, step)
    zoo.server.arm_fault(match, kind, method=method, interval=DRIP)
    messages: list[str] = []
    res = rotationzoo.fetch(MODEL, report=messages.append)

    following = "modelscope" if source == "huggingface" else "huggingface"
    assert res.source.startswith(following + ":"), messages  # not retried: the next source served it
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    log = zoo.server.requests()
    dripped = [e for e in log if e["fault"] == kind]
    assert len(dripped) == 1
    next_source = next(e for e in log if e["seq"] > dripped[0]["seq"] and _is_first_request_of(e, following))
    # a drip of ~0 bytes has a deadline of TIMEOUT (headers), or TIMEOUT + bytes / MIN_RATE (body)
    given_up_after = next_source["time"] - dripped[0]["time"]
    assert TIMEOUT - 0.1 <= given_up_after <= TIMEOUT + SLACK, given_up_after
    line = next(m for m in messages if m.startswith(source) and "trying" in m)
    assert ("headers not complete" if kind == "drip_headers" else "body too slow") in line, line
    assert "\n" not in line and len(line.split("; trying")[0]) <= 240
    assert _partials(zoo.cache) == []


@pytest.mark.parametrize("kind", ["drip_headers", "drip_body"])
def test_every_source_dripping_is_one_timeout_line_each(zoo, kind) -> None:
    for source in ("huggingface", "modelscope", "url"):
        match, method = _request_of(zoo, source, "download")
        zoo.server.arm_fault(match, kind, method=method, interval=DRIP)
    t0 = time.monotonic()
    with network.using(timeout=TIMEOUT), pytest.raises(FetchError) as info:  # the library's knob
        rotationzoo.fetch(MODEL)
    assert time.monotonic() - t0 < 3 * (TIMEOUT + SLACK)
    attempts = info.value.attempts
    assert [a["source"].split(":")[0] for a in attempts] == ["huggingface", "modelscope", "url"]
    assert [a["kind"] for a in attempts] == ["timeout"] * 3, attempts
    assert all("\n" not in a["reason"] and len(a["reason"]) <= 120 for a in attempts)
    assert _partials(zoo.cache) == []


@pytest.mark.parametrize("source", ["huggingface", "modelscope", "url"])
def test_a_slow_but_steady_body_is_not_cut_and_one_under_the_rate_is(zoo, monkeypatch, source) -> None:
    monkeypatch.setenv("ROTATIONZOO_TIMEOUT", str(TIMEOUT))
    size = len(zoo.files["k"][1])
    pieces = 20  # 0.1 s apart: the body takes 2 s, twice TIMEOUT, so a flat timeout would cut it
    chunk = math.ceil(size / pieces)
    rate = chunk / 0.1
    match, method = _request_of(zoo, source, "download")

    monkeypatch.setenv("ROTATIONZOO_MIN_RATE", str(rate / 2))  # the body keeps up with MIN_RATE
    zoo.server.arm_fault(match, "drip_body", method=method, interval=0.1, chunk=chunk)
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, source=source, cache_dir=zoo.cache / "steady")
    assert time.monotonic() - t0 >= 1.8
    assert res.source.startswith(source) and res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert [e["fault"] for e in zoo.server.requests() if match in e["target"]].count("drip_body") == 1

    monkeypatch.setenv("ROTATIONZOO_MIN_RATE", str(rate * 4))  # now it falls behind: cut after ~1.3 s
    zoo.server.arm_fault(match, "drip_body", method=method, interval=0.1, chunk=chunk)
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source=source, cache_dir=zoo.cache / "too-slow")
    assert time.monotonic() - t0 < 1.8 + SLACK
    assert info.value.attempts[0]["kind"] == "timeout" and "body too slow" in info.value.attempts[0]["reason"]
    assert _partials(zoo.cache) == []


@pytest.mark.parametrize(("source", "status"), [("huggingface", 429), ("modelscope", 503)])
def test_a_hub_client_told_to_wait_is_retried_on_our_budget_then_fails_over(zoo, short_timeout, source,
                                                                           status) -> None:
    """A 429 / 5xx to the hub client's own download request never lets the client sleep and retry on
    its own (huggingface_hub 1 + 2 + 4 + 8 + 8 s, or as long as a Retry-After says): rotationzoo
    retries it ROTATIONZOO_RETRIES times (0.5 s, 1 s apart), then fails over."""
    _first(source)
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "http500", count=50, method=method, status=status)
    messages: list[str] = []
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert time.monotonic() - t0 < SLACK + 1.5 + 1
    assert not res.source.startswith(source)
    assert [e["status"] for e in zoo.server.requests() if e["fault"]] == [status] * 3  # 1 + ROTATIONZOO_RETRIES
    assert any(m.startswith(source) and f"HTTP {status}" in m and "(3 attempts)" in m for m in messages), messages


def test_the_client_hooks_do_nothing_outside_a_download(hub_server, monkeypatch) -> None:
    """Other code using the hub clients' HTTP libraries in the same process is not put under the
    deadlines: a body taking 2.5 times ROTATIONZOO_TIMEOUT still arrives, in this thread while no
    download runs (on a kept-alive connection a download used, too), and in this thread while
    another thread's download runs."""
    import threading

    import httpx2
    import requests

    from rotationzoo.hub import transfer

    monkeypatch.setenv("ROTATIONZOO_TIMEOUT", "0.2")
    transfer.hook_clients()
    url = hub_server.put_raw("slow.bin", b"x" * 10)
    session, client = requests.Session(), httpx2.Client()
    with transfer.transfer(network.limits(), client=True):  # both keep a connection a download used
        assert session.get(url, timeout=10).content == client.get(url, timeout=10).content == b"x" * 10
    gets = [lambda: session.get(url, timeout=10).content, lambda: client.get(url, timeout=10).content,
            lambda: requests.get(url, timeout=10).content, lambda: httpx2.get(url, timeout=10).content]
    for get in gets:
        hub_server.arm_fault("slow.bin", "drip_body", interval=0.05)  # 0.5 s in all
        assert get() == b"x" * 10
    hold, release = threading.Event(), threading.Event()

    def elsewhere() -> None:
        with transfer.transfer(network.limits(), client=True):
            hold.set()
            release.wait(10)

    other = threading.Thread(target=elsewhere)
    other.start()
    try:
        hold.wait(10)
        for get in gets:
            hub_server.arm_fault("slow.bin", "drip_body", interval=0.05)
            assert get() == b"x" * 10
    finally:
        release.set()
        other.join()
        session.close()
        client.close()


def test_limits_come_from_the_environment_or_the_library(monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_TIMEOUT", "4")
    monkeypatch.setenv("ROTATIONZOO_MIN_RATE", "1000")
    assert network.limits() == network.Limits(timeout=4, min_rate=1000)
    assert network.limits().body_seconds(5000) == 9
    with network.using(min_rate=0) as lim:
        assert lim == network.limits() == network.Limits(4, 0) and lim.body_seconds(5000) == math.inf
        with network.using(timeout=2):
            assert network.limits() == network.Limits(2, 0)
    assert network.limits() == network.Limits(4, 1000)
    for value in ("abc", "-1", "nan", "inf"):
        monkeypatch.setenv("ROTATIONZOO_MIN_RATE", value)
        with pytest.raises(ConfigError, match="ROTATIONZOO_MIN_RATE"):
            network.limits()
    monkeypatch.setenv("ROTATIONZOO_MIN_RATE", "1000")
    monkeypatch.setenv("ROTATIONZOO_TIMEOUT", "0")
    with pytest.raises(ConfigError, match="ROTATIONZOO_TIMEOUT must be > 0"):
        network.limits()
    with pytest.raises(ConfigError, match="timeout"):
        network.Limits(timeout=0)
    with pytest.raises(ConfigError, match="min_rate"):
        network.Limits(min_rate=float("nan"))
