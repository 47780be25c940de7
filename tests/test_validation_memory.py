"""What reading and validating a rotation file costs: the cap ``max_bytes`` states is the real peak.

``max_bytes`` counts the tensors as stored, as loaded in fp32, and the fp64 working set of
``validate`` (which measures orthogonality chunk by chunk). Peaks are measured in a fresh process
from the kernel's high-water mark of resident memory, reset just before the measured call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rotationzoo import RotationSet, read_rotation, validate, write_rotation
from rotationzoo.files.schema import VALIDATION_CHUNK_BYTES, validation_chunks, validation_work_bytes
from rotationzoo.errors import RotationFileError
from rotationzoo.files.validation import nonfinite_counts, orthogonality_errors

from helpers import random_orthogonal

REPO = Path(__file__).resolve().parents[1]
#: What the allocator and torch may take beyond the tensors counted (page rounding, small buffers).
SLACK_MIB = 12
#: The same for validate alone, whose temporaries are few and large.
WORK_SLACK_MIB = 2


def peak(setup: str, measured: str) -> dict:
    """Run ``setup``, reset the resident-memory high-water mark, run ``measured``; report the rise."""
    code = f"""
import json, torch
torch.set_num_threads(1)
def status(key):
    return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)][0] * 1024
{setup}
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
base = status("VmRSS")
{measured}
print(json.dumps({{"rise_mib": (status("VmHWM") - base) / 2**20, "out": out}}))
"""
    # A fixed mmap threshold: glibc otherwise raises it after each large free, so later large
    # tensors come from the heap and freed ones stay resident, and the peak measures fragmentation
    # (seen from 40 to 60 MiB for one 48 MiB working set) rather than what the code holds.
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_errors(rot: torch.Tensor) -> list[float]:
    """``max|R Rᵀ − I|`` of each matrix, one at a time, the plain way."""
    out = []
    for m in rot.reshape(-1, rot.shape[-2], rot.shape[-1]):
        r = m.double()
        out.append(float((r @ r.T - torch.eye(r.shape[0], dtype=torch.float64)).abs().max()))
    return out


@pytest.fixture(scope="module")
def clear_refs_works() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:  # pragma: no cover - kernels without it
        pytest.skip(f"cannot reset the resident-memory high-water mark here ({exc})")


def test_chunked_errors_equal_the_plain_computation() -> None:
    # many small matrices (several chunks), one large matrix (row blocks), a broken and a NaN matrix
    small = random_orthogonal(70, 128, 3)
    small[5] += 1e-3 * torch.eye(128)
    small[41, 7, 9] = float("nan")
    assert validation_chunks(128, 70)[0] < 70  # really chunked
    got = orthogonality_errors(small)
    want = reference_errors(small)
    for i, (g, w) in enumerate(zip(got.tolist(), want)):
        assert (g != g and w != w) or abs(g - w) <= 1e-15, i
    assert nonfinite_counts(small).tolist() == [int(i == 41) for i in range(70)]
    big = random_orthogonal(1, 1024, 4)
    big[0, 1000, 3] += 5e-4  # in the last row block, off the diagonal block
    assert validation_chunks(1024, 1)[1] < 1024  # really blocked
    assert abs(float(orthogonality_errors(big)[0]) - reference_errors(big)[0]) <= 1e-15
    big[0, 1023, 1023] = float("inf")
    assert nonfinite_counts(big).tolist() == [1]
    report = validate(RotationSet(rotations=small, layer_ids=tuple(range(70))), raise_on_error=False)
    assert "layer 5: not orthogonal" in " ".join(report.problems)
    assert "layer 41: 1 non-finite values" in " ".join(report.problems)


def test_identical_matrices_are_measured_once() -> None:
    """Layers that share one stored matrix (as in a data-free Hadamard file, or a small hostile
    file declaring a thousand layers) cost one measurement; every layer still gets its result."""
    from rotationzoo.files.validation import _distinct, measure_matrices

    base = random_orthogonal(6, 32, 8)
    base[4] += 1e-3  # not orthogonal
    base[5, 1, 2] = float("inf")
    pattern = [i % 6 for i in range(40)]
    rot = base[pattern].contiguous()
    reps, group = _distinct(rot)
    assert len(reps) == 6 and [pattern[r] for r in reps] == list(range(6)) and [reps[g] % 6 for g in group] == pattern
    bad, err = measure_matrices(rot)
    want = reference_errors(rot)
    assert bad.tolist() == [int(p == 5) for p in pattern]
    assert all(abs(e - w) <= 1e-15 for e, w, p in zip(err.tolist(), want, pattern) if p != 5)
    report = validate(RotationSet(rotations=rot, layer_ids=tuple(range(40))), raise_on_error=False)
    not_orthogonal = sorted(int(x.split("layer ")[1].split(":")[0]) for x in report.problems if "not orthogonal" in x)
    non_finite = sorted(int(x.split("layer ")[1].split(":")[0]) for x in report.problems if "non-finite" in x)
    assert not_orthogonal == [i for i, p in enumerate(pattern) if p == 4]
    assert non_finite == [i for i, p in enumerate(pattern) if p == 5]


@pytest.mark.parametrize("count, d", [(32, 512), (64, 256)])
def test_validation_working_set_is_bounded(count: int, d: int, clear_refs_works) -> None:
    # 32 matrices of d = 512 (32 MiB): a whole-set fp64 check would take 4 × 64 MiB more; 64 of
    # d = 256 take several chunks, each of which must be freed before the next is made
    setup = f"""
from rotationzoo import RotationSet, validate
q, _ = torch.linalg.qr(torch.randn({count}, {d}, {d}, dtype=torch.float64))
rs = RotationSet(rotations=q.float().contiguous(), layer_ids=tuple(range({count})))
del q
validate(rs)  # warm up (thread pools, code paths)
"""
    r = peak(setup, "out = validate(rs).max_orthogonality_error")
    work = validation_work_bytes(d, count) / 2**20
    assert work <= VALIDATION_CHUNK_BYTES / 2**20
    assert r["out"] < 1e-5 and r["rise_mib"] <= work + WORK_SLACK_MIB, (r, work)


def test_reading_and_validating_stays_within_max_bytes(tmp_path: Path, clear_refs_works) -> None:
    n, d = 64, 256
    path = write_rotation(tmp_path / "k.pt", RotationSet(rotations=random_orthogonal(n, d, 5), layer_ids=tuple(range(n)),
                                                         eigenvalues=torch.rand(n, d)))
    stored = loaded = n * (d * d + d) * 4  # fp32 on disk, fp32 in memory
    need = stored + loaded + validation_work_bytes(d, n)
    with pytest.raises(RotationFileError, match=f"need {need} bytes to read and validate"):
        read_rotation(path, max_bytes=need - 1)
    setup = f"""
from rotationzoo import read_rotation, validate
validate(read_rotation({str(path)!r}, max_bytes={need}))  # warm up
"""
    r = peak(setup, f"out = validate(read_rotation({str(path)!r}, max_bytes={need})).num_layers")
    assert r["out"] == n and r["rise_mib"] <= need / 2**20 + SLACK_MIB, (r, need / 2**20)
