"""The decode-time simulation of a KV cache in one forward: each query reads every key and value as the
cache would hold it while that query's token is decoded.

:func:`simulated_int2_attention`: OSCAR's windows (the sink and the recent tokens exact, everything else
read back from its quantized form), with fused (flash) attention pieces on CPU merged by their
log-sum-exp; :func:`simulated_attention`: any rule of the form "key (or value) ``j`` is read quantized
when ``prefix ≤ j < b(i)``", with separate boundaries for keys and values (KIVI's residual: keys
quantized in whole blocks of ``R`` tokens, values once more than ``R`` newer ones exist:
:func:`kivi_boundaries`); :func:`exact_attention`: plain causal attention (the reference of the
per-layer errors).
"""

from __future__ import annotations

from typing import Any

import torch


def _bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An attention mask as booleans (True = may attend); additive float masks are converted."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled dot-product attention with GQA (``q [B, Hq, S, d]``, ``k/v [B, Hkv, L, d]``)."""
    import torch.nn.functional as F

    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


#: Query rows per block of the simulated attention (bounds its masks to ``block × (block + window)``).
SIM_QUERY_BLOCK = 256


def simulated_int2_attention(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    k_int2: torch.Tensor,
    v_int2: torch.Tensor,
    *,
    prefix: int,
    recent: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    block: int = SIM_QUERY_BLOCK,
    sink_ends: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention where each query reads window keys exactly and older keys as INT2.

    Query ``t`` (absolute position ``i = L − S + t``) reads key/value ``j ≤ i`` from
    ``k_exact``/``v_exact`` when ``j < prefix`` or ``i − j ≤ recent`` (the sink, the current token
    and the ``recent`` tokens before it) and from ``k_int2``/``v_int2`` otherwise: what a decode
    step at position ``i`` reads from the OSCAR cache.

    Without a padding mask and for a whole sequence (``S = L``) the INT2 keys a query reads,
    ``prefix ≤ j ≤ i − recent − 1``, form a causal pattern shifted by ``c = prefix + recent + 1``:
    they are attended with the fused causal (flash) attention on ``q[c:]`` against
    ``k_int2[prefix : L − recent − 1]``, the exact keys blockwise (each block of ``block`` queries
    against at most ``prefix + block + recent`` keys), and the two partial softmaxes are merged by
    their log-sum-exp. Otherwise (padding masks, ``S < L``, and whenever autograd records the call:
    the fused kernel's log-sum-exp carries no gradient, so the merged output would get wrong gradients
    for queries and keys) blocks of queries attend through one masked SDPA each. Both cost about one
    causal attention.

    Args:
        query: ``[B, Hq, S, d]`` (in the same basis as the keys).
        k_exact, v_exact: ``[B, Hkv, L, d]`` window versions (``L ≥ S``).
        k_int2, v_int2: ``[B, Hkv, L, d]`` dequantized INT2 versions.
        prefix, recent: window sizes.
        scale: softmax scale.
        attention_mask: optional ``[B or 1, 1, S, L]`` boolean (True = attend) or additive mask,
            combined with the causal rule (padding).
        block: query rows per block.
        sink_ends: per sequence of a left-padded batch, where its sink ends (its leading padding + ``prefix``):
            each sequence's own first ``prefix`` tokens are exact, as the INT2 cache keeps them
            (:class:`~rotationzoo.integrations.transformers.slots.Slots`); ``None``: ``prefix`` for every one.

    Returns:
        ``[B, Hq, S, d]`` in ``query``'s dtype.
    """
    s, length = query.shape[2], k_exact.shape[2]
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, k_exact, v_exact, k_int2, v_int2))
    if attention_mask is not None or s != length or query.device.type != "cpu" or grads or sink_ends:
        return _blocked_int2_attention(query, k_exact, v_exact, k_int2, v_int2, prefix=prefix, recent=recent,
                                       scale=scale, attention_mask=attention_mask, block=block, sink_ends=sink_ends)
    g = query.shape[1] // k_exact.shape[1]
    parts = _exact_parts(query, k_exact, v_exact, prefix=prefix, recent=recent, scale=scale, block=block)
    c = prefix + recent + 1
    if length > c:
        k2 = k_int2[:, :, prefix:length - recent - 1].repeat_interleave(g, dim=1)
        v2 = v_int2[:, :, prefix:length - recent - 1].repeat_interleave(g, dim=1)
        parts.append((c, *_flash(query[:, :, c:], k2, v2, causal=True, scale=scale)))
    return _merge(parts, query.shape, query.dtype)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused (flash) attention on CPU with its log-sum-exp: ``(out fp32, lse fp32)``; ``causal`` is
    top-left aligned (query ``t`` reads keys ``u ≤ t``)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, scale=scale)
    return out.float(), lse.float()


def _merge(parts: list[tuple[int, torch.Tensor, torch.Tensor]], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Combine partial attentions ``(first query, out, lse)`` over disjoint key sets into one softmax."""
    b, h, s, d = shape
    lse = torch.full((b, h, s), float("-inf"))
    for start, _, part_lse in parts:
        lse[:, :, start:start + part_lse.shape[2]] = torch.logaddexp(lse[:, :, start:start + part_lse.shape[2]], part_lse)
    out = torch.zeros(b, h, s, d)
    for start, part_out, part_lse in parts:
        n = part_lse.shape[2]
        out[:, :, start:start + n] += torch.exp(part_lse - lse[:, :, start:start + n])[..., None] * part_out
    return out.to(dtype)


def _exact_parts(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix: int, recent: int, scale: float,
                 block: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """Every query over its exact keys (``j < prefix`` or ``i − recent ≤ j ≤ i``) as partial results.

    Queries ``i ≥ a0 = prefix + recent`` use fused attention: the sink (all ``prefix`` keys), and the
    band in blocks of ``W = recent`` queries: the current block's keys are a causal pattern, the
    previous block's keys ``u ≥ t`` become one after reversing both (``u' ≤ t'``). Earlier queries,
    and windows too small for that to pay, go through one masked pass (:func:`_exact_part`).
    """
    b, hq, s, d = query.shape
    g = hq // k.shape[1]
    w = recent
    a0 = prefix + w
    if w < 32 or s - a0 < 2 * w:
        return [(0, *_exact_part(query, k, v, prefix=prefix, recent=recent, scale=scale, block=block))]
    parts = [(0, *_exact_part(query[:, :, :a0], k[:, :, :a0], v[:, :, :a0], prefix=prefix, recent=recent,
                              scale=scale, block=block))]
    kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    n = s - a0
    nb = -(-n // w)

    def blocks(x: torch.Tensor, start: int) -> torch.Tensor:  # x[start : start + nb·W] → [B·nb, H, W, d]
        y = x[:, :, start:start + nb * w]
        if y.shape[2] < nb * w:  # the current blocks run past the end: zero queries / keys, never read
            y = torch.nn.functional.pad(y, (0, 0, 0, nb * w - y.shape[2]))
        return y.reshape(b, hq, nb, w, d).permute(0, 2, 1, 3, 4).reshape(b * nb, hq, w, d)

    def unblock(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        o = o.reshape(b, nb, hq, w, d).permute(0, 2, 1, 3, 4).reshape(b, hq, nb * w, d)[:, :, :n]
        lse = lse.reshape(b, nb, hq, w).permute(0, 2, 1, 3).reshape(b, hq, nb * w)[:, :, :n]
        return o, lse

    qb = blocks(query, a0)
    parts.append((a0, *unblock(*_flash(qb, blocks(kr, a0), blocks(vr, a0), causal=True, scale=scale))))
    o, lse = _flash(qb.flip(2), blocks(kr, a0 - w).flip(2), blocks(vr, a0 - w).flip(2), causal=True, scale=scale)
    parts.append((a0, *unblock(o.flip(2), lse.flip(2))))
    if prefix:
        parts.append((a0, *_flash(query[:, :, a0:], kr[:, :, :prefix], vr[:, :, :prefix], causal=False, scale=scale)))
    return parts


def _exact_part(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, prefix: int, recent: int, scale: float,
                block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its exact keys only (``j < prefix`` or ``i − recent ≤ j ≤ i``),
    blockwise, with the fp32 log-sum-exp of its scores: ``(out [B, Hq, S, d], lse [B, Hq, S])``.

    The query heads sharing a KV head are attended together (no repeated keys)."""
    b, hq, s, d = query.shape
    hkv = k.shape[1]
    g = hq // hkv
    dev = query.device
    qg = query.float().reshape(b, hkv, g, s, d)
    kf, vf = k.float(), v.float()
    p = min(prefix, s)
    outs, lses = [], []
    for a in range(0, s, block):
        e = min(s, a + block)
        band = min(max(p, a - recent), e)
        kk = torch.cat([kf[:, :, :p], kf[:, :, band:e]], dim=2)
        vv = torch.cat([vf[:, :, :p], vf[:, :, band:e]], dim=2)
        cols = torch.cat([torch.arange(0, p, device=dev), torch.arange(band, e, device=dev)])
        i = torch.arange(a, e, device=dev)[:, None]
        allowed = (cols[None, :] <= i) & ((cols[None, :] < prefix) | (i - cols[None, :] <= recent))
        scores = torch.matmul(qg[:, :, :, a:e].reshape(b, hkv, g * (e - a), d), kk.transpose(-1, -2)) * scale
        scores = scores.view(b, hkv, g, e - a, -1).masked_fill_(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp_(scores.sub_(lse[..., None]))
        out = torch.matmul(probs.view(b, hkv, g * (e - a), -1), vv).view(b, hkv, g, e - a, d)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=3).reshape(b, hq, s, d).to(query.dtype)
    return out, torch.cat(lses, dim=3).reshape(b, hq, s)


def _blocked_int2_attention(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    k_int2: torch.Tensor,
    v_int2: torch.Tensor,
    *,
    prefix: int,
    recent: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    block: int = SIM_QUERY_BLOCK,
    sink_ends: list[int] | None = None,
) -> torch.Tensor:
    """The general path of :func:`simulated_int2_attention` (padding masks, ``S < L``, any device), with its
    arguments: blocks of ``block`` queries attend at once over only the keys they need (the sink, the INT2
    keys ``prefix ≤ j ≤ i − recent − 1``, the exact band), through one masked SDPA per block, so the cost is
    about that of one causal attention. With ``sink_ends`` a key before the longest sink end and from the
    shortest is gathered in both places, and each sequence reads it from its own (the sink before its end)."""
    b, _, s, _ = query.shape
    length = k_exact.shape[2]
    offset = length - s
    dev = query.device
    mask = _bool_mask(attention_mask)
    outs = []
    lo, hi = (min(sink_ends), max(sink_ends)) if sink_ends else (prefix, prefix)
    ends = torch.tensor(sink_ends, device=dev)[:, None] if sink_ends else None
    p = min(hi, length)
    for a in range(0, s, block):
        e = min(s, a + block)
        i = torch.arange(offset + a, offset + e, device=dev)[:, None]  # absolute query positions
        q_end = max(lo, offset + e - 1 - recent)  # INT2 keys: prefix <= j <= i - recent - 1
        band = max(lo, offset + a - recent)  # exact band: max(prefix, i - recent) <= j <= i
        band = min(band, offset + e)
        parts_k = [k_exact[:, :, :p], k_int2[:, :, lo:q_end], k_exact[:, :, band:offset + e]]
        parts_v = [v_exact[:, :, :p], v_int2[:, :, lo:q_end], v_exact[:, :, band:offset + e]]
        js = torch.arange(0, p, device=dev)[None, :]
        jq = torch.arange(lo, max(lo, q_end), device=dev)[None, :]
        jb = torch.arange(band, offset + e, device=dev)[None, :]
        m = torch.cat([js <= i, (i - jq) > recent, (jb <= i) & ((i - jb) <= recent)], dim=1)
        cols = torch.cat([js[0], jq[0], jb[0]])
        if ends is not None:  # each sequence's own sink: [0, its end) from the sink, the rest from the others
            own = torch.cat([js < ends, jq >= ends, jb >= ends], dim=1)
            m = m[None, None] & own[:, None, None, :]
        if mask is not None:
            m = m & mask[:, :, a:e][..., cols]
        elif ends is None:
            m = m[None, None]
        o = _sdpa(query[:, :, a:e], torch.cat(parts_k, 2), torch.cat(parts_v, 2), m, scale)
        outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return torch.nan_to_num(out, nan=0.0) if mask is not None or ends is not None else out


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Plain causal attention ``[B, Hq, S, d]`` (bottom-right aligned when ``L > S``)."""
    import torch.nn.functional as F

    s, length = query.shape[2], key.shape[2]
    mask = _bool_mask(attention_mask)
    if mask is None and s == length:
        hq, hkv = query.shape[1], key.shape[1]
        if hq != hkv:
            key, value = key.repeat_interleave(hq // hkv, dim=1), value.repeat_interleave(hq // hkv, dim=1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    if mask is None:
        i = torch.arange(length - s, length, device=query.device)[:, None]
        mask = (torch.arange(length, device=query.device)[None, :] <= i)[None, None]
    return torch.nan_to_num(_sdpa(query, key, value, mask, scale), nan=0.0)


def kivi_boundaries(positions: torch.Tensor, residual: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's read rule at absolute query positions ``i``: keys ``j < R·⌊i/R⌋`` and values ``j < i − R``
    are read quantized (``(b_k, b_v)``, exclusive bounds).

    KIVI's decode step (jy-yuan/KIVI ``models/llama_kivi.py``) appends the new key and value to the
    full-precision residual and attends *first*; only afterwards is a full residual of ``R`` keys quantized
    (whole blocks of ``R``) and the oldest of ``R + 1`` values quantized. So query ``i`` reads its own key
    and value exactly, a block of ``R`` keys quantized from the query after the one that completes it
    on, and ``R + 1`` values exactly (its own included)."""
    return residual * torch.div(positions, residual, rounding_mode="floor"), positions - residual


def simulated_attention(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    k_quant: torch.Tensor,
    v_quant: torch.Tensor,
    *,
    boundaries: Any,
    prefix: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    block: int = SIM_QUERY_BLOCK,
) -> torch.Tensor:
    """Causal attention where query ``i`` reads key ``j`` quantized when ``prefix ≤ j < b_k(i)`` and value
    ``j`` quantized when ``prefix ≤ j < b_v(i)``, everything else exactly.

    Blocks of queries attend through one masked SDPA each over four key segments, one per pair of
    versions (quantized or exact key, quantized or exact value), each spanning what any query of the
    block reads in that pair; the masks pick exactly one version of every ``(i, j)``.

    Args:
        query: ``[B, Hq, S, d]`` (in the keys' basis).
        k_exact, v_exact, k_quant, v_quant: ``[B, Hkv, L, d]``, ``L ≥ S`` (the queries are the last ``S``).
        boundaries: ``positions [n] -> (b_k [n], b_v [n])`` (absolute positions), e.g. :func:`kivi_boundaries`.
        prefix: leading tokens always read exactly (a sink).
        scale: softmax scale.
        attention_mask: optional ``[B or 1, 1, S, L]`` boolean or additive mask (padding).
        block: query rows per block.

    Returns:
        ``[B, Hq, S, d]`` in ``query``'s dtype.
    """
    s, length = query.shape[2], k_exact.shape[2]
    offset, dev = length - s, query.device
    mask = _bool_mask(attention_mask)
    outs = []
    for a in range(0, s, block):
        e = min(s, a + block)
        i = torch.arange(offset + a, offset + e, device=dev)
        b_k, b_v = (t.clamp(prefix, None) for t in boundaries(i))
        lo, hi = torch.minimum(b_k, b_v), torch.maximum(b_k, b_v)
        spans = [  # (first, end, key version, value version, which (i, j) read this pair)
            (prefix, int(lo.max()), k_quant, v_quant, lambda j: j < lo[:, None]),
            (int(b_v.min()), int(b_k.max()), k_quant, v_exact, lambda j: (j >= b_v[:, None]) & (j < b_k[:, None])),
            (int(b_k.min()), int(b_v.max()), k_exact, v_quant, lambda j: (j >= b_k[:, None]) & (j < b_v[:, None])),
            (0, prefix, k_exact, v_exact, lambda j: torch.ones_like(j, dtype=torch.bool).expand(len(i), -1)),
            (max(prefix, int(hi.min())), offset + e, k_exact, v_exact, lambda j: j >= hi[:, None]),
        ]
        keys, values, masks, cols = [], [], [], []
        for first, end, kk, vv, rule in spans:
            end = min(end, offset + e)
            if end <= first:
                continue
            j = torch.arange(first, end, device=dev)[None, :]
            keys.append(kk[:, :, first:end])
            values.append(vv[:, :, first:end])
            masks.append(rule(j) & (j <= i[:, None]))
            cols.append(j[0])
        m = torch.cat(masks, dim=1)
        m = m & mask[:, :, a:e][..., torch.cat(cols)] if mask is not None else m[None, None]
        outs.append(_sdpa(query[:, :, a:e], torch.cat(keys, 2), torch.cat(values, 2), m, scale))
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return torch.nan_to_num(out, nan=0.0)
