"""Experiment: a K clip per (layer, KV head), chosen on calibration activations, as the authors' tree serves it.

The authors' SGLang tree reads ``SGLANG_OSCAR_K_CLIP_PER_HEAD`` (JSON ``{"<layer>,<kv head>": ratio}``) beside the
one ``SGLANG_OSCAR_K_CLIP_RATIO``; rotationzoo prints such tables in launch lines (``serve-args --k-clip-per-head``).
This script asks whether choosing that table on calibration text lowers the served KL.

``fit``: for each (layer, KV head) of a captured dump (``rotationzoo calibrate --dump-out``), the K
clip (kernel index ``int(r*d)``, ``r`` from a grid) that minimises the head's served attention-output error
``sum ||o - o_fp||^2 / sum ||o_fp||^2`` over drawn queries (the query heads that read the KV head; keys in the sink and the
recent window exact, older keys and values in the format; V at the format's clip), in the method's rotated basis as
the evaluation stores it. Writes the table (and beside it ``*.layers.json``, the best clip per layer) and prints
the proxy at every uniform clip too::

    python tools/exp_clip_table.py fit --dump bench-out/dump8k_g64 --method hadamard \\
        --format int2-g64-bf16-c0.92/0.92 --out bench-out/cliptab_hadamard.json

``frontier``: ``tools/bench_frontier.py`` with ``CLIP_TABLES=method=table.json,...`` applied to the K rows of those
methods (the simulation re-quantizes each KV head's keys at its own clip; everything else as the tool runs it).
A method name may be a ``--rotation`` name or ``hadamard``::

    CLIP_TABLES=default=bench-out/cliptab_default.json python tools/exp_clip_table.py frontier [bench_frontier options]

Measured (docs/real-model.md, "Nor does a K clip per KV head"): level or worse for the learned default on the
held-out texts; for Hadamard about what a heavier uniform clip gives. Not built into the library.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _methods(name: str):
    from rotationzoo.evaluate.methods import MethodSpec
    if name in ("hadamard", "none"):
        return getattr(MethodSpec, name)()
    return MethodSpec.from_source(name, name)


def _shape(dump, layer_ids):
    from rotationzoo.integrations.transformers import ModelShape
    q = dump.load(layer_ids[0], "q", 0)
    k = dump.load(layer_ids[0], "k", 0)
    return ModelShape(layer_ids=tuple(layer_ids), head_dim=int(k.shape[-1]), num_kv_heads=int(k.shape[1]),
                      num_q_heads=int(q.shape[1]), context_length=None)


def head_errors(oscar, dump, lid, chunks, queries, ratios, prefix, recent, seed=0):
    """``[len(ratios), H_kv]``: served attention-output error per K clip ratio and KV head (sums over chunks)."""
    from rotationzoo.integrations.transformers.oscar import fake_quantize
    tr = oscar.layer(lid)
    num = den = None
    for c in chunks:
        q = dump.load(lid, "q", c).float().permute(1, 0, 2)[None]  # [1, Hq, T, d]
        k = dump.load(lid, "k", c).float().permute(1, 0, 2)[None]
        v = dump.load(lid, "v", c).float().permute(1, 0, 2)[None]
        t_len = k.shape[2]
        hkv, hq, d = k.shape[1], q.shape[1], k.shape[-1]
        g = hq // hkv
        lo = prefix + recent + 1
        if t_len <= lo + 16:
            continue
        gen = torch.Generator().manual_seed(seed * 1000 + lid * 10 + c)
        pos = torch.sort(torch.randint(lo, t_len, (queries,), generator=gen)).values
        kr = tr.keys(k, oscar.hp_dtype).float()
        vr = tr.values(v, oscar.hp_dtype).float()
        qr = tr.queries(q, torch.float32)[:, :, pos]  # [1, Hq, m, d]
        scale = d ** -0.5
        cols = torch.arange(t_len)
        exact = (cols[None, :] < prefix) | (cols[None, :] >= pos[:, None] - recent)  # [m, T]
        causal = cols[None, :] <= pos[:, None]
        qg = qr.reshape(1, hkv, g, -1, d)
        s_fp = torch.einsum("bhgmd,bhtd->bhgmt", qg, kr) * scale
        s_fp = s_fp.masked_fill(~causal, float("-inf"))
        o_fp = torch.einsum("bhgmt,bhtd->bhgmd", torch.softmax(s_fp, -1), vr)
        o_fp = tr.output(o_fp.reshape(1, hq, -1, d)).reshape(1, hkv, g, -1, d)
        vq = fake_quantize(vr, oscar, "v", torch.float32)
        row = []
        for r in ratios:
            kq = fake_quantize(kr, oscar.replace(k_clip_ratio=r), "k", torch.float32)
            s_q = torch.einsum("bhgmd,bhtd->bhgmt", qg, kq) * scale
            s = torch.where(exact, s_fp, s_q).masked_fill(~causal, float("-inf"))
            a = torch.softmax(s, -1)
            a_ex = a * exact
            o = torch.einsum("bhgmt,bhtd->bhgmd", a_ex, vr) + torch.einsum("bhgmt,bhtd->bhgmd", a - a_ex, vq)
            o = tr.output(o.reshape(1, hq, -1, d)).reshape(1, hkv, g, -1, d)
            row.append((o - o_fp).square().sum(dim=(0, 2, 3, 4)))
        num = torch.stack(row) if num is None else num + torch.stack(row)
        e = o_fp.square().sum(dim=(0, 2, 3, 4))
        den = e if den is None else den + e
    return num / den


def cmd_fit(a):
    from rotationzoo.fit.dump import open_dump
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.kvformat import parse_format
    torch.set_num_threads(a.threads)
    dump = open_dump(a.dump)
    layer_ids = list(dump.layer_ids)
    shape = _shape(dump, layer_ids)
    fmt = parse_format(a.format)
    m = _methods(a.method)
    m = m.in_format(fmt)
    oscar = m.oscar(shape, Int2KVConfig.from_format(fmt))
    d = shape.head_dim
    idx = [int(i) for i in a.indices.split(",")]
    ratios = [i / d for i in idx]
    from rotationzoo.kernels.layout import clip_index
    base = idx.index(clip_index(fmt.k_clip_ratio, d)) if clip_index(fmt.k_clip_ratio, d) in idx else None
    table, per_layer = {}, {}
    tot = torch.zeros(len(ratios))
    best_tot = 0.0
    chunks = [int(c) for c in a.chunks.split(",")]
    for lid in layer_ids:
        err = head_errors(oscar, dump, lid, chunks, a.queries, ratios, fmt.prefix_tokens, fmt.recent_tokens)
        best, choice = err.min(dim=0)
        tot += err.sum(dim=1)
        best_tot += float(best.sum())
        layer_choice = int(err.sum(dim=1).argmin())
        per_layer[str(lid)] = ratios[layer_choice]
        for h in range(err.shape[1]):
            table[f"{lid},{h}"] = ratios[int(choice[h])]
        print(f"layer {lid:2d}: heads " + " ".join(f"{ratios[int(c)]:.4f}" for c in choice)
              + f"  err at base {float(err[base].sum()) if base is not None else float('nan'):.4f}"
              f" best {float(best.sum()):.4f}", flush=True)
    print("uniform clip -> summed proxy: " + ", ".join(f"{r:.4f}:{float(t):.4f}" for r, t in zip(ratios, tot)))
    print(f"per-head table summed proxy: {best_tot:.4f}")
    Path(a.out).write_text(json.dumps(table, indent=1) + "\n")
    Path(a.out).with_suffix(".layers.json").write_text(json.dumps(per_layer, indent=1) + "\n")
    print(f"wrote {a.out}")


def _install_tables(spec: str):
    """Patch the evaluation so that the K rows of the named methods use their per-head clip tables."""
    from rotationzoo.evaluate import methods
    from rotationzoo.integrations.transformers import attention
    tables = {}
    for part in filter(None, spec.split(",")):
        name, path = part.split("=", 1)
        raw = json.loads(Path(path).read_text())
        tables[name] = {tuple(int(x) for x in key.split(",")): float(r) for key, r in raw.items()}
    orig_oscar = methods.MethodSpec.oscar

    def oscar(self, *args, **kwargs):
        o = orig_oscar(self, *args, **kwargs)
        if o is not None and self.method in tables:
            o._clip_table = tables[self.method]
        return o

    methods.MethodSpec.oscar = oscar
    state = {}
    orig_sim = attention._simulate

    def simulate(session, module, *args, **kwargs):
        state["lid"] = int(getattr(module, "layer_idx", 0))
        return orig_sim(session, module, *args, **kwargs)

    orig_fq = attention.fake_quantize

    def fake_quantize(x, oscar, side, dtype):
        out = orig_fq(x, oscar, side, dtype)
        table = getattr(oscar, "_clip_table", None)
        if side != "k" or not table:
            return out
        lid = state["lid"]
        for h in range(x.shape[1]):
            r = table.get((lid, h))
            if r is not None and r != oscar.kv_format.k_clip_ratio:
                out[:, h] = orig_fq(x[:, h:h + 1], oscar.replace(k_clip_ratio=r), side, dtype)[:, 0]
        return out

    attention._simulate = simulate
    attention.fake_quantize = fake_quantize
    print(f"clip tables for: {', '.join(tables)}", file=sys.stderr)


def main():
    if sys.argv[1:2] == ["frontier"]:
        _install_tables(os.environ.get("CLIP_TABLES", ""))
        import bench_frontier
        sys.argv = [sys.argv[0]] + sys.argv[2:]
        return bench_frontier.main()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("--dump", required=True)
    f.add_argument("--method", required=True, help="hadamard, or a rotation source (folder, k.pt,v.pt, MODEL[@TAG])")
    f.add_argument("--format", required=True)
    f.add_argument("--indices", default="48,50,52,54,55,56,57,58,59,60,61,62,63",
                   help="clip indices int(r*d) to try (ratio = index / d)")
    f.add_argument("--chunks", default="1,2")
    f.add_argument("--queries", type=int, default=256)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument("--out", required=True)
    a = p.parse_args()
    return cmd_fit(a)


if __name__ == "__main__":
    sys.exit(main())
