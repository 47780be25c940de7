"""Tile operations of the INT2 decode kernels (:mod:`~rotationzoo.kernels.triton_decode`): ``@triton.jit``
helpers for one quarter of the head dims (query rows, key scores and value sums on the codes, window rows,
the normalised store), the domain check of an INT2 row's scale/zero, and the tensor-core products.

The kernels re-create these in their own namespace for each Triton mode (compiled, interpreted, ahead of
time), so the names they use (``tl``, ``_MAX_FN``, ``_SUM_FN``) must also be defined in
:mod:`~rotationzoo.kernels.triton_decode`.
"""

import triton
import triton.language as tl

_MAX_FN = tl.standard._elementwise_max
_SUM_FN = tl.standard._sum_combine


@triton.jit
def _query_quarter(q_ptr, q_base, row_ok, rk_rows, qk_scale, A: tl.constexpr, Q: tl.constexpr, G: tl.constexpr,
                   NQ: tl.constexpr):
    """Columns ``A·Q …`` of the scaled query rows, row ``(r, k)`` masked to the quarter's ``k``-th group:
    ``[MP·NQ, Q]``."""
    qr = tl.load(q_ptr + q_base[:, None] + (A * Q + tl.arange(0, Q))[None, :], mask=row_ok[:, None], other=0.0)
    if NQ > 1:
        qr = tl.where((tl.arange(0, Q)[None, :] // G) == (rk_rows % NQ)[:, None], qr, 0.0)
    return qr * qk_scale


@triton.jit
def _k_quarter(qk, qsum, kb, sz_rows, tm, A: tl.constexpr, Q: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr,
               MP: tl.constexpr, BN: tl.constexpr, SPLIT_DOT: tl.constexpr):
    """Quarter ``A``'s share of the scores ``Σ_g s_g (q_g·c_g − z_g Σ q_g)`` over its groups: ``[MP, BN]``
    (``qk``: the query rows divided by ``F(A)`` of :func:`_code_quarter`, ``qsum`` their plain sums)."""
    raw = _dot_fc(qk, tl.trans(_code_quarter(kb, A, SPLIT_DOT)), SPLIT_DOT, tl.full([MP * NQ, BN], 0.0, tl.float32))
    g = (A * Q) // G + tl.arange(0, NQ)
    s = tl.load(sz_rows + (2 * g)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)  # [NQ, BN]
    z = tl.load(sz_rows + (2 * g + 1)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)
    out = tl.reduce(tl.reshape(raw, (MP, NQ, BN)) * s[None, :, :], 1, _SUM_FN)
    return out - tl.reduce(qsum[:, :, None] * (s * z)[None, :, :], 1, _SUM_FN), tl.reduce(_outside(s, z), 0, _MAX_FN)


@triton.jit
def _v_quarter(acc, zacc, p, alpha, vb, sz_rows, tm, A: tl.constexpr, Q: tl.constexpr, G: tl.constexpr,
               NQ: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, SPLIT_DOT: tl.constexpr):
    """Fold a tile into quarter ``A``'s output: ``acc`` rows ``(r, k)`` gain ``Σ (p s_k) F(A) c`` (divided by
    ``F(A)`` at the store), ``zacc`` ``Σ p s_k z_k`` (group ``k`` of the quarter)."""
    g = (A * Q) // G + tl.arange(0, NQ)
    s = tl.load(sz_rows + (2 * g)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)
    z = tl.load(sz_rows + (2 * g + 1)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)
    w3 = p[:, None, :] * s[None, :, :]  # [MP, NQ, BN]
    alpha_r = tl.reshape(tl.broadcast_to(alpha[:, None], (MP, NQ)), (MP * NQ,))
    acc = _dot_fc(tl.reshape(w3, (MP * NQ, BN)), _code_quarter(vb, A, SPLIT_DOT), SPLIT_DOT, acc * alpha_r[:, None])
    zacc = zacc * alpha[:, None] + tl.reduce(w3 * z[None, :, :], 2, _SUM_FN)
    return acc, zacc


@triton.jit
def _outside(s, z):
    """1.0 where a group's ``|s|·max(|z|, |3 − z|)`` is not ``≤ 2^64`` (decode_reference.MAX_DEQUANT), else 0.0."""
    return tl.where(tl.abs(s) * tl.maximum(tl.abs(z), tl.abs(3.0 - z)) <= 18446744073709551616.0, 0.0, 1.0)


@triton.jit
def _tile_outside(sz_rows, tm, NG: tl.constexpr):
    """Whether any token of the tile has a group outside the domain (a scalar, 1.0 or 0.0)."""
    g = tl.arange(0, NG)
    s = tl.load(sz_rows + (2 * g)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)
    z = tl.load(sz_rows + (2 * g + 1)[:, None], mask=tm[None, :], other=0.0).to(tl.float32)
    return tl.reduce(tl.reduce(_outside(s, z), 1, _MAX_FN), 0, _MAX_FN)  # the module's combiner: AOT-safe


@triton.jit
def _code_quarter(bytes16, A: tl.constexpr, SPLIT_DOT: tl.constexpr):
    """Quarter ``A`` of ``[BN, Q]`` int16 code bytes (bits ``2A, 2A+1``) times ``F(A)`` = 1, 4, 16, 1: bf16
    compiled, fp32 interpreted. The caller divides its query rows or weights by ``F(A)`` (exact).

    The bits are masked in place (``bytes & (3 << 2A)`` is ``c·4^A``; only the top quarter is shifted
    down, ``bytes >> 6``, no mask), and the bits ``0x4300 | x`` are the bf16 number ``128 + x`` (exponent
    7, ``x < 128`` in the mantissa); subtracting 128 (exact) leaves ``x``: two integer operations and a
    subtraction per code instead of an integer-to-float conversion.
    """
    if A == 3:
        bits = bytes16 >> 6
    else:
        bits = bytes16 & (3 << (2 * A))
    c = (bits | 0x4300).to(tl.bfloat16, bitcast=True)
    if SPLIT_DOT:
        out = c - 128.0
    else:  # the interpreter has no bf16 arithmetic
        out = c.to(tl.float32) - 128.0
    return out


@triton.jit
def _window_quarter(sink_rows, recent_rows, in_sink, in_rec, jq, A: tl.constexpr, Q: tl.constexpr):
    """Columns ``A·Q …`` of a window tile: rows from the sink or the recent tokens (window dtype)."""
    cols = A * Q + jq
    return (tl.load(sink_rows + cols[None, :], mask=in_sink[:, None], other=0.0)
            + tl.load(recent_rows + cols[None, :], mask=in_rec[:, None], other=0.0))


@triton.jit
def _store_quarter(o_rows, acc, zacc, inv, keep, jq, unscale, A: tl.constexpr, Q: tl.constexpr, G: tl.constexpr,
                   NQ: tl.constexpr, MP: tl.constexpr):
    """Columns ``A·Q …`` of the normalised partial output: column ``j`` from row ``(r, k(j))`` of ``acc``
    times ``unscale`` (``1 / F(A)`` for INT2 tokens, 1 for window tokens) minus ``zacc[r, k(j)]``
    (``k(j)``: the quarter's group of column ``j``)."""
    acc = acc * unscale
    if NQ > 1:  # selected, not multiplied by a one-hot: 0 times an inf window value would be NaN
        onehot = (jq[None, :] // G) == tl.arange(0, NQ)[:, None]  # [NQ, Q]
        out = tl.reduce(tl.where(onehot[None, :, :], tl.reshape(acc, (MP, NQ, Q)), 0.0), 1, _SUM_FN)
        out = out - tl.reduce(tl.where(onehot[None, :, :], zacc[:, :, None], 0.0), 1, _SUM_FN)
    else:
        out = acc - zacc
    tl.store(o_rows + (A * Q + jq)[None, :], out * inv[:, None], mask=keep[:, None])


@triton.jit
def _first_of_groups(raw, MP: tl.constexpr, NQ: tl.constexpr, N: tl.constexpr):
    """Row ``(r, 0)`` of each ``NQ``-row group of ``raw [MP·NQ, N]``: ``[MP, N]`` (selected, so an inf or
    NaN in the other rows does not reach it)."""
    if NQ > 1:
        first = (tl.arange(0, NQ) == 0)[None, :, None]
        out = tl.reduce(tl.where(first, tl.reshape(raw, (MP, NQ, N)), 0.0), 1, _SUM_FN)
    else:
        out = raw
    return out


@triton.jit
def _dot_ff(a, b, SPLIT_DOT: tl.constexpr):
    """fp32 × fp32 → fp32: three bf16 products (hi·hi + hi·lo + lo·hi) compiled, one fp32 product
    interpreted. (Each helper has one ``return``: Triton compiles the code after a constexpr branch
    that returns, too.)"""
    if SPLIT_DOT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(a_hi, b_hi, out_dtype=tl.float32)
        out = tl.dot(a_hi, b_lo, out, out_dtype=tl.float32)
        out = tl.dot(a_lo, b_hi, out, out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    return out


@triton.jit
def _dot_fc(a, c, SPLIT_DOT: tl.constexpr, acc):
    """``acc + a @ c`` for fp32 ``a`` and codes ``c`` (exact in bf16): two bf16 products compiled
    (``a`` split into high and low parts), one fp32 product interpreted."""
    if SPLIT_DOT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        out = tl.dot(a_lo, c, tl.dot(a_hi, c, acc, out_dtype=tl.float32), out_dtype=tl.float32)
    else:
        out = tl.dot(a, c, acc, input_precision="ieee", out_dtype=tl.float32)
    return out


@triton.jit
def _dot_fw(a, w, SPLIT_DOT: tl.constexpr, HP_KIND: tl.constexpr):
    """fp32 × window rows (stored bf16 / fp16 / fp32) → fp32: the window dtype is exact in its own
    16-bit type, so two products of ``a`` split in that type; fp32 windows take the fp32 product. The low
    part meets the window with its infinities replaced by 0: an exact ``a`` has a low part of 0, and
    ``0 · inf`` would make NaN of what the high part's product gives (``a · inf``, as the reference)."""
    if SPLIT_DOT and HP_KIND == 0:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        wb = w.to(tl.bfloat16)
        w_fin = tl.where(tl.abs(wb) == float("inf"), 0.0, wb).to(tl.bfloat16)
        out = tl.dot(a_lo, w_fin, tl.dot(a_hi, wb, out_dtype=tl.float32), out_dtype=tl.float32)
    elif SPLIT_DOT and HP_KIND == 1:
        a_hi = a.to(tl.float16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.float16)
        wh = w.to(tl.float16)
        w_fin = tl.where(tl.abs(wh) == float("inf"), 0.0, wh).to(tl.float16)
        out = tl.dot(a_lo, w_fin, tl.dot(a_hi, wh, out_dtype=tl.float32), out_dtype=tl.float32)
    else:
        out = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)
    return out
