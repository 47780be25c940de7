"""`plan` refuses impossible numbers with one line, and one group-size rule holds for the INT2
configuration, the kernels and the planner.

Each bad value is given on the command line as a user would type it (NaN, infinities, 400-digit
numbers, negatives, zero, values just past the documented bound) and through the library; every
refusal is one ``error:`` line naming the option, never an internal error or a traceback.
"""

from __future__ import annotations

import pytest
import torch

from rotationzoo.cli.main import main
from rotationzoo.errors import ConfigError, KernelInputError
from rotationzoo.int2kv import HEAD_DIMS, MAX_CONTEXT_TOKENS, Int2KVConfig, allowed_group_sizes, check_group_size
from rotationzoo.kernels import quantize_int2
from rotationzoo.planner import MAX_BATCH, MAX_MEMORY_BYTES, gib_bytes, parse_size, plan
from rotationzoo.registry import Architecture

from helpers import int2_config

NINES_400 = "9" * 400
GIB = 2**30


def one_error_line(capsys, *argv: str, rc_expected: int = 1) -> str:
    """Run the CLI; assert it failed (exit ``rc_expected``) with exactly one ``error:`` line and no internal error;
    return it."""
    rc = main(list(argv))
    cap = capsys.readouterr()
    lines = [line for line in cap.err.splitlines() if line.strip()]
    assert rc == rc_expected, (rc, cap.out[-300:], cap.err[-300:])
    assert len(lines) == 1 and lines[0].startswith("error: "), cap.err
    assert "internal error" not in cap.err and "Traceback" not in cap.err
    return lines[0]


BASE = ("plan", "--model", "Qwen3-8B", "--context", "4096")

# (extra argv, text the one line must hold): every numeric option of `plan`, each impossible value
CLI_CASES = [
    (("--weights-gib", "nan", "--gpu-memory", "80GiB"), "--weights-gib must be a finite number"),
    (("--weights-gib", "inf", "--gpu-memory", "80GiB"), "--weights-gib must be a finite number"),
    (("--weights-gib", "-inf", "--gpu-memory", "80GiB"), "--weights-gib must be a finite number"),
    (("--weights-gib", "1e300", "--gpu-memory", "80GiB"), "--weights-gib must be a finite number"),
    (("--weights-gib", "-1", "--gpu-memory", "80GiB"), "--weights-gib must be a finite number"),
    (("--weights-gib", str(2**20 + 1), "--gpu-memory", "80GiB"), "in [0, 1,048,576]"),
    (("--gpu-memory", NINES_400), "cannot read the size"),
    (("--gpu-memory", "9" * 30 + "GiB"), "must be from one byte to"),
    (("--gpu-memory", "1.1PB"), "cannot read the size"),
    (("--gpu-memory", "1025TiB"), "must be from one byte to 1,125,899,906,842,624 bytes"),
    (("--gpu-memory", "nan"), "cannot read the size"),
    (("--gpu-memory", "inf"), "cannot read the size"),
    (("--gpu-memory", "0"), "must be from one byte"),
    (("--gpu-memory", "0.1"), "must be from one byte"),
    (("--gpu-memory", "-80GiB"), "cannot read the size"),
    # --reserve: a usage error (exit 2), test_plan_refuses_impossible_reserves below
    (("--prefix-tokens", "-1"), "prefix_tokens must be an integer from 0 to 1,073,741,824"),
    (("--prefix-tokens", NINES_400), "prefix_tokens must be an integer from 0"),
    (("--recent-tokens", str(MAX_CONTEXT_TOKENS + 1)), "recent_tokens must be an integer from 0 to 1,073,741,824"),
    (("-g", "8"), "group_size 8 is not one the INT2 kernels run"),
    (("-g", "0"), "group_size 0 is not one the INT2 kernels run"),
    (("-g", "-16"), "group_size -16 is not one the INT2 kernels run"),
    (("-g", "48"), "group_size 48 is not one the INT2 kernels run"),
    (("-g", "256"), "group_size 256 is not valid for head_dim 128; expected one of 128, 64, 32, 16"),
    (("-g", NINES_400), "(400 characters)"),
]


@pytest.mark.parametrize("extra,message", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_plan_refuses_impossible_numbers_with_one_line(capsys, extra, message) -> None:
    """Values the command line alone gives: a usage error (exit 2) with the library's bound."""
    line = one_error_line(capsys, *BASE, *extra, rc_expected=2)
    assert message in line, line
    assert len(line) < 400  # a 400-digit value is not echoed whole


@pytest.mark.parametrize("context", ["0", "-1", str(MAX_CONTEXT_TOKENS + 1), NINES_400])
def test_plan_refuses_impossible_contexts(capsys, context) -> None:
    """A usage error naming the option (exit 2, as ``plan`` without ``--context``), with the planner's bound."""
    line = one_error_line(capsys, "plan", "--model", "Qwen3-8B", "--context", context, rc_expected=2)
    assert "error: --context must be an integer from 1 to 1,073,741,824 tokens" in line
    assert len(line) < 400  # a 400-digit value is not echoed whole


@pytest.mark.parametrize("batch, message", [
    ("0", "--batch must be an integer from 1 to 1,048,576"),
    ("-3", "--batch must be an integer from 1"),
    (str(MAX_BATCH + 1), "--batch must be an integer from 1 to 1,048,576"),
    (NINES_400, "(400 characters)"),
])
def test_plan_refuses_impossible_batches(capsys, batch, message) -> None:
    line = one_error_line(capsys, *BASE, "--batch", batch, rc_expected=2)
    assert message in line and len(line) < 400, line


def test_the_acceptance_case_g8() -> None:
    """`rotationzoo plan --model Qwen3-8B --context 4096 -g 8` fails with one line (checked end to end)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", "plan", "--model", "Qwen3-8B", "--context",
                        "4096", "-g", "8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""  # a usage error
    assert r.stderr.strip().splitlines() == [
        "error: group_size 8 is not one the INT2 kernels run; expected one of 256, 128, 64, 32, 16 (or None for head_dim)"]


def test_bounds_are_inclusive_and_reachable() -> None:
    p = plan("Qwen3-8B", context=MAX_CONTEXT_TOKENS, batch=MAX_BATCH, gpu_memory_bytes=MAX_MEMORY_BYTES,
             weights_bytes=MAX_MEMORY_BYTES, reserve=0.99)
    assert p.context == MAX_CONTEXT_TOKENS and p.format("bf16").fits is False
    assert parse_size("1024TiB") == MAX_MEMORY_BYTES == gib_bytes(2**20) and parse_size("1") == 1
    assert plan("Qwen3-8B", context=1, config=Int2KVConfig(prefix_tokens=MAX_CONTEXT_TOKENS)).context == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"context": 2**70}, "context must be an integer from 1"),
    ({"context": 10.0}, "context must be an integer"),
    ({"context": True}, "context must be an integer"),
    ({"context": 8, "batch": 0}, "batch must be"),
    ({"context": 8, "gpu_memory_bytes": 2**51}, "gpu_memory_bytes must be an integer from 1 to"),
    ({"context": 8, "gpu_memory_bytes": float("inf")}, "gpu_memory_bytes must be an integer"),
    ({"context": 8, "gpu_memory_bytes": GIB, "weights_bytes": -1}, "weights_bytes must be an integer from 0"),
    ({"context": 8, "gpu_memory_bytes": GIB, "weights_bytes": 10**300}, "weights_bytes must be an integer from 0"),
    ({"context": 8, "reserve": float("nan")}, "reserve must be a finite number"),
    ({"context": 8, "reserve": 10**400}, "reserve must be a finite number"),
])
def test_plan_library_refuses_impossible_numbers(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan("Qwen3-8B", **kwargs)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1e-9, 2.0**20 + 1, "1", None, True])
def test_gib_bytes(value) -> None:
    with pytest.raises(ConfigError):
        gib_bytes(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["1" * 41, "2PiB", "1e3GB", "nanGB", "0.0000001"])
def test_parse_size_bounds(text) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("field,value", [("k_clip_ratio", float("nan")), ("v_clip_ratio", float("-inf")),
                                         ("k_clip_ratio", -0.01), ("v_clip_ratio", 1.01), ("k_clip_ratio", 10**400),
                                         ("prefix_tokens", -1), ("recent_tokens", 2**31), ("prefix_tokens", 1.0)])
def test_config_numbers_are_bounded(field, value) -> None:
    with pytest.raises(ConfigError, match=field):
        Int2KVConfig(**{field: value})


# -- one group-size rule ---------------------------------------------------------------------------

CANDIDATES = (None, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


def _kernel_runs(d: int, g: int | None, lloyd_max: bool = False) -> bool:
    """The kernels take the group size in a config: a size the config refuses never reaches them."""
    try:
        quantize_int2(torch.ones(1, d), config=int2_config(0.0, g, lloyd_max=lloyd_max), backend="torch")
    except (KernelInputError, ConfigError):
        return False
    return True


def _config_plans(d: int, g: int | None, lloyd_max: bool = False) -> tuple[str, ...] | None:
    """The plan's notes, or None when the configuration or the plan is refused."""
    try:
        cfg = Int2KVConfig(group_size=g, lloyd_max=lloyd_max)
        return plan(Architecture(head_dim=d, num_layers=2, num_kv_heads=1), context=16, config=cfg).notes
    except ConfigError:
        return None


@pytest.mark.parametrize("d", (*HEAD_DIMS, 16, 32, 512))
def test_config_kernels_and_planner_agree_on_every_group_size(d) -> None:
    """The configuration, the kernels and the planner accept exactly the same (head_dim, group_size);
    Lloyd-Max levels (no change to the bytes) need one group per row in the kernels, which the plan notes."""
    for g in CANDIDATES:
        kernel = _kernel_runs(d, g) if d in HEAD_DIMS else False
        assert (_config_plans(d, g) is not None) == kernel, (d, g)
        assert kernel == (d in HEAD_DIMS and (g is None or g in allowed_group_sizes(d))), (d, g)
        notes = _config_plans(d, g, lloyd_max=True)
        assert (notes is not None) == kernel, (d, g)
        lloyd_runs = _kernel_runs(d, g, lloyd_max=True) if kernel else False
        assert lloyd_runs == (kernel and g in (None, d)), (d, g)
        if kernel:
            assert any("lloyd_max with group_size" in n for n in notes or ()) == (not lloyd_runs), (d, g)


def test_the_rule_lists_what_it_allows() -> None:
    assert allowed_group_sizes(128) == (128, 64, 32, 16) and allowed_group_sizes(64) == (64, 32, 16)
    assert check_group_size(None, 256) == 256 and check_group_size(32) == 32 and check_group_size(None) is None
    with pytest.raises(ConfigError, match="head_dim 96 is not one the INT2 kernels run; expected one of 64, 128, 256"):
        check_group_size(None, 96)
    with pytest.raises(ConfigError, match="must be an integer"):
        check_group_size("16")


def test_numbers_checks() -> None:
    """The shared checks refuse non-finite values even under an infinite bound, and cut long echoes."""
    import math

    from rotationzoo.errors import RegistryError
    from rotationzoo.numbers import check_int, check_real, shown

    for bad in (math.inf, math.nan, -math.inf):
        with pytest.raises(ConfigError, match="finite"):
            check_real(bad, "x", low=-math.inf, high=math.inf)
    assert check_real(3, "x", low=0, high=math.inf) == 3.0
    with pytest.raises(RegistryError, match="x must be an integer from 0 to 5, got True"):
        check_int(True, "x", low=0, high=5, error=RegistryError)
    assert len(shown(10**400)) <= 80 and "(401 characters)" in shown(10**400)
    assert "digits" in shown(10**5000)  # past Python's int-to-text limit


@pytest.mark.parametrize("reserve", ["1", "nan", "-0.1", "inf", "1.5"])
def test_plan_refuses_impossible_reserves(capsys, reserve) -> None:
    """``--reserve 1`` exited 1 while --context and --batch out of bounds exit 2: now a usage error (exit 2)
    naming ``--reserve``, with the planner's own bound (:func:`~rotationzoo.planner.check_reserve`)."""
    from rotationzoo.planner import check_reserve

    line = one_error_line(capsys, *BASE, "--reserve", reserve, rc_expected=2)
    assert "error: --reserve must be a finite number in [0, 1)" in line, line
    with pytest.raises(ConfigError, match=r"^reserve must be a finite number in \[0, 1\)"):
        check_reserve(float(reserve))
    with pytest.raises(ConfigError, match=r"^reserve must be a finite number in \[0, 1\)"):
        plan("Qwen3-8B", context=8, reserve=float(reserve))


@pytest.mark.parametrize("text", ["80", "141", "80.5", "4096", "1048575"])
def test_plan_refuses_a_gpu_memory_without_its_unit(capsys, text) -> None:
    """``--gpu-memory 80`` was planned as 80 bytes (a negative KV budget printed): a number without a unit below
    1 MiB is refused with one line saying what was probably meant; parse_size still reads byte counts."""
    line = one_error_line(capsys, *BASE, "--gpu-memory", text, rc_expected=2)
    assert f"did you mean {text}GiB?" in line and "has no unit" in line, line
    assert parse_size(text) == round(float(text))  # the library's byte count, as documented


@pytest.mark.parametrize("text,value", [("1048576", 2**20), ("80GiB", 80 * GIB), ("80B", 80), ("1024TiB", 2**50)])
def test_gpu_memory_with_a_unit_or_a_large_byte_count_is_read(text, value) -> None:
    from rotationzoo.planner import parse_gpu_memory

    assert parse_gpu_memory(text) == value


def test_the_gpu_memory_help_names_only_units_it_reads(capsys) -> None:
    """The help said "at most 1 PiB", but PiB is not a unit --gpu-memory reads: the largest is written 1024TiB."""
    import re

    import click
    import typer.main

    from rotationzoo.cli.main import app

    command = typer.main.get_command(app).commands["plan"]  # type: ignore[attr-defined]
    help_text = next(p.help for p in command.params if isinstance(p, click.Option) and "--gpu-memory" in p.opts)
    for size in re.findall(r"\b\d[\d.]*\s*[A-Za-z]+\b", help_text or ""):
        if size.split()[-1] in ("alone", "bytes"):  # "80 alone", "2⁵⁰ bytes": prose, not a size
            continue
        parse_size(size)  # every size the help shows is one it reads
    assert "1024TiB" in (help_text or "") and "PiB" not in (help_text or "")
