"""The engine table is all data: nothing outside ``rotationzoo/engines/`` branches on an engine's name.

Page sizes, planner notes, preparation steps (llama.cpp's GGUF), what ``--model-path`` names, which
knobs and file kinds a target takes: each is a field of :class:`rotationzoo.engines.EngineTarget`, and
callers (``serving``, ``planner``, the CLI) read the fields. This test reads the package's source and
fails on any comparison with an engine name (``e == "llamacpp"``, ``name in ("vllm", …)``,
``engine.startswith("sglang")``) outside the engines package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from rotationzoo.engines import TARGETS, target
from rotationzoo.planner import engine_page_size, plan
from rotationzoo.vocab import ENGINES

PACKAGE = Path(__file__).resolve().parents[1] / "rotationzoo"
#: every engine name, and the prefixes a branch could test (``sglang`` for both SGLang targets)
NAMES = frozenset(ENGINES) | {"llama", "llama.cpp", "llama-cpp"}


def _is_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(e) for e in node.elts)
    return False


def engine_name_branches(package: Path = PACKAGE) -> list[str]:
    """``file:line`` of each comparison with an engine name, or ``startswith``/``endswith`` of one, outside engines/."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "engines":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and any(_is_name(x) for x in [node.left, *node.comparators]):
                out.append(f"{rel}:{node.lineno}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("startswith", "endswith") and any(_is_name(a) for a in node.args)):
                out.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.match_case) and _is_name(getattr(node.pattern, "value", None) or ast.Pass()):
                out.append(f"{rel}:{node.lineno}")
    return out


def test_no_module_outside_engines_branches_on_an_engine_name() -> None:
    assert engine_name_branches() == []


def test_the_check_finds_a_branch(tmp_path) -> None:
    pkg = tmp_path / "rotationzoo"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "engines" / "x.py").write_text('ok = "vllm" == e\n')  # inside engines/: allowed
    (pkg / "serving.py").write_text('def f(e):\n    if e == "llamacpp":\n        return 1\n'
                                    '    return e.startswith("sglang") or e in ("vllm", "x")\n')
    assert engine_name_branches(pkg) == ["serving.py:2", "serving.py:4", "serving.py:4"]


def test_page_sizes_and_plan_notes_come_from_the_table() -> None:
    for name, t in TARGETS.items():
        assert engine_page_size(name, "bfloat16") == t.page_size("bfloat16")
        assert target(name) is t
    assert [engine_page_size(e) for e in ("sglang", "sglang-legacy", "vllm", "vllm-prototype", "llamacpp")] == \
        [8, 8, 16, 16, 1]
    p = plan("Qwen3-8B", context=4096, engine="llamacpp")
    assert p.page_size == 1 and any("q2_0" in n for n in p.notes)


def test_a_target_names_the_architectures_it_serves() -> None:
    """The llama.cpp branch rotates the cache in its dense-Qwen3 and Gemma-4 graphs only; other targets take any
    model."""
    assert dict(target("llama.cpp").architectures or {}).keys() == {"qwen3", "gemma4"}
    assert target("llamacpp").to_json()["architectures"] == ["qwen3", "gemma4"]
    assert [n for n, t in TARGETS.items() if t.architectures is not None] == ["llamacpp"]
