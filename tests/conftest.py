"""Test-wide set-up: isolated caches, no network but loopback, Triton's CPU interpreter."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# Must happen before any test imports huggingface_hub, modelscope or triton.
_TMP = Path(tempfile.mkdtemp(prefix="rotationzoo-tests-"))
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.setdefault("HF_HOME", str(_TMP / "hf-home"))
os.environ.setdefault("MODELSCOPE_CACHE", str(_TMP / "modelscope"))
os.environ["ROTATIONZOO_CACHE"] = str(_TMP / "rotationzoo-cache")
os.environ.pop("ROTATIONZOO_REGISTRY", None)
os.environ.pop("ROTATIONZOO_OFFLINE", None)
os.environ.pop("HF_HUB_OFFLINE", None)
# the test hub server answers plain http on 127.0.0.1: URL sources may point at it
os.environ["ROTATIONZOO_ALLOW_HTTP_LOOPBACK"] = "1"
os.environ["ROTATIONZOO_PINS"] = str(_TMP / "pins.json")
if not os.path.exists("/dev/nvidiactl"):
    # Triton has no CPU backend: its interpreter runs kernels on CPU tensors (bit-exact, slow).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
UPSTREAM = SHARED / "upstream-rotations"

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _own_pin_file(tmp_path, monkeypatch) -> None:
    """Each test pins files on first use in its own pin file, and sees the once-per-process warning
    about unpinned files afresh (whatever ran before it)."""
    monkeypatch.setenv("ROTATIONZOO_PINS", str(tmp_path / "pins.json"))
    from rotationzoo.hub import fetch

    fetch._warned_unpinned.clear()


@pytest.fixture
def upstream_dir() -> Path:
    """The authors' published rotation files (skips when ../shared is absent)."""
    if not (UPSTREAM / "SOURCES.md").is_file():
        pytest.skip(f"upstream rotation files not found at {UPSTREAM} (needs ../shared beside the repo)")
    return UPSTREAM


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    """A fresh rotationzoo cache for one test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(d))
    return d


def _slow_tests_tool() -> Any:
    """tools/slow_tests.py as a module (its reader of tests/slow_tests.txt)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("slow_tests", REPO / "tools" / "slow_tests.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


SLOW_TESTS_TOOL = _slow_tests_tool()
#: Modules whose every test is slow (model loads, compilers) and single test functions over ~0.5 s on
#: 2 cores: ``make test-fast`` leaves them out.
SLOW_MODULES, SLOW_TESTS = (frozenset(x) for x in SLOW_TESTS_TOOL.read_list())


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the slow tests (``-m "not slow"`` leaves them out), in one place."""
    import pytest

    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        if module in SLOW_MODULES or f"{module}::{item.originalname}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
