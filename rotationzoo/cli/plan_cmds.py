"""``rotationzoo plan``: KV-cache memory of BF16, FP8 and OSCAR INT2, and how many sequences fit.

Examples::

    rotationzoo plan --model Qwen3-8B --context 131072
    rotationzoo plan -m Qwen3-8B --context 131072 --gpu-memory 80GiB --batch 8
    rotationzoo plan -m GLM-4.7-FP8 --context 32768 --gpu-memory 1128GB --engine sglang --json
    rotationzoo plan -m Qwen3-32B --context 65536 --gpu-memory 141GB --scale-dtype bfloat16 --reserve 0.15

Pure arithmetic from the registry (no torch, no download).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from .. import vocab
from ..errors import CLIError
from ._options import (GroupOpt, HpDtypeOpt, JsonOpt, PrefixOpt, RecentOpt, ScaleDtypeOpt, TagOpt, config_changes,
                       usage_errors)
from ._output import console, emit_json, printable

_LABELS = {"bf16": "BF16", "fp8": "FP8", "oscar_int2": "OSCAR INT2"}
#: ``--engine``: the engines of the engine table (``rotationzoo.vocab.ENGINES``, what ``plan`` accepts).
_ENGINE_HELP = (" | ".join(vocab.ENGINES) + " (llama.cpp / llama-cpp work too): the engine whose KV page size the "
                "capacities are rounded to (the SGLang targets: 4·itemsize(hp_dtype) tokens; the vLLM targets: "
                "16-token blocks; llamacpp: 1).")


def gib(n: int | None) -> str:
    """``n`` bytes as GiB with two decimals (``–`` for None)."""
    return "–" if n is None else f"{n / 2**30:,.2f} GiB"


def _num(n: int | None) -> str:
    return "–" if n is None else f"{n:,}"


def _budget_line(p: Any) -> str:
    if p.kv_budget_bytes is None:
        return "no --gpu-memory: capacities not computed"
    return (f"KV budget {gib(p.kv_budget_bytes)} = {gib(p.gpu_memory_bytes)} × (1 − {p.reserve:g} reserve) − weights "
            f"{gib(p.weights_bytes)} ({p.weights_source})")


def render(p: Any) -> None:
    """Print a plan as a rich table plus its header, budget and notes."""
    from rich.table import Table

    from rich.markup import escape

    con = console()
    cfg = p.config
    what = escape(printable(f"{p.model}@{p.tag}" if p.tag else p.model))  # a registry id or a model folder's name
    con.print(f"[bold]{what}[/]: {p.layers_with_kv} KV layers × {p.num_kv_heads} KV heads × d {p.head_dim}; "
              f"{p.context:,} tokens × {p.batch} sequence{'s' if p.batch != 1 else ''}; {p.engine} pages of "
              f"{p.page_size} tokens")
    con.print(f"OSCAR INT2: {cfg.label(p.head_dim)} (windows in {cfg.hp_dtype}, scale/zero in {cfg.scale_dtype})")
    con.print(printable(_budget_line(p)), markup=False)
    table = Table(show_header=True, header_style="bold")
    for col in ("KV format", "bytes/token", "bits/elem", "per sequence", f"× {p.batch}", "fits", "vs BF16",
                "max context", "max sequences"):
        table.add_column(col, justify="left" if col == "KV format" else "right")
    for f in p.formats:
        table.add_row(_LABELS[f.name], _num(f.bytes_per_token), f"{f.bits_per_element:.4f}", gib(f.sequence_bytes_paged),
                      gib(f.batch_bytes_paged), {True: "yes", False: "no", None: "–"}[f.fits],
                      f"{f.saving_vs_bf16:.2f}×", _num(f.max_context),
                      _num(f.max_sequences))
    con.print(table)
    con.print("[dim]bytes/token: all KV layers, K and V (for INT2, an INT2 token; window tokens cost hp_dtype bytes); sizes are "
              "rounded to whole pages; max context is for the batch, max sequences at this context[/]")
    for note in p.notes:
        con.print(f"[dim]note: {escape(printable(note, drop_ansi=True))}[/]")


def cmd_plan(
    model_arg: Annotated[Optional[str], typer.Argument(metavar="MODEL", help="Model id or alias (e.g. Qwen3-8B; "
                         "MODEL@TAG works too).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="The same as MODEL.")] = None,
    context: Annotated[Optional[int], typer.Option("--context", "-c", help="Tokens per sequence (1 to 2^30).")] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", "-b", help="Concurrent sequences for the totals "
                     "and for max context (default 1; at most 2^20).")] = None,
    gpu_memory: Annotated[Optional[str], typer.Option("--gpu-memory", help="GPU memory for one model replica: 80GiB "
                          "(binary, 1024³), 80GB or 80G (decimal, 10⁹), 80000MiB; a number without a unit is bytes, "
                          "at least 1 MiB (80 alone is refused: write 80GiB); at most 1024TiB (2⁵⁰ bytes). Without it "
                          "no capacities.")] = None,
    engine: Annotated[str, typer.Option("--engine", "-e", help=_ENGINE_HELP)] = "sglang",
    weights_gib: Annotated[Optional[float], typer.Option("--weights-gib", help="Weights in GiB, 0 to 2^20 (default: "
                           "the registry's num_parameters × bytes(weight_dtype)).")] = None,
    reserve: Annotated[float, typer.Option("--reserve", help="Fraction of GPU memory kept for activations and "
                       "workspace, in [0, 1).")] = 0.1,
    tag: TagOpt = None,
    group_size: GroupOpt = None,
    scale_dtype: ScaleDtypeOpt = None,
    prefix_tokens: PrefixOpt = None,
    recent_tokens: RecentOpt = None,
    hp_dtype: HpDtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """KV-cache memory of BF16, FP8 and OSCAR INT2 for a model and context, and how many sequences fit.

    Per token: 2 (K, V) × KV layers × KV heads × head_dim × bits / 8 bytes; OSCAR INT2 tokens cost
    2 + 2·bits(scale_dtype)/G bits, and each sequence keeps prefix + recent window tokens in
    hp_dtype. The INT2 settings are the entry's serving defaults unless overridden. Capacities use
    gpu_memory × (1 − reserve) − weights, rounded down to the engine's page size. See docs/plan.md.

    Examples:  rotationzoo plan --model Qwen3-8B --context 131072  |
    rotationzoo plan -m Qwen3-8B -c 131072 --gpu-memory 80GiB --batch 8  |
    rotationzoo plan -m Qwen3-32B -c 65536 --gpu-memory 141GB --scale-dtype bfloat16 --json
    """
    from ..int2kv import MAX_CONTEXT_TOKENS
    from ..numbers import check_int
    from ..planner import MAX_BATCH, check_reserve, gib_bytes, parse_gpu_memory, plan
    from ..registry import get_model
    from ..registry.model import split_model_tag

    name = model_arg or model
    if name is None:
        raise CLIError("give the model: rotationzoo plan --model MODEL --context TOKENS (see `rotationzoo list`)")
    if model_arg and model and model_arg != model:
        raise CLIError(f"MODEL {model_arg!r} and --model {model!r} disagree; give one")
    if context is None:
        raise CLIError("give --context TOKENS (tokens per sequence, e.g. 131072)")
    with usage_errors():  # the planner's own bounds, named as the options
        check_int(context, "--context", low=1, high=MAX_CONTEXT_TOKENS, hint=" tokens (2^30)")
        if batch is not None:
            check_int(batch, "--batch", low=1, high=MAX_BATCH, hint=" sequences (2^20)")
        check_reserve(reserve, "--reserve")
    base, at_tag = split_model_tag(name)
    if tag and at_tag and tag != at_tag:
        raise CLIError(f"--tag {tag!r} and MODEL@{at_tag} disagree; give one")
    entry = get_model(base).tag(tag or at_tag)
    with usage_errors():  # sizes and INT2-KV knobs the command line gives: the library's bounds, exit 2
        config = entry.serving.replace(**config_changes(group_size=group_size, scale_dtype=scale_dtype,
                                                        prefix_tokens=prefix_tokens, recent_tokens=recent_tokens,
                                                        hp_dtype=hp_dtype))
        gpu_bytes = parse_gpu_memory(gpu_memory) if gpu_memory is not None else None
        weights = gib_bytes(weights_gib, "--weights-gib") if weights_gib is not None else None
        result = plan(entry, context=context, batch=batch, engine=engine, config=config, reserve=reserve,
                      gpu_memory_bytes=gpu_bytes, weights_bytes=weights)  # a group size the head_dim refuses
    if json_out:
        emit_json(result.to_json())
        return
    render(result)


def register(app: typer.Typer) -> None:
    """Add ``plan`` to the CLI."""
    app.command("plan", no_args_is_help=True)(cmd_plan)
