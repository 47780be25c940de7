"""Which token slots each tier of :class:`~rotationzoo.integrations.transformers.OscarInt2Cache` holds.

A cache layer keeps a batch's token slots ``[0, end)`` in tiers of the same width for every sequence:
the sink (``hp_dtype``), then the INT2 tier and the recent rows (slots ``[tier_start, end)``). For a batch
whose sequences start at the same slot the sink is slots ``[0, prefix)`` and ``tier_start == prefix``.

In a left-padded batch (prompts of different lengths, as ``generate`` batches them) sequence ``b`` starts
after its ``starts[b]`` padding tokens, and its sink is its own first ``prefix`` tokens, slots ``[starts[b],
starts[b] + prefix)``: the sink buffer holds ``prefix`` rows per sequence, gathered from those slots (filled as
they arrive), and the tier starts at the shortest padding's sink end. A tier slot before a sequence's own
sink end is padding or a copy of its sink, and that sequence does not read it. So each row is stored and
read exactly as its prompt alone would be, for ``prefix`` BF16 rows per sequence as without padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Slots:
    """The slot ranges of a cache layer's tiers (see the module docstring).

    Attributes:
        prefix: sink rows per sequence.
        tier_start: slots from it go to the INT2 tier and the recent rows.
        starts: ``[B]`` each sequence's leading padding (``None``: none, the sink is slots ``[0, prefix)``).
        filled: the slot after the last sink's (``max(starts) + prefix``): later rows go to the tier only.
        open: a sequence is all padding so far (a prefill in chunks): :meth:`reopen` reads the starts again.
    """

    prefix: int = 0
    tier_start: int = 0
    starts: torch.Tensor | None = None
    filled: int = 0
    open: bool = False

    @classmethod
    def of(cls, prefix: int, pads: list[int] | None, device: torch.device, seen: int) -> "Slots":
        """The ranges for sinks of ``prefix`` tokens after each sequence's ``pads`` (``None``: no padding) in the
        first ``seen`` slots."""
        if not pads or not any(pads):
            return cls(prefix, prefix, None, prefix)
        return cls(prefix, prefix + min(pads), torch.tensor(pads, device=device), prefix + max(pads), max(pads) >= seen)

    def reopen(self, pads: list[int] | None, seen: int) -> None:
        """Read the starts again from the ``pads`` of the first ``seen`` slots while a sequence was all padding (its
        sink had not begun; the tier keeps its first slot: the slots before a sequence's sink end are not read)."""
        if pads is not None and self.starts is not None:
            self.starts = torch.tensor(pads, device=self.starts.device)
            self.filled, self.open = self.prefix + max(pads), max(pads) >= seen

    def store(self, sink: torch.Tensor, x: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """``(sink, skip)`` for new rows ``x [B, H, n, d]`` at slots ``[start, start + n)``: the sink with the
        rows that belong to it, and how many of ``x``'s first rows the tier does not take."""
        n = x.shape[2]
        skip = min(max(self.tier_start - start, 0), n)
        if self.starts is None:
            take = min(max(self.prefix - start, 0), n)
            return (torch.cat([sink, x[:, :, :take]], dim=2) if take else sink), skip
        if not self.prefix or (start >= self.filled and sink.shape[2]):  # no sink, or every sequence's is full
            return sink, skip
        if not sink.shape[2]:
            sink = x.new_zeros(x.shape[:2] + (self.prefix, x.shape[3]))
        slot = self.starts[:, None] + torch.arange(self.prefix, device=x.device)[None, :]  # [B, prefix]
        inside = (slot >= start) & (slot < start + n)
        at = (slot - start).clamp(0, n - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
        return torch.where(inside[:, None, :, None], x.gather(2, at), sink), skip

    def merge(self, sink: torch.Tensor, rows: torch.Tensor, end: int, first: int) -> torch.Tensor:
        """The slots ``[first, end)`` as one row each (``[B, H, end − first, d]``): ``[sink | rows]``, ``rows``
        the tier's, ending at slot ``end − 1``; in a padded batch each sequence's sink rows at its own slots."""
        if self.starts is None:
            return torch.cat([sink, rows], dim=2)
        b, h, _, d = rows.shape
        out = rows.new_zeros((b, h, end - first, d))
        out[:, :, end - first - rows.shape[2]:] = rows
        if not self.prefix:  # no sink: the slots before the tier are padding for every sequence
            return out
        col = torch.arange(first, end, device=rows.device)[None, :] - self.starts[:, None]  # sink row of each slot
        own = (col >= 0) & (col < self.prefix)
        at = col.clamp(0, self.prefix - 1)[:, None, :, None].expand(-1, h, -1, d)
        return torch.where(own[:, None, :, None], sink.gather(2, at), out)

    def kernel_mask(self, mask: torch.Tensor | None, sink_rows: int, tier_rows: int, end: int, first: int,
                    queries: int) -> tuple[bool, torch.Tensor | None]:
        """``(fits, mask)``: the model's boolean ``mask`` (``[B or 1, 1 or Hq, S, slots]``, one column per slot
        ``[first, end)``) for a kernel that reads ``sink_rows`` then ``tier_rows`` rows (``None`` stays
        ``None`` without padding: causal); ``fits`` is False for a mask of another width. Read on the device."""
        width = end - first if self.starts is not None else sink_rows + tier_rows
        if mask is not None and mask.shape[-1] != width:
            return False, None
        if self.starts is None:
            return True, mask
        dev = self.starts.device
        sink = self.starts[:, None] + torch.arange(sink_rows, device=dev)[None, :]  # [B, sink_rows]
        tier = torch.arange(end - tier_rows, end, device=dev)[None, :].expand(sink.shape[0], -1)
        slots = torch.cat([sink, tier], dim=1)
        own = torch.cat([(sink >= first) & (sink < end), tier >= (self.starts + self.prefix)[:, None]], dim=1)
        if mask is None:  # causal over the new tokens
            seen = slots[:, None, :] <= torch.arange(end - queries, end, device=dev)[None, :, None]
            return True, (own[:, None, :] & seen)[:, None]
        b, heads, s, _ = mask.shape
        at = (slots - first).clamp(0, width - 1)[:, None, None, :].expand(-1, heads, s, -1)
        return True, mask.expand(sink.shape[0], -1, -1, -1).gather(-1, at) & own[:, None, None, :]

    def padding_mask(self, mask: torch.Tensor | None, end: int, first: int, queries: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
        """The model's boolean ``mask`` (``None``: causal) for an attention over the merged slots ``[first, end)``,
        as an additive ``[B, 1 or H, S, end − first]`` mask that also keeps each sequence of a padded batch off
        its padding, as the kernel path does; ``None`` (the model's mask stands) without padding or for a mask
        of another width."""
        if self.starts is None or (mask is not None and mask.shape[-1] != end - first):
            return None
        slot = torch.arange(first, end, device=self.starts.device)
        seen = ((slot[None, None, :] >= self.starts[:, None, None]) & (
            slot[None, None, :] <= torch.arange(end - queries, end, device=slot.device)[None, :, None]))[:, None]
        if mask is not None:
            seen = seen & mask
        return torch.zeros(seen.shape, dtype=dtype, device=slot.device).masked_fill_(~seen, torch.finfo(dtype).min)

    def dropped(self, sink_rows: int, tier_rows: int, end: int, window: int) -> tuple[int, int]:
        """``(from_sink, from_tier)``: the rows that leave a sliding window of ``window`` tokens (it keeps the
        last ``window − 1`` slots of ``end``), from the front of each tier (a padded batch's sink rows stay,
        unread once their slots leave the window)."""
        first = end - (window - 1)
        from_tier = min(max(first - (end - tier_rows), 0), tier_rows)
        if self.starts is not None:
            return 0, from_tier
        return min(max(first - (min(end, self.prefix) - sink_rows), 0), sink_rows), from_tier

    def sink_cut(self, end: int, n: int, sink_rows: int) -> int:
        """Sink rows to remove with the newest ``n`` slots of ``end`` (a crop reaching into the sink; a padded
        batch's sink rows stay, unread past ``end``, and are written again)."""
        if self.starts is not None:
            return 0
        return min(min(end, self.prefix) - min(end - n, self.prefix), sink_rows)

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Follow a reordering or selection of the batch's sequences (beam search)."""
        if self.starts is not None:
            self.starts = fn(self.starts)


__all__ = ["Slots"]
