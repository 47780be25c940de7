"""How an evaluation reads the text: scoring windows, INT2 exposure, and the copy probe.

Windows: the text's token ids are cut into windows of ``context`` tokens (each one forward,
``stride`` apart, non-overlapping by default); in each window every position but the first is a
scored target. The model's context length is the default ``context``, so that INT2 keys dominate
what a token attends to, as in long generation.

Exposure: query position ``i`` of a window reads key ``j`` (``j ≤ i``) quantized when
``prefix_tokens ≤ j ≤ i − recent_tokens − 1``, i.e. ``max(0, i − recent_tokens − prefix_tokens)`` of
its ``i + 1`` keys (a KIVI format: the ``R·⌊i/R⌋`` keys of the residual blocks completed before its
step, as KIVI attends before it quantizes; see
:func:`~rotationzoo.integrations.transformers.simulate.kivi_boundaries`). A result reports the fraction
of (query, key) pairs read quantized and the fraction of scored tokens that read at least one quantized
key.

Copy probe: sequences ``[lead-in: prefix_tokens] [P: passage_tokens] [filler: filler_tokens] [P]``
cut from the evaluation text, scored on the second ``P`` only (tokens 2 … L of it, which have a
copy cue). The lead-in keeps ``P`` out of the BF16 sink and ``filler_tokens > recent_tokens`` keeps it
out of the recent window, so every token of the first ``P`` is read back as INT2 when the second
``P`` is predicted: the probe measures retrieval from the quantized history.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ..errors import ConfigError
from ..int2kv import Int2KVConfig
from ..kvformat import KVFormat
from ..numbers import MAX_COUNT, MAX_RESAMPLES, check_int, check_real
from .stats import DEFAULT_BLOCK_TOKENS, DEFAULT_RESAMPLES


@dataclass(frozen=True)
class CopyProbe:
    """The copy probe's shape (see the module docstring).

    Attributes:
        passage_tokens: ``L``, tokens of the passage that is repeated.
        filler_tokens: ``F``, tokens between the two copies; ``None`` means ``recent_tokens + 64``.
        probes: how many probe sequences (each from a different part of the text).
    """

    passage_tokens: int = 128
    filler_tokens: int | None = None
    probes: int = 8

    def __post_init__(self) -> None:  # the bounds of --passage-tokens, --filler-tokens and --probes
        check_int(self.passage_tokens, "passage_tokens (--passage-tokens)", low=2, high=MAX_COUNT)
        if self.filler_tokens is not None:
            check_int(self.filler_tokens, "filler_tokens (--filler-tokens)", low=1, high=MAX_COUNT)
        check_int(self.probes, "probes (--probes)", low=1, high=MAX_COUNT)

    def filler(self, config: Int2KVConfig) -> int:
        return self.filler_tokens if self.filler_tokens is not None else config.recent_tokens + 64

    def sequence_tokens(self, config: Int2KVConfig) -> int:
        return config.prefix_tokens + 2 * self.passage_tokens + self.filler(config)


@dataclass(frozen=True)
class EvalProtocol:
    """How results are measured and compared.

    Attributes:
        context: tokens per scoring window (``None``: the model's context length, or the text
            length when shorter).
        stride: tokens between window starts (``None``: ``context``, non-overlapping).
        draws: sign draws per rotation method beside its as-served run (``R·D``, ``D`` a seeded random
            ±1 diagonal per layer): equally valid variants that no one serves, whose spread says how much
            of a difference the rounding of one particular rotation makes. ``0`` (default): the rotations
            exactly as their files hold them (Hadamard as the published matrix). Every metric and every
            comparison is of the as-served run; the draws are reported as a spread beside it. A side
            learned by refinement is never drawn (:attr:`MethodSpec.learned_sides
            <rotationzoo.evaluate.methods.MethodSpec.learned_sides>`).
        seed: seed of the sign draws and the bootstrap.
        baseline: method every other method is compared with.
        block_tokens: tokens per bootstrap block.
        resamples: bootstrap resamples (1 … :data:`~rotationzoo.numbers.MAX_RESAMPLES`).
        confidence: interval coverage, in [0.5, 1).
        error_windows: leading windows over which attention-output errors are measured (per layer and per
            KV head: ``MethodResult.layer_errors`` / ``head_errors``).
        probe: the copy probe, or ``None``.
        compare_all: also compare every INT2 method with every other one, paired on the same tokens
            and draws (``MethodResult.vs_methods``), not only with the baseline.
    """

    context: int | None = None
    stride: int | None = None
    draws: int = 0
    seed: int = 0
    baseline: str = "hadamard"
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    resamples: int = DEFAULT_RESAMPLES
    confidence: float = 0.95
    error_windows: int = 0
    probe: CopyProbe | None = field(default=None)
    compare_all: bool = False

    def __post_init__(self) -> None:
        if self.context is not None and self.context < 2:
            raise ConfigError(f"context must be at least 2 tokens, got {self.context}")
        if self.stride is not None and self.stride < 1:
            raise ConfigError(f"stride must be at least 1 token, got {self.stride}")
        if self.draws < 0:
            raise ConfigError(f"draws must be 0 (as served) or more, got {self.draws}")
        check_real(self.confidence, "confidence (--confidence)", low=0.5, high=1.0, high_open=True,
                   hint=" (the intervals' coverage, e.g. 0.95)")
        check_int(self.block_tokens, "block_tokens (--block-tokens)", low=1, high=MAX_COUNT)
        check_int(self.resamples, "resamples (--resamples)", low=1, high=MAX_RESAMPLES)
        if not isinstance(self.compare_all, bool):
            raise ConfigError(f"compare_all (--compare-all) must be true or false, got {self.compare_all!r}")
        check_int(self.error_windows, "error_windows (--error-windows)", low=0, high=MAX_COUNT)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_context(protocol: EvalProtocol, model_context: int | None, n_tokens: int) -> int:
    """The window length actually used: ``context``, else the model's, never more than the text."""
    want = protocol.context or model_context or n_tokens
    return max(2, min(int(want), n_tokens))


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` per forward; targets ``t`` in ``[first_target, end)``.

    With ``stride < context`` each window scores only the targets not scored before (the Hugging
    Face sliding-window recipe).
    """
    out = []
    begin, scored_to = 0, 1
    while True:
        end = min(begin + context, n)
        first = max(begin + 1, scored_to)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        if end >= n:
            return out
        begin += stride


def _format(config: Int2KVConfig | KVFormat) -> KVFormat:
    return config if isinstance(config, KVFormat) else config.kv_format()


def min_int2_window(config: Int2KVConfig | KVFormat) -> int:
    """Fewest tokens a window needs for one scored token to read a key quantized.

    The scored query positions of a window of ``n`` tokens are ``0 … n − 2`` (the last token has no
    target); position ``i`` reads quantized keys only when ``i > prefix_tokens + recent_tokens`` (a KIVI
    format: once ``i ≥ R``, its first residual block quantized after the step of position ``R − 1``), so a
    window needs ``prefix_tokens + recent_tokens + 3`` tokens (KIVI: ``R + 2``).
    """
    fmt = _format(config)
    if fmt.axis == "kivi":
        return fmt.recent_tokens + 2
    return fmt.prefix_tokens + fmt.recent_tokens + 3


def check_int2_window(tokens: int, config: Int2KVConfig | KVFormat, what: str = "a window") -> None:
    """Refuse a window that would quantize nothing (every key it reads stays in the full-precision windows).

    Args:
        tokens: the window length (or the whole text's, when shorter).
        config: the INT2-KV settings or the format (their sink and recent windows).
        what: what ``tokens`` is, for the message (``"--context 100"``).

    Raises:
        ConfigError: ``tokens < min_int2_window(config)``.
    """
    need = min_int2_window(config)
    fmt = _format(config)
    if tokens < need:
        kept = (f"KIVI's residual of {fmt.recent_tokens} tokens stays" if fmt.axis == "kivi" else
                f"{fmt.prefix_tokens} sink + {fmt.recent_tokens} recent tokens stay")
        raise ConfigError(
            f"{what}: nothing would be quantized: a window needs at least {need} tokens to read a key quantized "
            f"({kept} in {fmt.hp_dtype}); give at least {need} tokens, or smaller --prefix-tokens / --recent-tokens"
        )


def int2_keys(query_pos: torch.Tensor, config: Int2KVConfig | KVFormat) -> torch.Tensor:
    """How many keys query positions ``query_pos`` (within their forward) read quantized."""
    fmt = _format(config)
    if fmt.axis == "kivi":
        return fmt.recent_tokens * torch.div(query_pos, fmt.recent_tokens, rounding_mode="floor")
    return (query_pos - fmt.recent_tokens - fmt.prefix_tokens).clamp_min(0)


@dataclass
class Exposure:
    """Running exposure of scored tokens to quantized keys (see the module docstring)."""

    pairs_int2: float = 0.0
    pairs: float = 0.0
    tokens_with_int2: int = 0
    tokens: int = 0

    def add(self, query_pos: torch.Tensor, config: Int2KVConfig | KVFormat) -> None:
        k = int2_keys(query_pos, config)
        self.pairs_int2 += float(k.sum())
        self.pairs += float((query_pos + 1).sum())
        self.tokens_with_int2 += int((k > 0).sum())
        self.tokens += int(query_pos.numel())

    def to_json(self) -> dict[str, float]:
        return {
            "pairs": self.pairs_int2 / self.pairs if self.pairs else 0.0,
            "tokens": self.tokens_with_int2 / self.tokens if self.tokens else 0.0,
        }


def check_probe(probe: CopyProbe, config: Int2KVConfig, tokens: int | None = None) -> int:
    """Refuse a copy probe that cannot be cut: passages of fewer than 2 tokens, or (given ``tokens``, the probe
    text's length) a text too short for the probes.
    :func:`~rotationzoo.evaluate.run.check_evaluation` calls it once the texts are tokenized, before the weights
    load.

    Args:
        probe: the copy probe.
        config: the INT2-KV settings the probes are cut for (their sink sets the lead-in).
        tokens: the token count of the text the probes are cut from (``None``: the sizes alone).

    Returns:
        The tokens the probes need.

    Raises:
        ConfigError: one line saying what the probe needs and what to change.
    """
    stretch = config.prefix_tokens + probe.passage_tokens + probe.filler(config)
    need = probe.probes * stretch
    if tokens is not None and need > tokens:
        raise ConfigError(f"the copy probe needs {probe.probes} × {stretch} = {need} tokens of text, the text has "
                          f"{tokens}; use fewer --probes or shorter --passage-tokens (or more --tokens of text)")
    return need


def probe_sequences(ids: Sequence[int], probe: CopyProbe, config: Int2KVConfig) -> list[tuple[list[int], int]]:
    """``(token ids, first scored target)`` of each copy-probe sequence, cut from ``ids``.

    Probe ``k`` uses the ``k``-th consecutive stretch of ``prefix + L + F`` tokens of ``ids`` for its
    lead-in, passage and filler; the passage is then repeated. The scored targets are the second
    passage without its first token (the tokens that have a copy cue): positions ``first … end − 1``.

    Raises:
        ConfigError: the text is too short for the probes asked for (:func:`check_probe`).
    """
    lead, length, filler = config.prefix_tokens, probe.passage_tokens, probe.filler(config)
    stretch = lead + length + filler
    check_probe(probe, config, len(ids))
    out = []
    for k in range(probe.probes):
        a = k * stretch
        lead_ids = list(ids[a:a + lead])
        passage = list(ids[a + lead:a + lead + length])
        fill = list(ids[a + lead + length:a + stretch])
        seq = lead_ids + passage + fill + passage
        out.append((seq, lead + length + filler + 1))
    return out
