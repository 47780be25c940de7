"""Benchmark the INT2 KV kernels against the device copy bandwidth measured in the same run.

Usage::

    python tools/bench_kernels.py                         # CUDA: T = 4096, 65536, 1048576 tokens
    python tools/bench_kernels.py --quick --json-out bench-out/int2.json
    python tools/bench_kernels.py --sweep                 # also try launch configs of the fused kernel
    python tools/bench_kernels.py --dry-run               # CPU, Triton interpreter, tiny sizes

For each token count ``T`` (``H`` heads of ``d`` dims, bf16 input, ``G``-dim groups, fp32 scale/zero
by default) it times, with ``triton.testing.do_bench`` (median, L2 flushed between runs):

- ``copy``: ``dst.copy_(x)`` of the bf16 input (the bandwidth denominator);
- ``fused``: the rotate + clip + quantize + pack kernel (rotation as bf16 ``tl.dot`` in the kernel);
- ``two-step``: a torch bf16 GEMM ``x @ R`` followed by the same kernel without rotation;
- ``dequant``: INT2 -> bf16, materialised.

It also checks, on the same device, that the triton kernels without a rotation give exactly the
PyTorch reference's bytes (``torch.equal`` on codes, scale/zero bits and dequantized values), and
``--sweep`` times the fused kernel at each ``rotationzoo.kernels.layout.quant_launch_candidates``
(rows per tile x warps x pipeline stages).

Bytes formulas (per row = one token of one head; ``s`` = bytes per scale/zero value):

- copy:      ``2 * d * 2``                       (read x + write the copy, bf16)
- quantize:  ``d * 2 + d / 4 + 2 * (d / G) * s`` (read x, write codes and scale/zero); the two-step
  path is reported against the same useful bytes (it moves ``d * 2`` more read and written
  through the GEMM's output); the rotation matrix (``2 d^2`` bytes, L2-resident) is not counted
- dequant:   ``d / 4 + 2 * (d / G) * s + d * 2`` (read codes and scale/zero, write bf16)

GB/s = bytes / time; "% copy" = kernel GB/s / copy GB/s at the same T. Kernel times exclude output
allocation (buffers are preallocated and the launch wrappers in ``rotationzoo.kernels.triton_int2``
are called directly).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede any triton import
    os.environ["TRITON_INTERPRET"] = "1"

_EQUAL_KEYS = (
    "codes_equal_reference_no_rotation",
    "scales_zeros_equal_reference_no_rotation",
    "dequant_equal_reference",
)
TARGETS = {"fused_pct_copy": 80.0, "dequant_pct_copy": 85.0, "speedup": 2.5, "min_tokens": 65536}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 4096,65536,1048576)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=None, help="default: head_dim")
    p.add_argument("--clip", type=float, default=0.96, help="clip ratio (0 disables)")
    p.add_argument("--scale-dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--quick", action="store_true", help="T = 4096, 65536 and shorter timing runs")
    p.add_argument("--sweep", action="store_true", help="also time fused-kernel launch configs")
    p.add_argument("--cuda-graph", action="store_true", help="also time under CUDA graphs")
    p.add_argument("--json-out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny sizes, no real timing")
    return p.parse_args(argv)


def _config(clip: float, group: int, sdt):
    """The INT2 settings of one measurement as the kernels take them (K side: ``clip`` on keys)."""
    from rotationzoo.dtypes import TORCH_DTYPES
    from rotationzoo.int2kv import Int2KVConfig

    name = next(k for k, v in TORCH_DTYPES.items() if v == sdt)
    return Int2KVConfig(k_clip_ratio=max(clip, 0.0), group_size=group, scale_dtype=name)  # type: ignore[arg-type]


def bytes_per_row(kind: str, d: int, group: int, s_bytes: int) -> float:
    """Bytes moved per (token, head) row; see the module docstring."""
    meta = 2 * (d // group) * s_bytes
    if kind == "copy":
        return 2.0 * d * 2
    if kind == "quantize":
        return d * 2 + d / 4 + meta
    if kind == "dequant":
        return d / 4 + meta + d * 2
    raise ValueError(kind)


def make_timer(device: str, quick: bool, cuda_graph: bool = False):
    if device == "cuda":
        import triton.testing

        rep = 30 if quick else 100

        def timer(fn) -> float:
            if cuda_graph:
                return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
            return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))

        return timer

    def cpu_timer(fn) -> float:  # dry run: one warm call, one timed call
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return cpu_timer


def random_rotation(d: int, device: str):
    import torch

    g = torch.Generator().manual_seed(0)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32).contiguous().to(device)


def bench_one(t: int, args, device: str, timer, sdt, s_bytes: int) -> dict:
    import torch

    from rotationzoo.kernels import layout, quantize_int2
    from rotationzoo.kernels.reference import unpack_codes
    from rotationzoo.kernels.triton_int2 import dequantize_triton, quantize_triton

    h, d = args.heads, args.head_dim
    group = args.group_size or d
    ng = d // group
    ci = layout.clip_index(args.clip, d)
    rows = t * h
    x = torch.randn(t, h, d, device=device, dtype=torch.bfloat16)
    r = random_rotation(d, device)
    rb = r.to(torch.bfloat16)
    x3 = x.view(rows, 1, d)
    codes = torch.empty(rows, 1, d // 4, dtype=torch.uint8, device=device)
    sz = torch.empty(rows, 1, 2 * ng, dtype=sdt, device=device)
    codes2 = torch.empty_like(codes)
    sz2 = torch.empty_like(sz)
    copy_dst = torch.empty_like(x)
    deq = torch.empty(rows, d, dtype=torch.bfloat16, device=device)
    xr_buf = torch.empty(rows, d, dtype=torch.bfloat16, device=device)

    def fused(**kw):
        quantize_triton(x3, r, None, codes, sz, clip_index=ci, group_size=group, lloyd_max=False, **kw)

    def two_step():
        torch.matmul(x.view(rows, d), rb, out=xr_buf)
        quantize_triton(
            xr_buf.view(rows, 1, d), None, None, codes2, sz2, clip_index=ci, group_size=group, lloyd_max=False
        )

    def dequant():
        dequantize_triton(codes.view(rows, d // 4), sz.view(rows, 2 * ng), deq, group_size=group)

    ms = {
        "copy": timer(lambda: copy_dst.copy_(x)),
        "fused": timer(fused),
        "two_step": timer(two_step),
        "dequant": timer(dequant),
    }
    b_copy = rows * bytes_per_row("copy", d, group, s_bytes)
    b_q = rows * bytes_per_row("quantize", d, group, s_bytes)
    b_dq = rows * bytes_per_row("dequant", d, group, s_bytes)
    gbps = {
        "copy": b_copy / ms["copy"] / 1e6,
        "fused": b_q / ms["fused"] / 1e6,
        "two_step": b_q / ms["two_step"] / 1e6,
        "dequant": b_dq / ms["dequant"] / 1e6,
    }
    row = {"tokens": t, "heads": h, "head_dim": d, "group_size": group, "rows": rows}
    for k in ms:
        row[f"{k}_ms"] = ms[k]
        row[f"{k}_gbps"] = gbps[k]
        if k != "copy":
            row[f"{k}_pct_copy"] = 100.0 * gbps[k] / gbps["copy"]
    row["speedup_fused_vs_two_step"] = ms["two_step"] / ms["fused"]

    # agreement of the fused kernel with the two-step path and with the torch reference
    fused()
    two_step()
    q1, q2 = unpack_codes(codes).int(), unpack_codes(codes2).int()
    row["codes_differ_fused_vs_two_step"] = float((q1 != q2).float().mean())
    row["max_code_delta_fused_vs_two_step"] = int((q1 - q2).abs().max())
    if rows <= 65536 * 8:
        ref_codes, _ = quantize_int2(x, config=_config(args.clip, group, sdt), rotation=r, backend="torch")
        q3 = unpack_codes(ref_codes.view(rows, 1, d // 4)).int()
        row["codes_differ_fused_vs_reference"] = float((q1 != q3).float().mean())
    row.update(byte_equality(x[: min(t, 65536)], args.clip, group, sdt))

    if args.cuda_graph and device == "cuda":
        graph_timer = make_timer(device, args.quick, cuda_graph=True)
        for name, fn in (("fused", fused), ("dequant", dequant)):
            try:
                row[f"{name}_graph_ms"] = graph_timer(fn)
            except Exception as exc:  # noqa: BLE001 - report and continue
                row[f"{name}_graph_ms"] = None
                row[f"{name}_graph_error"] = repr(exc)

    if args.sweep:
        best = None
        sweep = []
        for bt, warps, stages in layout.quant_launch_candidates(d):
            cfg = {"block_rows": bt, "num_warps": warps, "num_stages": stages}
            try:
                t_ms = timer(lambda cfg=cfg: fused(**cfg))
            except Exception as exc:  # noqa: BLE001 - a config may not compile
                sweep.append({**cfg, "error": repr(exc)})
                continue
            entry = {**cfg, "ms": t_ms, "gbps": b_q / t_ms / 1e6}
            sweep.append(entry)
            if best is None or t_ms < best["ms"]:
                best = entry
        row["fused_sweep"] = sweep
        row["fused_sweep_best"] = best
    return row


def byte_equality(x, clip: float, group: int, sdt) -> dict:
    """Triton vs the PyTorch reference on the same device, byte for byte (``torch.equal``).

    Without a rotation the kernels are bit-exact by design (codes, scale/zero bits, dequantized
    values); with one, only the fp32 summation order inside ``tl.dot`` may differ, which the
    ``codes_differ_*`` fractions report instead.
    """
    import torch

    from rotationzoo.kernels import dequantize_int2, quantize_int2

    def same(a, b) -> bool:
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            view = {4: torch.int32, 2: torch.int16}[a.element_size()]
            return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
        return torch.equal(a, b)

    cfg = _config(clip, group, sdt)
    tri = quantize_int2(x, config=cfg, backend="triton")
    ref = quantize_int2(x, config=cfg, backend="torch")
    deq_t = dequantize_int2(*ref, backend="triton")
    deq_r = dequantize_int2(*ref, backend="torch")
    return {
        "bytes_checked_rows": int(x.shape[0] * x.shape[1]),
        "codes_equal_reference_no_rotation": same(tri[0], ref[0]),
        "scales_zeros_equal_reference_no_rotation": same(tri[1], ref[1]),
        "dequant_equal_reference": same(deq_t, deq_r),
    }


def print_table(result: dict) -> None:
    headers = ["T", "copy GB/s", "fused ms", "GB/s", "% copy", "2-step ms", "GB/s", "% copy", "speedup"]
    headers += ["deq ms", "GB/s", "% copy", "codes≠", "bytes=="]
    lines = []
    for r in result["rows"]:
        lines.append(
            [
                f"{r['tokens']}",
                f"{r['copy_gbps']:.0f}",
                f"{r['fused_ms']:.4f}",
                f"{r['fused_gbps']:.0f}",
                f"{r['fused_pct_copy']:.1f}",
                f"{r['two_step_ms']:.4f}",
                f"{r['two_step_gbps']:.0f}",
                f"{r['two_step_pct_copy']:.1f}",
                f"{r['speedup_fused_vs_two_step']:.2f}x",
                f"{r['dequant_ms']:.4f}",
                f"{r['dequant_gbps']:.0f}",
                f"{r['dequant_pct_copy']:.1f}",
                f"{r['codes_differ_fused_vs_two_step']:.1e}",
                "yes" if all(r.get(k) for k in _EQUAL_KEYS) else "NO",
            ]
        )
    title = (
        f"INT2 KV kernels on {result['gpu']}: H={result['config']['heads']} d={result['config']['head_dim']} "
        f"G={result['config']['group_size']} clip={result['config']['clip']} scale={result['config']['scale_dtype']}"
        + (" [DRY RUN: CPU interpreter, timings meaningless]" if result["dry_run"] else "")
    )
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(h, justify="right")
        for line in lines:
            table.add_row(*line)
        Console(width=max(160, Console().width)).print(table)
    except ImportError:  # pragma: no cover - rich is a dependency, plain text otherwise
        print(title)
        widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for line in lines:
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    for name, ok in result.get("targets_met", {}).items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.dry_run:
        device = "cpu"
        tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else [64, 130]
        args.heads = min(args.heads, 2)
        gpu = f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"
    else:
        if not torch.cuda.is_available():
            print(
                "bench_kernels: no CUDA device visible to torch; this benchmark needs an NVIDIA GPU "
                "(use --dry-run to exercise the code path on CPU)",
                file=sys.stderr,
            )
            return 2
        device = "cuda"
        if args.tokens:
            tokens = [int(v) for v in args.tokens.split(",")]
        else:
            tokens = [4096, 65536] if args.quick else [4096, 65536, 1048576]
        gpu = torch.cuda.get_device_name(0)
    try:
        import triton
    except ImportError:
        print("bench_kernels: triton is not installed (pip install 'rotationzoo[triton]')", file=sys.stderr)
        return 2

    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.scale_dtype]
    s_bytes = torch.empty(0, dtype=sdt).element_size()
    group = args.group_size or args.head_dim
    timer = make_timer(device, args.quick)
    torch.manual_seed(0)
    result = {
        "gpu": gpu,
        "device_count": torch.cuda.device_count() if device == "cuda" else 0,
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "dry_run": args.dry_run,
        "timer": "triton.testing.do_bench median" if device == "cuda" else "time.perf_counter, one call",
        "config": {
            "heads": args.heads,
            "head_dim": args.head_dim,
            "group_size": group,
            "clip": args.clip,
            "scale_dtype": args.scale_dtype,
            "input_dtype": "bf16",
            "output_dtype": "bf16",
        },
        "bytes_per_row": {
            "copy": "2 * d * 2",
            "quantize": "d * 2 + d / 4 + 2 * (d / G) * s",
            "dequant": "d / 4 + 2 * (d / G) * s + d * 2",
            "values": {
                k: bytes_per_row(k, args.head_dim, group, s_bytes) for k in ("copy", "quantize", "dequant")
            },
        },
        "rows": [],
    }
    for t in tokens:
        result["rows"].append(bench_one(t, args, device, timer, sdt, s_bytes))
        if device == "cuda":
            torch.cuda.empty_cache()

    big = [r for r in result["rows"] if r["tokens"] >= TARGETS["min_tokens"]]
    if big and not args.dry_run:
        result["targets"] = TARGETS
        result["targets_met"] = {
            f"fused >= {TARGETS['fused_pct_copy']:.0f}% of copy at >= 64K tokens": all(
                r["fused_pct_copy"] >= TARGETS["fused_pct_copy"] for r in big
            ),
            f"dequant >= {TARGETS['dequant_pct_copy']:.0f}% of copy at >= 64K tokens": all(
                r["dequant_pct_copy"] >= TARGETS["dequant_pct_copy"] for r in big
            ),
            f"fused >= {TARGETS['speedup']}x two-step at >= 64K tokens": all(
                r["speedup_fused_vs_two_step"] >= TARGETS["speedup"] for r in big
            ),
        }
    print_table(result)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
