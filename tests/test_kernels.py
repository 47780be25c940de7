"""INT2 KV kernels, torch backend: bit-exact against a naive loop implementation written from the spec.

The naive implementation below follows the OSCAR / SGLang semantics one row and one element at a
time with numpy float32 scalars (IEEE fp32 arithmetic), independent of rotationzoo's vectorised code.
"""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from rotationzoo.errors import BackendUnavailableError, ConfigError, KernelInputError
from rotationzoo.kernels import (
    allowed_group_sizes,
    byte_index_and_shift,
    clip_index,
    dequantize_int2,
    fake_quantize_int2,
    quantize_int2,
    quantize_int2_into,
)
from rotationzoo.kernels import layout
from rotationzoo.kernels.reference import pack_codes, unpack_codes

from helpers import int2_config

F32 = np.float32
LM_T = F32(0.9810652732849121)
LM_C = 1.5095585584640503


# --- the naive implementation -------------------------------------------------------------------


def naive_clip_index(r: float, d: int) -> int:
    if r <= 0:
        return -1
    return min(max(int(r * d), 0), d - 1)


def naive_pairwise_sum(vals: list) -> np.float32:
    s = list(vals)
    while len(s) > 1:
        h = len(s) // 2
        s = [F32(s[j] + s[j + h]) for j in range(h)]
    return s[0]


def naive_quantize_row(row: list, k: int, group: int, lloyd_max: bool):
    """One row of fp32 values -> (codes list[int] of d, scales, zeros) as np.float32."""
    d = len(row)
    vals = [F32(v) for v in row]
    nan_row = any(math.isnan(v) for v in vals)
    if nan_row:
        vals = [F32(0.0)] * d
    if k >= 0:
        thr = sorted(abs(v) for v in vals)[k]
        vals = [min(max(v, -thr), thr) for v in vals]
    bad = nan_row or any(math.isinf(v) for v in vals)
    if bad:
        vals = [F32(0.0)] * d
    vals = [F32(0.0) if v == 0 else F32(v) for v in vals]
    q = [0] * d
    scales, zeros = [], []
    if lloyd_max:
        mean = F32(naive_pairwise_sum(vals) / F32(d))
        diff = [F32(v - mean) for v in vals]
        var = F32(naive_pairwise_sum([F32(x * x) for x in diff]) / F32(d))
        std = F32(np.sqrt(F32(var + F32(1e-8))))
        for i, x in enumerate(diff):
            z = F32(x / std)
            q[i] = int(z >= -LM_T) + int(z >= F32(0.0)) + int(z >= LM_T)
        scale = F32(std * F32((2 * LM_C / 3.0) * 1.16))
        zero = F32(F32(1.5) - F32(mean / scale))
        scales, zeros = [scale], [zero]
    else:
        for g0 in range(0, d, group):
            grp = vals[g0 : g0 + group]
            mn, mx = min(grp), max(grp)
            scale = F32(F32(max(F32(mx - mn), F32(1e-8))) / F32(3.0))
            zero = F32(-mn / scale)
            for i, v in enumerate(grp):
                t = F32(F32(F32(v / scale) + zero) + F32(0.5))
                q[g0 + i] = int(min(max(np.floor(t), 0.0), 3.0))
            scales.append(scale)
            zeros.append(zero)
    if bad:
        q = [0] * d
        scales = [F32("nan")] * len(scales)
        zeros = [F32("nan")] * len(zeros)
    return q, scales, zeros


def naive_pack(q: list) -> list:
    quarter = len(q) // 4
    return [q[j] | q[j + quarter] << 2 | q[j + 2 * quarter] << 4 | q[j + 3 * quarter] << 6 for j in range(quarter)]


def naive_quantize(x: torch.Tensor, clip_ratio=0.0, group_size=None, lloyd_max=False, scale_dtype=torch.float32):
    d = x.shape[-1]
    group = group_size or d
    k = naive_clip_index(clip_ratio, d)
    rows = x.reshape(-1, d).to(torch.float32).tolist()
    codes, sz = [], []
    for row in rows:
        with np.errstate(all="ignore"):  # rows of +-1e30 overflow the Lloyd-Max variance, as in fp32
            q, s, z = naive_quantize_row(row, k, group, lloyd_max)
        codes.append(naive_pack(q))
        sz.append([float(v) for pair in zip(s, z) for v in pair])
    ng = d // group
    c = torch.tensor(codes, dtype=torch.uint8).reshape(*x.shape[:-1], d // 4)
    s = torch.tensor(sz, dtype=torch.float32).reshape(*x.shape[:-1], 2 * ng).to(scale_dtype)
    return c, s


def naive_dequantize(codes: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
    quarter = codes.shape[-1]
    d = 4 * quarter
    out = []
    for crow, srow in zip(codes.reshape(-1, quarter).tolist(), sz.reshape(-1, sz.shape[-1]).float().tolist()):
        vals = []
        for dim in range(d):
            byte, shift = dim % quarter, 2 * (dim // quarter)
            q = (crow[byte] >> shift) & 3
            g = dim // group
            vals.append(float(F32(F32(F32(q) - F32(srow[2 * g + 1])) * F32(srow[2 * g]))))
        out.append(vals)
    return torch.tensor(out, dtype=torch.float32).reshape(*codes.shape[:-1], d)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor, for byte-for-byte comparison."""
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bytes(got: tuple, want: tuple) -> None:
    assert got[0].dtype == want[0].dtype == torch.uint8
    assert got[0].shape == want[0].shape, (got[0].shape, want[0].shape)
    assert torch.equal(got[0], want[0]), f"{int((got[0] != want[0]).sum())} code bytes differ"
    assert got[1].dtype == want[1].dtype and got[1].shape == want[1].shape
    assert torch.equal(bits(got[1]), bits(want[1])), "scales/zeros differ: " + str(
        (got[1].float() - want[1].float()).abs().max()
    )


def rand(shape, dtype=torch.float32, seed=0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if heavy:  # a few outliers per row, like post-RoPE keys
        x = x * (1 + 8 * (torch.rand(shape, generator=g) > 0.97))
    return (x * 2.0 + 0.3).to(dtype)


def orthogonal(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32).contiguous()


# --- layout -------------------------------------------------------------------------------------


def test_byte_index_and_shift_worked_example():
    assert byte_index_and_shift(0, 128) == (0, 0)
    assert byte_index_and_shift(33, 128) == (1, 2)
    assert byte_index_and_shift(70, 128) == (6, 4)
    assert byte_index_and_shift(127, 128) == (31, 6)
    assert byte_index_and_shift(16, 64) == (0, 2)
    # dims 5, 37, 69, 101 with codes 3, 0, 2, 1 -> byte 5 == 0b01_10_00_11 == 0x63
    q = torch.zeros(128, dtype=torch.uint8)
    q[5], q[37], q[69], q[101] = 3, 0, 2, 1
    packed = pack_codes(q)
    assert packed[5].item() == 0x63
    assert int(packed.sum()) == 0x63


@pytest.mark.parametrize("d", [64, 128, 256])
def test_byte_index_and_shift_pins_pack_codes(d):
    for dim in range(d):
        q = torch.zeros(d, dtype=torch.uint8)
        q[dim] = 2
        byte, shift = byte_index_and_shift(dim, d)
        packed = pack_codes(q)
        assert packed[byte].item() == 2 << shift
        assert int(packed.count_nonzero()) == 1
    q = torch.randint(0, 4, (5, d), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(q)), q)
    assert pack_codes(q).tolist() == [naive_pack(row) for row in q.tolist()]


def test_byte_index_and_shift_rejects_bad_args():
    with pytest.raises(ValueError):
        byte_index_and_shift(128, 128)
    with pytest.raises(ValueError):
        byte_index_and_shift(0, 130)


def test_clip_index_and_plan():
    assert clip_index(0.96, 128) == 122
    assert clip_index(0.92, 128) == 117
    assert clip_index(0.0, 128) == -1
    assert clip_index(-0.3, 128) == -1
    assert clip_index(1.0, 128) == 127
    assert clip_index(1e-9, 64) == 0
    assert clip_index(0.96, 256) == 245
    for r in (0.01, 0.3, 0.5, 0.9, 0.96, 0.999):
        for d in (64, 128, 256):
            assert clip_index(r, d) == naive_clip_index(r, d)
    assert layout.clip_plan(-1, 128) == ("none", 0)
    assert layout.clip_plan(122, 128) == ("top", 6)
    assert layout.clip_plan(117, 128) == ("top", 11)
    assert layout.clip_plan(3, 128) == ("bottom", 4)
    assert layout.clip_plan(64, 128) == ("radix", 31)
    assert layout.clip_plan(122, 128, search="bisect") == ("bisect", 7)
    assert layout.clip_plan(61, 64, search="bisect") == ("bisect", 6)
    assert layout.clip_plan(245, 256, search="bisect") == ("bisect", 8)
    assert layout.clip_plan(-1, 128, search="bisect") == ("none", 0)
    assert [layout.bisect_iters(d) for d in (16, 32, 64, 128, 256)] == [0, 0, 6, 7, 8]


def test_group_sizes_and_launch_heuristics():
    assert allowed_group_sizes(128) == (128, 64, 32, 16)
    assert allowed_group_sizes(64) == (64, 32, 16)
    assert layout.resolve_group_size(256, None) == 256
    assert layout.quant_block_rows(128, rotate=True) >= 16
    assert layout.quant_block_rows(256, rotate=True) >= 16
    for d in (64, 128, 256):
        bt = layout.quant_block_rows(d, rotate=True)
        assert 4 <= layout.quant_num_warps(d, bt, rotate=True) <= 8
    # an explicit register ceiling only at the launch table's own entry (a sweep sets its own)
    bt = layout.quant_block_rows(128, rotate=False)
    warps = layout.quant_num_warps(128, bt, rotate=False)
    assert layout.quant_max_registers(128, bt, warps, rotate=False) == 255
    assert layout.quant_max_registers(128, bt // 2, warps, rotate=False) is None
    assert layout.quant_max_registers(64, 64, 8, rotate=False) is None
    rows = layout.quant_block_rows(128, rotate=True, capability=80)
    warps = layout.quant_num_warps(128, rows, rotate=True, capability=80)
    assert layout.quant_max_registers(128, rows, warps, rotate=True, capability=80) == 255  # sm_80 spilled without
    hrows = layout.quant_block_rows(128, rotate=True, capability=90)
    hwarps = layout.quant_num_warps(128, hrows, rotate=True, capability=90)
    assert layout.quant_max_registers(128, hrows, hwarps, rotate=True, capability=90) is None
    assert layout.persistent_programs(0, 8, 132) == 1
    assert layout.persistent_programs(3, 8, 132) == 3
    assert layout.persistent_programs(10_000, 8, 132) == 66
    assert layout.persistent_programs(10_000, 1, 132) == 528


# --- quantize: reference vs naive ---------------------------------------------------------------

_GROUP_CASES = [(d, g) for d in (64, 128, 256) for g in allowed_group_sizes(d)]
_CLIPS = [0.0, 0.96, 0.92, 0.5, 0.03, -1.0]
_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("d,group", _GROUP_CASES)
@pytest.mark.parametrize("ci", range(len(_CLIPS)))
def test_quantize_matches_naive(d, group, ci):
    clip = _CLIPS[ci]
    dtype = _DTYPES[(ci + d // 64) % 3]
    sdt = _SCALE_DTYPES[(ci + group // 16) % 3]
    shape = (7, d) if ci % 2 else (3, 3, d)  # odd row counts
    x = rand(shape, dtype, seed=ci * 1000 + d + group, heavy=ci % 3 == 0)
    got = quantize_int2(x, config=int2_config(clip, group, scale=sdt), backend="torch")
    want = naive_quantize(x, clip, group, False, sdt)
    assert got[0].shape == (*shape[:-1], d // 4)
    assert got[1].shape == (*shape[:-1], 2 * d // group)
    assert_same_bytes(got, want)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("clip", [0.0, 0.96, 0.92])
@pytest.mark.parametrize("dtype", _DTYPES)
def test_lloyd_max_matches_naive(d, clip, dtype):
    x = rand((5, d), dtype, seed=d + int(clip * 100), heavy=True)
    got = quantize_int2(x, config=int2_config(clip, lloyd_max=True), backend="torch")
    assert_same_bytes(got, naive_quantize(x, clip, None, True))


def test_lloyd_max_levels():
    x = rand((64, 128), seed=3)
    codes, sz = quantize_int2(x, config=int2_config(lloyd_max=True), backend="torch")
    y = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch")
    xf = x.double()
    mean = xf.mean(-1, keepdim=True)
    std = (xf.var(-1, unbiased=False, keepdim=True) + 1e-8).sqrt()
    levels = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64) * (2 * LM_C / 3) * 1.16
    q = unpack_codes(codes).long()
    torch.testing.assert_close(y.double(), mean + std * levels[q], rtol=0, atol=2e-6)
    z = (xf - mean) / std
    expected_q = (z >= -0.9810652732849121).long() + (z >= 0).long() + (z >= 0.9810652732849121).long()
    assert (expected_q != q).float().mean() < 1e-3  # fp32 vs fp64 statistics: boundary cases only


def test_special_rows_match_naive():
    d = 128
    rows = [
        torch.zeros(d),  # zero row: scale 1e-8/3, zero -0.0
        torch.full((d,), -0.0),
        torch.full((d,), 2.5),  # constant row
        torch.full((d,), -1e4),
        torch.cat([torch.full((d // 2,), 1.0), torch.full((d // 2,), -1.0)]),  # ties at the threshold
        torch.arange(d, dtype=torch.float32) % 4 - 1.5,  # values on exact code points
        torch.linspace(-1, 1, d) * 1e-30,  # tiny (subnormal range after scaling)
        torch.linspace(-1, 1, d) * 1e30,
        rand((d,), seed=9) * torch.where(torch.arange(d) % 7 == 0, 0.0, 1.0),  # many exact zeros
    ]
    x = torch.stack(rows)
    for clip in (0.0, 0.96, 0.5):
        for group in (128, 32):
            got = quantize_int2(x, config=int2_config(clip, group), backend="torch")
            assert_same_bytes(got, naive_quantize(x, clip, group))
        got = quantize_int2(x, config=int2_config(clip, lloyd_max=True), backend="torch")
        assert_same_bytes(got, naive_quantize(x, clip, None, True))
    codes, sz = quantize_int2(x[:4], backend="torch")
    assert not codes.any()  # constant rows -> all codes 0
    assert torch.equal(bits(sz[0]), bits(torch.tensor([1e-8 / 3, -0.0]).float()))
    assert torch.equal(bits(sz[1]), bits(sz[0]))  # -0.0 inputs behave like +0.0


def test_nan_inf_policy():
    d = 64
    x = rand((6, d), seed=4)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")  # removed by the clip (when on)
    x[2, :2] = float("-inf")
    x[3, :3] = float("inf")  # clip 0.96 at d=64 keeps the 3rd largest: inf survives
    for clip in (0.0, 0.96):
        codes, sz = quantize_int2(x, config=int2_config(clip, 16), backend="torch")
        assert_same_bytes((codes, sz), naive_quantize(x, clip, 16))
        bad = torch.isnan(sz).any(-1)
        assert torch.equal(torch.isnan(sz).all(-1), bad)
        assert not codes[bad].any()
        expected_bad = [True, clip == 0, clip == 0, True, False, False]
        assert bad.tolist() == expected_bad
        y = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch")
        assert torch.isnan(y[bad]).all() and torch.isfinite(y[~bad]).all()
    # a clipped inf row quantizes exactly like the same row with the inf replaced by the threshold
    thr = torch.sort(x[1].abs()).values[clip_index(0.96, d)]
    assert torch.isfinite(thr)
    y = x[1:2].clone()
    y[0, 5] = thr
    got = quantize_int2(x[1:2], config=int2_config(0.96), backend="torch")
    assert_same_bytes(got, quantize_int2(y, config=int2_config(0.96), backend="torch"))


def test_codes_use_unrounded_scale_zero():
    x = rand((9, 128), seed=5)
    c32, s32 = quantize_int2(x, config=int2_config(0.96, 32), backend="torch")
    for sdt in (torch.bfloat16, torch.float16):
        c, s = quantize_int2(x, config=int2_config(0.96, 32, scale=sdt), backend="torch")
        assert torch.equal(c, c32)
        assert torch.equal(bits(s), bits(s32.to(sdt)))


def test_rotation_against_naive():
    d = 128
    x = rand((40, 2, d), torch.bfloat16, seed=6, heavy=True)
    r = orthogonal(d, seed=1)
    codes, sz = quantize_int2(x, config=int2_config(0.96), rotation=r, backend="torch")
    # independent rotation: fp64 products of the bf16 operands, rounded to bf16 once
    rot = (x.to(torch.bfloat16).double() @ r.to(torch.bfloat16).double()).to(torch.bfloat16)
    want = naive_quantize(rot, 0.96)
    q_got, q_want = unpack_codes(codes).int(), unpack_codes(want[0]).int()
    frac = (q_got != q_want).float().mean().item()
    assert frac <= 1e-3 and (q_got - q_want).abs().max() <= 1, frac
    # and exactly the pre-rotated path for the reference's own rotation
    from rotationzoo.kernels.reference import bf16_matmul

    assert_same_bytes((codes, sz), quantize_int2(bf16_matmul(x, r), config=int2_config(0.96), backend="torch"))


def test_per_head_rotation_equals_per_head_calls():
    d, h = 64, 3
    x = rand((11, h, d), torch.float16, seed=7)
    r = torch.stack([orthogonal(d, seed=s) for s in range(h)])
    codes, sz = quantize_int2(x, config=int2_config(0.92), rotation=r, backend="torch")
    for i in range(h):
        c, s = quantize_int2(x[:, i], config=int2_config(0.92), rotation=r[i], backend="torch")
        assert torch.equal(codes[:, i], c) and torch.equal(bits(sz[:, i]), bits(s))
    back = dequantize_int2(codes, sz, rotation=r, dtype=torch.float32, backend="torch")
    for i in range(h):
        one = dequantize_int2(codes[:, i], sz[:, i], rotation=r[i], dtype=torch.float32, backend="torch")
        assert torch.equal(back[:, i], one)


def test_empty_input():
    codes, sz = quantize_int2(torch.zeros(0, 4, 128), backend="torch")
    assert codes.shape == (0, 4, 32) and sz.shape == (0, 4, 2)
    assert dequantize_int2(codes, sz, backend="torch").shape == (0, 4, 128)
    codes, sz = quantize_int2(rand((64,)), backend="torch")  # a single row without a batch dim
    assert codes.shape == (16,) and sz.shape == (2,)


# --- dequantize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("d,group", [(64, 16), (128, 128), (128, 64), (256, 32)])
@pytest.mark.parametrize("sdt", _SCALE_DTYPES)
def test_dequantize_matches_naive_and_step_bound(d, group, sdt):
    x = rand((13, d), seed=d + group, heavy=True)
    codes, sz = quantize_int2(x, config=int2_config(0.92, group, scale=sdt), backend="torch")
    y = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch")
    assert torch.equal(y, naive_dequantize(codes, sz, group))
    for odt in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_int2(codes, sz, dtype=odt, backend="torch"), y.to(odt))
    # error within half an INT2 step of the clipped input (scale from the stored fp32 metadata)
    if sdt == torch.float32:
        k = clip_index(0.92, d)
        thr = torch.sort(x.abs(), dim=-1).values[:, k : k + 1]
        xc = torch.minimum(torch.maximum(x, -thr), thr)
        step = sz[:, 0::2].repeat_interleave(group, dim=-1)
        assert ((y - xc).abs() / step).max() <= 0.5 + 1e-4
        # endpoints: each group's min is reproduced almost exactly
        lo = xc.reshape(13, -1, group).amin(-1)
        got_lo = y.reshape(13, -1, group).amin(-1)
        torch.testing.assert_close(got_lo, lo, rtol=0, atol=1e-5 * float(xc.abs().max()))


def test_round_trip_with_rotation_restores_basis():
    d = 128
    x = rand((300, 2, d), torch.bfloat16, seed=8, heavy=True)
    r = orthogonal(d, seed=2)
    codes, sz = quantize_int2(x, config=int2_config(0.96), rotation=r, backend="torch")
    back = dequantize_int2(codes, sz, rotation=r, dtype=torch.float32, backend="torch")
    # the same error measured in fp64: rotate, quantize error in the rotated basis, un-rotate
    x_rot = x.double() @ r.double()
    xh_rot = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch").double()
    exact_back = xh_rot @ r.double().T
    err = (back.double() - x.double()).pow(2).mean().sqrt()
    err_rot = (xh_rot - x_rot).pow(2).mean().sqrt()
    # orthogonality: the error norm is basis independent; bf16 steps add at most a few tenths of a %
    assert abs(err / err_rot - 1) < 0.01, (err, err_rot)
    # un-rotation itself sits at the bf16 precision floor
    floor = (exact_back - back.double()).pow(2).mean().sqrt() / exact_back.pow(2).mean().sqrt()
    assert floor < 2**-8
    # rows point the right way in the original basis (a wrong basis gives cosines near 0)
    codes, sz = quantize_int2(x, config=int2_config(0.0, 16), rotation=r, backend="torch")
    back = dequantize_int2(codes, sz, rotation=r, dtype=torch.float32, backend="torch")
    cos = torch.nn.functional.cosine_similarity(back.double().reshape(-1, d), x.double().reshape(-1, d), dim=-1)
    print(f"rotated INT2 g16 round trip: cosine mean {cos.mean():.4f} min {cos.min():.4f}")
    assert cos.mean() > 0.9 and cos.min() > 0.8


# --- paged store --------------------------------------------------------------------------------


@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_paged_store_skips_negative_and_out_of_range_slots(sdt):
    t, h, d, slots = 9, 2, 64, 12
    x = rand((t, h, d), torch.bfloat16, seed=10)
    loc = torch.tensor([4, -1, 0, 11, 12, 7, -100, 2, 5], dtype=torch.int32)
    codes_buf = torch.full((slots, h, d // 4), 0xAB, dtype=torch.uint8)
    sz_buf = torch.full((slots, h, 4), -7.0, dtype=sdt)
    quantize_int2_into(x, loc, codes_buf, sz_buf, config=int2_config(0.96, 32, scale=sdt), backend="torch")
    codes, sz = quantize_int2(x, config=int2_config(0.96, 32, scale=sdt), backend="torch")
    written = set()
    for i, s in enumerate(loc.tolist()):
        if 0 <= s < slots:
            written.add(s)
            assert torch.equal(codes_buf[s], codes[i]) and torch.equal(bits(sz_buf[s]), bits(sz[i]))
    for s in set(range(slots)) - written:
        assert (codes_buf[s] == 0xAB).all() and (sz_buf[s] == -7.0).all()
    assert written == {4, 0, 11, 7, 2, 5}


def test_paged_store_with_rotation_and_int64_loc():
    t, h, d = 6, 3, 128
    x = rand((t, h, d), torch.float32, seed=11)
    r = orthogonal(d, seed=3)
    loc = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int64)
    codes_buf = torch.zeros(6, h, d // 4, dtype=torch.uint8)
    sz_buf = torch.zeros(6, h, 2)
    quantize_int2_into(x, loc, codes_buf, sz_buf, config=int2_config(0.92), rotation=r, backend="torch")
    codes, sz = quantize_int2(x, config=int2_config(0.92), rotation=r, backend="torch")
    assert torch.equal(codes_buf.flip(0), codes) and torch.equal(sz_buf.flip(0), sz)
    quantize_int2_into(x[:0], loc[:0], codes_buf, sz_buf, backend="torch")  # no rows: no-op


# --- argument errors ----------------------------------------------------------------------------


def test_bad_inputs_raise_kernel_input_error():
    x = rand((4, 128))
    x3 = x[:, None]
    loc = torch.zeros(4, dtype=torch.int64)
    cbuf, sbuf = torch.zeros(4, 1, 32, dtype=torch.uint8), torch.zeros(4, 1, 2)
    cu, c8 = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 32, dtype=torch.int8)
    bad_calls = [
        lambda: quantize_int2(rand((4, 96))),
        lambda: quantize_int2(rand((4, 130))),
        lambda: quantize_int2(x.double()),
        lambda: quantize_int2(x.to(torch.int32)),
        lambda: quantize_int2(torch.tensor(1.0)),
        lambda: quantize_int2(x.numpy()),
        lambda: quantize_int2(x, config=int2_config(0.0, 256)),  # more than head_dim
        lambda: quantize_int2(x, config=int2_config(0.0, 64, lloyd_max=True)),
        lambda: quantize_int2(x, config={"group_size": 16}),
        lambda: quantize_int2(x, side="q"),
        lambda: quantize_int2(x, rotation=torch.eye(64)),
        lambda: quantize_int2(x, rotation=torch.eye(128, dtype=torch.int64)),
        lambda: quantize_int2(x, rotation=torch.eye(128).expand(3, 128, 128)),  # x has 4 "heads"
        lambda: quantize_int2(x, rotation=torch.eye(128)[None, None]),
        lambda: quantize_int2(x, backend="cuda"),
        lambda: dequantize_int2(c8, torch.zeros(4, 2)),
        lambda: dequantize_int2(torch.zeros(4, 24, dtype=torch.uint8), torch.zeros(4, 2)),
        lambda: dequantize_int2(cu, torch.zeros(4, 3)),
        lambda: dequantize_int2(cu, torch.zeros(5, 2)),
        lambda: dequantize_int2(cu, torch.zeros(4, 2), config=int2_config(0.0, 64)),
        lambda: dequantize_int2(cu, torch.zeros(4, 2), config=int2_config(scale=torch.bfloat16)),
        lambda: dequantize_int2(cu, torch.zeros(4, 32)),  # group 8
        lambda: dequantize_int2(cu, torch.zeros(4, 2, dtype=torch.float64)),
        lambda: dequantize_int2(cu, torch.zeros(4, 2), dtype=torch.int8),
        lambda: dequantize_int2(cu, torch.zeros(4, 2), rotation=torch.eye(64)),
        lambda: quantize_int2_into(x, loc, cbuf, sbuf),  # x not [T, H, d]
        lambda: quantize_int2_into(x3, torch.zeros(4), cbuf, sbuf),  # float slots
        lambda: quantize_int2_into(x3, loc[:3], cbuf, sbuf),
        lambda: quantize_int2_into(x3, loc, torch.zeros(4, 2, 32, dtype=torch.uint8), torch.zeros(4, 2, 2)),
        lambda: quantize_int2_into(x3, loc, cbuf, torch.zeros(5, 1, 2)),
        lambda: quantize_int2_into(x3, loc, cbuf, sbuf, config=int2_config(0.0, 64)),
        lambda: quantize_int2_into(x3, loc, cbuf, torch.zeros(4, 1, 4), config=int2_config(lloyd_max=True)),
        lambda: quantize_int2_into(x3, loc, cbuf, sbuf.bfloat16(), config=int2_config()),  # not the config's dtype
        # writes would alias: every slot (or head) of an expanded buffer is the same memory
        lambda: quantize_int2_into(x3, loc, cbuf[:1].expand(4, 1, 32), sbuf, backend="torch"),
        lambda: quantize_int2_into(x3, loc, cbuf, sbuf[:1].expand(4, 1, 2), backend="torch"),
        lambda: quantize_int2_into(x[:2, None].expand(2, 3, 128), loc[:2], cbuf[:, :1].expand(4, 3, 32),
                                   torch.zeros(4, 3, 2), backend="torch"),
        # the quantizer reads values; a raw RuntimeError of .item() on a meta tensor before
        lambda: quantize_int2(x.to("meta"), backend="torch"),
        lambda: fake_quantize_int2(x.to("meta"), backend="torch"),
        lambda: quantize_int2_into(x3.to("meta"), loc.to("meta"), cbuf.to("meta"), sbuf.to("meta"), backend="torch"),
        lambda: clip_index(float("nan"), 128),  # a raw ValueError of int(nan) before
        lambda: clip_index(float("inf"), 128),
        lambda: clip_index("0.9", 128),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(KernelInputError) as info:
            call()
        assert isinstance(info.value, ValueError), i
        assert str(info.value), i


def test_helpers_and_buffers_refuse_what_no_kernel_can_use():
    with pytest.raises(KernelInputError, match="clip_ratio must be a finite number .* got nan"):
        clip_index(float("nan"), 128)
    assert clip_index(float("-inf"), 128) == -1  # <= 0: no clip
    with pytest.raises(ConfigError, match="head_dim 96 .* 64, 128, 256"):
        allowed_group_sizes(96)  # had listed 96, 48, 24: sizes for a head_dim no kernel runs
    assert allowed_group_sizes(256) == (256, 128, 64, 32, 16)
    with pytest.raises(KernelInputError, match="meta device"):
        quantize_int2(torch.zeros(2, 64, device="meta"), backend="torch")
    x = rand((4, 1, 64))
    loc = torch.arange(4)
    codes = torch.zeros(1, 1, 16, dtype=torch.uint8).expand(4, 1, 16)
    with pytest.raises(KernelInputError, match=r"codes_buf .* strides \[0, 16, 1\] \(an expanded tensor"):
        quantize_int2_into(x, loc, codes, torch.zeros(4, 1, 2), backend="torch")
    # a strided view with memory of its own per slot is a buffer like any other
    big_c, big_s = torch.zeros(8, 1, 16, dtype=torch.uint8), torch.zeros(8, 1, 2)
    quantize_int2_into(x, loc, big_c[::2], big_s[::2], backend="torch")
    want = quantize_int2(x, backend="torch")
    assert torch.equal(big_c[::2], want[0]) and torch.equal(big_s[::2], want[1]) and not big_c[1::2].any()


def test_error_messages_name_what_was_expected():
    with pytest.raises(KernelInputError, match="64, 128, 256"):
        quantize_int2(rand((2, 96)))
    with pytest.raises(KernelInputError, match="bfloat16, float16, float32"):
        quantize_int2(rand((2, 128)).double())
    with pytest.raises(KernelInputError, match="group_size 256 .* 128, 64, 32, 16"):
        quantize_int2(rand((2, 128)), config=int2_config(0.0, 256))


@pytest.mark.parametrize("bad", [dict(group_size=8), dict(group_size=48), dict(k_clip_ratio=1.5),
                                 dict(k_clip_ratio=float("nan")), dict(k_clip_ratio="0.9"), dict(scale_dtype="float64")])
def test_bad_settings_are_refused_by_the_config(bad):
    """The settings come only as an Int2KVConfig, which refuses a bad value when it is made."""
    from rotationzoo.errors import ConfigError
    from rotationzoo.int2kv import Int2KVConfig

    with pytest.raises(ConfigError):
        Int2KVConfig(**bad)


def test_the_loose_keywords_are_gone():
    """clip_ratio / group_size / lloyd_max / scale_dtype / clip_search are not keywords of the entry
    points any more: the settings travel as one config."""
    x = rand((2, 64))
    for kw in ("clip_ratio", "group_size", "lloyd_max", "scale_dtype", "clip_search"):
        with pytest.raises(TypeError):
            quantize_int2(x, **{kw: None})
        with pytest.raises(TypeError):
            fake_quantize_int2(x, **{kw: None})
    codes, sz = quantize_int2(x)
    for kw in ("group_size", "lloyd_max"):
        with pytest.raises(TypeError):
            dequantize_int2(codes, sz, **{kw: None})


def test_triton_backend_unavailable_on_cpu_without_interpreter(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    from rotationzoo.kernels import triton_int2

    # stand-in for a process without TRITON_INTERPRET=1 (triton's own settings are left alone)
    monkeypatch.setattr(triton_int2, "interpret_mode", lambda: False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        quantize_int2(rand((2, 64)), backend="triton")
    with pytest.raises(BackendUnavailableError):
        dequantize_int2(torch.zeros(2, 16, dtype=torch.uint8), torch.ones(2, 2), backend="triton")
    # auto never picks the interpreter for CPU tensors
    codes, _ = quantize_int2(rand((2, 64)), backend="auto")
    assert codes.shape == (2, 16)


def test_import_does_not_pull_triton():
    code = "import sys, rotationzoo.kernels as k; assert 'triton' not in sys.modules, 'triton imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("knobs", [
    {}, {"clip": 0.96}, {"clip": 0.92, "group": 16}, {"lloyd_max": True, "clip": 0.96},
    {"clip": 0.96, "search": "bisect"}, {"scale": torch.bfloat16, "group": 32},
    {"scale": torch.float16, "clip": 0.5},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_equals_the_round_trip(knobs, dtype) -> None:
    """fake_quantize_int2 reads back exactly what quantize_int2 + dequantize_int2 give (NaN rows too)."""
    g = torch.Generator().manual_seed(len(knobs))
    x = (torch.randn(300, 2, 128, generator=g) * torch.rand(300, 2, 1, generator=g) * 10).to(dtype)
    x[3, 1, 7] = float("nan")
    x[5, 0] = 0.0
    cfg = int2_config(**knobs)
    codes, sz = quantize_int2(x, config=cfg, backend="torch")
    ref = dequantize_int2(codes, sz, dtype=torch.float32, backend="torch")
    got = fake_quantize_int2(x, config=cfg, dtype=torch.float32, backend="torch")
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
    assert fake_quantize_int2(x, config=cfg, backend="torch").dtype == dtype
