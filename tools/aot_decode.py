"""The decode-attention kernels in the ahead-of-time report (``tools/aot_report.py``).

Two kernels (:mod:`rotationzoo.kernels.triton_decode`): the split kernel (kind ``decode``: one range
of INT2 tokens or one tile of window tokens per program) and the merge (kind ``decode_merge``).
Variants are specialised like real launches: CPU stand-ins of a 4,096-token cache of 8 KV heads
(64 sink + 256 recent BF16 tokens) go through ``decode_launch`` / ``merge_launch`` in compiled mode.
The launch a variant compiles is the one ``decode_attention_int2`` picks (``source="heuristic"``), or
a candidate of ``decode_sweep_variants`` (``source="sweep"``).
"""

from __future__ import annotations

from rotationzoo.kernels import decode_plan, layout

CONTEXT, KV_HEADS, PREFIX, RECENT = 4096, 8, 64, 256
"""Shape of the stand-in cache (only strides, alignment and dtypes matter)."""

SCALE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
HP_DTYPES = ("bf16", "fp16")
ROWS = ((4, 1), (1, 1), (8, 1), (4, 4), (3, 1))
"""``(query heads per KV head, query tokens)``: Qwen3-8B's 4 (the serving case), MHA, 8, four
draft tokens (causal, 16 rows) and SmolLM2's 3 (padded to 4 rows)."""


def decode_variants(head_dims, quick: bool) -> list[dict]:
    """Split-kernel variants: head_dim × group size × scale dtype × window dtype × query rows (its
    products always run on tensor cores: ``rotate=True``); ``quick``: the serving case per head_dim
    plus one of each other axis."""
    out = []
    for d in head_dims:
        for g in layout.allowed_group_sizes(d):
            for sdt in SCALE_BYTES:
                for hp in HP_DTYPES:
                    for gq, s in ROWS:
                        v = dict(kind="decode", d=d, group=g, scale=sdt, hp=hp, gq=gq, s=s, rotate=True,
                                 source="heuristic")
                        if not quick or _representative(v):
                            out.append(v)
                        if (gq, s) in ((4, 1), (4, 4)) and g == d and sdt == "fp32" and hp == "bf16":
                            out.append(dict(v, mask=True))  # a boolean mask (padding, sliding windows)
    return out


def _representative(v: dict) -> bool:
    d, g = v["d"], v["group"]
    serving = g == d and v["scale"] == "fp32" and v["hp"] == "bf16" and (v["gq"], v["s"]) == (4, 1)
    smollm2 = d == 64 and g == 16 and v["scale"] == "fp16" and v["hp"] == "bf16" and (v["gq"], v["s"]) == (3, 1)
    grouped = d == 128 and g == layout.MIN_GROUP_SIZE and v["scale"] == "bf16" and (v["gq"], v["s"]) == (4, 4) \
        and v["hp"] == "fp16"  # 16 rows, 2 groups per quarter: two row blocks
    draft = d == 128 and g == d and v["scale"] == "fp32" and v["hp"] == "bf16" and (v["gq"], v["s"]) == (4, 4)
    return serving or smollm2 or grouped or draft


def merge_variants(head_dims, quick: bool) -> list[dict]:
    """Merge variants: head_dim × query rows × output rotation × output dtype."""
    out = []
    for d in head_dims:
        for gq, s in ROWS:
            for rotate in (True, False):
                for odt in ("bf16", "fp16", "fp32"):
                    if quick and not ((gq, s) == (4, 1) and rotate and odt == "bf16"):
                        continue
                    out.append(dict(kind="decode_merge", d=d, gq=gq, s=s, rotate=rotate, out=odt, source="heuristic"))
    return out


def decode_sweep_variants(head_dims, quick: bool) -> list[dict]:
    """Launch candidates of the split kernel on the serving case: tokens per tile × warps × stages."""
    out = []
    for d in head_dims if not quick else [d for d in head_dims if d == 128] or head_dims[:1]:
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    out.append(dict(kind="decode", d=d, group=d, scale="fp32", hp="bf16", gq=4, s=1, rotate=True,
                                    source="sweep", block_rows=bn, num_warps=warps, num_stages=stages))
    return out


def launch(v: dict):
    """``(compiled-mode kernel, Launch)`` of a decode variant for ``v["target"]``."""
    import torch

    from rotationzoo.kernels import triton_decode as td

    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    d = v["d"]
    hq = KV_HEADS * v["gq"]
    q = torch.empty(1, hq, v["s"], d, dtype=torch.bfloat16)
    kern = td.decode_aot_kernels()
    if v["kind"] == "decode_merge":
        rows = v["gq"] * v["s"]
        po = torch.empty(KV_HEADS, 64, rows, d)
        pl = torch.empty(KV_HEADS, 64, rows)
        out = torch.empty(1, hq, v["s"], d, dtype=dt[v["out"]])
        rot = torch.empty(d, d) if v["rotate"] else None
        return kern.merge, td.merge_launch(q, out, po, pl, rot, n_kv_heads=KV_HEADS, n_splits=64, interpret=False)
    ng = d // v["group"]
    n = CONTEXT - PREFIX - RECENT

    def side():
        hp = dt[v["hp"]]
        return (torch.empty(1, KV_HEADS, PREFIX, d, dtype=hp), torch.empty(1, KV_HEADS, n, d // 4, dtype=torch.uint8),
                torch.empty(1, KV_HEADS, n, 2 * ng, dtype=dt[v["scale"]]), torch.empty(1, KV_HEADS, RECENT, d, dtype=hp))

    tile = v.get("block_rows") or decode_plan.decode_tile_tokens(d, max(1, d // 4 // v["group"]))
    splits = decode_plan.triton_splits(n, KV_HEADS, 132, tile)
    windows = decode_plan.window_splits(PREFIX + RECENT)
    rows = v["gq"] * v["s"]
    po = torch.empty(KV_HEADS, splits[0] + windows, rows, d)
    pl = torch.empty(KV_HEADS, splits[0] + windows, rows)
    q_rows = torch.empty(1, KV_HEADS, rows, d)  # the rotated query rows (rotated before the launch)
    mask = torch.empty(1, 1, v["s"], CONTEXT, dtype=torch.bool) if v.get("mask") else None
    return kern.split, td.decode_launch(
        q, q_rows, side(), side(), po, pl, scale=d ** -0.5, causal=True, splits=splits, windows=windows, mask=mask,
        interpret=False, block_tokens=v.get("block_rows"), num_warps=v.get("num_warps"), num_stages=v.get("num_stages"))


def bytes_per_row(v: dict) -> float:
    """Bytes per INT2 token and KV head the split kernel reads: K and V codes ``d/4`` plus ``2·(d/G)``
    scale/zero values each (the merge: its partials, ``4·d`` per row)."""
    if v["kind"] == "decode_merge":
        return 4.0 * v["d"]
    return 2 * (v["d"] / 4 + 2 * (v["d"] // v["group"]) * SCALE_BYTES[v["scale"]])


def tile_load_bytes(v: dict, block_rows: int) -> int:
    """Bytes one split program requests per INT2 tile."""
    return int(block_rows * bytes_per_row(v)) if v["kind"] == "decode" else 0


def name(r: dict) -> str:
    if r["kind"] == "decode_merge":
        return f"decode-merge d={r['d']} rows={r['gq']}x{r['s']} rotate={int(r['rotate'])} out={r['out']}"
    return (f"decode d={r['d']} G={r['group']} scale={r['scale']} hp={r['hp']} rows={r['gq']}x{r['s']} "
            f"rotate={int(r['rotate'])}" + (" mask" if r.get("mask") else ""))


def table_rows(records: list[dict]) -> list[list[str]]:
    """Rows of the report's decode table."""
    rows = []
    for r in records:
        head = [f"sm_{r['target']}", r["kind"].replace("decode_merge", "merge").replace("decode", "split"), str(r["d"]),
                str(r.get("group", "-")), f"{r['gq']}x{r['s']}", r.get("hp", "-"), r.get("scale", r.get("out", "-")),
                f"{r.get('block_rows')} x {r.get('num_warps')} x {r.get('num_stages')}"]
        if not r["ok"]:
            rows.append(head + ["FAILED", r.get("error", "")[:40], "-", "-", "-", "-"])
            continue
        e = r.get("h200_estimate") or {}
        est = "-" if not e else (f"{e['outstanding_per_sm_bytes'] / 1024:.1f}/{e['needed_per_sm_bytes'] / 1024:.1f} KiB, "
                                 f"issue {e.get('issue_bound_pct_of_copy', '-')} %")
        rows.append(head + [str(r["regs"]), "yes" if r["spills"] else "no", f"{r['smem_bytes'] / 1024:.1f}",
                            f"{r['tensor_core_instructions']} {r['tensor_core'] or ''}".strip(),
                            f"{r['occupancy']['warps']} ({r['occupancy']['limited_by'].replace('_', ' ')})", est])
    return rows


TABLE_COLUMNS = ("target", "kernel", "d", "G", "rows", "window", "scale/out", "tokens x warps x stages", "regs",
                 "spill", "smem KiB", "tensor cores", "resident warps", "H200: in flight / needed, issue bound")
