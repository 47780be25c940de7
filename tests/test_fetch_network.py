"""Failing fast and safely: unreachable hosts, 5xx budgets, size caps, pins on first use, hits that
prove their bytes, orphaned downloads, and paths that stay inside the cache."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hubserver import fresh_probe_memory, hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, REPO_ID, TAG, zoo  # noqa: F401  (fixture)

import rotationzoo
from rotationzoo.cli.main import main
from rotationzoo import RotationSet, write_rotation
from rotationzoo.errors import CacheError, ConfigError, FetchError, IntegrityError
from rotationzoo.hub import cache_records, entry_dir, network, verify_cache
from rotationzoo.hub.pins import local_pins, pin_state, read_pins
from rotationzoo.registry import get_entry


pytestmark = pytest.mark.usefixtures("fresh_probe_memory")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- unreachable hosts ---------------------------------------------------------------------------


def test_unreachable_sources_fail_in_seconds_with_one_line_each(zoo, monkeypatch) -> None:
    dead = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", dead)
    zoo.server.stop()  # the raw URL source is dead too
    t0 = time.monotonic()
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL)
    assert time.monotonic() - t0 < 5
    attempts = info.value.attempts
    assert [a["source"].split(":")[0] for a in attempts] == ["huggingface", "modelscope", "url"]
    assert all(a["kind"] == "unreachable" and "connection refused" in a["reason"] for a in attempts), attempts
    lines = str(info.value).splitlines()
    assert len(lines) == 1 + len(attempts) + 1 and lines[-1].startswith("hint:")
    assert all(len(line) <= 240 for line in lines)


def test_cli_failure_prints_no_client_logs(zoo, tmp_path) -> None:
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
           "MODELSCOPE_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "ROTATIONZOO_CACHE": str(tmp_path / "c")}
    zoo.server.stop()
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", "--model", MODEL],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert time.monotonic() - t0 < 30  # interpreter start and imports included
    assert "Retry" not in r.stderr and "WARNING" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 5, r.stderr  # error line + 3 sources + hint


def test_dns_failure_is_unreachable_at_once() -> None:
    t0 = time.monotonic()
    with pytest.raises(network.Unavailable) as info:
        network.reach("https://no-such-host.invalid/x", timeout=5)
    assert info.value.kind == "unreachable" and "DNS" in info.value.reason
    assert time.monotonic() - t0 < 6


def test_an_unreachable_host_is_remembered(monkeypatch) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/x"
    with pytest.raises(network.Unavailable):
        network.reach(url, timeout=2)
    calls = []
    monkeypatch.setattr(network, "_resolve", lambda *a: calls.append(a) or [])
    with pytest.raises(network.Unavailable, match="connection refused"):
        network.reach(url, timeout=2)
    assert calls == []


# -- 5xx: bounded retries, then failover ----------------------------------------------------------


def test_persistent_5xx_is_retried_within_the_budget_then_fails_over(zoo, monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_RETRIES", "1")
    zoo.server.arm_fault("/resolve/", "http500", count=1000)
    messages: list[str] = []
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert time.monotonic() - t0 < 15
    assert res.source.startswith("modelscope:")
    heads = [r for r in zoo.server.requests("HEAD") if "k_rotation" in r["target"]]
    assert len(heads) == 2  # one attempt + ROTATIONZOO_RETRIES=1, and the client was never asked
    assert any("HTTP 500 (2 attempts)" in m and "trying modelscope" in m for m in messages), messages


def test_transient_5xx_heals_on_the_same_source(zoo) -> None:
    zoo.server.arm_fault("k_rotation", "http500", count=1, method="HEAD")
    messages: list[str] = []
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert res.source.startswith("huggingface:")
    assert any("retrying in" in m for m in messages), messages


def test_declared_size_differing_from_the_registry_fails_over_before_downloading(zoo, tmp_path) -> None:
    path, data = zoo.files["k"]
    other = write_rotation(tmp_path / "big.pt", RotationSet(torch.eye(16).repeat(8, 1, 1), range(8), "x"))
    zoo.server.commit_files(REPO_ID, {path: other.read_bytes()})  # main now holds a file of another size
    reg = json.loads(Path(os.environ["ROTATIONZOO_REGISTRY"]).read_text())
    for f in reg["models"][0]["tags"][TAG]["files"].values():
        f["sources"][0]["revision"] = "main"
    Path(os.environ["ROTATIONZOO_REGISTRY"]).write_text(json.dumps(reg))
    with pytest.raises(FetchError) as info:
        rotationzoo.fetch(MODEL, source="huggingface")
    assert info.value.attempts[0]["kind"] == "wrong_size", info.value.attempts
    gets = [r for r in zoo.server.requests("GET") if "k_rotation" in r["target"] and "/resolve/" in r["target"]]
    assert gets == []


# -- URL downloads stop at the expected size -----------------------------------------------------


class _Flood(http.server.BaseHTTPRequestHandler):
    """Streams far more than any rotation file, with or without a Content-Length."""

    sent = 0

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        if "declared" in self.path:
            self.send_header("Content-Length", str(64 << 20))
        self.end_headers()
        block = b"\0" * (1 << 16)
        try:
            for _ in range(1024):  # 64 MiB
                self.wfile.write(block)
                type(self).sent += len(block)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("declared", [True, False])
def test_url_download_stops_at_the_pinned_size(zoo, monkeypatch, tmp_path, declared) -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flood)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/{'declared' if declared else 'stream'}/k.pt"
        reg = json.loads(Path(os.environ["ROTATIONZOO_REGISTRY"]).read_text())
        for f in reg["models"][0]["tags"][TAG]["files"].values():
            f["sources"] = [{"type": "url", "url": url}]
        Path(os.environ["ROTATIONZOO_REGISTRY"]).write_text(json.dumps(reg))
        with pytest.raises(FetchError) as info:
            rotationzoo.fetch(MODEL)
        assert info.value.attempts[0]["kind"] == "too_large", info.value.attempts
        assert _Flood.sent < (16 << 20)  # stopped long before the 64 MiB the server would send
        leftovers = [p for p in zoo.cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
        assert leftovers == []
    finally:
        httpd.shutdown()


# -- trust on first use --------------------------------------------------------------------------


def test_unpinned_files_are_pinned_on_first_use_and_changes_refused(zoo, tmp_path) -> None:
    zoo.write_registry(pinned=False)
    entry = get_entry(MODEL)
    assert pin_state(entry, "k") == "unpinned"
    with pytest.warns(UserWarning):
        first = rotationzoo.fetch(MODEL, source="modelscope")
    assert pin_state(entry, "k") == "pinned locally"
    (label, pin), = local_pins(entry, "k").items()
    assert label == f"modelscope:{REPO_ID}@master" and pin["source"] == label
    assert pin["sha256"] == first.sha256["k"]
    assert pin["commit"] and len(pin["commit"]) == 40

    # the repository changes the file under the same name, and the cache is cleared
    path, _ = zoo.files["k"]
    other = write_rotation(tmp_path / "other.pt", RotationSet(torch.linalg.qr(torch.randn(4, 16, 16))[0],
                                                                 range(4), "qqt_r_h_pbr"))
    zoo.server.commit_files(REPO_ID, {path: other.read_bytes()})
    fresh = tmp_path / "another-cache"  # e.g. another machine of the same user
    with pytest.raises(IntegrityError, match="changed since it was first used.*--accept-new"):
        rotationzoo.fetch(MODEL, source="modelscope", cache_dir=fresh)
    assert not (entry_dir(fresh, entry) / path.rsplit("/", 1)[-1]).exists()
    assert rotationzoo.fetch(MODEL, source="modelscope").from_cache  # the first copy is still good
    again = rotationzoo.fetch(MODEL, source="modelscope", cache_dir=fresh, accept_new=True)
    assert again.sha256["k"] == hashlib.sha256(other.read_bytes()).hexdigest()
    assert local_pins(entry, "k")[label]["sha256"] == again.sha256["k"]


def test_cli_shows_pin_states_and_accepts_new(zoo, tmp_path, capsys) -> None:
    zoo.write_registry(pinned=False)
    assert main(["info", MODEL, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tag"]["files"]["k"]["pin"] == {"state": "unpinned"}
    assert main(["fetch", MODEL, "--source", "modelscope", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    sha = got["k"]["sha256"]
    for side in ("k", "v"):  # what an overlay registry pins, as docs/fetching.md tells
        data = Path(got[side]["path"]).read_bytes()
        assert (got[side]["sha256"], got[side]["size"]) == (hashlib.sha256(data).hexdigest(), len(data))
    assert main(["info", MODEL, "--json"]) == 0
    pin = json.loads(capsys.readouterr().out)["tag"]["files"]["k"]["pin"]
    assert pin["state"] == "pinned locally" and [p["sha256"] for p in pin["local"]] == [sha]
    assert pin["local"][0]["source"] == f"modelscope:{REPO_ID}@master"
    assert main(["info", MODEL]) == 0
    assert f"sha256 {sha} (pinned locally" in capsys.readouterr().out
    assert main(["fetch", MODEL, "--source", "modelscope", "--accept-new", "--timeout", "5", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["from_cache"] is False  # --accept-new downloads again


def test_registry_pins_win_over_the_pin_file(zoo) -> None:
    entry = get_entry(MODEL)
    rotationzoo.fetch(MODEL)
    assert pin_state(entry, "k") == "pinned" and read_pins() == {}


# -- a cache hit proves its bytes ----------------------------------------------------------------


def test_same_size_swap_with_mtime_restored_is_not_served(zoo, tmp_path) -> None:
    res = rotationzoo.fetch(MODEL)
    k = res.paths["k"]
    st = k.stat()
    data = bytearray(k.read_bytes())
    data[-100] ^= 0xFF
    k.write_bytes(bytes(data))
    os.utime(k, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = rotationzoo.fetch(MODEL)
    assert not again.from_cache
    assert again.paths["k"].read_bytes() == zoo.files["k"][1]


def test_k_symlinked_to_v_is_not_served_as_k(zoo) -> None:
    res = rotationzoo.fetch(MODEL)
    k, v = res.paths["k"], res.paths["v"]
    k.unlink()
    k.symlink_to(v)
    again = rotationzoo.fetch(MODEL)
    assert not again.from_cache and not again.paths["k"].is_symlink()
    assert again.paths["k"].read_bytes() == zoo.files["k"][1]


def test_a_symlink_is_never_a_hit_even_to_the_right_bytes(zoo, tmp_path) -> None:
    res = rotationzoo.fetch(MODEL)
    k = res.paths["k"]
    outside = tmp_path / "elsewhere.pt"  # e.g. a file another user controls
    outside.write_bytes(k.read_bytes())
    k.unlink()
    k.symlink_to(outside)
    again = rotationzoo.fetch(MODEL)
    assert not again.from_cache and not again.paths["k"].is_symlink()


@pytest.mark.parametrize("marker", ["1", "[]", "{}", '{"size": 3}', '{"sha256": "x", "size": 1}', "{" * 5000])
def test_malformed_markers_are_misses_not_crashes(zoo, marker) -> None:
    res = rotationzoo.fetch(MODEL)
    k = res.paths["k"]
    Path(str(k) + ".verified").write_text(marker)
    records = {r.path: r for r in cache_records()}
    assert records[k].sha256 is None
    verify_cache()  # a file without a valid marker is removed, nothing raises
    again = rotationzoo.fetch(MODEL)
    assert again.paths["k"].read_bytes() == zoo.files["k"][1]


# -- orphaned downloads ------------------------------------------------------------------------


def test_orphaned_part_files_are_listed_and_swept(zoo) -> None:
    res = rotationzoo.fetch(MODEL)
    folder = res.paths["k"].parent
    orphan = folder / ".url-abc123.part"
    orphan.write_bytes(b"\0" * 4096)
    listed = [r for r in cache_records() if r.path == orphan]
    assert listed and listed[0].area == "partial" and listed[0].size == 4096
    records = verify_cache()
    assert not orphan.exists()
    assert any(r.path == orphan and r.removed and "killed download" in (r.problem or "") for r in records)
    # the next download of an entry sweeps its folder too
    orphan.write_bytes(b"x")
    rotationzoo.fetch(MODEL, force=True)
    assert not orphan.exists()


# -- paths stay inside the cache ----------------------------------------------------------------


def test_revision_override_cannot_climb(zoo) -> None:
    with pytest.raises(ConfigError, match="revision"):
        rotationzoo.fetch(MODEL, source="huggingface", revision="../../outside")
    with pytest.raises(ConfigError, match="no '..' or '--'"):  # would share rel/1's folder
        rotationzoo.fetch(MODEL, source="huggingface", revision="rel--1")


def test_two_revisions_keep_their_own_derived_files(zoo, tmp_path) -> None:
    """A file built from one revision's files is neither rewritten by a build from another revision nor
    removed by cache verify while both revisions are cached."""
    from rotationzoo.files.derived import ensure_rotations_gguf

    other = {}
    for side, (path, _) in zoo.files.items():
        p = write_rotation(tmp_path / "v2" / path.rsplit("/", 1)[-1],
                           RotationSet(torch.linalg.qr(torch.randn(4, 16, 16))[0], range(4),
                                       "qqt_r_h_pbr" if side == "k" else "sst_r_h_pbr", torch.rand(4, 16)))
        other[path] = p.read_bytes()
    commit2 = zoo.server.commit_files(REPO_ID, other)
    zoo.write_registry(pinned=False)
    g1 = ensure_rotations_gguf(rotationzoo.load(MODEL, source="huggingface"))
    first = g1.read_bytes()
    pair2 = rotationzoo.load(MODEL, source="huggingface", revision=commit2)
    assert pair2.sha256["k"] == hashlib.sha256(other[zoo.files["k"][0]]).hexdigest()
    g2 = ensure_rotations_gguf(pair2)
    assert g2 != g1 and g1.read_bytes() == first and g2.read_bytes() != first
    records = verify_cache()
    assert [r.path for r in records if r.area == "derived"] and all(r.ok for r in records), \
        [(r.path, r.problem) for r in records if not r.ok]
    assert g1.read_bytes() == first and g2.is_file()


def test_entry_folder_symlinked_outside_the_cache_is_refused(zoo, tmp_path) -> None:
    entry = get_entry(MODEL)
    folder = entry_dir(zoo.cache, entry)
    folder.parent.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    folder.symlink_to(outside, target_is_directory=True)
    with pytest.raises(CacheError, match="outside the cache root"):
        rotationzoo.fetch(MODEL)
    assert list(outside.iterdir()) == []


def test_unwritable_cache_is_one_typed_line(zoo, tmp_path) -> None:
    if os.geteuid() == 0:
        # root writes anywhere: make the cache root a file instead of a folder
        blocked = tmp_path / "not-a-folder"
        blocked.write_text("x")
    else:
        blocked = tmp_path / "read-only"
        blocked.mkdir(mode=0o500)
    says = "is not a folder; set --cache-dir" if os.geteuid() == 0 else "is not writable.*ROTATIONZOO_CACHE"
    with pytest.raises(CacheError, match=says):
        rotationzoo.fetch(MODEL, cache_dir=blocked)


def test_a_xet_backed_file_comes_over_http_where_the_cap_holds(zoo, monkeypatch) -> None:
    """The Hub names Xet storage for a Xet-backed file; the Xet client reads in Rust, past the deadlines and the
    byte cap, so a download switches it off: the file comes over HTTP from the first source, nothing asks the
    Xet service, and huggingface_hub's own setting is as it was."""
    pytest.importorskip("hf_xet", reason="hf_xet is not installed: huggingface_hub takes HTTP anyway")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    zoo.server.arm_fault("/resolve/", "xet", count=1000)
    res = rotationzoo.fetch(MODEL)
    assert res.source.startswith("huggingface:"), res.source
    assert not any("xet-read-token" in r["target"] for r in zoo.server.requests()), zoo.server.requests()
    assert constants.HF_HUB_DISABLE_XET is False
