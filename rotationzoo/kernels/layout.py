"""Byte layout, argument rules and launch heuristics of the INT2 KV format.

Everything here is plain Python (no torch, no triton) so it can be imported and tested anywhere.

Packing (quarter-interleaved, the SGLang OSCAR layout). A row of ``d`` codes ``q[0..d-1]`` (2 bits
each) becomes ``Q = d // 4`` bytes; byte ``j`` holds dims ``j, j+Q, j+2Q, j+3Q``::

    byte[j] = q[j] | q[j+Q] << 2 | q[j+2Q] << 4 | q[j+3Q] << 6

Worked example, ``d = 128`` (``Q = 32``): dim 0 -> byte 0 bits 0-1; dim 33 -> byte 1 bits 2-3;
dim 70 -> byte 6 bits 4-5; dim 127 -> byte 31 bits 6-7. If ``q[5] = 3``, ``q[37] = 0``,
``q[69] = 2`` and ``q[101] = 1`` then ``byte[5] = 0b01_10_00_11 = 0x63``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from ..errors import KernelInputError
from ..int2kv import HEAD_DIMS, MIN_GROUP_SIZE, allowed_group_sizes, check_group_size

# HEAD_DIMS (64, 128, 256), MIN_GROUP_SIZE (16) and allowed_group_sizes come from the one group-size
# rule, rotationzoo.int2kv.check_group_size, which the config and the planner call too.

QVALUE_BOUNDS: dict[str, tuple[int, int]] = {"uint2": (0, 3)}
"""Code range of each stored integer type (only uint2 here)."""

CLIP_SELECT_MAX_ITERS = 12
"""Clip thresholds needing at most this many max-and-mask (or min-and-mask) passes use them;
others use a 31-step bisection on the float bit pattern. Both return the exact sorted value."""

RADIX_ITERS = 31
"""Passes of the bit-pattern bisection (bits 30..0 of a non-negative fp32)."""


def packed_dim(d: int) -> int:
    """Bytes per packed row: ``d // 4``."""
    return d // 4


def byte_index_and_shift(dim: int, d: int) -> tuple[int, int]:
    """Where dim ``dim`` of a ``d``-wide row lives in its packed row.

    Args:
        dim: element index along head_dim, ``0 <= dim < d``.
        d: head_dim (a multiple of 4).

    Returns:
        ``(byte, shift)``: the code is ``(packed[byte] >> shift) & 3``, with
        ``byte = dim % (d // 4)`` and ``shift = 2 * (dim // (d // 4))``.

    Example (``d = 128``): ``byte_index_and_shift(0, 128) == (0, 0)``,
    ``byte_index_and_shift(33, 128) == (1, 2)``, ``byte_index_and_shift(70, 128) == (6, 4)``,
    ``byte_index_and_shift(127, 128) == (31, 6)``.

    Raises:
        ValueError: ``d`` not a positive multiple of 4 or ``dim`` out of range.
    """
    if not isinstance(d, int) or d <= 0 or d % 4:
        raise ValueError(f"d must be a positive multiple of 4, got {d!r}")
    if not isinstance(dim, int) or not 0 <= dim < d:
        raise ValueError(f"dim must be in [0, {d}), got {dim!r}")
    quarter = d // 4
    return dim % quarter, 2 * (dim // quarter)


def clip_index(clip_ratio: float, d: int) -> int:
    """Sort index of the per-row clip threshold, or ``-1`` when clipping is off.

    ``-1`` if ``clip_ratio <= 0``, else ``min(max(int(clip_ratio * d), 0), d - 1)`` (``int`` floors
    a positive product). The threshold is ``sort(|row|)[index]`` over the full row.
    d=128: 0.96 -> 122, 0.92 -> 117, 1.0 -> 127. A NaN, ``+inf`` or a non-number raises
    :class:`~rotationzoo.errors.KernelInputError`.
    """
    if (isinstance(clip_ratio, bool) or not isinstance(clip_ratio, numbers.Real) or clip_ratio != clip_ratio
            or clip_ratio == math.inf):
        raise KernelInputError(f"clip_ratio must be a finite number (<= 0 disables clipping), got {clip_ratio!r}")
    if clip_ratio <= 0.0:
        return -1
    return min(max(int(clip_ratio * d), 0), d - 1)


def bisect_iters(d: int) -> int:
    """Passes of the decode-flush bisection: ``log2(d)`` for ``d >= 64``, else 0 (exact threshold)."""
    return d.bit_length() - 1 if d >= 64 else 0


def clip_plan(index: int, d: int, *, search: str = "exact") -> tuple[str, int]:
    """How a kernel finds the clip threshold of a row, as ``(mode, passes)``.

    - ``("none", 0)`` when ``index < 0``;
    - ``("bisect", log2(d))`` when ``search == "bisect"`` and ``d >= 64``: the decode flush's
      bisection of ``[0, max|row|]`` (at or below ``sort(|row|)[index]``; ``d < 64`` is exact);
    - otherwise ``sort(|row|)[index]`` exactly:
    - ``("top", d - index)``: repeated max-and-mask, when few values lie above the index
      (d=128, ratio 0.96 -> 6 passes; 0.92 -> 11 passes);
    - ``("bottom", index + 1)``: repeated min-and-mask, when few values lie below it;
    - ``("radix", 31)``: bisection on the fp32 bit pattern otherwise.
    """
    if index < 0:
        return "none", 0
    if search == "bisect" and bisect_iters(d):
        return "bisect", bisect_iters(d)
    above, below = d - index, index + 1
    if min(above, below) <= CLIP_SELECT_MAX_ITERS:
        return ("top", above) if above <= below else ("bottom", below)
    return "radix", RADIX_ITERS


def check_head_dim(d: int) -> None:
    """Raise ``ValueError`` (a ``ConfigError``) unless ``d`` is one of :data:`HEAD_DIMS`."""
    check_group_size(None, d)


def resolve_group_size(d: int, group_size: int | None, *, lloyd_max: bool = False) -> int:
    """``group_size`` (``None`` means ``d``) after the one group-size rule
    (:func:`rotationzoo.int2kv.check_group_size`); raises ``ValueError`` (a ``ConfigError``)."""
    g = check_group_size(group_size, d, lloyd_max=lloyd_max)
    assert g is not None
    return g


# --- launch heuristics (from compiled resource reports, not yet timed on hardware) -------------

_QUANT_LAUNCH: dict[tuple[int, bool], tuple[int, int, int]] = {
    (64, True): (64, 4, 1),
    (64, False): (64, 8, 1),
    (128, True): (64, 8, 1),
    (128, False): (64, 8, 1),
    (256, True): (32, 8, 1),
    (256, False): (16, 8, 1),
}
"""Compiled quantize launch per ``(head_dim, rotate)``: ``(rows per tile, warps, pipeline stages)``.

Picked from ``tools/aot_report.py`` (docs/performance.md, "Ahead-of-time compilation report"): no
register spills on sm_90 or sm_80 (with the ``maxnreg`` ceilings below), then the fewest SASS
instructions per row (the kernel is issue-bound) with enough bytes in flight."""

_QUANT_LAUNCH_SM90: dict[tuple[int, bool], tuple[int, int, int]] = {
    (128, True): (128, 8, 2),
    (256, True): (64, 8, 2),
}
"""Hopper (compute capability 9.x) entries that replace :data:`_QUANT_LAUNCH`'s, with a rotation:
tiles of at least 64 rows feed wgmma (smaller ones fall back to mma.sync), and 2 stages let Triton
prefetch the next tile with asynchronous copies while the product and the clip run. In the serving
case that is 25 % (d = 128) and 42 % (d = 256) fewer instructions per row, without spills on sm_90;
on sm_80 the same tiles spill (255 registers), hence Hopper only."""


_QUANT_MAXNREG: dict[tuple[int, bool], int] = {(128, False): 255}
"""Explicit register ceilings (ptxas ``.maxnreg``) for some :data:`_QUANT_LAUNCH` entries. Without
one, ptxas gave one d = 128 variant (min-and-mask clip, bf16 scale, paged store) 80 registers and
8 bytes of spills on sm_90; with the explicit architectural ceiling it takes 96 and spills nothing."""


_QUANT_MAXNREG_SM80: dict[tuple[int, bool], int] = {(128, True): 255}
"""Ampere (compute capability 8.x) ceilings: without one, ptxas held six d = 128 rotating G = 16
variants (64 rows × 8 warps) to 128 registers with 8 bytes of spills; with it they take 167–173 and
spill nothing (same residency: one 8-warp block per SM either way)."""


def quant_max_registers(d: int, block_rows: int, num_warps: int, *, rotate: bool, capability: int | None = None
                        ) -> int | None:
    """Register ceiling for the compiler (``maxnreg``) at the launch table's own entry, else ``None``."""
    rows, warps, _ = _quant_launch(d, rotate, capability)
    if (block_rows, num_warps) != (rows, warps):
        return None
    key = (d, bool(rotate))
    return _for_arch(_QUANT_MAXNREG_BY_ARCH, capability, key, _QUANT_MAXNREG.get(key))


def _quant_launch(d: int, rotate: bool, capability: int | None) -> tuple[int, int, int]:
    key = (d, bool(rotate))
    return _for_arch(_QUANT_LAUNCH_BY_ARCH, capability, key, _QUANT_LAUNCH.get(key, (32 if d >= 256 else 64, 8, 1)))


_QUANT_LAUNCH_BY_ARCH = {9: _QUANT_LAUNCH_SM90}
_QUANT_MAXNREG_BY_ARCH = {8: _QUANT_MAXNREG_SM80}


def _for_arch(tables: Mapping[int, Mapping[Any, Any]], capability: int | None, key: Any, default: Any) -> Any:
    """``tables[major][key]`` for the GPU's major compute capability when it has that entry, else ``default``."""
    if capability is None:
        return default
    return tables.get(capability // 10, {}).get(key, default)


def quant_block_rows(d: int, *, rotate: bool, interpret: bool = False, capability: int | None = None) -> int:
    """Rows per tile of the quantize kernel.

    Compiled (``capability`` = 10 * major + minor of the GPU, ``None`` if unknown): from the launch
    tables (``tl.dot`` needs at least 16 rows): 64 at d = 64 and d = 128 (128 with a rotation on
    Hopper), 32 with a rotation (64 on Hopper) and 16 without at d = 256. Interpreted: 64 rows
    (fewer, larger numpy steps).
    """
    if interpret:
        return 64
    return _quant_launch(d, rotate, capability)[0]


def quant_num_warps(d: int, block_rows: int, *, rotate: bool, capability: int | None = None) -> int:
    """Warps per program: the launch table's for its block size; otherwise one 128-bit (8 x bf16)
    load per thread per step, 4..8 warps."""
    rows, warps, _ = _quant_launch(d, rotate, capability)
    if block_rows == rows:
        return warps
    elems = block_rows * d
    warps = elems // (32 * 8 * 4)  # four 128-bit loads per thread
    return int(min(max(warps, 4), 8))


def quant_num_stages(d: int, block_rows: int, *, rotate: bool, capability: int | None = None) -> int:
    """Software-pipelining stages of the quantize kernel's tile loop (1: no prefetch): the launch
    table's for its block size, else 1."""
    rows, _, stages = _quant_launch(d, rotate, capability)
    return stages if block_rows == rows else 1


def quant_launch_candidates(d: int) -> tuple[tuple[int, int, int], ...]:
    """``(rows per tile, warps, stages)`` tried by ``bench_kernels.py --sweep`` and ``aot_report.py``.

    Rows 16..128 x 4 or 8 warps x 1 or 2 stages; 128-row tiles only below d = 256.
    """
    rows = (16, 32, 64, 128) if d < 256 else (16, 32, 64)
    return tuple((bt, w, s) for bt in rows for w in (4, 8) for s in (1, 2))


def dequant_block_rows(d: int, *, interpret: bool = False) -> int:
    """Rows per tile of the dequantize kernel (64; 32 at d=256)."""
    if interpret:
        return 64
    return 32 if d >= 256 else 64


_DEQUANT_WARPS_SM80: dict[int, int] = {256: 8}
"""Ampere (8.x): at d = 256 (32 rows) with 4 warps ptxas held one variant (G = 128, fp16 scale and
output) to 80 registers with 8 bytes of spills; with 8 warps all 45 d = 256 variants take 48–66
registers and spill nothing. Hopper keeps 4 (with 8, three d = 256 variants spill there)."""
_DEQUANT_WARPS_BY_ARCH = {8: _DEQUANT_WARPS_SM80}


def dequant_num_warps(d: int, block_rows: int, *, capability: int | None = None) -> int:
    """Warps per dequantize program (4; 8 at d = 256 on sm_8x)."""
    del block_rows
    return _for_arch(_DEQUANT_WARPS_BY_ARCH, capability, d, 4)


def persistent_programs(num_tiles: int, num_heads: int, num_sms: int, *, per_sm: int = 4) -> int:
    """Programs along the tile axis of a persistent launch (the grid is ``(this, num_heads)``).

    Enough programs to fill ``per_sm`` slots on every SM, never more than there are tiles, at least
    one. A program keeps the rotation matrix loaded across all the tiles it visits.
    """
    if num_tiles <= 0:
        return 1
    want = max(1, math.ceil(num_sms * per_sm / max(num_heads, 1)))
    return int(min(num_tiles, want))
