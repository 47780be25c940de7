"""Progress of long runs: one ``progress(done, total, what)`` convention for eval, fit, refinement
and calibration; on the command line a bar on a terminal, a few plain lines on stderr otherwise,
never anything on stdout (``--json`` stays parseable)."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rotationzoo.cli._output import ProgressLines  # noqa: E402
from rotationzoo.cli.main import main  # noqa: E402
from rotationzoo.progress import Tally, prefixed  # noqa: E402

AUSTEN = Path(__file__).resolve().parent / "data" / "austen"


def stages(calls: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """Calls split into stages by the convention's rule (a new total, or ``done`` going back)."""
    out: list[list[tuple[int, int, str]]] = []
    for call in calls:
        if not out or call[1] != out[-1][-1][1] or call[0] < out[-1][-1][0]:
            out.append([])
        out[-1].append(call)
    return out


def check_convention(calls: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """Every stage starts at 0 (its total known before its first unit), only grows, ends at its total."""
    got = stages(calls)
    assert got, "no progress reported"
    for stage in got:
        total = stage[0][1]
        assert stage[0][0] == 0 and total > 0, stage[:2]
        assert [d for d, _, _ in stage] == sorted(d for d, _, _ in stage)
        assert stage[-1][0] == total, stage[-2:]
        assert all(isinstance(w, str) and w for _, _, w in stage)
    return got


# -- the convention and its renderers --------------------------------------------------------------


def test_plain_lines_are_few_and_give_elapsed_time_and_eta() -> None:
    now = [0.0]
    out = io.StringIO()
    lines = ProgressLines("eval", out, interval=10.0, clock=lambda: now[0])
    for stage_total in (1000, 50):
        lines(0, stage_total, "fp")
        for done in range(1, stage_total + 1):
            now[0] += 1.0  # one unit per second
            lines(done, stage_total, f"run {done}")
    got = out.getvalue().splitlines()
    first = got[:got.index("eval: 50/50 (100%) in 50 s") + 1]
    assert got[0] == "eval: 0/1,000 · fp" and got[1] == "eval: 100/1,000 (10%), 1 min 40 s elapsed, eta 15 min 00 s · run 100"
    assert got[10] == "eval: 1,000/1,000 (100%) in 16 min 40 s" and len(got[:11]) == 11
    assert got[11] == "eval: 0/50 · fp"  # a new stage starts over
    assert got[12:] == ["eval: 10/50 (20%), 10 s elapsed, eta 40 s · run 10", "eval: 20/50 (40%), 20 s elapsed, eta 30 s · run 20",
                        "eval: 30/50 (60%), 30 s elapsed, eta 20 s · run 30", "eval: 40/50 (80%), 40 s elapsed, eta 10 s · run 40",
                        "eval: 50/50 (100%) in 50 s"]
    assert first == got
    fast = io.StringIO()
    quick = ProgressLines("fit", fast)  # a run of a few seconds: its first and last line only
    for done in range(0, 10001):
        quick(done, 10000, "layer 0")
    assert fast.getvalue().splitlines()[0] == "fit: 0/10,000 · layer 0"
    assert len(fast.getvalue().splitlines()) == 2 and fast.getvalue().splitlines()[1].startswith("fit: 10,000/10,000 (100%)")


def test_tally_sums_counters_reported_from_threads() -> None:
    calls: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def record(done: int, total: int, what: str) -> None:
        with lock:
            calls.append((done, total, what))

    tally = Tally(record, 8 * 100, "layers")
    tally.start()

    def layer(lid: int) -> None:
        for done in range(1, 101):
            tally.set(lid, done, f"layer {lid}")

    threads = [threading.Thread(target=layer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check_convention(calls)
    assert len(calls) == 801 and calls[0] == (0, 800, "layers")
    seen: list[tuple[int, int, str]] = []
    prefixed(lambda d, t, w: seen.append((d, t, w)), "samples")(3, 9, "layer 2")
    assert seen == [(3, 9, "samples: layer 2")] and prefixed(None, "x") is None


# -- the library -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    from test_cli_refine import _planted_dump

    return _planted_dump(tmp_path_factory.mktemp("progress") / "dump", layers=(0, 1, 2))


def test_fit_and_refinement_report_progress(dump) -> None:
    from rotationzoo.fit import Refinement, fit_rotations, refine_dump
    from rotationzoo.fit.dump import open_dump

    calls: list[tuple[int, int, str]] = []
    fit_rotations(dump, "qqt_sst", workers=2, progress=lambda *a: calls.append(a))
    (stage,) = check_convention(calls)
    chunks = len(open_dump(dump).chunk_ids(0))
    assert stage[0][1] == 3 * 2 * chunks  # every layer's chunks, in two passes (qqt, then sst)
    assert {w for _, _, w in stage[1:]} == {"layer 0", "layer 1", "layer 2"}
    calls.clear()
    refine_dump(dump, Refinement(loss="block", steps=5, init="oscar", sample_tokens=512), group_size=16, workers=2,
                progress=lambda *a: calls.append(a))
    samples, init, refine = check_convention(calls)
    assert samples[0][1] == 3 * chunks and samples[-1][2].startswith("samples: layer ")
    assert init[0][1] == 3 * 2 * chunks and init[-1][2].startswith("r_h_pbr init: layer ")
    assert refine[0][1] == 3 * 2 * (5 + 1)  # layers × sides × (steps + the held-out comparison)
    assert {w for _, _, w in refine[1:]} == {f"layer {i} {s}" for i in range(3) for s in "KV"}


def _tiny_model(tmp_path: Path) -> tuple[Path, Path]:
    import test_evaluate

    return test_evaluate._save_tiny(tmp_path)


def test_calibration_and_evaluation_report_progress(tmp_path) -> None:
    from rotationzoo.evaluate import EvalProtocol, MethodSpec, evaluate, tokenize_texts
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.integrations.transformers import calibrate, load_model

    folder, text = _tiny_model(tmp_path)
    model, tok = load_model(folder)
    calls: list[tuple[int, int, str]] = []
    calibrate(model, tok, [text], tokens=400, seq_len=128, progress=lambda *a: calls.append(a))
    capture, second = check_convention(calls)
    assert capture[0] == (0, 400, "capture") and len(capture) == 1 + 4  # one call per window of 128
    assert second[0][1] == 2 * 4 and second[-1][2] == "K/V pass 2: layer 1"  # 2 layers × 4 chunks
    calls.clear()
    ids = tokenize_texts(tok, [text], tokens=300)
    evaluate(model, ids, [MethodSpec.fp(), MethodSpec.none()], Int2KVConfig(prefix_tokens=4, recent_tokens=8),
             EvalProtocol(context=100, baseline="none", resamples=20), progress=lambda *a: calls.append(a))
    (stage,) = check_convention(calls)
    assert stage[0][1] == 3 * 2  # windows × (fp + none)


# -- the command line ------------------------------------------------------------------------------


def _lines(err: str, label: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{label}: ")]


@pytest.mark.parametrize("command", ["eval", "fit", "refine", "calibrate"])
def test_cli_progress_goes_to_stderr_as_a_few_lines_in_a_pipe(command, dump, tmp_path, capsys) -> None:
    folder, text = _tiny_model(tmp_path)
    argv, label = {
        "eval": (["eval", "--model", str(folder), "--text", str(text), "--context", "64", "--methods", "fp,none",
                  "--baseline", "none", "--prefix-tokens", "4", "--recent-tokens", "8", "--draws", "2"], "eval"),
        "fit": (["fit", "--dump", str(dump), "--out", str(tmp_path / "fit")], "fit"),
        "refine": (["fit", "--dump", str(dump), "--out", str(tmp_path / "ref"), "--loss", "block", "--refine", "20", "--init", "oscar",
                    "-g", "16", "--sample-tokens", "512"], "refine"),
        "calibrate": (["calibrate", "--model", str(folder), "--text", str(text), "--tokens", "400", "--seq-len", "128",
                       "--out", str(tmp_path / "cal")], "calibrate"),
    }[command]
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # stdout: the JSON report only
    lines = _lines(err, label)
    n_stages = {"eval": 1, "fit": 1, "refine": 3, "calibrate": 2}[command]
    assert len([line for line in lines if "(100%)" in line]) == n_stages, err
    assert len(lines) <= 12 * n_stages and all(line.count("/") >= 1 for line in lines), err
    assert lines[0].startswith(f"{label}: 0/")
    if command in ("eval", "calibrate"):
        assert err.splitlines()[0].startswith(f"loading {folder}")


def test_cli_progress_on_a_terminal_is_a_bar_on_stderr(tmp_path, capsys, monkeypatch) -> None:
    folder, text = _tiny_model(tmp_path)
    monkeypatch.setattr("rotationzoo.cli._output.progress_enabled", lambda: True)
    assert main(["eval", "--model", str(folder), "--text", str(text), "--context", "64", "--methods", "fp,none",
                 "--baseline", "none", "--prefix-tokens", "4", "--recent-tokens", "8", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["results"][1]["method"] == "none"
    assert not _lines(err, "eval")  # the bar, not the plain lines
