"""The C kernels for CPUs (rotationzoo.kernels.native): decode attention against the PyTorch
reference within fp32 summation-order tolerance, the uniform quantizer bit for bit against it, what
backend="auto" runs, and the fallback where they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2
from rotationzoo.kernels import reference as ref
from rotationzoo.kernels.layout import clip_index

from test_decode_attention import CASES, make_cache, orthogonal

pytestmark = pytest.mark.skipif(not native.native_available(),
                                reason=f"the C kernels cannot be built here: {native.native_unavailable_reason()}")

#: relative max error of the C attention against the reference (fp32 sums in another order)
TOL = 1e-5


def rel_err(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("b,hq,hkv,s,d,parts,group,extra", CASES)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_c_decode_equals_the_reference(b, hq, hkv, s, d, parts, group, extra, splits):
    kw = dict(group=group, lloyd_max=extra.get("lloyd_max", False), hp=extra.get("hp", torch.bfloat16),
              scale=extra.get("scale", torch.float32))
    k, _ = make_cache(b, hkv, d, *parts, seed=1, **kw)
    v, _ = make_cache(b, hkv, d, *parts, seed=2, **kw)
    q = torch.randn(b, hq, s, d, generator=torch.Generator().manual_seed(3))
    heads = hkv if extra.get("per_head") else None
    rk, rv = orthogonal(d, heads, 4), orthogonal(d, heads, 5)
    want = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, backend="torch", dtype=torch.float32)
    got = native.decode_attention_native(q, tuple(k), tuple(v), q_rotation=rk, o_rotation=rv.transpose(-1, -2),
                                         scale=d ** -0.5, causal=True, num_splits=splits, dtype=torch.float32)
    assert rel_err(got, want) < TOL
    auto = decode_attention_int2(q, k, v, k_rotation=rk, v_rotation=rv, num_splits=splits, dtype=torch.float32)
    assert torch.equal(auto, got)  # backend="auto" on CPU is the C kernel


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


def _rows(d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(800, d, generator=g) * torch.rand(800, 1, generator=g) * 10
    x[::40, 3] = float("nan")
    x[7::40, 5] = float("inf")
    x[15::40, 1:3] = float("-inf")
    x[9::40] = 0.0
    x[11::40, :4] = -0.0
    x[13::40] = x[13::40].round()  # ties at the clip threshold and in the groups
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
                for sdt in (torch.float32, torch.bfloat16):
                    kw = dict(clip_index=clip_index(ratio, d), group_size=group, scale_dtype=sdt, clip_search=search)
                    c1, s1 = ref.quantize_rows(x, lloyd_max=False, **kw)
                    c2, s2 = native.quantize_rows_native(x, **kw)
                    assert torch.equal(c1, c2), (group, ratio, search, sdt)
                    assert _same(s1, s2), (group, ratio, search, sdt)


def test_quantize_auto_on_cpu_is_the_c_quantizer_and_equals_the_reference():
    x = _rows(128, torch.bfloat16).reshape(2, 4, 100, 128)
    for kw in (dict(clip_ratio=0.96, group_size=32), dict(clip_ratio=0.92, clip_search="bisect"),
               dict(clip_ratio=0.96, lloyd_max=True), dict(clip_ratio=0.9, scale_dtype=torch.float16)):
        c1, s1 = quantize_int2(x, backend="torch", **kw)
        c2, s2 = quantize_int2(x, **kw)
        assert torch.equal(c1, c2) and _same(s1, s2), kw
    assert native.quantize_native_supported(x, rotation=None, lloyd_max=False, scale_dtype=torch.bfloat16)
    assert not native.quantize_native_supported(x, rotation=None, lloyd_max=True, scale_dtype=torch.float32)
    assert not native.quantize_native_supported(x, rotation=None, lloyd_max=False, scale_dtype=torch.float16)


_FALLBACK = """
import warnings, torch
from rotationzoo.kernels import decode_attention_int2, native, quantize_int2
x = torch.randn(1, 2, 40, 64)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    codes, sz = quantize_int2(x, clip_ratio=0.96)
    kv = (x[:, :, :4], codes, sz, x[:, :, :4])
    out = decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv)
    decode_attention_int2(torch.randn(1, 4, 1, 64), kv, kv)
    quantize_int2(x, clip_ratio=0.96)
rc, rs = quantize_int2(x, clip_ratio=0.96, backend="torch")
assert torch.equal(codes, rc) and torch.equal(sz, rs)
print("REASON", native.native_unavailable_reason())
print("WARNINGS", len(seen), str(seen[0].message) if seen else "")
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("env,reason,message", [
    ({"ROTATIONZOO_NATIVE": "0"}, "ROTATIONZOO_NATIVE is false",
     "rotationzoo: CPU decode attention runs the PyTorch reference (several times slower): ROTATIONZOO_NATIVE is false"),
    ({"CC": "/nonexistent/cc", "PATH": "/nonexistent"}, "CC='/nonexistent/cc' does not exist",
     "rotationzoo: the C kernels for CPUs are not used, the PyTorch reference runs instead (slower): "
     "CC='/nonexistent/cc' does not exist; set CC to a C compiler (cc, gcc or clang) or unset it"),
    ({"CC": "", "PATH": "/nonexistent"}, "no C compiler found",
     "rotationzoo: the C kernels for CPUs are not used, the PyTorch reference runs instead (slower): "
     "no C compiler found (install cc, gcc or clang, or set CC)"),
])
def test_without_the_c_kernels_auto_runs_the_reference_and_says_why_once(env, reason, message):
    run_env = dict(os.environ, **env)
    proc = subprocess.run([sys.executable, "-c", _FALLBACK], capture_output=True, text=True, env=run_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"REASON {reason}" in proc.stdout
    assert f"WARNINGS 1 {message}\n" in proc.stdout, proc.stdout
