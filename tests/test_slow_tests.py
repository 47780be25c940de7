"""tests/slow_tests.txt (what ``make test-fast`` leaves out) and the tool that rewrites it."""

from __future__ import annotations

from pathlib import Path

import conftest
import pytest

REPO = Path(__file__).resolve().parents[1]
tool = conftest.SLOW_TESTS_TOOL


def test_every_listed_test_exists() -> None:
    modules, functions = tool.read_list()
    assert {"test_real_model", "test_aot", "test_native_build"} <= modules
    for module in modules:
        assert (REPO / "tests" / f"{module}.py").is_file(), module
    stale = sorted(set(functions) - tool.existing_functions())
    assert not stale, f"listed in tests/slow_tests.txt but not defined: {stale}"


def test_durations_take_each_functions_slowest_case() -> None:
    log = """\
============================= slowest durations ==============================
1.25s call     tests/test_a.py::test_x[1-2]
0.50s setup    tests/test_a.py::test_x[1-2]
0.40s call     tests/test_a.py::test_x[3]
0.30s call     tests/test_b.py::TestGroup::test_y
(12 durations < 0.005s hidden.  Use -vv to show these durations.)
"""
    assert tool.durations(log) == {"test_a::test_x": 1.75, "test_b::test_y": 0.3}


def test_the_conftest_marks_listed_tests_slow() -> None:
    assert conftest.SLOW_MODULES == frozenset(tool.read_list()[0])
    assert "test_cache_decode::test_triton_backend_in_the_cache_matches_the_reference" in conftest.SLOW_TESTS


@pytest.mark.parametrize("content", ["", "# only a comment\n"])
def test_rewrite_refuses_a_log_without_durations(tmp_path, capsys, content) -> None:
    log = tmp_path / "durations.log"
    log.write_text(content)
    assert tool.main([str(log)]) == 2
    assert "has no durations" in capsys.readouterr().err
