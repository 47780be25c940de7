"""Fetching and the cache: ``fetch``, ``cache ls|rm|verify``, ``demo``.

Examples::

    rotationzoo fetch --model Qwen3-8B
    rotationzoo fetch --model Qwen3-8B --tag longbench-seq150000_prompt44_group128 --source url --json
    HF_ENDPOINT=https://my-mirror.example rotationzoo fetch --model Qwen3-8B --source huggingface
    rotationzoo cache ls --json
    rotationzoo cache verify
    rotationzoo cache rm --model Qwen3-8B
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import CLIError
from ._output import console, emit_json, print_warning, progress_enabled

JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
CacheDirOpt = Annotated[Optional[Path], typer.Option("--cache-dir", help="Cache root (default: $ROTATIONZOO_CACHE or the user cache dir).")]


def cmd_fetch(
    model: Annotated[str, typer.Option("--model", "-m", help="Model id or alias (e.g. Qwen3-8B).")],
    tag: Annotated[Optional[str], typer.Option("--tag", "-t", help="Calibration tag (default: the model's default).")] = None,
    source: Annotated[str, typer.Option(help="auto (entry order, with failover) | huggingface | modelscope | url | bundled.")] = "auto",
    revision: Annotated[Optional[str], typer.Option(help="Hub revision override (branch, tag or commit sha).")] = None,
    cache_dir: CacheDirOpt = None,
    offline: Annotated[bool, typer.Option("--offline", help="Use only the cache; never touch the network.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Download again even if a verified copy is cached.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Download (once), verify (size, sha256, structure) and cache a model's K and V rotation files.

    Prints the two local paths (or JSON with model, tag, source, and path + sha256 of k and v).

    Examples:  rotationzoo fetch --model Qwen3-8B  |  rotationzoo fetch -m qwen3-8b --source modelscope --json
    """
    import warnings

    from ..api import fetch
    from ..hub import SOURCE_CHOICES

    if source not in SOURCE_CHOICES:
        raise CLIError(f"--source must be one of {', '.join(SOURCE_CHOICES)}, got {source!r}")
    messages: list[str] = []
    show = progress_enabled() and not json_out

    def report(msg: str) -> None:
        messages.append(msg)
        if show:
            console(stderr=True).print(f"[dim]{msg}[/]")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if show:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                          console=console(stderr=True), transient=True) as prog:
                prog.add_task(f"fetching {model}{'@' + tag if tag else ''}", total=None)
                res = fetch(model, tag, source=source, revision=revision, cache_dir=cache_dir,
                            offline=offline or None, force=force, report=report)
        else:
            res = fetch(model, tag, source=source, revision=revision, cache_dir=cache_dir,
                        offline=offline or None, force=force, report=report)
    for w in caught:
        print_warning(str(w.message))
    if json_out:
        out = res.to_json()
        out["messages"] = messages
        emit_json(out)
        return
    for side in ("k", "v"):
        typer.echo(str(res.paths[side]))


cache_app = typer.Typer(help="Inspect, verify and clean the local rotation cache.", no_args_is_help=True)


@cache_app.command("ls")
def cmd_cache_ls(cache_dir: CacheDirOpt = None, json_out: JsonOpt = False) -> None:
    """List cached rotation files with their model, tag, size and source.

    Example:  rotationzoo cache ls --json
    """
    from ..hub import cache_records, cache_root

    records = cache_records(cache_dir)
    if json_out:
        emit_json({"cache_dir": str(cache_root(cache_dir)), "files": [r.to_json() for r in records]})
        return
    from rich.table import Table

    table = Table(title=f"cache {cache_root(cache_dir)} ({len(records)} files)")
    for col in ("model", "tag", "side", "size", "sha256", "source"):
        table.add_column(col)
    for r in records:
        table.add_row(r.model or "?", r.tag or "?", (r.side or "?").upper(), f"{r.size:,}",
                      (r.sha256 or "-")[:12], r.source or "-")
    console().print(table)


@cache_app.command("verify")
def cmd_cache_verify(
    cache_dir: CacheDirOpt = None,
    keep: Annotated[bool, typer.Option("--keep", help="Report bad files but do not remove them.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-hash every cached file against its verification marker and the registry; remove bad ones.

    Exit 1 if any file was bad.  Example:  rotationzoo cache verify --json
    """
    from ..hub import verify_cache

    records = verify_cache(cache_dir, remove_bad=not keep)
    bad = [r for r in records if not r.ok]
    if json_out:
        emit_json({"checked": len(records), "bad": len(bad), "removed": 0 if keep else len(bad),
                   "files": [r.to_json() for r in records]})
    else:
        c = console()
        for r in records:
            mark = "[green]ok[/]" if r.ok else f"[red]BAD[/] {r.problem}" + ("" if keep else " (removed)")
            c.print(f"{r.path}: {mark}")
        c.print(f"{len(records)} files checked, {len(bad)} bad")
    if bad:
        raise typer.Exit(1)


@cache_app.command("rm")
def cmd_cache_rm(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Only this model.")] = None,
    tag: Annotated[Optional[str], typer.Option("--tag", "-t", help="Only this tag (with --model).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove everything, including the hub clients' caches.")] = False,
    cache_dir: CacheDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove cached files: one model (and tag), or everything with --all.

    Examples:  rotationzoo cache rm --model Qwen3-8B  |  rotationzoo cache rm --all
    """
    from ..hub import remove_cached

    if model is None and not all_:
        raise CLIError("say what to remove: --model M [--tag T], or --all")
    if tag is not None and model is None:
        raise CLIError("--tag needs --model")
    removed = remove_cached(model, tag, cache_dir)
    if json_out:
        emit_json({"removed": [str(p) for p in removed]})
    else:
        typer.echo(f"removed {len(removed)} files")


def cmd_demo(
    model: Annotated[str, typer.Option("--model", "-m", help="Registry model to demonstrate.")] = "SmolLM2-135M-Instruct",
    tag: Annotated[Optional[str], typer.Option("--tag", "-t")] = None,
    tokens: Annotated[int, typer.Option(help="Tokens in the random K tensor.")] = 1024,
    json_out: JsonOpt = False,
) -> None:
    """Load a registry entry (the bundled one by default: no network) and INT2-quantize a tensor with it.

    Resolves, verifies and loads the entry's K/V rotations, then rotates, clips and INT2-quantizes a
    random K-like tensor with layer 0's R_K and reports the reconstruction error with and without
    the rotation.

    Example:  rotationzoo demo  |  rotationzoo demo --json
    """
    import time

    import torch

    from ..api import load
    from ..registry import get_entry

    t0 = time.perf_counter()
    entry = get_entry(model, tag)
    pair = load(model, tag)
    t_load = time.perf_counter() - t0
    s = pair.serving
    d = pair.head_dim
    heads = entry.architecture.num_kv_heads or 1
    g = torch.Generator().manual_seed(0)
    # K-like activations: a few outlier channels, as real keys have
    x = torch.randn(tokens, heads, d, generator=g)
    x[..., : max(1, d // 32)] *= 8.0
    x = x.to(torch.bfloat16)
    out: dict = {
        "model": entry.model_id, "tag": entry.name, "layers": len(pair.layer_ids), "head_dim": d,
        "k_file": str(pair.paths["k"]), "k_sha256": pair.sha256["k"], "load_seconds": round(t_load, 4),
        "group_size": s.group_size, "k_clip_ratio": s.k_clip_ratio,
    }
    try:
        from ..kernels import dequantize_int2, quantize_int2
    except ImportError as exc:  # kernels not available in this build
        out["quantize"] = f"skipped ({exc})"
    else:
        r = pair.k.rotations[0]
        rel = {}
        for name, rot, clip in (("none", None, 0.0), ("rotated", r, 0.0), ("rotated+clip", r, s.k_clip_ratio)):
            codes, sz = quantize_int2(x, rotation=rot, clip_ratio=clip, group_size=s.group_size)
            back = dequantize_int2(codes, sz, group_size=s.group_size, rotation=rot, dtype=torch.float32)
            err = (back - x.float()).norm() / x.float().norm()
            rel[name] = round(float(err), 4)
        out["codes_shape"] = list(codes.shape)
        out["scales_zeros_shape"] = list(sz.shape)
        out["relative_error"] = rel
    if json_out:
        emit_json(out)
        return
    c = console()
    c.print(f"[bold]{out['model']}@{out['tag']}[/]: {out['layers']} layers × d={d}, loaded and validated "
            f"in {t_load * 1e3:.1f} ms from {out['k_file']}")
    c.print(f"K sha256 {out['k_sha256']}")
    if "relative_error" in out:
        c.print(f"INT2 quantized a [{tokens}, {heads}, {d}] bf16 tensor with layer {pair.layer_ids[0]}'s R_K: "
                f"codes {out['codes_shape']} uint8, scales/zeros {out['scales_zeros_shape']} "
                f"(group {s.group_size})")
        for k, v in out["relative_error"].items():
            c.print(f"  relative reconstruction error, {k:>12}: {v:.4f}")
    else:
        c.print(f"quantize: {out['quantize']}")


def register(app: typer.Typer) -> None:
    app.command("fetch")(cmd_fetch)
    app.add_typer(cache_app, name="cache")
    app.command("demo")(cmd_demo)
