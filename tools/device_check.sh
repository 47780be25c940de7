#!/usr/bin/env bash
# One prepared script for a CUDA machine: environment, kernel correctness on the real backend, the
# kernel benchmark (copy bandwidth measured in the same run, byte equality with the PyTorch
# reference), decode attention from the INT2 cache against SDPA in BF16, and the ahead-of-time
# compile report for this GPU's target. Every step is bounded by
# `timeout`; a failing step never stops the others, and ONE JSON, ${OUT:-bench-out}/device-check.json,
# is always written (by a shell fallback if Python itself is broken). The whole run stays under
# 8 minutes. Uses the machine's own python3 (PYTHON= to change it) with its torch + triton; nothing
# is installed.
#
# Usage, from the repository root:
#   bash tools/device_check.sh             # on the GPU machine
#   bash tools/device_check.sh --dry-run   # same steps on CPU: Triton interpreter, tiny shapes, no nvidia-smi
# DEVICE_CHECK_STEPS=env,bench,merge limits the run to some steps (env tests aot bench noclip decode merge);
# DEVICE_CHECK_BUDGET_S (default 470) is the time the steps may take in all.
# Exit status: 0 when every step succeeded and every check passed, 1 otherwise, 2 on bad usage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
dry=0
case "${1:-}" in
  --dry-run) dry=1 ;;
  "") ;;
  *) echo "usage: bash tools/device_check.sh [--dry-run]" >&2; exit 2 ;;
esac
out="${OUT:-bench-out}"
mkdir -p "$out" || exit 2
py="${PYTHON:-python3}"
only="${DEVICE_CHECK_STEPS:-env,tests,aot,bench,noclip,decode,merge}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry" = 1 ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
total_s="${DEVICE_CHECK_BUDGET_S:-470}"   # the whole script, with a margin under 8 minutes
merge_reserve_s=40   # kept back for writing the JSON
t_start=$(date +%s)
steps="$out/device-check-steps.tsv"
: > "$steps"
rm -f "$out/device-check.json"

wanted() { case ",$only," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

left() {  # seconds a step may still take, keeping the reserve for the merge
  local rest=$(( total_s - merge_reserve_s - ($(date +%s) - t_start) ))
  [ "$rest" -lt 5 ] && rest=5
  [ "$1" -lt "$rest" ] && rest=$1
  echo "$rest"
}

record() {  # record NAME RC SECONDS LOG
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$steps"
  echo "== step $1: exit $2 after ${3}s (log $4)"
}

step() {  # step NAME LIMIT_S LOG command... : run bounded, tee the log, record the outcome
  local name=$1 limit log=$3 t0 rc
  limit=$(left "$2")
  shift 3
  if ! wanted "$name"; then record "$name" skipped 0 "$log"; return 0; fi
  echo "== step $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  record "$name" "$rc" "$(( $(date +%s) - t0 ))" "$log"
}

# 1. environment: versions, GPU, driver
if [ "$dry" = 1 ]; then
  echo "dry run: nvidia-smi skipped" > "$out/nvidia-smi.csv"
elif wanted env; then
  timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
    > "$out/nvidia-smi.csv" 2>&1 || echo "nvidia-smi failed (exit $?)" >> "$out/nvidia-smi.csv"
fi
step env 30 "$out/env.txt" "$py" -c '
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, capability=list(torch.cuda.get_device_capability(0)), sm_count=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1))
except Exception as exc:
    info["torch_error"] = repr(exc)
try:
    import triton
    info["triton"] = triton.__version__
except Exception as exc:
    info["triton_error"] = repr(exc)
print(json.dumps(info))
'
cap=$(sed -n 's/.*"capability": \[\([0-9]*\), \([0-9]*\)\].*/\1\2/p' "$out/env.txt" 2>/dev/null | head -n 1)
[ -n "$cap" ] || cap=90

# 2. ahead-of-time compile report for this target, in the background (CPU only)
if [ "$dry" = 1 ]; then
  aot_args=(--quick --targets 90 --head-dims 64 --no-sweep --jobs 2)
else
  jobs=$(( $(nproc 2>/dev/null || echo 2) / 2 )); [ "$jobs" -gt 8 ] && jobs=8; [ "$jobs" -lt 1 ] && jobs=1
  aot_args=(--quick --targets "$cap" --jobs "$jobs")
fi
aot_pid=""
if wanted aot; then
  step aot 300 "$out/aot.txt" "$py" tools/aot_report.py "${aot_args[@]}" --json-out "$out/aot.json" > /dev/null &
  aot_pid=$!
else
  record aot skipped 0 "$out/aot.txt"
fi

# 3. kernel correctness on the real backend (a representative subset in the dry run)
tests=(tests/test_kernels.py tests/test_kernels_triton.py tests/test_decode_attention.py)
[ "$dry" = 1 ] && tests+=(-k "paged_store or dequant_kernel_equals_reference or bisection_clip_bit_exact or triton_equals_reference and 256")
step tests 120 "$out/kernel-tests.txt" "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" \
  --junitxml="$out/kernel-tests.xml"

# 4. benchmark: clip 0.96 with the launch sweep, then without the clip
if [ "$dry" = 1 ]; then bench=(--dry-run --tokens 64); noclip=(--dry-run --tokens 64); else bench=(); noclip=(--quick); fi
step bench 140 "$out/int2-kernels.txt" "$py" tools/bench_kernels.py "${bench[@]}" --sweep \
  --json-out "$out/int2-kernels.json"
step noclip 60 "$out/int2-kernels-noclip.txt" "$py" tools/bench_kernels.py "${noclip[@]}" --clip 0 \
  --json-out "$out/int2-kernels-noclip.json"

# 5. decode attention read from the INT2 cache vs SDPA and FlashAttention in BF16 at 32K and 128K (Qwen3-8B
#    geometry, batch 1 and 8; tiny and interpreted in the dry run)
if [ "$dry" = 1 ]; then decode=(--dry-run); else decode=(--contexts 32768,131072 --batches 1,8); fi
step decode 80 "$out/decode.txt" "$py" tools/bench_decode.py --cuda "${decode[@]}" --json-out "$out/decode.json"

if [ -n "$aot_pid" ]; then wait "$aot_pid"; fi

# 6. one JSON and a compact table
merge_rc=1
if wanted merge; then
  t0=$(date +%s)
  timeout --kill-after=5 30 "$py" - "$out" "$dry" "$(( $(date +%s) - t_start ))" <<'PY'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path

out, dry, elapsed = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])


def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception as exc:  # missing or broken: say so in the JSON
        return {"error": f"{name}: {exc!r}"[:300]}


steps = []
for line in (out / "device-check-steps.tsv").read_text().splitlines():
    name, rc, secs, log = (line.split("\t") + ["", "", "", ""])[:4]
    entry = {"name": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs or 0), "log": log}
    entry["timed_out"] = entry["exit"] in (124, 137)
    if entry["exit"] not in (0, "skipped"):
        try:
            entry["log_tail"] = Path(log).read_text(errors="replace")[-1500:]
        except OSError:
            pass
    steps.append(entry)

env = {}
try:
    env = json.loads((out / "env.txt").read_text().strip().splitlines()[-1])
except Exception as exc:
    env = {"error": repr(exc)[:300]}
env["nvidia_smi"] = (out / "nvidia-smi.csv").read_text().strip() if (out / "nvidia-smi.csv").exists() else None

tests = {}
try:
    suite = ET.parse(out / "kernel-tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except Exception as exc:
    tests = {"error": repr(exc)[:300]}

KEEP = ("tokens", "copy_gbps", "fused_gbps", "fused_pct_copy", "two_step_gbps", "two_step_pct_copy",
        "dequant_gbps", "dequant_pct_copy", "speedup_fused_vs_two_step", "codes_differ_fused_vs_two_step",
        "codes_differ_fused_vs_reference", "codes_equal_reference_no_rotation",
        "scales_zeros_equal_reference_no_rotation", "dequant_equal_reference", "fused_sweep_best")


def bench_part(name):
    b = load(name)
    if "error" in b:
        return b
    rows = [{k: r.get(k) for k in KEEP if k in r} for r in b.get("rows", [])]
    return {"gpu": b.get("gpu"), "config": b.get("config"), "timer": b.get("timer"), "rows": rows,
            "targets_met": b.get("targets_met"), "full": b}


bench, noclip = bench_part("int2-kernels.json"), bench_part("int2-kernels-noclip.json")
decode = load("decode.json")
eq_keys = ("codes_equal_reference_no_rotation", "scales_zeros_equal_reference_no_rotation", "dequant_equal_reference")
eq_rows = [r for part in (bench, noclip) for r in part.get("rows", [])]
byte_equal = bool(eq_rows) and all(r.get(k) is True for r in eq_rows for k in eq_keys)

aot = load("aot.json")
if "error" not in aot:
    problems = [r for r in aot.get("records", []) if not r.get("ok") or r.get("spills")]
    keep = ("triton", "ptxas", "targets", "wall_s", "verdict", "summary", "sm_limits", "h200", "goal")
    aot = dict({k: aot.get(k) for k in keep}, problems=problems)

checks = {
    "every_step_succeeded": all(s["exit"] in (0, "skipped") for s in steps),
    "kernel_tests_passed": "error" not in tests and tests.get("tests", 0) > 0
    and tests.get("failures", 1) == 0 and tests.get("errors", 1) == 0,
    "bytes_equal_reference": byte_equal,
    "aot_ok": bool(aot.get("verdict", {}).get("ok")),
    "decode_matches_reference": decode.get("matches_reference") is True,
}
result = {
    "schema": "rotationzoo-device-check/1",
    "dry_run": dry,
    "wall_s_before_merge": elapsed,
    "machine": env,
    "steps": steps,
    "kernel_tests": tests,
    "bench": bench,
    "bench_noclip": noclip,
    "aot": aot,
    "decode": decode,
    "checks": checks,
    "ok": all(checks.values()),
}
(out / "device-check.json").write_text(json.dumps(result, indent=1) + "\n")

print()
print(f"device check on {env.get('gpu', 'CPU (dry run)' if dry else '?')}, torch {env.get('torch')}, "
      f"triton {env.get('triton')}" + ("  [DRY RUN: interpreter, numbers meaningless]" if dry else ""))
print(f"{'step':<8} {'exit':>7} {'s':>5}")
for s in steps:
    print(f"{s['name']:<8} {str(s['exit']):>7} {s['seconds']:>5}" + ("  TIMED OUT" if s["timed_out"] else ""))
head = f"{'bench':<7} {'T':>8} {'copy GB/s':>9} {'fused GB/s':>10} {'% copy':>6} {'2-step %':>8} {'speedup':>7} {'deq %':>6} {'bytes==':>7}"
print(head)
for label, part in (("clip", bench), ("noclip", noclip)):
    for r in part.get("rows", []):
        same = all(r.get(k) is True for k in eq_keys)
        print(f"{label:<7} {r.get('tokens', 0):>8} {r.get('copy_gbps', 0):>9.0f} {r.get('fused_gbps', 0):>10.0f} "
              f"{r.get('fused_pct_copy', 0):>6.1f} {r.get('two_step_pct_copy', 0):>8.1f} "
              f"{r.get('speedup_fused_vs_two_step', 0):>6.2f}x {r.get('dequant_pct_copy', 0):>6.1f} {'yes' if same else 'NO':>7}")
    if "error" in part:
        print(f"{label:<7} {part['error']}")
print(f"{'decode':<7} {'ctx':>7} {'B':>2} {'INT2 ms':>8} {'SDPA ms':>8} {'flash ms':>8} {'vs SDPA':>7} {'vs flash':>8} "
      f"{'% copy':>6} {'rel err':>8}")
for r in decode.get("rows", []):
    print(f"{'':<7} {r.get('context', 0):>7} {r.get('batch', 0):>2} {r.get('int2_ms', float('nan')):>8.3f} "
          f"{r.get('sdpa_ms', float('nan')):>8.3f} {r.get('flash_ms', float('nan')):>8.3f} "
          f"{r.get('speedup_vs_sdpa', float('nan')):>6.2f}x {r.get('speedup_vs_flash', float('nan')):>7.2f}x "
          f"{r.get('int2_pct_copy', float('nan')):>6.1f} {r.get('int2_rel_err_vs_reference', float('nan')):>8.1e}")
if "error" in decode:
    print(f"decode  {decode['error']}")
v = aot.get("verdict") or {}
print(f"aot: {v or aot.get('error')}")
print(f"kernel tests: {tests}")
print(f"checks: {checks} -> {'OK' if result['ok'] else 'NOT OK'}")
print(f"wrote {out / 'device-check.json'}")
sys.exit(0 if result["ok"] else 1)
PY
  merge_rc=$?
  record merge "$merge_rc" "$(( $(date +%s) - t0 ))" "$out/device-check.json"
fi

# the JSON must exist even when Python could not write it
if [ "$merge_rc" -ne 0 ] && [ "$merge_rc" -ne 1 ] || [ ! -s "$out/device-check.json" ]; then
  {
    printf '{"schema": "rotationzoo-device-check/1", "dry_run": %s, "ok": false,\n' "$([ "$dry" = 1 ] && echo true || echo false)"
    printf ' "error": "the Python merge step failed (exit %s); see the step logs", "steps": [\n' "$merge_rc"
    sep=""
    while IFS=$'\t' read -r name rc secs log; do
      printf '%s  {"name": "%s", "exit": "%s", "seconds": "%s", "log": "%s"}' "$sep" "$name" "$rc" "$secs" "$log"
      sep=$',\n'
    done < "$steps"
    printf '\n]}\n'
  } > "$out/device-check.json"
  echo "wrote $out/device-check.json (fallback: the Python merge failed)"
  merge_rc=1
fi
echo "device check: $(( $(date +%s) - t_start ))s in all"
exit "$merge_rc"
