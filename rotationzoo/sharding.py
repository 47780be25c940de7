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

Expert parallelism (SGLang's ``--ep-size``) splits the ``tp`` ranks into ``ep`` groups for the MoE layers
only: each group holds ``1/ep`` of the experts, each expert's weights are split over the ``tp / ep`` ranks of
a group, and attention (the KV heads, their rotations) stays split over all ``tp`` ranks.
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


#: How an engine splits experts: ``"groups"`` of TP ranks (SGLang's ``--ep-size``, a divisor of the TP size),
#: ``"every_rank"`` (vLLM's ``--enable-expert-parallel``: the TP size or nothing), ``"none"`` (no expert parallelism).
EXPERT_PARALLEL = ("groups", "every_rank", "none")


def ep_sizes(tp_size: int, expert_parallel: str = "groups") -> list[int]:
    """The expert-parallel sizes above 1 an engine of that kind takes at ``tp_size`` ranks, smallest first."""
    if expert_parallel == "none" or tp_size < 2:
        return []
    if expert_parallel == "every_rank":
        return [tp_size]
    return [e for e in range(2, tp_size + 1) if not tp_size % e]


def _listed(sizes: list[int], most: int = 4) -> str:
    """``2, 4 or 8``; a long list keeps its first sizes and its last (``2, 3, 4, … or 1024``)."""
    shown = [str(e) for e in sizes]
    if len(shown) > most:
        shown = shown[:most - 1] + ["…", shown[-1]]
    return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]


def check_ep_size(ep_size: Any, tp_size: int, expert_parallel: str = "groups") -> int:
    """``ep_size`` when it is an integer dividing ``tp_size`` (SGLang splits the TP ranks into that many
    expert-parallel groups; ``expert_parallel="every_rank"``: 1 or ``tp_size``, as vLLM);
    :class:`~rotationzoo.errors.ConfigError`, one line, otherwise."""
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or not 1 <= ep_size <= MAX_TP:
        raise ConfigError(f"expert-parallel size must be an integer in [1, {MAX_TP}], got {ep_size!r}")
    if ep_size == 1 or ep_size in ep_sizes(tp_size, expert_parallel):
        return ep_size
    fit = ep_sizes(tp_size, expert_parallel)
    hint = f"try --ep-size {_listed(fit)}" if fit else "use --ep-size 1" + (" at TP 1" if tp_size == 1 else "")
    if expert_parallel == "every_rank":
        why = f"expert parallelism here spans every tensor-parallel rank, so it is 1 or the TP size ({tp_size})"
    elif expert_parallel == "none":
        why = "this engine has no expert parallelism"
    else:
        why = f"it does not divide the tensor-parallel size {tp_size} (the expert groups are made of the TP ranks)"
    raise ConfigError(f"expert-parallel size {ep_size}: {why}; {hint}")


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
                  weight_block_size: int | None = None, ep_size: int = 1, expert_parallel: str = "groups") -> None:
    """Refuse a TP size a model cannot be served at: KV heads that cannot be split (:func:`kv_heads_per_rank`),
    or block-quantized MoE weights whose per-rank gate/up shard ``moe_intermediate_size / (tp / ep)`` is no
    whole number of ``weight_block_size`` blocks (SGLang refuses such a shard at start-up: MiniMax-M2.7's 1536
    over 8 ranks is 192, blocks of 128; with ``--ep-size 2`` each expert is split over 4 ranks, 384). The sizes
    the message suggests pass both rules at the same ``ep_size``, and a refused MoE shard names the expert-
    parallel sizes that would take it on an engine whose experts split as ``expert_parallel`` says
    (:data:`EXPERT_PARALLEL`).

    Raises:
        ConfigError: one line, with TP (or EP) sizes that work.
    """
    tp = _tp(tp_size)
    ep = check_ep_size(ep_size, tp, expert_parallel)
    moe = moe_intermediate_size if weight_block_size is not None else None
    block = weight_block_size or 1

    def heads_fit(t: int) -> bool:
        return num_kv_heads is None or _heads_fit(num_kv_heads, t)

    def moe_fits(t: int, e: int) -> bool:
        return moe is None or not moe % (t // e * block)

    def fits(t: int) -> bool:
        return not t % ep and heads_fit(t) and moe_fits(t, ep)

    if num_kv_heads is not None and heads_fit(tp):
        kv_heads_per_rank(num_kv_heads, tp)  # the heads' own checks
    if fits(tp):
        return
    hint = _sizes_near(tp, fits)
    if not heads_fit(tp):
        raise _heads_error(int(num_kv_heads or 1), tp, hint)
    assert moe is not None
    ranks = tp // ep
    detail = f"{moe} / {ranks} = {moe // ranks}" if not moe % ranks else f"{moe} does not divide by {ranks}"
    over = f"{tp} tensor-parallel ranks" + (f" in {ep} expert-parallel groups" if ep > 1 else "")
    eps = [e for e in ep_sizes(tp, expert_parallel) if e > ep and moe_fits(tp, e)]
    if eps:
        hint += f", or keep --tp {tp} with --ep-size {_listed(eps)}"
    raise ConfigError(f"the MoE weights cannot be split over {over}: each rank's gate/up shard (intermediate size "
                      f"{detail}) must be a whole number of the checkpoint's {block}-wide quantization blocks; "
                      f"{hint}")


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
