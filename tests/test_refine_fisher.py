"""The fisher refinement loss (served pairs weighted by the model's output gradients), the gradients'
capture during calibration and their way through a dump into the samples."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rotationzoo.errors import DumpError, FitError
from rotationzoo.fit import samples_from_dump
from rotationzoo.fit.dump import Dump, DumpWriter
from rotationzoo.fit.refine import refine_layer
from rotationzoo.fit.refine_loss import RefineConfig, _drawn_queries, layer_data, numerators
from rotationzoo.fit.samples import LayerSamples
from rotationzoo.hadamard import hadamard_matrix
from test_refine_served import D, HKV, HQ, INT2KV, N, PREFIX, RECENT, rotated_error
from test_refine_served import _samples as served_samples

CFG = RefineConfig(int2kv=INT2KV, loss="fisher", queries_per_block=24, steps_k=0, steps_v=0)


def _samples(blocks: int = 4, seed: int = 0, grads: bool = True) -> LayerSamples:
    return served_samples(blocks=blocks, seed=seed, grads=grads)


def _direct(samples: LayerSamples, side: str, r: torch.Tensor, cfg: RefineConfig) -> torch.Tensor:
    """The fisher loss numerator per KV head written out pair by pair (fp64), for the same drawn queries:
    K ``Σ (a_ij·scale·g_i·(v_j − o_i))² (q_i R·e_j)²``, V ``Σ a_ij² (g_i R·e_j)²`` over the INT2 pairs."""
    q, k, v, pos = samples.blocks()
    grads = samples.grads()
    assert grads is not None
    sel = _drawn_queries(pos, N, cfg, samples.layer_id)
    grp = HQ // HKV
    scale = D ** -0.5
    out = torch.zeros(HKV, dtype=torch.float64)
    for b in range(q.shape[0]):
        for h in range(HKV):
            e = rotated_error((k if side == "k" else v)[b, :, h], r, side, cfg)
            for j in range(grp):
                for i in sel[b].tolist():
                    qi, gi = q[b, i, h * grp + j].double(), grads[b, i, h * grp + j].double()
                    a = torch.softmax((k[b, : i + 1, h].double() @ qi) * scale, dim=0)
                    vv = v[b, : i + 1, h].double()
                    o = a @ vv
                    far = [t for t in range(i + 1) if t < i - RECENT and t + int(pos[b]) >= PREFIX]
                    for t in far:
                        if side == "k":
                            c = float(a[t]) * scale * float(gi @ (vv[t] - o))
                            out[h] += c ** 2 * float((qi @ r.double()) @ e[t]) ** 2
                        else:
                            out[h] += float(a[t]) ** 2 * float((gi @ r.double()) @ e[t]) ** 2
    return out


@pytest.mark.parametrize("side", ["k", "v"])
def test_fisher_loss_equals_its_pairwise_definition(side: str) -> None:
    s = _samples()
    r = hadamard_matrix(D, dtype=torch.float64)
    data = layer_data(s, side, CFG)
    got = numerators(r[None].float(), data, torch.arange(data.x.shape[0]), CFG)
    torch.testing.assert_close(got, _direct(s, side, r, CFG), rtol=2e-4, atol=1e-8)


def test_positions_the_model_does_not_use_stop_counting() -> None:
    """A query whose output gradient is zero adds nothing to either side's loss; the served loss still counts it."""
    s = _samples()
    r = hadamard_matrix(D, dtype=torch.float64)[None].float()
    idx = torch.arange(s.num_blocks)
    pos = s.blocks()[3]
    drawn = _drawn_queries(pos, N, CFG, s.layer_id)
    served = replace(CFG, loss="served")
    assert s.g is not None
    for side in ("k", "v"):
        before, served_before = numerators(r, layer_data(s, side, CFG), idx, CFG), \
            numerators(r, layer_data(s, side, served), idx, served)
        saved = s.g.clone()
        s.g.zero_()
        for b in range(s.num_blocks):
            s.g[b, drawn[b]] = saved[b, drawn[b]]  # only the drawn queries keep their gradients
        torch.testing.assert_close(numerators(r, layer_data(s, side, CFG), idx, CFG), before, rtol=1e-6, atol=0.0)
        s.g[:, :, 0] = 0.0  # the first query head's gradients gone
        after = numerators(r, layer_data(s, side, CFG), idx, CFG)
        assert float(after[0]) < float(before[0])
        torch.testing.assert_close(numerators(r, layer_data(s, side, served), idx, served), served_before)
        s.g.copy_(saved)


def test_fisher_refinement_lowers_its_held_out_loss() -> None:
    s = _samples(blocks=8, seed=3)
    cfg = replace(CFG, steps_k=25, lr=2e-2, batch_blocks=4)
    rec = refine_layer(s, "k", torch.eye(D, dtype=torch.float64), cfg).record  # outlier channels unrotated
    assert rec["loss"] == "k_fisher_score" and rec["heldout_final"] <= rec["heldout_init"]
    assert rec["heldout_refined"] < rec["heldout_init"]


def test_fisher_loss_needs_gradients_and_samples_take_them_for_all_or_none() -> None:
    s = _samples(grads=False)
    assert s.grads() is None
    with pytest.raises(FitError, match="loss 'fisher' needs the output gradients.*calibrate --grads"):
        layer_data(s, "k", CFG)
    mixed = LayerSamples(0, block_size=N, max_tokens=2 * N, dtype=torch.float32)
    q, kv = torch.randn(N, HQ, D), torch.randn(N, HKV, D)
    mixed.add_sequence(q, kv, kv, g=torch.randn(N, HQ, D))
    with pytest.raises(FitError, match="some calibration sequences came with output gradients and some without"):
        mixed.add_sequence(q, kv, kv)
    with pytest.raises(FitError, match="g must have q's shape"):
        mixed.add_sequence(q, kv, kv, g=torch.randn(N, HKV, D))
    assert RefineConfig(loss="fisher").loss_name("v") == "v_fisher_out"


def _write_dump(root: Path, grads: bool, budget: int | None = None) -> None:
    w = DumpWriter(root, token_budget=budget)
    gen = torch.Generator().manual_seed(1)
    for chunk in range(3):
        for layer in (0, 1):
            n = 6 if chunk == 0 else 200
            w.write(layer, q=torch.randn(n, HQ, D, generator=gen), k=torch.randn(n, HKV, D, generator=gen),
                    v=torch.randn(n, HKV, D, generator=gen))
            if grads:
                w.write_grads(layer, torch.full((n, HQ, D), float(100 * chunk + layer)))


def test_dump_gradients_reach_the_samples_in_block_order(tmp_path: Path) -> None:
    _write_dump(tmp_path / "with", grads=True)
    _write_dump(tmp_path / "without", grads=False)
    assert Dump(tmp_path / "with").has_grads(1) and not Dump(tmp_path / "without").has_grads(1)
    s = samples_from_dump(tmp_path / "with", max_tokens=400, block_size=100, grads=True)
    g = s.layers[1].grads()
    assert g is not None and g.shape == (4, 100, HQ, D)
    assert [float(g[b, 0, 0, 0]) for b in range(4)] == [101.0, 101.0, 201.0, 201.0]  # chunk 0 (warm-up) skipped
    assert samples_from_dump(tmp_path / "with", max_tokens=400, block_size=100).layers[1].grads() is None
    with pytest.raises(FitError, match="layer 0 holds no output gradients.*calibrate --grads"):
        samples_from_dump(tmp_path / "without", max_tokens=400, block_size=100, grads=True)


def test_writer_cuts_gradients_like_their_chunk(tmp_path: Path) -> None:
    _write_dump(tmp_path / "d", grads=True, budget=300)  # 6 + 200 + 94 rows per layer
    d = Dump(tmp_path / "d", keep_first_chunk=True)
    assert [d.load(0, "g", c).shape[0] for c in d.chunk_ids(0, ("q", "k", "v", "g"))] == [6, 200, 94]
    w = DumpWriter(tmp_path / "e")
    with pytest.raises(DumpError, match="no chunk written yet"):
        w.write_grads(0, torch.zeros(4, HQ, D))
    w.write(0, q=torch.zeros(4, HQ, D), k=torch.zeros(4, HKV, D), v=torch.zeros(4, HKV, D))
    with pytest.raises(DumpError, match=r"g must be \[n ≥ 4, heads, d\]"):
        w.write_grads(0, torch.zeros(3, HQ, D))


# -- the capture, on a tiny model -----------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> object:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=HQ,
        num_key_value_heads=HKV, head_dim=32, max_position_embeddings=256,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def test_output_gradients_are_those_of_the_nll_at_o_proj() -> None:
    from rotationzoo.integrations.transformers.capture import OutputGradCapture

    model = _tiny_llama()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    got: dict[int, torch.Tensor] = {}
    with OutputGradCapture(model, lambda lid, g: got.__setitem__(lid, g)):
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        nll = torch.nn.functional.cross_entropy(model(inputs_embeds=emb).logits[0, :-1], ids[0, 1:], reduction="sum")
        torch.autograd.grad(nll, [emb])
    # the same gradient, taken by perturbing layer 1's attention output directly
    inputs: list[torch.Tensor] = []
    o_proj = model.model.layers[1].self_attn.o_proj
    h = o_proj.register_forward_pre_hook(lambda m, a: (inputs.append(a[0].detach().requires_grad_()), (inputs[-1],))[1])
    nll = torch.nn.functional.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum")
    (want,) = torch.autograd.grad(nll, inputs)
    h.remove()
    assert sorted(got) == [0, 1] and got[1].shape == (40, HQ, 32)
    torch.testing.assert_close(got[1], want[0].reshape(40, HQ, 32))
    assert all(p.grad is None for p in model.parameters())  # the weights' gradients are not taken
