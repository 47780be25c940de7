"""The keep rule's options for ``fit --refine`` and ``calibrate --refine``: checks, held-out tokens, the run.

Everything a user can get wrong (options without --refine or --keep-text, fewer held-out tokens
than one window) is refused before the model, the capture or the dump is read; the rule itself is
:func:`rotationzoo.evaluate.keep.keep_by_text`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ._output import print_note, progress_reporter

if TYPE_CHECKING:  # pragma: no cover
    from ..fit import FitResult


def check_keep_knobs(keep_text: Optional[list[Path]], keep_tokens: Optional[int], keep_context: Optional[int],
                     refine: Optional[int], keep_model: Optional[str] = None) -> None:
    """Refuse keep-rule options without --refine or without the text they apply to, before anything loads."""
    from ..errors import CLIError

    if (keep_text or keep_model or keep_tokens is not None or keep_context is not None) and refine is None:
        raise CLIError("--keep-text / --keep-model / --keep-tokens / --keep-context judge --refine's result; add "
                       "--refine STEPS")
    if keep_model and not keep_text:
        raise CLIError("--keep-model is the model --keep-text is evaluated with; add --keep-text FILE")
    if (keep_tokens is not None or keep_context is not None) and not keep_text:
        raise CLIError("--keep-tokens / --keep-context set the keep rule on --keep-text; add --keep-text FILE")


def keep_plan(tokens: Optional[int], context: Optional[int], bound: int) -> tuple[int, int, str]:
    """``(window, held-out tokens, what the window is)`` of the keep rule, checked before anything loads.

    ``bound`` is the longest the calibration context can be (--seq-len, the dump's longest prompt): the
    window when --keep-context is not given; ``tokens`` default to 4096, at least one window.
    """
    from ..errors import CLIError
    from ..evaluate.keep import keep_tokens

    window = bound if context is None else context
    want = keep_tokens(window) if tokens is None else tokens
    what = "--keep-context" if context is not None else "the calibration context; --keep-context sets another"
    if want < window:
        raise CLIError(f"--keep-tokens {want} is less than one keep window of {window} tokens ({what}); give "
                       f"--keep-tokens ≥ {window}")
    return window, want, what


def keep_ids(tokenizer: Any, texts: list[Path], plan: tuple[int, int, str]) -> list[int]:
    """The held-out token ids of the keep rule, read before the long work so that a short text fails fast."""
    from ..errors import CLIError
    from ..evaluate.inputs import tokenize_texts

    window, want, what = plan
    ids = tokenize_texts(tokenizer, texts, tokens=want, skip=0)
    if len(ids) < window:
        raise CLIError(f"--keep-text holds {len(ids)} tokens, fewer than one keep window of {window} ({what}); "
                       f"give a longer text")
    return ids


def keep_rule(result: "FitResult", lm: Any, ids: list[int], tokens: Optional[int], context: Optional[int]) -> "FitResult":
    """The keep rule on held-out ``ids`` (:func:`rotationzoo.evaluate.keep.keep_by_text`), with progress.

    Windows of ``context`` tokens (default: the calibration context the result records), ``tokens``
    of the ids (default: 4096, at least one window).
    """
    from ..evaluate.keep import keep_by_text, keep_summary, keep_tokens, keep_window

    window = keep_window(result) if context is None else context
    ids = ids[:keep_tokens(window) if tokens is None else tokens]
    with progress_reporter("keep rule") as progress:
        kept = keep_by_text(lm, ids, result, window=window, progress=progress, source="--keep-text")
    print_note(keep_summary(kept) or "")
    return kept


def keep_model_and_ids(keep_text: Optional[list[Path]], keep_model: Optional[str], keep_tokens: Optional[int],
                       keep_context: Optional[int], bound: int, fits: Any = None) -> Optional[tuple[Any, list[int]]]:
    """``(model, held-out ids)`` for ``fit --refine --keep-text``, checked, loaded and read up front.

    Before the weights load: the texts, the model file (a GGUF cut short), whether rotations of
    ``fits`` (a dump's :class:`~rotationzoo.fit.dump.DumpShape` and layer ids, ``(shape, layer_ids)``)
    fit the model, and the held-out text's token count (with the tokenizer alone).
    """
    from ..errors import CLIError

    if not keep_text:
        return None
    from ..evaluate.inputs import check_texts, find_smollm2_gguf
    from ..integrations.transformers import load_model, load_tokenizer, peek_model

    texts = check_texts(keep_text, option="--keep-text")
    plan = keep_plan(keep_tokens, keep_context, bound)
    path = keep_model or find_smollm2_gguf()
    if path is None:
        raise CLIError("--keep-text needs --keep-model PATH (the SmolLM2 GGUF default is not installed)")
    shape = peek_model(str(path), option="--keep-model")
    if fits is not None:
        _check_fits(fits, shape, str(path))
    tokenizer = load_tokenizer(str(path))
    ids = keep_ids(tokenizer, list(texts), plan)
    print_note(f"loading {path} for the keep rule")
    lm, _ = load_model(str(path), dtype="auto", tokenizer=tokenizer)
    return lm, ids


def _check_fits(fits: Any, shape: Any, path: str) -> None:
    """Refuse a --keep-model that the rotations fitted from the dump cannot run on (before it loads)."""
    from ..errors import CLIError

    dump_shape, layer_ids = fits
    got = (dump_shape.head_dim, dump_shape.num_kv_heads)
    if got != (shape.head_dim, shape.num_kv_heads):
        raise CLIError(f"--keep-model {path} has head_dim {shape.head_dim} and {shape.num_kv_heads} KV heads; the dump "
                       f"has head_dim {got[0]} and {got[1]} KV heads: judge with the model the dump was captured from")
    missing = sorted(set(shape.layer_ids) - set(layer_ids))
    if missing:
        raise CLIError(f"--keep-model {path} has {len(shape.layer_ids)} layers; the dump lacks layers "
                       f"{', '.join(map(str, missing[:8]))}{' ...' if len(missing) > 8 else ''}: judge with the "
                       f"model the dump was captured from (or fit every layer)")


def keep_calibrated(result: "FitResult", lm: Any, held_ids: Optional[list[int]], keep_tokens: Optional[int],
                     keep_context: Optional[int]) -> "FitResult":
    """``calibrate --refine``'s keep rule, on --keep-text (skipped, with a note, without it)."""
    if held_ids is not None:
        return keep_rule(result, lm, held_ids, keep_tokens, keep_context)
    print_note("keep rule skipped: give --keep-text FILE, a text other than the calibration one (the calibration "
               "text's own continuation overstates what refinement gains on other text: docs/fitting.md)")
    return result
