"""Which backend runs a kernel call: ``"torch"`` (the PyTorch reference), ``"cpu"`` (the C++ kernels
of :mod:`rotationzoo.kernels.native`) or ``"triton"``."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..errors import BackendUnavailableError, KernelInputError
from . import native

_TRITON_IMPORT_ERROR: list[BaseException | None] = []

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")
"""What ``backend=`` accepts."""


def triton_available() -> bool:
    """True when the triton package imports (the result is cached)."""
    if not _TRITON_IMPORT_ERROR:
        try:
            importlib.import_module("triton")
        except Exception as exc:  # ImportError or a broken install
            _TRITON_IMPORT_ERROR.append(exc)
        else:
            _TRITON_IMPORT_ERROR.append(None)
    return _TRITON_IMPORT_ERROR[0] is None


def _cpu_kernel_reason(kernel: str) -> str:
    """Why the C++ ``kernel`` cannot run here (``""`` when it can); under ``torch.compile`` this is
    evaluated once, while tracing, and its result kept as a constant of the graph."""
    if native.native_available(kernel):
        return ""
    return native.native_unavailable_reason(kernel) or "not built"


# what torch.compiler.assume_constant_result does, without importing dynamo (and with it triton) here
_cpu_kernel_reason._dynamo_marked_constant = True  # type: ignore[attr-defined]


def pick_backend(backend: str, device: torch.device, kernel: str | None = "decode") -> str:
    """``"torch"``, ``"cpu"`` or ``"triton"`` for ``backend`` (one of :data:`BACKEND_NAMES`) on ``device``.

    ``"auto"`` is triton for CUDA tensors when triton imports; on CPU tensors the C++ ``kernel``
    (``"decode"`` or ``"quantize"``) where it can be built, else the reference (one
    :class:`~rotationzoo.kernels.native.NativeKernelWarning` says why); torch elsewhere. ``"cpu"`` needs
    CPU tensors and the C++ kernel (``kernel=None``: an operation without one, which runs the reference
    there); ``"triton"`` needs CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1``. In a forked process, the first call for CPU tensors runs
    :func:`~rotationzoo.kernels.native.fork_guard` (torch to one thread).

    Raises:
        KernelInputError: an unknown backend name.
        BackendUnavailableError: the backend cannot run here.
    """
    if backend not in BACKEND_NAMES:
        raise KernelInputError(f"backend must be 'auto', 'torch', 'cpu' or 'triton', got {backend!r}")
    if device.type == "cpu":
        native.fork_guard()
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None and triton_available():
            return "triton"
        if device.type == "cpu" and kernel is not None:
            if not _cpu_kernel_reason(kernel):
                return "cpu"
            if kernel == "decode" and not torch.compiler.is_compiling():
                native.warn_unavailable_once()
        return "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise BackendUnavailableError(f"backend 'cpu' (the C++ kernels) needs CPU tensors, got a tensor on {device}; "
                                          f"use backend='auto'")
        if kernel is None:
            return "torch"
        reason = _cpu_kernel_reason(kernel)
        if reason:
            raise BackendUnavailableError(f"backend 'cpu': the C++ {kernel} kernel cannot run here: {reason}; use "
                                          f"backend='auto' or 'torch'")
        return "cpu"
    if not triton_available():
        raise BackendUnavailableError(
            f"backend 'triton' needs the triton package, which failed to import "
            f"({_TRITON_IMPORT_ERROR[0]!r}); install rotationzoo[triton] or use backend='torch'"
        )
    if device.type == "cuda":
        return "triton"
    from .triton_int2 import interpret_mode  # looked up here, so tests can stand in for the mode

    if device.type == "cpu" and interpret_mode():
        return "triton"
    raise BackendUnavailableError(
        f"backend 'triton' needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
        f"(Triton's slow CPU interpreter); got a tensor on {device}. Use backend='torch', 'cpu' or 'auto'."
    )
