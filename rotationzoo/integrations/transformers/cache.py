"""A ``transformers`` cache that stores keys/values OSCAR-style: rotated, INT2 outside the windows.

The classes subclass transformers' cache API (``CacheLayerMixin``, transformers ≥ 4.56; tested with
5.24), so they are defined on first use (:func:`cache_classes`); import them from
:mod:`rotationzoo.integrations.transformers`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...errors import EvaluationError
from .common import require_transformers
from .oscar import OSCAR_TAG, LayerTransform, OscarKV, dequantize_rows, quantize_rows


class _LayerBody:
    """One layer of :class:`OscarInt2Cache`.

    Storage (all ``[B, H_kv, n, ·]``, in the rotated basis): ``sink_k/v`` (first ``prefix``
    tokens, ``hp_dtype``), INT2 ``codes_k/v`` (uint8 ``[..., d/4]``) with ``sz_k/v``
    (``[..., 2·d/G]`` in ``scale_dtype``), and ``recent_k/v`` (the last ``recent`` tokens,
    ``hp_dtype``). ``update`` returns the history dequantized plus the new tokens, tagged so
    that the OSCAR attention knows they are rotated.
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, oscar: OscarKV, layer_idx: int) -> None:
        super().__init__()
        self.oscar = oscar
        self.layer_idx = int(layer_idx)
        self.cumulative_length = 0
        self.r_k: torch.Tensor | None = None
        self.r_v: torch.Tensor | None = None
        self.transform = LayerTransform(None, None)
        self.consumed = True
        self._clear()

    def _clear(self) -> None:
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.recent_k: torch.Tensor | None = None
        self.recent_v: torch.Tensor | None = None
        self.codes_k: torch.Tensor | None = None
        self.codes_v: torch.Tensor | None = None
        self.sz_k: torch.Tensor | None = None
        self.sz_v: torch.Tensor | None = None
        self.cumulative_length = 0
        self.consumed = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        wdt = self.oscar.hp_dtype
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.transform = self.oscar.layer(self.layer_idx, self.device)
        self.r_k, self.r_v = self.transform.r_k, self.transform.r_v
        empty = lambda n: key_states.new_zeros((b, h, 0, n), dtype=wdt)  # noqa: E731
        self.sink_k, self.recent_k = empty(d), empty(d)
        self.sink_v, self.recent_v = empty(dv), empty(dv)
        self.is_initialized = True

    def _int2(self, side: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return getattr(self, f"codes_{side}"), getattr(self, f"sz_{side}")

    def _history(self, side: str) -> torch.Tensor:
        sink, recent = getattr(self, f"sink_{side}"), getattr(self, f"recent_{side}")
        codes, sz = self._int2(side)
        parts = [sink.to(self.dtype)]
        if codes is not None and codes.shape[2]:
            if (self.oscar.quantize_k if side == "k" else self.oscar.quantize_v):
                assert sz is not None
                parts.append(dequantize_rows(codes, sz, self.oscar, self.dtype))
            else:
                parts.append(codes.to(self.dtype))  # kept unquantized (quantize_<side>=False)
        parts.append(recent.to(self.dtype))
        return torch.cat(parts, dim=2)

    def _store(self, side: str, x: torch.Tensor) -> None:
        """Append rotated window-dtype rows ``x [B, H, n, d]``; demote what leaves the window.

        Rows demoted by a multi-token update (a prefill) get the exact clip threshold, as the
        SGLang prefill store; rows demoted by a one-token update (decode) get
        ``config.clip_search`` (``"bisect"`` is the fork's decode-flush search).
        """
        o = self.oscar
        cfg = o.config
        sink = getattr(self, f"sink_{side}")
        take = min(max(cfg.prefix_tokens - sink.shape[2], 0), x.shape[2])
        if take:
            setattr(self, f"sink_{side}", torch.cat([sink, x[:, :, :take]], dim=2))
        recent = torch.cat([getattr(self, f"recent_{side}"), x[:, :, take:]], dim=2)
        extra = recent.shape[2] - cfg.recent_tokens
        if extra > 0:
            old, recent = recent[:, :, :extra], recent[:, :, extra:]
            codes, sz = self._int2(side)
            if o.quantize_k if side == "k" else o.quantize_v:
                c, s = quantize_rows(old, o, side, clip_search="exact" if x.shape[2] > 1 else None)
            else:  # not quantized: keep the rows in the codes slot
                c, s = old, old.new_zeros(old.shape[:-1] + (0,))
            setattr(self, f"codes_{side}", c if codes is None else torch.cat([codes, c], dim=2))
            setattr(self, f"sz_{side}", s if sz is None else torch.cat([sz, s], dim=2))
        setattr(self, f"recent_{side}", recent.contiguous())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.consumed:
            raise EvaluationError(
                "OscarInt2Cache returned rotated keys that were not read by the OSCAR attention: run the model "
                "inside rotationzoo.integrations.transformers.oscar_kv(model, ...)"
            )
        wdt = self.oscar.hp_dtype
        kr = self.transform.keys(key_states, wdt)
        vr = self.transform.values(value_states, wdt)
        keys = torch.cat([self._history("k"), kr.to(self.dtype)], dim=2)
        values = torch.cat([self._history("v"), vr.to(self.dtype)], dim=2)
        self._store("k", kr)
        self._store("v", vr)
        self.cumulative_length += key_states.shape[2]
        setattr(keys, OSCAR_TAG, self)
        self.consumed = False
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("OscarInt2Cache cannot be cropped (INT2 tokens cannot be restored)")

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in ("sink_k", "sink_v", "recent_k", "recent_v", "codes_k", "codes_v", "sz_k", "sz_v"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._map_batch(lambda t: t[indices, ...])

    def offload(self) -> None:  # pragma: no cover - not supported
        pass

    def prefetch(self) -> None:  # pragma: no cover - not supported
        pass

    def nbytes(self) -> int:
        """Bytes held by this layer (windows, codes, scales/zeros)."""
        total = 0
        for name in ("sink_k", "sink_v", "recent_k", "recent_v", "codes_k", "codes_v", "sz_k", "sz_v"):
            t = getattr(self, name)
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def stored_tokens(self) -> dict[str, int]:
        """``{"prefix": …, "int2": …, "recent": …}`` token counts held."""
        if not self.is_initialized:
            return {"prefix": 0, "int2": 0, "recent": 0}
        assert self.sink_k is not None and self.recent_k is not None
        n_int2 = self.codes_k.shape[2] if self.codes_k is not None else 0
        return {"prefix": self.sink_k.shape[2], "int2": n_int2, "recent": self.recent_k.shape[2]}


class _CacheBody:
    """A ``transformers`` cache that stores keys/values OSCAR-style: rotated, INT2 outside the windows.

    Use it inside :func:`oscar_kv` (whose attention rotates the query and un-rotates the
    output)::

        with oscar_kv(model, oscar) as kv:
            out = model.generate(**inputs, cache=kv.new_cache(), max_new_tokens=64)

    Per layer, the first ``prefix`` tokens and the last ``recent`` tokens are kept rotated in
    ``hp_dtype``; each token leaving the recent window is clipped and INT2-quantized with
    :func:`rotationzoo.kernels.quantize_int2` (Triton on CUDA, the PyTorch reference on CPU) and
    only its codes and scales/zeros are kept. A forward over several new tokens (a prefill)
    attends to those new tokens exactly among themselves, as the SGLang fork's prefill does;
    decode steps read the INT2 history.

    Args:
        oscar: settings and rotations.
        config: the model config (for the layer count).
        num_layers: the layer count, if no config is given.
    """

    def __init__(self, oscar: OscarKV, config: Any = None, num_layers: int | None = None) -> None:
        if num_layers is None:
            if config is None:
                raise EvaluationError("OscarInt2Cache needs the model config or num_layers")
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            num_layers = int(text.num_hidden_layers)
        self.oscar = oscar
        self.layers: list[Any]
        super().__init__(layers=[cache_classes()["OscarInt2Layer"](oscar, i) for i in range(num_layers)])  # type: ignore[call-arg]

    def nbytes(self) -> int:
        """Bytes held by all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element (codes, scales/zeros and windows over all layers)."""
        elems = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, d = layer.sink_k.shape
                elems += 2 * b * h * d * layer.cumulative_length
        return 8.0 * self.nbytes() / elems if elems else 0.0


_CACHE_CLASSES: dict[str, type] = {}


def cache_classes() -> dict[str, type]:
    """Define (once, importing transformers) ``OscarInt2Layer`` and ``OscarInt2Cache``: the bodies
    above mixed into transformers' cache bases, which are only importable with transformers."""
    if _CACHE_CLASSES:
        return _CACHE_CLASSES
    require_transformers()
    from transformers.cache_utils import Cache, CacheLayerMixin

    layer = type("OscarInt2Layer", (_LayerBody, CacheLayerMixin), {"__doc__": _LayerBody.__doc__,
                                                                    "__module__": __name__})
    cache = type("OscarInt2Cache", (_CacheBody, Cache), {"__doc__": _CacheBody.__doc__, "__module__": __name__})
    _CACHE_CLASSES.update(OscarInt2Layer=layer, OscarInt2Cache=cache)
    return _CACHE_CLASSES


def __getattr__(name: str) -> Any:
    if name in ("OscarInt2Cache", "OscarInt2Layer"):
        return cache_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
