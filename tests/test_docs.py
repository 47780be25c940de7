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


def _architecture_names() -> set[str]:
    """Modules docs/architecture.md's module table names: ``pkg/mod`` in a row's module cell, or ``mod`` in
    backticks in the job cell of a package's row (``kernels/``: ``native``, ``ops``, …)."""
    import re

    table = (DOCS / "architecture.md").read_text(encoding="utf-8").split("## Modules", 1)[1]
    named: set[str] = set()
    for row in (line for line in table.splitlines() if line.startswith("| `")):
        module_cell, job = row.split("|")[1], "|".join(row.split("|")[2:])
        for name in re.findall(r"`([^`]+)`", module_cell):
            named.add(name.rstrip("/"))
            if name.endswith("/"):
                named.update(f"{name}{short}" for short in re.findall(r"`([a-z_][a-z0-9_]*)`", job))
    return named


def test_the_architecture_table_names_every_module() -> None:
    """docs/architecture.md's table had left out 25 modules (fit/refine, hub/pins, registry/latent, kernels/decode,
    …): every module of the package is named (the CLI's command files by its row: one file per command group)."""
    package = REPO / "rotationzoo"
    modules = {str(p.relative_to(package).with_suffix("")) for p in package.rglob("*.py")
               if p.name != "__init__.py" and not p.name.startswith("_version")}
    missing = sorted(m for m in modules if m not in _architecture_names() and not m.startswith("cli/"))
    assert not missing, f"docs/architecture.md: add rows for {', '.join(missing)}"


def test_python_paths_in_the_docs_exist() -> None:
    """docs/registry.md named ``rotationzoo.registry.LatentSet``, which is ``rotationzoo.registry.model.LatentSet``:
    every ``rotationzoo.<module>.<name>`` the docs quote resolves (keys such as ``rotationzoo.tag`` of a GGUF, whose
    first part is no module of the package, are not Python paths)."""
    import importlib
    import re

    import rotationzoo

    package = REPO / "rotationzoo"
    wrong = []
    for page in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for ref in sorted(set(re.findall(r"`(rotationzoo(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`", page.read_text("utf-8")))):
            parts = ref.split(".")
            if not ((package / parts[1]).is_dir() or (package / f"{parts[1]}.py").is_file()
                    or hasattr(rotationzoo, parts[1])):
                continue
            n = len(parts)
            while True:  # the longest importable prefix, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:n]))
                    break
                except ImportError:
                    n -= 1
            for attr in parts[n:]:
                if not hasattr(obj, attr):
                    wrong.append(f"{page.name}: {ref}")
                    break
                obj = getattr(obj, attr)
    assert not wrong, wrong


def test_concepts_says_what_the_bundled_default_holds() -> None:
    """concepts.md said one R_K and one R_V per layer are shared by all KV heads; the bundled default holds one per
    KV head, with key centering, refined: the page says so, with its real shape, and links to fitting.md."""
    pytest.importorskip("torch")
    import rotationzoo

    pair = rotationzoo.load("SmolLM2-135M-Instruct")
    text = " ".join((DOCS / "concepts.md").read_text(encoding="utf-8").split())
    shape = list(pair.k.rotations.shape)
    assert len(shape) == 4 and f"`{shape}`" in text, shape
    assert pair.k.k_mean is not None and f"`{list(pair.k.k_mean.shape)}`" in text and "`k_mean`" in text
    assert pair.k.objective.startswith("refined") and "fitting.md#learned-refinement" in text
    assert "fitting.md#per-kv-head-rotations" in text and "fitting.md#centering" in text


def _help(capsys, *argv: str) -> str:
    from rotationzoo.cli.main import main

    assert main([*argv, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())


def test_export_help_names_every_tensor_a_safetensors_export_writes(tmp_path, capsys) -> None:
    """``export --help`` said the safetensors file holds ``(fp32 [d, d]) and eigenvalues``; the bundled default's
    export holds [H_kv, d, d] rotations and k_mean: every field a pair file may hold, and the shape, are named."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from rotationzoo.cli.main import main
    from rotationzoo.files.schema import LAYER_FIELDS

    out = tmp_path / "pair.safetensors"
    assert main(["export", "SmolLM2-135M-Instruct", "--to", "safetensors", "--out", str(out), "--offline"]) == 0
    capsys.readouterr()
    help_text = _help(capsys, "export").replace("│", " ")
    help_text = " ".join(help_text.split())
    with safe_open(str(out), framework="pt") as f:
        keys = list(f.keys())
        ranks = {f.get_slice(k).get_shape().__len__() for k in keys if k.endswith(".rotation")}
    written = {k.split(".", 2)[2] for k in keys}
    assert {"rotation", "k_mean"} <= written  # what this test is about
    for field in LAYER_FIELDS:  # written or not by this pair, a pair file may hold it
        assert field in help_text, field
    for side, _, field in (k.split(".", 2) for k in keys):
        if field != "eigenvalues":
            assert f"{side}.<layer>.{field}" in help_text, (side, field)
    assert ranks == {3} and "[H_kv, d, d]" in help_text


def test_cache_import_help_says_how_an_imported_pair_is_removed(tmp_path, capsys) -> None:
    """``cache import --help`` said ``cache ls, verify and rm know them``, but ``cache rm --model NAME`` refuses
    an imported name (only --all removes it, docs/fetching.md): the help says so, and that is what happens."""
    pytest.importorskip("torch")
    from rotationzoo.cli.main import main

    cache = tmp_path / "cache"
    assert main(["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64",
                 "--out", str(tmp_path / "h2")]) == 0
    assert main(["cache", "import", str(tmp_path / "h2"), "--name", "mine", "--cache-dir", str(cache)]) == 0
    assert main(["cache", "rm", "--model", "mine", "--dry-run", "--cache-dir", str(cache)]) != 0
    capsys.readouterr()
    assert main(["cache", "rm", "--all", "--dry-run", "--cache-dir", str(cache)]) == 0
    assert "imported/mine/k_rotation_hadamard.pt" in capsys.readouterr().out.replace("\\", "/")
    help_text = _help(capsys, "cache", "import")
    assert "verify and rm know them" not in help_text
    assert "cache rm removes them with --all only, not with --model" in help_text
    fetching = " ".join((DOCS / "fetching.md").read_text(encoding="utf-8").split())
    assert "pairs under `imported/` go with `--all` only" in fetching
