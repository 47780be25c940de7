"""What a key or value row reads back from a cache in any :class:`~rotationzoo.kvformat.KVFormat` (plain PyTorch).

INT2 rows along the token axis go through this project's INT2 kernels (:func:`~rotationzoo.kernels.
fake_quantize_int2`, bit for bit what the cache stores). The other formats are simulated here, as their
engines or papers define them (``../shared/docs/kv-formats.md`` in the source tree):

* ``bf16``: the row rounded to bfloat16;
* ``fp8_e4m3``: ``fp8(clamp(x / s, ±448)) · s`` (round to nearest even, saturating as vLLM's
  ``scaled_fp8_conversion`` does); ``scale="tensor"``: ``s = 1`` (the engines' default without
  calibrated scales); per group: ``s = max|group| / 448``, stored in ``scale_dtype``;
* INT3 / INT4 along rows: the INT2 quantizer widened: per group ``scale = max(max − min, 1e-8) / (2^b − 1)``,
  ``zero = −min / scale``, ``q = clamp(floor(x / scale + zero + 0.5), 0, 2^b − 1)``, read back as
  ``(q − zero) · scale`` with scale and zero rounded to ``scale_dtype``, after the same per-row clip;
* ``kivi``: keys per channel over groups of ``group_size`` consecutive tokens (from token 0), values per
  row in groups of ``group_size`` dims: ``scale = (max − min) / (2^b − 1)``, ``q = round(clamp((x − min) /
  scale, 0, 2^b − 1))`` (half to even), read back as ``q · scale + min`` with scale and min in
  ``scale_dtype`` (KIVI's ``quant/new_pack.py``). Keys of a last, partial token group are returned as
  they are: KIVI never quantizes them (its residual holds them).

The functions return the values a decode step reads; where a format keeps tokens in full precision
(windows, KIVI's residual) is the attention's business (:mod:`rotationzoo.integrations.transformers.attention`).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..int2kv import Int2KVConfig
from ..kvformat import CODE_BITS, KVFormat
from .layout import clip_index
from .reference import RANGE_EPS, clip_rows
from .settings import TORCH_DTYPES

#: Largest finite FP8 e4m3fn magnitude.
FP8_E4M3_MAX = 448.0


def fake_quantize_format(x: torch.Tensor, fmt: KVFormat, side: str, *, dtype: torch.dtype | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """What rows ``x [B, H, T, d]`` (any float dtype) read back from a cache in ``fmt``, in ``dtype``
    (default ``x.dtype``): every token quantized (see the module docstring).

    Raises:
        ConfigError: a format with mixed code widths (quantize each layer in ``fmt.layer_format(layer_id)``,
            widened KV heads in ``fmt.wide_format()``).
    """
    from . import fake_quantize_int2

    if fmt.mixed:
        raise ConfigError(f"{fmt.name}: mixed code widths quantize per layer or KV head; pass "
                          f"fmt.layer_format(layer_id) or fmt.wide_format()")
    out_dtype = dtype or x.dtype
    if fmt.code == "int2" and fmt.axis == "token":
        return fake_quantize_int2(x.contiguous(), config=Int2KVConfig.from_format(fmt), side=side,  # type: ignore[arg-type]
                                  dtype=out_dtype, backend=backend)  # type: ignore[arg-type]
    if fmt.code == "bf16":
        return x.to(torch.bfloat16).to(out_dtype)
    xf = x.to(torch.float32)
    d = x.shape[-1]
    if fmt.code == "fp8_e4m3":
        return _fp8(xf, fmt, d).to(out_dtype)
    bits = CODE_BITS[fmt.code]
    if fmt.axis == "kivi":
        return (_kivi_keys(xf, fmt, bits) if side == "k" else _kivi_rows(xf, fmt.group_for(d), bits, fmt)).to(out_dtype)
    ratio = fmt.k_clip_ratio if side == "k" else fmt.v_clip_ratio
    rows = clip_rows(xf.reshape(-1, d), clip_index(ratio, d))
    return _uniform(rows, fmt.group_for(d), bits, fmt).reshape(x.shape).to(out_dtype)


def _fp8(x: torch.Tensor, fmt: KVFormat, d: int) -> torch.Tensor:
    if fmt.scale == "tensor":
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    g = fmt.group_for(d)
    grouped = x.reshape(*x.shape[:-1], d // g, g)
    s = (grouped.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    s = s.to(TORCH_DTYPES[fmt.scale_dtype]).to(torch.float32)
    q = (grouped / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return (q * s).reshape(x.shape)


def _uniform(rows: torch.Tensor, g: int, bits: int, fmt: KVFormat) -> torch.Tensor:
    """Asymmetric uniform ``bits``-bit codes of ``rows [n, d]`` per group of ``g`` dims, read back."""
    n, d = rows.shape
    top = float(2**bits - 1)
    grouped = rows.reshape(n, d // g, g)
    mn, mx = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    scale = torch.clamp_min(mx - mn, RANGE_EPS) / top
    zero = -mn / scale
    q = torch.clamp(torch.floor(grouped / scale + zero + 0.5), 0.0, top)
    sdt = TORCH_DTYPES[fmt.scale_dtype]
    return ((q - zero.to(sdt).float()) * scale.to(sdt).float()).reshape(n, d)


def _kivi_rows(x: torch.Tensor, g: int, bits: int, fmt: KVFormat) -> torch.Tensor:
    """KIVI's quantizer over the last axis of ``x [..., n]`` in groups of ``g``, read back."""
    shape = x.shape
    grouped = x.reshape(*shape[:-1], shape[-1] // g, g)
    top = float(2**bits - 1)
    mn, mx = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    scale = (mx - mn) / top
    q = torch.round(torch.clamp((grouped - mn) / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0, top))
    sdt = TORCH_DTYPES[fmt.scale_dtype]
    return (q * scale.to(sdt).float() + mn.to(sdt).float()).reshape(shape)


def _kivi_keys(x: torch.Tensor, fmt: KVFormat, bits: int) -> torch.Tensor:
    """Keys ``[B, H, T, d]`` per channel over groups of ``group_size`` tokens; a last partial group as given."""
    g = int(fmt.group_size or 1)
    t = x.shape[2]
    full = t // g * g
    out = x.clone()
    if full:
        per_channel = x[:, :, :full].transpose(2, 3)  # [B, H, d, full]: groups run along the tokens
        out[:, :, :full] = _kivi_rows(per_channel.contiguous(), g, bits, fmt).transpose(2, 3)
    return out


__all__ = ["FP8_E4M3_MAX", "fake_quantize_format"]
