"""How decode attention over the INT2 cache is cut into work: splits, tiles, warps (plain Python).

Both backends split the history the same way: the INT2 tokens into ``num_splits`` contiguous ranges of
whole tiles, each attended on its own with an fp32 online softmax; the BF16 windows (sink and recent
tokens, at most ``prefix + recent``) into ranges of their own; the partial results are merged by their
log-sum-exp. The PyTorch reference walks the ranges one after the other, so its transient memory is
one range's tile; the Triton kernel runs them as parallel programs (flash-decoding).
"""

from __future__ import annotations

import math

DECODE_MAX_QUERIES = 16
"""Most query tokens per sequence :func:`~rotationzoo.kernels.decode_attention_int2` is meant for (a
decode step, speculative drafts): the Triton kernel keeps ``heads per KV head × queries`` rows in
registers. The cache uses the kernel up to this many new tokens and its prefill path above."""

REFERENCE_TILE_BYTES = 4 << 20
"""fp32 bytes of one side's unpacked code tile in the PyTorch reference (``batch × KV heads × tokens ×
d × 4``). Larger tiles amortise the per-tile Python and dispatch overhead (about 30 small operations),
smaller ones stay in cache; 4 MiB measured best on SmolLM2's shape (``tools/bench_decode.py
--cpu-variants``). The reference's transient memory is a small multiple of this (docs/performance.md)."""

REFERENCE_MIN_TILE = 64
"""Fewest tokens per reference tile."""

TRITON_MIN_SPLIT_TOKENS = 256
"""Fewest INT2 tokens per Triton split (a split with fewer is mostly overhead: its partial result
costs ``rows × d × 4`` bytes to write and read back)."""

PROGRAMS_PER_SM = 4
"""Target resident split programs per SM (with 4 warps each: 16 warps, 4 tiles of loads in flight)."""

_DECODE_LAUNCH: dict[int, tuple[int, int, int]] = {
    64: (32, 4, 2),
    128: (64, 4, 2),
    256: (64, 4, 2),
}
"""Split kernel launch per head_dim: ``(tokens per tile, warps, pipeline stages)``, from
``tools/aot_report.py`` (no spill on sm_90 or sm_80 in the variants the library launches; at d = 128
the serving case's estimated issue bound was 32 % of copy at 64 × 4 × 2, 37 % at 128 × 4 × 2 with 243
registers, which spilled for bf16 scales; at d = 64, 64-token tiles spill). Rows with several groups
per quarter of the dims take :data:`GROUPED_TILE_TOKENS` (see :func:`decode_tile_tokens`)."""

GROUPED_TILE_TOKENS = 32
"""INT2 tokens per tile when a quarter of the dims holds several groups (``G < d/4``) at d ≥ 128: the
block-diagonal query rows double the products, and 64-token tiles spilled on sm_90 (d = 128, G = 16,
16 query rows: 64 B of stack at 64 × 4 × 2; none at 32 × 4 × 2, estimated issue bound 21 % vs 21 %)."""

DECODE_MAX_REGISTERS = 255
"""Register ceiling (ptxas ``.maxnreg``) of the split kernel: the architectural maximum. Without it
ptxas held some variants (d = 64) to 168 registers and spilled 8 bytes outside the tile loop."""

HP_TILE = 32
"""Window tokens per tile of the Triton kernel (the windows are at most a few hundred tokens)."""


def padded_rows(rows: int, groups: int) -> int:
    """Rows of the query tile: ``rows`` (heads per KV head × query tokens) rounded up to a power of two
    such that ``rows × groups ≥ 16`` (the smallest ``tl.dot``)."""
    p = 1 << max(0, math.ceil(math.log2(max(rows, 1))))
    while p * groups < 16:
        p *= 2
    return p


def row_block(rows: int, groups: int) -> int:
    """Query rows per split program: :func:`padded_rows` of at most ``16 / groups`` rows (``groups``:
    groups per quarter of the head dims), so that a program holds 16 block-diagonal rows; more rows
    are spread over programs of a third grid axis (each reads the same codes, mostly from L2)."""
    return padded_rows(min(rows, max(1, 16 // groups)), groups)


def decode_tile_tokens(d: int, quarter_groups: int = 1) -> int:
    """INT2 tokens per tile of the Triton split kernel; ``quarter_groups``: the most (scale, zero) groups
    of keys or values in a quarter of the dims (``max(1, d / 4 / G)``)."""
    tile = _DECODE_LAUNCH.get(d, (32, 4, 2))[0]
    return min(tile, GROUPED_TILE_TOKENS) if quarter_groups > 1 and d >= 128 else tile


def decode_num_warps(d: int) -> int:
    """Warps per split program."""
    return _DECODE_LAUNCH.get(d, (32, 4, 2))[1]


def decode_num_stages(d: int) -> int:
    """Software-pipelining stages of the split kernel's tile loop."""
    return _DECODE_LAUNCH.get(d, (32, 4, 2))[2]


def merge_num_warps(d: int) -> int:
    """Warps of the merge kernel: 4, 8 at d = 256 (with 4 the output rotation's ``[32, 256]`` blocks
    spilled)."""
    return 8 if d >= 256 else 4


def triton_splits(n_int2: int, batch_heads: int, num_sms: int, tile: int) -> tuple[int, int]:
    """``(splits, tokens per split)`` of the INT2 tokens for the Triton kernel.

    Enough programs to give every SM :data:`PROGRAMS_PER_SM` (``splits × batch × KV heads``), but no
    split under :data:`TRITON_MIN_SPLIT_TOKENS` tokens; tokens per split a multiple of ``tile``.
    ``(0, tile)`` when there are no INT2 tokens.
    """
    if n_int2 <= 0:
        return 0, tile
    want = max(1, math.ceil(num_sms * PROGRAMS_PER_SM / max(batch_heads, 1)))
    most = max(1, n_int2 // TRITON_MIN_SPLIT_TOKENS)
    return split_ranges(n_int2, min(want, most), tile)


def split_ranges(n_int2: int, splits: int, tile: int) -> tuple[int, int]:
    """``(splits, tokens per split)`` for at most ``splits`` ranges of whole ``tile``-token tiles
    covering ``n_int2`` tokens (the last range may be shorter; none is empty)."""
    if n_int2 <= 0:
        return 0, tile
    per = math.ceil(math.ceil(n_int2 / max(1, splits)) / tile) * tile
    return math.ceil(n_int2 / per), per


def window_splits(n_window: int, tile: int = HP_TILE) -> int:
    """Programs for the window tokens (sink and recent) of one sequence and KV head: one per ``tile``."""
    return math.ceil(n_window / tile) if n_window > 0 else 0


def reference_tile_tokens(batch_heads: int, d: int, *, budget: int = REFERENCE_TILE_BYTES) -> int:
    """Tokens per tile of the PyTorch reference: the unpacked fp32 tile of one side within ``budget``
    bytes, a power of two, at least :data:`REFERENCE_MIN_TILE`."""
    per_token = max(1, batch_heads) * d * 4
    n = max(REFERENCE_MIN_TILE, budget // per_token)
    return 1 << (n.bit_length() - 1)


__all__ = [
    "DECODE_MAX_QUERIES", "DECODE_MAX_REGISTERS", "HP_TILE", "PROGRAMS_PER_SM", "REFERENCE_MIN_TILE", "REFERENCE_TILE_BYTES",
    "GROUPED_TILE_TOKENS", "TRITON_MIN_SPLIT_TOKENS", "decode_num_stages", "decode_num_warps", "decode_tile_tokens", "merge_num_warps", "padded_rows",
    "reference_tile_tokens", "row_block", "split_ranges", "triton_splits", "window_splits",
]
