"""The command line as a user meets it: filters and pipe-friendly tables, one-line errors (JSON with
--json, tracebacks with --debug), one suggestion per typo, range-checked options."""

from __future__ import annotations

import json
from pathlib import Path
import re

import pytest
import torch
from helpers import random_orthogonal, run_cli

from rotationzoo.cli.main import main
from rotationzoo.files.format import RotationSet, write_rotation

LONG_ID = "Qwen/Qwen3.5-35B-A3B"


# -- list ------------------------------------------------------------------------------------------


def test_list_pattern_matches_ids_and_aliases_case_insensitively(capsys) -> None:
    rc, out, _ = run_cli(capsys, "list", "QWEN3*", "--json")
    ids = {m["id"] for m in json.loads(out)}
    assert rc == 0 and "Qwen/Qwen3-8B" in ids and LONG_ID in ids
    assert not any(i.startswith(("HuggingFaceTB/", "zai-org/")) for i in ids)
    rc, out, _ = run_cli(capsys, "list", "smollm2*", "--json")  # an alias, lower case
    assert [m["id"] for m in json.loads(out)] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    rc, out, _ = run_cli(capsys, "list", "*/qwen3-8b", "--json")  # the full id
    assert [m["id"] for m in json.loads(out)] == ["Qwen/Qwen3-8B"]
    rc, out, err = run_cli(capsys, "list", "qwen")  # no wildcard: an exact name, and a hint
    assert rc == 0 and out == "" and "no model matches 'qwen'" in err and "'qwen*'" in err
    from rotationzoo.registry import list_models  # Python filters the same way

    assert [m.id for m in list_models("smollm2*")] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert {m.id for m in list_models("QWEN3*")} == ids and list_models("qwen") == []
    assert len(list_models()) == len(list_models("*")) > 10


def test_list_plain_is_tab_separated_and_complete(capsys) -> None:
    from rotationzoo.registry import get_model, list_models

    rc, out, _ = run_cli(capsys, "list", "--plain")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == len(list_models())
    rows = {line.split("\t")[0]: line.split("\t") for line in lines}
    assert all(len(r) == 7 for r in rows.values())
    smol = rows["HuggingFaceTB/SmolLM2-135M-Instruct"]
    assert smol[2:5] == ["30", "64", get_model("SmolLM2-135M-Instruct").default_tag]
    assert "hadamard" in smol[5].split(",")
    assert "│" not in out and "…" not in out


def test_list_in_a_pipe_never_cuts_ids_or_tags(capsys, monkeypatch) -> None:
    """Captured stdout is not a terminal (as `rotationzoo list | cat`): even a narrow COLUMNS cuts nothing."""
    from rotationzoo.registry import list_models

    monkeypatch.setenv("COLUMNS", "60")
    rc, out, _ = run_cli(capsys, "list")
    assert rc == 0 and "…" not in out
    for m in list_models():
        assert m.id in out and (m.default_tag or "(MLA latent set)") in out


# -- errors ----------------------------------------------------------------------------------------


def test_library_error_is_one_line_and_json_with_json(capsys) -> None:
    rc, out, err = run_cli(capsys, "info", "Qwen3-9B")
    assert rc == 1 and out == "" and err.count("\n") == 1 and err.startswith("error: unknown model 'Qwen3-9B'")
    rc, out, err = run_cli(capsys, "info", "Qwen3-9B", "--json")
    assert rc == 1 and err == ""
    got = json.loads(out)["error"]
    assert got["type"] == "UnknownModelError" and got["message"].startswith("unknown model 'Qwen3-9B'")
    assert "attempts" not in got
    # serve-args' documented --format json is --json too
    rc, out, _ = run_cli(capsys, "serve-args", "Qwen3-9B", "--engine", "vllm", "--format", "json")
    assert rc == 1 and "unknown model" in json.loads(out)["error"]["message"]


def test_json_error_carries_the_attempts_of_a_fetch_error(capsys, monkeypatch) -> None:
    from rotationzoo import errors

    attempts = [{"source": "huggingface:acme/x", "reason": "DNS failure"}]

    def fail(*a, **k):
        exc = errors.FetchError("could not fetch Qwen/Qwen3-8B: every source failed")
        exc.attempts = attempts
        raise exc

    monkeypatch.setattr("rotationzoo.api.fetch", fail)
    rc, out, _ = run_cli(capsys, "fetch", "Qwen3-8B", "--json")
    assert rc == 1
    assert json.loads(out) == {"error": {"type": "FetchError", "message": "could not fetch Qwen/Qwen3-8B: every "
                                         "source failed", "attempts": attempts}}


def _boom(*a, **k):
    raise TypeError("unsupported operand\nsecond line")


def test_unexpected_error_is_one_line_asking_for_debug(capsys, monkeypatch) -> None:
    monkeypatch.setattr("rotationzoo.registry.list_models", _boom)
    rc, out, err = run_cli(capsys, "list")
    assert rc == 1 and out == ""
    assert err == ("error: internal error (TypeError: unsupported operand); re-run with --debug and report it\n")
    rc, out, err = run_cli(capsys, "list", "--json")
    assert rc == 1 and json.loads(out)["error"]["type"] == "TypeError" and err == ""


def test_debug_shows_the_traceback(capsys, monkeypatch) -> None:
    monkeypatch.setattr("rotationzoo.registry.list_models", _boom)
    rc, _, err = run_cli(capsys, "--debug", "list")
    assert rc == 1 and "Traceback (most recent call last)" in err and "_boom" in err
    assert err.rstrip().endswith("re-run with --debug and report it")
    monkeypatch.setenv("ROTATIONZOO_DEBUG", "1")
    rc, _, err = run_cli(capsys, "info", "Qwen3-9B")
    assert rc == 1 and "Traceback" in err and "UnknownModelError" in err
    monkeypatch.delenv("ROTATIONZOO_DEBUG")
    rc, _, err = run_cli(capsys, "info", "Qwen3-9B")  # the mode does not stick to the next run
    assert "Traceback" not in err


def test_misspelt_command_is_suggested_once(capsys) -> None:
    rc, _, err = run_cli(capsys, "lst")
    assert rc == 2 and err.count("Did you mean") == 1 and "'list'" in err
    rc, _, err = run_cli(capsys, "cache", "lss")
    assert rc == 2 and err.count("Did you mean") == 1 and "'ls'" in err


@pytest.mark.parametrize("argv, says", [
    (("verify", "x.pt", "--num-layers", "-3"), "is not in the range"),
    (("verify", "x.pt", "--head-dim", "0"), "head_dim must be a positive integer"),
    (("verify", "x.pt", "--head-dim", "128,x"), "expected D or D,LAYER:D"),
    (("demo", "--tokens", "-5"), "is not in the range"),
    (("demo", "--tokens", "0"), "is not in the range"),
])
def test_out_of_range_numbers_are_usage_errors(capsys, argv, says) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and says in err and "Traceback" not in err


def test_every_command_takes_json() -> None:
    import click
    import typer.main

    from rotationzoo.cli.main import app

    root = typer.main.get_command(app)

    def leaves(group: click.Group, prefix: str):
        for name in group.list_commands(click.Context(group)):
            cmd = group.get_command(click.Context(group), name)
            if isinstance(cmd, click.Group):
                yield from leaves(cmd, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", cmd

    missing = [name for name, cmd in leaves(root, "") if not any("--json" in p.opts for p in cmd.params)]
    assert missing == []


def test_help_of_demo_tag_and_cache_group(capsys) -> None:
    rc, out, _ = run_cli(capsys, "demo", "--help")
    assert rc == 0 and re.search(r"--tag.*Calibration tag", out.replace("\n", " "))
    rc, out, _ = run_cli(capsys, "cache", "--help")
    assert rc == 0 and "rotationzoo cache rm --model Qwen3-8B --dry-run" in out and "rotationzoo cache ls" in out


def _commands(group, path=()):
    """``(path, command)`` of the root group, every sub-group and every command, read from the click tree."""
    import click

    yield path, group
    for name in group.list_commands(click.Context(group)):
        cmd = group.get_command(click.Context(group), name)
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_help_shows_every_bracketed_text_literally(capsys, monkeypatch) -> None:
    """Every ``[...]`` of every declared help text (commands, groups, options, arguments) is in the
    rendered --help, not eaten as rich markup; the declared texts stay as written."""
    import click
    import typer.main

    from rotationzoo.cli.main import app

    monkeypatch.setenv("COLUMNS", "4000")  # no wrapping inside the panels
    flat = lambda text: " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())  # noqa: E731
    checked, lost = 0, []
    for path, cmd in _commands(typer.main.get_command(app)):
        declared = [t for obj in (cmd, *cmd.params) for t in (getattr(obj, "help", None), cmd.short_help) if t]
        wanted = {flat(m) for t in declared for m in re.findall(r"\[[^\[\]]*\]", t)}
        rc, out, _ = run_cli(capsys, *path, "--help")
        assert rc == 0
        lost += [(" ".join(path), w) for w in sorted(wanted) if w not in flat(out)]
        checked += len(wanted)
        cmd.get_help(click.Context(cmd, info_name=path[-1] if path else "rotationzoo"))  # rendered from this tree
        capsys.readouterr()
        assert [t for obj in (cmd, *cmd.params) for t in (getattr(obj, "help", None), cmd.short_help) if t] == declared
    assert lost == [] and checked >= 8
    rc, out, _ = run_cli(capsys, "fit", "--help")
    assert "the files hold [layers, KV heads, d, d] and" in flat(out) and "[L, H_kv, d, d]" in flat(out)
    rc, out, _ = run_cli(capsys, "verify", "--help")
    assert "(matrices [d, d] or [H_kv, d, d])" in flat(out)


# -- verify ----------------------------------------------------------------------------------------


def _pair(folder, d: int = 8):
    deep = folder / ("nested-" * 12) / "rotations"
    for side, obj, seed in (("k", "qqt_r_h_pbr", 1), ("v", "sst_r_h_pbr", 2)):
        write_rotation(deep / f"{side}_rotation_{obj}.pt",
                       RotationSet(rotations=random_orthogonal(2, d, seed), layer_ids=(0, 1), objective=obj))
    return deep / "k_rotation_qqt_r_h_pbr.pt", deep / "v_rotation_sst_r_h_pbr.pt"


def test_verify_file_column_keeps_the_end_of_long_paths(tmp_path, capsys, monkeypatch) -> None:
    from rotationzoo.cli import _output

    k, v = _pair(tmp_path)
    rc, out, _ = run_cli(capsys, "verify", str(k), str(v))
    assert rc == 0 and str(k) in out and str(v) in out  # a pipe: whole paths
    monkeypatch.setattr(_output, "PIPE_WIDTH", 100)  # as a 100-column terminal
    rc, out, _ = run_cli(capsys, "verify", str(k), str(v))
    assert rc == 0 and "…/k_rotation_qqt_r_h_pbr.pt" in out and "…/v_rotation_sst_r_h_pbr.pt" in out
    assert max(len(line) for line in out.splitlines()) <= 100


def test_verify_accepts_a_pair_folder(tmp_path, capsys) -> None:
    k, v = _pair(tmp_path)
    rc, out, _ = run_cli(capsys, "verify", str(k.parent), "--json")
    reports = json.loads(out)
    assert rc == 0 and [Path(r["path"]).name for r in reports] == [k.name, v.name]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, _ = run_cli(capsys, "verify", str(empty))
    assert rc == 1 and "no rotation pair found" in out


def test_verify_strips_ansi_codes_from_messages(tmp_path, capsys, monkeypatch) -> None:
    k, _ = _pair(tmp_path)

    def coloured(*a, **k):
        raise RuntimeError("Weights only load failed. \x1b[1mdo those steps only if you trust it\x1b[0m.")

    monkeypatch.setattr(torch, "load", coloured)
    for extra in ((), ("--json",)):
        rc, out, err = run_cli(capsys, "verify", str(k), *extra)
        assert rc == 1 and "do those steps only" in out
        assert "\x1b" not in out and "\x1b" not in err


def test_every_short_flag_means_one_thing() -> None:
    """``-t`` is --tag wherever it exists, ``-o`` --out, ``-n`` --dry-run, …: never two options."""
    import click
    import typer.main

    from rotationzoo.cli.main import app

    meaning: dict[str, set[str]] = {}

    def walk(cmd: click.Command) -> None:
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(click.Context(cmd)):
                walk(cmd.get_command(click.Context(cmd), name))
            return
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            longs = [o for o in p.opts + p.secondary_opts if o.startswith("--")]
            for o in p.opts:
                if len(o) == 2 and o.startswith("-") and o != "-h":
                    meaning.setdefault(o, set()).add(longs[0] if longs else o)

    walk(typer.main.get_command(app))
    clashes = {short: sorted(longs) for short, longs in meaning.items() if len(longs) > 1}
    assert clashes == {}, clashes
    assert meaning["-t"] == {"--tag"} and meaning["-o"] == {"--out"} and meaning["-n"] == {"--dry-run"}


# -- text from files reaches the terminal escaped --------------------------------------------------

#: What a hostile file may hold in its metadata: clear the screen, recolour, start a forged line, reverse text.
EVIL = "qqt\x1b[2J\x1b[31mRED\nimported OK: trusted pair from the registry\u202eevil"
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")  # all but the line ends


def _hostile_pair(folder: Path) -> Path:
    """A valid K/V pair whose ``objective`` and recorded calibration hold control characters."""
    folder.mkdir(parents=True)
    for side, seed in (("k", 1), ("v", 2)):
        path = folder / f"{side}_rotation_x.pt"
        write_rotation(path, RotationSet(rotations=random_orthogonal(2, 8, seed), layer_ids=(0, 1), objective="x"))
        data = torch.load(path, weights_only=True)
        data["objective"] = EVIL
        data["calibration"] = {"generation_id": "g1\nimported OK: trusted pair from the registry\x1b[0m", "tokens": 5}
        torch.save(data, path)
    return folder


def _no_raw_control(out: str, err: str) -> None:
    for text in (out, err):
        assert not RAW.search(text), repr(text)
        assert not any(line.lstrip().startswith("imported OK") for line in text.splitlines()), text


def test_printable_shows_control_characters_escaped() -> None:
    from rotationzoo.cli._output import printable

    assert printable("a\x1b[2J\nb\u202ec\x9b\x7f\t\r\x00\u2066") == "a\\x1b[2J\\nb\\u202ec\\x9b\\x7f\\t\\r\\x00\\u2066"
    assert printable("Qwen/Qwen3-8B été ✓ […]") == "Qwen/Qwen3-8B été ✓ […]"  # printable text unchanged
    assert printable("\x1b[1mbold\x1b[0m \x07", drop_ansi=True) == "bold \\x07"  # a library's colours dropped


def test_an_error_keeps_its_own_lines_and_escapes_the_rest(capsys) -> None:
    """A failed fetch says one line per source tried, then a hint: those lines stay; nothing else in the
    message reaches the terminal raw (a whole ANSI sequence is dropped, as a library's colours are)."""
    from rotationzoo.cli._output import print_error

    print_error("could not fetch X from 2 source(s):\n  a: refused \x1b[2J\u202e\n  b: 404\nhint: try --offline")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["error: could not fetch X from 2 source(s):", "  a: refused \\u202e", "  b: 404",
                     "hint: try --offline"]


def test_verify_and_cache_import_print_file_metadata_escaped(tmp_path, capsys) -> None:
    pair = _hostile_pair(tmp_path / "calib")
    rc, out, err = run_cli(capsys, "verify", str(pair))
    _no_raw_control(out, err)
    rows = [line for line in out.splitlines() if "_rotation_x.pt" in line]
    assert len(rows) == 2, out  # one line per file: nothing in a cell starts a line of its own
    if rc == 0:
        assert all("\\x1b[2J" in row and "\\n" in row and "\\u202e" in row for row in rows), out
        rc, out, _ = run_cli(capsys, "verify", str(pair), "--json")
        assert {r["objective"] for r in json.loads(out)} == {EVIL}  # JSON keeps the value exact
    rc, out, err = run_cli(capsys, "cache", "import", str(pair), "--name", "esc")
    _no_raw_control(out, err)
    if rc == 0:
        assert "generation_id g1\\nimported OK" in out
        rc, out, err = run_cli(capsys, "cache", "ls")
        _no_raw_control(out, err)


# -- errors before and around the command: JSON when --json is among the arguments ------------------


@pytest.mark.parametrize("argv, says", [
    (("fetch", "--model", "X", "--source", "bogus", "--json"), "Invalid value for '--source'"),
    (("fetch", "--model", "X", "--json", "--source", "bogus"), "Invalid value for '--source'"),
    (("fetch", "--bogus", "--json"), "No such option"),
    (("lst", "--json"), "No such command 'lst'"),
    (("verify", "x.pt", "--head-dim", "0", "--json"), "head_dim must be a positive integer"),
    (("serve-args", "Qwen3-8B", "--tp", "x", "--format", "json"), "Invalid value for '--tp-size'"),
])
def test_usage_error_with_json_is_one_json_document(capsys, argv, says) -> None:
    rc, out, err = run_cli(capsys, *argv)
    got = json.loads(out)["error"]
    assert rc == 2 and err == "" and got["type"] == "UsageError" and says in got["message"]
    assert "\n" not in got["message"] and got["message"].endswith("--help)")


def test_usage_error_without_json_is_one_line_on_stderr(capsys) -> None:
    rc, out, err = run_cli(capsys, "fetch", "--model", "X", "--source", "bogus")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: Invalid value for '--source'") and "(see rotationzoo fetch --help)" in err
    rc, out, err = run_cli(capsys, "cache", "ls", "--bogus\x1b[2J")  # the echoed argument: escaped
    assert rc == 2 and out == "" and err.count("\n") == 1 and "\x1b" not in err and "\\x1b[2J" in err
    rc, out, _ = run_cli(capsys, "fetch", "--help")  # help is no error
    assert rc == 0 and "--source" in out


def test_bad_debug_variable_with_json_is_json(capsys, monkeypatch) -> None:
    monkeypatch.setenv("ROTATIONZOO_DEBUG", "maybe")
    rc, out, err = run_cli(capsys, "list", "--json")
    got = json.loads(out)["error"]
    assert rc == 1 and err == "" and got["type"] == "ConfigError" and "ROTATIONZOO_DEBUG='maybe'" in got["message"]
    rc, out, err = run_cli(capsys, "list")
    assert rc == 1 and out == "" and err.startswith("error: ROTATIONZOO_DEBUG='maybe'") and err.count("\n") == 1


def _interrupt(*a, **k):
    raise KeyboardInterrupt


def test_ctrl_c_is_reported_and_exits_130(capsys, monkeypatch) -> None:
    monkeypatch.setattr("rotationzoo.registry.list_models", _interrupt)
    rc, out, err = run_cli(capsys, "list", "--json")
    assert rc == 130 and err == ""
    assert json.loads(out) == {"error": {"type": "Interrupted", "message": "interrupted"}}
    rc, out, err = run_cli(capsys, "list")
    assert rc == 130 and out == "" and err == "error: interrupted\n"


def test_sigint_with_json_prints_the_json_error(tmp_path) -> None:
    """A real SIGINT in a running command (what Ctrl-C sends), in a child process."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, sys, rotationzoo.registry as r\n"
            "from rotationzoo.cli.main import main\n"
            "r.list_models = lambda pattern=None: os.kill(os.getpid(), signal.SIGINT) or __import__('time').sleep(30)\n"
            "sys.exit(main(['list', '--json']))\n")
    env = {**os.environ, "ROTATIONZOO_DEBUG": "0"}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert got.returncode == 130, got.stderr
    assert json.loads(got.stdout) == {"error": {"type": "Interrupted", "message": "interrupted"}}


def test_sigterm_runs_the_commands_cleanup_and_exits_143(tmp_path) -> None:
    """`timeout` or a job scheduler sends SIGTERM: the command's finally blocks run (a capture's temporary K/V
    folder was left in TMPDIR for good), then one line and exit 143."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, sys, tempfile, rotationzoo.registry as r\n"
            "from rotationzoo.cli.main import main\n"
            "def slow(pattern=None):\n"
            "    with tempfile.TemporaryDirectory(prefix='rotationzoo-kv-') as d:\n"
            "        open(os.path.join(d, 'chunk.pt'), 'w').write('x')\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        __import__('time').sleep(30)\n"
            "r.list_models = slow\n"
            "sys.exit(main(['list']))\n")
    env = {**os.environ, "ROTATIONZOO_DEBUG": "0", "TMPDIR": str(tmp_path)}
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert got.returncode == 143, got.stderr
    assert got.stderr.strip().splitlines()[-1] == "error: terminated (SIGTERM)"
    assert not list(tmp_path.glob("rotationzoo-kv-*"))  # cleaned up on the way out
