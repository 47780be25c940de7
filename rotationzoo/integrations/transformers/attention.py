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
from .cache import cache_classes
from .common import (base_attention, base_implementation, cache_argument, register_attention, require_transformers,
                     switch_attention)
from .oscar import ACTIVE_SESSION, OSCAR_IMPL_PREFIX, OSCAR_TAG, OscarKV, fake_quantize
from .simulate import exact_attention, kivi_boundaries, simulated_attention, simulated_int2_attention
from .windows import visible


class _LayerErrors:
    """Running ``Σ‖o − o_ref‖²`` and ``Σ‖o_ref‖²`` per (layer, KV head) (fp64); a layer's are its heads' sums."""

    def __init__(self) -> None:
        self.num: dict[tuple[int, int], float] = {}
        self.den: dict[tuple[int, int], float] = {}

    def add(self, layer_id: int, out: torch.Tensor, ref: torch.Tensor, num_kv_heads: int) -> None:
        """Add one forward's attention outputs ``[B, Hq, S, d]``; a KV head's error is over its query heads."""
        b = out.shape[0]
        diff = (out.double() - ref.double()).pow(2).reshape(b, num_kv_heads, -1).sum((0, 2)).tolist()
        norm = ref.double().pow(2).reshape(b, num_kv_heads, -1).sum((0, 2)).tolist()
        for h in range(num_kv_heads):
            self.num[(layer_id, h)] = self.num.get((layer_id, h), 0.0) + diff[h]
            self.den[(layer_id, h)] = self.den.get((layer_id, h), 0.0) + norm[h]

    def relative(self, heads: bool = False) -> dict[Any, float]:
        """``{layer_id: ‖o − o_ref‖_F / ‖o_ref‖_F}`` over everything added (``heads``: keyed by
        ``(layer_id, KV head)``)."""
        num: dict[Any, float] = {}
        den: dict[Any, float] = {}
        for key in sorted(self.num):
            unit = key if heads else key[0]
            num[unit] = num.get(unit, 0.0) + self.num[key]
            den[unit] = den.get(unit, 0.0) + self.den[key]
        return {k: (num[k] / den[k]) ** 0.5 if den[k] > 0 else 0.0 for k in num}


class OscarSession:
    """What :func:`oscar_kv` yields: the settings, a cache factory and the attention-output error statistics.

    Attributes:
        model: the model.
        oscar: the :class:`OscarKV` settings.
        collect_errors: whether simulated forwards also run exact attention and record
            ``‖o − o_fp‖ / ‖o_fp‖`` per layer and per KV head (one more attention per layer).
        errors: the running error sums (see :meth:`layer_errors` and :meth:`head_errors`).
    """

    def __init__(self, model: Any, oscar: OscarKV, collect_errors: bool = False) -> None:
        self.model = model
        self.oscar = oscar
        self.collect_errors = collect_errors
        self.errors = _LayerErrors()
        self.row_mask: torch.Tensor | None = None
        self._pads: tuple[Any, list[int] | None] = (None, None)

    def note_inputs(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of the model: keep the forward's 2-D ``attention_mask`` (``[batch, tokens]``), from
        which a new cache's layers read each sequence's leading padding (:meth:`leading_pads`)."""
        mask = kwargs.get("attention_mask")
        self.row_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def forget_inputs(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook of the model (run even when the forward fails): the mask belongs to that forward only, so
        a later forward that bypasses the hook (the inner model called directly) assumes no padding."""
        self.row_mask = None

    def leading_pads(self, batch: int) -> list[int] | None:
        """Per sequence of the current forward, how many masked tokens come before its first one (a left-padded
        batch); ``None`` without a 2-D mask of ``batch`` rows. Read on the host once per forward."""
        mask = self.row_mask
        if mask is None or mask.shape[0] != batch:
            return None
        if self._pads[0] is not mask:
            self._pads = (mask, [int(n) for n in ((mask != 0).cumsum(-1) == 0).sum(-1).tolist()])
        return self._pads[1]

    def new_cache(self) -> Any:
        """A fresh :class:`OscarInt2Cache` for this model: pass it as ``cache=`` to ``model(...)`` or
        ``model.generate(...)`` (transformers 5.24 and later; ``past_key_values=`` before: :meth:`cache_kwargs`
        picks the one the installed version reads)."""
        return cache_classes()["OscarInt2Cache"](self.oscar, config=self.model.config)

    def cache_kwargs(self) -> dict[str, Any]:
        """``{"cache": self.new_cache()}``, or ``{"past_key_values": …}`` where the installed transformers
        predates ``cache=`` (:func:`~.common.cache_argument`): ``model.generate(**inputs, **kv.cache_kwargs())``
        runs on either."""
        return {cache_argument(): self.new_cache()}

    def layer_errors(self) -> dict[int, float]:
        """Per-layer relative attention-output error of the simulated forwards so far."""
        return self.errors.relative()

    def head_errors(self) -> dict[tuple[int, int], float]:
        """The same per (layer, KV head): the error of the query heads that read that KV head."""
        return self.errors.relative(heads=True)

    def reset_errors(self) -> None:
        """Forget the error statistics."""
        self.errors = _LayerErrors()


def _simulate(session: OscarSession, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """The simulated cache attention of one layer, in the session's format; returns ``[B, S, Hq, d]`` like
    the base functions."""
    if session.oscar.kv_format.mixed and getattr(module, "layer_idx", None) is None:
        raise EvaluationError(f"{session.oscar.kv_format.name}: mixed code widths need each attention module's "
                              f"layer_idx, and {type(module).__name__} has none")
    lid = int(getattr(module, "layer_idx", 0))
    oscar = session.oscar.for_layer(lid)
    fmt = oscar.kv_format
    dtype = query.dtype
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    tr = oscar.layer(lid, query.device)
    kr = tr.keys(key, oscar.hp_dtype)
    vr = tr.values(value, oscar.hp_dtype)
    k_exact, v_exact = kr.to(dtype), vr.to(dtype)
    kivi = fmt.axis == "kivi"
    pads = session.leading_pads(query.shape[0]) if fmt.prefix_tokens and not kivi else None
    sink_ends = [n + fmt.prefix_tokens for n in pads] if pads and any(pads) else None  # each sequence's own sink
    first = min(sink_ends) if sink_ends else fmt.prefix_tokens
    needs = key.shape[2] > (fmt.recent_tokens if kivi else first + fmt.recent_tokens + 1)
    k_q = fake_quantize(kr, oscar, "k", dtype) if needs and oscar.quantize_k else k_exact
    v_q = fake_quantize(vr, oscar, "v", dtype) if needs and oscar.quantize_v else v_exact
    wide = list(session.oscar.kv_format.wide_heads_of(lid))
    if wide and max(wide) >= kr.shape[1]:
        raise EvaluationError(f"{session.oscar.kv_format.name} widens KV head {lid}.{max(wide)}, but layer {lid} has "
                              f"{kr.shape[1]} KV heads (0 to {kr.shape[1] - 1})")
    if wide and needs:  # mixed widths per KV head: those heads read back the wide format's rows (rows are
        wide_kv = session.oscar.wide_view()  # quantized one by one: only the widened heads' rows are needed)
        if oscar.quantize_k:
            k_q = k_q.clone()
            k_q[:, wide] = fake_quantize(kr[:, wide], wide_kv, "k", dtype)
        if oscar.quantize_v:
            v_q = v_q.clone()
            v_q[:, wide] = fake_quantize(vr[:, wide], wide_kv, "v", dtype)
    q = tr.queries(query, dtype)
    if kivi:
        out_r = simulated_attention(q, k_exact, v_exact, k_q, v_q, prefix=0, scale=scale,
                                    boundaries=lambda i: kivi_boundaries(i, fmt.recent_tokens),
                                    attention_mask=attention_mask)
    else:
        out_r = simulated_int2_attention(q, k_exact, v_exact, k_q, v_q, prefix=fmt.prefix_tokens,
                                         recent=fmt.recent_tokens, scale=scale, attention_mask=attention_mask,
                                         sink_ends=sink_ends)
    out = tr.output(out_r)
    if session.collect_errors:
        ref = exact_attention(query, key, value, scale, attention_mask)
        session.errors.add(lid, out, ref, key.shape[1])
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
            if layer.slots.starts is not None:  # a padded batch: each sequence off its padding, as the kernel path
                end, s = layer.cumulative_length, query.shape[2]
                padded = layer.slots.padding_mask(visible(attention_mask), end, layer._first(end, s), s, query.dtype)
                attention_mask = attention_mask if padded is None else padded
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
        collect_errors: record the attention-output error of simulated forwards per layer and per KV head.

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
        self._hooks: list[Any] = []

    def __enter__(self) -> OscarSession:
        if ACTIVE_SESSION.get() is not None:
            raise EvaluationError("an OSCAR KV context is already active")
        model = self.session.model
        self._prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
        switch_attention(model, oscar_attention_name(base_implementation(model, OSCAR_IMPL_PREFIX)))
        self._token = ACTIVE_SESSION.set(self.session)
        self._hooks = [model.register_forward_pre_hook(self.session.note_inputs, with_kwargs=True),
                       model.register_forward_hook(self.session.forget_inputs, with_kwargs=True, always_call=True)]
        return self.session

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.session.row_mask, self.session._pads = None, (None, None)
        if self._token is not None:
            ACTIVE_SESSION.reset(self._token)
            self._token = None
        if self._prev is not None:
            switch_attention(self.session.model, self._prev)
