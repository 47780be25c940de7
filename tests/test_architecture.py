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
LOWER = ("errors", "config", "dtypes", "hashing", "safefile", "hadamard", "vocab", "numbers", "kvformat", "int2kv", "launch", "progress", "headdims", "registry",
         "format", "rotation_set", "sharding", "validation",
         "_inspect", "_schema", "_stheader", "hub", "kernels", "fit", "latent", "artefacts")
HIGHER = ("api", "pair", "localpair", "calibrated", "pairfile", "engines", "planner", "serving", "derived", "export", "publish", "evaluate", "demo",
          "integrations", "workflows", "cli", "mla", "serving_mla", "launchspec")
MAX_MODULE_LINES = 500
#: Modules allowed past the limit, with the reason.
LONG_MODULES: dict[str, str] = {}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package_root: Path = PACKAGE) -> set[str]:
    """Every ``rotationzoo`` module ``path`` imports, at any depth of the file (absolute names)."""
    name = module_name(path, package_root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rotationzoo"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("rotationzoo"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
    return out


def layer_of(module: str) -> str | None:
    parts = module.split(".")
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
    layers = {layer_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {None, "_version"}
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


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_are_small(path: Path) -> None:
    lines = len(path.read_text(encoding="utf-8").splitlines())
    if module_name(path) in LONG_MODULES:
        return
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines; split it by job"
