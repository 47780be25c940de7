"""Pieces shared by the transformers modules: the dependency check, the name a model takes its cache by, and
attention switching."""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from ...errors import EvaluationError, MissingDependencyError


def require_transformers() -> Any:
    """The ``transformers`` module, or :class:`MissingDependencyError` naming the extra to install."""
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError("transformers", "transformers", what="this") from None
    return transformers


def cache_argument() -> str:
    """The keyword ``model(...)`` and ``model.generate(...)`` take a cache by in the installed transformers:
    ``"cache"`` from 5.24 on (where ``past_key_values`` is deprecated), ``"past_key_values"`` before (every
    version Python 3.10 installs, up to 5.20.2)."""
    require_transformers()
    from transformers.generation import utils

    return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


def switch_attention(model: Any, name: str) -> None:
    """Make ``model`` dispatch attention to the registered implementation ``name``."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            if getattr(model.config, "_attn_implementation", None) == name:
                return
        except (ValueError, KeyError, ImportError):
            pass
    for module in model.modules():  # older versions / models without the setter
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def base_implementation(model: Any, prefix: str) -> str:
    """The implementation a wrapper registered under ``prefix`` should wrap (``"sdpa"``/``"eager"``)."""
    prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
    base = prev[len(prefix) + 1:] if prev.startswith(prefix) else prev
    return base if base in ("sdpa", "eager") else "sdpa"


def base_attention(module: torch.nn.Module, base: str) -> Callable[..., Any]:
    """The model's own ``eager`` attention function, or the registered ``sdpa`` one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise EvaluationError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def register_attention(name: str, base: str, forward: Callable[..., Any]) -> str:
    """Register ``forward`` as attention implementation ``name`` (once), with ``base``'s mask builder."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:  # newer versions pick the mask builder by implementation name
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - older transformers build masks independently of the name
        ALL_MASK_ATTENTION_FUNCTIONS = AttentionMaskInterface = None  # type: ignore[assignment,misc]
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    AttentionInterface.register(name, forward)
    if AttentionMaskInterface is not None:
        mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_base])
    return name
