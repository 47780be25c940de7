"""Learned rotations: the straight-through INT2 quantizer, the block reservoir and the refinement."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rotationzoo.errors import FitError
from rotationzoo.fit import refine as refine_mod
from rotationzoo.fit.dump import open_dump, write_dump
from rotationzoo.fit.refine import (
    RefineConfig,
    ste_quantize_int2,
    refine_layer,
    refine_rotations,
)
from rotationzoo.fit.samples import CalibrationSamples, LayerSamples
from rotationzoo.files.format import RotationSet, read_rotation, write_rotation
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import dequantize_int2, quantize_int2
from rotationzoo.kernels.layout import clip_index
from rotationzoo.files.validation import validate

from helpers import int2_config

D = 64
OUTLIERS = (0, 1, 2, 3)


@pytest.fixture(autouse=True)
def _one_thread():
    """Single-threaded, as refine_rotations runs each job (tiny ops are slower on contended threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g) * 3
    x[:, 3] *= 20  # an outlier channel
    x[1] = 0.0
    x[2, :10] = -0.0
    x[4, :] = 1.5  # a constant row (range 0 -> the 1e-8 floor)
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values, NaN where the other is NaN (a constant row's 1e-8 range underflows in fp16)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [16, 64])
@pytest.mark.parametrize("clip", [0.0, 0.92, 0.96])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_equals_kernels(d: int, group: int, clip: float, scale_dtype: torch.dtype) -> None:
    x = _rows(300, d)
    xb = x.to(torch.bfloat16).to(torch.float32)
    codes, sz = quantize_int2(xb, config=int2_config(clip, group, scale=scale_dtype), backend="torch")
    ref = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch")
    ci = clip_index(clip, d)
    assert _same(ste_quantize_int2(xb, clip_index=ci, group_size=group, scale_dtype=scale_dtype), ref)
    # the fp32 rows rounded to bf16 inside, as the served rows are
    out = ste_quantize_int2(x, clip_index=ci, group_size=group, scale_dtype=scale_dtype, round_rows=torch.bfloat16)
    assert _same(out, ref)
    assert not out.isnan().any() or scale_dtype == torch.float16


def _surrogate(x: torch.Tensor, ci: int, group: int) -> torch.Tensor:
    """Autograd version of the straight-through estimator: x_c + scale·u with u held constant."""
    n, d = x.shape
    xc = x
    if ci >= 0:
        thr = torch.kthvalue(x.abs(), ci + 1, dim=-1, keepdim=True).values
        xc = torch.minimum(torch.maximum(x, -thr), thr)
    g = xc.reshape(n, d // group, group)
    scale = (g.amax(-1) - g.amin(-1)).clamp_min(1e-8) / 3.0
    zero = -g.amin(-1) / scale
    with torch.no_grad():
        q = torch.clamp(torch.floor(g / scale[..., None] + zero[..., None] + 0.5), 0, 3)
        u = ((q - zero[..., None]) * scale[..., None] - g) / scale[..., None]
    return (g + scale[..., None] * u).reshape(n, d)


@pytest.mark.parametrize("clip", [0.0, 0.92])
@pytest.mark.parametrize("group", [16, 64])
def test_straight_through_gradient(clip: float, group: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, D, generator=g, requires_grad=True)
    w = torch.randn(200, D, generator=g)
    ci = clip_index(clip, D)
    (ste_quantize_int2(x, clip_index=ci, group_size=group) * w).sum().backward()
    got, x.grad = x.grad, None
    (_surrogate(x, ci, group) * w).sum().backward()
    assert torch.allclose(got, x.grad, atol=1e-5)
    assert (got != w).any()  # not the plain identity


# -- reservoir ------------------------------------------------------------------------------------


def _numbered(n: int, start: float, hq: int = 2, hkv: int = 1, d: int = D) -> tuple[torch.Tensor, ...]:
    """Tokens whose every value is its global token number (to check contiguity)."""
    ids = torch.arange(start, start + n, dtype=torch.float32)
    return ids[:, None, None].expand(n, hq, d), ids[:, None, None].expand(n, hkv, d), -ids[:, None, None].expand(n, hkv, d)


def _fill(seed: int) -> LayerSamples:
    s = LayerSamples(0, block_size=16, max_tokens=64, dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(123)
    start = 0
    for _ in range(40):
        n = int(torch.randint(5, 70, (1,), generator=g))
        s.add_sequence(*_numbered(n, start))
        start += n
    return s


def test_reservoir_bounded_deterministic_and_contiguous() -> None:
    a, b, c = _fill(0), _fill(0), _fill(1)
    assert a.num_blocks == a.capacity == 4 and a.blocks_seen > 20
    assert a.nbytes() == 4 * 16 * (2 + 1 + 1) * D * 4 + 4 * 8
    qa, ka, va, pa = a.blocks()
    assert torch.equal(qa, b.blocks()[0]) and torch.equal(pa, b.blocks()[3])
    assert not torch.equal(qa, c.blocks()[0])
    first = qa[:, :, 0, 0]
    assert torch.equal(first - first[:, :1], torch.arange(16.0).expand(4, 16))  # consecutive tokens
    assert torch.equal(ka[:, :, 0, 0], first) and torch.equal(va[:, :, 0, 0], -first)
    assert float(first.max()) > 64  # not simply the first blocks offered
    assert a.tokens_seen == a.tokens_dropped + 16 * a.blocks_seen


def test_reservoir_from_dump_matches_live(tmp_path) -> None:
    seqs = [_numbered(n, 1000 * i) for i, n in enumerate((40, 33, 50, 20))]
    chunks = [{"q": s[0][:3], "k": s[1][:3], "v": s[2][:3]} for s in seqs[:1]]  # warm-up chunk 0
    chunks += [{"q": torch.cat([seqs[i][0], seqs[i + 1][0]]), "k": torch.cat([seqs[i][1], seqs[i + 1][1]]),
                "v": torch.cat([seqs[i][2], seqs[i + 1][2]]), "seq_lens": [len(seqs[i][0]), len(seqs[i + 1][0])]}
               for i in (0, 2)]
    write_dump(tmp_path / "d", {5: chunks})
    from_dump = CalibrationSamples(block_size=16, max_tokens=256, dtype=torch.float32)
    from_dump.add_dump(open_dump(tmp_path / "d"))
    live = CalibrationSamples(block_size=16, max_tokens=256, dtype=torch.float32)
    for s in seqs:
        live.on_qkv(5, *s)
    for x, y in zip(from_dump.layers[5].blocks(), live.layers[5].blocks()):
        assert torch.equal(x, y)
    q, _, _, pos = from_dump.layers[5].blocks()
    assert from_dump.layers[5].num_blocks == 2 + 2 + 3 + 1
    assert torch.equal(pos, q[:, 0, 0, 0].to(torch.int64) % 1000)  # position of each block in its sequence


def test_sink_positions_add_no_error() -> None:
    s = _planted(blocks=4)
    s.positions[:] = 0  # blocks at the start of their sequences: inside a 64-token sink
    rec = refine_layer(s, "k", torch.eye(D), RefineConfig(**{**CFG, "steps_k": 0, "int2kv": Int2KVConfig(group_size=16, prefix_tokens=64)})).record
    assert rec["heldout_init"] == 0.0
    s.positions[:] = 32  # half of each block in the sink
    half = refine_layer(s, "k", torch.eye(D), RefineConfig(**{**CFG, "steps_k": 0, "int2kv": Int2KVConfig(group_size=16, prefix_tokens=64)})).record
    full = refine_layer(s, "k", torch.eye(D), RefineConfig(**{**CFG, "steps_k": 0})).record
    assert 0.2 * full["heldout_init"] < half["heldout_init"] < 0.8 * full["heldout_init"]


# -- refinement on a synthetic layer --------------------------------------------------------------


def _planted(blocks: int = 12, n: int = 64, seed: int = 0) -> LayerSamples:
    """Keys with huge outlier channels that the queries never look at: Hadamard spreads the outliers
    into every group, so a rotation keeping them in their own group makes a smaller logit error."""
    g = torch.Generator().manual_seed(seed)
    s = LayerSamples(3, block_size=n, max_tokens=blocks * n, dtype=torch.float32)
    chan = torch.ones(D)
    chan[list(OUTLIERS)] = 12.0
    qmask = torch.ones(D)
    qmask[list(OUTLIERS)] = 0.0
    for _ in range(blocks):
        q = torch.randn(n, 2, D, generator=g) * qmask
        k = torch.randn(n, 1, D, generator=g) * chan
        v = torch.randn(n, 1, D, generator=g) * chan
        s.add_sequence(q, k, v, start=1000)
    return s


def _good_rotation() -> torch.Tensor:
    """Outlier channels kept in group 0 (with 12 ordinary channels), Hadamard within each group of 16."""
    h = hadamard_matrix(16, dtype=torch.float64)
    return torch.block_diag(*([h] * 4))


CFG = {"int2kv": Int2KVConfig(group_size=16, prefix_tokens=0), "steps_k": 30, "steps_v": 20, "lr": 2e-2, "batch_blocks": 4,
       "holdout": 0.25, "loss": "block"}  # blocks of 16-64 tokens: every pair (the served loss needs ≥ 321)


def test_refinement_beats_hadamard_on_planted_outliers() -> None:
    s = _planted()
    res = refine_layer(s, "k", hadamard_matrix(D, dtype=torch.float64), RefineConfig(**CFG))
    rec = res.record
    assert rec["kept"] == "refined"
    assert rec["heldout_final"] < 0.5 * rec["heldout_init"]  # Hadamard 0.64, refined 0.16 when written
    r = res.rotation
    assert float((r @ r.T - torch.eye(D, dtype=torch.float64)).abs().max()) <= 1e-6
    assert float((r.float() @ r.float().T - torch.eye(D)).abs().max()) <= 1e-6


def test_keeps_init_when_refinement_cannot_help(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _planted()
    good = _good_rotation()
    # steps=0: nothing to gain, the init is returned unchanged
    res = refine_layer(s, "k", good, RefineConfig(**{**CFG, "steps_k": 0}))
    assert res.record["kept"] == "init" and torch.allclose(res.rotation, good, atol=1e-12)
    # an optimizer that returns something worse (identity spreads nothing) is ignored
    monkeypatch.setattr(refine_mod, "_optimize", lambda r0, *a, **k: (torch.eye(D, dtype=torch.float64).expand_as(r0).clone(), [1.0]))
    res = refine_layer(s, "k", good, RefineConfig(**CFG))
    assert res.record["kept"] == "init" and torch.allclose(res.rotation, good, atol=1e-12)
    assert res.record["heldout_refined"] > res.record["heldout_init"] == res.record["heldout_final"]


def test_per_head_keeps_the_better_per_head(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    s = LayerSamples(0, block_size=64, max_tokens=8 * 64, dtype=torch.float32)
    chan = torch.ones(D)
    chan[list(OUTLIERS)] = 12.0
    for _ in range(8):
        s.add_sequence(torch.randn(64, 4, D, generator=g), torch.randn(64, 2, D, generator=g) * chan,
                       torch.randn(64, 2, D, generator=g), start=100)
    h = hadamard_matrix(D, dtype=torch.float64)
    eye = torch.eye(D, dtype=torch.float64)
    # "refined" = identity for both heads: worse than Hadamard on head 0's outliers ... and head 1 too
    monkeypatch.setattr(refine_mod, "_optimize", lambda r0, *a, **k: (torch.stack([h, eye]), [1.0]))
    init = torch.stack([eye, eye])
    res = refine_layer(s, "k", init, RefineConfig(**{**CFG, "per_head": True}))
    assert res.rotation.shape == (2, D, D)
    assert res.record["kept"] == ["refined", "init"]
    assert torch.allclose(res.rotation[0], h) and torch.allclose(res.rotation[1], eye)


def test_same_seed_same_rotations_any_worker_count(tmp_path) -> None:
    samples = CalibrationSamples(block_size=64, max_tokens=8 * 64, dtype=torch.float32)
    for lid in (0, 1):
        s = _planted(blocks=8, seed=lid)
        q, k, v, _ = s.blocks()
        for i in range(q.shape[0]):
            samples.on_qkv(lid, q[i], k[i], v[i])
    cfg = RefineConfig(**{**CFG, "steps_k": 15, "steps_v": 10})
    a = refine_rotations(samples, "hadamard", cfg, workers=1)
    b = refine_rotations(samples, "hadamard", cfg, workers=2)
    c = refine_rotations(samples, "hadamard", replace(cfg, seed=1))
    for side in ("k", "v"):
        assert torch.equal(a.stacked(side), b.stacked(side))
    assert not torch.equal(a.stacked("k"), c.stacked("k"))
    assert [r["kept"] for r in a.records] == [r["kept"] for r in b.records]
    rs = a.rotation_set("k")
    assert validate(rs, head_dim=D, layer_ids=(0, 1)).max_orthogonality_error <= 1e-6
    back = read_rotation(write_rotation(tmp_path / "k_rotation_refined.pt", rs))  # a format-version-1 file
    assert back.format_version == 1 and torch.equal(back.rotations, a.stacked("k"))
    assert {r["side"] for r in a.records} == {"k", "v"} and all(r["seed"] == 0 for r in a.records)


def test_given_and_fitted_inits() -> None:
    samples = CalibrationSamples(block_size=64, max_tokens=4 * 64, dtype=torch.float32)
    q, k, v, _ = _planted(blocks=4).blocks()
    for i in range(4):
        samples.on_qkv(2, q[i], k[i], v[i])
    good = RotationSet(rotations=_good_rotation()[None].float(), layer_ids=(2,), objective="qqt_r_pbr_hg16")
    cfg = RefineConfig(**{**CFG, "steps_k": 0, "steps_v": 0})
    res = refine_rotations(samples, {"k": good, "v": {2: torch.eye(D)}}, cfg)
    assert torch.equal(res.stacked("k")[0], good.rotations[0]) and torch.equal(res.stacked("v")[0], torch.eye(D))
    assert [r["init"] for r in res.records] == ["qqt_r_pbr_hg16", "given"]
    fitted = refine_rotations(samples, "r_pbr_hg", cfg)
    r = fitted.stacked("k")[0].double()
    assert float((r @ r.T - torch.eye(D, dtype=torch.float64)).abs().max()) < 1e-6
    assert not torch.allclose(r, hadamard_matrix(D, dtype=torch.float64), atol=1e-3)
    with pytest.raises(FitError, match="no V rotations"):
        refine_rotations(samples, {"k": good}, cfg)


def test_per_head_results_are_per_head_sets() -> None:
    samples = CalibrationSamples(block_size=64, max_tokens=4 * 64, dtype=torch.float32)
    s = _planted(blocks=4)
    q, k, v, _ = s.blocks()
    for i in range(4):
        samples.on_qkv(0, q[i], k[i], v[i])
    res = refine_rotations(samples, "hadamard", RefineConfig(**{**CFG, "steps_k": 2, "steps_v": 2, "per_head": True}))
    assert res.stacked("k").shape == (1, 1, D, D)
    rs = res.rotation_set("k")  # one matrix per (layer, KV head)
    assert rs.source_grouping == "kv_head" and rs.rotations.shape == (1, 1, D, D)
    with pytest.raises(FitError, match="needs ≥ 2"):
        refine_layer(_planted(blocks=1), "k", torch.eye(D), RefineConfig(**CFG))


@pytest.mark.parametrize("int2kv, said", [
    (Int2KVConfig(lloyd_max=True), r"int2kv.lloyd_max=True is not modelled: refine with lloyd_max=False"),
    (Int2KVConfig(clip_search="bisect"), r"int2kv.clip_search='bisect' is not modelled"),
    ({"group_size": 16}, r"int2kv must be an Int2KVConfig, got dict"),
])
def test_refinement_refuses_int2_settings_its_loss_does_not_model(int2kv, said) -> None:
    with pytest.raises(FitError, match=said):
        RefineConfig(int2kv=int2kv)


def test_refinement_models_the_configs_settings() -> None:
    """The loss reads its clip ratio, group size, sink and dtypes from the one Int2KVConfig."""
    s = _planted(blocks=4)
    base = refine_layer(s, "k", torch.eye(D), RefineConfig(**{**CFG, "steps_k": 0})).record["heldout_init"]
    for change in ({"k_clip_ratio": 0.0}, {"group_size": 64}, {"scale_dtype": "float16"}, {"hp_dtype": "float32"}):
        cfg = RefineConfig(**{**CFG, "steps_k": 0, "int2kv": replace(CFG["int2kv"], **change)})
        assert refine_layer(s, "k", torch.eye(D), cfg).record["heldout_init"] != base, change
    assert RefineConfig(**CFG).to_dict()["int2kv"] == CFG["int2kv"].to_json()
