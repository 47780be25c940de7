"""Pure-PyTorch reference of the INT2 KV kernels (any device, vectorised, bit-exact twin of Triton).

Every function here works on already-validated inputs; :mod:`rotationzoo.kernels` checks arguments
and dispatches. The arithmetic is spelled out so that it can be compared operation by operation with
the Triton kernels in :mod:`rotationzoo.kernels.triton_int2` and with the SGLang OSCAR kernels:

1. rotation (optional): ``bf16(x) @ bf16(R)``, exact products, fp32 accumulation, one rounding of
   the result to bf16 (the SGLang ``k.to(bf16) @ R_K`` prefill GEMM);
2. rows are upcast to fp32; a row holding a NaN is zeroed and flagged (see the NaN/inf policy);
3. clip: ``thr = sort(|row|)[clip_index]``; ``row = min(max(row, -thr), thr)``;
4. a row where a ±inf survived the clip is zeroed and flagged; signed zeros become ``+0``;
5. uniform: per contiguous group ``scale = max(max - min, 1e-8) / 3``, ``zero = -min / scale``,
   ``q = clamp(floor(x / scale + zero + 0.5), 0, 3)`` (IEEE fp32, round-to-nearest divisions);
   Lloyd-Max: see :func:`lloyd_max_params`;
6. flagged rows get codes 0 and NaN scale/zero; scale/zero are stored in ``scale_dtype`` (rounded
   to nearest even); ``q`` always uses the unrounded fp32 values;
7. quarter-interleaved packing (:mod:`rotationzoo.kernels.layout`).
"""

from __future__ import annotations

import torch

from ..errors import KernelInputError
from .layout import bisect_iters

# Lloyd-Max (approximate, SGLANG_LLOYD_MAX=1) constants, all exactly representable in fp32.
LM_THRESHOLD = 0.9810652732849121
"""Decision thresholds on the standardised row are ``-LM_THRESHOLD, 0, +LM_THRESHOLD``."""
LM_CENTROID = 1.5095585584640503
"""Outer effective centroid ``C``; the level span is ``2C``."""
LM_RATIO = 1.16
"""Stretch of the uniform-equivalent step."""
LM_SCALE = 1.1673918962478638
"""``fp32((2C / 3) * 1.16)`` (the fp64 product 1.1673919518788656 rounded to fp32, as a Triton
kernel sees the constexpr): ``scale = LM_SCALE * std``."""
LM_ZERO_OFFSET = 1.5
"""``C / (2C / 3)`` in fp64 is exactly 1.5: ``zero = 1.5 - mean / scale``."""
LM_STD_EPS = 1e-8
"""Added to the variance before the square root."""
RANGE_EPS = 1e-8
"""Lower bound of ``max - min`` in the uniform scale."""


def bf16_matmul(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``bf16(x) @ bf16(r)`` with exact products, fp32 accumulation and one rounding to bf16.

    Args:
        x: ``[..., d]`` float tensor; with a per-head ``r`` it is ``[..., H, d]``.
        r: ``[d, e]`` shared matrix or ``[H, d, e]`` per head.

    Returns:
        ``[..., e]`` bf16. Computed as an fp32 matmul of the bf16-rounded operands (a product of two
        bf16 values is exact in fp32 and in TF32), so the result only depends on the summation order
        of the fp32 accumulation, like the tensor-core GEMM it stands in for.
    """
    xf = x.to(torch.bfloat16).to(torch.float32)
    rf = r.to(torch.bfloat16).to(torch.float32)
    if rf.dim() == 2:
        out = xf @ rf
    else:
        out = torch.einsum("...hd,hde->...he", xf, rf)
    return out.to(torch.bfloat16)


def pairwise_sum(v: torch.Tensor) -> torch.Tensor:
    """Row sums of ``v [n, d]`` (``d`` a power of two) by repeated halving in fp32.

    ``s <- s[:, :h] + s[:, h:]`` until one column is left. This fixes the summation order, so the
    Triton kernel reproduces it bit for bit.
    """
    s = v
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def clip_rows(v: torch.Tensor, index: int) -> torch.Tensor:
    """Clamp each row of ``v [n, d]`` (fp32, NaN-free) to ``±sort(|row|)[index]``; ``index < 0``: no-op."""
    if index < 0:
        return v
    a = v.abs()
    d = a.shape[-1]
    # all three give sort(a)[:, index] exactly; topk is the fastest when few values lie on one side
    if d - index <= 16:
        thr = torch.topk(a, d - index, dim=-1).values[:, -1:]
    elif index + 1 <= 16:
        thr = torch.topk(a, index + 1, dim=-1, largest=False).values[:, -1:]
    else:
        thr = torch.kthvalue(a, index + 1, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(v, -thr), thr)




def bisect_clip_rows(v: torch.Tensor, index: int) -> torch.Tensor:
    """The clip of the SGLang fork's decode-flush kernel (``gpu_flush_int2``) on rows ``v [n, d]``.

    ``lo = 0``, ``hi = max|row|``; :func:`~rotationzoo.kernels.layout.bisect_iters` times: ``mid = (lo + hi) * 0.5``, and if more
    than ``d - index`` values have ``|x| > mid`` then ``lo = mid`` else ``hi = mid``; the threshold is
    the final ``hi`` (fp32 throughout). It clips at or below the exact ``sort(|row|)[index]``:
    slightly more values than :func:`clip_rows`. ``d < 64`` uses the exact threshold, as the fork does.
    """
    if index < 0:
        return v
    d = v.shape[-1]
    iters = bisect_iters(d)
    if iters == 0:
        return clip_rows(v, index)
    a = v.abs()
    target = d - index
    lo = torch.zeros(a.shape[:-1] + (1,), dtype=torch.float32, device=v.device)
    hi = a.amax(dim=-1, keepdim=True).to(torch.float32)
    for _ in range(iters):
        mid = (lo + hi) * 0.5
        too_many = (a > mid).sum(dim=-1, keepdim=True) > target
        lo = torch.where(too_many, mid, lo)
        hi = torch.where(too_many, hi, mid)
    return torch.minimum(torch.maximum(v, -hi), hi)


def lloyd_max_params(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Approximate Lloyd-Max INT2 of whole rows ``v [n, d]`` (fp32, finite).

    ``mean = pairwise_sum(v) / d``; ``var = pairwise_sum((v - mean)^2) / d``;
    ``std = sqrt(var + 1e-8)``; ``z = (v - mean) / std``;
    ``q = [z >= -T] + [z >= 0] + [z >= T]`` with ``T = 0.9810652732849121``;
    ``scale = LM_SCALE * std``; ``zero = 1.5 - mean / scale``, so that the ordinary dequant
    ``(q - zero) * scale`` gives ``mean + std * {-1.7511, -0.5837, 0.5837, 1.7511}``.

    Returns:
        ``(q uint8 [n, d], scale fp32 [n, 1], zero fp32 [n, 1])``.
    """
    d = v.shape[-1]
    mean = pairwise_sum(v) / d
    diff = v - mean[:, None]
    var = pairwise_sum(diff * diff) / d
    # correctly rounded fp32 sqrt: torch's vectorised CPU float sqrt can be 1 ulp off, the fp64
    # sqrt rounded to fp32 is exact (53 >= 2 * 24 + 2 bits)
    std = torch.sqrt((var + LM_STD_EPS).to(torch.float64)).to(torch.float32)
    z = diff / std[:, None]
    q = (z >= -LM_THRESHOLD).to(torch.uint8) + (z >= 0.0).to(torch.uint8) + (z >= LM_THRESHOLD).to(torch.uint8)
    scale = std * LM_SCALE
    zero = LM_ZERO_OFFSET - mean / scale
    return q, scale[:, None], zero[:, None]


def uniform_params(v: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform INT2 of ``v [n, d]`` (fp32, finite) per contiguous group.

    Returns:
        ``(q uint8 [n, d], scale fp32 [n, groups], zero fp32 [n, groups])``.
    """
    n, d = v.shape
    g = v.reshape(n, d // group_size, group_size)
    mn = g.amin(dim=-1)
    mx = g.amax(dim=-1)
    scale = torch.clamp_min(mx - mn, RANGE_EPS) / 3.0
    zero = -mn / scale
    t = g / scale[..., None] + zero[..., None] + 0.5
    q = torch.clamp(torch.floor(t), 0.0, 3.0).to(torch.uint8)
    return q.reshape(n, d), scale, zero


def pack_codes(q: torch.Tensor) -> torch.Tensor:
    """Quarter-interleave codes ``q [..., d]`` (uint8, 0..3) into ``[..., d/4]`` bytes.

    ``byte[j] = q[j] | q[j+Q] << 2 | q[j+2Q] << 4 | q[j+3Q] << 6`` with ``Q = d / 4``.
    """
    d = q.shape[-1]
    quarter = d // 4
    q4 = q.to(torch.uint8).reshape(*q.shape[:-1], 4, quarter)
    return q4[..., 0, :] | (q4[..., 1, :] << 2) | (q4[..., 2, :] << 4) | (q4[..., 3, :] << 6)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., d/4]`` uint8 -> ``[..., d]`` uint8 codes 0..3."""
    parts = [(codes >> (2 * a)) & 3 for a in range(4)]
    return torch.cat(parts, dim=-1)


def _levels(v: torch.Tensor, clip_index: int, group_size: int, lloyd_max: bool, clip_search: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-5 of the module docstring on rows ``v [n, d]``: ``(q, scale, zero, bad rows)``."""
    if v.device.type == "meta":  # the NaN/inf checks below read values
        raise KernelInputError("the quantizer reads the values and a tensor on the meta device holds none; pass CPU or "
                               "CUDA tensors")
    v = v.to(torch.float32)
    if bool(torch.isnan(v).any()):
        nan_row = torch.isnan(v).any(dim=-1)
        v = v.masked_fill(nan_row[:, None], 0.0)
    else:
        nan_row = torch.zeros(v.shape[0], dtype=torch.bool, device=v.device)
    v = bisect_clip_rows(v, clip_index) if clip_search == "bisect" else clip_rows(v, clip_index)
    bad = nan_row | torch.isinf(v).any(dim=-1) if bool(torch.isinf(v).any()) else nan_row
    if bool(bad.any()):
        v = v.masked_fill(bad[:, None], 0.0)
    v = v + 0.0  # -0.0 + 0.0 is +0.0 (round to nearest): signed zeros become +0, nothing else changes
    q, scale, zero = lloyd_max_params(v) if lloyd_max else uniform_params(v, group_size)
    return q, scale, zero, bad


def fake_quantize_rows(
    v: torch.Tensor,
    *,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    scale_dtype: torch.dtype,
    clip_search: str = "exact",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """What an INT2 row reads back: ``dequantize_rows(*quantize_rows(v, ...))`` without packing.

    Bit-identical to the round trip (same codes, the same ``scale_dtype``-rounded scale and zero,
    ``(q − zero) · scale`` in fp32, then ``dtype``), about twice as fast; flagged rows are NaN.
    """
    n, d = v.shape
    q, scale, zero, bad = _levels(v, clip_index, group_size, lloyd_max, clip_search)
    s = scale.masked_fill(bad[:, None], float("nan")).to(scale_dtype).to(torch.float32)
    z = zero.masked_fill(bad[:, None], float("nan")).to(scale_dtype).to(torch.float32)
    groups = s.shape[-1]
    out = (q.to(torch.float32).reshape(n, groups, d // groups) - z[..., None]) * s[..., None]
    return out.reshape(n, d).to(dtype)


def quantize_rows(
    v: torch.Tensor,
    *,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    scale_dtype: torch.dtype,
    clip_search: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip, quantize and pack rows.

    Args:
        v: ``[n, d]`` rows, any float dtype (upcast to fp32, exact for bf16/fp16).
        clip_index: :func:`rotationzoo.kernels.layout.clip_index` of the ratio (``-1``: no clip).
        group_size: contiguous dims per (scale, zero) pair; ``d`` when ``lloyd_max``.
        lloyd_max: approximate Lloyd-Max levels instead of min/max uniform levels.
        scale_dtype: dtype of the stored scale/zero pairs.
        clip_search: ``"exact"`` (:func:`clip_rows`) or ``"bisect"`` (:func:`bisect_clip_rows`).

    Returns:
        ``codes uint8 [n, d/4]`` and ``scales_zeros [n, 2 * d / group_size]`` (``scale_dtype``),
        interleaved ``[s0, z0, s1, z1, ...]``.
    """
    n, d = v.shape
    q, scale, zero, bad = _levels(v, clip_index, group_size, lloyd_max, clip_search)
    codes = pack_codes(q).masked_fill(bad[:, None], 0)
    scale = scale.masked_fill(bad[:, None], float("nan"))
    zero = zero.masked_fill(bad[:, None], float("nan"))
    sz = torch.stack((scale, zero), dim=-1).reshape(n, 2 * scale.shape[-1]).to(scale_dtype)
    return codes, sz


def dequantize_rows(codes: torch.Tensor, sz: torch.Tensor, *, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``(q - zero) * scale`` in fp32 for ``codes [n, d/4]`` and ``sz [n, 2 * groups]``, cast to ``dtype``."""
    n = codes.shape[0]
    q = unpack_codes(codes).to(torch.float32)
    d = q.shape[-1]
    s = sz[:, 0::2].to(torch.float32)
    z = sz[:, 1::2].to(torch.float32)
    out = (q.reshape(n, d // group_size, group_size) - z[..., None]) * s[..., None]
    return out.reshape(n, d).to(dtype)


# --- whole-tensor entry points (called by rotationzoo.kernels after validation) ------------------


def quantize_int2_torch(
    x: torch.Tensor,
    *,
    rotation: torch.Tensor | None,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    scale_dtype: torch.dtype,
    clip_search: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference :func:`rotationzoo.kernels.quantize_int2` on validated inputs."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    v = bf16_matmul(x, rotation) if rotation is not None else x
    codes, sz = quantize_rows(
        v.reshape(-1, d), clip_index=clip_index, group_size=group_size, lloyd_max=lloyd_max, scale_dtype=scale_dtype,
        clip_search=clip_search,
    )
    return codes.reshape(*lead, d // 4), sz.reshape(*lead, sz.shape[-1])


def dequantize_int2_torch(
    codes: torch.Tensor,
    sz: torch.Tensor,
    *,
    group_size: int,
    rotation: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Reference :func:`rotationzoo.kernels.dequantize_int2` on validated inputs."""
    quarter = codes.shape[-1]
    lead = codes.shape[:-1]
    d = 4 * quarter
    mid = torch.bfloat16 if rotation is not None else dtype
    out = dequantize_rows(codes.reshape(-1, quarter), sz.reshape(-1, sz.shape[-1]), group_size=group_size, dtype=mid)
    out = out.reshape(*lead, d)
    if rotation is not None:
        out = unrotate(out, rotation).to(dtype)
    return out


def unrotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ Rᵀ`` (per head: ``x[..., h, :] @ R[h]ᵀ``) with the bf16 semantics of :func:`bf16_matmul`."""
    return bf16_matmul(x, rotation.transpose(-1, -2))


def quantize_int2_into_torch(
    x: torch.Tensor,
    loc: torch.Tensor,
    codes_buf: torch.Tensor,
    sz_buf: torch.Tensor,
    *,
    rotation: torch.Tensor | None,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    clip_search: str = "exact",
) -> None:
    """Reference :func:`rotationzoo.kernels.quantize_int2_into` on validated inputs."""
    if x.shape[0] == 0:
        return
    codes, sz = quantize_int2_torch(
        x,
        rotation=rotation,
        clip_index=clip_index,
        group_size=group_size,
        lloyd_max=lloyd_max,
        scale_dtype=sz_buf.dtype,
        clip_search=clip_search,
    )
    loc = loc.to(torch.int64)
    keep = (loc >= 0) & (loc < codes_buf.shape[0])
    idx = loc[keep]
    codes_buf[idx] = codes[keep]
    sz_buf[idx] = sz[keep]
