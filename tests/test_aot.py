"""Ahead-of-time compilation of the triton INT2 kernels for sm_90 and sm_80, on any machine.

No GPU is needed: ``tools/aot_report.py`` lowers each kernel with ``triton.compile(ASTSource(...),
target=GPUTarget(...))`` and Triton's bundled ``ptxas``, then reads registers, spills, shared memory
and tensor-core instructions from the cubin. This process runs Triton's interpreter
(``TRITON_INTERPRET=1``, tests/conftest.py); the report compiles compiled-mode copies of the kernels
anyway. A representative subset is compiled here at the launch parameters of
``rotationzoo.kernels.layout``; the full set is ``python tools/aot_report.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'rotationzoo[triton]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import aot_report  # noqa: E402

from rotationzoo.kernels import triton_int2  # noqa: E402


def quant(d, group, *, rotate, clip, lloyd_max=False, has_loc=True, scale="fp32", **launch):
    return dict(kind="quantize", d=d, group=group, rotate=rotate, clip=clip, lloyd_max=lloyd_max,
                has_loc=has_loc, scale=scale, source="sweep" if launch else "heuristic", **launch)


# The serving case and its grouped variant (the most registers at d = 128), the heaviest clip
# (31-pass bisection) with the smallest groups at the largest head_dim, Lloyd-Max with a rotation,
# the decode flush's bisection into the paged store with a rotation at d = 256, the launches
# ptxas spilled in without an explicit register ceiling (sm_90, sm_80), a grouped dequantize, the
# d = 256 dequantize that spilled on sm_80 with 4 warps, and decode attention: the serving case
# (Qwen3-8B's 4 query rows per KV head, G = d, fp32 scale/zero), with a boolean mask, SmolLM2's
# (3 rows, G = 16, fp16 scale/zero), 16 draft rows with two groups per quarter (spilled 64 B on sm_90
# with 64-token tiles) and the merge with the output rotation.
SUBSET = [
    quant(128, 128, rotate=True, clip="top"),
    quant(128, 16, rotate=True, clip="top", scale="bf16"),
    quant(256, 16, rotate=False, clip="radix", has_loc=False, scale="bf16"),
    quant(64, 64, rotate=True, clip="bottom", lloyd_max=True, scale="fp16"),
    quant(256, 256, rotate=True, clip="bisect"),
    quant(128, 128, rotate=False, clip="bottom", scale="bf16"),  # spilled 8 B on sm_90 without a maxnreg
    quant(128, 16, rotate=True, clip="top", has_loc=False),  # spilled 8 B on sm_80 without a maxnreg
    dict(kind="dequantize", d=128, group=32, scale="fp16", out="bf16", source="heuristic"),
    dict(kind="dequantize", d=256, group=128, scale="fp16", out="fp16", source="heuristic"),  # 8 B on sm_80, 4 warps
    dict(kind="decode", d=128, group=128, scale="fp32", hp="bf16", gq=4, s=1, rotate=True, source="heuristic"),
    dict(kind="decode", d=64, group=16, scale="fp16", hp="bf16", gq=3, s=1, rotate=True, source="heuristic"),
    dict(kind="decode", d=128, group=128, scale="fp32", hp="bf16", gq=4, s=1, rotate=True, mask=True, source="heuristic"),
    dict(kind="decode", d=128, group=16, scale="bf16", hp="fp16", gq=4, s=4, rotate=True, source="heuristic"),
    dict(kind="decode_merge", d=128, gq=4, s=1, rotate=True, out="bf16", source="heuristic"),
]


@pytest.fixture(autouse=True)
def _fresh_triton_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))  # really compile every time


@pytest.mark.parametrize("target", [90, 80])
def test_default_launches_compile_without_spills(target):
    assert triton_int2.interpret_mode(), "this process runs the interpreter (conftest), AOT must still work"
    problems = []
    for v in SUBSET:
        rec = aot_report.compile_variant(dict(v, target=target))
        name = aot_report.variant_name(rec)
        if not rec["ok"]:
            problems.append(f"{name}: {rec['error']}")
            continue
        if rec["spills"]:
            problems.append(f"{name}: spills ({rec['stack_bytes']} B stack, {rec['spill_instructions']} LDL/STL)")
        if rec.get("rotate") and not rec["tensor_core_ok"]:
            problems.append(f"{name}: the rotation does not use tensor cores")
        if rec["occupancy"]["blocks"] < 1:
            problems.append(f"{name}: cannot be resident ({rec['smem_bytes']} B shared memory)")
    assert not problems, "\n".join(problems)


def test_a_compile_error_is_reported():
    rec = aot_report.compile_variant(dict(quant(128, 128, rotate=True, clip="top", block_rows=48, num_warps=4,
                                                num_stages=1), target=90))
    assert not rec["ok"] and "power of 2" in rec["error"], rec  # tl.arange(0, BT) needs a power of 2


def test_a_spilling_launch_is_reported():
    rec = aot_report.compile_variant(dict(quant(128, 128, rotate=True, clip="top", block_rows=128, num_warps=4,
                                                num_stages=1), target=90))
    assert rec["ok"] and rec["spills"] and rec["stack_bytes"] > 0 and rec["spill_instructions"] > 0, rec


def test_residency_arithmetic():
    lim = aot_report.SM_LIMITS[90]
    # 138 registers -> 144 per thread, 4608 per warp: 14 warps fit, so one 8-warp block
    assert aot_report.residency(138, 8, 50176, lim) == {
        "blocks": 1, "warps": 8, "limited_by": "registers", "smem_per_block": 51200}
    # 64 registers, 4 warps: 8 blocks by registers, but 41 KiB per block leaves room for 5
    occ = aot_report.residency(64, 4, 40 * 1024, lim)
    assert (occ["blocks"], occ["limited_by"]) == (5, "shared_memory")
    assert aot_report.residency(32, 4, 0, lim)["warps"] == 64  # the warp limit
    assert aot_report.residency(64, 4, 300 * 1024, lim)["blocks"] == 0  # over the per-block maximum


def test_bandwidth_estimate_arithmetic():
    rec = {"tile_load_bytes": 16896, "num_stages": 1, "num_warps": 8, "block_rows": 64, "ldgsts": 0,
           "occupancy": {"blocks": 1}, "loop_instructions": 3593, "bytes_per_row": 296.0}
    est = aot_report.bandwidth_estimate(rec)
    need = 4.3e12 * 700e-9 / 132  # bytes in flight per SM for 4.3 TB/s at 700 ns
    assert est["needed_per_sm_bytes"] == round(need)
    assert est["little_bound_pct_of_copy"] == round(16896 / need * 100, 1)
    assert est["warp_instructions_per_row"] == round(3593 * 8 / 64, 1)
    issue = (296.0 / 4.3e12) / (3593 * 8 / 64 / (132 * 4 * 1.98e9))
    assert est["issue_bound_pct_of_copy"] == round(issue * 100, 1)
    piped = aot_report.bandwidth_estimate(dict(rec, num_stages=3, ldgsts=4))
    assert piped["loads_overlap_compute"] and piped["outstanding_per_sm_bytes"] == 2 * 16896


def test_an_interrupted_run_resumes_from_its_records(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # main() drops it
    records = tmp_path / "records.jsonl"
    goal = aot_report.goal_variant(64, 90)
    (done,) = aot_report.compile_todo([goal], 1, records)
    with records.open("a") as f:
        f.write('{"kind": "quantize", "d": 12')  # a line cut short when the run was stopped
    assert aot_report.load_records(records) == {aot_report._key(goal): done}
    out = tmp_path / "aot.json"
    argv = ["--targets", "90", "--head-dims", "64", "--quick", "--no-sweep", "--records", str(records)]
    assert aot_report.main([*argv, "--report-only", "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["records"] == [done] and result["reused_from_records"] == 1 and result["goal"][0]["ok"]
