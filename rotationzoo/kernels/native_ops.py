"""Calls into the C++ kernels of :mod:`rotationzoo.kernels.native` on validated CPU tensors.

:func:`decode_attention_native` is decode attention over the INT2 cache (``native_decode.cpp``),
:func:`quantize_rows_native` the uniform quantizer (``native_quantize.cpp``, bit for bit the
reference). Both assume their library is available (:func:`~rotationzoo.kernels.native.native_available`);
:mod:`rotationzoo.kernels.ops` registers them as torch operators with the reference as their fallback.
"""

from __future__ import annotations

import array
import ctypes
from typing import Any

import torch

from . import native
from .layout import bisect_iters

NATIVE_SPLIT_TOKENS = 1024
"""Fewest key positions per work item of the C++ kernel (more items only when the threads need them)."""

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


_FN: dict[str, Any] = {}
_ARGS = [0]  # how many int64 the decode kernel reads (struct rz_decode_args)


def _entry(kernel: str) -> Any:
    fn = _FN.get(kernel)
    if fn is None:
        lib = native.library(kernel)
        assert lib is not None, f"the C++ {kernel} kernel is not available here"
        fn = getattr(lib, native.KERNELS[kernel][1])
        if kernel == "decode":
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_double], ctypes.c_int
            count = lib.rz_decode_arg_count
            count.restype = ctypes.c_int64
            _ARGS[0] = int(count())
        else:
            fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                           ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            fn.restype = None
        _FN[kernel] = fn
    return fn


def native_splits(b: int, h: int, total: int, threads: int) -> int:
    """Ranges per (sequence, KV head): enough work items for ``threads`` (two each), each at least
    :data:`NATIVE_SPLIT_TOKENS` key positions."""
    want = -(-2 * threads // (b * h))
    return max(1, min(want, total // NATIVE_SPLIT_TOKENS))


def _last_unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride()[-1] == 1 or t.shape[-1] == 1 else t.contiguous()


def decode_attention_native(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    q_rotation: torch.Tensor | None,
    o_rotation: torch.Tensor | None,
    scale: float,
    causal: bool,
    num_splits: int | None,
    mask: torch.Tensor | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """:func:`rotationzoo.kernels.decode_attention_int2` on validated CPU inputs, in C++: the
    arguments of :func:`~rotationzoo.kernels.decode_reference.decode_attention_torch` (``o_rotation``
    multiplies the output, ``o @ R``); returns fp32 ``[B, Hq, S, d]``. ``num_splits`` cuts each
    (sequence, KV head)'s key positions into that many ranges (default :func:`native_splits`);
    ``portable`` runs the portable inner loops instead of the vectorized ones (tests)."""
    b, hq, s, d = query.shape
    h = keys[0].shape[1]
    rows = (hq // h) * s
    q = _last_unit(query if query.dtype == torch.float32 else query.to(torch.float32))
    kept = [q]  # every tensor the C++ code reads, alive until it returns
    windows = (keys[0], keys[3], values[0], values[3])
    bf16 = all(t.dtype == torch.bfloat16 for t in windows)
    window = torch.bfloat16 if bf16 else torch.float32
    p, n, r = int(keys[0].shape[2]), int(keys[1].shape[2]), int(keys[3].shape[2])
    total = p + n + r
    threads = max(1, torch.get_num_threads())
    splits = min(num_splits, max(1, total)) if num_splits else native_splits(b, h, total, threads)
    args = [b, h, rows, s, d, p, n, r, int(causal and s > 1), int(bf16), hq // h,
            _KIND[keys[2].dtype], _KIND[values[2].dtype],
            max(1, keys[2].shape[-1] // 2) if n else 1, max(1, values[2].shape[-1] // 2) if n else 1,
            q.data_ptr(), *q.stride()[:3]]
    args += _matrix(q_rotation, d, kept)
    args += _matrix(o_rotation, d, kept)
    for part in (keys, values):
        for k, t in enumerate(part):
            if k in (0, 3) and t.dtype != window:
                t = t.to(window)
            st = t.stride()
            if st[-1] != 1 and t.shape[-1] != 1:
                t = t.contiguous()
                st = t.stride()
            kept.append(t)
            args += (t.data_ptr(), st[0], st[1], st[2])
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask.to(torch.bool)
        kept.append(m)
        args += (m.data_ptr(), *(int(st) if size > 1 else 0 for st, size in zip(m.stride(), m.shape)))
    else:
        args += (0, 0, 0, 0, 0)
    out = torch.empty((b, hq, s, d), dtype=torch.float32)
    args += (splits, threads, int(portable), out.data_ptr())
    fn = _entry("decode")
    if len(args) != _ARGS[0]:
        raise RuntimeError(f"rotationzoo native decode: {len(args)} arguments for a kernel that reads {_ARGS[0]}")
    packed = array.array("q", args)  # about 4x faster than a ctypes array built from the list
    rc = fn(packed.buffer_info()[0], scale)
    del kept
    if rc == 1:
        raise MemoryError("rotationzoo native decode: out of memory for a tile of scores")
    if rc != 0:
        raise RuntimeError(f"rotationzoo native decode: arguments refused (code {rc})")
    return out


def _matrix(m: torch.Tensor | None, d: int, kept: list[torch.Tensor]) -> tuple[int, int, int]:
    """``(pointer, per-head stride, transposed)`` of a ``[d, d]`` / ``[H, d, d]`` matrix for the kernel:
    a transposed view of a contiguous fp32 matrix is passed as it is (``transposed = 1``), anything
    else as a contiguous fp32 copy."""
    if m is None:
        return 0, 0, 0
    per_head = m.dim() == 3
    if m.dtype == torch.float32:  # read from the strides: a view costs microseconds at every decode call
        st = m.stride()
        if not per_head or st[0] == d * d:
            if st[-1] == 1 and st[-2] == d:
                kept.append(m)
                return m.data_ptr(), d * d if per_head else 0, 0
            if st[-2] == 1 and st[-1] == d:  # the transposed view of a contiguous matrix: same first element
                kept.append(m)
                return m.data_ptr(), d * d if per_head else 0, 1
    base = m.to(torch.float32).contiguous()
    kept.append(base)
    return base.data_ptr(), d * d if per_head else 0, 0


def quantize_rows_native(x: torch.Tensor, *, clip_index: int, group_size: int, clip_search: str,
                         scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotationzoo.kernels.reference.quantize_rows` of ``x [..., d]`` with uniform levels, in C++,
    bit for bit (see ``native_quantize.cpp``); returns ``(codes [..., d/4], scales_zeros [..., 2·d/G])``."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    rows = x.reshape(-1, d)
    if rows.dtype not in (torch.float32, torch.bfloat16):
        rows = rows.to(torch.float32)  # fp16 → fp32 is exact, as the reference's upcast
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) != d):
        rows = rows.contiguous()
    n = rows.shape[0]
    codes = torch.empty((n, d // 4), dtype=torch.uint8)
    sz = torch.empty((n, 2 * (d // group_size)), dtype=scale_dtype)
    bisect = bisect_iters(d) if clip_search == "bisect" else 0
    _entry("quantize")(n, d, rows.data_ptr(), int(rows.dtype == torch.bfloat16), d, clip_index, bisect, group_size,
                       _KIND[scale_dtype], codes.data_ptr(), sz.data_ptr(), max(1, torch.get_num_threads()))
    return codes.reshape(*lead, d // 4), sz.reshape(*lead, sz.shape[-1])


def simd_compiled() -> bool:
    """Whether the decode library has its vectorized inner loops (AVX2 + FMA + F16C) compiled in."""
    lib = native.library("decode")
    return bool(lib is not None and lib.rz_decode_has_simd())


__all__ = ["NATIVE_SPLIT_TOKENS", "decode_attention_native", "native_splits", "quantize_rows_native", "simd_compiled"]
