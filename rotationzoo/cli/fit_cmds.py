"""``rotationzoo fit`` and ``rotationzoo calibrate``: regenerate or fit OSCAR rotations.

Examples::

    # the authors' recipe from an SGLang Q/K/V dump (chunk 0 skipped, qqt_sst, r_h_pbr)
    rotationzoo fit --dump qkv_dumps/gpqa --out rotations/ --model-id Qwen/Qwen3-8B --tag gpqa-seq20000

    # group-aware composition for 32-wide quantisation groups
    rotationzoo fit --dump qkv_dumps/gpqa --out rot-g32/ --composition r_pbr_hg --group-size 32

    # data-free Hadamard baseline
    rotationzoo fit --objective hadamard --num-layers 36 --head-dim 128 --out rotations/

    # learned rotations: 200 steps per layer from OSCAR, against the INT2 error at G = 64
    rotationzoo fit --dump qkv_dumps/gpqa --out rot-refined/ --refine 200 --init oscar --group-size 64

    # one rotation per (layer, KV head), each from that head's own covariance
    rotationzoo fit --dump qkv_dumps/gpqa --out rot-kvhead/ --grouping kv_head

    # capture from a local transformers model (folder or .gguf), no SGLang needed
    rotationzoo calibrate --model ./Qwen3-8B --text calib.txt --tokens 20000 --out rotations/ --dump-out qkv/

This module imports torch and the library only inside the commands, so other commands start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, List, Optional

import typer

from .. import vocab
from ..recipe import MAX_WORKERS
from ..workflows.keep import check_keep_options
from ._options import (
    BlockSizeOpt,
    KClipOpt,
    ParamOpt,
    PrefixOpt,
    RecentOpt,
    ScaleDtypeOpt,
    ServingOpt,
    VClipOpt,
    InitOpt,
    JsonOpt,
    KeepContextOpt,
    KeepKClipOpt,
    KeepTextOpt,
    KeepTokensOpt,
    KeepVClipOpt,
    LossOpt,
    QueriesPerBlockOpt,
    RefineOpt,
    SampleTokensOpt,
    SeedOpt,
    choice,
    usage_errors,
)
from ._output import console, emit_json, print_note, printable, progress_reporter

if TYPE_CHECKING:  # pragma: no cover
    from ..fit import FitOutput, FitResult

_OBJECTIVE_HELP = ("Covariance target(s): qqt_sst is OSCAR's (V1), hadamard is data-free; the authors' later recipes: "
                   "cov_eig_hadamard_perhead (their V2 per-head fitter), oscar2_perhead and oscar2_center (OSCAR-2, "
                   "per KV head; center writes k_mean).")
ObjectiveOpt = Annotated[str, typer.Option("--objective", click_type=choice(vocab.OBJECTIVES), help=_OBJECTIVE_HELP)]
CompositionOpt = Annotated[Optional[str], typer.Option(
    "--composition", click_type=choice(vocab.COMPOSITIONS),
    help="Rotation composition (default r_h_pbr = U·H·P_br, OSCAR's); r_pbr_hg needs --group-size. The "
         "recipes fix their own (cov_eig_hadamard_perhead: U_desc·H; oscar2_*: r_h_pbr).")]
GroupSizeOpt = Annotated[
    Optional[int], typer.Option("--group-size", "-g", help="Quantisation group size G for --composition r_pbr_hg, "
                                                  "and the INT2 group of --refine's loss (default there: head_dim).")
]
SignsOpt = Annotated[str, typer.Option("--signs", click_type=choice(vocab.SIGN_CONVENTIONS),
                                       help="Eigenvector signs: canonical (largest entry positive) or lapack (as eigh returns).")]
TagOpt = Annotated[Optional[str], typer.Option("--tag", help="Calibration tag recorded in rotationzoo.json.")]
FormatOpt = Annotated[str, typer.Option("--format", click_type=choice(vocab.FILE_FORMATS),
                                        help="Output format: pt (the authors') or safetensors.")]
MinTokensOpt = Annotated[Optional[int], typer.Option(
    "--min-tokens", min=1,
    help="Fewest tokens per layer to fit from (default 256); a layer with fewer is refused, its rotation would be noise.")]
GroupingOpt = Annotated[Optional[str], typer.Option(
    "--grouping", click_type=choice(vocab.GROUPINGS),
    help="layer: one rotation per layer; kv_head: one per layer and KV head, each from that head's own statistics "
         "(files [L, H_kv, d, d]). Default: kv_head for the recipes (layer there is the authors' --shared, files "
         "*-shared.pt; cov_eig_hadamard_perhead has no shared form), layer otherwise (kv_head files *-kv_head.pt).")]
CenterOpt = Annotated[Optional[str], typer.Option(
    "--center", click_type=choice(vocab.CENTERS),
    help="Centering before rotation: none; k (each KV head's mean key subtracted, written as k_mean; the default "
         "of oscar2_center); kv (values too: v_mean, added back to the attention output; a rotationzoo extension "
         "the authors' engine does not read). With qqt_sst / oscar2_center and --refine.")]


def _parse_layers(text: Optional[str]) -> Optional[list[int]]:
    """``--layers``, read as ``layers=`` is (:func:`~rotationzoo.files.limits.parse_layer_ids`); a refusal is a
    usage error."""
    if text is None:
        return None
    from ..files.limits import parse_layer_ids

    with usage_errors():
        return parse_layer_ids(text, "--layers")


def _trained_store(refine: Optional[int], serving: Optional[str], param: str = "expm", **knobs: Any) -> Any:
    """The INT2 store ``--refine`` trains for: ``--serving MODEL@TAG``'s settings (else the defaults) with the
    INT2-KV options given; ``None`` when neither is given. Refused without ``--refine`` (so is ``--param``)."""
    from ..errors import CLIError
    from ..int2kv import Int2KVConfig
    from ..registry import get_entry, split_model_tag

    if param != "expm" and refine is None:
        raise CLIError(f"--param {param}: what --refine learns; add --refine STEPS")
    given = {k: v for k, v in knobs.items() if v is not None}
    if not given and serving is None:
        return None
    if refine is None:
        flags = ", ".join(["--serving"] * (serving is not None) + ["--" + k.replace("_", "-") for k in given])
        raise CLIError(f"{flags}: the INT2 store that --refine trains for; add --refine STEPS")
    base = get_entry(*split_model_tag(serving)).serving if serving is not None else Int2KVConfig()
    return base.replace(**given)


def _recipe(objective: str, composition: Optional[str], group_size: Optional[int], grouping: Optional[str],
            center: Optional[str], signs: str, min_tokens: Optional[int], refine: Optional[int], init: str, seed: int,
            sample_tokens: Optional[int], loss: str, block_size: Optional[int], queries_per_block: Optional[int],
            store: Any, param: str, keep_text: Optional[List[Path]], keep_tokens: Optional[int],
            keep_context: Optional[int], keep_model: Optional[str] = None,
            keep_clips: tuple[Optional[float], Optional[float]] = (None, None)) -> Any:
    """The :class:`~rotationzoo.recipe.FitRecipe` the flags ask for, checked (before anything is read or loaded);
    a refusal is a usage error."""
    from ..recipe import FitRecipe, KeepRule, Refinement

    # the flags' strings are checked by check(), the one place that knows the names; an option not given
    # leaves the recipe's own default
    refine_fields: dict[str, Any] = {
        "steps": refine, "init": init, "seed": seed, "loss": loss, "block_size": block_size, "param": param,
        "queries_per_block": queries_per_block, "int2kv": store,
        **({"sample_tokens": sample_tokens} if sample_tokens is not None else {})}
    with usage_errors():  # refused from the options alone: a usage error
        refinement = None if refine is None else Refinement(**refine_fields)
        keep = (KeepRule(texts=tuple(str(t) for t in keep_text), tokens=keep_tokens, context=keep_context,
                         model=keep_model, k_clip_ratio=keep_clips[0], v_clip_ratio=keep_clips[1])
                if keep_text and refinement is not None else None)
        fields: dict[str, Any] = {"objective": objective, "composition": composition, "group_size": group_size,
                                  "grouping": grouping, "center": center, "signs": signs, "refine": refinement,
                                  "keep": keep, **({"min_tokens": min_tokens} if min_tokens is not None else {})}
        return FitRecipe(**fields).check()


def _print_kept(result: "FitResult") -> None:
    from ..evaluate.keep import keep_summary

    said = keep_summary(result)
    if said:
        print_note(said)


def _report(result: "FitResult", out: "FitOutput", as_json: bool) -> None:
    if as_json:
        emit_json({
            "files": {side: {"path": str(p), **out.manifest["files"][side]} for side, p in out.paths.items()},
            "manifest": str(out.manifest_path),
            "result": result.summary(),
        })
        return
    from rich.markup import escape

    con = console()
    for side, p in out.paths.items():
        f = out.manifest["files"][side]
        objective = escape(printable(f["objective"]).ljust(16))  # the manifest's: literally
        con.print(f"[bold]{side.upper()}[/] {objective} sha256 {f['sha256'][:12]}…  {escape(printable(p))}")
    s = result.stats
    tokens = f"{result.token_count} tokens/layer, " if result.tokens else ""
    heads = f" × {result.num_kv_heads} KV heads (grouping kv_head)" if result.grouping == "kv_head" else ""
    con.print(
        f"{len(result.layer_ids)} layers{heads}, head_dim {result.head_dim}, {tokens}"
        f"{s.wall_s:.2f} s, {s.bytes_read / 1e6:.1f} MB read, peak RSS {s.peak_rss_bytes / 2**20:.0f} MiB"
    )
    if result.refinement is not None:
        ref = result.refinement
        for side, rows in ref["layers"].items():
            kept_flags = [k for r in rows for k in (r["kept"] if isinstance(r["kept"], list) else [r["kept"]])]
            unit = "KV heads" if result.grouping == "kv_head" else "layers"
            con.print(f"{side.upper()} {ref['loss'][side]}: held-out loss {-ref['mean_relative_improvement'][side]:+.1%} "
                      f"mean vs {ref['init']}, refined rotation kept in "
                      f"{kept_flags.count('refined')}/{len(kept_flags)} {unit}")
    con.print(printable(f"manifest: {out.manifest_path}"), markup=False)


def fit_command(
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for the rotation files and rotationzoo.json.")],
    dump: Annotated[
        Optional[Path], typer.Option("--dump", help="Q/K/V dump folder (SGLang layout: layer_<L>/{q,k,v,seq_lens}/<chunk>.pt).")
    ] = None,
    objective: ObjectiveOpt = "qqt_sst",
    composition: CompositionOpt = None,
    group_size: GroupSizeOpt = None,
    keep_first_chunk: Annotated[
        bool, typer.Option("--keep-first-chunk", help="Also fit on chunk 0 (SGLang's warm-up batch; skipped by default).")
    ] = False,
    layers: Annotated[Optional[str], typer.Option("--layers", help="Only these layers, e.g. 0,1,2 or 3-7.")] = None,
    num_layers: Annotated[
        Optional[int], typer.Option("--num-layers", help="Layer count for --objective hadamard without --dump.")
    ] = None,
    head_dim: Annotated[Optional[int], typer.Option("--head-dim", help="head_dim for --objective hadamard without --dump.")] = None,
    model_id: Annotated[Optional[str], typer.Option("--model-id", "--model", help="Model id recorded in "
                                                    "rotationzoo.json (as calibrate's --model-id).")] = None,
    tag: TagOpt = None,
    signs: SignsOpt = "canonical",
    workers: Annotated[Optional[int], typer.Option(
        "--workers", help=f"Layers processed concurrently, 1 to {MAX_WORKERS:,} (default: auto).")] = None,
    refine: RefineOpt = None,
    init: InitOpt = "hadamard",
    seed: SeedOpt = 0,
    sample_tokens: SampleTokensOpt = None,
    loss: LossOpt = "served",
    block_size: BlockSizeOpt = None,
    queries_per_block: QueriesPerBlockOpt = None,
    serving: ServingOpt = None,
    param: ParamOpt = "expm",
    scale_dtype: ScaleDtypeOpt = None, prefix_tokens: PrefixOpt = None, recent_tokens: RecentOpt = None,
    k_clip_ratio: KClipOpt = None, v_clip_ratio: VClipOpt = None,
    keep_text: KeepTextOpt = None,
    keep_tokens: KeepTokensOpt = None,
    keep_context: KeepContextOpt = None,
    keep_k_clip_ratio: KeepKClipOpt = None,
    keep_v_clip_ratio: KeepVClipOpt = None,
    keep_model: Annotated[Optional[str], typer.Option(
        "--keep-model", help="Local transformers model folder or .gguf file that --keep-text is evaluated with "
                             "(default: the SmolLM2-135M-Instruct GGUF, as rotationzoo eval).")] = None,
    grouping: GroupingOpt = None,
    min_tokens: MinTokensOpt = None,
    center: CenterOpt = None,
    tp_size: Annotated[Optional[int], typer.Option(
        "--tp-size", min=1, help="TP ranks a per-rank dump (layer_<L>/rank_<r>/) must have; default: "
                                 "rotationzoo_dump.json's tp_size, else what every layer agrees on.")] = None,
    fmt: FormatOpt = "pt",
    as_json: JsonOpt = False,
) -> None:
    """Fit per-layer (or per-KV-head) K/V rotations from a Q/K/V dump, or write the Hadamard baseline.

    Streams every chunk once per pass in fp64 with the authors' exact normalisations, writes
    k_rotation_<objective>.pt / v_rotation_<objective>.pt (validated, each in the layout its content
    needs: V1 per layer, V2 per KV head, V3 with k_mean / v_mean or an OSCAR-2 transform; every file with
    a calibration record) and rotationzoo.json.

    Examples:

      rotationzoo fit --dump qkv_dumps/gpqa --out rotations/ --model-id Qwen/Qwen3-8B

      rotationzoo fit --dump qkv/ --out rot/ --objective ktk_vtv --composition r_h

      rotationzoo fit --dump qkv/ --out rot-g32/ --composition r_pbr_hg --group-size 32

      rotationzoo fit --objective hadamard --num-layers 36 --head-dim 128 --out rotations/

      rotationzoo fit --dump qkv/ --out rot-refined/ --refine 200 --init oscar -g 64

      rotationzoo fit --dump qkv/ --out rot-r/ --refine 100 --init oscar --grouping kv_head --center k -g 16 --keep-text held_out.txt --keep-model model.gguf

      rotationzoo fit --dump qkv/ --out rot-s/ --refine 100 --init oscar --grouping kv_head --center k --serving SmolLM2-135M-Instruct --keep-text held_out.txt

      rotationzoo fit --dump qkv/ --out rot-kvhead/ --grouping kv_head

      rotationzoo fit --dump qkv/ --out rot-v2/ --objective cov_eig_hadamard_perhead

      rotationzoo fit --dump qkv/ --out rot-center/ --objective oscar2_center --center kv

    cov_eig_hadamard_perhead is the authors' V2 fitter (rotation/fit_perhead_rotation.py): per KV head the raw
    K^T K / n and V^T V / n, eigenvectors by descending eigenvalue times the normalised Hadamard, from the first
    20 chunk files of each layer in lexicographic order, chunk 0 included; it writes a V2 pair. Where this
    departs from their script: any power-of-two head_dim (theirs: 128 only), the dump's own layer ids (theirs:
    0 ... --layers-1, no hybrid models), fp64 sums and eigh (theirs: fp32; same matrix, fewer rounding
    errors), canonical eigenvector signs unless --signs lapack, and refusal of NaN, too few tokens or a
    rank-deficient head. oscar2_perhead / oscar2_center are their OSCAR-2 fitter's orthogonal variants
    (rotation/tools/fit_oscar2_variants.py), fitted from a dump instead of startup-calibration moments
    (V3 files; --grouping layer is their --shared).

    A per-rank dump (layer_<L>/rank_<r>/{q,k,v}/<chunk>.pt) is merged along the head axis in rank order;
    KV heads several ranks hold must be bit-identical and are kept once. A rank missing, fewer than
    --min-tokens tokens per layer or a layer with no chunks is refused with one line.

    With --grouping kv_head every KV head gets its own rotation (from its own covariance, or
    refined on its own held-out loss with --refine); the files hold [layers, KV heads, d, d] and
    are named k_rotation_<target>_<composition>-kv_head.pt.

    With --refine, each layer's rotation starts from --init and is learned against the INT2
    store's error on a reservoir of --sample-tokens tokens per layer (blocks of --block-size). The
    default --loss served counts only the query-key pairs that are INT2 when served (keys older than
    the recent window, outside the sink), K as the attention-weighted score error and V as the error
    those far values add to the attention output; --loss block counts every pair of a block. A layer
    keeps the learned rotation only if it lowers the loss on held-out blocks (--init says where it
    starts: --objective other than qqt_sst and --composition are refused). --refine trains for the
    INT2 store of --serving MODEL[@TAG] (its clips, windows, group and scale/zero dtype), with -g,
    --scale-dtype, --prefix-tokens, --recent-tokens and the clip ratios overriding one setting each;
    the fitted folder's rotationzoo.json records the recipe. --init oscar --grouping kv_head --center k starts from the
    oscar2_center closed form (k_mean kept). With --keep-text the whole result is then judged by the
    model on held-out text: the init, refined and mixed K/V pairs are evaluated (KL, the eval
    protocol) and the lowest kept, so refinement cannot make the model worse on those tokens.

    The dump is checked before any activation is read: its folders and files must lie inside it
    and be regular files, and every chunk an inspected torch.save archive of one tensor within the
    documented limits, with valid seq_lens. Layers with fewer than --min-tokens tokens, NaN or Inf
    values, or a zero or rank-deficient covariance are refused with one line (docs/security.md).
    """
    from ..errors import CLIError
    from ..recipe import check_workers
    from ..workflows.fitting import check_data_free, fit_dump

    if dump is None and objective != "hadamard":
        raise CLIError("--dump DIR is required (only --objective hadamard works without a dump)")
    if refine is not None and dump is None:
        raise CLIError("--refine needs --dump DIR (the calibration samples)")
    layer_ids = _parse_layers(layers)
    keep_clips = (keep_k_clip_ratio, keep_v_clip_ratio)
    with usage_errors():  # what the options alone refuse: the library's checks, as usage errors
        check_workers(workers, "--workers")
        if dump is None:
            check_data_free(layer_ids, num_layers, head_dim)
        check_keep_options(keep_text, keep_tokens, keep_context, refine is not None, keep_model,
                           clipped=keep_clips != (None, None))
    store = _trained_store(refine, serving, param, scale_dtype=scale_dtype, prefix_tokens=prefix_tokens,
                           recent_tokens=recent_tokens, k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio)
    recipe = _recipe(objective, composition, group_size, grouping, center, signs, min_tokens, refine, init, seed,
                     sample_tokens, loss, block_size, queries_per_block, store, param, keep_text, keep_tokens,
                     keep_context, keep_model, keep_clips)
    label = "refine" if refine is not None else "fit"
    with progress_reporter(label, enabled=dump is not None and objective != "hadamard") as progress:
        result, written = fit_dump(dump, recipe, out, layers=layer_ids, keep_first_chunk=keep_first_chunk,
                                   tp_size=tp_size, num_layers=num_layers, head_dim=head_dim, workers=workers,
                                   model_id=model_id, tag=tag, fmt=fmt, progress=progress, note=print_note)
    _print_kept(result)
    _report(result, written, as_json)


def calibrate_command(
    model: Annotated[str, typer.Option("--model", help="Local transformers model folder or .gguf file.")],
    text: Annotated[
        List[Path], typer.Option("--text", help="Calibration text file (UTF-8); repeat for more files. "
                                 "Checked before the model loads; read only as far as --tokens tokens.")
    ],
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens per layer to fit on (T).")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output folder for the rotation files and rotationzoo.json.")],
    dump_out: Annotated[
        Optional[Path], typer.Option("--dump-out", help="Also write the captured Q/K/V as an SGLang-layout dump here.")
    ] = None,
    objective: Annotated[str, typer.Option(
        "--objective", click_type=choice(tuple(o for o in vocab.OBJECTIVES if o != "hadamard")),
        help="Covariance target(s); qqt_sst is OSCAR's.")] = "qqt_sst",
    composition: CompositionOpt = None,
    group_size: GroupSizeOpt = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per calibration sequence.")] = 2048,
    dtype: Annotated[str, typer.Option("--dtype", help="Model dtype: auto, bfloat16, float16 or float32.")] = "auto",
    device: Annotated[str, typer.Option("--device", help="Where the model runs (cpu, cuda, ...).")] = "cpu",
    model_id: Annotated[
        Optional[str], typer.Option("--model-id", help="Model id for rotationzoo.json (default: the folder/file name).")
    ] = None,
    tag: TagOpt = None,
    signs: SignsOpt = "canonical",
    overwrite_dump: Annotated[bool, typer.Option("--overwrite-dump", help="Replace an existing dump in --dump-out.")] = False,
    grads: Annotated[bool, typer.Option(
        "--grads", help="Also run a backward pass per window and write each layer's output gradients into "
                        "--dump-out (g/), for fit --dump D --refine N --loss fisher (on with --loss fisher; about "
                        "2x the capture's time; memory grows with --seq-len: 20.9 GiB for SmolLM2-135M at 8192).")] = False,
    refine: RefineOpt = None,
    init: InitOpt = "hadamard",
    seed: SeedOpt = 0,
    sample_tokens: SampleTokensOpt = None,
    loss: LossOpt = "served",
    block_size: BlockSizeOpt = None,
    queries_per_block: QueriesPerBlockOpt = None,
    serving: ServingOpt = None,
    param: ParamOpt = "expm",
    scale_dtype: ScaleDtypeOpt = None, prefix_tokens: PrefixOpt = None, recent_tokens: RecentOpt = None,
    k_clip_ratio: KClipOpt = None, v_clip_ratio: VClipOpt = None,
    keep_text: KeepTextOpt = None,
    keep_tokens: KeepTokensOpt = None,
    keep_context: KeepContextOpt = None,
    keep_k_clip_ratio: KeepKClipOpt = None,
    keep_v_clip_ratio: KeepVClipOpt = None,
    grouping: GroupingOpt = None,
    min_tokens: MinTokensOpt = None,
    center: CenterOpt = None,
    model_revision: Annotated[Optional[str], typer.Option(
        "--model-revision", help="The model's revision, recorded in the files' calibration record (default: the "
                                 "commit of a Hugging Face cache snapshot the model lies in, if any).")] = None,
    fmt: FormatOpt = "pt",
    as_json: JsonOpt = False,
) -> None:
    """Capture post-RoPE Q/K/V from a local transformers model and fit rotations (no SGLang needed).

    Each text file is tokenized and cut into --seq-len windows, run as independent sequences until
    --tokens tokens; Q/K/V stream straight into the fp64 accumulators. Nothing is downloaded.
    Progress goes to stderr (a bar on a terminal, else a few lines).

    Examples:

      rotationzoo calibrate --model ./Qwen3-8B --text calib.txt --tokens 20000 --out rotations/

      rotationzoo calibrate --model model.Q8_0.gguf --text a.txt --text b.txt --tokens 8000 --out rot/ --dump-out qkv/

      rotationzoo calibrate --model model.gguf --text calib.txt --tokens 20000 --out rot/ --refine 200 --init oscar -g 64

      rotationzoo calibrate --model ./Qwen3-8B --text calib.txt --tokens 20000 --out rot-kvhead/ --grouping kv_head

      rotationzoo calibrate --model ./Qwen3-8B --text calib.txt --tokens 20000 --out rot-c/ --objective oscar2_center

      rotationzoo calibrate --model model.gguf --text calib.txt --tokens 20000 --out rot/ --refine 100 --init oscar --grouping kv_head --center k -g 16 --seq-len 8192 --queries-per-block 64 --keep-text other.txt

      rotationzoo calibrate --model model.gguf --text calib.txt --tokens 20000 --seq-len 8192 --out rot/ --dump-out qkv/ --grads

    --refine learns the rotations as `rotationzoo fit --refine` does, on samples kept during the capture;
    with --keep-text (a text other than the calibration one) the model then judges them against their
    init on --keep-tokens tokens of it (the keep rule).
    A refined rotation fits the key positions it was calibrated on: give --seq-len as long as the
    context that will be served (refined at 2048, it did not carry to 8K windows; docs/fitting.md).
    Every file records its calibration: prompt_sha256 (of the token windows run, the authors'
    definition), text_sha256, tokens, the model's revision (and a .gguf file's sha256).
    """
    from ..workflows.fitting import calibrate

    keep_clips = (keep_k_clip_ratio, keep_v_clip_ratio)
    with usage_errors():
        check_keep_options(keep_text, keep_tokens, keep_context, refine is not None, clipped=keep_clips != (None, None))
    store = _trained_store(refine, serving, param, scale_dtype=scale_dtype, prefix_tokens=prefix_tokens,
                           recent_tokens=recent_tokens, k_clip_ratio=k_clip_ratio, v_clip_ratio=v_clip_ratio)
    recipe = _recipe(objective, composition, group_size, grouping, center, signs, min_tokens, refine, init, seed,
                     sample_tokens, loss, block_size, queries_per_block, store, param, keep_text, keep_tokens,
                     keep_context, keep_clips=keep_clips)
    with progress_reporter("calibrate") as progress:
        result, written = calibrate(model, text, recipe, out, tokens=tokens, seq_len=seq_len, dump_out=dump_out,
                                    overwrite_dump=overwrite_dump, grads=grads, dtype=dtype, device=device, model_id=model_id,
                                    model_revision=model_revision, tag=tag, fmt=fmt, progress=progress,
                                    note=print_note)
    _print_kept(result)
    _report(result, written, as_json)


def register(app: typer.Typer) -> None:
    """Add ``fit`` and ``calibrate`` to the CLI."""
    app.command("fit", no_args_is_help=True)(fit_command)
    app.command("calibrate", no_args_is_help=True)(calibrate_command)
