"""fetch / load / cache against the in-repo hub server, with the real huggingface_hub and modelscope clients."""

from __future__ import annotations

import hashlib
import json
import os
import time
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from helpers import random_orthogonal
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)

import rotationzoo
from rotationzoo import RotationSet, write_rotation
from rotationzoo.cli.main import main
from rotationzoo.errors import FetchError, IntegrityError, OfflineError
from rotationzoo.hub import UnpinnedEntryWarning, cache_records, verify_cache

REPO_ID = "zoo/RotationZoo"
MODEL = "acme/Tiny-LM"
TAG = "seq100_prompt2_group16"
L, D = 4, 16


def _orthogonal(seed: int) -> torch.Tensor:
    return random_orthogonal(L, D, seed)


@pytest.fixture
def zoo(hub_env, tmp_path, monkeypatch):
    """A hub repo with one K/V pair, the same bytes at a raw URL, and a registry overlay pinning them."""
    server = hub_env.server
    files = {}
    for side, obj, seed in (("k", "qqt_r_h_pbr", 1), ("v", "sst_r_h_pbr", 2)):
        p = write_rotation(tmp_path / "src" / f"{side}_rotation_{obj}.pt",
                           RotationSet(_orthogonal(seed), range(L), obj, torch.rand(L, D)))
        files[side] = (f"Tiny-LM/{TAG}/{p.name}", p.read_bytes())
    commit = server.commit_files(REPO_ID, {path: data for path, data in files.values()})
    for side, (path, data) in files.items():
        server.put_raw(path, data)
    sources = [
        {"type": "huggingface", "repo": REPO_ID, "revision": commit},
        {"type": "modelscope", "repo": REPO_ID, "revision": "master"},
        {"type": "url", "url": None},
    ]

    def file_entry(side, pinned=True):
        path, data = files[side]
        srcs = [dict(s) for s in sources]
        srcs[2]["url"] = server.raw_url(path)
        return {"path": path, "sha256": hashlib.sha256(data).hexdigest() if pinned else None,
                "size": len(data) if pinned else None, "sources": srcs}

    def write_registry(pinned=True, model=MODEL):
        reg = {"registry_version": 1, "models": [{
            "id": model, "aliases": [model.split("/")[1]],
            "architecture": {"num_layers": L, "head_dim": D, "num_kv_heads": 2},
            "default_tag": TAG,
            "tags": {TAG: {"objectives": {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"},
                           "serving": {"group_size": 16},
                           "files": {s: file_entry(s, pinned) for s in "kv"}}}}]}
        path = tmp_path / f"registry-{'pinned' if pinned else 'unpinned'}.json"
        path.write_text(json.dumps(reg))
        monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(path))
        return path

    cache = tmp_path / "rz-cache"
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(cache))
    write_registry()
    return type("Zoo", (), {"server": server, "files": files, "commit": commit, "cache": cache,
                            "write_registry": staticmethod(write_registry), "env": hub_env})


@pytest.fixture
def no_backoff_sleep(monkeypatch):
    """huggingface_hub retries 5xx and connection errors 5 times with 1-8 s sleeps before giving up.
    The requests still happen (the server logs them); only the waiting between them is skipped."""
    import types

    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "time", types.SimpleNamespace(**{**vars(_http.time), "sleep": lambda s: None}))


def _file_gets(server, name: str) -> list[dict]:
    return [r for r in server.requests("GET") if name in r["target"]]


def _assert_no_bad_copies(root: Path, bad: set[str]) -> None:
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert hashlib.sha256(p.read_bytes()).hexdigest() not in bad, f"bad bytes kept at {p}"


# -- each source ---------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["huggingface", "modelscope", "url"])
def test_fetch_and_load_each_source(zoo, source, tmp_path) -> None:
    res = rotationzoo.fetch(MODEL, source=source, cache_dir=tmp_path / source)
    assert res.source.startswith(source) and not res.from_cache
    for side in "kv":
        assert res.paths[side].read_bytes() == zoo.files[side][1]
        assert res.sha256[side] == hashlib.sha256(zoo.files[side][1]).hexdigest()
    pair = rotationzoo.load("tiny-lm", source=source, cache_dir=tmp_path / source)
    assert torch.equal(pair.k.rotations, _orthogonal(1)) and torch.equal(pair.v.rotations, _orthogonal(2))
    assert pair.layer_ids == tuple(range(L)) and pair.serving.group_size == 16
    assert pair.k.objective == "qqt_r_h_pbr"


def test_auto_uses_the_first_source_and_always_passes_a_revision(zoo) -> None:
    res = rotationzoo.fetch(MODEL)
    assert res.source == f"huggingface:{REPO_ID}@{zoo.commit}"
    gets = _file_gets(zoo.server, "k_rotation_qqt_r_h_pbr.pt")
    assert len(gets) == 1 and zoo.commit in gets[0]["target"]


# -- failover and integrity ----------------------------------------------------------------------


def test_hf_500_fails_over_to_modelscope(zoo, no_backoff_sleep) -> None:
    zoo.server.arm_fault("/resolve/", "http500", count=1000)
    messages = []
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert res.source.startswith("modelscope:")
    assert any("huggingface" in m and "500" in m and "trying modelscope" in m for m in messages), messages
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]


def test_missing_file_fails_over(zoo, tmp_path, no_backoff_sleep) -> None:
    zoo.server.commit_files(REPO_ID, {}, delete=[p for p, _ in zoo.files.values()])  # gone from main/master
    messages = []
    res = rotationzoo.fetch(MODEL, source="auto", revision=None, report=messages.append)
    # HF is pinned to the old commit (still there); force modelscope to see the 404 → url failover
    assert res.source.startswith("huggingface:")
    res = rotationzoo.fetch(MODEL, cache_dir=tmp_path / "c2", report=messages.append, revision="main")
    assert res.source == f"url:{zoo.server.raw_url(zoo.files['k'][0])}"
    assert any("EntryNotFound" in m or "404" in m for m in messages), messages


def test_every_source_down_gives_one_clear_error(zoo, no_backoff_sleep) -> None:
    zoo.server.arm_fault("/", "http500", count=1000)
    with pytest.raises(FetchError) as ei:
        rotationzoo.fetch(MODEL)
    msg = str(ei.value)
    assert "huggingface:" in msg and "modelscope:" in msg and "url:" in msg and "500" in msg


@pytest.mark.parametrize("source", ["huggingface", "modelscope", "url"])
def test_corrupt_once_is_detected_and_refetched(zoo, source, tmp_path) -> None:
    path, data = zoo.files["k"]
    zoo.server.arm_fault(path.rsplit("/", 1)[-1], "corrupt", count=1)
    messages = []
    res = rotationzoo.fetch(MODEL, source=source, report=messages.append)
    assert res.paths["k"].read_bytes() == data
    assert any("sha256 mismatch" in m and "downloading again" in m for m in messages), messages
    assert len(_file_gets(zoo.server, path.rsplit("/", 1)[-1])) >= 2
    bad = bytes(b ^ 0xFF for b in data)
    _assert_no_bad_copies(tmp_path, {hashlib.sha256(bad).hexdigest()})


@pytest.mark.parametrize("source", ["huggingface", "modelscope", "url"])
def test_corrupt_twice_raises_and_keeps_nothing(zoo, source, tmp_path) -> None:
    path, data = zoo.files["v"]
    zoo.server.arm_fault(path.rsplit("/", 1)[-1], "corrupt", count=2)
    with pytest.raises(IntegrityError) as ei:
        rotationzoo.fetch(MODEL, source=source)
    bad_sha = hashlib.sha256(bytes(b ^ 0xFF for b in data)).hexdigest()
    msg = str(ei.value)
    assert hashlib.sha256(data).hexdigest() in msg and bad_sha in msg and source in msg
    _assert_no_bad_copies(tmp_path, {bad_sha})
    assert not any(r.side == "v" for r in cache_records(zoo.cache))
    # the next call (no fault armed) recovers
    assert rotationzoo.fetch(MODEL, source=source).paths["v"].read_bytes() == data


@pytest.mark.parametrize("source", ["huggingface", "url"])
def test_truncated_body_recovers_or_fails_clearly(zoo, source) -> None:
    """A body cut short is never served: the Hugging Face client retries the download itself; the
    URL download is caught by the size check and downloaded again."""
    path, data = zoo.files["k"]
    zoo.server.clear_log()
    zoo.server.arm_fault(path.rsplit("/", 1)[-1], "truncate", count=1)
    messages: list[str] = []
    res = rotationzoo.fetch(MODEL, source=source, report=messages.append)
    assert res.paths["k"].read_bytes() == data
    gets = [e for e in zoo.server.requests("GET") if path.rsplit("/", 1)[-1] in e["target"]]
    assert gets[0]["fault"] == "truncate" and gets[0]["bytes"] < len(data)  # the fault was served
    if source == "huggingface":  # the client itself retries the download (resuming or from the start)
        assert gets[1]["fault"] is None and gets[1]["bytes"] + (gets[1]["range"] and gets[0]["bytes"] or 0) == len(data)
    else:  # rotationzoo's size check catches it and downloads again
        assert any("truncated or wrong file" in m and "downloading again" in m for m in messages), messages
        assert len(gets) == 2 and gets[1]["bytes"] == len(data)


def test_connection_reset_fails_over(zoo, no_backoff_sleep) -> None:
    zoo.server.arm_fault("/resolve/", "reset", count=20)
    res = rotationzoo.fetch(MODEL)
    assert res.source.startswith("modelscope:")


# -- cache behaviour -----------------------------------------------------------------------------


def test_warm_load_makes_no_request(zoo) -> None:
    # its speed is measured by tools/bench_client.py, not asserted here
    rotationzoo.load(MODEL)
    zoo.server.clear_log()
    pair = rotationzoo.load(MODEL)
    assert zoo.server.requests() == []
    assert pair.k.rotations.shape == (L, D, D)
    res = rotationzoo.fetch(MODEL)
    assert res.from_cache and zoo.server.requests() == []


def test_offline_warm_and_cold(zoo, monkeypatch, tmp_path) -> None:
    rotationzoo.fetch(MODEL)
    zoo.server.clear_log()
    monkeypatch.setenv("ROTATIONZOO_OFFLINE", "1")
    assert rotationzoo.load(MODEL).k.rotations.shape == (L, D, D)
    with pytest.raises(OfflineError) as ei:
        rotationzoo.fetch(MODEL, cache_dir=tmp_path / "empty")
    msg = str(ei.value)
    assert "k_rotation_qqt_r_h_pbr.pt" in msg and "v_rotation_sst_r_h_pbr.pt" in msg
    assert f"rotationzoo fetch --model {MODEL} --tag {TAG}" in msg and "ROTATIONZOO_OFFLINE" in msg
    monkeypatch.delenv("ROTATIONZOO_OFFLINE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="HF_HUB_OFFLINE"):
        rotationzoo.fetch(MODEL, cache_dir=tmp_path / "empty")
    for flag in ("force", "accept_new"):  # a warm cache: the flag is what cannot be done, nothing is missing
        with pytest.raises(OfflineError, match=f"--{flag.replace('_', '-')} downloads .* again") as ei:
            rotationzoo.fetch(MODEL, **{flag: True})
        assert "not cached" not in str(ei.value)
        assert rotationzoo.fetch("SmolLM2-135M-Instruct", **{flag: True}).paths["k"].is_file()  # bundled: no network
    assert zoo.server.requests() == []


def test_online_overrides_an_offline_variable_as_offline_false_does(zoo, monkeypatch, tmp_path, capsys) -> None:
    """--online is offline=False: the network is used where ROTATIONZOO_OFFLINE / HF_HUB_OFFLINE say offline; without
    either flag the variables decide, as offline=None."""
    for var in ("ROTATIONZOO_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
        cache = tmp_path / var
        assert main(["fetch", "--model", MODEL, "--cache-dir", str(cache)]) == 1
        assert var in capsys.readouterr().err
        assert main(["fetch", "--model", MODEL, "--cache-dir", str(cache), "--online", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["k"]["path"].startswith(str(cache)) and not got["from_cache"]
        assert rotationzoo.fetch(MODEL, cache_dir=tmp_path / f"{var}-py", offline=False).paths["k"].is_file()
        monkeypatch.delenv(var)


def test_changed_file_on_disk_is_not_served(zoo) -> None:
    res = rotationzoo.fetch(MODEL)
    p = res.paths["k"]
    data = bytearray(p.read_bytes())
    data[-10] ^= 0xFF
    p.write_bytes(bytes(data))  # size same, mtime changes: the marker no longer matches
    res2 = rotationzoo.fetch(MODEL)
    assert res2.paths["k"].read_bytes() == zoo.files["k"][1]
    assert not res2.from_cache  # re-fetched and re-verified (here from the client's own pinned cache)


def test_force_downloads_again(zoo) -> None:
    rotationzoo.fetch(MODEL)
    zoo.server.clear_log()
    rotationzoo.fetch(MODEL, force=True)
    assert len(_file_gets(zoo.server, "_rotation_")) == 2


def test_unpinned_entry_warns_once_and_records_sha(zoo) -> None:
    zoo.write_registry(pinned=False, model="acme/Tiny-Unpinned")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = rotationzoo.fetch("acme/Tiny-Unpinned")
        rotationzoo.fetch("acme/Tiny-Unpinned", force=True)
    unpinned = [w for w in caught if issubclass(w.category, UnpinnedEntryWarning)]
    assert len(unpinned) == 2  # once per file, not again on the second fetch
    assert res.sha256["k"] in str(unpinned[0].message)
    recs = {r.side: r for r in cache_records(zoo.cache)}
    assert recs["k"].sha256 == hashlib.sha256(zoo.files["k"][1]).hexdigest()


def test_unpinned_invalid_file_is_rejected(zoo, tmp_path) -> None:
    """Without a sha256, structure is the only check: a non-rotation file never enters the cache."""
    path, _ = zoo.files["k"]
    zoo.server.commit_files(REPO_ID, {path: b"PK\x03\x04" + b"\0" * 200})
    zoo.write_registry(pinned=False, model="acme/Tiny-Unpinned")
    with pytest.raises(IntegrityError, match="not a valid rotation file"):
        rotationzoo.fetch("acme/Tiny-Unpinned", source="modelscope")
    assert not cache_records(zoo.cache)


def test_eight_processes_one_download(zoo, tmp_path) -> None:
    code = (
        "import json, rotationzoo;"
        f"r = rotationzoo.fetch({MODEL!r});"
        "print(json.dumps({s: [str(r.paths[s]), r.sha256[s]] for s in 'kv'}))"
    )
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(8)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o == outs[0] for o in outs)
    for side in "kv":
        name = zoo.files[side][0].rsplit("/", 1)[-1]
        assert len(_file_gets(zoo.server, name)) == 1, _file_gets(zoo.server, name)


def test_cache_verify_and_rm(zoo, capsys) -> None:
    res = rotationzoo.fetch(MODEL)
    assert all(r.ok for r in verify_cache(zoo.cache))
    p = res.paths["v"]
    data = bytearray(p.read_bytes())
    data[100] ^= 1
    st = p.stat()
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size and mtime: only a re-hash sees it
    assert main(["cache", "verify", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["bad"] == 1 and out["removed"] == 1 and not p.exists()
    assert main(["cache", "ls", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["files"]
    assert [f["side"] for f in listed] == ["k"]
    assert main(["cache", "rm", "--model", "tiny-lm", "--yes", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["removed"]) >= 1
    assert cache_records(zoo.cache) == []


def test_a_hub_clients_unfinished_download_is_listed_and_removed_once_left_alone(zoo, capsys) -> None:
    """A process killed during a Hugging Face download leaves ``blobs/<sha>.<rand>.incomplete``: `cache ls`
    shows it, `cache verify` removes it once it has not been written for an hour (a live one is kept)."""
    rotationzoo.fetch(MODEL, source="huggingface")
    blobs = next((zoo.cache / "hub" / "huggingface").glob("models--*/blobs"))
    fresh, stale = blobs / ("a" * 64 + ".1.incomplete"), blobs / ("b" * 64 + ".2.incomplete")
    fresh.write_bytes(b"x" * 10)
    stale.write_bytes(b"y" * 20)
    hour_ago = time.time() - 3601
    os.utime(stale, (hour_ago, hour_ago))
    assert main(["cache", "ls", "--json"]) == 0
    listed = {Path(f["path"]).name: f for f in json.loads(capsys.readouterr().out)["files"]}
    assert listed[fresh.name]["area"] == listed[stale.name]["area"] == "partial"
    assert main(["cache", "verify", "--json"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["bad"] == 2 and got["removed"] == 1  # the live one is reported, not removed
    assert fresh.exists() and not stale.exists()
    stale.write_bytes(b"y")
    os.utime(stale, (hour_ago, hour_ago))
    assert main(["cache", "verify"]) == 1
    lines = {line.split(": ", 1)[0].rsplit("/", 1)[-1]: line for line in capsys.readouterr().out.splitlines()}
    assert lines[fresh.name].endswith("(kept)") and lines[stale.name].endswith("(removed)")
    assert "(removed) (removed)" not in lines[stale.name]
    assert rotationzoo.fetch(MODEL, source="huggingface", offline=True).from_cache  # the verified files stay


def test_a_modelscope_fetch_writes_nothing_into_the_home_folder(zoo, tmp_path, monkeypatch) -> None:
    """The ModelScope client keeps an install id and creates its folders in ~/.modelscope and
    ~/.cache/modelscope on first use: for a user with no ModelScope config of their own they go into
    the cache, and the client's config is the one before afterwards."""
    from modelscope_hub.config import get_default_config

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("MODELSCOPE_HOME", "MODELSCOPE_CREDENTIALS_PATH", "MODELSCOPE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    before = get_default_config()
    res = rotationzoo.fetch(MODEL, source="modelscope")
    assert res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert list(home.rglob("*")) == []
    assert list((zoo.cache / "hub" / "modelscope").rglob("session"))  # where the client's id went
    assert get_default_config() is before


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_fetch_json_through_hf_endpoint(zoo, tmp_path) -> None:
    """`rotationzoo fetch --model … --json` as a user runs it: HF_ENDPOINT + a pinning registry."""
    env = {**os.environ, "HF_ENDPOINT": zoo.server.url, "ROTATIONZOO_CACHE": str(tmp_path / "cli-cache")}
    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", "--model", "Tiny-LM",
                        "--source", "huggingface", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["model"] == MODEL and out["tag"] == TAG and out["source"].startswith("huggingface:")
    for side in "kv":
        assert Path(out[side]["path"]).read_bytes() == zoo.files[side][1]
        assert out[side]["sha256"] == hashlib.sha256(zoo.files[side][1]).hexdigest()
    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", "--model", "Tiny-LM"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == [out["k"]["path"], out["v"]["path"]]


def test_cli_fetch_errors(zoo, capsys) -> None:
    assert main(["fetch", "--model", "Tiny-LM", "--source", "ftp"]) == 2
    assert "Invalid value for '--source'" in capsys.readouterr().err
    assert main(["fetch", "--model", "Tiny-LM", "--offline", "--cache-dir", "/nonexistent-rz"]) == 1
    assert "rotationzoo fetch --model acme/Tiny-LM" in capsys.readouterr().err


def test_cli_fetch_is_quiet_when_not_a_terminal(zoo, tmp_path) -> None:
    """Piped output carries no client progress bars: stdout is JSON, stderr is empty."""
    for source in ("modelscope", "huggingface", "url"):
        env = {**os.environ, "MODELSCOPE_ENDPOINT": zoo.server.url, "HF_ENDPOINT": zoo.server.url,
               "ROTATIONZOO_CACHE": str(tmp_path / f"quiet-{source}")}
        r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", "--model", "Tiny-LM",
                            "--source", source, "--json"], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["source"].startswith(source)
        assert r.stderr == "", r.stderr


def test_a_hub_declaring_another_sha256_is_passed_over_before_downloading(zoo, tmp_path) -> None:
    """Hugging Face declares an LFS file's sha256 (X-Linked-Etag): another sha256 than the registry's moves
    on to the next source without downloading, as a ModelScope listing's does."""
    wrong = {s: bytes(b ^ 0xFF for b in zoo.files[s][1]) for s in "kv"}  # the same size, other bytes
    evil = zoo.server.commit_files("evil/RotationZoo", {zoo.files[s][0]: wrong[s] for s in "kv"})
    path = zoo.write_registry()
    reg = json.loads(path.read_text())
    for f in reg["models"][0]["tags"][TAG]["files"].values():
        f["sources"][0].update(repo="evil/RotationZoo", revision=evil)
    path.write_text(json.dumps(reg))
    messages: list[str] = []
    res = rotationzoo.fetch(MODEL, report=messages.append)
    assert res.source.startswith("modelscope:") and res.paths["k"].read_bytes() == zoo.files["k"][1]
    assert any("huggingface" in m and "lists sha256" in m and "trying modelscope" in m for m in messages), messages
    assert not [r for r in zoo.server.requests("GET") if "evil" in r["target"]]  # nothing downloaded from it
