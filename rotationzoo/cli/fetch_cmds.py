"""Fetching and the cache: ``fetch``, ``cache ls|rm|verify|import``, ``demo``.

Examples::

    rotationzoo fetch Qwen3-8B
    rotationzoo fetch --model Qwen3-8B --tag longbench-seq150000_prompt44_group128 --source url --json
    HF_ENDPOINT=https://my-mirror.example rotationzoo fetch Qwen3-8B --source huggingface
    rotationzoo cache ls --json
    rotationzoo cache verify
    rotationzoo cache rm --model Qwen3-8B --dry-run
    rotationzoo cache rm --model Qwen3-8B --yes
    rotationzoo cache import ~/.cache/huggingface/oscar-rotations/Qwen3-8B-0123456789ab
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import CLIError
from ._options import (
    CacheDirOpt,
    Group,
    JsonOpt,
    OfflineOpt,
    RevisionOpt,
    SourceOpt,
    TagOpt,
    TimeoutOpt,
    usage_errors,
)
from ._output import (
    console,
    emit_json,
    print_warning,
    printable,
    progress_enabled,
    stdin_is_tty,
)


def cmd_fetch(
    model_arg: Annotated[Optional[str], typer.Argument(metavar="MODEL", help="Model id or alias (e.g. Qwen3-8B; MODEL@TAG works too).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="The same as MODEL.")] = None,
    tag: TagOpt = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Download again even if a verified copy is cached.")] = False,
    accept_new: Annotated[bool, typer.Option(
        "--accept-new", help="For files the registry does not pin: download again and accept (re-pin) a file that "
                             "differs from the one pinned on first use.")] = False,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Download (once), verify (size, sha256, structure) and cache a model's K and V rotation files.

    Prints the two local paths (or JSON with model, tag, source, and path, sha256 and size of k and v).
    Sources are tried in the registry's order; an unreachable one is skipped at once. For a model whose
    rotations are an MLA latent set (GLM-5.2), every layer_<id>.pt is fetched and checked, and the
    folder is printed.

    Examples:  rotationzoo fetch Qwen3-8B  |  rotationzoo fetch -m qwen3-8b --source modelscope --json
    |  rotationzoo fetch Qwen3-8B --accept-new  |  rotationzoo fetch GLM-5.2
    """
    import warnings

    from rich.markup import escape

    from ..api import fetch

    name = model_arg or model
    if name is None:
        raise CLIError("give the model to fetch: rotationzoo fetch MODEL (see `rotationzoo list`)")
    if model_arg and model and model_arg != model:
        raise CLIError(f"MODEL {model_arg!r} and --model {model!r} disagree; give one")
    messages: list[str] = []
    show = progress_enabled() and not json_out

    def report(msg: str) -> None:
        messages.append(msg)
        if show:
            console(stderr=True).print(f"[dim]{escape(printable(msg, drop_ansi=True))}[/]", markup=True)

    from ..mla import latent_model

    if latent_model(name, tag) is not None:  # an MLA latent set: a folder of layer files
        from .latent_cmds import fetch_latent_cmd

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fetch_latent_cmd(name, source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                             timeout=timeout, force=force, accept_new=accept_new, report=report, json_out=json_out,
                             messages=messages)
        for w in caught[:1]:  # one line for the set, not one per layer file
            print_warning(f"{len(caught)} latent layer files are not pinned in the registry; each was validated and "
                          f"pinned on first use" if len(caught) > 1 else str(w.message))
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fetch(name, tag, source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                    timeout=timeout, force=force, accept_new=accept_new, report=report)
    for w in caught:
        print_warning(str(w.message))
    if json_out:
        out = res.to_json()
        out["messages"] = messages
        emit_json(out)
        return
    for side in ("k", "v"):
        typer.echo(printable(res.paths[side]))


cache_app = typer.Typer(
    cls=Group,
    help="Inspect, verify and clean the local rotation cache.\n\n"
         "Examples:\n\n"
         "  rotationzoo cache ls\n\n"
         "  rotationzoo cache verify --json\n\n"
         "  rotationzoo cache rm --model Qwen3-8B --dry-run   (only lists, with sizes)\n\n"
         "  rotationzoo cache rm --model Qwen3-8B             (lists, then asks)\n\n"
         "  rotationzoo cache rm --all --yes                  (no question)",
    no_args_is_help=True,
)


def human_size(n: int) -> str:
    """``1536`` → ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop returns


@cache_app.command("ls")
def cmd_cache_ls(cache_dir: CacheDirOpt = None, json_out: JsonOpt = False) -> None:
    """List cached files (downloads and files derived from them): model, tag, size, source; then a total.

    Example:  rotationzoo cache ls  |  rotationzoo cache ls --json
    """
    from rich.markup import escape

    from ..hub import cache_records, cache_root

    records = cache_records(cache_dir)
    total = sum(r.size for r in records)
    root = cache_root(cache_dir)
    if json_out:
        emit_json({"cache_dir": str(root), "bytes": total, "files": [r.to_json() for r in records]})
        return
    from rich.table import Table

    c = console()
    if records:
        table = Table(title=escape(printable(f"cache {root}")))
        for col in ("model", "tag", "file", "size", "sha256", "source"):
            table.add_column(col, justify="right" if col == "size" else "left")
        for r in records:
            what = (r.side or "?").upper() if r.area == "files" else f"{r.area}: {r.path.name}"
            cells = (r.model or "?", r.tag or "?", what, human_size(r.size), (r.sha256 or "-")[:12], r.source or "-")
            table.add_row(*(escape(printable(cell)) for cell in cells))  # markers are files: shown literally
        c.print(table)
    c.print(escape(printable(f"total: {len(records)} file{'' if len(records) == 1 else 's'}, {human_size(total)} "
                             f"({total:,} bytes) in {root}")))


@cache_app.command("verify")
def cmd_cache_verify(
    cache_dir: CacheDirOpt = None,
    keep: Annotated[bool, typer.Option("--keep", help="Report bad files but do not remove them.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Re-hash every cached file against its marker (downloads also against the registry, derived
    files against the inputs they were built from); remove bad ones. Each entry is judged while its lock
    is held, so a fetch or import writing it meanwhile is waited for (10 s at most, then the entry is
    left for the next check). Exit 1 if any file was bad or could not be checked.

    Example:  rotationzoo cache verify --json
    """
    from rich.markup import escape

    from ..hub import verify_cache

    records = verify_cache(cache_dir, remove_bad=not keep)
    bad = [r for r in records if r.ok is False]
    busy = [r for r in records if r.ok is None]  # a writer held its entry meanwhile: left for the next check
    if json_out:
        emit_json({"checked": len(records) - len(busy), "bad": len(bad), "not_checked": len(busy),
                   "removed": sum(r.removed for r in records), "files": [r.to_json() for r in records]})
    else:
        c = console()
        for r in records:
            why = escape(printable(r.problem, drop_ansi=True))
            mark = ("[green]ok[/]" if r.ok else f"[yellow]{why}[/]" if r.ok is None
                    else f"[red]BAD[/] {why}" + (" (removed)" if r.removed else " (kept)"))
            c.print(f"{escape(printable(r.path))}: {mark}")
        c.print(f"{len(records) - len(busy)} files checked, {len(bad)} bad"
                + (f", {len(busy)} in use by another process (not checked: run it again)" if busy else ""))
    if bad or busy:
        raise typer.Exit(1)


@cache_app.command("import")
def cmd_cache_import(
    folder: Annotated[Path, typer.Argument(help="A start-up calibration folder of the authors' server "
                                                  "($HF_HOME/oscar-rotations/<model>-<digest12>/), or any pair folder.")],
    name: Annotated[Optional[str], typer.Option("--name", help="Name under imported/ (default: the folder's name).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace another pair imported under the same name.")] = False,
    allow_mixed: Annotated[bool, typer.Option(
        "--allow-mixed", help="Import a K and a V of different provenance (files recording different calibration "
                              "generation ids, or an id other than the manifest's); refused without it.")] = False,
    latent: Annotated[Optional[str], typer.Option("--latent", metavar="MODEL", help="Import FOLDER as MODEL's MLA "
                      "latent set (layer_<id>.pt files), checked against its latent layers first.")] = None,
    subspace: Annotated[bool, typer.Option("--subspace", help="With --latent: FOLDER is the set's high-precision "
                        "subspace folder ([k, rank] files).")] = False,
    accept_new: Annotated[bool, typer.Option("--accept-new", help="With --latent: replace files imported from the "
                          "same folder before that differ now.")] = False,
    cache_dir: CacheDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Copy a rotation pair the authors' server calibrated at start-up into the cache, with its provenance.

    Refused while the folder holds a .oscar_*.pending.json (the server is still writing it, or was
    interrupted), and when K and V record different calibrations (unless --allow-mixed). The files
    are copied into the cache first; the copies are validated and hashed, their markers written from
    those hashes, and only then moved to <cache>/imported/NAME/ (cache ls and verify list them; cache rm
    removes them with --all only, not with --model), so a source changing meanwhile is never kept as
    verified. The calibration they record is printed (generation id, prompt sha256, tokens, model
    revision). Serve, evaluate or publish the imported folder like any pair.

    With --latent MODEL, FOLDER is a copy of MODEL's MLA latent set (layer_<id>.pt files, e.g. from the
    authors' image): it must cover the model's latent layers, every file is checked, pinned to the folder
    and kept under the cache's files/ area, where fetch, load_latent and serve-args find it.

    Examples:  rotationzoo cache import ~/.cache/huggingface/oscar-rotations/Qwen3-8B-0123456789ab  |
    rotationzoo cache import ./calib --name qwen3-8b-gpqa --json  |  rotationzoo cache import ./calib --allow-mixed  |
    rotationzoo cache import ./k3_latent_rot --latent Kimi-K3
    """
    if latent is not None:
        from .latent_cmds import import_latent_cmd

        given = [flag for flag, on in (("--name", name is not None), ("--force", force),
                                       ("--allow-mixed", allow_mixed)) if on]
        if given:  # a latent set is kept under files/ by its model, one folder per source: none of them applies
            raise CLIError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with a K/V pair import, not "
                           "--latent (a latent set is kept by its model; --accept-new replaces an earlier import)")

        import_latent_cmd(str(folder), latent, cache_dir=cache_dir, accept_new=accept_new, subspace=subspace,
                          json_out=json_out)
        return
    if subspace or accept_new:
        raise CLIError("--subspace and --accept-new go with --latent MODEL")
    from ..files.calibrated import import_calibrated

    got = import_calibrated(folder, name=name, cache_dir=cache_dir, force=force, allow_mixed=allow_mixed)
    if json_out:
        emit_json(got.to_json())
        return
    # every value below came from the folder (its name, the files' metadata, the manifest): shown literally
    typer.echo(printable(f"imported {got.name}: {got.folder}"))
    for s, p in got.paths.items():
        typer.echo(printable(f"  {s.upper()} {p.name}  sha256 {got.sha256[s]}"))
    cal = got.calibration or {}
    if cal:
        keys = ("generation_id", "model_path", "model_revision", "prompt_sha256", "tokens", "tp_size")
        typer.echo("  calibration: " + ", ".join(printable(f"{k} {cal[k]}") for k in keys if k in cal))
    else:
        typer.echo("  calibration: not recorded in the files")


@cache_app.command("rm")
def cmd_cache_rm(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Only this model, MODEL or MODEL@TAG (only "
                                                 "that tag).")] = None,
    tag: Annotated[str | None, typer.Option("--tag", "-t", help="With --model: only this tag (default: every tag).")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Remove everything, including the hub clients' caches.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="List what would be removed, with sizes; remove nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation (needed when stdin is not a terminal).")] = False,
    cache_dir: CacheDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove cached files (derived files included): one model (and tag), or everything with --all.

    Lists what goes (with sizes and a total) and asks before removing anything; --yes skips the
    question, --dry-run only lists. Without a terminal on stdin (scripts, CI) --yes is required.

    Examples:  rotationzoo cache rm --model Qwen3-8B --dry-run  |  rotationzoo cache rm --model Qwen3-8B  |
    rotationzoo cache rm --model Qwen3-8B@seq20000_prompt83_group128  |  rotationzoo cache rm --all --yes
    """
    from rich.markup import escape

    from ..hub import check_removal, removal_plan, remove_cached

    with usage_errors():  # neither a model nor --all, or both: the library's line, a usage error
        check_removal(model, tag, all=all_)
    records, hub_bytes = removal_plan(model, tag, cache_dir, all=all_)
    total = sum(r.size for r in records) + hub_bytes
    what = f"{len(records)} file{'' if len(records) == 1 else 's'}, {human_size(total)} ({total:,} bytes)" + (
        f", of which {human_size(hub_bytes)} in the hub clients' caches" if hub_bytes else "")
    if json_out and dry_run:
        emit_json({"dry_run": True, "bytes": total, "hub_bytes": hub_bytes,
                   "files": [{"path": str(r.path), "model": r.model, "tag": r.tag, "size": r.size} for r in records]})
        return
    if not records and not hub_bytes:
        if json_out:
            emit_json({"removed": [], "bytes": 0})
        else:
            console().print("nothing to remove")
        return
    if not (yes or dry_run or stdin_is_tty()):
        raise CLIError(f"cache rm would remove {what}; stdin is not a terminal, so nothing was asked: "
                       "add --yes to remove them (or --dry-run to list them)")
    c = console(stderr=not dry_run)  # the listing before a question goes with the question
    if not json_out:
        for r in records:
            c.print(escape(printable(f"{human_size(r.size):>10}  {r.path}")))
    if dry_run:
        c.print(escape(f"would remove {what}"))
        return
    if not yes and not typer.confirm(f"remove {what}?", default=False, err=True):
        console(stderr=True).print("nothing was removed")
        raise typer.Exit(1)
    removed = remove_cached(model, tag, cache_dir, all=all_)
    if json_out:
        emit_json({"removed": [str(p) for p in removed], "bytes": total})
    else:
        typer.echo(f"removed {what}")


def cmd_demo(
    model: Annotated[str, typer.Option("--model", "-m", help="Registry model to demonstrate.")] = "SmolLM2-135M-Instruct",
    tag: TagOpt = None,
    tokens: Annotated[int, typer.Option("--tokens", min=1, max=262_144, help="Rows of the random K-like tensor.")] = 1024,
    json_out: JsonOpt = False,
) -> None:
    """Load a registry entry (the bundled one by default: no network) and INT2-quantize a tensor with it.

    Resolves, verifies and loads the entry's K/V rotations, then rotates, clips and INT2-quantizes a
    random K-like tensor with layer 0's R_K and reports the reconstruction error with and without
    the rotation.

    Example:  rotationzoo demo  |  rotationzoo demo --json
    """
    from rich.markup import escape

    from ..demo import run_demo

    out = run_demo(model, tag, tokens=tokens)
    if json_out:
        emit_json(out)
        return
    c = console()
    c.print(f"[bold]{escape(printable(out['model']))}@{escape(printable(out['tag']))}[/]: {out['layers']} layers × "
            f"d={out['head_dim']}, loaded and validated in {out['load_seconds'] * 1e3:.1f} ms from "
            f"{escape(printable(out['k_file']))}")
    c.print(f"K sha256 {out['k_sha256']}")
    c.print(f"INT2 quantized a [{out['tokens']}, {out['heads']}, {out['head_dim']}] bf16 tensor with layer "
            f"{out['layer']}'s R_K: codes {out['codes_shape']} uint8, scales/zeros {out['scales_zeros_shape']} "
            f"(group {out['group_size']})")
    for k, v in out["relative_error"].items():
        c.print(f"  relative reconstruction error, {k:>12}: {v:.4f}")


def register(app: typer.Typer) -> None:
    app.command("fetch")(cmd_fetch)
    app.add_typer(cache_app, name="cache")
    app.command("demo")(cmd_demo)
