#!/usr/bin/env python
"""Write tests/slow_tests.txt, the tests ``make test-fast`` leaves out, from measured durations.

Usage::

    python -m pytest -q -p no:randomly --durations=0 > durations.log    # a full run, quiet machine
    python tools/slow_tests.py durations.log                             # rewrite tests/slow_tests.txt
    python tools/slow_tests.py durations.log --threshold 0.3 --check     # what would change, exit 1 if any

A test function is slow when any of its cases (setup + call + teardown) took at least
``--threshold`` seconds (0.5 by default, measured on a 2-core machine). Functions already listed
and not in the log (they were deselected, or the log is partial) stay listed; a listed function that
no longer exists is dropped; whole modules (``module::*``, slow by nature) are kept as they are.
tests/conftest.py marks every listed test ``slow``.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "slow_tests.txt"
HEADER = """\
# Test functions over about 0.5 s on a 2-core machine: `make test-fast` (-m "not slow") leaves them out.
# One `module::function` per line after its slowest case's seconds, or `module::*` for a module whose every
# test is slow by nature (a model load, a compiler run, ptxas). Rewritten by tools/slow_tests.py from a
# `pytest --durations=0` log (the `module::*` lines are kept as they are); tests/conftest.py reads it.
"""
_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(tests/\S+?\.py)::(\S+)")


def read_list(path: Path = LIST) -> tuple[set[str], dict[str, float]]:
    """``(modules, {"module::function": seconds})`` of a slow-tests file (empty when there is none)."""
    modules: set[str] = set()
    functions: dict[str, float] = {}
    if not path.is_file():
        return modules, functions
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.endswith("::*"):
            modules.add(line[:-3])
        elif line:
            seconds, key = line.split()
            functions[key] = float(seconds)
    return modules, functions


def durations(log: str) -> dict[str, float]:
    """The slowest case of each test function in a ``--durations=0`` log, setup + call + teardown."""
    per_case: dict[tuple[str, str], float] = defaultdict(float)
    for line in log.splitlines():
        m = _LINE.match(line)
        if m:
            per_case[(m.group(3), m.group(4))] += float(m.group(1))
    out: dict[str, float] = {}
    for (path, case), seconds in per_case.items():
        name = case.split("[", 1)[0].split("::")[-1]
        key = f"{Path(path).stem}::{name}"
        out[key] = max(out.get(key, 0.0), seconds)
    return out


def existing_functions() -> set[str]:
    """Every ``module::test_function`` defined under tests/ (methods of test classes included)."""
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                found.add(f"{path.stem}::{node.name}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example: python tools/slow_tests.py durations.log --threshold 0.5")
    ap.add_argument("log", type=Path, help="output of `python -m pytest --durations=0` (a full run)")
    ap.add_argument("--threshold", type=float, default=0.5, help="seconds that make a function slow (default 0.5)")
    ap.add_argument("--check", action="store_true", help="print what would change and exit 1 if anything would")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"slow_tests: no log at {args.log}; run pytest with --durations=0 and save its output", file=sys.stderr)
        return 2
    measured = durations(args.log.read_text(encoding="utf-8", errors="replace"))
    if not measured:
        print(f"slow_tests: {args.log} has no durations; run pytest with --durations=0", file=sys.stderr)
        return 2
    modules, old = read_list()
    live = existing_functions()
    new = {k: v for k, v in old.items() if k not in measured and k in live}
    new.update({k: v for k, v in measured.items() if v >= args.threshold and k.split("::")[0] not in modules})
    added, dropped = sorted(set(new) - set(old)), sorted(set(old) - set(new))
    for key in added:
        print(f"+ {key} ({new[key]:.2f} s)")
    for key in dropped:
        print(f"- {key}")
    if args.check:
        return 1 if added or dropped else 0
    body = "".join(f"{m}::*\n" for m in sorted(modules)) + "".join(f"{new[k]:6.2f} {k}\n" for k in sorted(new))
    LIST.write_text(HEADER + body, encoding="utf-8")
    print(f"slow_tests: {len(new)} functions in {LIST.relative_to(ROOT)} ({len(added)} added, {len(dropped)} dropped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
