"""What a layer of :class:`~rotationzoo.integrations.transformers.cache.OscarInt2Cache` attends to: the
sliding window of each layer of a model, and the attention mask as booleans on the device."""

from __future__ import annotations

import weakref
from typing import Any

import torch


# (weak reference to an additive mask, its boolean form), replaced as one tuple so that a thread never reads
# one mask's reference with another mask's booleans
_LAST_MASK: list[tuple[Any, torch.Tensor] | None] = [None]


def visible(mask: torch.Tensor | None) -> torch.Tensor | None:
    """``mask`` as booleans (True = may attend): a boolean mask as it is, an additive one compared with
    half its dtype's minimum on the device (once per forward: every layer gets the same mask object)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    last = _LAST_MASK[0]
    if last is not None and last[0]() is mask:
        return last[1]
    allowed = mask > torch.finfo(mask.dtype).min / 2
    _LAST_MASK[0] = (weakref.ref(mask), allowed)
    return allowed


def sliding_windows(config: Any) -> list[int | None]:
    """Per decoder layer of the model ``config``: its sliding window (``sliding_attention`` and
    ``chunked_attention`` layers, as transformers' own caches read them), else ``None``."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older transformers: the config's own fields
        types = getattr(text, "layer_types", None) or ["full_attention"] * layers
        window = getattr(text, "sliding_window", None)
        return [window if t == "sliding_attention" and window else None for t in types][:layers]
    types, kwargs = get_layer_types_and_kwargs(text)
    return [kw.get("sliding_window") if t in ("sliding_attention", "chunked_attention", "hybrid_sliding") else None
            for t, kw in zip(types, kwargs)][:layers]


__all__ = ["sliding_windows", "visible"]
