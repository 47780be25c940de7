"""The C kernels for CPUs: decode attention over the INT2 cache and the uniform INT2 quantizer.

PyTorch has no operator that unpacks INT2 codes inside a matrix product, so the PyTorch reference
(:mod:`rotationzoo.kernels.decode_reference`) writes each tile's codes out as fp32 and reads them
back: about the bytes an fp32 cache costs, plus the codes. ``native_decode.c`` dequantizes each
row in registers instead and reads only the codes, scales/zeros and windows; ``native_quantize.c``
is the reference quantizer bit for bit.

**Build.** Each kernel is compiled on its first use with the system C compiler (``$CC`` if set,
else ``cc``, ``gcc`` or ``clang`` from ``PATH``; resolved to an absolute path, logged at debug
level) into a fresh temporary folder that is removed right after loading. The compiler runs with
fixed arguments (``-x c``, so a C++ driver compiles C), a minimal environment (``PATH``,
``TMPDIR`` pointing into that folder, ``LANG=C``) and a deadline of :data:`BUILD_TIMEOUT_S`.
Whatever goes wrong (an unusable ``CC``, no compiler, a compiler that fails or runs past the
deadline, no temporary folder, a library that does not load or lacks its symbol) is not an error:
that kernel falls back to the PyTorch reference for the rest of the process and one
:class:`NativeKernelWarning` names the cause. A compiler that cannot run or hangs is not run again;
otherwise the two kernels are built, and fall back, independently. ``ROTATIONZOO_NATIVE=0``
(read at each call) keeps every CPU kernel on the reference without running a compiler.

**Fork.** The OpenMP runtime torch uses (libgomp) cannot run a parallel region in a child forked
after the parent ran one: the child waits forever for the parent's worker threads. A process
forked after this module was imported therefore switches torch to one thread
(``torch.set_num_threads(1)``, as torch's own DataLoader workers do) on its first CPU INT2 kernel
call and says so once; the C kernels then run single-threaded too. Start workers with the
``"spawn"`` or ``"forkserver"`` method to keep every thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from importlib import resources

import torch

from ..config import native_kernels
from .decode_reference import rotate_output, rotate_queries
from .layout import bisect_iters

log = logging.getLogger("rotationzoo")

NATIVE_SPLIT_TOKENS = 1024
"""Fewest key positions per work item of the C kernel (more items only when the threads need them)."""

BUILD_TIMEOUT_S = 30.0
"""Deadline of one compiler run, in seconds: past it the compiler is killed (with its children), the
kernels fall back to the reference, and no compiler runs again in this process."""


class NativeKernelWarning(RuntimeWarning):
    """A CPU INT2 kernel runs the PyTorch reference instead of C (the message says why), or a forked
    process runs them on one thread."""


#: Each C source with the flags it is compiled with. The quantizer is bit-exact with the PyTorch
#: reference, so it gets no contraction and no reassociation; the attention sums in fp32 in its own
#: order anyway, so it may reassociate (vectorized reductions).
_SOURCES = {
    "decode": ("native_decode.c", ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd",
                                   "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp")),
    "quantize": ("native_quantize.c", ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")),
}
_I64, _I32, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
#: Each kernel's entry point: symbol, argument types, result type.
_SYMBOLS: dict[str, tuple[str, list[type], type | None]] = {
    "decode": ("rz_decode_int2", [_I64] * 8 + [_I32, _PTR, _PTR, _I32, _I32, _I32, _I64, _I32, _PTR, _PTR], _I32),
    "quantize": ("rz_quantize_uniform", [_I64, _I64, _PTR, _I32, _I64, _I32, _I32, _I64, _I32, _PTR, _PTR, _I32], None),
}
_WHAT = {"decode": "decode attention", "quantize": "quantization"}

_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL | str] = {}  # kernel → its library, or why it is not built (one line)
_COMPILER: list[str] = []  # [absolute path] once found, or ["", why] once unusable
_WARNED: set[str] = set()
_FORKED = [False]  # set in a forked child, cleared by its first kernel call


class _NoBuild(Exception):
    """Nothing can be built in this process: the compiler cannot be used, or no temporary folder."""


def _find_compiler() -> str:
    """The compiler's absolute path. Raises :class:`_NoBuild` with the reason."""
    cc = os.environ.get("CC", "")
    if cc.strip():
        found = shutil.which(cc)
        if found is None:
            if os.sep not in cc:
                why = "is not found on PATH"
            elif os.path.isdir(cc):
                why = "is a directory"
            elif os.path.exists(cc):
                why = "is not executable"
            else:
                why = "does not exist"
            raise _NoBuild(f"CC={cc!r} {why}; set CC to a C compiler (cc, gcc or clang) or unset it")
        path = os.path.abspath(found)
        log.debug("rotationzoo: C compiler %s (from CC=%r)", path, cc)
        return path
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            path = os.path.abspath(found)
            log.debug("rotationzoo: C compiler %s (%r on PATH)", path, name)
            return path
    raise _NoBuild("no C compiler found (install cc, gcc or clang, or set CC)")


def _compiler() -> str:
    if not _COMPILER:
        try:
            _COMPILER.append(_find_compiler())
        except _NoBuild as exc:
            _COMPILER.extend(("", str(exc)))
    if not _COMPILER[0]:
        raise _NoBuild(_COMPILER[1])
    return _COMPILER[0]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the compiler and everything it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or [""])[0][:300]


def _run(cc: str, args: list[str], work: str, source: str) -> None:
    """Run the compiler in ``work`` under the deadline. Raises :class:`_NoBuild` when it cannot start
    or runs too long, ``RuntimeError`` when it fails."""
    env = {"PATH": os.environ.get("PATH") or os.defpath, "TMPDIR": work, "LANG": "C", "LC_ALL": "C"}
    out_log = os.path.join(work, "cc.log")
    log.debug("rotationzoo: running %s", " ".join([cc, *args]))
    with open(out_log, "wb") as out:
        try:
            proc = subprocess.Popen([cc, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=work, start_new_session=True)
        except OSError as exc:
            raise _NoBuild(f"C compiler {cc} cannot run: {exc.strerror or exc}; set CC to a working C compiler"
                           ) from None
        try:
            rc = proc.wait(timeout=BUILD_TIMEOUT_S)
        except BaseException as exc:
            _kill(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise _NoBuild(f"C compiler {cc} did not finish {source} within {BUILD_TIMEOUT_S:g} s (killed); "
                               f"check CC, or set ROTATIONZOO_NATIVE=0") from None
            raise
    if rc != 0:
        raise RuntimeError(f"C compiler {cc} failed on {source} (exit {rc}): {_first_line(out_log)}")


def _compile(cc: str, name: str) -> ctypes.CDLL:
    """Build and load one kernel's library. Raises :class:`_NoBuild`, or any other exception with a
    one-line reason."""
    source, flags = _SOURCES[name]
    symbol, argtypes, restype = _SYMBOLS[name]
    try:
        work = tempfile.mkdtemp(prefix="rotationzoo-native-")
    except OSError as exc:
        raise _NoBuild(f"no temporary folder for the compiler ({exc.strerror or exc}); set TMPDIR to a writable "
                       f"folder") from None
    try:
        lib_path = os.path.join(work, f"rz_{name}.so")
        with resources.as_file(resources.files(__package__).joinpath(source)) as src:
            start = time.monotonic()
            _run(cc, [*flags, "-fPIC", "-shared", "-x", "c", str(src), "-x", "none", "-o", lib_path, "-lm"], work,
                 source)
        log.debug("rotationzoo: compiled %s in %.2f s", source, time.monotonic() - start)
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError as exc:
            raise RuntimeError(f"the library {cc} built from {source} does not load: {exc}") from None
        try:
            fn = getattr(lib, symbol)
        except AttributeError:
            raise RuntimeError(f"the library {cc} built from {source} has no symbol {symbol}; set CC to a C "
                               f"compiler") from None
        fn.argtypes = argtypes
        fn.restype = restype
        return lib
    finally:
        shutil.rmtree(work, ignore_errors=True)  # a loaded library stays mapped


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warn(message: str) -> None:
    """A :class:`NativeKernelWarning` attributed to the first caller outside rotationzoo."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, NativeKernelWarning, stacklevel=level + 1)


def _warn_once(key: str, message: str) -> None:
    """One warning per cause and process."""
    if key not in _WARNED:
        _WARNED.add(key)
        _warn(message)


def _build(name: str) -> ctypes.CDLL | str:
    """One kernel's library, or why it cannot be built (one line, warned once)."""
    try:
        return _compile(_compiler(), name)
    except _NoBuild as exc:
        if _COMPILER and _COMPILER[0]:
            _COMPILER[:] = ["", str(exc)]  # nothing is built again
        reason = str(exc)
        _warn_once(reason, f"rotationzoo: the C kernels for CPUs are not used, the PyTorch reference runs instead "
                           f"(slower): {reason}")
    except Exception as exc:  # every other failure of the build falls back as well
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _warn_once(reason, f"rotationzoo: CPU {_WHAT[name]} runs the PyTorch reference (slower): {reason}")
    return reason


def _library(name: str) -> ctypes.CDLL | None:
    """The loaded library of kernel ``name`` (built on first use), or ``None`` where it cannot run."""
    if not native_kernels():
        return None
    lib = _LIBS.get(name)
    if lib is None:
        with _LOCK:
            lib = _LIBS.get(name)
            if lib is None:
                lib = _LIBS[name] = _build(name)
    return lib if isinstance(lib, ctypes.CDLL) else None


def native_available(kernel: str = "decode") -> bool:
    """Whether the C ``kernel`` (``"decode"`` or ``"quantize"``) runs here (built on the first call; the
    result is kept for the process; ``ROTATIONZOO_NATIVE`` is read at every call)."""
    return _library(kernel) is not None


def native_unavailable_reason(kernel: str = "decode") -> str | None:
    """Why :func:`native_available` is false (``None`` when it is true)."""
    if not native_kernels():
        return "ROTATIONZOO_NATIVE is false"
    lib = _LIBS.get(kernel) if _library(kernel) is None else None
    return lib if isinstance(lib, str) else None


def warn_unavailable_once() -> None:
    """One :class:`NativeKernelWarning` per process that CPU decode runs the slower PyTorch reference,
    and why (nothing more where the failed build already said so)."""
    reason = native_unavailable_reason("decode")
    if reason is not None:
        _warn_once(reason, f"rotationzoo: CPU decode attention runs the PyTorch reference (several times slower): "
                           f"{reason}")


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    _FORKED[0] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_guard() -> None:
    """In a process forked after this module was imported, on its first CPU kernel call: torch to one
    thread (the OpenMP pool of the parent is gone, a parallel region would wait for it forever), said
    once. Everywhere else, nothing."""
    if not _FORKED[0]:
        return
    _FORKED[0] = False
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
        _warn(f"rotationzoo: in a forked process torch's OpenMP threads hang once the parent has used them, so "
              f"torch and the INT2 kernels run on 1 thread here instead of {threads}; start workers with the "
              f"'spawn' or 'forkserver' method to keep every thread")


def quantize_native_supported(x: torch.Tensor, *, rotation: torch.Tensor | None, lloyd_max: bool,
                              scale_dtype: torch.dtype) -> bool:
    """Whether :func:`quantize_rows_native` takes this call: CPU rows, no rotation, uniform levels,
    fp32 or bf16 scale/zero, and the C kernels built."""
    return (x.device.type == "cpu" and rotation is None and not lloyd_max
            and scale_dtype in (torch.float32, torch.bfloat16) and native_available("quantize"))


def quantize_rows_native(x: torch.Tensor, *, clip_index: int, group_size: int, clip_search: str,
                         scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotationzoo.kernels.reference.quantize_rows` of ``x [..., d]`` with uniform levels, in C,
    bit for bit (see ``native_quantize.c``); returns ``(codes [..., d/4], scales_zeros [..., 2·d/G])``."""
    lib = _library("quantize")
    assert lib is not None, "quantize_rows_native called where native_available('quantize') is false"
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
                            group_size, int(scale_dtype == torch.bfloat16), codes.data_ptr(), sz.data_ptr(),
                            max(1, torch.get_num_threads()))
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
    lib = _library("decode")
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


__all__ = ["BUILD_TIMEOUT_S", "NATIVE_SPLIT_TOKENS", "NativeKernelWarning", "decode_attention_native", "fork_guard",
           "native_available", "native_splits", "native_unavailable_reason", "quantize_native_supported",
           "quantize_rows_native", "warn_unavailable_once"]
