"""``transformers`` integration: load a local model, capture post-RoPE Q/K/V and calibrate, and run
a model with an OSCAR INT2 KV cache.

Modules: :mod:`~.loading` (``load_model``, ``load_tokenizer``, ``model_shape``), :mod:`~.modelfile` (``peek_model``: the shape
before loading), :mod:`~.capture` (``QKVCapture``),
:mod:`~.calibration` (``calibrate``, ``collect_statistics``, ``capture_to_dump``), :mod:`~.texts`
(``check_text_files``, ``read_token_ids``: texts checked up front, read in bounded pieces), :mod:`~.oscar`
(``OscarKV``: rotations + :class:`~rotationzoo.int2kv.Int2KVConfig`), :mod:`~.attention`
(``oscar_kv``: the decode-time simulation), :mod:`~.cache` (``OscarInt2Cache`` for ``generate()``).

Example::

    import rotationzoo
    from rotationzoo.integrations.transformers import OscarKV, load_model, oscar_kv

    model, tokenizer = load_model("models/Qwen3-8B")          # local folder or a .gguf file
    pair = rotationzoo.load("Qwen3-8B")
    oscar = OscarKV.from_rotations(pair, pair.config())       # the entry's serving settings
    with oscar_kv(model, oscar) as kv:
        out = model.generate(**inputs, cache=kv.new_cache(), max_new_tokens=64)   # real INT2 cache
        logits = model(input_ids, use_cache=False).logits                          # decode-time simulation

``cache=`` is transformers 5.24's name; earlier versions (every one Python 3.10 installs) take
``past_key_values=``, and ``model.generate(**inputs, **kv.cache_kwargs())`` runs on either.

``transformers`` is an optional dependency (``pip install rotationzoo[transformers]``), imported
only when these functions run; a missing install raises
:class:`~rotationzoo.errors.MissingDependencyError`. Nothing is downloaded: loading uses
``local_files_only=True``.
"""

from __future__ import annotations

from typing import Any

from .attention import OSCAR_IMPL_PREFIX, OscarSession, oscar_attention_name, oscar_kv, simulated_int2_attention
from .cache import cache_classes
from .common import cache_argument
from .calibration import (
    WARMUP_TOKENS,
    CalibrationProgress,
    CapturedStatistics,
    calibrate,
    capture_to_dump,
    collect_statistics,
    token_windows,
)
from .capture import CAPTURE_IMPL_PREFIX, QKVCallback, QKVCapture, capture_attention_name
from .loading import ModelShape, load_model, load_tokenizer, model_shape
from .modelfile import peek_model
from .oscar import OscarKV
from .texts import check_text_files, read_token_ids

__all__ = [
    "CAPTURE_IMPL_PREFIX",
    "OSCAR_IMPL_PREFIX",
    "WARMUP_TOKENS",
    "CalibrationProgress",
    "CapturedStatistics",
    "ModelShape",
    "OscarInt2Cache",
    "OscarInt2Layer",
    "OscarKV",
    "OscarSession",
    "QKVCallback",
    "QKVCapture",
    "cache_argument",
    "calibrate",
    "capture_attention_name",
    "capture_to_dump",
    "check_text_files",
    "collect_statistics",
    "load_model",
    "load_tokenizer",
    "model_shape",
    "oscar_attention_name",
    "oscar_kv",
    "peek_model",
    "read_token_ids",
    "simulated_int2_attention",
    "token_windows",
]


def __getattr__(name: str) -> Any:
    if name in ("OscarInt2Cache", "OscarInt2Layer"):
        return cache_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
