"""Tensor-parallel sharding of per-KV-head rotations: contiguous head blocks, replication when there are
fewer KV heads than ranks, a one-line error otherwise; shared sets and [d] vectors are not sharded."""

from __future__ import annotations

import pytest
import torch

import layouts
from rotationzoo.errors import ConfigError
from rotationzoo.files.rotation_set import RotationSet
from rotationzoo.files.rotation_set import shard_set
from rotationzoo.launch import LaunchConfig
from rotationzoo.sharding import check_ep_size, check_tp_size, ep_sizes, kv_heads_per_rank


@pytest.mark.parametrize("heads, tp, want", [
    (8, 1, [tuple(range(8))]),
    (8, 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),
    (4, 4, [(0,), (1,), (2,), (3,)]),
    (2, 4, [(0,), (0,), (1,), (1,)]),  # replicated: two ranks per head
    (1, 8, [(0,)] * 8),
])
def test_heads_per_rank(heads, tp, want) -> None:
    assert kv_heads_per_rank(heads, tp) == want


@pytest.mark.parametrize("heads, tp", [(4, 3), (8, 3), (6, 4), (8, 0), (8, 2000)])
def test_impossible_splits_are_one_line(heads, tp) -> None:
    with pytest.raises(ConfigError) as ei:
        kv_heads_per_rank(heads, tp)
    assert "\n" not in str(ei.value)


def test_a_per_head_set_is_sliced_with_its_companions() -> None:
    rs = RotationSet(layouts.orthogonal(3, 4, 8, 8), range(3), eigenvalues=torch.rand(3, 4, 8),
                     k_mean=torch.randn(3, 4, 8), q_rotation=layouts.orthogonal(3, 4, 8, 8, seed=2))
    part = shard_set(rs, 2, 1)
    assert part.num_kv_heads == 2 and torch.equal(part.rotations, rs.rotations[:, 2:4])
    assert torch.equal(part.k_mean, rs.k_mean[:, 2:4]) and torch.equal(part.q_rotation, rs.q_rotation[:, 2:4])
    assert torch.equal(part.eigenvalues, rs.eigenvalues[:, 2:4])
    shared_mean = RotationSet(layouts.orthogonal(3, 4, 8, 8), range(3), k_mean=torch.randn(3, 8))
    assert torch.equal(shard_set(shared_mean, 4, 3).k_mean, shared_mean.k_mean)  # [d] vectors pass


def test_a_shared_set_is_the_same_on_every_rank() -> None:
    rs = RotationSet(layouts.orthogonal(36, 8, 8), range(36))  # [L, d, d]: 36 layers, never 36 heads
    assert shard_set(rs, 8, 5) is rs


def test_expert_parallelism_splits_each_expert_over_tp_over_ep_ranks() -> None:
    """MiniMax-M2.7's FP8 MoE weights (1536, blocks of 128): TP 8 alone leaves 192-wide shards; with EP 2 each
    expert is split over 4 ranks (384, three blocks) and the KV heads still over 8 ranks."""
    moe = {"num_kv_heads": 8, "moe_intermediate_size": 1536, "weight_block_size": 128}
    with pytest.raises(ConfigError, match=r"1536 / 8 = 192\) .* try --tp 1, 2, 4, or keep --tp 8 with --ep-size "
                                          r"2, 4 or 8$"):
        check_tp_size(8, **moe)
    for ep in (2, 4, 8):
        check_tp_size(8, ep_size=ep, **moe)
    # 1536 over 16 ranks in 2 groups: 192 again; the message counts the ranks of a group and names what fits
    with pytest.raises(ConfigError, match=r"over 16 tensor-parallel ranks in 2 expert-parallel groups: .*"
                                          r"\(intermediate size 1536 / 8 = 192\).* --ep-size 4, 8 or 16$"):
        check_tp_size(16, num_kv_heads=16, moe_intermediate_size=1536, weight_block_size=128, ep_size=2)
    # the KV heads are not expert-parallel: 8 heads over 6 ranks stay refused whatever the EP size
    with pytest.raises(ConfigError, match="8 KV heads cannot be split over 6"):
        check_tp_size(6, ep_size=2, **moe)


@pytest.mark.parametrize("ep, tp, message", [
    (3, 8, r"expert-parallel size 3: it does not divide the tensor-parallel size 8 .* try --ep-size 2, 4 or 8$"),
    (2, 1, r"expert-parallel size 2: it does not divide the tensor-parallel size 1 .* use --ep-size 1 at TP 1$"),
    (0, 8, r"expert-parallel size must be an integer in \[1, 1024\], got 0"),
    (True, 8, "expert-parallel size must be an integer"),
])
def test_an_ep_size_that_does_not_divide_the_tp_size_is_one_line(ep, tp, message) -> None:
    """As SGLang takes it (groups of TP ranks); vLLM's spans every rank and takes 1 or the TP size only."""
    with pytest.raises(ConfigError, match=message) as ei:
        check_ep_size(ep, tp)
    assert "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(tp_size=tp, ep_size=ep)


def test_vllms_expert_parallelism_takes_the_tp_size_only() -> None:
    assert ep_sizes(12, "every_rank") == [12] and ep_sizes(12) == [2, 3, 4, 6, 12] and ep_sizes(12, "none") == []
    assert check_ep_size(12, 12, "every_rank") == 12 and check_ep_size(1, 12, "every_rank") == 1
    with pytest.raises(ConfigError, match=r"spans every tensor-parallel rank, so it is 1 or the TP size \(12\); "
                                          r"try --ep-size 12$"):
        check_ep_size(6, 12, "every_rank")
    with pytest.raises(ConfigError, match=r"try --ep-size 2, 4, 8, … or 1024$"):  # a long list keeps its last size
        check_ep_size(5, 1024)
    moe = {"num_kv_heads": 8, "moe_intermediate_size": 1536, "weight_block_size": 128}
    with pytest.raises(ConfigError, match=r"keep --tp 8 with --ep-size 8$"):  # only what vLLM launches
        check_tp_size(8, expert_parallel="every_rank", **moe)
    with pytest.raises(ConfigError, match=r"try --tp 1, 2, 4$"):  # no expert parallelism: no EP suggested
        check_tp_size(8, expert_parallel="none", **moe)
