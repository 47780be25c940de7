"""Plots of a report: paired differences to the baseline (ΔNLL and ΔKL with their confidence intervals), or,
for a formats grid, the frontier: quality against bits per element."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import ConfigError, MissingDependencyError
from ..safefile import check_output_path, replace_with, temp_beside
from .report import EvalReport, MethodResult


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("matplotlib", "plot", what="plotting") from None
    return plt


def plot_report(report: EvalReport, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write a PNG with ΔNLL (left) and ΔKL (right) per method against the baseline, with CIs; a report
    of several formats gets :func:`plot_frontier` instead.

    Needs matplotlib (``pip install rotationzoo[plot]``); the non-interactive Agg backend is used.
    """
    if len({r.format for r in report.results if r.format}) > 1:
        return plot_frontier([report], path, title=title)
    plt = _pyplot()
    rows = [r for r in report.results if r.vs_baseline]
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 1.2 + 0.45 * max(2, len(rows))))
    colors = {"better": "tab:green", "worse": "tab:red", "no detectable difference": "tab:gray"}
    for ax, key, label in ((axes[0], "nll", "ΔNLL (nats/token)"), (axes[1], "kl", "ΔKL (nats/token)")):
        for i, r in enumerate(rows):
            d = r.vs_baseline[key]  # type: ignore[index]
            ax.errorbar([d.delta], [i], xerr=[[d.delta - d.lo], [d.hi - d.delta]], fmt="o", capsize=4,
                        color=colors[d.verdict])
        ax.axvline(0.0, color="black", linewidth=1)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r.method for r in rows])
        ax.set_xlabel(f"{label}, method − {report.baseline}")
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title or f"{Path(report.model).name}: {report.windows} × {report.context} tokens, "
                 f"{int(100 * report.protocol.get('confidence', 0.95))}% CI", fontsize=10)
    return _save(plt, fig, path)


def plot_frontier(reports: Sequence[EvalReport], path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write a PNG of the memory/quality frontier: KL to the model, ΔNLL against it and copy accuracy
    (when probed) against bits per element, one marker per (rotation, format), one colour per rotation,
    95 % intervals as bars; several reports (texts) side by side as rows of panels."""
    plt = _pyplot()
    probed = any(r.copy for rep in reports for r in rep.results)
    cols = 3 if probed else 2
    fig, axes = plt.subplots(len(reports), cols, figsize=(5.2 * cols, 4.2 * len(reports)), squeeze=False)
    rotations = list(dict.fromkeys(r.rotation for rep in reports for r in rep.results if r.format))
    palette = plt.get_cmap("tab10")
    for row, rep in zip(axes, reports):
        rows = [r for r in rep.results if r.format]
        fp = next((r for r in rep.results if r.kind == "fp"), None)
        panels = [("kl", "KL to the unquantized model (nats/token)"), ("nll", "ΔNLL vs the unquantized model")]
        if probed:
            panels.append(("copy", "copy accuracy"))
        for ax, (key, label) in zip(row, panels):
            for r in rows:
                y, lo, hi = _value(r, key)
                if y is None:
                    continue
                c = palette(rotations.index(r.rotation) % 10)
                ax.errorbar([r.bpe], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3, color=c,
                            label=r.rotation)
                ax.annotate(str(r.format).split("-w")[0], (r.bpe, y), textcoords="offset points", xytext=(4, 3),
                            fontsize=6, color=c)
            if key == "copy" and fp is not None and fp.copy:
                ax.axhline(fp.copy["accuracy"], color="black", linewidth=1, linestyle="--", label="unquantized")
            if key == "kl":
                ax.set_yscale("log")
            ax.set_xlabel(f"bits per K/V element at {rep.context} tokens")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        handles, labels = row[0].get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        row[0].legend(seen.values(), seen.keys(), fontsize=7, loc="upper right")
        row[0].set_title(f"{Path(rep.model).name}: {', '.join(Path(t).name for t in rep.texts)}, "
                         f"{rep.windows} × {rep.context} tokens", fontsize=8, loc="left")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def check_plot_path(path: str | os.PathLike[str]) -> Path:
    """Refuse, before an evaluation runs, a plot path matplotlib cannot write: its suffix names no format
    it saves (``.png``, ``.svg``, ``.pdf``, ...), or the path cannot be written (an existing folder, an
    unwritable one).

    Raises:
        ConfigError: one line.
        MissingDependencyError: matplotlib is not installed.
    """
    p = check_output_path(path, what="--plot", error=ConfigError)
    plt = _pyplot()
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if p.suffix[1:].lower() not in formats:
        raise ConfigError(f"--plot {p}: matplotlib saves {', '.join('.' + f for f in sorted(formats))}, not "
                          f"{p.suffix or 'a name without a suffix'}; give one of those")
    return p


def _save(plt: Any, fig: Any, path: str | os.PathLike[str]) -> Path:
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(out)  # whole or not at all; a link at the path is replaced, not written through
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=120, format=out.suffix[1:].lower() or "png")
        replace_with(tmp, out, what="--plot")
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
    return out


def _value(r: MethodResult, key: str) -> tuple[float | None, float, float]:
    """``(value, lo, hi)`` of one panel's metric (``None`` when the report does not have it)."""
    if key == "copy":
        if not r.copy:
            return None, 0.0, 0.0
        acc = r.copy["accuracy"]
        return acc, r.copy.get("lo", acc), r.copy.get("hi", acc)
    d = (r.vs_fp or {}).get(key)
    if d is None:
        return None, 0.0, 0.0
    return d.delta, min(d.lo, d.delta), max(d.hi, d.delta)
