#!/usr/bin/env python
"""Integrity checks for a registry file (CI gate).

Usage::

    python tools/check_registry.py                 # the bundled registry.json
    python tools/check_registry.py path/to/registry.json [--json] [--strict]

Checks the JSON Schema, unique ids and aliases across models, that every default tag exists,
sha256 format, positive sizes, well-formed sources, revisions (40-hex commits, or counted as
unpinned), paths consistent with their tag, that bundled files exist with the registered
sha256, and that a tag with bundled files says the grouping they hold (``"grouping": "kv_head"`` for
per-KV-head files, what ``info``, ``plan`` and ``serve-args`` read before anything is downloaded).
Exits 1 on any error (``--strict``: also on warnings).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rotationzoo.config import package_data_dir  # noqa: E402
from rotationzoo.files.format import read_rotation  # noqa: E402
from rotationzoo.files.rotation_set import grouping_of  # noqa: E402
from rotationzoo.registry import lint_registry, schema_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("registry", nargs="?", type=Path, default=ROOT / "registry.json")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--strict", action="store_true", help="fail on warnings too")
    args = ap.parse_args(argv)
    try:
        data = json.loads(args.registry.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: {args.registry}: {exc}", file=sys.stderr)
        return 1
    report = lint_registry(data, schema=json.loads(schema_path().read_text()))
    for m in data.get("models", []) if isinstance(data, dict) else []:
        for tname, t in (m.get("tags") or {}).items():
            bundled: list = []  # the bundled sides that are there, read
            for side, f in (t.get("files") or {}).items():
                for s in f.get("sources", t.get("sources", [])):
                    if isinstance(s, dict) and s.get("type") == "bundled":
                        p = package_data_dir() / str(s.get("path"))
                        if not p.is_file():
                            report.errors.append(f"{m.get('id')}@{tname}: bundled file {p} is missing")
                        elif f.get("sha256") and hashlib.sha256(p.read_bytes()).hexdigest() != f["sha256"]:
                            report.errors.append(f"{m.get('id')}@{tname}: bundled {side} file does not match its sha256")
                        else:
                            bundled.append(read_rotation(p))
            said, held = t.get("grouping", "layer"), grouping_of(*bundled)
            if bundled and said != held:
                unit, fix = ("KV head", 'set "grouping": "kv_head"') if held == "kv_head" else ("layer", 'remove "grouping"')
                report.errors.append(f"{m.get('id')}@{tname}: the bundled files hold one rotation per {unit} but the "
                                     f"entry's grouping is {said}; {fix}")
    if args.json:
        print(json.dumps({"ok": report.ok and not (args.strict and report.warnings), "errors": report.errors,
                          "warnings": report.warnings, "models": report.models, "tags": report.tags,
                          "files": report.files, "unpinned_files": report.unpinned_files,
                          "unpinned_sources": report.unpinned_sources}, indent=2))
    else:
        for e in report.errors:
            print(f"error: {e}")
        for w in report.warnings:
            print(f"warning: {w}")
        print(f"{args.registry}: {report.models} models, {report.tags} tags, {report.files} files; "
              f"{report.unpinned_files} files without sha256 (unpinned), "
              f"{report.unpinned_sources} hub sources not pinned to a commit; "
              f"{len(report.errors)} errors, {len(report.warnings)} warnings")
    if report.errors or (args.strict and report.warnings):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
