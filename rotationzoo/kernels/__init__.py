"""INT2 KV-cache kernels with the OSCAR / SGLang semantics: rotate, clip, quantize, pack, dequantize.

Quick use::

    from rotationzoo.kernels import Int2KVConfig, quantize_int2, dequantize_int2
    cfg = Int2KVConfig()                                            # the serving settings
    codes, sz = quantize_int2(k, rotation=R_k, config=cfg, side="k")   # k: [T, H, 128] bf16
    k_hat = dequantize_int2(codes, sz, rotation=R_k, config=cfg)       # back in the original basis

Every entry point takes the INT2-KV settings as one ``config`` (:class:`~rotationzoo.int2kv.Int2KVConfig`,
``side`` picking its K or V clip ratio); without one: no clip, one group per row, uniform levels, fp32
scale/zero. :func:`decode_attention_int2` is attention over the cache layout read straight from the codes.

Format (byte-compatible with the SGLang OSCAR caches): for each row of ``d`` values (one token, one
KV head) the codes are ``d/4`` bytes, quarter-interleaved (byte ``j`` holds dims ``j, j+d/4, j+d/2,
j+3d/4`` in bits 0-1, 2-3, 4-5, 6-7; see :func:`byte_index_and_shift`), and the scales/zeros are
``2 * d / group_size`` values ``[s0, z0, s1, z1, ...]`` in ``scale_dtype``; dims ``g*G .. g*G+G-1``
dequantize as ``(q - z_g) * s_g``. The full description, with the NaN/inf policy, is in
``docs/kernels.md``.

Backends: ``"torch"`` (:mod:`rotationzoo.kernels.reference`, any device), ``"cpu"`` (the C++ kernels of
:mod:`rotationzoo.kernels.native`: decode attention and the uniform quantizer) and ``"triton"``
(:mod:`rotationzoo.kernels.triton_int2`; CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).
``"auto"`` picks triton for CUDA tensors when triton is installed, the C++ kernels for CPU tensors
where they can be built, torch otherwise. Each kernel is a torch operator (:mod:`rotationzoo.kernels.ops`).
"""

from __future__ import annotations

import math

import torch

from ..errors import BackendUnavailableError, KernelInputError
from ..int2kv import Int2KVConfig
from . import layout
from . import reference as _ref
from .backend import pick_backend
from .backend import triton_available
from .decode import Int2KV, decode_attention_int2
from .ops import quantize_cpu_fn
from .layout import HEAD_DIMS, allowed_group_sizes, byte_index_and_shift, clip_index, packed_dim
from ..dtypes import TORCH_DTYPES
from .settings import resolve as _settings
from ..vocab import CLIP_SEARCHES, Backend, Side


INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Accepted dtypes of the values to quantize."""
SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
"""Accepted dtypes of the stored scale/zero pairs (float32 is the SGLang default). float16's range cannot hold
some groups' scale or zero (a constant group reads back NaN; docs/kernels.md, "NaN and inf policy"): for 16
bits prefer bfloat16."""
OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
"""Accepted dtypes of dequantized output."""

__all__ = [
    "HEAD_DIMS",
    "INPUT_DTYPES",
    "OUTPUT_DTYPES",
    "SCALE_DTYPES",
    "allowed_group_sizes",
    "byte_index_and_shift",
    "CLIP_SEARCHES",
    "Int2KV",
    "Int2KVConfig",
    "clip_index",
    "decode_attention_int2",
    "dequantize_int2",
    "fake_quantize_int2",
    "packed_dim",
    "quantize_int2",
    "quantize_int2_into",
    "triton_available",
]


# --- argument checks ----------------------------------------------------------------------------


def _check_tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise KernelInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _check_values(x: object, name: str = "x") -> torch.Tensor:
    x = _check_tensor(x, name)
    if x.dtype not in INPUT_DTYPES:
        raise KernelInputError(f"{name} dtype {x.dtype} is not supported; expected one of {_names(INPUT_DTYPES)}")
    if x.dim() < 1:
        raise KernelInputError(f"{name} must have at least one dimension [..., head_dim], got a scalar")
    try:
        layout.check_head_dim(x.shape[-1])
    except ValueError as exc:
        raise KernelInputError(f"{name} last dimension: {exc}") from None
    return x


def _check_group(d: int, group_size: int | None, lloyd_max: bool = False) -> int:
    """The one group-size rule (:func:`rotationzoo.int2kv.check_group_size`), as a kernel input error."""
    try:
        return layout.resolve_group_size(d, group_size, lloyd_max=lloyd_max)
    except ValueError as exc:
        raise KernelInputError(str(exc)) from None


def _check_clip(clip_ratio: float, d: int) -> int:
    if isinstance(clip_ratio, bool) or not isinstance(clip_ratio, (int, float)):
        raise KernelInputError(f"clip_ratio must be a float in [0, 1] (<= 0 disables), got {clip_ratio!r}")
    ratio = float(clip_ratio)
    if not math.isfinite(ratio) or ratio > 1.0:
        raise KernelInputError(f"clip_ratio must be a finite float <= 1 (<= 0 disables), got {clip_ratio!r}")
    return clip_index(ratio, d)


def _check_lloyd_max(lloyd_max: bool, d: int, group_size: int) -> bool:
    if not isinstance(lloyd_max, bool):
        raise KernelInputError(f"lloyd_max must be a bool, got {lloyd_max!r}")
    _check_group(d, group_size, lloyd_max)
    return lloyd_max


def _check_rotation(
    rotation: object, shape: tuple[int, ...], device: torch.device, name: str = "x"
) -> torch.Tensor | None:
    """``None`` or a ``[d, d]`` / ``[H, d, d]`` float tensor matching values of ``shape`` on ``device``."""
    if rotation is None:
        return None
    r = _check_tensor(rotation, "rotation")
    d = shape[-1]
    if not r.is_floating_point():
        raise KernelInputError(f"rotation must be a floating-point tensor, got {r.dtype}")
    if r.device != device:
        raise KernelInputError(f"rotation is on {r.device} but {name} is on {device}")
    if r.dim() == 2:
        if tuple(r.shape) != (d, d):
            raise KernelInputError(f"rotation must be [{d}, {d}] (or [heads, {d}, {d}]), got {list(r.shape)}")
        return r
    if r.dim() == 3:
        if tuple(r.shape[1:]) != (d, d):
            raise KernelInputError(f"per-head rotation must be [heads, {d}, {d}], got {list(r.shape)}")
        if len(shape) < 2 or shape[-2] != r.shape[0]:
            raise KernelInputError(
                f"per-head rotation [{r.shape[0]}, {d}, {d}] needs {name} shaped [..., {r.shape[0]}, {d}], "
                f"got {list(shape)}"
            )
        return r
    raise KernelInputError(f"rotation must be [{d}, {d}] or [heads, {d}, {d}], got {list(r.shape)}")


def _check_clip_search(clip_search: object) -> str:
    if clip_search not in CLIP_SEARCHES:
        raise KernelInputError(f"clip_search must be one of {', '.join(CLIP_SEARCHES)}, got {clip_search!r}")
    return str(clip_search)


def _check_scale_dtype(scale_dtype: object) -> torch.dtype:
    if scale_dtype not in SCALE_DTYPES:
        raise KernelInputError(f"scale_dtype {scale_dtype} is not supported; expected one of {_names(SCALE_DTYPES)}")
    return scale_dtype


def _check_sz_dtype(config: Int2KVConfig | None, sz: torch.Tensor, what: str) -> None:
    if config is not None and sz.dtype != TORCH_DTYPES[config.scale_dtype]:
        raise KernelInputError(f"{what} dtype {str(sz.dtype).replace('torch.', '')} disagrees with "
                               f"config.scale_dtype={config.scale_dtype!r}")


def _group_from_sz(d: int, sz_last: int, config: Int2KVConfig | None, what: str) -> int:
    if sz_last < 2 or sz_last % 2:
        raise KernelInputError(f"{what} last dimension must be 2 * groups (interleaved scale/zero), got {sz_last}")
    groups = sz_last // 2
    if d % groups:
        raise KernelInputError(f"{what} holds {groups} groups, which does not divide head_dim {d}")
    inferred = d // groups
    if config is not None:
        want = _settings(config, "k", d).group_size
        if want != inferred:
            raise KernelInputError(f"config's group size {want} disagrees with {what}: {groups} groups of head_dim {d} "
                                   f"means {inferred}")
    return _check_group(d, inferred)


# --- public API ---------------------------------------------------------------------------------


def _quantize_settings(config: Int2KVConfig | None, side: str, d: int) -> tuple[int, int, bool, torch.dtype, str]:
    """``(group_size, clip_index, lloyd_max, scale_dtype, clip_search)`` of a quantize call at head_dim
    ``d`` (:func:`~.settings.resolve`), checked."""
    st = _settings(config, side, d)
    gs = _check_group(d, st.group_size)
    return (gs, _check_clip(st.clip_ratio, d), _check_lloyd_max(st.lloyd_max, d, gs),
            _check_scale_dtype(st.scale_dtype), _check_clip_search(st.clip_search))


def _rows_backend(backend: str, device: torch.device, lloyd_max: bool) -> str:
    """The quantizer's backend: the C++ quantizer has uniform levels only (``auto`` then runs torch)."""
    be = pick_backend(backend, device, "quantize")
    if be == "cpu" and lloyd_max:
        if backend == "cpu":
            raise BackendUnavailableError("backend 'cpu': the C++ quantizer writes uniform levels only; use "
                                          "backend='torch' or 'auto' for lloyd_max")
        return "torch"
    return be


def _quantize_rows(x: torch.Tensor, r: torch.Tensor | None, be: str, ci: int, gs: int, lm: bool, sdt: torch.dtype,
                   cs: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales/zeros of ``x [..., d]`` by the torch or C++ backend (bit-identical)."""
    if be == "cpu":
        v = _ref.bf16_matmul(x, r) if r is not None else x
        return quantize_cpu_fn()(v, ci, gs, cs, sdt)
    return _ref.quantize_int2_torch(x, rotation=r, clip_index=ci, group_size=gs, lloyd_max=lm, scale_dtype=sdt,
                                    clip_search=cs)


def quantize_int2(
    x: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    config: Int2KVConfig | None = None,
    side: Side = "k",
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate (optional), clip, quantize to INT2 and pack rows of ``x``.

    Args:
        x: ``[..., d]`` with ``d`` in 64, 128, 256; bf16, fp16 or fp32. Each ``d``-vector (one
            token of one head) is a row with its own clip threshold.
        rotation: ``None``; ``R [d, d]`` applied as ``x @ R`` to every row; or per-head
            ``R [H, d, d]`` applied as ``x[..., h, :] @ R[h]`` (``x`` is then ``[..., H, d]``).
            The rotation runs in bf16: ``bf16(x) @ bf16(R)`` with fp32 accumulation, the result
            rounded to bf16 before the clip (the SGLang prefill GEMM ``k.to(bf16) @ R_K``). Per-layer
            matrices are the caller's business: call once per layer with that layer's ``R``.
        config: the INT2-KV settings (:class:`~rotationzoo.int2kv.Int2KVConfig`): the clip ratio of
            ``side`` (the threshold is ``sort(|row|)[int(ratio * d)]``, floor, clamped to ``d - 1``;
            ``0`` disables; SGLang/OSCAR use 0.96 for K and 0.92 for V), the group size (contiguous
            dims sharing one (scale, zero): ``d, d/2, …``, at least 16; ``None`` means ``d``), Lloyd-Max
            levels (``group_size == d``), the scale dtype (codes are always computed from the unrounded
            fp32 scale and zero) and the clip search (``"exact"``: the sorted value, as the SGLang
            prefill store; ``"bisect"``: the ``log2(d)``-step bisection of its decode flush). Without
            one: no clip, one group per row, uniform levels, fp32 scale/zero, exact.
        side: ``"k"`` or ``"v"``: which clip ratio of ``config`` applies.
        backend: ``"auto"`` (Triton for CUDA tensors; on CPU the C++ quantizer of
            :mod:`rotationzoo.kernels.native`, bit-identical to the reference, where it can be built,
            for uniform levels; else the reference), ``"torch"`` (the PyTorch reference), ``"cpu"``
            (the C++ quantizer; uniform levels only) or ``"triton"``.

    Returns:
        ``(codes, scales_zeros)``: ``codes`` uint8 ``[..., d/4]`` (quarter-interleaved, 4 codes per
        byte) and ``scales_zeros`` ``[..., 2 * d / group_size]`` in the scale dtype, interleaved
        ``[s0, z0, s1, z1, ...]``. Rows holding a NaN, or a ±inf that the clip did not remove, get
        codes 0 and NaN scale/zero.

    Example (``d = 128``): dims 5, 37, 69, 101 with codes 3, 0, 2, 1 share byte 5:
    ``codes[..., 5] == 3 | 0 << 2 | 2 << 4 | 1 << 6 == 0x63``.

    Raises:
        KernelInputError: unsupported shape, dtype, group size, clip ratio or rotation.
        BackendUnavailableError: the backend cannot run here.
    """
    x = _check_values(x)
    d = x.shape[-1]
    gs, ci, lm, sdt, cs = _quantize_settings(config, side, d)
    r = _check_rotation(rotation, tuple(x.shape), x.device)
    be = _rows_backend(backend, x.device, lm)
    if be != "triton":
        return _quantize_rows(x, r, be, ci, gs, lm, sdt, cs)

    from .triton_int2 import quantize_triton

    lead = x.shape[:-1]
    heads = r.shape[0] if r is not None and r.dim() == 3 else 1
    x3 = x.reshape(-1, heads, d)
    n = x3.shape[0]
    codes = torch.empty(n, heads, d // 4, dtype=torch.uint8, device=x.device)
    sz = torch.empty(n, heads, 2 * (d // gs), dtype=sdt, device=x.device)
    quantize_triton(x3, r, None, codes, sz, clip_index=ci, group_size=gs, lloyd_max=lm, clip_search=cs)
    return codes.reshape(*lead, d // 4), sz.reshape(*lead, sz.shape[-1])


def dequantize_int2(
    codes: torch.Tensor,
    scales_zeros: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    config: Int2KVConfig | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Unpack and dequantize: ``out[..., dim] = (q - zero_g) * scale_g`` with ``g = dim // group_size``.

    Args:
        codes: uint8 ``[..., d/4]`` as returned by :func:`quantize_int2` (``d`` in 64, 128, 256).
        scales_zeros: ``[..., 2 * d / group_size]`` fp32/bf16/fp16, same leading shape as ``codes``;
            the group size is read from its last dimension.
        rotation: ``None``, or the ``R [d, d]`` / ``[H, d, d]`` used to quantize: the result is
            un-rotated as ``x_hat @ Rᵀ`` in bf16 (bf16 operands, fp32 accumulation, bf16 result; the
            SGLang output un-rotation), then cast to ``dtype``.
        dtype: output dtype, bf16 (default), fp16 or fp32. The fp32 dequant is rounded once to it.
        config: the INT2-KV settings the codes were written with (its group size, Lloyd-Max's
            ``group_size == d``, and ``scale_dtype``, which must be the dtype of ``scales_zeros``);
            Lloyd-Max codes dequantize with the same formula.
        backend: ``"auto"``, ``"torch"``, ``"cpu"`` (no C++ dequantizer: the reference, which is CPU
            code) or ``"triton"``.

    Returns:
        ``[..., d]`` tensor of ``dtype``.

    Raises:
        KernelInputError: mismatched or unsupported shapes/dtypes.
        BackendUnavailableError: the backend cannot run here.
    """
    codes = _check_tensor(codes, "codes")
    sz = _check_tensor(scales_zeros, "scales_zeros")
    if codes.dtype != torch.uint8:
        raise KernelInputError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() < 1:
        raise KernelInputError("codes must be [..., head_dim/4], got a scalar")
    d = 4 * codes.shape[-1]
    if d not in HEAD_DIMS:
        raise KernelInputError(
            f"codes last dimension {codes.shape[-1]} means head_dim {d}, which is not one of "
            f"{', '.join(map(str, HEAD_DIMS))}"
        )
    if sz.dtype not in SCALE_DTYPES:
        raise KernelInputError(
            f"scales_zeros dtype {sz.dtype} is not supported; expected one of {_names(SCALE_DTYPES)}"
        )
    if sz.dim() != codes.dim() or sz.shape[:-1] != codes.shape[:-1]:
        raise KernelInputError(
            f"scales_zeros {list(sz.shape)} must share the leading shape of codes {list(codes.shape)}"
        )
    if sz.device != codes.device:
        raise KernelInputError(f"scales_zeros is on {sz.device} but codes is on {codes.device}")
    _check_sz_dtype(config, sz, "scales_zeros")
    gs = _group_from_sz(d, sz.shape[-1], config, "scales_zeros")
    _check_lloyd_max(config is not None and config.lloyd_max, d, gs)
    if dtype not in OUTPUT_DTYPES:
        raise KernelInputError(f"dtype {dtype} is not supported; expected one of {_names(OUTPUT_DTYPES)}")
    r = _check_rotation(rotation, (*codes.shape[:-1], d), codes.device, "codes")
    if pick_backend(backend, codes.device, None) != "triton":
        return _ref.dequantize_int2_torch(codes, sz, group_size=gs, rotation=r, dtype=dtype)

    from .triton_int2 import dequantize_triton

    lead = codes.shape[:-1]
    mid = torch.bfloat16 if r is not None else dtype
    c2 = codes.reshape(-1, d // 4)
    s2 = sz.reshape(-1, sz.shape[-1])
    out = torch.empty(c2.shape[0], d, dtype=mid, device=codes.device)
    dequantize_triton(c2, s2, out, group_size=gs)
    out = out.reshape(*lead, d)
    if r is not None:
        out = _ref.unrotate(out, r).to(dtype)
    return out


def fake_quantize_int2(
    x: torch.Tensor,
    *,
    config: Int2KVConfig | None = None,
    side: Side = "k",
    dtype: torch.dtype | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """What INT2 rows read back: ``dequantize_int2(*quantize_int2(x, ...))``, bit for bit.

    The PyTorch backend skips the packing (:func:`~rotationzoo.kernels.reference.fake_quantize_rows`);
    the other backends run their quantizer and the dequantizer. No rotation: rotate ``x`` first if needed.
    (Not differentiable; the straight-through version for fitting is
    :func:`rotationzoo.fit.ste.ste_quantize_int2`.)

    Args:
        x: ``[..., d]`` values (bf16, fp16 or fp32).
        config, side, backend: as for :func:`quantize_int2`.
        dtype: output dtype (default ``x.dtype``).
    """
    x = _check_values(x)
    d = x.shape[-1]
    gs, ci, lm, sdt, cs = _quantize_settings(config, side, d)
    out_dtype = dtype or x.dtype
    if out_dtype not in OUTPUT_DTYPES:
        raise KernelInputError(f"dtype {out_dtype} is not supported; expected one of {_names(OUTPUT_DTYPES)}")
    be = _rows_backend(backend, x.device, lm)
    if be == "torch":
        out = _ref.fake_quantize_rows(x.reshape(-1, d), clip_index=ci, group_size=gs, lloyd_max=lm, scale_dtype=sdt,
                                      clip_search=cs, dtype=out_dtype)
        return out.reshape(x.shape)
    codes, sz = quantize_int2(x, config=config, side=side, backend=backend)
    return dequantize_int2(codes, sz, dtype=out_dtype, backend="torch" if be == "cpu" else backend)


def quantize_int2_into(
    x: torch.Tensor,
    loc: torch.Tensor,
    codes_buf: torch.Tensor,
    sz_buf: torch.Tensor,
    *,
    rotation: torch.Tensor | None = None,
    config: Int2KVConfig | None = None,
    side: Side = "k",
    backend: Backend = "auto",
) -> None:
    """Quantize ``x`` and write row ``t`` into slot ``loc[t]`` of a paged INT2 cache (in place).

    The store layout is SGLang's: ``codes_buf [slots, H, d/4]`` uint8 and
    ``sz_buf [slots, H, 2 * groups]`` (its dtype is the scale dtype; its last dimension gives the group
    size). Rows whose slot is negative, or ``>= slots`` (like SGLang's ``hp_global_offset``: slots
    past the INT2 tier), are skipped and their slots left untouched. Duplicate slots: one of the rows
    wins, unspecified which.

    Args:
        x: ``[T, H, d]`` bf16/fp16/fp32 (any strides).
        loc: ``[T]`` int32/int64 slot ids, on the same device.
        codes_buf: ``[slots, H, d/4]`` uint8.
        sz_buf: ``[slots, H, 2 * d / group_size]`` fp32/bf16/fp16.
        rotation, config, side, backend: as in :func:`quantize_int2` (``clip_search="bisect"`` is what
            the decode flush writes); a config's ``scale_dtype`` must be the dtype of ``sz_buf``.

    Raises:
        KernelInputError: shape/dtype/device mismatch among the arguments, or a buffer with a zero stride.
        BackendUnavailableError: the backend cannot run here.
    """
    x = _check_values(x)
    if x.dim() != 3:
        raise KernelInputError(f"x must be [tokens, heads, head_dim], got {list(x.shape)}")
    t, h, d = x.shape
    loc = _check_tensor(loc, "loc")
    if loc.dtype not in (torch.int32, torch.int64) or loc.dim() != 1 or loc.shape[0] != t:
        raise KernelInputError(f"loc must be int32/int64 [{t}], got {loc.dtype} {list(loc.shape)}")
    codes_buf = _check_tensor(codes_buf, "codes_buf")
    sz_buf = _check_tensor(sz_buf, "sz_buf")
    if codes_buf.dtype != torch.uint8 or codes_buf.dim() != 3 or codes_buf.shape[1:] != (h, d // 4):
        raise KernelInputError(
            f"codes_buf must be uint8 [slots, {h}, {d // 4}], got {codes_buf.dtype} {list(codes_buf.shape)}"
        )
    if sz_buf.dtype not in SCALE_DTYPES:
        raise KernelInputError(f"sz_buf dtype {sz_buf.dtype} is not supported; expected one of {_names(SCALE_DTYPES)}")
    if sz_buf.dim() != 3 or sz_buf.shape[:2] != codes_buf.shape[:2]:
        raise KernelInputError(
            f"sz_buf must be [{codes_buf.shape[0]}, {h}, 2*groups], got {list(sz_buf.shape)}"
        )
    for name, t_ in (("loc", loc), ("codes_buf", codes_buf), ("sz_buf", sz_buf)):
        if t_.device != x.device:
            raise KernelInputError(f"{name} is on {t_.device} but x is on {x.device}")
    for name, t_ in (("codes_buf", codes_buf), ("sz_buf", sz_buf)):
        if any(n > 1 and st == 0 for n, st in zip(t_.shape, t_.stride())):
            raise KernelInputError(f"{name} must hold memory of its own for each slot and head, got strides "
                                   f"{list(t_.stride())} (an expanded tensor: writes would alias); pass a real buffer")
    st = _settings(config, side, d)
    _check_sz_dtype(config, sz_buf, "sz_buf")
    gs = _group_from_sz(d, sz_buf.shape[-1], config, "sz_buf")
    ci = _check_clip(st.clip_ratio, d)
    lm = _check_lloyd_max(st.lloyd_max, d, gs)
    cs = _check_clip_search(st.clip_search)
    r = _check_rotation(rotation, tuple(x.shape), x.device)
    if t == 0:
        return
    be = _rows_backend(backend, x.device, lm)
    if be != "triton":
        codes, sz = _quantize_rows(x, r, be, ci, gs, lm, sz_buf.dtype, cs)
        loc = loc.to(torch.int64)
        keep = (loc >= 0) & (loc < codes_buf.shape[0])
        idx = loc[keep]
        codes_buf[idx] = codes[keep]
        sz_buf[idx] = sz[keep]
        return

    from .triton_int2 import quantize_triton

    quantize_triton(x, r, loc, codes_buf, sz_buf, clip_index=ci, group_size=gs, lloyd_max=lm, clip_search=cs)
