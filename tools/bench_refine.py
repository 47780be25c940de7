#!/usr/bin/env python
"""Learned INT2 rotations: cost and held-out loss of :func:`rotationzoo.fit.refine_fit`.

Two modes:

* **real** (default): SmolLM2-135M-Instruct (the GGUF of :func:`rotationzoo.evaluate.find_smollm2_gguf`)
  runs once over the first ``--calib-tokens`` tokens of *Emma* (``--calib-seq`` windows) with
  :func:`~rotationzoo.integrations.transformers.collect_statistics`, keeping a reservoir of
  ``--sample-tokens`` tokens per layer beside the covariances; then, for every group size in
  ``--groups`` and init in ``--inits``, :func:`~rotationzoo.fit.refine_fit` refines every layer
  (``--layers`` for a subset). Per run: wall time, CPU time, peak RSS, mean held-out loss of the
  init and of the result per side, and how many layers kept the refined rotation. With
  ``--save DIR`` each full run is written with :func:`~rotationzoo.fit.write_fitted` to
  ``DIR/refined_<init>_g<G>``; ``--best DIR`` writes, per G, the init with the lowest mean
  held-out loss (K and V averaged) to ``DIR/refined_g<G>``.
* **memory** (``--synthetic LAYERS,HEAD_DIM,HQ,HKV``, e.g. ``36,128,32,8``): random activations
  of ``--calib-tokens`` tokens per layer in ``--calib-seq`` sequences fill the reservoir of every
  layer, then ``--layers`` (default: two) are refined with ``--workers`` jobs, so the peak RSS is
  that of a full refinement (the reservoir of every layer plus the working set of the jobs
  running at once).
* ``--dump DIR``: the samples (and the OSCAR inits) from a Q/K/V dump instead of a model pass.

``--loss`` (``served`` or ``block``), ``--block-size``, ``--grouping``, ``--center``, ``--lr`` and
``--steps-v`` are those of ``rotationzoo fit --refine``; ``--prototype`` is a named recipe, a
re-implementation of a quick prototype learned-rotation fit: Hadamard init, the ``block`` loss on
1,024-token blocks, K only (V stays Hadamard), Adam ``lr = 2e-3``, 300 steps, 2,048 training tokens
per layer (plus one held-out block). With ``--keep-tokens N`` (real mode) each run is then judged by
the model on ``N`` tokens of ``--keep-text`` (default: the calibration text after the calibration
tokens, a screen that ranks runs on the calibration novel only, see docs/fitting.md)
(:func:`rotationzoo.evaluate.keep.keep_by_text`), and its cost is part of the run's.

End-to-end quality (KL, perplexity, copy probe) is measured by ``tools/bench_real_model.py
--extra refined_g64=DIR/refined_g64@64 ...``.

Usage::

    nice -n 10 python tools/bench_refine.py --layers 0,4,9,14,19,24,29 --json-out bench-out/refine/inits.json
    nice -n 10 python tools/bench_refine.py --inits oscar --best bench-out/grid/rotations --json-out bench-out/refine/real.json
    nice -n 10 python tools/bench_refine.py --synthetic 36,128,32,8 --json-out bench-out/refine/memory.json
    python tools/bench_refine.py --inits oscar --grouping kv_head --center k --groups 64,16 --steps 100 \
        --sample-tokens 20480 --keep-tokens 4096 --save bench-out/rotations --json-out bench-out/refine/served.json
    python tools/bench_refine.py --prototype --groups 64 --save bench-out/rotations --json-out bench-out/refine/prototype.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from rotationzoo.fit import Refinement, refine_fit, samples_from_dump, write_fitted  # noqa: E402
from rotationzoo.fit.refine_loss import RefineConfig  # noqa: E402
from rotationzoo.fit.result import peak_rss_bytes  # noqa: E402
from rotationzoo.fit.samples import CalibrationSamples  # noqa: E402

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _load() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _ids(text: str | None) -> list[int] | None:
    return [int(x) for x in text.split(",") if x.strip()] if text else None


def capture(args: argparse.Namespace) -> Any:
    """One model pass: covariance statistics and the sample reservoir."""
    from rotationzoo.evaluate import find_smollm2_gguf
    from rotationzoo.integrations.transformers import collect_statistics, load_model

    text = args.texts_dir / f"{args.calib}.txt"
    if not text.is_file():
        raise SystemExit(f"{text} missing: python tools/texts.py {args.calib} --out-dir {args.texts_dir}")
    t0 = time.perf_counter()
    model, tok = load_model(args.model or find_smollm2_gguf())
    stats = collect_statistics(model, tok, [text], tokens=args.calib_tokens, seq_len=args.calib_seq, model_id=MODEL_ID,
                               sample_tokens=args.sample_tokens, sample_seed=args.seed,
                               sample_block_size=_options(args).blocks, grouping=args.grouping)
    if args.keep_tokens:
        from rotationzoo.evaluate.inputs import tokenize_texts

        args.keep_model = model
        held = args.texts_dir / f"{args.keep_text}.txt" if args.keep_text else text
        args.keep_ids = tokenize_texts(tok, [held], tokens=args.keep_tokens, skip=0 if args.keep_text else args.calib_tokens)
        args.keep_source = f"{args.keep_text}" if args.keep_text else f"{args.calib} after {args.calib_tokens} tokens"
    del model
    assert stats.samples is not None
    _log(f"captured {stats.tokens} tokens per layer ({stats.info['prompts']} sequences) in "
         f"{time.perf_counter() - t0:.0f} s; reservoir {stats.samples.nbytes() / 2**20:.0f} MiB")
    return stats


def synthetic_samples(args: argparse.Namespace) -> CalibrationSamples:
    """Random activations with a few outlier channels, ``--calib-tokens`` per layer."""
    n_layers, d, hq, hkv = (int(x) for x in args.synthetic.split(","))
    samples = CalibrationSamples(max_tokens=args.sample_tokens, seed=args.seed, block_size=_options(args).blocks)
    g = torch.Generator().manual_seed(args.seed)
    chan = torch.ones(d)
    chan[:4] = 10.0
    bufs = [torch.empty(args.calib_seq, h, d) for h in (hq, hkv, hkv)]  # reused: no allocator churn
    for lid in range(n_layers):
        left = args.calib_tokens
        while left > 0:
            n = min(args.calib_seq, left)
            q, k, v = (torch.randn(b.shape, generator=g, out=b)[:n] for b in bufs)
            q.mul_(chan)
            k.mul_(chan)
            samples.on_qkv(lid, q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16))
            left -= n
    _log(f"synthetic reservoir: {n_layers} layers, d={d}, {hq}/{hkv} heads, {samples.nbytes() / 2**30:.2f} GiB, "
         f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB")
    return samples


def _options(args: argparse.Namespace) -> Refinement:
    return Refinement(steps=args.steps, seed=args.seed, sample_tokens=args.sample_tokens, loss=args.loss,
                      block_size=args.block_size)


def run_one(args: argparse.Namespace, samples: CalibrationSamples, init: str, g: int | None,
            statistics: Any, info: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    c0, t0 = time.process_time(), time.perf_counter()
    cfg = RefineConfig(param=args.param, loss=args.loss, lr=args.lr, queries_per_block=args.queries_per_block)
    res = refine_fit(samples, init, steps=args.steps, group_size=g, seed=args.seed, statistics=statistics,
                     config=cfg, layers=_ids(args.layers), workers=args.workers, source_info=info, model=MODEL_ID,
                     grouping=args.grouping, center=args.center, steps_v=args.steps_v)
    refine_s = time.perf_counter() - t0
    if getattr(args, "keep_model", None) is not None and not args.layers:
        from rotationzoo.evaluate.keep import keep_by_text, keep_summary

        res = keep_by_text(args.keep_model, args.keep_ids, res, source=args.keep_source)
        _log(keep_summary(res) or "")
    assert res.refinement is not None
    ref = res.refinement
    row: dict[str, Any] = {"init": init, "group_size": g, "param": args.param, "loss": args.loss,
                           "grouping": args.grouping, "center": args.center, "steps": args.steps,
                           "steps_v": args.steps if args.steps_v is None else args.steps_v, "lr": args.lr,
                           "block_size": samples.block_size, "layers": len(res.layer_ids),
                           "wall_s": time.perf_counter() - t0, "refine_s": refine_s, "cpu_s": time.process_time() - c0,
                           "peak_rss_bytes": peak_rss_bytes(), "load_average": _load(), "keep": ref.get("keep")}
    for side, rows in ref["layers"].items():
        row[side] = {"heldout_init": sum(r["heldout_init"] for r in rows) / len(rows),
                     "heldout_final": sum(r["heldout_final"] for r in rows) / len(rows),
                     "mean_relative_improvement": ref["mean_relative_improvement"][side],
                     "kept_refined": sum(k == "refined" for r in rows
                                             for k in (r["kept"] if isinstance(r["kept"], list) else [r["kept"]])),
                     "per_layer": rows}
    _log(f"G={g} init={init}: {row['wall_s']:.0f} s wall, {row['cpu_s']:.0f} s CPU, peak RSS "
         f"{row['peak_rss_bytes'] / 2**20:.0f} MiB; held-out " + ", ".join(
             f"{s.upper()} {row[s]['heldout_init']:.4f} -> {row[s]['heldout_final']:.4f}" for s in ("k", "v")))
    return res, row


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| G | init | loss | K held-out init → final | V held-out init → final | K/V kept | keep rule | wall s | "
           "CPU s | peak RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        k, v = r["k"], r["v"]
        keep = r.get("keep")
        rule = f"{keep['chosen']} (KL {keep['kl'][keep['chosen']]:.4f} vs init {keep['kl']['init']:.4f})" if keep else "—"
        out.append(f"| {r['group_size']} | {r['init']} | {r.get('loss', 'block')} | {k['heldout_init']:.4f} → "
                   f"{k['heldout_final']:.4f} ({-k['mean_relative_improvement']:+.1%}) | {v['heldout_init']:.4f} → "
                   f"{v['heldout_final']:.4f} ({-v['mean_relative_improvement']:+.1%}) | {k['kept_refined']}/"
                   f"{v['kept_refined']} | {rule} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['peak_rss_bytes'] / 2**20:.0f} |")
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="model folder or .gguf (default: the SmolLM2 GGUF)")
    p.add_argument("--texts-dir", type=Path, default=REPO / "bench-out" / "texts")
    p.add_argument("--calib", default="emma")
    p.add_argument("--calib-tokens", type=int, default=20000)
    p.add_argument("--calib-seq", type=int, default=2048)
    p.add_argument("--sample-tokens", type=int, default=Refinement().sample_tokens,
                   help="reservoir tokens per layer (20480 keeps every whole block of 20,000 tokens)")
    p.add_argument("--groups", default="64,16")
    p.add_argument("--inits", default="hadamard,oscar,r_pbr_hg")
    p.add_argument("--steps", type=int, default=Refinement().steps)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--param", default="expm", choices=("expm", "cayley"), help="retraction of the skew parameter")
    p.add_argument("--layers", help="refine only these layers, e.g. 0,4,9")
    p.add_argument("--workers", type=int, default=None, help="concurrent (layer, side) jobs (default: torch threads)")
    p.add_argument("--dump", type=Path, help="take the samples and the OSCAR inits from this Q/K/V dump instead of "
                                             "running the model (e.g. one written by collect_statistics(dump_out=))")
    p.add_argument("--synthetic", help="memory mode: LAYERS,HEAD_DIM,HQ,HKV of random activations")
    p.add_argument("--save", type=Path, help="write every full run to SAVE/refined_<init>_g<G>")
    p.add_argument("--best", type=Path, help="write the best init per G to BEST/refined_g<G>")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--loss", default="served", choices=("served", "block"))
    p.add_argument("--block-size", type=int, default=None, help="tokens per block (default: 1024 served, 256 block)")
    p.add_argument("--grouping", default="layer", choices=("layer", "kv_head"))
    p.add_argument("--center", default=None, choices=("none", "k", "kv"))
    p.add_argument("--lr", type=float, default=RefineConfig().lr)
    p.add_argument("--steps-v", type=int, default=None, help="V steps (default: --steps; 0 keeps V at its init)")
    p.add_argument("--queries-per-block", type=int, default=RefineConfig().queries_per_block)
    p.add_argument("--keep-tokens", type=int, default=0, help="judge each run on this many held-out tokens (real mode)")
    p.add_argument("--keep-text", help="the held-out text of --keep-tokens (a tools/texts.py name; default: the "
                                       "calibration text after the calibration tokens, which overstates refinement)")
    p.add_argument("--prototype", action="store_true", help="the prototype recipe (see the module docstring)")
    args = p.parse_args(argv)
    if args.prototype:
        args.inits, args.loss, args.block_size, args.lr, args.steps, args.steps_v = "hadamard", "block", 1024, 2e-3, 300, 0
        args.sample_tokens = 3072  # two 1,024-token training blocks and one held out
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                              "load_average_start": _load(), "runs": []}
    t_all = time.perf_counter()
    if args.synthetic:
        samples, stats, info = synthetic_samples(args), None, {"kind": "synthetic", "shape": args.synthetic}
        args.layers = args.layers or "0,1"
        report["reservoir_bytes"] = samples.nbytes()
        report["peak_rss_after_reservoir_bytes"] = peak_rss_bytes()
    elif args.dump:
        t0 = time.perf_counter()
        samples, stats = samples_from_dump(args.dump, max_tokens=args.sample_tokens, seed=args.seed,
                                            block_size=_options(args).blocks), None
        info = {"kind": "dump", "path": str(args.dump)}
        report["calibration"] = dict(info, reservoir_bytes=samples.nbytes(), read_s=time.perf_counter() - t0)
    else:
        stats = capture(args)
        samples, info = stats.samples, stats.info
        report["calibration"] = dict(info, reservoir_bytes=samples.nbytes(), peak_rss_bytes=peak_rss_bytes())
    best: dict[int, tuple[float, Any]] = {}
    for g in [int(x) for x in args.groups.split(",")]:
        for init in args.inits.split(","):
            statistics = stats.accumulators if stats else args.dump
            res, row = run_one(args, samples, init, g, statistics, info)
            report["runs"].append(row)
            score = row["k"]["heldout_final"] + row["v"]["heldout_final"]  # same held-out blocks for every init
            if not args.layers and args.save:
                name = "prototype" if args.prototype else f"refined_{init}_{args.loss}_{args.grouping}_c{args.center or 'none'}"
                write_fitted(res, args.save / f"{name}_g{g}", tag=f"{args.calib}-{args.calib_tokens}")
            if g not in best or score < best[g][0]:
                best[g] = (score, res)
            _write(args, report, t_all)
    if args.best and not args.layers:
        for g, (_, res) in best.items():
            out = write_fitted(res, args.best / f"refined_g{g}", tag=f"{args.calib}-{args.calib_tokens}")
            report.setdefault("best", {})[str(g)] = {"init": res.refinement["init"], "path": str(out.manifest_path.parent)}
            _log(f"G={g}: best init {res.refinement['init']} written to {out.manifest_path.parent}")
    report["peak_rss_bytes"] = peak_rss_bytes()
    _write(args, report, t_all)
    print(markdown(report["runs"]))
    return 0


def _write(args: argparse.Namespace, report: dict[str, Any], t0: float) -> None:
    report["wall_s"] = time.perf_counter() - t0
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(report["runs"]))


if __name__ == "__main__":
    raise SystemExit(main())
