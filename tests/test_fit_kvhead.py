"""Per-KV-head rotations in the fitter: ``grouping="kv_head"`` (closed form, refinement, files, CLI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_cli
import torch

from rotationzoo.errors import FitError
from rotationzoo.fit import (
    LayerAccumulator,
    Refinement,
    fit_rotations,
    output_file_names,
    refine_dump,
    write_dump,
    write_fitted,
)
from rotationzoo.files.format import read_rotation

D = 16


def _head_chunks(hq: int, hkv: int, sizes: list[int], *, seed: int) -> list[dict]:
    """Every KV head (and its query group) with its own planted covariance: its own eigenbasis and spectrum."""
    g = torch.Generator().manual_seed(seed)
    gq = hq // hkv
    mixes = []
    for h in range(hkv):
        spectrum = torch.linspace(0.3, 3.0, D) ** (1 + h)
        mixes.append({kind: torch.linalg.qr(torch.randn(D, D, generator=g))[0] * spectrum.roll(i * 5)
                      for i, kind in enumerate("qkv")})
    out = []
    for n in sizes:
        q = torch.cat([torch.randn(n, gq, D, generator=g) @ m["q"] for m in mixes], dim=1)
        k = torch.stack([torch.randn(n, D, generator=g) @ m["k"] for m in mixes], dim=1)
        v = torch.stack([torch.randn(n, D, generator=g) @ m["v"] for m in mixes], dim=1)
        out.append({"q": q.float(), "k": k.float(), "v": v.float(), "seq_lens": [n]})
    return out


def _dump(root: Path, *, hq: int = 4, hkv: int = 2, layers=(0, 1), sizes=(5, 300, 211)) -> Path:
    return write_dump(root, {lid: _head_chunks(hq, hkv, list(sizes), seed=10 + lid) for lid in layers})


def _head_dump(src: Path, dst: Path, h: int, hq: int, hkv: int, layers=(0, 1), sizes=(5, 300, 211)) -> Path:
    """The same activations, only KV head ``h`` and its query group: a one-KV-head dump."""
    gq = hq // hkv
    chunks = {lid: [{"q": c["q"][:, h * gq:(h + 1) * gq], "k": c["k"][:, h:h + 1], "v": c["v"][:, h:h + 1],
                     "seq_lens": c["seq_lens"]} for c in _head_chunks(hq, hkv, list(sizes), seed=10 + lid)]
              for lid in layers}
    return write_dump(dst, chunks)


@pytest.mark.parametrize("objective,composition,group_size", [("qqt_sst", "r_h_pbr", None),
                                                               ("ktk_vtv", "r_pbr_hg", 8)])
def test_each_head_gets_the_rotation_of_its_own_data(tmp_path, objective, composition, group_size):
    hq, hkv = 4, 2
    root = _dump(tmp_path / "dump", hq=hq, hkv=hkv)
    res = fit_rotations(root, objective, composition, group_size=group_size, grouping="kv_head")
    assert res.grouping == "kv_head" and res.summary()["grouping"] == "kv_head"
    for side in ("k", "v"):
        rs = getattr(res, side)
        assert rs.rotations.shape == (2, hkv, D, D) and rs.eigenvalues.shape == (2, hkv, D)
        assert rs.source_grouping == "kv_head" and rs.per_head and rs.num_kv_heads == hkv
        assert res.covariances[side].shape == (2, hkv, D, D)
        # the heads' planted covariances differ, and so do their rotations
        assert float((rs.rotations[:, 0] - rs.rotations[:, 1]).abs().max()) > 0.1
    for h in range(hkv):
        single = fit_rotations(_head_dump(root, tmp_path / f"head{h}", h, hq, hkv), objective, composition,
                               group_size=group_size)
        for side in ("k", "v"):
            ours, ref = getattr(res, side), getattr(single, side)
            assert torch.allclose(ours.rotations[:, h], ref.rotations, atol=1e-5), (side, h)
            assert torch.allclose(ours.eigenvalues[:, h], ref.eigenvalues, rtol=1e-5), (side, h)


@pytest.mark.parametrize("objective,composition,group_size", [("qqt_sst", "r_h_pbr", None),
                                                               ("ktk_vtv", "r_h_pbr", None),
                                                               ("qqt_sst", "r_pbr_hg", 4)])
def test_one_kv_head_equals_layer_grouping(tmp_path, objective, composition, group_size):
    root = _dump(tmp_path / "dump", hq=4, hkv=1)
    layer = fit_rotations(root, objective, composition, group_size=group_size)
    head = fit_rotations(root, objective, composition, group_size=group_size, grouping="kv_head")
    for side in ("k", "v"):
        a, b = getattr(layer, side), getattr(head, side)
        assert b.rotations.shape == (2, 1, D, D)
        assert torch.equal(b.rotations[:, 0], a.rotations) and torch.equal(b.eigenvalues[:, 0], a.eigenvalues)


def test_per_head_targets_average_to_the_layer_target(tmp_path):
    """The per-head covariances are the terms the per-layer target averages (ktk/vtv accumulated per head)."""
    chunks = _head_chunks(8, 2, [200, 150], seed=3)
    flat = LayerAccumulator(0, num_q_heads=8, num_kv_heads=2, head_dim=D, targets=("qqt", "sst", "ktk", "vtv"))
    per = LayerAccumulator(0, num_q_heads=8, num_kv_heads=2, head_dim=D, targets=("qqt", "sst", "ktk", "vtv"),
                           per_head=True)
    for acc in (flat, per):
        for c in chunks:
            acc.add_q(c["q"])
            acc.add_k(c["k"])
            acc.add_v(c["v"])
        acc.start_second_pass()
        for c in chunks:
            acc.add_kv(c["k"], c["v"])
    for target in ("qqt", "sst", "ktk", "vtv"):
        heads = per.covariance(target, per_head=True)
        assert heads.shape == (2, D, D)
        assert torch.allclose(heads.mean(dim=0), flat.covariance(target), rtol=1e-12, atol=1e-12), target
    k = torch.cat([c["k"] for c in chunks]).double()
    assert torch.allclose(per.covariance("ktk", per_head=True)[1], k[:, 1].T @ k[:, 1] / k.shape[0], rtol=1e-12)
    with pytest.raises(FitError, match=r"ktk was accumulated over all KV heads.*per_head=True"):
        flat.covariance("ktk", per_head=True)
    with pytest.raises(FitError, match="per_head=True"):  # statistics gathered over all heads cannot fit per head
        fit_rotations({0: flat}, "ktk_vtv", grouping="kv_head")


def test_refusals(tmp_path):
    with pytest.raises(FitError, match="hadamard.*data-free.*grouping='layer'"):
        fit_rotations(None, "hadamard", num_layers=2, head_dim=D, grouping="kv_head")
    with pytest.raises(FitError, match="unknown grouping 'head'"):
        fit_rotations(tmp_path, grouping="head")  # type: ignore[arg-type]


def test_files_and_manifest(tmp_path):
    root = _dump(tmp_path / "dump")
    res = fit_rotations(root, grouping="kv_head")
    assert output_file_names(res) == {"k": "k_rotation_qqt_r_h_pbr-kv_head.pt", "v": "v_rotation_sst_r_h_pbr-kv_head.pt"}
    assert output_file_names(fit_rotations(root)) == {"k": "k_rotation_qqt_r_h_pbr.pt", "v": "v_rotation_sst_r_h_pbr.pt"}
    for fmt in ("pt", "safetensors"):
        out = write_fitted(res, tmp_path / fmt, fmt=fmt)
        assert out.manifest["grouping"] == "kv_head" and out.manifest["num_kv_heads"] == 2
        for side, p in out.paths.items():
            back = read_rotation(p)
            assert back.source_grouping == "kv_head" and back.rotations.shape == (2, 2, D, D)
            assert torch.equal(back.rotations, getattr(res, side).rotations)
    assert write_fitted(fit_rotations(root), tmp_path / "layer").manifest["grouping"] == "layer"


# -- refinement ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rdump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two KV heads whose keys put outlier channels where their queries never look, each head differently."""
    chunks: dict[int, list[dict]] = {}
    d = 32
    for lid in (0, 1):
        g = torch.Generator().manual_seed(lid)
        chan, qmask = torch.ones(2, d), torch.ones(2, d)
        for h, outliers in enumerate(([0, 1, 2, 3], [20, 21, 22, 23])):
            chan[h, outliers] = 10.0 + 4 * h
            qmask[h, outliers] = 1e-3  # hardly ever: no real query is exactly 0 (a direction never seen is refused)
        warm = {"q": torch.randn(3, 4, d, generator=g), "k": torch.randn(3, 2, d, generator=g),
                "v": torch.randn(3, 2, d, generator=g), "seq_lens": [3]}
        body = [{"q": torch.randn(256, 4, d, generator=g) * qmask.repeat_interleave(2, dim=0),
                 "k": torch.randn(256, 2, d, generator=g) * chan, "v": torch.randn(256, 2, d, generator=g) * chan,
                 "seq_lens": [256]} for _ in range(4)]
        chunks[lid] = [warm, *body]
    return write_dump(tmp_path_factory.mktemp("kvrefine") / "dump", chunks)


@pytest.mark.parametrize("init", ["hadamard", "oscar"])
def test_refine_per_head_never_worse_per_head(rdump, init):
    res = refine_dump(rdump, Refinement(loss="block", steps=20, init=init, seed=1), group_size=16, grouping="kv_head")
    assert res.grouping == "kv_head" and res.num_kv_heads == 2
    for side in ("k", "v"):
        rs = getattr(res, side)
        assert rs.rotations.shape == (2, 2, 32, 32) and rs.source_grouping == "kv_head"
    ref = res.refinement
    assert ref is not None and ref["config"]["per_head"] is True
    for side in ("k", "v"):
        rows = ref["layers"][side]
        assert [r["layer_id"] for r in rows] == [0, 1]
        for r in rows:
            assert len(r["kept"]) == 2 and len(r["heldout_final_per_head"]) == 2
            for before, final in zip(r["heldout_init_per_head"], r["heldout_final_per_head"]):
                assert final <= before
    if init == "hadamard":  # the per-head OSCAR fit of these keys is already hard to beat in 20 steps
        assert any(k == "refined" for r in ref["layers"]["k"] for k in r["kept"])


def test_refine_per_head_keeps_the_init_where_refining_hurts(rdump, monkeypatch):
    """An optimizer that returns the identity (outliers left unspread: worse than Hadamard at G = 16 for
    every head) must leave every head at its init."""
    from rotationzoo.fit import refine as refine_mod

    eye = torch.eye(32, dtype=torch.float64)
    monkeypatch.setattr(refine_mod, "_optimize", lambda r0, *a, **k: (eye.expand_as(r0).clone(), [1.0]))
    res = refine_dump(rdump, Refinement(loss="block", steps=5, init="hadamard"), group_size=16, grouping="kv_head")
    had = refine_dump(rdump, Refinement(loss="block", steps=0, init="hadamard"), group_size=16, grouping="kv_head")
    assert res.refinement is not None
    rows = res.refinement["layers"]["k"]
    assert all(r["kept"] == ["init", "init"] for r in rows)
    assert all(r["heldout_final_per_head"] == r["heldout_init_per_head"] for r in rows)
    assert torch.equal(res.k.rotations, had.k.rotations)


def test_refine_per_head_init_is_the_per_head_fit(rdump):
    res = refine_dump(rdump, Refinement(loss="block", steps=0, init="oscar"), group_size=16, grouping="kv_head")
    oscar = fit_rotations(rdump, "qqt_sst", "r_h_pbr", grouping="kv_head")
    for side in ("k", "v"):  # kept as given, up to the fp64 re-orthogonalisation of the fp32 init
        assert torch.allclose(getattr(res, side).rotations, getattr(oscar, side).rotations, atol=1e-6)
    had = refine_dump(rdump, Refinement(loss="block", steps=0, init="hadamard"), group_size=16, grouping="kv_head")
    assert torch.equal(had.k.rotations[:, 0], had.k.rotations[:, 1])  # H_d for every head


# -- CLI -------------------------------------------------------------------------------------------


def test_cli_fit_kv_head_writes_a_verified_pair(tmp_path, capsys):
    root = _dump(tmp_path / "dump")
    out = tmp_path / "out"
    ran = run_cli(capsys, "fit", "--dump", str(root), "--out", str(out), "--grouping", "kv_head", "--json")
    assert ran[0] == 0, ran[2]
    report = json.loads(ran[1])
    assert report["result"]["grouping"] == "kv_head"
    k, v = Path(report["files"]["k"]["path"]), Path(report["files"]["v"]["path"])
    assert (k.name, v.name) == ("k_rotation_qqt_r_h_pbr-kv_head.pt", "v_rotation_sst_r_h_pbr-kv_head.pt")
    ran = run_cli(capsys, "verify", str(out), "--num-layers", "2", "--head-dim", str(D))
    assert ran[0] == 0, ran[2]
    api = fit_rotations(root, grouping="kv_head")
    assert torch.equal(read_rotation(k).rotations, api.k.rotations)
    assert json.loads((out / "rotationzoo.json").read_text())["grouping"] == "kv_head"
    for path, rs in ((k, api.k), (v, api.v)):  # the authors' V2 layout, read as their server reads it
        obj = torch.load(path, map_location="cpu", weights_only=True)
        assert obj["format_version"] == 2 and obj["source_grouping"] == "per_kv_head"
        assert sorted(obj["layers"]) == [0, 1] and all(obj["layers"][i]["rotation"].dim() == 3 for i in (0, 1))
        assert torch.equal(torch.stack([obj["layers"][i]["rotation"] for i in (0, 1)]), rs.rotations)
    ran = run_cli(capsys, "fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "16", "--out",
               str(tmp_path / "h"), "--grouping", "kv_head")
    assert ran[0] == 2, ran[2]  # a recipe the options alone refuse: a usage error
    assert "data-free" in ran[2]


def test_cli_refine_kv_head_verified_and_reproducible(rdump, tmp_path, capsys):
    names = ("k_rotation_refined_k_logit_r_h_pbr-kv_head.pt", "v_rotation_refined_v_attn_out_r_h_pbr-kv_head.pt")
    files = []
    for name, seed in (("a", 2), ("b", 2), ("c", 3)):
        out = tmp_path / name
        ran = run_cli(capsys, "fit", "--dump", str(rdump), "--out", str(out), "--loss", "block", "--refine", "20", "--init", "oscar", "-g", "16",
                   "--seed", str(seed), "--grouping", "kv_head")
        assert ran[0] == 0, ran[2]
        files.append([(out / f).read_bytes() for f in names])
    assert "KV heads" in ran[1]
    assert files[0] == files[1] and files[0] != files[2]
    ran = run_cli(capsys, "verify", str(tmp_path / "a"), "--num-layers", "2", "--head-dim", "32")
    assert ran[0] == 0, ran[2]
    m = json.loads((tmp_path / "a" / "rotationzoo.json").read_text())
    assert m["grouping"] == "kv_head" and m["objective"] == "refined"
    for rows in m["refinement"]["layers"].values():
        for r in rows:
            assert all(f <= b for b, f in zip(r["heldout_init_per_head"], r["heldout_final_per_head"]))

