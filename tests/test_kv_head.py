"""Per-KV-head rotation files (``source_grouping: "kv_head"``, ``[H_kv, d, d]`` per layer):
format, validation, verify, export, and the engines that refuse them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rotationzoo.errors import ExportError, InvalidRotationError, RotationFileError
from rotationzoo.export import export, read_exported
from rotationzoo.files.format import RotationFormatWarning, RotationSet, read_rotation, write_rotation
from rotationzoo.files.pair import resolve_pair
from rotationzoo.serving import ServingError, launch_spec
from rotationzoo.files.validation import validate, verify_file

from helpers import run_cli

L, H, D = 30, 3, 64  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64


def per_head_set(seed: int = 0, layers: int = L, heads: int = H, d: int = D) -> RotationSet:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(layers, heads, d, d, generator=g, dtype=torch.float64))
    eig = torch.rand(layers, heads, d, generator=g, dtype=torch.float64).sort(dim=-1).values
    return RotationSet(rotations=q.float(), layer_ids=tuple(range(layers)), objective="qqt_r_h_pbr",
                       eigenvalues=eig.float(), source_grouping="kv_head")


@pytest.fixture
def pair_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pair"
    write_rotation(d / "k_rotation.pt", per_head_set(1))
    write_rotation(d / "v_rotation.pt", per_head_set(2))
    return d


@pytest.mark.parametrize("suffix", ["pt", "safetensors"])
def test_round_trip_keeps_every_head(tmp_path: Path, suffix: str) -> None:
    rs = per_head_set()
    back = read_rotation(write_rotation(tmp_path / f"k.{suffix}", rs), head_dim=D, num_layers=L, num_kv_heads=H)
    assert back.per_head and back.num_kv_heads == H and back.source_grouping == "kv_head"
    assert torch.equal(back.rotations, rs.rotations) and torch.equal(back.eigenvalues, rs.eigenvalues)
    assert back[7].shape == (H, D, D)
    assert validate(back, head_dim=D, num_layers=L, num_kv_heads=H).ok


def test_the_file_holds_one_h_d_d_tensor_per_layer(tmp_path: Path) -> None:
    obj = torch.load(write_rotation(tmp_path / "k.pt", per_head_set()), weights_only=True)
    assert obj["source_grouping"] == "per_kv_head" and obj["format_version"] == 2  # the authors' V2 layout
    assert obj["layers"][3]["rotation"].shape == (H, D, D) and obj["layers"][3]["eigenvalues"].shape == (H, D)


def test_validation_names_the_layer_and_the_head() -> None:
    rs = per_head_set()
    rs.rotations[4, 2, 0, 0] += 1e-3
    problems = validate(rs, raise_on_error=False).problems
    assert len(problems) == 1 and "layer 4, head 2: not orthogonal" in problems[0]
    rs.rotations[5, 1, 3, 3] = float("nan")
    with pytest.raises(InvalidRotationError, match="layer 5, head 1: 1 non-finite"):
        validate(rs)


def test_head_count_must_match_the_model(tmp_path: Path) -> None:
    p = write_rotation(tmp_path / "k.pt", per_head_set())
    with pytest.raises(RotationFileError, match="for 3 KV heads, but the model has 4"):
        read_rotation(p, num_kv_heads=4)
    with pytest.raises(RotationFileError, match="3 KV heads exceeds max_kv_heads=2"):
        read_rotation(p, num_kv_heads=2)
    assert "for 3 KV heads, but the model has 8" in validate(per_head_set(), num_kv_heads=8,
                                                               raise_on_error=False).problems[0]
    assert validate(RotationSet(rotations=per_head_set().rotations[:, 0], layer_ids=tuple(range(L))),
                    num_kv_heads=8).ok  # one rotation per layer fits any head count


def test_the_shape_decides_the_grouping(tmp_path: Path) -> None:
    rs = per_head_set(layers=2)
    assert RotationSet(rotations=rs.rotations, layer_ids=(0, 1)).per_head  # no label needed
    with pytest.raises(RotationFileError, match="does not match the rotations' shape"):
        RotationSet(rotations=rs.rotations, layer_ids=(0, 1), source_grouping="layer")
    with pytest.raises(RotationFileError, match="does not match the rotations' shape"):
        RotationSet(rotations=rs.rotations[:, 0], layer_ids=(0, 1), source_grouping="kv_head")
    obj = rs.to_dict()
    obj["source_grouping"] = "layer"  # mislabelled: read by shape, with one warning
    torch.save(obj, tmp_path / "a.pt")
    with pytest.warns(RotationFormatWarning, match="disagrees with the rotations' shape"):
        assert read_rotation(tmp_path / "a.pt").per_head
    obj = rs.to_dict()
    for f in ("rotation", "eigenvalues"):  # ragged head counts are read
        obj["layers"][1][f] = obj["layers"][1][f][:2].clone()
    torch.save(obj, tmp_path / "b.pt")
    got = read_rotation(tmp_path / "b.pt")
    assert got.ragged and [t.shape[0] for t in got.rotations] == [H, 2]
    with pytest.raises(RotationFileError, match="different numbers of KV heads"):
        _ = got.num_kv_heads
    obj = rs.to_dict()
    obj["layers"][0]["rotation"] = obj["layers"][0]["rotation"][0].clone()
    torch.save(obj, tmp_path / "c.pt")
    with pytest.raises(RotationFileError, match="mixes per-KV-head and per-layer"):
        read_rotation(tmp_path / "c.pt")


def test_byte_cap_scales_with_the_model_heads(tmp_path: Path) -> None:
    p = write_rotation(tmp_path / "k.pt", per_head_set())
    read_rotation(p, head_dim=D, num_layers=L, num_kv_heads=H)  # 3 heads' worth of bytes allowed
    with pytest.raises(RotationFileError, match="more than max_bytes"):
        read_rotation(p, max_bytes=L * D * D * 4 * 2)


def test_cli_verify_reads_a_per_head_pair(pair_dir: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, "verify", str(pair_dir), "--model", "SmolLM2-135M-Instruct", "--json")
    assert rc == 0, err
    reports = json.loads(out)
    assert [r["source_grouping"] for r in reports] == ["kv_head", "kv_head"]
    assert [r["num_kv_heads"] for r in reports] == [H, H]
    assert all(r["max_orthogonality_error"] < 1e-5 for r in reports)


def test_verify_refuses_heads_the_model_does_not_have(tmp_path: Path, capsys) -> None:
    write_rotation(tmp_path / "k_rotation.pt", per_head_set(heads=2))
    rep = verify_file(tmp_path / "k_rotation.pt", head_dim=D, num_kv_heads=H)
    assert not rep.ok and "for 2 KV heads, but the model has 3" in rep.problems[0]
    rc, _, _ = run_cli(capsys, "verify", str(tmp_path / "k_rotation.pt"), "--model", "SmolLM2-135M-Instruct")
    assert rc == 1


def test_serving_engines_refuse_per_head_rotations(pair_dir: Path) -> None:
    """Every target that reads one rotation per layer refuses per-KV-head files in one line; the authors'
    current tree (--engine sglang) serves them and names the log line that proves it read them."""
    for engine in ("sglang-legacy", "vllm", "llamacpp"):
        with pytest.raises(ServingError, match=f"per-KV-head rotations .* cannot be served by {engine}") as ei:
            launch_spec(str(pair_dir), engine=engine)
        assert "\n" not in str(ei.value)
    spec = launch_spec(str(pair_dir), engine="sglang")
    assert spec.env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"
    assert all(f"[per-head: {H} kv heads]" in c for c in spec.checks) and len(spec.checks) == 2


def test_cli_serve_args_refuses_with_one_line(pair_dir: Path, capsys) -> None:
    rc, out, err = run_cli(capsys, "serve-args", str(pair_dir), "--engine", "sglang-legacy")
    assert rc != 0 and out == ""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "per-KV-head" in lines[0], err


def test_export_safetensors_keeps_heads_and_gguf_refuses(pair_dir: Path, tmp_path: Path) -> None:
    out = export(str(pair_dir), tmp_path / "pair.safetensors", to="safetensors")
    back = read_exported(out)
    src = resolve_pair(str(pair_dir))
    assert back.per_head and torch.equal(back.k.rotations, src.k.rotations)
    assert torch.equal(back.v.rotations, src.v.rotations)
    with pytest.raises(ExportError, match="per KV head"):
        export(str(pair_dir), tmp_path / "pair.gguf", to="gguf")
    assert not (tmp_path / "pair.gguf").exists()
