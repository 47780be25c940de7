"""No hangs: a FIFO, a device or a /proc file where rotationzoo expects a regular file (a cache marker,
a cached file, the pin file, a lock file, a model, a text) is refused by its type in milliseconds with
one typed line, or treated as a bad marker and verified again; a lock held elsewhere is waited on for
a bounded time; a lock file that cannot be created is an error at once."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest
from helpers import run_cli
from hubserver import fresh_probe_memory, hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, zoo  # noqa: F401  (fixture)

import rotationzoo
from rotationzoo import safefile
from rotationzoo.errors import CacheError, ConfigError, ModelLoadError, OfflineError, RotationFileError
from rotationzoo.hub import read_marker
from rotationzoo.hub.layout import marker_path

# a hang fails the test instead of the run
pytestmark = [pytest.mark.timeout(20), pytest.mark.usefixtures("fresh_probe_memory")]
FAST = 5.0  # seconds: every refusal here is due well within this


def _cli(capsys, *argv: str) -> tuple[int, str, str, float]:
    """:func:`helpers.run_cli` and how long it took."""
    t0 = time.monotonic()
    code, out, err = run_cli(capsys, *argv)
    return code, out, err, time.monotonic() - t0


def _fifo_marker(zoo) -> Path:
    """Fetch the pair, then put a FIFO in place of the K file's ``.verified`` marker."""
    k = rotationzoo.fetch(MODEL).paths["k"]
    mp = marker_path(k)
    mp.unlink()
    os.mkfifo(mp)
    return k


@pytest.fixture
def zoo64(zoo, tmp_path, monkeypatch):
    """The zoo with a second model whose rotations have a head_dim the INT2 kernels serve (64)."""
    import hashlib
    import json

    import torch
    from helpers import random_orthogonal

    from rotationzoo import RotationSet, write_rotation

    files = {}
    for side, obj, seed in (("k", "qqt_r_h_pbr", 3), ("v", "sst_r_h_pbr", 4)):
        p = write_rotation(tmp_path / "src64" / f"{side}_rotation_{obj}.pt",
                           RotationSet(random_orthogonal(2, 64, seed), range(2), obj, torch.rand(2, 64)))
        files[side] = (f"Tiny-64/t/{p.name}", p.read_bytes())
    commit = zoo.server.commit_files("zoo/RotationZoo", {path: data for path, data in files.values()})
    entry = {s: {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                 "sources": [{"type": "huggingface", "repo": "zoo/RotationZoo", "revision": commit}]}
             for s, (path, data) in files.items()}
    reg = {"registry_version": 1, "models": [{
        "id": "acme/Tiny-64", "aliases": ["Tiny-64"],
        "architecture": {"num_layers": 2, "head_dim": 64, "num_kv_heads": 2},
        "default_tag": "t",
        "tags": {"t": {"objectives": {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"}, "serving": {"group_size": 64},
                       "files": entry}}}]}
    path = tmp_path / "registry-64.json"
    path.write_text(json.dumps(reg))
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(path))
    return "acme/Tiny-64"


def _one_line_or_ok(code: int, err: str) -> None:
    if code != 0:
        lines = [line for line in err.strip().splitlines() if line.startswith("error")]
        assert len(lines) == 1 and len(err.strip().splitlines()) == 1, err


# -- a FIFO planted as a .verified marker --------------------------------------------------------


@pytest.mark.parametrize("argv", [("cache", "ls"), ("cache", "ls", "--json"), ("cache", "verify"),
                                  ("cache", "rm", "--model", MODEL, "--dry-run"), ("fetch", MODEL),
                                  ("fetch", MODEL, "--offline")], ids=" ".join)
def test_a_fifo_marker_never_blocks_the_cli(zoo, capsys, argv) -> None:
    k = _fifo_marker(zoo)
    code, out, err, elapsed = _cli(capsys, *argv)
    assert elapsed < FAST, elapsed
    if argv[:2] != ("cache", "verify"):  # exit 1 there is its report of a bad file, not an error
        _one_line_or_ok(code, err)
    if argv == ("fetch", MODEL):  # the marker was bad: the file was downloaded and verified again
        assert code == 0 and read_marker(k) is not None and marker_path(k).is_file()
    if argv[-1] == "--offline":
        assert code == 1 and "offline mode" in err
    if argv == ("cache", "verify"):
        assert code == 1 and "its marker is a FIFO" in out and not k.exists()
    if argv == ("cache", "ls", "--json"):
        import json

        got = {Path(f["path"]).name: f for f in json.loads(out)["files"]}
        assert "a FIFO" in got[k.name]["problem"] and got[k.name]["sha256"] is None


def test_a_fifo_marker_never_blocks_load_and_is_replaced(zoo) -> None:
    k = _fifo_marker(zoo)
    t0 = time.monotonic()
    pair = rotationzoo.load(MODEL)
    assert time.monotonic() - t0 < FAST
    assert pair.paths["k"] == k and marker_path(k).is_file() and read_marker(k)["sha256"] == pair.sha256["k"]


def test_a_fifo_marker_never_blocks_load_offline(zoo) -> None:
    _fifo_marker(zoo)
    t0 = time.monotonic()
    with pytest.raises(OfflineError):
        rotationzoo.load(MODEL, offline=True)
    assert time.monotonic() - t0 < FAST


def test_a_fifo_marker_never_blocks_serve_args(zoo64, capsys) -> None:
    k = rotationzoo.fetch(zoo64).paths["k"]
    marker_path(k).unlink()
    os.mkfifo(marker_path(k))
    code, out, err, elapsed = _cli(capsys, "serve-args", zoo64)
    assert elapsed < FAST and code == 0, err
    assert f"SGLANG_OSCAR_K_ROTATION_PATH={k}" in out and marker_path(k).is_file()


def test_read_marker_never_opens_a_fifo(tmp_path) -> None:
    f = tmp_path / "k.pt"
    f.write_bytes(b"x")
    os.mkfifo(marker_path(f))
    t0 = time.monotonic()
    assert read_marker(f) is None
    assert time.monotonic() - t0 < 1


def test_a_cached_file_swapped_for_a_fifo_is_not_a_hit(zoo) -> None:
    k = rotationzoo.fetch(MODEL).paths["k"]
    k.unlink()
    os.mkfifo(k)
    t0 = time.monotonic()
    res = rotationzoo.fetch(MODEL)  # downloaded again, the FIFO replaced by the verified file
    assert time.monotonic() - t0 < FAST
    assert not res.from_cache and k.is_file() and k.read_bytes() == zoo.files["k"][1]


# -- the pin file and its lock -------------------------------------------------------------------


@pytest.mark.parametrize("pins", ["/proc/version", "fifo", "/dev/null"])
def test_a_pin_file_that_is_not_a_regular_file_fails_fetch_at_once(zoo, capsys, monkeypatch, tmp_path, pins) -> None:
    zoo.write_registry(pinned=False)  # the pin file is read for unpinned files only
    if pins == "fifo":
        pins = str(tmp_path / "pins-fifo.json")
        os.mkfifo(pins)
    monkeypatch.setenv("ROTATIONZOO_PINS", pins)
    code, _, err, elapsed = _cli(capsys, "fetch", MODEL)
    assert elapsed < FAST, elapsed
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert pins in err and "not a regular file" in err and "ROTATIONZOO_PINS" in err


def test_pins_in_proc_fail_the_cli_in_well_under_five_seconds(zoo, monkeypatch) -> None:
    """``ROTATIONZOO_PINS=/proc/version rotationzoo fetch …``, interpreter start included: the pin file
    is checked before anything is downloaded or validated."""
    import subprocess
    import sys

    if not Path("/proc/version").exists():
        pytest.skip("no /proc here")
    zoo.write_registry(pinned=False)
    env = {**os.environ, "ROTATIONZOO_PINS": "/proc/version"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "fetch", MODEL], capture_output=True,
                       text=True, timeout=60, env=env)
    assert time.monotonic() - t0 < FAST
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "/proc/version: a /proc pseudo-file, not a regular file" in r.stderr


@pytest.mark.parametrize("where", ["folder", "proc"])
def test_a_pin_lock_that_cannot_be_created_fails_at_once(zoo, monkeypatch, tmp_path, where) -> None:
    """The pin file reads as absent but its lock cannot be created (a folder in its place, or a pin
    file named in /proc, where nothing can be created): an error at once, not a retry loop."""
    zoo.write_registry(pinned=False)
    pins = tmp_path / "pins.json"
    if where == "folder":
        (tmp_path / "pins.json.lock").mkdir()
    else:
        pins = Path("/proc/rotationzoo-no-such-pins.json")
        if not Path("/proc/version").exists():
            pytest.skip("no /proc here")
    monkeypatch.setenv("ROTATIONZOO_PINS", str(pins))
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="lock file") as info:
        rotationzoo.fetch(MODEL)
    assert time.monotonic() - t0 < FAST
    assert "\n" not in str(info.value)


def test_a_pin_lock_held_elsewhere_is_waited_on_for_a_bounded_time(zoo, monkeypatch, tmp_path) -> None:
    import fcntl

    from rotationzoo.hub import pins as pins_module

    zoo.write_registry(pinned=False)
    monkeypatch.setattr(pins_module, "LOCK_WAIT_S", 0.5)
    pins = tmp_path / "pins.json"
    monkeypatch.setenv("ROTATIONZOO_PINS", str(pins))
    fd = os.open(tmp_path / "pins.json.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process pinning, forever
    try:
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match="locked by another process"):
            rotationzoo.fetch(MODEL)
        assert 0.4 < time.monotonic() - t0 < FAST
    finally:
        os.close(fd)


def test_an_entry_lock_held_elsewhere_is_waited_on_for_a_bounded_time(zoo, monkeypatch) -> None:
    import fcntl

    from rotationzoo.hub import fetch as fetch_module
    from rotationzoo.hub.layout import lock_path
    from rotationzoo.registry import get_entry

    monkeypatch.setattr(fetch_module, "LOCK_WAIT_S", 0.5)
    lp = lock_path(zoo.cache, get_entry(MODEL))
    lp.parent.mkdir(parents=True)
    fd = os.open(lp, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process downloading, forever
    try:
        t0 = time.monotonic()
        with pytest.raises(CacheError, match="locked by another process") as ei:
            rotationzoo.fetch(MODEL)
        assert 0.4 < time.monotonic() - t0 < FAST
        assert "writable" not in str(ei.value)  # a busy lock, not a folder to change
    finally:
        os.close(fd)
    assert rotationzoo.fetch(MODEL).paths["k"].is_file()  # released: the next fetch works


def test_an_entry_lock_that_is_a_fifo_fails_at_once(zoo) -> None:
    from rotationzoo.hub.layout import lock_path
    from rotationzoo.registry import get_entry

    lp = lock_path(zoo.cache, get_entry(MODEL))
    lp.parent.mkdir(parents=True)
    os.mkfifo(lp)
    t0 = time.monotonic()
    with pytest.raises(CacheError, match="a FIFO, not a regular file"):
        rotationzoo.fetch(MODEL)
    assert time.monotonic() - t0 < FAST


# -- the one helper ------------------------------------------------------------------------------


@pytest.fixture(params=["fifo", "socket", "folder", "/dev/null", "/dev/zero", "/proc/version", "/proc/self/status"])
def not_regular(request, tmp_path) -> str:
    kind = request.param
    if kind.startswith("/"):
        if not os.path.exists(kind):
            pytest.skip(f"{kind} does not exist here")
        return kind
    p = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "folder":
        p.mkdir()
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        request.addfinalizer(s.close)
    return str(p)


def test_safefile_refuses_by_type_without_blocking(not_regular, tmp_path) -> None:
    link = tmp_path / "link"
    link.symlink_to(not_regular)
    for path in (not_regular, str(link)):  # behind a link too
        t0 = time.monotonic()
        with pytest.raises(CacheError, match="not a regular file"):
            safefile.check_regular(path, what="marker", error=CacheError)
        with pytest.raises(CacheError, match="not a regular file"):
            safefile.open_regular(path, what="marker", error=CacheError)
        with pytest.raises(RotationFileError, match="not a regular file"):
            rotationzoo.hashing.sha256_file(path)
        with pytest.raises(RotationFileError):
            rotationzoo.read_rotation(path)
        assert time.monotonic() - t0 < 1


def test_open_regular_checks_the_descriptor_too(tmp_path, monkeypatch) -> None:
    """A FIFO swapped in between the check and the open is refused after the open, never waited on."""
    fifo = tmp_path / "swapped"
    os.mkfifo(fifo)
    monkeypatch.setattr(safefile, "check_regular", lambda *a, **k: None)  # the check saw a regular file
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="a FIFO, not a regular file"):
        safefile.open_regular(fifo, what="pin file")
    assert time.monotonic() - t0 < 1


def test_safefile_reads_regular_files(tmp_path) -> None:
    p = tmp_path / "f.json"
    p.write_bytes(b"{}")
    assert safefile.read_regular(p, 10) == b"{}"
    with pytest.raises(ConfigError, match="more than the 1 B"):
        safefile.read_regular(p, 1)
    link = tmp_path / "link.json"
    link.symlink_to(p)
    assert safefile.read_regular(link, 10) == b"{}"  # a link to a regular file is fine unless refused
    with pytest.raises(ConfigError, match="a symlink, not a regular file"):
        safefile.open_regular(link, follow_symlinks=False)


# -- models and texts ----------------------------------------------------------------------------


def test_check_model_files_refuses_what_is_not_a_regular_file(not_regular, tmp_path) -> None:
    t0 = time.monotonic()
    if not os.path.isdir(not_regular):
        with pytest.raises(ModelLoadError, match="not a regular file") as info:
            safefile.check_model_files(not_regular, option="--model")
        assert str(info.value).startswith("--model ") and "\n" not in str(info.value)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert safefile.check_model_files(folder) == folder
    (folder / "model.safetensors").symlink_to(not_regular)
    if not os.path.isdir(not_regular):
        with pytest.raises(ModelLoadError, match="model.safetensors"):
            safefile.check_model_files(folder, option="--keep-model")
    assert time.monotonic() - t0 < 1


def test_check_model_files_accepts_a_gguf_file_and_says_when_missing(tmp_path) -> None:
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + b"\0" * 60)
    assert safefile.check_model_files(g) == g
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        safefile.check_model_files(tmp_path / "missing.gguf")


def test_a_proc_file_as_a_text_is_refused_by_type() -> None:
    pytest.importorskip("transformers")
    from rotationzoo.integrations.transformers.texts import check_text_files

    with pytest.raises(ConfigError, match="/proc pseudo-file"):
        check_text_files(["/proc/version"], option="--text")


def test_a_proc_file_in_a_dump_is_refused_by_type() -> None:
    from rotationzoo.errors import DumpError
    from rotationzoo.fit.dump_schema import check_regular, open_regular

    if not Path("/proc/version").exists():
        pytest.skip("no /proc here")
    for check in (check_regular, open_regular):
        with pytest.raises(DumpError, match=r"not a regular file \(a /proc pseudo-file\)"):
            check(Path("layer_0/k/0.pt"), "/proc/version")


def test_a_fifo_as_the_manifest_of_a_pair_folder_never_blocks_load(tmp_path) -> None:
    import torch
    from helpers import random_orthogonal

    from rotationzoo import RotationSet, write_rotation
    from rotationzoo.fit.output import MANIFEST_NAME

    for side, obj, seed in (("k", "qqt_r_h_pbr", 1), ("v", "sst_r_h_pbr", 2)):
        write_rotation(tmp_path / "pair" / f"{side}_rotation_{obj}.pt",
                       RotationSet(random_orthogonal(2, 16, seed), range(2), obj, torch.rand(2, 16)))
    os.mkfifo(tmp_path / "pair" / MANIFEST_NAME)
    t0 = time.monotonic()
    pair = rotationzoo.load(tmp_path / "pair")
    assert time.monotonic() - t0 < FAST and pair.layer_ids == (0, 1)


def test_a_fifo_in_a_model_subfolder_never_blocks_the_loader(tmp_path) -> None:
    """A model's index may name weights in a subfolder: a FIFO there is refused before any loader opens it."""
    from rotationzoo.errors import ModelLoadError
    from rotationzoo.safefile import MAX_MODEL_DEPTH, check_model_files

    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "sub/pipe.safetensors"}}))
    os.mkfifo(model / "sub" / "pipe.safetensors")
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=r"sub/pipe.safetensors: a FIFO"):
        check_model_files(model)
    assert time.monotonic() - t0 < FAST
    deep = tmp_path / "deep"
    (deep.joinpath(*["d"] * (MAX_MODEL_DEPTH + 1))).mkdir(parents=True)
    with pytest.raises(ModelLoadError, match="nested more than"):
        check_model_files(deep)
