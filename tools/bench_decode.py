#!/usr/bin/env python
"""Decode attention straight from the INT2 cache: how fast, against the caches users run, on CPU and CUDA.

Modes (each prints its tables and writes the numbers as JSON, ``--json-out``)::

    python tools/bench_decode.py --cpu                        # SmolLM2 generate + attention-only, CPU
    python tools/bench_decode.py --cpu --skip-generate        # the attention-only table alone (minutes)
    python tools/bench_decode.py --cpu --contexts 8192 --runs 3 --steps 16 --attn-contexts 8192   # quick
    python tools/bench_decode.py --cuda                       # Qwen3-8B geometry: INT2 kernel vs SDPA / FlashAttention BF16
    python tools/bench_decode.py --cuda --dry-run             # the same code path on CPU (Triton interpreter, tiny)

``--cpu``: see :mod:`bench_decode_cpu` (generate with DynamicCache, StaticCache fp32 and bf16 and
OscarInt2Cache at 8K and 32K positions; decode attention alone at 8K / 32K / 128K on 1 and 2
threads against preallocated SDPA in fp32 and bf16, each with ``enable_gqa`` and with the query heads as
rows, ratios also against the fastest of the four; with GB/s and the fraction of the copy bandwidth
measured in the same run; every number the median of ``--runs`` alternating runs after a discarded
warm-up, with its spread). Default JSON: ``bench-out/decode-cpu.json``.

``--cuda``: 32 query heads, 8 KV heads, d = 128 (Qwen3-8B), G = 128, fp32 scale/zero, 64 + 256 BF16
windows, contexts 32K and 128K (``--contexts``), batch 1 and 8: ``decode_attention_int2`` (Triton) against
``torch.nn.functional.scaled_dot_product_attention`` on the same context in BF16 (and
FlashAttention's ``flash_attn_with_kvcache`` when installed): ms per call (CUDA graphs when they
capture, else back-to-back launches), GB/s of the bytes each must read, % of the device copy
bandwidth measured in the same run, and the INT2 result against the PyTorch reference on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_decode_cpu import (  # noqa: E402
    CACHES, MODEL, attention_table, cpu_identity, cpu_label, generate_child, int2_configs, print_attention,
    print_generate, run_generate)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def show(title: str, headers: tuple[str, ...], rows: list[list[str]]) -> None:
    """Plain columns (no dependency: the GPU machine may lack rich)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(title)
    for line in (list(headers), *rows):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print()


def _synthetic_cache(b: int, hq: int, hkv: int, d: int, context: int, group: int, device: str = "cpu",
                     prefix: int = 64, recent: int = 256, scale_dtype: Any = None) -> dict[str, Any]:
    import torch

    from rotationzoo.dtypes import TORCH_DTYPES
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.kernels import Int2KV, quantize_int2

    g = torch.Generator(device=device).manual_seed(0)
    n = max(0, context - prefix - recent)
    sdt = scale_dtype or torch.float32
    cfg = Int2KVConfig(k_clip_ratio=0.0, group_size=group,
                       scale_dtype=next(k for k, v in TORCH_DTYPES.items() if v == sdt))  # type: ignore[arg-type]

    def side() -> Int2KV:
        x = torch.randn(b, hkv, context, d, generator=g, device=device)
        codes, sz = quantize_int2(x[:, :, prefix:prefix + n], config=cfg)
        return Int2KV(x[:, :, :prefix].bfloat16(), codes, sz, x[:, :, prefix + n:].bfloat16())

    q = torch.randn(b, hq, 1, d, generator=g, device=device)
    rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))[0]
    rot = rot.float().to(device)
    return {"q": q, "k": side(), "v": side(), "rot": rot, "n_int2": n}


# --- CUDA: Qwen3-8B geometry --------------------------------------------------------------------


def _cuda_timer(fn: Callable[[], Any], iters: int, device: Any) -> tuple[float, str]:
    """Seconds per call: a CUDA graph of ``iters`` calls when it captures, else back-to-back launches."""
    import torch

    fn()
    torch.cuda.synchronize(device)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(iters):
                    fn()
        graph.replay()
        torch.cuda.synchronize(device)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3 / iters)
        return best, "graph"
    except Exception:  # noqa: BLE001 - capture is not possible everywhere: time plain launches
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3 / iters)
        return best, "launches"


def _copy_gbps(device: Any, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t, _ = _cuda_timer(lambda: dst.copy_(src), 10, device)
    return 2 * nbytes / t / 1e9


def int2_read_bytes(b: int, hkv: int, d: int, group: int, scale_bytes: int, n_int2: int, n_window: int) -> int:
    """Bytes an INT2 decode step must read: per token and KV head, K and V codes ``d/4`` plus
    ``2·(d/G)`` scale/zero values, and the BF16 window rows ``2d`` each."""
    per_int2 = 2 * (d // 4 + 2 * (d // group) * scale_bytes)
    return b * hkv * (n_int2 * per_int2 + n_window * 2 * 2 * d)


def run_cuda(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rotationzoo.kernels import decode_attention_int2

    dry = args.dry_run
    if dry:  # the same path on CPU: Triton's interpreter on a tiny cache
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, hq, hkv, d = torch.device("cpu"), 4, 2, 64
        contexts, batches = [min(c, 512) for c in args.contexts[:1]] or [512], [1]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("--cuda needs a CUDA device (use --dry-run to check the code path on CPU)")
        device, hq, hkv, d = torch.device("cuda"), 32, 8, 128
        contexts, batches = args.contexts, args.batches
    group = d
    try:
        from flash_attn import flash_attn_with_kvcache  # type: ignore[import-not-found]
    except ImportError:
        flash_attn_with_kvcache = None
    copy = _copy_gbps(device, 1 << 30) if not dry else None
    rows, results = [], []
    for context in contexts:
        for b in batches:
            c = _synthetic_cache(b, hq, hkv, d, context, group, device=str(device))
            q, k, v, rot = c["q"].bfloat16(), c["k"], c["v"], c["rot"]
            n_int2 = c["n_int2"]
            n_window = context - n_int2
            kw = dict(k_rotation=rot, v_rotation=rot)
            out = decode_attention_int2(q, k, v, backend="triton", dtype=torch.float32, **kw)
            ref = decode_attention_int2(q, k, v, backend="torch", dtype=torch.float32, **kw)
            rel = float((out - ref).norm() / ref.norm())
            rec: dict[str, Any] = {"context": context, "batch": b, "int2_rel_err_vs_reference": rel,
                                   "int2_bytes": int2_read_bytes(b, hkv, d, group, 4, n_int2, n_window),
                                   "bf16_bytes": b * hkv * context * 2 * 2 * d}
            if not dry:
                kb = torch.randn(b, hkv, context, d, device=device, dtype=torch.bfloat16)
                vb = torch.randn_like(kb)
                t_int2, how = _cuda_timer(lambda: decode_attention_int2(q, k, v, backend="triton", **kw), 20, device)
                t_sdpa, _ = _cuda_timer(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, kb, vb, enable_gqa=True), 20, device)
                rec.update(timer=how, int2_ms=t_int2 * 1e3, sdpa_ms=t_sdpa * 1e3, copy_gbps=copy,
                           int2_gbps=rec["int2_bytes"] / t_int2 / 1e9, sdpa_gbps=rec["bf16_bytes"] / t_sdpa / 1e9,
                           speedup_vs_sdpa=t_sdpa / t_int2)
                rec["int2_pct_copy"] = 100 * rec["int2_gbps"] / copy
                rec["sdpa_pct_copy"] = 100 * rec["sdpa_gbps"] / copy
                if flash_attn_with_kvcache is not None:
                    kf, vf, qf = kb.transpose(1, 2).contiguous(), vb.transpose(1, 2).contiguous(), q.transpose(1, 2)
                    t_fa, _ = _cuda_timer(lambda: flash_attn_with_kvcache(qf, kf, vf), 20, device)
                    rec.update(flash_ms=t_fa * 1e3, flash_gbps=rec["bf16_bytes"] / t_fa / 1e9,
                               speedup_vs_flash=t_fa / t_int2)
                del kb, vb
            results.append(rec)
            del c, k, v
            f = lambda key, fmt="{:.3f}": fmt.format(rec[key]) if key in rec else "-"  # noqa: E731
            rows.append([str(context), str(b), f("int2_ms"), f("sdpa_ms"), f("flash_ms"), f("speedup_vs_sdpa", "{:.2f}x"),
                         f("speedup_vs_flash", "{:.2f}x"), f("int2_gbps", "{:.0f}"), f("int2_pct_copy", "{:.1f}"), f("sdpa_gbps", "{:.0f}"),
                         f("sdpa_pct_copy", "{:.1f}"), f"{rec['int2_bytes'] / 1e6:.1f}", f"{rec['bf16_bytes'] / 1e6:.1f}",
                         f"{rel:.1e}"])
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: Triton interpreter, numbers meaningless)"
    show(f"Decode attention, {hq} query / {hkv} KV heads, d = {d}, G = {group}, fp32 scale/zero, 64 + 256 BF16 windows "
         f"on {gpu}" + (f"; copy {copy:.0f} GB/s" if copy else ""),
         ("context", "batch", "INT2 ms", "SDPA ms", "flash ms", "vs SDPA", "vs flash", "INT2 GB/s", "% copy", "SDPA GB/s", "% copy",
          "INT2 MB", "BF16 MB", "rel err"), rows)
    goals = None
    if not dry:
        long = [r for r in results if r["context"] >= 32768]
        longest = [r for r in results if r["context"] >= 131072]
        goals = {"speedup_3x_sdpa_at_32k_and_128k": bool(long) and all(r["speedup_vs_sdpa"] >= 3 for r in long),
                 "speedup_2x_flash_at_128k": (all(r["speedup_vs_flash"] >= 2 for r in longest)
                                              if longest and all("speedup_vs_flash" in r for r in longest) else None),
                 "int2_70pct_copy_at_32k_and_128k": bool(long) and all(r["int2_pct_copy"] >= 70 for r in long)}
    return {"mode": "cuda", "dry_run": dry, "gpu": gpu, "geometry": {"q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "group_size": group, "scale_dtype": "float32", "prefix_tokens": 64, "recent_tokens": 256},
            "copy_gbps": copy, "flash_attn": flash_attn_with_kvcache is not None, "rows": results, "goals": goals,
            "matches_reference": all(r["int2_rel_err_vs_reference"] < 1e-2 for r in results)}


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="SmolLM2 generate and decode attention alone, on CPU")
    mode.add_argument("--cuda", action="store_true", help="Qwen3-8B geometry: the Triton kernel vs SDPA / FlashAttention BF16")
    mode.add_argument("--_generate-child", type=int, dest="generate_child", help=argparse.SUPPRESS)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--contexts", type=ints, default=None,
                   help="--cpu: generate contexts (default 8192,32768); --cuda: contexts (default 32768,131072)")
    p.add_argument("--attn-contexts", type=ints, default=[8192, 32768, 131072], help="--cpu: attention-only contexts")
    p.add_argument("--threads", type=ints, default=[1, 2], help="--cpu: attention-only thread counts (default 1,2)")
    p.add_argument("--int2", default="served,16:float32",
                   help="--cpu: INT2 settings of the attention-only rows, G:scale_dtype or 'served' (the bundled SmolLM2 "
                        "entry's; default served,16:float32)")
    p.add_argument("--caches", default=",".join(CACHES), help=f"--cpu: generate caches (default {','.join(CACHES)})")
    p.add_argument("--runs", type=int, default=5, help="--cpu: timed runs after the warm-up (default 5, at least 5 for reports)")
    p.add_argument("--steps", type=int, default=32, help="--cpu: decode steps timed per generate run (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="--cpu: tokens of the real prompt repeated to the context")
    p.add_argument("--skip-generate", action="store_true", help="--cpu: the attention-only table alone")
    p.add_argument("--skip-attention", action="store_true", help="--cpu: the generate table alone")
    p.add_argument("--batches", type=ints, default=[1, 8], help="--cuda batches")
    p.add_argument("--dry-run", action="store_true", help="--cuda on CPU under the Triton interpreter, tiny shapes")
    p.add_argument("--json-out", type=Path, default=None, help="JSON (default --cpu: bench-out/decode-cpu.json)")
    args = p.parse_args(argv)
    if args.contexts is None:
        args.contexts = [32768, 131072] if args.cuda else [8192, 32768]
    if args.cpu and args.json_out is None:
        args.json_out = REPO / "bench-out" / "decode-cpu.json"
    return args


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    caches = tuple(c for c in args.caches.split(",") if c)
    unknown = set(caches) - set(CACHES)
    if unknown:
        raise SystemExit(f"unknown cache(s) {', '.join(sorted(unknown))}; choose from {', '.join(CACHES)}")
    out: dict[str, Any] = {"mode": "cpu", "model": MODEL, "torch": torch.__version__, "cpus": os.cpu_count(),
                           "cpu": cpu_identity()}
    print(f"CPU: {cpu_label(out['cpu'])}, {out['cpus']} cores\n")
    if not args.skip_generate:
        out["generate"] = run_generate(args.contexts, args.steps, args.runs, caches, args.prompt_tokens)
        print_generate(out["generate"], show)
    if not args.skip_attention:
        out["attention"] = attention_table(args.attn_contexts, args.threads, args.runs, int2_configs(args.int2))
        print_attention(out["attention"], show)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.generate_child is not None:
        print(json.dumps(generate_child(args.generate_child, args.steps, args.runs, tuple(args.caches.split(",")),
                                        args.prompt_tokens)))
        return 0
    result = run_cpu(args) if args.cpu else run_cuda(args)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    if args.cuda and not result["matches_reference"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
