"""Compile every INT2 kernel variant ahead of time for sm_90 / sm_80 and report its GPU resources.

Kernels: the fused quantize, the dequantize, and decode attention over the INT2 cache (its split
kernel and its merge, variants from ``tools/aot_decode.py``).

Runs on a CPU-only machine: Triton's ahead-of-time API (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", 90, 32))``) lowers each kernel to PTX and a cubin with the ``ptxas`` Triton
bundles; no driver or GPU is touched. Usage::

    python tools/aot_report.py                          # every variant, sm_90 and sm_80
    python tools/aot_report.py --quick --jobs 2         # a representative subset
    python tools/aot_report.py --targets 90 --head-dims 128 --json-out bench-out/aot.json
    python tools/aot_report.py --records bench-out/aot.jsonl    # resumable: rerun to continue
    python tools/aot_report.py --records bench-out/aot.jsonl --report-only   # what it has so far

Each variant is specialized exactly as a real launch would be: the launch arguments come from
``rotationzoo.kernels.triton_int2.quant_launch`` / ``dequant_launch`` (compiled mode, CPU tensors of a
4096-token x 8-head cache standing in for the GPU ones) and go through Triton's own argument binder,
so strides equal to 1 become constants and 16-byte alignment hints match. Per variant it records
whether it compiled (and the error), registers per thread, local/stack bytes and spill instructions
(``cuobjdump --dump-resource-usage`` and the SASS), static + dynamic shared memory, tensor-core
instructions of the fused rotation (``HGMMA`` = wgmma on sm_90, ``HMMA`` = mma.sync on sm_80),
resident warps per SM from registers and shared memory, and the bytes moved per row.

Exit status: 0 when every variant compiled and no default launch spills (sweep candidates may; they
are counted apart), 1 otherwise, 2 when triton is missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aot_decode  # noqa: E402

from rotationzoo.kernels import layout  # noqa: E402

TOKENS, HEADS = 4096, 8
"""Shape the launch arguments are built for (only their strides, alignment and sizes matter)."""

CLIP_RATIOS = {"none": 0.0, "top": 0.96, "bottom": 0.03, "radix": 0.5, "bisect": 0.96}
"""A clip ratio that selects each clip mode at every head_dim (checked against ``layout.clip_plan``):
the exact searches (max-and-mask, min-and-mask, 31-pass bit-pattern bisection) and the decode
flush's ``log2(d)``-pass bisection (``clip_search="bisect"``)."""

CLIP_SEARCH = {"bisect": "bisect"}
"""``clip_search`` of each clip mode (``"exact"`` unless listed)."""

SCALE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OUT_DTYPES = ("bf16", "fp16", "fp32")

_SM_COMMON = dict(regs_per_sm=65536, max_regs_per_thread=255, reg_alloc_unit_per_warp=256, max_warps_per_sm=64,
                  max_blocks_per_sm=32, smem_reserved_per_block=1024, smem_alloc_unit=128)
SM_LIMITS = {
    90: dict(_SM_COMMON, name="sm_90 (H100 / H200)", sms=132, smem_per_sm=228 * 1024, max_smem_per_block=227 * 1024),
    80: dict(_SM_COMMON, name="sm_80 (A100)", sms=108, smem_per_sm=164 * 1024, max_smem_per_block=163 * 1024),
}
"""Per-SM limits of the residency estimate (CUDA programming guide, compute capability tables):
registers are allocated per warp in units of 256 (8 per thread), shared memory in 128-byte units
with 1 KB per block reserved by the system."""

H200 = dict(copy_bandwidth_tb_s=4.3, dram_latency_ns=700.0, sms=132, clock_ghz=1.98, warp_instructions_per_clock_per_sm=4)
"""Figures for the sm_90 bandwidth estimates: the H200's device copy bandwidth (measured elsewhere),
a stated DRAM latency under load of ~600-800 ns (the midpoint), SM count, boost clock and issue rate
(4 schedulers x 1 warp instruction per clock)."""


# --- variants -----------------------------------------------------------------------------------


def quant_variants(head_dims, quick: bool) -> list[dict]:
    """The quantize variants the library can launch, with the heuristic block size and warps."""
    out = []
    for d in head_dims:
        for g in layout.allowed_group_sizes(d):
            for rotate in (True, False):
                for clip in CLIP_RATIOS:
                    for lm in (False, True) if g == d else (False,):
                        for loc in (True, False):
                            for sdt in SCALE_BYTES:
                                out.append(dict(kind="quantize", d=d, group=g, rotate=rotate, clip=clip,
                                                lloyd_max=lm, has_loc=loc, scale=sdt, source="heuristic"))
    if quick:
        out = [v for v in out if _representative(v)]
    return out


def _representative(v: dict) -> bool:
    d, g = v["d"], v["group"]
    goal = v["rotate"] and v["clip"] == "top" and g == d and not v["lloyd_max"] and v["scale"] == "fp32"
    grouped = not v["rotate"] and v["clip"] == "radix" and g == layout.MIN_GROUP_SIZE and v["scale"] == "bf16"
    lloyd = v["lloyd_max"] and v["rotate"] and v["clip"] == "bottom" and v["scale"] == "fp16"
    ablation = g == d and not v["lloyd_max"] and v["scale"] == "fp32" and v["has_loc"] and d == 128
    flush = v["rotate"] and v["clip"] == "bisect" and g == d and not v["lloyd_max"] and v["scale"] == "fp32"
    return (goal or lloyd or flush) and v["has_loc"] or (grouped and not v["has_loc"]) or ablation


def dequant_variants(head_dims, quick: bool) -> list[dict]:
    """The dequantize variants: head_dim x group size x scale dtype x output dtype."""
    out = []
    for d in head_dims:
        groups = layout.allowed_group_sizes(d)
        for g in groups:
            for sdt in SCALE_BYTES:
                for odt in OUT_DTYPES:
                    if quick and not ((g, sdt, odt) in ((d, "fp32", "bf16"), (groups[-1], "bf16", "fp32"))):
                        continue
                    out.append(dict(kind="dequantize", d=d, group=g, scale=sdt, out=odt, source="heuristic"))
    return out


def sweep_variants(head_dims, quick: bool) -> list[dict]:
    """Launch candidates (``bench_kernels.py --sweep``) on the serving case: clip 0.96, G = d, fp32
    scale; with a rotation (and, unless ``quick``, without one and without the paged store)."""
    out = []
    for d in head_dims:
        for rotate in (True, False) if not quick else (True,):
            for loc in (True, False) if not quick else (True,):
                for bt, warps, stages in layout.quant_launch_candidates(d):
                    out.append(dict(kind="quantize", d=d, group=d, rotate=rotate, clip="top", lloyd_max=False,
                                    has_loc=loc, scale="fp32", source="sweep", block_rows=bt, num_warps=warps,
                                    num_stages=stages))
    return out


def all_variants(targets, head_dims, quick: bool) -> list[dict]:
    base = quant_variants(head_dims, quick) + dequant_variants(head_dims, quick) + sweep_variants(head_dims, quick)
    base += (aot_decode.decode_variants(head_dims, quick) + aot_decode.merge_variants(head_dims, quick)
             + aot_decode.decode_sweep_variants(head_dims, quick))
    return [dict(v, target=t) for t in targets for v in base]


# --- one compile (runs in a worker process) ------------------------------------------------------


def _tensors(v: dict):
    """CPU stand-ins for the launch arguments of variant ``v`` (compiled-mode layout)."""
    import torch

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    d, ng = v["d"], v["d"] // v["group"]
    if v["kind"] == "dequantize":
        n = TOKENS * HEADS
        codes = torch.empty(n, d // 4, dtype=torch.uint8)
        sz = torch.empty(n, 2 * ng, dtype=dt[v["scale"]])
        return codes, sz, torch.empty(n, d, dtype=dt[v["out"]])
    rot = torch.eye(d) if v["rotate"] else None
    if v["has_loc"]:  # quantize_int2_into: [T, H, d] into [slots, H, ...] pages
        slots = 2 * TOKENS
        x = torch.empty(TOKENS, HEADS, d, dtype=torch.bfloat16)
        loc = torch.empty(TOKENS, dtype=torch.int64)
        codes = torch.empty(slots, HEADS, d // 4, dtype=torch.uint8)
        sz = torch.empty(slots, HEADS, 2 * ng, dtype=dt[v["scale"]])
    else:  # quantize_int2 with a shared rotation: rows flattened to [T * H, 1, d]
        x = torch.empty(TOKENS * HEADS, 1, d, dtype=torch.bfloat16)
        loc = None
        codes = torch.empty(TOKENS * HEADS, 1, d // 4, dtype=torch.uint8)
        sz = torch.empty(TOKENS * HEADS, 1, 2 * ng, dtype=dt[v["scale"]])
    return x, rot, loc, codes, sz


def _launch(v: dict):
    from rotationzoo.kernels import triton_int2 as ti

    if v["kind"].startswith("decode"):
        return aot_decode.launch(v)

    sms = SM_LIMITS.get(v["target"], SM_LIMITS[90])["sms"]
    over = {k: v[k] for k in ("block_rows", "num_warps") if k in v}
    if v["kind"] == "dequantize":
        codes, sz, out = _tensors(v)
        return ti.aot_kernels().dequant, ti.dequant_launch(
            codes, sz, out, group_size=v["group"], interpret=False, num_sms=sms, capability=v["target"], **over
        )
    x, rot, loc, codes, sz = _tensors(v)
    ci = layout.clip_index(CLIP_RATIOS[v["clip"]], v["d"])
    search = CLIP_SEARCH.get(v["clip"], "exact")
    assert layout.clip_plan(ci, v["d"], search=search)[0] == v["clip"], (v, ci)
    launch = ti.quant_launch(
        x, rot, loc, codes, sz, clip_index=ci, group_size=v["group"], lloyd_max=v["lloyd_max"], clip_search=search,
        interpret=False, num_sms=sms, num_stages=v.get("num_stages"), capability=v["target"], **over,
    )  # fmt: skip
    return ti.aot_kernels().quant, launch


def compile_launch(fn, launch, target_cap: int):
    """``triton.compile`` of ``fn`` specialized for ``launch``'s arguments, for ``sm_<target_cap>``.

    Mirrors ``JITFunction.run``: Triton's binder specializes the arguments, ``_pack_args`` splits
    them into signature / constexprs / attributes, then the ASTSource is compiled for the target.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", target_cap, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def _cuobjdump() -> str:
    try:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001 - older layouts: the bundled binary
        import triton

        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def read_resources(cubin: bytes) -> dict:
    """Registers, stack/local bytes and static shared memory (``cuobjdump --dump-resource-usage``),
    plus spill (``LDL``/``STL``) and tensor-core instruction counts from the SASS."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        tool = _cuobjdump()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage.stdout))
    ins = [(int(a, 16), op, rest) for a, op, rest in _SASS.findall(sass) if op != "NOP"]

    def count(*names: str) -> int:
        return sum(1 for _, op, _ in ins if op in names)

    loop = _tile_loop(ins)
    return {
        "regs": int(fields.get("REG", -1)),
        "stack_bytes": int(fields.get("STACK", 0)),
        "local_bytes": int(fields.get("LOCAL", 0)),
        "static_smem": int(fields.get("SHARED", 0)),
        "spill_instructions": count("LDL", "STL"),
        "sass_instructions": len(ins),
        "loop_instructions": sum(1 for a, _, _ in ins if loop[0] <= a <= loop[1]) if loop else None,
        "hgmma": count("HGMMA"),
        "hmma": count("HMMA"),
        "ldgsts": count("LDGSTS"),
    }


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[A-Z0-9_.]*([^;]*);")


def _tile_loop(ins: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """Address range of the persistent tile loop: the widest backward branch (static_range loops are
    unrolled, so the tile loop is the only long one)."""
    spans = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            spans.append((int(target.group(1), 16), addr))
    return max(spans, key=lambda s: s[1] - s[0]) if spans else None


def residency(regs: int, warps: int, smem: int, lim: dict) -> dict:
    """Resident blocks and warps per SM from registers, shared memory and the warp/block limits."""
    per_warp = math.ceil(max(regs, 1) * 32 / lim["reg_alloc_unit_per_warp"]) * lim["reg_alloc_unit_per_warp"]
    by = {
        "registers": (lim["regs_per_sm"] // per_warp) // warps,
        "warps": lim["max_warps_per_sm"] // warps,
        "blocks": lim["max_blocks_per_sm"],
    }
    smem_block = math.ceil((smem + lim["smem_reserved_per_block"]) / lim["smem_alloc_unit"]) * lim["smem_alloc_unit"]
    by["shared_memory"] = lim["smem_per_sm"] // smem_block if smem <= lim["max_smem_per_block"] else 0
    blocks = min(by.values())
    limiter = min(by, key=lambda k: (by[k], k != "registers"))
    return {"blocks": blocks, "warps": blocks * warps, "limited_by": limiter, "smem_per_block": smem_block}


def bytes_per_row(v: dict) -> float:
    """docs/performance.md: quantize ``2d + d/4 + 2(d/G)s``; dequantize ``d/4 + 2(d/G)s + out d``."""
    if v["kind"].startswith("decode"):
        return aot_decode.bytes_per_row(v)
    d, meta = v["d"], 2 * (v["d"] // v["group"]) * SCALE_BYTES[v["scale"]]
    if v["kind"] == "quantize":
        return 2 * d + d / 4 + meta
    return d / 4 + meta + d * SCALE_BYTES.get(v["out"], 2)


def tile_load_bytes(v: dict, block_rows: int) -> int:
    """Bytes one program requests from DRAM per tile (the loads of one loop iteration)."""
    d = v["d"]
    if v["kind"].startswith("decode"):
        return aot_decode.tile_load_bytes(v, block_rows)
    if v["kind"] == "quantize":
        return block_rows * (2 * d + (8 if v["has_loc"] else 0))
    return block_rows * (d // 4 + 2 * (d // v["group"]) * SCALE_BYTES[v["scale"]])


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (ptxas, cuobjdump): load-independent."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _error_line(exc: BaseException) -> str:
    """``Type: first line ... reason`` (Triton puts the source excerpt between the two)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("Repro command")]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}" if lines else ""
    return f"{type(exc).__name__}: {text}"[:500]


def compile_variant(v: dict) -> dict:
    """Compile one variant and measure it; never raises (errors are recorded)."""
    rec = dict(v, ok=False, bytes_per_row=bytes_per_row(v))
    t0, c0 = time.perf_counter(), _cpu_seconds()
    try:
        fn, launch = _launch(v)
        kw = launch.kwargs
        rec.update(block_rows=kw.get("BT") or kw.get("BN") or kw.get("MP"), num_warps=kw["num_warps"],
                   num_stages=kw["num_stages"])
        ck = compile_launch(fn, launch, v["target"])
        res = read_resources(ck.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - one failing variant must not stop the report
        rec["error"], rec["error_detail"] = _error_line(exc), str(exc)[-3000:]
        rec.update(compile_s=round(time.perf_counter() - t0, 3), cpu_s=round(_cpu_seconds() - c0, 3))
        return rec
    rec.update(compile_s=round(time.perf_counter() - t0, 3), cpu_s=round(_cpu_seconds() - c0, 3))
    lim = SM_LIMITS.get(v["target"], SM_LIMITS[90])
    smem = res["static_smem"] + int(ck.metadata.shared)
    spills = res["stack_bytes"] + res["local_bytes"] > 0 or res["spill_instructions"] > 0
    rec.update(res, ok=True, dynamic_smem=int(ck.metadata.shared), smem_bytes=smem, spills=spills)
    rec["tensor_core_instructions"] = res["hgmma"] + res["hmma"]
    rec["tensor_core"] = "wgmma" if res["hgmma"] else "mma.sync" if res["hmma"] else None
    rec["tensor_core_ok"] = bool(res["hgmma"] + res["hmma"]) if v.get("rotate") else None
    rec["occupancy"] = residency(res["regs"], rec["num_warps"], smem, lim)
    rec["tile_load_bytes"] = tile_load_bytes(v, rec["block_rows"])
    if v["target"] == 90 and v["kind"] != "decode_merge":
        rec["h200_estimate"] = bandwidth_estimate(rec)
    return rec


# --- the report ---------------------------------------------------------------------------------


def goal_variant(d: int, target: int) -> dict:
    """The serving case the bandwidth goal is about: rotate, clip 0.96, G = d, fp32 scale, paged store."""
    return dict(kind="quantize", d=d, group=d, rotate=True, clip="top", lloyd_max=False, has_loc=True,
                scale="fp32", source="heuristic", target=target)


def bandwidth_estimate(rec: dict, machine: dict = H200) -> dict:
    """Two upper bounds on a compiled variant's speed, as % of the copy bandwidth (sm_90 / H200).

    Little's law: sustaining ``bandwidth`` needs ``bandwidth x latency`` bytes of loads in flight.
    Each resident program has one tile of loads outstanding; with ``num_stages >= 2`` and the loads
    turned into asynchronous copies (``LDGSTS``) the next ``stages - 1`` tiles are fetched while the
    current one is processed, otherwise the program's loads and its arithmetic alternate (so the
    bound is optimistic). Stores are not waited on and not counted.

    Issue rate: the tile loop's SASS instructions x warps / rows per tile is the warp instructions
    per row; at one warp instruction per scheduler per clock (optimistic: shuffles, conversions and
    divisions issue slower) this is the least time per row.
    """
    need_total = machine["copy_bandwidth_tb_s"] * 1e12 * machine["dram_latency_ns"] * 1e-9
    need_sm = need_total / machine["sms"]
    pipelined = rec.get("num_stages", 1) >= 2 and rec.get("ldgsts", 0) > 0
    per_program = rec["tile_load_bytes"] * (rec["num_stages"] - 1 if pipelined else 1)
    have_sm = rec["occupancy"]["blocks"] * per_program
    out = {
        "needed_total_bytes": round(need_total),
        "needed_per_sm_bytes": round(need_sm),
        "loads_overlap_compute": pipelined,
        "outstanding_per_program_bytes": per_program,
        "resident_programs_per_sm": rec["occupancy"]["blocks"],
        "outstanding_per_sm_bytes": have_sm,
        "little_bound_pct_of_copy": round(min(1.0, have_sm / need_sm) * 100, 1),
    }
    if rec.get("loop_instructions"):
        per_row = rec["loop_instructions"] * rec["num_warps"] / rec["block_rows"]
        rate = machine["sms"] * machine["warp_instructions_per_clock_per_sm"] * machine["clock_ghz"] * 1e9
        t_issue = per_row / rate
        t_mem = rec["bytes_per_row"] / (machine["copy_bandwidth_tb_s"] * 1e12)
        out["warp_instructions_per_row"] = round(per_row, 1)
        out["issue_bound_pct_of_copy"] = round(min(1.0, t_mem / t_issue) * 100, 1)
    out["bound_pct_of_copy"] = min(out["little_bound_pct_of_copy"], out.get("issue_bound_pct_of_copy", 100.0))
    return out


def _key(rec: dict) -> tuple:
    fields = ["kind", "d", "group", "rotate", "clip", "lloyd_max", "has_loc", "scale", "out", "hp", "gq", "s", "mask",
              "source", "target"]
    if rec["source"] != "heuristic":  # heuristic records gain their launch fields when compiled
        fields += ["block_rows", "num_warps", "num_stages"]
    return tuple(rec.get(k) for k in fields)


def run(variants: list[dict], jobs: int, progress=None) -> list[dict]:
    """Compile ``variants`` (``jobs`` worker processes; 1 = in this process), in input order.
    ``progress(record)`` is called as each one finishes."""
    if jobs <= 1:
        out = []
        for v in variants:
            out.append(compile_variant(v))
            if progress:
                progress(out[-1])
        return out
    ctx = multiprocessing.get_context("spawn")  # no inherited CUDA or interpreter state
    results: dict[int, dict] = {}
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(compile_variant, v): i for i, v in enumerate(variants)}
        for f in cf.as_completed(futures):
            i = futures[f]
            try:
                results[i] = f.result()
            except Exception as exc:  # noqa: BLE001 - a crashed worker (compile_variant itself never raises)
                results[i] = dict(variants[i], ok=False, error=f"worker failed: {exc!r}"[:500], compile_s=0.0)
            if progress:
                progress(results[i])
    return [results[i] for i in range(len(variants))]


def load_records(path: Path | None) -> dict[tuple, dict]:
    """Records a previous (possibly interrupted) run appended to ``path``, by variant key."""
    if path is None or not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short when that run was stopped
            continue
        out[_key(rec)] = rec
    return out


def _min_median(values: list) -> list | None:
    return [min(values), statistics.median(values)] if values else None


def summarize(records: list[dict]) -> dict:
    """Per (target, family, source): counts, failures, spills, registers, smem, tensor cores, residency."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(f"sm_{r['target']} {r['kind']} {r['source']}", []).append(r)
    out = {}
    for name, recs in sorted(groups.items()):
        ok = [r for r in recs if r["ok"]]
        rot = [r for r in ok if r.get("rotate")]
        regs = [r["regs"] for r in ok]
        warps = [r["occupancy"]["warps"] for r in ok]
        out[name] = {
            "variants": len(recs),
            "compiled": len(ok),
            "failed": len(recs) - len(ok),
            "spilling": sum(1 for r in ok if r["spills"]),
            "regs_min_median_max": [min(regs), statistics.median(regs), max(regs)] if regs else None,
            "smem_max_bytes": max((r["smem_bytes"] for r in ok), default=None),
            "rotating_with_tensor_cores": f"{sum(1 for r in rot if r['tensor_core_ok'])}/{len(rot)}",
            "rotating_with_wgmma": sum(1 for r in rot if r["tensor_core"] == "wgmma"),
            "resident_warps_min_median": [min(warps), statistics.median(warps)] if warps else None,
            "h200_issue_bound_pct_min_median": _min_median(
                [r["h200_estimate"]["issue_bound_pct_of_copy"] for r in ok
                 if "issue_bound_pct_of_copy" in r.get("h200_estimate", {})]),
            "compile_s_total": round(sum(r["compile_s"] for r in recs), 1),
            "cpu_s_total": round(sum(r.get("cpu_s", 0.0) for r in recs), 1),
        }
    return out


def show(title: str, headers: tuple, rows: list[list[str]]) -> None:
    """A rich table, or plain columns where rich is not installed (a bare GPU machine)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        print(title)
        for line in (list(headers), *rows):
            print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
        return
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=max(150, Console().width)).print(table)


def _mm(values, fmt="{:g}") -> str:
    return "/".join(fmt.format(x) for x in values) if values else "-"


def print_report(result: dict) -> None:
    ptxas = ", ".join(f"{k}: {v}" for k, v in result["ptxas"].items())
    rows = [[name, str(s["variants"]), str(s["compiled"]), str(s["failed"]), str(s["spilling"]),
             _mm(s["regs_min_median_max"]), str(s["smem_max_bytes"]),
             f"{s['rotating_with_tensor_cores']} ({s['rotating_with_wgmma']})", _mm(s["resident_warps_min_median"]),
             _mm(s["h200_issue_bound_pct_min_median"], "{:.0f}"), f"{s['cpu_s_total']:.0f}"]
            for name, s in result["summary"].items()]
    show(f"INT2 kernels compiled ahead of time (Triton {result['triton']}, ptxas {ptxas})",
         ("target / family / launch", "variants", "ok", "failed", "spilling", "regs min/med/max", "smem max",
          "rotate: TC (wgmma)", "resident warps min/med", "H200 issue % min/med", "CPU s"), rows)
    show("Serving case: rotate, clip 0.96, G = d, fp32 scale, paged store (heuristic launch)", _LAUNCH_COLUMNS,
         _launch_rows(result["goal"]))
    sweep = [r for r in result["records"] if r["source"] == "sweep" and r["kind"] == "quantize" and r["has_loc"]]
    if sweep:
        show("Launch candidates (bench_kernels.py --sweep): clip 0.96, G = d, fp32, paged store", _LAUNCH_COLUMNS,
             _launch_rows(sweep))
    budget = sorted((r for r in result["records"] if _is_budget(r)),
                    key=lambda r: (r["d"], r["lloyd_max"], r["rotate"], list(CLIP_RATIOS).index(r["clip"])))
    if budget:
        rows = [[str(r["d"]), "yes" if r["rotate"] else "no", r["clip"], "yes" if r["lloyd_max"] else "no",
                 f"{r['block_rows']} x {r['num_warps']} x {r['num_stages']}", str(r["loop_instructions"]),
                 str(r["h200_estimate"].get("warp_instructions_per_row", "-")),
                 str(r["h200_estimate"].get("issue_bound_pct_of_copy", "-"))] for r in budget]
        show("Where the instructions go: heuristic launch, G = d, fp32 scale, paged store, sm_90",
             ("d", "rotate", "clip", "Lloyd-Max", "rows x warps x stages", "loop SASS instr", "warp instr / row",
              "H200 issue bound % copy"), rows)
    decode = sorted((r for r in result["records"] if r["kind"].startswith("decode")),
                    key=lambda r: (r["target"], r["kind"], r["source"], r["d"], r.get("group") or 0))
    if decode:
        show("Decode attention (split-K over the INT2 cache, then the log-sum-exp merge)", aot_decode.TABLE_COLUMNS,
             aot_decode.table_rows([r for r in decode if r["source"] == "heuristic"][:60]))
        sweep_d = [r for r in decode if r["source"] == "sweep"]
        if sweep_d:
            show("Decode split-kernel launch candidates (serving case: G = d, fp32 scale, BF16 windows, 4 query rows)",
                 aot_decode.TABLE_COLUMNS, aot_decode.table_rows(sweep_d))
    bad = [r for r in result["records"] if not r["ok"] or r.get("spills")]
    if bad:
        rows = [[variant_name(r), r.get("error") or (f"spills: stack {r['stack_bytes']} B, local {r['local_bytes']} B, "
                                                     f"{r['spill_instructions']} LDL/STL")] for r in bad[:80]]
        show(f"Failures and spills ({len(bad)}{', first 80' if len(bad) > 80 else ''})", ("variant", "problem"), rows)
    verdict = result["verdict"]
    print(f"compile failures: {verdict['failures']}, spilling default launches: {verdict['spilling']} "
          f"(sweep candidates: {verdict.get('sweep_candidates_spilling', 0)}), "
          f"rotating variants without tensor cores: {verdict['rotate_without_tensor_cores']} -> "
          f"{'OK' if verdict['ok'] else 'NOT OK'}   ({result['wall_s']:.0f} s wall, {result['jobs']} jobs, "
          f"{result.get('cpu_s', 0):.0f} CPU s)")


_LAUNCH_COLUMNS = ("target", "d", "rotate", "rows x warps x stages", "regs", "spill", "smem KiB", "tensor cores",
                   "resident warps", "H200: in flight / SM KiB", "Little %", "warp instr / row", "issue %")


def _launch_rows(records: list[dict]) -> list[list[str]]:
    rows = []
    for r in records:
        head = [f"sm_{r['target']}", str(r["d"]), "yes" if r["rotate"] else "no",
                f"{r.get('block_rows')} x {r.get('num_warps')} x {r.get('num_stages')}"]
        if not r["ok"]:
            rows.append(head + ["FAILED"] + ["-"] * (len(_LAUNCH_COLUMNS) - 5))
            continue
        e = r.get("h200_estimate")
        est = ["-"] * 4
        if e:
            est = [f"{e['outstanding_per_sm_bytes'] / 1024:.1f} / {e['needed_per_sm_bytes'] / 1024:.1f}"
                   + (" async" if e["loads_overlap_compute"] else ""),
                   f"{e['little_bound_pct_of_copy']:.0f}", str(e.get("warp_instructions_per_row", "-")),
                   str(e.get("issue_bound_pct_of_copy", "-"))]
        occ = r["occupancy"]
        rows.append(head + [str(r["regs"]), "yes" if r["spills"] else "no", f"{r['smem_bytes'] / 1024:.1f}",
                            f"{r['tensor_core_instructions']} {r['tensor_core'] or ''}".strip(),
                            f"{occ['warps']} ({occ['limited_by'].replace('_', ' ')})", *est])
    return rows


def _is_budget(r: dict) -> bool:
    return (r["ok"] and r["target"] == 90 and r["kind"] == "quantize" and r["source"] == "heuristic"
            and r["group"] == r["d"] and r["scale"] == "fp32" and r["has_loc"] and "h200_estimate" in r)


def variant_name(r: dict) -> str:
    if r["kind"].startswith("decode"):
        base = aot_decode.name(r)
    elif r["kind"] == "dequantize":
        base = f"dequant d={r['d']} G={r['group']} scale={r['scale']} out={r['out']}"
    else:
        base = (f"quant d={r['d']} G={r['group']} rotate={int(r['rotate'])} clip={r['clip']} lm={int(r['lloyd_max'])} "
                f"loc={int(r['has_loc'])} scale={r['scale']}")
    launch = f" [{r.get('block_rows')}x{r.get('num_warps')}x{r.get('num_stages')}]" if "block_rows" in r else ""
    return f"sm_{r['target']} {base}{launch}"


def _verdict(records: list[dict]) -> dict:
    """Compile failures (any launch), spilling default launches and rotating variants without tensor
    cores; ``ok`` if none. Sweep candidates that spill are counted apart: they are why the launch
    tables do not pick them."""
    ok = [r for r in records if r["ok"]]
    verdict = {
        "failures": len(records) - len(ok),
        "spilling": sum(1 for r in ok if r["spills"] and r["source"] != "sweep"),
        "rotate_without_tensor_cores": sum(1 for r in ok if r.get("rotate") and not r["tensor_core_ok"]),
    }
    verdict["ok"] = not any(verdict.values())
    verdict["sweep_candidates_spilling"] = sum(1 for r in ok if r["spills"] and r["source"] == "sweep")
    return verdict


def _ptxas_versions(targets: list[int]) -> dict:
    """The release of the ptxas Triton uses for each target (informative; ``?`` if unknown)."""
    out = {}
    for t in targets:
        try:
            from triton.backends.nvidia.compiler import get_ptxas_version

            found = re.search(r"release ([\d.]+)", get_ptxas_version(t))
            out[f"sm_{t}"] = found.group(1) if found else "?"
        except Exception:  # noqa: BLE001 - informative only
            out[f"sm_{t}"] = "?"
    return out


def select_variants(args: argparse.Namespace, targets: list[int], head_dims: list[int]) -> tuple[list, list]:
    """The variants the options ask for, and the serving-case goal variants (added if missing)."""
    variants = all_variants(targets, head_dims, args.quick)
    if args.no_sweep:
        variants = [v for v in variants if v["source"] != "sweep"]
    goals = [goal_variant(d, t) for t in targets for d in head_dims]
    keys = {_key(v) for v in variants}
    variants += [g for g in goals if _key(g) not in keys]
    if args.limit:
        variants = variants[: args.limit]
    return variants, goals


def compile_todo(todo: list[dict], jobs: int, records: Path | None) -> list[dict]:
    """:func:`run` with progress lines, appending each record to ``records`` (JSON lines) if given."""
    t0 = time.perf_counter()
    done = [0]
    sink = records.open("a") if records else None

    def progress(rec: dict) -> None:
        done[0] += 1
        if sink:
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
        if done[0] % 50 == 0 or done[0] == len(todo):
            print(f"  {done[0]}/{len(todo)} ({time.perf_counter() - t0:.0f} s)", flush=True)

    try:
        return run(todo, jobs, progress)
    finally:
        if sink:
            sink.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="90,80", help="compute capabilities, comma-separated (default 90,80)")
    p.add_argument("--head-dims", default=",".join(map(str, layout.HEAD_DIMS)), help="default 64,128,256")
    p.add_argument("--quick", action="store_true", help="a representative subset (minutes instead of an hour)")
    p.add_argument("--no-sweep", action="store_true", help="skip the launch candidates")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes (default 2)")
    p.add_argument("--json-out", type=Path, default=None, help="write the records and summary as JSON here")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="Triton cache to use (default: a fresh temporary one, so every variant really compiles)")
    p.add_argument("--limit", type=int, default=None, help="compile only the first N variants (debugging)")
    p.add_argument("--records", type=Path, default=None,
                   help="append each compiled variant to this JSON-lines file; variants already in it are not "
                   "compiled again (resume an interrupted run)")
    p.add_argument("--report-only", action="store_true",
                   help="compile nothing: report the variants already in --records (a partial run so far)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # AOT compiles; nothing is interpreted or launched
    tmp = None
    if args.cache_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="rotationzoo-aot-")
        os.environ["TRITON_CACHE_DIR"] = tmp.name
    else:
        os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir)
    try:
        import torch
        import triton
    except ImportError as exc:
        print(f"aot_report: {exc.name} is not installed (pip install 'rotationzoo[triton]')", file=sys.stderr)
        return 2
    targets = [int(t) for t in args.targets.split(",") if t.strip()]
    head_dims = [int(d) for d in args.head_dims.split(",") if d.strip()]
    variants, goals = select_variants(args, targets, head_dims)
    earlier = load_records(args.records)
    if args.report_only:  # what an interrupted run has compiled so far
        variants = [v for v in variants if _key(v) in earlier]
    todo = [v for v in variants if _key(v) not in earlier]
    print(f"aot_report: {len(variants)} variants for {', '.join(f'sm_{t}' for t in targets)}: compiling "
          f"{len(todo)} with {args.jobs} job(s), {len(variants) - len(todo)} from {args.records}", flush=True)
    t0 = time.perf_counter()
    fresh = {_key(r): r for r in compile_todo(todo, args.jobs, args.records)}
    records = [fresh.get(_key(v)) or earlier[_key(v)] for v in variants]
    wall = time.perf_counter() - t0
    by_key = {_key(r): r for r in records}
    goal_recs = []
    for g in goals:
        goal_recs.append(dict(by_key.get(_key(g)) or {**g, "ok": False, "error": "not compiled (--limit or --report-only)"}))
    verdict = _verdict(records)
    result = {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "ptxas": _ptxas_versions(targets),
        "targets": [f"sm_{t}" for t in targets],
        "head_dims": head_dims,
        "quick": args.quick,
        "jobs": args.jobs,
        "wall_s": round(wall, 1),
        "reused_from_records": len(variants) - len(todo),
        "report_only": args.report_only,
        "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in records), 1),
        "launch_shape": {"tokens": TOKENS, "heads": HEADS, "input_dtype": "bf16", "loc_dtype": "int64"},
        "clip_ratios": CLIP_RATIOS,
        "sm_limits": {f"sm_{k}": v for k, v in SM_LIMITS.items() if k in targets},
        "h200": H200,
        "resources_from": "cuobjdump --dump-resource-usage (REG, STACK, LOCAL, SHARED) and cuobjdump -sass "
        "(LDL/STL spill instructions, HGMMA/HMMA); dynamic shared memory from the compiled metadata",
        "bytes_per_row": {"quantize": "2d + d/4 + 2 (d/G) s", "dequantize": "d/4 + 2 (d/G) s + d o"},
        "verdict": verdict,
        "summary": summarize(records),
        "goal": goal_recs,
        "records": records,
    }
    print_report(result)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    if tmp is not None:
        tmp.cleanup()
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
