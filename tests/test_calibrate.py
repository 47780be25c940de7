"""Calibration from a live transformers model: Q/K/V capture, streaming fit, SGLang-layout dump.

The model is a tiny randomly initialised ``LlamaForCausalLM`` built here from a ``LlamaConfig`` and
saved with ``save_pretrained``, with a word-level tokenizer built offline; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from rotationzoo import read_rotation, validate  # noqa: E402
from rotationzoo.errors import DumpError, FitError, ModelLoadError  # noqa: E402
from rotationzoo.fit import Refinement, fit_rotations, open_dump, samples_from_dump  # noqa: E402
from rotationzoo.integrations.transformers import (  # noqa: E402
    WARMUP_TOKENS,
    QKVCapture,
    calibrate,
    capture_to_dump,
    collect_statistics,
    load_model,
    token_windows,
)

WORDS = ("the a of and to in is was for on that with as by at from it an be this are or which his her "
         "model cache key value query head layer token rotation group").split()
HQ, HKV, D, LAYERS = 8, 2, 32, 2


def _tiny_model_dir(root: Path, head_dim: int = D, words: tuple[int, int] = (700, 400)) -> Path:
    """A tiny random Llama (``save_pretrained``) with a word-level tokenizer and two calibration texts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=head_dim, max_position_embeddings=4096,
    )
    LlamaForCausalLM(cfg).save_pretrained(root)
    fast.save_pretrained(root)
    rng = random.Random(0)
    (root / "calib_a.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words[0])), encoding="utf-8")
    (root / "calib_b.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words[1])), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return _tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir)


def _manual_qkv(model, input_ids: torch.Tensor, layer: int = 0):
    """Post-RoPE q/k/v of a Llama layer, computed directly from the module weights."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[layer]
        blk = model.model.layers[layer]
        x = blk.input_layernorm(hidden)
        b, s, _ = x.shape
        q = blk.self_attn.q_proj(x).view(b, s, -1, D).transpose(1, 2)
        k = blk.self_attn.k_proj(x).view(b, s, -1, D).transpose(1, 2)
        v = blk.self_attn.v_proj(x).view(b, s, -1, D).transpose(1, 2)
        pos = torch.arange(s).unsqueeze(0)
        cos, sin = model.model.rotary_emb(x, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), out.logits


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_capture_records_post_rope_qkv_and_keeps_outputs(tiny, impl):
    model, _ = tiny
    model.set_attn_implementation(impl)
    try:
        ids = torch.randint(3, 20, (1, 17), generator=torch.Generator().manual_seed(1))
        q_ref, k_ref, v_ref, logits_ref = _manual_qkv(model, ids)
        seen: dict[int, tuple] = {}
        with QKVCapture(model, lambda lid, q, k, v: seen.__setitem__(lid, (q.clone(), k.clone(), v.clone()))):
            assert model.config._attn_implementation.startswith("rotationzoo_qkv_capture")
            with torch.no_grad():
                logits = model(input_ids=ids, use_cache=False).logits
        assert model.config._attn_implementation == impl
        assert sorted(seen) == list(range(LAYERS))
        q, k, v = seen[0]
        assert q.shape == (17, HQ, D) and k.shape == (17, HKV, D) and v.shape == (17, HKV, D)
        torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)  # causal mask kept
    finally:
        model.set_attn_implementation("sdpa")


def test_calibrate_writes_dump_that_fit_reproduces(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    res = calibrate(model, tokenizer, texts, tokens=900, seq_len=256, dump_out=tmp_path / "dump", model_id="tiny")
    assert res.layer_ids == tuple(range(LAYERS)) and res.tokens == {0: 900, 1: 900}
    assert res.prompts == 4  # 701 tokens of a → 256 + 256 + 189, then 199 of b
    assert (res.num_q_heads, res.num_kv_heads, res.head_dim) == (HQ, HKV, D)
    for rs in (res.k, res.v):
        validate(rs, num_layers=LAYERS, head_dim=D)
    # the dump follows the SGLang layout, with a warm-up chunk 0
    dump = open_dump(tmp_path / "dump")
    assert dump.chunk_ids(0) == (1, 2, 3, 4)
    assert dump.load(0, "q", 0).shape == (WARMUP_TOKENS, HQ, D)
    assert dump.load(1, "k", 3).shape == (189, HKV, D)
    assert dump.seq_lens(0, 2) == [256]
    info = json.loads((tmp_path / "dump" / "rotationzoo_dump.json").read_text())
    assert info["model"] == "tiny" and info["prompts"] == 4 and info["tokens"] == 900
    # fitting the dump gives the same rotations
    again = fit_rotations(tmp_path / "dump")
    assert again.tokens == res.tokens and again.prompts == 4 and again.model == "tiny"
    assert torch.equal(again.k.rotations, res.k.rotations) and torch.equal(again.v.rotations, res.v.rotations)
    # without a dump (K/V spilled to a temporary folder) the result is the same too
    direct = calibrate(model, tokenizer, texts, tokens=900, seq_len=256)
    assert torch.equal(direct.v.rotations, res.v.rotations) and torch.equal(direct.k.rotations, res.k.rotations)
    with pytest.raises(DumpError, match="already holds a dump"):
        calibrate(model, tokenizer, texts, tokens=300, seq_len=64, dump_out=tmp_path / "dump")


def test_an_interrupted_capture_leaves_a_dump_no_fit_takes(tiny, tiny_model_dir, tmp_path):
    """Ctrl-C half way through a capture: the chunks written stay, marked unfinished, and every reader
    refuses them (never fits fewer tokens than asked as if whole); capturing again over it finishes it."""
    model, tokenizer = tiny
    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    reports = []

    def interrupt(*args):  # the 3rd progress report stands for Ctrl-C
        reports.append(args)
        if len(reports) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        calibrate(model, tokenizer, texts, tokens=900, seq_len=256, dump_out=tmp_path / "dump", progress=interrupt)
    assert list((tmp_path / "dump").glob("layer_0/k/*.pt"))  # something was written
    for read in (lambda: open_dump(tmp_path / "dump"), lambda: fit_rotations(tmp_path / "dump")):
        with pytest.raises(DumpError, match="did not finish"):
            read()
    calibrate(model, tokenizer, texts, tokens=900, seq_len=256, dump_out=tmp_path / "dump", overwrite_dump=True)
    assert fit_rotations(tmp_path / "dump").tokens == {0: 900, 1: 900}


def test_statistics_keep_a_sample_reservoir_for_refinement(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    # windows of 701 → 256 + 256 + 189 tokens, then 199: two whole 256-token blocks per layer, one kept
    stats = collect_statistics(model, tokenizer, texts, tokens=900, seq_len=256, dump_out=tmp_path / "dump",
                               sample_tokens=256, sample_seed=5)
    assert stats.samples is not None and stats.samples.layer_ids() == (0, 1)
    s = stats.samples.layers[1]
    assert (s.num_blocks, s.blocks_seen, s.tokens_seen) == (1, 2, 900)
    q, k, v, pos = s.blocks()
    assert q.shape == (1, 256, HQ, D) and k.shape == v.shape == (1, 256, HKV, D) and pos.tolist() == [0]
    again = samples_from_dump(tmp_path / "dump", max_tokens=256, seed=5)  # the dump reader keeps the same blocks
    for x, y in zip(again.layers[1].blocks(), s.blocks()):
        assert torch.equal(x, y)
    none = collect_statistics(model, tokenizer, texts, tokens=300, seq_len=256, sample_tokens=0)
    assert none.samples is None
    res = calibrate(model, tokenizer, texts, tokens=900, seq_len=256, group_size=16,
                    refine=Refinement(loss="block", steps=3, init="oscar", sample_tokens=512))
    assert res.objective == "refined" and res.layer_ids == (0, 1) and res.refinement["init"] == "oscar"
    for rs in (res.k, res.v):
        validate(rs, num_layers=LAYERS, head_dim=D)
    with pytest.raises(FitError, match="qqt_sst"):
        calibrate(model, tokenizer, texts, tokens=300, objective="ktk_vtv", refine=Refinement(loss="block", steps=1))


def test_calibrate_with_grads_keeps_them_in_the_dump_and_the_samples(tiny, tiny_model_dir, tmp_path):
    """``grads``: every chunk of the dump (the warm-up too) gets its output gradients, the reservoir's blocks carry
    the same ones, a fisher refinement runs from either, and the model's weights get no gradient."""
    model, tokenizer = tiny
    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    stats = collect_statistics(model, tokenizer, texts, tokens=900, seq_len=256, dump_out=tmp_path / "dump",
                               sample_tokens=256, sample_seed=5, grads=True)
    dump = open_dump(tmp_path / "dump", keep_first_chunk=True)
    assert dump.has_grads(1) and dump.info()["grads"] == "nll"
    chunks = dump.chunk_ids(1, ("q", "k", "v", "g"))
    assert chunks == (0, 1, 2, 3, 4) and dump.load(1, "g", 0).shape == (WARMUP_TOKENS, HQ, D)
    assert all(float(dump.load(1, "g", c).abs().sum()) > 0 for c in chunks)
    last = dump.load(1, "g", 3)
    assert float(last[-1].abs().sum()) == 0.0 < float(last[-2].abs().sum())  # the last token predicts nothing
    kept = stats.samples.layers[1]
    again = samples_from_dump(tmp_path / "dump", max_tokens=256, seed=5, grads=True).layers[1]
    assert kept.grads() is not None and torch.equal(kept.grads(), again.grads())
    held = stats.samples.nbytes()
    stats.samples.drop_grads()
    assert kept.grads() is None and stats.samples.nbytes() == held - 2 * 256 * HQ * D * 2  # two layers, bf16
    assert all(p.grad is None for p in model.parameters())
    from rotationzoo.fit import refine_dump
    from rotationzoo.int2kv import Int2KVConfig

    fisher = Refinement(loss="fisher", steps=2, init="oscar", sample_tokens=256, block_size=128,
                        int2kv=Int2KVConfig(group_size=16, prefix_tokens=4, recent_tokens=16))
    for res in (calibrate(model, tokenizer, texts, tokens=900, seq_len=256, group_size=16, refine=fisher),
                refine_dump(tmp_path / "dump", fisher, group_size=16)):
        assert res.refinement["loss"] == {"k": "k_fisher_score", "v": "v_fisher_out"}
        for rs in (res.k, res.v):
            validate(rs, num_layers=LAYERS, head_dim=D)
    plain = capture_to_dump(model, [[1, 5, 6, 7, 8, 9], [3 + i % 30 for i in range(300)]], tmp_path / "plain")
    with pytest.raises(FitError, match="holds no output gradients"):
        refine_dump(plain, fisher, group_size=16)
    with pytest.raises(FitError, match="give dump_out or sample_tokens"):
        collect_statistics(model, tokenizer, texts, tokens=300, seq_len=256, sample_tokens=0, grads=True)


def test_cli_calibrate_grads_needs_a_dump(tiny_model_dir, tmp_path, capsys):
    from helpers import run_cli

    code, _, err = run_cli(capsys, "calibrate", "--model", str(tiny_model_dir), "--text",
                           str(tiny_model_dir / "calib_a.txt"), "--tokens", "300", "--out", str(tmp_path / "rot"), "--grads")
    assert code != 0 and "give dump_out (--dump-out DIR)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "rot").exists()


def test_calibrate_other_objectives(tiny, tiny_model_dir):
    model, tokenizer = tiny
    res = calibrate(model, tokenizer, [tiny_model_dir / "calib_a.txt"], tokens=300, seq_len=128,
                    objective="ktk_vtv", composition="r_pbr_hg", group_size=8)
    assert res.k.objective == "ktk_r_pbr_hg8" and res.v.objective == "vtv_r_pbr_hg8"
    with pytest.raises(FitError, match="objective must be"):
        calibrate(model, tokenizer, [tiny_model_dir / "calib_a.txt"], tokens=10, objective="hadamard")


def test_calibrate_kv_head_matches_the_dump_fit(tiny, tiny_model_dir, tmp_path):
    model, tokenizer = tiny
    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    for objective in ("qqt_sst", "ktk_vtv"):  # ktk/vtv are accumulated per KV head for this grouping
        dump = tmp_path / f"dump-{objective}"
        res = calibrate(model, tokenizer, texts, tokens=600, seq_len=256, objective=objective, dump_out=dump,
                        grouping="kv_head")
        again = fit_rotations(dump, objective, grouping="kv_head")
        assert res.grouping == "kv_head" and res.k.rotations.shape == (LAYERS, HKV, D, D)
        assert torch.equal(again.k.rotations, res.k.rotations) and torch.equal(again.v.rotations, res.v.rotations)
    with pytest.raises(FitError, match="unknown grouping"):
        calibrate(model, tokenizer, texts, tokens=10, grouping="head")


def test_capture_to_dump_budget(tiny, tmp_path):
    model, _ = tiny
    seqs = [[1, 5, 6, 7, 8, 9], [3 + i % 30 for i in range(37)], [3 + i % 30 for i in range(57)]]
    root = capture_to_dump(model, seqs, tmp_path / "d", token_budget=50, info={"model": "tiny"})
    dump = open_dump(root, keep_first_chunk=True)
    sizes = [dump.load(0, "q", c).shape[0] for c in dump.chunk_ids(0)]
    assert sizes == [6, 37, 7]  # the chunk that crosses the budget is truncated to fit exactly
    assert dump.seq_lens(0, 2) == [7]


def test_token_windows(tiny):
    _, tokenizer = tiny
    wins = list(token_windows(tokenizer, ["the a of " * 10, "model cache " * 5], tokens=35, seq_len=12))
    assert [len(w) for w in wins] == [12, 12, 7, 4]
    assert wins[0][0] == 1 and wins[3][0] == 1  # each text starts with BOS
    with pytest.raises(FitError):
        list(token_windows(tokenizer, ["x"], tokens=0, seq_len=4))


def test_load_model_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(tmp_path / "weights.bin")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)


def test_cli_calibrate_then_fit(tiny_model_dir, tmp_path):
    import typer
    from typer.testing import CliRunner

    from rotationzoo.cli import fit_cmds

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    fit_cmds.register(app)
    runner = CliRunner()
    r = runner.invoke(app, [
        "calibrate", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "calib_a.txt"),
        "--text", str(tiny_model_dir / "calib_b.txt"), "--tokens", "500", "--seq-len", "200",
        "--out", str(tmp_path / "rot"), "--dump-out", str(tmp_path / "dump"), "--tag", "t", "--json",
    ])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["result"]["tokens"] == 500 and report["result"]["model"] == tiny_model_dir.name
    m = json.loads((tmp_path / "rot" / "rotationzoo.json").read_text())
    assert m["model"] == tiny_model_dir.name and m["tag"] == "t" and m["source"]["kind"] == "transformers"
    r = runner.invoke(app, ["fit", "--dump", str(tmp_path / "dump"), "--out", str(tmp_path / "rot2")])
    assert r.exit_code == 0, r.output
    for name in ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"):
        a, b = read_rotation(tmp_path / "rot" / name), read_rotation(tmp_path / "rot2" / name)
        assert torch.equal(a.rotations, b.rotations) and torch.equal(a.eigenvalues, b.eigenvalues)
    # --refine: learned rotations from the samples kept during the capture (two 256-token blocks per layer)
    r = runner.invoke(app, [
        "calibrate", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "calib_a.txt"), "--tokens", "600",
        "--seq-len", "300", "--out", str(tmp_path / "rot3"), "--loss", "block", "--refine", "3", "--init", "r_pbr_hg", "-g", "16",
        "--sample-tokens", "512", "--seed", "2",
    ])
    assert r.exit_code == 0, r.output
    assert "keep rule skipped: give --keep-text FILE" in r.output
    m = json.loads((tmp_path / "rot3" / "rotationzoo.json").read_text())
    assert m["objective"] == "refined" and m["refinement"]["init_composition"] == "r_pbr_hg16"
    assert "keep" not in m["refinement"]
    assert m["refinement"]["seed"] == 2 and m["refinement"]["samples"]["max_tokens"] == 512
    assert read_rotation(tmp_path / "rot3" / "k_rotation_refined_k_logit_r_pbr_hg16.pt").layer_ids == (0, 1)


def test_calibrate_records_its_provenance_and_a_dump_fit_keeps_it(tiny_model_dir, tmp_path):
    import hashlib

    from typer.testing import CliRunner

    from rotationzoo.cli.main import app

    texts = [tiny_model_dir / "calib_a.txt", tiny_model_dir / "calib_b.txt"]
    r = CliRunner().invoke(app, [
        "calibrate", "--model", str(tiny_model_dir), "--text", str(texts[0]), "--text", str(texts[1]),
        "--tokens", "500", "--seq-len", "200", "--objective", "oscar2_center", "--model-revision", "0123abcd",
        "--out", str(tmp_path / "rot"), "--dump-out", str(tmp_path / "dump"),
    ])
    assert r.exit_code == 0, r.output
    _, tokenizer = load_model(tiny_model_dir)
    windows = list(token_windows(tokenizer, texts, tokens=500, seq_len=200, texts_are_paths=True))
    prompt = hashlib.sha256(json.dumps(windows, separators=(",", ":")).encode()).hexdigest()
    text = hashlib.sha256(b"".join(t.read_bytes() for t in texts)).hexdigest()
    k = read_rotation(tmp_path / "rot" / "k_rotation_oscar2_center.pt")
    cal = k.calibration
    assert cal["prompt_sha256"] == prompt and cal["text_sha256"] == text and cal["tokens"] == 500
    assert cal["model_revision"] == "0123abcd" and cal["model_path"] == tiny_model_dir.name
    assert cal["global_q_heads"] == HQ and cal["global_kv_heads"] == HKV and cal["post_rope"] is True
    assert read_rotation(tmp_path / "rot" / "v_rotation_oscar2_center.pt").calibration == cal
    r = CliRunner().invoke(app, ["fit", "--dump", str(tmp_path / "dump"), "--out", str(tmp_path / "again"),
                                 "--objective", "oscar2_center"])
    assert r.exit_code == 0, r.output
    again = read_rotation(tmp_path / "again" / "k_rotation_oscar2_center.pt")
    assert {key: again.calibration[key] for key in ("prompt_sha256", "text_sha256", "model_revision", "tokens")} == \
        {key: cal[key] for key in ("prompt_sha256", "text_sha256", "model_revision", "tokens")}
    assert torch.equal(again.rotations, k.rotations) and torch.equal(again.k_mean, k.k_mean)


def test_cli_calibrate_refine_keeps_what_the_model_judges_best(tmp_path):
    """calibrate --refine --loss served on 1,024-token blocks, then the keep rule on --keep-text (head_dim 64: the INT2 kernels' smallest; a 40-word vocabulary makes the value
    covariance rank-deficient, hence the Hadamard init); the manifest records the decision."""
    from typer.testing import CliRunner

    from rotationzoo.cli.main import app

    root = _tiny_model_dir(tmp_path / "m", head_dim=64, words=(2100, 1000))
    r = CliRunner().invoke(app, [
        "calibrate", "--model", str(root), "--text", str(root / "calib_a.txt"), "--tokens", "2048",
        "--seq-len", "1024", "--out", str(tmp_path / "rot"), "--refine", "2", "--init", "hadamard", "-g", "16",
        "--sample-tokens", "2048", "--grouping", "kv_head", "--keep-tokens", "900", "--keep-context", "512",
        "--keep-text", str(root / "calib_b.txt"),
    ])
    assert r.exit_code == 0, r.output
    assert "keep rule on " in r.output and "; kept " in r.output and "1 × 512-token windows" in r.output
    m = json.loads((tmp_path / "rot" / "rotationzoo.json").read_text())
    keep = m["refinement"]["keep"]
    assert keep["windows"] == 1 and keep["window"] == 512 and keep["source"] == "--keep-text"
    assert keep["tokens"] == 512 - 64 - 256 - 2  # one whole window; the 388 tokens after it are not scored
    assert m["refinement"]["samples"]["context"] == 1024
    assert keep["chosen"] == min(keep["kl"], key=lambda n: keep["kl"][n])
    assert m["refinement"]["loss"] == {"k": "k_served_score", "v": "v_served_out"}
    assert m["refinement"]["samples"]["block_size"] == 1024
    kept_k = keep["chosen"] in ("refined", "refined_k")  # a side kept at its init is named so
    name = "refined_k_served_score_hadamard" if kept_k else "refined_kept_init_hadamard"
    k = read_rotation(tmp_path / "rot" / f"k_rotation_{name}-kv_head.pt")
    assert k.rotations.shape == (LAYERS, HKV, 64, 64) and m["files"]["k"]["objective"] == name
    r = CliRunner().invoke(app, ["calibrate", "--model", str(root), "--text", str(root / "calib_a.txt"),
                                 "--tokens", "600", "--out", str(tmp_path / "x"), "--keep-text", str(root / "calib_b.txt")])
    assert r.exit_code == 1 and ("--keep-text / --keep-model / --keep-tokens / --keep-context / --keep-k-clip-ratio / "
                                 "--keep-v-clip-ratio judge --refine's result") in str(r.exception)
    # the keep window defaults to the calibration context (--seq-len): 900 tokens hold none, refused before loading
    r = CliRunner().invoke(app, ["calibrate", "--model", str(root), "--text", str(root / "calib_a.txt"),
                                 "--tokens", "2048", "--seq-len", "1024", "--out", str(tmp_path / "y"), "--refine", "2",
                                 "--keep-tokens", "900", "--keep-text", str(root / "calib_b.txt")])
    assert r.exit_code == 1 and "loading" not in r.output
    assert "--keep-tokens 900 is less than one keep window of 1024 tokens (the calibration context" in str(r.exception)
    r = CliRunner().invoke(app, ["calibrate", "--model", str(root), "--text", str(root / "calib_a.txt"),
                                 "--tokens", "2048", "--out", str(tmp_path / "y"), "--refine", "2",
                                 "--keep-context", "1024"])
    assert r.exit_code == 1 and "set the keep rule on --keep-text; add --keep-text FILE" in str(r.exception)


def test_cli_fit_refine_keep_window_is_the_dump_context(tmp_path):
    """fit --refine --keep-text judges whole windows as long as the dump's prompts (the context the refinement saw),
    and a held-out text shorter than one window is refused before the dump's activations are read."""
    from typer.testing import CliRunner

    from rotationzoo.cli.main import app
    from rotationzoo.fit import open_dump

    root = _tiny_model_dir(tmp_path / "m", head_dim=64, words=(2100, 1100))
    r = CliRunner().invoke(app, ["calibrate", "--model", str(root), "--text", str(root / "calib_a.txt"), "--tokens",
                                 "2048", "--seq-len", "1024", "--out", str(tmp_path / "rot"), "--dump-out",
                                 str(tmp_path / "dump")])
    assert r.exit_code == 0, r.output
    assert open_dump(tmp_path / "dump").context() == 1024
    refine = ["fit", "--dump", str(tmp_path / "dump"), "--refine", "2", "--init", "hadamard", "-g", "16",
              "--sample-tokens", "2048", "--grouping", "kv_head", "--keep-model", str(root)]
    r = CliRunner().invoke(app, [*refine, "--out", str(tmp_path / "refined"), "--keep-text", str(root / "calib_b.txt")])
    assert r.exit_code == 0, r.output
    keep = json.loads((tmp_path / "refined" / "rotationzoo.json").read_text())["refinement"]["keep"]
    assert keep["window"] == 1024 and keep["windows"] == 1 and keep["tokens"] == 1024 - 64 - 256 - 2
    short = tmp_path / "short.txt"
    short.write_text(" ".join(WORDS[:5] * 100), encoding="utf-8")  # 501 tokens
    r = CliRunner().invoke(app, [*refine, "--out", str(tmp_path / "none"), "--keep-text", str(short)])
    assert r.exit_code == 1 and not (tmp_path / "none").exists()
    assert "--keep-text holds 501 tokens, fewer than one keep window of 1024 (the calibration context" in str(r.exception)


# -- refused before the model loads (and before the capture) ---------------------------------------


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test if the tokenizer or the weights are loaded."""
    import rotationzoo.integrations.transformers as tr

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(tr, "load_model", refuse)
    monkeypatch.setattr(tr, "load_tokenizer", refuse)


@pytest.mark.parametrize("args,message", [
    (["--seq-len", "0"], "seq_len (--seq-len) must be an integer of at least 1 token, got 0; give a positive "
                         "--seq-len"),
    (["--seq-len", "-7"], "seq_len (--seq-len) must be an integer of at least 1 token, got -7"),
    (["--out", "FILE"], "output folder (--out) {file} exists and is not a folder; give a folder"),
    (["--dump-out", "FILE"], "dump folder (--dump-out) {file} exists and is not a folder"),
    (["--device", "bogus"], "device 'bogus' is not a torch device"),
    (["--dtype", "float8"], "unknown dtype 'float8'"),
])
def test_cli_calibrate_refuses_bad_options_before_the_model_loads(tiny_model_dir, tmp_path, capsys, nothing_loads,
                                                                   args, message):
    """--seq-len 0 was refused after the weight load; --out naming a file failed with FileExistsError after the
    whole capture; --device bogus with a RuntimeError after the weight load."""
    from helpers import run_cli

    file = tmp_path / "existing"
    file.write_text("x")
    argv = ["calibrate", "--model", str(tiny_model_dir), "--text", str(tiny_model_dir / "calib_a.txt"), "--tokens",
            "300", "--out", str(tmp_path / "rot"), *[str(file) if a == "FILE" else a for a in args]]
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "internal error" not in err, err
    assert message.format(file=file) in err, err
    assert file.read_text() == "x" and not (tmp_path / "rot").exists()


def test_calibrate_checks_its_sizes_and_output_folder_for_python_callers(tiny_model_dir, tmp_path, nothing_loads):
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import calibrate as calibrate_workflow

    text = [tiny_model_dir / "calib_a.txt"]
    for seq_len in (0, -7, 1.5, True):
        with pytest.raises(FitError, match=r"seq_len \(--seq-len\) must be an integer of at least 1 token"):
            calibrate_workflow(tiny_model_dir, text, FitRecipe(), tmp_path / "rot", tokens=300, seq_len=seq_len)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FitError, match="exists and is not a folder"):
        calibrate_workflow(tiny_model_dir, text, FitRecipe(), tmp_path / "file", tokens=300, seq_len=128)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(FitError, match="is a link to nothing"):
        calibrate_workflow(tiny_model_dir, text, FitRecipe(), tmp_path / "dangling", tokens=300, seq_len=128)
    with pytest.raises(FitError, match=r"file is not a folder; give a path in a folder"):
        calibrate_workflow(tiny_model_dir, text, FitRecipe(), tmp_path / "file" / "rot", tokens=300, seq_len=128)


def test_write_fitted_into_a_file_is_a_typed_error(tmp_path):
    """FileExistsError (an internal error on the command line) before; nothing is written."""
    from rotationzoo.fit import FitResult, hadamard_rotations, write_fitted
    from rotationzoo.recipe import FitRecipe
    from rotationzoo.workflows import fit_dump

    h = hadamard_rotations((0, 1), D)
    res = FitResult(k=h, v=h, objective="hadamard", composition="none", group_size=None,
                    targets={"k": None, "v": None}, layer_ids=(0, 1), head_dim=D)
    (tmp_path / "out").write_text("x")
    with pytest.raises(FitError, match=r"output folder .*out exists and is not a folder; give a folder"):
        write_fitted(res, tmp_path / "out")
    assert (tmp_path / "out").read_text() == "x"
    assert write_fitted(res, tmp_path / "new" / "rot").paths["k"].is_file()
    with pytest.raises(FitError, match=r"output folder \(--out\) .*out exists and is not a folder"):
        fit_dump(None, FitRecipe(objective="hadamard"), tmp_path / "out", num_layers=2, head_dim=D)
