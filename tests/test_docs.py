"""The documentation site: generated pages up to date, zoo complete, strict mkdocs build."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GEN = REPO / "tools" / "gen_docs.py"


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_docs_are_up_to_date():
    proc = subprocess.run([sys.executable, str(GEN), "--check"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + "\n(run `python tools/gen_docs.py` and commit docs/zoo.md, docs/cli.md)"


def test_check_detects_drift(tmp_path):
    gen = _gen_docs()
    assert gen.main(["--docs-dir", str(tmp_path)]) == 0
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 0
    (tmp_path / "zoo.md").write_text((tmp_path / "zoo.md").read_text() + "\nedited by hand\n")
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 1
    (tmp_path / "cli.md").unlink()
    assert gen.main(["--check", "--docs-dir", str(tmp_path)]) == 1


def test_zoo_lists_every_registry_entry():
    from rotationzoo.registry import Registry, bundled_registry_path

    text = (DOCS / "zoo.md").read_text(encoding="utf-8")
    rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
    reg = Registry.from_files([bundled_registry_path()], origins=["bundled"])
    n_entries = 0
    for m in reg:
        assert f"`{m.id}`" in text, m.id
        for name, t in m.tags.items():
            n_entries += 1
            assert any(f"`{name}`" in r for r in rows), f"{m.id}@{name} missing from the zoo table"
            assert f"### {m.id}" in text
    table_rows = [r for r in rows if r.count("|") >= 12]
    assert len(table_rows) == n_entries


def test_cli_reference_lists_every_command():
    import click
    import typer.main

    from rotationzoo.cli.main import app

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    root = typer.main.get_command(app)
    ctx = click.Context(root)
    for name in root.list_commands(ctx):
        assert f"`rotationzoo {name}`" in text, name
    for needle in ("rotationzoo serve-args", "--engine", "rotationzoo export", "--base-gguf"):
        assert needle in text


def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (site / "index.html").is_file() and (site / "zoo" / "index.html").is_file()


def test_every_list_of_exit_codes_names_sigterm() -> None:
    """Where the docs give 130 (interrupted) as an exit code, they give 143 (terminated by SIGTERM) too."""
    import re

    pages = [REPO / "README.md", DOCS / "quickstart.md", DOCS / "cli.md"]
    for page in pages:
        text = " ".join(page.read_text(encoding="utf-8").split())
        said = [m.start() for m in re.finditer(r"\b130 (?:when )?interrupted", text)]
        assert said, page
        for at in said:
            assert re.search(r"\b143\b[^.]{0,40}(?:SIGTERM|terminated)", text[at:at + 200]), (page, text[at:at + 200])
