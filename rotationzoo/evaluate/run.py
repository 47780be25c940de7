"""Running an evaluation: every window (and copy probe) through the unquantized model once and
through every method and sign draw, then per-method means and paired comparisons."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import ConfigError, EvaluationError
from ..int2kv import Int2KVConfig, check_group_size
from ..integrations.transformers import ModelShape, model_shape
from ..progress import Progress
from .methods import MethodSpec
from .metrics import TokenMetrics, compare, hidden_states
from .protocol import (
    EvalProtocol,
    Exposure,
    check_int2_window,
    check_probe,
    probe_sequences,
    resolve_context,
    windows,
)
from .report import EvalReport, MethodResult, environment
from .stats import PairedDifference, mean_and_spread, paired_difference

Run = tuple[str, int | None]  # (method name, sign draw or None)


@dataclass
class _Collected:
    """Per-token metrics by run, concatenated over the sequences of one pass."""

    fp: list[TokenMetrics] = field(default_factory=list)
    runs: dict[Run, list[TokenMetrics]] = field(default_factory=dict)
    errors: dict[str, dict[Any, list[float]]] = field(default_factory=dict)
    exposure: dict[str, Exposure] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)

    def stacked(self, spec: MethodSpec, runs: Sequence[Run], field_name: str) -> torch.Tensor:
        """``[1, tokens]`` of one metric of one method as served (fp rows for the ``fp`` method)."""
        if spec.kind == "fp":
            return torch.cat([getattr(m, field_name) for m in self.fp])[None]
        return torch.cat([getattr(m, field_name) for m in self.runs[(spec.name, None)]])[None]

    def draw_means(self, spec: MethodSpec, runs: Sequence[Run], field_name: str) -> list[float]:
        """The mean of one metric in each sign draw of a method (empty without draws)."""
        keys = [r for r in runs if r[0] == spec.name and r[1] is not None]
        return [float(torch.cat([getattr(m, field_name) for m in self.runs[k]]).double().mean()) for k in keys]


def _runs(methods: Sequence[MethodSpec], protocol: EvalProtocol) -> list[Run]:
    """Each method as served, then its sign draws (rotations with a side not learned by refinement)."""
    out: list[Run] = []
    for spec in methods:
        if spec.kind == "fp":
            continue
        out.append((spec.name, None))
        if spec.drawn:
            out.extend((spec.name, d) for d in range(protocol.draws))
    return out


def check_evaluation(methods: Sequence[MethodSpec], shape: ModelShape, config: Int2KVConfig,
                     protocol: EvalProtocol, tokens: int | None = None, probe_tokens: int | None = None) -> int | None:
    """Every refusal :func:`evaluate` would make, from the model's shape alone: call it before the model
    loads (the shape from :func:`~rotationzoo.integrations.transformers.peek_model`), and again with
    ``tokens`` once the texts are tokenized.

    Args:
        methods, shape, config, protocol: as :func:`evaluate` gets them.
        tokens: the evaluation text's token count (``None``: not tokenized yet).
        probe_tokens: the token count of the text the copy probes are cut from (``None``: ``tokens``).

    Returns:
        The window length (``None`` without ``tokens``).

    Raises:
        EvaluationError: unnamed or duplicate methods, an unknown baseline, rotations that do not fit the
            model, a group size the model's head_dim cannot run.
        ConfigError: a copy probe with passages under 2 tokens; with ``tokens``, windows too short to quantize
            anything, or a text too short for the copy probes asked for.
    """
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise EvaluationError(f"method names must be unique, got {', '.join(names)}")
    if not methods:
        raise EvaluationError("nothing to evaluate: give at least one method")
    if protocol.baseline not in names and protocol.baseline not in {m.method for m in methods} and len(names) > 1:
        raise EvaluationError(f"the baseline {protocol.baseline!r} is not one of the methods "
                              f"({', '.join(dict.fromkeys(m.method for m in methods))}); add it or choose another "
                              f"--baseline")
    try:  # the one group-size rule (rotationzoo.int2kv.check_group_size), for this model's head_dim
        check_group_size(config.group_size, shape.head_dim, lloyd_max=config.lloyd_max)
    except ConfigError as exc:
        raise EvaluationError(f"{exc} (the model's head_dim is {shape.head_dim})") from None
    for m in methods:
        m.check_fits(shape)
        if m.kind != "fp":
            try:
                m.format_of(config).group_for(shape.head_dim)
            except ConfigError as exc:
                raise EvaluationError(f"method {m.name!r}: {exc}") from None
    probe_text = probe_tokens if probe_tokens is not None else tokens
    if protocol.probe is not None:  # the probes are cut with the widest sink of the methods' formats
        check_probe(protocol.probe, _widest(methods, config), probe_text)
    if tokens is None:
        return None
    context = resolve_context(protocol, shape.context_length, tokens)
    fmts = list(dict.fromkeys(m.format_of(config) for m in methods if m.kind != "fp"))
    for fmt in fmts:
        check_int2_window(context, fmt, f"windows of {context} tokens" + (f" in {fmt.name}" if len(fmts) > 1 else ""))
    return context


def _pass(model: Any, seqs: Sequence[tuple[list[int], int]], methods: Sequence[MethodSpec], runs: Sequence[Run],
          shape: ModelShape, config: Int2KVConfig, protocol: EvalProtocol, tick: Callable[[str], None],
          error_seqs: int = 0) -> _Collected:
    by_name = {m.name: m for m in methods}
    out = _Collected(runs={r: [] for r in runs})
    for i, (seq, first) in enumerate(seqs):
        h_fp, _ = hidden_states(model, seq)
        tick("fp")
        others = {}
        for name, draw in runs:
            t0 = time.perf_counter()
            oscar = by_name[name].oscar(shape, config, draw=draw, seed=protocol.seed)
            others[(name, draw)], errs = hidden_states(model, seq, oscar, collect_errors=i < error_seqs)
            for lid, e in errs.items():
                out.errors.setdefault(name, {}).setdefault(lid, []).append(e)
            out.wall[name] = out.wall.get(name, 0.0) + time.perf_counter() - t0
            tick(name if draw is None else f"{name} draw {draw + 1}")
        fp_m, metrics = compare(model, seq, first, h_fp, others)
        out.fp.append(fp_m)
        for key, m in metrics.items():
            out.runs[key].append(m)
        for fmt in {spec.format_of(config) for spec in methods if spec.kind != "fp"}:
            out.exposure.setdefault(fmt.name, Exposure()).add(torch.arange(first - 1, len(seq) - 1), fmt)
        del h_fp, others
    return out


def _result(spec: MethodSpec, main: _Collected, probe: _Collected | None, runs: Sequence[Run], shape: ModelShape,
            config: Int2KVConfig, context: int, fp_bits: int, protocol: EvalProtocol) -> MethodResult:
    nll, _ = mean_and_spread(main.stacked(spec, runs, "nll"))
    kl, _ = mean_and_spread(main.stacked(spec, runs, "kl"))
    draw_nll, draw_kl = main.draw_means(spec, runs, "nll"), main.draw_means(spec, runs, "kl")
    copy = None
    if probe is not None:
        copy = {"accuracy": float(probe.stacked(spec, runs, "correct").mean()),
                "nll": float(probe.stacked(spec, runs, "nll").mean()),
                "tokens": int(probe.stacked(spec, runs, "nll").shape[-1])}
    errs = {key: sum(v) / len(v) for key, v in main.errors.get(spec.name, {}).items()}
    is_fp = spec.kind == "fp"
    fmt = None if is_fp else spec.format_of(config)
    vs_fp = {}
    if not is_fp:  # the quality loss itself, with its interval: ΔNLL and KL against the unquantized model
        fp_spec = MethodSpec.fp()
        for key in ("nll", "kl"):
            vs_fp[key] = paired_difference(main.stacked(spec, runs, key), main.stacked(fp_spec, runs, key),
                                           block=protocol.block_tokens, resamples=protocol.resamples,
                                           confidence=protocol.confidence, seed=protocol.seed)
        if copy is not None and probe is not None and protocol.probe is not None:
            correct = probe.stacked(spec, runs, "correct")
            ci = paired_difference(correct, torch.zeros_like(correct), block=max(1, protocol.probe.passage_tokens - 1),
                                   resamples=protocol.resamples, confidence=protocol.confidence, seed=protocol.seed)
            copy.update(lo=ci.lo, hi=ci.hi)
    return MethodResult(
        method=spec.name, kind=spec.kind, draws=len(draw_kl),
        perplexity=math.exp(nll), nll=nll, nll_spread=_sd(draw_nll), kl=kl, kl_spread=_sd(draw_kl),
        top1=float(main.stacked(spec, runs, "agree").mean()), accuracy=float(main.stacked(spec, runs, "correct").mean()),
        tokens_scored=int(main.stacked(spec, runs, "nll").shape[-1]), context_len=context,
        bpe=float(fp_bits) if fmt is None else fmt.bits_per_element(shape.head_dim, context, len(shape.layer_ids),
                                                                      shape.num_kv_heads),
        exposure={"pairs": 0.0, "tokens": 0.0} if fmt is None else main.exposure[fmt.name].to_json(),
        source=spec.source, objectives=dict(spec.objectives), copy=copy,
        layer_errors=dict(sorted((k, v) for k, v in errs.items() if not isinstance(k, tuple))),
        head_errors=dict(sorted((k, v) for k, v in errs.items() if isinstance(k, tuple))),
        wall_s=main.wall.get(spec.name, 0.0), rotation=spec.method, format=None if fmt is None else fmt.name,
        draw_kl=draw_kl, draw_nll=draw_nll, vs_fp=vs_fp or None,
    )


def _sd(values: list[float]) -> float:
    """Standard deviation of the per-draw means (0 for fewer than two draws)."""
    return float(torch.tensor(values, dtype=torch.float64).std(unbiased=True)) if len(values) > 1 else 0.0


def baseline_of(spec: MethodSpec, methods: Sequence[MethodSpec], baseline: str) -> MethodSpec | None:
    """What ``spec`` is compared with: the method named ``baseline``, or in a formats grid the baseline
    rotation stored in ``spec``'s own format (``hadamard`` → ``hadamard@<format>``)."""
    by_name = {m.name: m for m in methods}
    if baseline in by_name:
        return by_name[baseline]
    same = [m for m in methods if m.method == baseline and m.kv_format == spec.kv_format and m.kind != "fp"]
    return same[0] if same else None


def _compare(results: list[MethodResult], methods: Sequence[MethodSpec], main: _Collected, probe: _Collected | None,
             runs: Sequence[Run], protocol: EvalProtocol) -> None:
    by_name = {m.name: m for m in methods}
    if protocol.compare_all:
        for r in results:
            spec = by_name[r.method]
            for other in methods:
                if spec.kind != "fp" and other.kind != "fp" and other.name != spec.name:
                    r.vs_methods[other.name] = {k: paired_difference(
                        main.stacked(spec, runs, k), main.stacked(other, runs, k), block=protocol.block_tokens,
                        resamples=protocol.resamples, confidence=protocol.confidence, seed=protocol.seed)
                        for k in ("nll", "kl")}
    def diff(data: _Collected, metric: str, spec: MethodSpec, base: MethodSpec, block: int) -> PairedDifference:
        return paired_difference(data.stacked(spec, runs, metric), data.stacked(base, runs, metric), block=block,
                                 resamples=protocol.resamples, confidence=protocol.confidence, seed=protocol.seed)

    for r in results:
        spec = by_name[r.method]
        base = baseline_of(spec, methods, protocol.baseline)
        if spec.kind == "fp" or base is None or spec.name == base.name:
            continue
        r.baseline = base.name
        r.vs_baseline = {k: diff(main, k, spec, base, protocol.block_tokens) for k in ("nll", "kl")}
        if probe is not None and protocol.probe is not None:
            # one block per probe passage: its tokens are one copy, correlated
            r.vs_baseline["copy_nll"] = diff(probe, "nll", spec, base, max(1, protocol.probe.passage_tokens - 1))


def evaluate(
    model: Any,
    ids: Sequence[int],
    methods: Sequence[MethodSpec],
    config: Int2KVConfig | None = None,
    protocol: EvalProtocol | None = None,
    *,
    model_name: str = "",
    texts: Sequence[str] = (),
    probe_ids: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> EvalReport:
    """Evaluate methods on token ids: perplexity, KL to the unquantized model, top-1 agreement,
    INT2 exposure, the copy probe, and paired differences to the baseline with confidence intervals.

    Args:
        model: a causal LM (e.g. from :func:`rotationzoo.integrations.transformers.load_model`).
        ids: evaluation token ids (:func:`tokenize_texts`).
        methods: what to compare (:class:`MethodSpec`).
        config: the INT2-KV settings shared by every INT2 method (default :class:`Int2KVConfig`).
        protocol: windows, draws, baseline, bootstrap and probe (default :class:`EvalProtocol`).
        model_name, texts: recorded in the report.
        probe_ids: token ids the copy probes are cut from (default: ``ids``; e.g. text after the
            scored windows, so that probes and windows do not share tokens).
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): ``0`` before the
            first forward, then after each forward (windows and probes × the fp run, every method
            and every sign draw); ``what`` names the run (``"hadamard draw 2"``).

    Raises:
        EvaluationError: rotations that do not fit the model, an unknown baseline, bad settings.
        ConfigError: INT2 methods with windows too short to quantize anything (see
            :func:`~rotationzoo.evaluate.protocol.min_int2_window`).
    """
    t0 = time.perf_counter()
    config = config or Int2KVConfig()
    protocol = protocol or EvalProtocol()
    shape = model_shape(model)
    context = check_evaluation(methods, shape, config, protocol, len(ids),
                               None if probe_ids is None else len(probe_ids))
    assert context is not None
    stride = protocol.stride or context
    wins = windows(len(ids), context, stride)
    seqs = [(list(ids[b:e]), first - b) for b, e, first in wins]
    widest = _widest(methods, config)  # the copy probe's passage lies outside every format's windows
    probes = (probe_sequences(ids if probe_ids is None else probe_ids, protocol.probe, widest)
              if protocol.probe is not None else [])
    runs = _runs(methods, protocol)
    total = (len(seqs) + len(probes)) * (1 + len(runs))
    done = [0]

    def tick(label: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total, label)

    if progress is not None:
        progress(0, total, "fp")  # the total is known before the first forward: the ETA starts at once

    main = _pass(model, seqs, methods, runs, shape, config, protocol, tick, error_seqs=protocol.error_windows)
    probe = _pass(model, probes, methods, runs, shape, config, protocol, tick) if probes else None
    fp_bits = torch.finfo(next(model.parameters()).dtype).bits
    results = [_result(m, main, probe, runs, shape, config, context, fp_bits, protocol) for m in methods]
    _compare(results, methods, main, probe, runs, protocol)
    report = EvalReport(
        model=model_name, texts=[str(t) for t in texts], tokens=len(ids), context=context, stride=stride,
        windows=len(wins), config=config.to_json(), protocol=protocol.to_json(),
        baseline=protocol.baseline if protocol.baseline in {m.method for m in methods} else None,
        results=results, warnings=_warnings(main, context), environment=environment(),
    )
    report.wall_s = time.perf_counter() - t0
    return report


def _widest(methods: Sequence[MethodSpec], config: Int2KVConfig) -> Int2KVConfig:
    """``config`` with the largest sink and recent windows of the methods' formats (KIVI: its residual)."""
    fmts = [m.format_of(config) for m in methods if m.kind != "fp"] or [config.kv_format()]
    return config.replace(prefix_tokens=max(f.prefix_tokens for f in fmts),
                          recent_tokens=max(f.recent_tokens for f in fmts))


def _warnings(main: _Collected, context: int) -> list[str]:
    out = []
    for name, exposure in main.exposure.items():
        if exposure.tokens_with_int2 == 0:
            out.append(f"nothing was quantized in {name}: windows of {context} tokens never reach past its "
                       f"full-precision windows; use a longer --context (or text) or smaller windows")
    return out
