"""tools/device_check.sh always writes its one JSON: failing or hanging steps are recorded, never fatal.

The full dry run (``bash tools/device_check.sh --dry-run``: every step on CPU under Triton's
interpreter) is part of ``.ci/run``; these tests replace the Python the script calls with a wrapper
that breaks chosen steps, so they take seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "device_check.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


def run_check(tmp_path, python: str, steps: str, budget: int = 470) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=python, DEVICE_CHECK_STEPS=steps, DEVICE_CHECK_BUDGET_S=str(budget))
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    report = json.loads((out / "device-check.json").read_text())
    return proc, report


def wrapper(tmp_path, bench: str) -> str:
    """A ``python`` that runs the real one, except for tools/bench_kernels.py: ``fail`` or ``hang``."""
    action = "exit 3" if bench == "fail" else "exec sleep 60"
    path = tmp_path / "python"
    path.write_text(f'#!/usr/bin/env bash\ncase " $* " in *bench_kernels.py*) {action} ;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return str(path)


def steps_by_name(report: dict) -> dict:
    return {s["name"]: s for s in report["steps"]}


def test_json_is_written_when_python_itself_is_broken(tmp_path):
    proc, report = run_check(tmp_path, python="false", steps="env,tests,aot,bench,noclip,merge")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert report["ok"] is False and "merge" in report["error"]
    steps = steps_by_name(report)
    assert set(steps) >= {"env", "tests", "aot", "bench", "noclip"}
    assert all(steps[name]["exit"] != "0" for name in ("env", "tests", "aot", "bench", "noclip"))


def test_a_failing_step_does_not_stop_the_others(tmp_path):
    proc, report = run_check(tmp_path, python=wrapper(tmp_path, "fail"), steps="env,bench,noclip,merge")
    assert proc.returncode == 1, proc.stdout[-2000:]
    steps = steps_by_name(report)
    assert steps["env"]["exit"] == 0 and steps["bench"]["exit"] == 3 and steps["noclip"]["exit"] == 3
    assert steps["tests"]["exit"] == "skipped"
    assert report["machine"]["torch"]  # the steps that ran are reported
    assert report["checks"]["bytes_equal_reference"] is False and report["ok"] is False
    assert "error" in report["bench"]


def test_a_hanging_step_is_cut_off(tmp_path):
    # budget 45 s minus the 40 s kept for the merge: each step gets the 5 s floor
    proc, report = run_check(tmp_path, python=wrapper(tmp_path, "hang"), steps="bench,merge", budget=45)
    steps = steps_by_name(report)
    assert steps["bench"]["exit"] == 124 and steps["bench"]["timed_out"], steps
    assert steps["bench"]["seconds"] < 30
    assert proc.returncode == 1
