"""tools/check_registry.py: passes on the bundled registry, fails on broken ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "check_registry.py"


def run(path: Path | None = None, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(TOOL), *([str(path)] if path else []), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def broken(tmp_path: Path, mutate) -> Path:
    data = json.loads((ROOT / "registry.json").read_text())
    mutate(data)
    p = tmp_path / "registry.json"
    p.write_text(json.dumps(data, indent=2))
    return p


def test_bundled_registry_passes() -> None:
    r = run(None, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["errors"] == []
    # the six model-card entries and the four zoo tags of the current recipes (Qwen3-30B-A3B perhead and
    # shared, MiniMax-M3, Gemma-4-12B-it): 10 tags × 2 files; the authors publish no checksums
    assert out["unpinned_files"] == 26
    r = run()
    assert "files without sha256 (unpinned)" in r.stdout and "hub sources not pinned" in r.stdout


def _dup_alias(d):
    d["models"][2]["aliases"].append("Qwen3-8B")


def _bad_sha(d):
    d["models"][3]["tags"]["seq20000_prompt83_group128"]["files"]["k"]["sha256"] = "abc123"


def _no_default(d):
    d["models"][3]["default_tag"] = "seq99_prompt1_group128"


def _bad_size(d):
    d["models"][8]["tags"]["calibrated"]["files"]["v"]["size"] = 0


def _bad_source(d):
    d["models"][3]["tags"]["seq20000_prompt83_group128"]["sources"][0]["repo"] = "no-namespace"


def _path_wrong_tag(d):
    d["models"][3]["tags"]["seq20000_prompt83_group128"]["files"]["v"]["path"] = "Qwen3-8B/other/v_rotation_sst_r_h_pbr.pt"


def _swapped_sides(d):
    files = d["models"][3]["tags"]["seq20000_prompt83_group128"]["files"]
    files["k"]["path"], files["v"]["path"] = files["v"]["path"], files["k"]["path"]


def _smollm2_tag(d, name=None):
    m = next(m for m in d["models"] if m["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct")
    return m["tags"][name or m["default_tag"]]


def _per_head_said_layer(d):
    del _smollm2_tag(d)["grouping"]  # the bundled default's files hold one rotation per KV head


def _per_layer_said_kv_head(d):
    _smollm2_tag(d, "hadamard")["grouping"] = "kv_head"  # the bundled Hadamard files: one rotation per layer


@pytest.mark.parametrize(
    "mutate, message",
    [
        (_dup_alias, "name 'qwen3-8b' is also used by"),
        (_bad_sha, "is not 64 lowercase hex digits"),
        (_no_default, "default_tag 'seq99_prompt1_group128' is not one of its tags"),
        (_bad_size, "must be a positive integer"),
        (_bad_source, "is not a NAMESPACE/NAME id"),
        (_path_wrong_tag, "is not under a folder named after the tag"),
        (_swapped_sides, "does not name a K file"),
        (_per_head_said_layer, "hold one rotation per KV head but the entry's grouping is layer; set \"grouping\""),
        (_per_layer_said_kv_head, "hold one rotation per layer but the entry's grouping is kv_head; remove"),
    ],
)
def test_broken_registry_fails(tmp_path: Path, mutate, message: str) -> None:
    r = run(broken(tmp_path, mutate))
    assert r.returncode == 1
    assert message in r.stdout, r.stdout


def test_unreadable_registry(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text("{oops")
    r = run(p)
    assert r.returncode == 1 and "error:" in r.stderr
