"""The losses learned rotations minimise: K attention-logit error and V attention-output error.

See :mod:`rotationzoo.fit.refine` for the objective; this module holds the settings
(:class:`RefineConfig`), the per-layer training tensors built from calibration blocks and the
(held-out) loss of a rotation on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..errors import FitError
from ..int2kv import Int2KVConfig
from ..kernels.layout import clip_index as _clip_index
from .samples import LayerSamples
from .ste import fake_quantize_int2

#: Loss names recorded per side.
LOSS_NAMES = {"k": "k_logit", "v": "v_attn_out"}


@dataclass
class RefineConfig:
    """Settings of :func:`refine_rotations`.

    Attributes:
        sides: ``("k", "v")`` or one of them.
        steps_k, steps_v: optimizer steps per layer.
        lr: Adam learning rate on the skew parameter (radians-ish per step).
        batch_blocks: training blocks per step (all when fewer).
        rebase_every: re-base ``R0 ← R`` every this many steps (0: never).
        param: ``"expm"`` or ``"cayley"``.
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
        softmax_scale: attention scale for the V weights (``None``: ``d^-½``).
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

    def __post_init__(self) -> None:
        bad = [s for s in self.sides if s not in ("k", "v")]
        if bad or not self.sides:
            raise FitError(f"sides must be a non-empty subset of ('k', 'v'), got {self.sides!r}")
        if self.param not in ("expm", "cayley"):
            raise FitError(f"param must be 'expm' or 'cayley', got {self.param!r}")
        if min(self.steps_k, self.steps_v, self.batch_blocks - 1, self.rebase_every) < 0 or not self.lr >= 0:
            raise FitError("steps, rebase_every and lr must be ≥ 0 and batch_blocks ≥ 1")
        if not 0.0 < self.holdout < 1.0:
            raise FitError(f"holdout must be in (0, 1), got {self.holdout}")
        if not isinstance(self.int2kv, Int2KVConfig):
            raise FitError(f"int2kv must be an Int2KVConfig, got {type(self.int2kv).__name__}")
        if self.int2kv.lloyd_max:
            raise FitError("refinement learns against uniform INT2 levels; int2kv.lloyd_max=True is not modelled: "
                           "refine with lloyd_max=False (the rotations serve with either)")
        if self.int2kv.clip_search != "exact":
            raise FitError(f"refinement clips rows at their exact thresholds; int2kv.clip_search="
                           f"{self.int2kv.clip_search!r} is not modelled: refine with clip_search='exact'")

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
        return getattr(torch, self.int2kv.scale_dtype)

    @property
    def round_rows(self) -> torch.dtype:
        return getattr(torch, self.int2kv.hp_dtype)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly settings (``int2kv`` as :meth:`Int2KVConfig.to_json`)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sides"] = list(self.sides)
        d["int2kv"] = self.int2kv.to_json()
        return d



# -- per-layer data --------------------------------------------------------------------------------


@dataclass
class LayerData:
    """fp32 training tensors of one layer, blocks first: ``x [B, H, n, d]``, ``m [B, H, d, d]``,
    ``w [B, H, n, n]``, ``mask [B, 1, n, 1]``, ``den [B, H]``."""

    x: torch.Tensor
    metric: torch.Tensor
    mask: torch.Tensor
    den: torch.Tensor
    side: str


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
    if side == "k":
        metric = _query_grams(q, shape.num_kv_heads)  # [B, Hkv, d, d]
        x = centered(_heads_first(k))
        den = ((x @ metric) * x).sum(dim=(-1, -2))
    else:
        scale = cfg.softmax_scale if cfg.softmax_scale is not None else shape.head_dim ** -0.5
        metric = _block_attention_weights(q, k, scale)  # [B, Hkv, n, n]
        x = centered(_heads_first(v))
        den = ((metric @ x) * x).sum(dim=(-1, -2))
    return LayerData(x=x, metric=metric, mask=mask, den=den.to(torch.float64), side=side)


def numerators(r: torch.Tensor, data: LayerData, idx: torch.Tensor, cfg: RefineConfig) -> torch.Tensor:
    """Per-head loss numerators ``[H]`` (fp64) of blocks ``idx`` under rotations ``r [P, d, d]`` fp32."""
    x = data.x[idx] @ r  # [b, H, n, d]
    d = x.shape[-1]
    gs = cfg.group_size or d
    ci = _clip_index(cfg.clip_ratio(data.side), d)
    xq = fake_quantize_int2(x.reshape(-1, d), clip_index=ci, group_size=gs, scale_dtype=cfg.scale_dtype,
                            round_rows=cfg.round_rows).reshape(x.shape)
    e = (xq - x) * data.mask[idx]
    metric = data.metric[idx]
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



__all__ = ["LOSS_NAMES", "RefineConfig"]
