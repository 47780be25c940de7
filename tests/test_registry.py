"""The registry: schema, content, lookup, overlays, and the light CLI commands."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rotationzoo.cli.main import main
from rotationzoo.errors import RegistryError, UnknownModelError, UnknownTagError
from rotationzoo.registry import (
    bundled_registry_path,
    get_entry,
    get_model,
    list_models,
    parse_tag_name,
    schema_path,
)

REPO = Path(__file__).resolve().parents[1]


def _registry_json() -> dict:
    return json.loads(bundled_registry_path().read_text())


def test_registry_matches_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a dev extra")
    schema = json.loads(schema_path().read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(_registry_json(), schema)
    bad = _registry_json()
    bad["models"][0]["tags"]["hadamard"]["files"]["k"]["sha256"] = "XYZ"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_model_card_entries() -> None:
    expected = {
        ("MiniMaxAI/MiniMax-M2.7", "seq30000_prompt107_group128"): (77.27, 81.31),
        ("Qwen/Qwen3-4B-Thinking-2507", "seq20000_prompt83_group128"): (67.27, 67.17),
        ("Qwen/Qwen3-4B-Thinking-2507", "seq20000_prompt85_group128"): None,
        ("Qwen/Qwen3-8B", "seq20000_prompt83_group128"): (56.67, 55.56),
        ("Qwen/Qwen3-32B", "seq16000_prompt69_group128"): (58.49, 60.40),
        ("zai-org/GLM-4.7-FP8", "seq10000_prompt43_group128"): (73.23, 73.57),
    }
    for (mid, tag), result in expected.items():
        e = get_entry(mid, tag)
        assert e.calibration.tokens == int(tag[3:tag.index("_")])
        assert e.calibration.group_size == 128
        assert e.objectives == {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"}
        assert e.files["k"].path == f"{mid.split('/')[1]}/{tag}/k_rotation_qqt_r_h_pbr.pt"
        assert e.files["v"].path.endswith(f"{tag}/v_rotation_sst_r_h_pbr.pt")
        for f in e.files.values():
            assert f.sha256 is None and f.size is None  # unknown here: unpinned, never invented
            assert [s.describe().split("@")[0] for s in f.sources] == [  # the model card's own repo first
                "modelscope:togethercomputer/OSCAR-RotationZoo",
                "huggingface:Zhongzhu/OSCAR-RotationZoo",
                "modelscope:zzz879978/OSCAR-RotationZoo",
                "huggingface:togethercomputer/OSCAR-RotationZoo",
            ]
        if result is None:
            assert e.results == ()
        else:
            assert (e.results[0].bf16, e.results[0].oscar_int2) == result
        assert e.serving.k_clip_ratio == 0.96
        assert e.serving.v_clip_ratio == (0.96 if mid == "Qwen/Qwen3-32B" else 0.92)
        # windows, Lloyd-Max and TP of the authors' per-model recipes (rotation/run/<model>.sh)
        prefix, recent, lloyd_max, tp = RECIPES[mid]
        assert (e.serving.prefix_tokens, e.serving.recent_tokens, e.serving.group_size) == (prefix, recent, 128)
        assert (e.serving.lloyd_max, e.launch.tp_size) == (lloyd_max, tp)
        assert e.launch.recipe and e.launch.recipe.startswith("rotation/run/")
    assert get_entry("MiniMax-M2.7").serving.lloyd_max is True


#: (sink, recent, Lloyd-Max, TP) of the authors' recipes for the model-card entries.
RECIPES = {
    "MiniMaxAI/MiniMax-M2.7": (128, 1024, True, 4),
    "Qwen/Qwen3-4B-Thinking-2507": (64, 256, False, 1),
    "Qwen/Qwen3-8B": (128, 2048, True, 1),
    "Qwen/Qwen3-32B": (64, 256, False, 2),
    "zai-org/GLM-4.7-FP8": (64, 256, False, 8),
}


def test_upstream_entries_match_files(upstream_dir: Path) -> None:
    """Every shared upstream file is a pinned registry file with the same sha256 and size."""
    from rotationzoo.files.validation import sha256_file

    by_sha = {}
    for m in list_models():
        for t in m.tags.values():
            for f in t.files.values():
                if f.sha256:
                    by_sha[f.sha256] = (m, t, f)
    files = sorted(upstream_dir.rglob("*.pt"))
    assert len(files) == 16
    for path in files:
        m, t, f = by_sha[sha256_file(path)]
        assert f.size == path.stat().st_size
        (src,) = f.sources
        assert src.type == "url" and src.pinned
        assert src.url.startswith("https://github.com/FutureMLS-Lab/OSCAR/raw/") and src.url.endswith(f.path)
        from rotationzoo import read_rotation

        rs = read_rotation(path)
        assert rs.head_dim == m.architecture.head_dim
        assert rs.layer_ids == m.architecture.expected_layer_ids()


def test_lookup_aliases_case_insensitive() -> None:
    assert get_model("qwen3-8b").id == "Qwen/Qwen3-8B"
    assert get_model("QWEN/QWEN3-8B").id == "Qwen/Qwen3-8B"
    assert get_model("MiniMax/MiniMax-M2.7").id == "MiniMaxAI/MiniMax-M2.7"
    assert get_entry("Qwen3-8B").name == "seq20000_prompt83_group128"
    assert get_entry("Qwen3-8B", "LONGBENCH-seq150000_prompt44_group128").calibration.dataset == "LongBench"
    with pytest.raises(UnknownModelError) as ei:
        get_model("Qwen3-9B")
    assert "Qwen3-8B" in ei.value.suggestions and "did you mean" in str(ei.value)
    with pytest.raises(UnknownTagError, match="did you mean 'seq20000_prompt83_group128'"):
        get_entry("Qwen3-8B", "seq20000_prompt84_group128")


def test_hybrid_layer_ids() -> None:
    arch = get_model("Qwen3.5-4B").architecture
    assert arch.expected_layer_ids() == tuple(range(3, 32, 4)) and arch.head_dim == 256


def test_parse_tag_name() -> None:
    assert parse_tag_name("seq20000_prompt83_group128") == {"tokens": 20000, "prompts": 83, "group_size": 128}
    assert parse_tag_name("hadamard") is None


def _overlay(tmp_path: Path, models: list) -> Path:
    p = tmp_path / "extra.json"
    p.write_text(json.dumps({"registry_version": 1, "models": models}))
    return p


def test_overlay_overrides_and_adds(tmp_path: Path, monkeypatch) -> None:
    qwen = next(m for m in _registry_json()["models"] if m["id"] == "Qwen/Qwen3-8B")
    qwen["tags"]["seq20000_prompt83_group128"]["files"]["k"]["sha256"] = "a" * 64
    qwen["tags"]["seq20000_prompt83_group128"]["files"]["k"]["size"] = 123
    new = json.loads(json.dumps(qwen))
    new["id"], new["aliases"] = "acme/Tiny-1B", ["tiny"]
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(_overlay(tmp_path, [qwen, new])))
    e = get_entry("qwen3-8b")
    assert e.files["k"].sha256 == "a" * 64 and e.files["k"].size == 123
    assert get_model("tiny").id == "acme/Tiny-1B"
    assert get_model("Qwen3-8B").origin.endswith("extra.json")
    assert len(list_models()) == len(_registry_json()["models"]) + 1


def test_overlay_errors(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(tmp_path / "nope.json"))
    with pytest.raises(RegistryError, match="does not exist"):
        list_models()
    bad = next(m for m in _registry_json()["models"] if m["id"] == "Qwen/Qwen3-8B")
    bad["default_tag"] = "nope"
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(_overlay(tmp_path, [bad])))
    with pytest.raises(RegistryError, match="default_tag 'nope' is not one of its tags"):
        list_models()
    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(tmp_path / "broken.json"))
    with pytest.raises(RegistryError, match="not valid JSON"):
        list_models()


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_list_json(capsys) -> None:
    assert main(["list", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [m["id"] for m in out] == [m["id"] for m in _registry_json()["models"]]
    assert all("default_tag" in m for m in out)


def test_cli_info_json(capsys) -> None:
    assert main(["info", "qwen3-8b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["id"] == "Qwen/Qwen3-8B" and out["default_tag"] == "seq20000_prompt83_group128"
    assert out["tag"]["serving"]["k_clip_ratio"] == 0.96 and out["tag"]["serving"]["v_clip_ratio"] == 0.92


def test_cli_info_unknown_suggests(capsys) -> None:
    assert main(["info", "Qwen3-9B"]) == 1
    err = capsys.readouterr().err
    assert "unknown model 'Qwen3-9B'" in err and "Qwen3-8B" in err


def test_cli_verify(upstream_dir: Path, tmp_path: Path, capsys) -> None:
    files = [str(p) for p in sorted((upstream_dir / "qwen3.5-4B").rglob("*.pt"))]
    assert main(["verify", *files, "--model", "Qwen3.5-4B", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)
    assert len(reports) == 4 and all(r["ok"] for r in reports)
    # the same files checked against the wrong model fail with exit 1
    assert main(["verify", files[0], "--num-layers", "36", "--head-dim", "128"]) == 1
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "│ NO │" in out and "shape (256, 256) exceeds max_head_dim=128; the model's head_dim is 128" in flat


def test_cli_verify_bad_file_exit_code(tmp_path: Path, capsys) -> None:
    p = tmp_path / "junk.pt"
    p.write_bytes(b"PK\x03\x04 definitely not a zip")
    assert main(["verify", str(p), "--json"]) == 1
    (report,) = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["problems"]


def test_cli_version(capsys) -> None:
    from rotationzoo import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rotationzoo {__version__}"


def test_list_imports_nothing_heavy() -> None:
    """`rotationzoo list` stays light: no torch, no hub clients, no safetensors (its start-up time is
    measured by tools/bench_client.py, not asserted here)."""
    heavy = ("torch", "huggingface_hub", "modelscope", "safetensors", "transformers", "numpy")
    code = (
        "import sys; from rotationzoo.cli.main import main; rc = main(['list', '--json']); assert rc == 0;"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1:] in ([], [""]), f"imported: {r.stderr.strip()}"
