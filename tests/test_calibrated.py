"""Start-up calibration folders of the authors' server: refused while a publication is pending,
imported into the cache with their provenance, loaded, verified and removed like other cached files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import layouts
import rotationzoo
from rotationzoo.files.calibrated import import_calibrated
from rotationzoo.errors import PairError
from rotationzoo.hub import cache_records, verify_cache

from helpers import run_cli


def calibration_folder(root: Path, *, pending: bool = False, generation: str = "g-0001") -> Path:
    d = root / "oscar-rotations" / "Qwen3-8B-0123456789ab"
    d.mkdir(parents=True)
    names = {"k": "k_rotation_qqt_r_h_pbr.pt", "v": "v_rotation_sst_r_h_pbr.pt"}
    for side, seed in (("k", 0), ("v", 1)):
        obj = layouts.v1(seed=seed, objective="qqt_r_h_pbr" if side == "k" else "sst_r_h_pbr", with_calibration=True)
        obj["calibration"]["generation_id"] = generation
        torch.save(obj, d / names[side])
    pair_id = hashlib.sha256(f"K={d / names['k']}\0V={d / names['v']}".encode()).hexdigest()[:16]
    manifest = {"generation_id": "g-0001", "k_path": str(d / names["k"]), "v_path": str(d / names["v"]),
                "prompt_sha256": "ab" * 32, "tokens": 4096}
    (d / f".oscar_{pair_id}.{'pending' if pending else 'complete'}.json").write_text(json.dumps(manifest))
    return d


def test_a_pending_publication_is_refused_and_nothing_imported(tmp_path, cache_dir, capsys) -> None:
    d = calibration_folder(tmp_path, pending=True)
    code, _, err = run_cli(capsys, "cache", "import", str(d))
    assert code == 1 and "pending.json is present" in err and len(err.strip().splitlines()) == 1
    assert not (cache_dir / "imported").exists() or not any((cache_dir / "imported").iterdir())
    with pytest.raises(PairError, match="publication of this pair is in progress or was interrupted"):
        rotationzoo.load(d)
    with pytest.raises(PairError):
        rotationzoo.load(f"{d / 'k_rotation_qqt_r_h_pbr.pt'},{d / 'v_rotation_sst_r_h_pbr.pt'}")


def test_a_complete_pair_is_imported_with_its_provenance(tmp_path, cache_dir, capsys) -> None:
    d = calibration_folder(tmp_path)
    pair = rotationzoo.load(d)  # the folder itself loads, calibration kept
    assert pair.k.calibration["prompt_sha256"] == "ab" * 32
    code, out, _ = run_cli(capsys, "cache", "import", str(d), "--json")
    got = json.loads(out)
    assert code == 0 and got["name"] == "Qwen3-8B-0123456789ab" and got["calibration"]["tokens"] == 4096
    imported = Path(got["folder"])
    assert imported.parent == cache_dir / "imported"
    assert rotationzoo.load(imported).k.calibration == pair.k.calibration
    recs = [r for r in cache_records(cache_dir) if r.area == "imported"]
    assert sorted(r.side for r in recs) == ["k", "v"] and all(r.sha256 for r in recs)
    assert all(r.ok for r in verify_cache(cache_dir))
    code, out, _ = run_cli(capsys, "cache", "import", str(d))  # the same pair again: fine
    assert code == 0 and "calibration: generation_id g-0001" in out
    code, _, _ = run_cli(capsys, "cache", "rm", "--all", "--yes")
    assert code == 0 and not any((cache_dir / "imported").glob("*")) if (cache_dir / "imported").exists() else True


def test_a_folder_mixing_two_calibrations_is_refused(tmp_path, cache_dir) -> None:
    d = calibration_folder(tmp_path, generation="g-0002")
    with pytest.raises(PairError, match="mixes two calibrations"):
        import_calibrated(d)


def test_a_manifest_naming_other_files_is_refused(tmp_path, cache_dir) -> None:
    d = calibration_folder(tmp_path)
    m = next(d.glob(".oscar_*.complete.json"))
    data = json.loads(m.read_text())
    data["k_path"] = str(d / "k_rotation_other.pt")
    m.write_text(json.dumps(data))
    with pytest.raises(PairError, match="refusing to guess"):
        import_calibrated(d)


def test_another_pair_under_the_same_name_needs_force(tmp_path, cache_dir) -> None:
    import_calibrated(calibration_folder(tmp_path / "a"))
    other = calibration_folder(tmp_path / "b")
    torch.save(layouts.v1(seed=9, with_calibration=True), other / "k_rotation_qqt_r_h_pbr.pt")
    with pytest.raises(PairError, match="another pair is imported under the name"):
        import_calibrated(other)
    assert import_calibrated(other, force=True).sha256["k"] == hashlib.sha256(
        (other / "k_rotation_qqt_r_h_pbr.pt").read_bytes()).hexdigest()


def test_verify_leaves_an_import_in_progress_alone(tmp_path, cache_dir) -> None:
    """An import fills a hidden staging folder before renaming it into place; cache verify must not take
    its files for unmarked ones and delete them under it, and clears such a folder only once it has long
    been left alone (a killed import)."""
    import os
    import shutil
    import time

    from rotationzoo.hub.cache import STAGING_GRACE_S

    got = import_calibrated(calibration_folder(tmp_path), cache_dir=cache_dir)
    staging = cache_dir / "imported" / f".{got.name}.in-progress"
    shutil.copytree(got.folder, staging)  # what the import's staging folder holds before its rename
    for p in staging.iterdir():
        if p.name.endswith(".verified"):
            p.unlink()  # copied, marker not yet written
    staged = sorted(p for p in staging.iterdir())
    recs = verify_cache(cache_dir)
    partial = [r for r in recs if r.area == "partial"]
    assert sorted(r.path for r in partial) == staged and all("staging folder" in str(r.problem) for r in partial)
    assert all(p.is_file() for p in staged)
    assert all(r.ok for r in recs if r.area == "imported")  # the finished import is untouched
    old = time.time() - STAGING_GRACE_S - 60
    for p in [staging, *staged]:
        os.utime(p, (old, old))
    recs = verify_cache(cache_dir)
    assert [(str(r.problem), r.removed) for r in recs if r.area == "partial"] == [
        ("left by a killed import or write", True)] * 2
    assert not any(p.exists() for p in staged) and all(p.is_file() for p in got.paths.values())


def test_a_failed_forced_import_keeps_the_old_one(tmp_path, cache_dir, monkeypatch) -> None:
    """--force moves the old import aside before renaming the new one in; when that rename fails (a full
    disk, Ctrl-C), the old import goes back in place, whole."""
    import os

    from rotationzoo.errors import CacheError

    from test_publish import make_fitted

    first = import_calibrated(make_fitted(tmp_path / "a" / "calib", seeds=(1, 2)), name="mine", cache_dir=cache_dir)
    before = {p.name: p.read_bytes() for p in first.folder.iterdir()}
    real = os.replace

    def failing(src, dst, *args, **kwargs):  # only the new import's rename fails (stdlib fault injection)
        if os.path.basename(os.fspath(src)).startswith(".mine.") and ".old." not in os.fspath(src):
            raise OSError(28, "No space left on device")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CacheError, match="No space left"):
        import_calibrated(make_fitted(tmp_path / "b" / "calib", seeds=(3, 4)), name="mine", cache_dir=cache_dir,
                          force=True)
    monkeypatch.setattr(os, "replace", real)
    assert {p.name: p.read_bytes() for p in first.folder.iterdir()} == before
    assert sorted(os.listdir(cache_dir / "imported")) == ["mine"]


@pytest.mark.parametrize("k_name", ["../outside/k.pt", "/abs/k.pt", "sub/k.pt", ".hidden.pt", "k.pt.verified"])
def test_a_manifest_naming_files_outside_its_folder_reads_and_imports_nothing(tmp_path, cache_dir, capsys,
                                                                             k_name) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save(layouts.v1(seed=0), outside / "k.pt")
    d = tmp_path / "pair"
    d.mkdir()
    torch.save(layouts.v1(seed=1), d / "v.pt")
    v_name = "v.pt"
    if k_name == "/abs/k.pt":
        k_name = str(outside / "k.pt")
    elif k_name == "k.pt.verified":  # a marker's name: the import would write K's marker over it
        torch.save(layouts.v1(seed=0), d / "k.pt")
        (d / "v.pt").rename(d / k_name)
        k_name, v_name = "k.pt", k_name
    (d / "rotationzoo.json").write_text(json.dumps(
        {"files": {"k": {"name": k_name}, "v": {"name": v_name}}}))
    for args in (("verify", str(d)), ("cache", "import", str(d))):
        code, out, err = run_cli(capsys, *args)
        assert code == 1 and "is not a rotation file name in the folder" in out + err
    with pytest.raises(PairError, match="not a rotation file name in the folder"):
        rotationzoo.load(d)
    assert not (cache_dir / "imported").exists() or not any((cache_dir / "imported").iterdir())


def test_a_manifest_naming_k_and_v_alike_is_refused(tmp_path, cache_dir) -> None:
    d = tmp_path / "pair"
    d.mkdir()
    torch.save(layouts.v1(seed=0), d / "k.pt")
    (d / "rotationzoo.json").write_text(json.dumps({"files": {"k": {"name": "k.pt"}, "v": {"name": "k.pt"}}}))
    with pytest.raises(PairError, match="K and V are both named"):
        import_calibrated(d)


def test_a_folder_of_links_is_read_as_its_files(tmp_path, cache_dir) -> None:
    """A Hugging Face snapshot folder holds links into ``../../blobs``: its pair is read, and an import copies
    the bytes (never a link) into the cache."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    torch.save(layouts.v1(seed=0), blobs / "kblob")
    torch.save(layouts.v1(seed=1), blobs / "vblob")
    d = tmp_path / "snapshots" / "abc"
    d.mkdir(parents=True)
    (d / "k_rotation_x.pt").symlink_to("../../blobs/kblob")
    (d / "v_rotation_x.pt").symlink_to("../../blobs/vblob")
    assert rotationzoo.load(d).sha256["k"] == hashlib.sha256((blobs / "kblob").read_bytes()).hexdigest()
    got = import_calibrated(d, name="snap")
    assert got.sha256["k"] == hashlib.sha256((blobs / "kblob").read_bytes()).hexdigest()
    assert all(not p.is_symlink() for p in got.paths.values())
