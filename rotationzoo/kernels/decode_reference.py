"""PyTorch reference of decode attention over the INT2 cache layout: chunked, scores on the codes.

Works on validated inputs (:func:`rotationzoo.kernels.decode_attention_int2` checks them). The
history is never dequantized as a whole: it is walked in tiles of ``tile`` tokens (sink, INT2 codes,
recent), and each tile is folded into an fp32 online softmax (running max ``m``, sum ``l`` and
output ``acc`` per query row), which is the log-sum-exp merge of the tiles' partial attentions. The
transient memory is one tile.

Scores and outputs are computed on the codes instead of dequantized rows. With codes ``c``, scale
``s_g`` and zero ``z_g`` of group ``g`` (dequantized row ``k̃ = (c − z_g)·s_g``)::

    q · k̃  = Σ_g s_g · (q_g · c_g − z_g · Σ q_g)
    Σ_t p_t ṽ_t[dims of g] = Σ_t (p_t s_t,g) · c_t[dims of g] − Σ_t p_t s_t,g z_t,g

so a tile costs one lookup of the code bytes (byte → its four codes as fp32, in the bytes' own
order: byte ``j`` holds dims ``j, j+Q, j+2Q, j+3Q``, so the query is permuted once instead of every
tile), two matrix products and a few ``[rows, tokens]`` operations. ``tools/bench_decode.py
--cpu-variants`` measures this against dequantizing each tile, unpacking with shifts and per-query
lookup tables of code bytes (docs/performance.md).
"""

from __future__ import annotations

import functools

import torch

from .decode_plan import reference_tile_tokens

_NEG_INF = float("-inf")

MAX_DEQUANT = 2.0 ** 64
"""Decode attention's domain for INT2 rows: a row with a group whose scale or zero is not finite, or
whose ``|s| · max(|z|, |3 − z|)`` (the largest magnitude it dequantizes to) exceeds this, is read as
NaN by every backend (the same fp32 test), so an overflow never depends on a backend's summation
order. The quantizer writes such rows only for non-finite inputs (NaN scales) or inputs past 2^64."""


def flagged_scales(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, z)`` of fp32 ``sz [..., 2·groups]``; every scale of a row outside :data:`MAX_DEQUANT` is NaN."""
    s, z = sz[..., 0::2], sz[..., 1::2]
    bound = s.abs() * torch.maximum(z.abs(), (3.0 - z).abs())
    return s.masked_fill(~(bound <= MAX_DEQUANT).all(dim=-1, keepdim=True), float("nan")), z


@functools.lru_cache(maxsize=8)
def _byte_codes(device: torch.device) -> torch.Tensor:
    """``[256, 4]`` fp32: the four 2-bit codes of each byte (bits 0-1, 2-3, 4-5, 6-7)."""
    b = torch.arange(256, dtype=torch.int32)
    return torch.stack([(b >> (2 * a)) & 3 for a in range(4)], dim=1).to(torch.float32).to(device)


@functools.lru_cache(maxsize=16)
def _byte_order(d: int, groups: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dims, onehot)``: the natural dim of each position of an unpacked tile (position ``4j + a`` is
    dim ``a·Q + j``) and ``[groups, d]`` fp32 membership of each position in each group."""
    q = d // 4
    dims = torch.tensor([a * q + j for j in range(q) for a in range(4)], dtype=torch.int64)
    onehot = (dims[None, :] // (d // groups) == torch.arange(groups)[:, None]).to(torch.float32)
    return dims.to(device), onehot.to(device)


def unpack_tile(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., n, d/4]`` uint8 → ``[..., n, d]`` fp32 codes in byte order (position ``4j + a``)."""
    return torch.nn.functional.embedding(codes.to(torch.int32), _byte_codes(codes.device)).flatten(-2)


def rotate_queries(query: torch.Tensor, rotation: torch.Tensor | None, num_kv_heads: int, scale: float) -> torch.Tensor:
    """``[B, Hq, S, d]`` → ``[B, H_kv, g·S, d]`` fp32 ``scale · (q @ R)``; row ``i·S + s`` is query token
    ``s`` of head ``h·g + i`` (``R [d, d]`` shared or ``[H_kv, d, d]`` per KV head)."""
    b, hq, s, d = query.shape
    q = query.to(torch.float32).reshape(b, num_kv_heads, (hq // num_kv_heads) * s, d)
    if rotation is not None:
        r = rotation.to(torch.float32)
        q = q @ (r if r.dim() == 2 else r[None])
    return q * scale


def rotate_output(o: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``o [B, H_kv, rows, d] @ R`` (shared or per KV head) in fp32."""
    if rotation is None:
        return o
    r = rotation.to(torch.float32)
    return o @ (r if r.dim() == 2 else r[None])


class _Softmax:
    """fp32 online softmax state of ``[B, H_kv, rows]`` query rows; ``acc`` holds the output dims in
    byte order (position ``4j + a`` is dim ``a·Q + j``, see :func:`unpack_tile`)."""

    def __init__(self, b: int, h: int, rows: int, d: int, device: torch.device) -> None:
        self.m = torch.full((b, h, rows), _NEG_INF, device=device)
        self.l = torch.zeros((b, h, rows), device=device)
        self.acc = torch.zeros((b, h, rows, d), device=device)

    def fold(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold a tile's scores in: returns ``(p, alpha)``, the tile's weights ``exp(score − m_new)`` and
        the factor ``exp(m_old − m_new)`` already applied to ``l``; the caller then adds ``p @ v`` with
        :meth:`add` (``acc ← alpha · acc + pv``)."""
        m_new = torch.maximum(self.m, scores.amax(dim=-1))
        finite = torch.where(m_new == _NEG_INF, 0.0, m_new)  # a row that has seen no key yet
        alpha = torch.exp(self.m - finite)
        p = torch.exp(scores - finite[..., None])
        self.l = self.l * alpha + p.sum(dim=-1)
        self.m = m_new
        return p, alpha

    def add(self, pv: torch.Tensor, alpha: torch.Tensor) -> None:
        self.acc.mul_(alpha[..., None]).add_(pv)


class _Visible:
    """Which key positions each query row sees: the causal limit (``limit [rows]``: the last visible
    position) and an optional boolean mask ``[B|1, H_kv|1, rows, L]`` (True = attend)."""

    def __init__(self, limit: torch.Tensor | None, mask: torch.Tensor | None) -> None:
        self.limit = limit
        self.mask = mask

    def apply(self, scores: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Scores of keys at positions ``pos [n]`` that a row may not see set to −inf."""
        if self.limit is not None:
            scores = scores.masked_fill(pos[None, :] > self.limit[:, None], _NEG_INF)
        if self.mask is not None:
            scores = scores.masked_fill(~self.mask[..., pos], _NEG_INF)
        return scores


def rows_mask(mask: torch.Tensor, num_kv_heads: int, rows: int) -> torch.Tensor:
    """A boolean ``[B|1, Hq|1, S, L]`` mask as ``[B|1, H_kv|1, rows, L]`` (``rows = g·S``), row ``i·S + s``
    of KV head ``h`` being token ``s`` of query head ``h·g + i`` (the layout of :func:`rotate_queries`)."""
    b, hm, s, length = mask.shape
    mask = mask if mask.dtype == torch.bool else mask.to(torch.bool)
    if hm == 1:
        return mask[:, :, None].expand(b, 1, rows // s, s, length).reshape(b, 1, rows, length)
    return mask.reshape(b, num_kv_heads, rows, length)


def _dense(state: _Softmax, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, tile: int,
           visible: _Visible) -> None:
    """Fold window tokens ``k, v [B, H_kv, n, d]`` (any float dtype), key positions ``first …``."""
    dims, _ = _byte_order(q.shape[-1], 1, q.device)
    for a in range(0, k.shape[2], tile):
        kt = k[:, :, a:a + tile].to(torch.float32)
        vt = v[:, :, a:a + tile, dims].to(torch.float32)  # value dims in byte order, like the INT2 tiles
        pos = torch.arange(first + a, first + a + kt.shape[2], device=q.device)
        p, alpha = state.fold(visible.apply(q @ kt.transpose(-1, -2), pos))
        state.add(p @ vt, alpha)


def _int2(state: _Softmax, q: torch.Tensor, keys: tuple[torch.Tensor, torch.Tensor],
          values: tuple[torch.Tensor, torch.Tensor], first: int, tile: int, visible: _Visible) -> None:
    """Fold INT2 tokens (codes ``[B, H_kv, n, d/4]``, scales/zeros ``[B, H_kv, n, 2·groups]``) tile by tile."""
    kc, ksz = keys
    vc, vsz = values
    b, h, rows, d = q.shape
    groups = ksz.shape[-1] // 2
    vgroups = vsz.shape[-1] // 2
    dims, onehot = _byte_order(d, groups, q.device)
    qp = q[..., dims]  # the queries in byte order
    if groups == 1:
        qsum = qp.sum(dim=-1, keepdim=True)  # [B, H, rows, 1]
        qk = qp
    else:
        qk = (qp[..., None, :] * onehot).reshape(b, h, rows * groups, d)  # row (r, g): q masked to group g
        qsum = qk.sum(dim=-1).reshape(b, h, rows, groups)
    _, vonehot = _byte_order(d, vgroups, q.device)
    for a in range(0, kc.shape[2], tile):
        n = min(tile, kc.shape[2] - a)
        s, z = flagged_scales(ksz[:, :, a:a + n].to(torch.float32))  # [B, H, n, groups]
        raw = qk @ unpack_tile(kc[:, :, a:a + n]).transpose(-1, -2)  # [B, H, rows·groups, n]
        if groups == 1:  # s·(q·c − z·Σq)
            scores = raw.sub_(qsum * z[..., 0][:, :, None, :]).mul_(s[..., 0][:, :, None, :])
        else:
            raw = raw.reshape(b, h, rows, groups, n)
            scores = (raw * s.transpose(-1, -2)[:, :, None]).sum(dim=-2) - qsum @ (s * z).transpose(-1, -2)
        pos = torch.arange(first + a, first + a + n, device=q.device)
        p, alpha = state.fold(visible.apply(scores, pos))
        sv, zv = flagged_scales(vsz[:, :, a:a + n].to(torch.float32))
        cv = unpack_tile(vc[:, :, a:a + n])  # [B, H, n, d] byte order
        if vgroups == 1:  # Σ (p s) c − Σ p s z
            w = p * sv[..., 0][:, :, None, :]
            pv = (w @ cv).sub_(w @ zv)
        else:
            w = (p[..., None, :] * sv.transpose(-1, -2)[:, :, None]).reshape(b, h, rows * vgroups, n)
            r = (w @ cv).reshape(b, h, rows, vgroups, d)
            zsum = (w.reshape(b, h, rows, vgroups, n) * zv.transpose(-1, -2)[:, :, None]).sum(dim=-1)
            pv = (r * vonehot).sum(dim=-2) - zsum @ vonehot
        state.add(pv, alpha)


def decode_attention_torch(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    q_rotation: torch.Tensor | None,
    o_rotation: torch.Tensor | None,
    scale: float,
    causal: bool,
    num_splits: int | None,
    dtype: torch.dtype,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference :func:`rotationzoo.kernels.decode_attention_int2` on validated inputs.

    ``keys``/``values`` are ``(sink, codes, scales_zeros, recent)`` with every part a tensor (empty
    parts have 0 tokens); ``q_rotation`` multiplies the queries (``q @ R``), ``o_rotation`` the
    output (``o @ R``); ``mask`` (``[B|1, Hq|1, S, L]`` booleans, True = attend) restricts what each
    query row sees beyond the causal rule. ``num_splits`` sets the INT2 tile to ``ceil(N / num_splits)``
    tokens (default :func:`~rotationzoo.kernels.decode_plan.reference_tile_tokens`). Returns
    ``[B, Hq, S, d]`` in ``dtype``.
    """
    b, hq, s, d = query.shape
    k_sink, k_codes, k_sz, k_recent = keys
    v_sink, v_codes, v_sz, v_recent = values
    h = k_sink.shape[1]
    q = rotate_queries(query, q_rotation, h, scale)
    rows = q.shape[2]
    p_len, n_len, r_len = k_sink.shape[2], k_codes.shape[2], k_recent.shape[2]
    total = p_len + n_len + r_len
    limit = None
    if causal and s > 1:  # query token t sees keys up to position total − s + t
        limit = total - s + torch.arange(rows, device=q.device) % s
    tile = reference_tile_tokens(b * h, d)
    int2_tile = -(-n_len // num_splits) if num_splits else tile
    visible = _Visible(limit, None if mask is None else rows_mask(mask, h, rows))
    state = _Softmax(b, h, rows, d, q.device)
    _dense(state, q, k_sink, v_sink, 0, tile, visible)
    _int2(state, q, (k_codes, k_sz), (v_codes, v_sz), p_len, max(1, int2_tile), visible)
    _dense(state, q, k_recent, v_recent, p_len + n_len, tile, visible)
    dims, _ = _byte_order(d, 1, q.device)
    acc = torch.empty_like(state.acc)
    acc[..., dims] = state.acc  # back to the natural dim order
    l = state.l[..., None]
    out = rotate_output(torch.where(l == 0, 0.0, acc / l), o_rotation)  # a row that sees no key: 0
    return out.reshape(b, hq, s, d).to(dtype)


__all__ = ["MAX_DEQUANT", "decode_attention_torch", "flagged_scales", "rotate_output", "rotate_queries", "rows_mask",
           "unpack_tile"]
