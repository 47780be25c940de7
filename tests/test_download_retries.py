"""Retries as documented: a 5xx or a dropped connection on a download request itself (the GET, not
only the pre-flight) is retried ``ROTATIONZOO_RETRIES`` times with backoff on the same source, with
the real Hugging Face and ModelScope clients and for URL sources, before the next source is tried."""

from __future__ import annotations

import time

import pytest
from hubserver import fresh_probe_memory, hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, zoo  # noqa: F401  (fixture)
from test_fetch_deadline import _first, _request_of

import rotationzoo

SOURCES = ("huggingface", "modelscope", "url")

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_probe_memory")]


def _faulted(zoo, match: str) -> list[dict]:
    return [e for e in zoo.server.requests() if e["fault"] and match in e["target"]]


@pytest.mark.parametrize("source", SOURCES)
def test_one_http_500_on_the_download_get_heals_on_the_same_source(zoo, source) -> None:
    _first(source)
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "http500", count=1, method=method)
    messages: list[str] = []
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert time.monotonic() - t0 < 5
    assert res.source.startswith(source), (res.source, messages)
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert [e["status"] for e in _faulted(zoo, match)] == [500]
    assert any("HTTP 500" in m and "retrying in 0.5 s" in m for m in messages), messages


@pytest.mark.parametrize("source", SOURCES)
def test_one_dropped_connection_on_the_download_get_heals_on_the_same_source(zoo, source) -> None:
    _first(source)
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "reset", count=1, method=method)
    messages: list[str] = []
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert time.monotonic() - t0 < 5
    assert res.source.startswith(source), (res.source, messages)
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert len(_faulted(zoo, match)) == 1


@pytest.mark.parametrize("source", SOURCES)
def test_a_persistent_5xx_on_the_download_get_is_retried_then_fails_over(zoo, monkeypatch, source) -> None:
    monkeypatch.setenv("ROTATIONZOO_RETRIES", "1")
    _first(source)
    match, method = _request_of(zoo, source, "download")
    zoo.server.arm_fault(match, "http500", count=1000, method=method, status=503)
    messages: list[str] = []
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert time.monotonic() - t0 < 10
    assert not res.source.startswith(source)
    assert [e["status"] for e in _faulted(zoo, match)] == [503, 503]  # one attempt + ROTATIONZOO_RETRIES=1
    assert any(m.startswith(source) and "HTTP 503" in m and "(2 attempts)" in m for m in messages), messages
