"""The authors' later recipes and centering: each fit against a direct implementation of its math.

* ``cov_eig_hadamard_perhead`` against the authors' V2 script (fp32, ``sorted(glob)[:20]`` chunks,
  chunk 0 included), written as a V2 pair;
* ``oscar2_perhead`` / ``oscar2_center`` against ``E·H·P_br`` of the per-head ``M_q`` and ``S_v``,
  ``k_mean`` the per-head key mean, ``--grouping layer`` the authors' ``--shared``;
* value centering: ``v_mean`` the per-head value mean and the V rotation of the centered values;
* centering composes with refinement; fitted centering leaves a model's logits unchanged with INT2 off;
* the combinations that mean nothing are refused before anything is read.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from rotationzoo.errors import FitError
from rotationzoo.fit import Refinement, fit_rotations, refine_dump, write_dump, write_fitted
from rotationzoo.fit.compose import br_permutation_matrix
from rotationzoo.files.format import read_rotation
from rotationzoo.hadamard import hadamard_matrix

D, HQ, HKV = 16, 4, 2
LAYERS = (3, 7)  # sparse ids, as a hybrid model dumps them


def _chunks(sizes: list[int], seed: int) -> list[dict]:
    """Per KV head its own mean, eigenbasis and spectrum (queries, keys and values): covariances
    ``Qᵀ diag(s²) Q`` with evenly spaced eigenvalues, so that eigenvectors are well defined in fp32 too."""
    g = torch.Generator().manual_seed(seed)
    gq = HQ // HKV
    heads = []
    for h in range(HKV):
        spec = torch.linspace(1.0, float(D), D).sqrt() * (1 + h)
        heads.append({kind: (spec.roll(3 * i + h)[:, None] * torch.linalg.qr(torch.randn(D, D, generator=g))[0],
                             torch.randn(D, generator=g) * (2.0 + h)) for i, kind in enumerate("qkv")})
    out = []
    for n in sizes:
        def draw(kind: str, h: int, width: int) -> torch.Tensor:
            mix, mean = heads[h][kind]
            return torch.randn(n, width, D, generator=g) @ mix + mean
        q = torch.cat([draw("q", h, gq) for h in range(HKV)], dim=1)
        k = torch.cat([draw("k", h, 1) for h in range(HKV)], dim=1)
        v = torch.cat([draw("v", h, 1) for h in range(HKV)], dim=1)
        out.append({"q": q.bfloat16(), "k": k.bfloat16(), "v": v.bfloat16(), "seq_lens": [n]})
    return out


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    """23 chunks per layer (a 6-token warm-up chunk 0, then 22 of 120 tokens): more than the V2 recipe reads."""
    root = tmp_path_factory.mktemp("recipes") / "dump"
    return write_dump(root, {lid: _chunks([6] + [120] * 22, seed=lid) for lid in LAYERS})


@pytest.fixture(scope="module")
def long_dump(tmp_path_factory) -> Path:
    """Sequences long enough for the refinement's 256-token blocks."""
    return write_dump(tmp_path_factory.mktemp("recipes-long") / "dump",
                      {lid: _chunks([6, 700, 700, 600], seed=20 + lid) for lid in LAYERS})


def _loaded(root: Path, lid: int, kind: str, chunks: list[int] | None = None) -> torch.Tensor:
    names = sorted((root / f"layer_{lid}" / kind).glob("*.pt"), key=lambda p: int(p.stem))
    picked = [p for p in names if chunks is None or int(p.stem) in chunks]
    return torch.cat([torch.load(p, weights_only=True) for p in picked]).double()


def _align(r: torch.Tensor, ref: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """``r`` with the signs of its eigenvectors (the columns of ``r @ tailᵀ``) matched to ``ref``'s."""
    u, u_ref = r.double() @ tail.T, ref.double() @ tail.T
    signs = torch.sign((u * u_ref).sum(dim=0))
    return (u * signs) @ tail


# -- the V2 recipe -------------------------------------------------------------------------------------


def _authors_v2(root: Path, lid: int, sub: str, d: int) -> torch.Tensor:
    """The authors' fit_perhead_rotation.py for one layer and side, as written (fp32, first 20 sorted files)."""
    h = hadamard_matrix(d, dtype=torch.float32)
    fs = sorted(glob.glob(f"{root}/layer_{lid}/{sub}/*.pt"))[:20]
    t = torch.cat([torch.load(f, map_location="cpu", weights_only=True).float() for f in fs], 0)

    def fit(x: torch.Tensor) -> torch.Tensor:
        c = (x.T @ x) / x.shape[0]
        ev, evec = torch.linalg.eigh(c)
        return (evec[:, torch.argsort(ev, descending=True)] @ h).contiguous()

    return torch.stack([fit(t[:, i, :]) for i in range(t.shape[1])], 0)


def test_v2_recipe_equals_the_authors_script(dump, tmp_path):
    res = fit_rotations(dump, "cov_eig_hadamard_perhead")
    h = hadamard_matrix(D, dtype=torch.float64)
    # the chunks: 0, 1, 10, ..., 19, 2, 20, 21, 22, 3, ..., 6 (file names sorted), the warm-up included
    assert res.keep_first_chunk and res.tokens == {lid: 6 + 19 * 120 for lid in LAYERS}
    for side in ("k", "v"):
        rs = getattr(res, side)
        assert rs.per_head and rs.eigenvalues is None and rs.objective == "cov_eig_hadamard_perhead"
        for i, lid in enumerate(LAYERS):
            ref = _authors_v2(dump, lid, side, D)
            for head in range(HKV):
                got = _align(rs.rotations[i, head], ref[head], h)
                assert (got - ref[head].double()).abs().max() <= 1e-5
    out = write_fitted(res, tmp_path / "out")
    for side, p in out.paths.items():
        assert p.name == f"{side}_rotation_cov_eig_hadamard_perhead.pt"
        raw = torch.load(p, weights_only=True)
        assert raw["format_version"] == 2 and raw["source_grouping"] == "per_kv_head"
        assert raw["objective"] == "cov_eig_hadamard_perhead" and "transform" not in raw
        assert sorted(raw["layers"]) == list(LAYERS) and set(raw["layers"][3]) == {"layer_id", "rotation"}
        assert raw["layers"][3]["rotation"].shape == (HKV, D, D) and raw["calibration"]["tokens"] == 6 + 19 * 120


def test_v2_recipe_is_its_math_in_fp64(dump):
    """Against the same math in fp64 the only difference is fp32 storage (with the recipe's own signs)."""
    res = fit_rotations(dump, "cov_eig_hadamard_perhead", signs="lapack")
    h = hadamard_matrix(D, dtype=torch.float64)
    chosen = [0, 1, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 2, 20, 21, 22, 3, 4, 5, 6]  # sorted file names, first 20
    for i, lid in enumerate(LAYERS):
        k = _loaded(dump, lid, "k", chosen)
        for head in range(HKV):
            x = k[:, head]
            ev, evec = torch.linalg.eigh(x.T @ x / x.shape[0])
            ref = evec[:, torch.argsort(ev, descending=True)] @ h
            got = _align(res.k.rotations[i, head], ref, h)
            assert (got - ref).abs().max() < 1e-6


def test_cli_v2_pair(dump, tmp_path, capsys):
    from rotationzoo.cli.main import main

    code = main(["fit", "--dump", str(dump), "--out", str(tmp_path / "v2"), "--objective", "cov_eig_hadamard_perhead",
                 "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    assert {s: f["format_version"] for s, f in got["files"].items()} == {"k": 2, "v": 2}
    k = read_rotation(tmp_path / "v2" / "k_rotation_cov_eig_hadamard_perhead.pt")
    ref = _authors_v2(dump, 7, "k", D)
    h = hadamard_matrix(D, dtype=torch.float64)
    assert (_align(k[7][1], ref[1], h) - ref[1].double()).abs().max() <= 1e-5


# -- OSCAR-2 ------------------------------------------------------------------------------------------


def _oscar2_k(dump: Path, lid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``E·H·P_br`` of each head's unit-mean ``M_q`` (chunk 0 skipped) and the per-head key mean."""
    q, k = _loaded(dump, lid, "q")[6:], _loaded(dump, lid, "k")[6:]
    gq = HQ // HKV
    rots = []
    for head in range(HKV):
        x = q[:, head * gq:(head + 1) * gq].reshape(-1, D)
        m = x.T @ x / x.shape[0]
        m = m / (torch.trace(m) / D)
        ev, evec = torch.linalg.eigh(m)
        rots.append(evec @ hadamard_matrix(D, dtype=torch.float64) @ br_permutation_matrix(ev))
    return torch.stack(rots), k.mean(dim=0)


def _sst(dump: Path, lid: int, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Per head ``Σ e (v−μ)(v−μ)ᵀ / Σ e`` with ``e = kᵀ M_q k`` (the authors' energy-weighted S_v)."""
    q, k, v = (_loaded(dump, lid, kind)[6:] for kind in "qkv")
    gq = HQ // HKV
    out = []
    for head in range(HKV):
        x = q[:, head * gq:(head + 1) * gq].reshape(-1, D)
        m = x.T @ x / x.shape[0]
        e = ((k[:, head] @ m) * k[:, head]).sum(-1)
        vv = v[:, head] - (0 if mean is None else mean[head])
        out.append((vv * e[:, None]).T @ vv / e.sum())
    return torch.stack(out)


def _aligned_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max error after matching the sign of each column of ``ref`` (the composition's tail mixes them, so
    compare ``got @ refᵀ`` with a signed permutation-free identity: the rotations agree up to the eigenvectors'
    signs, which only flip ``U``'s columns)."""
    return float((got.double() @ ref.T.double() - torch.eye(ref.shape[-1], dtype=torch.float64)).abs().max())


def _u(r: torch.Tensor, ev: torch.Tensor) -> torch.Tensor:
    return r.double() @ (hadamard_matrix(D, dtype=torch.float64) @ br_permutation_matrix(ev)).T


def test_oscar2_center_is_the_per_head_metric_basis_and_key_mean(dump, tmp_path):
    res = fit_rotations(dump, "oscar2_center")
    plain = fit_rotations(dump, "oscar2_perhead")
    assert res.center == "k" and plain.center == "none" and res.grouping == "kv_head"
    assert torch.equal(res.k.rotations, plain.k.rotations) and torch.equal(res.v.rotations, plain.v.rotations)
    for i, lid in enumerate(LAYERS):
        ref_r, ref_mu = _oscar2_k(dump, lid)
        assert (res.k.k_mean[i].double() - ref_mu).abs().max() < 1e-5
        for head in range(HKV):
            ev = res.k.eigenvalues[i, head].double()
            assert abs(float(ev.mean()) - 1) < 1e-5  # the unit-mean metric's eigenvalues
            u, u_ref = _u(res.k.rotations[i, head], ev), _u(ref_r[head], ev)
            signs = torch.sign((u * u_ref).sum(dim=0))
            assert (u - u_ref * signs).abs().max() < 1e-5  # the same eigenvectors, up to their signs
        cov = _sst(dump, lid)
        for head in range(HKV):
            r = res.v.rotations[i, head].double()
            # R diagonalises S_v into a spectrum of flattened (Hadamard-mixed) eigen-directions: R^T S R = (H P)^T Λ (H P)
            lam = res.v.eigenvalues[i, head].double()
            hp = hadamard_matrix(D, dtype=torch.float64) @ br_permutation_matrix(lam)
            assert torch.allclose(r.T @ cov[head] @ r, hp.T @ torch.diag(lam) @ hp, atol=1e-4 * float(lam.max()))
    out = write_fitted(res, tmp_path / "c")
    assert {s: p.name for s, p in out.paths.items()} == {"k": "k_rotation_oscar2_center.pt",
                                                         "v": "v_rotation_oscar2_center.pt"}
    k, v = read_rotation(out.paths["k"]), read_rotation(out.paths["v"])
    assert k.layout_version == 3 and k.objective == "oscar2_center" and k.companions == ("k_mean",)
    assert k.transform == {"key": "center", "centered": True, "orthogonal": True}
    assert v.objective == "oscar2_v_pre_wo" and v.transform == {"value": "pre_wo", "orthogonal": True}
    raw = torch.load(out.paths["k"], weights_only=True)
    assert raw["source_grouping"] == "head" and raw["layers"][7]["k_mean"].shape == (HKV, D)


def test_shared_forms_average_the_per_head_moments(dump, tmp_path):
    res = fit_rotations(dump, "oscar2_center", grouping="layer")
    assert res.grouping == "layer" and res.k.rotations.shape == (2, D, D) and res.k.k_mean.shape == (2, D)
    v1 = fit_rotations(dump, "qqt_sst")  # the V1 shared fit: the mean over heads of the same moments
    assert _aligned_err(res.v.rotations[0], v1.v.rotations[0]) < 1e-4
    assert torch.allclose(res.k.eigenvalues[0] * v1.k.eigenvalues[0].mean(), v1.k.eigenvalues[0], rtol=1e-4)
    _, mu = _oscar2_k(dump, 3)
    assert (res.k.k_mean[0].double() - mu.mean(dim=0)).abs().max() < 1e-5
    names = {s: p.name for s, p in write_fitted(res, tmp_path / "s").paths.items()}
    assert names == {"k": "k_rotation_oscar2_center-shared.pt", "v": "v_rotation_oscar2_center-shared.pt"}
    assert read_rotation(tmp_path / "s" / names["k"]).to_dict()["source_grouping"] == "layer"


def test_value_centering_fits_the_centered_values(dump, tmp_path):
    res = fit_rotations(dump, "oscar2_center", center="kv")
    for i, lid in enumerate(LAYERS):
        mu_v = _loaded(dump, lid, "v")[6:].mean(dim=0)
        assert (res.v.v_mean[i].double() - mu_v).abs().max() < 1e-5
        cov = _sst(dump, lid, mu_v)
        for head in range(HKV):
            r, lam = res.v.rotations[i, head].double(), res.v.eigenvalues[i, head].double()
            hp = hadamard_matrix(D, dtype=torch.float64) @ br_permutation_matrix(lam)
            assert torch.allclose(r.T @ cov[head] @ r, hp.T @ torch.diag(lam) @ hp, atol=1e-4 * float(lam.max()))
        assert not torch.allclose(res.v.eigenvalues[i], fit_rotations(dump, "oscar2_center").v.eigenvalues[i])
    out = write_fitted(res, tmp_path / "kv")
    v = read_rotation(out.paths["v"])
    assert out.paths["v"].name == "v_rotation_oscar2_center-center_kv.pt" and v.companions == ("v_mean",)
    assert v.transform == {"value": "pre_wo", "orthogonal": True, "centered": True} and v.layout_version == 3
    m = json.loads(out.manifest_path.read_text())
    assert m["center"] == "kv" and m["grouping"] == "kv_head" and m["files"]["v"]["format_version"] == 3


def test_key_centering_on_the_v1_objective(dump):
    res = fit_rotations(dump, "qqt_sst", center="k")
    plain = fit_rotations(dump, "qqt_sst")
    assert torch.equal(res.k.rotations, plain.k.rotations) and res.k.k_mean.shape == (2, D)
    assert res.k.transform == {"key": "qqt", "centered": True, "orthogonal": True} and res.v.transform is None


@pytest.mark.parametrize("objective,kw,match", [
    ("oscar2_perhead", {"center": "k"}, "oscar2_perhead does not center"),
    ("oscar2_center", {"center": "none"}, "oscar2_center centers the keys"),
    ("cov_eig_hadamard_perhead", {"center": "k"}, "needs the OSCAR targets"),
    ("ktk_vtv", {"center": "kv"}, "needs the OSCAR targets"),
    ("qqt", {"center": "k"}, "needs both keys and values"),
    ("cov_eig_hadamard_perhead", {"grouping": "layer"}, "has no shared form"),
    ("cov_eig_hadamard_perhead", {"composition": "r_h_pbr"}, "does not apply"),
    ("oscar2_center", {"composition": "r_pbr_hg", "group_size": 8}, "does not apply"),
    ("qqt_sst", {"center": "x"}, "unknown center"),
])
def test_combinations_that_mean_nothing_are_refused_before_reading(objective, kw, match, tmp_path):
    with pytest.raises(FitError, match=match):
        fit_rotations(tmp_path / "no-such-dump", objective, **kw)


def test_refinement_starts_from_the_centered_init_and_keeps_the_means(long_dump):
    dump = long_dump
    opts = Refinement(loss="block", steps=0, init="oscar", sample_tokens=1024)
    res = refine_dump(dump, opts, grouping="kv_head", center="kv")
    closed = fit_rotations(dump, "oscar2_center", center="kv")
    assert res.center == "kv"
    assert torch.allclose(res.k.k_mean, closed.k.k_mean) and torch.allclose(res.v.v_mean, closed.v.v_mean)
    assert torch.allclose(res.k.rotations, closed.k.rotations, atol=1e-6)  # 0 steps: the centered closed form
    assert torch.allclose(res.v.rotations, closed.v.rotations, atol=1e-6)
    assert res.k.transform == {"key": "refined", "centered": True, "orthogonal": True}
    from rotationzoo.fit import samples_from_dump
    from rotationzoo.fit.refine_loss import RefineConfig, layer_data

    layer = samples_from_dump(dump, max_tokens=1024).layers[3]
    mu = closed.k.k_mean[0]
    plain, centered = layer_data(layer, "k", RefineConfig(loss="block")), layer_data(layer, "k", RefineConfig(loss="block"), mu)
    assert torch.allclose(centered.x, plain.x - mu[None, :, None, :])  # the loss sees the stored (centered) keys
    stepped = refine_dump(dump, Refinement(loss="block", steps=3, init="hadamard", sample_tokens=1024), center="k")
    assert stepped.k.k_mean.shape == (2, D) and stepped.v.v_mean is None
    assert torch.allclose(stepped.k.k_mean, fit_rotations(dump, "qqt_sst", center="k").k.k_mean)


def test_refinement_starts_from_any_given_closed_form(long_dump):
    """The V2 recipe and oscar2_center (a FitResult) as inits: 0 steps give them back, the means kept."""
    from rotationzoo.fit import refine_fit, samples_from_dump
    from rotationzoo.fit.refine_loss import RefineConfig

    samples = samples_from_dump(long_dump, max_tokens=1024)
    cfg = RefineConfig(loss="block")
    for objective, center in (("cov_eig_hadamard_perhead", "none"), ("oscar2_center", "k")):
        closed = fit_rotations(long_dump, objective)
        res = refine_fit(samples, closed, steps=0, grouping="kv_head", center=center, config=cfg)
        assert res.refinement["init"] == "given" and res.composition == closed.k.objective
        for side in ("k", "v"):
            assert torch.allclose(getattr(res, side).rotations, getattr(closed, side).rotations, atol=1e-6)
        assert (res.k.k_mean is None) == (center == "none")
        if center == "k":
            assert torch.equal(res.k.k_mean, closed.k.k_mean)
    with pytest.raises(FitError, match="centers 'k' but center='none'"):
        refine_fit(samples, closed, steps=0, grouping="kv_head", config=cfg)
    with pytest.raises(FitError, match="a pair with K and V rotation sets"):
        refine_fit(samples, object(), steps=0, config=cfg)


def test_fitted_centering_leaves_the_logits_unchanged_with_int2_off(tmp_path):
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from test_transformers_int2 import cfg, tiny_llama

    from rotationzoo.integrations.transformers import OscarKV, capture_to_dump, oscar_kv

    model = tiny_llama(num_kv_heads=2)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 96, (64,), generator=g) for _ in range(12)]
    root = capture_to_dump(model, [seqs[0][:6], *seqs], tmp_path / "dump")
    ids = torch.randint(3, 96, (1, 48), generator=g)
    for grouping in ("kv_head", "layer"):
        res = fit_rotations(root, "oscar2_center", center="kv", grouping=grouping)
        assert float(res.k.k_mean.abs().max()) > 1e-3 and float(res.v.v_mean.abs().max()) > 1e-3
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits
            oscar = OscarKV.from_rotations(res, cfg(prefix_tokens=0, recent_tokens=0), quantize_k=False,
                                           quantize_v=False)
            with oscar_kv(model, oscar) as kv:
                sim = model(ids, use_cache=False).logits
                cached = model(ids, **kv.cache_kwargs()).logits
        assert (sim - ref).abs().max() <= 1e-5 and (cached - ref).abs().max() <= 1e-5
