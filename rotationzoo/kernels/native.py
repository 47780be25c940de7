"""Decode attention over the INT2 cache on CPUs, in C: the fast CPU path of ``decode_attention_int2``.

PyTorch has no operator that unpacks INT2 codes inside a matrix product, so the PyTorch reference
(:mod:`rotationzoo.kernels.decode_reference`) writes each tile's codes out as fp32 and reads them
back: about the bytes an fp32 cache costs, plus the codes. ``native_decode.c`` dequantizes each
row in registers instead and reads only the codes, scales/zeros and windows. It is compiled on
first use with the system C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``; about a second)
into a temporary folder that is removed right after loading, so nothing is left on disk.

Where no compiler works, or with ``ROTATIONZOO_NATIVE=0``, :func:`native_available` is false and
``backend="auto"`` on CPU runs the PyTorch reference (one warning says why, once).
``backend="torch"`` always runs the reference.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from importlib import resources

import torch

from ..config import native_kernels
from .decode_reference import rotate_output, rotate_queries
from .layout import bisect_iters

NATIVE_SPLIT_TOKENS = 1024
"""Fewest key positions per work item of the C kernel (more items only when the threads need them)."""

#: Each C source with the flags it is compiled with. The quantizer is bit-exact with the PyTorch
#: reference, so it gets no contraction and no reassociation; the attention sums in fp32 in its own
#: order anyway, so it may reassociate (vectorized reductions).
_SOURCES = {
    "decode": ("native_decode.c", ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd",
                                   "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp")),
    "quantize": ("native_quantize.c", ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")),
}
_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc):
        return cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _compile(cc: str, name: str, work: str) -> ctypes.CDLL | str:
    source, flags = _SOURCES[name]
    out = os.path.join(work, f"rz_{name}.so")
    with resources.as_file(resources.files(__package__).joinpath(source)) as path:
        proc = subprocess.run([cc, *flags, "-fPIC", "-shared", str(path), "-o", out, "-lm"], capture_output=True,
                              text=True, timeout=120)
    if proc.returncode != 0:
        first = (proc.stderr or proc.stdout).strip().splitlines()
        return f"{cc} failed on {source}: {first[0] if first else 'exit ' + str(proc.returncode)}"
    return ctypes.CDLL(out)


def _build() -> dict[str, ctypes.CDLL] | str:
    """The loaded libraries, or why they could not be built (one line)."""
    if not native_kernels():
        return "ROTATIONZOO_NATIVE is false"
    cc = _compiler()
    if cc is None:
        return "no C compiler found (set CC, or install cc/gcc/clang)"
    work = tempfile.mkdtemp(prefix="rotationzoo-native-")
    libs: dict[str, ctypes.CDLL] = {}
    try:
        for name in _SOURCES:
            lib = _compile(cc, name, work)
            if isinstance(lib, str):
                return lib
            libs[name] = lib
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc} could not build the CPU kernels: {exc}"
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a loaded library stays mapped
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn = libs["decode"].rz_decode_int2
    fn.argtypes = [i64] * 8 + [i32, ptr, ptr, i32, i32, i32, i64, i32, ptr, ptr]
    fn.restype = i32
    fn = libs["quantize"].rz_quantize_uniform
    fn.argtypes = [i64, i64, ptr, i32, i64, i32, i32, i64, i32, ptr, ptr]
    fn.restype = None
    return libs


def _library(name: str = "decode") -> ctypes.CDLL | None:
    with _LOCK:
        if "libs" not in _STATE:
            _STATE["libs"] = _build()
    libs = _STATE["libs"]
    return libs[name] if isinstance(libs, dict) else None


def native_available() -> bool:
    """Whether the C kernels run here (compiled on the first call; the result is kept)."""
    return _library() is not None


def native_unavailable_reason() -> str | None:
    """Why :func:`native_available` is false (``None`` when it is true)."""
    _library()
    libs = _STATE["libs"]
    return None if isinstance(libs, dict) else str(libs)


def warn_unavailable_once() -> None:
    """One ``RuntimeWarning`` per process that CPU decode runs the slower PyTorch reference, and why."""
    if not _STATE.get("warned") and not native_available():
        _STATE["warned"] = True
        warnings.warn(f"rotationzoo: CPU decode attention runs the PyTorch reference (several times slower): "
                      f"{native_unavailable_reason()}", RuntimeWarning, stacklevel=3)


def quantize_native_supported(x: torch.Tensor, *, rotation: torch.Tensor | None, lloyd_max: bool,
                              scale_dtype: torch.dtype) -> bool:
    """Whether :func:`quantize_rows_native` takes this call: CPU rows, no rotation, uniform levels,
    fp32 or bf16 scale/zero, and the C kernels built."""
    return (x.device.type == "cpu" and rotation is None and not lloyd_max
            and scale_dtype in (torch.float32, torch.bfloat16) and native_available())


def quantize_rows_native(x: torch.Tensor, *, clip_index: int, group_size: int, clip_search: str,
                         scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotationzoo.kernels.reference.quantize_rows` of ``x [..., d]`` with uniform levels, in C,
    bit for bit (see ``native_quantize.c``); returns ``(codes [..., d/4], scales_zeros [..., 2·d/G])``."""
    lib = _library("quantize")
    assert lib is not None, "quantize_rows_native called where native_available() is false"
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
    lib.rz_quantize_uniform(n, d, rows.data_ptr(), int(rows.dtype == torch.bfloat16), d, clip_index, bisect,
                            group_size, int(scale_dtype == torch.bfloat16), codes.data_ptr(), sz.data_ptr())
    return codes.reshape(*lead, d // 4), sz.reshape(*lead, sz.shape[-1])


def _part(t: torch.Tensor) -> list[int]:
    return [t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)]


def native_splits(b: int, h: int, total: int, threads: int) -> int:
    """Ranges per (sequence, KV head): enough work items for ``threads`` (two each), each at least
    :data:`NATIVE_SPLIT_TOKENS` key positions."""
    want = -(-2 * threads // (b * h))
    return max(1, min(want, total // NATIVE_SPLIT_TOKENS))


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
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`rotationzoo.kernels.decode_attention_int2` on validated CPU inputs, in C (see the module
    docstring); same arguments as :func:`~rotationzoo.kernels.decode_reference.decode_attention_torch`.
    ``num_splits`` cuts each (sequence, KV head)'s key positions into that many ranges (default
    :func:`native_splits`)."""
    lib = _library()
    assert lib is not None, "decode_attention_native called where native_available() is false"
    b, hq, s, d = query.shape
    h = keys[0].shape[1]
    q = rotate_queries(query, q_rotation, h, scale).contiguous()
    rows = q.shape[2]
    windows = [keys[0], keys[3], values[0], values[3]]
    bf16 = all(t.dtype == torch.bfloat16 for t in windows)

    window = torch.bfloat16 if bf16 else torch.float32
    kept = []  # the tensors the C code reads, alive until it returns
    parts: list[int] = []
    for side in (keys, values):
        for t, dt in zip(side, (window, torch.uint8, torch.float32, window)):
            t = t.to(dt)
            t = t if t.stride(-1) == 1 else t.contiguous()  # the C code walks the last dimension
            kept.append(t)
            parts += _part(t)
    p, n, r = keys[0].shape[2], keys[1].shape[2], keys[3].shape[2]
    total = p + n + r
    threads = max(1, torch.get_num_threads())
    splits = min(num_splits, max(1, total)) if num_splits else native_splits(b, h, total, threads)
    k_groups = max(1, keys[2].shape[-1] // 2) if n else 1
    v_groups = max(1, values[2].shape[-1] // 2) if n else 1
    ws = torch.empty(b * h * splits * rows * (d + 2), dtype=torch.float32)
    out = torch.empty((b, h, rows, d), dtype=torch.float32)
    arr = (ctypes.c_int64 * len(parts))(*parts)
    rc = lib.rz_decode_int2(b, h, rows, s, d, p, n, r, int(causal and s > 1), q.data_ptr(), arr, int(bf16),
                            k_groups, v_groups, splits, threads, ws.data_ptr(), out.data_ptr())
    del kept
    if rc != 0:
        raise MemoryError("rotationzoo native decode: out of memory for a tile of scores")
    return rotate_output(out, o_rotation).reshape(b, hq, s, d).to(dtype)


__all__ = ["NATIVE_SPLIT_TOKENS", "decode_attention_native", "native_available", "native_splits",
           "native_unavailable_reason", "quantize_native_supported", "quantize_rows_native", "warn_unavailable_once"]
