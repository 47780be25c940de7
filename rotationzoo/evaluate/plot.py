"""A panel of paired differences to the baseline (ΔNLL and ΔKL with their confidence intervals)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MissingDependencyError
from .report import EvalReport


def plot_report(report: EvalReport, path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write a PNG with ΔNLL (left) and ΔKL (right) per method against the baseline, with CIs.

    Needs matplotlib (``pip install rotationzoo[plot]``); the non-interactive Agg backend is used.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("matplotlib", "plot", what="plotting") from None
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
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
