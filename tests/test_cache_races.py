"""``cache verify`` removes only what is bad when it judges it: a file a writer puts in place while the check runs
(an import, a derived file) is judged by the marker written with it, under the entry's lock; a folder that is not
a cache is never cleaned; and the locks area is a real folder inside the root."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rotationzoo
from rotationzoo import RotationSet, write_rotation
from rotationzoo.errors import CacheError
from rotationzoo.files.calibrated import import_calibrated
from rotationzoo.hub import cache_records, remove_cached, verify_cache

from helpers import run_cli
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, zoo  # noqa: F401  (fixture)


def pair_folder(root: Path, seed: int) -> Path:
    """A K/V pair folder (4 layers, d = 16) of its own bytes."""
    for side, objective, s in (("k", "qqt_r_h_pbr", seed), ("v", "sst_r_h_pbr", seed + 1)):
        g = torch.Generator().manual_seed(s)
        q = torch.linalg.qr(torch.randn(4, 16, 16, dtype=torch.float64, generator=g))[0].float().contiguous()
        write_rotation(root / f"{side}_rotation_{objective}.pt", RotationSet(q, range(4), objective, torch.rand(4, 16)))
    return root


def test_a_pair_imported_while_verify_runs_is_judged_by_its_own_markers(cache_dir, tmp_path, monkeypatch) -> None:
    """Verify lists the cache, then an import replaces the pair under the same name (files and markers): the new
    pair passes and stays (it had been judged against the old markers and removed, the K or the V left alone)."""
    import rotationzoo.hub.cache as cache_module

    old, new = pair_folder(tmp_path / "A", 10), pair_folder(tmp_path / "B", 20)
    import_calibrated(old, name="X")
    listed = cache_module.cache_records

    def listed_then_replaced(root):
        records = listed(root)
        import_calibrated(new, name="X", force=True)  # between the listing and the judging
        return records

    monkeypatch.setattr(cache_module, "cache_records", listed_then_replaced)
    records = verify_cache(cache_dir)
    assert [(r.ok, r.removed) for r in records] == [(True, False)] * 2, [r.problem for r in records]
    for p in new.iterdir():
        assert (cache_dir / "imported" / "X" / p.name).read_bytes() == p.read_bytes()
    monkeypatch.undo()
    assert all(r.ok for r in verify_cache(cache_dir)) and len(cache_records(cache_dir)) == 2


def test_a_derived_file_is_never_seen_by_verify_without_its_marker(cache_dir, tmp_path, monkeypatch) -> None:
    """The rotations GGUF is written and its marker recorded under its folder's lock: a verify that comes between
    the two leaves it unchecked (it had removed it as a file without a marker, and the launch then failed)."""
    import rotationzoo.files.derived as derived
    import rotationzoo.hub.cache as cache_module

    monkeypatch.setattr(cache_module, "VERIFY_LOCK_WAIT_S", 0.1)
    seen = []
    recorded = derived.record_derived

    def verify_first(path, **kwargs):
        seen.extend(verify_cache(cache_dir))  # the GGUF is in place, its marker not yet
        return recorded(path, **kwargs)

    monkeypatch.setattr(derived, "record_derived", verify_first)
    out = derived.ensure_rotations_gguf(rotationzoo.load(pair_folder(tmp_path / "P", 30)))
    assert out.is_file() and [(r.path, r.ok, r.removed) for r in seen] == [(out, None, False)]
    assert "not checked" in str(seen[0].problem) and "locked by another process" in str(seen[0].problem)
    monkeypatch.undo()
    assert [(r.path, r.ok) for r in verify_cache(cache_dir)] == [(out, True)]


def test_a_folder_that_is_not_a_cache_is_never_cleaned(tmp_path, capsys) -> None:
    """A project folder given as the cache (a ``files/`` folder and ``.git``): verify and rm refuse, nothing goes
    (verify had removed every file without a marker, at any depth); a cache with its markers is checked."""
    proj = tmp_path / "proj"
    mine = {proj / "files" / "report.md": b"r", proj / "files" / "docs" / "notes.txt": b"n"}
    (proj / ".git").mkdir(parents=True)
    for p, data in mine.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    for argv in (["cache", "verify"], ["cache", "rm", "--all", "--yes"]):
        code, _, err = run_cli(capsys, *argv, "--cache-dir", str(proj))
        assert code == 1 and "does not look like a rotationzoo cache" in err and "nothing was removed" in err, err
    with pytest.raises(CacheError, match="no .* marker|neither a .verified marker"):
        verify_cache(proj)
    assert all(p.read_bytes() == data for p, data in mine.items())
    assert [r.ok for r in verify_cache(proj, remove_bad=False)] == [False, False]  # listed, kept
    left = tmp_path / "cache" / "imported" / ".X.abc" / "k_rotation_x.pt"  # a cache holding only what a killed
    left.parent.mkdir(parents=True)  # import left behind is a cache: checked, not refused
    left.write_bytes(b"k")
    assert [(r.area, r.removed) for r in verify_cache(tmp_path / "cache")] == [("partial", False)]


def test_cache_rm_never_locks_through_a_linked_locks_area(zoo, tmp_path, capsys) -> None:
    """``locks/`` linked out of the root: rm refuses before making a lock there (it had created lock files in the
    linked folder)."""
    rotationzoo.fetch(MODEL)
    outside = tmp_path / "outside"
    outside.mkdir()
    (zoo.cache / "locks").rename(tmp_path / "locks.moved")
    (zoo.cache / "locks").symlink_to(outside)
    for argv in (["--model", MODEL, "--yes"], ["--all", "--yes"]):
        code, _, err = run_cli(capsys, "cache", "rm", *argv)
        assert code == 1 and "locks is a symlink" in err, err
    with pytest.raises(CacheError, match="locks is a symlink"):
        remove_cached(cache_dir=zoo.cache, all=True)
    assert list(outside.iterdir()) == [] and len(cache_records(zoo.cache)) == 2
