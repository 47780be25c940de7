"""The INT2-KV settings a kernel call runs with: an :class:`~rotationzoo.int2kv.Int2KVConfig`, or
none (no clip, one group per row, uniform levels, fp32 scale/zero, the exact clip search).

Every kernel entry point takes the settings as ``config=`` (``side="k"`` or ``"v"`` choosing the clip
ratio); there are no loose keywords beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import TORCH_DTYPES
from ..errors import ConfigError, KernelInputError
from ..int2kv import Int2KVConfig
from ..vocab import SIDES


@dataclass(frozen=True)
class Settings:
    """The resolved settings of one call at one head_dim."""

    clip_ratio: float
    group_size: int
    lloyd_max: bool
    scale_dtype: torch.dtype
    clip_search: str


def resolve(config: object, side: object, head_dim: int) -> Settings:
    """The settings of a call on rows of ``head_dim`` values from ``config`` (or ``None``).

    Raises:
        KernelInputError: ``config`` is not an ``Int2KVConfig``, ``side`` is not ``"k"``/``"v"``, or the
            config's group size does not fit ``head_dim``.
    """
    if side not in SIDES:
        raise KernelInputError(f"side must be 'k' or 'v' (which clip ratio of the config applies), got {side!r}")
    if config is None:
        return Settings(clip_ratio=0.0, group_size=head_dim, lloyd_max=False, scale_dtype=torch.float32,
                        clip_search="exact")
    if not isinstance(config, Int2KVConfig):
        raise KernelInputError(f"config must be a rotationzoo.Int2KVConfig, got {type(config).__name__}")
    try:
        group = config.group_for(head_dim)
    except ConfigError as exc:
        raise KernelInputError(str(exc)) from None
    return Settings(clip_ratio=config.clip_ratio(str(side)), group_size=group, lloyd_max=config.lloyd_max,
                    scale_dtype=TORCH_DTYPES[config.scale_dtype], clip_search=config.clip_search)


__all__ = ["Settings", "TORCH_DTYPES", "resolve"]
