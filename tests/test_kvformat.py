"""KV formats as one type: names, the one bits-per-element formula, what each format reads back, the
decode-time simulation of each, and ``eval`` over a formats × rotations grid."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rotationzoo.errors import CLIError, ConfigError, EvaluationError  # noqa: E402
from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.kernels import fake_quantize_int2  # noqa: E402
from rotationzoo.kernels.formats import fake_quantize_format  # noqa: E402
from rotationzoo.kvformat import KVFormat, parse_format  # noqa: E402

NAMES = ["bf16", "fp8", "fp8-row", "fp8-g32-bf16", "int4-g64-bf16", "int3-g64-bf16", "int2-g64-bf16", "int2",
         "int2-g16-fp32", "int2-lm", "int2-g64-bf16-w64+256-c0.96/0.92-bisect", "int4-g64-bf16-w0+0-c0/0", "kivi2",
         "kivi4-g32-r128-fp16", "kivi2-g16-r32-bf16-hpfp32", "int3-g32-fp16-w4+8-c0.9/0.9", "bf16-w64+256",
         "int2-g64-bf16-int3:0/1/29", "int2-int4:3", "int3-g32-int4:0"]


@pytest.mark.parametrize("name", NAMES)
def test_names_read_back(name) -> None:
    fmt = parse_format(name)
    assert parse_format(fmt.name) == fmt and str(fmt) == fmt.name
    assert KVFormat.from_json(fmt.to_json()) == fmt == KVFormat.from_json({"name": fmt.name})


@pytest.mark.parametrize("bad", ["int5", "int2-g", "fp16", "kivi3", "int2-w64", "int2-c2/0.9", "kivi2-g48-r128",
                                 "int4-lm", "", "int2-int3:", "int2-int3:0/x", "int3-int3:0", "int4-int3:1",
                                 "kivi2-int3:0", "int2-fp8:0"])
def test_not_a_format_is_one_line(bad) -> None:
    with pytest.raises(ConfigError) as info:
        parse_format(bad)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name, d, context, want", [
    ("int2-g16-fp32", 64, 8192, 6.39),   # SmolLM2's earlier default: 2 + 64/16 bits, 320 BF16 window tokens
    ("int2-g64-bf16", 64, 8192, 3.03),   # the authors' budget at head_dim 64, with the windows
    ("int3-g64-bf16", 64, 8192, 3.99),
    ("int4-g64-bf16", 64, 8192, 4.95),
    ("int2-bf16", 128, 131072, 2.2836),  # the paper's 2.28
    ("kivi2", 128, 32768, 3.0254),       # KIVI-2, G 32, R 128 (kv-formats.md: 3.03)
    ("fp8", 64, 8192, 8.0),
    ("fp8-row", 128, 4096, 8.25),        # vLLM's per-token-head FP8: one fp32 scale per row
    ("bf16", 64, 100, 16.0),
])
def test_one_bits_per_element_formula(name, d, context, want) -> None:
    assert parse_format(name).bits_per_element(d, context) == pytest.approx(want, abs=5e-3)


def test_mixed_code_widths_per_layer() -> None:
    fmt = parse_format("int2-g64-bf16-int3:29/0/1/1")
    assert fmt.wide_layers == (0, 1, 29) and fmt.name == "int2-g64-bf16-w64+256-c0.96/0.92-int3:0/1/29"
    # 27 layers at 2 + 32/64 bits, 3 at 3 + 32/64, 320 BF16 window tokens of 8,192 in every layer
    want = (27 * ((8192 - 320) * 2.5 + 320 * 16) + 3 * ((8192 - 320) * 3.5 + 320 * 16)) / 8192 / 30
    assert fmt.bits_per_element(64, 8192, 30) == pytest.approx(want, rel=1e-12)
    assert want == pytest.approx(3.1234, abs=1e-4)
    assert fmt.layer_format(29) == parse_format("int3-g64-bf16")
    assert fmt.layer_format(2) == parse_format("int2-g64-bf16")
    assert parse_format("int4").layer_format(3) == parse_format("int4")
    for args in ((64, 8192), (64, 8192, 2)):
        with pytest.raises(ConfigError, match="number of cached layers") as info:
            fmt.bits_per_element(*args)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="simulation only"):
        Int2KVConfig.from_format(fmt)
    with pytest.raises(ConfigError, match="both wide_code and wide_layers"):
        KVFormat(wide_layers=(1,))
    with pytest.raises(ConfigError, match="quantize per layer or KV head; pass fmt.layer_format"):
        fake_quantize_format(torch.randn(1, 1, 4, 64), fmt, "k")
    assert KVFormat.from_json(json.loads(json.dumps(fmt.to_json()))) == fmt


def test_mixed_code_widths_per_kv_head() -> None:
    fmt = parse_format("int2-g64-bf16-int3:23.2/18.1/7")
    assert fmt.wide_layers == (7,) and fmt.wide_heads == ((18, 1), (23, 2)) and fmt.mixed
    assert fmt.name == "int2-g64-bf16-w64+256-c0.96/0.92-int3:7/18.1/23.2" and parse_format(fmt.name) == fmt
    assert fmt.wide_heads_of(18) == (1,) and fmt.wide_heads_of(7) == () and fmt.wide_heads_of(3) == ()
    assert fmt.layer_format(18) == fmt.narrow_format() == parse_format("int2-g64-bf16")
    assert fmt.layer_format(7) == fmt.wide_format() == parse_format("int3-g64-bf16")
    # 30 layers x 3 KV heads = 90 units; layer 7 (3 heads) and two single heads are 3-bit
    narrow = ((8192 - 320) * 2.5 + 320 * 16) / 8192
    wide = ((8192 - 320) * 3.5 + 320 * 16) / 8192
    assert fmt.bits_per_element(64, 8192, 30, 3) == pytest.approx((85 * narrow + 5 * wide) / 90, rel=1e-12)
    # six heads cost what two whole layers cost
    six = parse_format("int2-g64-bf16-int3:18.0/18.1/18.2/23.0/23.1/23.2")
    assert six.bits_per_element(64, 8192, 30, 3) == pytest.approx(
        parse_format("int2-g64-bf16-int3:18/23").bits_per_element(64, 8192, 30), rel=1e-12)
    for args in ((64, 8192, 30), (64, 8192, 30, 2)):
        with pytest.raises(ConfigError, match="number of KV heads") as info:
            fmt.bits_per_element(*args)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="number of KV heads|num_kv_heads"):
        fmt.bits_per_element(64, 8192, 30, 2.5)
    with pytest.raises(ConfigError, match="layer 18 is widened whole and by KV head"):
        parse_format("int2-g64-int3:18/18.1")
    for bad in ("x", ((1,),), ((1, "a"),), ((-1, 0),)):
        with pytest.raises(ConfigError, match="wide_heads"):
            KVFormat(wide_code="int3", wide_heads=bad)
    with pytest.raises(ConfigError, match="simulation only"):
        Int2KVConfig.from_format(fmt)
    assert KVFormat.from_json(json.loads(json.dumps(fmt.to_json()))) == fmt


def test_mixed_widths_per_kv_head_route_each_head() -> None:
    """A widened KV head reads back the wide format's rows and only that head changes: its query heads'
    error is the wide format's, the other heads' the base format's (layer 0 sees the same inputs in every run)."""
    from rotationzoo.integrations.transformers import OscarKV, oscar_kv

    model = _tiny()
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2))

    def errors(name: str) -> dict[tuple[int, int], float]:
        oscar = OscarKV(None, None, kv_format=parse_format(name))
        with torch.no_grad(), oscar_kv(model, oscar, collect_errors=True) as kv:
            model(ids, use_cache=False)
            return kv.head_errors()

    heads = model.config.num_key_value_heads
    assert heads >= 2
    base, wide = errors("int2-g32-w2+4"), errors("int3-g32-w2+4-c0/0")
    mixed = errors("int2-g32-w2+4-int3:0.1")
    assert mixed[(0, 1)] == wide[(0, 1)] and wide[(0, 1)] < base[(0, 1)]
    assert all(mixed[(0, h)] == base[(0, h)] for h in range(heads) if h != 1)
    whole = "/".join(f"0.{h}" for h in range(heads))
    assert {k: v for k, v in errors(f"int2-g32-w2+4-int3:{whole}").items() if k[0] == 0} == {
        k: v for k, v in errors("int2-g32-w2+4-int3:0").items() if k[0] == 0}
    later = errors("int2-g32-w2+4-int3:1.1")  # a head of layer 1 only: layer 0 as the base format
    assert all(later[(0, h)] == base[(0, h)] for h in range(heads)) and later[(1, 1)] != base[(1, 1)]
    oscar = OscarKV(None, None, kv_format=parse_format(f"int2-g32-w2+4-int3:0.{heads}"))
    with torch.no_grad(), oscar_kv(model, oscar), pytest.raises(EvaluationError, match=f"widens KV head 0.{heads}, "
                                                                f"but layer 0 has {heads} KV heads") as info:
        model(ids, use_cache=False)
    assert "\n" not in str(info.value)


def test_mixed_widths_route_each_layer_to_its_format() -> None:
    """A layer's attention error under mixed widths is that of its own format: layer 0 sees the same inputs
    in every run, so its error is the base format's when layer 1 is widened and the wide format's when it is."""
    from rotationzoo.integrations.transformers import OscarKV, oscar_kv

    model = _tiny()
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(2))

    def errors(name: str) -> dict[int, float]:
        oscar = OscarKV(None, None, kv_format=parse_format(name))
        with torch.no_grad(), oscar_kv(model, oscar, collect_errors=True) as kv:
            model(ids, use_cache=False)
            return kv.layer_errors()

    base, wide = errors("int2-g32-w2+4"), errors("int3-g32-w2+4-c0/0")
    first, second = errors("int2-g32-w2+4-int3:1"), errors("int2-g32-w2+4-int3:0")
    assert first[0] == base[0] and second[0] == wide[0] and wide[0] < base[0]
    assert first[1] != base[1] and errors("int2-g32-w2+4-int3:0/1") == wide
    oscar = OscarKV(None, None, kv_format=parse_format("int2-g32-w2+4-int3:1"))
    with torch.no_grad(), oscar_kv(model, oscar) as kv, pytest.raises(EvaluationError, match="one code width per cache"):
        model(ids, **kv.cache_kwargs())


def test_int2kvconfig_is_one_format() -> None:
    cfg = Int2KVConfig(group_size=64, scale_dtype="bfloat16", k_clip_ratio=0.9, recent_tokens=128, lloyd_max=False)
    fmt = cfg.kv_format()
    assert Int2KVConfig.from_format(fmt) == cfg and fmt.name == "int2-g64-bf16-w64+128-c0.9/0.92"
    for ctx in (1, 100, 321, 8192, 131072):
        assert cfg.bits_per_element(64, ctx) == fmt.bits_per_element(64, ctx)
    with pytest.raises(ConfigError, match="not an INT2 store"):
        Int2KVConfig.from_format(parse_format("int4-g64"))


# -- what each format reads back -----------------------------------------------------------------


def _rows(seed: int = 0, t: int = 96) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 3, t, 64, generator=g)
    x[..., 5] *= 8  # an outlier channel, as keys have
    return x


def test_int2_rows_are_the_kernels_values() -> None:
    x = _rows()
    fmt = parse_format("int2-g16-bf16-c0.96/0.92")
    for side in "kv":
        want = fake_quantize_int2(x, config=Int2KVConfig.from_format(fmt), side=side, backend="torch")
        assert torch.equal(fake_quantize_format(x, fmt, side, backend="torch"), want)


def test_the_widened_quantizer_at_two_bits_is_the_int2_reference() -> None:
    """INT3/INT4 use the INT2 quantizer with more levels: at 2 bits it gives the reference's values, bit for bit."""
    from rotationzoo.kernels.formats import _uniform
    from rotationzoo.kernels.layout import clip_index
    from rotationzoo.kernels.reference import clip_rows, fake_quantize_rows

    rows = _rows().reshape(-1, 64)
    fmt = parse_format("int2-g16-fp16")
    ours = _uniform(clip_rows(rows, clip_index(0.92, 64)), 16, 2, fmt)
    ref = fake_quantize_rows(rows, clip_index=clip_index(0.92, 64), group_size=16, lloyd_max=False,
                             scale_dtype=torch.float16)
    assert torch.equal(ours, ref)


def test_more_bits_less_error() -> None:
    x = _rows()
    err = {n: float((fake_quantize_format(x, parse_format(n), "v") - x).norm() / x.norm())
           for n in ("int2-g64-bf16-c0/0", "int3-g64-bf16", "int4-g64-bf16", "fp8-row", "bf16")}
    assert err["int2-g64-bf16-c0/0"] > err["int3-g64-bf16"] > err["int4-g64-bf16"] > err["fp8-row"] > err["bf16"] > 0
    assert err["int4-g64-bf16"] < 0.2 * err["int2-g64-bf16-c0/0"]


def test_fp8_is_the_e4m3_cast() -> None:
    x = _rows() * 100  # past 448: saturates as the engines' conversion does
    got = fake_quantize_format(x, parse_format("fp8"), "k", dtype=torch.float32)
    assert torch.equal(got, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    row = fake_quantize_format(x, parse_format("fp8-row"), "k")
    torch.testing.assert_close(row.abs().amax(-1), x.abs().amax(-1), rtol=1e-6, atol=0)  # the row's max maps to ±448


def test_kivi_keys_per_channel_values_per_token() -> None:
    x = _rows(t=100)
    fmt = parse_format("kivi2-g32-r64")
    k, v = fake_quantize_format(x, fmt, "k"), fake_quantize_format(x, fmt, "v")
    assert torch.equal(k[:, :, 96:], x[:, :, 96:])  # the last, partial token group: never quantized
    # a channel that is constant over a token group is exact for keys (its range is 0), not for values
    y = x.clone()
    y[:, :, :32, 7] = 1.25
    assert torch.equal(fake_quantize_format(y, fmt, "k")[:, :, :32, 7], y[:, :, :32, 7])
    assert k.shape == v.shape == x.shape and not torch.equal(v, x)
    assert 4 == len(torch.unique(fake_quantize_format(x, fmt, "v")[0, 0, 0, :32]))  # 2 bits per value group


# -- the simulation of each read rule --------------------------------------------------------------


def _qkv(seed: int = 3, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, length, 16, generator=g) for h in (4, 2, 2))
    return q, k, v, k + 0.2 * torch.randn(k.shape, generator=g), v + 0.2 * torch.randn(v.shape, generator=g)


@pytest.mark.parametrize("prefix, recent", [(4, 8), (0, 0), (10, 40)])
def test_the_general_rule_is_the_window_rule(prefix, recent) -> None:
    from rotationzoo.integrations.transformers.simulate import simulated_attention, simulated_int2_attention

    q, k, v, kq, vq = _qkv()
    a = simulated_int2_attention(q, k, v, kq, vq, prefix=prefix, recent=recent, scale=0.25)
    b = simulated_attention(q, k, v, kq, vq, prefix=prefix, scale=0.25, block=48,
                            boundaries=lambda i: (i - recent, i - recent))
    torch.testing.assert_close(a, b, atol=2e-6, rtol=0)


@pytest.mark.parametrize("residual", [1, 5, 16, 32])
def test_kivi_rule_is_kivis_decode_order(residual) -> None:
    """A token-by-token cache written from KIVI's decode step (jy-yuan/KIVI ``models/llama_kivi.py``): append
    the new key and value to the full-precision residual, attend, and only then quantize a full residual of
    ``R`` keys and the oldest of ``R + 1`` values. The simulation, the exposure count and the shortest window
    that reads a quantized key must agree with it."""
    from rotationzoo.evaluate.protocol import int2_keys, min_int2_window
    from rotationzoo.integrations.transformers.simulate import kivi_boundaries, simulated_attention

    q, k, v, kq, vq = _qkv()
    got = simulated_attention(q, k, v, kq, vq, prefix=0, scale=0.25, block=40,
                              boundaries=lambda i: kivi_boundaries(i, residual))
    fmt = parse_format(f"kivi2-g{residual}-r{residual}")
    keys_q: list = []  # what the cache holds: quantized history, then the full-precision residual
    values_q: list = []
    keys_r: list = []
    values_r: list = []
    first_read = None
    for i in range(q.shape[2]):
        keys_r.append(k[:, :, i])  # 1. the new token joins the residual
        values_r.append(v[:, :, i])
        kk = torch.stack(keys_q + keys_r, 2).repeat_interleave(2, 1)  # 2. attention over what is held now
        vv = torch.stack(values_q + values_r, 2).repeat_interleave(2, 1)
        want = torch.softmax(q[:, :, i:i + 1] @ kk.transpose(-1, -2) * 0.25, -1) @ vv
        torch.testing.assert_close(got[:, :, i:i + 1], want, atol=2e-6, rtol=0)
        assert int2_keys(torch.tensor([i]), fmt).item() == len(keys_q)
        if keys_q and first_read is None:
            first_read = i
        if len(keys_r) == residual:  # 3. then a full residual of keys is quantized ...
            keys_q += [kq[:, :, len(keys_q) + n] for n in range(residual)]
            keys_r = []
        if len(values_r) > residual:  # ... and the oldest of R + 1 values
            values_q.append(vq[:, :, len(values_q)])
            values_r.pop(0)
    assert first_read == residual and min_int2_window(fmt) == first_read + 2  # scored positions: 0 … n − 2


def test_kivi_keeps_its_residual_in_fp16() -> None:
    """KIVI's code keeps the residual (and its scale/min) in fp16; ``-hp…`` names another dtype."""
    fmt = parse_format("kivi2")
    assert fmt.hp_dtype == "float16" and fmt.name == "kivi2-g32-r128-fp16" == parse_format(fmt.name).name
    bf = parse_format("kivi2-g32-r128-fp16-hpbf16")
    assert bf.hp_dtype == "bfloat16" and bf.name == "kivi2-g32-r128-fp16-hpbf16" and parse_format(bf.name) == bf
    assert bf == fmt.replace(hp_dtype="bfloat16") and KVFormat.from_json(bf.to_json()) == bf
    assert bf.bits_per_element(128, 32768) == fmt.bits_per_element(128, 32768)  # both 16-bit


# -- the model, every format -----------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny():
    from test_evaluate import tiny_llama

    return tiny_llama()


def test_the_cache_refuses_a_format_it_does_not_store() -> None:
    from rotationzoo.integrations.transformers import OscarKV, oscar_kv

    model = _tiny()
    ids = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(1))
    oscar = OscarKV(None, None, kv_format=parse_format("int4-g32-w2+4"))
    with torch.no_grad(), oscar_kv(model, oscar) as kv:
        model(ids, use_cache=False)  # the simulation evaluates any format
        with pytest.raises(EvaluationError, match="int4-g32-bf16-w2\\+4-c0/0 is evaluated by the decode-time "
                                                  "simulation only") as info:
            model(ids, **kv.cache_kwargs())
    assert "\n" not in str(info.value)


def test_evaluate_a_formats_grid(tmp_path) -> None:
    from rotationzoo.evaluate import EvalProtocol, MethodSpec, evaluate, formats_grid, plot_report
    from test_evaluate import random_pair

    model = _tiny()
    ids = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    fmts = [parse_format(n) for n in ("int2-g32-bf16-w4+8", "int4-g32-bf16-w4+8", "fp8-row", "kivi2-g16-r32")]
    specs = formats_grid([MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard(),
                          MethodSpec.from_source("rand", random_pair())], fmts)
    assert [s.name for s in specs[:3]] == ["fp", "none@int2-g32-bf16-w4+8-c0.96/0.92", "none@int4-g32-bf16-w4+8-c0/0"]
    report = evaluate(model, ids, specs, Int2KVConfig(), EvalProtocol(block_tokens=32, resamples=100))
    by = {r.method: r for r in report.results}
    for f in fmts:
        had, rand = by[f"hadamard@{f.name}"], by[f"rand@{f.name}"]
        assert rand.baseline == had.method and rand.vs_baseline["kl"].delta == pytest.approx(rand.kl - had.kl)
        assert rand.bpe == pytest.approx(f.bits_per_element(64, 256)) and rand.format == f.name
        assert rand.vs_fp["kl"].delta == pytest.approx(rand.kl) and rand.vs_fp["kl"].lo <= rand.kl
        assert had.draws == 0 and had.vs_baseline is None
    kl = {f.name: by[f"none@{f.name}"].kl for f in fmts}
    assert kl["int4-g32-bf16-w4+8-c0/0"] < kl["int2-g32-bf16-w4+8-c0.96/0.92"] and kl["fp8-row"] < kl["kivi2-g16-r32-fp16"]
    assert by["none@kivi2-g16-r32-fp16"].exposure["pairs"] > 0.5
    if pytest.importorskip("matplotlib"):
        assert plot_report(report, tmp_path / "frontier.png").stat().st_size > 10_000


def test_cli_eval_formats(tmp_path, capsys) -> None:
    from rotationzoo.cli.main import main
    from test_evaluate import _save_tiny

    folder, text = _save_tiny(tmp_path)
    args = ["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none,hadamard", "--context", "300",
            "--formats", "int2-g32-bf16-w4+8,int4-g32-w4+8,fp8,kivi2-g16-r32,served", "-g", "32",
            "--prefix-tokens", "4", "--recent-tokens", "8", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in data["results"]}
    assert len(rows) == 1 + 2 * 5 and rows["fp"]["format"] is None
    assert rows["none@int2-g32-fp32-w4+8-c0.96/0.92"]["bpe"] == pytest.approx(
        Int2KVConfig(group_size=32, prefix_tokens=4, recent_tokens=8).bits_per_element(64, 300))
    assert rows["none@fp8"]["bpe"] == 8.0 and rows["none@fp8"]["baseline"] == "hadamard@fp8"
    assert main([*args[:-3], "--formats", "int5", "--json"]) == 2
    assert "not a KV format name" in capsys.readouterr().out
    mixed = ["--methods", "none,hadamard", "--formats"]
    assert main([*args[:-3], *mixed, "int2-g32-w4+8-int3:1,int2-g32-w4+8-int4:7", "--json"]) == 1
    assert "widens layer(s) 7, but the model caches layers 0, 1" in capsys.readouterr().out
    assert main([*args[:-3], *mixed, "int2-g32-w4+8-int3:1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][-1]
    assert row["format"] == "int2-g32-bf16-w4+8-c0.96/0.92-int3:1"
    assert row["bpe"] == pytest.approx(parse_format(row["format"]).bits_per_element(64, 300, 2))
    assert row["bpe"] > rows["none@int2-g32-bf16-w4+8-c0.96/0.92"]["bpe"]
    assert main([*args[:-3], *mixed, "int2-g32-w4+8-int3:1.9", "--json"]) == 1
    assert "widens KV head(s) 1.9, but the model's layers have 2 KV heads (0 to 1)" in capsys.readouterr().out
    assert main([*args[:-3], *mixed, "int2-g32-w4+8-int3:1.0", "--error-windows", "1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["results"][-1]
    assert row["format"] == "int2-g32-bf16-w4+8-c0.96/0.92-int3:1.0"
    assert rows["none@int2-g32-bf16-w4+8-c0.96/0.92"]["bpe"] < row["bpe"] < parse_format(
        "int2-g32-w4+8-int3:1").bits_per_element(64, 300, 2)
    assert row["bpe"] == pytest.approx(parse_format(row["format"]).bits_per_element(64, 300, 2, 2))
    assert sorted(row["head_errors"]) == ["0.0", "0.1", "1.0", "1.1"] and sorted(row["layer_errors"]) == ["0", "1"]


def test_parse_formats_served_and_twice() -> None:
    from rotationzoo.workflows import parse_formats

    served = Int2KVConfig(group_size=16)
    assert parse_formats("served,int4", served) == [served.kv_format(), parse_format("int4")]
    assert parse_formats(None, served) == []
    with pytest.raises(CLIError, match="twice"):
        parse_formats("int4,int4-bf16-w64+256", served)


def test_registry_results_and_info_carry_bits(capsys) -> None:
    from rotationzoo.cli.main import main
    from rotationzoo.registry import get_entry

    entry = get_entry("SmolLM2-135M-Instruct")
    with_context = [r for r in entry.results if r.context]
    assert with_context and all(r.context == 8192 for r in with_context)
    assert entry.bits_per_element(8192) == entry.serving.bits_per_element(64, 8192)
    assert main(["info", "SmolLM2-135M-Instruct", "--json"]) == 0
    tag = json.loads(capsys.readouterr().out)["tag"]
    assert tag["format"] == entry.serving.kv_format().name
    assert tag["results"][0]["bits_per_element"] == pytest.approx(entry.bits_per_element(8192))
    assert main(["info", "SmolLM2-135M-Instruct"]) == 0
    out = capsys.readouterr().out
    format_line = next(line for line in out.splitlines() if line.startswith("format:"))
    assert f"{entry.bits_per_element(8192):.2f} bits/element (8,192 tokens)" in out and "bits/element" in format_line
