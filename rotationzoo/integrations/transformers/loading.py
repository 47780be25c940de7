"""Loading a local causal LM (folder or GGUF) offline, and reading the shape the OSCAR path needs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import ModelLoadError
from ...hashing import sha256_file
from .common import require_transformers


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a local folder or a local ``.gguf`` file, offline.

    Args:
        model: a folder with ``config.json`` (``save_pretrained`` layout) or a ``.gguf`` file
            (dequantised by transformers; needs the ``gguf`` package).
        dtype: ``"auto"`` (the checkpoint's dtype), a dtype name (``"bfloat16"``, ...) or a
            ``torch.dtype``.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelLoadError: the path does not exist, is neither a folder nor a ``.gguf`` file, or loading fails.
        MissingDependencyError: transformers is not installed.
    """
    transformers = require_transformers()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {path} not found; give a local model folder or a .gguf file (nothing is downloaded)")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        folder, kwargs["gguf_file"] = path.parent, path.name
    else:
        folder = path
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder}: no config.json; not a transformers model folder")
    torch_dtype: Any = dtype
    if isinstance(dtype, str) and dtype != "auto":
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, ImportError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load {path} with transformers: {msg}") from None
    lm.to(device)
    lm.eval()
    return lm, tok


@dataclass(frozen=True)
class ModelShape:
    """What the OSCAR path needs to know about a decoder.

    Attributes:
        head_dim: ``d``.
        num_q_heads: query heads per layer.
        num_kv_heads: key/value heads per layer.
        layer_ids: attention layer indices.
        context_length: the model's maximum context (``max_position_embeddings``), if known.
    """

    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    layer_ids: tuple[int, ...]
    context_length: int | None


def model_shape(model: Any) -> ModelShape:
    """The :class:`ModelShape` of a transformers decoder (from its text config)."""
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = int(cfg.num_attention_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    ctx = getattr(cfg, "max_position_embeddings", None)
    return ModelShape(head_dim=d, num_q_heads=heads, num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                      layer_ids=tuple(range(int(cfg.num_hidden_layers))), context_length=int(ctx) if ctx else None)


_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")


def model_provenance(model: Any, path: str | os.PathLike[str] | None = None,
                     revision: str | None = None) -> dict[str, Any]:
    """What identifies the calibrated model, for the files' ``calibration`` record: ``model_revision``
    (``revision`` if given, else the commit transformers recorded, else the commit of a Hugging Face cache
    snapshot folder the path lies in, else ``None``) and, for a single ``.gguf`` file, its ``model_sha256``."""
    out: dict[str, Any] = {}
    rev = revision or getattr(getattr(model, "config", None), "_commit_hash", None)
    if not rev and path is not None:
        m = _SNAPSHOT.search(Path(path).expanduser().resolve().as_posix())
        rev = m.group(1) if m else None
    out["model_revision"] = rev if isinstance(rev, str) else None
    if path is not None and Path(path).suffix.lower() == ".gguf" and Path(path).is_file():
        out["model_sha256"] = sha256_file(Path(path).expanduser())
    return out
