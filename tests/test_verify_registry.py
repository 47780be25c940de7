"""``rotationzoo verify --registry`` (the zoo integrity check) and the CI workflows that run the checks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

import layouts
from helpers import random_orthogonal
from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)

from rotationzoo import RotationSet, write_rotation
from rotationzoo.cli.main import main
from rotationzoo.publish import verify_registry
from rotationzoo.errors import ConfigError
from rotationzoo.files.localpair import verify_path
from rotationzoo.registry import get_model, load_registry

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
REPO_ID = "zoo/RotationZoo"
MODEL = "acme/Tiny-LM"
L, D = 4, 16


def _orthogonal(seed: int) -> torch.Tensor:
    return random_orthogonal(L, D, seed)


@pytest.fixture
def zoo(hub_env, tmp_path, monkeypatch):
    """Three tags of one model on the test hub: pinned, unpinned, and pinned to the wrong sha256."""
    server = hub_env.server
    blobs: dict[str, bytes] = {}
    for side, seed in (("k", 1), ("v", 2)):
        p = write_rotation(tmp_path / "src" / f"{side}_rotation_x.pt", RotationSet(_orthogonal(seed), range(L), "x"))
        blobs[side] = p.read_bytes()
    tags = ("pinned", "unpinned", "tampered")
    commit = server.commit_files(REPO_ID, {f"Tiny-LM/{t}/{s}_rotation_x.pt": b for t in tags for s, b in blobs.items()})

    def tag_entry(name: str) -> dict:
        files = {}
        for side, data in blobs.items():
            sha, size = hashlib.sha256(data).hexdigest(), len(data)
            if name == "unpinned":
                sha, size = None, None
            if name == "tampered" and side == "v":
                sha = "0" * 64  # what the registry promises is not what the hub serves
            files[side] = {"path": f"Tiny-LM/{name}/{side}_rotation_x.pt", "sha256": sha, "size": size}
        return {"objectives": {"k": "x", "v": "x"}, "serving": {"group_size": 16},
                "sources": [{"type": "huggingface", "repo": REPO_ID, "revision": commit}], "files": files}

    reg = {"registry_version": 1, "models": [{
        "id": MODEL, "aliases": ["Tiny-LM"], "architecture": {"num_layers": L, "head_dim": D},
        "default_tag": "pinned", "tags": {t: tag_entry(t) for t in tags}}]}
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(reg, indent=2) + "\n")
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(path))
    cache = tmp_path / "rz-cache"
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(cache))
    return type("Zoo", (), {"server": server, "blobs": blobs, "cache": cache, "commit": commit})


def _by_tag(checks) -> dict:
    return {c.tag: c for c in checks}


def test_offline_check_of_the_bundled_registry(cache_dir, capsys) -> None:
    checks = verify_registry()
    status = {(c.model, c.tag): c.status for c in checks}
    assert status[("HuggingFaceTB/SmolLM2-135M-Instruct", "hadamard")] == "ok"  # bundled: always checkable
    assert set(status.values()) == {"ok", "missing"}  # nothing else is cached, nothing was downloaded
    models = json.loads((ROOT / "registry.json").read_text())["models"]
    assert len(checks) == sum(len(m.get("tags", {})) + ("mla_latent" in m) for m in models)  # a latent set is one
    assert status[("zai-org/GLM-5.2-FP8", "c_kv_rcov_phblock_g128")] == "missing"
    assert main(["verify", "--registry", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["download"] is False and out["counts"]["failed"] == 0
    bundled_tags = sum(1 for m in load_registry() for t in m.tags.values()
                       if all(s.type == "bundled" for f in t.files.values() for s in f.sources))
    assert bundled_tags >= 2 and out["counts"]["ok"] == bundled_tags and out["checked"] == len(checks)
    smol = next(e for e in out["entries"] if e["tag"] == "hadamard")
    assert smol["files"]["k"]["sha256"] == smol["files"]["k"]["registry_sha256"]
    assert main(["verify", "--registry"]) == 0
    text = capsys.readouterr().out
    assert "ok HuggingFaceTB/SmolLM2-135M-Instruct@hadamard" in text and "not cached (use --download)" in text


def test_download_reports_ok_unpinned_and_failed(zoo, capsys) -> None:
    assert main(["verify", "--registry", "--download", "--model", MODEL, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and out["counts"] == {"ok": 1, "unpinned": 1, "missing": 0, "failed": 1}
    entries = {e["tag"]: e for e in out["entries"]}
    assert entries["pinned"]["status"] == "ok" and entries["pinned"]["problems"] == []
    unpinned = entries["unpinned"]
    assert unpinned["status"] == "unpinned" and unpinned["files"]["v"]["registry_sha256"] is None
    assert unpinned["files"]["v"]["sha256"] == hashlib.sha256(zoo.blobs["v"]).hexdigest()
    assert entries["tampered"]["status"] == "failed" and "sha256" in entries["tampered"]["problems"][0]
    # human output: one line per entry, the observed sha256 of unpinned files, the failure reason
    assert main(["verify", "--registry", "--download", "--model", MODEL]) == 1
    text = capsys.readouterr().out
    assert "ok acme/Tiny-LM@pinned" in text and "unpinned acme/Tiny-LM@unpinned" in text
    assert "failed acme/Tiny-LM@tampered" in text and "not pinned in the registry" in text
    assert "3 entries: 1 ok, 1 unpinned, 0 not cached, 1 failed" in text


def test_without_download_only_the_cache_is_checked_and_rehashed(zoo) -> None:
    assert {c.tag: c.status for c in verify_registry(model=MODEL)} == {
        "pinned": "missing", "unpinned": "missing", "tampered": "missing"}
    assert zoo.server.requests() == []
    verify_registry(model=MODEL, download=True)
    zoo.server.clear_log()
    checks = _by_tag(verify_registry(model=MODEL))
    assert checks["pinned"].status == "ok" and checks["unpinned"].status == "unpinned"
    assert checks["tampered"].status == "missing"  # its V file was refused, so it never entered the cache
    assert zoo.server.requests() == []
    # a cached file changed on disk behind the cache's back (size and mtime kept): caught by re-hashing
    k = Path(checks["pinned"].files["k"]["path"])
    st = k.stat()
    data = bytearray(k.read_bytes())
    data[-30] ^= 0xFF
    k.write_bytes(bytes(data))
    os.utime(k, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = _by_tag(verify_registry(model=MODEL))["pinned"]
    assert again.status == "failed" and any("the registry pins" in p for p in again.problems)


def test_verify_usage_errors(tmp_path, capsys) -> None:
    assert main(["verify"]) == 2
    assert "--registry" in capsys.readouterr().err
    p = tmp_path / "k.pt"
    write_rotation(p, RotationSet(_orthogonal(1), range(L), "x"))
    assert main(["verify", str(p), "--registry"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["verify", str(p), "--download"]) == 2
    assert "--download goes with --registry" in capsys.readouterr().err
    assert main(["verify", str(p), "--num-layers", str(L), "--head-dim", str(D), "--json"]) == 0  # files as before
    assert json.loads(capsys.readouterr().out)[0]["ok"]


def test_verify_model_takes_model_at_tag(cache_dir, capsys) -> None:
    """``verify --model MODEL@TAG`` (files against that tag's architecture; with --registry only that tag) had
    been refused as an unknown model, though every other command takes the form."""
    import rotationzoo

    smol = "SmolLM2-135M-Instruct"
    k = Path(rotationzoo.__file__).parent / "data" / "rotations" / smol / "hadamard" / "k_rotation_hadamard.pt"
    assert main(["verify", str(k), "--model", f"{smol}@hadamard", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)[0]
    assert report["ok"] and report["num_layers"] == 30 and report["head_dim"] == 64
    assert main(["verify", "--registry", "--model", f"{smol}@hadamard", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checked"] == 1 and [(e["tag"], e["status"]) for e in out["entries"]] == [("hadamard", "ok")]
    assert [c.tag for c in verify_registry(model=f"{smol}@hadamard")] == ["hadamard"]
    for argv in (["verify", str(k), "--model", f"{smol}@nope"], ["verify", "--registry", "--model", f"{smol}@nope"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "has no tag 'nope'" in err and len(err.strip().splitlines()) == 1, err


# -- the CI workflows ----------------------------------------------------------------------------


def _load(name: str) -> dict:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    assert isinstance(data, dict) and data.get("jobs"), name
    return data


def _triggers(data: dict) -> dict:
    # YAML 1.1 reads the bare key `on` as the boolean True
    return data.get("on", data.get(True))


def _run_lines(data: dict) -> list[str]:
    lines = []
    for job in data["jobs"].values():
        for step in job["steps"]:
            for line in str(step.get("run", "")).splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    lines.append(line.strip())
    return lines


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, flags=re.M))


def _check_command(line: str) -> str:
    """Assert that the command a workflow runs exists here; returns what it was."""
    import click
    import typer

    from rotationzoo.cli.main import app

    words = shlex.split(line.split("|")[0])
    while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value before the command
        words = words[1:]
    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), line
        return words[1]
    if words[0] == "make":
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        assert targets and set(targets) <= _make_targets(), (line, _make_targets())
        return "make"
    if words[0] == ".venv/bin/python":
        assert (ROOT / words[1]).is_file(), line
        return words[1]
    if words[0] == ".venv/bin/rotationzoo":
        group = typer.main.get_command(app)
        ctx = click.Context(group, info_name="rotationzoo")
        name = words[1]
        cmd = group.get_command(ctx, name)
        assert cmd is not None, f"no CLI command {name!r}: {line}"
        sub = cmd.make_context(name, list(words[2:]), parent=ctx)  # raises on an unknown option
        assert isinstance(sub, click.Context)
        return f"rotationzoo {name}"
    raise AssertionError(f"unexpected command in a workflow: {line}")


def test_ci_workflow_runs_the_readme_test_command_and_the_registry_check() -> None:
    data = _load("ci.yml")
    triggers = _triggers(data)
    assert "push" in triggers and "pull_request" in triggers
    lines = _run_lines(data)
    assert "make test PYTHON=python" in lines and "make install PYTHON=python" in lines
    assert ".venv/bin/python tools/check_registry.py" in lines
    assert "make test" in (ROOT / "README.md").read_text()  # the README's test command
    assert lines.index("make install PYTHON=python") < lines.index(".venv/bin/python tools/check_registry.py")
    assert {_check_command(line) for line in lines} == {"make", "tools/check_registry.py", "tools/check_install.sh"}


def test_zoo_integrity_workflow_is_scheduled_and_verifies_with_download() -> None:
    data = _load("zoo-integrity.yml")
    triggers = _triggers(data)
    assert triggers["schedule"][0]["cron"].count(" ") == 4 and "workflow_dispatch" in triggers
    lines = _run_lines(data)
    verify = [line for line in lines if "rotationzoo verify" in line]
    assert verify and "--registry" in verify[0] and "--download" in verify[0]
    assert {_check_command(line) for line in lines} == {"make", "tools/check_registry.py", "rotationzoo verify"}
    job = next(iter(data["jobs"].values()))
    assert any(s.get("shell") == "bash" for s in job["steps"] if "rotationzoo verify" in str(s.get("run", "")))


def test_offline_env_wins_over_download(zoo, monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_OFFLINE", "1")
    checks = _by_tag(verify_registry(model=MODEL, download=True))
    assert {t: c.status for t, c in checks.items()} == {"pinned": "missing", "unpinned": "missing",
                                                         "tampered": "missing"}
    assert "ROTATIONZOO_OFFLINE is set" in checks["pinned"].problems[0]
    assert zoo.server.requests() == []


def test_verify_takes_what_the_resolver_takes(tmp_path, capsys) -> None:
    """`verify MODEL@TAG` fetches (here: bundled, offline) and checks against the model; `verify K,V`
    checks both files and their agreement."""
    assert main(["verify", "SmolLM2-135M-Instruct", "--offline", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert len(reports) == 2 and all(r["ok"] and r["num_layers"] == 30 and r["head_dim"] == 64 for r in reports)
    k, v = tmp_path / "k.pt", tmp_path / "v.pt"
    write_rotation(k, RotationSet(_orthogonal(1), range(L), "qqt"))
    write_rotation(v, RotationSet(_orthogonal(2)[:-1], range(L - 1), "sst"))
    assert main(["verify", f"{k},{v}", "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [r["ok"] for r in reports] == [False, False] and "K and V disagree" in reports[0]["problems"][-1]
    assert main(["verify", "NoSuchModel-9B"]) == 1


def test_offline_flag_wins_over_download_and_fetch_options_reach_the_hub(zoo, capsys) -> None:
    """``verify --registry --download --offline`` sends no request (the flag had been dropped: 4 requests to the
    hub); the fetch options of the files mode (--source, --revision, --timeout) reach the registry mode too."""
    argv = ["verify", "--registry", "--download", "--model", MODEL, "--json"]
    assert main([*argv, "--offline"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"ok": 0, "unpinned": 0, "missing": 3, "failed": 0}
    assert "--offline" in out["entries"][0]["problems"][0]
    assert zoo.server.requests() == []
    assert main([*argv, "--source", "modelscope"]) == 1  # the entries name a Hugging Face source only
    assert zoo.server.requests() == [] and "modelscope" in capsys.readouterr().out
    assert main([*argv, "--revision", "no-such-branch"]) == 1
    asked = [r["path"] for r in zoo.server.requests()]
    assert asked and all("no-such-branch" in path for path in asked), asked


@pytest.mark.parametrize("atol", ["nan", "-1", "inf"])
def test_a_tolerance_that_is_not_one_is_a_usage_error(atol, tmp_path, capsys) -> None:
    """--atol nan had passed a file with max|RRᵀ−I| = 8 (every comparison with NaN is false); -1 failed every
    file as 'not orthogonal'. The Python validator refuses them too."""
    p = write_rotation(tmp_path / "k.pt", RotationSet(_orthogonal(1), range(L), "x"))
    assert main(["verify", str(p), "--atol", atol]) == 2
    assert "--atol must be a finite number in [0, 1]" in capsys.readouterr().err
    from rotationzoo.files.validation import validate

    with pytest.raises(ConfigError, match="atol must be a finite number"):
        validate(RotationSet(_orthogonal(1), range(L), "x"), atol=float(atol))
    with pytest.raises(ConfigError, match="checks a RotationSet, got str"):
        validate(str(p))  # type: ignore[arg-type]


def test_verify_against_an_mla_model_refuses_a_tag_it_does_not_have(tmp_path, capsys) -> None:
    """``verify FILE --model GLM-5.2@no-such-tag`` had checked against the latent set, ignoring the tag."""
    p = write_rotation(tmp_path / "k.pt", RotationSet(_orthogonal(1), range(L), "x"))
    assert main(["verify", str(p), "--model", "GLM-5.2@no-such-tag"]) == 1  # as an unknown tag of any model
    assert "has one latent set" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="has one latent set"):
        verify_path(p, model="GLM-5.2@no-such-tag")


def test_verify_path_takes_the_model_as_verify_does(tmp_path, capsys) -> None:
    """verify_path(model=) checks a file against the registry model's layers and head_dim, as verify --model."""
    m = get_model("SmolLM2-135M-Instruct")
    arch = m.tag().architecture
    ok = write_rotation(tmp_path / "ok.pt", RotationSet(layouts.orthogonal(arch.num_layers, arch.head_dim, arch.head_dim, seed=1),
                                                        range(arch.num_layers), "x"))
    short = write_rotation(tmp_path / "short.pt", RotationSet(_orthogonal(1), range(L), "x"))
    assert [r.ok for r in verify_path(ok, model="SmolLM2-135M-Instruct")] == [True]
    bad = verify_path(short, model="SmolLM2-135M-Instruct")
    assert not bad[0].ok and verify_path(short)[0].ok
    assert main(["verify", str(short), "--model", "SmolLM2-135M-Instruct", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)[0]["problems"] == bad[0].problems
