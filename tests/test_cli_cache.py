"""`rotationzoo cache ls / rm`: a total line, a dry run with sizes, a question before removing."""

from __future__ import annotations

import io
import json
import sys

import pytest

from rotationzoo.cli import fetch_cmds
from rotationzoo.hub import cache_records, derived_path, record_derived
from rotationzoo.registry import get_entry

from helpers import run_cli

SMOL = "SmolLM2-135M-Instruct"


@pytest.fixture
def filled(cache_dir):
    """Three derived files in a fresh cache: two tags of SmolLM2 (1000 and 2000 B), one of Qwen3-8B (4000 B)."""
    for (model, tag), size in (((SMOL, "hadamard"), 1000), ((SMOL, None), 2000), (("Qwen3-8B", None), 4000)):
        entry = get_entry(model, tag)
        inputs = {"k": "0" * 64, "v": "1" * 64}
        p = derived_path("oscar-rot-kv.gguf", entry=entry, inputs=inputs, cache_dir=cache_dir)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * size)
        record_derived(p, inputs=inputs, entry=entry)
    assert len(cache_records(cache_dir)) == 3
    return cache_dir


def test_cache_ls_ends_with_a_total(filled, capsys) -> None:
    rc, out, _ = run_cli(capsys, "cache", "ls")
    assert rc == 0
    assert out.rstrip().splitlines()[-1] == f"total: 3 files, 6.8 KiB (7,000 bytes) in {filled}"
    rc, out, _ = run_cli(capsys, "cache", "ls", "--json")
    assert json.loads(out)["bytes"] == 7000


def test_cache_rm_dry_run_lists_sizes_and_removes_nothing(filled, capsys) -> None:
    rc, out, _ = run_cli(capsys, "cache", "rm", "--model", SMOL, "--dry-run")
    lines = out.rstrip().splitlines()
    assert rc == 0 and len(lines) == 3 and "Qwen" not in out
    assert lines[-1] == "would remove 2 files, 2.9 KiB (3,000 bytes)"
    assert "1000 B" in out and "2.0 KiB" in out
    rc, out, _ = run_cli(capsys, "cache", "rm", "--model", SMOL, "--tag", "hadamard", "--dry-run", "--json")
    got = json.loads(out)
    assert rc == 0 and got["dry_run"] and got["bytes"] == 1000 and len(got["files"]) == 1
    rc, out, _ = run_cli(capsys, "cache", "rm", "--all", "--dry-run")
    assert out.rstrip().endswith("would remove 3 files, 6.8 KiB (7,000 bytes)")
    assert len(cache_records(filled)) == 3


def test_cache_rm_refuses_without_yes_when_stdin_is_not_a_terminal(filled, capsys) -> None:
    rc, out, err = run_cli(capsys, "cache", "rm", "--model", SMOL)
    assert rc == 2 and out == "" and err.count("\n") == 1 and "--yes" in err and "2 files" in err
    assert len(cache_records(filled)) == 3
    rc, out, _ = run_cli(capsys, "cache", "rm", "--model", SMOL, "--tag", "hadamard", "--yes")
    assert rc == 0 and out == "removed 1 file, 1000 B (1,000 bytes)\n"
    assert {r.tag for r in cache_records(filled)} == {get_entry(SMOL).name, "seq20000_prompt83_group128"}


def test_cache_rm_takes_model_at_tag_as_every_command_does(filled, capsys) -> None:
    """``--model MODEL@TAG`` means that tag (it had been refused as an unknown model)."""
    from rotationzoo.hub import removal_plan

    rc, out, err = run_cli(capsys, "cache", "rm", "--model", f"{SMOL}@hadamard", "--dry-run", "--json")
    got = json.loads(out)
    assert rc == 0 and got["bytes"] == 1000 and len(got["files"]) == 1 and got["files"][0]["tag"] == "hadamard", err
    assert [r.tag for r in removal_plan(f"{SMOL}@hadamard", cache_dir=filled)[0]] == ["hadamard"]
    rc, out, err = run_cli(capsys, "cache", "rm", "--model", f"{SMOL}@hadamard", "--tag", get_entry(SMOL).name)
    assert rc == 2 and out == "" and "name different tags; give one" in err and len(cache_records(filled)) == 3
    rc, out, _ = run_cli(capsys, "cache", "rm", "--model", f"{SMOL}@hadamard", "--yes")
    assert rc == 0 and out == "removed 1 file, 1000 B (1,000 bytes)\n"
    assert {r.tag for r in cache_records(filled)} == {get_entry(SMOL).name, "seq20000_prompt83_group128"}


@pytest.mark.parametrize("name", [f"{SMOL}@", "@hadamard"])
def test_an_empty_side_of_model_at_tag_removes_nothing(filled, capsys, name) -> None:
    """``--model "$M@$TAG"`` with TAG unset (``MODEL@``) had been read as the whole model: every tag removed."""
    rc, out, err = run_cli(capsys, "cache", "rm", "--model", name, "--yes")
    assert rc == 1 and out == "" and "unset shell variable" in err and len(cache_records(filled)) == 3


@pytest.mark.parametrize("answer, kept", [("n\n", 3), ("y\n", 1)])
def test_cache_rm_asks_on_a_terminal(filled, capsys, monkeypatch, answer, kept) -> None:
    monkeypatch.setattr(fetch_cmds, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(sys, "stdin", io.StringIO(answer))
    rc, _, err = run_cli(capsys, "cache", "rm", "--model", SMOL)
    assert "remove 2 files, 2.9 KiB (3,000 bytes)? [y/N]" in err
    assert rc == (1 if kept == 3 else 0) and len(cache_records(filled)) == kept


def test_cache_rm_all_with_yes(filled, capsys) -> None:
    rc, out, _ = run_cli(capsys, "cache", "rm", "--all", "--yes", "--json")
    assert rc == 0 and json.loads(out)["bytes"] == 7000 and cache_records(filled) == []
    rc, out, _ = run_cli(capsys, "cache", "rm", "--all", "--yes")
    assert rc == 0 and out == "nothing to remove\n"


def test_a_folder_that_is_not_a_cache_loses_nothing_to_verify_or_rm(tmp_path, capsys) -> None:
    """`--cache-dir project` by mistake: its files/, derived/ and imported/ folders hold the user's files, which
    `cache verify` had removed as unmarked and `cache rm --all` with the folders."""
    project = tmp_path / "project"
    for rel, text in (("files/report.pdf", "report"), ("imported/q3/data.csv", "a,b"), ("derived/fig.png", "x"),
                      ("hub/blob.bin", "blob"), ("src/main.py", "code")):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text(text)
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    for argv in (["cache", "verify"], ["cache", "rm", "--all", "--yes"]):
        rc, _, err = run_cli(capsys, *argv, "--cache-dir", str(project))
        assert rc == 1 and "does not look like a rotationzoo cache (it holds src)" in err, err
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before
    rc, out, _ = run_cli(capsys, "cache", "verify", "--keep", "--cache-dir", str(project))  # reports, removes nothing
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before


# -- cache import: refusals name the file the user gave -------------------------------------------------


def _pair_folder(folder):
    """A valid K/V pair (2 layers, d 16) in ``folder``; returns its K file."""
    from helpers import random_orthogonal

    from rotationzoo import RotationSet, write_rotation

    for side, obj, seed in (("k", "qqt_r_h_pbr", 1), ("v", "sst_r_h_pbr", 2)):
        write_rotation(folder / f"{side}_rotation_{obj}.pt", RotationSet(random_orthogonal(2, 16, seed), range(2), obj))
    return folder / "k_rotation_qqt_r_h_pbr.pt"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("odd", ["a FIFO", "a link to a character device"])
def test_cache_import_says_the_k_file_is_not_a_regular_file(cache_dir, tmp_path, capsys, odd) -> None:
    """Before: "found v_rotation_….pt but no k_rotation*.pt", as if the K file were not there."""
    import os

    k = _pair_folder(tmp_path)
    k.unlink()
    os.mkfifo(k) if odd == "a FIFO" else k.symlink_to("/dev/zero")
    rc, _, err = run_cli(capsys, "cache", "import", str(tmp_path), "--name", "odd")
    assert rc == 1 and f"{k}: the K rotation file is {odd}, not a regular file" in err, err
    assert len(err.strip().splitlines()) == 1 and not (cache_dir / "imported" / "odd").exists()


def test_a_refused_import_names_the_source_file_not_the_staging_copy(cache_dir, tmp_path, capsys) -> None:
    import os

    import torch

    class _Code:
        def __reduce__(self):
            return (os.getcwd, ())

    k = _pair_folder(tmp_path)
    torch.save({"format_version": 1, "x": _Code()}, k)
    rc, _, err = run_cli(capsys, "cache", "import", str(tmp_path), "--name", "evil")
    assert rc == 1 and err.startswith(f"error: {k}: refused to load"), err  # before: imported/.evil.xxxx/k_….pt
    assert ".evil." not in err and not (cache_dir / "imported" / "evil").exists()


def test_remove_cached_without_a_model_or_all_removes_nothing(filled, capsys) -> None:
    """Python refuses what `cache rm` refuses: a forgotten model (``remove_cached(tag=...)``, or no argument)
    never empties the cache; everything takes ``all=True`` (``--all``)."""
    from rotationzoo.errors import ConfigError
    from rotationzoo.hub import removal_plan, remove_cached

    for kwargs, said in (({}, "say what to remove"), ({"tag": "hadamard"}, "say what to remove"),
                         ({"model": SMOL, "all": True}, "not both")):
        for fn in (remove_cached, removal_plan):
            with pytest.raises(ConfigError, match=said):
                fn(cache_dir=filled, **kwargs)
    assert len(cache_records(filled)) == 3
    for argv, said in (([], "say what to remove"), (["--tag", "hadamard"], "say what to remove"),
                       (["--model", SMOL, "--all"], "not both")):
        rc, out, err = run_cli(capsys, "cache", "rm", *argv, "--yes")
        assert rc == 2 and out == "" and said in err and err.count("\n") == 1, err
    assert len(cache_records(filled)) == 3
    assert len(removal_plan(cache_dir=filled, all=True)[0]) == 3
    assert len(remove_cached(cache_dir=filled, all=True)) >= 3 and cache_records(filled) == []


@pytest.mark.parametrize("kwargs", [{"model": SMOL, "tag": ""}, {"model": ""}, {"all": "no"}, {"all": 1},
                                    {"model": SMOL, "tag": 3}])
def test_remove_cached_refuses_empty_or_untyped_arguments(filled, kwargs) -> None:
    """tag="" had been read as no tag (every tag of the model removed) and all="no" as true (everything)."""
    from rotationzoo.errors import ConfigError
    from rotationzoo.hub import removal_plan, remove_cached

    for fn in (remove_cached, removal_plan):
        with pytest.raises(ConfigError):
            fn(cache_dir=filled, **kwargs)
    assert len(cache_records(filled)) == 3
