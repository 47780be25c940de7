"""The C++ kernels for CPUs (rotationzoo.kernels.native_ops): decode attention against the PyTorch
reference within fp32 summation-order tolerance (vectorized and portable inner loops, with masks),
the uniform quantizer bit for bit against it, what backend="auto" and backend="cpu" run, and the
fallback where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rotationzoo.errors import BackendUnavailableError
from rotationzoo.kernels import Int2KV, decode_attention_int2, native, native_ops, quantize_int2
from rotationzoo.kernels import reference as ref
from rotationzoo.kernels.layout import clip_index

from helpers import int2_config
from test_decode_attention import CASES, make_cache, orthogonal

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason=f"the C++ kernels cannot be built here: {native.native_unavailable_reason()}")

#: relative max error of the C++ attention against the reference (fp32 sums in another order)
TOL = 1e-5


def rel_err(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("b,hq,hkv,s,d,parts,group,extra", CASES)
@pytest.mark.parametrize("splits,portable", [(None, False), (1, False), (3, False), (3, True)])
def test_c_decode_equals_the_reference(b, hq, hkv, s, d, parts, group, extra, splits, portable):
    kw = dict(group=group, lloyd_max=extra.get("lloyd_max", False), hp=extra.get("hp", torch.bfloat16),
              scale=extra.get("scale", torch.float32))
    k, _ = make_cache(b, hkv, d, *parts, seed=1, **kw)
    v, _ = make_cache(b, hkv, d, *parts, seed=2, **kw)
    q = torch.randn(b, hq, s, d, generator=torch.Generator().manual_seed(3))
    heads = hkv if extra.get("per_head") else None
    rk, rv = orthogonal(d, heads, 4), orthogonal(d, heads, 5)
    want = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="torch", dtype=torch.float32)
    got = native_ops.decode_attention_native(q, tuple(k), tuple(v), q_rotation=rk, o_rotation=rv.transpose(-1, -2),
                                             scale=d ** -0.5, causal=True, num_splits=splits, portable=portable)
    assert rel_err(got, want) < TOL
    if not portable:
        auto = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, num_splits=splits, dtype=torch.float32)
        assert torch.equal(auto, got)  # backend="auto" on CPU is the C++ kernel
        cpu = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, num_splits=splits, dtype=torch.float32,
                                    backend="cpu")
        assert torch.equal(cpu, got)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [(9, 3, 1), (8, 2, 3), (12, 2, 2)])  # (Hq, H_kv, S): 3, 12 and 12 rows per KV head
def test_c_decode_long_ranges_threads_and_row_blocks(threads, rows):
    """Several tiles per range, several ranges per head, query rows past one block of four."""
    hq, hkv, s = rows
    k, _ = make_cache(1, hkv, 64, 64, 2900, 40, seed=7, group=16)
    v, _ = make_cache(1, hkv, 64, 64, 2900, 40, seed=8, group=64, scale=torch.bfloat16)
    k = Int2KV(k.sink, k.codes, k.scales_zeros.bfloat16(), k.recent)  # one scale dtype per side
    q = torch.randn(1, hq, s, 64, generator=torch.Generator().manual_seed(9))
    want = decode_attention_int2(q, k, v, backend="torch", dtype=torch.float32)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for splits in (None, 2, 5):
            got = decode_attention_int2(q, k, v, backend="cpu", num_splits=splits, dtype=torch.float32)
            assert rel_err(got, want) < TOL, splits
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not native_ops.simd_compiled(), reason="the pipelined tiles are in the AVX2 loops, not compiled here")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("rows", [(4, 4, 1), (4, 2, 1), (9, 3, 1), (4, 1, 1), (2, 1, 3)])  # 1, 2, 3, 4 and 6 rows
def test_c_decode_fused_value_and_score_passes(d, rows):
    """Full INT2 tiles where one tile's values and the next one's scores run in the same passes (one
    (scale, zero) group per row, up to four query rows per KV head), ranges that cut tiles anywhere,
    1 and 2 threads; six rows (two blocks) take the unfused loops."""
    hq, hkv, s = rows
    k, _ = make_cache(1, hkv, d, 64, 1000, 37, seed=11, group=d, scale=torch.bfloat16)
    v, _ = make_cache(1, hkv, d, 64, 1000, 37, seed=12, group=d, scale=torch.bfloat16)
    q = torch.randn(1, hq, s, d, generator=torch.Generator().manual_seed(13))
    rk, rv = orthogonal(d, None, seed=14), orthogonal(d, hkv, seed=15)
    want = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="torch", dtype=torch.float32)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for splits in (None, 1, 3):
                got = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="cpu", num_splits=splits,
                                            dtype=torch.float32)
                assert rel_err(got, want) < TOL, (threads, splits)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("heads", ["broadcast", "per_head"])
def test_c_decode_applies_a_mask_as_the_reference(heads):
    b, hq, hkv, s, d = 2, 4, 2, 2, 64
    k, _ = make_cache(b, hkv, d, 4, 300, 7, seed=11)
    v, _ = make_cache(b, hkv, d, 4, 300, 7, seed=12)
    total = 311
    g = torch.Generator().manual_seed(13)
    mask = torch.rand(b, hq if heads == "per_head" else 1, s, total, generator=g) > 0.3
    mask[0, :, :, :5] = False  # left padding of sequence 0
    q = torch.randn(b, hq, s, d, generator=g)
    want = decode_attention_int2(q, k, v, mask=mask, backend="torch", dtype=torch.float32)
    for portable in (False, True):
        got = native_ops.decode_attention_native(q, tuple(k), tuple(v), q_rotation=None, o_rotation=None,
                                                 scale=d ** -0.5, causal=True, num_splits=2, mask=mask,
                                                 portable=portable)
        assert rel_err(got, want) < TOL
    unmasked = decode_attention_int2(q, k, v, backend="cpu", dtype=torch.float32)
    assert rel_err(unmasked, want) > 1e-3  # the mask changed the result
    mask[1, :, 1] = False  # query token 1 of sequence 1 sees no key: zeros, not NaN
    blind = decode_attention_int2(q, k, v, mask=mask, backend="cpu", dtype=torch.float32)
    assert (blind[1, :, 1] == 0).all() and not blind.isnan().any()


def test_c_decode_reads_views_of_larger_buffers_and_windows_of_any_dtype():
    """The cache's INT2 tier is a view of the first tokens of a bigger buffer; windows may be fp32."""
    k, _ = make_cache(1, 2, 64, 4, 300, 6, seed=1, group=16)
    v, _ = make_cache(1, 2, 64, 4, 300, 6, seed=2, group=16)
    q = torch.randn(1, 6, 1, 64)
    want = decode_attention_int2(q, k, v, backend="torch", dtype=torch.float32)
    view = lambda side: Int2KV(side.sink.float(), side.codes[:, :, :250], side.scales_zeros[:, :, :250],  # noqa: E731
                               side.recent.float())
    big = lambda t: torch.cat([t, torch.zeros_like(t)], dim=2)[:, :, : t.shape[2]]  # noqa: E731
    kb = Int2KV(k.sink, big(k.codes), big(k.scales_zeros), k.recent)
    vb = Int2KV(v.sink, big(v.codes), big(v.scales_zeros), v.recent)
    assert not kb.codes.is_contiguous()
    assert rel_err(decode_attention_int2(q, kb, vb, dtype=torch.float32), want) < TOL
    short = decode_attention_int2(q, view(k), view(v), backend="torch", dtype=torch.float32)
    assert rel_err(decode_attention_int2(q, view(k), view(v), dtype=torch.float32), short) < TOL


def test_c_decode_makes_nan_rows_nan_and_leaves_the_others():
    kv, _ = make_cache(1, 2, 64, 2, 40, 3, seed=1)
    codes, sz = kv.codes.clone(), kv.scales_zeros.clone()
    sz[0, 1, 7] = float("nan")  # KV head 1 holds a flagged row
    kv = Int2KV(kv.sink, codes, sz, kv.recent)
    out = decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv)
    assert not torch.isnan(out[0, :2]).any() and torch.isnan(out[0, 2:]).all()


def test_the_vectorized_loops_are_compiled_in_where_torch_runs_avx2():
    simd = native.isa_flags() != []
    assert native_ops.simd_compiled() == simd


def _rows(d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(800, d, generator=g) * torch.rand(800, 1, generator=g) * 10
    x[::40, 3] = float("nan")
    x[7::40, 5] = float("inf")
    x[15::40, 1:3] = float("-inf")
    x[9::40] = 0.0
    x[11::40, :4] = -0.0
    x[13::40] = x[13::40].round()  # ties at the clip threshold and in the groups
    x[17::40, 0] = 1e5  # fp16 scales overflow to inf
    x[19::40] *= 1e-6  # fp16 scales are subnormal
    return x.to(dtype)


def _same(a, b):
    """Equal codes; equal scale/zero bits, NaN wherever the other is NaN (NaN bit patterns aside)."""
    nan = torch.isnan(a.float())
    if not torch.equal(nan, torch.isnan(b.float())):
        return False
    return torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_quantizer_is_the_reference_bit_for_bit(d, dtype):
    x = _rows(d, dtype, seed=d)
    for group in sorted({d, d // 4, 16}):
        for ratio in (0.0, 0.92, 0.96, 1.0, 0.05):
            for search in ("exact", "bisect"):
                for sdt in (torch.float32, torch.bfloat16, torch.float16)[:2 if ratio in (1.0, 0.05) else 3]:
                    kw = dict(clip_index=clip_index(ratio, d), group_size=group, scale_dtype=sdt, clip_search=search)
                    c1, s1 = ref.quantize_rows(x, lloyd_max=False, **kw)
                    c2, s2 = native_ops.quantize_rows_native(x, **kw)
                    assert torch.equal(c1, c2), (group, ratio, search, sdt)
                    assert _same(s1, s2), (group, ratio, search, sdt)


def test_quantize_auto_and_cpu_on_cpu_equal_the_reference():
    x = _rows(128, torch.bfloat16).reshape(2, 100, 4, 128)
    rot = orthogonal(128, 4, 21)
    for cfg, r in ((int2_config(0.96, 32), None), (int2_config(0.92, search="bisect"), rot),
                   (int2_config(0.96, lloyd_max=True), None), (int2_config(0.9, scale=torch.float16), rot)):
        c1, s1 = quantize_int2(x, config=cfg, rotation=r, backend="torch")
        c2, s2 = quantize_int2(x, config=cfg, rotation=r)
        assert torch.equal(c1, c2) and _same(s1, s2), cfg
        if not cfg.lloyd_max:
            c3, s3 = quantize_int2(x, config=cfg, rotation=r, backend="cpu")
            assert torch.equal(c1, c3) and _same(s1, s3), cfg
    with pytest.raises(BackendUnavailableError, match="uniform levels"):
        quantize_int2(x, config=int2_config(lloyd_max=True), backend="cpu")


_FALLBACK = """
import warnings, torch
from rotationzoo.errors import BackendUnavailableError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import decode_attention_int2, native, quantize_int2
x = torch.randn(1, 2, 40, 64)
cfg = Int2KVConfig(k_clip_ratio=0.96)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    codes, sz = quantize_int2(x, config=cfg)
    kv = (x[:, :, :4], codes, sz, x[:, :, :4])
    out = decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv)
    decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv)
    quantize_int2(x, config=cfg)
rc, rs = quantize_int2(x, config=cfg, backend="torch")
assert torch.equal(codes, rc) and torch.equal(sz, rs)
try:
    decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv, backend="cpu")
    print("CPU ran")
except BackendUnavailableError as exc:
    print("CPU refused", str(exc).splitlines()[0][:60])
print("REASON", native.native_unavailable_reason())
print("WARNINGS", len(seen), str(seen[0].message) if seen else "")
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env,reason,message", [
    ({"ROTATIONZOO_NATIVE": "0"}, "ROTATIONZOO_NATIVE is false",
     "rotationzoo: CPU decode attention runs the PyTorch reference (several times slower): ROTATIONZOO_NATIVE is false"),
    ({"CC": "/nonexistent/cc"}, "CC='/nonexistent/cc' does not exist",
     "rotationzoo: the C++ kernels for CPUs are not used, the PyTorch reference runs instead (slower): "
     "CC='/nonexistent/cc' does not exist; set CC to a C++ compiler (c++, g++ or clang++) or unset it"),
    ({"CC": "", "PATH": "/nonexistent"}, "no C++ compiler found",
     "rotationzoo: the C++ kernels for CPUs are not used, the PyTorch reference runs instead (slower): "
     "no C++ compiler found (install g++ or clang++, or set CXX)"),
])
def test_without_the_c_kernels_auto_runs_the_reference_and_says_why_once(env, reason, message):
    run_env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    run_env.update(env)
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, env=run_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"REASON {reason}" in proc.stdout
    assert f"WARNINGS 1 {message}\n" in proc.stdout, proc.stdout
    assert "CPU refused backend 'cpu': the C++ decode kernel cannot run here" in proc.stdout
