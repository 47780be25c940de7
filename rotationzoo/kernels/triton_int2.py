"""Triton INT2 KV kernels: fused rotate + clip + quantize + pack (optionally into slots), and dequant.

Imported only when the triton backend is used. The kernels follow the semantics of
:mod:`rotationzoo.kernels.reference` operation for operation; every fp32 division is the IEEE
round-to-nearest ``tl.math.div_rn`` (Triton's ``/`` on fp32 is the approximate ``div.full.f32``),
the square root is ``sqrt_rn``, fp32 -> bf16 rounding is done with integer arithmetic
(round-to-nearest-even, like torch) and launches pass ``enable_fp_fusion=False`` so that no
multiply-add is contracted into an FMA. Under ``TRITON_INTERPRET=1`` they run on CPU tensors and are
bit-exact with the reference (tested); compiled, the same holds except for the fp32 summation order
inside ``tl.dot`` when a rotation is fused.

Kernels are built on first use for the current Triton mode (compiled or interpreted), so setting
``TRITON_INTERPRET=1`` after ``import triton`` still takes effect.
"""

import functools
import types

import torch
import triton
import triton.language as tl

from .triton_launch import Launch, dequant_launch, interpret_mode, kernel_copies, quant_launch

__all__ = [
    "Launch", "aot_kernels", "dequant_launch", "dequantize_triton", "interpret_mode", "quant_launch", "quantize_triton",
]

# Reductions go through tl.reduce with Triton's own combine functions (what tl.max/min/sum do
# inside). The interpreter recognises these objects and reduces with numpy, whichever mode triton
# was imported in; the kernels call no other @jit library function (tl.cdiv, tl.zeros, tl.max ...),
# so they also run interpreted when TRITON_INTERPRET=1 was set after triton had been imported.
_MAX_FN = tl.standard._elementwise_max
_MIN_FN = tl.standard._elementwise_min
_SUM_FN = tl.standard._sum_combine


def _int2_quant_kernel(
    x_ptr,
    r_ptr,
    loc_ptr,
    codes_ptr,
    sz_ptr,
    n_rows,
    num_tiles,
    n_slots,
    sx_t,
    sx_h,
    sx_d,
    sr_h,
    sr_i,
    sr_o,
    sc_s,
    sc_h,
    sc_q,
    ss_s,
    ss_h,
    ss_k,
    D: tl.constexpr,
    Q: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    ROTATE: tl.constexpr,
    DOT_BF16: tl.constexpr,
    HAS_LOC: tl.constexpr,
    CLIP_INDEX: tl.constexpr,
    CLIP_MODE: tl.constexpr,
    CLIP_ITERS: tl.constexpr,
    LLOYD_MAX: tl.constexpr,
    SZ_BF16: tl.constexpr,
):
    """Rotate (optional) + clip + quantize + pack ``BT``-row tiles of one head.

    Grid ``(P, H)``: program ``(p, h)`` loads ``R[h]`` (or the shared ``R``) once, then visits tiles
    ``p, p + P, ...`` of head ``h``. Input row ``t`` of head ``h`` is at
    ``x_ptr + t*sx_t + h*sx_h + dim*sx_d``; it is written to slot ``loc[t]`` (``HAS_LOC``; rows whose
    slot is negative or ``>= n_slots`` are skipped) or to slot ``t``.

    Per row (fp32): rotation ``bf16(bf16(x) @ R)`` via ``tl.dot`` with fp32 accumulation; NaN row ->
    zeroed and flagged; clip at ``sort(|row|)[CLIP_INDEX]`` found exactly by ``CLIP_MODE``
    (1 max-and-mask, 2 min-and-mask, 3 bit-pattern bisection) or at the decode flush's bisected
    threshold (4, ``CLIP_ITERS`` halvings); rows with ±inf left -> flagged; signed
    zeros -> +0; uniform or Lloyd-Max levels; flagged rows store codes 0 and NaN scale/zero.
    """
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # head offsets in 64 bits: a head-major buffer may pass 2^31 elements
    nprog = tl.num_programs(0)
    dims = tl.arange(0, D)
    qidx = tl.arange(0, Q)
    gidx = tl.arange(0, NG)
    shifts = tl.arange(0, 4) * 2
    if ROTATE:
        r_offs = head * sr_h + dims[:, None] * sr_i + dims[None, :] * sr_o
        rmat = tl.load(r_ptr + r_offs)
    for tile in range(pid, num_tiles, nprog):
        rows = tile * BT + tl.arange(0, BT)
        in_range = rows < n_rows
        if HAS_LOC:
            slot = tl.load(loc_ptr + rows, mask=in_range, other=-1).to(tl.int64)
            active = in_range & (slot >= 0) & (slot < n_slots)
        else:
            slot = rows.to(tl.int64)
            active = in_range
        x_offs = rows.to(tl.int64)[:, None] * sx_t + head * sx_h + dims[None, :] * sx_d
        v = tl.load(x_ptr + x_offs, mask=active[:, None], other=0.0).to(tl.float32)

        if ROTATE:
            # round to bf16 (nearest even) with integer ops: identical compiled and interpreted
            vb = v.to(tl.int32, bitcast=True)
            vb = (vb + 0x7FFF + ((vb >> 16) & 1)) & -65536
            v = tl.where(v != v, v, vb.to(tl.float32, bitcast=True))
            if DOT_BF16:
                acc = tl.dot(v.to(tl.bfloat16), rmat, out_dtype=tl.float32)
            else:
                acc = tl.dot(v, rmat, input_precision="ieee", out_dtype=tl.float32)
            ab = acc.to(tl.int32, bitcast=True)
            ab = (ab + 0x7FFF + ((ab >> 16) & 1)) & -65536
            v = tl.where(acc != acc, acc, ab.to(tl.float32, bitcast=True))

        nan_row = tl.reduce((v != v).to(tl.int32), 1, _MAX_FN) > 0
        v = tl.where(nan_row[:, None], 0.0, v)

        if CLIP_MODE != 0:
            a = tl.abs(v)
            if CLIP_MODE == 1:
                # the (D - CLIP_INDEX)-th largest |x|, counting ties
                rem = tl.full([BT], D - CLIP_INDEX, tl.int32)
                thr = tl.full([BT], 0.0, tl.float32)
                found = tl.full([BT], 0, tl.int32)
                for _ in tl.static_range(CLIP_ITERS):
                    cur = tl.reduce(a, 1, _MAX_FN)
                    eq = a == cur[:, None]
                    cnt = tl.reduce(eq.to(tl.int32), 1, _SUM_FN)
                    hit = (found == 0) & (cnt >= rem)
                    thr = tl.where(hit, cur, thr)
                    found = tl.where(hit, 1, found)
                    rem = rem - cnt
                    a = tl.where(eq, -1.0, a)
            elif CLIP_MODE == 2:
                # the (CLIP_INDEX + 1)-th smallest |x|, counting ties
                rem = tl.full([BT], CLIP_INDEX + 1, tl.int32)
                thr = tl.full([BT], 0.0, tl.float32)
                found = tl.full([BT], 0, tl.int32)
                for _ in tl.static_range(CLIP_ITERS):
                    cur = tl.reduce(a, 1, _MIN_FN)
                    eq = a == cur[:, None]
                    cnt = tl.reduce(eq.to(tl.int32), 1, _SUM_FN)
                    hit = (found == 0) & (cnt >= rem)
                    thr = tl.where(hit, cur, thr)
                    found = tl.where(hit, 1, found)
                    rem = rem - cnt
                    a = tl.where(eq, float("inf"), a)
            elif CLIP_MODE == 3:
                # largest bit pattern t with #{|x| < t} <= CLIP_INDEX: exactly sort(|x|)[CLIP_INDEX]
                u = a.to(tl.int32, bitcast=True)
                prefix = tl.full([BT], 0, tl.int32)
                for i in tl.static_range(CLIP_ITERS):
                    cand = prefix | (1 << (30 - i))
                    below = tl.reduce((u < cand[:, None]).to(tl.int32), 1, _SUM_FN)
                    prefix = tl.where(below <= CLIP_INDEX, cand, prefix)
                thr = prefix.to(tl.float32, bitcast=True)
            else:
                # the decode flush's search (reference.bisect_clip_rows): CLIP_ITERS halvings of
                # [0, max|x|] keeping at most D - CLIP_INDEX values above the upper end, which is
                # the threshold (at or below the exact sort(|x|)[CLIP_INDEX])
                lo = tl.full([BT], 0.0, tl.float32)
                hi = tl.reduce(a, 1, _MAX_FN)
                for _ in tl.static_range(CLIP_ITERS):
                    mid = (lo + hi) * 0.5
                    above = tl.reduce((a > mid[:, None]).to(tl.int32), 1, _SUM_FN)
                    too_many = above > D - CLIP_INDEX
                    lo = tl.where(too_many, mid, lo)
                    hi = tl.where(too_many, hi, mid)
                thr = hi
            v = tl.minimum(tl.maximum(v, -thr[:, None]), thr[:, None])

        inf_row = tl.reduce((tl.abs(v) == float("inf")).to(tl.int32), 1, _MAX_FN) > 0
        bad = nan_row | inf_row
        v = tl.where(bad[:, None] | (v == 0.0), 0.0, v)

        if LLOYD_MAX:
            # fixed halving order of the row sums (matches reference.pairwise_sum)
            s = v
            if D >= 256:
                s = tl.reduce(tl.reshape(s, (BT, 2, 128)), 1, _SUM_FN)
            if D >= 128:
                s = tl.reduce(tl.reshape(s, (BT, 2, 64)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 32)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 16)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 8)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 4)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 2)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 1)), 1, _SUM_FN)
            mean = tl.math.div_rn(tl.reshape(s, (BT,)), D * 1.0)
            diff = v - mean[:, None]
            s = diff * diff
            if D >= 256:
                s = tl.reduce(tl.reshape(s, (BT, 2, 128)), 1, _SUM_FN)
            if D >= 128:
                s = tl.reduce(tl.reshape(s, (BT, 2, 64)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 32)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 16)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 8)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 4)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 2)), 1, _SUM_FN)
            s = tl.reduce(tl.reshape(s, (BT, 2, 1)), 1, _SUM_FN)
            var = tl.math.div_rn(tl.reshape(s, (BT,)), D * 1.0)
            std = tl.math.sqrt_rn(var + 1e-8)
            z = tl.math.div_rn(diff, std[:, None])
            # literals = reference.LM_THRESHOLD, LM_SCALE, LM_ZERO_OFFSET (all exact in fp32)
            qf = (
                (z >= -0.9810652732849121).to(tl.float32)
                + (z >= 0.0).to(tl.float32)
                + (z >= 0.9810652732849121).to(tl.float32)
            )
            lm_scale = std * 1.1673918962478638
            lm_zero = 1.5 - tl.math.div_rn(mean, lm_scale)
            scale = lm_scale[:, None]
            zero = lm_zero[:, None]
        else:
            g = tl.reshape(v, (BT, NG, G))
            mn = tl.reduce(g, 2, _MIN_FN)
            mx = tl.reduce(g, 2, _MAX_FN)
            scale = tl.math.div_rn(tl.maximum(mx - mn, 1e-8), 3.0)
            zero = tl.math.div_rn(-mn, scale)
            t = tl.math.div_rn(g, scale[:, :, None]) + zero[:, :, None] + 0.5
            qf = tl.reshape(tl.minimum(tl.maximum(tl.floor(t), 0.0), 3.0), (BT, D))

        q4 = tl.reshape(qf.to(tl.int32), (BT, 4, Q))
        packed = tl.reduce(q4 << shifts[None, :, None], 1, _SUM_FN)
        packed = tl.where(bad[:, None], 0, packed).to(tl.uint8)
        scale = tl.where(bad[:, None], float("nan"), scale)
        zero = tl.where(bad[:, None], float("nan"), zero)
        if SZ_BF16:
            sb = scale.to(tl.int32, bitcast=True)
            sb = (sb + 0x7FFF + ((sb >> 16) & 1)) & -65536
            scale = tl.where(scale != scale, scale, sb.to(tl.float32, bitcast=True))
            zb = zero.to(tl.int32, bitcast=True)
            zb = (zb + 0x7FFF + ((zb >> 16) & 1)) & -65536
            zero = tl.where(zero != zero, zero, zb.to(tl.float32, bitcast=True))

        c_offs = slot[:, None] * sc_s + head * sc_h + qidx[None, :] * sc_q
        tl.store(codes_ptr + c_offs, packed, mask=active[:, None])
        s_offs = slot[:, None] * ss_s + head * ss_h + (2 * gidx)[None, :] * ss_k
        tl.store(sz_ptr + s_offs, scale, mask=active[:, None])
        tl.store(sz_ptr + s_offs + ss_k, zero, mask=active[:, None])


def _int2_dequant_kernel(
    codes_ptr,
    sz_ptr,
    out_ptr,
    n_rows,
    num_tiles,
    sc_r,
    sc_q,
    ss_r,
    ss_k,
    so_r,
    so_d,
    D: tl.constexpr,
    Q: tl.constexpr,
    NG: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """``out[r, dim] = (code(r, dim) - zero[r, dim // G]) * scale[r, dim // G]`` for ``BT``-row tiles.

    Grid ``(P,)``, persistent over tiles. Codes are unpacked from the quarter-interleaved bytes
    (byte ``j`` bits ``2a..2a+1`` is dim ``a*Q + j``); scale/zero are read as fp32 from the
    interleaved ``[s0, z0, s1, z1, ...]`` row; the fp32 result is rounded once to the output dtype.
    """
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    dims = tl.arange(0, D)
    qidx = tl.arange(0, Q)
    gidx = tl.arange(0, NG)
    shifts = tl.arange(0, 4) * 2
    for tile in range(pid, num_tiles, nprog):
        rows = tile * BT + tl.arange(0, BT)
        m = rows < n_rows
        r64 = rows.to(tl.int64)
        packed = tl.load(codes_ptr + r64[:, None] * sc_r + qidx[None, :] * sc_q, mask=m[:, None], other=0)
        q = (packed.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & 3
        qf = tl.reshape(q, (BT, NG, G)).to(tl.float32)
        s_offs = r64[:, None] * ss_r + (2 * gidx)[None, :] * ss_k
        s = tl.load(sz_ptr + s_offs, mask=m[:, None], other=0.0).to(tl.float32)
        z = tl.load(sz_ptr + s_offs + ss_k, mask=m[:, None], other=0.0).to(tl.float32)
        out = tl.reshape((qf - z[:, :, None]) * s[:, :, None], (BT, D))
        if OUT_BF16:
            ob = out.to(tl.int32, bitcast=True)
            ob = (ob + 0x7FFF + ((ob >> 16) & 1)) & -65536
            out = tl.where(out != out, out, ob.to(tl.float32, bitcast=True))
        tl.store(out_ptr + r64[:, None] * so_r + dims[None, :] * so_d, out, mask=m[:, None])


# --- build (per Triton mode) --------------------------------------------------------------------


def _copies(namespace: dict, wrap, aot: bool = False) -> types.SimpleNamespace:
    return kernel_copies(namespace, wrap, {"quant": _int2_quant_kernel, "dequant": _int2_dequant_kernel},
                         combine=("_MAX_FN", "_MIN_FN", "_SUM_FN"), aot=aot)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> types.SimpleNamespace:
    del interpret  # the cache key; triton.jit reads the same setting
    return _copies(dict(globals()), triton.jit)


@functools.lru_cache(maxsize=1)
def aot_kernels() -> types.SimpleNamespace:
    """Compiled-mode (``JITFunction``) copies of both kernels, for ahead-of-time compilation.

    Built whatever ``TRITON_INTERPRET`` says, so ``triton.compile`` works on a CPU-only machine even
    in a process that runs the interpreter: Triton's combine functions, which are interpreted
    objects when triton was imported under ``TRITON_INTERPRET=1``, are re-jitted for the copies.
    Never launch these; use :func:`quantize_triton` / :func:`dequantize_triton`.
    """
    from triton.runtime.jit import JITFunction

    return _copies(dict(globals()), JITFunction, aot=True)


def quantize_triton(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    loc: torch.Tensor | None,
    codes_out: torch.Tensor,
    sz_out: torch.Tensor,
    *,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    clip_search: str = "exact",
    block_rows: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    num_stages: int | None = None,
) -> None:
    """Launch the fused quantize kernel.

    Args:
        x: ``[N, H, d]`` bf16/fp16/fp32 rows (any strides).
        rotation: ``None``, ``[d, d]`` shared or ``[H, d, d]`` per head (any float dtype; rounded to bf16).
        loc: ``None`` (row ``t`` goes to slot ``t``) or ``[N]`` int32/int64 slots.
        codes_out: ``[S, H, d/4]`` uint8.
        sz_out: ``[S, H, 2 * d / group_size]`` fp32/bf16/fp16.
        clip_index: from :func:`layout.clip_index` (``-1``: off).
        group_size: contiguous dims per scale/zero pair (``d`` when ``lloyd_max``).
        lloyd_max: approximate Lloyd-Max levels.
        clip_search: ``"exact"`` or ``"bisect"`` (the decode flush's threshold search).
        block_rows, num_warps, programs, num_stages: launch overrides (benchmark sweeps); default
            heuristics from :mod:`rotationzoo.kernels.layout`.
    """
    if x.shape[0] == 0:
        return
    interpret = interpret_mode()
    launch = quant_launch(
        x, rotation, loc, codes_out, sz_out, clip_index=clip_index, group_size=group_size, lloyd_max=lloyd_max,
        clip_search=clip_search, block_rows=block_rows, num_warps=num_warps, programs=programs, num_stages=num_stages, interpret=interpret,
    )  # fmt: skip
    _kernels(interpret).quant[launch.grid](*launch.args, **launch.kwargs)


def dequantize_triton(
    codes: torch.Tensor,
    sz: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int,
    block_rows: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
) -> None:
    """Launch the dequantize kernel on ``codes [N, d/4]``, ``sz [N, 2*groups]`` into ``out [N, d]``."""
    if codes.shape[0] == 0:
        return
    interpret = interpret_mode()
    launch = dequant_launch(
        codes, sz, out, group_size=group_size, block_rows=block_rows, num_warps=num_warps, programs=programs,
        interpret=interpret,
    )  # fmt: skip
    _kernels(interpret).dequant[launch.grid](*launch.args, **launch.kwargs)
