"""The keep rule as ``fit --refine`` and ``calibrate --refine`` print it; the rule and its checks are
:mod:`rotationzoo.workflows.keep`'s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ._output import print_note, progress_reporter

if TYPE_CHECKING:  # pragma: no cover
    from ..fit import FitResult


def keep_rule(result: "FitResult", lm: Any, ids: list[int], tokens: Optional[int], context: Optional[int]) -> "FitResult":
    """:func:`~rotationzoo.workflows.keep.apply_keep_rule` with a progress bar and its summary on stderr."""
    from ..evaluate.keep import keep_summary
    from ..workflows.keep import apply_keep_rule

    with progress_reporter("keep rule") as progress:
        kept = apply_keep_rule(result, lm, ids, tokens, context, progress=progress)
    print_note(keep_summary(kept) or "")
    return kept


def keep_calibrated(result: "FitResult", lm: Any, held_ids: Optional[list[int]], keep_tokens: Optional[int],
                    keep_context: Optional[int]) -> "FitResult":
    """``calibrate --refine``'s keep rule, on --keep-text (skipped, with a note, without it)."""
    if held_ids is not None:
        return keep_rule(result, lm, held_ids, keep_tokens, keep_context)
    print_note("keep rule skipped: give --keep-text FILE, a text other than the calibration one (the calibration "
               "text's own continuation overstates what refinement gains on other text: docs/fitting.md)")
    return result
