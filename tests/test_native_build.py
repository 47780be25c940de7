"""Building the C++ kernels fails closed, bounded and once (rotationzoo.kernels.native): a hanging
compiler is killed at the deadline with everything it started, an unusable CXX/CC, a failing
compiler, a library without its symbol and a missing temporary folder each fall back to the PyTorch
reference with one warning naming the cause; torch's extension tooling builds them with the compiler
seeing a minimal environment; the library is cached by hash, so a second process compiles nothing;
a forked child finishes.

Each case runs in a fresh interpreter (what is built, or not, is kept for the whole process), with
its own cache folder where a build must really run."""

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

GXX = shutil.which("g++") or shutil.which("c++")
needs_cxx = pytest.mark.skipif(GXX is None, reason="no C++ compiler (g++ or c++) on PATH")
needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None and not (Path(sys.executable).parent / "ninja").exists(),
                                 reason="torch's extension tooling needs ninja")

#: Quantize and decode twice each on CPU with backend="auto", check them against the reference and
#: report what happened as JSON (warnings, seconds, which kernels run C++).
_PROBE = r"""
import json, logging, sys, tempfile, time, warnings
import torch
logging.basicConfig(level=logging.DEBUG, format="LOG %(message)s", stream=sys.stderr)
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2
native.BUILD_TIMEOUT_S = float(sys.argv[1])
if len(sys.argv) > 2:
    tempfile.tempdir = sys.argv[2]
g = torch.Generator().manual_seed(0)
x = torch.randn(1, 2, 300, 64, generator=g)
q = torch.randn(1, 4, 1, 64, generator=g)
cfg = Int2KVConfig(k_clip_ratio=0.96)
start = time.monotonic()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    for _ in range(2):
        codes, sz = quantize_int2(x, config=cfg)
        kv = Int2KV(x[:, :, :4], codes, sz, x[:, :, -4:])
        out = decode_attention_int2(q, kv, kv, dtype=torch.float32)
seconds = time.monotonic() - start
rc, rs = quantize_int2(x, config=cfg, backend="torch")
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


def probe(env: dict[str, str], *args: str, cache: Path | None = None, timeout: float = 150) -> tuple[dict, str]:
    """Run :data:`_PROBE` with ``env`` added to this environment (and ``cache`` as the cache root);
    ``(report, stderr)``."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "ROTATIONZOO_NATIVE")}
    if cache is not None:
        run_env["ROTATIONZOO_CACHE"] = str(cache)
    run_env.update(env)
    proc = subprocess.run([sys.executable, "-c", _PROBE, *(args or ("60",))], capture_output=True, text=True,
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


@pytest.mark.timeout(180)
@needs_ninja
def test_a_hanging_compiler_is_killed_at_the_deadline_once(tmp_path):
    pids = tmp_path / "pids"
    cc = script(tmp_path / "c++", f'echo $$ >> {pids}\nsleep 300 &\necho $! >> {pids}\nwait\n')
    report, _ = probe({"CXX": str(cc)}, "20", cache=tmp_path / "cache")
    assert 20 <= report["seconds"] < 38, report  # one deadline, not one per kernel or per call
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert f"{cc} did not finish native_" in report["warnings"][0] and "within 20 s" in report["warnings"][0]
    assert report["categories"] == ["NativeKernelWarning"]
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2  # the compiler ran once (one kernel): the shell and its sleep
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in started), "the compiler outlived the deadline (ninja puts it in a group of its own)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("var,kind", [("CXX", "missing"), ("CC", "relative"), ("CXX", "not-executable"),
                                      ("CC", "directory")])
def test_an_unusable_compiler_is_named_once_and_the_reference_runs(tmp_path, kind, var):
    cc = {"missing": "/nonexistent/cc", "relative": "rotationzoo-no-such-cc", "directory": str(tmp_path),
          "not-executable": str(tmp_path / "cc")}[kind]
    (tmp_path / "cc").write_text("#!/bin/sh\nexec g++ \"$@\"\n")  # not executable
    why = {"missing": "does not exist", "relative": "is not found on PATH", "directory": "is a directory",
           "not-executable": "is not executable"}[kind]
    report, _ = probe({var: cc})
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert f"{var}={cc!r} {why}; set {var} to a C++ compiler" in report["warnings"][0]
    assert report["files"] == ["<string>"]  # attributed to the caller, not to rotationzoo or torch
    assert report["reason"].startswith(f"{var}={cc!r} {why}")


@pytest.mark.timeout(240)
@needs_ninja
def test_a_failing_compiler_is_run_once_per_kernel_and_said_once_each(tmp_path):
    runs = tmp_path / "runs"
    cc = script(tmp_path / "c++", f'echo run >> {runs}\necho "cc1plus: error: no space left on device" >&2\nexit 3\n')
    report, _ = probe({"CXX": str(cc)}, cache=tmp_path / "cache")
    assert not report["decode"] and not report["quantize"]
    assert 2 <= len(runs.read_text().split()) <= 3  # one build per kernel (decode: two sources), not one per call
    assert sorted(report["warnings"]) == sorted(
        f"rotationzoo: CPU {what} runs the PyTorch reference (slower): C++ compiler {cc} failed on {src}: "
        f"exit status 3: cc1plus: error: no space left on device"
        for what, src in (("decode attention", "native_decode.cpp"), ("quantization", "native_quantize.cpp")))


@pytest.mark.timeout(240)
@needs_ninja
def test_a_compiler_that_fails_silently_is_named_by_its_exit_status(tmp_path):
    """A compiler that prints nothing: the warning read ``raise CalledProcessError(retcode, process.args,``
    (a line of torch's traceback) before."""
    cc = script(tmp_path / "c++", "exit 1\n")
    report, _ = probe({"CXX": str(cc)}, cache=tmp_path / "cache")
    assert sorted(report["warnings"]) == sorted(
        f"rotationzoo: CPU {what} runs the PyTorch reference (slower): C++ compiler {cc} failed on {src}: "
        f"exit status 1, no error message"
        for what, src in (("decode attention", "native_decode.cpp"), ("quantization", "native_quantize.cpp")))


#: What torch's extension tooling leaves in the build log when the compiler (CXX=a script that exits 1 silently)
#: fails: ninja's FAILED steps inside a Python traceback.
_SILENT_LOG = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 2893, in _run_ninja_build
    subprocess.run(
  File "/usr/lib/python3.11/subprocess.py", line 571, in run
    raise CalledProcessError(retcode, process.args,
subprocess.CalledProcessError: Command '['ninja', '-v', '-j', '2']' returned non-zero exit status 1.

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<string>", line 6, in <module>
  File "/venv/lib/python3.11/site-packages/torch/utils/cpp_extension.py", line 2910, in _run_ninja_build
    raise RuntimeError(message) from e
RuntimeError: Error building extension 'rz_quantize': [1/2] /tmp/failcc -c native_quantize.cpp -o native_quantize.o
FAILED: [code=1] native_quantize.o
/tmp/failcc -c native_quantize.cpp -o native_quantize.o
{said}ninja: build stopped: subcommand failed.
"""


@pytest.mark.parametrize("log,want", [
    (_SILENT_LOG.format(said=""), "exit status 1, no error message"),
    (_SILENT_LOG.format(said="In file included from x.h:1,\nx.cpp:3:5: error: 'foo' was not declared\n"),
     "exit status 1: x.cpp:3:5: error: 'foo' was not declared"),
    (_SILENT_LOG.format(said="/bin/sh: 1: /tmp/failcc: Permission denied\n").replace("[code=1]", "[code=126]"),
     "exit status 126: /bin/sh: 1: /tmp/failcc: Permission denied"),
    ("[1/2] c++ -c a.cpp\nFAILED: a.o\nc++ -c a.cpp\na.cpp:1:1: error: bad\nninja: build stopped\n",  # ninja < 1.12
     "a.cpp:1:1: error: bad"),
    ("Traceback (most recent call last):\n  File \"x\", line 1\n    raise OSError(2)\n"
     "OSError: [Errno 2] no such file\n", "OSError: [Errno 2] no such file"),  # torch's tooling failed
    ("", "no error message"),
])
def test_the_build_failure_names_the_compilers_status_and_first_error_never_a_traceback_line(log, want):
    from rotationzoo.kernels.native import _first_error

    assert _first_error(log) == want


@pytest.mark.timeout(240)
@needs_cxx
@needs_ninja
def test_a_library_without_its_symbol_falls_back_once(tmp_path):
    """What a C++ compiler without ``extern "C"`` gives: a library whose symbol is mangled (here: absent)."""
    cc = script(tmp_path / "c++", 'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; [ "$1" = -MF ] && dep=$2; shift; done\n'
                                  '[ -n "$dep" ] && : > "$dep"\n'
                                  'echo "extern \\"C\\" int rz_other(void) { return 0; }" > "$TMPDIR/e.cpp"\n'
                                  f'case "$out" in *.so) exec {GXX} -shared -fPIC "$TMPDIR/e.cpp" -o "$out";; '
                                  f'*) exec {GXX} -fPIC -c "$TMPDIR/e.cpp" -o "$out";; esac\n')
    report, _ = probe({"CXX": str(cc)}, cache=tmp_path / "cache")
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 2, report["warnings"]
    assert any("native_decode.cpp has no symbol rz_decode_int2" in w for w in report["warnings"])
    assert any("native_quantize.cpp has no symbol rz_quantize_uniform" in w for w in report["warnings"])


@pytest.mark.timeout(120)
def test_no_temporary_folder_falls_back_once(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    report, _ = probe({}, "30", str(not_a_folder), cache=tmp_path / "cache")
    assert not report["decode"] and not report["quantize"]
    assert len(report["warnings"]) == 1, report["warnings"]
    assert "no temporary folder for the compiler (Not a directory); set TMPDIR" in report["warnings"][0]


@pytest.mark.timeout(300)
@needs_cxx
@needs_ninja
def test_torch_tooling_builds_with_a_minimal_environment_once_and_the_cache_serves_the_next_process(tmp_path):
    """A C++ driver builds both kernels through torch's extension tooling; the compiler sees only the
    environment rotationzoo gives it and its path is logged; a second process loads the cached
    libraries without running the compiler."""
    dump = tmp_path / "env"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    dump.mkdir()  # one file per compiler run: ninja may run two at once
    script(bin_dir / "rz-test-c++", f'env > {dump}/run.$$\nexec {GXX} "$@"\n')
    env = {"CXX": "rz-test-c++", "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "CPATH": "/nonexistent", "ROTATIONZOO_PROBE_SECRET": "1"}
    report, err = probe(env, cache=tmp_path / "cache")
    assert report["warnings"] == [] and report["decode"] and report["quantize"], report
    runs = [p.read_text() for p in sorted(dump.iterdir())]
    assert len(runs) >= 3  # compile and link of each kernel
    for run in runs:
        seen = dict(line.split("=", 1) for line in run.splitlines() if "=" in line)
        assert set(seen) <= {"PATH", "TMPDIR", "LANG", "LC_ALL", "CXX", "MAX_JOBS", "TORCH_DONT_CHECK_COMPILER_ABI",
                             "PWD", "OLDPWD", "SHLVL", "_"}, sorted(seen)
        assert seen["LANG"] == "C" and "rotationzoo-native-" in seen["TMPDIR"]
    assert f"LOG rotationzoo: C++ compiler {bin_dir / 'rz-test-c++'} (from CXX='rz-test-c++')" in err
    libs = sorted(p.name for p in (tmp_path / "cache" / "kernels").iterdir())
    assert [n.split("-")[0] for n in libs] == ["rz_decode", "rz_quantize"], libs
    before = sorted(dump.iterdir())
    report, err = probe(env, cache=tmp_path / "cache")
    assert report["warnings"] == [] and report["decode"] and report["quantize"], report
    assert sorted(dump.iterdir()) == before, "the cached libraries were compiled again"
    assert "from the cache" in err


@pytest.mark.timeout(120)
def test_a_cached_library_others_may_write_is_not_loaded(tmp_path):
    """A library in the cache that another user could have replaced is ignored (built afresh instead)."""
    from rotationzoo.kernels import native

    lib = tmp_path / "kernels" / "rz_decode-x.so"
    lib.parent.mkdir(mode=0o700)
    lib.write_bytes(b"")
    lib.chmod(0o700)
    assert native._trusted(lib)
    lib.chmod(0o722)
    assert not native._trusted(lib)
    lib.chmod(0o700)
    lib.parent.chmod(0o777)
    assert not native._trusted(lib)
    lib.parent.chmod(0o700)
    link = tmp_path / "kernels" / "link.so"
    link.symlink_to(lib)
    assert not native._trusted(link)


def test_a_built_library_is_kept_only_in_a_folder_it_would_be_loaded_from_never_through_a_link(tmp_path):
    """A library is written into the cache's kernels folder only when that folder is a real one of this user
    that nobody else may write, through a new file (a name planted there is never written through)."""
    from rotationzoo.kernels import native

    built = tmp_path / "built.so"
    built.write_bytes(b"\x7fELF library")
    victim = tmp_path / "victim"
    victim.write_text("export IMPORTANT=1\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = tmp_path / "c1" / "kernels"
    linked.parent.mkdir()
    linked.symlink_to(outside)  # the kernels folder a link out of the cache
    assert not native._keep(str(built), linked, linked / "rz_decode-x.so") and list(outside.iterdir()) == []
    shared = tmp_path / "c2" / "kernels"
    shared.mkdir(parents=True)
    shared.chmod(0o777)  # a team cache: others may plant names in it
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (shared / f".rz_decode-x.so.{pid}.tmp").symlink_to(victim)
    assert not native._keep(str(built), shared, shared / "rz_decode-x.so")
    assert victim.read_text() == "export IMPORTANT=1\n" and not (shared / "rz_decode-x.so").exists()
    own = tmp_path / "c3" / "kernels"
    own.mkdir(parents=True, mode=0o700)
    (own / "rz_decode-x.so").symlink_to(victim)  # a link at the final name is replaced, not written through
    assert native._keep(str(built), own, own / "rz_decode-x.so")
    assert victim.read_text() == "export IMPORTANT=1\n" and (own / "rz_decode-x.so").read_bytes() == built.read_bytes()
    assert [p.name for p in own.iterdir()] == ["rz_decode-x.so"]


_FORK = r"""
import multiprocessing, sys, warnings
import torch
from rotationzoo.int2kv import Int2KVConfig
from rotationzoo.kernels import Int2KV, decode_attention_int2, native, quantize_int2
torch.set_num_threads(2)
cfg = Int2KVConfig(k_clip_ratio=0.96)
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 2, 3000, 64, generator=g)
q = torch.randn(2, 4, 1, 64, generator=g)
torch.randn(4_000_000).exp().sum()  # torch's OpenMP threads start in the parent
codes, sz = quantize_int2(x, config=cfg)
kv = Int2KV(x[:, :, :4], codes, sz, x[:, :, -4:])
want = decode_attention_int2(q, kv, kv, dtype=torch.float32)
print("C", native.native_available("decode"), native.native_available("quantize"), flush=True)

def child():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        c2, s2 = quantize_int2(x, config=cfg)
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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("native", ["1", "0"])
def test_a_child_forked_after_torch_and_the_c_kernels_ran_finishes(native):
    if native == "1" and (GXX is None or shutil.which("ninja") is None):
        pytest.skip("no C++ compiler or no ninja")
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env["ROTATIONZOO_NATIVE"] = native
    proc = subprocess.run([sys.executable, "-c", _FORK, "30"], capture_output=True, text=True, env=env, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"C {native == '1'} {native == '1'}" in proc.stdout
    assert "CHILD 0" in proc.stdout, proc.stdout + proc.stderr[-3000:]
