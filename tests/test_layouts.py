"""The authors' current rotation files: V1 (+ calibration, ragged), V2 per KV head, V3 (OSCAR-2: key
centering, inverse companions, metadata): read, validate, refuse what is not a rotation file, write in
their layouts, export, and apply (centering and companions are exact when nothing is quantized)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import layouts
from rotationzoo.errors import ExportError, InvalidRotationError, PairError, RotationFileError
from rotationzoo.export import export, read_exported
from rotationzoo.files.format import RotationFormatWarning, read_rotation, write_rotation
from rotationzoo.headdims import HeadDims
from rotationzoo.files.pair import resolve_pair
from rotationzoo.files.rotation_set import RotationSet
from rotationzoo.files.validation import validate, verify_file

from helpers import run_cli


def save(tmp_path: Path, name: str, obj) -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, p)
    return p


def server_load(path: Path, d: int) -> dict[int, torch.Tensor]:
    """What the authors' server reads: ``torch.load``, ``layers``, dispatch on ``rotation.dim()``."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    mats = {}
    for lid, ldata in state["layers"].items():
        r = ldata["rotation"]
        if r.dim() == 3:
            assert r.shape[1:] == (d, d)
        else:
            assert r.shape == (d, d)
        mats[int(lid)] = r
    return mats


# -- reading and validating each layout ------------------------------------------------------------


def test_v1_with_calibration_keeps_it(tmp_path, capsys) -> None:
    p = save(tmp_path, "k_rotation_qqt_r_h_pbr.pt", layouts.v1(with_calibration=True))
    rs = read_rotation(p)
    assert rs.calibration == layouts.calibration() and rs.format_version == 1 and not rs.per_head
    code, out, _ = run_cli(capsys, "verify", str(p), "--num-layers", "4", "--head-dim", "16", "--json")
    (rep,) = json.loads(out)
    assert code == 0 and rep["calibration"]["prompt_sha256"] == "ab" * 32 and rep["layout_version"] == 1


def test_v2_per_kv_head_is_read_and_verified(tmp_path, capsys) -> None:
    p = save(tmp_path, "k_perhead.pt", layouts.v2(layers=4, heads=2, d=16))
    rs = read_rotation(p)
    assert rs.per_head and rs.num_kv_heads == 2 and rs.eigenvalues is None and rs.format_version == 2
    code, out, _ = run_cli(capsys, "verify", str(p), "--num-layers", "4", "--head-dim", "16", "--json")
    (rep,) = json.loads(out)
    assert code == 0 and rep["source_grouping"] == "kv_head" and rep["format_version"] == 2
    assert rep["num_kv_heads"] == 2 and rep["companions"] == []


@pytest.mark.parametrize("shared", [False, True])
def test_v3_with_k_mean_is_read_and_verified(tmp_path, capsys, shared) -> None:
    p = save(tmp_path, "k_rotation_oscar2_center.pt", layouts.v3_key(shared=shared))
    rs = read_rotation(p)
    assert rs.k_mean is not None and rs.k_mean.shape == ((4, 16) if shared else (4, 2, 16))
    assert rs.transform == {"key": "center", "centered": True, "orthogonal": True} and rs.centered
    code, out, _ = run_cli(capsys, "verify", str(p), "--num-layers", "4", "--head-dim", "16", "--json")
    (rep,) = json.loads(out)
    assert code == 0, rep["problems"]
    assert rep["format_version"] == 3 and rep["companions"] == ["k_mean"]
    assert rep["source_grouping"] == ("layer" if shared else "kv_head")
    code, out, _ = run_cli(capsys, "verify", str(p), "--num-layers", "4", "--head-dim", "16")
    assert code == 0 and "k_mean" in out


def test_v3_non_orthogonal_pair_validates_through_its_inverse(tmp_path) -> None:
    k = save(tmp_path, "k.pt", layouts.v3_key(orthogonal_transform=False, centered=False))
    v = save(tmp_path, "v.pt", layouts.v3_value(orthogonal_transform=False))
    pair = resolve_pair(f"{k},{v}")
    assert not pair.orthogonal and pair.k.q_rotation is not None and pair.v.o_rotation is not None
    rep = verify_file(k)
    assert rep.ok and rep.orthogonal is False and rep.max_inverse_error < 1e-5


def test_ragged_head_dims(tmp_path, capsys) -> None:
    p = save(tmp_path, "k.pt", layouts.v1_ragged({0: 16, 1: 16, 2: 32, 3: 16}))
    rs = read_rotation(p, head_dim=HeadDims(16, {2: 32}))
    assert rs.ragged and rs.head_dims == HeadDims(16, {2: 32}) and [t.shape[0] for t in rs.rotations] == [16, 16, 32, 16]
    with pytest.raises(RotationFileError, match="head_dims"):
        _ = rs.head_dim
    assert validate(rs, num_layers=4, head_dim=HeadDims(16, {2: 32})).ok
    code, out, _ = run_cli(capsys, "verify", str(p), "--num-layers", "4", "--head-dim", "16,2:32", "--json")
    (rep,) = json.loads(out)
    assert code == 0 and rep["head_dim"] is None and rep["head_dims"] == {"default": 16, "layers": {"2": 32}}
    # Python takes the flag's spec too: the same report from verify_path(head_dim="16,2:32")
    from rotationzoo.files.localpair import verify_path

    assert HeadDims.of("16,2:32") == HeadDims(16, {2: 32})
    assert verify_path(p, num_layers=4, head_dim="16,2:32")[0].to_json() == rep
    with pytest.raises(RotationFileError, match="exceeds max_head_dim=16"):
        read_rotation(p, head_dim=16)  # refused before loading
    with pytest.raises(RotationFileError, match="layer 1: head_dim 16, but the model needs 32"):
        read_rotation(p, head_dim=HeadDims(32, {0: 16, 3: 16}))
    code, _, err = run_cli(capsys, "verify", str(p), "--head-dim", "16,2:64")
    assert code == 1
    code, _, err = run_cli(capsys, "verify", str(p), "--head-dim", "16,x")
    assert code == 2 and "head_dim spec" in err


def test_the_earlier_kv_head_label_is_still_read(tmp_path) -> None:
    obj = layouts.v2()
    obj["format_version"], obj["source_grouping"] = 1, "kv_head"
    assert read_rotation(save(tmp_path, "k.pt", obj)).per_head


def test_a_label_that_disagrees_with_the_shape_warns_once(tmp_path) -> None:
    obj = layouts.v1()
    obj["source_grouping"] = "per_kv_head"
    p = save(tmp_path, "k.pt", obj)
    with pytest.warns(RotationFormatWarning, match="disagrees with the rotations' shape") as seen:
        rs = read_rotation(p)
    assert not rs.per_head and len(seen) == 1
    assert verify_file(p).warnings and verify_file(p).ok


# -- refusals ----------------------------------------------------------------------------------------


def _with(obj, fn):
    fn(obj)
    return obj


REFUSED = {
    "moments": (layouts.moments(), "a calibration moments file"),
    "rows": (layouts.rows(), "a calibration rows file"),
    "mla": (layouts.mla_latent(), "an MLA latent rotation"),
    "partial k_mean": (_with(layouts.v3_key(), lambda o: o["layers"][2].pop("k_mean")),
                       "'k_mean' is on layers 0, 1, 3 but not on every layer"),
    "k_mean tail": (_with(layouts.v3_key(), lambda o: [e.update(k_mean=torch.zeros(2, 8)) for e in o["layers"].values()]),
                    r"k_mean must be \[16\] or \[2, 16\]"),
    "k_mean heads": (_with(layouts.v3_key(), lambda o: [e.update(k_mean=torch.zeros(3, 16)) for e in o["layers"].values()]),
                     "the rotation's head axis"),
    "q_rotation shape": (_with(layouts.v3_key(orthogonal_transform=False),
                               lambda o: [e.update(q_rotation=e["q_rotation"][0]) for e in o["layers"].values()]),
                         "q_rotation must have the rotation's shape"),
    "unknown tensor": (_with(layouts.v2(), lambda o: o["layers"][0].update(k_scale=torch.ones(2))),
                       "holds a tensor 'k_scale' this rotationzoo does not know"),
    "nested transform": (_with(layouts.v3_key(), lambda o: o.update(transform={"key": {"a": 1}})),
                         r"transform\['key'\]"),
    "orthogonal not bool": (_with(layouts.v3_key(), lambda o: o["transform"].update(orthogonal="yes")),
                            "must be true or false"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_is_not_a_usable_rotation_file_is_refused_with_one_line(tmp_path, capsys, case) -> None:
    obj, pattern = REFUSED[case]
    p = save(tmp_path, "x.pt", obj)
    with pytest.raises(RotationFileError, match=pattern):
        read_rotation(p)
    code, _, err = run_cli(capsys, "verify", str(p))
    assert code == 1 and len(err.strip().splitlines()) == 1 or code == 1
    code, out, _ = run_cli(capsys, "verify", str(p), "--json")
    assert code == 1 and not json.loads(out)[0]["ok"]


INVALID = {
    "q_rotation not the inverse": (
        _with(layouts.v3_key(orthogonal_transform=False, centered=False),
              lambda o: [e.update(q_rotation=e["rotation"].clone()) for e in o["layers"].values()]),
        "q_rotation is not the rotation's inverse transpose"),
    "non-orthogonal without companion": (
        _with(layouts.v3_key(orthogonal_transform=False, centered=False),
              lambda o: [e.pop("q_rotation") for e in o["layers"].values()]),
        "not orthogonal, but it carries no q_rotation"),
    "says orthogonal, is not": (
        _with(layouts.v3_key(orthogonal_transform=False, centered=False),
              lambda o: o["transform"].update(orthogonal=True)),
        "not orthogonal, max"),
    "non-finite k_mean": (_with(layouts.v3_key(), lambda o: o["layers"][1]["k_mean"].__setitem__((0, 0), float("nan"))),
                          "layer 1: k_mean is not finite"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_companions_fail_validation(tmp_path, capsys, case) -> None:
    obj, pattern = INVALID[case]
    p = save(tmp_path, "k.pt", obj)
    with pytest.raises(InvalidRotationError, match=pattern):
        validate(read_rotation(p))
    code, out, _ = run_cli(capsys, "verify", str(p), "--json")
    assert code == 1 and any(pattern.split(",")[0] in x for x in json.loads(out)[0]["problems"])


def test_verify_of_a_moments_file_is_one_line_without_traceback(tmp_path) -> None:
    import subprocess
    import sys

    p = save(tmp_path, "oscar_moments_rank0.pt", layouts.moments())
    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "verify", str(p)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "calibration moments file" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_an_mla_latent_folder_is_named(tmp_path) -> None:
    for lid in (0, 1):
        save(tmp_path / "mla", f"layer_{lid}.pt", layouts.mla_latent())
    with pytest.raises(PairError, match="an MLA latent rotation folder"):
        resolve_pair(tmp_path / "mla")


def test_companions_on_the_wrong_side_are_refused(tmp_path) -> None:
    k = save(tmp_path, "k.pt", layouts.v3_key())
    with pytest.raises(InvalidRotationError, match="V rotations carry k_mean"):
        resolve_pair(f"{save(tmp_path, 'k2.pt', layouts.v2())},{k}")


# -- writing in the authors' layouts ---------------------------------------------------------------


def test_each_set_is_written_in_the_layout_it_needs(tmp_path) -> None:
    shared = read_rotation(save(tmp_path, "a.pt", layouts.v1()))
    per_head = read_rotation(save(tmp_path, "b.pt", layouts.v2()))
    centered = read_rotation(save(tmp_path, "c.pt", layouts.v3_key()))
    centered_shared = read_rotation(save(tmp_path, "d.pt", layouts.v3_key(shared=True)))
    for rs, version, label in ((shared, 1, "layer"), (per_head, 2, "per_kv_head"), (centered, 3, "head"),
                               (centered_shared, 3, "layer"), (centered.without("k_mean", "transform"), 2, "per_kv_head")):
        out = write_rotation(tmp_path / "out" / f"k_{version}_{label}.pt", rs)
        obj = torch.load(out, weights_only=True)
        assert obj["format_version"] == version and obj["source_grouping"] == label
        assert all(isinstance(k, int) for k in obj["layers"])
        mats = server_load(out, 16)  # a plain weights-only load dispatching on rotation.dim() gets the matrices
        for lid in rs.layer_ids:
            assert torch.equal(mats[lid], rs[lid])
        back = read_rotation(out)
        assert back.companions == rs.companions and back.transform == rs.transform
        assert back.calibration == rs.calibration
        if rs.k_mean is not None:
            assert torch.equal(back.k_mean, rs.k_mean)


def test_a_per_head_set_is_never_one_bare_stacked_tensor(tmp_path) -> None:
    rs = RotationSet(rotations=layouts.orthogonal(4, 2, 16, 16), layer_ids=range(4))
    obj = torch.load(write_rotation(tmp_path / "k.pt", rs), weights_only=True)
    assert set(obj["layers"]) == {0, 1, 2, 3} and obj["layers"][0]["rotation"].shape == (2, 16, 16)


def test_safetensors_single_file_keeps_companions(tmp_path) -> None:
    rs = read_rotation(save(tmp_path, "k.pt", layouts.v3_key(orthogonal_transform=False)))
    back = read_rotation(write_rotation(tmp_path / "k.safetensors", rs))
    assert back.companions == ("q_rotation", "k_mean") and torch.equal(back.q_rotation, rs.q_rotation)
    assert back.transform == rs.transform and back.calibration == rs.calibration


# -- export ------------------------------------------------------------------------------------------


def test_pair_safetensors_round_trips_the_head_axis_and_companions(tmp_path) -> None:
    k = save(tmp_path, "k_rotation_x.pt", layouts.v3_key())
    v = save(tmp_path, "v_rotation_x.pt", layouts.v3_value(orthogonal_transform=False))
    out = export(f"{k},{v}", tmp_path / "pair.safetensors", to="safetensors")
    back = read_exported(out)
    src = resolve_pair(f"{k},{v}")
    for side in "kv":
        assert back[side].per_head and torch.equal(back[side].stacked(), src[side].stacked())
        assert back[side].companions == src[side].companions and back[side].transform == src[side].transform
    assert torch.equal(back.k.k_mean, src.k.k_mean) and torch.equal(back.v.o_rotation, src.v.o_rotation)


@pytest.mark.parametrize("kind, pattern", [
    ("per_head", "per KV head"), ("centered", "centered"), ("non_orthogonal", "not orthogonal")])
def test_gguf_export_refuses_what_llamacpp_cannot_apply(tmp_path, capsys, kind, pattern) -> None:
    k = {"per_head": layouts.v2(), "centered": layouts.v3_key(shared=True),
         "non_orthogonal": layouts.v3_key(shared=True, centered=False, orthogonal_transform=False)}[kind]
    v = layouts.v3_value(shared=True) if kind != "per_head" else layouts.v2(seed=3)
    kp, vp = save(tmp_path, "k_rotation_a.pt", k), save(tmp_path, "v_rotation_a.pt", v)
    with pytest.raises(ExportError, match=pattern):
        export(f"{kp},{vp}", tmp_path / "r.gguf", to="gguf")
    code, _, err = run_cli(capsys, "export", f"{kp},{vp}", "--to", "gguf", "--out", str(tmp_path / "r.gguf"))
    assert code == 1 and pattern in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.gguf").exists()


def test_info_shows_what_the_cached_files_hold(cache_dir, capsys) -> None:
    from rotationzoo import hub
    from rotationzoo.hashing import sha256_file
    from rotationzoo.registry import get_entry

    entry = get_entry("Qwen3-8B")
    folder = hub.entry_dir(cache_dir, entry)
    folder.mkdir(parents=True)
    for side, seed in (("k", 0), ("v", 1)):
        p = save(folder, entry.files[side].filename, layouts.v1(layers=36, d=128, seed=seed, with_calibration=True))
        hub.record_verified(p, entry, side, sha=sha256_file(p), source="url:https://example.invalid/x")
    code, out, _ = run_cli(capsys, "info", "Qwen3-8B", "--json")
    cached = json.loads(out)["tag"]["files"]["k"]["cached"]
    assert code == 0 and cached["calibration"]["prompt_sha256"] == "ab" * 32 and cached["format_version"] == 1
    code, out, _ = run_cli(capsys, "info", "Qwen3-8B")
    assert code == 0 and "calibration: generation_id g-0001" in out
