"""Learned rotations as a fit: calibration samples in, a standard format-version-1 pair out.

:func:`refine_fit` starts every layer from an init rotation (``hadamard``, ``oscar`` = OSCAR's
``U·H·P_br`` or ``r_pbr_hg`` = ``U·P_br·H_G``), refines it with
:func:`rotationzoo.fit.refine.refine_rotations` and returns a :class:`~rotationzoo.fit.FitResult`
(``objective = "refined"``) that :func:`~rotationzoo.fit.write_fitted` writes like any other fit:
``k_rotation_refined_k_logit_<init>.pt``, ``v_rotation_refined_v_attn_out_<init>.pt`` and a
``rotationzoo.json`` whose ``refinement`` records the init, the losses, steps, seed and every
layer's held-out loss before and after::

    from rotationzoo.fit import refine_fit, samples_from_dump, write_fitted

    samples = samples_from_dump("qkv_dumps/gpqa")
    result = refine_fit(samples, "oscar", steps=200, group_size=64, statistics="qkv_dumps/gpqa")
    write_fitted(result, "rotations-refined/", tag="gpqa-refined")

The OSCAR inits are fitted from the full covariance statistics when ``statistics`` (a dump or the
accumulators of :func:`~rotationzoo.integrations.transformers.collect_statistics`) is given, else
from the samples themselves. ``grouping="kv_head"`` learns one rotation per (layer, KV head),
each kept only where it lowers that head's held-out loss, from per-head OSCAR inits (or ``H_d`` for
every head).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch

from ..errors import FitError
from ..progress import Progress, prefixed
from ..files.format import RotationSet
from ..recipe import DEFAULT_MIN_TOKENS, DEFAULT_STEPS, INIT_COMPOSITIONS, Refinement, check_min_tokens, resolve_center
from ..vocab import REFINE_INITS, Center, Grouping
from .compose import composition_label
from .dump import Dump, open_dump
from .accumulate import kinds_for
from .fitter import check_grouping, check_tokens, dump_provenance, fit_rotations
from .refine import RefineResult, refine_rotations, relative_improvement
from .refine_loss import RefineConfig
from .result import FitResult, FitStats, peak_rss_bytes
from .samples import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_TOKENS, CalibrationSamples

def _check_init(init: str) -> None:
    if init not in INIT_COMPOSITIONS:
        raise FitError(f"unknown init {init!r}; expected one of {', '.join(REFINE_INITS)}")


def refine_config(refinement: Refinement, base: RefineConfig | None = None) -> RefineConfig:
    """``base`` (default settings) with ``refinement``'s loss, parametrisation, INT2 store and, when given, queries
    per block: what :func:`refine_fit` runs for a :class:`~rotationzoo.recipe.Refinement` (``int2kv=None`` keeps
    ``base``'s store)."""
    cfg = replace(base or RefineConfig(), loss=refinement.loss, param=refinement.param)
    if refinement.int2kv is not None:
        cfg = replace(cfg, int2kv=refinement.int2kv)
    return cfg if refinement.queries_per_block is None else replace(cfg, queries_per_block=refinement.queries_per_block)


def samples_from_dump(
    dump: str | os.PathLike[str] | Dump,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    keep_first_chunk: bool = False,
    layers: Iterable[int] | None = None,
    progress: Progress | None = None,
    grads: bool = False,
) -> CalibrationSamples:
    """A bounded reservoir of whole token blocks per layer, read from a Q/K/V dump.

    Args:
        dump: dump folder (SGLang layout) or an opened :class:`~rotationzoo.fit.dump.Dump`.
        max_tokens: tokens kept per layer (default 14,336; see :mod:`rotationzoo.fit.samples`).
        block_size: tokens per block.
        seed: reservoir seed.
        keep_first_chunk: also read chunk 0 (skipped by default, as the fitter does).
        layers: only these layers.
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): chunks read.
        grads: also keep the output gradients (``g/``), which the ``"fisher"`` loss needs.
    """
    d = dump if isinstance(dump, Dump) else open_dump(dump, keep_first_chunk=keep_first_chunk, layers=layers)
    samples = CalibrationSamples(block_size=block_size, max_tokens=max_tokens, seed=seed)
    samples.add_dump(d, layers=layers, progress=progress, grads=grads)
    return samples


def _init_source(init: str, samples: CalibrationSamples, statistics: Any, group_size: int | None,
                 layers: tuple[int, ...], grouping: Grouping = "layer",
                 progress: Progress | None = None, min_tokens: int = DEFAULT_MIN_TOKENS,
                 center: str = "none") -> tuple[Any, str, dict[str, dict[int, torch.Tensor]]]:
    """What :func:`refine_rotations` starts from, its label (``hadamard``, ``r_h_pbr``, ``r_pbr_hg64``) and,
    when centered, the means to center the samples with (``{"k": {layer: [H_kv, d] or [d]}, ...}``): from
    the full statistics when given (a centered closed-form fit, whose means the samples then use), else
    from the samples."""
    _check_init(init)
    comp = INIT_COMPOSITIONS[init]
    shape = samples.layers[layers[0]].shape
    assert shape is not None
    g = group_size or shape.head_dim
    label = "hadamard" if comp is None else composition_label(comp, g)
    if statistics is None:
        return comp or "hadamard", label, _sample_means(samples, layers, grouping, center)
    if comp is None and center == "none":
        return "hadamard", label, {}
    fit = fit_rotations(statistics, "qqt_sst", comp or "r_h_pbr", group_size=g if comp == "r_pbr_hg" else None,
                        layers=layers, grouping=grouping, progress=prefixed(progress, f"{label} init"),
                        min_tokens=min_tokens, center=center)  # type: ignore[arg-type]
    means = _set_means(fit.k, fit.v)
    return ("hadamard" if comp is None else fit), label, means


def _given_init(init: Any, center: str) -> tuple[Any, str, dict[str, dict[int, torch.Tensor]]]:
    """A given pair (a :class:`FitResult`, a loaded pair: anything with ``.k`` / ``.v`` rotation sets) as the
    init: its label (the K set's objective) and its own means, which must match ``center``."""
    k, v = getattr(init, "k", None), getattr(init, "v", None)
    if not isinstance(k, RotationSet) or not isinstance(v, RotationSet):
        raise FitError(f"init must be one of {', '.join(REFINE_INITS)} or a pair with K and V rotation sets "
                       f"(a FitResult, a loaded pair), got {type(init).__name__}")
    has = "kv" if v.v_mean is not None else ("k" if k.k_mean is not None else "none")
    if has != center:
        raise FitError(f"the given init centers {has!r} but center={center!r}; pass the init's own centering")
    return init, k.objective, _set_means(k, v)


def _set_means(k: RotationSet | None, v: RotationSet | None) -> dict[str, dict[int, torch.Tensor]]:
    """``{"k": {layer: k_mean}, "v": {layer: v_mean}}`` of the sets that carry a mean."""
    return {side: {lid: t for lid, t in zip(rs.layer_ids, getattr(rs, f"{side}_mean"))}
            for side, rs in (("k", k), ("v", v)) if rs is not None and getattr(rs, f"{side}_mean") is not None}


def _sample_means(samples: CalibrationSamples, layers: tuple[int, ...], grouping: str,
                  center: str) -> dict[str, dict[int, torch.Tensor]]:
    """The kept blocks' own key / value means (``[H_kv, d]``, or ``[d]`` for one rotation per layer)."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for side in ("k", "v")[: {"none": 0, "k": 1, "kv": 2}[center]]:
        for lid in layers:
            mu = getattr(samples.layers[lid], side).to(torch.float64).mean(dim=(0, 1))  # [H_kv, d]
            out.setdefault(side, {})[lid] = mu if grouping == "kv_head" else mu.mean(dim=0)
    return out


def _check_samples(samples: CalibrationSamples, ids: tuple[int, ...], min_tokens: int) -> None:
    """Refuse layers with fewer than ``min_tokens`` tokens, and kept blocks that are not finite or all
    zero (their losses would be NaN, and the init kept without a word)."""
    check_tokens({lid: samples.layers[lid].tokens_seen for lid in ids if lid in samples.layers}, min_tokens)
    names = {"q": "queries", "k": "keys", "v": "values"}
    for lid in ids:
        layer = samples.layers.get(lid)
        for kind, name in names.items():
            t = getattr(layer, kind, None)
            if t is None:
                continue
            if not bool(torch.isfinite(t).all()):
                raise FitError(f"layer {lid}: the calibration samples hold non-finite {name} (NaN or Inf); "
                               "re-dump the model")
            if not bool(t.abs().amax() > 0):
                raise FitError(f"layer {lid}: the calibration samples hold all-zero {name}; there is nothing to "
                               "learn a rotation from (re-dump the model)")


def _layer_losses(res: RefineResult) -> dict[str, list[dict[str, Any]]]:
    keys: tuple[str, ...] = ("layer_id", "heldout_init", "heldout_refined", "heldout_final", "kept", "train_blocks",
                             "heldout_blocks")
    if res.config.per_head:  # one loss per KV head (``kept`` is then a list too)
        keys += ("heldout_init_per_head", "heldout_refined_per_head", "heldout_final_per_head")
    out: dict[str, list[dict[str, Any]]] = {side: [] for side in res.config.sides}
    for rec in sorted(res.records, key=lambda r: (r["side"], r["layer_id"])):
        out[rec["side"]].append({k: rec[k] for k in keys})
    return out


def refinement_summary(res: RefineResult, init: str, init_label: str, samples: CalibrationSamples) -> dict[str, Any]:
    """The manifest's ``refinement``: init, losses, optimizer, steps, seed, per-layer (and, refined per
    KV head, per-head) held-out losses."""
    cfg = res.config
    return {
        "init": init,
        "init_composition": init_label,
        "loss": {side: cfg.loss_name(side) for side in cfg.sides},
        "steps": {"k": cfg.steps_k, "v": cfg.steps_v},
        "seed": cfg.seed,
        "optimizer": "adam",
        "param": cfg.param,
        "config": {k: v for k, v in cfg.to_dict().items() if k != "int2kv"},  # that is the manifest's int2kv
        "samples": {k: v for k, v in samples.summary().items() if k != "layers"},
        "mean_relative_improvement": {
            side: relative_improvement([r for r in res.records if r["side"] == side]) for side in cfg.sides
        },
        "layers": _layer_losses(res),
    }


def refine_fit(
    samples: CalibrationSamples,
    init: Any = "hadamard",
    *,
    steps: int = DEFAULT_STEPS,
    group_size: int | None = None,
    seed: int = 0,
    statistics: str | os.PathLike[str] | Dump | Mapping[int, Any] | None = None,
    config: RefineConfig | None = None,
    layers: Iterable[int] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    source_info: Mapping[str, Any] | None = None,
    model: str | None = None,
    grouping: Grouping = "layer",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    center: Center | None = None,
    steps_v: int | None = None,
) -> FitResult:
    """Learn every layer's K and V rotation against the INT2 store's error; a fit result to write.

    Args:
        samples: calibration blocks per layer (:func:`samples_from_dump`, or ``stats.samples`` of
            :func:`~rotationzoo.integrations.transformers.collect_statistics`).
        init: ``"hadamard"``, ``"oscar"`` (``r_h_pbr``) or ``"r_pbr_hg"`` (with ``G = group_size``), or a given
            pair: any closed form's :class:`~rotationzoo.fit.FitResult` (e.g. ``cov_eig_hadamard_perhead``,
            ``oscar2_center``) or loaded rotations, per layer or per KV head (``grouping`` must match), its
            ``k_mean`` / ``v_mean`` kept (``center`` must say the same).
        steps: optimizer steps per layer and side (0: the init, with its held-out loss recorded).
        group_size: INT2 group ``G`` of the loss (``None``: ``config.int2kv.group_size``, whose
            ``None`` is head_dim).
        seed: seeds the train/held-out split and the minibatches.
        statistics: a dump or covariance accumulators to fit the OSCAR inits from (default: the samples).
        config: further settings (``config.int2kv``: the INT2-KV settings the loss models; learning
            rate, ...); ``steps``, ``group_size`` and ``seed`` override its fields.
        layers: only these layers (default: all with samples).
        workers: concurrent (layer, side) jobs (the result does not depend on it).
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): the OSCAR inits'
            fit from a dump (``what``: ``"r_h_pbr init: layer <L>"``), then the optimizer steps of
            every (layer, side) (``"layer <L> K"``).
        source_info: what the samples came from (recorded as the result's ``source``).
        model: model id recorded in the result.
        grouping: ``"layer"``, or ``"kv_head"``: one rotation per layer and KV head, each kept only
            where it lowers that head's held-out loss (``[L, H_kv, d, d]`` sets; the OSCAR inits
            are fitted per head, ``hadamard`` is ``H_d`` for every head).
        min_tokens: fewest calibration tokens per layer (as :func:`~rotationzoo.fit.fit_rotations`).
        center: ``"k"`` / ``"kv"``: start from the centered closed form (the means from ``statistics``,
            else from the samples), learn on the centered keys (and values) and keep ``k_mean``
            (``v_mean``) in the result, as :func:`~rotationzoo.fit.fit_rotations` writes them.
        steps_v: V steps when they differ from ``steps`` (0: V stays at its init, as K-only recipes do).

    Returns:
        A :class:`~rotationzoo.fit.FitResult` with ``objective = "refined"`` and ``refinement`` set.
    """
    t0 = time.perf_counter()
    base = config or RefineConfig()
    per_head = check_grouping(grouping)
    if base.per_head and not per_head:
        raise FitError("config.per_head=True learns one rotation per KV head; pass grouping='kv_head'")
    if group_size is None:
        group_size = base.int2kv.group_size
    cfg = replace(base, steps_k=int(steps), steps_v=int(steps if steps_v is None else steps_v), seed=int(seed),
                  per_head=per_head,
                  int2kv=replace(base.int2kv, group_size=group_size))
    if tuple(cfg.sides) != ("k", "v"):
        raise FitError("refine_fit writes a pair: rotations for both K and V")
    ids = tuple(sorted(int(i) for i in layers)) if layers is not None else samples.layer_ids()
    if not ids:
        raise FitError("no calibration samples to refine on")
    centered = resolve_center("qqt_sst", center, ("qqt", "sst"))
    _check_samples(samples, ids, check_min_tokens(min_tokens))
    if isinstance(init, str):
        src, label, means = _init_source(init, samples, statistics, group_size, ids, grouping, progress, min_tokens,
                                         centered)
    else:
        src, label, means = _given_init(init, centered)
        init = "given"
    learned = f"signs_{label}" if cfg.param == "signs" else label  # learned signs named apart from a learned rotation
    res = refine_rotations(samples, src, cfg, layers=ids, workers=workers, progress=progress, means=means)
    first = samples.layers[ids[0]].shape
    assert first is not None
    info = dict(source_info or {})
    result = FitResult(
        k=_centered(res.rotation_set("k", f"refined_{cfg.loss_name('k')}_{learned}"), means, "k"),
        v=_centered(res.rotation_set("v", f"refined_{cfg.loss_name('v')}_{learned}"), means, "v"),
        objective="refined", composition=learned, group_size=group_size,
        targets={side: cfg.loss_name(side) for side in ("k", "v")},
        layer_ids=ids, head_dim=first.head_dim, num_q_heads=first.num_q_heads, num_kv_heads=first.num_kv_heads,
        tokens={lid: samples.layers[lid].tokens_seen for lid in ids}, prompts=info.get("prompts"),
        source=info, model=model if model is not None else info.get("model"),
        refinement=refinement_summary(res, init, label, samples), center=centered, int2kv=cfg.int2kv,
        init=(_centered(res.rotation_set("k", label, init=True), means, "k"),
              _centered(res.rotation_set("v", label, init=True), means, "v")),
    )
    result.stats = FitStats(wall_s=time.perf_counter() - t0, peak_rss_bytes=peak_rss_bytes(), workers=res.workers)
    return result


def _centered(rs: RotationSet, means: Mapping[str, Mapping[int, torch.Tensor]], side: str) -> RotationSet:
    """The refined set with its side's mean (``k_mean`` / ``v_mean``) and a ``transform`` saying so."""
    if side not in means:
        return rs
    mean = torch.stack([means[side][lid] for lid in rs.layer_ids]).to(torch.float32)
    what = "key" if side == "k" else "value"
    changes: dict[str, Any] = {f"{side}_mean": mean, "transform": {what: "refined", "centered": True, "orthogonal": True}}
    return replace(rs, **changes)


def refine_dump(
    dump: str | os.PathLike[str] | Dump,
    options: Refinement,
    *,
    group_size: int | None = None,
    keep_first_chunk: bool = False,
    layers: Iterable[int] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    config: RefineConfig | None = None,
    grouping: Grouping = "layer",
    min_tokens: int = DEFAULT_MIN_TOKENS,
    center: Center | None = None,
) -> FitResult:
    """``rotationzoo fit --dump D --refine STEPS [--grouping kv_head] [--center k|kv]``: a reservoir of the dump's
    blocks (:func:`samples_from_dump`), the OSCAR inits fitted from the whole dump, then
    :func:`refine_fit`. ``dump`` may be an opened :class:`~rotationzoo.fit.dump.Dump`
    (``keep_first_chunk`` and ``layers`` are then its own). Every chunk is inspected
    (:meth:`~rotationzoo.fit.dump.Dump.plan`) and ``min_tokens`` checked before any is read.
    ``progress(done, total, what)`` (:mod:`rotationzoo.progress`) reports the three stages: the samples
    read (``"samples: layer <L>"``), the inits' fit, the refinement."""
    d = dump if isinstance(dump, Dump) else open_dump(dump, keep_first_chunk=keep_first_chunk, layers=layers)
    check_tokens(d.plan(kinds_for(("qqt", "sst"))).tokens, check_min_tokens(min_tokens))
    d.info()  # rotationzoo_dump.json checked too, before any chunk is read
    samples = samples_from_dump(d, max_tokens=options.sample_tokens, seed=options.seed, block_size=options.blocks,
                                progress=prefixed(progress, "samples"), grads=options.loss == "fisher")
    dump_info = d.info()
    info = {"kind": "dump", "path": str(d.root), "prompts": dump_info.get("prompts", d.prompt_count()),
            **dump_provenance(dump_info)}
    result = refine_fit(samples, options.init, steps=options.steps, group_size=group_size, seed=options.seed,
                        statistics=d, config=refine_config(options, config), workers=workers, progress=progress,
                        source_info=info, model=dump_info.get("model"), grouping=grouping, min_tokens=min_tokens,
                        center=center, steps_v=options.steps_v)
    result.keep_first_chunk = d.keep_first_chunk
    return result


__all__ = ["refine_config", "refine_dump", "refine_fit", "refinement_summary", "samples_from_dump"]
