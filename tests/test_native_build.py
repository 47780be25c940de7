"""Building the C kernels fails closed, bounded and once (rotationzoo.kernels.native): a hanging
compiler is killed at the deadline, an unusable CC, a failing compiler, a library without its symbol
and a missing temporary folder each fall back to the PyTorch reference with one warning naming the
cause; a C++ driver builds them; the compiler sees a minimal environment; a forked child finishes.

Each case runs in a fresh interpreter: what is built (or not) is kept for the whole process."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

GCC = shutil.which("gcc") or shutil.which("cc")
needs_gcc = pytest.mark.skipif(GCC is None, reason="no C compiler (gcc or cc) on PATH")

#: Quantize and decode twice each on CPU with backend="auto", check them against the reference and
#: report what happened as JSON (warnings, seconds, which kernels run C).
_PROBE = r"""
import json, logging, sys, tempfile, time, warnings
import torch
logging.basicConfig(level=logging.DEBUG, format="LOG %(message)s", stream=sys.stderr)
from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2
native.BUILD_TIMEOUT_S = float(sys.argv[1])
if len(sys.argv) > 2:
    tempfile.tempdir = sys.argv[2]
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 2, 300, 64, generator=g)
q = torch.randn(1, 4, 1, 64, generator=g)
start = time.monotonic()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
        codes, sz = quantize_int2(x, clip_ratio=0.96)
        kv = Int2KV(x[:, :, :4], codes, sz, x[:, :, -4:])
        out = decode_attention_int2(q, kv, kv, dtype=torch.float32)
seconds = time.monotonic() - start
rc, rs = quantize_int2(x, clip_ratio=0.96, backend="torch")
assert torch.equal(codes, rc) and torch.equal(sz, rs), "quantize differs from the reference"
ref = decode_attention_int2(q, kv, kv, backend="torch", dtype=torch.float32)
assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5), "decode differs from the reference"
print(json.dumps({
    "seconds": seconds,
    "warnings": [str(w.message) for w in seen],
    "categories": [w.category.__name__ for w in seen],
    "files": [w.filename for w in seen],
    "decode": native.native_available("decode"),
    "quantize": native.native_available("quantize"),
    "reason": native.native_unavailable_reason("decode"),
}))
"""


def probe(env: dict[str, str], *args: str, timeout: float = 120) -> tuple[dict, str]:
    """Run :data:`_PROBE` with ``env`` added to this environment; ``(report, stderr)``."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("CC", "ROTATIONZOO_NATIVE")}
    run_env.update(env)
    proc = subprocess.run([sys.executable, "-c", _PROBE, *(args or ("30",))], capture_output=True, text=True,
                          env=run_env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def gone(pid: int) -> bool:
    """The process has exited (or is a zombie waiting for its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.timeout(120)
def test_a_hanging_compiler_is_killed_at_the_deadline_once(tmp_path):
    pids = tmp_path / "pids"
    cc = script(tmp_path / "cc", f'echo $$ >> {pids}\nsleep 100 &\necho $! >> {pids}\nwait\n')
    report, _ = probe({"CC": str(cc)}, "2")
    assert 2 <= report["seconds"] < 10, report  # one deadline of 2 s, not one per kernel or per call
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert f"{cc} did not finish native_" in report["warnings"][0] and "within 2 s" in report["warnings"][0]
    assert report["categories"] == ["NativeKernelWarning"]
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2  # the compiler ran once: the shell and its sleep
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in started), "the compiler's process group outlived the deadline"


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on PATH")
def test_a_cxx_driver_builds_the_c_kernels():
    report, _ = probe({"CC": "g++"})
    assert report["warnings"] == [] and report["decode"] and report["quantize"], report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["missing", "relative", "not-executable", "directory"])
def test_an_unusable_cc_is_named_once_and_the_reference_runs(tmp_path, kind):
    cc = {"missing": "/nonexistent/cc", "relative": "rotationzoo-no-such-cc", "directory": str(tmp_path),
          "not-executable": str(tmp_path / "cc")}[kind]
    (tmp_path / "cc").write_text("#!/bin/sh\nexec gcc \"$@\"\n")  # not executable
    why = {"missing": "does not exist", "relative": "is not found on PATH", "directory": "is a directory",
           "not-executable": "is not executable"}[kind]
    report, _ = probe({"CC": cc})
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert f"CC={cc!r} {why}; set CC to a C compiler" in report["warnings"][0]
    assert report["files"] == ["<string>"]  # attributed to the caller, not to rotationzoo
    assert report["reason"].startswith(f"CC={cc!r} {why}")


@pytest.mark.timeout(120)
def test_a_failing_compiler_is_run_once_per_kernel_and_said_once_each(tmp_path):
    runs = tmp_path / "runs"
    cc = script(tmp_path / "cc", f'echo run >> {runs}\necho "cc1: error: no space left on device" >&2\nexit 1\n')
    report, _ = probe({"CC": str(cc)})
    assert not report["decode"] and not report["quantize"]
    assert len(runs.read_text().split()) == 2  # one build per kernel, not one per call
    assert sorted(report["warnings"]) == sorted(
        f"rotationzoo: CPU {what} runs the PyTorch reference (slower): C compiler {cc} failed on {src} (exit 1): "
        f"cc1: error: no space left on device"
        for what, src in (("decode attention", "native_decode.c"), ("quantization", "native_quantize.c")))


@pytest.mark.timeout(120)
@needs_gcc
def test_a_library_without_its_symbol_falls_back_once(tmp_path):
    """What ``CC=g++`` without ``-x c`` did: a library whose symbol is C++-mangled (here: absent)."""
    runs = tmp_path / "runs"
    cc = script(tmp_path / "cc", f'echo run >> {runs}\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                                 f'echo "int rz_other(void) {{ return 0; }}" > "$TMPDIR/e.c"\n'
                                 f'exec {GCC} -shared -fPIC "$TMPDIR/e.c" -o "$out"\n')
    report, _ = probe({"CC": str(cc)})
    assert not report["decode"] and not report["quantize"]
    assert len(runs.read_text().split()) == 2
    assert len(report["warnings"]) == 2, report["warnings"]
    assert any("native_decode.c has no symbol rz_decode_int2" in w for w in report["warnings"])
    assert any("native_quantize.c has no symbol rz_quantize_uniform" in w for w in report["warnings"])


@pytest.mark.timeout(120)
@needs_gcc
def test_no_temporary_folder_falls_back_once(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    report, _ = probe({}, "30", str(not_a_folder))
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "no temporary folder for the compiler (Not a directory); set TMPDIR" in report["warnings"][0]


@pytest.mark.timeout(180)
@needs_gcc
def test_the_compiler_sees_a_minimal_environment_and_its_path_is_logged(tmp_path):
    dump = tmp_path / "env"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script(bin_dir / "rz-test-cc", f'env >> {dump}\nexec {GCC} "$@"\n')
    report, err = probe({"CC": "rz-test-cc", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                         "CPATH": "/nonexistent", "ROTATIONZOO_PROBE_SECRET": "1"})
    assert report["warnings"] == [] and report["decode"] and report["quantize"], report
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert set(seen) <= {"PATH", "TMPDIR", "LANG", "LC_ALL", "PWD", "OLDPWD", "SHLVL", "_"}, sorted(seen)
    assert seen["LANG"] == "C" and "rotationzoo-native-" in seen["TMPDIR"]
    assert f"LOG rotationzoo: C compiler {bin_dir / 'rz-test-cc'} (from CC='rz-test-cc')" in err


_FORK = r"""
import multiprocessing, sys, warnings
import torch
from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 3000, 64, generator=g)
q = torch.randn(2, 4, 1, 64, generator=g)
torch.randn(4_000_000).exp().sum()  # torch's OpenMP threads start in the parent
codes, sz = quantize_int2(x, clip_ratio=0.96)
kv = Int2KV(x[:, :, :4], codes, sz, x[:, :, -4:])
want = decode_attention_int2(q, kv, kv, dtype=torch.float32)
print("C", native.native_available("decode"), native.native_available("quantize"), flush=True)

def child():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c2, s2 = quantize_int2(x, clip_ratio=0.96)
        out = decode_attention_int2(q, Int2KV(x[:, :, :4], c2, s2, x[:, :, -4:]), kv, dtype=torch.float32)
        ref = decode_attention_int2(q, kv, kv, backend="torch", dtype=torch.float32)
        torch.randn(4_000_000).exp().sum()
    assert torch.equal(c2, codes) and torch.equal(s2, sz)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5) and torch.allclose(ref, want, rtol=1e-5, atol=1e-5)
    forked = [str(w.message) for w in seen if "forked" in str(w.message)]
    assert len(forked) == 1 and "1 thread here instead of 2" in forked[0], forked
    assert torch.get_num_threads() == 1

p = multiprocessing.get_context("fork").Process(target=child)
p.start()
p.join(float(sys.argv[1]))
alive = p.is_alive()
if alive:
    p.kill()
print("CHILD", "hung" if alive else p.exitcode, flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("native", ["1", "0"])
def test_a_child_forked_after_torch_and_the_c_kernels_ran_finishes(native):
    if native == "1" and GCC is None:
        pytest.skip("no C compiler (gcc or cc) on PATH")
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["ROTATIONZOO_NATIVE"] = native
    proc = subprocess.run([sys.executable, "-c", _FORK, "30"], capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"C {native == '1'} {native == '1'}" in proc.stdout
    assert "CHILD 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]
