"""Decode attention on INT2 rows outside its domain (a scale or zero that is ±inf, NaN, or so large that
the row dequantizes past 2^64): every backend reads the row as NaN, so the C kernel, the PyTorch
reference and the Triton kernel (interpreter on CPU) give NaN at the same positions and the same
values elsewhere, instead of overflowing differently in their own summation orders."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rotationzoo.kernels import Int2KV, decode_attention_int2, native  # noqa: E402
from rotationzoo.kernels.decode_reference import MAX_DEQUANT  # noqa: E402

from test_decode_attention import DEVICE, make_cache  # noqa: E402

INF, NAN = float("inf"), float("nan")
B, HQ, HKV, S, D = 1, 4, 2, 2, 64
SINK, N, RECENT = 2, 40, 3


def planted(side: str, field: str, value: float, where: str, group: int) -> tuple[Int2KV, Int2KV, torch.Tensor]:
    """Keys, values (one of them with ``value`` planted in a scale or zero) and where the output must
    be NaN: every query row of the KV head that reads the planted row."""
    k, _ = make_cache(B, HKV, D, SINK, N, RECENT, seed=1, group=group)
    v, _ = make_cache(B, HKV, D, SINK, N, RECENT, seed=2, group=group)
    target = k if side == "k" else v
    sz = target.scales_zeros.clone()
    col = 0 if field == "s" else 1
    head = 1 if where == "row" else 0
    if where == "row":  # every group of one row
        sz[0, head, 7, col::2] = value
    else:  # one group of one row
        sz[0, head, 9, col] = value
    target = Int2KV(target.sink, target.codes, sz, target.recent)
    want = torch.zeros(B, HQ, S, D, dtype=torch.bool)
    want[0, head * (HQ // HKV):(head + 1) * (HQ // HKV)] = True
    return (target, v, want) if side == "k" else (k, target, want)


def query() -> torch.Tensor:
    return torch.randn(B, HQ, S, D, generator=torch.Generator().manual_seed(0)).to(DEVICE)


def assert_same(got: torch.Tensor, want: torch.Tensor, nan_at: torch.Tensor, what: object, tol: float) -> None:
    got, want = got.cpu(), want.cpu()
    assert torch.equal(torch.isnan(want), nan_at), ("reference", what)
    assert torch.equal(torch.isnan(got), nan_at), what
    assert torch.isfinite(got[~nan_at]).all(), what
    torch.testing.assert_close(got[~nan_at], want[~nan_at], rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


CASES = list(itertools.product([INF, -INF, NAN, 3e38, 1e38, 1e30], "kv", "sz", ["row", "group"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("group", [64, 16])
def test_the_c_kernel_and_the_reference_read_out_of_domain_rows_as_nan(group):
    if DEVICE.type != "cpu" or not native.native_available():
        pytest.skip(f"the C kernel does not run here: {native.native_unavailable_reason() or 'CUDA tensors'}")
    q = query()
    for value, side, field, where in CASES:
        k, v, nan_at = planted(side, field, value, where, group)
        ref = decode_attention_int2(q, k, v, backend="torch", dtype=torch.float32)
        got = decode_attention_int2(q, k, v, dtype=torch.float32)  # the C kernel on CPU
        assert_same(got, ref, nan_at, (value, side, field, where, group), 1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", [64, 16])
def test_the_triton_kernel_reads_out_of_domain_rows_as_nan(group):
    pytest.importorskip("triton", reason="triton is not installed")
    q = query()
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    for value, side in itertools.product([INF, NAN, 1e38], "kv"):  # the interpreter is slow: a subset
        for field, where in (("s", "row"), ("z", "group")):
            k, v, nan_at = planted(side, field, value, where, group)
            ref = decode_attention_int2(q, k, v, backend="torch", dtype=torch.float32)
            got = decode_attention_int2(q, k, v, backend="triton", dtype=torch.float32)
            assert_same(got, ref, nan_at, (value, side, field, where, group), tol)


@pytest.mark.timeout(300)
def test_the_domain_ends_at_max_dequant_in_every_backend():
    """``|s|·max(|z|, |3 − z|) = 2^64`` is in the domain; the next fp32 scale above is not."""
    assert MAX_DEQUANT == 2.0 ** 64
    backends = ["torch"]
    if DEVICE.type == "cpu" and native.native_available():
        backends.append("auto")
    try:
        import triton  # noqa: F401
        backends.append("triton")
    except ImportError:
        pass
    q = query()
    inside = 2.0 ** 62  # with z = -1: 2^62 · max(1, 4) = 2^64 exactly
    outside = torch.nextafter(torch.tensor(inside), torch.tensor(INF)).item()  # the next fp32 number
    for side, scale in itertools.product("kv", (inside, outside)):
        k, _ = make_cache(B, HKV, D, SINK, N, RECENT, seed=1, group=D)
        v, _ = make_cache(B, HKV, D, SINK, N, RECENT, seed=2, group=D)
        target = k if side == "k" else v
        sz = target.scales_zeros.clone()
        sz[0, 1, 5] = torch.tensor([scale, -1.0])
        target = Int2KV(target.sink, target.codes, sz, target.recent)
        kk, vv = (target, v) if side == "k" else (k, target)
        for backend in backends:
            out = decode_attention_int2(q, kk, vv, backend=backend, dtype=torch.float32).cpu()
            if scale == inside:
                assert not torch.isnan(out).any(), (side, backend)
            else:
                assert torch.isnan(out[0, 2:]).all() and not torch.isnan(out[0, :2]).any(), (side, backend)



def test_float16_scale_zero_hold_only_what_docs_say():
    """docs/kernels.md, "float16 scale/zero": the fork's pair (fp32 ``scale = max(range, 1e-8) / 3``, ``zero =
    −min / scale``) rounded to float16 underflows (scale ≤ 2^-25: every constant group) or overflows (``|zero|``
    or scale ≥ 65520) for finite rows, in every backend, and decode attention reads such a row as NaN;
    bfloat16 and float32 hold the same groups."""
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.kernels import dequantize_int2, quantize_int2

    groups = {  # the first group of a row: its values, what float16 reads back
        "constant 0.5": ([0.5] * 16, "nan"),  # scale 0, zero -inf
        "min 1, range 1e-5": ([1.0] * 15 + [1.00001], "inf"),  # zero -3e5 -> -inf
        "range 2e5": ([0.0] * 15 + [2e5], "not finite"),  # scale 66667 -> inf
        "constant 1e-4": ([1e-4] * 16, "zeros"),  # scale 0 beside a finite zero (-3e4)
    }
    backends = ["torch"] + (["cpu"] if native.native_available("quantize") else [])
    q = torch.randn(1, 2, 1, D, generator=torch.Generator().manual_seed(1))
    for name, (values, fp16_reads) in groups.items():
        x = torch.randn(1, 1, 2, D, generator=torch.Generator().manual_seed(0))
        x[0, 0, 0, :16] = torch.tensor(values)
        for sdt, be in itertools.product(("float16", "bfloat16", "float32"), backends):
            cfg = Int2KVConfig(k_clip_ratio=0.0, v_clip_ratio=0.0, group_size=16, scale_dtype=sdt)
            codes, sz = quantize_int2(x, config=cfg, backend=be)
            back = dequantize_int2(codes, sz, config=cfg, dtype=torch.float32, backend="torch")[0, 0]
            got, s = back[0, :16], sz[0, 0, 0, 0]
            kv = Int2KV(None, codes, sz, None)
            out = decode_attention_int2(q, kv, kv, config=cfg, backend="torch" if be == "torch" else "auto")
            what = (name, sdt, be, got[:2].tolist(), sz[0, 0, 0, :2].tolist())
            assert torch.isfinite(back[1]).all(), what  # the random row
            if sdt != "float16" or fp16_reads == "zeros":
                assert not torch.isnan(out).any(), what
            else:
                assert torch.isnan(out).all(), what
            if sdt != "float16":
                assert torch.isfinite(sz).all() and s > 0, what
                torch.testing.assert_close(got, x[0, 0, 0, :16], rtol=1e-2, atol=0, msg=lambda m: f"{what}: {m}")
            elif fp16_reads == "nan":
                assert s == 0 and torch.isnan(got).all(), what
            elif fp16_reads == "inf":
                assert s > 0 and torch.isinf(got).all(), what
            elif fp16_reads == "not finite":
                assert s == INF and not torch.isfinite(got).any(), what
            else:
                assert s == 0 and torch.isfinite(sz).all() and torch.equal(got, torch.zeros(16)), what
    # the thresholds: float16 rounds a scale of 2^-25 to 0 and the next fp32 number up to its smallest
    # subnormal, and numbers from 65520 on to inf (65504 is its largest finite number)
    edge = torch.tensor([2.0 ** -25, 2.0 ** -25 * (1 + 2 ** -23), 65519.0, 65520.0])
    assert edge.half().float().tolist() == [0.0, 2.0 ** -24, 65504.0, INF]
