"""The C++ kernels for CPUs: how they are built, cached and loaded, and when they are not used.

PyTorch has no operator that unpacks INT2 codes inside a matrix product, so the PyTorch reference
(:mod:`rotationzoo.kernels.decode_reference`) writes each tile's codes out as fp32 and reads them
back. ``native_decode.cpp`` (with its vectorized inner loops in ``native_decode_simd.cpp``) reads
only the codes, scales/zeros and windows; ``native_quantize.cpp`` is the reference quantizer bit for
bit. :mod:`rotationzoo.kernels.native_ops` calls them and registers them as torch operators.

**Build.** Each kernel is built on its first use, on its own, by torch's extension tooling
(``torch.utils.cpp_extension.load``: the include paths, language standard and link flags of the
torch build that runs) with flags that follow torch's CPU capability (AVX2 + FMA + F16C where torch
uses AVX2 or AVX-512, nothing ISA-specific elsewhere; OpenMP where torch uses it, on Linux). The
build runs in a child Python process with a minimal environment (``PATH``, ``TMPDIR`` inside a
fresh folder, ``LANG``/``LC_ALL=C``, ``CXX``) and a deadline of :data:`BUILD_TIMEOUT_S`, after which
it is killed with everything it started. The compiler is ``$CXX``, else ``$CC``, else ``c++``,
``g++``, ``clang++``, ``cc``, ``gcc`` or ``clang`` from ``PATH`` (resolved to an absolute path,
logged at debug level). The library is kept under ``<cache>/kernels/``, named by the hash of its
sources, flags, compiler and torch version, so later processes load it without compiling.

**Fallback.** Whatever goes wrong (an unusable compiler, no ninja, a build that fails or runs past
the deadline, no temporary folder, a library that does not load or lacks its symbol) is not an
error: that kernel runs the PyTorch reference for the rest of the process and one
:class:`NativeKernelWarning` names the cause. A compiler that cannot run or hangs is not run again;
otherwise the kernels are built, and fall back, independently. ``ROTATIONZOO_NATIVE=0`` (read at
each call) keeps every CPU kernel on the reference without running a compiler.

**Fork.** The OpenMP runtime torch uses (libgomp) cannot run a parallel region in a child forked
after the parent ran one: the child waits forever for the parent's worker threads. A process
forked after this module was imported therefore switches torch to one thread
(``torch.set_num_threads(1)``, as torch's own DataLoader workers do) on its first CPU INT2 kernel
call and says so once; the C++ kernels then run single-threaded too. Start workers with the
``"spawn"`` or ``"forkserver"`` method to keep every thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from importlib import resources
from pathlib import Path

import torch

from .. import config

log = logging.getLogger("rotationzoo")

BUILD_TIMEOUT_S = 30.0
"""Deadline of one kernel's build (the child process that runs torch's extension tooling and the
compiler), in seconds: past it the build is killed with everything it started, the kernels fall back
to the reference, and no compiler runs again in this process."""

CACHE_AREA = "kernels"
"""Folder of the cache root (``ROTATIONZOO_CACHE``) holding the built libraries."""


class NativeKernelWarning(RuntimeWarning):
    """A CPU INT2 kernel runs the PyTorch reference instead of C++ (the message says why), or a forked
    process runs them on one thread."""


#: Each kernel: its sources (the first is the one named in messages), entry point and extra flags.
#: The quantizer is bit-exact with the PyTorch reference, so it gets no contraction and no
#: reassociation; decode sums in fp32 in its own order anyway, so it may reassociate.
KERNELS: dict[str, tuple[tuple[str, ...], str, tuple[str, ...]]] = {
    "decode": (("native_decode.cpp", "native_decode_simd.cpp", "native_decode.h"), "rz_decode_int2",
               ("-O3", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fno-math-errno")),
    "quantize": (("native_quantize.cpp",), "rz_quantize_uniform", ("-O3", "-ffp-contract=off")),
}
_WHAT = {"decode": "decode attention", "quantize": "quantization"}

#: The child's build: torch's extension tooling compiles and links the sources (argv: the parent's
#: sys.path and the build as JSON).
_BUILD_SCRIPT = r"""
import json, sys
sys.path[:] = json.loads(sys.argv[1])
spec = json.loads(sys.argv[2])
from torch.utils.cpp_extension import load
load(name=spec["name"], sources=spec["sources"], build_directory=spec["build"], extra_cflags=spec["cflags"],
     extra_ldflags=spec["ldflags"], is_python_module=False, verbose=False)
"""

_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL | str] = {}  # kernel → its library, or why it is not built (one line)
_COMPILER: list[str] = []  # [absolute path] once found, or ["", why] once unusable
_WARNED: set[str] = set()
_FORKED = [False]  # set in a forked child, cleared by its first kernel call


class _NoBuild(Exception):
    """Nothing can be built in this process: the compiler cannot be used, or no temporary folder."""


def _find_compiler() -> str:
    """The compiler's absolute path. Raises :class:`_NoBuild` with the reason."""
    for var in ("CXX", "CC"):
        cc = os.environ.get(var, "")
        if not cc.strip():
            continue
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
            raise _NoBuild(f"{var}={cc!r} {why}; set {var} to a C++ compiler (c++, g++ or clang++) or unset it")
        path = os.path.abspath(found)
        log.debug("rotationzoo: C++ compiler %s (from %s=%r)", path, var, cc)
        return path
    for name in ("c++", "g++", "clang++", "cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            path = os.path.abspath(found)
            log.debug("rotationzoo: C++ compiler %s (%r on PATH)", path, name)
            return path
    raise _NoBuild("no C++ compiler found (install g++ or clang++, or set CXX)")


def _compiler() -> str:
    if not _COMPILER:
        try:
            _COMPILER.append(_find_compiler())
        except _NoBuild as exc:
            _COMPILER.extend(("", str(exc)))
    if not _COMPILER[0]:
        raise _NoBuild(_COMPILER[1])
    return _COMPILER[0]


def isa_flags() -> list[str]:
    """Instruction-set flags of the kernels: AVX2 + FMA + F16C where torch itself runs AVX2 or AVX-512
    code (``torch.backends.cpu.get_cpu_capability()``), none on other machines (the portable loops)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return []
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # an older or unusual torch: stay portable
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if capability.upper().startswith(("AVX2", "AVX512")) else []


def openmp_flags() -> list[str]:
    """``-fopenmp`` where torch runs on OpenMP on Linux (the kernels then share torch's libgomp pool)."""
    return ["-fopenmp"] if sys.platform.startswith("linux") and torch.backends.openmp.is_available() else []


def build_flags(name: str) -> tuple[list[str], list[str]]:
    """``(compile flags, link flags)`` of kernel ``name`` beyond those of torch's extension tooling."""
    omp = openmp_flags()
    return [*KERNELS[name][2], *isa_flags(), *omp], omp


def _source_texts(name: str) -> list[tuple[str, bytes]]:
    pkg = resources.files(__package__)
    return [(f, pkg.joinpath(f).read_bytes()) for f in KERNELS[name][0]]


def _cache_key(name: str, cc: str, cflags: list[str], ldflags: list[str], sources: list[tuple[str, bytes]]) -> str:
    """Hash of everything the library depends on: sources, flags, compiler, torch build, machine."""
    h = hashlib.sha256()
    try:
        st = os.stat(cc)
        cc_id = [cc, st.st_size, st.st_mtime_ns]
    except OSError:
        cc_id = [cc]
    h.update(json.dumps([name, cc_id, cflags, ldflags, torch.__version__, platform.machine(), sys.platform,
                         sys.version_info[:2]]).encode())
    for fname, text in sources:
        h.update(fname.encode() + b"\0" + hashlib.sha256(text).digest())
    return h.hexdigest()[:20]


def _trusted(path: Path, *, folder_only: bool = False) -> bool:
    """A regular file (not a link) of this user that nobody else may write, in such a folder (``folder_only``:
    the folder alone)."""
    try:
        for p, want in ((path.parent, stat.S_ISDIR), (path, stat.S_ISREG))[:1 if folder_only else 2]:
            st = os.lstat(p)
            if not want(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                return False
    except OSError:
        return False
    return True


def _keep(built: str, cache: Path, cached: Path) -> bool:
    """Copy the library ``built`` to ``cached`` for later processes, only into a folder :func:`_trusted` would
    load from (a real folder of this user that nobody else may write; never through a link), through a new
    file beside it (``O_EXCL | O_NOFOLLOW``: a name planted there is never written through) renamed into
    place. Returns whether it is there.

    Raises:
        OSError: the folder or the file cannot be written.
    """
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _trusted(cached, folder_only=True):
        log.debug("rotationzoo: %s is not a folder of this user only (a link, or others may write it); "
                  "the library is not kept there", cache)
        return False
    fd, tmp = -1, cache / f".{cached.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o700)
        with open(built, "rb") as src, os.fdopen(fd, "wb") as out:
            fd = -1
            shutil.copyfileobj(src, out)
        os.replace(tmp, cached)
    finally:
        if fd >= 0:
            os.close(fd)
        if tmp.exists() and not tmp.is_symlink():
            tmp.unlink()
    return _trusted(cached)


def _kill_session(proc: subprocess.Popen[bytes]) -> None:
    """Kill the build and everything it started: its session (ninja starts each compiler in a process
    group of its own, so one group is not enough)."""
    sid = proc.pid
    victims = []
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        fields = f.read().rsplit(b")", 1)[1].split()
                    if int(fields[3]) == sid:
                        victims.append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


_NINJA_FAILED = re.compile(r"FAILED: (?:\[code=(-?\d+)\] )?")  # ninja >= 1.12 names the command's exit status
_NINJA_STEP = re.compile(r"\[\d+/\d+\] ")
_PY_EXCEPTION = re.compile(r"[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b:?")


def _first_error(text: str) -> str:
    """What the compiler said in a build log, for the one-line warning: ``exit status N: <its first error line>``
    (``exit status N, no error message`` when it printed none).

    torch's tooling runs ninja, which prints ``FAILED: [code=N] <target>``, the command, then the compiler's
    output, and wraps all of it in a Python traceback whose lines (``raise CalledProcessError(...``) are never
    the answer. A log without a failed ninja step (torch's tooling failed around the compiler) gives its first
    non-Python error line, else the last exception's line.
    """
    lines = text.splitlines()
    status: int | None = None
    said: list[str] = []  # the failed commands' own output
    i = 0
    while i < len(lines):
        m = _NINJA_FAILED.match(lines[i].strip())
        if not m:
            i += 1
            continue
        if status is None and m.group(1) is not None:
            status = int(m.group(1))
        i += 2  # the line after FAILED: is the command ninja ran
        while i < len(lines) and not lines[i].startswith(("FAILED: ", "ninja: ")) and not _NINJA_STEP.match(lines[i]):
            if lines[i].strip():
                said.append(lines[i].strip())
            i += 1
    if status is None and not said:
        own = [ln.strip() for ln in lines if ln.strip() and not ln[:1].isspace()
               and not ln.startswith(("Traceback", "The above exception", "During handling"))]
        python = [ln for ln in own if _PY_EXCEPTION.match(ln)]
        errors = [ln for ln in own if "error" in ln.lower() and ln not in python]
        return ((errors or python[-1:] or own[-1:] or ["no error message"])[0])[:300]
    line = next((ln for ln in said if "error" in ln.lower()), said[0] if said else "")[:300]
    if status is None:
        return line
    return f"exit status {status}: {line}" if line else f"exit status {status}, no error message"


def _run_build(cc: str, name: str, work: str, cflags: list[str], ldflags: list[str]) -> str:
    """Build kernel ``name`` in ``work`` by torch's extension tooling in a child process under the
    deadline; returns the library's path. Raises :class:`_NoBuild` when the child cannot start or runs
    too long, ``RuntimeError`` (one line) when the build fails."""
    src_dir = os.path.join(work, "src")
    os.makedirs(src_dir)
    for fname, body in _source_texts(name):
        with open(os.path.join(src_dir, fname), "wb") as f:
            f.write(body)
    sources = [os.path.join(src_dir, f) for f in KERNELS[name][0] if not f.endswith(".h")]
    ext = f"rz_{name}"
    spec = {"name": ext, "sources": sources, "build": work, "cflags": cflags, "ldflags": ldflags}
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH") or os.defpath])
    env = {"PATH": path, "TMPDIR": work, "LANG": "C", "LC_ALL": "C", "CXX": cc, "MAX_JOBS": "2",
           "TORCH_DONT_CHECK_COMPILER_ABI": "1"}
    out_log = os.path.join(work, "build.log")
    source = KERNELS[name][0][0]
    log.debug("rotationzoo: building %s with %s %s", source, cc, " ".join(cflags))
    with open(out_log, "wb") as out:
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-c", _BUILD_SCRIPT, json.dumps(sys.path), json.dumps(spec)],
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work,
                                    start_new_session=True)
        except OSError as exc:
            raise _NoBuild(f"the build of {source} cannot start: {exc.strerror or exc}") from None
        try:
            rc = proc.wait(timeout=BUILD_TIMEOUT_S)
        except BaseException as exc:
            _kill_session(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise _NoBuild(f"C++ compiler {cc} did not finish {source} within {BUILD_TIMEOUT_S:g} s (killed); "
                               f"check CXX, or set ROTATIONZOO_NATIVE=0") from None
            raise
    lib = os.path.join(work, f"{ext}.so")
    if rc != 0 or not os.path.isfile(lib):
        with open(out_log, "rb") as log_file:
            text = log_file.read(65536).decode("utf-8", "replace")
        if "Ninja is required" in text:
            raise RuntimeError("torch's extension tooling needs ninja, which is not installed (pip install ninja)")
        raise RuntimeError(f"C++ compiler {cc} failed on {source}: {_first_error(text)}")
    return lib


def _load(lib_path: str, name: str, cc: str) -> ctypes.CDLL:
    source, symbol = KERNELS[name][0][0], KERNELS[name][1]
    try:
        lib = ctypes.CDLL(lib_path)
    except OSError as exc:
        raise RuntimeError(f"the library {cc} built from {source} does not load: {exc}") from None
    if not hasattr(lib, symbol):
        raise RuntimeError(f"the library {cc} built from {source} has no symbol {symbol}; set CXX to a C++ compiler")
    return lib


def _build(name: str) -> ctypes.CDLL | str:
    """One kernel's library (from the cache, else built), or why it cannot be (one line, warned once)."""
    try:
        cc = _compiler()
        cflags, ldflags = build_flags(name)
        key = _cache_key(name, cc, cflags, ldflags, _source_texts(name))
        cache = config.cache_dir() / CACHE_AREA
        cached = cache / f"rz_{name}-{key}.so"
        if cached.is_file() and _trusted(cached):
            log.debug("rotationzoo: %s from the cache (%s)", KERNELS[name][0][0], cached)
            return _load(str(cached), name, cc)
        try:
            work = tempfile.mkdtemp(prefix="rotationzoo-native-")
        except OSError as exc:
            raise _NoBuild(f"no temporary folder for the compiler ({exc.strerror or exc}); set TMPDIR to a writable "
                           f"folder") from None
        try:
            start = time.monotonic()
            built = _run_build(cc, name, work, cflags, ldflags)
            log.debug("rotationzoo: built %s in %.1f s", KERNELS[name][0][0], time.monotonic() - start)
            try:  # keep it for later processes: written beside, then renamed into place
                if _keep(built, cache, cached):
                    built = str(cached)
            except OSError as exc:  # a read-only cache: load it from the build folder
                log.debug("rotationzoo: %s not cached (%s)", KERNELS[name][0][0], exc)
            return _load(built, name, cc)
        finally:
            shutil.rmtree(work, ignore_errors=True)  # a loaded library stays mapped
    except _NoBuild as exc:
        if _COMPILER and _COMPILER[0]:
            _COMPILER[:] = ["", str(exc)]  # nothing is built again
        reason = str(exc)
        _warn_once(reason, f"rotationzoo: the C++ kernels for CPUs are not used, the PyTorch reference runs instead "
                           f"(slower): {reason}")
    except Exception as exc:  # every other failure of the build falls back as well
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        _warn_once(reason, f"rotationzoo: CPU {_WHAT[name]} runs the PyTorch reference (slower): {reason}")
    return reason


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warn(message: str) -> None:
    """A :class:`NativeKernelWarning` attributed to the first caller outside rotationzoo (and torch's
    operator machinery, which runs the kernels)."""
    frame, level = sys._getframe(1), 1
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    while frame.f_back is not None and frame.f_code.co_filename.startswith((_PACKAGE, torch_dir)):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, NativeKernelWarning, stacklevel=level + 1)


def _warn_once(key: str, message: str) -> None:
    """One warning per cause and process."""
    if key not in _WARNED:
        _WARNED.add(key)
        _warn(message)


def library(name: str) -> ctypes.CDLL | None:
    """The loaded library of kernel ``name`` (built on first use), or ``None`` where it cannot run."""
    if not config.native_kernels():
        return None
    lib = _LIBS.get(name)
    if lib is None:
        with _LOCK:
            lib = _LIBS.get(name)
            if lib is None:
                lib = _LIBS[name] = _build(name)
    return lib if isinstance(lib, ctypes.CDLL) else None


def native_available(kernel: str = "decode") -> bool:
    """Whether the C++ ``kernel`` (``"decode"`` or ``"quantize"``) runs here (built on the first call; the
    result is kept for the process; ``ROTATIONZOO_NATIVE`` is read at every call)."""
    return library(kernel) is not None


def native_unavailable_reason(kernel: str = "decode") -> str | None:
    """Why :func:`native_available` is false (``None`` when it is true)."""
    if not config.native_kernels():
        return "ROTATIONZOO_NATIVE is false"
    lib = _LIBS.get(kernel) if library(kernel) is None else None
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


__all__ = ["BUILD_TIMEOUT_S", "CACHE_AREA", "KERNELS", "NativeKernelWarning", "build_flags", "fork_guard", "isa_flags",
           "library", "native_available", "native_unavailable_reason", "openmp_flags", "warn_unavailable_once"]
