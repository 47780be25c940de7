"""The OSCAR attention: a decode-time simulation for one-shot forwards, and the real-cache path.

Inside ``with oscar_kv(model, oscar):``

* ``model(...)`` without a cache runs the simulation: each query position ``i`` sees key/value
  ``j`` exactly as the cache would hold it while decoding token ``i`` (window tokens rounded to
  ``hp_dtype``, older ones INT2), all in one forward with block masks;
* ``model(...)`` / ``model.generate(...)`` with ``cache=session.new_cache()`` use the real INT2
  cache (:mod:`rotationzoo.integrations.transformers.cache`).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from ...errors import EvaluationError
from .common import base_attention, base_implementation, register_attention, require_transformers, switch_attention
from .cache import cache_classes
from .oscar import ACTIVE_SESSION, OSCAR_IMPL_PREFIX, OSCAR_TAG, OscarKV, fake_quantize


class _LayerErrors:
    """Running ``Σ‖o − o_ref‖²`` and ``Σ‖o_ref‖²`` per layer (fp64)."""

    def __init__(self) -> None:
        self.num: dict[int, float] = {}
        self.den: dict[int, float] = {}

    def add(self, layer_id: int, out: torch.Tensor, ref: torch.Tensor) -> None:
        diff = (out.double() - ref.double()).pow(2).sum().item()
        norm = ref.double().pow(2).sum().item()
        self.num[layer_id] = self.num.get(layer_id, 0.0) + diff
        self.den[layer_id] = self.den.get(layer_id, 0.0) + norm

    def relative(self) -> dict[int, float]:
        """``{layer_id: ‖o − o_ref‖_F / ‖o_ref‖_F}`` over everything added."""
        return {lid: (self.num[lid] / self.den[lid]) ** 0.5 if self.den[lid] > 0 else 0.0 for lid in sorted(self.num)}


class OscarSession:
    """What :func:`oscar_kv` yields: the settings, a cache factory and per-layer error statistics.

    Attributes:
        model: the model.
        oscar: the :class:`OscarKV` settings.
        collect_errors: whether simulated forwards also run exact attention and record
            ``‖o − o_fp‖ / ‖o_fp‖`` per layer (one more attention per layer).
        errors: the running per-layer error sums (see :meth:`layer_errors`).
    """

    def __init__(self, model: Any, oscar: OscarKV, collect_errors: bool = False) -> None:
        self.model = model
        self.oscar = oscar
        self.collect_errors = collect_errors
        self.errors = _LayerErrors()

    def new_cache(self) -> Any:
        """A fresh :class:`OscarInt2Cache` for this model (pass it as ``cache=`` /
        ``past_key_values=`` to ``model(...)`` or ``model.generate(...)``)."""
        return cache_classes()["OscarInt2Cache"](self.oscar, config=self.model.config)

    def layer_errors(self) -> dict[int, float]:
        """Per-layer relative attention-output error of the simulated forwards so far."""
        return self.errors.relative()

    def reset_errors(self) -> None:
        """Forget the error statistics."""
        self.errors = _LayerErrors()


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
    their log-sum-exp. Otherwise (padding masks, ``S < L``) blocks of queries attend through one
    masked SDPA each. Both cost about one causal attention.

    Args:
        query: ``[B, Hq, S, d]`` (in the same basis as the keys).
        k_exact, v_exact: ``[B, Hkv, L, d]`` window versions (``L ≥ S``).
        k_int2, v_int2: ``[B, Hkv, L, d]`` dequantized INT2 versions.
        prefix, recent: window sizes.
        scale: softmax scale.
        attention_mask: optional ``[B or 1, 1, S, L]`` boolean (True = attend) or additive mask,
            combined with the causal rule (padding).
        block: query rows per block.

    Returns:
        ``[B, Hq, S, d]`` in ``query``'s dtype.
    """
    s, length = query.shape[2], k_exact.shape[2]
    if attention_mask is not None or s != length or query.device.type != "cpu":
        return _blocked_int2_attention(query, k_exact, v_exact, k_int2, v_int2, prefix=prefix, recent=recent,
                                       scale=scale, attention_mask=attention_mask, block=block)
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
) -> torch.Tensor:
    """The general path of :func:`simulated_int2_attention` (padding masks, ``S < L``): blocks of
    queries attend at once over only the keys they need, through one masked SDPA per block.

    Causal attention where each query reads window keys exactly and older keys as INT2.

    Query ``t`` (absolute position ``i = L − S + t``) reads key/value ``j ≤ i`` from
    ``k_exact``/``v_exact`` when ``j < prefix`` or ``i − j ≤ recent`` (the sink, the current token
    and the ``recent`` tokens before it) and from ``k_int2``/``v_int2`` otherwise: what a decode
    step at position ``i`` reads from the OSCAR cache. Blocks of ``block`` queries are attended
    at once over only the keys they need, so the cost is about that of one causal attention.

    Args:
        query: ``[B, Hq, S, d]`` (in the same basis as the keys).
        k_exact, v_exact: ``[B, Hkv, L, d]`` window versions (``L ≥ S``).
        k_int2, v_int2: ``[B, Hkv, L, d]`` dequantized INT2 versions.
        prefix, recent: window sizes.
        scale: softmax scale.
        attention_mask: optional ``[B or 1, 1, S, L]`` boolean (True = attend) or additive mask,
            combined with the causal rule (padding).
        block: query rows per block.

    Returns:
        ``[B, Hq, S, d]`` in ``query``'s dtype.
    """
    b, _, s, _ = query.shape
    length = k_exact.shape[2]
    offset = length - s
    dev = query.device
    mask = _bool_mask(attention_mask)
    outs = []
    p = min(prefix, length)
    for a in range(0, s, block):
        e = min(s, a + block)
        i = torch.arange(offset + a, offset + e, device=dev)[:, None]  # absolute query positions
        q_end = max(prefix, offset + e - 1 - recent)  # INT2 keys: prefix <= j <= i - recent - 1
        band = max(prefix, offset + a - recent)  # exact band: max(prefix, i - recent) <= j <= i
        band = min(band, offset + e)
        parts_k = [k_exact[:, :, :p], k_int2[:, :, prefix:q_end], k_exact[:, :, band:offset + e]]
        parts_v = [v_exact[:, :, :p], v_int2[:, :, prefix:q_end], v_exact[:, :, band:offset + e]]
        js = torch.arange(0, p, device=dev)[None, :]
        jq = torch.arange(prefix, max(prefix, q_end), device=dev)[None, :]
        jb = torch.arange(band, offset + e, device=dev)[None, :]
        m = torch.cat([js <= i, (i - jq) > recent, (jb <= i) & ((i - jb) <= recent)], dim=1)
        if mask is not None:
            cols = torch.cat([js[0], jq[0], jb[0]])
            m = m & mask[:, :, a:e][..., cols]
        else:
            m = m[None, None]
        o = _sdpa(query[:, :, a:e], torch.cat(parts_k, 2), torch.cat(parts_v, 2), m, scale)
        outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return torch.nan_to_num(out, nan=0.0) if mask is not None else out


def _exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
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


def _simulate(session: OscarSession, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """The simulated OSCAR attention of one layer; returns ``[B, S, Hq, d]`` like the base functions."""
    oscar = session.oscar
    cfg = oscar.config
    lid = int(getattr(module, "layer_idx", 0))
    dtype = query.dtype
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    tr = oscar.layer(lid, query.device)
    kr = tr.keys(key, oscar.hp_dtype)
    vr = tr.values(value, oscar.hp_dtype)
    k_exact, v_exact = kr.to(dtype), vr.to(dtype)
    needs_int2 = key.shape[2] > cfg.prefix_tokens + cfg.recent_tokens + 1
    k_q = fake_quantize(kr, oscar, "k", dtype) if needs_int2 and oscar.quantize_k else k_exact
    v_q = fake_quantize(vr, oscar, "v", dtype) if needs_int2 and oscar.quantize_v else v_exact
    out_r = simulated_int2_attention(
        tr.queries(query, dtype), k_exact, v_exact, k_q, v_q, prefix=cfg.prefix_tokens, recent=cfg.recent_tokens,
        scale=scale, attention_mask=attention_mask,
    )
    out = tr.output(out_r)
    if session.collect_errors:
        ref = _exact_attention(query, key, value, scale, attention_mask)
        session.errors.add(lid, out, ref)
    return out.transpose(1, 2).contiguous()


def oscar_attention_name(base: str = "sdpa") -> str:
    """Register (once) and return the OSCAR attention implementation wrapping ``base``.

    The registered function (for ``model.set_attn_implementation(name)``):

    * keys coming from an :class:`OscarInt2Cache` layer are already rotated: a decode step (a few new
      tokens, causal mask) runs :func:`~rotationzoo.kernels.decode_attention_int2` on the layer's
      codes; otherwise the query is rotated with ``R_K``, ``base`` (``"sdpa"`` or ``"eager"``)
      attends in the rotated basis, and the output is un-rotated with ``R_Vᵀ``;
    * otherwise, inside :func:`oscar_kv`, the layer runs the decode-time simulation
      (:func:`simulated_int2_attention`);
    * otherwise it is ``base`` unchanged.
    """
    if base not in ("sdpa", "eager"):
        raise EvaluationError(f"the OSCAR attention wraps 'sdpa' or 'eager', got {base!r}")

    def oscar_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        layer = getattr(key, OSCAR_TAG, None)
        if layer is not None:  # real INT2 cache: keys/values are in the rotated basis
            layer.consumed = True
            if layer.pending is not None:  # a decode step: attention read from the codes
                plain = not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
                scale = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
                out = layer.attend(query, attention_mask, float(scale)) if plain else None
                if out is not None:
                    return out.transpose(1, 2), None
                key, value = layer.take_pending()  # a padding mask or another variant: attend the old way
            q = layer.transform.queries(query, query.dtype)
            out, weights = base_attention(module, base)(module, q, key.to(query.dtype), value.to(query.dtype),
                                                        attention_mask, **kwargs)
            return layer.transform.output(out.transpose(1, 2)).transpose(1, 2), weights
        session = ACTIVE_SESSION.get()
        if session is None:
            return base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)
        return _simulate(session, module, query, key, value, attention_mask, kwargs.get("scaling")), None

    return register_attention(f"{OSCAR_IMPL_PREFIX}_{base}", base, oscar_attention_forward)


class oscar_kv:  # noqa: N801 - used as a context manager, like a function
    """Context manager: run ``model`` with OSCAR INT2 keys/values.

    Inside it, ``model(...)`` without a cache (or with an ordinary ``DynamicCache``) runs the
    decode-time simulation (each position sees its own windows exactly and older tokens as INT2),
    and ``model(...)``/``model.generate(...)`` with ``cache=session.new_cache()`` use the real
    INT2 cache. On exit the previous attention implementation is restored.

    Args:
        model: a ``transformers`` decoder whose attention calls ``cache.update`` with post-RoPE
            keys and dispatches through ``AttentionInterface`` (Llama, Mistral, Qwen2/3, ...).
        oscar: the settings and rotations.
        collect_errors: record the per-layer attention-output error of simulated forwards.

    Example::

        pair = rotationzoo.load("SmolLM2-135M-Instruct")
        oscar = OscarKV.from_rotations(pair, pair.config())       # the entry's serving settings
        with oscar_kv(model, oscar) as kv:
            nll = model(ids, labels=ids, use_cache=False).loss          # simulated INT2 KV
            out = model.generate(ids, cache=kv.new_cache(), max_new_tokens=64)   # real INT2 cache
    """

    def __init__(self, model: Any, oscar: OscarKV, *, collect_errors: bool = False) -> None:
        require_transformers()
        self.session = OscarSession(model, oscar, collect_errors)
        self._prev: str | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> OscarSession:
        if ACTIVE_SESSION.get() is not None:
            raise EvaluationError("an OSCAR KV context is already active")
        model = self.session.model
        self._prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
        switch_attention(model, oscar_attention_name(base_implementation(model, OSCAR_IMPL_PREFIX)))
        self._token = ACTIVE_SESSION.set(self.session)
        return self.session

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            ACTIVE_SESSION.reset(self._token)
            self._token = None
        if self._prev is not None:
            switch_attention(self.session.model, self._prev)
