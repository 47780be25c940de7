"""Which token slots each tier of :class:`~rotationzoo.integrations.transformers.OscarInt2Cache` holds.

A cache layer keeps a batch's token slots ``[0, end)`` in three tiers of the same width for every
sequence: the sink (slots ``[0, sink_end)``, ``hp_dtype``), then the INT2 tier and the recent rows (slots
``[tier_start, end)``). For a batch whose sequences start at the same slot, ``sink_end == tier_start ==
prefix_tokens``. In a left-padded batch (prompts of different lengths, as ``generate`` batches them)
sequence ``b`` starts after its ``pads[b]`` padding tokens, and its sink is its own first
``prefix_tokens`` tokens, slots ``[0, pads[b] + prefix_tokens)``: the sink then runs to the longest of
those ends and the tier starts at the shortest, and a slot between the two is held twice, each sequence
reading it from its own place (the sink before its end, the tier after). So each row is stored and read
exactly as its prompt alone would be, whatever the other rows' padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Slots:
    """The slot ranges of a cache layer's tiers (see the module docstring).

    Attributes:
        sink_end: slots before it go to the sink.
        tier_start: slots from it go to the INT2 tier and the recent rows.
        row_ends: ``[B]`` per sequence, its padding + ``prefix_tokens`` (``None``: every sequence starts at
            the same slot, and ``sink_end == tier_start``).
    """

    sink_end: int = 0
    tier_start: int = 0
    row_ends: torch.Tensor | None = None

    @classmethod
    def of(cls, prefix: int, pads: list[int] | None, device: torch.device) -> "Slots":
        """The ranges for sinks of ``prefix`` tokens after each sequence's ``pads`` (``None``: no padding)."""
        low, high = (min(pads), max(pads)) if pads and prefix else (0, 0)
        ends = torch.tensor(pads, device=device) + prefix if pads and high > low else None
        return cls(prefix + high, prefix + low, ends)

    def split(self, start: int, n: int) -> tuple[int, int]:
        """``(to_sink, skip)`` for ``n`` new tokens at slots ``[start, start + n)``: the first ``to_sink`` go to
        the sink, all but the first ``skip`` to the tier."""
        return min(max(self.sink_end - start, 0), n), min(max(self.tier_start - start, 0), n)

    def overlap(self, sink_rows: int, tier_rows: int, end: int) -> tuple[int, int]:
        """``(first, count)``: the slots held both by ``sink_rows`` sink rows and ``tier_rows`` tier rows whose
        last slot is ``end − 1`` (``count`` 0: none)."""
        if self.row_ends is None or not sink_rows:
            return 0, 0
        tier_lo = end - tier_rows
        return tier_lo, max(min(end, self.sink_end) - tier_lo, 0)

    def held(self, sink_rows: int, tier_rows: int, end: int) -> int:
        """Token slots held by ``sink_rows`` sink rows and ``tier_rows`` tier rows ending at ``end`` (a slot held
        in both counted once)."""
        return sink_rows + tier_rows - self.overlap(sink_rows, tier_rows, end)[1]

    def merge(self, sink: torch.Tensor, rows: torch.Tensor, end: int) -> torch.Tensor:
        """``[sink | rows]`` (``[B, H, n, d]`` each, the tier's rows ending at slot ``end − 1``) as one row per
        slot: a slot held twice is each sequence's own copy."""
        first, count = self.overlap(sink.shape[2], rows.shape[2], end)
        if not count:
            return torch.cat([sink, rows], dim=2)
        assert self.row_ends is not None
        from_sink = torch.arange(first, first + count, device=sink.device)[None, :] < self.row_ends[:, None]
        both = torch.where(from_sink[:, None, :, None], sink[:, :, sink.shape[2] - count:], rows[:, :, :count])
        return torch.cat([sink[:, :, :sink.shape[2] - count], both, rows[:, :, count:]], dim=2)

    def kernel_mask(self, mask: torch.Tensor | None, sink_rows: int, tier_rows: int, end: int,
                    queries: int) -> tuple[bool, torch.Tensor | None]:
        """``(fits, mask)``: the model's boolean ``mask`` (``[B or 1, 1 or Hq, S, slots]``, one column per slot
        held) for a kernel that reads ``sink_rows`` then ``tier_rows`` rows (``None`` stays ``None`` without a
        slot held twice: causal); ``fits`` is False for a mask of another width. Read on the device."""
        first, count = self.overlap(sink_rows, tier_rows, end)
        if mask is not None and mask.shape[-1] != sink_rows + tier_rows - count:
            return False, None
        if not count:
            return True, mask
        assert self.row_ends is not None
        dev = self.row_ends.device
        sink_hi = min(end, self.sink_end)
        slots = torch.cat([torch.arange(sink_hi - sink_rows, sink_hi, device=dev),
                           torch.arange(end - tier_rows, end, device=dev)])
        ends = self.row_ends[:, None]
        own = torch.cat([slots[None, :sink_rows] < ends, slots[None, sink_rows:] >= ends], dim=1)[:, None, None, :]
        if mask is None:  # causal over the new tokens
            return True, own & (slots[None, :] <= torch.arange(end - queries, end, device=dev)[:, None])[None, None]
        return True, mask[..., slots - min(sink_hi - sink_rows, end - tier_rows)] & own

    def dropped(self, sink_rows: int, tier_rows: int, end: int, window: int) -> tuple[int, int]:
        """``(from_sink, from_tier)``: the rows that leave a sliding window of ``window`` tokens (it keeps the
        last ``window − 1`` slots of ``end``), from the front of each tier."""
        first = end - (window - 1)
        from_sink = min(max(first - (min(end, self.sink_end) - sink_rows), 0), sink_rows)
        return from_sink, min(max(first - (end - tier_rows), 0), tier_rows)

    def sink_cut(self, end: int, n: int, sink_rows: int) -> int:
        """Sink rows to remove with the newest ``n`` slots of ``end`` (a crop reaching into the sink)."""
        return min(min(end, self.sink_end) - min(end - n, self.sink_end), sink_rows)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Follow a reordering or selection of the batch's sequences (beam search)."""
        if self.row_ends is not None:
            self.row_ends = fn(self.row_ends)


__all__ = ["Slots"]
