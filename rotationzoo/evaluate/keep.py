"""The keep rule of learned rotations, judged on held-out text.

A refinement lowers its calibration loss, which is a stand-in for what serving suffers; whether the
model is better off is decided here, by the model itself. :func:`keep_by_text` runs a short KL
evaluation (the protocol of ``rotationzoo eval``: each window one forward in which every position reads
its BF16 sink and recent window exactly and all older keys/values as INT2 rows) of four candidate
pairs on the same held-out tokens:

* ``init``: the rotations refinement started from (K and V);
* ``refined``: the refined K and V;
* ``refined_k``: refined K, init V; ``refined_v``: init K, refined V.

The candidate with the lowest mean KL to the unquantized model is kept; ``init`` wins ties, so the
result is never worse than its init on these tokens. The windows are as long as the context the
calibration saw (:func:`keep_window`): a refined rotation fits the key positions it was calibrated
on, and judged on shorter windows it can win there and lose at its own context. The decision,
every candidate's KL and the tokens are recorded in the result's ``refinement["keep"]`` (the manifest's).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from ..errors import EvaluationError
from ..fit.result import KEPT_INIT
from ..files.format import RotationSet
from ..int2kv import Int2KVConfig
from ..integrations.transformers import OscarKV, model_shape
from ..progress import Progress
from .metrics import compare, hidden_states
from .protocol import min_int2_window
from .stats import paired_difference

#: Candidate names, in the order they are evaluated (ties go to the first).
CANDIDATES: tuple[str, ...] = ("init", "refined", "refined_k", "refined_v")
#: Tokens per forward of the keep evaluation when the calibration context is not known.
KEEP_WINDOW = 2048
#: Fewest held-out tokens the keep rule evaluates by default (at least one window).
KEEP_TOKENS = 4096


def keep_window(result: Any) -> int:
    """Tokens per keep-rule window for ``result``: the longest calibration sequence its samples came from.

    That is the context the refinement was fitted at (``refinement["samples"]["context"]``, recorded by
    :func:`~rotationzoo.fit.refine_fit`); :data:`KEEP_WINDOW` for results that do not record it.
    """
    context = ((result.refinement or {}).get("samples") or {}).get("context")
    return int(context) if context else KEEP_WINDOW


def keep_tokens(window: int) -> int:
    """Default held-out tokens for windows of ``window`` tokens: :data:`KEEP_TOKENS`, at least one window."""
    return max(KEEP_TOKENS, int(window))


def _candidates(result: Any) -> dict[str, tuple[RotationSet, RotationSet]]:
    if result.init is None or result.k is None or result.v is None:
        raise EvaluationError("the keep rule judges learned rotations against their init; this fit result has no "
                              "init (fit it with --refine)")
    k0, v0 = result.init
    return {"init": (k0, v0), "refined": (result.k, result.v), "refined_k": (result.k, v0), "refined_v": (k0, result.v)}


def _check_shape(model: Any, result: Any) -> None:
    shape = model_shape(model)
    missing = sorted(set(result.layer_ids) - set(shape.layer_ids))
    if missing or shape.head_dim != result.head_dim or (result.num_kv_heads and shape.num_kv_heads != result.num_kv_heads):
        raise EvaluationError(
            f"the keep model does not match the rotations (model: {len(shape.layer_ids)} layers, "
            f"{shape.num_kv_heads} KV heads, head_dim {shape.head_dim}; rotations: layers {list(result.layer_ids)[:4]}…, "
            f"{result.num_kv_heads} KV heads, head_dim {result.head_dim}); pass the model the rotations were fitted for")


def keep_by_text(
    model: Any,
    ids: Sequence[int],
    result: Any,
    *,
    config: Int2KVConfig | None = None,
    window: int | None = None,
    progress: Progress | None = None,
    source: str | None = None,
) -> Any:
    """Judge a refined :class:`~rotationzoo.fit.FitResult` against its init on held-out tokens ``ids``.

    Args:
        model: the causal LM the rotations were fitted for.
        ids: held-out token ids (not used for calibration); cut into whole windows of ``window``
            tokens (tokens after the last whole window are not used).
        result: a refined fit result (``result.init`` holds the sets it started from).
        config: the INT2-KV settings to judge with (default: the result's own, ``serving_config()``).
        window: tokens per forward (default: :func:`keep_window`, the calibration context).
        progress: ``progress(done, total, what)``: forwards run.
        source: what the tokens are (recorded).

    Returns:
        A copy of ``result`` with the kept K and V sets (a side kept at its init is written as
        ``refined_kept_init_<init>``: the run's file, holding the init) and ``refinement["keep"]`` =
        ``{"chosen", "kl": {candidate: mean KL}, "vs_init": {candidate: ΔKL vs init with a 95 % block-bootstrap
        interval}, "tokens", "windows", "window", "source", "int2kv"}``.

    Raises:
        EvaluationError: no init, a model of another shape, a window too short to hold INT2 reads, or
            fewer tokens than one window.
    """
    cands = _candidates(result)
    _check_shape(model, result)
    cfg = config or result.serving_config()
    window = keep_window(result) if window is None else int(window)
    first = cfg.prefix_tokens + cfg.recent_tokens + 2  # the first target predicted from a position reading INT2 keys
    if window < min_int2_window(cfg) + 64:
        raise EvaluationError(f"the keep rule needs windows of at least {min_int2_window(cfg) + 64} tokens to score "
                              f"INT2 reads; got {window} (give a longer --keep-context)")
    wins = [list(ids[a:a + window]) for a in range(0, len(ids) - window + 1, window)]
    if not wins:
        raise EvaluationError(f"the keep rule judges whole windows of {window} tokens (the calibration context); got "
                              f"{len(ids)} held-out tokens (give at least {window} with --keep-tokens, a longer "
                              f"--keep-text, or a shorter --keep-context)")
    kv = {name: OscarKV.from_rotations(pair, cfg) for name, pair in cands.items()}
    per_token: dict[str, list[Any]] = {name: [] for name in cands}
    scored = 0
    total = len(wins) * (1 + len(cands))
    done = 0
    for w in wins:
        h_fp, _ = hidden_states(model, w)
        others = {}
        for name in ("fp", *cands):
            if name != "fp":
                others[name], _ = hidden_states(model, w, kv[name])
            done += 1
            if progress is not None:
                progress(done, total, f"keep rule: {name}")
        _, metrics = compare(model, w, first, h_fp, others)
        for name, m in metrics.items():
            per_token[name].append(m.kl)
        scored += len(w) - first
        del h_fp, others
    tokens_kl = {name: torch.cat(parts).double() for name, parts in per_token.items()}
    kl = {name: float(t.mean()) for name, t in tokens_kl.items()}
    chosen = min(CANDIDATES, key=lambda n: (kl[n], CANDIDATES.index(n)))
    k, v = cands[chosen]
    vs_init = {name: paired_difference(tokens_kl[name], tokens_kl["init"]).to_json() for name in CANDIDATES[1:]}
    kept_init = {"init": ("k", "v"), "refined": (), "refined_k": ("v",), "refined_v": ("k",)}[chosen]
    targets = {side: (KEPT_INIT if side in kept_init else t) for side, t in result.targets.items()}
    refinement = dict(result.refinement or {})
    refinement["keep"] = {"chosen": chosen, "kl": kl, "vs_init": vs_init, "tokens": scored, "windows": len(wins),
                          "window": window, "source": source, "int2kv": cfg.to_json()}
    return dataclasses.replace(result, k=k, v=v, refinement=refinement, targets=targets)


def keep_summary(result: Any) -> str | None:
    """One line on the keep decision of ``result`` (``None`` when none was made)."""
    keep = (result.refinement or {}).get("keep")
    if not keep:
        return None
    init = keep["kl"]["init"]
    parts = ", ".join(f"{n} {keep['kl'][n]:.4f}" for n in CANDIDATES)
    rel = (keep["kl"][keep["chosen"]] / init - 1.0) if init > 0 else 0.0
    ci = keep.get("vs_init", {}).get(keep["chosen"])
    interval = f", ΔKL [{ci['lo']:+.4f}, {ci['hi']:+.4f}]" if ci else ""
    return (f"keep rule on {keep['tokens']} held-out tokens ({keep['windows']} × {keep['window']}-token windows): "
            f"KL {parts}; kept {keep['chosen']} "
            f"({rel:+.1%} vs init{interval})")


__all__ = ["CANDIDATES", "KEEP_TOKENS", "KEEP_WINDOW", "keep_by_text", "keep_summary", "keep_tokens", "keep_window"]
