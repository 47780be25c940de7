"""The INT2-KV settings a kernel call runs with: an :class:`~rotationzoo.int2kv.Int2KVConfig`, loose
keywords, or both.

Every kernel entry point takes ``config=`` (the one carrier of the INT2 settings, with ``side="k"``
or ``"v"`` choosing the clip ratio) and, for compatibility, the loose keywords it always took
(``clip_ratio``, ``group_size``, ``lloyd_max``, ``scale_dtype``, ``clip_search``). The rule when both
are given: a keyword that repeats the config's value is accepted, one that disagrees is refused with
one line. Without a config the keywords' historical defaults apply (no clip, one group per row,
uniform levels, fp32 scale/zero, the exact clip search).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import KernelInputError
from ..int2kv import Int2KVConfig
from ..vocab import SIDES

#: torch dtype of each dtype name of :class:`~rotationzoo.int2kv.Int2KVConfig`.
TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                        "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Settings:
    """The resolved settings of one call (``group_size`` ``None`` = head_dim, only without a config)."""

    clip_ratio: float
    group_size: int | None
    lloyd_max: bool
    scale_dtype: torch.dtype
    clip_search: str


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def resolve(config: object, side: object, *, clip_ratio: Any = None, group_size: Any = None, lloyd_max: Any = None,
            scale_dtype: Any = None, clip_search: Any = None, head_dim: int | None = None) -> Settings:
    """The settings of a call from ``config`` (or ``None``) and the loose keywords (``None`` = not given).

    Args:
        config: an :class:`Int2KVConfig` or ``None``.
        side: ``"k"`` or ``"v"``: which of the config's clip ratios applies.
        clip_ratio, group_size, lloyd_max, scale_dtype, clip_search: the loose keywords.
        head_dim: lets ``group_size=head_dim`` agree with a config whose ``group_size`` is ``None``.

    Raises:
        KernelInputError: ``config`` is not an ``Int2KVConfig``, ``side`` is not ``"k"``/``"v"``, or a
            keyword disagrees with the config.
    """
    if side not in SIDES:
        raise KernelInputError(f"side must be 'k' or 'v' (which clip ratio of the config applies), got {side!r}")
    if config is None:
        return Settings(
            clip_ratio=0.0 if clip_ratio is None else clip_ratio,
            group_size=group_size,
            lloyd_max=False if lloyd_max is None else lloyd_max,
            scale_dtype=torch.float32 if scale_dtype is None else scale_dtype,
            clip_search="exact" if clip_search is None else clip_search,
        )
    if not isinstance(config, Int2KVConfig):
        raise KernelInputError(f"config must be a rotationzoo.Int2KVConfig, got {type(config).__name__}")
    ratio_name = f"{side}_clip_ratio"
    cfg_group = config.group_size
    if group_size is not None and head_dim is not None and cfg_group is None and group_size == head_dim:
        cfg_group = head_dim  # None means head_dim: the same setting spelled out
    given = (("clip_ratio", clip_ratio, ratio_name, config.clip_ratio(str(side))),
             ("group_size", group_size, "group_size", cfg_group),
             ("lloyd_max", lloyd_max, "lloyd_max", config.lloyd_max),
             ("scale_dtype", scale_dtype, "scale_dtype", TORCH_DTYPES[config.scale_dtype]),
             ("clip_search", clip_search, "clip_search", config.clip_search))
    for keyword, value, field, want in given:
        if value is None:
            continue
        if keyword == "clip_ratio":
            same = not isinstance(value, bool) and isinstance(value, (int, float)) and float(value) == want
        else:
            same = value is want if keyword == "lloyd_max" else value == want
        if not same:
            shown = _name(want) if keyword == "scale_dtype" else want
            raise KernelInputError(
                f"{keyword}={_name(value) if keyword == 'scale_dtype' else value!r} conflicts with "
                f"config.{field}={shown!r}; give the setting once, in the config or as a keyword"
            )
    group = config.group_size if head_dim is None else config.group_for(head_dim)
    return Settings(clip_ratio=config.clip_ratio(str(side)), group_size=group, lloyd_max=config.lloyd_max,
                    scale_dtype=TORCH_DTYPES[config.scale_dtype], clip_search=config.clip_search)


__all__ = ["Settings", "TORCH_DTYPES", "resolve"]
