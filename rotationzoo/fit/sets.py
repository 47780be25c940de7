"""From finished statistics to rotation sets: one eigendecomposition per layer (or per KV head) and side,
the objective's composition, the centering means and the file metadata.

Every covariance is symmetrised and refused when it is zero or rank-deficient (a rotation of
directions the data never shows is arbitrary, and would still load and serve). The recipes of
:mod:`rotationzoo.fit.recipes` decide the composition (``U_desc·H`` for the V2 recipe, ``E·H·P_br``
of the unit-mean key metric for OSCAR-2) and the companions: ``k_mean`` on the K set and
``v_mean`` on the V set when centered, ``[L, H_kv, d]`` per KV head or ``[L, d]`` (the mean over
heads) for one rotation per layer, as the authors' loader requires.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from ..errors import FitError
from ..files.format import RotationSet
from ..files.validation import validate
from ..vocab import SignConvention
from .accumulate import LayerAccumulator
from .compose import composition_label, rotation_from_covariance
from ..recipe import OSCAR2_OBJECTIVES, V2_OBJECTIVE
from .recipes import side_objective, transform, unit_mean, v2_rotation

#: A covariance whose smallest eigenvalue is at most this fraction of its largest is rank-deficient:
#: the directions it does not see would be rotated arbitrarily. fp64 rounding leaves a missing
#: direction near 1e-16 of the largest; real activations stay far above 1e-10.
RANK_RTOL = 1e-10

_ZERO_HINT = {"qqt": "all-zero queries", "ktk": "all-zero keys", "vtv": "all-zero values",
              "sst": "all-zero values, or keys no query attends to (all-zero keys)"}
Compose = Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]


def _checked(c: torch.Tensor, acc: LayerAccumulator, target: str, head: int | None,
             compose: Compose) -> tuple[torch.Tensor, torch.Tensor]:
    """One covariance's rotation and eigenvalues, refused when the covariance is zero or rank-deficient."""
    what = f"layer {acc.layer_id} {target}" if head is None else f"layer {acc.layer_id} KV head {head} {target}"
    d = int(c.shape[-1])
    if not float(torch.diagonal(c).sum()) > 0:  # the trace of a PSD matrix: 0 only for 0 (NaN refused below)
        if bool(torch.isfinite(c).all()):
            raise FitError(f"{what}: the covariance is zero ({_ZERO_HINT[target]}); there is nothing to fit a "
                           "rotation to (re-dump the model)")
    r, lam = compose(c, what)
    rank = int((lam > RANK_RTOL * float(lam.max())).sum()) if float(lam.max()) > 0 else 0
    if rank < d:
        t = acc.num_tokens
        heads = (acc.group if head is not None else acc.num_q_heads) if target == "qqt" else \
            (1 if head is not None else acc.num_kv_heads)
        rows = t * int(heads or 1)
        few = f", fewer than head_dim {d}" if rows < d else ""
        raise FitError(f"{what}: the covariance has rank {rank} of {d}: {d - rank} directions never occur in the data "
                       f"and would be rotated arbitrarily. It comes from {rows} rows ({t} tokens x {heads} heads){few}; "
                       "fit on more tokens (or the data has channels that are always zero)")
    return r, lam


def layer_means(acc: LayerAccumulator, side: str, per_head: bool) -> torch.Tensor:
    """The stored mean of one side: ``[H_kv, d]`` per KV head, else the mean over heads ``[d]`` (fp64)."""
    mu = acc.mean(side)
    return mu if per_head else mu.mean(dim=0)


def _layer(acc: LayerAccumulator, objective: str, side: str, target: str, composition: str, group_size: int | None,
           signs: SignConvention, per_head: bool, center: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's symmetrised covariance, rotation and eigenvalues (a leading ``H_kv`` axis per head)."""
    mean = layer_means(acc, "v", per_head) if side == "v" and center == "kv" else None
    c = acc.covariance(target, per_head=per_head, mean=mean).to("cpu", torch.float64)
    c = (c + c.transpose(-1, -2)) / 2
    if objective in OSCAR2_OBJECTIVES and side == "k":
        c = unit_mean(c)
    if objective == V2_OBJECTIVE:
        def compose(m: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
            return v2_rotation(m, signs=signs, what=what)
    else:
        def compose(m: torch.Tensor, what: str) -> tuple[torch.Tensor, torch.Tensor]:
            return rotation_from_covariance(m, composition, group_size=group_size, signs=signs, what=what)
    if not per_head:
        r, lam = _checked(c, acc, target, None, compose)
        return r, lam, c
    pairs = [_checked(c[h], acc, target, h, compose) for h in range(c.shape[0])]
    return torch.stack([r for r, _ in pairs]), torch.stack([lam for _, lam in pairs]), c


def build_sets(accs: Mapping[int, LayerAccumulator], side_targets: Mapping[str, str | None], *, objective: str,
               composition: str, group_size: int | None, signs: SignConvention, d: int, per_head: bool = False,
               center: str = "none") -> tuple[dict[str, RotationSet | None], dict[str, torch.Tensor]]:
    """Per side: eigendecompose each layer's (or KV head's) covariance, compose, attach the means and metadata.

    Returns:
        ``({"k": RotationSet | None, "v": ...}, {side: fp64 covariances [L, (H_kv,) d, d]})``; every set
        validated (orthogonal to 1e-5, finite, head_dim, layer ids).
    """
    ids = tuple(accs)
    sides: dict[str, RotationSet | None] = {"k": None, "v": None}
    covs: dict[str, torch.Tensor] = {}
    label = composition if objective == V2_OBJECTIVE else composition_label(composition, group_size)
    for side, target in side_targets.items():
        if target is None:
            continue
        done = [_layer(acc, objective, side, target, composition, group_size, signs, per_head, center)
                for acc in accs.values()]
        companions: dict[str, Any] = {}
        if side == "k" and center in ("k", "kv"):
            companions["k_mean"] = torch.stack([layer_means(a, "k", per_head) for a in accs.values()]).float()
        if side == "v" and center == "kv":
            companions["v_mean"] = torch.stack([layer_means(a, "v", per_head) for a in accs.values()]).float()
        eig = None if objective == V2_OBJECTIVE else torch.stack([lam for _, lam, _ in done]).to(torch.float32)
        rs = RotationSet(rotations=torch.stack([r for r, _, _ in done]).to(torch.float32).contiguous(), layer_ids=ids,
                         objective=side_objective(objective, side) or f"{target}_{label}",
                         eigenvalues=eig.contiguous() if eig is not None else None,
                         source_grouping="kv_head" if per_head else "layer",
                         transform=transform(objective, side, center, target), **companions)
        validate(rs, head_dim=d, layer_ids=ids)
        sides[side] = rs
        covs[side] = torch.stack([c for _, _, c in done])
    return sides, covs


def fitted_means(accs: Mapping[int, LayerAccumulator]) -> dict[str, torch.Tensor]:
    """``{"k": [L, H_kv, d], "v": ...}`` fp64: the per-head means the statistics hold (a side is left out
    when its keys or values were not read)."""
    out: dict[str, torch.Tensor] = {}
    for side in ("k", "v"):
        try:
            out[side] = torch.stack([acc.mean(side) for acc in accs.values()])
        except FitError:
            continue
    return out
