"""Test-wide set-up: isolated caches, no network but loopback, Triton's CPU interpreter."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

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


#: Modules whose every test is slow (a model load, a compiler run, ptxas): ``make test-fast`` skips them.
SLOW_MODULES = frozenset({"test_real_model", "test_aot", "test_native_build"})
#: Single tests that take over ~5 s on a 2-core machine (``--durations`` of a full run), by name.
SLOW_TESTS = frozenset({
    "test_triton_backend_in_the_cache_matches_the_reference", "test_the_triton_kernel_reads_out_of_domain_rows_as_nan",
    "test_decode_steps_equal_the_dequantize_path", "test_triton_equals_reference", "test_cli_fetch_is_quiet_when_not_a_terminal",
    "test_cli_fit_refine_writes_a_verified_pair", "test_the_first_kernel_call_may_happen_while_compiling",
    "test_fuzz_reader_raises_only_typed_errors", "test_pieces_give_the_real_tokenizers_whole_text_ids",
    "test_cli_fetch_json_through_hf_endpoint", "test_cli_calibrate_refine_keeps_what_the_model_judges_best",
    "test_a_mask_restricts_what_each_query_row_sees", "test_a_sliding_layer_keeps_only_its_window_of_int2_rows",
    "test_validation_working_set_is_bounded", "test_a_failing_step_does_not_stop_the_others",
    "test_cli_fit_refine_keep_window_is_the_dump_context", "test_help_shows_every_bracketed_text_literally",
    "test_make_docs_runs_mkdocs_without_the_material_notice", "test_mkdocs_build_strict", "test_cli_eval",
    "test_eight_processes_one_download", "test_deflate_bomb_refused_fast_and_small",
    "test_cli_failure_prints_no_client_logs", "test_interpreter_enabled_after_triton_was_imported",
})


def pytest_collection_modifyitems(config, items) -> None:
    """Mark the slow tests (``-m "not slow"`` leaves them out), in one place."""
    import pytest

    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module is not None else ""
        if module in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
