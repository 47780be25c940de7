#!/usr/bin/env python
"""SmolLM2-135M-Instruct under the evaluation protocol: KL, perplexity, top-1, copy probe, paired CIs.

Calibrates on *Emma* (qqt for K, sst for V, one model pass for every fit), then for each held-out
text (default: *Persuasion* from Debian's ``r-cran-janeaustenr`` and *Moby Dick* from Debian's
``r-cran-tokenizers``, neither used for calibration) and each group size G (64, 32, 16) evaluates

* ``fp``        the unquantized model,
* ``none``      INT2 without a rotation,
* ``hadamard``  the data-free ``H_d`` for K and V (the baseline of every comparison),
* ``r_h_pbr``   OSCAR as published (``U·H·P_br``),
* ``r_pbr_hg``  the group-aware ``U·P_br·H_G`` fitted for that G,
* any ``--extra NAME=ROTATIONS`` (a folder, an exported file, a registry id; ``NAME=ROTATIONS@G``
  evaluates it at one group size only),
* with ``--recipes A,B,…`` instead of ``r_h_pbr`` / ``r_pbr_hg``: the listed fits of :data:`RECIPES`, all
  from the same capture — the authors' V2 per-head recipe, OSCAR-2 per head, key centering, their
  shared form, value centering (``…_kv``),

with the authors' serving defaults (clip 0.96 / 0.92, 64 + 256 BF16 windows, fp32 scale/zero), one
scoring window of ``--context`` tokens per text, ``--draws`` sign draws per rotation method and the
copy probe. Every row: perplexity, KL to fp, top-1 agreement, copy accuracy, INT2 exposure, BPE,
and ΔNLL / ΔKL against Hadamard with 95 % block-bootstrap CIs (tokens and draws resampled).

Usage::

    python tools/bench_real_model.py --json-out bench-out/real-model.json --markdown bench-out/real-model.md \\
        --plot bench-out/real-model.png --save-rotations bench-out/rotations
    python tools/bench_real_model.py --groups 64 --texts persuasion --draws 2          # smaller
    python tools/bench_real_model.py --groups 16,64 --recipes r_h_pbr,oscar2_perhead,oscar2_center,oscar2_center_kv \
        --save-rotations bench-out/rotations --json-out bench-out/recipes.json       # the fitting recipes
    python tools/bench_real_model.py --timing --json-out bench-out/timing.json         # cost of one window

``--timing`` measures, on one ``--context`` window, the fp forward and one INT2 method's forward
(wall time, best of ``--repeat``) and the peak RSS of a fresh process, and prints the ratio.
Partial results are written to ``--json-out`` after every (text, group) block.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


#: ``--recipes`` names → (objective, fit_rotations options); ``r_pbr_hg`` is fitted for every ``--groups`` G.
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "r_h_pbr": ("qqt_sst", {}),
    "r_pbr_hg": ("qqt_sst", {"composition": "r_pbr_hg"}),
    "cov_eig_hadamard_perhead": ("cov_eig_hadamard_perhead", {}),
    "oscar2_perhead": ("oscar2_perhead", {}),
    "oscar2_center": ("oscar2_center", {}),
    "oscar2_center_kv": ("oscar2_center", {"center": "kv"}),
    "shared_center": ("oscar2_center", {"grouping": "layer"}),
    "shared_center_kv": ("oscar2_center", {"grouping": "layer", "center": "kv"}),
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts-dir", type=Path, default=REPO / "bench-out" / "texts")
    p.add_argument("--calib", default="emma", help="calibration text (tools/texts.py name)")
    p.add_argument("--texts", default="persuasion,mobydick", help="held-out texts (tools/texts.py names)")
    p.add_argument("--calib-tokens", type=int, default=20000)
    p.add_argument("--calib-seq", type=int, default=2048)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--skip", type=int, default=4000, help="skip the first N tokens of each held-out text")
    p.add_argument("--groups", default="64,32,16")
    p.add_argument("--draws", type=int, default=4)
    p.add_argument("--probes", type=int, default=8, help="copy-probe sequences (0: no probe)")
    p.add_argument("--probe-tokens", type=int, default=128)
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--extra", action="append", default=[], help="NAME=ROTATIONS[@G]: more methods")
    p.add_argument("--no-fit", action="store_true", help="skip r_h_pbr / r_pbr_hg (only builtins and --extra)")
    p.add_argument("--recipes", default=None, help=f"fit these instead of r_h_pbr / r_pbr_hg: {', '.join(RECIPES)}")
    p.add_argument("--save-rotations", type=Path, default=None)
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG prefix: one panel per (text, group)")
    p.add_argument("--summary", type=Path, default=None,
                   help="also write one table of ΔKL vs hadamard (%% of hadamard's KL, with CIs) over every (text, G) here")
    p.add_argument("--summary-plot", type=Path, default=None, help="and the same as a PNG")
    p.add_argument("--replot", type=Path, nargs="+", default=None,
                   help="no runs: merge these --json-out files and write --summary / --summary-plot / --markdown")
    p.add_argument("--timing", action="store_true", help="measure fp vs one INT2 method on one window")
    p.add_argument("--repeat", type=int, default=2)
    return p.parse_args(argv)


def _text(args: argparse.Namespace, name: str) -> Path:
    path = args.texts_dir / f"{name}.txt"
    if not path.is_file():
        _log(f"extracting {name} (tools/texts.py)")
        subprocess.run([sys.executable, str(REPO / "tools" / "texts.py"), name, "--out-dir", str(args.texts_dir)],
                       check=True, stdout=subprocess.DEVNULL)
    return path


def _fits(model: Any, tok: Any, args: argparse.Namespace, groups: list[int]) -> dict[str, Any]:
    from rotationzoo.fit import fit_rotations, write_fitted
    from rotationzoo.integrations.transformers import collect_statistics

    names = args.recipes.split(",") if args.recipes else ["r_h_pbr", "r_pbr_hg"]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise SystemExit(f"unknown --recipes {unknown}; choose from {', '.join(RECIPES)}")
    objectives = tuple(dict.fromkeys(RECIPES[n][0] for n in names))
    t0 = time.perf_counter()
    stats = collect_statistics(model, tok, [_text(args, args.calib)], tokens=args.calib_tokens,
                               seq_len=args.calib_seq, model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                               objective=objectives, grouping="kv_head")
    _log(f"captured {stats.tokens} calibration tokens per layer in {time.perf_counter() - t0:.0f} s")
    fits: dict[str, Any] = {}
    for name in names:
        objective, options = RECIPES[name]
        if name == "r_pbr_hg":
            for g in groups:
                fits[f"r_pbr_hg{g}"] = fit_rotations(stats.accumulators, objective, group_size=g, source_info=stats.info,
                                                     **options)
            continue
        fits[name] = fit_rotations(stats.accumulators, objective, source_info=stats.info, **options)
    if args.save_rotations is not None:
        for name, res in fits.items():
            write_fitted(res, args.save_rotations / name, model="HuggingFaceTB/SmolLM2-135M-Instruct",
                         tag=f"{args.calib}-{stats.tokens}")
    return fits


def _methods(g: int, fits: dict[str, Any], extras: list[tuple[str, str, int | None]]) -> list[Any]:
    from rotationzoo.evaluate import MethodSpec

    out = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard()]
    for name, res in fits.items():
        if not name.startswith("r_pbr_hg") or name == f"r_pbr_hg{g}":
            out.append(MethodSpec.from_source(name, res))
    out += [MethodSpec.from_source(name, src) for name, src, only in extras if only in (None, g)]
    return out


def _extras(items: list[str]) -> list[tuple[str, str, int | None]]:
    out = []
    for item in items:
        name, _, rest = item.partition("=")
        src, at, g = rest.rpartition("@") if "@" in rest and rest.rsplit("@", 1)[1].isdigit() else (rest, "", "")
        out.append((name, src if at else rest, int(g) if at else None))
    return out


def run_grid(args: argparse.Namespace) -> dict[str, Any]:
    from rotationzoo.evaluate import CopyProbe, EvalProtocol, evaluate, find_smollm2_gguf, plot_report, tokenize_texts
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.integrations.transformers import load_model

    groups = [int(g) for g in args.groups.split(",")]
    model, tok = load_model(find_smollm2_gguf())
    fits = {} if args.no_fit else _fits(model, tok, args, groups)
    extras = _extras(args.extra)
    probe = CopyProbe(passage_tokens=args.probe_tokens, probes=args.probes) if args.probes else None
    out: dict[str, Any] = {"calibration": {"text": args.calib, "tokens": args.calib_tokens}, "runs": []}
    for text in args.texts.split(","):
        ids = tokenize_texts(tok, [_text(args, text)], skip=args.skip, tokens=args.context + _probe_tokens(args))
        window, probe_ids = ids[: args.context], ids[args.context:]
        for g in groups:
            t0 = time.perf_counter()
            config = Int2KVConfig(group_size=g)
            protocol = EvalProtocol(context=args.context, draws=args.draws, resamples=args.resamples, probe=probe,
                                    compare_all=True)  # every pair of methods, paired (vs_methods in the JSON)
            methods = _methods(g, fits, extras)
            last = [0.0]

            def progress(done: int, total: int, label: str) -> None:
                if time.perf_counter() - last[0] > 60 or done == total:
                    last[0] = time.perf_counter()
                    _log(f"{text} G{g}: {done}/{total} forwards ({label})")

            report = evaluate(model, window, methods, config, protocol, probe_ids=probe_ids, progress=progress)
            report.texts = [text]
            report.extra = {"skip": args.skip, "g": g}
            out["runs"].append(report.to_dict())
            _log(f"{text} G{g}: done in {time.perf_counter() - t0:.0f} s")
            if args.plot is not None:
                plot_report(report, args.plot.with_name(f"{args.plot.stem}-{text}-g{g}.png"))
            _write(args, out)
    return out


def _probe_tokens(args: argparse.Namespace) -> int:
    return args.probes * (64 + args.probe_tokens + 256 + 64) if args.probes else 0


def _write(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(out))
    if args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(summary(out))
    if args.summary_plot is not None and out["runs"]:
        summary_plot(out, args.summary_plot)


def _blocks(out: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """``(text, G, run)`` in the order G, then text."""
    runs = [(r["texts"][0], int(r["config"]["group_size"]), r) for r in out["runs"]]
    return sorted(runs, key=lambda t: (t[1], t[0] != "persuasion", t[0]))


def _relative(run: dict[str, Any], r: dict[str, Any]) -> tuple[float, float, float] | None:
    """ΔKL vs the baseline and its CI, as % of the baseline's KL."""
    base = next((x for x in run["results"] if x["method"] == run.get("baseline")), None)
    kl = (r.get("vs_baseline") or {}).get("kl")
    if base is None or kl is None or not base["kl"]:
        return None
    return tuple(100 * kl[k] / base["kl"] for k in ("delta", "lo", "hi"))  # type: ignore[return-value]


def summary(out: dict[str, Any]) -> str:
    """One table: per method, ΔKL vs hadamard in % of hadamard's KL [95 % CI] for every (text, G), and the
    KL itself."""
    blocks = _blocks(out)
    methods: list[str] = []
    for _, _, run in blocks:
        methods += [r["method"] for r in run["results"] if r["method"] not in methods and r["kind"] != "fp"]
    head = " | ".join(f"{t} G = {g}" for t, g, _ in blocks)
    lines = [f"| method | {head} |", "|---|" + "---|" * len(blocks)]
    for m in methods:
        cells = []
        for _, _, run in blocks:
            r = next((x for x in run["results"] if x["method"] == m), None)
            if r is None:
                cells.append("not run")
                continue
            rel = _relative(run, r)
            verdict = ((r.get("vs_baseline") or {}).get("kl") or {}).get("verdict", "")
            mark = {"better": " ✓", "worse": " ✗"}.get(verdict, "")
            cells.append(f"{r['kl']:.4f}" + (f" ({rel[0]:+.1f} % [{rel[1]:+.1f}, {rel[2]:+.1f}]){mark}" if rel else ""))
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_plot(out: dict[str, Any], path: Path) -> Path:
    """ΔKL vs hadamard in % of its KL with 95 % CIs: one panel per G, one marker per text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = _blocks(out)
    groups = sorted({g for _, g, _ in blocks})
    methods: list[str] = []
    for _, _, run in blocks:
        methods += [r["method"] for r in run["results"] if r.get("vs_baseline") and r["method"] not in methods
                    and r["kind"] != "none"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 1.4 + 0.42 * len(methods)), sharey=True,
                             squeeze=False)
    styles = {"persuasion": ("o", "tab:blue", -0.13), "mobydick": ("s", "tab:orange", 0.13)}
    for ax, g in zip(axes[0], groups):
        for text, gg, run in blocks:
            if gg != g:
                continue
            marker, color, dy = styles.get(text, ("^", "tab:green", 0.0))
            first = True
            for i, m in enumerate(methods):
                r = next((x for x in run["results"] if x["method"] == m), None)
                rel = _relative(run, r) if r is not None else None
                if rel is None:
                    continue
                ax.errorbar([rel[0]], [i + dy], xerr=[[rel[0] - rel[1]], [rel[2] - rel[0]]], fmt=marker, color=color,
                            capsize=3, label=text if first else None)
                first = False
        ax.axvline(0.0, color="black", linewidth=1)
        ax.axvline(-30.0, color="gray", linewidth=1, linestyle="--")
        ax.set_title(f"G = {g}")
        ax.set_xlabel("ΔKL vs hadamard, % of hadamard's KL (95 % CI)")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_yticks(range(len(methods)))
    axes[0][0].set_yticklabels(methods)
    axes[0][0].invert_yaxis()
    fig.suptitle("SmolLM2-135M-Instruct, one 8,192-token window per text, 4 sign draws\n"
                 "dashed: 30 % less KL than hadamard", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ci(d: dict[str, Any] | None, scale: float = 1.0, digits: int = 4) -> str:
    if not d:
        return ""
    return f"{d['delta'] * scale:+.{digits}f} [{d['lo'] * scale:+.{digits}f}, {d['hi'] * scale:+.{digits}f}]"


def markdown(out: dict[str, Any]) -> str:
    """One table per (text, group): the measured rows, Δ vs Hadamard with CIs and verdicts."""
    lines = []
    for run in out["runs"]:
        lines += [f"### {run['texts'][0]}, G = {run['config']['group_size']}", "",
                  f"{run['tokens']} tokens, one {run['context']}-token window; "
                  f"{run['protocol']['draws']} sign draws per rotation method (learned rotations as given)", "",
                  "| method | ppl | KL (nats) | top-1 | copy acc | INT2 pairs | BPE | ΔNLL vs hadamard [95% CI] "
                  "| ΔKL vs hadamard [95% CI] | verdict (KL) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["results"]:
            vs = r.get("vs_baseline") or {}
            spread = f" ±{r['kl_spread']:.4f}" if r["draws"] > 1 else ""
            copy = f"{100 * r['copy']['accuracy']:.1f} %" if r.get("copy") else ""
            lines.append(
                f"| {r['method']} | {r['perplexity']:.3f} | {r['kl']:.4f}{spread} | {100 * r['top1']:.1f} % | {copy} "
                f"| {100 * r['exposure']['pairs']:.1f} % | {r['bpe']:.2f} | {_ci(vs.get('nll'))} | {_ci(vs.get('kl'))} "
                f"| {(vs.get('kl') or {}).get('verdict', '')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def timing(args: argparse.Namespace) -> dict[str, Any]:
    """fp forward vs one INT2 method's forward on one window (best of ``--repeat`` alternated runs), with peak RSS."""
    import resource

    import torch

    from rotationzoo.evaluate import MethodSpec, find_smollm2_gguf, tokenize_texts
    from rotationzoo.evaluate.metrics import hidden_states
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.integrations.transformers import load_model, model_shape

    model, tok = load_model(find_smollm2_gguf())
    ids = tokenize_texts(tok, [_text(args, args.texts.split(",")[0])], skip=args.skip, tokens=args.context)
    shape = model_shape(model)
    oscar = MethodSpec.hadamard().oscar(shape, Int2KVConfig(group_size=int(args.groups.split(",")[0])), draw=0)
    times = {"fp": float("inf"), "int2": float("inf")}
    for rep in range(args.repeat):  # alternated, so that a busy machine slows both alike
        for name, o in (("fp", None), ("int2", oscar)):
            t0 = time.perf_counter()
            hidden_states(model, ids, o)
            times[name] = min(times[name], time.perf_counter() - t0)
            _log(f"{name} #{rep + 1}: {time.perf_counter() - t0:.1f} s for {len(ids)} tokens")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"tokens": len(ids), "threads": torch.get_num_threads(), "fp_s": times["fp"], "int2_s": times["int2"],
           "ratio": times["int2"] / times["fp"], "peak_rss_mib": rss}
    print(f"context {len(ids)}: fp {times['fp']:.1f} s, INT2 (hadamard) {times['int2']:.1f} s, "
          f"ratio {out['ratio']:.2f}, peak RSS {rss:.0f} MiB")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        merged: dict[str, Any] = {"runs": []}
        for f in args.replot:
            merged["runs"] += json.loads(f.read_text())["runs"]
        args.json_out = None
        _write(args, merged)
        print(summary(merged))
        return 0
    if args.timing:
        out = timing(args)
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(out, indent=1) + "\n")
        return 0
    out = run_grid(args)
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
