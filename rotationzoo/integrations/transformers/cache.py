"""A ``transformers`` cache that stores keys/values OSCAR-style: rotated, INT2 outside the windows.

The classes subclass transformers' cache API (``CacheLayerMixin``, transformers ≥ 4.56; tested with
5.25 and 5.20), so they are defined on first use (:func:`cache_classes`); import them from
:mod:`rotationzoo.integrations.transformers`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...errors import EvaluationError
from ...kernels import Int2KV, decode_attention_int2
from ...kernels.decode_plan import DECODE_MAX_QUERIES
from .common import require_transformers
from .slots import Slots
from .windows import sliding_windows, visible
from .oscar import (
    ACTIVE_SESSION,
    OSCAR_IMPL_PREFIX,
    OSCAR_TAG,
    LayerTransform,
    OscarKV,
    dequantize_rows,
    int2_store,
    quantize_rows,
)

INT2_GROWTH_TOKENS = 256
"""Fewest tokens of room added when an INT2 buffer of the cache is full (it grows by an eighth)."""

CROP_TOKENS = 128
"""Most rows demoted to INT2 by the last forward also kept in ``hp_dtype``, so that :meth:`crop` can undo it."""

_INT2_NAMES = ("codes_k", "sz_k", "codes_v", "sz_v")
_WINDOW_NAMES = ("sink_k", "sink_v", "recent_k", "recent_v")


class _LayerBody:
    """One layer of :class:`OscarInt2Cache`.

    Storage (all ``[B, H_kv, n, ·]``, in the rotated basis): ``sink_k/v`` (first ``prefix`` tokens of each
    sequence, after its padding, ``hp_dtype``), INT2 ``codes_k/v`` (uint8 ``[..., d/4]``) with ``sz_k/v``
    (``[..., 2·d/G]`` in ``scale_dtype``), and ``recent_k/v`` (the last ``recent`` tokens,
    ``hp_dtype``). The INT2 tier lives in buffers with room for more tokens (grown by an eighth, at
    least :data:`INT2_GROWTH_TOKENS`), so demoting a token does not copy the history.

    A forward of up to :data:`~rotationzoo.kernels.decode_plan.DECODE_MAX_QUERIES` new tokens (a
    decode step) stores them and keeps a view of what they attend to; the OSCAR attention then calls
    :meth:`attend`, which reads the codes directly (:func:`~rotationzoo.kernels.decode_attention_int2`)
    with the model's attention mask, if any, read on the device (no host synchronisation). A longer
    forward (a prefill) gets the history dequantized plus the new tokens, as before. Either way the
    returned key tensor is tagged so that the OSCAR attention knows it comes from this layer.
    A sliding-window layer (``sliding_window`` ``W``) keeps only the last ``W − 1`` tokens, as transformers'
    sliding layers do: what falls out leaves the sink, then the front of the INT2 tier (no copy). Which slots
    each tier holds (each sequence's own sink in a left-padded batch): :class:`~.slots.Slots`.
    """

    is_compileable = False
    is_croppable = True  # the last forward's tokens, exactly (crop)
    supports_early_init = False

    def __init__(self, oscar: OscarKV, layer_idx: int, sliding_window: int | None = None) -> None:
        super().__init__()
        self.oscar = oscar
        self.layer_idx = int(layer_idx)
        self.sliding_window = None if sliding_window is None else int(sliding_window)
        self.is_sliding = self.sliding_window is not None
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
        self._buf: dict[str, torch.Tensor | None] = dict.fromkeys(_INT2_NAMES)
        self._n_int2 = {"k": 0, "v": 0}  # the INT2 tier is buf[:, :, lo:n] of each side
        self._int2_lo = {"k": 0, "v": 0}
        self._slid = False  # the last forward dropped tokens out of the sliding window
        self.pending: tuple[Int2KV, Int2KV] | None = None
        self.cumulative_length = 0
        self.consumed = True
        # what the last forward did, so that crop() can undo it: its token count, and the rows it demoted to
        # INT2 (at most CROP_TOKENS, the newest) kept in hp_dtype as well
        self._last_tokens = 0
        self._demoted: dict[str, torch.Tensor | None] = {"k": None, "v": None}
        self._demoted_count = {"k": 0, "v": 0}
        self.slots = Slots()  # which slots each tier holds (each sequence's own sink in a left-padded batch)

    # the INT2 tier: views of the buffers
    def _int2_view(self, name: str) -> torch.Tensor | None:
        buf = self._buf[name]
        side = name[-1]
        return None if buf is None else buf[:, :, self._int2_lo[side]: self._n_int2[side]]

    codes_k = property(lambda self: self._int2_view("codes_k"), doc="INT2 key codes ``[B, H_kv, N, d/4]``.")
    sz_k = property(lambda self: self._int2_view("sz_k"), doc="Key scales/zeros ``[B, H_kv, N, 2·d/G]``.")
    codes_v = property(lambda self: self._int2_view("codes_v"), doc="INT2 value codes.")
    sz_v = property(lambda self: self._int2_view("sz_v"), doc="Value scales/zeros.")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = int2_store(self.oscar, self.layer_idx, key_states.shape[-1], value_states.shape[-1])  # before any row
        self.device = key_states.device
        self.dtype = key_states.dtype
        wdt = self.oscar.hp_dtype
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        self.transform = self.oscar.layer(self.layer_idx, self.device)
        self.transform.keys(key_states[:, :, :0], wdt)  # one line if the rotations do not fit, before anything is kept
        self.transform.values(value_states[:, :, :0], wdt)
        self.r_k, self.r_v = self.transform.r_k, self.transform.r_v
        empty = lambda n: key_states.new_zeros((b, h, 0, n), dtype=wdt)  # noqa: E731
        session = ACTIVE_SESSION.get()
        pads = session.leading_pads(b) if session is not None else None  # a left-padded batch
        self.slots = Slots.of(cfg.prefix_tokens, pads, self.device, key_states.shape[2])
        self.sink_k, self.recent_k = empty(d), empty(d)
        self.sink_v, self.recent_v = empty(dv), empty(dv)
        self.is_initialized = True

    def _append_int2(self, side: str, codes: torch.Tensor, sz: torch.Tensor) -> None:
        """Write demoted rows after the INT2 tokens of ``side``, growing the buffers when full (a sliding
        layer's dropped front is not copied)."""
        lo, n, extra = self._int2_lo[side], self._n_int2[side], codes.shape[2]
        full = any(self._buf[name] is None or self._buf[name].shape[2] < n + extra  # type: ignore[union-attr]
                   for name in (f"codes_{side}", f"sz_{side}"))
        for name, rows in ((f"codes_{side}", codes), (f"sz_{side}", sz)):
            buf = self._buf[name]
            if full:
                cap = n - lo + extra + max(INT2_GROWTH_TOKENS, (n - lo + extra) // 8)
                grown = rows.new_empty(rows.shape[:2] + (cap,) + rows.shape[3:])
                if buf is not None:
                    grown[:, :, : n - lo] = buf[:, :, lo:n]
                self._buf[name] = buf = grown
            assert buf is not None
            start = n - lo if full else n
            buf[:, :, start:start + extra] = rows
        if full:
            self._int2_lo[side], n = 0, n - lo
        self._n_int2[side] = n + extra

    def _history(self, side: str) -> torch.Tensor:
        sink, recent = getattr(self, f"sink_{side}"), getattr(self, f"recent_{side}")
        parts = (sink, getattr(self, f"codes_{side}"), getattr(self, f"sz_{side}"), recent)
        return self._materialize(side, parts, self.cumulative_length, self._first(self.cumulative_length, 0))

    def _first(self, end: int, new: int) -> int:
        """The first slot the model's mask covers when ``new`` of the slots to ``end`` are new (sliding: W − 1 more)."""
        return 0 if self.sliding_window is None else max(0, end - new - (self.sliding_window - 1))

    def _materialize(self, side: str, parts: tuple, end: int, first: int) -> torch.Tensor:
        """Slots ``[first, end)``, ``[sink | INT2 dequantized | recent]`` in the cache dtype (the prefill path's)."""
        sink, codes, sz, recent = parts
        tier = []
        if codes is not None and codes.shape[2]:
            if self.oscar.quantize_k if side == "k" else self.oscar.quantize_v:
                tier.append(dequantize_rows(codes, sz, self.oscar, self.dtype))
            else:
                tier.append(codes.to(self.dtype))  # kept unquantized (quantize_<side>=False)
        tier.append(recent.to(self.dtype))
        return self.slots.merge(sink.to(self.dtype), torch.cat(tier, dim=2), end, first)

    def _store(self, side: str, x: torch.Tensor) -> Int2KV:
        """Append rotated window-dtype rows ``x [B, H, n, d]``; demote what leaves the window.

        Returns what the new rows attend to: the sink, the INT2 tier and the recent rows as they were
        before the demotion, with ``x`` appended (so the rows that leave the recent window now are
        still read exactly by the tokens that push them out, as in the simulation).

        Rows demoted by a multi-token update (a prefill) get the exact clip threshold, as the
        SGLang prefill store; rows demoted by a one-token update (decode) get
        ``config.clip_search`` (``"bisect"`` is the fork's decode-flush search).
        """
        o = self.oscar
        cfg = int2_store(o)
        sink = getattr(self, f"sink_{side}")
        start, n = self.cumulative_length, x.shape[2]
        sink, skip = self.slots.store(sink, x, start)  # each sequence's first prefix tokens; the tier's first slot
        setattr(self, f"sink_{side}", sink)
        recent = torch.cat([getattr(self, f"recent_{side}"), x[:, :, skip:]], dim=2)
        view = Int2KV(sink, getattr(self, f"codes_{side}"), getattr(self, f"sz_{side}"), recent)
        extra = recent.shape[2] - cfg.recent_tokens
        self._demoted[side], self._demoted_count[side] = None, max(extra, 0)
        if extra > 0:
            old, recent = recent[:, :, :extra], recent[:, :, extra:]
            if o.quantize_k if side == "k" else o.quantize_v:
                c, s = quantize_rows(old, o, side, clip_search="exact" if x.shape[2] > 1 else None)
            else:  # not quantized: keep the rows in the codes slot
                c, s = old, old.new_zeros(old.shape[:-1] + (0,))
            self._append_int2(side, c, s)
            self._demoted[side] = old[:, :, -CROP_TOKENS:].clone()
        setattr(self, f"recent_{side}", recent.contiguous())
        if self.sliding_window is not None:
            self._slide(side, start + n)
        return view

    def _slide(self, side: str, end: int) -> None:
        """Drop the slots of ``side`` before the last ``sliding_window − 1`` of ``end``: from the sink, then the
        front of the INT2 tier, then of the recent rows (the view a pending step reads stays as it was)."""
        assert self.sliding_window is not None
        sink, recent = getattr(self, f"sink_{side}"), getattr(self, f"recent_{side}")
        int2 = self._n_int2[side] - self._int2_lo[side]
        from_sink, from_tier = self.slots.dropped(sink.shape[2], int2 + recent.shape[2], end, self.sliding_window)
        self._slid, from_int2 = self._slid or bool(from_sink or from_tier), min(from_tier, int2)
        setattr(self, f"sink_{side}", sink[:, :, from_sink:])
        self._int2_lo[side] += from_int2
        setattr(self, f"recent_{side}", recent[:, :, from_tier - from_int2:])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        session = ACTIVE_SESSION.get()
        impl = getattr(getattr(getattr(session, "model", None), "config", None), "_attn_implementation", None)
        if session is None or not str(impl).startswith(OSCAR_IMPL_PREFIX):  # the plain attention would read
            raise EvaluationError(                                            # rotated keys: no logits at all
                "OscarInt2Cache used outside oscar_kv(model, ...): its keys are stored rotated and only the OSCAR "
                "attention reads them; run the forward inside `with oscar_kv(model, oscar) as kv:`")
        if not self.consumed:
            raise EvaluationError(
                "OscarInt2Cache returned rotated keys that were not read by the OSCAR attention: run the model "
                "inside rotationzoo.integrations.transformers.oscar_kv(model, ...)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        else:
            held = self.sink_k.shape if self.sink_k is not None else key_states.shape
            if key_states.shape[:2] != held[:2] or key_states.shape[-1] != held[-1]:
                raise EvaluationError(f"layer {self.layer_idx}: keys {list(key_states.shape)} do not continue the "
                                      f"cached [batch, KV heads, tokens, head_dim] = {list(held)}; call cache.reset() "
                                      f"before another prompt batch")
        if self.slots.open:  # a prefill in chunks, a sequence all padding so far: where its sink begins
            self.slots.reopen(session.leading_pads(key_states.shape[0]), self.cumulative_length + key_states.shape[2])
        wdt, self._slid = self.oscar.hp_dtype, False
        kr = self.transform.keys(key_states, wdt)  # one line when the rotations do not fit the model
        vr = self.transform.values(value_states, wdt)
        if key_states.shape[2] <= DECODE_MAX_QUERIES and self.oscar.quantize_k and self.oscar.quantize_v:
            self.pending = (self._store("k", kr), self._store("v", vr))
            keys, values = kr.to(self.dtype), vr.to(self.dtype)  # stand-ins: attend() reads the pending view
        else:
            self.pending = None
            keys = torch.cat([self._history("k"), kr.to(self.dtype)], dim=2)
            values = torch.cat([self._history("v"), vr.to(self.dtype)], dim=2)
            self._store("k", kr)
            self._store("v", vr)
        self.cumulative_length += key_states.shape[2]
        self._last_tokens = int(key_states.shape[2])
        setattr(keys, OSCAR_TAG, self)
        self.consumed = False
        return keys, values

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor | None:
        """Decode attention of ``query [B, Hq, S, d]`` (model basis) over the pending view, read from the
        codes, with the model's ``mask`` (``None``: causal; boolean or additive ``[B or 1, 1 or Hq, S, L]``:
        padding, a sliding window) read by the kernel on the device; ``[B, Hq, S, d]`` in the model basis,
        or ``None`` for a mask of another shape: then :meth:`take_pending` gives keys/values to attend to.
        Nothing here reads a tensor's values on the host."""
        assert self.pending is not None
        k, v = self.pending
        b, hq, s = query.shape[:3]
        if mask is not None and (mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hq)
                                 or mask.shape[2] != s):
            return None
        assert k.sink is not None and k.recent is not None
        tier_rows = k.recent.shape[2] + (0 if k.codes is None else k.codes.shape[2])
        end = self.cumulative_length
        fits, read = self.slots.kernel_mask(visible(mask), k.sink.shape[2], tier_rows, end, self._first(end, s), s)
        if not fits:
            return None
        self.pending = None
        t = self.transform  # centering, q_rotation / o_rotation and v_mean included
        out = decode_attention_int2(query, k, v, config=int2_store(self.oscar), q_rotation=t.query_matrix,
                                    o_rotation=t.output_matrix, scale=scale, mask=read, causal=self.slots.starts is None,
                                    backend=self.oscar.backend)  # type: ignore[arg-type]  # padded: the mask says all
        return out if t.v_mean is None else t.with_v_mean(out)

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending view as full keys/values ``[B, H_kv, L, d]`` in the cache dtype (rotated basis)."""
        assert self.pending is not None
        k, v = self.pending
        self.pending = None
        end, first = self.cumulative_length, self._first(self.cumulative_length, self._last_tokens)
        return self._materialize("k", k, end, first), self._materialize("v", v, end, first)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask: every token so far, or for a sliding layer the last
        ``sliding_window − 1`` (what it holds) plus the new ones, as transformers' sliding layers."""
        if self.sliding_window is None:
            return self.cumulative_length + query_length, 0
        held = min(self.cumulative_length, self.sliding_window - 1)
        return held + query_length, self.cumulative_length - held

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    @property
    def batch_size(self) -> int:
        """Sequences held (raises ``AttributeError`` before the first forward, as transformers expects)."""
        if not self.is_initialized or self.sink_k is None:
            raise AttributeError("batch_size")
        return int(self.sink_k.shape[0])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative count; ``0`` does
        nothing), exactly as if they had never been added: at most the tokens of the last forward, whose
        demoted rows the cache still holds in ``hp_dtype`` (up to :data:`CROP_TOKENS`).

        Raises:
            EvaluationError: a positive count (an absolute length), or more tokens than can be undone.
        """
        n = -int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise EvaluationError(f"crop({tokens_to_remove}): give the number of tokens to remove as a negative "
                                  f"count, as transformers' caches do")
        if n == 0 or not self.is_initialized:
            return
        if self._slid:
            raise EvaluationError(f"OscarInt2Cache cannot remove {n} tokens from sliding-window layer {self.layer_idx}: "
                                  f"its last forward dropped tokens out of the window")
        if n > self._last_tokens or any(min(n, c) > (0 if d is None else d.shape[2])
                                        for c, d in ((self._demoted_count[s], self._demoted[s]) for s in "kv")):
            raise EvaluationError(
                f"OscarInt2Cache can undo only the tokens of its last forward ({self._last_tokens}) whose INT2 rows it "
                f"still holds exactly (at most {CROP_TOKENS}); cannot remove {n}: INT2 tokens cannot be restored")
        for side in "kv":
            self._undo(side, n, self.cumulative_length)
        self.cumulative_length -= n
        self._last_tokens -= n
        self.pending = None

    def _undo(self, side: str, n: int, end: int) -> None:
        """Remove the newest ``n`` token slots of ``side`` (of ``end``) and move back the rows their arrival
        demoted."""
        sink, recent = getattr(self, f"sink_{side}"), getattr(self, f"recent_{side}")
        log = self._demoted[side]
        back = min(n, self._demoted_count[side])  # INT2 rows that leave the tier: back into the window, or removed
        if log is not None and back:
            rows = torch.cat([log[:, :, log.shape[2] - back:], recent], dim=2)
            self._demoted[side] = log[:, :, :log.shape[2] - back]
        else:
            rows = recent
        keep = max(rows.shape[2] - n, 0)  # at most recent_tokens: back <= n
        cut = self.slots.sink_cut(end, n, sink.shape[2])
        if cut:  # the removed tokens reach into the sink (a sequence shorter than prefix_tokens)
            setattr(self, f"sink_{side}", sink[:, :, :sink.shape[2] - cut].contiguous())
        setattr(self, f"recent_{side}", rows[:, :, :keep].contiguous())
        self._n_int2[side] -= back
        self._demoted_count[side] -= back

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for name in _WINDOW_NAMES:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, fn(t))
        for name in _INT2_NAMES:
            t = self._int2_view(name)
            if t is not None:
                self._buf[name] = fn(t)
        for side in "kv":
            log = self._demoted[side]
            if log is not None:
                self._demoted[side] = fn(log)
            self._n_int2[side] -= self._int2_lo[side]  # the buffers now start at the tier's first token
            self._int2_lo[side] = 0
        self.slots.map_batch(fn)
        self.pending = None

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

    def _tensors(self, reserved: bool) -> list[torch.Tensor]:
        out = [getattr(self, n) for n in _WINDOW_NAMES]
        out += [self._buf[n] if reserved else self._int2_view(n) for n in _INT2_NAMES]
        if reserved:  # the last forward's demoted rows, kept for crop()
            out += [self._demoted["k"], self._demoted["v"]]
        return [t for t in out if t is not None]

    def nbytes(self) -> int:
        """Bytes of the cached tokens (windows, codes, scales/zeros)."""
        return sum(t.numel() * t.element_size() for t in self._tensors(False))

    def reserved_bytes(self) -> int:
        """Bytes allocated, including the INT2 buffers' room for tokens not demoted yet and the last forward's
        demoted rows kept for :meth:`crop`."""
        return sum(t.numel() * t.element_size() for t in self._tensors(True))

    def stored_tokens(self) -> dict[str, int]:
        """``{"prefix": …, "int2": …, "recent": …}`` rows held per tier."""
        if not self.is_initialized:
            return {"prefix": 0, "int2": 0, "recent": 0}
        assert self.sink_k is not None and self.recent_k is not None
        return {"prefix": self.sink_k.shape[2], "int2": self._n_int2["k"] - self._int2_lo["k"],
                "recent": self.recent_k.shape[2]}


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
    decode steps read the INT2 history straight from the codes
    (:func:`rotationzoo.kernels.decode_attention_int2`: Triton on CUDA, the chunked PyTorch
    reference on CPU), never dequantizing it as a whole.

    Sliding-window layers of the model (its ``layer_types``) keep only their window.

    Args:
        oscar: settings and rotations.
        config: the model config (for the layer count and which layers slide).
        num_layers: the layer count, if no config is given (every layer then attends to everything).
    """

    def __init__(self, oscar: OscarKV, config: Any = None, num_layers: int | None = None) -> None:
        windows: list[int | None]
        if num_layers is None:
            if config is None:
                raise EvaluationError("OscarInt2Cache needs the model config or num_layers")
            windows = sliding_windows(config)
        else:
            windows = [None] * int(num_layers)
        self.oscar = oscar
        self.layers: list[Any]
        layer = cache_classes()["OscarInt2Layer"]
        super().__init__(layers=[layer(oscar, i, w) for i, w in enumerate(windows)])  # type: ignore[call-arg]

    def nbytes(self) -> int:
        """Bytes of the cached tokens in all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    def reserved_bytes(self) -> int:
        """Bytes allocated by all layers (:meth:`nbytes` plus the INT2 buffers' free room)."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    def bits_per_element(self) -> float:
        """Stored bits per cached K/V element (codes, scales/zeros and windows over all layers)."""
        elems = 0
        for layer in self.layers:
            if layer.is_initialized:
                b, h, _, d = layer.sink_k.shape
                elems += 2 * b * h * d * sum(layer.stored_tokens().values())
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
