"""Tensor-parallel sharding of per-KV-head rotations, by the authors' server's rule.

Under tensor parallelism each rank holds a contiguous block of KV heads. SGLang requires
``H % tp == 0`` (each rank holds ``H / tp`` heads) or ``tp % H == 0`` (fewer KV heads than ranks: each
head is replicated on ``tp / H`` consecutive ranks). A per-KV-head rotation set is sharded the same
way: rank ``r`` keeps heads ``[b, b + local)`` with ``local = max(1, H // tp)``,
``rep = local · tp / H`` (1 unless heads are replicated) and ``b = (r // rep) · local``; its
companions with a head axis (``k_mean [H, d]``, ``q_rotation``, …) are sharded alike, and ``[d]``
vectors and one-rotation-per-layer sets are the same on every rank. A bare stacked tensor is never
sharded: its first axis could be layers or heads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover - the rule itself needs no torch (the registry checks TP sizes with it)
    from .rotation_set import RotationSet

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


def shard_set(rs: "RotationSet", tp_size: int, rank: int) -> "RotationSet":
    """The part of ``rs`` that rank ``rank`` of ``tp_size`` loads: its KV heads of a per-KV-head set (with
    the companions' head axes), or ``rs`` itself for one rotation per layer.

    Raises:
        ConfigError: a bad rank, heads that cannot be split (see :func:`kv_heads_per_rank`).
    """
    from .rotation_set import COMPANIONS

    tp = _tp(tp_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tp:
        raise ConfigError(f"rank must be an integer in [0, {tp}), got {rank!r}")
    if not rs.per_head:
        return rs
    heads = kv_heads_per_rank(rs.num_kv_heads or 1, tp)[rank]
    lo, hi = heads[0], heads[-1] + 1
    changes: dict[str, Any] = {"rotations": rs.stacked(what="sharding")[:, lo:hi].contiguous()}
    for f in ("eigenvalues", *COMPANIONS):
        value = getattr(rs, f)
        if value is None:
            continue
        t = rs.stacked(f, what="sharding")
        changes[f] = t[:, lo:hi].contiguous() if t.dim() >= 3 else t  # [L, H, ...] sliced; [L, d] kept
    return replace(rs, **changes)
