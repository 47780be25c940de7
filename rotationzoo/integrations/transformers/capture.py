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


#: ``on_grad(layer_id, g [n, H_q, d])``: the gradient of a backward pass's loss with respect to one layer's
#: attention output (the input of its ``o_proj``), once per layer per backward.
GradCallback = Callable[[int, torch.Tensor], None]


class OutputGradCapture:
    """Context manager: while active, a backward pass through ``model`` reports, per attention layer, the
    gradient of its loss with respect to the layer's attention output ``o [n, H_q, d]`` (what ``o_proj``
    reads, heads split), the ``g`` of the ``"fisher"`` refinement loss (:mod:`rotationzoo.fit.refine_loss`).

    Attention layers are the modules with a ``layer_idx`` and an ``o_proj`` (Llama, Qwen, Mistral, ...
    in ``transformers``); the forward must run with autograd on (``torch.enable_grad()`` and an input that
    requires grad, e.g. ``inputs_embeds``), the callback fires during ``loss.backward()``.

    Raises:
        EvaluationError: the model has no such attention layer.
    """

    def __init__(self, model: Any, on_grad: GradCallback) -> None:
        self.model = model
        self.on_grad = on_grad
        self._hooks: list[Any] = []
        self._layers = [(int(m.layer_idx), m) for m in model.modules()
                        if getattr(m, "layer_idx", None) is not None and isinstance(getattr(m, "o_proj", None), torch.nn.Module)]
        if not self._layers:
            raise EvaluationError(f"{type(model).__name__}: no attention layer with o_proj found; output gradients "
                                  f"cannot be captured for this model")

    def __enter__(self) -> "OutputGradCapture":
        for lid, attn in self._layers:
            self._hooks.append(attn.o_proj.register_forward_pre_hook(self._pre_hook(lid, attn)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _pre_hook(self, layer_id: int, attn: torch.nn.Module) -> Callable[..., None]:
        d = int(getattr(attn, "head_dim"))

        def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0]
            if not x.requires_grad:
                return
            x.register_hook(lambda g: self.on_grad(layer_id, g.detach().reshape(-1, g.shape[-1] // d, d)))
        return pre
