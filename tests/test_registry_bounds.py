"""Registry overlays with impossible numbers are refused with one line, when loaded and by lint.

Every case is an overlay (``ROTATIONZOO_REGISTRY``) a user could write or download: a field of the
architecture, a file, the serving block, the calibration or the results set to a value no model
has (0, negatives, 10^9 layers, 2^70, strings, floats, NaN …), or a registry file that is not a
small JSON document. ``rotationzoo plan`` on it must fail with one ``error:`` line naming the field.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from rotationzoo.cli.main import main
from rotationzoo.errors import RegistryError
from rotationzoo.int2kv import MAX_CONTEXT_TOKENS
from rotationzoo.registry import load_registry
from rotationzoo.registry import bounds
from rotationzoo.registry.lint import lint_registry
from rotationzoo.registry.load import schema_path

GOOD: dict[str, Any] = {
    "registry_version": 1,
    "models": [{
        "id": "Test/Tiny",
        "aliases": ["tiny"],
        "architecture": {"num_layers": 4, "head_dim": 64, "num_kv_heads": 2, "num_attention_heads": 4,
                         "num_parameters": 1000, "weight_dtype": "bfloat16"},
        "default_tag": "t",
        "tags": {"t": {
            "objectives": {"k": "qqt", "v": "sst"},
            "serving": {"group_size": 64},
            "calibration": {"dataset": "x", "tokens": 10, "prompts": 1},
            "results": [{"benchmark": "b", "bf16": 1.0, "oscar_int2": 0.9}],
            "files": {s: {"path": f"Tiny/t/{s}_rotation.pt", "sha256": None, "size": None,
                          "sources": [{"type": "url", "url": f"https://example.invalid/{s}.pt"}]} for s in "kv"},
        }},
    }],
}

_DELETE = object()


def with_field(path: str, value: Any) -> dict[str, Any]:
    """``GOOD`` with the dotted ``path`` (under the model; ``tag.`` means its one tag) set to ``value``."""
    doc = copy.deepcopy(GOOD)
    node: Any = doc["models"][0]
    parts = path.replace("tag.", "tags.t.").split(".")
    for p in parts[:-1]:
        node = node[p]
    if value is _DELETE:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return doc


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "overlay.json"
    p.write_text(text, encoding="utf-8")
    return p


def plan_fails_with_one_line(capsys, monkeypatch, registry: Path | str) -> str:
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(registry))
    rc = main(["plan", "tiny", "--context", "100"])
    cap = capsys.readouterr()
    lines = [line for line in cap.err.splitlines() if line.strip()]
    assert rc == 1, (cap.out[-300:], cap.err[-300:])
    assert len(lines) == 1 and lines[0].startswith("error: "), cap.err
    assert "internal error" not in cap.err and "Traceback" not in cap.err
    assert len(lines[0]) < 500
    with pytest.raises(RegistryError):
        load_registry()
    return lines[0]


def test_the_good_overlay_plans(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(write(tmp_path, json.dumps(GOOD))))
    assert main(["plan", "tiny", "--context", "100"]) == 0
    assert "Test/Tiny@t" in capsys.readouterr().out
    assert lint_registry(GOOD).ok


HEAD = "architecture.head_dim must be one of 16, 32, 64, 128, 256, 512"
KV = "architecture.num_kv_heads must be an integer from 1 to 256"
LAYERS = "architecture.num_layers must be an integer from 1 to 1,024"
IDS = "architecture.attention_layer_ids"
HEADS = "architecture.num_attention_heads must be an integer from 1 to 4,096"
PARAMS = "architecture.num_parameters must be an integer from 1 to 1,000,000,000,000,000"
SIZE = "files.k.size must be an integer from 1 to 268,435,456"

# (field under the model, value, text the one line must hold)
FIELD_CASES: list[tuple[str, Any, str]] = [
    *[("architecture.head_dim", v, HEAD) for v in (0, -128, 100, 1024, "128", 128.0, True, None, [128])],
    ("architecture.head_dim", _DELETE, "architecture: head_dim is required"),
    *[("architecture.num_kv_heads", v, KV) for v in (-8, 0, 257, 10**9, "8", 8.0, True)],
    *[("architecture.num_layers", v, LAYERS) for v in (10**9, 0, -1, 1025, 1.5, "4", False)],
    ("architecture.attention_layer_ids", [-1], f"{IDS}[0] must be an integer from 0 to 3"),
    ("architecture.attention_layer_ids", [2**70], f"{IDS}[0] must be an integer from 0 to 3"),
    ("architecture.attention_layer_ids", [0, 4], f"{IDS}[1] must be an integer from 0 to 3"),
    ("architecture.attention_layer_ids", [1, 1], "distinct and increasing"),
    ("architecture.attention_layer_ids", [3, 1], "distinct and increasing"),
    ("architecture.attention_layer_ids", [0, "1"], f"{IDS}[1] must be an integer"),
    ("architecture.attention_layer_ids", [0.0], f"{IDS}[0] must be an integer"),
    ("architecture.attention_layer_ids", [], f"{IDS} must be a list of 1 to 1024 layer ids, got 0 items"),
    ("architecture.attention_layer_ids", "0,1", f"{IDS} must be a list"),
    ("architecture.attention_layer_ids", list(range(1025)), f"{IDS} must be a list of 1 to 1024 layer ids"),
    *[("architecture.num_attention_heads", v, HEADS) for v in (0, -4, 4097, "4")],
    ("architecture.num_attention_heads", 3, "num_attention_heads 3 is not a multiple of num_kv_heads 2"),
    *[("architecture.num_parameters", v, PARAMS) for v in (-1, 0, 10**16, 1.5e9, "1000")],
    ("architecture.weight_dtype", "int4", "architecture.weight_dtype must be one of"),
    ("architecture.num_experts", 8, "architecture: unknown key(s) 'num_experts'"),
    ("architecture", [64], "architecture must be an object"),
    *[("tag.files.k.size", v, SIZE) for v in (-1, 0, 2**40, 1.5, "12", True)],
    *[("tag.files.k.sha256", v, "is not 64 lowercase hex digits") for v in ("ABC", "A" * 64, 12)],
    *[("tag.serving.group_size", v, "group_size") for v in (8, 512, 0, -16, "128", 12, 1.0)],
    ("tag.serving.group_size", 128, "serving: group_size 128 is not valid for head_dim 64"),
    ("tag.serving.lloyd_max", True, "lloyd_max"),  # group 64 = head_dim is fine; see the next line
    *[("tag.serving.k_clip_ratio", v, "k_clip_ratio must be a finite number in [0, 1]") for v in (-0.1, 1.5, "0.9")],
    *[("tag.serving.prefix_tokens", v, "prefix_tokens must be an integer from 0 to 1,073,741,824")
      for v in (-1, MAX_CONTEXT_TOKENS + 1, 10**400, 2.0)],
    ("tag.serving.recent_tokens", 1.5, "recent_tokens must be an integer"),
    ("tag.serving", "fast", "expected an object of INT2-KV settings"),
    ("tag.serving.page", 8, "unknown key(s) page"),
    *[("tag.calibration.tokens", v, "calibration.tokens must be an integer from 0 to") for v in (-1, 2**41, "many")],
    ("tag.calibration.prompts", -5, "calibration.prompts must be an integer from 0"),
    *[("tag.calibration.group_size", v, "calibration.group_size must be an integer from 1 to 4,096") for v in (0, 5000)],
    ("tag.calibration.notes", 5, "calibration.notes must be a string"),
    ("tag.results", [{"benchmark": "b", "bf16": "high"}], "results[0].bf16 must be a finite number"),
    ("tag.results", [{"benchmark": "b", "oscar_int2": 1e300}], "results[0].oscar_int2 must be a finite number"),
    ("tag.results", "none", "results must be a list"),
]
# lloyd_max with group 64 = head_dim 64 is valid: drop that line from the refusals, keep it as a check below
FIELD_CASES = [c for c in FIELD_CASES if c[0] != "tag.serving.lloyd_max"]


def _id(case: Any) -> str:
    return "deleted" if case is _DELETE else str(case)[:40]


@pytest.mark.parametrize("field,value,message", FIELD_CASES, ids=[f"{f}={_id(v)}" for f, v, _ in FIELD_CASES])
def test_overlay_numbers_are_refused_with_one_line(capsys, monkeypatch, tmp_path, field, value, message) -> None:
    line = plan_fails_with_one_line(capsys, monkeypatch, write(tmp_path, json.dumps(with_field(field, value))))
    assert message in line, line


@pytest.mark.parametrize("field,value,message", FIELD_CASES, ids=[f"{f}={_id(v)}" for f, v, _ in FIELD_CASES])
def test_lint_applies_the_same_rules(field, value, message) -> None:
    rep = lint_registry(with_field(field, value))
    assert not rep.ok and any(message in e for e in rep.errors), rep.errors


def test_valid_edges_load(monkeypatch, tmp_path) -> None:
    doc = with_field("architecture.attention_layer_ids", [0, 3])
    doc["models"][0]["architecture"].update(num_kv_heads=256, num_attention_heads=4096, num_parameters=10**15)
    doc["models"][0]["tags"]["t"]["serving"].update(lloyd_max=True, prefix_tokens=MAX_CONTEXT_TOKENS)
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(write(tmp_path, json.dumps(doc))))
    m = load_registry().resolve("tiny")
    assert m.architecture.expected_layer_ids() == (0, 3) and m.tag().serving.lloyd_max
    assert lint_registry(doc).ok


# JSON that is not a number a registry may hold, as raw text
RAW_CASES = [
    ('"head_dim": 64', '"head_dim": NaN', "NaN is not a number a registry may hold"),
    ('"head_dim": 64', '"head_dim": Infinity', "Infinity is not a number"),
    ('"head_dim": 64', '"head_dim": -Infinity', "-Infinity is not a number"),
    ('"head_dim": 64', '"head_dim": 1e400', "too large"),
    ('"num_kv_heads": 2', '"num_kv_heads": ' + "9" * 5000, "not valid registry JSON"),
    ('"bf16": 1.0', '"bf16": NaN', "NaN is not a number"),
]


@pytest.mark.parametrize("old,new,message", RAW_CASES, ids=[n[:30] for _, n, _ in RAW_CASES])
def test_non_numbers_in_the_json_text(capsys, monkeypatch, tmp_path, old, new, message) -> None:
    text = json.dumps(GOOD)
    assert old in text
    line = plan_fails_with_one_line(capsys, monkeypatch, write(tmp_path, text.replace(old, new, 1)))
    assert message in line


def test_deeply_nested_json(capsys, monkeypatch, tmp_path) -> None:
    deep = '{"registry_version": 1, "models": [], "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    assert "nested too deeply" in plan_fails_with_one_line(capsys, monkeypatch, write(tmp_path, deep))
    nested = '{"registry_version": 1, "models": [], "x": ' + "[" * 40 + "]" * 40 + "}"
    assert f"at most {bounds.MAX_JSON_DEPTH} levels" in plan_fails_with_one_line(capsys, monkeypatch,
                                                                               write(tmp_path, nested))


def test_registry_files_that_are_not_small_regular_files(capsys, monkeypatch, tmp_path) -> None:
    assert "must be a regular file" in plan_fails_with_one_line(capsys, monkeypatch, "/dev/zero")
    big = write(tmp_path, json.dumps(GOOD) + " " * bounds.MAX_REGISTRY_BYTES)
    assert "over the 16,777,216-byte limit" in plan_fails_with_one_line(capsys, monkeypatch, big)
    (tmp_path / "bin.json").write_bytes(b'{"models": ["\xff"]}')
    assert "not UTF-8" in plan_fails_with_one_line(capsys, monkeypatch, tmp_path / "bin.json")
    folder = tmp_path / "folder.json"
    folder.mkdir()
    assert "must be a regular file" in plan_fails_with_one_line(capsys, monkeypatch, folder)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_registry_is_refused_without_blocking(capsys, monkeypatch, tmp_path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert "must be a regular file" in plan_fails_with_one_line(capsys, monkeypatch, fifo)


def test_the_schema_states_the_same_bounds() -> None:
    """registry.schema.json's limits are the constants the loader checks (one rule, written twice)."""
    from rotationzoo.int2kv import HEAD_DIMS, allowed_group_sizes

    schema = json.loads(schema_path().read_text())
    arch = schema["$defs"]["architecture"]["properties"]
    assert arch["head_dim"]["enum"] == list(bounds.REGISTRY_HEAD_DIMS)
    assert arch["num_layers"]["maximum"] == bounds.MAX_LAYERS
    assert arch["attention_layer_ids"]["items"]["maximum"] == bounds.MAX_LAYERS - 1
    assert arch["attention_layer_ids"]["maxItems"] == bounds.MAX_LAYERS
    assert arch["num_kv_heads"]["maximum"] == bounds.MAX_KV_HEADS
    assert arch["num_attention_heads"]["maximum"] == bounds.MAX_ATTENTION_HEADS
    assert arch["num_parameters"]["maximum"] == bounds.MAX_PARAMETERS
    assert arch["moe_intermediate_size"]["maximum"] == bounds.MAX_INTERMEDIATE
    assert arch["weight_block_size"]["maximum"] == bounds.MAX_WEIGHT_BLOCK
    assert arch["gguf_architecture"]["pattern"] == bounds.GGUF_ARCHITECTURE.pattern
    tag = schema["$defs"]["tag"]["properties"]
    serving = tag["serving"]["properties"]
    assert serving["group_size"]["enum"] == sorted({g for d in HEAD_DIMS for g in allowed_group_sizes(d)})
    assert serving["prefix_tokens"]["maximum"] == serving["recent_tokens"]["maximum"] == MAX_CONTEXT_TOKENS
    assert (serving["k_clip_ratio"]["minimum"], serving["k_clip_ratio"]["maximum"]) == (0, 1)
    calib = tag["calibration"]["properties"]
    assert calib["tokens"]["maximum"] == calib["prompts"]["maximum"] == bounds.MAX_COUNT
    assert schema["$defs"]["file"]["properties"]["size"]["maximum"] == bounds.MAX_FILE_BYTES


def test_the_bundled_registry_is_within_bounds() -> None:
    assert len(load_registry()) >= 10  # every bundled entry loads under the bounds
