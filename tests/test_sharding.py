"""Tensor-parallel sharding of per-KV-head rotations: contiguous head blocks, replication when there are
fewer KV heads than ranks, a one-line error otherwise; shared sets and [d] vectors are not sharded."""

from __future__ import annotations

import pytest
import torch

import layouts
from rotationzoo.errors import ConfigError
from rotationzoo.files.rotation_set import RotationSet
from rotationzoo.files.rotation_set import shard_set
from rotationzoo.sharding import kv_heads_per_rank


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
