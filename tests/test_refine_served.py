"""The served refinement loss (only the pairs that are INT2 when served) and the keep rule on text."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rotationzoo.errors import EvaluationError, FitError
from rotationzoo.fit.refine import refine_layer
from rotationzoo.fit.refine_loss import RefineConfig, _drawn_queries, layer_data, numerators
from rotationzoo.fit.samples import LayerSamples
from rotationzoo.fit.ste import ste_quantize_int2
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels.layout import clip_index

D, N, HQ, HKV = 64, 96, 4, 2
PREFIX, RECENT = 4, 16
INT2KV = Int2KVConfig(group_size=16, prefix_tokens=PREFIX, recent_tokens=RECENT)
CFG = RefineConfig(int2kv=INT2KV, loss="served", queries_per_block=24, steps_k=0, steps_v=0)


def _samples(blocks: int = 4, seed: int = 0, starts: tuple[int, ...] = (0, 96), grads: bool = False) -> LayerSamples:
    """Random blocks with three outlier channels in K and V; ``grads``: with output gradients of random scale."""
    g = torch.Generator().manual_seed(seed)
    s = LayerSamples(5, block_size=N, max_tokens=blocks * N, dtype=torch.float32)
    chan = torch.ones(D)
    chan[:3] = 8.0
    for b in range(blocks):
        q = torch.randn(N, HQ, D, generator=g)
        k = torch.randn(N, HKV, D, generator=g) * chan
        v = torch.randn(N, HKV, D, generator=g) * chan
        out_grads = torch.randn(N, HQ, D, generator=g) * torch.rand(N, 1, 1, generator=g) if grads else None
        s.add_sequence(q, k, v, start=starts[b % len(starts)], g=out_grads)
    return s


def rotated_error(x: torch.Tensor, r: torch.Tensor, side: str, cfg: RefineConfig) -> torch.Tensor:
    """The INT2 store's error of rows ``x [n, d]`` in the basis ``r``, fp64, as the loss quantizes them."""
    xr = x.float() @ r.float()
    xq = ste_quantize_int2(xr, clip_index=clip_index(cfg.clip_ratio(side), D), group_size=16,
                           scale_dtype=torch.float32, round_rows=torch.bfloat16)
    return (xq - xr).double()


def _direct(samples: LayerSamples, side: str, r: torch.Tensor, cfg: RefineConfig) -> torch.Tensor:
    """The served loss numerator per KV head written out pair by pair (fp64), for the same drawn queries."""
    q, k, v, pos = samples.blocks()
    sel = _drawn_queries(pos, N, cfg, samples.layer_id)
    g = HQ // HKV
    out = torch.zeros(HKV, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(HKV):
            e = rotated_error((k if side == "k" else v)[b, :, h], r, side, cfg)
            for j in range(g):
                for i in sel[b].tolist():
                    qi = q[b, i, h * g + j].double()
                    scores = (k[b, : i + 1, h].double() @ qi) * D ** -0.5
                    a = torch.softmax(scores, dim=0)
                    far = [t for t in range(i + 1) if t < i - RECENT and t + int(pos[b]) >= PREFIX]
                    if side == "k":
                        qr = qi @ r.double()
                        out[h] += sum(float(a[t]) * float(qr @ e[t]) ** 2 for t in far)
                    else:
                        err = sum((float(a[t]) * e[t] for t in far), torch.zeros(D, dtype=torch.float64))
                        out[h] += float(err @ err)
    return out


@pytest.mark.parametrize("side", ["k", "v"])
def test_served_loss_equals_its_pairwise_definition(side: str) -> None:
    s = _samples()
    r = hadamard_matrix(D, dtype=torch.float64)
    data = layer_data(s, side, CFG)
    got = numerators(r[None].float(), data, torch.arange(data.x.shape[0]), CFG)
    want = _direct(s, side, r, CFG)
    torch.testing.assert_close(got, want, rtol=2e-4, atol=1e-6)


def test_drawn_queries_read_int2_keys_and_short_blocks_are_refused() -> None:
    pos = torch.tensor([0, 96, 3])
    sel = _drawn_queries(pos, N, CFG, 0)
    assert sel.shape == (3, 24)
    for p, row in zip(pos.tolist(), sel):
        assert int(row.min()) >= RECENT + 1 + max(0, PREFIX - p)  # the first query with an INT2 key
        assert len(set(row.tolist())) == 24 and int(row.max()) < N
    assert torch.equal(sel, _drawn_queries(pos, N, CFG, 0)) and not torch.equal(sel, _drawn_queries(pos, N, CFG, 1))
    with pytest.raises(FitError, match="holds no .query, key. pair that is INT2"):
        _drawn_queries(torch.tensor([0]), RECENT + PREFIX + 1, CFG, 0)


def test_served_v_loss_ignores_values_the_windows_hold_exactly() -> None:
    """Values of the sink and of the recent window are read in BF16 when served: changing them
    (the attention weights depend on q and k only) leaves the served V loss unchanged, while the
    every-pair block loss moves."""
    s = _samples()
    r = hadamard_matrix(D, dtype=torch.float64)[None].float()
    idx = torch.arange(s.num_blocks)
    before = numerators(r, layer_data(s, "v", CFG), idx, CFG)
    block_cfg = replace(CFG, loss="block")
    block_before = numerators(r, layer_data(s, "v", block_cfg), idx, block_cfg)
    q, k, v, pos = s.blocks()
    sink_block = int((pos == 0).nonzero()[0])
    s.v[sink_block, :PREFIX] *= 50.0  # the sink of a block that starts the sequence
    s.v[:, N - RECENT:] *= 50.0  # the newest keys: no drawn query is RECENT + 1 positions past them
    after = numerators(r, layer_data(s, "v", CFG), idx, CFG)
    torch.testing.assert_close(after, before, rtol=1e-6, atol=0.0)
    assert not torch.allclose(numerators(r, layer_data(s, "v", block_cfg), idx, block_cfg), block_before)


def test_served_refinement_lowers_its_held_out_loss() -> None:
    s = _samples(blocks=8, seed=3)
    cfg = replace(CFG, steps_k=25, lr=2e-2, batch_blocks=4)
    res = refine_layer(s, "k", hadamard_matrix(D, dtype=torch.float64), cfg)
    rec = res.record
    assert rec["loss"] == "k_served_score" and rec["heldout_final"] <= rec["heldout_init"]
    assert rec["train_loss_last"] < rec["train_loss_first"]


def test_refine_config_refuses_unknown_losses() -> None:
    with pytest.raises(FitError, match="loss must be one of served, fisher, block"):
        RefineConfig(loss="kl")
    with pytest.raises(FitError, match="queries_per_block"):
        RefineConfig(queries_per_block=0)


# -- the keep rule on held-out text ---------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=D, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _result(k_rot: torch.Tensor, v_rot: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor) -> object:
    from rotationzoo.fit import FitResult
    from rotationzoo.files.format import RotationSet

    def rs(t: torch.Tensor, name: str) -> RotationSet:
        return RotationSet(rotations=t.float().contiguous(), layer_ids=(0, 1), objective=name)

    return FitResult(k=rs(k_rot, "refined_k"), v=rs(v_rot, "refined_v"), objective="refined", composition="hadamard",
                     group_size=16, targets={"k": "k_served_score", "v": "v_served_out"}, layer_ids=(0, 1),
                     head_dim=D, num_q_heads=4, num_kv_heads=2, int2kv=INT2KV, refinement={"init": "hadamard"},
                     init=(rs(k0, "hadamard"), rs(v0, "hadamard")))


@pytest.fixture(scope="module")
def keep_inputs() -> tuple[object, list[int], torch.Tensor]:
    ids = torch.randint(3, 96, (400,), generator=torch.Generator().manual_seed(5)).tolist()
    h = hadamard_matrix(D, dtype=torch.float32).expand(2, D, D).contiguous()
    return _tiny_llama(), ids, h


def test_keep_rule_never_keeps_a_set_the_model_finds_worse(keep_inputs) -> None:
    from rotationzoo.evaluate.keep import keep_by_text, keep_summary

    model, ids, h = keep_inputs
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    worse_v = q.float().expand(2, D, D)  # a random rotation: the model measurably prefers the init's Hadamard V
    res = keep_by_text(model, ids, _result(q.float().expand(2, D, D), worse_v, h, h), window=128)
    keep = res.refinement["keep"]
    assert set(keep["kl"]) == {"init", "refined", "refined_k", "refined_v"} and keep["windows"] == 3
    assert keep["kl"]["refined_v"] > keep["kl"]["init"] and keep["kl"]["refined"] > keep["kl"]["init"]
    assert keep["chosen"] in ("init", "refined_k")
    worse = keep["vs_init"]["refined_v"]
    assert worse["verdict"] == "worse" and worse["delta"] == pytest.approx(keep["kl"]["refined_v"] - keep["kl"]["init"])
    assert torch.equal(res.v.rotations, h) and res.refinement["init"] == "hadamard"
    assert res.targets["v"] == "kept_init" and res.side_objective("v") == "refined_kept_init_hadamard"
    want_k = q.float().expand(2, D, D) if keep["chosen"] == "refined_k" else h
    assert torch.equal(res.k.rotations, want_k)
    assert "kept " + keep["chosen"] in (keep_summary(res) or "")


def test_keep_rule_judges_at_the_rules_clips(keep_inputs) -> None:
    from rotationzoo.recipe import KeepRule
    from rotationzoo.workflows.keep import apply_keep_rule

    model, ids, h = keep_inputs
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    result = _result(q.float().expand(2, D, D), h, h, h)
    trained = apply_keep_rule(result, model, ids, context=128)
    judged = apply_keep_rule(result, model, ids, context=128,
                             rule=KeepRule(texts=("held_out.txt",), k_clip_ratio=0.0, v_clip_ratio=0.5))
    assert trained.refinement["keep"]["int2kv"] == INT2KV.to_json()
    assert judged.refinement["keep"]["int2kv"] == INT2KV.replace(k_clip_ratio=0.0, v_clip_ratio=0.5).to_json()
    assert judged.refinement["keep"]["kl"]["refined_k"] != trained.refinement["keep"]["kl"]["refined_k"]
    assert judged.int2kv == result.int2kv  # the files still record the store they were refined for


def test_keep_rule_ties_go_to_the_init(keep_inputs) -> None:
    from rotationzoo.evaluate.keep import keep_by_text

    model, ids, h = keep_inputs
    res = keep_by_text(model, ids, _result(h.clone(), h.clone(), h, h), window=128)
    kl = res.refinement["keep"]["kl"]
    assert len(set(kl.values())) == 1 and res.refinement["keep"]["chosen"] == "init"
    assert res.k.objective == "hadamard"  # the init's own set


def test_keep_rule_refusals(keep_inputs) -> None:
    from rotationzoo.evaluate.keep import keep_by_text

    model, ids, h = keep_inputs
    good = _result(h, h, h, h)
    with pytest.raises(EvaluationError, match="has no init"):
        keep_by_text(model, ids, replace(good, init=None), window=128)
    with pytest.raises(EvaluationError, match="at least"):
        keep_by_text(model, ids[:40], good, window=128)
    with pytest.raises(EvaluationError, match="does not match the rotations"):
        keep_by_text(model, ids, replace(good, head_dim=128), window=128)
