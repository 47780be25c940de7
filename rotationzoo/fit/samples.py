"""Bounded, seeded reservoirs of calibration samples (contiguous token blocks) per layer.

The covariance fitter (:mod:`rotationzoo.fit.accumulate`) needs only second moments; learning a
rotation against the real INT2 error (:mod:`rotationzoo.fit.refine`) needs the activations
themselves, and the value loss needs attention weights, i.e. queries and keys of *consecutive*
positions of one sequence. So samples are kept as **blocks** of ``block_size`` consecutive tokens
of one sequence: ``q [block_size, H_q, d]``, ``k``/``v [block_size, H_kv, d]`` plus the position
of the block's first token in its sequence. Blocks are reservoir-sampled (Algorithm R, one
``random.Random`` per layer seeded from ``(seed, layer_id)``) over every block seen, so the
reservoir is a uniform sample of the calibration blocks whatever their number, its memory is
fixed in advance, and the same inputs and seed always give the same samples.

Each sequence is cut into ``⌊n / block_size⌋`` whole blocks starting at its first token; the
``n mod block_size`` tokens left at its end (and sequences shorter than one block) are counted in
:attr:`LayerSamples.tokens_dropped` and not kept.

Memory (the default: ``block_size = 256``, ``max_tokens = 14,336`` = 56 blocks, bf16). A layer
costs ``max_tokens · (H_q + 2·H_kv) · d · bytes`` (plus 8 bytes per block for its position): for
a 36-layer model with ``d = 128``, 32 query and 8 KV heads that is
``14,336 · 48 · 128 · 2 B = 176 MB`` per layer, ``36 × 176 MB = 6.34e9 B = 5.91 GiB`` in all; with
the interpreter and the working sets of two refinement jobs the measured peak is 7.43 GiB
(``tools/bench_refine.py --synthetic 36,128,32,8``), within 8 GiB with room to spare. Fed 20,000
tokens per layer (78 whole blocks), it keeps 56 of them. Keeping all 20,000 tokens would need
8.24 GiB for the reservoir alone (16,384 tokens: 6.75 GiB, measured peak 7.9 GiB, too close to
8 GiB), and fp32 storage would double either figure, hence bf16 and 14,336 by default.
SmolLM2-135M (30 layers, ``d = 64``, 9 + 2·3 heads) costs 27.5 MB per layer, 0.77 GiB in all, at
the default size.

Fill a reservoir from a live capture::

    from rotationzoo.fit.samples import CalibrationSamples
    from rotationzoo.integrations.transformers import QKVCapture

    samples = CalibrationSamples(max_tokens=14336, seed=0)
    with torch.no_grad(), QKVCapture(model, samples.on_qkv):
        for window in windows:                        # batch 1, no cache: one sequence per call
            model(input_ids=torch.tensor([window]), use_cache=False)

or from a dump: ``samples.add_dump(open_dump("qkv_dumps/gpqa"))``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..errors import FitError
from ..recipe import DEFAULT_BLOCK_SIZE, DEFAULT_SAMPLE_TOKENS
from ..progress import Progress, Tally
from .dump import Dump
from .dump_schema import GRAD_KIND

#: Tokens per block (consecutive positions of one sequence): :data:`rotationzoo.recipe.DEFAULT_BLOCK_SIZE`;
#: tokens kept per layer (56 blocks of 256; see the module docstring for the memory arithmetic):
#: :data:`rotationzoo.recipe.DEFAULT_SAMPLE_TOKENS`, the ``sample_tokens`` of a refinement.
DEFAULT_MAX_TOKENS = DEFAULT_SAMPLE_TOKENS
#: Storage dtype of the kept activations.
DEFAULT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class BlockShape:
    """Head layout of a layer's samples: ``H_q``, ``H_kv``, ``d``."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


class LayerSamples:
    """Reservoir of whole token blocks of one layer.

    Args:
        layer_id: model layer index (seeds the reservoir together with ``seed``).
        block_size: tokens per block.
        max_tokens: capacity in tokens; ``max_tokens // block_size`` blocks are kept.
        dtype: storage dtype of q/k/v (``torch.bfloat16`` or ``torch.float32``...).
        seed: reservoir seed.

    Attributes:
        q, k, v: ``[num_blocks, block_size, H, d]`` kept blocks (``None`` before the first block).
        positions: ``[num_blocks]`` int64, position of each block's first token in its sequence.
        blocks_seen, tokens_seen, tokens_dropped: counters over everything offered.
        context: the longest sequence offered, in tokens (position of its last token + 1): the
            context the calibration saw, and so the one a refinement learned from these blocks fits.
    """

    def __init__(
        self,
        layer_id: int,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        dtype: torch.dtype = DEFAULT_DTYPE,
        seed: int = 0,
    ) -> None:
        if block_size < 1:
            raise FitError(f"block_size must be ≥ 1, got {block_size}")
        if max_tokens < block_size:
            raise FitError(f"max_tokens ({max_tokens}) must hold at least one block of {block_size} tokens")
        if not dtype.is_floating_point:
            raise FitError(f"sample dtype must be floating point, got {dtype}")
        self.layer_id = int(layer_id)
        self.block_size = int(block_size)
        self.capacity = int(max_tokens) // int(block_size)
        self.dtype = dtype
        self.seed = int(seed)
        self._rng = random.Random(self.seed * 1_000_003 + self.layer_id)
        self.shape: BlockShape | None = None
        self.q: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.g: torch.Tensor | None = None
        self.positions = torch.zeros(self.capacity, dtype=torch.int64)
        self.blocks_seen = 0
        self.tokens_seen = 0
        self.tokens_dropped = 0
        self.context = 0

    @property
    def num_blocks(self) -> int:
        """Blocks currently kept."""
        return min(self.blocks_seen, self.capacity)

    @property
    def num_tokens(self) -> int:
        """Tokens currently kept."""
        return self.num_blocks * self.block_size

    def nbytes(self) -> int:
        """Bytes held by the reservoir (its full capacity once the first block arrived)."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.g, self.positions)
                   if t is not None)

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kept blocks ``(q, k, v, positions)`` (views of the first :attr:`num_blocks` slots).

        Raises:
            FitError: no block was kept.
        """
        if self.q is None or self.num_blocks == 0:
            raise FitError(f"layer {self.layer_id}: no calibration block kept (sequences shorter than {self.block_size} tokens?)")
        n = self.num_blocks
        return self.q[:n], self.k[:n], self.v[:n], self.positions[:n]  # type: ignore[index]

    def grads(self) -> torch.Tensor | None:
        """The kept blocks' attention-output gradients ``g [num_blocks, block_size, H_q, d]`` (``None`` when the
        sequences came without them), in the order of :meth:`blocks`."""
        return None if self.g is None else self.g[:self.num_blocks]

    def _allocate(self, q: torch.Tensor, k: torch.Tensor, with_grads: bool) -> None:
        hq, hkv, d = int(q.shape[1]), int(k.shape[1]), int(q.shape[2])
        if hq % hkv:
            raise FitError(f"layer {self.layer_id}: {hq} query heads is not a multiple of {hkv} KV heads")
        self.shape = BlockShape(hq, hkv, d)
        c, b = self.capacity, self.block_size
        self.q = torch.zeros(c, b, hq, d, dtype=self.dtype)
        self.k = torch.zeros(c, b, hkv, d, dtype=self.dtype)
        self.v = torch.zeros(c, b, hkv, d, dtype=self.dtype)
        self.g = torch.zeros(c, b, hq, d, dtype=self.dtype) if with_grads else None

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 3 or not t.is_floating_point():
                raise FitError(f"layer {self.layer_id}: {name} must be a float tensor [n, heads, d], got {tuple(t.shape)} {t.dtype}")
        n = int(q.shape[0])
        if k.shape[0] != n or v.shape[0] != n:
            raise FitError(f"layer {self.layer_id}: q, k, v token counts differ ({n}, {k.shape[0]}, {v.shape[0]})")
        if k.shape != v.shape or q.shape[2] != k.shape[2]:
            raise FitError(f"layer {self.layer_id}: inconsistent shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        if self.shape is not None and (q.shape[1], k.shape[1], q.shape[2]) != (
            self.shape.num_q_heads, self.shape.num_kv_heads, self.shape.head_dim
        ):
            raise FitError(
                f"layer {self.layer_id}: got q {tuple(q.shape)} / k {tuple(k.shape)}, but earlier blocks had "
                f"H_q={self.shape.num_q_heads}, H_kv={self.shape.num_kv_heads}, d={self.shape.head_dim}"
            )
        return n

    def add_sequence(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0,
                     g: torch.Tensor | None = None) -> int:
        """Offer the consecutive tokens of one sequence.

        Args:
            q: ``[n, H_q, d]``; k, v: ``[n, H_kv, d]`` (any float dtype, any device).
            start: position of the first token in its sequence.
            g: ``[n, H_q, d]``, the gradient of the model's loss with respect to each query's attention
                output (before ``o_proj``), for the ``"fisher"`` refinement loss: given for every sequence
                of a reservoir or for none.

        Returns:
            The number of whole blocks offered (kept or not).
        """
        n = self._check(q, k, v)
        if g is not None and tuple(g.shape) != tuple(q.shape):
            raise FitError(f"layer {self.layer_id}: g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
        if self.blocks_seen and (g is None) != (self.g is None):
            raise FitError(f"layer {self.layer_id}: some calibration sequences came with output gradients and some "
                           f"without; give them for all or none")
        self.tokens_seen += n
        self.context = max(self.context, int(start) + n)
        whole = n // self.block_size
        self.tokens_dropped += n - whole * self.block_size
        if whole and self.q is None:
            self._allocate(q, k, g is not None)
        b = self.block_size
        for i in range(whole):
            slot = self._slot()
            if slot is None:
                continue
            sl = slice(i * b, (i + 1) * b)
            self.q[slot].copy_(q[sl].detach())  # type: ignore[index]
            self.k[slot].copy_(k[sl].detach())  # type: ignore[index]
            self.v[slot].copy_(v[sl].detach())  # type: ignore[index]
            if g is not None:
                self.g[slot].copy_(g[sl].detach())  # type: ignore[index]
            self.positions[slot] = int(start) + i * b
        return whole

    def _slot(self) -> int | None:
        """Algorithm R: where the next block goes (``None``: not kept)."""
        i = self.blocks_seen
        self.blocks_seen += 1
        if i < self.capacity:
            return i
        j = self._rng.randint(0, i)  # inclusive
        return j if j < self.capacity else None

    def add_chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int] | None = None,
        g: torch.Tensor | None = None,
    ) -> int:
        """Offer a chunk holding several sequences back to back (``seq_lens`` tokens each, default one).

        Every segment is taken to start at position 0 of its sequence; ``g`` as in :meth:`add_sequence`.

        Returns:
            Whole blocks offered.
        """
        n = self._check(q, k, v)
        lens = [n] if seq_lens is None else [int(x) for x in seq_lens]
        if sum(lens) != n:
            raise FitError(f"layer {self.layer_id}: seq_lens sum to {sum(lens)}, but the chunk has {n} tokens")
        offered, at = 0, 0
        for length in lens:
            offered += self.add_sequence(q[at:at + length], k[at:at + length], v[at:at + length],
                                         g=None if g is None else g[at:at + length])
            at += length
        return offered


class CalibrationSamples:
    """One :class:`LayerSamples` per layer, created on first sight.

    Args:
        block_size, max_tokens, dtype, seed: as in :class:`LayerSamples` (per layer).

    Attributes:
        layers: ``{layer_id: LayerSamples}``, ascending ids after :meth:`layer_ids`.
    """

    def __init__(
        self,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        dtype: torch.dtype = DEFAULT_DTYPE,
        seed: int = 0,
    ) -> None:
        LayerSamples(0, block_size=block_size, max_tokens=max_tokens, dtype=dtype)  # argument checks
        self.block_size = int(block_size)
        self.max_tokens = int(max_tokens)
        self.dtype = dtype
        self.seed = int(seed)
        self.layers: dict[int, LayerSamples] = {}

    def layer(self, layer_id: int) -> LayerSamples:
        """The reservoir of ``layer_id`` (created empty when new)."""
        lid = int(layer_id)
        if lid not in self.layers:
            self.layers[lid] = LayerSamples(
                lid, block_size=self.block_size, max_tokens=self.max_tokens, dtype=self.dtype, seed=self.seed
            )
        return self.layers[lid]

    def layer_ids(self) -> tuple[int, ...]:
        """Layers with at least one kept block, ascending."""
        return tuple(sorted(lid for lid, s in self.layers.items() if s.num_blocks))

    @property
    def context(self) -> int:
        """The longest calibration sequence offered to any layer, in tokens (0 before the first)."""
        return max((s.context for s in self.layers.values()), default=0)

    def drop_grads(self) -> None:
        """Free the output gradients every reservoir holds (a loss other than ``"fisher"`` does not read them)."""
        for s in self.layers.values():
            s.g = None

    def nbytes(self) -> int:
        """Bytes held by all reservoirs."""
        return sum(s.nbytes() for s in self.layers.values())

    def on_qkv(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """A :class:`~rotationzoo.integrations.transformers.QKVCapture` callback.

        Each call is taken to be one whole sequence starting at position 0 (a batch-1 forward
        without cache: ``n = S``). For batched forwards call :meth:`add_chunk` with
        ``seq_lens=[S] * B`` instead.
        """
        self.layer(layer_id).add_sequence(q.detach().to("cpu"), k.detach().to("cpu"), v.detach().to("cpu"))

    def add_chunk(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int] | None = None,
        g: torch.Tensor | None = None,
    ) -> int:
        """:meth:`LayerSamples.add_chunk` for ``layer_id``."""
        return self.layer(layer_id).add_chunk(q, k, v, seq_lens, g)

    def add_dump(self, dump: Dump, layers: Iterable[int] | None = None, progress: Progress | None = None, *,
                 grads: bool = False) -> None:
        """Offer every used chunk of a dump (chunk 0 per the dump's own rule), split by ``seq_lens``.

        Args:
            dump: an opened :class:`~rotationzoo.fit.dump.Dump` (needs ``q``, ``k`` and ``v``).
            layers: only these layers (default: all of the dump's).
            progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): chunks read.
            grads: also read the output gradients (``g/``, every layer must hold them), for the ``"fisher"`` loss.

        Raises:
            FitError: ``grads`` and a layer without them.
        """
        ids = dump.layer_ids if layers is None else tuple(int(i) for i in layers)
        kinds: tuple[str, ...] = ("q", "k", "v", GRAD_KIND) if grads else ("q", "k", "v")
        if grads:
            lacking = [lid for lid in ids if not dump.has_grads(lid)]
            if lacking:
                raise FitError(f"{dump.root}: layer {lacking[0]} holds no output gradients (g/); the fisher loss needs a "
                               f"dump written by calibrate --grads")
        chunks = {lid: dump.chunk_ids(lid, kinds) for lid in ids}
        tally = Tally(progress, sum(len(c) for c in chunks.values()), "reading the dump")
        tally.start()
        for lid in ids:
            for i, chunk in enumerate(chunks[lid]):
                q, k, v = (dump.load(lid, kind, chunk) for kind in ("q", "k", "v"))
                g = dump.load(lid, GRAD_KIND, chunk) if grads else None
                self.add_chunk(lid, q, k, v, dump.seq_lens(lid, chunk), g)
                del q, k, v, g
                tally.set(lid, i + 1, f"layer {lid}")

    def summary(self) -> dict[str, object]:
        """JSON-friendly counts."""
        return {
            "block_size": self.block_size,
            "max_tokens": self.max_tokens,
            "dtype": str(self.dtype).replace("torch.", ""),
            "seed": self.seed,
            "context": self.context,
            "nbytes": self.nbytes(),
            "layers": {
                str(lid): {"blocks": s.num_blocks, "blocks_seen": s.blocks_seen, "tokens_seen": s.tokens_seen,
                           "tokens_dropped": s.tokens_dropped}
                for lid, s in sorted(self.layers.items())
            },
        }
