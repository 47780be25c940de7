"""The INT2 store's quantizer with a straight-through gradient, for learning rotations against it.

Forward values are exactly those of :func:`rotationzoo.kernels.quantize_int2` followed by
:func:`~rotationzoo.kernels.dequantize_int2` (``backend="torch"``): row clip, per-group asymmetric
INT2, scale/zero rounded to the stored dtype, the values of :func:`rotationzoo.kernels.fake_quantize_int2`.
See :func:`ste_quantize_int2` for the gradient (the kernels' function has none).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FitError
from ..kernels.reference import RANGE_EPS


class _FakeInt2(torch.autograd.Function):
    """Forward: the kernels' clip + INT2 + dequant of ``bf16``-rounded rows; backward: see
    :func:`ste_quantize_int2`. Hand-written so that one step costs a dozen passes over the rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clip_index: int, group_size: int, scale_dtype: torch.dtype,
                round_rows: torch.dtype | None) -> torch.Tensor:
        n, d = x.shape
        xr = x.to(round_rows).to(torch.float32) if round_rows is not None else x
        if clip_index >= 0:
            top = torch.topk(xr.abs(), d - clip_index, dim=-1)  # the clipped elements; thr = the last
            thr = top.values[:, -1:]
            xc = torch.clamp(xr, min=-thr, max=thr)
            idx = top.indices
            sgn = torch.sign(torch.gather(xr, 1, idx))
        else:
            xc, idx, sgn = xr, None, None
        xc = xc + 0.0  # -0.0 -> +0.0 (as the kernels do); every other value is unchanged
        g = xc.view(n, d // group_size, group_size)
        mx, imx = g.max(dim=-1)
        mn, imn = g.min(dim=-1)
        scale = torch.clamp_min(mx - mn, RANGE_EPS) / 3.0
        zero = -mn / scale
        q = torch.clamp(torch.floor(g / scale[..., None] + zero[..., None] + 0.5), 0.0, 3.0)
        s_st = scale.to(scale_dtype).to(torch.float32)[..., None]
        z_st = zero.to(scale_dtype).to(torch.float32)[..., None]
        out = (q - z_st) * s_st
        ctx.save_for_backward((out - g).div_(scale[..., None]), imx, imn, idx, sgn)
        ctx.shape = (n, d, group_size)
        return out.view(n, d)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        u, imx, imn, idx, sgn = ctx.saved_tensors
        n, d, gs = ctx.shape
        gg = grad.reshape(n, d // gs, gs)
        # x̂ = x_c + scale·u (u constant): d/dscale = u; scale = (max − min)/3
        gscale = (gg * u).sum(dim=-1) / 3.0
        gx = gg.clone()
        gx.scatter_add_(-1, imx[..., None], gscale[..., None])
        gx.scatter_add_(-1, imn[..., None], -gscale[..., None])
        gx = gx.view(n, d)
        if idx is not None:
            gclip = torch.gather(gx, 1, idx)
            gx.scatter_(1, idx, 0.0)  # clipped: x_c = ±thr does not move with x
            gthr = (gclip * sgn).sum(dim=-1, keepdim=True)  # ... but with thr = |x| of the last one
            gx.scatter_add_(1, idx[:, -1:], gthr * sgn[:, -1:])
        return gx, None, None, None, None


def ste_quantize_int2(
    x: torch.Tensor,
    *,
    clip_index: int,
    group_size: int,
    scale_dtype: torch.dtype = torch.float32,
    round_rows: torch.dtype | None = None,
) -> torch.Tensor:
    """Clip, INT2-quantize and dequantize rows ``x [n, d]`` (fp32, finite), differentiably.

    Forward: exactly ``dequantize_int2(*quantize_int2(xr, clip_ratio, group_size, scale_dtype),
    dtype=float32)`` of :mod:`rotationzoo.kernels` (``backend="torch"``) on
    ``xr = round_rows(x)`` (``x`` itself when ``round_rows`` is ``None``):
    ``thr = sort(|xr|)[clip_index]``, clamp, ``-0 → +0``, per group
    ``scale = max(max − min, 1e-8)/3``, ``zero = −min/scale``,
    ``q = clamp(floor(x/scale + zero + 0.5), 0, 3)``, ``(q − zero_s)·scale_s`` with scale/zero
    rounded to ``scale_dtype``.

    Backward (straight-through): the rounding to ``round_rows`` is the identity, and
    ``x̂ = x_clipped + scale·u`` with each element's rounding offset ``u = (x̂ − x_clipped)/scale``
    (code units) held constant, so gradients reach the elements themselves, each group's min and
    max (through ``scale``) and, for the clipped elements, the row's threshold element. (Plain
    straight-through rounding with a differentiable scale and zero gives the same gradient.)
    """
    if x.dim() != 2:
        raise FitError(f"ste_quantize_int2 takes rows [n, d], got {list(x.shape)}")
    return _FakeInt2.apply(x, int(clip_index), int(group_size), scale_dtype, round_rows)


__all__ = ["ste_quantize_int2"]
