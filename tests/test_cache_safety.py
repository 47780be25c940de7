"""Nothing outside the cache root is ever deleted, written or followed: linked areas, linked folders,
links planted in the hub clients' caches, linked markers; and `cache rm` checks before it removes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, REPO_ID, TAG, zoo  # noqa: F401  (fixture)

import rotationzoo
from rotationzoo.errors import CacheError
from rotationzoo.hub import cache_records, remove_cached, verify_cache

from helpers import run_cli

K_NAME = "k_rotation_qqt_r_h_pbr.pt"


def _victim(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """A folder outside the cache with a file, a nested file and hidden files (what must survive)."""
    v = tmp_path / "victim"
    files = {v / "notes.txt": b"keep", v / "sub" / "deep.txt": b"deep", v / ".hidden.tmp": b"h",
             v / "sub" / ".x.part": b"p"}
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return v, files


def _intact(files: dict[Path, bytes]) -> None:
    for p, data in files.items():
        assert p.is_file() and p.read_bytes() == data, f"{p} was touched"


@pytest.mark.parametrize("area", ["files", "derived"])
def test_cache_verify_never_follows_a_linked_area(cache_dir, tmp_path, capsys, area) -> None:
    victim, files = _victim(tmp_path)
    cache_dir.mkdir(parents=True)
    (cache_dir / area).symlink_to(victim)
    code, out, err = run_cli(capsys, "cache", "verify")
    assert code == 1 and "is a symlink" in err and len(err.strip().splitlines()) == 1
    _intact(files)
    with pytest.raises(CacheError, match="symlink"):
        verify_cache(cache_dir)
    _intact(files)


def test_a_link_leaving_the_root_inside_an_area_stops_verify(cache_dir, tmp_path) -> None:
    victim, files = _victim(tmp_path)
    folder = cache_dir / "files" / "models--acme--Tiny-LM" / TAG
    folder.mkdir(parents=True)
    (folder / K_NAME).write_bytes(b"data")  # unverified: verify would remove it
    for link, target in ((folder.parent / "other-tag", victim), (folder / "v.pt", victim / "notes.txt"),
                         (folder / (K_NAME + ".verified"), victim / "notes.txt")):
        link.symlink_to(target)
        with pytest.raises(CacheError, match=f"{link.name} is a symlink to .*outside the cache root"):
            verify_cache(cache_dir)
        assert (folder / K_NAME).exists()  # nothing was removed
        _intact(files)
        link.unlink()


def test_links_inside_the_root_and_fifos_are_reported_and_removed_as_links(cache_dir, tmp_path) -> None:
    folder = cache_dir / "files" / "models--acme--Tiny-LM" / TAG
    folder.mkdir(parents=True)
    (folder / K_NAME).write_bytes(b"data")
    kept = cache_dir / "locks" / "kept.json"  # inside the root, in no area verify walks
    kept.parent.mkdir(parents=True)
    kept.write_text(json.dumps({"sha256": "0" * 64, "size": 4}))
    (folder / (K_NAME + ".verified")).symlink_to(kept)
    (folder / "dangling.pt").symlink_to(cache_dir / "nonexistent")
    os.mkfifo(folder / "fifo.pt")
    records = verify_cache(cache_dir)
    assert {r.path.name for r in records} == {K_NAME, K_NAME + ".verified", "dangling.pt", "fifo.pt"}
    assert not any(r.ok for r in records)
    assert kept.read_text().startswith("{") and not any(folder.iterdir())


@pytest.mark.parametrize("area", ["files", "derived", "hub"])
def test_cache_rm_all_with_a_linked_area_removes_nothing(zoo, tmp_path, capsys, area) -> None:
    rotationzoo.fetch(MODEL)
    before = sorted(p for p in zoo.cache.rglob("*") if p.is_file())
    victim, files = _victim(tmp_path)
    link = zoo.cache / area
    if link.exists():
        link.rename(zoo.cache / f".{area}.moved")  # hidden: the root holds only the cache's own entries
    link.symlink_to(victim)
    code, out, err = run_cli(capsys, "cache", "rm", "--all", "--yes")
    assert code == 1 and "is a symlink" in err and len(err.strip().splitlines()) == 1
    _intact(files)
    with pytest.raises(CacheError):
        remove_cached(cache_dir=zoo.cache, all=True)
    _intact(files)
    link.unlink()
    if (zoo.cache / f".{area}.moved").exists():
        (zoo.cache / f".{area}.moved").rename(link)
    assert sorted(p for p in zoo.cache.rglob("*") if p.is_file()) == before  # nothing else went either


def test_cache_rm_model_with_a_linked_tag_folder_removes_nothing(zoo, tmp_path, capsys) -> None:
    rotationzoo.fetch(MODEL)
    victim, files = _victim(tmp_path)
    (zoo.cache / "derived" / "models--acme--Tiny-LM").mkdir(parents=True)
    link = zoo.cache / "derived" / "models--acme--Tiny-LM" / TAG
    link.symlink_to(victim)
    with pytest.raises(CacheError, match="symlink"):
        remove_cached(MODEL, cache_dir=zoo.cache)
    code, out, err = run_cli(capsys, "cache", "rm", "--model", MODEL, "--yes")
    assert code == 1 and "symlink" in err
    _intact(files)
    link.unlink()
    assert len(cache_records(zoo.cache)) == 2  # K and V: nothing was removed


def test_cache_rm_waits_for_no_download_and_names_only_what_it_removes(zoo, tmp_path, capsys) -> None:
    """A download holding an entry's lock keeps rm (of the model, or of everything) off its folder; an
    imported pair named like a model folder is neither listed nor removed by rm --model."""
    from rotationzoo.errors import CacheError as Err
    from rotationzoo.hub import cache_root, lock_path
    from rotationzoo.registry import get_entry
    from rotationzoo.safefile import file_lock

    got = rotationzoo.fetch(MODEL)
    before = sorted(p for p in zoo.cache.rglob("*") if p.is_file() and "locks" not in p.parts)
    with file_lock(lock_path(cache_root(zoo.cache), get_entry(MODEL)), timeout=1, what="download", error=Err):
        for argv in (["--model", MODEL], ["--all"]):
            code, _, err = run_cli(capsys, "cache", "rm", *argv, "--yes")
            assert code == 1 and "is locked by another process" in err and "nothing was removed" in err, err
    assert sorted(p for p in zoo.cache.rglob("*") if p.is_file() and "locks" not in p.parts) == before
    imported = zoo.cache / "imported" / "models--acme--Tiny-LM"
    imported.mkdir(parents=True)
    (imported / "k_rotation_x.pt").write_bytes(b"mine")
    code, out, _ = run_cli(capsys, "cache", "rm", "--model", MODEL, "--dry-run")
    assert code == 0 and "imported" not in out and "would remove 2 files" in out, out
    code, out, _ = run_cli(capsys, "cache", "rm", "--model", MODEL, "--yes")
    assert code == 0 and "removed 2 files" in out and not got.paths["k"].exists(), out
    assert (imported / "k_rotation_x.pt").read_bytes() == b"mine"


def _client_file(root: Path, source: str) -> Path:
    hub = root / "hub" / source
    pattern = f"**/{K_NAME}"
    found = [p for p in hub.glob(pattern) if "snapshots" in p.parts or source == "modelscope"]
    assert found, list(hub.rglob("*"))
    return found[0]


@pytest.mark.parametrize("source", ["huggingface", "modelscope"])
@pytest.mark.parametrize("good_bytes", [True, False])
def test_a_link_planted_in_a_hub_client_cache_is_refused_and_its_target_kept(zoo, tmp_path, source,
                                                                              good_bytes) -> None:
    root = tmp_path / f"cache-{source}"
    rotationzoo.fetch(MODEL, source=source, cache_dir=root)
    client_copy = _client_file(root, source)
    outside = tmp_path / "someone-elses-file.pt"
    outside.write_bytes(zoo.files["k"][1] if good_bytes else b"not a rotation file")
    client_copy.unlink()
    client_copy.symlink_to(outside)
    # our verified copy goes, so that the next load asks the client again
    for p in (root / "files").rglob(f"{K_NAME}*"):
        p.unlink()
    with pytest.raises(CacheError, match="outside the cache root"):
        rotationzoo.load(MODEL, source=source, cache_dir=root)
    assert outside.is_file() and outside.stat().st_size > 0
    assert client_copy.is_symlink()  # reported, not silently replaced
    assert not any((root / "files").rglob(K_NAME))


@pytest.mark.parametrize("source", ["huggingface", "modelscope"])
def test_a_linked_hub_area_is_refused_before_the_client_writes(zoo, tmp_path, source) -> None:
    root = tmp_path / "cache"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    (root / "hub").symlink_to(elsewhere)
    with pytest.raises(CacheError, match="symlink"):
        rotationzoo.fetch(MODEL, source=source, cache_dir=root)
    assert list(elsewhere.iterdir()) == []
    (root / "hub").unlink()
    (root / "hub").mkdir()
    (root / "hub" / source).symlink_to(elsewhere)
    with pytest.raises(CacheError, match="symlink"):
        rotationzoo.fetch(MODEL, source=source, cache_dir=root)
    assert list(elsewhere.iterdir()) == []


def test_a_linked_folder_inside_the_client_cache_is_refused(zoo, tmp_path) -> None:
    root = tmp_path / "cache"
    rotationzoo.fetch(MODEL, source="huggingface", cache_dir=root)
    repo = root / "hub" / "huggingface" / f"models--{REPO_ID.replace('/', '--')}"
    elsewhere = tmp_path / "blobs-elsewhere"
    (repo / "blobs").rename(elsewhere)
    (repo / "blobs").symlink_to(elsewhere)
    kept = sorted(elsewhere.iterdir())
    for p in (root / "files").rglob("*_rotation_*"):
        p.unlink()
    with pytest.raises(CacheError, match="outside the cache root"):
        rotationzoo.fetch(MODEL, source="huggingface", cache_dir=root, force=True)
    assert sorted(elsewhere.iterdir()) == kept
