"""Loading a local causal LM (folder or GGUF) offline, and reading the shape the OSCAR path needs."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from ...dtypes import TORCH_DTYPES
from ...errors import ModelLoadError
from ...hashing import sha256_file
from ...safefile import check_model_files
from .common import require_transformers
from .modelfile import (
    ModelShape,
    check_no_remote_code,
    config_shape,
    gguf_shape,
    model_shape,
    one_line,
    read_gguf_header,
    shape_of_config,
)

__all__ = ["ModelShape", "check_load_options", "load_model", "load_tokenizer", "model_provenance", "model_shape",
           "shape_of_config"]


def check_load_options(dtype: str | torch.dtype | None = "auto",
                       device: str | torch.device = "cpu") -> tuple[Any, torch.device]:
    """``(torch dtype or "auto", torch.device)`` of :func:`load_model`'s ``dtype`` and ``device``, checked before
    anything loads: a device string torch parses, of a kind this machine has (``cuda`` needs a visible GPU,
    ``cuda:N`` at least ``N + 1`` of them), not ``meta`` (it holds no weights).

    Raises:
        ModelLoadError: an unknown dtype, a device torch does not know, or one this machine does not have.
    """
    torch_dtype: Any = dtype
    if isinstance(dtype, str) and dtype != "auto":
        torch_dtype = TORCH_DTYPES.get(dtype)
        if torch_dtype is None:
            raise ModelLoadError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"device {device!r} is not a torch device ({one_line(exc)}); use cpu, cuda, cuda:N or "
                             f"mps") from None
    if dev.type == "cpu":
        return torch_dtype, dev
    if dev.type == "meta":
        raise ModelLoadError(f"device {device!r} holds no weights; use cpu, cuda, cuda:N or mps")
    try:
        backend: Any = torch.get_device_module(dev)  # torch.cuda, torch.mps, torch.xpu, ...
        available = bool(backend.is_available()) if hasattr(backend, "is_available") else False
        count = int(backend.device_count()) if available and hasattr(backend, "device_count") else 1
    except Exception as exc:  # a backend that fails to answer is not usable here
        raise ModelLoadError(f"device {device!r}: torch cannot use it on this machine ({type(exc).__name__}: "
                             f"{one_line(exc)}); use --device cpu") from None
    if not available:
        raise ModelLoadError(f"device {device!r}: this machine has no {dev.type} device torch can use; use "
                             f"--device cpu (or install a torch build for {dev.type})")
    if dev.index is not None and dev.index >= count:
        raise ModelLoadError(f"device {device!r}: this machine has {count} {dev.type} device(s), numbered from 0; "
                             f"give one of them or --device cpu")
    return torch_dtype, dev


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
            is cut short or declares an impossible shape, an unknown dtype, a device this machine does not
            have (all before anything loads), or loading fails.
        MissingDependencyError: transformers is not installed.
    """
    torch_dtype, dev = check_load_options(dtype, device)
    transformers = require_transformers()
    path, folder, kwargs = _where(model)
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    with _load_errors(path):
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
        lm.to(dev)
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
    file's header complete and every tensor byte present; the shape its header or config declares).

    Raises:
        ModelLoadError: as :func:`~rotationzoo.integrations.transformers.modelfile.peek_model`.
    """
    if not os.path.lexists(Path(model).expanduser()):
        raise ModelLoadError(f"model {model} not found; give a local model folder or a .gguf file (nothing is "
                             f"downloaded)")
    path = check_model_files(model)
    kwargs: dict[str, Any] = {"local_files_only": True, "trust_remote_code": False}  # never code from a folder
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        meta, _ = read_gguf_header(path)  # a file cut short fails here, in milliseconds, with one line
        gguf_shape(meta, str(path))  # and so does one declaring no layers, 0 heads or 2^40 layers
        return path, path.parent, {**kwargs, "gguf_file": path.name}
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: no config.json; not a transformers model folder")
    check_no_remote_code(path)
    config_shape(path)  # its counts, before the tokenizer or the weights: no layers, 0 heads, 2^40 layers
    return path, path, kwargs


@contextlib.contextmanager
def _load_errors(path: Path) -> Iterator[None]:
    """transformers', tokenizers' and gguf's loading errors, whatever their type (a tokenizer raises a plain
    ``Exception``), as one :class:`ModelLoadError` line naming the type.

    Raises:
        ModelLoadError: for any ``Exception`` raised inside (not for KeyboardInterrupt or SystemExit).
    """
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path} with transformers ({type(exc).__name__}: {one_line(exc)}); "
                             f"check the model files, or give another model") from None


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
