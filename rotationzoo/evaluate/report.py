"""What an evaluation reports: one :class:`MethodResult` per method, and the run around them."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch

from ..safefile import write_text_atomic
from .stats import PairedDifference


@dataclass
class MethodResult:
    """Everything measured for one method (means over its sign draws and all scored tokens).

    Attributes:
        method, kind, source, objectives: what was evaluated (``method`` is ``rotation@format`` in a
            formats grid); rotation: the rotation method's own name; format: the cache format's name
            (``None`` for ``fp``).
        draws: sign draws evaluated beside the as-served run (0: none asked, or not drawable).
        perplexity: ``exp(nll)``.
        nll: mean negative log-likelihood per scored token (nats), as served; ``nll_spread``: standard
            deviation of the sign draws' means (``draw_nll``), 0 without two draws.
        kl: mean ``KL(p_fp ‖ p_method)`` per token (nats), as served; ``kl_spread`` / ``draw_kl`` likewise.
        top1: agreement of the method's argmax with the unquantized model's.
        accuracy: agreement of the argmax with the next token.
        tokens_scored, context_len: scored tokens and the window length.
        bpe: stored bits per K/V element at ``context_len`` in the method's format (codes, scales and zeros,
            windows; :meth:`rotationzoo.kvformat.KVFormat.bits_per_element`); for ``fp`` the model's KV
            dtype bits.
        exposure: ``{"pairs": …, "tokens": …}``: fraction of (query, key) pairs read as INT2 and of
            scored tokens reading at least one INT2 key.
        copy: copy-probe ``{"accuracy", "nll", "tokens", "lo", "hi"}`` (``lo``/``hi``: the accuracy's interval, a
            bootstrap over the probes, so below its nominal coverage with few of them (about 89 % for 95 % with
            the default 8); ``None`` without the probe).
        vs_fp: ``{"nll": …, "kl": …}``: the method against the unquantized model on the same tokens (ΔNLL,
            and KL itself) with their intervals; ``None`` for ``fp``.
        vs_baseline: ``{"nll": PairedDifference, "kl": …, "copy_nll": …}`` against ``baseline`` (the
            baseline method in the same format; ``None`` for the baseline itself and for ``fp``).
        layer_errors: per layer ``‖o − o_fp‖ / ‖o_fp‖`` of the attention output (first windows).
        head_errors: the same per ``(layer, KV head)`` (over the query heads reading it; JSON keys ``"L.h"``).
        wall_s: seconds spent in this method's forwards.
        vs_methods: with ``EvalProtocol.compare_all``, ``{other method: {"nll": …, "kl": …}}``, this
            method minus the other, paired as ``vs_baseline``.
    """

    method: str
    kind: str
    draws: int
    perplexity: float
    nll: float
    nll_spread: float
    kl: float
    kl_spread: float
    top1: float
    accuracy: float
    tokens_scored: int
    context_len: int
    bpe: float
    exposure: dict[str, float]
    source: str | None = None
    objectives: dict[str, str] = field(default_factory=dict)
    copy: dict[str, float] | None = None
    vs_baseline: dict[str, PairedDifference] | None = None
    layer_errors: dict[int, float] = field(default_factory=dict)
    head_errors: dict[tuple[int, int], float] = field(default_factory=dict)
    wall_s: float = 0.0
    vs_methods: dict[str, dict[str, PairedDifference]] = field(default_factory=dict)
    rotation: str = ""
    format: str | None = None
    draw_kl: list[float] = field(default_factory=list)
    draw_nll: list[float] = field(default_factory=list)
    baseline: str | None = None
    vs_fp: dict[str, PairedDifference] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["vs_baseline"] = {k: v.to_json() for k, v in self.vs_baseline.items()} if self.vs_baseline else None
        d["vs_fp"] = {k: v.to_json() for k, v in self.vs_fp.items()} if self.vs_fp else None
        d["vs_methods"] = {m: {k: v.to_json() for k, v in diffs.items()} for m, diffs in self.vs_methods.items()}
        d["layer_errors"] = {str(k): v for k, v in self.layer_errors.items()}
        d["head_errors"] = {f"{lid}.{h}": v for (lid, h), v in self.head_errors.items()}
        return d


@dataclass
class EvalReport:
    """One evaluation: the model, the text, the settings, and one result per method.

    Attributes:
        model: model path or id; texts: evaluation text files; tokens: tokens evaluated.
        context, stride, windows: the scoring windows.
        config: the INT2-KV settings (``Int2KVConfig.to_json()``); protocol: ``EvalProtocol.to_json()``.
        baseline: the method the others are compared with.
        results: one :class:`MethodResult` per method.
        warnings: things a reader must know (e.g. nothing was quantized).
        environment: versions and hardware; wall_s: total seconds; extra: anything else recorded.
    """

    model: str
    texts: list[str]
    tokens: int
    context: int
    stride: int
    windows: int
    config: dict[str, Any]
    protocol: dict[str, Any]
    baseline: str | None
    results: list[MethodResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["results"] = [r.to_dict() for r in self.results]
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as indented JSON; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, default=str) + "\n"
        if path is not None:
            write_text_atomic(path, text)
        return text

    def result(self, method: str) -> MethodResult:
        for r in self.results:
            if r.method == method:
                return r
        raise KeyError(f"no result for method {method!r}")


def environment() -> dict[str, Any]:
    """Versions and hardware facts recorded with a report."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        env["transformers"] = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    env["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    return env


def _ci(d: PairedDifference | None, scale: float = 1.0, digits: int = 4) -> str:
    if d is None:
        return ""
    mark = {"better": "[green]", "worse": "[red]"}.get(d.verdict, "[dim]")
    return f"{mark}{d.delta * scale:+.{digits}f} [{d.lo * scale:+.{digits}f}, {d.hi * scale:+.{digits}f}][/]"


def results_table(report: EvalReport, *, title: str | None = None) -> Any:
    """A ``rich`` table: per method BPE, perplexity, KL, top-1, exposure, copy accuracy and the
    paired differences to the baseline with their confidence intervals."""
    from rich.table import Table

    table = Table(title=title)
    cols = ["method", "draws", "BPE", "ppl", "KL (nats)", "top-1", "INT2 pairs", "copy acc",
            f"ΔNLL vs {report.baseline}", f"ΔKL vs {report.baseline}", "verdict (KL)"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("method", cols[-1]) else "right")
    for r in report.results:
        vs = r.vs_baseline or {}
        spread = f" ±{r.kl_spread:.4f}" if r.draws > 1 else ""  # the sign draws' spread beside the served value
        table.add_row(
            r.method, str(r.draws), f"{r.bpe:.2f}", f"{r.perplexity:.3f}", f"{r.kl:.4f}{spread}",
            f"{100 * r.top1:.1f}%", f"{100 * r.exposure.get('pairs', 0.0):.1f}%",
            f"{100 * r.copy['accuracy']:.1f}%" if r.copy else "", _ci(vs.get("nll")), _ci(vs.get("kl")),
            vs["kl"].verdict if "kl" in vs else "",
        )
    return table


def pairs_table(report: EvalReport, *, title: str | None = None) -> Any:
    """A ``rich`` table of every row against every other but fp (``EvalProtocol.compare_all``; with ``--formats``,
    rows of different formats too): ΔKL and ΔNLL, row − column, paired on the same tokens; ``None`` when the
    report has no such comparisons."""
    from rich.table import Table

    pairs = [(r.method, other, d) for r in report.results for other, d in r.vs_methods.items() if r.method < other]
    if not pairs:
        return None
    table = Table(title=title)
    for c in ("method", "against", "ΔKL", "ΔNLL", "verdict (KL)"):
        table.add_column(c, justify="left" if c in ("method", "against", "verdict (KL)") else "right")
    for a, b, d in pairs:
        table.add_row(a, b, _ci(d.get("kl")), _ci(d.get("nll")), d["kl"].verdict if "kl" in d else "")
    return table


def summary_line(report: EvalReport) -> str:
    """One line under the table: windows, BPE formula, time."""
    draws = report.protocol.get("draws") or 0
    served = "rotations as served" + (f", ± the spread of {draws} sign draws" if draws else "")
    return (f"{report.windows} window(s) of {report.context} tokens; BPE = stored bits per K/V element at that "
            f"context; {served}; Δ = method − {report.baseline} (in the same format), "
            f"{100 * report.protocol.get('confidence', 0.95):.0f}% block-bootstrap CI "
            f"({report.protocol.get('block_tokens')}-token blocks); {report.wall_s:.0f} s")


def by_name(results: Sequence[MethodResult]) -> dict[str, MethodResult]:
    return {r.method: r for r in results}
