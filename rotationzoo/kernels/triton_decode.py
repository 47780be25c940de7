"""Triton decode attention over the INT2 cache layout: split-K (flash-decoding) and a log-sum-exp merge.

Imported only when the triton backend runs :func:`rotationzoo.kernels.decode_attention_int2`. Two
launches per call:

1. ``_decode_split_kernel``, grid ``(int2 splits + window splits, B · H_kv)``: program ``(p, bh)``
   rotates the ``g · S`` query rows of KV head ``bh`` (``q @ R``, the rotation in column blocks),
   then attends either to one range of INT2 tokens (whole tiles, scores and outputs computed on the
   codes: ``s·(q·c − z·Σq)`` and ``Σ p s c − Σ p s z`` per group) or to one tile of window tokens
   (sink, then recent), with an fp32 online softmax in base 2; it writes the normalised partial
   output and its log-sum-exp.
2. ``_decode_merge_kernel``, grid ``(B · H_kv,)``: merges the partials by their log-sum-exp, applies
   the output matrix (``R_Vᵀ`` or ``o_rotation``, in column blocks) and writes ``[B, Hq, S, d]``.

Groups smaller than ``d`` use block-diagonal query rows: row ``(r, g)`` holds query ``r`` masked to
the dims of group ``g``, so one ``tl.dot`` gives every group's partial product (and the sum over
groups the plain one, for the window tokens). Compiled, products run on tensor cores with fp32
operands split into a bf16 (or fp16) high and low part (codes 0..3 and bf16 window rows are exact);
interpreted, they are plain fp32 products. Kernels are built on first use for the current Triton mode.
"""

import functools
import types

import torch
import triton
import triton.language as tl

from . import decode_plan
from .triton_launch import Launch, _num_sms, interpret_mode

__all__ = ["Launch", "decode_aot_kernels", "decode_attention_triton", "decode_launch", "merge_launch"]

_MAX_FN = tl.standard._elementwise_max
_SUM_FN = tl.standard._sum_combine

_HP_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
"""``HP_KIND`` constexpr of each window dtype (how window rows enter ``tl.dot`` when compiled)."""
ROT_BLOCK = 32
"""Columns of the rotation per step (a ``[32, d]`` fp32 block stays in registers)."""


def _decode_split_kernel(
    q_ptr, rq_ptr,
    ks_ptr, kc_ptr, kz_ptr, kr_ptr,
    vs_ptr, vc_ptr, vz_ptr, vr_ptr,
    po_ptr, pl_ptr,
    n_sink, n_int2, n_recent, n_int2_splits, split_tokens, n_kv_heads, n_splits, qk_scale, total,
    sq_b, sq_h, sq_s, sr_h, sr_i,
    sks_b, sks_h, sks_t, skc_b, skc_h, skc_t, skz_b, skz_h, skz_t, skr_b, skr_h, skr_t,
    svs_b, svs_h, svs_t, svc_b, svc_h, svc_t, svz_b, svz_h, svz_t, svr_b, svr_h, svr_t,
    GQ: tl.constexpr, S: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    D: tl.constexpr, Q: tl.constexpr, NGK: tl.constexpr, NGV: tl.constexpr,
    BN: tl.constexpr, HPT: tl.constexpr, BK: tl.constexpr,
    ROTATE_Q: tl.constexpr, CAUSAL: tl.constexpr, HP_KIND: tl.constexpr, SPLIT_DOT: tl.constexpr,
):
    """Partial attention of one split (see the module docstring); partials ``[B·H_kv, n_splits, M, D]``."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_kv_heads
    hk = bh % n_kv_heads
    dims = tl.arange(0, D)
    qidx = tl.arange(0, Q)
    shifts = tl.arange(0, 4) * 2
    GK: tl.constexpr = D // NGK
    GV: tl.constexpr = D // NGV
    RK: tl.constexpr = MP * NGK
    RV: tl.constexpr = MP * NGV

    # query rows, repeated once per K group: row (r, g) = query r (= head i, token s), r = i*S + s
    rk_rows = tl.arange(0, RK)
    r_of = rk_rows // NGK
    r_ok = r_of < M
    q_base = b.to(tl.int64) * sq_b + (hk * GQ + r_of // S).to(tl.int64) * sq_h + (r_of % S) * sq_s
    if ROTATE_Q:
        qr = tl.full([RK, D], 0.0, tl.float32)
        kk = tl.arange(0, BK)
        for kb in tl.static_range(D // BK):
            qb = tl.load(q_ptr + q_base[:, None] + (kb * BK + kk)[None, :], mask=r_ok[:, None], other=0.0)
            rb = tl.load(rq_ptr + hk.to(tl.int64) * sr_h + (kb * BK + kk)[:, None] * sr_i + dims[None, :])
            qr += _dot_ff(qb.to(tl.float32), rb.to(tl.float32), SPLIT_DOT)
    else:
        qr = tl.load(q_ptr + q_base[:, None] + dims[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
    gmask_k = ((dims[None, :] // GK) == (rk_rows % NGK)[:, None]).to(tl.float32)
    qk = qr * qk_scale * gmask_k  # [RK, D]: each row masked to its group
    qsum = tl.reshape(tl.reduce(qk, 1, _SUM_FN), (MP, NGK))  # Σ q over each group
    rows = tl.arange(0, MP)
    limit = total - S + rows % S  # last key position each query row sees (causal)
    onehot_v = ((dims[None, :] // GV) == tl.arange(0, NGV)[:, None]).to(tl.float32)  # [NGV, D]

    m_i = tl.full([MP], float("-inf"), tl.float32)
    l_i = tl.full([MP], 0.0, tl.float32)
    acc = tl.full([RV, D], 0.0, tl.float32)
    zacc = tl.full([MP, NGV], 0.0, tl.float32)
    if pid < n_int2_splits:
        start = pid * split_tokens
        end = tl.minimum(start + split_tokens, n_int2)
        kc_base = b.to(tl.int64) * skc_b + hk.to(tl.int64) * skc_h
        kz_base = b.to(tl.int64) * skz_b + hk.to(tl.int64) * skz_h
        vc_base = b.to(tl.int64) * svc_b + hk.to(tl.int64) * svc_h
        vz_base = b.to(tl.int64) * svz_b + hk.to(tl.int64) * svz_h
        gk = tl.arange(0, NGK)
        gv = tl.arange(0, NGV)
        for t0 in range(start, end, BN):
            t = t0 + tl.arange(0, BN)
            tm = t < end
            t64 = t.to(tl.int64)
            kb_ = tl.load(kc_ptr + kc_base + t64[:, None] * skc_t + qidx[None, :], mask=tm[:, None], other=0)
            ck = tl.reshape((kb_.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & 3, (BN, D)).to(tl.float32)
            ks = tl.load(kz_ptr + kz_base + t64[None, :] * skz_t + (2 * gk)[:, None], mask=tm[None, :], other=0.0)
            kz = tl.load(kz_ptr + kz_base + t64[None, :] * skz_t + (2 * gk + 1)[:, None], mask=tm[None, :], other=0.0)
            ks = ks.to(tl.float32)
            kzs = ks * kz.to(tl.float32)
            raw = tl.reshape(_dot_fc(qk, tl.trans(ck), SPLIT_DOT), (MP, NGK, BN))
            scores = (tl.reduce(raw * ks[None, :, :], 1, _SUM_FN)
                      - tl.reduce(qsum[:, :, None] * kzs[None, :, :], 1, _SUM_FN))
            ok = tm[None, :]
            if CAUSAL:
                ok = ok & ((n_sink + t)[None, :] <= limit[:, None])
            scores = tl.where(ok, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX_FN))
            m_fin = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_fin)
            p = tl.exp2(scores - m_fin[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _SUM_FN)
            m_i = m_new
            vb_ = tl.load(vc_ptr + vc_base + t64[:, None] * svc_t + qidx[None, :], mask=tm[:, None], other=0)
            cv = tl.reshape((vb_.to(tl.int32)[:, None, :] >> shifts[None, :, None]) & 3, (BN, D)).to(tl.float32)
            vs = tl.load(vz_ptr + vz_base + t64[None, :] * svz_t + (2 * gv)[:, None], mask=tm[None, :], other=0.0)
            vz = tl.load(vz_ptr + vz_base + t64[None, :] * svz_t + (2 * gv + 1)[:, None], mask=tm[None, :], other=0.0)
            w = p[:, None, :] * vs.to(tl.float32)[None, :, :]  # [MP, NGV, BN]
            alpha_v = tl.reshape(tl.broadcast_to(alpha[:, None], (MP, NGV)), (RV,))
            acc = acc * alpha_v[:, None] + _dot_fc(tl.reshape(w, (RV, BN)), cv, SPLIT_DOT)
            zacc = zacc * alpha[:, None] + tl.reduce(w * vz.to(tl.float32)[None, :, :], 2, _SUM_FN)
    else:
        u = (pid - n_int2_splits) * HPT + tl.arange(0, HPT)
        in_sink = u < n_sink
        in_rec = (u >= n_sink) & (u < n_sink + n_recent)
        u64 = u.to(tl.int64)
        r64 = (u - n_sink).to(tl.int64)
        kt = (tl.load(ks_ptr + b.to(tl.int64) * sks_b + hk.to(tl.int64) * sks_h + u64[:, None] * sks_t + dims[None, :],
                      mask=in_sink[:, None], other=0.0)
              + tl.load(kr_ptr + b.to(tl.int64) * skr_b + hk.to(tl.int64) * skr_h + r64[:, None] * skr_t
                        + dims[None, :], mask=in_rec[:, None], other=0.0))
        vt = (tl.load(vs_ptr + b.to(tl.int64) * svs_b + hk.to(tl.int64) * svs_h + u64[:, None] * svs_t + dims[None, :],
                      mask=in_sink[:, None], other=0.0)
              + tl.load(vr_ptr + b.to(tl.int64) * svr_b + hk.to(tl.int64) * svr_h + r64[:, None] * svr_t
                        + dims[None, :], mask=in_rec[:, None], other=0.0))
        raw = tl.reshape(_dot_fw(qk, tl.trans(kt), SPLIT_DOT, HP_KIND), (MP, NGK, HPT))
        scores = tl.reduce(raw, 1, _SUM_FN)  # the group-masked rows add up to the full product
        pos = tl.where(in_sink, u, u + n_int2)
        ok = (in_sink | in_rec)[None, :]
        if CAUSAL:
            ok = ok & (pos[None, :] <= limit[:, None])
        scores = tl.where(ok, scores, float("-inf"))
        m_i = tl.reduce(scores, 1, _MAX_FN)
        m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
        p = tl.exp2(scores - m_fin[:, None])
        l_i = tl.reduce(p, 1, _SUM_FN)
        w = tl.reshape(tl.broadcast_to(p[:, None, :], (MP, NGV, HPT)), (RV, HPT))
        acc = _dot_fw(w, vt, SPLIT_DOT, HP_KIND)

    out = tl.reduce(tl.reshape(acc, (MP, NGV, D)) * onehot_v[None, :, :], 1, _SUM_FN)
    out = out - tl.reduce(zacc[:, :, None] * onehot_v[None, :, :], 1, _SUM_FN)
    seen = l_i > 0.0
    out = out / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    slot = (bh.to(tl.int64) * n_splits + pid) * M
    keep = rows < M
    tl.store(po_ptr + (slot + rows)[:, None] * D + dims[None, :], out, mask=keep[:, None])
    tl.store(pl_ptr + slot + rows, lse, mask=keep)


def _decode_merge_kernel(
    po_ptr, pl_ptr, ro_ptr, out_ptr,
    n_splits, n_kv_heads, so_b, so_h, so_s, sr_h, sr_i,
    GQ: tl.constexpr, S: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, D: tl.constexpr, BK: tl.constexpr,
    ROTATE_O: tl.constexpr, SPLIT_DOT: tl.constexpr, OUT_KIND: tl.constexpr,
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
    inv = 1.0 / tl.where(keep, l_i, 1.0)
    o_base = b.to(tl.int64) * so_b + (hk * GQ + rows // S).to(tl.int64) * so_h + (rows % S) * so_s
    res = tl.full([MP, D], 0.0, tl.float32)
    for kb in tl.static_range(D // BK):
        ob = tl.full([MP, BK], 0.0, tl.float32)
        for sp in range(n_splits):
            wgt = tl.exp2(tl.load(pl_ptr + base + sp * M + rows, mask=keep, other=float("-inf")) - m_fin) * inv
            part = tl.load(po_ptr + (base + sp * M + rows)[:, None] * D + (kb * BK + kk)[None, :], mask=keep[:, None],
                           other=0.0)
            ob += wgt[:, None] * part
        if ROTATE_O:
            rb = tl.load(ro_ptr + hk.to(tl.int64) * sr_h + (kb * BK + kk)[:, None] * sr_i + dims[None, :])
            res += _dot_ff(ob, rb.to(tl.float32), SPLIT_DOT)
        else:
            tl.store(out_ptr + o_base[:, None] + (kb * BK + kk)[None, :], _cast(ob, OUT_KIND), mask=keep[:, None])
    if ROTATE_O:
        tl.store(out_ptr + o_base[:, None] + dims[None, :], _cast(res, OUT_KIND), mask=keep[:, None])


@triton.jit
def _cast(x, OUT_KIND: tl.constexpr):
    if OUT_KIND == 0:
        return x.to(tl.bfloat16)
    if OUT_KIND == 1:
        return x.to(tl.float16)
    return x


@triton.jit
def _dot_ff(a, b, SPLIT_DOT: tl.constexpr):
    """fp32 × fp32 → fp32: three bf16 products (hi·hi + hi·lo + lo·hi) compiled, one fp32 product interpreted."""
    if SPLIT_DOT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a_hi, b_hi, out_dtype=tl.float32)
        acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
        return tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
    return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _dot_fc(a, c, SPLIT_DOT: tl.constexpr):
    """fp32 × codes (exact small integers in fp32) → fp32: two bf16 products compiled."""
    if SPLIT_DOT:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        cb = c.to(tl.bfloat16)
        return tl.dot(a_lo, cb, tl.dot(a_hi, cb, out_dtype=tl.float32), out_dtype=tl.float32)
    return tl.dot(a, c, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def _dot_fw(a, w, SPLIT_DOT: tl.constexpr, HP_KIND: tl.constexpr):
    """fp32 × window rows (stored bf16 / fp16 / fp32) → fp32: the window dtype is exact in its own
    16-bit type, so two products of ``a`` split in that type; fp32 windows take the fp32 product."""
    if SPLIT_DOT and HP_KIND == 0:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        wb = w.to(tl.bfloat16)
        return tl.dot(a_lo, wb, tl.dot(a_hi, wb, out_dtype=tl.float32), out_dtype=tl.float32)
    if SPLIT_DOT and HP_KIND == 1:
        a_hi = a.to(tl.float16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.float16)
        wh = w.to(tl.float16)
        return tl.dot(a_lo, wh, tl.dot(a_hi, wh, out_dtype=tl.float32), out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)


# --- build (per Triton mode) --------------------------------------------------------------------

_HELPERS = ("_cast", "_dot_ff", "_dot_fc", "_dot_fw")


def _copies(namespace: dict, wrap) -> types.SimpleNamespace:
    def copy_of(fn):
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__module__ = fn.__module__
        copy.__qualname__ = fn.__qualname__
        copy.__doc__ = fn.__doc__
        copy.__annotations__ = dict(fn.__annotations__)
        return wrap(copy)

    for name in _HELPERS:  # the helpers, re-created in the same mode as the kernels that call them
        namespace[name] = copy_of(globals()[name].fn)
    return types.SimpleNamespace(split=copy_of(_decode_split_kernel), merge=copy_of(_decode_merge_kernel))


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> types.SimpleNamespace:
    del interpret  # the cache key; triton.jit reads the same setting
    return _copies(dict(globals()), triton.jit)


@functools.lru_cache(maxsize=1)
def decode_aot_kernels() -> types.SimpleNamespace:
    """Compiled-mode (``JITFunction``) copies of both decode kernels for ahead-of-time compilation
    (works in a process that runs the interpreter; never launch these)."""
    from triton.runtime.jit import JITFunction

    namespace = dict(globals())
    for name in ("_MAX_FN", "_SUM_FN"):
        fn = namespace[name]
        if not isinstance(fn, JITFunction):
            namespace[name] = JITFunction(fn.fn)
    return _copies(namespace, JITFunction)


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dimension (a copy only when it has not)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def decode_launch(query, keys, values, q_rotation, po, pl, *, scale: float, causal: bool, splits: tuple[int, int],
                  windows: int, interpret: bool | None = None, block_tokens: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None) -> Launch:
    """The split kernel's launch for validated inputs (``keys``/``values`` as ``(sink, codes, sz, recent)``
    with unit last strides), without running it. ``splits`` is ``(int2 splits, tokens per split)``,
    ``windows`` the window programs; ``po``/``pl`` the partial buffers."""
    b, hq, s, d = query.shape
    k_sink, k_codes, k_sz, k_recent = keys
    v_sink, v_codes, v_sz, v_recent = values
    h = k_sink.shape[1]
    interpret = interpret_mode() if interpret is None else interpret
    ngk = max(1, k_sz.shape[-1] // 2)
    ngv = max(1, v_sz.shape[-1] // 2)
    rows = (hq // h) * s
    mp = decode_plan.padded_rows(rows, min(ngk, ngv))
    n_int2_splits, per_split = splits
    if q_rotation is not None:
        r = _rows_last(q_rotation if q_rotation.dtype == torch.float32 else q_rotation.float())
        sr = (r.stride(0) if r.dim() == 3 else 0, r.stride(-2))
    else:
        r, sr = query, (0, 0)
    total = k_sink.shape[2] + k_codes.shape[2] + k_recent.shape[2]
    args = (
        (query, r, k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent, po, pl,
         k_sink.shape[2], k_codes.shape[2], k_recent.shape[2], n_int2_splits, per_split, h, n_int2_splits + windows,
         scale * 1.4426950408889634, total)
        + query.stride()[:3] + sr
        + _strides(k_sink) + _strides(k_codes) + _strides(k_sz) + _strides(k_recent)
        + _strides(v_sink) + _strides(v_codes) + _strides(v_sz) + _strides(v_recent)
    )
    kwargs = dict(
        GQ=hq // h, S=s, M=rows, MP=mp, D=d, Q=d // 4, NGK=ngk, NGV=ngv,
        BN=block_tokens or decode_plan.decode_tile_tokens(d), HPT=decode_plan.HP_TILE, BK=ROT_BLOCK,
        ROTATE_Q=q_rotation is not None, CAUSAL=bool(causal and s > 1), HP_KIND=_HP_KIND[k_sink.dtype],
        SPLIT_DOT=not interpret,
        num_warps=num_warps or decode_plan.decode_num_warps(d),
        num_stages=num_stages or decode_plan.decode_num_stages(d),
    )
    return Launch((n_int2_splits + windows, b * h), args, kwargs)


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
                  OUT_KIND={torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[out.dtype], num_warps=4, num_stages=1)
    return Launch((b * n_kv_heads,), args, kwargs)


def decode_attention_triton(query, keys, values, *, q_rotation, o_rotation, scale: float, causal: bool,
                            num_splits: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Run both kernels on validated inputs (see :func:`rotationzoo.kernels.decode_attention_int2`)."""
    b, hq, s, d = query.shape
    keys = tuple(_rows_last(t) for t in keys)
    values = tuple(_rows_last(t) for t in values)
    query = _rows_last(query)
    h = keys[0].shape[1]
    n_int2 = keys[1].shape[2]
    tile = decode_plan.decode_tile_tokens(d)
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
    launch = decode_launch(query, keys, values, q_rotation, po, pl, scale=scale, causal=causal, splits=splits,
                           windows=windows, interpret=interpret)
    kern.split[launch.grid](*launch.args, **launch.kwargs)
    launch = merge_launch(query, out, po, pl, o_rotation, n_kv_heads=h, n_splits=n_splits, interpret=interpret)
    kern.merge[launch.grid](*launch.args, **launch.kwargs)
    return out
