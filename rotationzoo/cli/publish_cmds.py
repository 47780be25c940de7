"""Publishing: ``publish``.

Examples::

    rotationzoo publish rotations/ --repo me/RotationZoo --model Qwen/Qwen3-8B --tag seq20000_prompt83_group128
    rotationzoo publish rotations/ --repo me/RotationZoo --model Qwen3-8B --tag gpqa --dry-run
    rotationzoo publish rotations/ --repo me/RotationZoo --model acme/Tiny-LM --tag v1 \\
        --to huggingface --create-tag tiny-v1 --registry-out my-registry.json --json
    rotationzoo publish rotations/ --repo huggingface=me/RotationZoo --repo modelscope=me2/RotationZoo \\
        --model Qwen3-8B --tag seq20000_prompt83_group128
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import CLIError, PublishError
from ._options import CacheDirOpt, JsonOpt, RevisionOpt, SourceOpt, usage_errors
from ._output import console, emit_json, print_warning, printable, progress_enabled


def _hub_values(values: list[str] | None, what: str) -> str | dict[str, str] | None:
    """``["SHA"]`` → ``"SHA"`` (every hub); ``["huggingface=SHA", "ms=SHA2"]`` → a per-hub mapping."""
    from ..publish import parse_hubs

    if not values:
        return None
    plain = [v for v in values if "=" not in v]
    per_hub = [v for v in values if "=" in v]
    if plain and (per_hub or len(plain) > 1):
        raise CLIError(f"{what}: give one value for every hub, or HUB=VALUE once per hub")
    if plain:
        return plain[0]
    out: dict[str, str] = {}
    for item in per_hub:
        hub, _, value = item.partition("=")
        try:
            name = parse_hubs(hub)[0]
        except PublishError:
            raise CLIError(f"{what}: unknown hub {hub!r} in {item.split('=')[0]}=…; use huggingface or modelscope") from None
        out[name] = value
    return out


def cmd_publish(
    rotations: Annotated[str, typer.Argument(
        metavar="ROTATIONS",
        help="What to publish: a folder with the K/V rotation files (and rotationzoo.json), 'K.pt,V.pt', an exported "
             "pair file, or a registry id MODEL[@TAG] (fetched and verified first).")],
    repo: Annotated[list[str], typer.Option("--repo", help="Destination repository NAMESPACE/NAME on every hub, or [HUB=]NS/NAME once per hub.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Registry model, or the full id NS/NAME of a new model.")],
    tag: Annotated[str, typer.Option("--tag", "-t", help="Calibration tag; files go to <model folder>/<tag>/.")],
    to: Annotated[str, typer.Option("--to", help="Comma-separated hubs: huggingface, modelscope.")] = "huggingface,modelscope",
    branch: Annotated[str, typer.Option("--branch", help="Branch to commit to (ModelScope: master when main).")] = "main",
    create_tag: Annotated[Optional[str], typer.Option("--create-tag", help="Also tag the new commit with this name.")] = None,
    registry_out: Annotated[Optional[Path], typer.Option("--registry-out", help="Merge the registry entry into this file (created if missing).")] = None,
    expected_parent: Annotated[Optional[list[str]], typer.Option("--expected-parent", "--parent-commit", help="Refuse unless the branch head is this sha ([HUB=]SHA; repeat per hub).")] = None,
    safetensors: Annotated[bool, typer.Option("--safetensors", help="Also upload safetensors copies of .pt files.")] = False,
    description: Annotated[Optional[str], typer.Option("--description", help="Description of the registry tag entry.")] = None,
    dataset: Annotated[Optional[str], typer.Option("--dataset", help="Calibration dataset recorded in the registry entry.")] = None,
    commit_message: Annotated[Optional[str], typer.Option("--commit-message", "--message",
                                                          help="Commit message (first line).")] = None,
    atol: Annotated[float, typer.Option("--atol", help="Tolerance on max|RRᵀ−I| of the validation before the upload "
                                        "(as verify --atol).")] = 1e-5,
    private: Annotated[bool, typer.Option("--private", help="Create a missing repository as private.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be uploaded; write nothing.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing <model>/<tag>/ folder.")] = False,
    token: Annotated[Optional[list[str]], typer.Option("--token", help="Write token ([HUB=]TOKEN); default HF_TOKEN / MODELSCOPE_API_TOKEN or the stored login.")] = None,
    source: SourceOpt = "auto",
    revision: RevisionOpt = None,
    cache_dir: CacheDirOpt = None,
    offline: Annotated[bool, typer.Option("--offline", help="Offline mode: publish is refused at once, before any "
                                          "request (as with ROTATIONZOO_OFFLINE or HF_HUB_OFFLINE).")] = False,
    timeout: Annotated[Optional[float], typer.Option(
        "--timeout", help="Seconds each network step of fetching a MODEL@TAG given as the pair may take (default: "
                          "ROTATIONZOO_TIMEOUT or 10); the hub clients' own requests of the upload keep theirs.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Validate a fitted K/V pair and publish it to the Hugging Face Hub and ModelScope.

    Uploads the pair (plus rotationzoo.json, and safetensors copies with --safetensors) under
    <model folder>/<tag>/ in one commit per hub, updating the README table row of the entry in that
    commit, then prints the registry entry pinned to the commit sha. Exit 1 if anything is refused
    (a dry run that finds a problem included).

    Examples:  rotationzoo publish out/ --repo me/RotationZoo --model Qwen3-8B --tag gpqa --dry-run  |
    rotationzoo publish out/ --repo me/RotationZoo --model acme/Tiny-LM --tag v1 --registry-out reg.json --json  |
    rotationzoo publish k.pt,v.pt --repo me/RotationZoo --model Qwen3-8B --tag mine --branch dev
    """
    from ..numbers import check_real
    from ..publish import publish

    with usage_errors():  # before anything is read: a NaN tolerance would pass every file
        check_real(atol, "--atol", low=0.0, high=1.0, hint=" (a tolerance on max|R Rᵀ − I|)")
    messages: list[str] = []
    show = progress_enabled() and not json_out

    def report(msg: str) -> None:
        messages.append(msg)
        if show:
            from rich.markup import escape

            console(stderr=True).print(f"[dim]{escape(printable(msg, drop_ansi=True))}[/]", markup=True,
                                       highlight=False)

    res = publish(
        rotations, repo=_hub_values(repo, "--repo") or "", model=model, tag=tag, to=to, branch=branch, create_tag=create_tag,
        registry_out=registry_out, dry_run=dry_run, force=force, token=_hub_values(token, "--token"),
        expected_parent=_hub_values(expected_parent, "--expected-parent"), safetensors=safetensors,
        description=description, dataset=dataset, commit_message=commit_message, private=private, report=report, atol=atol,
        source=source, revision=revision, cache_dir=cache_dir, offline=offline or None, timeout=timeout,
    )
    if json_out:
        out = res.to_json()
        out["messages"] = messages
        emit_json(out)
    else:
        _print_result(res)
    if not res.ok:
        raise typer.Exit(1)


def _print_result(res) -> None:  # noqa: ANN001 - PublishResult, imported lazily
    from rich.markup import escape

    c = console()
    for w in res.warnings:
        print_warning(w)
    head = "dry run: nothing was uploaded" if res.dry_run else "published"
    lit = lambda text: escape(printable(text))  # noqa: E731 - names, objectives, hub answers: literally
    c.print(f"[bold]{head}[/]: {lit(res.model)} {lit(res.tag)} ({len(res.layer_ids)} layers × d {res.head_dim}, "
            f"K {lit(res.objectives['k'])}, V {lit(res.objectives['v'])})")
    c.print(f"files → {lit(res.repo)}/{lit(res.folder)}/")
    for f in res.files:
        c.print(lit(f"  {f.path}  {f.size:,} B  sha256 {f.sha256}"))
    for h in res.hubs:
        state = "new repository" if h.exists is False else (f"head {h.parent[:12]}" if h.parent else "state unknown")
        if res.dry_run:
            line = f"{h.hub}: would commit to {h.repo}@{h.branch} ({state}); README {h.card or '?'}"
            if h.replaced:
                line += f"; replaces {len(h.replaced)} existing files"
        else:
            line = f"{h.hub}: {h.repo}@{h.branch} commit {h.commit}" + (f", tag {h.create_tag}" if h.create_tag else "")
            line += f"; README {h.card}; registry revision {h.revision}"
        c.print(lit(line))
        for p in h.problems:
            c.print(f"[red]✗[/] {escape(printable(p, drop_ansi=True))}")
    if res.registry_out is not None:
        c.print(f"registry entry {'merged into' if res.registry_changed else 'unchanged in'} {lit(res.registry_out)}")
    elif not res.dry_run:
        c.print("registry entry (merge it with --registry-out FILE):")
        emit_json(res.model_entry)


def register(app: typer.Typer) -> None:
    app.command("publish")(cmd_publish)
