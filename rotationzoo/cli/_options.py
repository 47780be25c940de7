"""Option aliases shared by every command, with choices taken from :mod:`rotationzoo.vocab`.

One name per knob: the INT2-KV options are the :class:`~rotationzoo.int2kv.Int2KVConfig` field
names (``--k-clip-ratio`` is ``k_clip_ratio``), and every choice list is the library's own.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any, Iterable, Iterator, List, Optional

import click
import typer
from typer.core import TyperCommand, TyperGroup

from .. import vocab
from ..recipe import MIN_KEEP_TOKENS
from ..workflows.evaluation import ROTATIONS_HELP
from ._output import json_requested


@contextlib.contextmanager
def literal_help(commands: Iterable[click.Command]) -> Iterator[None]:
    """While help is rendered, the help texts of ``commands`` and of their parameters escaped for
    rich markup, so that square brackets (``[H_kv, d, d]``) show literally; restored afterwards
    (the declared texts stay as written, e.g. for ``tools/gen_docs.py``)."""
    from rich.markup import escape

    saved: list[tuple[Any, str, str]] = []
    for cmd in commands:
        for obj in (cmd, *cmd.params):
            for attr in ("help", "short_help", "epilog"):
                value = getattr(obj, attr, None)
                if isinstance(value, str) and value:
                    saved.append((obj, attr, value))
                    setattr(obj, attr, escape(value))
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)


class Command(TyperCommand):
    """typer's command, its help text shown literally (:func:`literal_help`)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with literal_help([self]):
            super().format_help(ctx, formatter)


class Group(TyperGroup):
    """typer's group, its help and its commands' summaries shown literally (:func:`literal_help`),
    suggesting a misspelt command once (click >= 8.4 already adds the suggestion that typer
    appends again)."""

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with literal_help([self, *self.commands.values()]):
            super().format_help(ctx, formatter)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            if getattr(exc, "possibilities", None):  # click's own suggestion: drop typer's copy
                exc.message = exc.message.split(" Did you mean")[0]  # type: ignore[misc]
            raise


def head_dims_option(value: Optional[str]) -> Optional[str]:
    """``--head-dim D[,LAYER:D...]``: a bad spec is a usage error (exit 2) that shows the accepted form."""
    if value is None:
        return None
    from ..errors import ConfigError
    from ..headdims import HeadDims

    try:
        HeadDims.parse(value)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


@contextlib.contextmanager
def usage_errors() -> Iterator[None]:
    """Inside: a library check of what the command line alone gives (a :class:`~rotationzoo.errors.ConfigError`
    or :class:`~rotationzoo.errors.FitError`: a count out of range, options that do not go together) is raised
    as a :class:`~rotationzoo.errors.CLIError`, a usage error (exit 2), with the library's one line. The CLI
    checks nothing itself: the Python objects it builds refuse the same values with the same bounds."""
    from ..errors import CLIError, ConfigError, FitError

    try:
        yield
    except (ConfigError, FitError) as exc:
        raise CLIError(str(exc)) from None


def use_literal_help(app: typer.Typer) -> None:
    """Every command of ``app`` (and of its sub-apps) a :class:`Command` unless it names its own class."""
    for info in app.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = Command
    for group in app.registered_groups:
        if group.typer_instance is not None:
            use_literal_help(group.typer_instance)


def choice(values: tuple[str, ...]) -> click.Choice:
    return click.Choice(list(values))


JsonOpt = Annotated[bool, typer.Option("--json", callback=json_requested,
                                       help="Print machine-readable JSON on stdout (errors too).")]
CacheDirOpt = Annotated[Optional[Path], typer.Option(
    "--cache-dir", help="Cache root (default: $ROTATIONZOO_CACHE or the user cache dir).")]
OfflineOpt = Annotated[Optional[bool], typer.Option(
    "--offline/--online", help="--offline: use only the cache, never the network; --online: use the network even where "
                               "ROTATIONZOO_OFFLINE or HF_HUB_OFFLINE says offline (default: those variables).")]
TagOpt = Annotated[Optional[str], typer.Option("--tag", "-t", help="Calibration tag (default: the model's default tag).")]
ModelArg = Annotated[str, typer.Argument(help="Model id or alias, case-insensitive (e.g. Qwen3-8B; MODEL@TAG works too).")]
SourceOpt = Annotated[str, typer.Option(
    "--source", click_type=choice(vocab.SOURCE_CHOICES),
    help="auto (the entry's order, with failover) or one source type.")]
RevisionOpt = Annotated[Optional[str], typer.Option("--revision", help="Hub revision override (branch, tag or commit sha).")]
TimeoutOpt = Annotated[Optional[float], typer.Option(
    "--timeout", help="Seconds each network step may take (default: ROTATIONZOO_TIMEOUT or 10).")]
SideOpt = Annotated[Optional[str], typer.Option("--side", click_type=choice(vocab.SIDES),
                                                help="k | v: which side a single file is, or which side to keep.")]
RotationsHelp = ROTATIONS_HELP
ParamOpt = Annotated[str, typer.Option(
    "--param", click_type=choice(("expm", "cayley", "signs")),
    help="With --refine: what is learned: the rotation (expm or cayley parametrisation) or, signs, only the init's "
         "column signs (R0·D, chosen greedily on the calibration blocks; --refine N is then N sweeps over the "
         "columns), to tell learned signs from a learned rotation.")]
ServingOpt = Annotated[Optional[str], typer.Option(
    "--serving", help="With --refine: train for the INT2 store of this registry entry, MODEL[@TAG] (its group size, "
                      "scale/zero dtype, windows and clip ratios); -g and the INT2-KV options below override it.")]

# -- INT2-KV settings (Int2KVConfig fields); None = keep the default / the entry's serving value --
KClipOpt = Annotated[Optional[float], typer.Option("--k-clip-ratio", help="Per-row clip ratio of keys (0 disables).")]
VClipOpt = Annotated[Optional[float], typer.Option("--v-clip-ratio", help="Per-row clip ratio of values (0 disables).")]
GroupOpt = Annotated[Optional[int], typer.Option(
    "--group-size", "-g", help="INT2 group size G (default: the entry's, else head_dim: one pair per row).")]
PrefixOpt = Annotated[Optional[int], typer.Option("--prefix-tokens", help="Sink tokens kept in hp_dtype.")]
RecentOpt = Annotated[Optional[int], typer.Option("--recent-tokens", help="Recent tokens kept in hp_dtype.")]
HpDtypeOpt = Annotated[Optional[str], typer.Option("--hp-dtype", click_type=choice(vocab.DTYPE_NAMES),
                                                   help="dtype of the window tokens.")]
ScaleDtypeOpt = Annotated[Optional[str], typer.Option("--scale-dtype", click_type=choice(vocab.DTYPE_NAMES),
                                                      help="dtype of the stored scale/zero (float32: SGLang's default).")]
LloydMaxOpt = Annotated[Optional[bool], typer.Option("--lloyd-max/--no-lloyd-max",
                                                     help="Approximate Lloyd-Max INT2 levels (needs G = head_dim).")]
ClipSearchOpt = Annotated[Optional[str], typer.Option(
    "--clip-search", click_type=choice(vocab.CLIP_SEARCHES),
    help="exact (SGLang's prefill store) or bisect (its decode-flush search, applied to every INT2 row).")]

# -- learned refinement (rotationzoo.fit.RefineOptions fields) --
RefineOpt = Annotated[Optional[int], typer.Option(
    "--refine", min=0, metavar="STEPS",
    help="Learn the rotations: STEPS optimizer steps per layer and side against the INT2 error, from --init "
         "(kept per layer only where it lowers the held-out loss).")]
InitOpt = Annotated[str, typer.Option("--init", click_type=choice(vocab.REFINE_INITS),
                                      help="Starting rotation of --refine: hadamard, oscar (r_h_pbr) or r_pbr_hg "
                                           "(with --group-size).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of --refine: sample reservoir, held-out split, minibatches.")]
SampleTokensOpt = Annotated[Optional[int], typer.Option(
    "--sample-tokens", min=1,
    help="Calibration tokens kept per layer for --refine (whole blocks of --block-size; default 14336).")]
LossOpt = Annotated[str, typer.Option(
    "--loss", click_type=choice(vocab.REFINE_LOSSES),
    help="Loss of --refine: served (only the query-key pairs that are INT2 when served, keys older than the "
         "recent window and outside the sink, weighted by the queries' attention), fisher (the same pairs "
         "weighted by how much the model's next-token loss moves with each: needs the output gradients, which "
         "calibrate captures for it and calibrate --grads --dump-out writes into a dump) or block (every pair of "
         "a block, unweighted: the loss of earlier releases).")]
BlockSizeOpt = Annotated[Optional[int], typer.Option(
    "--block-size", min=16,
    help="Tokens per calibration block of --refine (default 1024 for --loss served and fisher, 256 for block).")]
QueriesPerBlockOpt = Annotated[Optional[int], typer.Option(
    "--queries-per-block", min=1,
    help="Queries drawn per calibration block by --loss served or fisher (default 64; a step's cost is linear "
         "in it).")]
KeepTextOpt = Annotated[Optional[List[Path]], typer.Option(
    "--keep-text",
    help="Held-out text (repeatable), other than the calibration text, on which --refine's result is judged "
         "against its init by a short KL evaluation: the refined, init and mixed K/V sets are compared and the "
         "one with the lowest KL is kept.")]
KeepTokensOpt = Annotated[Optional[int], typer.Option(
    "--keep-tokens", min=MIN_KEEP_TOKENS,
    help="Tokens of --keep-text the keep rule evaluates, in whole windows of --keep-context (default: 4096, at "
         "least one window).")]
KeepContextOpt = Annotated[Optional[int], typer.Option(
    "--keep-context", min=MIN_KEEP_TOKENS,
    help="Tokens per window of the keep rule (default: the calibration context, the longest calibration "
         "sequence: --seq-len for calibrate, the dump's prompts for fit).")]

KeepKClipOpt = Annotated[Optional[float], typer.Option(
    "--keep-k-clip-ratio",
    help="K clip ratio the keep rule judges at, where the rotations will be served at another clip than they "
         "are refined for (default: the refined store's; 0 disables).")]
KeepVClipOpt = Annotated[Optional[float], typer.Option(
    "--keep-v-clip-ratio", help="The same for values (default: the refined store's).")]


def config_changes(**knobs: Any) -> dict[str, Any]:
    """The INT2-KV knobs given on the command line (``None`` = not given)."""
    return {k: v for k, v in knobs.items() if v is not None}
