"""The INT2 kernels as torch operators (``torch.library``), each with a fake (meta) implementation so
that ``torch.compile`` traces through them without a graph break.

Eager calls run the implementations directly (:func:`decode_fn`, :func:`quantize_cpu_fn`): the
operator dispatch costs time per call and, on its first call, imports torch's compiler stack; under
``torch.compile`` the operators are what the graph records.

Decode attention, one operator per backend, all with the same schema (validated inputs, as
:func:`rotationzoo.kernels.decode_attention_int2` prepares them; fp32 ``[B, Hq, S, d]`` out):

* ``rotationzoo::decode_int2_torch``: the PyTorch reference (:mod:`~rotationzoo.kernels.decode_reference`), any device;
* ``rotationzoo::decode_int2_cpu``: the C++ kernel (:mod:`~rotationzoo.kernels.native_ops`); where it
  cannot be built, the reference (with one :class:`~rotationzoo.kernels.native.NativeKernelWarning`);
* ``rotationzoo::decode_int2_triton``: the Triton kernels (:mod:`~rotationzoo.kernels.triton_decode`).

Quantization: ``rotationzoo::quantize_int2_cpu``, the uniform quantizer in C++ (the reference where it
cannot be built; bit-identical either way).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import native, native_ops
from . import reference as _ref
from .decode_reference import decode_attention_torch

_DECODE_DOC = ("(query, k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent, q_rotation, o_rotation, "
               "mask, scale, causal, num_splits) -> fp32 [B, Hq, S, d]")


def _parts(a: tuple[Tensor, ...]) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]:
    return (a[0], a[1], a[2], a[3]), (a[4], a[5], a[6], a[7])


def _decode_torch(query: Tensor, k_sink: Tensor, k_codes: Tensor, k_sz: Tensor, k_recent: Tensor, v_sink: Tensor,
                  v_codes: Tensor, v_sz: Tensor, v_recent: Tensor, q_rotation: Optional[Tensor],
                  o_rotation: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
                  num_splits: int) -> Tensor:
    keys, values = _parts((k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent))
    return decode_attention_torch(query, keys, values, q_rotation=q_rotation, o_rotation=o_rotation, scale=scale,
                                  causal=causal, num_splits=num_splits or None, dtype=torch.float32, mask=mask)


def _decode_cpu(query: Tensor, k_sink: Tensor, k_codes: Tensor, k_sz: Tensor, k_recent: Tensor, v_sink: Tensor,
                v_codes: Tensor, v_sz: Tensor, v_recent: Tensor, q_rotation: Optional[Tensor],
                o_rotation: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
                num_splits: int) -> Tensor:
    if not native.native_available("decode"):
        native.warn_unavailable_once()
        return _decode_torch(query, k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent, q_rotation,
                             o_rotation, mask, scale, causal, num_splits)
    keys, values = _parts((k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent))
    return native_ops.decode_attention_native(query, keys, values, q_rotation=q_rotation, o_rotation=o_rotation,
                                              scale=scale, causal=causal, num_splits=num_splits or None, mask=mask)


def _decode_triton(query: Tensor, k_sink: Tensor, k_codes: Tensor, k_sz: Tensor, k_recent: Tensor, v_sink: Tensor,
                   v_codes: Tensor, v_sz: Tensor, v_recent: Tensor, q_rotation: Optional[Tensor],
                   o_rotation: Optional[Tensor], mask: Optional[Tensor], scale: float, causal: bool,
                   num_splits: int) -> Tensor:
    from .triton_decode import decode_attention_triton

    keys, values = _parts((k_sink, k_codes, k_sz, k_recent, v_sink, v_codes, v_sz, v_recent))
    return decode_attention_triton(query, keys, values, q_rotation=q_rotation, o_rotation=o_rotation, scale=scale,
                                   causal=causal, num_splits=num_splits or None, dtype=torch.float32, mask=mask)


def _decode_fake(query: Tensor, *args: object) -> Tensor:
    return query.new_empty(query.shape, dtype=torch.float32)


def _register_decode(name: str, fn: Callable[..., Tensor], device_types: str | None) -> Callable[..., Tensor]:
    op = torch.library.custom_op(f"rotationzoo::{name}", fn, mutates_args=(), device_types=device_types)
    op.register_fake(_decode_fake)
    return op


decode_int2_torch = _register_decode("decode_int2_torch", _decode_torch, None)
decode_int2_cpu = _register_decode("decode_int2_cpu", _decode_cpu, "cpu")
decode_int2_triton = _register_decode("decode_int2_triton", _decode_triton, None)

#: The decode operator of each backend name.
DECODE_OPS: dict[str, Callable[..., Tensor]] = {"torch": decode_int2_torch, "cpu": decode_int2_cpu,
                                                  "triton": decode_int2_triton}
_DECODE_IMPLS: dict[str, Callable[..., Tensor]] = {"torch": _decode_torch, "cpu": _decode_cpu, "triton": _decode_triton}


def decode_fn(backend: str) -> Callable[..., Tensor]:
    """The decode operator of ``backend`` (``"torch"``, ``"cpu"`` or ``"triton"``) while ``torch.compile``
    traces, else its implementation (the same computation without the operator dispatch)."""
    return DECODE_OPS[backend] if torch.compiler.is_compiling() else _DECODE_IMPLS[backend]


def _quantize_cpu(x: Tensor, clip_index: int, group_size: int, clip_search: str,
                  scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Clip, quantize (uniform levels) and pack rows ``x [..., d]``: ``(codes [..., d/4] uint8,
    scales_zeros [..., 2·d/G] scale_dtype)``, in C++ where it is built, else by the reference (bit-identical)."""
    if native.native_available("quantize"):
        return native_ops.quantize_rows_native(x, clip_index=clip_index, group_size=group_size,
                                               clip_search=clip_search, scale_dtype=scale_dtype)
    d = x.shape[-1]
    codes, sz = _ref.quantize_rows(x.reshape(-1, d), clip_index=clip_index, group_size=group_size, lloyd_max=False,
                                   scale_dtype=scale_dtype, clip_search=clip_search)
    return codes.reshape(*x.shape[:-1], d // 4), sz.reshape(*x.shape[:-1], sz.shape[-1])


quantize_int2_cpu = torch.library.custom_op("rotationzoo::quantize_int2_cpu", _quantize_cpu, mutates_args=(),
                                             device_types="cpu")


def quantize_cpu_fn() -> Callable[..., tuple[Tensor, Tensor]]:
    """``rotationzoo::quantize_int2_cpu`` while ``torch.compile`` traces, else its implementation."""
    return quantize_int2_cpu if torch.compiler.is_compiling() else _quantize_cpu


@quantize_int2_cpu.register_fake
def _quantize_fake(x: Tensor, clip_index: int, group_size: int, clip_search: str,
                   scale_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    d = x.shape[-1]
    return (x.new_empty((*x.shape[:-1], d // 4), dtype=torch.uint8),
            x.new_empty((*x.shape[:-1], 2 * (d // group_size)), dtype=scale_dtype))


__all__ = ["DECODE_OPS", "decode_fn", "decode_int2_cpu", "decode_int2_torch", "decode_int2_triton", "quantize_cpu_fn",
           "quantize_int2_cpu"]
