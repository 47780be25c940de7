"""Triton decode attention over the INT2 cache layout: split-K (flash-decoding) and a log-sum-exp merge.

Imported only when the triton backend runs :func:`rotationzoo.kernels.decode_attention_int2`. Two
launches per call:

1. ``_decode_split_kernel``, grid ``(int2 splits + window splits, B · H_kv)``: program ``(p, bh)``
   reads the ``g · S`` query rows of KV head ``bh`` (rotated before the launch by one fp32 product,
   ``q @ R``: held in the kernel, the rotation cost registers enough to spill), then attends either to one range of INT2 tokens (whole tiles, scores and outputs computed on the
   codes: ``s·(q·c − z·Σq)`` and ``Σ p s c − Σ p s z`` per group) or to one tile of window tokens
   (sink, then recent), with an fp32 online softmax in base 2; it writes the normalised partial
   output and its log-sum-exp.
2. ``_decode_merge_kernel``, grid ``(B · H_kv,)``: merges the partials by their log-sum-exp, applies
   the output matrix (``R_Vᵀ`` or ``o_rotation``, in column blocks) and writes ``[B, Hq, S, d]``.

Groups smaller than ``d`` use block-diagonal query rows: row ``(r, g)`` holds query ``r`` masked to
the dims of group ``g``, so one ``tl.dot`` gives every group's partial product. Window tokens take
whole query rows instead, and the group rows' outputs are picked by selection, not by a product with 0:
a window row holding ±inf then gives what the reference gives (a masked row's 0 times inf would be NaN).
Compiled, products run on tensor cores with fp32 operands split into a bf16 (or fp16) high and low part
(codes 0..3 and bf16 window rows are exact; a window's infinities meet only the high part);
interpreted, they are plain fp32 products. Kernels are built on first use for the current Triton mode;
their tile helpers live in :mod:`~rotationzoo.kernels.triton_decode_tiles`.
"""

import functools
import types

import torch
import triton
import triton.language as tl

from . import decode_plan
from .decode_reference import rotate_queries
from .triton_decode_tiles import (  # noqa: F401  (the kernels' helpers: re-created with them per mode)
    _code_quarter,
    _dot_fc,
    _dot_ff,
    _dot_fw,
    _first_of_groups,
    _k_quarter,
    _outside,
    _query_quarter,
    _store_quarter,
    _tile_outside,
    _v_quarter,
    _window_quarter,
)
from .triton_launch import Launch, _num_sms, interpret_mode, kernel_copies

__all__ = ["Launch", "decode_aot_kernels", "decode_attention_triton", "decode_launch", "merge_launch"]

_MAX_FN = tl.standard._elementwise_max
_SUM_FN = tl.standard._sum_combine

_HP_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""``HP_KIND`` constexpr of each window dtype (how window rows enter ``tl.dot`` when compiled)."""
ROT_BLOCK = 32
"""Columns of the rotation per step (a ``[32, d]`` fp32 block stays in registers)."""


def _decode_split_kernel(
    q_ptr,
    ks_ptr, kc_ptr, kz_ptr, kr_ptr,
    vs_ptr, vc_ptr, vz_ptr, vr_ptr,
    po_ptr, pl_ptr, mk_ptr,
    n_sink, n_int2, n_recent, n_int2_splits, split_tokens, n_kv_heads, n_splits, qk_scale, total,
    smk_b, smk_h, smk_s, smk_l,
    sq_b, sq_h, sq_r,
    sks_b, sks_h, sks_t, skc_b, skc_h, skc_t, skz_b, skz_h, skz_t, skr_b, skr_h, skr_t,
    svs_b, svs_h, svs_t, svc_b, svc_h, svc_t, svz_b, svz_h, svz_t, svr_b, svr_h, svr_t,
    GQ: tl.constexpr, S: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    D: tl.constexpr, Q: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr,
    BN: tl.constexpr, HPT: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HP_KIND: tl.constexpr, SPLIT_DOT: tl.constexpr,
):
    """Partial attention of one split (see the module docstring); partials ``[B·H_kv, n_splits, M, D]``.

    Everything is done per quarter of the head dims: bits ``2a, 2a+1`` of the code bytes are the
    dims ``a·Q … a·Q + Q − 1``, so quarter ``a`` of a tile is ``(bytes >> 2a) & 3`` with no reshuffle.
    A quarter holds ``NQ = max(1, Q / G)`` groups; with ``NQ > 1`` its query rows are block-diagonal
    (row ``(r, k)``: query ``r`` masked to the quarter's ``k``-th group).
    """
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = tl.program_id(2) * MP  # this program's block of query rows
    b = bh // n_kv_heads
    hk = bh % n_kv_heads
    jq = tl.arange(0, Q)
    NQK: tl.constexpr = Q // GK if GK < Q else 1
    NQV: tl.constexpr = Q // GV if GV < Q else 1
    RK: tl.constexpr = MP * NQK
    RV: tl.constexpr = MP * NQV

    # the rotated query rows (fp32 [B, H_kv, M, D], row r = i*S + s: head i of the group, token s),
    # scaled (base 2), per quarter: [RK, Q], row (r, k) masked to group k of the quarter
    rk_rows = tl.arange(0, RK)
    r_of = row0 + rk_rows // NQK
    q_base = b.to(tl.int64) * sq_b + hk.to(tl.int64) * sq_h + r_of.to(tl.int64) * sq_r
    qk0 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 0, Q, GK, NQK)
    qk1 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 1, Q, GK, NQK)
    qk2 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 2, Q, GK, NQK)
    qk3 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 3, Q, GK, NQK)
    qs0 = tl.reshape(tl.reduce(qk0, 1, _SUM_FN), (MP, NQK))  # Σ q over each group of the quarter
    qs1 = tl.reshape(tl.reduce(qk1, 1, _SUM_FN), (MP, NQK))
    qs2 = tl.reshape(tl.reduce(qk2, 1, _SUM_FN), (MP, NQK))
    qs3 = tl.reshape(tl.reduce(qk3, 1, _SUM_FN), (MP, NQK))
    rows = row0 + tl.arange(0, MP)
    limit = total - S + rows % S  # last key position each query row sees (causal)
    # the mask row of each query row (query head hk·GQ + r // S, token r % S); rows past M read nothing
    mk_rows = (mk_ptr + b.to(tl.int64) * smk_b + (hk * GQ + rows // S).to(tl.int64) * smk_h
               + (rows % S).to(tl.int64) * smk_s)

    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.full([MP], 0.0, tl.float32)
    acc0 = tl.full([RV, Q], 0.0, tl.float32)
    acc1 = tl.full([RV, Q], 0.0, tl.float32)
    acc2 = tl.full([RV, Q], 0.0, tl.float32)
    acc3 = tl.full([RV, Q], 0.0, tl.float32)
    zacc0 = tl.full([MP, NQV], 0.0, tl.float32)
    zacc1 = tl.full([MP, NQV], 0.0, tl.float32)
    zacc2 = tl.full([MP, NQV], 0.0, tl.float32)
    zacc3 = tl.full([MP, NQV], 0.0, tl.float32)
    if pid < n_int2_splits:
        start = pid * split_tokens
        end = tl.minimum(start + split_tokens, n_int2)
        qk1u = qk1 * 0.25  # quarters 1 and 2 are read as 4c and 16c (_code_quarter)
        qk2u = qk2 * 0.0625
        kc_base = b.to(tl.int64) * skc_b + hk.to(tl.int64) * skc_h
        kz_base = b.to(tl.int64) * skz_b + hk.to(tl.int64) * skz_h
        vc_base = b.to(tl.int64) * svc_b + hk.to(tl.int64) * svc_h
        vz_base = b.to(tl.int64) * svz_b + hk.to(tl.int64) * svz_h
        for t0 in range(start, end, BN):
            t = t0 + tl.arange(0, BN)
            tm = t < end
            t64 = t.to(tl.int64)
            kb = tl.load(kc_ptr + kc_base + t64[:, None] * skc_t + jq[None, :], mask=tm[:, None], other=0).to(tl.int16)
            kz_rows = kz_ptr + kz_base + t64[None, :] * skz_t
            if GK == D:  # one (scale, zero) per row: s·(q·c − z·Σq) with q·c summed over the quarters
                raw = _dot_fc(qk0, tl.trans(_code_quarter(kb, 0, SPLIT_DOT)), SPLIT_DOT, tl.full([RK, BN], 0.0, tl.float32))
                raw = _dot_fc(qk1u, tl.trans(_code_quarter(kb, 1, SPLIT_DOT)), SPLIT_DOT, raw)
                raw = _dot_fc(qk2u, tl.trans(_code_quarter(kb, 2, SPLIT_DOT)), SPLIT_DOT, raw)
                raw = _dot_fc(qk3, tl.trans(_code_quarter(kb, 3, SPLIT_DOT)), SPLIT_DOT, raw)
                ks = tl.load(kz_rows, mask=tm[None, :], other=0.0).to(tl.float32)  # [1, BN]
                kz = tl.load(kz_rows + 1, mask=tm[None, :], other=0.0).to(tl.float32)
                scores = (raw - (qs0 + qs1 + qs2 + qs3) * kz) * ks
                kbad = _outside(ks, kz)
            else:  # each quarter also says which tokens hold a group outside the domain
                scores, kbad = _k_quarter(qk0, qs0, kb, kz_rows, tm, 0, Q, GK, NQK, MP, BN, SPLIT_DOT)
                part, bad = _k_quarter(qk1u, qs1, kb, kz_rows, tm, 1, Q, GK, NQK, MP, BN, SPLIT_DOT)
                scores, kbad = scores + part, tl.maximum(kbad, bad)
                part, bad = _k_quarter(qk2u, qs2, kb, kz_rows, tm, 2, Q, GK, NQK, MP, BN, SPLIT_DOT)
                scores, kbad = scores + part, tl.maximum(kbad, bad)
                part, bad = _k_quarter(qk3, qs3, kb, kz_rows, tm, 3, Q, GK, NQK, MP, BN, SPLIT_DOT)
                scores, kbad = scores + part, tl.maximum(kbad, bad)
            scores = tl.where(kbad > 0, float("nan"), scores)  # a key row outside the domain: NaN where it is seen
            ok = tm[None, :]
            if CAUSAL:
                ok = ok & ((n_sink + t)[None, :] <= limit[:, None])
            if HAS_MASK:
                ok = ok & (tl.load(mk_rows[:, None] + (n_sink + t64)[None, :] * smk_l, mask=ok & (rows < M)[:, None],
                                   other=0) != 0)
            scores = tl.where(ok, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX_FN))
            m_fin = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_fin)
            p = tl.exp2(scores - m_fin[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM_FN)
            m_i = m_new
            vb = tl.load(vc_ptr + vc_base + t64[:, None] * svc_t + jq[None, :], mask=tm[:, None], other=0).to(tl.int16)
            vz_rows = vz_ptr + vz_base + t64[None, :] * svz_t
            if GV == D:  # Σ (p·s) c − Σ p·s·z, the same weights for every quarter
                vs = tl.load(vz_rows, mask=tm[None, :], other=0.0).to(tl.float32)
                vz = tl.load(vz_rows + 1, mask=tm[None, :], other=0.0).to(tl.float32)
                p = tl.where(tl.reduce(_outside(vs, vz), 1, _MAX_FN)[:, None] > 0, float("nan"), p)
                w = p * vs
                wz = tl.reduce(w * vz, 1, _SUM_FN)
                acc0 = _dot_fc(w, _code_quarter(vb, 0, SPLIT_DOT), SPLIT_DOT, acc0 * alpha[:, None])
                acc1 = _dot_fc(w, _code_quarter(vb, 1, SPLIT_DOT), SPLIT_DOT, acc1 * alpha[:, None])
                acc2 = _dot_fc(w, _code_quarter(vb, 2, SPLIT_DOT), SPLIT_DOT, acc2 * alpha[:, None])
                acc3 = _dot_fc(w, _code_quarter(vb, 3, SPLIT_DOT), SPLIT_DOT, acc3 * alpha[:, None])
                zacc0 = zacc0 * alpha[:, None] + wz[:, None]
            else:  # a value row outside the domain: every query row of the KV head NaN
                p = tl.where(_tile_outside(vz_rows, tm, D // GV) > 0, float("nan"), p)
                acc0, zacc0 = _v_quarter(acc0, zacc0, p, alpha, vb, vz_rows, tm, 0, Q, GV, NQV, MP, BN, SPLIT_DOT)
                acc1, zacc1 = _v_quarter(acc1, zacc1, p, alpha, vb, vz_rows, tm, 1, Q, GV, NQV, MP, BN, SPLIT_DOT)
                acc2, zacc2 = _v_quarter(acc2, zacc2, p, alpha, vb, vz_rows, tm, 2, Q, GV, NQV, MP, BN, SPLIT_DOT)
                acc3, zacc3 = _v_quarter(acc3, zacc3, p, alpha, vb, vz_rows, tm, 3, Q, GV, NQV, MP, BN, SPLIT_DOT)
        if GV == D:
            zacc1 = zacc0
            zacc2 = zacc0
            zacc3 = zacc0
    else:
        u = (pid - n_int2_splits) * HPT + tl.arange(0, HPT)
        in_sink = u < n_sink
        in_rec = (u >= n_sink) & (u < n_sink + n_recent)
        k_sink = ks_ptr + b.to(tl.int64) * sks_b + hk.to(tl.int64) * sks_h + u.to(tl.int64)[:, None] * sks_t
        k_rec = kr_ptr + b.to(tl.int64) * skr_b + hk.to(tl.int64) * skr_h + (u - n_sink).to(tl.int64)[:, None] * skr_t
        if NQK > 1:  # whole query rows: a block-diagonal row's 0 times an inf window entry would be NaN
            wq0 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 0, Q, GK, 1)
            wq1 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 1, Q, GK, 1)
            wq2 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 2, Q, GK, 1)
            wq3 = _query_quarter(q_ptr, q_base, r_of < M, rk_rows, qk_scale, 3, Q, GK, 1)
        else:
            wq0, wq1, wq2, wq3 = qk0, qk1, qk2, qk3
        raw = _dot_fw(wq0, tl.trans(_window_quarter(k_sink, k_rec, in_sink, in_rec, jq, 0, Q)), SPLIT_DOT, HP_KIND)
        raw += _dot_fw(wq1, tl.trans(_window_quarter(k_sink, k_rec, in_sink, in_rec, jq, 1, Q)), SPLIT_DOT, HP_KIND)
        raw += _dot_fw(wq2, tl.trans(_window_quarter(k_sink, k_rec, in_sink, in_rec, jq, 2, Q)), SPLIT_DOT, HP_KIND)
        raw += _dot_fw(wq3, tl.trans(_window_quarter(k_sink, k_rec, in_sink, in_rec, jq, 3, Q)), SPLIT_DOT, HP_KIND)
        scores = _first_of_groups(raw, MP, NQK, HPT)  # the NQK copies of each row are equal: take one
        pos = tl.where(in_sink, u, u + n_int2)
        ok = (in_sink | in_rec)[None, :]
        if CAUSAL:
            ok = ok & (pos[None, :] <= limit[:, None])
        if HAS_MASK:
            ok = ok & (tl.load(mk_rows[:, None] + pos.to(tl.int64)[None, :] * smk_l, mask=ok & (rows < M)[:, None],
                               other=0) != 0)
        scores = tl.where(ok, scores, float("-inf"))
        m_i = tl.reduce(scores, 1, _MAX_FN)
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(scores - m_fin[:, None])
        l_i = tl.reduce(p, 1, _SUM_FN)
        w = tl.reshape(tl.broadcast_to(p[:, None, :], (MP, NQV, HPT)), (RV, HPT))
        v_sink = vs_ptr + b.to(tl.int64) * svs_b + hk.to(tl.int64) * svs_h + u.to(tl.int64)[:, None] * svs_t
        v_rec = vr_ptr + b.to(tl.int64) * svr_b + hk.to(tl.int64) * svr_h + (u - n_sink).to(tl.int64)[:, None] * svr_t
        acc0 = _dot_fw(w, _window_quarter(v_sink, v_rec, in_sink, in_rec, jq, 0, Q), SPLIT_DOT, HP_KIND)
        acc1 = _dot_fw(w, _window_quarter(v_sink, v_rec, in_sink, in_rec, jq, 1, Q), SPLIT_DOT, HP_KIND)
        acc2 = _dot_fw(w, _window_quarter(v_sink, v_rec, in_sink, in_rec, jq, 2, Q), SPLIT_DOT, HP_KIND)
        acc3 = _dot_fw(w, _window_quarter(v_sink, v_rec, in_sink, in_rec, jq, 3, Q), SPLIT_DOT, HP_KIND)

    seen = l_i != 0.0  # NaN (a score past fp32, +inf) stays NaN through the merge, as in the reference
    inv = 1.0 / tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    slot = (bh.to(tl.int64) * n_splits + pid) * M
    keep = rows < M
    o_rows = po_ptr + (slot + rows)[:, None] * D
    int2 = pid < n_int2_splits  # INT2 quarters 1 and 2 accumulated 4c and 16c (_code_quarter)
    _store_quarter(o_rows, acc0, zacc0, inv, keep, jq, 1.0, 0, Q, GV, NQV, MP)
    _store_quarter(o_rows, acc1, zacc1, inv, keep, jq, tl.where(int2, 0.25, 1.0), 1, Q, GV, NQV, MP)
    _store_quarter(o_rows, acc2, zacc2, inv, keep, jq, tl.where(int2, 0.0625, 1.0), 2, Q, GV, NQV, MP)
    _store_quarter(o_rows, acc3, zacc3, inv, keep, jq, 1.0, 3, Q, GV, NQV, MP)
    tl.store(pl_ptr + slot + rows, lse, mask=keep)


def _decode_merge_kernel(
    po_ptr, pl_ptr, ro_ptr, out_ptr,
    n_splits, n_kv_heads, so_b, so_h, so_s, sr_h, sr_i,
    GQ: tl.constexpr, S: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    ROTATE_O: tl.constexpr, SPLIT_DOT: tl.constexpr,
):
    """Merge the partials of one (sequence, KV head) by log-sum-exp, then ``o @ R_out``; writes ``[B, Hq, S, D]``."""
    bh = tl.program_id(0)
    b = bh // n_kv_heads
    hk = bh % n_kv_heads
    rows = tl.arange(0, MP)
    keep = rows < M
    dims = tl.arange(0, D)
    kk = tl.arange(0, BK)
    base = bh.to(tl.int64) * n_splits * M
    m_i = tl.full([MP], float("-inf"), tl.float32)
    for sp in range(n_splits):
        m_i = tl.maximum(m_i, tl.load(pl_ptr + base + sp * M + rows, mask=keep, other=float("-inf")))
    m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
    l_i = tl.full([MP], 0.0, tl.float32)
    for sp in range(n_splits):
        l_i += tl.exp2(tl.load(pl_ptr + base + sp * M + rows, mask=keep, other=float("-inf")) - m_fin)
    inv = tl.where(keep & (l_i != 0.0), 1.0 / tl.where(l_i != 0.0, l_i, 1.0), 0.0)  # no visible key: 0
    o_base = b.to(tl.int64) * so_b + (hk * GQ + rows // S).to(tl.int64) * so_h + (rows % S) * so_s
    res = tl.full([MP, D], 0.0, tl.float32)
    for kb in tl.static_range(D // BK):
        ob = tl.full([MP, BK], 0.0, tl.float32)
        for sp in range(n_splits):
            wgt = tl.exp2(tl.load(pl_ptr + base + sp * M + rows, mask=keep, other=float("-inf")) - m_fin) * inv
            part = tl.load(po_ptr + (base + sp * M + rows)[:, None] * D + (kb * BK + kk)[None, :], mask=keep[:, None],
                           other=0.0)
            ob += wgt[:, None] * part
        ob = tl.where((l_i == 0.0)[:, None], 0.0, ob)  # a row that sees no key: 0, even beside a NaN partial
        if ROTATE_O:
            rb = tl.load(ro_ptr + hk.to(tl.int64) * sr_h + (kb * BK + kk)[:, None] * sr_i + dims[None, :])
            res += _dot_ff(ob, rb.to(tl.float32), SPLIT_DOT)
        else:
            tl.store(out_ptr + o_base[:, None] + (kb * BK + kk)[None, :], ob.to(out_ptr.dtype.element_ty),
                     mask=keep[:, None])
    if ROTATE_O:
        tl.store(out_ptr + o_base[:, None] + dims[None, :], res.to(out_ptr.dtype.element_ty), mask=keep[:, None])


# --- build (per Triton mode) --------------------------------------------------------------------

_HELPERS = ("_query_quarter", "_k_quarter", "_v_quarter", "_outside", "_tile_outside", "_code_quarter",
            "_window_quarter", "_store_quarter", "_first_of_groups", "_dot_ff", "_dot_fc", "_dot_fw")


def _copies(namespace: dict, wrap, aot: bool = False) -> types.SimpleNamespace:
    return kernel_copies(namespace, wrap, {"split": _decode_split_kernel, "merge": _decode_merge_kernel},
                         helpers=_HELPERS, combine=("_MAX_FN", "_SUM_FN"), aot=aot)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> types.SimpleNamespace:
    del interpret  # the cache key; triton.jit reads the same setting
    return _copies(dict(globals()), triton.jit)


@functools.lru_cache(maxsize=1)
def decode_aot_kernels() -> types.SimpleNamespace:
    """Compiled-mode (``JITFunction``) copies of both decode kernels for ahead-of-time compilation
    (works in a process that runs the interpreter; never launch these)."""
    from triton.runtime.jit import JITFunction

    return _copies(dict(globals()), JITFunction, aot=True)


def _quarter_groups(d: int, gk: int, gv: int) -> int:
    """The most groups of keys or values in a quarter of the dims (the tile size depends on it)."""
    return max(1, (d // 4) // min(gk, gv))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (a copy only when it has not)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _window_dtype(keys, values) -> torch.dtype:
    """The dtype of the non-empty window parts (validation gives them one), ``keys.sink``'s when all are
    empty: an empty part's dtype says nothing about the rows the kernel reads."""
    parts = (keys[0], keys[3], values[0], values[3])
    return next((t.dtype for t in parts if t.shape[2]), keys[0].dtype)


def decode_launch(query, q_rows, keys, values, po, pl, *, scale: float, causal: bool, splits: tuple[int, int],
                  windows: int, mask=None, interpret: bool | None = None, block_tokens: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> Launch:
    """The split kernel's launch for validated inputs, without running it: ``query [B, Hq, S, d]`` (for
    its shape), ``q_rows`` its rotated rows ``[B, H_kv, g·S, d]`` fp32 (unit last stride),
    ``keys``/``values`` as ``(sink, codes, sz, recent)`` with unit last strides, ``splits`` =
    ``(int2 splits, tokens per split)``, ``windows`` the window programs, ``po``/``pl`` the partial
    buffers, ``mask`` ``None`` or booleans ``[B|1, Hq|1, S, L]``."""
    b, hq, s, d = query.shape
    k_sink, k_codes, k_sz, k_recent = keys
    v_sink, v_codes, v_sz, v_recent = values
    h = k_sink.shape[1]
    interpret = interpret_mode() if interpret is None else interpret
    gk = d // max(1, k_sz.shape[-1] // 2)
    gv = d // max(1, v_sz.shape[-1] // 2)
    rows = (hq // h) * s
    mp = decode_plan.row_block(rows, max(1, d // 4 // max(gk, gv)))
    n_int2_splits, per_split = splits
    total = k_sink.shape[2] + k_codes.shape[2] + k_recent.shape[2]
    if mask is not None:
        mk = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
        smk = tuple(mk.stride(i) if mk.shape[i] > 1 else 0 for i in range(4))
    else:
        mk, smk = pl, (0, 0, 0, 0)  # never read
    args = (
        (q_rows, k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent, po, pl, mk,
         k_sink.shape[2], k_codes.shape[2], k_recent.shape[2], n_int2_splits, per_split, h, n_int2_splits + windows,
         scale * 1.4426950408889634, total) + smk
        + q_rows.stride()[:3]
        + _strides(k_sink) + _strides(k_codes) + _strides(k_sz) + _strides(k_recent)
        + _strides(v_sink) + _strides(v_codes) + _strides(v_sz) + _strides(v_recent)
    )
    kwargs = dict(
        GQ=hq // h, S=s, M=rows, MP=mp, D=d, Q=d // 4, GK=gk, GV=gv,
        BN=block_tokens or decode_plan.decode_tile_tokens(d, _quarter_groups(d, gk, gv)), HPT=decode_plan.HP_TILE,
        CAUSAL=bool(causal and s > 1), HAS_MASK=mask is not None, HP_KIND=_HP_KIND[_window_dtype(keys, values)],
        SPLIT_DOT=not interpret,
        num_warps=num_warps or decode_plan.decode_num_warps(d),
        num_stages=num_stages or decode_plan.decode_num_stages(d),
    )
    if not interpret:
        kwargs["maxnreg"] = decode_plan.DECODE_MAX_REGISTERS
    return Launch((n_int2_splits + windows, b * h, -(-rows // mp)), args, kwargs)


def merge_launch(query, out, po, pl, o_rotation, *, n_kv_heads: int, n_splits: int,
                 interpret: bool | None = None) -> Launch:
    """The merge kernel's launch (see :func:`decode_launch`)."""
    b, hq, s, d = query.shape
    interpret = interpret_mode() if interpret is None else interpret
    rows = (hq // n_kv_heads) * s
    if o_rotation is not None:
        r = _rows_last(o_rotation if o_rotation.dtype == torch.float32 else o_rotation.float())
        sr = (r.stride(0) if r.dim() == 3 else 0, r.stride(-2))
    else:
        r, sr = out, (0, 0)
    args = (po, pl, r, out, n_splits, n_kv_heads, *out.stride()[:3], *sr)
    kwargs = dict(GQ=hq // n_kv_heads, S=s, M=rows, MP=decode_plan.padded_rows(rows, 1), D=d, BK=ROT_BLOCK,
                  ROTATE_O=o_rotation is not None, SPLIT_DOT=not interpret,
                  num_warps=decode_plan.merge_num_warps(d), num_stages=1)
    return Launch((b * n_kv_heads,), args, kwargs)


def decode_attention_triton(query, keys, values, *, q_rotation, o_rotation, scale: float, causal: bool,
                            num_splits: int | None, dtype: torch.dtype, mask=None) -> torch.Tensor:
    """Run both kernels on validated inputs (see :func:`rotationzoo.kernels.decode_attention_int2`)."""
    b, hq, s, d = query.shape
    keys = tuple(_rows_last(t) for t in keys)
    values = tuple(_rows_last(t) for t in values)
    query = _rows_last(query)
    h = keys[0].shape[1]
    n_int2 = keys[1].shape[2]
    k_sz, v_sz = keys[2], values[2]
    tile = decode_plan.decode_tile_tokens(d, _quarter_groups(d, d // max(1, k_sz.shape[-1] // 2),
                                                              d // max(1, v_sz.shape[-1] // 2)))
    if num_splits is not None:
        splits = decode_plan.split_ranges(n_int2, num_splits, tile)
    else:
        splits = decode_plan.triton_splits(n_int2, b * h, _num_sms(query.device), tile)
    windows = decode_plan.window_splits(keys[0].shape[2] + keys[3].shape[2])
    n_splits = splits[0] + windows
    rows = (hq // h) * s
    po = torch.empty(b * h, n_splits, rows, d, dtype=torch.float32, device=query.device)
    pl = torch.empty(b * h, n_splits, rows, dtype=torch.float32, device=query.device)
    out = torch.empty(b, hq, s, d, dtype=dtype, device=query.device)
    interpret = interpret_mode()
    kern = _kernels(interpret)
    q_rows = rotate_queries(query, q_rotation, h, 1.0)  # one fp32 product, as the reference does
    launch = decode_launch(query, q_rows, keys, values, po, pl, scale=scale, causal=causal, splits=splits,
                           windows=windows, mask=mask, interpret=interpret)
    kern.split[launch.grid](*launch.args, **launch.kwargs)
    launch = merge_launch(query, out, po, pl, o_rotation, n_kv_heads=h, n_splits=n_splits, interpret=interpret)
    kern.merge[launch.grid](*launch.args, **launch.kwargs)
    return out
