"""Learn per-layer rotations against the error an INT2 KV store actually makes.

Starting from an init rotation (the data-free Hadamard ``H_d``, an OSCAR ``U·H·P_br`` or
``U·P_br·H_G`` matrix, per layer or per KV head, or any given one), each layer's ``R`` is optimized
on the orthogonal group to minimise, on calibration blocks (:mod:`rotationzoo.fit.samples`), one of
the losses of :mod:`rotationzoo.fit.refine_loss` (``RefineConfig.loss``):

* ``"served"`` (default): only the (query, key) pairs that are INT2 when served (key older than the
  recent window from its query, outside the sink), K as the attention-weighted score error and V as
  the error those far values add to the drawn queries' attention outputs;
* ``"fisher"``: the served pairs weighted by their squared effect on the model's next-token loss, from the
  output gradients captured with the calibration (measured worse than ``"served"``; see the module of the losses);
* ``"block"``: every pair of a block: **K, attention-logit error**
  ``Σ ‖Q_h (K̃_h − K_h)ᵀ‖² / Σ ‖Q_h K_hᵀ‖²`` (per block and head ``tr(E M Eᵀ)`` with the query Gram
  ``M = Q_hᵀQ_h``), and **V, attention-output error** ``Σ ‖A (Ṽ_h − V_h)‖² / Σ ‖A V_h‖²`` with the
  exact causal softmax weights ``A`` of the block (``tr(Eᵀ W E)``, ``W = Σ_j A_jᵀ A_j``).

The output projection is left out of the served and block losses (the error is measured in the head's value
space); the fisher loss sees it through the gradients.

``K̃ = dequant(quant(bf16(K·R)))·Rᵀ`` with the kernels' quantizer (:func:`~rotationzoo.fit.ste.ste_quantize_int2`,
a straight-through version of :func:`rotationzoo.kernels.fake_quantize_int2`).
Rows whose position in their sequence is below ``prefix`` stay in the BF16 sink when served and
add no error. Both losses are measured in the rotated basis (``‖A E Rᵀ‖ = ‖A E‖``; for K the Gram
is rotated, ``Rᵀ M R``), against the exact fp32 ``K·R``: the BF16 rounding of the served rows is
part of the error.

Parametrization: ``R = R0 · expm(S)``, ``S = A − Aᵀ`` (skew, so ``R`` is exactly orthogonal for
any ``A``, no projection or retraction error), Adam on ``A`` in fp64, re-based ``R0 ← R``,
``A ← 0`` every ``rebase_every`` steps so that ``S`` stays small; ``param="cayley"`` uses
``(I − S/2)⁻¹(I + S/2)`` instead (compare with ``tools/bench_refine.py --param cayley``). Every step uses a random minibatch of training blocks.
Rounding inside the loss is a straight-through estimator: forward values are exactly those of
:func:`rotationzoo.kernels.quantize_int2` + :func:`~rotationzoo.kernels.dequantize_int2`;
backward treats each element's rounding offset in code units as a constant, so the error of an
element is ``scale · u`` and its gradient flows through the group's scale (min/max) and the row's
clip threshold, which is what a rotation can change. (An identity straight-through estimator,
``x̂ ≈ x``, would give the error no gradient at all; the exact almost-everywhere gradient only
pulls each element towards its current grid point.)

A held-out share of the blocks decides: a layer (a head with ``per_head``) keeps the refined
rotation only when its held-out loss is lower than the init's, so refinement never makes a layer
worse on held-out data (whether the model is better off is judged on held-out text by
:func:`rotationzoo.evaluate.keep.keep_by_text`). Results are re-orthogonalised in fp64 (polar factor). The split and the
minibatches are seeded from ``(seed, layer)``, and :func:`refine_rotations` runs every (layer,
side) single-threaded, so a seed gives bit-identical rotations whatever the number of workers.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from ..errors import FitError
from ..files.format import RotationSet
from ..hadamard import hadamard_matrix
from ..progress import Progress, Tally
from ..recipe import check_workers
from .accumulate import LayerAccumulator
from .compose import rotation_from_covariance
from .refine_loss import LayerData, RefineConfig, heldout_loss, layer_data, numerators, total_loss
from .samples import CalibrationSamples, LayerSamples
from .ste import ste_quantize_int2

#: Init rotations computed from the samples themselves (besides a given matrix).
INITS: tuple[str, ...] = ("hadamard", "r_h_pbr", "r_pbr_hg")


# -- optimisation ---------------------------------------------------------------------------------


def _retract(base: torch.Tensor, a: torch.Tensor, param: str) -> torch.Tensor:
    s = a - a.transpose(-1, -2)
    if param == "expm":
        return base @ torch.linalg.matrix_exp(s)
    eye = torch.eye(s.shape[-1], dtype=s.dtype).expand_as(s)
    return base @ torch.linalg.solve(eye - s / 2, eye + s / 2)


def polar(r: torch.Tensor) -> torch.Tensor:
    """The nearest orthogonal matrix (polar factor ``U Vᵀ`` of the SVD), in fp64."""
    u, _, vh = torch.linalg.svd(r.to(torch.float64))
    return u @ vh


def _optimize_signs(r0: torch.Tensor, data: LayerData, train: torch.Tensor, passes: int, cfg: RefineConfig,
                    on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, list[float]]:
    """Column signs only (``param="signs"``): ``R = R0·D`` with ``D`` a ±1 diagonal, chosen greedily on every
    training block: ``passes`` sweeps over the columns, each column flipped where that lowers the loss (per
    head with per-head rotations, else for the layer). ``R0·D`` is exactly as orthogonal as ``R0``; only
    the INT2 store's rounding, which is not symmetric under a sign flip, sees the difference."""
    r = r0.clone()
    den = data.den[train].sum(0).clamp_min(1e-30)

    def losses(rr: torch.Tensor) -> torch.Tensor:  # per head (per-head rotations) or of the layer
        with torch.no_grad():
            per_head = numerators(rr.to(torch.float32), data, train, cfg)  # [H]
        return per_head / den if cfg.per_head else per_head.sum() / den.sum()

    current = losses(r)
    trace = [float(current.sum())]
    for sweep in range(1, passes + 1):
        for j in range(r.shape[-1]):
            flipped = r.clone()
            flipped[..., :, j].neg_()
            trial = losses(flipped)
            better = trial < current
            if cfg.per_head:
                r = torch.where(better[:, None, None], flipped, r)
                current = torch.where(better, trial, current)
            elif bool(better):
                r, current = flipped, trial
        trace.append(float(current.sum()))
        if on_step is not None:
            on_step(sweep)
    return r, trace


def _optimize(r0: torch.Tensor, data: LayerData, train: torch.Tensor, steps: int, cfg: RefineConfig,
              gen: torch.Generator, on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, list[float]]:
    """Adam (β = 0.9, 0.999, ε = 1e-8) on the skew parameter; returns the fp64 rotation ``[P, d, d]``
    and the minibatch loss trace. Adam is spelled out here (a few lines) rather than taken from
    ``torch.optim``, whose import costs seconds. ``param="signs"``: :func:`_optimize_signs`."""
    if cfg.param == "signs":
        return _optimize_signs(r0, data, train, steps, cfg, on_step)
    base = r0.clone()
    a = torch.zeros_like(base, requires_grad=True)
    m, v = torch.zeros_like(base), torch.zeros_like(base)
    b1, b2, eps = 0.9, 0.999, 1e-8
    trace: list[float] = []
    for step in range(1, steps + 1):
        if len(train) > cfg.batch_blocks:
            idx = train[torch.randperm(len(train), generator=gen)[:cfg.batch_blocks]].sort().values
        else:
            idx = train
        r = _retract(base, a, cfg.param)
        loss = numerators(r.to(torch.float32), data, idx, cfg).sum() / data.den[idx].sum().clamp_min(1e-30)
        (grad,) = torch.autograd.grad(loss, a)
        with torch.no_grad():
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            a -= cfg.lr * (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)
            if cfg.rebase_every and step % cfg.rebase_every == 0:
                base = _retract(base, a, cfg.param)
                a.zero_()
        trace.append(float(loss.detach()))
        if on_step is not None:
            on_step(step)
    with torch.no_grad():
        return polar(_retract(base, a, cfg.param)), trace


# -- one layer ------------------------------------------------------------------------------------


@dataclass
class LayerRefinement:
    """Outcome for one (layer, side).

    Attributes:
        layer_id: model layer.
        side: ``"k"`` or ``"v"``.
        rotation: fp64 ``[d, d]`` (or ``[H_kv, d, d]`` with ``per_head``), the kept rotation.
        record: init, loss, steps, seed, held-out loss before/after, kept, wall time...
        init: the init rotation, same shape (what a keep rule judged on text falls back to).
    """

    layer_id: int
    side: str
    rotation: torch.Tensor
    record: dict[str, Any] = field(default_factory=dict)
    init: torch.Tensor | None = None


def _split(num_blocks: int, cfg: RefineConfig, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if num_blocks < 2:
        raise FitError(f"layer {layer_id}: {num_blocks} calibration block(s); refinement needs ≥ 2 (train + held-out)"
                       f" — give more calibration tokens or a smaller block_size")
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer_id)
    perm = torch.randperm(num_blocks, generator=gen)
    n_hold = min(num_blocks - 1, max(1, round(cfg.holdout * num_blocks)))
    return perm[n_hold:].sort().values, perm[:n_hold].sort().values


def refine_layer(
    samples: LayerSamples, side: str, init: torch.Tensor, cfg: RefineConfig, *, init_name: str = "given",
    progress: Progress | None = None, mean: torch.Tensor | None = None,
) -> LayerRefinement:
    """Refine one layer's K or V rotation from ``init`` (``[d, d]``, or ``[H_kv, d, d]``), on rows
    centered by ``mean`` when given (``[H_kv, d]`` or ``[d]``: what a centered file stores).

    ``progress(done, total, what)`` (:mod:`rotationzoo.progress`) counts the optimizer steps and
    one more unit for the held-out comparison (``what``: ``"layer <L> K"``).

    Returns:
        A :class:`LayerRefinement`; its rotation is the refined one where it lowers the held-out
        loss (per head with ``cfg.per_head``), else the init.
    """
    t0 = time.perf_counter()
    shape = samples.shape
    if shape is None:
        raise FitError(f"layer {samples.layer_id}: no calibration samples")
    hkv, d = shape.num_kv_heads, shape.head_dim
    r_init = _check_init(init, d, hkv, samples.layer_id, side)
    if cfg.per_head and r_init.shape[0] == 1:
        r_init = r_init.expand(hkv, d, d).clone()
    elif not cfg.per_head and r_init.shape[0] != 1:
        raise FitError(f"layer {samples.layer_id} {side}: a per-head init [{hkv}, {d}, {d}] needs per_head=True")
    data = layer_data(samples, side, cfg, mean)
    train, hold = _split(data.x.shape[0], cfg, samples.layer_id)
    steps = cfg.steps_k if side == "k" else cfg.steps_v
    what = f"layer {samples.layer_id} {side.upper()}"
    on_step = (lambda step: progress(step, steps + 1, what)) if progress is not None else None
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + samples.layer_id * 2 + (side == "v"))
    refined, trace = _optimize(r_init, data, train, steps, cfg, gen, on_step) if steps else (r_init.clone(), [])
    before = heldout_loss(r_init, data, hold, cfg)
    after = heldout_loss(refined, data, hold, cfg)
    kept: str | list[str]
    if cfg.per_head:
        keep = after < before
        rotation = torch.where(keep[:, None, None], refined, r_init)
        kept = ["refined" if b else "init" for b in keep.tolist()]
    b_tot, a_tot = total_loss(before, data, hold), total_loss(after, data, hold)
    if not cfg.per_head:
        keep_layer = a_tot < b_tot
        rotation = (refined if keep_layer else r_init)[0]
        kept = "refined" if keep_layer else "init"
    final_heads = heldout_loss(rotation if cfg.per_head else rotation[None], data, hold, cfg)
    final = total_loss(final_heads, data, hold)
    record = {
        "layer_id": samples.layer_id, "side": side, "init": init_name, "loss": cfg.loss_name(side),
        "per_head": cfg.per_head, "steps": steps, "lr": cfg.lr, "param": cfg.param, "seed": cfg.seed,
        "batch_blocks": cfg.batch_blocks, "train_blocks": len(train), "heldout_blocks": len(hold),
        "block_size": samples.block_size, "heldout_init": b_tot, "heldout_refined": a_tot, "heldout_final": final,
        "heldout_init_per_head": before.tolist(), "heldout_refined_per_head": after.tolist(),
        "heldout_final_per_head": final_heads.tolist(), "kept": kept,
        "train_loss_first": trace[0] if trace else None, "train_loss_last": trace[-1] if trace else None,
        "wall_s": time.perf_counter() - t0,
    }
    if progress is not None:
        progress(steps + 1, steps + 1, what)
    return LayerRefinement(samples.layer_id, side, rotation, record, r_init if cfg.per_head else r_init[0])



def _check_init(init: torch.Tensor, d: int, hkv: int, layer_id: int, side: str) -> torch.Tensor:
    r = torch.as_tensor(init).to(torch.float64)
    if r.dim() == 2:
        r = r[None]
    if r.dim() != 3 or r.shape[-2:] != (d, d) or r.shape[0] not in (1, hkv):
        raise FitError(f"layer {layer_id} {side}: init rotation must be [{d}, {d}] or [{hkv}, {d}, {d}], got {list(r.shape)}")
    err = float((r @ r.transpose(-1, -2) - torch.eye(d, dtype=torch.float64)).abs().max())
    if not err <= 1e-4:
        raise FitError(f"layer {layer_id} {side}: init rotation is not orthogonal (max|RRᵀ−I| = {err:.2e}); pass a rotation")
    return r if err <= 1e-12 else polar(r)


# -- inits ----------------------------------------------------------------------------------------


def init_rotation(samples: LayerSamples, side: str, init: str, *, group_size: int | None = None,
                  per_head: bool = False, mean: torch.Tensor | None = None) -> torch.Tensor:
    """An init computed for one layer: ``"hadamard"`` (``H_d``), or ``"r_h_pbr"`` / ``"r_pbr_hg"``
    fitted (qqt for K, sst for V) from the samples' own q/k/v with :mod:`rotationzoo.fit`; with
    ``per_head`` these are fitted per KV head (``[H_kv, d, d]``; ``H_d`` stays ``[d, d]``, the
    same for every head). ``mean`` (V only) fits the V init on the centered values."""
    shape = samples.shape
    if shape is None:
        raise FitError(f"layer {samples.layer_id}: no calibration samples")
    d = shape.head_dim
    if init == "hadamard":
        return hadamard_matrix(d, dtype=torch.float64)
    if init not in INITS:
        raise FitError(f"unknown init {init!r}; expected one of {', '.join(INITS)} or a rotation tensor")
    target = "qqt" if side == "k" else "sst"
    acc = LayerAccumulator(samples.layer_id, num_q_heads=shape.num_q_heads, num_kv_heads=shape.num_kv_heads,
                           head_dim=d, targets=(target,))
    q, k, v, _ = samples.blocks()
    for i in range(q.shape[0]):
        acc.add_q(q[i])
    acc.start_second_pass()
    if target == "sst":
        for i in range(k.shape[0]):
            acc.add_kv(k[i], v[i])
    g = group_size if init == "r_pbr_hg" else None
    if per_head:
        cov = acc.covariance(target, per_head=True, mean=mean if target == "sst" else None)
        cov = (cov + cov.transpose(-1, -2)) / 2
        return torch.stack([rotation_from_covariance(c, init, group_size=g, what=f"layer {samples.layer_id} KV head "
                                                     f"{h} {target}")[0] for h, c in enumerate(cov)])
    cov = acc.covariance(target, mean=mean if target == "sst" else None)
    r, _ = rotation_from_covariance((cov + cov.T) / 2, init, group_size=g, what=f"layer {samples.layer_id} {target}")
    return r


# -- all layers -----------------------------------------------------------------------------------


@dataclass
class RefineResult:
    """Refined rotations of every layer.

    Attributes:
        layer_ids: refined layers, ascending.
        head_dim, num_kv_heads: the layout.
        rotations: ``{"k": {layer: fp64 [d, d] or [H_kv, d, d]}, "v": {...}}`` (sides refined only).
        records: one dict per (layer, side), see :func:`refine_layer`.
        config: the settings.
        wall_s: total seconds.
        workers: jobs run concurrently.
        inits: the init rotations, as ``rotations``.
    """

    layer_ids: tuple[int, ...]
    head_dim: int
    num_kv_heads: int
    rotations: dict[str, dict[int, torch.Tensor]]
    records: list[dict[str, Any]]
    config: RefineConfig
    wall_s: float = 0.0
    workers: int = 1
    inits: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    def stacked(self, side: str, *, init: bool = False) -> torch.Tensor:
        """fp32 ``[L, d, d]`` (``[L, H_kv, d, d]`` per head) of one side (its inits with ``init``)."""
        src = self.inits if init else self.rotations
        if side not in src:
            raise FitError(f"side {side!r} was not refined (sides: {', '.join(self.rotations)})")
        return torch.stack([src[side][i] for i in self.layer_ids]).to(torch.float32).contiguous()

    def rotation_set(self, side: str, objective: str | None = None, *, init: bool = False) -> RotationSet:
        """A :class:`~rotationzoo.files.format.RotationSet`: one matrix per layer, or ``[L, H_kv, d, d]``
        with ``source_grouping = "kv_head"`` when refined per head (the inits with ``init``)."""
        start = self.records[0]["init"] if self.records else "given"
        return RotationSet(rotations=self.stacked(side, init=init), layer_ids=self.layer_ids,
                           objective=objective or (start if init else f"refined_{self.config.loss_name(side)}_from_{start}"),
                           source_grouping="kv_head" if self.config.per_head else "layer")

    def summary(self) -> dict[str, Any]:
        """JSON-friendly records and settings (for a manifest)."""
        return {"config": self.config.to_dict(), "layer_ids": list(self.layer_ids), "wall_s": self.wall_s,
                "records": self.records}


def refine_rotations(
    samples: CalibrationSamples,
    init: Any = "hadamard",
    config: RefineConfig | None = None,
    *,
    layers: Any = None,
    workers: int | None = None,
    progress: Progress | None = None,
    means: Mapping[str, Mapping[int, torch.Tensor]] | None = None,
) -> RefineResult:
    """Refine every layer's K and/or V rotation.

    Args:
        samples: calibration blocks per layer.
        init: ``"hadamard"``, ``"r_h_pbr"``, ``"r_pbr_hg"`` (computed from the samples; group size
            from ``config``), an object with ``.k``/``.v`` rotation sets (a
            :class:`~rotationzoo.fit.FitResult`, a loaded pair), or ``{"k": rotations, "v": rotations}``
            where ``rotations`` is a ``RotationSet``, an ``[L, d, d]`` tensor in ``layers`` order or a
            ``{layer_id: [d, d]}`` mapping.
        config: settings (defaults of :class:`RefineConfig`).
        layers: only these layer ids (default: every layer with samples).
        workers: (layer, side) jobs run concurrently, each single-threaded (intra-op threads
            are set to 1 while refining, so the result does not depend on this number).
            Default: ``torch.get_num_threads()``.
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): optimizer steps
            (and one held-out comparison) of every (layer, side), from the worker threads
            (``what``: ``"layer <L> K"``).
        means: ``{"k": {layer: [H_kv, d] or [d]}, "v": ...}``: learn on centered rows (key / value
            centering), the side's rows minus its mean; a side absent here is not centered.

    Returns:
        A :class:`RefineResult`.
    """
    cfg = config or RefineConfig()
    t0 = time.perf_counter()
    asked = check_workers(workers, "workers")  # 0 or a negative count is refused, never taken as auto
    ids = tuple(sorted(int(i) for i in layers)) if layers is not None else samples.layer_ids()
    if not ids:
        raise FitError("no calibration samples to refine on")
    missing = [i for i in ids if i not in samples.layers or not samples.layers[i].num_blocks]
    if missing:
        raise FitError(f"no calibration blocks for layer(s) {missing}")
    first = samples.layers[ids[0]].shape
    assert first is not None
    jobs = [(lid, side) for lid in ids for side in cfg.sides]
    tally = Tally(progress, sum((cfg.steps_k if side == "k" else cfg.steps_v) + 1 for _, side in jobs), "refining")
    tally.start()

    def run(job: tuple[int, str]) -> LayerRefinement:
        lid, side = job
        mean = (means or {}).get(side, {}).get(lid)
        r0, name = _resolve_init(init, samples.layers[lid], side, lid, ids, cfg, mean)
        return refine_layer(samples.layers[lid], side, r0, cfg, init_name=name, mean=mean,
                            progress=(lambda done, total, what: tally.set(job, done, what)) if progress else None)

    workers = max(1, min(asked or torch.get_num_threads(), len(jobs)))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread per job: faster for these small ops, and worker-count independent
    try:
        if workers == 1:
            done = [run(j) for j in jobs]
        else:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rotationzoo-refine") as pool:
                done = list(pool.map(run, jobs))
    finally:
        torch.set_num_threads(threads_before)
    out: dict[str, dict[int, torch.Tensor]] = {s: {} for s in cfg.sides}
    inits: dict[str, dict[int, torch.Tensor]] = {s: {} for s in cfg.sides}
    for res in done:
        out[res.side][res.layer_id] = res.rotation
        inits[res.side][res.layer_id] = res.init if res.init is not None else res.rotation
    return RefineResult(layer_ids=ids, head_dim=first.head_dim, num_kv_heads=first.num_kv_heads, rotations=out,
                        records=[res.record for res in done], config=cfg, wall_s=time.perf_counter() - t0,
                        workers=workers, inits=inits)


def _resolve_init(init: Any, samples: LayerSamples, side: str, lid: int, ids: tuple[int, ...],
                  cfg: RefineConfig, mean: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
    if isinstance(init, str):
        return init_rotation(samples, side, init, group_size=cfg.group_size, per_head=cfg.per_head,
                             mean=mean if side == "v" else None), init
    src = init.get(side) if isinstance(init, Mapping) else getattr(init, side, None)
    if src is None:
        raise FitError(f"init has no {side.upper()} rotations; give {{'k': ..., 'v': ...}} or a name of {INITS}")
    if isinstance(src, RotationSet):
        if lid not in src.layer_ids:
            raise FitError(f"init {side.upper()} rotations lack layer {lid}")
        return src.rotations[src.layer_ids.index(lid)], src.objective
    if isinstance(src, Mapping):
        if lid not in src:
            raise FitError(f"init {side.upper()} rotations lack layer {lid}")
        return torch.as_tensor(src[lid]), "given"
    t = torch.as_tensor(src)
    if t.shape[0] != len(ids):
        raise FitError(f"init {side.upper()} tensor holds {t.shape[0]} rotations for {len(ids)} layers")
    return t[ids.index(lid)], "given"


def relative_improvement(records: list[dict[str, Any]]) -> float:
    """Mean over records of ``1 − final/init`` held-out loss (0 when nothing improved)."""
    vals = [1.0 - r["heldout_final"] / r["heldout_init"] for r in records if r["heldout_init"] > 0]
    return float(sum(vals) / len(vals)) if vals else 0.0


__all__ = [
    "INITS",
    "LayerRefinement",
    "RefineConfig",
    "RefineResult",
    "ste_quantize_int2",
    "init_rotation",
    "polar",
    "refine_layer",
    "refine_rotations",
    "relative_improvement",
]
