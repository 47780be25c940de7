"""Loading a local causal LM (folder or GGUF) offline, and reading the shape the OSCAR path needs."""

from __future__ import annotations

import contextlib
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator

import torch

from ...dtypes import TORCH_DTYPES
from ...errors import ModelLoadError
from ...hashing import sha256_file
from ...safefile import check_model_files
from .common import require_transformers
from .modelfile import ModelShape, check_no_remote_code, model_shape, read_gguf_header, shape_of_config

__all__ = ["ModelShape", "load_model", "load_tokenizer", "model_provenance", "model_shape", "shape_of_config"]


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
    tokenizer: Any = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a local folder or a local ``.gguf`` file, offline.

    Args:
        model: a folder with ``config.json`` (``save_pretrained`` layout) or a ``.gguf`` file
            (dequantised by transformers; needs the ``gguf`` package).
        dtype: ``"auto"`` (the checkpoint's dtype), a dtype name (``"bfloat16"``, ...) or a
            ``torch.dtype``.
        device: where to put the model.
        tokenizer: the tokenizer, if already loaded (:func:`load_tokenizer`); else it is loaded too.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelLoadError: the path does not exist, is neither a folder nor a ``.gguf`` file, a GGUF file
            is cut short, or loading fails.
        MissingDependencyError: transformers is not installed.
    """
    transformers = require_transformers()
    path, folder, kwargs = _where(model)
    torch_dtype: Any = dtype
    if isinstance(dtype, str) and dtype != "auto":
        torch_dtype = TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    with _load_errors(path):
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
    lm.to(device)
    lm.eval()
    return lm, tok


def load_tokenizer(model: str | os.PathLike[str]) -> Any:
    """The tokenizer of a local model folder or ``.gguf`` file, offline, without the weights (so that texts
    can be tokenized and checked before a long model load).

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    transformers = require_transformers()
    path, folder, kwargs = _where(model)
    with _load_errors(path):
        return transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)


def _where(model: str | os.PathLike[str]) -> tuple[Path, Path, dict[str, Any]]:
    """``(path, folder, from_pretrained keywords)`` of a model, its files checked first (regular files; a GGUF
    file's header complete and every tensor byte present)."""
    if not os.path.lexists(Path(model).expanduser()):
        raise ModelLoadError(f"model {model} not found; give a local model folder or a .gguf file (nothing is "
                             f"downloaded)")
    path = check_model_files(model)
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}  # never code from a folder
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        read_gguf_header(path)  # a file cut short fails here, in milliseconds, with one line
        return path, path.parent, {**kwargs, "gguf_file": path.name}
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json; not a transformers model folder")
    check_no_remote_code(path)
    return path, path, kwargs


@contextlib.contextmanager
def _load_errors(path: Path) -> Iterator[None]:
    """transformers' and gguf's loading errors as one :class:`ModelLoadError` line."""
    try:
        yield
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, struct.error, IndexError, EOFError,
            TypeError, AttributeError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"cannot load {path} with transformers: {msg}") from None


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
