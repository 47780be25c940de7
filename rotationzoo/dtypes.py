"""The one map from the dtype names of rotationzoo (``Int2KVConfig.scale_dtype`` / ``hp_dtype``, model
and window dtypes: :data:`rotationzoo.vocab.DTYPE_NAMES`) to torch dtypes."""

from __future__ import annotations

import torch

#: torch dtype of each dtype name.
TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (a key of :data:`TORCH_DTYPES`).

    Raises:
        KeyError: not a dtype name of rotationzoo.
    """
    return TORCH_DTYPES[name]


__all__ = ["TORCH_DTYPES", "torch_dtype"]
