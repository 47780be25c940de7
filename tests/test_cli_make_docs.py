"""`make docs` builds the site as CI does: strict, without mkdocs-material's MkDocs 2 notice."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_make_docs_runs_mkdocs_without_the_material_notice(tmp_path) -> None:
    venv = Path(sys.prefix)
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    if not (venv / "bin" / "mkdocs").is_file() or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed in this environment (pip install -e '.[docs]')")
    # the recipe as `make docs` runs it (without re-running `make install`)
    plan = subprocess.run(["make", "-n", "-o", "install", "docs", f"VENV={venv}"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    build = [line for line in plan.stdout.splitlines() if "mkdocs build" in line]
    assert len(build) == 1, plan.stdout
    env = {k: v for k, v in os.environ.items() if k not in ("NO_MKDOCS_2_WARNING", "DISABLE_MKDOCS_2_WARNING")}
    proc = subprocess.run(f"{build[0]} --site-dir {tmp_path / 'site'}", shell=True, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Material for MkDocs" not in proc.stdout + proc.stderr
    assert (tmp_path / "site" / "index.html").is_file()
