"""Paired statistics of evaluation results: a block bootstrap over tokens.

Every method is scored on the same tokens as its baseline, so the comparison is paired: the
difference of per-token means, with a confidence interval from a bootstrap that resamples
contiguous blocks of tokens (neighbouring tokens are correlated: a block keeps that correlation).
A difference is reported only when the interval excludes zero.

:func:`paired_difference` can also resample rows of sign draws per side (``[K, N]`` inputs), but
:func:`~rotationzoo.evaluate.run.evaluate` passes each method's as-served run alone (one row per side,
``PairedDifference.draws == (1, 1)``): its intervals are over token blocks of the as-served rotation,
and sign draws (``R·D``, ``D`` diagonal ±1), when requested, are reported as a spread beside it
(:func:`mean_and_spread`, ``MethodResult.kl_spread``), not in the interval. The copy probe's intervals
use one block per probe passage, so they resample the probes (8 by default): with that few clusters a
percentile bootstrap covers less than its nominal level (about 89 % for a nominal 95 % with 8, in a
synthetic check).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

from ..numbers import DEFAULT_BLOCK_TOKENS, DEFAULT_RESAMPLES

Verdict = Literal["better", "worse", "no detectable difference"]


@dataclass(frozen=True)
class PairedDifference:
    """``mean(method) − mean(baseline)`` with a bootstrap confidence interval.

    Attributes:
        delta: the point estimate (all draws, all tokens).
        lo, hi: the ``confidence`` interval bounds.
        confidence: e.g. 0.95.
        verdict: ``"better"`` when the interval lies below zero (lower is better for NLL and KL),
            ``"worse"`` when above, else ``"no detectable difference"``.
        tokens: tokens compared; blocks: bootstrap blocks; draws: ``(method, baseline)`` draw counts.
    """

    delta: float
    lo: float
    hi: float
    confidence: float
    verdict: Verdict
    tokens: int
    blocks: int
    draws: tuple[int, int]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _block_sums(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [K, N]`` → per-block sums ``[K, B]`` and token counts ``[B]`` (the last block may be short)."""
    n = x.shape[-1]
    nblocks = math.ceil(n / block)
    pad = nblocks * block - n
    padded = torch.nn.functional.pad(x, (0, pad))
    sums = padded.reshape(x.shape[0], nblocks, block).sum(-1)
    counts = torch.full((nblocks,), float(block), dtype=torch.float64)
    counts[-1] = block - pad
    return sums, counts


def verdict(lo: float, hi: float) -> Verdict:
    """``better`` / ``worse`` / ``no detectable difference`` from an interval on ``method − baseline``."""
    if hi < 0:
        return "better"
    if lo > 0:
        return "worse"
    return "no detectable difference"


def paired_difference(
    method: torch.Tensor,
    baseline: torch.Tensor,
    *,
    block: int = DEFAULT_BLOCK_TOKENS,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = 0.95,
    seed: int = 0,
) -> PairedDifference:
    """Difference of means of a per-token metric, method minus baseline, with a block-bootstrap CI.

    Args:
        method: ``[K_m, N]`` (or ``[N]``): the metric per sign draw and token.
        baseline: ``[K_b, N]`` (or ``[N]``) on the same ``N`` tokens in the same order.
        block: tokens per bootstrap block.
        resamples: bootstrap resamples.
        confidence: interval coverage.
        seed: generator seed (results are deterministic for a seed).

    Returns:
        A :class:`PairedDifference`. Each resample draws ``ceil(N / block)`` blocks with
        replacement (the same blocks for both sides: paired) and, independently per side, as many
        sign draws as there are, with replacement.
    """
    m = method.double().reshape(-1, method.shape[-1])
    b = baseline.double().reshape(-1, baseline.shape[-1])
    if m.shape[-1] != b.shape[-1]:
        raise ValueError(f"method and baseline must cover the same tokens, got {m.shape[-1]} and {b.shape[-1]}")
    sm, counts = _block_sums(m, block)
    sb, _ = _block_sums(b, block)
    g = torch.Generator().manual_seed(int(seed))
    nblocks = counts.shape[0]
    idx = torch.randint(nblocks, (resamples, nblocks), generator=g)
    total = counts[idx].sum(-1)  # [R]

    def side(s: torch.Tensor) -> torch.Tensor:
        per_draw = s[:, idx].sum(-1)  # [K, R]: each draw's block-resampled sum
        k = s.shape[0]
        pick = torch.randint(k, (resamples, k), generator=g)  # [R, K] draws with replacement
        return per_draw.T.gather(1, pick).mean(1) / total

    boot = side(sm) - side(sb)
    alpha = (1.0 - confidence) / 2
    lo, hi = torch.quantile(boot, torch.tensor([alpha, 1 - alpha], dtype=torch.float64)).tolist()
    delta = float(m.mean() - b.mean())
    return PairedDifference(delta=delta, lo=float(lo), hi=float(hi), confidence=confidence, verdict=verdict(lo, hi),
                            tokens=int(m.shape[-1]), blocks=int(nblocks), draws=(int(m.shape[0]), int(b.shape[0])))


def mean_and_spread(x: torch.Tensor) -> tuple[float, float]:
    """Mean over everything, and the standard deviation of the per-draw means (0 for one draw)."""
    x = x.double().reshape(-1, x.shape[-1])
    per_draw = x.mean(-1)
    spread = float(per_draw.std(unbiased=True)) if per_draw.numel() > 1 else 0.0
    return float(x.mean()), spread
