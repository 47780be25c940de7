"""Trust on first use: pins keyed by source and revision, warm hits pinned too, and a pin file that is
read defensively (malformed entries, deep JSON, devices, FIFOs, huge files) and written or named."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, REPO_ID, TAG, zoo  # noqa: F401  (fixture)

import rotationzoo
from rotationzoo import RotationSet, write_rotation
from rotationzoo.cli.main import main
from rotationzoo.errors import ConfigError, IntegrityError
from rotationzoo.hub import entry_dir, record_verified
from rotationzoo.hub.pins import local_pins, read_pins
from rotationzoo.registry import get_entry

pytestmark = pytest.mark.filterwarnings("ignore::rotationzoo.hub.UnpinnedEntryWarning")

K_PATH = f"Tiny-LM/{TAG}/k_rotation_qqt_r_h_pbr.pt"
V_PATH = f"Tiny-LM/{TAG}/v_rotation_sst_r_h_pbr.pt"


def _other_pair(tmp_path: Path, seed: int) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for side, obj in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        q = torch.linalg.qr(torch.randn(4, 16, 16, generator=g))[0]
        out[side] = write_rotation(tmp_path / f"{side}-{seed}.pt", RotationSet(q, range(4), obj)).read_bytes()
    return out


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def unpinned(zoo):
    zoo.write_registry(pinned=False)
    return zoo


def test_another_revision_is_another_first_use(unpinned, tmp_path) -> None:
    zoo = unpinned
    first = rotationzoo.fetch(MODEL, source="huggingface")
    new = _other_pair(tmp_path, 5)
    commit2 = zoo.server.commit_files(REPO_ID, {K_PATH: new["k"], V_PATH: new["v"]})
    second = rotationzoo.fetch(MODEL, source="huggingface", revision=commit2)
    assert second.sha256["k"] == _sha(new["k"]) != first.sha256["k"]
    labels = set(local_pins(get_entry(MODEL), "k"))
    assert labels == {f"huggingface:{REPO_ID}@{zoo.commit}", f"huggingface:{REPO_ID}@{commit2}"}
    # each revision keeps its own pin: the default revision's copy is still served, from the cache
    assert rotationzoo.fetch(MODEL, source="huggingface").from_cache
    again = rotationzoo.fetch(MODEL, source="huggingface", revision=commit2, accept_new=True)
    assert again.sha256 == second.sha256
    default = rotationzoo.fetch(MODEL, source="huggingface")
    assert default.from_cache and default.sha256 == first.sha256


def test_a_pin_the_reader_would_refuse_is_never_written(unpinned, tmp_path) -> None:
    """A hub's over-long or multi-line commit is dropped from the pin, and a source label no pin can hold is
    refused before writing: the pin file stays readable, with every pin it had."""
    from rotationzoo.hub.pins import MAX_LABEL, check_or_pin

    rotationzoo.fetch(MODEL, source="huggingface")
    before = read_pins()
    entry, sha = get_entry(MODEL), "ab" * 32
    assert check_or_pin(entry, "k", sha, source="url:https://x.invalid/k.pt", commit="c" * (MAX_LABEL + 1)) == "new"
    assert check_or_pin(entry, "v", sha, source="url:https://x.invalid/v.pt", revision="a\nb") == "new"
    with pytest.raises(ConfigError, match="no local pin can record it"):
        check_or_pin(entry, "k", sha, source="url:https://x.invalid/" + "k" * MAX_LABEL)
    pins = read_pins()
    assert set(before) < set(pins) and len(pins) == len(before) + 2
    assert pins[f"{MODEL}:{entry.name}:k|url:https://x.invalid/k.pt"]["commit"] is None
    assert pins[f"{MODEL}:{entry.name}:v|url:https://x.invalid/v.pt"]["revision"] is None


def test_a_change_under_the_same_source_and_revision_is_refused(unpinned, tmp_path) -> None:
    zoo = unpinned
    rotationzoo.fetch(MODEL, source="modelscope")
    new = _other_pair(tmp_path, 6)
    zoo.server.commit_files(REPO_ID, {K_PATH: new["k"], V_PATH: new["v"]})  # master moves
    with pytest.raises(IntegrityError, match=f"from modelscope:{REPO_ID}@master changed since it was first used"):
        rotationzoo.fetch(MODEL, source="modelscope", cache_dir=tmp_path / "fresh")


def test_a_warm_hit_without_a_pin_is_validated_and_pinned(unpinned, tmp_path, monkeypatch) -> None:
    """A shared cache filled under another pin file: the first hit pins what it serves, and a copy
    rewritten later (bytes and marker) is not served."""
    rotationzoo.fetch(MODEL, source="modelscope")
    monkeypatch.setenv("ROTATIONZOO_PINS", str(tmp_path / "other-user-pins.json"))
    entry = get_entry(MODEL)
    assert local_pins(entry, "k") == {}
    hit = rotationzoo.fetch(MODEL, offline=True)
    assert hit.from_cache
    assert local_pins(entry, "k")[f"modelscope:{REPO_ID}@master"]["sha256"] == hit.sha256["k"]
    # someone with write access to the cache swaps K for another valid file and rewrites its marker
    other = _other_pair(tmp_path, 7)["k"]
    k = entry_dir(unpinned.cache, entry) / "k_rotation_qqt_r_h_pbr.pt"
    k.write_bytes(other)
    record_verified(k, entry, "k", sha=_sha(other), source=f"modelscope:{REPO_ID}@master")
    with pytest.raises(rotationzoo.errors.OfflineError):
        rotationzoo.fetch(MODEL, offline=True)  # not a hit any more
    assert rotationzoo.fetch(MODEL, source="modelscope").sha256["k"] == hit.sha256["k"]


def test_a_warm_copy_that_is_not_a_rotation_file_is_not_pinned(unpinned, tmp_path, monkeypatch) -> None:
    rotationzoo.fetch(MODEL, source="modelscope")
    entry = get_entry(MODEL)
    k = entry_dir(unpinned.cache, entry) / "k_rotation_qqt_r_h_pbr.pt"
    k.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    record_verified(k, entry, "k", sha=_sha(k.read_bytes()), source="url:https://example.invalid/k.pt")
    monkeypatch.setenv("ROTATIONZOO_PINS", str(tmp_path / "fresh-pins.json"))
    with pytest.raises(rotationzoo.errors.OfflineError):
        rotationzoo.fetch(MODEL, offline=True)
    assert "url:https://example.invalid/k.pt" not in local_pins(entry, "k")


@pytest.mark.parametrize("entry_value", [{"sha256": "ABC"}, {"sha256": "0" * 64, "source": 5}, "x",
                                         {"sha256": "0" * 64, "source": "a\nb"}, {}])
def test_a_malformed_pin_entry_is_a_typed_error(unpinned, tmp_path, capsys, entry_value) -> None:
    pins = Path(os.environ["ROTATIONZOO_PINS"])
    key = f"{MODEL}:{TAG}:k|modelscope:{REPO_ID}@master"
    pins.write_text(json.dumps({"pins_version": 2, "pins": {key: entry_value}}))
    with pytest.raises(ConfigError, match=f"{pins}: pin .*fix or delete the pin file"):
        rotationzoo.fetch(MODEL, source="modelscope")
    assert main(["fetch", MODEL, "--source", "modelscope"]) == 1
    err = capsys.readouterr().err
    assert "pin" in err and len(err.strip().splitlines()) == 1
    assert pins.read_text().count("pins_version") == 1 and json.loads(pins.read_text())["pins"][key] == entry_value


def _bounded(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"pins-{kind}.json"
    if kind == "deep":
        p.write_text('{"pins_version": 2, "pins": ' + "[" * 200_000 + "]" * 200_000 + "}")
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(5 << 20)
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "dev":
        p = Path("/dev/zero")
    elif kind == "folder":
        p.mkdir()
    elif kind == "binary":
        p.write_bytes(b"\xff\xfe{" + b"\0" * 10)
    return p


@pytest.mark.parametrize("kind", ["deep", "huge", "fifo", "dev", "folder", "binary"])
def test_the_pin_file_is_read_with_bounds(tmp_path, kind) -> None:
    path = _bounded(tmp_path, kind)
    code = ("import sys; from pathlib import Path; from rotationzoo.hub.pins import read_pins\n"
            "from rotationzoo.errors import ConfigError\n"
            "try:\n    read_pins(Path(sys.argv[1]))\nexcept ConfigError as e:\n    print('ConfigError', e)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.startswith("ConfigError"), r.stdout + r.stderr
    assert str(path) in r.stdout and time.monotonic() - t0 < 20


def test_a_failed_pin_write_names_the_pin_file(unpinned, tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("ROTATIONZOO_PINS", str(blocker / "pins.json"))
    with pytest.raises(ConfigError, match=f"cannot write the pin file {blocker / 'pins.json'}"):
        rotationzoo.fetch(MODEL, source="modelscope")


def test_a_version_1_pin_file_is_read_and_upgraded(unpinned, tmp_path) -> None:
    zoo = unpinned
    pins = Path(os.environ["ROTATIONZOO_PINS"])
    label = f"modelscope:{REPO_ID}@master"
    v1 = {"pins_version": 1, "pins": {f"{MODEL}:{TAG}:{s}": {"sha256": _sha(zoo.files[s][1]), "source": label,
                                                           "revision": "master", "commit": None,
                                                           "pinned_at": "2026-05-01T00:00:00Z"} for s in "kv"}}
    pins.write_text(json.dumps(v1))
    assert set(read_pins()) == {f"{MODEL}:{TAG}:{s}|{label}" for s in "kv"}
    new = _other_pair(tmp_path, 8)
    zoo.server.commit_files(REPO_ID, {K_PATH: new["k"], V_PATH: new["v"]})
    with pytest.raises(IntegrityError, match="changed since it was first used"):
        rotationzoo.fetch(MODEL, source="modelscope")  # the v1 pin still protects
    rotationzoo.fetch(MODEL, source="huggingface")  # another source: a first use, written as v2
    data = json.loads(pins.read_text())
    assert data["pins_version"] == 2 and all("|" in k for k in data["pins"]) and len(data["pins"]) == 4


def test_a_moved_branch_is_downloaded_again_never_answered_from_the_clients_copy(unpinned, tmp_path) -> None:
    """ModelScope's client answers from its own copy of a branch's file: with --force (or a copy gone from
    the cache) the bytes come from the hub at the branch's head, so a moved branch is seen (and refused
    against the pin until accepted), never the old bytes recorded against the new commit."""
    zoo = unpinned
    first = rotationzoo.fetch(MODEL, source="modelscope")
    new = _other_pair(tmp_path, 8)
    zoo.server.commit_files(REPO_ID, {K_PATH: new["k"], V_PATH: new["v"]})  # master moves
    with pytest.raises(IntegrityError, match="changed since it was first used"):
        rotationzoo.fetch(MODEL, source="modelscope", force=True)
    assert rotationzoo.fetch(MODEL, source="modelscope").sha256 == first.sha256  # the verified copy stays
    got = rotationzoo.fetch(MODEL, source="modelscope", accept_new=True)
    assert got.sha256["k"] == _sha(new["k"]) and got.paths["k"].read_bytes() == new["k"]


@pytest.mark.parametrize("source, branch", [("huggingface", "main"), ("modelscope", "master")])
def test_bytes_refused_by_the_pin_are_kept_nowhere(unpinned, tmp_path, source, branch) -> None:
    import shutil

    from test_fetch import _assert_no_bad_copies

    zoo = unpinned
    rotationzoo.fetch(MODEL, source=source, revision=branch)
    new = _other_pair(tmp_path, 9)
    zoo.server.commit_files(REPO_ID, {K_PATH: new["k"], V_PATH: new["v"]})  # the branch moves
    shutil.rmtree(zoo.cache / "files")  # the verified copies gone (cache rm --model, say)
    with pytest.raises(IntegrityError, match="changed since it was first used"):
        rotationzoo.fetch(MODEL, source=source, revision=branch)
    _assert_no_bad_copies(zoo.cache, {_sha(new["k"]), _sha(new["v"])})
