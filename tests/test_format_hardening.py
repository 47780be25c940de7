"""Hostile rotation files: refused before anything is materialised, with typed errors only."""

from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import rotationzoo.files.format as fmt
from rotationzoo import RotationSet, read_rotation, validate, write_rotation
from rotationzoo.errors import (
    InvalidRotationError,
    RotationFileError,
    TorchVersionError,
    UnsafeRotationFileError,
)
from rotationzoo.files.validation import verify_file

from helpers import random_orthogonal

REPO = Path(__file__).resolve().parents[1]


# -- crafting files ------------------------------------------------------------------------------


class FakeStorage:
    """Pickled as torch.save does: a persistent id naming a ``data/<key>`` record."""

    def __init__(self, key: str, numel: int, stype=torch.FloatStorage) -> None:
        self.key, self.numel, self.stype = key, numel, stype


class FakeTensor:
    """Pickled as torch.save pickles a dense tensor, with any offset, shape and stride."""

    def __init__(self, storage: FakeStorage, shape, stride, offset: int = 0) -> None:
        self.args = (storage, offset, tuple(shape), tuple(stride), False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, FakeStorage):
            return ("storage", obj.stype, obj.key, "cpu", obj.numel)
        return None


def torch_pickle(obj) -> bytes:
    import io

    buf = io.BytesIO()
    _TorchPickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def raw_zip(path: Path, members: list[tuple[str, int, int, int, bytes]], prefix: bytes = b"") -> Path:
    """A zip from ``(name, method, crc, uncompressed size, payload)``: payloads are written as given.

    ``prefix`` is written before the archive, whose offsets do not count it (a concatenated zip).
    """
    out, central = bytearray(), bytearray()
    for name, method, crc, usize, payload in members:
        n = name.encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, method, 0, 0x21, crc, len(payload),
                               usize, len(n), 0, 0, 0, 0, 0, len(out)) + n
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0x21, crc, len(payload), usize, len(n), 0)
        out += n + payload
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0)
    path.write_bytes(prefix + bytes(out + central + eocd))
    return path


def torch_zip(path: Path, obj, records: dict[str, bytes], extra: dict[str, bytes] | None = None) -> Path:
    """A torch.save-style archive around ``obj`` (pickled with FakeStorage/FakeTensor) and records."""
    files = {"archive/data.pkl": torch_pickle(obj), "archive/byteorder": b"little", "archive/version": b"3\n"}
    files.update({f"archive/data/{k}": v for k, v in records.items()})
    files.update(extra or {})
    return raw_zip(path, [(n, 0, zlib.crc32(b), len(b), b) for n, b in files.items()])


def rotation_dict(layers: dict) -> dict:
    return {"format_version": 1, "objective": "qqt_r_h_pbr", "source_grouping": "layer", "layers": layers}


def probe(path: Path, **kwargs) -> dict:
    """Read ``path`` in a fresh process allowed 2 GiB of address space beyond what torch and rotationzoo map
    when imported (a CUDA build of torch maps more than 2 GiB itself); its time, and its peak RSS above the
    process's RSS once imported (``rss_mib``: what reading took, whichever torch build is installed)."""
    code = f"""
import json, resource, sys, time
import torch
from rotationzoo import read_rotation
from rotationzoo.errors import RotationZooError
def status(key):
    return [int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)][0]
mapped = status("VmSize") << 10
resource.setrlimit(resource.RLIMIT_AS, (mapped + (2 << 30), mapped + (2 << 30)))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the RSS now
before = status("VmRSS")
t = time.perf_counter()
try:
    read_rotation({str(path)!r}, **{kwargs!r})
    outcome = "loaded"
except RotationZooError as exc:
    outcome = "refused: " + str(exc)
except BaseException as exc:
    outcome = "raw " + type(exc).__name__ + ": " + str(exc)[:300]
seconds = time.perf_counter() - t
print(json.dumps({{"outcome": outcome, "seconds": seconds, "rss_mib": (status("VmHWM") - before) / 1024}}))
"""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def no_torch_load(monkeypatch):
    """Fail the test if a refused file ever reaches torch.load."""

    def boom(*a, **k):
        raise AssertionError("torch.load reached")

    monkeypatch.setattr(torch, "load", boom)


# -- 1. nothing is allocated before the file is checked ------------------------------------------


def test_stride0_view_refused_fast_and_small(tmp_path: Path) -> None:
    bad = tmp_path / "k.pt"
    torch.save(rotation_dict({0: {"layer_id": 0, "rotation": torch.ones(1).expand(16384, 16384)}}), bad)
    assert bad.stat().st_size < 2048
    r = probe(bad)
    assert r["outcome"].startswith("refused: ") and "stride" in r["outcome"], r
    assert r["seconds"] < 2.0 and r["rss_mib"] < 100, r


def test_deflate_bomb_refused_fast_and_small(tmp_path: Path) -> None:
    # a 1 MB member that inflates to a 1 GiB storage, viewed by one 4x4 "rotation": refused for
    # being compressed at all (torch.save never compresses), before its declared size is even read
    numel = 1 << 28
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = comp.compress(bytes(1 << 20)) + comp.flush(zlib.Z_FULL_FLUSH)
    stream = chunk * 1024 + comp.flush()
    crc = 0
    for _ in range(1024):
        crc = zlib.crc32(bytes(1 << 20), crc)
    obj = rotation_dict({0: {"layer_id": 0, "rotation": FakeTensor(FakeStorage("0", numel), (4, 4), (4, 1))}})
    members = [("archive/data.pkl", 0, zlib.crc32(p := torch_pickle(obj)), len(p), p),
               ("archive/byteorder", 0, zlib.crc32(b"little"), 6, b"little"),
               ("archive/version", 0, zlib.crc32(b"3\n"), 2, b"3\n"),
               ("archive/data/0", 8, crc, numel * 4, stream)]
    bad = raw_zip(tmp_path / "k.pt", members)
    assert bad.stat().st_size < 2 << 20
    r = probe(bad)
    assert r["outcome"].startswith("refused: ") and "'data/0' is encrypted or compressed (method 8)" in r["outcome"], r
    assert r["seconds"] < 2.0 and r["rss_mib"] < 100, r


def _identity_archive(path: Path, method: int, layers: int = 16, d: int = 512) -> Path:
    """An archive of ``layers`` d × d identity rotations, one record each, stored or deflated."""
    record = torch.eye(d).numpy().tobytes()
    crc = zlib.crc32(record)
    payload = record if method == 0 else zlib.compress(record, 9)[2:-4]  # raw deflate, as zip holds it
    obj = rotation_dict({i: {"layer_id": i, "rotation": FakeTensor(FakeStorage(str(i), d * d), (d, d), (d, 1))}
                         for i in range(layers)})
    pkl = torch_pickle(obj)
    members = [("archive/data.pkl", 0, zlib.crc32(pkl), len(pkl), pkl),
               ("archive/byteorder", 0, zlib.crc32(b"little"), 6, b"little"),
               ("archive/version", 0, zlib.crc32(b"3\n"), 2, b"3\n")]
    members += [(f"archive/data/{i}", method, crc, len(record), payload) for i in range(layers)]
    return raw_zip(path, members)


def test_deflated_rotations_within_the_limits_refused_fast_and_small(tmp_path: Path) -> None:
    # 16 orthogonal 512 × 512 matrices (16 MiB, well within max_bytes) deflate to a few KB: such a
    # file was inflated, loaded and validated (seconds and hundreds of MiB for kilobytes on disk)
    bad = _identity_archive(tmp_path / "k.pt", method=8)
    assert bad.stat().st_size < 64 << 10
    r = probe(bad)
    assert r["outcome"].startswith("refused: ") and "is encrypted or compressed (method 8)" in r["outcome"], r
    assert "re-save it with torch.save" in r["outcome"]
    assert r["seconds"] < 1.0 and r["rss_mib"] < 100, r
    # the very same archive with stored members is a valid rotation file
    ok = _identity_archive(tmp_path / "ok.pt", method=0)
    rs = read_rotation(ok)
    assert rs.rotations.shape == (16, 512, 512) and validate(rs).ok
    # a stored member whose stored size differs from its size is refused too
    data = bytearray(ok.read_bytes())
    with zipfile.ZipFile(ok) as zf:
        info = zf.getinfo("archive/data/3")
    struct.pack_into("<I", data, info.header_offset + 18, info.compress_size - 1)  # local header
    cd = data.rindex(struct.pack("<I", 0x02014B50), 0, data.rindex(b"archive/data/3"))
    struct.pack_into("<I", data, cd + 20, info.compress_size - 1)  # central directory
    (tmp_path / "odd.pt").write_bytes(bytes(data))
    with pytest.raises(RotationFileError, match="'data/3' is encrypted or compressed"):
        read_rotation(tmp_path / "odd.pt")


@pytest.mark.parametrize(
    "tensor, pattern",
    [
        (torch.ones(1).expand(64, 64), "stride-0"),
        (torch.arange(64.0).as_strided((16, 16), (1, 1)), "overlapping"),
        (torch.zeros(1000, 1000)[:16, :16], "storage 0 holds 1000000 elements but its tensors use 256"),
        (torch.zeros(0, 0), "empty tensor"),
        (torch.zeros(2, 4, 4, 4), r"shape \(2, 4, 4, 4\)"),
        (torch.zeros(4, 4, 3), r"rotation must be \[d, d\], or \[H_kv, d, d\] per KV head; got \[4, 4, 3\]"),
    ],
)
def test_bad_views_refused_before_loading(tmp_path: Path, no_torch_load, tensor, pattern) -> None:
    bad = tmp_path / "k.pt"
    torch.save(rotation_dict({0: {"layer_id": 0, "rotation": tensor}}), bad)
    with pytest.raises(RotationFileError, match=pattern) as ei:
        read_rotation(bad)
    assert str(bad) in str(ei.value)


def test_too_many_layers_refused_before_loading(tmp_path: Path, no_torch_load) -> None:
    one = torch.ones(1, 1)
    bad = tmp_path / "k.pt"
    torch.save(rotation_dict({i: {"layer_id": i, "rotation": one} for i in range(3000)}), bad)
    with pytest.raises(RotationFileError, match="max_layers=1024"):
        read_rotation(bad)


def test_one_stored_matrix_for_many_layers_is_bounded(tmp_path: Path, no_torch_load) -> None:
    # 16 KiB stored, but 200 layers share it: loading stacks 3.3 MB (3276800 bytes)
    eye = torch.eye(64)
    bad = tmp_path / "k.pt"
    torch.save(rotation_dict({i: {"layer_id": i, "rotation": eye} for i in range(200)}), bad)
    assert bad.stat().st_size < 64 * 64 * 4 * 2
    # 16384 bytes stored once, 200 × 64² × 4 loaded in fp32, plus validation's working set
    with pytest.raises(RotationFileError, match=r"200 layers of \[64, 64\] need \d+ bytes to read and validate \(16384 "
                                                r"stored, 3276800 loaded in fp32, \d+ to validate\), more than "
                                                r"max_bytes=1000000"):
        read_rotation(bad, max_bytes=1_000_000)


def test_oversized_members_refused(tmp_path: Path, no_torch_load) -> None:
    eye = torch.eye(4).flatten().numpy().tobytes()
    obj = rotation_dict({0: {"layer_id": 0, "rotation": FakeTensor(FakeStorage("0", 16), (4, 4), (4, 1))}})
    bad = torch_zip(tmp_path / "a.pt", obj, {"0": eye}, extra={"archive/notes": bytes(2 << 20)})
    with pytest.raises(RotationFileError, match="'notes' declares 2097152 bytes"):
        read_rotation(bad)
    # a record larger than its storage declares, and one no tensor uses
    bad = torch_zip(tmp_path / "b.pt", obj, {"0": eye + bytes(64)})
    with pytest.raises(RotationFileError, match="storage 0 declares 64 bytes, its record is 128 bytes"):
        read_rotation(bad)
    bad = torch_zip(tmp_path / "c.pt", obj, {"0": eye, "1": bytes(64)})
    with pytest.raises(RotationFileError, match="records no tensor uses"):
        read_rotation(bad)


def test_crafted_archive_within_limits_loads(tmp_path: Path) -> None:
    eye = torch.eye(4).flatten().numpy().tobytes()
    obj = rotation_dict({0: {"layer_id": 0, "rotation": FakeTensor(FakeStorage("0", 16), (4, 4), (4, 1))}})
    ok = torch_zip(tmp_path / "ok.pt", obj, {"0": eye})
    assert torch.equal(read_rotation(ok).rotations[0], torch.eye(4))


def test_zip_layout_tricks_refused(tmp_path: Path, no_torch_load) -> None:
    eye = torch.eye(4).flatten().numpy().tobytes()
    obj = rotation_dict({0: {"layer_id": 0, "rotation": FakeTensor(FakeStorage("0", 16), (4, 4), (4, 1))}})
    ok = torch_zip(tmp_path / "ok.pt", obj, {"0": eye})
    files = {i.filename: zipfile.ZipFile(ok).read(i.filename) for i in zipfile.ZipFile(ok).infolist()}
    members = [(n, 0, zlib.crc32(b), len(b), b) for n, b in files.items()]
    bad = raw_zip(tmp_path / "prefixed.pt", members, prefix=b"PK\x03\x04" + bytes(60))
    with pytest.raises(RotationFileError, match="data before its first member"):
        read_rotation(bad)
    bad = tmp_path / "comment.pt"
    bad.write_bytes(ok.read_bytes()[:-2] + b"\x04\x00abcd")  # EOCD comment length 4
    with pytest.raises(RotationFileError, match="a zip with a comment"):
        read_rotation(bad)
    bad = raw_zip(tmp_path / "dup.pt", members + members[-1:])
    with pytest.raises(RotationFileError, match="twice"):
        read_rotation(bad)
    bad = raw_zip(tmp_path / "two.pt", members + [("other/x", 0, 0, 0, b"")])
    with pytest.raises(RotationFileError, match="expected one folder with data.pkl"):
        read_rotation(bad)


def zip_directory_bomb(path: Path, listed: int, declared: int, *, zip64: bool = False) -> Path:
    """A ``.pt``-looking zip whose central directory lists ``listed`` tiny entries and whose end record
    (a ZIP64 one when ``zip64``) declares ``declared``: 55 bytes on disk per entry, a ``ZipInfo`` each in zipfile."""
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0, 0, 0, 0, 10, 0) + b"k/data.pkl"
    central = b"".join(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0)
                       + b"k/%07d" % i for i in range(listed))
    if zip64:
        tail = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, declared, declared, len(central),
                           len(local)) + struct.pack("<4sLQL", b"PK\x06\x07", 0, len(local) + len(central), 1)
        tail += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        tail = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, declared, declared, len(central), len(local), 0)
    path.write_bytes(local + central + tail)
    return path


@pytest.mark.parametrize("listed,declared,zip64,match", [
    (50_000, 0xFFFF, False, r"the zip archive declares 65535 members, more than the 6160 a rotation file may hold"),
    (10, 1_000_000, True, r"the zip archive declares 1000000 members, more than the 6160"),
    (50_000, 1, False, r"its zip central directory of 2750000 bytes is too large for the 1 member it declares"),
    (50_000, 100, True, r"its zip central directory of 2750000 bytes is too large for the 100 members"),
    (50_000, 6000, False, r"its zip central directory lists more entries than the 6000 it declares"),
])
def test_zip_directory_bomb_refused_from_its_end_record(tmp_path: Path, no_torch_load, listed: int, declared: int,
                                                        zip64: bool, match: str) -> None:
    """A zip listing 50,000 entries (a million in 55 MB took 10 s and 1.1 GB) is refused from its end record and a
    count of its directory, before zipfile builds a ZipInfo per entry: in milliseconds, with O(1) memory."""
    import time
    import tracemalloc

    from rotationzoo.files.artefacts import identify_torch_file

    def refuse() -> str:
        with pytest.raises(RotationFileError, match=match) as ei:
            read_rotation(bomb)
        assert identify_torch_file(bomb) is None  # the second look, at what the file is, stops there too
        return str(ei.value)

    bomb = zip_directory_bomb(tmp_path / "k_rotation.pt", listed, declared, zip64=zip64)
    t0 = time.perf_counter()
    msg = refuse()
    seconds = time.perf_counter() - t0
    assert "\n" not in msg and "refused before loading" in msg
    assert seconds < 0.5, f"took {seconds:.2f} s"  # zipfile: 50,000 ZipInfo, twice: 5 s
    tracemalloc.start()
    try:
        refuse()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse it"  # zipfile: ~500 bytes per entry


def test_colliding_dict_keys_refused_fast(tmp_path: Path, no_torch_load) -> None:
    # tuple hashes can be made to collide at will, which makes building a dict quadratic
    layers = {(i, i): {"rotation": FakeTensor(FakeStorage("0", 16), (4, 4), (4, 1))} for i in range(3)}
    bad = torch_zip(tmp_path / "k.pt", rotation_dict(layers), {"0": torch.eye(4).numpy().tobytes()})
    with pytest.raises(RotationFileError, match="a dict key of type tuple"):
        read_rotation(bad)
    layers = {2**70: {"rotation": FakeTensor(FakeStorage("0", 16), (4, 4), (4, 1))}}  # collide modulo 2**61-1
    bad = torch_zip(tmp_path / "k.pt", rotation_dict(layers), {"0": torch.eye(4).numpy().tobytes()})
    with pytest.raises(RotationFileError, match="a dict key of type int"):
        read_rotation(bad)


def test_limits_and_expectations(tmp_path: Path) -> None:
    rs = RotationSet(rotations=random_orthogonal(3, 64), layer_ids=(0, 1, 2), objective="x")
    path = write_rotation(tmp_path / "k.pt", rs)
    assert read_rotation(path).head_dim == 64
    with pytest.raises(RotationFileError, match="exceeds max_head_dim=32"):
        read_rotation(path, max_head_dim=32)
    with pytest.raises(RotationFileError, match="max_layers=2"):
        read_rotation(path, max_layers=2)
    with pytest.raises(RotationFileError, match="max_bytes=1000"):
        read_rotation(path, max_bytes=1000)
    with pytest.raises(RotationFileError, match="head_dim 64, but the model needs 128"):
        read_rotation(path, head_dim=128)
    with pytest.raises(RotationFileError, match="the model's head_dim is 32"):
        read_rotation(path, head_dim=32)
    with pytest.raises(RotationFileError, match="the model has 2 layers"):
        read_rotation(path, num_layers=2)
    assert read_rotation(path, head_dim=64, num_layers=3).num_layers == 3
    report = verify_file(path, head_dim=32)
    assert not report.ok and "head_dim is 32" in report.problems[0]
    # stored + loaded + a companion's room, plus validation's fp64 copy, product and mask of the 36 matrices
    assert fmt.make_limits(head_dim=128, num_layers=36).max_bytes == 36 * (128 * 128 + 128) * 16 + 36 * 17 * 128 * 128


def test_views_of_a_stacked_tensor_still_load(tmp_path: Path) -> None:
    rots, eig = random_orthogonal(4, 16), torch.rand(4, 16)
    path = tmp_path / "k.pt"
    torch.save(rotation_dict({i: {"layer_id": i, "rotation": rots[i], "eigenvalues": eig[i]} for i in range(4)}), path)
    rs = read_rotation(path)
    assert torch.equal(rs.rotations, rots) and torch.equal(rs.eigenvalues, eig)
    torch.save(rotation_dict({i: {"layer_id": i, "rotation": rots[i].T} for i in range(4)}), path)
    assert torch.equal(read_rotation(path).rotations, rots.transpose(1, 2))


def _safetensors(path: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def test_safetensors_header_checked_before_reading(tmp_path: Path, monkeypatch) -> None:
    import safetensors

    def boom(*a, **k):
        raise AssertionError("safe_open reached")

    monkeypatch.setattr(safetensors, "safe_open", boom)
    meta = {"__metadata__": {"format_version": "1"}}
    cases = [
        ({"rotation.0": {"dtype": "F32", "shape": [16384, 16384], "data_offsets": [0, 1 << 30]}}, "max_head_dim"),
        ({"rotation.0": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 1 << 40]}}, "data_offsets"),
        ({"rotation.0": {"dtype": "F32", "shape": [4, -4], "data_offsets": [0, 64]}}, "empty tensor"),
        ({"rotation.0": {"dtype": "F32", "shape": [2, 4, 4, 4], "data_offsets": [0, 512]}}, r"shape \(2, 4, 4, 4\)"),
        ({"rotation.0": {"dtype": "X9", "shape": [4, 4], "data_offsets": [0, 64]}}, "damaged safetensors entry"),
        ({f"rotation.{i}": {"dtype": "F32", "shape": [1, 1], "data_offsets": [4 * i, 4 * i + 4]}
          for i in range(7000)}, "max_layers=1024"),
    ]
    for i, (header, pattern) in enumerate(cases):
        bad = _safetensors(tmp_path / f"{i}.safetensors", {**meta, **header}, bytes(64))
        with pytest.raises(RotationFileError, match=pattern):
            read_rotation(bad)
    bad = tmp_path / "huge.safetensors"
    bad.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(RotationFileError):
        read_rotation(bad)


# -- 2. only typed errors escape -----------------------------------------------------------------


def _nested(depth: int):
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


@pytest.mark.parametrize(
    "obj, pattern",
    [
        (rotation_dict({float("inf"): {"rotation": torch.eye(4)}}), "layer key inf is not an integer"),
        ({**rotation_dict({0: {"rotation": torch.eye(4)}}), "objective": _nested(1000)}, "'objective' must be a string"),
        ({"format_version": _nested(1000), "layers": {0: {"rotation": torch.eye(4)}}}, "unknown format_version"),
        (rotation_dict({0: {"rotation": torch.zeros(0, 0)}}), "empty tensor"),
        (rotation_dict({0: {"rotation": torch.eye(4).to_sparse()}}), "tensor kind rotation files do not use"),
        (rotation_dict({0: {"rotation": torch.eye(4, dtype=torch.complex64)}}), "not floating point"),
        ({"format_version": 2**2000, "layers": {0: {"rotation": torch.eye(4)}}}, "newer format version"),
        ({"format_version": 10**5000, "layers": {0: {"rotation": torch.eye(4)}}}, "opcode LONG4"),
    ],
)
def test_hostile_content_gives_typed_errors(tmp_path: Path, obj, pattern) -> None:
    path = tmp_path / "x.pt"
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)  # pickling the 1000-deep values recurses
    try:
        torch.save(obj, path)
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(RotationFileError, match=pattern):
        read_rotation(path)
    report = verify_file(path)
    assert not report.ok and report.problems


def test_validate_never_raises_raw() -> None:
    rs = RotationSet(rotations=torch.zeros(2, 0, 0), layer_ids=(0, 1))
    with pytest.raises(InvalidRotationError, match="empty"):
        validate(rs)
    rs = RotationSet(rotations=torch.eye(4).expand(2, 4, 4).to_sparse(), layer_ids=(0, 1))
    with pytest.raises(InvalidRotationError, match="dense"):
        validate(rs)
    rs = RotationSet(rotations=random_orthogonal(2, 8), layer_ids=(0, 1), eigenvalues=torch.ones(2, 8).to_sparse())
    assert not validate(rs, raise_on_error=False).ok
    with pytest.raises(RotationFileError, match="layer ids must be integers"):
        RotationSet(rotations=random_orthogonal(1, 8), layer_ids=(1.9,))


def test_verify_file_reports_instead_of_raising(tmp_path: Path) -> None:
    good = write_rotation(tmp_path / "k.pt", RotationSet(rotations=random_orthogonal(2, 16), layer_ids=(0, 1)))
    data = bytearray(good.read_bytes())
    for offset in range(0, len(data), max(1, len(data) // 50)):
        bad = bytearray(data)
        bad[offset] ^= 0xFF
        path = tmp_path / "bad.pt"
        path.write_bytes(bytes(bad))
        report = verify_file(path)  # must not raise
        assert report.ok or report.problems


# -- 3. torch version ----------------------------------------------------------------------------


def test_old_torch_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = write_rotation(tmp_path / "k.pt", RotationSet(rotations=random_orthogonal(1, 8), layer_ids=(0,)))
    fmt.check_torch_version("2.6.0")
    fmt.check_torch_version("2.13.0+cpu")
    with pytest.raises(TorchVersionError, match=r"torch 2.5.1 is older than 2.6.*CVE-2025-32434"):
        fmt.check_torch_version("2.5.1")
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(TorchVersionError, match="torch>=2.6"):
        read_rotation(path)
    report = verify_file(path)
    assert not report.ok and "CVE-2025-32434" in report.problems[0]
    text = (REPO / "pyproject.toml").read_text()
    assert '"torch>=2.6"' in text


# -- 4. layer keys -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [1.9, True, "١", " 1", "+1", "01", "1\n", -1, b"1", None])
def test_loose_layer_keys_refused(tmp_path: Path, key) -> None:
    path = tmp_path / "x.pt"
    torch.save(rotation_dict({key: {"rotation": torch.eye(4)}}), path)
    with pytest.raises(RotationFileError, match="layer key .* is not an integer layer index") as ei:
        read_rotation(path)
    assert repr(key)[:10] in str(ei.value)


def test_layer_key_must_match_layer_id(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save(rotation_dict({3: {"layer_id": 4, "rotation": torch.eye(4)}}), path)
    with pytest.raises(RotationFileError, match="layer key 3 disagrees with its layer_id 4"):
        read_rotation(path)
    torch.save(rotation_dict({3: {"layer_id": 3, "rotation": torch.eye(4)}, "3": {"rotation": torch.eye(4)}}), path)
    with pytest.raises(RotationFileError, match="layer 3 appears twice"):
        read_rotation(path)
    torch.save(rotation_dict({"12": {"layer_id": 12, "rotation": torch.eye(4)}, 0: {"rotation": torch.eye(4)}}), path)
    assert read_rotation(path).layer_ids == (0, 12)


def test_safetensors_layer_names_are_strict(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    for name in ("rotation.١", "rotation.-1", "rotation.01"):
        path = tmp_path / "x.safetensors"
        save_file({name: torch.eye(4)}, str(path))
        with pytest.raises(RotationFileError, match="unexpected tensor"):
            read_rotation(path)


# -- 5. the unsafe-pickle message ----------------------------------------------------------------


class _System:
    def __reduce__(self):
        return (os.system, ("true",))


def test_pickle_protocol_torch_cannot_read_is_refused_plainly(tmp_path: Path, no_torch_load) -> None:
    path = tmp_path / "k.pt"
    torch.save(rotation_dict({0: {"rotation": torch.eye(4)}}), path, pickle_protocol=4)
    with pytest.raises(RotationFileError, match="opcode FRAME, which torch.load.weights_only=True. does not read") as ei:
        read_rotation(path)
    assert not isinstance(ei.value, UnsafeRotationFileError)


@pytest.mark.parametrize("protocol", [2, 4])
def test_unsafe_message_names_the_global(tmp_path: Path, protocol: int) -> None:
    path = tmp_path / "k.pt"
    torch.save(rotation_dict({0: {"rotation": torch.eye(4), "x": _System()}}), path, pickle_protocol=protocol)
    with pytest.raises(UnsafeRotationFileError) as ei:
        read_rotation(path)
    msg = str(ei.value)
    assert f"'{os.system.__module__}.system'" in msg and "weights_only" not in msg and str(path) in msg
    assert "\n" not in msg


# -- 6. what a file holds beside the rotations, and in what precision ---------------------------------


@pytest.mark.parametrize("extra", [{"k_mean": torch.zeros(2, 8)}, {"q_rotation": torch.eye(8)},
                                   {"stats": {"keys": torch.ones(2)}}, {"stats": [1, torch.ones(2)]}])
def test_an_unknown_tensor_beside_the_layers_is_refused(tmp_path: Path, extra: dict) -> None:
    """The rule a layer's fields follow holds at the top level too: a tensor this release does not know may
    change what the rotations mean (a top-level ``k_mean [L, d]`` would be ignored by every loader)."""
    layers = {i: {"rotation": r.clone()} for i, r in enumerate(random_orthogonal(2, 8))}
    path = tmp_path / "k.pt"
    torch.save({**rotation_dict(layers), **extra}, path)
    key = next(iter(extra))
    with pytest.raises(RotationFileError, match=f"holds a tensor '{key}' beside 'layers', which this rotationzoo "
                                                f"does not know"):
        read_rotation(path)
    report = verify_file(path)
    assert not report.ok and any(f"'{key}'" in p for p in report.problems)


def test_plain_values_beside_the_rotations_are_metadata(tmp_path: Path) -> None:
    r = random_orthogonal(2, 8)
    layers = {i: {"layer_id": i, "rotation": r[i].clone(), "note": "calibrated"} for i in range(2)}
    path = tmp_path / "k.pt"
    torch.save({**rotation_dict(layers), "note": "fitted on a laptop", "stats": {"tokens": 30000}}, path)
    assert torch.equal(read_rotation(path).rotations, r) and verify_file(path).ok
    torch.save(rotation_dict({0: {"rotation": r[0].clone(), "extra": {"x": torch.ones(2)}}}), path)
    with pytest.raises(RotationFileError, match="layer 0 holds a tensor 'extra'"):
        read_rotation(path)


@pytest.mark.parametrize("dtype, name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_a_rotation_stored_in_16_bits_is_refused_naming_its_dtype(tmp_path: Path, dtype, name: str) -> None:
    """16 bits cannot hold an orthogonal matrix to the 1e-5 tolerance: the message says so, not only
    'not orthogonal'; a tolerance loose enough for it still accepts it (the file stays readable and checkable);
    a matrix whose entries are exact in 16 bits (a Hadamard) passes."""
    r = random_orthogonal(2, 64)
    path = tmp_path / "k.pt"
    torch.save(rotation_dict({0: {"rotation": r[0].clone()}, 1: {"rotation": r[1].to(dtype)}}), path)
    pattern = (rf"layer 1: not orthogonal, max\|RRᵀ−I\| = .* > 1e-05: rotation is stored as {name}, too coarse to "
               rf"hold an orthogonal matrix \(max\|RRᵀ−I\| = .* > 1e-05 in {name}\); store rotations in float32 or float64")
    rs = read_rotation(path)
    with pytest.raises(InvalidRotationError, match=pattern) as ei:
        validate(rs)
    assert "\n" not in str(ei.value)
    report = verify_file(path)
    assert not report.ok and any(f"stored as {name}" in p for p in report.problems)
    assert verify_file(path, atol=1e-2).ok  # the tolerance decides, as for any file
    from rotationzoo.hadamard import hadamard_matrix

    h = hadamard_matrix(64, dtype=torch.float32)  # entries ±1/8, exact in 16 bits
    torch.save(rotation_dict({0: {"rotation": h.to(dtype)}}), path)
    assert torch.equal(read_rotation(path).rotations[0], h) and verify_file(path).ok
    # a non-orthogonal transform (its inverse carried as q_rotation) is not measured against RRᵀ = I
    a = torch.diag(torch.linspace(0.5, 2.0, 8)) @ random_orthogonal(1, 8)[0]
    v3 = {**rotation_dict({0: {"rotation": a.to(dtype), "q_rotation": torch.linalg.inv(a).T}}), "format_version": 3}
    torch.save(v3, path)
    assert not read_rotation(path).orthogonal
