"""Tensor-parallel sharding of per-KV-head rotations, by the authors' server's rule.

Under tensor parallelism each rank holds a contiguous block of KV heads. SGLang requires
``H % tp == 0`` (each rank holds ``H / tp`` heads) or ``tp % H == 0`` (fewer KV heads than ranks: each
head is replicated on ``tp / H`` consecutive ranks). A per-KV-head rotation set is sharded the same
way: rank ``r`` keeps heads ``[b, b + local)`` with ``local = max(1, H // tp)``,
``rep = local · tp / H`` (1 unless heads are replicated) and ``b = (r // rep) · local``; its
companions with a head axis (``k_mean [H, d]``, ``q_rotation``, …) are sharded alike, and ``[d]``
vectors and one-rotation-per-layer sets are the same on every rank. A bare stacked tensor is never
sharded: its first axis could be layers or heads. The rule is here (no torch: the registry checks TP sizes
with it); :func:`rotationzoo.files.rotation_set.shard_set` applies it to a set.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

#: Largest tensor-parallel size accepted.
MAX_TP = 1024


def _tp(tp_size: Any) -> int:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or not 1 <= tp_size <= MAX_TP:
        raise ConfigError(f"tensor-parallel size must be an integer in [1, {MAX_TP}], got {tp_size!r}")
    return tp_size


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> list[tuple[int, ...]]:
    """The KV heads each rank ``0 … tp_size−1`` holds.

    Raises:
        ConfigError: the heads cannot be split over ``tp_size`` ranks (neither ``H % tp == 0`` nor
            ``tp % H == 0``), e.g. 4 KV heads over 3 ranks.
    """
    tp = _tp(tp_size)
    h = num_kv_heads
    if isinstance(h, bool) or not isinstance(h, int) or h < 1:
        raise ConfigError(f"number of KV heads must be a positive integer, got {h!r}")
    if h % tp and tp % h:
        raise ConfigError(f"{h} KV heads cannot be split over {tp} tensor-parallel ranks: the ranks must divide the "
                          f"heads ({h} % {tp} = {h % tp}) or the heads the ranks ({tp} % {h} = {tp % h}); "
                          f"try --tp {', '.join(str(t) for t in _valid_tps(h, tp))}")
    local = max(1, h // tp)
    rep = (local * tp) // h if local * tp > h else 1
    out = []
    for rank in range(tp):
        begin = (rank // rep) * local
        out.append(tuple(range(begin, begin + local)))
    return out


def _valid_tps(h: int, near: int) -> list[int]:
    cands = sorted({t for t in range(1, 4 * max(h, near) + 1) if h % t == 0 or t % h == 0}, key=lambda t: (abs(t - near), t))
    return sorted(cands[:3])
