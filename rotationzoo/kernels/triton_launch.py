"""Launch arguments of the Triton INT2 kernels, computed without running them.

:func:`quant_launch` / :func:`dequant_launch` turn tensors and options into the grid, the
positional arguments and the constexprs/options of one launch; :mod:`rotationzoo.kernels.triton_int2`
runs them, and ``tools/aot_report.py`` compiles them ahead of time for a GPU target on any machine.
Block sizes, warps and stages come from the launch tables in :mod:`rotationzoo.kernels.layout`.
"""

import collections
import os
import types
from typing import Any, Callable, Iterable

import torch
import triton

from . import layout

_CLIP_MODES = {"none": 0, "top": 1, "bottom": 2, "radix": 3, "bisect": 4}
"""``CLIP_MODE`` constexpr of each :func:`layout.clip_plan` mode."""


def interpret_mode() -> bool:
    """Whether ``@triton.jit`` currently yields interpreted kernels (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        try:
            return bool(knobs.runtime.interpret)
        except AttributeError:  # pragma: no cover - older layouts
            pass
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in {"1", "true", "yes", "on"}


def kernel_copies(namespace: dict[str, Any], wrap: Callable[[Any], Any], kernels: dict[str, Any],
                  helpers: Iterable[str] = (), combine: Iterable[str] = (), aot: bool = False) -> types.SimpleNamespace:
    """Private copies of a module's raw kernel functions, each wrapped by ``wrap`` (``triton.jit`` or
    ``JITFunction``), re-created in ``namespace`` (a copy of the module's globals: the interpreter adds
    names to the globals of what it runs).

    ``kernels`` maps the returned names to the raw (undecorated) kernel functions; ``helpers`` name
    the ``@triton.jit`` functions they call, re-created in the same mode first. With ``aot=True`` the
    ``combine`` functions (Triton's reduction combiners, interpreted objects when triton was imported
    under ``TRITON_INTERPRET=1``) are re-jitted, so ``triton.compile`` works in a process that runs
    the interpreter.
    """
    if aot:
        from triton.runtime.jit import JITFunction

        for name in combine:
            if not isinstance(namespace[name], JITFunction):  # an InterpretedFunction wrapping the same function
                namespace[name] = JITFunction(namespace[name].fn)

    def copy_of(fn: Any) -> Any:
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__module__ = fn.__module__
        copy.__qualname__ = fn.__qualname__
        copy.__doc__ = fn.__doc__
        copy.__annotations__ = dict(fn.__annotations__)  # the tl.constexpr marks; FunctionType drops them
        return wrap(copy)

    for name in helpers:
        namespace[name] = copy_of(namespace[name].fn)
    return types.SimpleNamespace(**{name: copy_of(fn) for name, fn in kernels.items()})


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _capability(device: torch.device) -> int | None:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return 10 * major + minor
    return None


Launch = collections.namedtuple("Launch", "grid args kwargs")
Launch.__doc__ = "One kernel launch: ``kernel[grid](*args, **kwargs)`` (constexprs and options in kwargs)."


def quant_launch(
    x: torch.Tensor,
    rotation: torch.Tensor | None,
    loc: torch.Tensor | None,
    codes_out: torch.Tensor,
    sz_out: torch.Tensor,
    *,
    clip_index: int,
    group_size: int,
    lloyd_max: bool,
    clip_search: str = "exact",
    block_rows: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
    num_sms: int | None = None,
    capability: int | None = None,
) -> Launch:
    """The launch :func:`quantize_triton` makes (same arguments), without running it.

    ``interpret`` defaults to :func:`interpret_mode`; ``False`` gives the compiled-mode launch (bf16
    ``tl.dot`` operand, compiled tile sizes) on any device, which is what ahead-of-time compilation
    specializes. ``num_sms`` and ``capability`` (``10 * major + minor``, for the launch tables)
    default to the device's.
    """
    n, heads, d = x.shape
    interpret = interpret_mode() if interpret is None else interpret
    rotate = rotation is not None
    if rotation is not None:
        # compiled: bf16 operand for tl.dot; interpreted: the same bf16 values held in fp32 (the
        # interpreter has no bf16 matmul)
        r = rotation.to(torch.bfloat16)
        if interpret:
            r = r.to(torch.float32)
        sr = (0, r.stride(0), r.stride(1)) if r.dim() == 2 else (r.stride(0), r.stride(1), r.stride(2))
    else:
        r = x  # unused pointer
        sr = (0, 0, 0)
    cap = capability if capability is not None else _capability(x.device)
    bt = block_rows or layout.quant_block_rows(d, rotate=rotate, interpret=interpret, capability=cap)
    warps = num_warps or layout.quant_num_warps(d, bt, rotate=rotate, capability=cap)
    tiles = triton.cdiv(n, bt)
    progs = programs or layout.persistent_programs(tiles, heads, num_sms or _num_sms(x.device))
    mode, iters = layout.clip_plan(clip_index, d, search=clip_search)
    args = (
        (x, r, loc if loc is not None else x, codes_out, sz_out, n, tiles, codes_out.shape[0])
        + (*x.stride(), *sr)
        + (*codes_out.stride(), *sz_out.stride())
    )
    kwargs = dict(
        D=d,
        Q=d // 4,
        NG=d // group_size,
        G=group_size,
        BT=bt,
        ROTATE=rotate,
        DOT_BF16=not interpret,
        HAS_LOC=loc is not None,
        CLIP_INDEX=clip_index,
        CLIP_MODE=_CLIP_MODES[mode],
        CLIP_ITERS=iters,
        LLOYD_MAX=lloyd_max,
        SZ_BF16=sz_out.dtype == torch.bfloat16,
        num_warps=warps,
        num_stages=num_stages or layout.quant_num_stages(d, bt, rotate=rotate, capability=cap),
        enable_fp_fusion=False,
    )
    maxnreg = None if interpret else layout.quant_max_registers(d, bt, warps, rotate=rotate, capability=cap)
    if maxnreg is not None:
        kwargs["maxnreg"] = maxnreg
    return Launch((progs, heads), args, kwargs)


def dequant_launch(
    codes: torch.Tensor,
    sz: torch.Tensor,
    out: torch.Tensor,
    *,
    group_size: int,
    block_rows: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
    interpret: bool | None = None,
    num_sms: int | None = None,
    capability: int | None = None,
) -> Launch:
    """The launch :func:`dequantize_triton` makes (same arguments), without running it;
    ``capability`` as for :func:`quant_launch`."""
    n, quarter = codes.shape
    d = 4 * quarter
    interpret = interpret_mode() if interpret is None else interpret
    cap = capability if capability is not None else _capability(codes.device)
    bt = block_rows or layout.dequant_block_rows(d, interpret=interpret)
    warps = num_warps or layout.dequant_num_warps(d, bt, capability=cap)
    tiles = triton.cdiv(n, bt)
    progs = programs or layout.persistent_programs(tiles, 1, num_sms or _num_sms(codes.device))
    args = (codes, sz, out, n, tiles, *codes.stride(), *sz.stride(), *out.stride())
    kwargs = dict(
        D=d,
        Q=quarter,
        NG=d // group_size,
        G=group_size,
        BT=bt,
        OUT_BF16=out.dtype == torch.bfloat16,
        num_warps=warps,
        num_stages=1,
        enable_fp_fusion=False,
    )
    return Launch((progs,), args, kwargs)
