"""Which backend runs a kernel call: ``"torch"`` (the PyTorch reference) or ``"triton"``."""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..errors import BackendUnavailableError, KernelInputError
from .native import fork_guard

_TRITON_IMPORT_ERROR: list[BaseException | None] = []


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


def pick_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for ``backend`` (``"auto"``, ``"torch"`` or ``"triton"``) on ``device``.

    ``"auto"`` is triton for CUDA tensors when triton imports, torch otherwise; ``"triton"`` needs
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. In a forked process, the first call
    for CPU tensors runs :func:`~rotationzoo.kernels.native.fork_guard` (torch to one thread).

    Raises:
        KernelInputError: an unknown backend name.
        BackendUnavailableError: ``"triton"`` cannot run here.
    """
    if backend not in ("auto", "torch", "triton"):
        raise KernelInputError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if device.type == "cpu":
        fork_guard()
    if backend == "torch":
        return "torch"
    if backend == "auto":
        if device.type == "cuda" and importlib.util.find_spec("triton") is not None and triton_available():
            return "triton"
        return "torch"
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
        f"(Triton's slow CPU interpreter); got a tensor on {device}. Use backend='torch' or 'auto'."
    )
