"""Registry and file commands: ``list``, ``info``, ``verify``.

Examples::

    rotationzoo list
    rotationzoo list 'qwen3*'
    rotationzoo list --plain | grep -i vl
    rotationzoo list --json
    rotationzoo info qwen3-8b --json
    rotationzoo verify k_rotation_qqt_r_h_pbr.pt v_rotation_sst_r_h_pbr.pt --num-layers 36 --head-dim 128
    rotationzoo verify k.pt --model Qwen3-8B --json
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from ._options import (
    CacheDirOpt,
    JsonOpt,
    OfflineOpt,
    RevisionOpt,
    SourceOpt,
    TagOpt,
    TimeoutOpt,
    head_dims_option,
    usage_errors,
)
from ._output import console, emit_json, plain, print_warning, printable, tail

if TYPE_CHECKING:  # pragma: no cover
    from ..registry import ModelEntry
    from ..files.validation import ValidationReport


def cmd_list(
    pattern: Annotated[str | None, typer.Argument(
        help="Only models whose id or an alias matches this shell-style pattern, case-insensitive "
             "(e.g. 'qwen3*', '*-8b', 'smollm2*'); quote it so that the shell does not expand it.")] = None,
    plain_out: Annotated[bool, typer.Option("--plain", help="One model per line, tab-separated, no table: id, aliases, "
                                        "layers, head_dim, default tag, tags, pinned (for grep, cut, awk).")] = False,
    json_out: JsonOpt = False,
) -> None:
    """List the models in the registry (all, or those matching PATTERN) with their default tag.

    Printed to a pipe or a file, the table keeps every id and tag in full.

    Examples:  rotationzoo list  |  rotationzoo list 'qwen3*'  |  rotationzoo list --plain | grep -i vl  |
    rotationzoo list '*8b*' --json
    """
    from ..registry import list_models

    models = list_models(pattern)
    if json_out:
        emit_json([m.to_json() for m in models])
        return
    if pattern is not None and not models:
        hint = "" if any(ch in pattern for ch in "*?[") else f"; for a prefix use '{pattern}*'"
        print_warning(f"no model matches {pattern!r}{hint} (rotationzoo list shows all)")
        return
    rows = []
    for m in models:
        ids = m.architecture.expected_layer_ids() if m.architecture is not None else None
        n_pinned = sum(t.pinned for t in m.tags.values())
        rows.append((m, str(len(ids)) if ids else "?", f"{n_pinned}/{len(m.tags)}" if m.tags else "-"))
    if plain_out:
        for m, layers, pinned in rows:
            fields = (m.id, ",".join(m.aliases), layers, _head_dim(m), _default(m), ",".join(m.tags), pinned)
            typer.echo("\t".join(map(printable, fields)))  # an overlay's names: never a tab or a line of their own
        return
    from rich.markup import escape
    from rich.table import Table

    title = f"rotationzoo registry ({len(models)} models{f' matching {pattern!r}' if pattern else ''})"
    c = console()
    table = Table(title=escape(title))
    # on a narrow terminal the ids stay whole and the other columns wrap
    table.add_column("model", no_wrap=True, min_width=min(c.width // 2, max((len(m.id) for m in models), default=5)))
    table.add_column("aliases")
    table.add_column("layers × d")
    table.add_column("default tag")
    table.add_column("tags", justify="right")
    table.add_column("pinned", justify="center")
    for m, layers, pinned in rows:
        table.add_row(escape(printable(m.id)), escape(printable(", ".join(m.aliases))), f"{layers} × {_head_dim(m)}",
                      escape(printable(_default(m))), str(len(m.tags)), pinned)
    c.print(table)


def _head_dim(m: ModelEntry) -> str:
    return str(m.architecture.head_dim) if m.architecture is not None else "?"


def _default(m: ModelEntry) -> str:
    """The default tag, or what the model has instead of K/V tags (an MLA latent set)."""
    return m.default_tag if m.default_tag is not None else "(MLA latent set)" if m.mla_latent else "-"


def cmd_info(
    model: Annotated[str, typer.Argument(help="Model id or alias, case-insensitive (e.g. Qwen3-8B).")],
    tag: TagOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a model's entry: architecture, tags, serving defaults, files and sources.

    Examples:  rotationzoo info Qwen3-8B  |  rotationzoo info qwen3-8b --json  |
    rotationzoo info Qwen3-8B --tag longbench-seq150000_prompt44_group128
    """
    from ..hub.pins import local_pins, pin_state
    from ..files.pair import cached_details
    from ..registry import get_model, split_model_tag

    name, at_tag = split_model_tag(model)
    m = get_model(name)
    if m.mla_latent is not None and (tag or at_tag) in (None, m.mla_latent.name):
        from .latent_cmds import print_latent_info

        print_latent_info(m, json_out)
        return
    entry = m.tag(tag or at_tag)
    pins = {side: (pin_state(entry, side), local_pins(entry, side)) for side in entry.files}
    cached = cached_details(entry)
    if json_out:
        out = m.to_json()
        out["tag"] = entry.to_json()
        for side, (state, local) in pins.items():
            out["tag"]["files"][side]["pin"] = {"state": state, **({"local": list(local.values())} if local else {})}
            out["tag"]["files"][side]["cached"] = cached.get(side)
        emit_json(out)
        return
    from rich.text import Text

    c = console()
    # every line holds values of the registry (an overlay), the pin file or a cached file's metadata: printed
    # without markup, control characters shown escaped
    say = lambda text: c.print(printable(text), markup=False)  # noqa: E731
    arch = entry.architecture
    ids = arch.expected_layer_ids()
    c.print(Text(printable(m.id), style="bold") + Text(printable(f"  (aliases: {', '.join(m.aliases) or '-'})")))
    if m.description:
        say(m.description)
    say(
        f"architecture: {len(ids) if ids else '?'} attention layers"
        + (f" (ids {', '.join(map(str, ids or ()))})" if arch.attention_layer_ids else "")
        + f", head_dim {arch.head_dims}, kv heads {arch.num_kv_heads or '?'}"
    )
    say(f"tags: {', '.join(('*' + t if t == m.default_tag else t) for t in m.tags)}  (* = default)")
    c.print()
    c.print(Text(printable(f"tag {entry.name}"), style="bold") + Text(printable(f": {entry.description}")))
    cal = entry.calibration
    say(f"calibration: dataset {cal.dataset or '-'}, tokens {cal.tokens if cal.tokens is not None else '?'}, "
            f"prompts {cal.prompts if cal.prompts is not None else '?'}, group {cal.group_size or '?'}")
    say(f"objectives: K {entry.objectives['k']}, V {entry.objectives['v']}")
    s = entry.serving
    say(f"serving: K clip {s.k_clip_ratio}, V clip {s.v_clip_ratio}, group {s.group_size}, "
            f"{s.hp_dtype} sink {s.prefix_tokens} + recent {s.recent_tokens}, scales {s.scale_dtype}, "
            f"Lloyd-Max {'on' if s.lloyd_max else 'off'}")
    say(_bits_line(entry))
    lc = entry.launch
    say(f"launch: {'per-KV-head' if entry.grouping == 'kv_head' else 'one rotation per layer'}, TP {lc.tp_size}"
            + (f" in {lc.ep_size} expert-parallel groups" if lc.ep_size > 1 else "") + ", "
            f"backends {lc.attention_backend} / {lc.prefill_attention_backend} / {lc.decode_attention_backend}, "
            f"V-rotation absorption {'on' if lc.absorb_v_rotation else 'off'}, prefix cache "
            f"{'off' if lc.disable_radix_cache else 'on'}"
            + (f", --mamba-radix-cache-strategy {lc.mamba_scheduler_strategy}" if lc.mamba_scheduler_strategy else "")
            + (f" (recipe {lc.recipe})" if lc.recipe else ""))
    for r in entry.results:
        bpe = entry.bits_per_element(r.context) if r.context else None
        at = f" at {bpe:.2f} bits/element ({r.context:,} tokens)" if bpe is not None else ""
        say(f"result: {r.benchmark} BF16 {r.bf16} → OSCAR INT2 {r.oscar_int2}{at} ({r.source})")
    for conflict in entry.conflicts:
        say(f"conflict: {conflict.about}")
        for where, says in conflict.sources:
            say(f"    {where}: {says}")
        say(f"    the entry follows {conflict.chosen}")
    for repo in m.prebuilt_gguf:
        say(f"llama.cpp: ready-made model GGUFs with these rotations appended: huggingface:{repo}")
    for side, f in entry.files.items():
        state, local = pins[side]
        if f.sha256:
            sha = f"sha256 {f.sha256} (pinned)"
        elif local:
            sha = "pinned locally"
        else:
            sha = "sha256 unpinned (pinned on first fetch)"
        say(f"{side.upper()} file: {f.path}  {sha}  size {f.size or '?'}")
        for label, pin in local.items():
            say(f"    sha256 {pin['sha256']} (pinned locally {pin.get('pinned_at') or ''}, from {label})")
        for src in f.sources:
            say(f"    from {src.describe()}{'' if src.pinned else '  (revision not pinned)'}")
        got = cached.get(side)
        if got and "problem" in got:
            c.print(f"    cached copy unreadable: {printable(got['problem'], drop_ansi=True)}", markup=False)
        elif got:
            extra = "".join(f" +{x}" for x in got["companions"])
            say(f"    holds: format_version {got['format_version']}, {got['source_grouping']}{extra}")
            if got["calibration"]:
                recorded = ", ".join(f"{k} {v}" for k, v in got["calibration"].items())
                say(f"    calibration: {recorded}")


def cmd_verify(
    paths: Annotated[Optional[list[str]], typer.Argument(
        metavar="ROTATIONS...",
        help="What to check: rotation files (.pt, .safetensors), exported pair files (.safetensors / .gguf), pair "
             "folders, 'K.pt,V.pt', or registry ids MODEL[@TAG] (fetched, then checked against the model).")] = None,
    num_layers: Annotated[Optional[int], typer.Option(min=1, help="Expect layers 0..N-1.")] = None,
    head_dim: Annotated[Optional[str], typer.Option(
        metavar="D[,LAYER:D...]", callback=head_dims_option,
        help="Expect this d (matrices [d, d] or [H_kv, d, d]); per-layer head_dims as 256,5:512,11-13:512.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Take layer ids and head_dim from this registry model, MODEL[@TAG] "
                                                      "(with --registry: check only this model, or only that tag).")] = None,
    atol: Annotated[float, typer.Option(help="Tolerance on max|RRᵀ−I|.")] = 1e-5,
    registry: Annotated[bool, typer.Option("--registry", help="Check every registry entry instead of files: cached (or bundled) files, or all with --download.")] = False,
    download: Annotated[bool, typer.Option("--download", help="With --registry: download (and verify) entries that are not cached.")] = False,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: OfflineOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Validate rotation files: format, orthogonality, finiteness, shapes, layers. Exit 1 if any fails.

    With --registry, check every registry entry instead: files in the cache (or bundled), or every
    file with --download; each entry is reported ok, unpinned (valid, but no sha256 in the
    registry), missing (not cached) or failed. Exit 1 if any entry failed.

    Examples:  rotationzoo verify k.pt v.pt --num-layers 36 --head-dim 128  |
    rotationzoo verify k.pt --model Qwen3-8B --json  |  rotationzoo verify k.pt,v.pt  |
    rotationzoo verify Qwen3-8B@seq20000_prompt83_group128 --offline  |  rotationzoo verify --registry --download --json
    """
    from ..errors import CLIError
    from ..numbers import check_real

    with usage_errors():  # before anything is read: a NaN tolerance would pass every file
        check_real(atol, "--atol", low=0.0, high=1.0, hint=" (a tolerance on max|R Rᵀ − I|)")
    if registry:
        if paths:
            raise CLIError("give rotation files or --registry, not both")
        from rich.markup import escape

        from ..publish import verify_registry

        checks = verify_registry(download=download, model=model, cache_dir=cache_dir, source=source, revision=revision,
                                 offline=offline, timeout=timeout, atol=atol)
        for ch in checks:
            ch.problems = [plain(p) for p in ch.problems]
        counts = {s: sum(ch.status == s for ch in checks) for s in ("ok", "unpinned", "missing", "failed")}
        if json_out:
            emit_json({"ok": counts["failed"] == 0, "download": download, "checked": len(checks),
                       "counts": counts, "entries": [ch.to_json() for ch in checks]})
        else:
            c = console()
            style = {"ok": "green", "unpinned": "yellow", "missing": "dim", "failed": "red"}
            for ch in checks:
                c.print(f"[{style[ch.status]}]{ch.status:>8}[/] {escape(printable(f'{ch.model}@{ch.tag}'))}")
                if ch.status == "unpinned":
                    for side, f in ch.files.items():
                        c.print(escape(printable(f"          {side.upper()} sha256 {f['sha256']} ({f['size']} B), "
                                                 "not pinned in the registry")))
                elif ch.status == "failed":
                    for p in ch.problems:
                        c.print(f"          [red]✗[/] {escape(printable(p))}")
            c.print(f"{len(checks)} entries: {counts['ok']} ok, {counts['unpinned']} unpinned, "
                    f"{counts['missing']} not cached{'' if download else ' (use --download)'}, "
                    f"{counts['failed']} failed")
        if counts["failed"]:
            raise typer.Exit(1)
        return
    if download:
        raise CLIError("--download goes with --registry")
    if not paths:
        raise CLIError("give one or more rotation files to check, or --registry to check the registry entries")
    from ..files.pair import verify_path

    fetch = dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline, timeout=timeout)
    reports = [r for p in paths
               for r in verify_path(p, atol=atol, num_layers=num_layers, head_dim=head_dim, model=model, fetch=fetch)]
    for r in reports:  # torch and other libraries colour their messages: never let ANSI codes through
        r.problems = [plain(p) for p in r.problems]
    if json_out:
        emit_json([r.to_json() for r in reports])
    else:
        _print_reports(reports)
    if not all(r.ok for r in reports):
        raise typer.Exit(1)


def _print_reports(reports: list[ValidationReport]) -> None:
    """The verify table; on a terminal, long paths keep their end (``…/k_rotation.pt``)."""
    from rich.markup import escape
    from rich.table import Table

    c = console()
    rows = []
    layouts = [_layout(r) for r in reports]
    show_layout = any(x not in ("V1", "-") for x in layouts)  # only when a file is not a plain V1 one
    for r, layout in zip(reports, layouts):
        err = f"{r.max_orthogonality_error:.1e}" if r.max_orthogonality_error is not None else "-"
        # the file's own values (its objective, companions) and its path: shown literally, one line each
        rows.append(tuple(map(printable, (r.path or "-", "yes" if r.ok else "NO", str(r.num_layers or "-"), _dims(r),
                                          *((layout,) if show_layout else ()), r.objective or "-", err,
                                          (r.sha256 or "-")[:12]))))
    heads = ("file", "ok", "layers", "d", *(("layout",) if show_layout else ()), "objective", "max|RRᵀ−I|", "sha256")
    # what the other columns take (content, padding, borders); in a pipe (PIPE_WIDTH) nothing is cut
    others = sum(max(len(h), *(len(row[i]) for row in rows)) + 3 for i, h in enumerate(heads) if i) + 4
    room = max(20, c.width - others)
    table = Table(title="rotation files")
    table.add_column("file", no_wrap=True, min_width=min(room, max(len(row[0]) for row in rows)))
    for col in heads[1:]:
        table.add_column(col)
    for path, ok, *rest in rows:
        table.add_row(escape(tail(path, room)), f"[green]{ok}[/]" if ok == "yes" else f"[red]{ok}[/]",
                      *map(escape, rest))
    c.print(table)
    for w in dict.fromkeys(w for r in reports for w in r.warnings):
        c.print(f"[yellow]![/] {escape(printable(w, drop_ansi=True))}")
    for p in dict.fromkeys(p for r in reports for p in r.problems):  # a pair's disagreement fails both sides: once
        c.print(f"[red]✗[/] {escape(printable(p))}")


def _dims(r: ValidationReport) -> str:
    if r.head_dim is not None:
        return str(r.head_dim)
    dims = r.head_dims
    if isinstance(dims, dict):
        return ",".join([str(dims["default"]), *(f"{k}:{v}" for k, v in dims["layers"].items())])
    return "-"


def _layout(r: ValidationReport) -> str:
    """``V1``, ``V2 ×8`` (per KV head, 8 heads), ``V3 ×2 +k_mean``, ``V3 (non-orth.)``: what kind of file it is."""
    if r.layout_version is None or r.source_grouping is None:
        return "-"
    version = r.format_version if r.format_version is not None else r.layout_version
    heads = f" ×{r.num_kv_heads or '?'}" if r.source_grouping == "kv_head" else ""
    extra = "".join(f" +{c}" for c in r.companions) + ("" if r.orthogonal is not False else " (non-orth.)")
    return f"V{version}{heads}{extra}"


def _bits_line(entry: Any) -> str:
    """``format …: b bits per INT2 element + W window tokens; x bits/element at 8K, y at 32K, z at 128K``."""
    fmt = entry.serving.kv_format()
    d = entry.architecture.head_dim
    if not d:
        return f"format: {fmt.name}"
    at = ", ".join(f"{entry.bits_per_element(t):.2f} at {t // 1024}K" for t in (8192, 32768, 131072))
    return (f"format: {fmt.name}: {fmt.quantized_bits(d):.3g} bits per INT2 element + {fmt.window_tokens} "
            f"{fmt.hp_dtype} window tokens; bits/element {at} (BF16: 16)")


def register(app: typer.Typer) -> None:
    app.command("list")(cmd_list)
    app.command("info")(cmd_info)
    app.command("verify")(cmd_verify)
