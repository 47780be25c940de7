"""The package's layering and size rules, read from the source (no import needed).

Lower layers (registry, format, validation, hub, kernels, fit and the floor modules) never import
the higher ones (api, pair, serving, export, publish, evaluate, integrations, cli) — not even inside
a function. Modules stay small enough to read in one sitting.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rotationzoo"
LOWER = ("errors", "config", "dtypes", "hashing", "safefile", "hadamard", "vocab", "numbers", "kvformat", "int2kv", "recipe",
         "launch", "progress", "headdims", "registry", "files.format", "files.rotation_set", "sharding", "files.validation",
         "files.limits", "files.archive", "files.schema", "files.stheader", "files.manifest", "hub", "kernels", "fit",
         "files.latent", "files.artefacts")
HIGHER = ("api", "files.pair", "files.localpair", "files.calibrated", "files.pairfile", "engines", "planner", "serving",
          "files.derived", "export", "publish", "evaluate", "demo", "integrations", "workflows", "cli", "mla", "serving_mla",
          "launchspec")
MAX_MODULE_LINES = 500
#: Modules allowed past the limit, with the reason.
LONG_MODULES: dict[str, str] = {}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_statements(path: Path, package_root: Path = PACKAGE, *, typing_blocks: bool = True
                      ) -> list[tuple[str, tuple[str, ...]]]:
    """Every import of ``path``, at any depth of the file, as ``(absolute module, names imported from it)``
    (``()`` for ``import x``); ``typing_blocks=False`` leaves out ``if TYPE_CHECKING:`` blocks (they never run).
    The one reading of import statements that the layer and circle checks share."""
    name = module_name(path, package_root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if typing_blocks else {
        id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body for n in ast.walk(stmt)}
    out: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if node.level else []
            out.append((".".join(base + ([node.module] if node.module else [])), tuple(a.name for a in node.names)))
    return out


def imports_of(path: Path, package_root: Path = PACKAGE) -> set[str]:
    """Every ``rotationzoo`` module ``path`` imports, at any depth of the file, ``TYPE_CHECKING`` blocks included
    (absolute names; ``from m import x`` gives ``m`` and ``m.x``)."""
    out: set[str] = set()
    for target, names in import_statements(path, package_root):
        if target.startswith("rotationzoo"):
            out.add(target)
            out.update(f"{target}.{n}" for n in names)
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) > 2 and parts[1] == "files":
        return ".".join(parts[1:3])
    return parts[1] if len(parts) > 1 else None


def lower_layer_violations(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        mod = module_name(path, package)
        if layer_of(mod) not in LOWER:
            continue
        for target in sorted(imports_of(path, package)):
            if layer_of(target) in HIGHER:
                bad.append(f"{mod} imports {target}")
    return bad


def test_every_module_is_in_a_layer() -> None:
    layers = {layer_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {None, "_version", "files"}
    assert layers <= set(LOWER) | set(HIGHER), layers - set(LOWER) - set(HIGHER)


def test_lower_layers_never_import_higher_ones() -> None:
    assert lower_layer_violations() == []


def test_the_layer_check_catches_a_function_level_import(tmp_path) -> None:
    """The rule is not vacuous: a hub module importing api inside a function is reported."""
    fake = tmp_path / "rotationzoo"
    (fake / "hub").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "hub" / "__init__.py").write_text("")
    (fake / "hub" / "fetch.py").write_text("def f():\n    from ..api import load\n    return load\n")
    (fake / "registry.py").write_text("import rotationzoo.serving\n")
    (fake / "api.py").write_text("from .hub import fetch\n")
    assert lower_layer_violations(fake) == [
        "rotationzoo.hub.fetch imports rotationzoo.api", "rotationzoo.hub.fetch imports rotationzoo.api.load",
        "rotationzoo.registry imports rotationzoo.serving",
    ]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the modules it imports at any depth (function-level imports too, ``TYPE_CHECKING`` blocks not:
    they never run). ``from .pkg import name`` counts as an import of the module ``pkg.name`` when that is
    a module, of ``pkg`` (its ``__init__``) otherwise; a module's own ancestors (packages Python imports
    before it anyway) are left out."""
    mods = {module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        targets: set[str] = set()
        for target, names in import_statements(path, package, typing_blocks=False):
            subs = {f"{target}.{n}" for n in names} & set(mods)
            targets.update(subs)
            if len(subs) < len(names) or not names:
                targets.add(target)
        deps = set()
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != mod and not mod.startswith(t + "."):
                deps.add(t)
        graph[mod] = deps
    return graph


def import_circles(package: Path = PACKAGE) -> list[list[str]]:
    """Every set of modules that import each other, directly or around a longer loop (Tarjan's
    strongly connected components of :func:`import_graph` with more than one module)."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles() -> None:
    """Imports go one way: no two modules (or longer loops) import each other, lazily or not."""
    assert import_circles() == []


def test_the_circle_check_sees_function_level_and_package_imports(tmp_path) -> None:
    """Not vacuous: a lazy import closing a loop is reported, and so is a loop through a package's ``__init__``."""
    fake = tmp_path / "rotationzoo"
    (fake / "registry").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "registry" / "__init__.py").write_text("from .model import Entry\n")
    (fake / "registry" / "model.py").write_text("from .bounds import check\nclass Entry: ...\n")
    (fake / "registry" / "bounds.py").write_text("def check():\n    from .model import Entry\n    return Entry\n")
    (fake / "format.py").write_text("from .registry import Entry\n")
    (fake / "sharding.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from .format import x\n")
    (fake / "validation.py").write_text("from . import format\n")
    assert import_circles(fake) == [["rotationzoo.registry.bounds", "rotationzoo.registry.model"]]
    (fake / "registry" / "model.py").write_text("from ..format import y\nclass Entry: ...\n")
    assert import_circles(fake) == [["rotationzoo.format", "rotationzoo.registry", "rotationzoo.registry.model"]]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_are_small(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if module_name(path) in LONG_MODULES:
        return
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by job"
