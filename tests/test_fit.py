"""The reference fitter: faithfulness to the authors' math, dump handling, files, CLI."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from helpers import run_cli

from rotationzoo import read_rotation, validate
from rotationzoo.errors import DumpError, FitError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.fit import (
    OBJECTIVE_TARGETS,
    fit_rotations,
    hadamard_rotations,
    open_dump,
    output_file_names,
    write_dump,
    write_fitted,
)
from rotationzoo.fit.compose import (
    AUTHOR_COMPOSITIONS,
    block_hadamard,
    br_permutation,
    canonicalize_signs,
    compose,
    rotation_from_covariance,
)
from rotationzoo.files.validation import sha256_file

from authors_reference import br_perm_matrix as ref_perm_matrix
from authors_reference import build_hadamard as ref_hadamard
from authors_reference import load_chunks as ref_load

# ---------------------------------------------------------------------------------------------
# An independent fp64 implementation of the authors' fitter (compute_kv_rotation.py):
# load every chunk but 0 as .float().double(), concatenate, per-KV-head loops.
# ---------------------------------------------------------------------------------------------


def ref_covariance(root: Path, layer: int, target: str, keep_first: bool = False) -> torch.Tensor:
    if target in ("ktk", "vtv"):
        x = ref_load(root, layer, target[0], keep_first)
        t, hkv, d = x.shape
        flat = x.reshape(-1, d)
        c = flat.T @ flat / (t * hkv)
        return (c + c.T) / 2
    q = ref_load(root, layer, "q", keep_first)
    k = ref_load(root, layer, "k", keep_first)
    v = ref_load(root, layer, "v", keep_first)
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    c = torch.zeros(d, d, dtype=torch.float64)
    for h in range(hkv):
        qh = q[:, h * g:(h + 1) * g, :].reshape(-1, d)
        a = qh.T @ qh / (t * g)
        if target == "qqt":
            c += a
            continue
        kh = k[:, h, :]
        w = ((kh @ a) * kh).sum(dim=-1)
        w = w / max(float(w.sum()), 1e-12) * t
        vw = v[:, h, :] * w.sqrt().unsqueeze(-1)
        c += vw.T @ vw / t
    c /= hkv
    return (c + c.T) / 2


def ref_compose(u: torch.Tensor, lam: torch.Tensor, composition: str) -> torch.Tensor:
    h, p = ref_hadamard(u.shape[0]), ref_perm_matrix(lam)
    return {
        "plain": u, "pbr": p, "br": u @ p, "br_h128": u @ p @ h, "r_h": u @ h, "h_pbr": h @ p,
        "h_r_pbr": h @ u @ p, "h_pbr_r": h @ p @ u, "r_h_pbr": u @ h @ p,
    }[composition]


def assert_matches_reference(rot: torch.Tensor, eig: torch.Tensor, cov_ref: torch.Tensor, composition: str,
                             atol: float = 1e-6) -> None:
    """R equals the reference composition after aligning eigenvector signs (and the permutation)."""
    lam, u = torch.linalg.eigh(cov_ref)
    assert torch.allclose(eig.double(), lam, rtol=1e-6, atol=1e-7 * float(lam.abs().max()))
    r = rot.double()
    p_ref = ref_perm_matrix(lam)
    p_ours = ref_perm_matrix(eig.double())
    assert torch.equal(p_ours, p_ref), "eigenvalue order differs (ties?)"
    h = ref_hadamard(u.shape[0])
    # recover our U from R for the compositions that contain it, then align column signs
    recover = {
        "plain": lambda: r, "br": lambda: r @ p_ref.T, "br_h128": lambda: r @ h @ p_ref.T,
        "r_h": lambda: r @ h, "h_r_pbr": lambda: h @ r @ p_ref.T, "h_pbr_r": lambda: p_ref.T @ h @ r,
        "r_h_pbr": lambda: r @ p_ref.T @ h,
    }
    if composition in recover:
        u_ours = recover[composition]()
        signs = torch.sign((u_ours * u).sum(dim=0))
        assert bool((signs != 0).all())
        u = u * signs
    expected = ref_compose(u, lam, composition)
    diff = float((r - expected).abs().max())
    assert diff <= atol, f"max |R - R_ref| = {diff:.3e}"


# ---------------------------------------------------------------------------------------------
# synthetic dumps
# ---------------------------------------------------------------------------------------------


def synth_chunks(hq: int, hkv: int, d: int, sizes: list[int], *, seed: int, dtype=torch.bfloat16) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.2, 3.0, d) * (1 + 0.1 * torch.rand(d, generator=g))
    mix_q = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * scale
    mix_k = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * scale.flip(0)
    mix_v = torch.randn(d, d, generator=g) / d**0.5
    out = []
    for n in sizes:
        q = torch.randn(n, hq, d, generator=g) @ mix_q
        k = torch.randn(n, hkv, d, generator=g) @ mix_k
        v = torch.randn(n, hkv, d, generator=g) @ mix_v
        lens = [n // 2, n - n // 2] if n > 1 else [n]
        out.append({"q": q.to(dtype), "k": k.to(dtype), "v": v.to(dtype), "seq_lens": lens})
    return out


def make_dump(root: Path, *, hq: int = 8, hkv: int = 2, d: int = 64, layers=(0, 1), sizes=(6, 200, 173, 150),
              seed: int = 0, dtype=torch.bfloat16) -> Path:
    write_dump(root, {lid: synth_chunks(hq, hkv, d, list(sizes), seed=seed + lid, dtype=dtype) for lid in layers})
    return root


# ---------------------------------------------------------------------------------------------
# faithfulness
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_qqt_sst_match_authors_math(tmp_path, gqa, d):
    hkv = 2
    root = make_dump(tmp_path / "dump", hq=hkv * gqa, hkv=hkv, d=d, seed=gqa * 100 + d)
    res = fit_rotations(root)  # qqt_sst, r_h_pbr
    assert res.k.objective == "qqt_r_h_pbr" and res.v.objective == "sst_r_h_pbr"
    assert res.tokens == {0: 523, 1: 523}
    assert (res.num_q_heads, res.num_kv_heads, res.head_dim) == (hkv * gqa, hkv, d)
    for i, layer in enumerate(res.layer_ids):
        for side, target in (("k", "qqt"), ("v", "sst")):
            cov_ref = ref_covariance(root, layer, target)
            assert torch.allclose(res.covariances[side][i], cov_ref, rtol=1e-12, atol=1e-14 * float(cov_ref.abs().max()))
            rs = getattr(res, side)
            assert_matches_reference(rs.rotations[i], rs.eigenvalues[i], cov_ref, "r_h_pbr")


def test_lapack_signs_match_reference_without_alignment(tmp_path):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    res = fit_rotations(root, signs="lapack")
    for i, layer in enumerate(res.layer_ids):
        cov = ref_covariance(root, layer, "sst")
        lam, u = torch.linalg.eigh(cov)
        expected = u @ ref_hadamard(64) @ ref_perm_matrix(lam)
        assert float((res.v.rotations[i].double() - expected).abs().max()) < 1e-6


@pytest.mark.parametrize("objective", ["ktk_vtv", "qqt", "sst", "ktk", "vtv"])
def test_other_objectives(tmp_path, objective):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    res = fit_rotations(root, objective, "r_h")
    k_t, v_t = OBJECTIVE_TARGETS[objective]
    assert (res.k is None) == (k_t is None) and (res.v is None) == (v_t is None)
    for side, target in (("k", k_t), ("v", v_t)):
        if target is None:
            continue
        rs = getattr(res, side)
        assert rs.objective == f"{target}_r_h"
        for i, layer in enumerate(res.layer_ids):
            assert_matches_reference(rs.rotations[i], rs.eigenvalues[i], ref_covariance(root, layer, target), "r_h")
    names = output_file_names(res)
    assert set(names) == {s for s, t in (("k", k_t), ("v", v_t)) if t}


def test_ktk_vtv_reads_no_queries(tmp_path):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    for f in (root / "layer_0" / "q").glob("*.pt"):
        f.unlink()
    for f in (root / "layer_1" / "q").glob("*.pt"):
        f.unlink()
    res = fit_rotations(root, "ktk_vtv")
    assert res.num_q_heads is None and res.k.objective == "ktk_r_h_pbr"


@pytest.mark.parametrize("composition", AUTHOR_COMPOSITIONS)
def test_every_composition_matches_authors(composition):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(500, 32, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2, 32, dtype=torch.float64)
    cov = x.T @ x / 500
    r, lam = rotation_from_covariance(cov, composition, signs="lapack")
    lam_ref, u_ref = torch.linalg.eigh((cov + cov.T) / 2)
    assert torch.equal(lam, lam_ref)
    assert float((r - ref_compose(u_ref, lam_ref, composition)).abs().max()) < 1e-12
    assert float((r @ r.T - torch.eye(32, dtype=torch.float64)).abs().max()) < 1e-12


def test_bit_reversal_order_places_largest_eigenvalues():
    lam = torch.arange(128, dtype=torch.float64)  # ascending: index 127 is the largest
    perm = br_permutation(lam)
    # largest → 0, 2nd → 64, 3rd → 32, 4th → 96 (d = 128), as the authors' make_br_perm_matrix
    assert [int(perm[j]) for j in (0, 64, 32, 96, 16)] == [127, 126, 125, 124, 123]
    p = torch.eye(128, dtype=torch.float64)[:, perm]
    x = torch.randn(3, 128, dtype=torch.float64)
    assert torch.equal((x @ p)[:, 64], x[:, 126])


def test_canonical_signs_and_lapack_signs_give_same_importance():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(400, 64, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2, 64, dtype=torch.float64)
    cov = x.T @ x / 400
    r_c, lam_c = rotation_from_covariance(cov, "r_h_pbr")
    r_l, lam_l = rotation_from_covariance(cov, "r_h_pbr", signs="lapack")
    assert torch.equal(lam_c, lam_l)
    assert torch.allclose(torch.diag(r_c.T @ cov @ r_c), torch.diag(r_l.T @ cov @ r_l), rtol=1e-10)
    u = canonicalize_signs(torch.linalg.eigh(cov)[1])
    idx = u.abs().argmax(dim=0)
    assert bool((u[idx, torch.arange(64)] > 0).all())
    with pytest.raises(FitError, match="sign convention"):
        rotation_from_covariance(cov, signs="nope")  # type: ignore[arg-type]


def test_group_aware_composition(tmp_path):
    g = torch.Generator().manual_seed(3)
    d, gs = 128, 32
    x = torch.randn(2000, d, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, d, dtype=torch.float64)
    cov = x.T @ x / 2000
    r, lam = rotation_from_covariance(cov, "r_pbr_hg", group_size=gs)
    u = canonicalize_signs(torch.linalg.eigh((cov + cov.T) / 2)[1])
    hg = torch.block_diag(*[ref_hadamard(gs)] * (d // gs))
    assert float((r - u @ ref_perm_matrix(lam) @ hg).abs().max()) < 1e-12
    # importance diag(RᵀCR) is flat inside each group and the groups are balanced
    imp = torch.diag(r.T @ cov @ r).view(d // gs, gs)
    assert float((imp - imp.mean(dim=1, keepdim=True)).abs().max()) < 1e-9 * float(imp.max())
    means = imp.mean(dim=1)
    contiguous = torch.diag((u @ hg).T @ cov @ (u @ hg)).view(d // gs, gs).mean(dim=1)  # no P_br
    assert float(means.max() / means.min()) < 1.5 < 10 < float(contiguous.max() / contiguous.min())
    # the top d/G eigen-directions land one per group
    order = torch.argsort(lam, descending=True)
    pos = {int(order[i]): j for j, i in enumerate(br_permutation(lam).argsort().tolist())}
    assert sorted(pos[int(order[i])] // gs for i in range(d // gs)) == list(range(d // gs))
    assert torch.equal(block_hadamard(d, d), ref_hadamard(d))
    # through the fitter: label carries the group size
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    res = fit_rotations(root, composition="r_pbr_hg", group_size=16)
    assert res.k.objective == "qqt_r_pbr_hg16"
    assert output_file_names(res) == {"k": "k_rotation_qqt_r_pbr_hg16.pt", "v": "v_rotation_sst_r_pbr_hg16.pt"}
    with pytest.raises(FitError, match="needs a group size"):
        fit_rotations(root, composition="r_pbr_hg")
    with pytest.raises(FitError, match="does not divide"):
        fit_rotations(root, composition="r_pbr_hg", group_size=128)
    with pytest.raises(FitError, match="unknown composition"):
        fit_rotations(root, composition="r_h_p")


# ---------------------------------------------------------------------------------------------
# planted covariance
# ---------------------------------------------------------------------------------------------


def _white(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    z, _ = torch.linalg.qr(torch.randn(n, d, generator=g, dtype=torch.float64))
    return z * n**0.5  # zᵀz = n·I exactly (to rounding)


def test_planted_eigenvectors_are_recovered(tmp_path):
    d, hq, hkv, n = 64, 8, 2, 512
    gq = hq // hkv
    g = torch.Generator().manual_seed(7)
    u_q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    u_v = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    lam_q = torch.linspace(1.0, 4.0, d, dtype=torch.float64) ** 2
    lam_v = torch.linspace(0.5, 2.0, d, dtype=torch.float64) ** 2
    q = torch.empty(n, hq, d, dtype=torch.float64)
    for h in range(hkv):  # every group has exactly covariance U_q Λ_q U_qᵀ
        q[:, h * gq:(h + 1) * gq] = (_white(n * gq, d, g) * lam_q.sqrt() @ u_q.T).view(n, gq, d)
    k = torch.ones(n, hkv, d, dtype=torch.float64)  # identical keys → sst weights all 1
    v = torch.stack([_white(n, d, g) * lam_v.sqrt() @ u_v.T for _ in range(hkv)], dim=1)
    warm = {"q": torch.randn(6, hq, d), "k": torch.randn(6, hkv, d), "v": torch.randn(6, hkv, d)}
    write_dump(tmp_path / "dump", {0: [warm, {"q": q.float(), "k": k.float(), "v": v.float()}]})
    res = fit_rotations(tmp_path / "dump")
    h = ref_hadamard(d)
    for side, u_true, lam_true in (("k", u_q, lam_q), ("v", u_v, lam_v)):
        rs = getattr(res, side)
        assert torch.allclose(rs.eigenvalues[0].double(), lam_true, rtol=1e-5)
        r = rs.rotations[0].double()
        u_fit = r @ ref_perm_matrix(rs.eigenvalues[0].double()).T @ h
        overlap = (u_fit.T @ u_true).abs()
        assert float((overlap - torch.eye(d, dtype=torch.float64)).abs().max()) < 1e-4


# ---------------------------------------------------------------------------------------------
# dump handling
# ---------------------------------------------------------------------------------------------


def test_chunk0_skipped_by_default_and_kept_on_request(tmp_path):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64, layers=(0,), sizes=(40, 200, 100))
    # make chunk 0 very different, so that using it would show
    c0 = torch.load(root / "layer_0" / "q" / "0.pt") * 50
    torch.save(c0, root / "layer_0" / "q" / "0.pt")
    skip = fit_rotations(root)
    keep = fit_rotations(root, keep_first_chunk=True)
    assert skip.tokens == {0: 300} and keep.tokens == {0: 340}
    assert not skip.keep_first_chunk and keep.keep_first_chunk
    for res, kf in ((skip, False), (keep, True)):
        for side, target in (("k", "qqt"), ("v", "sst")):
            rs = getattr(res, side)
            assert_matches_reference(rs.rotations[0], rs.eigenvalues[0], ref_covariance(root, 0, target, kf), "r_h_pbr")
    assert not torch.allclose(skip.k.eigenvalues, keep.k.eigenvalues)


def test_sparse_layers_are_kept(tmp_path):
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(3, 7, 11))
    res = fit_rotations(root)
    assert res.layer_ids == (3, 7, 11) and res.k.layer_ids == (3, 7, 11)
    out = write_fitted(res, tmp_path / "out")
    raw = torch.load(out.paths["k"], weights_only=True)
    assert list(raw["layers"]) == [3, 7, 11] and all(isinstance(k, int) for k in raw["layers"])
    rs = read_rotation(out.paths["v"])
    validate(rs, layer_ids=[3, 7, 11], head_dim=64)
    assert out.manifest["layer_ids"] == [3, 7, 11]
    only = fit_rotations(root, layers=[7])
    assert only.layer_ids == (7,)
    assert torch.equal(only.k.rotations[0], res.k.rotations[1])


def test_workers_give_identical_results(tmp_path):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64, layers=(0, 1, 2))
    a = fit_rotations(root, workers=1)
    b = fit_rotations(root, workers=3)
    assert b.stats.workers == 3
    assert torch.equal(a.k.rotations, b.k.rotations) and torch.equal(a.v.rotations, b.v.rotations)
    assert a.stats.bytes_read == b.stats.bytes_read > 0
    assert a.stats.workspace_bytes > 0 and a.stats.peak_rss_bytes > 0


def test_fp16_and_fp32_dumps(tmp_path):
    for dtype in (torch.float16, torch.float32):
        root = make_dump(tmp_path / str(dtype), hq=4, hkv=2, d=64, layers=(0,), dtype=dtype)
        res = fit_rotations(root)
        rs = res.v
        assert_matches_reference(rs.rotations[0], rs.eigenvalues[0], ref_covariance(root, 0, "sst"), "r_h_pbr")


def test_dump_metadata_and_prompt_count(tmp_path):
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(0, 1), sizes=(6, 200, 100))
    dump = open_dump(root)
    assert dump.layer_ids == (0, 1)
    assert dump.chunk_ids(0) == (1, 2)
    assert open_dump(root, keep_first_chunk=True).chunk_ids(0) == (0, 1, 2)
    assert dump.seq_lens(0, 1) == [100, 100]
    assert dump.prompt_count() == 6  # authors' tag N: segments of every chunk of the first layer, chunk 0 included
    shape = dump.shape()
    assert (shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.group_size) == (4, 2, 64, "bfloat16", 2)
    assert fit_rotations(root).prompts == 6


# ---------------------------------------------------------------------------------------------
# hadamard
# ---------------------------------------------------------------------------------------------


def test_hadamard_objective(tmp_path):
    res = fit_rotations(None, "hadamard", num_layers=3, head_dim=64)
    assert res.layer_ids == (0, 1, 2) and res.k.objective == "hadamard"
    assert torch.equal(res.k.rotations[1], ref_hadamard(64).float())
    assert torch.equal(res.v.eigenvalues, torch.ones(3, 64))
    out = write_fitted(res, tmp_path / "h")
    assert sorted(p.name for p in out.paths.values()) == ["k_rotation_hadamard.pt", "v_rotation_hadamard.pt"]
    raw = torch.load(out.paths["k"], weights_only=True)
    assert raw["objective"] == "hadamard" and raw["format_version"] == 1 and raw["source_grouping"] == "layer"
    assert raw["layers"][0]["rotation"].data_ptr() == raw["layers"][2]["rotation"].data_ptr()  # one shared storage
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(3, 7))
    from_dump = fit_rotations(root, "hadamard")
    assert from_dump.layer_ids == (3, 7) and from_dump.head_dim == 64
    with pytest.raises(FitError, match="num_layers"):
        fit_rotations(None, "hadamard", head_dim=64)
    with pytest.raises(FitError, match="head_dim"):
        fit_rotations(None, "hadamard", num_layers=2)
    with pytest.raises(FitError, match="power of two"):
        fit_rotations(None, "hadamard", num_layers=2, head_dim=96)


def test_hadamard_equals_authors_published_file(upstream_dir):
    published = read_rotation(upstream_dir / "qwen3.5-4B" / "hadamard" / "k_rotation.pt")
    ours = hadamard_rotations(published.layer_ids, published.head_dim)
    assert ours.layer_ids == published.layer_ids == tuple(range(3, 32, 4))
    assert torch.equal(ours.rotations, published.rotations)
    assert torch.equal(ours.eigenvalues, published.eigenvalues)
    assert published.objective == ours.objective == "hadamard"


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------


def test_write_fitted_files_and_manifest(tmp_path):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    res = fit_rotations(root)
    out = write_fitted(res, tmp_path / "out", model="org/tiny", tag="synthetic-seq523")
    assert out.paths["k"].name == "k_rotation_qqt_r_h_pbr.pt"
    assert out.paths["v"].name == "v_rotation_sst_r_h_pbr.pt"
    m = json.loads(out.manifest_path.read_text())
    assert out.manifest_path.name == "rotationzoo.json" and m == json.loads(json.dumps(out.manifest, default=str))
    assert m["model"] == "org/tiny" and m["tag"] == "synthetic-seq523"
    assert m["tokens"] == 523 and m["prompts"] == 8 and m["head_dim"] == 64 and m["layer_ids"] == [0, 1]
    assert m["objectives"] == {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"} and m["composition"] == "r_h_pbr"
    assert m["int2kv"] == Int2KVConfig().to_json() and "clip_ratio" not in m  # one spelling of the settings
    assert m["library"]["name"] == "rotationzoo" and m["library"]["version"]
    for side, p in out.paths.items():
        assert m["files"][side] == {"name": p.name, "objective": m["objectives"][side], "format_version": 1,
                                    "sha256": sha256_file(p), "size": p.stat().st_size}
        raw = torch.load(p, weights_only=True)
        assert set(raw) == {"format_version", "objective", "source_grouping", "calibration", "layers"}
        assert raw["format_version"] == 1 and raw["calibration"]["tokens"] == 523
        assert raw["calibration"]["model_path"] == "org/tiny" and raw["calibration"]["global_kv_heads"] == 2
        entry = raw["layers"][0]
        assert set(entry) == {"layer_id", "rotation", "eigenvalues"}
        assert entry["rotation"].dtype == torch.float32 and entry["rotation"].is_contiguous()
        assert entry["eigenvalues"].dtype == torch.float32
        assert bool((entry["eigenvalues"][1:] >= entry["eigenvalues"][:-1]).all())  # ascending, not permuted
        rs = read_rotation(p)
        report = validate(rs, num_layers=2, head_dim=64)
        assert report.max_orthogonality_error < 1e-6
    st = write_fitted(res, tmp_path / "st", fmt="safetensors")
    assert st.paths["k"].name == "k_rotation_qqt_r_h_pbr.safetensors"
    assert torch.equal(read_rotation(st.paths["k"]).rotations, read_rotation(out.paths["k"]).rotations)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_missing_and_malformed_dumps(tmp_path):
    with pytest.raises(DumpError, match="does not exist"):
        fit_rotations(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="no layer_<L>"):
        fit_rotations(tmp_path / "empty")
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(0,))
    with pytest.raises(DumpError, match="no layer"):
        fit_rotations(root, layers=[5])


def test_inconsistent_head_dims(tmp_path):
    root = tmp_path / "dump"
    write_dump(root, {0: synth_chunks(4, 2, 64, [6, 50], seed=0), 1: synth_chunks(4, 2, 32, [6, 50], seed=1)})
    with pytest.raises(DumpError, match="inconsistent head dims between layers"):
        fit_rotations(root)
    root2 = make_dump(tmp_path / "dump2", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 50, 50))
    torch.save(torch.randn(50, 2, 32).bfloat16(), root2 / "layer_0" / "k" / "2.pt")
    with pytest.raises(DumpError, match="inconsistent head dims"):
        fit_rotations(root2)
    root3 = make_dump(tmp_path / "dump3", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 50))
    torch.save(torch.randn(50, 2, 32).bfloat16(), root3 / "layer_0" / "k" / "1.pt")
    with pytest.raises(DumpError, match="inconsistent head dims within chunk"):
        fit_rotations(root3)
    root4 = make_dump(tmp_path / "dump4", hq=6, hkv=4, d=64, layers=(0,), sizes=(6, 20))
    with pytest.raises(DumpError, match="not a multiple"):
        fit_rotations(root4)


def test_empty_layers_and_chunk_mismatch(tmp_path):
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(0,), sizes=(300,))
    with pytest.raises(DumpError, match="empty layer.*--keep-first-chunk"):
        fit_rotations(root)
    assert fit_rotations(root, keep_first_chunk=True).tokens == {0: 300}
    root2 = make_dump(tmp_path / "dump2", hq=4, hkv=2, d=64, layers=(0, 1), sizes=(6, 30))
    for kind in ("q", "k", "v"):
        for f in (root2 / "layer_1" / kind).glob("*.pt"):
            f.unlink()
    with pytest.raises(DumpError, match="layer_1: empty layer"):
        fit_rotations(root2)
    root3 = make_dump(tmp_path / "dump3", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 30, 30))
    (root3 / "layer_0" / "v" / "2.pt").unlink()
    with pytest.raises(DumpError, match="hold different chunks.*lacks chunk"):
        fit_rotations(root3)
    root4 = make_dump(tmp_path / "dump4", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 30))
    torch.save(torch.randn(29, 2, 64), root4 / "layer_0" / "v" / "1.pt")
    with pytest.raises(DumpError, match="29 tokens"):
        fit_rotations(root4)


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_unsafe_or_damaged_dump_files_are_refused(tmp_path):
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 30))
    torch.save({"x": _Evil()}, root / "layer_0" / "q" / "1.pt")
    with pytest.raises(DumpError, match="refused to load"):
        fit_rotations(root)
    (root / "layer_0" / "q" / "1.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DumpError, match="cannot read"):
        fit_rotations(root)
    with open(root / "layer_0" / "q" / "1.pt", "wb") as f:
        pickle.dump([1, 2, 3], f, protocol=2)  # a plain pickle, not a torch file
    with pytest.raises(DumpError, match="cannot read"):
        fit_rotations(root)
    torch.save({"not": "a tensor"}, root / "layer_0" / "q" / "1.pt")
    with pytest.raises(DumpError, match="expected a tensor"):
        fit_rotations(root)
    torch.save(torch.zeros(30, 2, 64, dtype=torch.int32), root / "layer_0" / "q" / "1.pt")
    with pytest.raises(DumpError, match="floating point"):
        fit_rotations(root)


def test_bad_arguments(tmp_path):
    root = make_dump(tmp_path / "dump", hq=4, hkv=2, d=64, layers=(0,), sizes=(6, 30))
    with pytest.raises(FitError, match="unknown objective"):
        fit_rotations(root, "qqt_vtv")
    with pytest.raises(FitError, match="workers"):
        fit_rotations(root, workers=0)
    with pytest.raises(FitError, match="needs a dump"):
        fit_rotations(None)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_fit(tmp_path, capsys):
    root = make_dump(tmp_path / "dump", hq=8, hkv=2, d=64)
    code, stdout, stderr = run_cli(capsys, "fit", "--dump", str(root), "--out", str(tmp_path / "out"), "--model", "org/tiny",
                                   "--tag", "t1", "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    assert Path(report["files"]["k"]["path"]).name == "k_rotation_qqt_r_h_pbr.pt"
    assert report["result"]["tokens"] == 523
    m = json.loads((tmp_path / "out" / "rotationzoo.json").read_text())
    assert m["model"] == "org/tiny" and m["tag"] == "t1"
    # --model-id (calibrate's name, fit_dump's model_id=) records the same; --model is its alias
    code, _, stderr = run_cli(capsys, "fit", "--dump", str(root), "--out", str(tmp_path / "o1"), "--model-id", "org/tiny",
                              "--tag", "t1")
    assert code == 0, stderr
    assert json.loads((tmp_path / "o1" / "rotationzoo.json").read_text())["model"] == "org/tiny"
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import fit_dump

    fit_dump(root, FitRecipe(), tmp_path / "o3", model_id="org/tiny", tag="t1")
    assert json.loads((tmp_path / "o3" / "rotationzoo.json").read_text())["model"] == "org/tiny"
    api = fit_rotations(root)
    assert torch.equal(read_rotation(tmp_path / "out" / "k_rotation_qqt_r_h_pbr.pt").rotations, api.k.rotations)
    code, stdout, stderr = run_cli(capsys, "fit", "--dump", str(root), "--out", str(tmp_path / "o2"), "--objective", "ktk_vtv",
                                   "--composition", "r_pbr_hg", "-g", "16", "--layers", "1", "--keep-first-chunk")
    assert code == 0, stderr
    assert "k_rotation_ktk_r_pbr_hg16.pt" in stdout
    assert read_rotation(tmp_path / "o2" / "v_rotation_vtv_r_pbr_hg16.pt").layer_ids == (1,)
    code, stdout, stderr = run_cli(capsys, "fit", "--objective", "hadamard", "--num-layers", "4", "--head-dim", "128", "--out",
                                   str(tmp_path / "h"))
    assert code == 0, stderr
    assert read_rotation(tmp_path / "h" / "v_rotation_hadamard.pt").rotations.shape == (4, 128, 128)


def test_cli_help_and_errors(tmp_path, capsys):
    code, stdout, stderr = run_cli(capsys, "fit", "--help")
    assert code == 0 and "--keep-first-chunk" in stdout and "rotationzoo fit --dump" in stdout
    code, stdout, stderr = run_cli(capsys, "calibrate", "--help")
    assert code == 0 and "--dump-out" in stdout
    code, _, stderr = run_cli(capsys, "fit", "--dump", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert code == 1 and "does not exist" in stderr
    code, _, stderr = run_cli(capsys, "fit", "--out", str(tmp_path / "o"))
    assert code == 2 and "--dump DIR is required" in stderr
