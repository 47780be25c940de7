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

from typing import Any, Callable

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
    if not _heads_fit(h, tp):
        raise _heads_error(h, tp, _sizes_near(tp, lambda t: _heads_fit(h, t)))
    local = max(1, h // tp)
    rep = (local * tp) // h if local * tp > h else 1
    out = []
    for rank in range(tp):
        begin = (rank // rep) * local
        out.append(tuple(range(begin, begin + local)))
    return out


def check_tp_size(tp_size: int, *, num_kv_heads: int | None = None, moe_intermediate_size: int | None = None,
                  weight_block_size: int | None = None) -> None:
    """Refuse a TP size a model cannot be served at: KV heads that cannot be split (:func:`kv_heads_per_rank`),
    or block-quantized MoE weights whose per-rank gate/up shard ``moe_intermediate_size / tp`` is no whole
    number of ``weight_block_size`` blocks (SGLang refuses such a shard at start-up: MiniMax-M2.7's 1536 over
    8 ranks is 192, blocks of 128). The sizes the message suggests pass both rules.

    Raises:
        ConfigError: one line, with TP sizes that work.
    """
    tp = _tp(tp_size)
    moe = moe_intermediate_size if weight_block_size is not None else None
    block = weight_block_size or 1

    def heads_fit(t: int) -> bool:
        return num_kv_heads is None or _heads_fit(num_kv_heads, t)

    def fits(t: int) -> bool:
        return heads_fit(t) and (moe is None or not moe % (t * block))

    if num_kv_heads is not None and heads_fit(tp):
        kv_heads_per_rank(num_kv_heads, tp)  # the heads' own checks
    if fits(tp):
        return
    hint = _sizes_near(tp, fits)
    if not heads_fit(tp):
        raise _heads_error(int(num_kv_heads or 1), tp, hint)
    assert moe is not None
    detail = f"{moe} / {tp} = {moe // tp}" if not moe % tp else f"{moe} does not divide by {tp}"
    raise ConfigError(f"the MoE weights cannot be split over {tp} tensor-parallel ranks: each rank's gate/up shard "
                      f"(intermediate size {detail}) must be a whole number of the checkpoint's {block}-wide "
                      f"quantization blocks; {hint}")


def _heads_fit(h: int, tp: int) -> bool:
    """The authors' rule: the ranks divide the heads, or the heads the ranks."""
    return h % tp == 0 or tp % h == 0


def _heads_error(h: int, tp: int, hint: str) -> ConfigError:
    return ConfigError(f"{h} KV heads cannot be split over {tp} tensor-parallel ranks: the ranks must divide the "
                       f"heads ({h} % {tp} = {h % tp}) or the heads the ranks ({tp} % {h} = {tp % h}); {hint}")


def _sizes_near(tp: int, fits: Callable[[int], bool]) -> str:
    """The three TP sizes nearest ``tp`` (up to :data:`MAX_TP`) that ``fits``, as the end of an error line."""
    near = sorted(sorted((t for t in range(1, MAX_TP + 1) if fits(t)), key=lambda t: (abs(t - tp), t))[:3])
    return f"try --tp {', '.join(map(str, near))}" if near else "no TP size splits them"
