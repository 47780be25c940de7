"""The losses learned rotations minimise, their settings and their per-layer training tensors.

Two losses (``RefineConfig.loss``), see :mod:`rotationzoo.fit.refine` for the optimisation:

* ``"served"`` (default): only the (query, key) pairs that are INT2 when served count: the key at
  least ``recent_tokens + 1`` positions older than its query and outside the sink
  (``position ≥ prefix_tokens``), exactly the split of :mod:`rotationzoo.integrations.transformers`'
  simulated attention. ``queries_per_block`` queries of each block that read such keys are drawn
  (seeded); their exact attention weights ``a_ij`` over the block (causal softmax of the captured
  q, k, scale ``d^-½``) weight both losses:

  - **K, attention-weighted score error** ``Σ a_ij (q_i·(k̃_j − k_j))² / Σ a_ij (q_i·k_j)²`` over
    the INT2 pairs (every query head of the KV head's group): the logit error where the softmax
    looks, which is what moves the attention distribution;
  - **V, far attention-output error** ``Σ_i ‖Σ_j a_ij (ṽ_j − v_j)‖² / Σ_i ‖o_i‖²``: the error the
    INT2 values add to each drawn query's output, relative to that output.

  Blocks must be longer than ``prefix_tokens + recent_tokens`` (1,024 tokens by default, see
  :data:`SERVED_BLOCK_SIZE`); a block is attended on its own, so its first keys stand in for a
  long context's older ones.
* ``"fisher"``: the served pairs and drawn queries, each weighted by how much the model's loss moves
  with it (an empirical Fisher weight): ``g_i = ∂NLL/∂o_i``, the gradient of the calibration text's
  negative log-likelihood with respect to query ``i``'s attention output, captured with the
  activations (:meth:`rotationzoo.fit.samples.LayerSamples.add_sequence`'s ``g``). A score error
  ``δs_ij`` moves the loss by ``c_ij δs_ij``, ``c_ij = a_ij·scale·g_i·(v_j − o_i)``, and a value error
  ``δv_j`` by ``a_ij g_i·δv_j``; squared and summed over pairs (the errors of different keys taken as
  uncorrelated):

  - **K** ``Σ c_ij² (q_i·(k̃_j − k_j))² / Σ c_ij² (q_i·k_j)²``;
  - **V** ``Σ a_ij² (g_i·(ṽ_j − v_j))² / Σ a_ij² (g_i·v_j)²``.

  Positions whose attention output the model's prediction does not use (``g_i ≈ 0``) stop counting,
  and so do directions of the value error the next layers ignore.
* ``"block"``: every (query, key) pair of a block, unweighted: K attention-logit error
  ``Σ ‖Q_h (K̃_h − K_h)ᵀ‖² / Σ ‖Q_h K_hᵀ‖²`` and V attention-output error with the block's causal
  attention (the loss of earlier releases; with 1,024-token blocks, K only, Hadamard init and
  ``lr = 2e-3`` it is the ``prototype`` recipe of ``tools/bench_refine.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import torch

from ..dtypes import TORCH_DTYPES
from ..errors import FitError
from ..int2kv import Int2KVConfig
from ..recipe import DEFAULT_QUERIES_PER_BLOCK, SERVED_BLOCK_SIZE, check_trained_store  # noqa: F401 - SERVED_BLOCK_SIZE re-exported
from ..vocab import REFINE_LOSSES, REFINE_PARAMS
from ..kernels.layout import clip_index as _clip_index
from .samples import LayerSamples
from .ste import ste_quantize_int2

#: Loss names recorded per side, per ``RefineConfig.loss``.
LOSS_NAMES_BY_LOSS = {"block": {"k": "k_logit", "v": "v_attn_out"},
                      "served": {"k": "k_served_score", "v": "v_served_out"},
                      "fisher": {"k": "k_fisher_score", "v": "v_fisher_out"}}
#: The names of the ``"block"`` loss (kept for the files earlier releases wrote).
LOSS_NAMES = LOSS_NAMES_BY_LOSS["block"]
#: The losses (``RefineConfig.loss``).
LOSSES: tuple[str, ...] = REFINE_LOSSES
#: What refinement learns: the rotation (``expm``, ``cayley`` parametrisations) or only the init's column signs.
PARAMS: tuple[str, ...] = REFINE_PARAMS


@dataclass
class RefineConfig:
    """Settings of :func:`refine_rotations`.

    Attributes:
        sides: ``("k", "v")`` or one of them.
        steps_k, steps_v: optimizer steps per layer.
        lr: Adam learning rate on the skew parameter (radians-ish per step).
        batch_blocks: training blocks per step (all when fewer).
        rebase_every: re-base ``R0 ← R`` every this many steps (0: never).
        param: ``"expm"`` or ``"cayley"`` (how the rotation is parametrised), or ``"signs"``: only the
            init's column signs are learned (``R0·D``, ``D`` a ±1 diagonal chosen greedily; ``steps`` are
            sweeps over the columns), so that learned signs can be told apart from a learned rotation.
        int2kv: the INT2-KV settings the loss models (:class:`~rotationzoo.int2kv.Int2KVConfig`, the
            one carrier of them): ``group_size`` (``None`` = head_dim), ``k_clip_ratio`` /
            ``v_clip_ratio`` (kernel semantics, 0 disables), ``scale_dtype`` (what scale/zero are
            rounded to), ``hp_dtype`` (what the rotated rows are rounded to before quantizing, as the
            served window holds them) and ``prefix_tokens`` (positions below it stay in the sink: no
            INT2 error). The loss quantizes with uniform levels and exact clip thresholds, so
            ``lloyd_max=True`` and ``clip_search="bisect"`` are refused.
        holdout: share of blocks held out for the keep decision (at least one block).
        per_head: one rotation per KV head (``[H_kv, d, d]`` per layer) instead of per layer.
        seed: seeds the split and the minibatches (with the layer id).
        softmax_scale: attention scale for the attention weights (``None``: ``d^-½``).
        loss: ``"served"`` (the pairs that are INT2 when served, attention-weighted; see the module
            docstring) or ``"block"`` (every pair of a block).
        queries_per_block: queries drawn per block for the served loss (each reads the block's INT2
            keys); the cost of a step is linear in it.
    """

    sides: tuple[str, ...] = ("k", "v")
    steps_k: int = 200
    steps_v: int = 200
    lr: float = 1e-2
    batch_blocks: int = 8
    rebase_every: int = 50
    param: str = "expm"
    int2kv: Int2KVConfig = field(default_factory=Int2KVConfig)
    holdout: float = 0.25
    per_head: bool = False
    seed: int = 0
    softmax_scale: float | None = None
    loss: str = "served"
    queries_per_block: int = DEFAULT_QUERIES_PER_BLOCK

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise FitError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if isinstance(self.queries_per_block, bool) or not isinstance(self.queries_per_block, int) \
                or self.queries_per_block < 1:
            raise FitError(f"queries_per_block must be an integer ≥ 1, got {self.queries_per_block!r}")
        bad = [s for s in self.sides if s not in ("k", "v")]
        if bad or not self.sides:
            raise FitError(f"sides must be a non-empty subset of ('k', 'v'), got {self.sides!r}")
        if self.param not in PARAMS:
            raise FitError(f"param must be one of {', '.join(PARAMS)}, got {self.param!r}")
        if min(self.steps_k, self.steps_v, self.batch_blocks - 1, self.rebase_every) < 0 or not self.lr >= 0:
            raise FitError("steps, rebase_every and lr must be ≥ 0 and batch_blocks ≥ 1")
        if not 0.0 < self.holdout < 1.0:
            raise FitError(f"holdout must be in (0, 1), got {self.holdout}")
        check_trained_store(self.int2kv)

    def loss_name(self, side: str) -> str:
        """The recorded name of ``side``'s loss (``"k_served_score"``, ``"v_attn_out"``, ...)."""
        return LOSS_NAMES_BY_LOSS[self.loss][side]

    @property
    def group_size(self) -> int | None:
        return self.int2kv.group_size

    @property
    def prefix(self) -> int:
        return self.int2kv.prefix_tokens

    def clip_ratio(self, side: str) -> float:
        return self.int2kv.clip_ratio(side)

    @property
    def scale_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.int2kv.scale_dtype]

    @property
    def round_rows(self) -> torch.dtype:
        return TORCH_DTYPES[self.int2kv.hp_dtype]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly settings (``int2kv`` as :meth:`Int2KVConfig.to_json`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sides"] = list(self.sides)
        d["int2kv"] = self.int2kv.to_json()
        return d



# -- per-layer data --------------------------------------------------------------------------------


@dataclass
class LayerData:
    """fp32 training tensors of one layer, blocks first: rows ``x [B, H, n, d]``, ``mask [B, 1, n, 1]``,
    ``den [B, H]`` and the ``metric``: the ``"block"`` loss's query Gram ``[B, H, d, d]`` (K) or
    ``W = Σ AᵀA`` ``[B, H, n, n]`` (V); the ``"served"`` loss's far attention weights
    ``[B, H, g·m, n]`` of the ``m`` drawn queries (per KV head, its ``g`` query heads), with those
    queries ``[B, H, g·m, d]`` in ``queries`` (K)."""

    x: torch.Tensor
    metric: torch.Tensor
    mask: torch.Tensor
    den: torch.Tensor
    side: str
    loss: str = "block"
    queries: torch.Tensor | None = None


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """``[b, n, H, d]`` (any float dtype) → fp32 ``[b, H, n, d]``."""
    return t.to(torch.float32).permute(0, 2, 1, 3).contiguous()


def _query_grams(q: torch.Tensor, hkv: int, chunk: int = 8) -> torch.Tensor:
    """``M = Σ_h Q_hᵀ Q_h`` over each KV head's query group: ``q [B, n, Hq, d]`` → ``[B, Hkv, d, d]``
    (converted to fp32 a few blocks at a time, so that the queries are never held in fp32 whole)."""
    b, n, hq, d = q.shape
    out = torch.empty(b, hkv, d, d, dtype=torch.float32)
    for s in range(0, b, chunk):
        qg = _heads_first(q[s:s + chunk]).reshape(-1, hkv, (hq // hkv) * n, d)
        out[s:s + chunk] = qg.transpose(-1, -2) @ qg
    return out


def _block_attention_weights(q: torch.Tensor, k: torch.Tensor, scale: float, chunk: int = 2) -> torch.Tensor:
    """``W = Σ_j A_jᵀ A_j`` per KV head: ``q [B, n, Hq, d]``, ``k [B, n, Hkv, d]`` → ``[B, Hkv, n, n]``."""
    b, n, hq, _ = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.empty(b, hkv, n, n, dtype=torch.float32)
    for s in range(0, b, chunk):
        qs, ks = _heads_first(q[s:s + chunk]), _heads_first(k[s:s + chunk]).repeat_interleave(g, dim=1)
        scores = (qs @ ks.transpose(-1, -2)) * scale
        a = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        a = a.reshape(a.shape[0], hkv, g, n, n)
        out[s:s + chunk] = torch.einsum("bhgij,bhgik->bhjk", a, a)
    return out


def _drawn_queries(pos: torch.Tensor, n: int, cfg: RefineConfig, layer_id: int) -> torch.Tensor:
    """``[B, m]`` in-block positions of the queries the served loss draws: each reads at least one
    INT2 key of its block (``i − recent − 1 ≥ max(0, prefix − block start)``), seeded by layer."""
    recent, prefix = cfg.int2kv.recent_tokens, cfg.prefix
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + layer_id + 7919)
    out = []
    for p in pos.tolist():
        first = recent + 1 + max(0, prefix - int(p))  # the first query with an INT2 key in this block
        count = n - first
        if count < 1:
            raise FitError(f"layer {layer_id}: a {n}-token calibration block starting at position {p} holds no "
                           f"(query, key) pair that is INT2 when served (sink {prefix} + recent {recent} tokens); "
                           f"use blocks of ≥ {SERVED_BLOCK_SIZE} tokens or loss='block'")
        m = min(cfg.queries_per_block, count)
        out.append(first + torch.randperm(count, generator=gen)[:m].sort().values)
    m = min(len(t) for t in out)
    return torch.stack([t[:m] if len(t) == m else t[torch.linspace(0, len(t) - 1, m).long()] for t in out])


def _drawn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cfg: RefineConfig,
                     scale: float, layer_id: int
                     ) -> tuple[torch.Tensor, Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The queries the served losses draw (:func:`_drawn_queries`: ``sel [B, m]`` in-block positions) and, block
    after block, those queries ``[Hq, m, d]``, the values ``[Hq, n, d]`` (each KV head repeated for its query
    heads), the exact causal attention weights ``[Hq, m, n]`` and the mask of the pairs that are INT2 when
    served ``[m, n]``."""
    hkv = k.shape[2]
    g = q.shape[2] // hkv
    n = q.shape[1]
    sel = _drawn_queries(pos, n, cfg, layer_id)
    cols = torch.arange(n)

    def blocks() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        for i in range(q.shape[0]):
            qi = q[i, sel[i]].to(torch.float32).permute(1, 0, 2)  # [Hq, m, d]
            ki = k[i].to(torch.float32).permute(1, 0, 2).repeat_interleave(g, dim=0)  # [Hq, n, d]
            vi = v[i].to(torch.float32).permute(1, 0, 2).repeat_interleave(g, dim=0)
            rows = sel[i][:, None]
            scores = (qi @ ki.transpose(-1, -2)) * scale
            a = torch.softmax(scores.masked_fill(cols[None, :] > rows, float("-inf")), dim=-1)  # [Hq, m, n]
            far = (cols[None, :] < rows - cfg.int2kv.recent_tokens) & (cols[None, :] + int(pos[i]) >= cfg.prefix)
            yield qi, vi, a, far

    return sel, blocks()


def _served_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, cfg: RefineConfig,
                    scale: float, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Far attention weights ``[B, Hkv, g·m, n]``, the drawn queries ``[B, Hkv, g·m, d]`` and each
    drawn query's squared output norm summed per KV head ``[B, Hkv]``, one block at a time."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    sel, blocks = _drawn_attention(q, k, v, pos, cfg, scale, layer_id)
    m = sel.shape[1]
    weights = torch.empty(b, hkv, g * m, n, dtype=torch.float32)
    queries = torch.empty(b, hkv, g * m, d, dtype=torch.float32)
    out_energy = torch.empty(b, hkv, dtype=torch.float64)
    for i, (qi, vi, a, far) in enumerate(blocks):
        out_energy[i] = (a @ vi).square().sum(dim=(-1, -2)).reshape(hkv, g).sum(-1).to(torch.float64)
        weights[i] = (a * far).reshape(hkv, g * m, n)
        queries[i] = qi.reshape(hkv, g * m, d)
    return weights, queries, out_energy


def _fisher_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, pos: torch.Tensor,
                    cfg: RefineConfig, scale: float, layer_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"fisher"`` loss's pair weights ``[B, Hkv, g·m, n]`` and the vectors the error is read along
    ``[B, Hkv, g·m, d]`` (the drawn queries for K, their output gradients ``g_i`` for V), one block at a time."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    grp = hq // hkv
    sel, blocks = _drawn_attention(q, k, v, pos, cfg, scale, layer_id)
    m = sel.shape[1]
    weights = torch.empty(b, hkv, grp * m, n, dtype=torch.float32)
    along = torch.empty(b, hkv, grp * m, d, dtype=torch.float32)
    for i, (qi, vi, a, far) in enumerate(blocks):
        gi = g[i, sel[i]].to(torch.float32).permute(1, 0, 2)  # [Hq, m, d]
        if side == "k":  # c_ij = a_ij·scale·g_i·(v_j − o_i)
            c = a * scale * (gi @ vi.transpose(-1, -2) - (gi * (a @ vi)).sum(-1, keepdim=True))
            weights[i] = (c * far).square().reshape(hkv, grp * m, n)
            along[i] = qi.reshape(hkv, grp * m, d)
        else:
            weights[i] = (a * far).square().reshape(hkv, grp * m, n)
            along[i] = gi.reshape(hkv, grp * m, d)
    return weights, along


def layer_data(samples: LayerSamples, side: str, cfg: RefineConfig, mean: torch.Tensor | None = None) -> LayerData:
    """The fp32 training tensors of one layer and side (queries are reduced to what the loss needs:
    their Gram per KV group for K, the block's attention weights for V). ``mean`` (``[H_kv, d]`` or
    ``[d]``) centers the rows learned on, as a centered file stores them (``k − μ_K``, ``v − μ_V``);
    the attention weights do not change (a key mean shifts every score of a query alike)."""
    q, k, v, pos = samples.blocks()
    shape = samples.shape
    assert shape is not None
    n = samples.block_size
    mask = ((pos[:, None] + torch.arange(n)[None, :]) >= cfg.prefix).to(torch.float32)[:, None, :, None]
    centered = (lambda x: x) if mean is None else (lambda x: x - mean.to(torch.float32).expand(
        shape.num_kv_heads, shape.head_dim)[None, :, None, :])
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else shape.head_dim ** -0.5
    if cfg.loss in ("served", "fisher"):
        x = centered(_heads_first(k if side == "k" else v))
        if cfg.loss == "served":
            weights, along, out_energy = _served_tensors(q, k, v, pos, cfg, scale, samples.layer_id)
            if side == "v":  # the drawn queries' output errors, relative to their outputs
                return LayerData(x=x, metric=weights, mask=mask, den=out_energy, side=side, loss="served")
        else:
            g = samples.grads()
            if g is None:
                raise FitError(f"layer {samples.layer_id}: loss 'fisher' needs the output gradients of the calibration "
                               f"blocks (a dump with g/ chunks, written by calibrate --grads); use loss 'served' "
                               f"without them")
            weights, along = _fisher_tensors(q, k, v, g, pos, cfg, scale, samples.layer_id, side)
        # the errors read along each drawn query (K) or its output gradient (fisher V), weighted per pair
        den = (weights * (along @ x.transpose(-1, -2)).square()).sum(dim=(-1, -2)).to(torch.float64)
        return LayerData(x=x, metric=weights, mask=mask, den=den, side=side, loss=cfg.loss, queries=along)
    if side == "k":
        metric = _query_grams(q, shape.num_kv_heads)  # [B, Hkv, d, d]
        x = centered(_heads_first(k))
        den = ((x @ metric) * x).sum(dim=(-1, -2))
    else:
        metric = _block_attention_weights(q, k, scale)  # [B, Hkv, n, n]
        x = centered(_heads_first(v))
        den = ((metric @ x) * x).sum(dim=(-1, -2))
    return LayerData(x=x, metric=metric, mask=mask, den=den.to(torch.float64), side=side)


def rotated_errors(r: torch.Tensor, data: LayerData, idx: torch.Tensor, cfg: RefineConfig) -> torch.Tensor:
    """The INT2 store's error ``[b, H, n, d]`` of blocks ``idx`` in the rotated basis (straight-through rounding),
    zero on the rows the sink keeps: what every loss measures."""
    x = data.x[idx] @ r  # [b, H, n, d]
    d = x.shape[-1]
    gs = cfg.group_size or d
    ci = _clip_index(cfg.clip_ratio(data.side), d)
    xq = ste_quantize_int2(x.reshape(-1, d), clip_index=ci, group_size=gs, scale_dtype=cfg.scale_dtype,
                            round_rows=cfg.round_rows).reshape(x.shape)
    return (xq - x) * data.mask[idx]


def numerators(r: torch.Tensor, data: LayerData, idx: torch.Tensor, cfg: RefineConfig) -> torch.Tensor:
    """Per-head loss numerators ``[H]`` (fp64) of blocks ``idx`` under rotations ``r [P, d, d]`` fp32."""
    e = rotated_errors(r, data, idx, cfg)
    metric = data.metric[idx]
    if data.loss == "fisher" or (data.loss == "served" and data.side == "k"):
        assert data.queries is not None
        s = (data.queries[idx] @ r) @ e.transpose(-1, -2)  # [b, H, g·m, n]: score errors (K), or value errors along g_i
        return (metric * s.square()).sum(dim=(-1, -2)).sum(dim=0).to(torch.float64)
    if data.loss == "served":  # V: the drawn queries' output errors
        return (metric @ e).square().sum(dim=(-1, -2)).sum(dim=0).to(torch.float64)
    if data.side == "k":
        mr = r.transpose(-1, -2) @ metric @ r
        num = ((e @ mr) * e).sum(dim=(-1, -2))
    else:
        num = ((metric @ e) * e).sum(dim=(-1, -2))
    return num.sum(dim=0).to(torch.float64)


def heldout_loss(r: torch.Tensor, data: LayerData, idx: torch.Tensor, cfg: RefineConfig, chunk: int = 16) -> torch.Tensor:
    """Per-head relative loss ``[H]`` over blocks ``idx`` (no gradient)."""
    with torch.no_grad():
        rf = r.to(torch.float32)
        num = sum(numerators(rf, data, idx[s:s + chunk], cfg) for s in range(0, len(idx), chunk))
        return num / data.den[idx].sum(dim=0).clamp_min(1e-30)



def total_loss(per_head: torch.Tensor, data: LayerData, idx: torch.Tensor) -> float:
    """Relative loss over all heads from per-head relative losses (weighted by their energy)."""
    den = data.den[idx].sum(dim=0)
    return float((per_head * den).sum() / den.sum().clamp_min(1e-30))



__all__ = ["LOSSES", "LOSS_NAMES", "LOSS_NAMES_BY_LOSS", "SERVED_BLOCK_SIZE", "RefineConfig"]
