"""The memory planner: formula, page rounding, capacity, the real INT2 cache to the byte, and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers import run_cli, with_cache

from rotationzoo.cli.main import main
from rotationzoo.errors import ConfigError, RegistryError
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.planner import parse_size, plan
from rotationzoo.registry import Architecture, get_model
from rotationzoo.registry.load import parse_model

QWEN3_8B_ELEMS = 2 * 36 * 8 * 128  # K+V elements of one token, all layers
GIB = 2**30


def _cli_json(capsys, *args: str) -> dict:
    code, out, err = run_cli(capsys, "plan", *args, "--json")
    assert code == 0, err
    return json.loads(out)


# -- the formula -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype,int2_bits,bpe_128k", [("float32", 2.5, 2.5330), ("bfloat16", 2.25, 2.2836)])
def test_qwen3_8b_cli_json_matches_the_documented_formula(capsys, scale_dtype, int2_bits, bpe_128k) -> None:
    """2.5 (fp32) / 2.25 (16-bit) bits per INT2 element at G = 128; with the paper's 64 + 256 BF16 window
    tokens the 16-bit layout is its 2.28 at 128K tokens."""
    out = _cli_json(capsys, "--model", "Qwen3-8B", "--context", "131072", "--scale-dtype", scale_dtype,
                    "--prefix-tokens", "64", "--recent-tokens", "256")
    int2 = out["formats"]["oscar_int2"]
    assert out["layers_with_kv"] == 36 and out["group_size"] == 128 and out["page_size"] == 8
    assert int2["bytes_per_token"] * 8 == QWEN3_8B_ELEMS * int2_bits
    want = (131072 - 320) * QWEN3_8B_ELEMS * int2_bits / 8 + 320 * QWEN3_8B_ELEMS * 2
    assert int2["sequence_bytes"] == want == int2["sequence_bytes_paged"] == int2["batch_bytes"]
    assert int2["window_tokens"] == 320
    assert int2["bits_per_element"] == pytest.approx(int2_bits + 320 * (16 - int2_bits) / 131072, rel=1e-12)
    assert round(int2["bits_per_element"], 4) == bpe_128k
    assert out["formats"]["bf16"]["sequence_bytes"] == 131072 * QWEN3_8B_ELEMS * 2
    assert out["formats"]["fp8"]["sequence_bytes"] == 131072 * QWEN3_8B_ELEMS
    if scale_dtype == "bfloat16":
        assert round(int2["bits_per_element"], 2) == 2.28


@pytest.mark.parametrize("context", [1, 63, 64, 100, 320, 321, 4099, 131072])
@pytest.mark.parametrize("config", [Int2KVConfig(), Int2KVConfig(group_size=32, scale_dtype="float16"),
                                    Int2KVConfig(prefix_tokens=0, recent_tokens=8, hp_dtype="float32")])
def test_bits_per_element_is_the_configs(context, config) -> None:
    p = plan("Qwen3-8B", context=context, config=config)
    assert p.format("oscar_int2").bits_per_element == pytest.approx(config.bits_per_element(128, context), rel=1e-12)
    assert p.format("bf16").bits_per_element == 16.0 and p.format("fp8").bits_per_element == 8.0


def test_hybrid_models_count_only_attention_layers() -> None:
    arch = Architecture(head_dim=256, num_layers=32, attention_layer_ids=tuple(range(3, 32, 4)), num_kv_heads=4)
    p = plan(arch, context=1000)
    assert p.layers_with_kv == 8 and p.model == "custom"
    assert p.format("bf16").bytes_per_token == 2 * 8 * 4 * 256 * 2
    with pytest.raises(ConfigError, match="num_kv_heads"):
        plan("Qwen3.5-4B", context=1000)  # the registry does not give its KV heads


def test_group_size_must_divide_head_dim() -> None:
    with pytest.raises(ConfigError, match="not valid for head_dim 64; expected one of 64, 32, 16"):
        plan("SmolLM2-135M-Instruct", context=100, config=Int2KVConfig(group_size=128))


# -- pages and capacity ----------------------------------------------------------------------------


@pytest.mark.parametrize("engine,hp_dtype,page", [("sglang", "bfloat16", 8), ("sglang", "float32", 16),
                                                   ("vllm", "bfloat16", 16), ("llama.cpp", "bfloat16", 1)])
def test_page_rounding(engine, hp_dtype, page) -> None:
    context = 131075  # not a whole number of pages
    p = plan("Qwen3-8B", context=context, engine=engine, config=Int2KVConfig(group_size=128, hp_dtype=hp_dtype))
    assert p.page_size == page
    bf16, int2 = p.format("bf16"), p.format("oscar_int2")
    assert bf16.sequence_bytes == context * bf16.bytes_per_token
    assert bf16.sequence_bytes_paged == math.ceil(context / page) * page * bf16.bytes_per_token
    int2_tokens = math.ceil((context - 320) / page) * page
    assert int2.sequence_bytes_paged == int2_tokens * int2.bytes_per_token + 320 * int2.window_bytes_per_token
    assert int2.sequence_bytes == (context - 320) * int2.bytes_per_token + 320 * int2.window_bytes_per_token


def test_capacity_is_the_largest_whole_page_count_that_fits() -> None:
    gpu = 80 * GIB
    p = plan("Qwen3-8B", context=131072, batch=4, gpu_memory_bytes=gpu)
    assert p.weights_bytes == 8_200_000_000 * 2 and p.weights_source == "8.2B parameters × bfloat16"
    assert p.kv_budget_bytes == int(gpu * 0.9) - p.weights_bytes
    for f in p.formats:
        assert f.max_sequences == p.kv_budget_bytes // f.sequence_bytes_paged
        assert f.max_context % p.page_size == 0
        at = plan("Qwen3-8B", context=f.max_context, batch=4, gpu_memory_bytes=gpu).format(f.name)
        over = plan("Qwen3-8B", context=f.max_context + p.page_size, batch=4, gpu_memory_bytes=gpu).format(f.name)
        assert at.fits and not over.fits, f.name
    # the entry's 128 + 2048 windows (docs/plan.md's worked example)
    assert p.format("oscar_int2").max_sequences == 18 and p.format("bf16").max_sequences == 3


def test_weights_override_missing_weights_and_reserve() -> None:
    p = plan("Qwen3-8B", context=1024, gpu_memory_bytes=80 * GIB, weights_bytes=10 * GIB, reserve=0.0)
    assert p.kv_budget_bytes == 70 * GIB and p.weights_source == "given"
    nothing = plan("Qwen3-8B", context=1024, gpu_memory_bytes=16 * GIB)
    assert all(f.max_sequences == 0 and f.max_context == 0 and f.fits is False for f in nothing.formats)
    assert any("weights alone exceed" in n for n in nothing.notes)
    arch = Architecture(head_dim=128, num_layers=2, num_kv_heads=1)
    with pytest.raises(ConfigError, match="weights"):
        plan(arch, context=10, gpu_memory_bytes=GIB)
    assert plan(arch, context=10).format("bf16").max_sequences is None  # no GPU: no capacities


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("141G", 141 * 10**9),
                                        ("80000MiB", 80000 * 2**20), ("1.5 TiB", 3 * 2**39), ("4096", 4096),
                                        ("80gib", 80 * 2**30)])
def test_parse_size(text, value) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "80 GiBs", "GiB", "-1GB", "0", "80Gi"])
def test_parse_size_rejects(text) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


# -- the registry fields ---------------------------------------------------------------------------


def test_registry_weights() -> None:
    assert get_model("Qwen3-8B").architecture.num_parameters == 8_200_000_000
    assert get_model("GLM-4.7-FP8").architecture.weight_dtype == "float8"
    assert get_model("SmolLM2-135M-Instruct").architecture.num_parameters == 134_515_008
    assert get_model("Qwen3.5-4B").architecture.num_parameters is None
    assert plan("GLM-4.7-FP8", context=8).weights_bytes == 358_000_000_000  # one byte per FP8 parameter


@pytest.mark.parametrize("arch,match", [({"num_parameters": 10}, "needs weight_dtype"),
                                        ({"num_parameters": 10, "weight_dtype": "int3"}, "weight_dtype must be"),
                                        ({"num_parameters": 1.5, "weight_dtype": "bfloat16"}, "integer")])
def test_registry_rejects_bad_weights(arch, match) -> None:
    raw = {"id": "a/b", "architecture": {"head_dim": 64, **arch}, "default_tag": "t",
           "tags": {"t": {"objectives": {"k": "x", "v": "x"}, "serving": {},
                          "files": {s: {"path": f"{s}.pt", "sha256": None, "size": None,
                                        "sources": [{"type": "url", "url": "https://x/y"}]} for s in "kv"}}}}
    with pytest.raises(RegistryError, match=match):
        parse_model(raw, "test", "bundled")


# -- the real cache, to the byte -------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    None,  # the SmolLM2 entry's serving settings: G16, fp16 scale/zero, 64 + 256 BF16 windows
    Int2KVConfig(group_size=None, scale_dtype="float32", prefix_tokens=64, recent_tokens=256),
    Int2KVConfig(group_size=32, scale_dtype="bfloat16", prefix_tokens=8, recent_tokens=24, hp_dtype="float32"),
])
def test_int2_bytes_equal_the_transformers_cache(config) -> None:
    """OscarInt2Cache.nbytes() of a SmolLM2-shaped random Llama after a prompt longer than the windows
    (plus decode steps) equals the planner's unrounded INT2 bytes, batch of two."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rotationzoo.integrations.transformers import OscarKV, oscar_kv

    entry = get_model("SmolLM2-135M-Instruct").tag()
    cfg = config or entry.serving
    layers = 3  # SmolLM2's attention shape (9 heads, 3 KV heads, d 64) on fewer layers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=576, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=1024)).eval()
    ids = torch.randint(3, 96, (2, 400), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), oscar_kv(model, OscarKV(None, None, config=cfg)) as kv:
        cache = kv.new_cache()
        model(ids[:, :390], **with_cache(cache))
        for t in range(390, 400):
            model(ids[:, t:t + 1], **with_cache(cache))
    arch = Architecture(head_dim=64, num_layers=layers, num_kv_heads=3)
    p = plan(arch, context=400, batch=2, config=cfg)
    assert cache.nbytes() == p.format("oscar_int2").batch_bytes
    assert cache.bits_per_element() == pytest.approx(p.format("oscar_int2").bits_per_element, rel=1e-12)
    full = plan(entry, context=400, config=cfg)  # the real model's 30 layers scale the same bytes
    assert full.format("oscar_int2").sequence_bytes * layers == p.format("oscar_int2").sequence_bytes * 30


# -- the command -----------------------------------------------------------------------------------


def test_cli_table_and_errors(capsys) -> None:
    assert main(["plan", "Qwen3-8B", "--context", "131072", "--gpu-memory", "80GiB", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "OSCAR INT2" in out and "23,040" in out and "5.87×" in out and "56.73 GiB" in out
    assert main(["plan", "--model", "Qwen3-8B"]) == 2  # a usage error
    assert "--context" in capsys.readouterr().err
    assert main(["plan", "Qwen3-8B", "--context", "10", "--gpu-memory", "80 GiBs"]) == 2  # a usage error
    assert "cannot read the size" in capsys.readouterr().err


def test_cli_overrides_and_weights(capsys) -> None:
    out = _cli_json(capsys, "-m", "Qwen3-8B@longbench-seq150000_prompt44_group128", "-c", "4096", "-g", "64",
                    "--prefix-tokens", "0", "--recent-tokens", "16", "--gpu-memory", "80GB", "--weights-gib", "10",
                    "--reserve", "0.2", "--engine", "vllm")
    assert out["tag"] == "longbench-seq150000_prompt44_group128" and out["engine"] == "vllm"
    assert out["config"]["group_size"] == 64 and out["config"]["prefix_tokens"] == 0
    assert out["formats"]["oscar_int2"]["window_tokens"] == 16 and out["page_size"] == 16
    assert out["kv_budget_bytes"] == int(80e9 * 0.8) - 10 * GIB


def test_plan_command_imports_nothing_heavy() -> None:
    heavy = ("torch", "transformers", "numpy", "huggingface_hub", "safetensors")
    code = ("import sys; from rotationzoo.cli.main import main; "
            "rc = main(['plan', 'Qwen3-8B', '--context', '4096', '--gpu-memory', '80GiB', '--json']); assert rc == 0; "
            f"print(','.join(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip().splitlines()[-1:] in ([], [""]), f"imported: {r.stderr.strip()}"


def test_engine_help_lists_every_engine_plan_accepts(capsys) -> None:
    """``--engine`` lists the engine vocabulary it accepts (it had listed 3 of the 5)."""
    import click
    import typer.main

    from rotationzoo.cli.main import app
    from rotationzoo.vocab import ENGINES

    plan_cmd = typer.main.get_command(app).commands["plan"]  # type: ignore[attr-defined]
    help_text = next(p.help for p in plan_cmd.params if isinstance(p, click.Option) and "--engine" in p.opts)
    assert len(ENGINES) == 5 and " | ".join(ENGINES) in help_text, help_text
    for engine in ENGINES:
        code, out, err = run_cli(capsys, "plan", "Qwen3-8B", "-c", "4096", "--engine", engine, "--json")
        assert code == 0 and json.loads(out)["engine"] == engine, err


def test_plan_takes_a_tag_as_the_command_does() -> None:
    """plan(model, tag) picks that tag's serving settings (as ``--tag`` and ``MODEL@TAG``); the two disagreeing, or a
    tag beside an entry that has its own, is refused in one line."""
    m = get_model("SmolLM2-135M-Instruct")
    other = next(t for t in m.tags if t != m.default_tag)
    want = plan(f"SmolLM2-135M-Instruct@{other}", context=8192)
    assert want.tag == other != plan("SmolLM2-135M-Instruct", context=8192).tag
    for got in (plan("SmolLM2-135M-Instruct", other, context=8192), plan(m, tag=other, context=8192),
                plan(f"SmolLM2-135M-Instruct@{other}", other, context=8192)):
        assert got.to_json() == want.to_json()
    with pytest.raises(ConfigError, match="name different tags"):
        plan(f"SmolLM2-135M-Instruct@{other}", m.default_tag, context=8192)
    with pytest.raises(ConfigError, match="a TagEntry is one tag already"):
        plan(m.tag(), other, context=8192)
    with pytest.raises(ConfigError, match="a bare Architecture has no tags"):
        plan(m.tag().architecture, other, context=8192)
