"""The evaluation library and ``rotationzoo eval``: metrics, paired statistics, copy probe, CLI (tiny models)."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.errors import ConfigError, EvaluationError  # noqa: E402
from rotationzoo.evaluate import (  # noqa: E402
    CopyProbe, EvalProtocol, MethodSpec, evaluate, paired_difference, probe_sequences, sign_flip, tokenize_texts, windows,
)
from rotationzoo.evaluate.metrics import compare, hidden_states  # noqa: E402
from rotationzoo.evaluate.protocol import int2_keys  # noqa: E402
from rotationzoo.files.format import RotationSet, write_rotation  # noqa: E402
from rotationzoo.int2kv import Int2KVConfig  # noqa: E402
from rotationzoo.integrations.transformers import model_shape  # noqa: E402
from rotationzoo.files.pair import RotationPair  # noqa: E402

D = 64


def tiny_llama(seed: int = 0, layers: int = 2, vocab: int = 96):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=192, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=D, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def random_pair(layers: int = 2, seed: int = 1) -> RotationPair:
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(2, layers, D, D, generator=g, dtype=torch.float64))[0].float()
    return RotationPair({"k": RotationSet(q[0], tuple(range(layers)), objective="qqt_test"),
                         "v": RotationSet(q[1], tuple(range(layers)), objective="sst_test")}, source="random")


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 96, (700,), generator=torch.Generator().manual_seed(5)).tolist()


# -- paired statistics -----------------------------------------------------------------------------


def test_bootstrap_detects_a_planted_difference() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4096, generator=g).abs()
    better = base - 0.05 + 0.02 * torch.randn(3, 4096, generator=g)
    d = paired_difference(better, base, block=128, resamples=500)
    assert d.verdict == "better" and d.hi < 0 and d.lo < d.delta < d.hi
    assert paired_difference(base, better, block=128, resamples=500).verdict == "worse"


def test_bootstrap_says_no_detectable_difference_on_equal_methods() -> None:
    """Two methods with the same distribution: 'no detectable difference' in >= 90 of 100 seeded trials."""
    hits = 0
    for trial in range(100):
        g = torch.Generator().manual_seed(1000 + trial)
        shared = torch.randn(4096, generator=g).abs()  # the same tokens: paired
        a = shared + 0.3 * torch.randn(2, 4096, generator=g)
        b = shared + 0.3 * torch.randn(2, 4096, generator=g)
        hits += paired_difference(a, b, block=128, resamples=300, seed=trial).verdict == "no detectable difference"
    assert hits >= 90, hits


def test_bootstrap_resamples_draws() -> None:
    """Draw-to-draw spread widens the interval even when every token agrees within a draw."""
    tokens = torch.ones(4096)
    tight = paired_difference(torch.stack([tokens * 1.0, tokens * 1.0]), torch.stack([tokens, tokens]), resamples=400)
    wide = paired_difference(torch.stack([tokens * 0.9, tokens * 1.1]), torch.stack([tokens, tokens]), resamples=400)
    assert tight.hi - tight.lo == 0.0 and wide.hi - wide.lo > 0.05 and wide.verdict == "no detectable difference"


# -- metrics ---------------------------------------------------------------------------------------


def test_kl_is_zero_for_fp_against_itself_and_matches_a_direct_computation(model, ids) -> None:
    seq = ids[:120]
    h_fp, _ = hidden_states(model, seq)
    noisy = h_fp + 0.05 * torch.randn(h_fp.shape, generator=torch.Generator().manual_seed(3))
    fp, got = compare(model, seq, 1, h_fp, {"same": h_fp, "noisy": noisy}, chunk=37)
    assert torch.equal(got["same"].kl, torch.zeros(119)) and got["same"].agree.min() == 1
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].float()
        lq = torch.log_softmax(model.lm_head(noisy[:-1]).float(), -1)
    lp = torch.log_softmax(logits, -1)
    direct = (lp.exp() * (lp - lq)).sum(-1)
    torch.testing.assert_close(got["noisy"].kl, direct, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fp.nll, -lp.gather(1, torch.tensor(seq[1:])[:, None])[:, 0], atol=1e-4, rtol=1e-4)
    assert got["noisy"].kl.mean() > 0


@pytest.mark.parametrize("n,context,stride", [(10, 4, 4), (10, 4, 2), (9, 9, 9), (100, 32, 7)])
def test_windows_score_every_target_once(n, context, stride) -> None:
    targets = []
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context and begin < first <= end
        targets.extend(range(first, end))
    if stride == context:
        assert targets == [t for t in range(1, n) if t % context]
    else:
        assert targets == list(range(1, n))


def test_bits_per_element_definition() -> None:
    c = Int2KVConfig(group_size=64, scale_dtype="float16")
    assert c.bits_per_element(64, 2048) == pytest.approx((1728 * 2.5 + 320 * 16) / 2048)
    assert Int2KVConfig(group_size=16, scale_dtype="float16", prefix_tokens=0, recent_tokens=0).bits_per_element(64, 2048) == 4.0
    # the paper's 2.28: d = G = 128, 16-bit scale/zero, 64 + 256 windows, 128K tokens
    assert Int2KVConfig(scale_dtype="bfloat16").bits_per_element(128, 131072) == pytest.approx(2.25 + 320 * 13.75 / 131072)
    assert Int2KVConfig().int2_bits(128) == 2.5  # fp32 scale/zero, as served
    assert Int2KVConfig(group_size=32).bits_per_element(64, 100) == 16.0


# -- copy probe ------------------------------------------------------------------------------------


def test_copy_probe_first_passage_is_int2() -> None:
    """Every token of the first passage is read as INT2 by every scored query of the second."""
    conf = Int2KVConfig(prefix_tokens=4, recent_tokens=8)
    probe = CopyProbe(passage_tokens=10, probes=3)
    seqs = probe_sequences(list(range(1000)), probe, conf)
    assert len(seqs) == 3
    for seq, first in seqs:
        lead, length = conf.prefix_tokens, probe.passage_tokens
        assert seq[lead:lead + length] == seq[first - 1:] and len(seq) == first - 1 + length
        passage = torch.arange(lead, lead + length)
        for q in range(first - 1, len(seq) - 1):  # queries predicting second-passage tokens 2..L
            exact = (passage < conf.prefix_tokens) | (q - passage <= conf.recent_tokens)
            assert not exact.any()
            assert int2_keys(torch.tensor([q]), conf).item() >= length
    with pytest.raises(ConfigError, match="copy probe needs"):
        probe_sequences(list(range(50)), probe, conf)


def test_check_evaluation_refuses_a_copy_probe_the_text_cannot_hold() -> None:
    """Checked with the other early checks, once the texts are tokenized (before: inside evaluate(), after the
    weight load)."""
    from rotationzoo.evaluate import check_evaluation
    from rotationzoo.integrations.transformers import ModelShape

    shape = ModelShape(head_dim=D, num_q_heads=4, num_kv_heads=2, layer_ids=(0, 1), context_length=256)
    conf = Int2KVConfig(prefix_tokens=4, recent_tokens=8)
    methods = [MethodSpec.fp(), MethodSpec.none()]
    protocol = EvalProtocol(baseline="none", probe=CopyProbe(passage_tokens=10, filler_tokens=20, probes=100))
    assert check_evaluation(methods, shape, conf, protocol) is None  # the sizes alone: the text is not read yet
    with pytest.raises(ConfigError, match=r"the copy probe needs 100 × 34 = 3400 tokens of text, the text has 512; "
                                          r"use fewer --probes"):
        check_evaluation(methods, shape, conf, protocol, 512)
    assert check_evaluation(methods, shape, conf, protocol, 512, probe_tokens=4000) == 256  # probes from other text
    with pytest.raises(ConfigError, match=r"passage_tokens \(--passage-tokens\) must be an integer from 2"):
        CopyProbe(passage_tokens=1)  # refused where it is made, before any check of the evaluation


# -- evaluate() ------------------------------------------------------------------------------------


def test_evaluate_reports_metrics_exposure_and_paired_ci(model, ids, tmp_path) -> None:
    conf = Int2KVConfig(group_size=32, prefix_tokens=4, recent_tokens=8)
    proto = EvalProtocol(draws=2, block_tokens=32, resamples=200, probe=CopyProbe(passage_tokens=12, probes=3))
    methods = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard(), MethodSpec.from_source("rand", random_pair())]
    seen = []
    report = evaluate(model, ids, methods, conf, proto, progress=lambda d, t, label: seen.append((d, t)))
    assert report.context == 256 == report.stride and report.windows == 3  # the model's context length
    fp, none, had, rand = report.results
    assert (fp.kl, fp.top1, fp.bpe) == (0.0, 1.0, 32.0) and fp.vs_baseline is None and had.vs_baseline is None
    # every method as served, plus two sign draws of each rotation reported as a spread beside it
    assert none.draws == 0 and had.draws == rand.draws == 2 and fp.tokens_scored == none.tokens_scored == 699 - 2
    assert len(had.draw_kl) == 2 and had.kl_spread == pytest.approx(float(torch.tensor(had.draw_kl).std()))
    assert had.kl not in had.draw_kl and had.format == conf.kv_format().name and had.rotation == "hadamard"
    assert none.kl > 0 and 0 < had.top1 < 1
    assert rand.bpe == pytest.approx(conf.bits_per_element(D, 256))
    ex = had.exposure
    want_pairs = sum(max(0, i - 12) for b, e, f in windows(700, 256, 256) for i in range(f - b - 1, e - b - 1))
    total_pairs = sum(i + 1 for b, e, f in windows(700, 256, 256) for i in range(f - b - 1, e - b - 1))
    assert ex["pairs"] == pytest.approx(want_pairs / total_pairs) and 0.8 < ex["tokens"] < 1
    assert set(rand.vs_baseline) == {"nll", "kl", "copy_nll"}
    d = rand.vs_baseline["kl"]
    assert d.lo <= d.delta <= d.hi and d.delta == pytest.approx(rand.kl - had.kl)
    assert rand.copy is not None and rand.copy["tokens"] == 3 * 11
    assert seen[0] == (0, (3 + 3) * (1 + 1 + 3 + 3))  # the total before the first forward: an ETA at once
    assert seen[-1] == (report_units := (3 + 3) * (1 + 1 + 3 + 3), report_units)
    data = json.loads(report.to_json(tmp_path / "r.json"))
    assert data["results"][3]["vs_baseline"]["kl"]["verdict"] in ("better", "worse", "no detectable difference")
    assert data["config"]["group_size"] == 32 and data["protocol"]["draws"] == 2


def test_compare_all_pairs_every_int2_method_with_every_other(model, ids) -> None:
    conf = Int2KVConfig(group_size=32, prefix_tokens=4, recent_tokens=8)
    methods = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard(), MethodSpec.from_source("rand", random_pair())]
    report = evaluate(model, ids[:300], methods, conf, EvalProtocol(draws=2, block_tokens=32, resamples=100,
                                                                    compare_all=True))
    fp, none, had, rand = report.results
    assert fp.vs_methods == {} and set(rand.vs_methods) == {"none", "hadamard"} and set(had.vs_methods) == {"none", "rand"}
    d, back = rand.vs_methods["hadamard"]["kl"], had.vs_methods["rand"]["kl"]
    assert d.delta == pytest.approx(rand.kl - had.kl) and back.delta == pytest.approx(-d.delta)
    assert d.delta == pytest.approx(rand.vs_baseline["kl"].delta)  # the baseline pair is the same comparison
    assert rand.vs_methods["none"]["nll"].delta == pytest.approx(rand.nll - none.nll)
    assert json.loads(json.dumps(report.to_dict()))["results"][3]["vs_methods"]["hadamard"]["kl"]["delta"] == d.delta
    plain = evaluate(model, ids[:300], methods, conf, EvalProtocol(draws=2, block_tokens=32, resamples=100))
    assert all(r.vs_methods == {} for r in plain.results)


def test_sign_draws_change_rounding_not_math(model, ids) -> None:
    r = random_pair().k.rotations
    flipped = sign_flip(r, 0, 0, "k")
    assert torch.allclose(flipped.abs(), r.abs()) and not torch.equal(flipped, r)
    assert torch.equal(sign_flip(r, 0, 0, "k"), flipped) and not torch.equal(sign_flip(r, 1, 0, "k"), flipped)
    eye = torch.eye(D)
    assert torch.allclose(flipped[0] @ flipped[0].T, eye, atol=1e-5)


def test_sign_draws_leave_learned_sides_as_given(model, ids) -> None:
    """A side learned by refinement is evaluated as the file holds it (its signs were learned with the INT2
    rounding); a closed-form side, and a side the keep rule left at its init, still gets R·D."""
    from rotationzoo.evaluate.run import _runs

    base = random_pair()
    k, v = base.k, base.v
    learned = RotationPair({"k": RotationSet(k.rotations, k.layer_ids, objective="refined_k_served_score_r_h_pbr"),
                            "v": RotationSet(v.rotations, v.layer_ids, objective="refined_kept_init_r_h_pbr")},
                           source="refined")
    spec = MethodSpec.from_source("refined", learned)
    assert spec.learned_sides == ("k",) and spec.drawn
    conf, shape = Int2KVConfig(group_size=16), model_shape(model)
    kv = spec.oscar(shape, conf, draw=0)
    assert torch.equal(kv.k_rotations, k.rotations)  # learned: as given
    assert torch.equal(kv.v_rotations, sign_flip(v.rotations, 0, 0, "v"))  # kept at its closed-form init: drawn
    both = MethodSpec.from_source("both", RotationPair(
        {"k": learned.k, "v": RotationSet(v.rotations, v.layer_ids, objective="refined_v_served_out_r_h_pbr")},
        source="both"))
    closed = MethodSpec.from_source("closed", base)
    assert both.learned_sides == ("k", "v") and not both.drawn and closed.learned_sides == () and closed.drawn
    runs = _runs([MethodSpec.fp(), MethodSpec.hadamard(), closed, both], EvalProtocol(draws=3))
    assert [r for r in runs if r[0] == "both"] == [("both", None)]  # evaluated once, as given
    assert [r for r in runs if r[0] == "closed"] == [("closed", None), ("closed", 0), ("closed", 1), ("closed", 2)]
    small = Int2KVConfig(group_size=16, prefix_tokens=4, recent_tokens=8)
    report = evaluate(model, ids[:300], [MethodSpec.fp(), MethodSpec.hadamard(), both], small,
                      EvalProtocol(draws=2, block_tokens=32, resamples=100))
    assert [r.draws for r in report.results if r.method in ("hadamard", "both")] == [2, 0]


def test_mismatched_rotations_are_refused_before_running(model, ids) -> None:
    calls = []
    bad = MethodSpec.from_source("wrong", random_pair(layers=3))
    with pytest.raises(EvaluationError, match="rotations cover 3 layers .* the model has 2"):
        evaluate(model, ids, [MethodSpec.fp(), MethodSpec.hadamard(), bad], progress=lambda *a: calls.append(a))
    assert calls == []
    with pytest.raises(EvaluationError, match="baseline 'hadamard' is not one of the methods"):
        evaluate(model, ids, [MethodSpec.fp(), MethodSpec.none()])
    with pytest.raises(EvaluationError, match="lloyd_max uses one .scale, zero. per row"):
        evaluate(model, ids, [MethodSpec.hadamard()], Int2KVConfig(group_size=16, lloyd_max=True))


def test_min_int2_window_is_where_exposure_starts() -> None:
    """A window of min_int2_window tokens is the shortest in which a scored token reads an INT2 key."""
    from rotationzoo.evaluate import min_int2_window
    from rotationzoo.evaluate.protocol import Exposure

    for conf in (Int2KVConfig(), Int2KVConfig(prefix_tokens=4, recent_tokens=8), Int2KVConfig(prefix_tokens=0,
                                                                                              recent_tokens=0)):
        need = min_int2_window(conf)
        for n, reads in ((need - 1, False), (need, True)):
            ex = Exposure()
            ex.add(torch.arange(0, n - 1), conf)  # the scored query positions of an n-token window
            assert (ex.tokens_with_int2 > 0) is reads, (conf, n)


def test_nothing_quantized_is_refused(model, ids) -> None:
    calls = []
    with pytest.raises(ConfigError, match="windows of 100 tokens: nothing would be quantized.*at least 323 tokens"):
        evaluate(model, ids[:200], [MethodSpec.fp(), MethodSpec.hadamard()], Int2KVConfig(),
                 EvalProtocol(context=100), progress=lambda *a: calls.append(a))
    assert calls == []
    report = evaluate(model, ids[:200], [MethodSpec.fp()], Int2KVConfig(), EvalProtocol(context=100))
    assert report.results[0].method == "fp"  # nothing to quantize, nothing refused


# -- CLI -------------------------------------------------------------------------------------------


def _save_tiny(tmp_path):
    """A tiny Llama folder with a word-level tokenizer, loadable offline by ``rotationzoo eval``."""
    tokenizers = pytest.importorskip("tokenizers")
    # 92 words (the model's vocabulary is 96): enough distinct tokens that every layer's values span d = 64
    words = "the a of and to in was she he her it had be that not as for with his you i at by on".split()
    words += [f"w{i}" for i in range(92 - len(words))]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    model = tiny_llama(seed=11)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    text = tmp_path / "held_out.txt"
    g = torch.Generator().manual_seed(2)
    text.write_text(" ".join(words[int(i)] for i in torch.randint(0, len(words), (600,), generator=g)))
    return folder, text


def test_cli_eval(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    from rotationzoo.cli.main import main
    from rotationzoo.export import export_safetensors
    from rotationzoo.fit import FitResult, hadamard_rotations, write_fitted

    folder, text = _save_tiny(tmp_path)
    h = hadamard_rotations((0, 1), D)
    res = FitResult(k=h, v=h, objective="hadamard", composition="none", group_size=None,
                    targets={"k": None, "v": None}, layer_ids=(0, 1), head_dim=D)
    write_fitted(res, tmp_path / "rot")
    # the same folder holding a .pt and a .safetensors copy of each file is one pair, as for export
    write_fitted(res, tmp_path / "rot", fmt="safetensors")
    export_safetensors(tmp_path / "rot", tmp_path / "pair.safetensors")
    out_json, out_png = tmp_path / "e.json", tmp_path / "e.png"
    rc = main(["eval", "--model", str(folder), "--rotations", str(tmp_path / "rot"), "--text", str(text),
               "--context", "128", "--group-size", "32", "--prefix-tokens", "4", "--recent-tokens", "8", "--draws", "2",
               "--methods", f"fp,none,hadamard,oscar,exported={tmp_path / 'pair.safetensors'},"
                            f"files={tmp_path / 'rot' / 'k_rotation_hadamard.pt'},{tmp_path / 'rot' / 'v_rotation_hadamard.pt'}",
               "--probe", "copy", "--probe-tokens", "8", "--probe-count", "2",
               "--plot", str(out_png), "--json-out", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "ΔKL vs hadamard" in captured.out and "exported" in captured.out
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"fp", "none", "hadamard", "oscar", "exported", "files"}
    # the same Hadamard matrices through a folder, an exported file, a K.pt,V.pt pair and the built-in method
    for name in ("oscar", "exported", "files"):
        assert rows[name]["kl"] == pytest.approx(rows["hadamard"]["kl"], rel=1e-6)
        assert rows[name]["vs_baseline"]["kl"]["verdict"] == "no detectable difference"
    assert rows["oscar"]["copy"]["tokens"] == 2 * 7 and data["context"] == 128
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc = main(["eval", "--model", str(folder), "--text", str(text), "--context", "64", "--methods", "fp,none",
               "--prefix-tokens", "4", "--recent-tokens", "8", "--baseline", "none", "--json"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["results"][1]["method"] == "none"


def test_cli_eval_takes_the_bootstrap_and_pairwise_settings_of_the_protocol(tmp_path, capsys) -> None:
    """--block-tokens, --resamples, --confidence and --compare-all are EvalProtocol's fields (the JSON echoes them);
    --compare-all prints every INT2 method against every other; out-of-range values are usage errors."""
    from rotationzoo.cli.main import main

    folder, text = _save_tiny(tmp_path)
    base = ["eval", "--model", str(folder), "--text", str(text), "--context", "64", "--methods", "fp,none,hadamard",
            "--prefix-tokens", "4", "--recent-tokens", "8", "--group-size", "32"]
    rc = main([*base, "--block-tokens", "16", "--resamples", "50", "--confidence", "0.9", "--compare-all", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {k: data["protocol"][k] for k in ("block_tokens", "resamples", "confidence", "compare_all")} == {
        "block_tokens": 16, "resamples": 50, "confidence": 0.9, "compare_all": True}
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows["none"]["vs_methods"]) == {"hadamard"} and rows["none"]["vs_methods"]["hadamard"]["kl"]["confidence"] == 0.9
    assert main([*base, "--resamples", "50", "--compare-all"]) == 0
    out = capsys.readouterr().out
    assert "every row against every other but fp" in out and "hadamard" in out.split("every row against")[1]
    for flag, value in (("--confidence", "1"), ("--confidence", "0.4"), ("--confidence", "nan"), ("--resamples", "0"),
                        ("--resamples", "100001"), ("--block-tokens", "0")):
        assert main([*base, flag, value]) == 2, flag
        assert flag in capsys.readouterr().err
    for kwargs, said in (({"confidence": 1.0}, "confidence"), ({"resamples": 10**6}, "resamples"),
                         ({"block_tokens": 0}, "block_tokens"), ({"compare_all": 1}, "compare_all")):
        with pytest.raises(ConfigError, match=said):
            EvalProtocol(**kwargs)


def test_parse_methods_takes_a_k_v_file_pair() -> None:
    from rotationzoo.workflows import parse_methods

    assert parse_methods("fp,a=k.pt,v.pt,hadamard,b=dir/,c=x.pt") == [
        ("fp", None), ("a", "k.pt,v.pt"), ("hadamard", None), ("b", "dir/"), ("c", "x.pt")]
    with pytest.raises(Exception, match="unknown method 'v.pt'"):
        parse_methods("fp,a=dir/,v.pt")  # only a K .pt file takes a V file after it


def test_cli_eval_errors(tmp_path, capsys) -> None:
    from rotationzoo.cli.main import main

    folder, text = _save_tiny(tmp_path)
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,oscar"]) == 2
    assert "--rotations" in capsys.readouterr().err
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,bogus"]) == 2
    assert "unknown method" in capsys.readouterr().err
    # a missing text is refused before the model is loaded (the model path does not even exist)
    assert main(["eval", "--model", str(tmp_path / "nope"), "--text", str(tmp_path / "nope.txt")]) == 1
    err = capsys.readouterr().err
    assert f"--text {tmp_path / 'nope.txt'}: evaluation text file not found" in err and "calibration" not in err
    assert main(["eval", "--model", str(folder), "--text", str(text), "--rotations", "SmolLM2-135M-Instruct"]) == 1
    err = capsys.readouterr().err.splitlines()  # refused from the model's config alone: nothing loads
    assert len(err) == 1 and "rotations cover 30 layers" in err[0]


def test_cli_eval_checks_its_output_paths_first(tmp_path, capsys) -> None:
    """--json-out and --plot that cannot be written are refused before the evaluation runs (never after
    it, losing its results), and a link at --json-out is replaced, never written through."""
    pytest.importorskip("matplotlib")
    from rotationzoo.cli.main import main

    folder, text = _save_tiny(tmp_path)
    run = ["eval", "--model", str(folder), "--text", str(text), "--context", "64", "--methods", "fp,none",
           "--prefix-tokens", "4", "--recent-tokens", "8", "--baseline", "none"]
    (tmp_path / "results").mkdir()
    (tmp_path / "a_file").write_text("x")
    for extra, message in ((["--json-out", str(text)], "a file this run reads"),  # its own --text
                           (["--json-out", str(folder / "config.json")], "a folder this run reads"),
                           (["--json-out", str(tmp_path / "results")], "is a folder; give a file name"),
                           (["--json-out", str(tmp_path / "a_file" / "e.json")], "is not a folder"),
                           (["--plot", str(tmp_path / "eval.txt")], "matplotlib saves"),
                           (["--plot", str(tmp_path / "e.png"), "--json-out", str(tmp_path / "e.png")], "same file")):
        assert main(run + extra) == 2  # a usage error, before the model is touched
        captured = capsys.readouterr()
        assert message in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
        assert "ΔKL" not in captured.out  # refused before anything ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "held_out.txt", "results", "tiny"]
    notes = tmp_path / "notes.txt"
    notes.write_text("a user's notes")
    (tmp_path / "link.json").symlink_to(notes)
    assert main(run + ["--json-out", str(tmp_path / "link.json")]) == 0
    assert notes.read_text() == "a user's notes" and not (tmp_path / "link.json").is_symlink()
    assert json.loads((tmp_path / "link.json").read_text())["results"][1]["method"] == "none"


def test_tokenize_texts(tmp_path) -> None:
    folder, text = _save_tiny(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    ids = tokenize_texts(tok, [text, text], tokens=500)
    assert len(ids) == 500 and tokenize_texts(tok, [text], tokens=10, skip=5) == ids[5:15]
    assert math.isfinite(len(ids))


@pytest.mark.parametrize("option, value", [("--tokens", "300"), ("--context", "100")])
def test_cli_eval_refuses_windows_that_quantize_nothing_before_loading(tmp_path, capsys, option, value) -> None:
    from rotationzoo.cli.main import main

    text = tmp_path / "t.txt"
    text.write_text("some text")
    # the model path does not exist: the refusal comes before any loading
    rc = main(["eval", "--model", str(tmp_path / "no-model"), "--text", str(text), "--methods", "fp,none",
               "--baseline", "none", option, value])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1
    assert f"error: {option} {value}: nothing would be quantized" in err and "at least 323 tokens" in err
    rc = main(["eval", "--model", str(tmp_path / "no-model"), "--text", str(text), "--methods", "fp,none",
               "--baseline", "none", option, value, "--prefix-tokens", "4", "--recent-tokens", "8"])
    assert rc == 1 and "no-model" in capsys.readouterr().err  # now it gets as far as loading


def test_cli_eval_takes_int2_settings_from_the_registry_entry(tmp_path, capsys, monkeypatch) -> None:
    """The default model is evaluated at its entry's serving settings (G = 16), NAME=ENTRY methods
    at theirs, and --group-size wins; a line says that the model is being loaded."""
    import rotationzoo.evaluate as ev
    from rotationzoo.cli.main import main
    from rotationzoo.registry import get_entry

    folder, text = _save_tiny(tmp_path)
    seen = []

    def stop(model, ids, specs, config, protocol, **kw):
        seen.append(config)
        raise EvaluationError("stopped by the test")

    monkeypatch.setattr(ev, "find_smollm2_gguf", lambda: folder)
    monkeypatch.setattr(ev, "evaluate", stop)
    # the settings chosen are what this test reads: the tiny model does not fit 30-layer rotations, which
    # check_evaluation refuses before anything loads (test_cli_eval_errors)
    monkeypatch.setattr(ev, "check_evaluation", lambda *a, **k: None)
    base = ["eval", "--text", str(text), "--methods", "fp,none", "--baseline", "none", "--context", "400"]
    assert main(base) == 1
    assert seen[-1] == get_entry("SmolLM2-135M-Instruct").serving  # the default entry's settings
    assert seen[-1].group_size == 64 and seen[-1].scale_dtype == "bfloat16"  # int2-g64-bf16, 3.03 bits at 8K
    assert f"loading {folder}" in capsys.readouterr().err
    assert main([*base, "--group-size", "32"]) == 1 and seen[-1].group_size == 32
    assert main(["eval", "--model", str(folder), "--text", str(text), "--methods", "fp,none",
                 "--baseline", "none", "--context", "400"]) == 1
    assert seen[-1].group_size is None  # a local model without registry rotations: the library defaults
    assert main(["eval", "--model", str(folder), "--text", str(text), "--context", "400", "--baseline", "none",
                 "--methods", "none,had=SmolLM2-135M-Instruct@hadamard"]) == 1
    assert seen[-1].group_size == 64
    fitted = tmp_path / "fitted"
    for side, rs in random_pair():
        write_rotation(fitted / f"{side}_rotation_test.pt", rs)
    (fitted / "rotationzoo.json").write_text(json.dumps({"group_size": 32, "files": {}}))
    with_fitted = ["eval", "--text", str(text), "--methods", "fp,oscar", "--baseline", "oscar", "--context", "400",
                   "--rotations", str(fitted)]
    assert main(with_fitted) == 1
    assert seen[-1].group_size == 32 and seen[-1].scale_dtype == "float32"  # the fitted G, library defaults
    assert main([*with_fitted, "--group-size", "16"]) == 1 and seen[-1].group_size == 16


def test_per_kv_head_rotations_evaluate_head_by_head(model, ids, monkeypatch) -> None:
    """Identical heads score exactly like the per-layer pair; other heads change the result; a
    per-head pair for another head count is refused before anything runs."""
    import rotationzoo.evaluate.methods as methods_mod

    monkeypatch.setattr(methods_mod, "sign_flip", lambda r, *a: r)  # per-head draws flip each head on its own
    conf = Int2KVConfig(group_size=32, prefix_tokens=4, recent_tokens=8)
    proto = EvalProtocol(draws=1, block_tokens=32, resamples=50)
    layer = random_pair()

    def per_head(pair: RotationPair, heads: int, other: RotationPair | None = None) -> RotationPair:
        sets = {}
        for s, rs in pair:
            r = rs.rotations[:, None].repeat(1, heads, 1, 1)
            if other is not None:
                r[:, 1] = other[s].rotations
            sets[s] = RotationSet(r, rs.layer_ids, objective=rs.objective, source_grouping="kv_head")
        return RotationPair(sets, source=f"{pair.source}-per-head")

    methods = [MethodSpec.fp(), MethodSpec.hadamard(), MethodSpec.from_source("layer", layer),
               MethodSpec.from_source("same", per_head(layer, 2)),
               MethodSpec.from_source("mixed", per_head(layer, 2, random_pair(seed=9)))]
    _, _, lay, same, mixed = evaluate(model, ids[:300], methods, conf, proto).results
    assert (same.nll, same.kl, same.top1) == (lay.nll, lay.kl, lay.top1)
    assert mixed.kl != lay.kl
    with pytest.raises(EvaluationError, match="per-KV-head K rotations for 3 heads, the model has 2"):
        evaluate(model, ids, [MethodSpec.hadamard(), MethodSpec.from_source("x", per_head(layer, 3))])
