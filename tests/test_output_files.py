"""What rotationzoo writes where a user asked for it: whole or not at all, with the permissions a plain write
would give, and checked before long work rather than after it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from test_fetch import MODEL, zoo  # noqa: F401  (fixture)

from rotationzoo.files.manifest import write_manifest
from rotationzoo.fit.dump_writer import DumpWriter
from rotationzoo.registry.edit import write_registry_file
from rotationzoo.registry.load import bundled_registry_path


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_outputs_get_the_umask_not_0600(tmp_path, umask022) -> None:
    """Each writer renames a temporary file onto its output; that file must not carry mkstemp's 0600."""
    import json

    manifest = write_manifest(tmp_path, {"manifest_version": 1})
    reg = tmp_path / "registry.json"
    write_registry_file(reg, json.loads(bundled_registry_path().read_text()))
    info = DumpWriter(tmp_path / "dump").write_info({"model": "m"})
    for p in (manifest, reg, info):
        assert _mode(p) == 0o644, (p, oct(_mode(p)))
    left = [p for p in tmp_path.rglob(".*") if p.is_file() and p.name != ".rotationzoo_dump.lock"]
    assert not left  # no temporary file left (the dump folder's lock file stays, as lock files do)


def test_a_fit_never_takes_over_a_folder_holding_another(tmp_path) -> None:
    """Writing a fit where another one lives would replace its manifest and leave its files undescribed."""
    from rotationzoo.errors import FitError
    from rotationzoo.fit import fit_rotations, write_fitted

    had = fit_rotations(None, "hadamard", num_layers=2, head_dim=16)
    first = write_fitted(had, tmp_path / "rot", tag="run1")
    before = first.manifest_path.read_bytes()
    write_fitted(had, tmp_path / "rot", tag="run1")  # the same files again: a re-run
    write_fitted(had, tmp_path / "rot", tag="run1", fmt="safetensors")  # the same fit in the other format
    (tmp_path / "rot" / "rotationzoo.json").write_bytes(before)
    import torch

    from rotationzoo.fit.dump import write_dump

    g = torch.Generator().manual_seed(0)
    chunk = lambda: {"q": torch.randn(300, 4, 16, generator=g), "k": torch.randn(300, 2, 16, generator=g),  # noqa: E731
                     "v": torch.randn(300, 2, 16, generator=g), "seq_lens": [300]}
    other = fit_rotations(write_dump(tmp_path / "dump", {lid: [chunk() for _ in range(3)] for lid in (0, 1)}),
                          "qqt_sst", min_tokens=1)
    with pytest.raises(FitError, match="holds another fit .*k_rotation_hadamard.pt.*give another --out"):
        write_fitted(other, tmp_path / "rot", tag="run2")
    assert (tmp_path / "rot" / "rotationzoo.json").read_bytes() == before
    assert not list((tmp_path / "rot").glob("*qqt*"))
    write_fitted(other, tmp_path / "rot2", tag="run2")  # its own folder: fine


def test_a_fit_never_writes_over_files_no_manifest_describes(tmp_path) -> None:
    """The authors' files copied in by hand (no manifest), or a manifest cut short: a fit with the same file
    names had replaced them silently."""
    from rotationzoo.errors import FitError
    from rotationzoo.fit import fit_rotations, write_fitted

    had = fit_rotations(None, "hadamard", num_layers=2, head_dim=16)
    out = write_fitted(had, tmp_path / "by_hand")
    (tmp_path / "by_hand" / "rotationzoo.json").unlink()  # files only, as downloaded by hand
    k = out.paths["k"]
    k.write_bytes(b"the authors' bytes")
    with pytest.raises(FitError, match="exists and no rotationzoo.json of a fit describes it"):
        write_fitted(had, tmp_path / "by_hand")
    assert k.read_bytes() == b"the authors' bytes"
    other = write_fitted(had, tmp_path / "cut")
    other.manifest_path.write_bytes(other.manifest_path.read_bytes()[:-5])  # cut short
    with pytest.raises(FitError, match="not valid JSON.*may hold another fit"):
        write_fitted(had, tmp_path / "cut")


def test_a_refit_that_fails_between_its_sides_leaves_the_old_pair_whole(tmp_path, monkeypatch) -> None:
    """A disk full (or Ctrl-C) after K was replaced and before V had served a new K with the old V."""
    from rotationzoo.fit import fit_rotations, output, write_fitted

    had = fit_rotations(None, "hadamard", num_layers=2, head_dim=16)
    first = write_fitted(had, tmp_path / "rot")
    before = {p.name: p.read_bytes() for p in (tmp_path / "rot").iterdir()}
    real = output.write_rotation

    def full_on_v(path, rs, **kw):
        if "v_rotation" in Path(path).name:
            raise OSError(28, "No space left on device")
        return real(path, rs, **kw)

    monkeypatch.setattr(output, "write_rotation", full_on_v)
    again = fit_rotations(None, "hadamard", num_layers=2, head_dim=16)
    again.k.rotations = -again.k.rotations  # other K bytes
    with pytest.raises(OSError):
        write_fitted(again, tmp_path / "rot")
    assert {p.name: p.read_bytes() for p in (tmp_path / "rot").iterdir()} == before
    assert first.paths["k"].exists()


def test_a_registry_file_is_updated_where_it_lives_and_only_if_it_is_one(tmp_path) -> None:
    """--registry-out through a link updates the file the link names (the link stays); a JSON file that
    is not a registry document (other keys, another version) is refused, untouched."""
    import json

    from rotationzoo.errors import RegistryError
    from rotationzoo.registry.edit import merge_into_registry, read_for_update

    real = tmp_path / "dotfiles" / "registry.json"
    real.parent.mkdir()
    write_registry_file(real, {"registry_version": 1, "models": []})
    link = tmp_path / "registry.json"
    link.symlink_to(real)
    write_registry_file(link, merge_into_registry(read_for_update(link), {"id": "a/New", "tags": {"t1": {}}}, "t1"))
    assert link.is_symlink() and [m["id"] for m in json.loads(real.read_text())["models"]] == ["a/New"]
    for doc in ({"name": "x", "models": []}, {"registry_version": 2, "models": []}):
        other = tmp_path / "other.json"
        other.write_text(json.dumps(doc))
        with pytest.raises(RegistryError, match="not a registry document of version 1.*refusing to overwrite"):
            read_for_update(other)
        assert json.loads(other.read_text()) == doc


# -- an output is never written over, or into, what a registry id was read from -----------------------


def test_export_and_eval_never_write_over_a_registry_ids_cached_files(zoo, tmp_path, capsys) -> None:
    """``export MODEL --out <its cached K file>`` (or a file beside it) and ``eval -r MODEL --json-out``
    there are refused before anything is written: before, only the names as given were checked, and the
    export replaced the verified cache copy it had just read."""
    from helpers import run_cli

    import rotationzoo
    from rotationzoo.errors import ExportError
    from rotationzoo.export import export

    k = rotationzoo.fetch(MODEL).paths["k"]
    kept = k.read_bytes()
    for out in (k, k.parent / "k.gguf", k.parent / "export.safetensors"):
        with pytest.raises(ExportError, match="this run reads; give another file name"):
            export(MODEL, out, to="gguf" if out.suffix == ".gguf" else "safetensors")
    rc, _, err = run_cli(capsys, "export", "Tiny-LM", "--to", "safetensors", "--out", str(k))
    assert rc == 1 and f"export output {k} is " in err and "a file this run reads" in err, err
    text, model = tmp_path / "t.txt", tmp_path / "model"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    model.mkdir()
    rc, out, err = run_cli(capsys, "eval", "--model", str(model), "-r", "Tiny-LM", "--text", str(text),
                           "--methods", "fp,oscar", "--json-out", str(k))
    assert rc == 2 and "--json-out" in err and "this run reads" in err and len(err.strip().splitlines()) == 1, err
    assert k.read_bytes() == kept and sorted(p.name for p in k.parent.iterdir() if not p.name.startswith(".")) == [
        "k_rotation_qqt_r_h_pbr.pt", "k_rotation_qqt_r_h_pbr.pt.verified",
        "v_rotation_sst_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt.verified"]
