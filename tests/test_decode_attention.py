"""Decode attention over the INT2 cache layout: the PyTorch reference against a naive
dequantize-then-softmax, the Triton kernel (interpreter on CPU) against the reference, the argument
rules, and the reference's transient memory (one tile, not the history)."""

from __future__ import annotations

import os
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rotationzoo.errors import KernelInputError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import Int2KV, decode_attention_int2, dequantize_int2, quantize_int2
from rotationzoo.kernels.decode_reference import decode_attention_torch

from helpers import int2_config

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def orthogonal(d, heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (d, d) if heads is None else (heads, d, d)
    return torch.linalg.qr(torch.randn(shape, generator=g, dtype=torch.float64))[0].float().to(DEVICE)


def make_cache(b, hkv, d, p, n, r, *, group=None, lloyd_max=False, hp=torch.bfloat16, scale=torch.float32, seed=0):
    """Random rotated-basis rows as a cache holds them: ``(Int2KV, dense fp32 [B, H, L, d] of what the
    cache reads back)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, hkv, p + n + r, d, generator=g) * (1 + torch.rand(b, hkv, 1, d, generator=g) * 3)
    x = x.to(DEVICE)
    codes, sz = quantize_int2(x[:, :, p:p + n], config=int2_config(0.96, group, lloyd_max=lloyd_max, scale=scale))
    sink, recent = x[:, :, :p].to(hp), x[:, :, p + n:].to(hp)
    dense = torch.cat([sink.float(), dequantize_int2(codes, sz, dtype=torch.float32), recent.float()], dim=2)
    return Int2KV(sink, codes, sz, recent), dense


def naive(q, k, v, *, rq=None, ro=None, scale=None, causal=True):
    """Attention over dense keys/values, one query row at a time (float64)."""
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    qq = q.double()
    out = torch.zeros(b, hq, s, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            r = None if rq is None else (rq if rq.dim() == 2 else rq[kh]).double().cpu()
            o_r = None if ro is None else (ro if ro.dim() == 2 else ro[kh]).double().cpu()
            for t in range(s):
                last = length - s + t if causal else length - 1
                qv = qq[bi, h, t].cpu() if r is None else qq[bi, h, t].cpu() @ r
                sc = (k[bi, kh, : last + 1].double().cpu() @ qv) * (scale or d ** -0.5)
                o = torch.softmax(sc, 0) @ v[bi, kh, : last + 1].double().cpu()
                out[bi, h, t] = o if o_r is None else o @ o_r
    return out


CASES = [
    # b, hq, hkv, s, d, (P, N, R), group, extra
    (1, 4, 2, 1, 64, (3, 150, 5), 64, {}),
    (2, 6, 2, 1, 64, (4, 97, 6), 16, {}),
    (1, 8, 2, 3, 128, (5, 130, 9), 128, {"per_head": True}),
    (1, 4, 1, 2, 64, (2, 70, 4), 64, {"lloyd_max": True}),
    (1, 4, 4, 1, 64, (0, 200, 0), 32, {"scale": torch.float16}),
    (1, 2, 1, 4, 64, (6, 0, 10), 64, {}),  # no INT2 token yet
    (1, 4, 2, 1, 64, (8, 60, 0), 64, {"hp": torch.float16}),  # no recent token
    (1, 4, 2, 1, 256, (2, 40, 3), 64, {"scale": torch.bfloat16}),
    (1, 16, 2, 3, 128, (4, 90, 6), 16, {}),  # 24 query rows of 2 groups per quarter: 3 row blocks
    (1, 4, 4, 1, 64, (3, 150, 5), 64, {}),  # one query row per KV head, one group per row
]


@pytest.mark.parametrize("b,hq,hkv,s,d,parts,group,extra", CASES)
def test_reference_equals_naive_dequantized_attention(b, hq, hkv, s, d, parts, group, extra):
    k, kd = make_cache(b, hkv, d, *parts, group=group, lloyd_max=extra.get("lloyd_max", False),
                       hp=extra.get("hp", torch.bfloat16), scale=extra.get("scale", torch.float32), seed=1)
    v, vd = make_cache(b, hkv, d, *parts, group=group, lloyd_max=extra.get("lloyd_max", False),
                       hp=extra.get("hp", torch.bfloat16), scale=extra.get("scale", torch.float32), seed=2)
    q = torch.randn(b, hq, s, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    rk = orthogonal(d, hkv if extra.get("per_head") else None, seed=4)
    rv = orthogonal(d, hkv if extra.get("per_head") else None, seed=5)
    want = naive(q, kd, vd, rq=rk, ro=rv.transpose(-1, -2))
    for splits in (None, 1, 3):
        got = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, num_splits=splits, backend="torch",
                                    dtype=torch.float32)
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("b,hq,hkv,s,d,parts,group,extra", CASES)
def test_triton_equals_reference(b, hq, hkv, s, d, parts, group, extra):
    pytest.importorskip("triton", reason="triton is not installed")
    k, _ = make_cache(b, hkv, d, *parts, group=group, lloyd_max=extra.get("lloyd_max", False),
                      hp=extra.get("hp", torch.bfloat16), scale=extra.get("scale", torch.float32), seed=6)
    v, _ = make_cache(b, hkv, d, *parts, group=group, lloyd_max=extra.get("lloyd_max", False),
                      hp=extra.get("hp", torch.bfloat16), scale=extra.get("scale", torch.float32), seed=7)
    q = torch.randn(b, hq, s, d, generator=torch.Generator().manual_seed(8)).to(DEVICE).to(torch.bfloat16)
    rk = orthogonal(d, hkv if extra.get("per_head") else None, seed=9)
    rv = orthogonal(d, hkv if extra.get("per_head") else None, seed=10)
    ref = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="torch", dtype=torch.float32)
    # interpreted: fp32 products, sums in another order; compiled: bf16-split tensor-core products
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    for splits in (None, 1, 3):
        got = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="triton", num_splits=splits,
                                    dtype=torch.float32 if splits else None)
        assert got.dtype == (torch.float32 if splits else torch.bfloat16) and got.shape == (b, hq, s, d)
        rel = float((got.float() - ref).norm() / ref.norm())
        assert rel < (tol if splits else 4e-3), (splits, rel)  # bf16 output: its rounding


def test_explicit_query_and_output_matrices():
    """Non-orthogonal sets: keys stored as k·A, values as v·B; q_rotation = A⁻ᵀ and o_rotation = B⁻ᵀ
    (the file format's meaning: the output is multiplied by o_rotationᵀ = B⁻¹) give attention in the
    original basis (checked against the naive formula with the same matrices)."""
    d, hkv = 64, 2
    g = torch.Generator().manual_seed(11)
    a = (torch.eye(d) + 0.3 * torch.randn(hkv, d, d, generator=g)).to(DEVICE)
    bm = (torch.eye(d) + 0.3 * torch.randn(d, d, generator=g)).to(DEVICE)
    k, kd = make_cache(1, hkv, d, 4, 120, 6, seed=12)
    v, vd = make_cache(1, hkv, d, 4, 120, 6, seed=13)
    q = torch.randn(1, 4, 2, d, generator=g).to(DEVICE)
    qa, ob = torch.linalg.inv(a).transpose(-1, -2), torch.linalg.inv(bm).transpose(-1, -2)
    want = naive(q, kd, vd, rq=qa, ro=ob.transpose(-1, -2))
    for backend in ("torch", "triton"):
        if backend == "triton":
            pytest.importorskip("triton", reason="triton is not installed")
        got = decode_attention_int2(q, k, v, q_rotation=qa, o_rotation=ob, backend=backend, dtype=torch.float32)
        torch.testing.assert_close(got.double().cpu(), want, atol=1e-4, rtol=1e-4)


def test_not_causal_and_scale():
    k, kd = make_cache(1, 2, 64, 3, 50, 4, seed=14)
    v, vd = make_cache(1, 2, 64, 3, 50, 4, seed=15)
    q = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(16)).to(DEVICE)
    got = decode_attention_int2(q, k, v, causal=False, scale=0.3, backend="torch", dtype=torch.float32)
    torch.testing.assert_close(got.double().cpu(), naive(q, kd, vd, causal=False, scale=0.3), atol=2e-5, rtol=2e-5)
    causal = decode_attention_int2(q, k, v, scale=0.3, backend="torch", dtype=torch.float32)
    assert not torch.allclose(causal, got)  # the last query tokens do not see each other then


def test_nan_rows_make_the_output_nan_in_both_backends():
    """A row the quantizer flagged (NaN scale/zero) poisons the output, as dequantize-then-attend would."""
    x = torch.randn(1, 2, 60, 64)
    x[0, 1, 30, 5] = float("nan")
    codes, sz = quantize_int2(x.to(DEVICE))
    kv = Int2KV(None, codes, sz, None)
    q = torch.randn(1, 2, 1, 64).to(DEVICE)
    for backend in ("torch", "triton"):
        if backend == "triton":
            pytest.importorskip("triton", reason="triton is not installed")
        out = decode_attention_int2(q, kv, kv, backend=backend)
        assert not torch.isnan(out[0, 0]).any() and torch.isnan(out[0, 1]).all(), backend


def _skip_unless_built(backend: str) -> None:
    """Skip a backend this machine cannot run (no triton; no C++ compiler for the CPU kernels)."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    if backend == "cpu":
        from rotationzoo.kernels import native

        if not native.native_available():
            pytest.skip("the C++ kernels are not built here (no compiler)")


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_row_that_sees_no_key_gets_zeros_even_beside_a_flagged_row(backend):
    """A query row the mask hides every key from gets zeros (the documented rule); a flagged value row in its
    KV head made the Triton kernel's merge return NaN there (0 x NaN)."""
    _skip_unless_built(backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 16, 64, generator=g)
    x[0, 0, 5, 0] = float("nan")  # one value row flagged by the quantizer
    codes, sz = quantize_int2(x.to(DEVICE))
    kc, ks = quantize_int2(torch.randn(1, 1, 16, 64, generator=g).to(DEVICE))
    k, v = Int2KV(None, kc, ks, None), Int2KV(None, codes, sz, None)
    mask = torch.ones(1, 2, 1, 16, dtype=torch.bool, device=DEVICE)
    mask[0, 1] = False  # query head 1 sees no key
    out = decode_attention_int2(torch.randn(1, 2, 1, 64, generator=g).to(DEVICE), k, v, mask=mask, backend=backend,
                                dtype=torch.float32)
    assert torch.isnan(out[0, 0]).all() and torch.equal(out[0, 1], torch.zeros_like(out[0, 1])), backend


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_float64_rotation_is_applied_in_fp32_as_documented(backend):
    """Every backend rounds a float64 matrix to fp32 first: the output equals the one for its fp32 rounding
    (the C++ kernel to its documented summation-order tolerance)."""
    _skip_unless_built(backend)
    d, hkv = 64, 2
    k, _ = make_cache(1, hkv, d, 4, 60, 4, seed=21)
    v, _ = make_cache(1, hkv, d, 4, 60, 4, seed=22)
    q = torch.randn(1, 4, 1, d, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    g = torch.Generator().manual_seed(24)
    rk = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))[0].to(DEVICE)
    rv = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].to(DEVICE)
    run = lambda a, b: decode_attention_int2(q, k, v, k_rotation=a, v_rotation=b, backend=backend,  # noqa: E731
                                             dtype=torch.float32)
    a, b = run(rk, rv), run(rk.float(), rv.float())
    if backend == "cpu":  # its copy of the fp32 rounding is read in another order than the transposed view
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(a, b)

@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_a_score_that_overflows_makes_the_row_nan_in_every_backend(backend):
    """q.k past fp32's range is +inf: the softmax is undefined and the reference gives NaN; the C++ kernel's
    vectorized exp had turned the NaN into 0 and returned a silent row of zeros."""
    _skip_unless_built(backend)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 64, generator=g).abs().to(DEVICE)
    recent = torch.randn(1, 1, 4, 64, generator=g)
    recent[0, 0, 2] = 1e38  # finite, but q.k / 8 overflows
    k, v = Int2KV(None, None, None, recent.to(DEVICE)), Int2KV(None, None, None, torch.randn(1, 1, 4, 64).to(DEVICE))
    out = decode_attention_int2(q, k, v, backend=backend, dtype=torch.float32)
    assert torch.isnan(out).all(), (backend, out[0, 0, 0, :4])


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_an_inf_window_entry_with_small_groups_reads_as_in_the_reference(backend):
    """Groups smaller than a quarter of the dims (G = 16 at d = 128): a window key or value holding +inf gives
    what the reference gives. Triton's block-diagonal query rows (and its one-hot merge of the group rows) had
    multiplied it by 0: NaN in every query row of the KV head."""
    _skip_unless_built(backend)
    d, cfg = 128, Int2KVConfig(group_size=16)
    g = torch.Generator().manual_seed(0)

    def side():
        c, sz = quantize_int2(torch.randn(1, 1, 8, d, generator=g).to(DEVICE), config=cfg, backend="torch")
        sink, recent = torch.randn(1, 1, 2, d, generator=g), torch.randn(1, 1, 4, d, generator=g)
        return Int2KV(sink.bfloat16().to(DEVICE), c, sz, recent.bfloat16().to(DEVICE))

    k, v = side(), side()
    q = torch.randn(1, 2, 1, d, generator=g)
    q[0, 0, 0, 5], q[0, 1, 0, 5] = -1.0, 1.0  # head 0 scores the key -inf (weight 0), head 1 +inf (NaN)
    q = q.to(DEVICE)
    for where in ("key", "value"):
        (k if where == "key" else v).recent[0, 0, 1, 5] = float("inf")
        ref = decode_attention_int2(q, k, v, config=cfg, backend="torch", dtype=torch.float32).cpu()
        got = decode_attention_int2(q, k, v, config=cfg, backend=backend, dtype=torch.float32).cpu()
        if where == "key":
            assert not torch.isnan(ref[0, 0]).any() and torch.isnan(ref[0, 1]).all()
        else:
            assert torch.isinf(ref[0, :, 0, 5]).all() and torch.isfinite(ref[..., :5]).all()
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), (where, got[0, :, 0, :8])
        assert torch.equal(torch.isinf(got), torch.isinf(ref)) and torch.equal(got[torch.isinf(ref)], ref[torch.isinf(ref)])
        fin = torch.isfinite(ref)
        torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5 if DEVICE.type == "cpu" else 1e-3, atol=1e-5)
        (k if where == "key" else v).recent[0, 0, 1, 5] = 0.0


def test_the_triton_window_precision_comes_from_the_rows_it_reads():
    """An empty bf16 sink beside fp32 recent rows (validation compares non-empty windows only): the compiled
    kernel's window products are fp32 (``HP_KIND`` 2), not bf16 from the empty sink's dtype."""
    pytest.importorskip("triton", reason="triton is not installed")
    from rotationzoo.kernels import triton_decode

    d = 64
    empty = torch.zeros(1, 1, 0, d, dtype=torch.bfloat16)
    side = Int2KV(empty, None, None, torch.randn(1, 1, 40, d))
    q = torch.randn(1, 1, 1, d)
    assert decode_attention_int2(q, side, side, backend="torch").dtype == torch.float32  # validation passes
    parts = (empty, torch.empty(1, 1, 0, d // 4, dtype=torch.uint8), torch.empty(1, 1, 0, 2), side.recent)
    po, pl = torch.empty(1, 2, 1, d), torch.empty(1, 2, 1)
    kinds = {}
    for name, recent in (("fp32", side.recent), ("fp16", side.recent.half()), ("none", side.recent[:, :, :0])):
        kv = parts[:3] + (recent,)
        launch = triton_decode.decode_launch(q, q, kv, kv, po, pl, scale=0.125, causal=True, splits=(0, 64),
                                             windows=2, interpret=False)
        kinds[name] = launch.kwargs["HP_KIND"]
    assert kinds == {"fp32": 2, "fp16": 1, "none": 0}, kinds


# -- argument rules --------------------------------------------------------------------------------


def test_bad_arguments_get_one_line_errors():
    k, _ = make_cache(1, 2, 64, 2, 20, 3)
    q = torch.randn(1, 4, 1, 64).to(DEVICE)
    r = orthogonal(64)
    cases = [
        (dict(query=torch.randn(1, 4, 64)), "query must be"),
        (dict(query=torch.randn(1, 3, 1, 64).to(DEVICE)), "multiple of H_kv"),
        (dict(keys=k._replace(codes=None)), "come together"),
        (dict(values=k._replace(recent=k.recent[:, :, :1])), "tokens but values"),
        (dict(k_rotation=r, q_rotation=r), "not both"),
        (dict(v_rotation=torch.eye(32).to(DEVICE)), r"\[64, 64\]"),
        (dict(config=Int2KVConfig(group_size=16)), "group size 16"),
        (dict(config=Int2KVConfig(scale_dtype="float16")), "scale_dtype"),
        (dict(config=Int2KVConfig(hp_dtype="float16")), "hp_dtype"),
        (dict(mask=torch.ones(1, 4, 1, 24, dtype=torch.bool).to(DEVICE)), "mask must be booleans"),
        (dict(mask=torch.ones(1, 1, 1, 25).to(DEVICE)), "mask must be booleans"),
        (dict(mask=torch.ones(1, 2, 1, 25, dtype=torch.bool).to(DEVICE)), r"mask must be booleans \[1 or 1, 4 or 1"),
        (dict(scale=-1.0), "positive"),
        (dict(num_splits=0), "num_splits"),
        (dict(keys=k._replace(sink=k.sink.half())), "share one dtype"),
        (dict(query=torch.randn(1, 4, 40, 64).to(DEVICE)), "holds 25"),
        (dict(keys=(k.sink, k.codes)), "must be an Int2KV"),
        (dict(causal=1), "causal must be true or false"),
        (dict(scale=True), "positive"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(num_splits=[2]), "num_splits"),
        (dict(causal=[True]), "causal must be true or false"),
        (dict(scale=1e300), "float32's normal range"),  # inf in fp32
        (dict(scale=1e-300), "float32's normal range"),  # 0 in fp32
        (dict(scale=10 ** 400), "float32's normal range"),  # past float: was a raw OverflowError
        (dict(scale=float("nan")), "float32's normal range"),
        (dict(query=torch.randn(1, 0, 1, 64).to(DEVICE)), "at least one sequence, head and token"),
        (dict(keys=Int2KV(*(t[:, :0] for t in k)), query=torch.randn(1, 0, 1, 64).to(DEVICE)),
         "at least one sequence, head and token"),
        (dict(keys=Int2KV(*(t[:, :0] for t in k))), "at least one KV head"),  # was a raw ZeroDivisionError
    ]
    # a call with the same shapes, dtypes and settings as one that passed skips the checks: first valid calls
    # (scale 1.0 equals True and hashes alike), then each bad one (twice: a refused call is never remembered)
    decode_attention_int2(q, k, k, backend="torch")
    decode_attention_int2(q, k, k, scale=1.0, backend="torch")
    for over, match in cases:
        for _ in range(2):
            kw = dict(query=q, keys=k, values=k)
            kw.update(over)
            with pytest.raises(KernelInputError, match=match) as exc:
                decode_attention_int2(kw.pop("query"), kw.pop("keys"), kw.pop("values"), backend="torch", **kw)
            assert "\n" not in str(exc.value)
    # an empty query, or a cache without KV heads, is refused alike by every backend (the C++ kernel had raised a
    # RuntimeError, the others returned an empty tensor)
    for backend in ("torch", "cpu", "triton"):
        if backend == "cpu" and DEVICE.type != "cpu":
            continue
        for over in (dict(query=torch.randn(1, 0, 1, 64).to(DEVICE)), dict(keys=Int2KV(*(t[:, :0] for t in k)))):
            kw = dict(query=q, keys=k, values=k)
            kw.update(over)
            with pytest.raises(KernelInputError, match="at least one"):
                decode_attention_int2(kw.pop("query"), kw.pop("keys"), kw.pop("values"), backend=backend)
    # the config the cache was written with is accepted
    cfg = Int2KVConfig(group_size=None, hp_dtype="bfloat16", scale_dtype="float32")
    decode_attention_int2(q, k, k, config=cfg, backend="torch")
    with pytest.raises(TypeError):
        decode_attention_int2(q, k, k, group_size=64, backend="torch")  # type: ignore[call-arg]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_mask_restricts_what_each_query_row_sees(backend):
    """mask (booleans [B or 1, Hq or 1, S, L]) on top of the causal rule: padding, sliding windows."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
    b, hq, hkv, s, d = 2, 4, 2, 2, 64
    k, kd = make_cache(b, hkv, d, 3, 70, 6, seed=30)
    v, vd = make_cache(b, hkv, d, 3, 70, 6, seed=31)
    g = torch.Generator().manual_seed(32)
    q = torch.randn(b, hq, s, d, generator=g).to(DEVICE)
    total = 79
    for heads in (1, hq):
        mask = torch.rand(b, heads, s, total, generator=g) > 0.4
        mask[0, :, :, :9] = False  # left padding
        mask[1, :, :, -20:] = True
        got = decode_attention_int2(q, k, v, mask=mask.to(DEVICE), backend=backend, dtype=torch.float32)
        blind = mask.clone()
        blind[1, :, 0] = False  # query token 0 of sequence 1 sees no key: zeros, not NaN
        none = decode_attention_int2(q, k, v, mask=blind.to(DEVICE), backend=backend, dtype=torch.float32)
        assert (none[1, :, 0] == 0).all() and torch.equal(none[1, :, 1], got[1, :, 1])
        for bi in range(b):
            for h in range(hq):
                kh = h // (hq // hkv)
                for t in range(s):
                    seen = mask[bi, h if heads > 1 else 0, t].clone()
                    seen[total - s + t + 1:] = False  # causal
                    sc = (kd[bi, kh, seen].double().cpu() @ q[bi, h, t].double().cpu()) * d ** -0.5
                    want = torch.softmax(sc, 0) @ vd[bi, kh, seen].double().cpu()
                    torch.testing.assert_close(got[bi, h, t].double().cpu(), want, atol=2e-5, rtol=2e-5)


# -- transient memory ------------------------------------------------------------------------------


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created while active (storages that existed before are not counted)."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in existing}
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.current = self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.current -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.skip or not key:
                continue
            if key not in self.refs:
                self.size[key] = t.untyped_storage().nbytes()
                self.refs[key] = 0
                self.current += self.size[key]
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def test_reference_transient_memory_is_one_tile():
    """The reference never holds the history in full precision: its peak transient memory stays
    within a few tiles, here ~1/10 of the dequantized history (and the bound fails without tiling)."""
    b, hkv, hq, d, n, tile = 1, 2, 4, 64, 4096, 256
    k, _ = make_cache(b, hkv, d, 4, n, 8, seed=20)
    v, _ = make_cache(b, hkv, d, 4, n, 8, seed=21)
    q = torch.randn(b, hq, 1, d).to(DEVICE)
    tile_bytes = 4 * b * hkv * tile * d  # one side's unpacked tile in fp32
    history_bytes = 2 * 4 * b * hkv * n * d  # K and V dequantized in fp32
    parts = [t for side in (k, v) for t in side] + [q]

    def peak(splits):  # the reference itself: inside its torch operator a dispatch mode sees only the result
        with LiveTensorBytes(parts) as mode:
            decode_attention_torch(q, tuple(k), tuple(v), q_rotation=None, o_rotation=None, scale=d ** -0.5,
                                   causal=True, num_splits=splits, dtype=torch.float32)
        return mode.peak

    tiled = peak(n // tile)
    assert tiled <= 3 * tile_bytes, (tiled, tile_bytes)
    assert tiled * 10 < history_bytes
    assert peak(1) > 3 * tile_bytes  # one tile of the whole history: the measurement sees it
