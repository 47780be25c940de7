"""The OSCAR INT2 KV path for transformers (simulation and real cache), on tiny random Llama models."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.errors import EvaluationError  # noqa: E402
from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.integrations.transformers import (  # noqa: E402
    OscarKV, oscar_attention_name, oscar_kv, simulated_int2_attention,
)
from rotationzoo.kernels import dequantize_int2, quantize_int2  # noqa: E402

from helpers import int2_config, with_cache  # noqa: E402

D = 64


def tiny_llama(num_kv_heads: int = 2, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=D, max_position_embeddings=1024, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    return model


def cfg(**knobs) -> Int2KVConfig:
    """INT2-KV settings for tests: no clip and fp32 (exact) windows unless given."""
    return Int2KVConfig(**{"k_clip_ratio": 0.0, "v_clip_ratio": 0.0, "hp_dtype": "float32", **knobs})


def random_rotations(layers: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(layers, D, D, generator=g, dtype=torch.float64))[0].float()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (1, 48), generator=torch.Generator().manual_seed(5))


# -- exactness -------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_huge_windows_equal_fp_attention(model, ids, impl) -> None:
    """Everything inside the windows, windows in the model dtype: rotations cancel exactly."""
    model.set_attn_implementation(impl)
    try:
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits
            r = random_rotations()
            oscar = OscarKV(r, random_rotations(seed=2), config=cfg(prefix_tokens=512, recent_tokens=512, k_clip_ratio=0.96))
            with oscar_kv(model, oscar) as kv:
                sim = model(ids, use_cache=False).logits
                cached = model(ids, **kv.cache_kwargs()).logits
            assert model.config._attn_implementation == impl  # restored on exit
        torch.testing.assert_close(sim, ref, atol=2e-5, rtol=0)
        torch.testing.assert_close(cached, ref, atol=2e-5, rtol=0)
    finally:
        model.set_attn_implementation("sdpa")


def test_identity_rotation_without_quantization_is_fp(model, ids) -> None:
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        eye = torch.eye(D).expand(2, D, D).contiguous()
        oscar = OscarKV(eye, eye, config=cfg(prefix_tokens=0, recent_tokens=0), quantize_k=False, quantize_v=False)
        with oscar_kv(model, oscar):
            out = model(ids, use_cache=False).logits
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def _naive_attention(q, k_ex, v_ex, k_q, v_q, prefix, recent, scale):
    """Per-query loop: key j ≤ i is exact when j < prefix or i − j ≤ recent, else INT2."""
    b, hq, s, d = q.shape
    hkv, length = k_ex.shape[1], k_ex.shape[2]
    g = hq // hkv
    out = torch.zeros_like(q)
    for h in range(hq):
        kh = h // g
        for t in range(s):
            i = length - s + t
            ks, vs = [], []
            for j in range(i + 1):
                exact = j < prefix or i - j <= recent
                ks.append((k_ex if exact else k_q)[0, kh, j])
                vs.append((v_ex if exact else v_q)[0, kh, j])
            kk, vv = torch.stack(ks), torch.stack(vs)
            p = torch.softmax((kk @ q[0, h, t]) * scale, dim=0)
            out[0, h, t] = p @ vv
    return out


@pytest.mark.parametrize("prefix,recent,extra,s", [(0, 0, 0, 20), (3, 5, 0, 20), (4, 2, 7, 20), (50, 0, 0, 20),
                                                  (4, 32, 0, 150), (0, 40, 0, 200), (8, 33, 0, 170)])
def test_simulated_attention_matches_naive_loop(prefix, recent, extra, s) -> None:
    """Both paths (fused partial attentions merged by log-sum-exp for whole sequences, masked blocks
    otherwise) equal a per-query loop."""
    g = torch.Generator().manual_seed(prefix * 31 + recent)
    length = s + extra
    q = torch.randn(1, 4, s, D, generator=g)
    k_ex, v_ex = torch.randn(1, 2, length, D, generator=g), torch.randn(1, 2, length, D, generator=g)
    k_q, v_q = k_ex + 0.3 * torch.randn_like(k_ex), v_ex + 0.3 * torch.randn_like(v_ex)
    got = simulated_int2_attention(q, k_ex, v_ex, k_q, v_q, prefix=prefix, recent=recent, scale=0.125, block=7)
    ref = _naive_attention(q, k_ex, v_ex, k_q, v_q, prefix, recent, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix,recent,s", [(4, 32, 100), (3, 5, 20)])
def test_simulated_attention_gradients_match_naive_loop(prefix, recent, s) -> None:
    """The simulation can be differentiated (a call autograd records takes the masked path: the fused kernel's
    log-sum-exp carries no gradient): its gradients with respect to the queries and to both versions of the keys
    and values equal the per-query loop's, for a shape that takes the fused path without gradients (``recent``
    32, ``s`` 100) and one that takes the masked path."""
    g = torch.Generator().manual_seed(11 + s)
    q = torch.randn(1, 4, s, D, generator=g)
    k_ex, v_ex = torch.randn(1, 2, s, D, generator=g), torch.randn(1, 2, s, D, generator=g)
    k_q, v_q = k_ex + 0.3 * torch.randn_like(k_ex), v_ex + 0.3 * torch.randn_like(v_ex)
    w = torch.randn(1, 4, s, D, generator=g)
    grads = []
    for fn in (lambda *t: simulated_int2_attention(*t, prefix=prefix, recent=recent, scale=0.125, block=16),
               lambda *t: _naive_attention(*t, prefix, recent, 0.125)):
        inputs = [t.clone().requires_grad_(True) for t in (q, k_ex, v_ex, k_q, v_q)]
        (fn(*inputs) * w).sum().backward()
        grads.append([t.grad for t in inputs])
    for name, got, ref in zip(("q", "k exact", "v exact", "k int2", "v int2"), *grads):
        assert got.abs().sum() > 0, name
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4, msg=name)


def test_windows_zero_matches_direct_reference(model, ids) -> None:
    """No windows, G = d, no clip: the OSCAR attention equals attention over keys/values quantized
    directly with the kernels and un-rotated with Rᵀ (only the current token exact)."""
    layer = model.model.layers[1].self_attn
    r_k, r_v = random_rotations(seed=3)[1], random_rotations(seed=4)[1]
    rots_k = torch.stack([torch.eye(D), r_k])
    rots_v = torch.stack([torch.eye(D), r_v])
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 24, D, generator=g)
    k = torch.randn(1, 2, 24, D, generator=g) * 2
    v = torch.randn(1, 2, 24, D, generator=g)
    oscar = OscarKV(rots_k, rots_v, config=cfg(prefix_tokens=0, recent_tokens=0, group_size=D))
    fn = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[oscar_attention_name("sdpa")]
    with oscar_kv(model, oscar):
        out, _ = fn(layer, q, k, v, None, scaling=D ** -0.5)
    # direct reference in the original basis: quantize k·R (fp32 rotation, as the OSCAR path does;
    # the kernels' fused rotation rounds to bf16 first, which moves ~1 % of the codes by one step),
    # un-rotate the dequantized rows with Rᵀ, attend with the unrotated query
    ck, sk = quantize_int2(k @ r_k, config=int2_config(0.0, D))
    cv, sv = quantize_int2(v @ r_v, config=int2_config(0.0, D))
    k_hat = dequantize_int2(ck, sk, dtype=torch.float32) @ r_k.T
    v_hat = dequantize_int2(cv, sv, dtype=torch.float32) @ r_v.T
    ref = _naive_attention(q, k, v, k_hat, v_hat, 0, 0, D ** -0.5).transpose(1, 2)
    assert out.shape == ref.shape == (1, 24, 4, D)
    rel = (out - ref).norm() / ref.norm()
    assert rel < 1e-5, rel
    # and the quantization is real: far from the unquantized attention
    exact = _naive_attention(q, k, v, k, v, 0, 0, D ** -0.5).transpose(1, 2)
    assert (out - exact).norm() / exact.norm() > 5 * rel


# -- the real cache --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
@pytest.mark.parametrize("group_size,clip", [(64, 0.0), (16, 0.96)])
def test_incremental_cache_equals_simulation(num_kv_heads, group_size, clip) -> None:
    """Decoding token by token through OscarInt2Cache reads exactly what the simulation reads."""
    model = tiny_llama(num_kv_heads=num_kv_heads, seed=num_kv_heads)
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(num_kv_heads))
    oscar = OscarKV(random_rotations(), random_rotations(seed=7),
                    config=Int2KVConfig(group_size=group_size, k_clip_ratio=clip, v_clip_ratio=clip, prefix_tokens=3,
                                        recent_tokens=6))
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        sim = model(ids, use_cache=False).logits
        cache = kv.new_cache()
        steps = [model(ids[:, :5], **with_cache(cache)).logits[:, -1:]]  # a short prefill: inside the windows
        for t in range(5, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], **with_cache(cache)).logits)
    inc = torch.cat(steps, dim=1)
    torch.testing.assert_close(inc, sim[:, 4:], atol=1e-4, rtol=1e-4)
    layer = cache.layers[0]
    assert layer.stored_tokens() == {"prefix": 3, "int2": 40 - 3 - 6, "recent": 6}
    assert layer.codes_k.dtype == torch.uint8 and layer.codes_k.shape == (1, num_kv_heads, 31, D // 4)
    assert layer.sz_k.shape == (1, num_kv_heads, 31, 2 * D // group_size)


def test_cache_codes_are_the_kernels_codes(model, ids) -> None:
    r = random_rotations()
    oscar = OscarKV(r, r, config=Int2KVConfig(group_size=32, prefix_tokens=4, recent_tokens=8, scale_dtype="float16"))
    keys = {}  # post-RoPE keys/values of layer 0 as handed to the cache
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        orig = cache.layers[0].update

        def spy(k, v, *a, **kw):
            keys["k"], keys["v"] = k.clone(), v.clone()
            return orig(k, v, *a, **kw)

        cache.layers[0].update = spy
        model(ids, **with_cache(cache))
    layer = cache.layers[0]
    k_rot = (keys["k"].float() @ r[0]).to(torch.bfloat16)
    codes, sz = quantize_int2(k_rot[:, :, 4:-8], config=int2_config(0.96, 32, scale=torch.float16))
    assert torch.equal(layer.codes_k, codes)
    assert torch.equal(layer.sz_k, sz)
    assert torch.equal(layer.sink_k, k_rot[:, :, :4])
    assert torch.equal(layer.recent_k, k_rot[:, :, -8:])


def test_cache_bits_per_element_matches_formula(model, ids) -> None:
    oscar = OscarKV(None, None, config=Int2KVConfig(group_size=64, prefix_tokens=1, recent_tokens=1)).replace(
        group_size=16, prefix_tokens=4, recent_tokens=8, scale_dtype="float16")
    assert oscar.describe()["group_size"] == 16 and oscar.describe()["rotated"] == {"k": False, "v": False}
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids, **with_cache(cache))
    want = oscar.config.bits_per_element(D, ids.shape[1])
    assert math.isclose(cache.bits_per_element(), want, rel_tol=1e-12)


def test_cache_argument_is_the_keyword_the_installed_models_take(model) -> None:
    """``cache`` from transformers 5.24 (where ``past_key_values`` is deprecated), ``past_key_values`` before:
    the name :meth:`OscarSession.cache_kwargs` passes is a parameter of the model's forward."""
    import inspect

    from rotationzoo.integrations.transformers import cache_argument

    name = cache_argument()
    assert name in inspect.signature(type(model).forward).parameters, name
    assert name == ("cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values")


def test_generate_with_cache(model, ids) -> None:
    prompt = ids[:, :12]
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=8, do_sample=False)
        eye = torch.eye(D).expand(2, D, D).contiguous()
        exact = OscarKV(random_rotations(), random_rotations(seed=3), config=cfg(prefix_tokens=256, recent_tokens=256))
        with oscar_kv(model, exact) as kv:
            same = model.generate(prompt, **kv.cache_kwargs(), max_new_tokens=8, do_sample=False)
        int2 = OscarKV(eye, eye, config=Int2KVConfig(prefix_tokens=2, recent_tokens=2, group_size=16))
        with oscar_kv(model, int2) as kv:
            cache = kv.new_cache()
            out = model.generate(prompt, **with_cache(cache), max_new_tokens=8, do_sample=False)
    assert torch.equal(same, ref)
    assert out.shape == ref.shape
    # the last generated token is never written to the cache
    assert cache.get_seq_length() == ref.shape[1] - 1
    assert cache.layers[1].stored_tokens() == {"prefix": 2, "int2": ref.shape[1] - 1 - 4, "recent": 2}


def test_generate_batched_with_padding() -> None:
    model = tiny_llama(seed=3)
    batch = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18]])
    mask = (batch != 0).long()
    with torch.no_grad():
        ref = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
        oscar = OscarKV(random_rotations(), random_rotations(seed=5), config=cfg(prefix_tokens=64, recent_tokens=64))
        with oscar_kv(model, oscar) as kv:
            out = model.generate(batch, attention_mask=mask, **kv.cache_kwargs(), max_new_tokens=6, do_sample=False)
            sim = model(batch, attention_mask=mask, use_cache=False).logits
        plain = model(batch, attention_mask=mask, use_cache=False).logits
    assert torch.equal(out, ref)
    torch.testing.assert_close(sim[mask.bool()], plain[mask.bool()], atol=2e-5, rtol=0)


def test_cache_without_oscar_attention_is_refused(model, ids) -> None:
    oscar = OscarKV(random_rotations(), random_rotations(), config=Int2KVConfig(prefix_tokens=4, recent_tokens=4))
    with oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
    with torch.no_grad(), pytest.raises(EvaluationError, match="oscar_kv"):
        model(ids[:, :10], **with_cache(cache))
        model(ids[:, 10:11], **with_cache(cache))


def test_layer_errors_are_collected(model, ids) -> None:
    oscar = OscarKV(None, None, config=Int2KVConfig(prefix_tokens=0, recent_tokens=0, group_size=16))
    with torch.no_grad(), oscar_kv(model, oscar, collect_errors=True) as kv:
        model(ids, use_cache=False)
        errs = kv.layer_errors()
    assert sorted(errs) == [0, 1]
    assert all(0 < e < 1.5 for e in errs.values())


# -- the INT2-KV settings reach the kernels ----------------------------------------------------------


@pytest.mark.parametrize("knobs", [{"lloyd_max": True}, {"clip_search": "bisect", "group_size": 16},
                                   {"scale_dtype": "bfloat16", "group_size": 32}])
def test_config_knobs_reach_the_quantizer(model, knobs) -> None:
    """Lloyd-Max, the bisection clip and the scale dtype are applied to the INT2 rows exactly as the kernels do."""
    from rotationzoo.dtypes import TORCH_DTYPES
    from rotationzoo.integrations.transformers.oscar import quantize_rows

    conf = Int2KVConfig(**knobs)
    oscar = OscarKV(None, None, config=conf)
    x = torch.randn(1, 2, 40, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes, sz = quantize_rows(x, oscar, "k")
    want_c, want_s = quantize_int2(x, config=int2_config(conf.k_clip_ratio, conf.group_size, lloyd_max=conf.lloyd_max,
                                                         scale=TORCH_DTYPES[conf.scale_dtype], search=conf.clip_search))
    plain_c, _ = quantize_int2(x, config=int2_config(conf.k_clip_ratio, conf.group_size))
    assert torch.equal(codes, want_c) and torch.equal(sz, want_s)
    assert not torch.equal(codes, plain_c) or sz.dtype != torch.float32  # the knob changed something


def test_lloyd_max_entry_is_evaluated_with_lloyd_max(model, ids) -> None:
    """An entry served with lloyd_max: true runs the model with Lloyd-Max codes (different logits)."""
    base = Int2KVConfig(prefix_tokens=2, recent_tokens=2)
    outs = {}
    for lm in (False, True):
        with torch.no_grad(), oscar_kv(model, OscarKV(random_rotations(), random_rotations(), config=base.replace(
                lloyd_max=lm))):
            outs[lm] = model(ids, use_cache=False).logits
    assert not torch.allclose(outs[False], outs[True])


def test_per_kv_head_rotations_rotate_each_head(model, ids) -> None:
    """[L, H_kv, d, d] rotations: identical heads equal the shared rotation; without quantization
    every rotation cancels."""
    r = random_rotations()
    per_head = r[:, None].expand(2, 2, D, D).contiguous()
    conf = Int2KVConfig(prefix_tokens=2, recent_tokens=2)
    with torch.no_grad():
        with oscar_kv(model, OscarKV(r, r, config=conf)):
            shared = model(ids, use_cache=False).logits
        with oscar_kv(model, OscarKV(per_head, per_head, config=conf)):
            heads = model(ids, use_cache=False).logits
        ref = model(ids, use_cache=False).logits
        distinct = torch.stack([random_rotations(seed=5), random_rotations(seed=6)], dim=1)
        with oscar_kv(model, OscarKV(distinct, distinct, config=cfg(prefix_tokens=0, recent_tokens=0),
                                     quantize_k=False, quantize_v=False)):
            exact = model(ids, use_cache=False).logits
    torch.testing.assert_close(heads, shared, atol=1e-5, rtol=0)
    torch.testing.assert_close(exact, ref, atol=2e-5, rtol=0)
