"""The cache keeps only the bytes it checked: ``cache import`` and ``fetch`` copy first, then read,
validate and hash the copy, write its marker from that hash and only then move it into place. A
source that changes while it is imported is never kept as verified, a K and a V of different
provenance are refused unless the user says so, and a download that fails its pin never touches the
valid copy already cached."""

from __future__ import annotations

import hashlib
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from test_calibrated import calibration_folder
from test_fetch import MODEL, zoo  # noqa: F401  (fixture)

import layouts
import rotationzoo
from rotationzoo.files import calibrated
from rotationzoo.files.calibrated import import_calibrated
from rotationzoo.cli.main import main
from rotationzoo.errors import IntegrityError, InvalidRotationError, PairError, RotationZooError
from rotationzoo.hub import read_marker, verify_cache
from rotationzoo.files.validation import validate

pytestmark = pytest.mark.timeout(60)

K_NAME = "k_rotation_qqt_r_h_pbr.pt"


def _bad_k(folder: Path) -> Path:
    """A K file with the same layout, calibration and generation id as the good one, not orthogonal."""
    obj = layouts.v1(seed=0, with_calibration=True)
    for layer in obj["layers"].values():
        layer["rotation"] = layer["rotation"] * 1.5
    p = folder / "bad-k.pt"
    torch.save(obj, p)
    return p


def _kept_is_verified(folder: Path) -> None:
    """Every file kept under ``folder`` validates and its marker records exactly its bytes."""
    for name in (K_NAME, "v_rotation_sst_r_h_pbr.pt"):
        p = folder / name
        marker = read_marker(p)
        assert marker is not None and marker["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert marker["size"] == p.stat().st_size
        validate(rotationzoo.read_rotation(p))


def test_a_source_swapped_during_the_copy_is_never_kept(tmp_path, cache_dir, monkeypatch) -> None:
    """The K file is non-orthogonal exactly while it is copied, and valid before and after: what was
    validated must be the copy (refused), not the source (which would pass)."""
    d = calibration_folder(tmp_path)
    good, bad = tmp_path / "good-k.pt", _bad_k(tmp_path)
    good.write_bytes((d / K_NAME).read_bytes())
    copy = calibrated._copy_regular

    def swapped_while_copied(src: Path, dst: Path) -> None:
        if src.name == K_NAME:
            os.replace(bad, src)
            try:
                copy(src, dst)
            finally:
                os.replace(src, bad)
                src.write_bytes(good.read_bytes())
        else:
            copy(src, dst)

    monkeypatch.setattr(calibrated, "_copy_regular", swapped_while_copied)
    with pytest.raises(InvalidRotationError) as info:
        import_calibrated(d)
    assert "\n" not in str(info.value)
    imported = cache_dir / "imported"
    assert not imported.exists() or list(imported.iterdir()) == []  # nothing kept, no staging left
    monkeypatch.undo()
    got = import_calibrated(d)  # the source is valid again: imported
    _kept_is_verified(got.folder)


def test_a_source_swapped_back_and_forth_is_never_cached_as_verified(tmp_path, cache_dir) -> None:
    d = calibration_folder(tmp_path)
    good, bad = (d / K_NAME).read_bytes(), _bad_k(tmp_path).read_bytes()
    stop = threading.Event()
    rng = random.Random(37)

    def swapper() -> None:
        i = 0
        while not stop.is_set():
            tmp = d / f".swap-{i}"
            tmp.write_bytes(bad if i % 2 else good)
            os.replace(tmp, d / K_NAME)
            i += 1
            time.sleep(rng.uniform(0.005, 0.05))

    t = threading.Thread(target=swapper)
    t.start()
    outcomes = []
    try:
        for _ in range(40):
            try:
                got = import_calibrated(d, force=True)
            except (InvalidRotationError, PairError, RotationZooError) as exc:
                outcomes.append(type(exc).__name__)
                continue
            outcomes.append("imported")
            _kept_is_verified(got.folder)
    finally:
        stop.set()
        t.join()
    assert all(r.ok for r in verify_cache(cache_dir, remove_bad=False)), outcomes


def test_a_publication_that_starts_during_the_copy_is_refused(tmp_path, cache_dir, monkeypatch) -> None:
    d = calibration_folder(tmp_path)
    copy = calibrated._copy_regular

    def server_starts_publishing(src: Path, dst: Path) -> None:
        copy(src, dst)
        (d / ".oscar_0123456789abcdef.pending.json").write_text("{}")

    monkeypatch.setattr(calibrated, "_copy_regular", server_starts_publishing)
    with pytest.raises(PairError, match="pending.json is present"):
        import_calibrated(d)
    assert not (cache_dir / "imported").exists() or list((cache_dir / "imported").iterdir()) == []


def test_a_fifo_in_place_of_a_file_to_import_never_blocks(tmp_path, cache_dir) -> None:
    d = calibration_folder(tmp_path)
    (d / K_NAME).unlink()
    os.mkfifo(d / K_NAME)
    t0 = time.monotonic()
    with pytest.raises(PairError):
        import_calibrated(d)
    assert time.monotonic() - t0 < 5


# -- K and V of different provenance --------------------------------------------------------------


def _mixed(root: Path, v_generation: str | None) -> Path:
    """A folder without a manifest whose V file records another calibration (or none)."""
    d = calibration_folder(root)
    for m in d.glob(".oscar_*"):
        m.unlink()
    obj = layouts.v1(seed=1, objective="sst_r_h_pbr", with_calibration=v_generation is not None)
    if v_generation is not None:
        obj["calibration"]["generation_id"] = v_generation
    torch.save(obj, d / "v_rotation_sst_r_h_pbr.pt")
    return d


@pytest.mark.parametrize("v_generation", ["g-0002", None], ids=["other-generation", "no-calibration"])
def test_k_and_v_of_different_provenance_are_refused_unless_allowed(tmp_path, cache_dir, capsys,
                                                                   v_generation) -> None:
    d = _mixed(tmp_path, v_generation)
    assert main(["cache", "import", str(d)]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "mixes two calibrations" in err and "--allow-mixed" in err
    assert not (cache_dir / "imported").exists() or list((cache_dir / "imported").iterdir()) == []
    with pytest.raises(PairError, match="allow_mixed=True"):
        import_calibrated(d)
    assert main(["cache", "import", str(d), "--allow-mixed"]) == 0
    got = import_calibrated(d, allow_mixed=True, name="mixed-api")
    _kept_is_verified(got.folder)


def test_a_file_of_another_calibration_than_the_manifest_is_allowed_only_when_asked(tmp_path, cache_dir) -> None:
    d = calibration_folder(tmp_path, generation="g-0002")  # both files g-0002, the manifest g-0001
    with pytest.raises(PairError, match="the manifest says 'g-0001'"):
        import_calibrated(d)
    assert import_calibrated(d, allow_mixed=True).calibration["generation_id"] == "g-0002"


# -- fetch: the valid copy stays --------------------------------------------------------------------


def test_a_download_refused_by_its_pin_never_touches_the_cached_copy(zoo, tmp_path) -> None:
    zoo.write_registry(pinned=False)
    with pytest.warns(UserWarning):
        first = rotationzoo.fetch(MODEL, source="url")
    k = first.paths["k"]
    before = k.read_bytes()
    path, _ = zoo.files["k"]
    other = rotationzoo.write_rotation(tmp_path / "other.pt", rotationzoo.RotationSet(
        torch.linalg.qr(torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(5)))[0], range(4),
        "qqt_r_h_pbr"))
    zoo.server.put_raw(path, other.read_bytes())  # the server changes the file
    with pytest.raises(IntegrityError, match="changed since it was first used"):
        rotationzoo.fetch(MODEL, source="url", force=True)
    assert k.read_bytes() == before and read_marker(k)["sha256"] == first.sha256["k"]
    again = rotationzoo.fetch(MODEL, source="url")
    assert again.from_cache and again.sha256["k"] == first.sha256["k"]
    assert [p.name for p in k.parent.iterdir() if p.name.endswith(".tmp")] == []
