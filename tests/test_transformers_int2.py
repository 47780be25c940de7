"""The OSCAR INT2 KV path for transformers, on tiny random Llama models (no download)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.evaluate import (  # noqa: E402
    EvalSettings, MethodSpec, _windows, bits_per_element, evaluate, plot_results, tokenize_texts,
)
from rotationzoo.integrations.transformers import (  # noqa: E402
    OscarKV, oscar_attention_name, oscar_kv, simulated_int2_attention,
)
from rotationzoo.kernels import dequantize_int2, quantize_int2  # noqa: E402

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
            oscar = OscarKV(r, random_rotations(seed=2), prefix=512, recent=512, window_dtype=None, clip_k=0.96)
            with oscar_kv(model, oscar) as kv:
                sim = model(ids, use_cache=False).logits
                cached = model(ids, cache=kv.new_cache()).logits
            assert model.config._attn_implementation == impl  # restored on exit
        torch.testing.assert_close(sim, ref, atol=2e-5, rtol=0)
        torch.testing.assert_close(cached, ref, atol=2e-5, rtol=0)
    finally:
        model.set_attn_implementation("sdpa")


def test_identity_rotation_without_quantization_is_fp(model, ids) -> None:
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        eye = torch.eye(D).expand(2, D, D).contiguous()
        oscar = OscarKV(eye, eye, prefix=0, recent=0, window_dtype=None, quantize_k=False, quantize_v=False)
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


@pytest.mark.parametrize("prefix,recent,extra", [(0, 0, 0), (3, 5, 0), (4, 2, 7), (50, 0, 0)])
def test_simulated_attention_matches_naive_loop(prefix, recent, extra) -> None:
    g = torch.Generator().manual_seed(prefix * 31 + recent)
    s, length = 20, 20 + extra
    q = torch.randn(1, 4, s, D, generator=g)
    k_ex, v_ex = torch.randn(1, 2, length, D, generator=g), torch.randn(1, 2, length, D, generator=g)
    k_q, v_q = k_ex + 0.3 * torch.randn_like(k_ex), v_ex + 0.3 * torch.randn_like(v_ex)
    got = simulated_int2_attention(q, k_ex, v_ex, k_q, v_q, prefix=prefix, recent=recent, scale=0.125, block=7)
    ref = _naive_attention(q, k_ex, v_ex, k_q, v_q, prefix, recent, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


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
    oscar = OscarKV(rots_k, rots_v, prefix=0, recent=0, window_dtype=None, group_size=D)
    fn = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS[oscar_attention_name("sdpa")]
    with oscar_kv(model, oscar):
        out, _ = fn(layer, q, k, v, None, scaling=D ** -0.5)
    # direct reference in the original basis: quantize k·R (fp32 rotation, as the OSCAR path does;
    # the kernels' fused rotation rounds to bf16 first, which moves ~1 % of the codes by one step),
    # un-rotate the dequantized rows with Rᵀ, attend with the unrotated query
    ck, sk = quantize_int2(k @ r_k, group_size=D)
    cv, sv = quantize_int2(v @ r_v, group_size=D)
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
    oscar = OscarKV(random_rotations(), random_rotations(seed=7), group_size=group_size, clip_k=clip, clip_v=clip,
                    prefix=3, recent=6)
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        sim = model(ids, use_cache=False).logits
        cache = kv.new_cache()
        steps = [model(ids[:, :5], cache=cache).logits[:, -1:]]  # a short prefill: inside the windows
        for t in range(5, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], cache=cache).logits)
    inc = torch.cat(steps, dim=1)
    torch.testing.assert_close(inc, sim[:, 4:], atol=1e-4, rtol=1e-4)
    layer = cache.layers[0]
    assert layer.stored_tokens() == {"prefix": 3, "int2": 40 - 3 - 6, "recent": 6}
    assert layer.codes_k.dtype == torch.uint8 and layer.codes_k.shape == (1, num_kv_heads, 31, D // 4)
    assert layer.sz_k.shape == (1, num_kv_heads, 31, 2 * D // group_size)


def test_cache_codes_are_the_kernels_codes(model, ids) -> None:
    r = random_rotations()
    oscar = OscarKV(r, r, group_size=32, clip_k=0.96, clip_v=0.92, prefix=4, recent=8, scale_dtype=torch.float16)
    keys = {}  # post-RoPE keys/values of layer 0 as handed to the cache
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        orig = cache.layers[0].update

        def spy(k, v, *a, **kw):
            keys["k"], keys["v"] = k.clone(), v.clone()
            return orig(k, v, *a, **kw)

        cache.layers[0].update = spy
        model(ids, cache=cache)
    layer = cache.layers[0]
    k_rot = (keys["k"].float() @ r[0]).to(torch.bfloat16)
    codes, sz = quantize_int2(k_rot[:, :, 4:-8], clip_ratio=0.96, group_size=32, scale_dtype=torch.float16)
    assert torch.equal(layer.codes_k, codes)
    assert torch.equal(layer.sz_k, sz)
    assert torch.equal(layer.sink_k, k_rot[:, :, :4])
    assert torch.equal(layer.recent_k, k_rot[:, :, -8:])


def test_cache_bits_per_element_matches_formula(model, ids) -> None:
    oscar = OscarKV(None, None, group_size=64, prefix=1, recent=1).replace(
        group_size=16, prefix=4, recent=8, scale_dtype=torch.float16)
    assert oscar.describe()["group_size"] == 16 and oscar.describe()["rotated"] == {"k": False, "v": False}
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
        model(ids, cache=cache)
    want = bits_per_element(head_dim=D, group_size=16, context_len=ids.shape[1], prefix=4, recent=8,
                            scale_bits=16, window_bits=16)
    assert math.isclose(cache.bits_per_element(), want, rel_tol=1e-12)


def test_generate_with_cache(model, ids) -> None:
    prompt = ids[:, :12]
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=8, do_sample=False)
        eye = torch.eye(D).expand(2, D, D).contiguous()
        exact = OscarKV(random_rotations(), random_rotations(seed=3), prefix=256, recent=256, window_dtype=None)
        with oscar_kv(model, exact) as kv:
            same = model.generate(prompt, cache=kv.new_cache(), max_new_tokens=8, do_sample=False)
        int2 = OscarKV(eye, eye, prefix=2, recent=2, group_size=16)
        with oscar_kv(model, int2) as kv:
            cache = kv.new_cache()
            out = model.generate(prompt, cache=cache, max_new_tokens=8, do_sample=False)
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
        oscar = OscarKV(random_rotations(), random_rotations(seed=5), prefix=64, recent=64, window_dtype=None)
        with oscar_kv(model, oscar) as kv:
            out = model.generate(batch, attention_mask=mask, cache=kv.new_cache(), max_new_tokens=6, do_sample=False)
            sim = model(batch, attention_mask=mask, use_cache=False).logits
        plain = model(batch, attention_mask=mask, use_cache=False).logits
    assert torch.equal(out, ref)
    torch.testing.assert_close(sim[mask.bool()], plain[mask.bool()], atol=2e-5, rtol=0)


def test_cache_without_oscar_attention_is_refused(model, ids) -> None:
    from rotationzoo.errors import FitError

    oscar = OscarKV(random_rotations(), random_rotations(), prefix=4, recent=4)
    with oscar_kv(model, oscar) as kv:
        cache = kv.new_cache()
    with torch.no_grad(), pytest.raises(FitError, match="oscar_kv"):
        model(ids[:, :10], cache=cache)
        model(ids[:, 10:11], cache=cache)


def test_layer_errors_are_collected(model, ids) -> None:
    oscar = OscarKV(None, None, prefix=0, recent=0, group_size=16)
    with torch.no_grad(), oscar_kv(model, oscar, collect_errors=True) as kv:
        model(ids, use_cache=False)
        errs = kv.layer_errors()
    assert sorted(errs) == [0, 1]
    assert all(0 < e < 1.5 for e in errs.values())


# -- evaluation library and CLI --------------------------------------------------------------------


def test_bits_per_element_definition() -> None:
    # d = G = 64, 16-bit scale and zero: 2.5 bits per INT2 element; 320 BF16 window tokens at L = 2048
    assert bits_per_element(head_dim=64, group_size=64, context_len=2048, prefix=64, recent=256) == pytest.approx(
        (1728 * 2.5 + 320 * 16) / 2048)
    assert bits_per_element(head_dim=64, group_size=16, context_len=2048, prefix=0, recent=0) == 4.0
    assert bits_per_element(head_dim=128, group_size=None, context_len=131072, prefix=64, recent=256,
                            scale_bits=16) == pytest.approx(2.25 + 320 * 13.75 / 131072)  # the paper's 2.28
    assert bits_per_element(head_dim=64, group_size=32, context_len=100, prefix=64, recent=256) == 16.0


@pytest.mark.parametrize("n,window,stride", [(10, 4, 4), (10, 4, 2), (9, 9, 9), (100, 32, 7)])
def test_windows_score_every_target_once(n, window, stride) -> None:
    targets = []
    for begin, end, first in _windows(n, window, stride):
        assert end - begin <= window and begin < first <= end
        targets.extend(range(first, end))
    if stride == window:
        assert targets == [t for t in range(1, n) if t % window]
    else:
        assert targets == list(range(1, n))


def test_evaluate_report_and_plot(model, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    settings = EvalSettings(window=64, group_size=16, clip_k=0.96, clip_v=0.92, prefix=4, recent=8)
    methods = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard()]
    report = evaluate(model, ids, methods, settings, model_name="tiny")
    assert [r.method for r in report.results] == ["fp", "none", "hadamard"]
    fp, none, had = report.results
    assert fp.bpe == 32.0 and fp.tokens_scored == none.tokens_scored == 200 - 4
    assert none.perplexity > 0 and had.layer_errors and len(had.layer_ids) == 2
    assert had.bpe == pytest.approx(bits_per_element(head_dim=64, group_size=16, context_len=64, prefix=4, recent=8))
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["results"][2]["method"] == "hadamard"
    png = plot_results(report.results, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _save_tiny(tmp_path):
    """A tiny Llama folder with a word-level tokenizer, loadable offline by ``rotationzoo eval``."""
    tokenizers = pytest.importorskip("tokenizers")
    words = "the a of and to in was she he her it had be that not as for with his you i at by on".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    model = tiny_llama(seed=11)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    text = tmp_path / "held_out.txt"
    g = torch.Generator().manual_seed(2)
    text.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (400,), generator=g)))
    return folder, text


def test_cli_eval(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from rotationzoo.cli.main import main
    from rotationzoo.fit import hadamard_rotations, write_fitted
    from rotationzoo.fit import FitResult

    folder, text = _save_tiny(tmp_path)
    h = hadamard_rotations((0, 1), D)
    res = FitResult(k=h, v=h, objective="hadamard", composition="none", group_size=None,
                    targets={"k": None, "v": None}, layer_ids=(0, 1), head_dim=D)
    write_fitted(res, tmp_path / "rot")
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    rc = main(["eval", "--model", str(folder), "--rotations", str(tmp_path / "rot"), "--text", str(text),
               "--window", "128", "--group-size", "32", "--prefix", "4", "--recent", "8",
               "--methods", "fp,none,hadamard,oscar,again=" + str(tmp_path / "rot"),
               "--plot", str(out_png), "--json-out", str(out_json)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "BPE" in printed and "hadamard" in printed and "again" in printed
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"fp", "none", "hadamard", "oscar", "again"}
    # the same Hadamard matrices through the file path and the built-in method
    assert rows["oscar"]["perplexity"] == pytest.approx(rows["hadamard"]["perplexity"], rel=1e-6)
    assert rows["oscar"]["bpe"] == pytest.approx(bits_per_element(head_dim=64, group_size=32, context_len=128,
                                                                  prefix=4, recent=8))
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main(["eval", "--model", str(folder), "--text", str(text), "--window", "64", "--methods", "fp,none", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["results"][1]["method"] == "none"


def test_cli_eval_errors(tmp_path, capsys) -> None:
    from rotationzoo.cli.main import main

    folder, text = _save_tiny(tmp_path)
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,oscar"]) != 0
    assert "--rotations" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,bogus"]) != 0
    assert "unknown method" in capsys.readouterr().err


def test_tokenize_texts(tmp_path) -> None:
    folder, text = _save_tiny(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = tokenize_texts(tok, [text, text], tokens=500)
    assert len(ids) == 500
