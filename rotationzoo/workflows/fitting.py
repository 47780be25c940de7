"""``rotationzoo fit`` and ``rotationzoo calibrate`` as Python calls: a :class:`~rotationzoo.recipe.FitRecipe` in,
written files out, with the commands' defaults and checks.

::

    from rotationzoo.recipe import FitRecipe, KeepRule, Refinement
    from rotationzoo.registry import get_entry
    from rotationzoo.workflows import fit_dump

    # rotationzoo fit --dump qkv/ --out rot/ --objective oscar2_center
    result, written = fit_dump("qkv/", FitRecipe(objective="oscar2_center"), "rot/")

    # rotationzoo fit --dump qkv/ --out rot-r/ --refine 100 --init oscar --grouping kv_head --center k
    #     --serving SmolLM2-135M-Instruct --keep-text held_out.txt
    store = get_entry("SmolLM2-135M-Instruct").serving           # the windows, clips and group it is served with
    recipe = FitRecipe(grouping="kv_head", center="k",
                       refine=Refinement(steps=100, init="oscar", int2kv=store),
                       keep=KeepRule(texts=("held_out.txt",)))
    result, written = fit_dump("qkv/", recipe, "rot-r/")

Every refusal a recipe can earn (:meth:`~rotationzoo.recipe.FitRecipe.check`), and the keep rule's texts and
judge model, are checked before a dump's activations are read or a model's weights load. The fitted folder's
``rotationzoo.json`` records the recipe (``recipe``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

from ..errors import ConfigError
from ..progress import Progress
from ..recipe import FitRecipe
from .keep import apply_keep_rule, keep_ids, keep_plan, load_judge

if TYPE_CHECKING:  # pragma: no cover
    from ..fit import FitOutput, FitResult

#: Where a workflow reports one-line notes (a model loading, ...), e.g. the CLI's stderr.
Note = Callable[[str], None]


def fit_dump(
    dump: Optional[str | os.PathLike[str]],
    recipe: FitRecipe,
    out: str | os.PathLike[str],
    *,
    layers: Optional[Iterable[int] | str] = None,
    keep_first_chunk: bool = False,
    tp_size: Optional[int] = None,
    num_layers: Optional[int] = None,
    head_dim: Optional[int] = None,
    workers: Optional[int] = None,
    model_id: Optional[str] = None,
    tag: Optional[str] = None,
    fmt: str = "pt",
    progress: Progress | None = None,
    keep_progress: Progress | None = None,
    note: Note | None = None,
) -> tuple["FitResult", "FitOutput"]:
    """``rotationzoo fit``: fit ``recipe`` from a Q/K/V dump and write the files and manifest to ``out``.

    Args:
        dump: the dump folder (SGLang layout, whole layers or per TP rank); ``None`` only for the data-free
            ``objective="hadamard"`` (then ``num_layers`` and ``head_dim``).
        recipe: what to fit; a refinement (``recipe.refine``) learns from a reservoir of the dump's blocks,
            its OSCAR inits fitted from the whole dump, then the keep rule (``recipe.keep``) judges it.
        out: output folder.
        layers, keep_first_chunk, tp_size: which layers and chunks of the dump are read (``layers``: layer ids, or
            text as ``--layers`` takes it, ``"0,1,2"`` or ``"3-7"``), how many TP ranks a per-rank dump must have.
        num_layers, head_dim: the data-free Hadamard baseline's shape.
        workers: layers processed concurrently (default: auto).
        model_id, tag: recorded in ``rotationzoo.json`` (``calibrate``'s ``model_id`` too).
        fmt: ``"pt"`` (the authors' format) or ``"safetensors"``.
        progress: ``progress(done, total, what)`` of the fit; ``keep_progress`` that of the keep rule (default:
            ``progress``).
        note: one-line notes (the judge model loading).

    Returns:
        ``(result, written)``: the :class:`~rotationzoo.fit.FitResult` (after the keep rule) and the
        :class:`~rotationzoo.fit.FitOutput` (paths, manifest).

    Raises:
        FitError, ConfigError, DumpError: a refused recipe, keep rule or dump, before the long work.
    """
    from ..files.limits import parse_layer_ids
    from ..fit import fit_rotations, open_dump, refine_dump, write_fitted
    from ..recipe import check_workers
    from ..fit.output import check_output_folder

    recipe.check()
    if dump is None and (recipe.refine is not None or recipe.objective != "hadamard"):
        raise ConfigError("a dump is required: only objective 'hadamard' (without a refinement) is data-free")
    ids = None if layers is None else parse_layer_ids(layers, "layers")
    check_workers(workers)
    if dump is None:
        check_data_free(ids, num_layers, head_dim)
    check_output_folder(out, what="output folder (--out)")  # before the dump is read: a long fit never ends in it
    if recipe.refine is not None:
        assert dump is not None
        opened = open_dump(dump, keep_first_chunk=keep_first_chunk, layers=ids, tp_size=tp_size)
        keep = recipe.keep
        # texts checked, model loaded, held-out tokens read: before the dump's activations are read
        judge = (load_judge(keep.texts, keep.model, keep.tokens, keep.context, bound=opened.context(),
                            fits=(opened.shape(), opened.layer_ids), note=note) if keep is not None else None)
        result = refine_dump(opened, recipe.refine, group_size=recipe.group_size, workers=workers,
                             progress=progress, grouping=recipe.resolved_grouping(),
                             min_tokens=recipe.min_tokens, center=recipe.center)
        if judge is not None and keep is not None:
            lm, held_ids = judge
            result = apply_keep_rule(result, lm, held_ids, keep.tokens, keep.context,
                                     progress=keep_progress or progress, rule=keep)
    else:
        source = None if dump is None else open_dump(dump, keep_first_chunk=keep_first_chunk, layers=ids,
                                                     tp_size=tp_size)
        result = fit_rotations(source, recipe.objective, recipe.composition, group_size=recipe.group_size,
                               keep_first_chunk=keep_first_chunk, layers=ids, workers=workers, progress=progress,
                               signs=recipe.signs, num_layers=num_layers, head_dim=head_dim,
                               grouping=recipe.grouping, min_tokens=recipe.min_tokens, center=recipe.center)
    return result, write_fitted(result, out, model=model_id, tag=tag, fmt=fmt, extra={"recipe": recipe.to_json()})


def check_data_free(layers: Optional[Sequence[int]], num_layers: Optional[int], head_dim: Optional[int]) -> None:
    """The shape of the data-free Hadamard baseline (``objective="hadamard"`` without a dump), checked before
    anything is written: ``num_layers`` (from 1 to the most layers a rotation file holds) or ``layers``, every
    layer id below ``num_layers`` when both are given, and a ``head_dim``.

    Raises:
        ConfigError: one line naming the Python argument and its option (``num_layers (--num-layers)``).
    """
    from ..files.limits import MAX_LAYERS
    from ..numbers import check_int

    if num_layers is None and layers is None:
        raise ConfigError("objective 'hadamard' without a dump needs num_layers (--num-layers N) or layer ids "
                          "(layers, --layers)")
    if num_layers is not None:
        check_int(num_layers, "num_layers (--num-layers)", low=1, high=MAX_LAYERS, hint=" (the most layers a "
                  "rotation file holds)")
        stray = [i for i in layers or () if i >= num_layers]
        if stray:
            raise ConfigError(f"layer {stray[0]} (layers, --layers) is not one of the {num_layers} layers of "
                              f"num_layers (--num-layers; ids 0 to {num_layers - 1}): give ids below it, or leave "
                              f"num_layers unset")
    if head_dim is None:
        raise ConfigError("objective 'hadamard' without a dump needs head_dim (--head-dim D)")


def calibrate(
    model: str | os.PathLike[str],
    texts: Sequence[str | os.PathLike[str]],
    recipe: FitRecipe,
    out: str | os.PathLike[str],
    *,
    tokens: int,
    seq_len: int = 2048,
    dump_out: Optional[str | os.PathLike[str]] = None,
    overwrite_dump: bool = False,
    grads: bool = False,
    dtype: str = "auto",
    device: str = "cpu",
    model_id: Optional[str] = None,
    model_revision: Optional[str] = None,
    tag: Optional[str] = None,
    fmt: str = "pt",
    progress: Progress | None = None,
    keep_progress: Progress | None = None,
    note: Note | None = None,
) -> tuple["FitResult", "FitOutput"]:
    """``rotationzoo calibrate``: capture post-RoPE Q/K/V from a local transformers model (folder or ``.gguf``)
    reading ``texts``, fit ``recipe`` and write the files and manifest to ``out``.

    Args:
        model: a local transformers model folder or ``.gguf`` file (nothing is downloaded).
        texts: calibration text files (UTF-8), read only as far as ``tokens`` tokens.
        recipe: what to fit; a refinement learns on samples kept during the capture and its keep rule
            (``recipe.keep``; ``keep.model`` does not apply: the model that runs judges) runs on the held-out
            text. Without a keep rule a refinement is not judged (``note`` says so).
        out: output folder.
        tokens: tokens per layer to fit on; ``seq_len``: tokens per calibration sequence.
        dump_out, overwrite_dump: also write the captured Q/K/V as an SGLang-layout dump.
        grads: also write the output gradients into ``dump_out`` (``g/``), for a later ``"fisher"`` refinement
            from the dump (a ``"fisher"`` recipe captures them whatever this says).
        dtype, device: how the model runs.
        model_id: recorded in ``rotationzoo.json`` (default: the folder or file name).
        model_revision: recorded in the files' calibration record (default: a Hugging Face snapshot's commit).
        tag, fmt: as :func:`fit_dump`.
        progress, keep_progress, note: as :func:`fit_dump`.

    Returns:
        ``(result, written)`` as :func:`fit_dump`.

    Raises:
        FitError, ConfigError, ModelLoadError: a refused recipe, sizes (``tokens``, ``seq_len``), texts, output
            folder, dtype, device or model file, before the weights load (one line each); then a capture or fit
            that fails.
    """
    from ..fit import write_fitted
    from ..fit.fitter import check_token_budget
    from ..fit.output import check_output_folder
    from ..integrations.transformers import calibrate as run_calibration
    from ..integrations.transformers import check_text_files, load_model, load_tokenizer, peek_model
    from ..integrations.transformers.calibration import check_capture_sizes
    from ..integrations.transformers.loading import check_load_options, model_provenance

    recipe.check()
    check_capture_sizes(tokens, seq_len)  # before the model loads: sizes, budget, outputs, dtype and device
    check_token_budget(tokens, recipe.min_tokens)
    check_output_folder(out, what="output folder (--out)")
    if dump_out is not None:
        check_output_folder(dump_out, what="dump folder (--dump-out)")
    check_load_options(dtype, device)
    checked = check_text_files(list(texts), what="calibration text", option="--text")
    if grads and dump_out is None:
        raise ConfigError("grads (--grads) writes the output gradients into a dump: give dump_out (--dump-out DIR)")
    keep = recipe.keep
    if keep is not None and keep.model is not None:
        raise ConfigError("calibrate judges with the model it runs; the keep rule's model (--keep-model) is for a "
                          "fit from a dump")
    held_out = list(check_text_files(list(keep.texts), what="held-out text", option="--keep-text")) if keep else None
    plan = keep_plan(keep.tokens, keep.context, min(seq_len, tokens)) if keep is not None else None
    peek_model(os.fspath(model), option="--model")  # a model file cut short fails here, before anything loads
    tokenizer = load_tokenizer(os.fspath(model))
    held_ids = keep_ids(tokenizer, held_out, plan) if held_out and plan else None  # a short text, before the weights
    if note is not None:
        note(f"loading {model} ({dtype}, {device})")
    lm, _ = load_model(os.fspath(model), dtype=dtype, device=device, tokenizer=tokenizer)
    mid = model_id or Path(model).name
    result = run_calibration(
        lm, tokenizer, checked, tokens=tokens, seq_len=seq_len, objective=recipe.objective,
        composition=recipe.composition, group_size=recipe.group_size, dump_out=dump_out,
        overwrite_dump=overwrite_dump, signs=recipe.signs, model_id=mid, progress=progress, refine=recipe.refine,
        grads=grads,
        grouping=recipe.grouping, min_tokens=recipe.min_tokens, center=recipe.center,
        provenance=model_provenance(lm, os.fspath(model), model_revision),
    )
    if recipe.refine is not None and keep is not None and held_ids is not None:
        result = apply_keep_rule(result, lm, held_ids, keep.tokens, keep.context,
                                 progress=keep_progress or progress, rule=keep)
    elif recipe.refine is not None and note is not None:
        note("keep rule skipped: give --keep-text FILE, a text other than the calibration one (the calibration "
             "text's own continuation overstates what refinement gains on other text: docs/fitting.md)")
    return result, write_fitted(result, out, model=mid, tag=tag, fmt=fmt, extra={"recipe": recipe.to_json()})


__all__ = ["calibrate", "check_data_free", "fit_dump"]
