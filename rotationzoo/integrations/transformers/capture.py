"""Capturing post-RoPE Q/K/V as the model hands them to its attention kernel.

A registered attention function records ``query [B, H_q, S, d]``, ``key``/``value [B, H_kv, S, d]``
(after q_norm/k_norm and RoPE, the same point where the OSCAR SGLang dump hook reads them) and then
calls the model's original implementation (``sdpa`` or ``eager``), so the forward pass is unchanged.
The matching mask function is registered too, so causal masking is the original one.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch

from ...errors import EvaluationError
from .common import base_attention, base_implementation, register_attention, require_transformers, switch_attention

#: Prefix of the attention implementations registered for capture (one per base implementation).
CAPTURE_IMPL_PREFIX = "rotationzoo_qkv_capture"
#: ``on_qkv(layer_id, q [n, H_q, d], k [n, H_kv, d], v [n, H_kv, d])``, called once per layer per forward.
QKVCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]

_ACTIVE_CAPTURE: contextvars.ContextVar["QKVCapture | None"] = contextvars.ContextVar(
    "rotationzoo_active_capture", default=None
)


def capture_attention_name(base: str) -> str:
    """Register (once) and return the capture implementation wrapping ``base`` (``"sdpa"``/``"eager"``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise EvaluationError(f"cannot capture attention implementation {base!r}; use 'sdpa' or 'eager'")

    def capture_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        capture = _ACTIVE_CAPTURE.get()
        if capture is not None:
            capture.record(module, query, key, value)
        return base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)

    return register_attention(f"{CAPTURE_IMPL_PREFIX}_{base}", base, capture_attention_forward)


class QKVCapture:
    """Context manager: while active, every attention call of ``model`` reports its Q/K/V.

    The callback receives per layer ``q [n, H_q, d]``, ``k [n, H_kv, d]``, ``v [n, H_kv, d]``
    (the model's dtype and device; views, copy them to keep them), ``n = B·S`` new tokens in batch
    order. Only the new tokens of a forward are reported (cached ones are not).

    Args:
        model: a ``transformers`` model whose attention goes through ``AttentionInterface``.
        on_qkv: the callback.

    Example::

        with QKVCapture(model, lambda layer, q, k, v: print(layer, q.shape)):
            model(input_ids, use_cache=False)
    """

    def __init__(self, model: Any, on_qkv: QKVCallback) -> None:
        require_transformers()
        self.model = model
        self.on_qkv = on_qkv
        self._prev_impl: str | None = None
        self._token: contextvars.Token | None = None
        self._fallback_ids: dict[int, int] = {}

    def __enter__(self) -> "QKVCapture":
        if _ACTIVE_CAPTURE.get() is not None:
            raise EvaluationError("a Q/K/V capture is already active in this context")
        self._prev_impl = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        switch_attention(self.model, capture_attention_name(base_implementation(self.model, CAPTURE_IMPL_PREFIX)))
        self._token = _ACTIVE_CAPTURE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE_CAPTURE.reset(self._token)
            self._token = None
        if self._prev_impl is not None:
            switch_attention(self.model, self._prev_impl)

    def _layer_id(self, module: torch.nn.Module) -> int:
        lid = getattr(module, "layer_idx", None)
        if lid is None:
            lid = self._fallback_ids.setdefault(id(module), len(self._fallback_ids))
        return int(lid)

    def record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Report the new tokens of one attention call to the callback."""
        b, hq, s, d = query.shape
        hkv = key.shape[1]
        k = key[:, :, -s:, :]
        v = value[:, :, -s:, :]
        q_flat = query.transpose(1, 2).reshape(b * s, hq, d)
        k_flat = k.transpose(1, 2).reshape(b * s, hkv, d)
        v_flat = v.transpose(1, 2).reshape(b * s, hkv, v.shape[-1])
        self.on_qkv(self._layer_id(module), q_flat, k_flat, v_flat)
