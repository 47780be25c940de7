"""Hostile and degenerate Q/K/V dumps: refused with one typed line, quickly, before anything is written.

Every case builds its dump from a small valid one, breaks one thing, and checks that ``fit_rotations``
(and, for a few, ``rotationzoo fit``) refuses it with a ``RotationZooError`` whose message is one line
naming the problem. Cases decided from metadata alone must be refused within ``FAST`` seconds; the
few that need the data itself (NaN, all-zero or rank-deficient activations) within ``DATA``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import struct
import threading
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from rotationzoo.errors import DumpError, FitError, RotationZooError
from rotationzoo.fit import DumpLimits, fit_rotations, open_dump, refine_dump, samples_from_dump, write_dump
from rotationzoo.fit.dump_schema import inspect_chunk
from rotationzoo.fit.fitter import DEFAULT_MIN_TOKENS
from rotationzoo.recipe import Refinement

from test_fit import make_dump
from test_format_hardening import FakeStorage, FakeTensor, torch_pickle, torch_zip

FAST = 1.0  # seconds: refused from metadata, before any activation is read
DATA = 3.0  # seconds: refused after reading a small dump's activations (2 cores, shared)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers, 8 query / 2 KV heads, d = 64, chunks of 6 (warm-up), 200, 173 and 150 tokens."""
    return make_dump(tmp_path_factory.mktemp("good") / "dump", hq=8, hkv=2, d=64)


@pytest.fixture
def dump(good: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good dump to break."""
    return Path(shutil.copytree(good, tmp_path / "dump", symlinks=True))


def refused(call: Callable[[], Any], match: str, limit: float = FAST, error: type = RotationZooError,
            unblock: Path | None = None) -> str:
    """Run ``call`` (in a thread, so that a read that blocks fails the test instead of hanging it) and
    return its one-line refusal, checking type, message and time."""
    box: dict[str, Any] = {}

    def target() -> None:
        t0 = time.perf_counter()
        try:
            call()
            box["result"] = "no error"
        except BaseException as exc:  # noqa: BLE001 - inspected below
            box["exc"] = exc
        box["seconds"] = time.perf_counter() - t0

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(max(10.0, 5 * limit))
    if th.is_alive():
        if unblock is not None:  # let the blocked reader see EOF, so the thread ends
            os.close(os.open(unblock, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"still running after {max(10.0, 5 * limit)} s (blocked?)")
    exc = box.get("exc")
    assert exc is not None, f"accepted: {box.get('result')}"
    assert isinstance(exc, error), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    assert "\n" not in msg and msg.strip() == msg, msg
    assert re.search(match, msg), msg
    assert box["seconds"] < limit, f"took {box['seconds']:.2f} s: {msg}"
    return msg


def fit(root: Path, **kw: Any) -> Callable[[], Any]:
    return lambda: fit_rotations(root, **kw)


def layer_chunks(n_sizes: list[int], *, q: Callable[[int], torch.Tensor] | None = None,
                 k: Callable[[int], torch.Tensor] | None = None, v: Callable[[int], torch.Tensor] | None = None,
                 hq: int = 4, hkv: int = 2, d: int = 64, seed: int = 0) -> list[dict]:
    """Chunks of random activations, with any kind replaced by ``kind(n)``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in n_sizes:
        out.append({"q": q(n) if q else torch.randn(n, hq, d, generator=g),
                    "k": k(n) if k else torch.randn(n, hkv, d, generator=g),
                    "v": v(n) if v else torch.randn(n, hkv, d, generator=g)})
    return out


# -- files that are not what they claim ----------------------------------------------------------


def test_fifo_chunk_is_refused_without_blocking(dump):
    f = dump / "layer_0" / "k" / "2.pt"
    f.unlink()
    os.mkfifo(f)
    refused(fit(dump), r"layer_0/k/2\.pt: not a regular file \(a FIFO\)", unblock=f)
    # one swapped in after the folder was listed is opened with O_NONBLOCK, then refused as well
    refused(lambda: inspect_chunk(f, str(f), "k", DumpLimits()), "not a regular file", unblock=f)


def test_fifo_seq_lens_and_metadata_are_refused_without_blocking(dump):
    f = dump / "layer_1" / "seq_lens" / "1.pt"
    f.unlink()
    os.mkfifo(f)
    refused(fit(dump), r"seq_lens/1\.pt: not a regular file \(a FIFO\)", unblock=f)
    f.unlink()
    torch.save(torch.tensor([100, 100], dtype=torch.int32), f)
    info = dump / "rotationzoo_dump.json"
    os.mkfifo(info)
    refused(fit(dump), r"rotationzoo_dump\.json: not a regular file \(a FIFO\)", unblock=info)


def test_socket_chunk_is_refused(dump, tmp_path):
    short = Path(os.path.realpath("/tmp")) / f"rz-sock-{os.getpid()}"
    shutil.rmtree(short, ignore_errors=True)
    shutil.copytree(dump, short)
    try:
        f = short / "layer_1" / "v" / "3.pt"
        f.unlink()
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(f))
        try:
            refused(fit(short), r"v/3\.pt: not a regular file \(a socket\)")
        finally:
            s.close()
    finally:
        shutil.rmtree(short, ignore_errors=True)


def test_links_that_leave_the_dump_are_refused(dump, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    torch.save(torch.randn(173, 2, 64).bfloat16(), outside / "x.pt")
    chunk = dump / "layer_0" / "k" / "2.pt"
    chunk.unlink()
    chunk.symlink_to(outside / "x.pt")
    refused(fit(dump), r"layer_0/k/2\.pt: chunk file resolves to .*outside the dump folder")
    chunk.unlink()
    chunk.symlink_to("/dev/zero")
    refused(fit(dump), r"resolves to /dev/zero, outside the dump folder")
    chunk.unlink()
    torch.save(torch.randn(173, 2, 64).bfloat16(), chunk)
    # a whole layer folder, and a kind folder, linked from outside
    shutil.move(str(dump / "layer_1"), str(outside / "layer_1"))
    (dump / "layer_1").symlink_to(outside / "layer_1")
    refused(lambda: open_dump(dump), r"layer_1: layer folder resolves to .*outside the dump folder")
    (dump / "layer_1").unlink()
    shutil.move(str(outside / "layer_1"), str(dump / "layer_1"))
    shutil.move(str(dump / "layer_1" / "v"), str(outside / "v"))
    (dump / "layer_1" / "v").symlink_to(outside / "v")
    refused(fit(dump), r"layer_1/v: v/ folder resolves to .*outside the dump folder")
    info = dump / "rotationzoo_dump.json"
    (outside / "info.json").write_text("{}")
    info.symlink_to(outside / "info.json")
    refused(lambda: open_dump(dump).info(), r"metadata file resolves to .*outside")


def test_links_inside_the_dump_are_followed(dump):
    """A layer folder linked to another layer of the same dump is fitted (no refusal for that)."""
    shutil.rmtree(dump / "layer_1")
    (dump / "layer_1").symlink_to("layer_0")
    res = fit_rotations(dump)
    assert torch.equal(res.k.rotations[0], res.k.rotations[1])


@pytest.mark.parametrize("content,match", [
    (b"hello, I am a text file\n", r"cannot read: not a torch\.save archive \(it starts with b'hell'"),
    (b"", r"empty file"),
    (b"PK\x03\x04 truncated", r"cannot read: damaged zip archive"),
])
def test_text_and_foreign_files_posing_as_chunks(dump, content, match):
    for name in ("1.pt", "0.pt"):  # chunk 0 is skipped by the fit, but checked all the same
        f = dump / "layer_0" / "q" / name
        f.write_bytes(content)
        refused(fit(dump), rf"layer_0/q/{name[0]}\.pt: {match}")
        torch.save(torch.randn(6 if name == "0.pt" else 200, 8, 64).bfloat16(), f)
    assert fit_rotations(dump).tokens == {0: 523, 1: 523}


def test_torch_files_that_are_not_one_tensor(dump):
    f = dump / "layer_0" / "q" / "1.pt"
    torch.save({"q": torch.randn(200, 8, 64)}, f)
    refused(fit(dump), r"layer_0/q/1\.pt: expected a tensor \[n, heads, head_dim\], got dict")
    torch.save([torch.randn(200, 8, 64), torch.randn(200, 8, 64)], f)
    refused(fit(dump), r"more than 1 tensors")
    torch.save(torch.randn(200, 8, 64, 1), f)
    refused(fit(dump), r"refused before loading: a tensor of shape \(200, 8, 64, 1\)")
    torch.save(torch.randn(200, 8 * 64), f)
    refused(fit(dump), r"expected a tensor \[n, heads, head_dim\], got shape \(200, 512\)")


def test_compressed_or_truncated_members_are_refused(dump):
    f = dump / "layer_1" / "k" / "3.pt"
    t = torch.randn(150, 2, 64).bfloat16()
    torch.save(t, f)
    with zipfile.ZipFile(f) as zin:
        members = [(i.filename, zin.read(i)) for i in zin.infolist()]
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for name, data in members:
            zout.writestr(name, data)
    refused(fit(dump), r"k/3\.pt: refused before loading: member .* is compressed")
    # the archive claims a record far longer than the file (memory-mapped, it would fault on first use)
    numel = 1 << 24
    obj = FakeTensor(FakeStorage("0", numel, torch.BFloat16Storage), (numel // 128, 2, 64), (128, 64, 1))
    files = {"archive/data.pkl": torch_pickle(obj), "archive/byteorder": b"little", "archive/version": b"3\n",
             "archive/data/0": bytes(1000)}
    out, central = bytearray(), bytearray()
    for name, payload in files.items():
        n, crc = name.encode(), zlib.crc32(payload)
        size = numel * 2 if name.endswith("data/0") else len(payload)
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0x21, crc, size, size, len(n),
                               0, 0, 0, 0, 0, len(out)) + n
        out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0x21, crc, size, size, len(n), 0) + n + payload
    eocd = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(files), len(files), len(central), len(out), 0)
    f.write_bytes(bytes(out + central + eocd))
    refused(fit(dump), r"k/3\.pt: refused before loading: member 'archive/data/0' extends past the end of the file")


def test_zip_directory_bomb_chunk_is_refused_from_its_end_record(dump):
    """A chunk whose zip directory lists 50,000 entries (a million took `fit --dump` 10 s and 723 MB) is refused
    from the zip's end record before zipfile parses the directory, with O(1) memory."""
    import tracemalloc

    from test_format_hardening import zip_directory_bomb

    zip_directory_bomb(dump / "layer_0" / "q" / "1.pt", 50_000, 0xFFFF)
    match = (r"layer_0/q/1\.pt: refused before loading: the zip archive declares 65535 members, more than the 17 a "
             r"Q/K/V dump file may hold")
    refused(fit(dump), match, error=DumpError)  # within FAST
    tracemalloc.start()
    try:
        refused(fit(dump), match, limit=10 * FAST, error=DumpError)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated to refuse it"  # zipfile: ~500 bytes per entry


def test_unsafe_pickles_are_refused_before_loading(dump):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > /dev/null",))

    torch.save({"x": Evil()}, dump / "layer_0" / "v" / "1.pt")
    msg = refused(fit(dump), r"refused to load: its pickle references 'posix\.system'")
    assert "a Q/K/V dump file never needs" in msg


def test_non_canonical_names_are_refused(dump):
    (dump / "layer_0" / "k" / "1.pt").rename(dump / "layer_0" / "k" / "01.pt")
    refused(fit(dump), r"k/01\.pt: not a canonical chunk file name")
    (dump / "layer_0" / "k" / "01.pt").rename(dump / "layer_0" / "k" / "1.pt")
    shutil.copytree(dump / "layer_1", dump / "layer_01")
    refused(fit(dump), r"layer_01: not a canonical layer folder name")


# -- views and storages --------------------------------------------------------------------------


def test_stride0_view_of_2_34_rows_in_a_tiny_file(dump):
    f = dump / "layer_0" / "k" / "1.pt"
    torch.save(torch.zeros(1, 2, 64).bfloat16().expand(2**34, 2, 64), f)
    assert f.stat().st_size < 2048
    refused(fit(dump), r"k/1\.pt: refused before loading: a view with stride \(0, 64, 1\) \(stride-0")
    torch.save(torch.zeros(1, 2, 64).bfloat16().expand(200, 2, 64), f)  # small too: never repeated memory
    refused(fit(dump), r"stride-0")


def test_overlapping_and_mis_sized_views(dump):
    f = dump / "layer_0" / "k" / "1.pt"
    torch.save(torch.as_strided(torch.randn(4096).bfloat16(), (200, 2, 64), (1, 64, 1)), f)
    refused(fit(dump), r"refused before loading: a view with overlapping strides \(1, 64, 1\)")
    torch.save(torch.randn(20000, 2, 64).bfloat16()[:200], f)  # storage 100 times the view
    refused(fit(dump), r"storage 0 holds 2560000 elements but its tensors use 25600")
    torch_zip(f, FakeTensor(FakeStorage("0", 100, torch.BFloat16Storage), (200, 2, 64), (128, 64, 1)),
              {"0": bytes(200)})
    refused(fit(dump), r"a view \(offset 0, shape \(200, 2, 64\), stride \(128, 64, 1\)\) beyond its storage of 100")
    torch_zip(f, FakeTensor(FakeStorage("0", 1 << 40, torch.BFloat16Storage), (1 << 33, 2, 64), (128, 64, 1)),
              {"0": bytes(16)})
    refused(fit(dump), r"a storage of \d+ bytes exceeds max_bytes")


# -- sizes beyond the documented bounds ----------------------------------------------------------


def test_head_dim_bounds(tmp_path):
    root = write_dump(tmp_path / "d65536", {0: layer_chunks([6, 2], d=65536, hq=2, hkv=1)})
    refused(fit(root), r"refused before loading: shape \(6, 2, 65536\): 65536 head_dim, more than max_head_dim=1024")
    # 2-token chunks of d = 4096 (76 s and 3 GiB before these bounds): refused from metadata
    root = write_dump(tmp_path / "d4096", {0: layer_chunks([6, 2, 2], d=4096, hq=8, hkv=2)})
    refused(fit(root), r"4096 head_dim, more than max_head_dim=1024")
    # allowed by a raised limit, still refused before anything is read: 4 tokens are far too few
    wide = open_dump(root, limits=DumpLimits(max_head_dim=4096))
    refused(fit(wide), r"layer 0: 4 tokens, fewer than min_tokens=256")
    # ... and, with min_tokens lowered, by the cost bound on the fp64 statistics: 6 matrices of 4096²
    refused(fit(open_dump(root, limits=DumpLimits(max_head_dim=4096, max_statistics_bytes=512 << 20)), min_tokens=1),
            r"keeps 0\.75 GiB of fp64 statistics, more than max_statistics_bytes=536870912")
    for d in (1, 8):
        root = write_dump(tmp_path / f"d{d}", {0: layer_chunks([6, 300], d=d)})
        refused(fit(root), rf"layer_0/q/0\.pt: head_dim {d} is below 16, the smallest the INT2 kernels serve",
                error=DumpError)
        refused(lambda: samples_from_dump(root), rf"head_dim {d} is below 16", error=DumpError)
        from rotationzoo.fit import LayerAccumulator

        acc = LayerAccumulator(0, num_q_heads=4, num_kv_heads=2, head_dim=d, targets=("ktk",))
        acc.add_k(torch.randn(300, 2, d))
        refused(lambda: fit_rotations({0: acc}, "ktk"), rf"head_dim {d} is below 16", error=FitError)
    nan = torch.randn(300, 4, 96)
    nan[0, 0, 0] = float("nan")
    root = write_dump(tmp_path / "d96", {0: layer_chunks([6, 300], d=96, q=lambda n: nan[:n])})
    # refused before any activation is read: the NaN in the chunk is never reached
    refused(fit(root), r"head_dim 96 is not a power of two", error=FitError)
    refused(fit(root, composition="plain"), r"layer_0/q/1\.pt: holds non-finite values", limit=DATA)


def test_head_and_row_bounds(tmp_path, dump):
    root = write_dump(tmp_path / "heads", {0: layer_chunks([6, 2], hq=512, hkv=1, d=16)})
    refused(fit(root), r"512 heads, more than max_heads=256")
    refused(fit(open_dump(dump, limits=DumpLimits(max_rows_per_chunk=199))), r"200 tokens, more than max_rows_per_chunk=199")
    refused(fit(open_dump(dump, limits=DumpLimits(max_tokens_per_layer=500))), r"more than max_tokens_per_layer=500")
    refused(fit(open_dump(dump, limits=DumpLimits(max_chunks=3))), r"more than max_chunks=3 chunk files")
    refused(lambda: open_dump(dump, limits=DumpLimits(max_layers=1)), r"2 layers, more than max_layers=1")
    refused(fit(open_dump(dump, limits=DumpLimits(max_chunk_bytes=16 << 10))), r"max_bytes=16384")
    for bad in (0, -1, 2.5, True, "1"):
        refused(lambda: DumpLimits(max_head_dim=bad), r"DumpLimits\.max_head_dim must be a positive integer")
    refused(lambda: open_dump(dump, limits={"max_head_dim": 8}), r"limits must be a DumpLimits")  # type: ignore[arg-type]


def test_a_folder_of_too_many_entries_is_not_listed_to_the_end(dump):
    for i in range(1024 + 8):
        (dump / "layer_1" / "k" / f"junk{i}").touch()
    refused(fit(open_dump(dump, limits=DumpLimits(max_chunks=4))), r"k: more than 1028 entries")


# -- seq_lens ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,match", [
    ([float("nan")], r"must be positive integers, found nan"),
    ([100.0, 100.0], r"must be positive integers, found 100\.0"),
    (["100", "100"], r"must be positive integers, found '100'"),
    ([[100, 100]], r"must be positive integers, found \[100, 100\]"),
    ([-1, 201], r"must be positive integers, found -1"),
    ([0, 200], r"must be positive integers, found 0"),
    ([True, 199], r"must be positive integers, found True"),
    ([100, 99], r"sum to 199, but the chunk has 200 tokens"),
    ([], r"holds no sequence lengths"),
    (torch.tensor([100.0, 100.0]), r"expected a 1-D integer tensor of sequence lengths, got float32"),
    (torch.tensor([True]), r"got bool"),
    (torch.tensor([[100, 100]], dtype=torch.int32), r"got int32 of shape \[1, 2\]"),
    (torch.ones(201, dtype=torch.int32), r"201 sequence lengths for a chunk of 200 tokens"),
    (torch.tensor([300, -100], dtype=torch.int64), r"found -100"),
    ({"lens": [200]}, r"expected a tensor or list of sequence lengths, got dict"),
])
def test_bad_seq_lens(dump, value, match):
    torch.save(value, dump / "layer_1" / "seq_lens" / "1.pt")
    refused(fit(dump), rf"layer_1/seq_lens/1\.pt: .*{match}", error=DumpError)
    refused(lambda: open_dump(dump).seq_lens(1, 1), match, error=DumpError)


def test_seq_lens_as_a_list_or_any_int_tensor_are_read(dump):
    torch.save([50, 150], dump / "layer_1" / "seq_lens" / "1.pt")
    torch.save(torch.tensor([173], dtype=torch.int64), dump / "layer_1" / "seq_lens" / "2.pt")
    d = open_dump(dump)
    assert d.seq_lens(1, 1) == [50, 150] and d.seq_lens(1, 2) == [173]
    assert fit_rotations(d).tokens == {0: 523, 1: 523}


# -- rotationzoo_dump.json -----------------------------------------------------------------------


@pytest.mark.parametrize("text,match", [
    ("[" * 200_000 + "]" * 200_000, r"not valid JSON \(nested too deeply\)"),
    ('{"a": ' * 100_000 + "1" + "}" * 100_000, r"not valid JSON \(nested too deeply\)"),
    (json.dumps({"notes": "x" * (2 << 20)}), r"2097165 bytes, more than max_info_bytes=1048576"),
    ("[1, 2]", r"expected a JSON object, got list"),
    ("{nope", r"not valid JSON"),
    (json.dumps({"model": ["Qwen/Qwen3-8B"]}), r"'model' must be a printable string"),
    (json.dumps({"model": "a\nb; rm -rf ~"}), r"'model' must be a printable string"),
    (json.dumps({"prompts": -3}), r"'prompts' must be a non-negative integer"),
    (json.dumps({"tokens": "many"}), r"'tokens' must be a non-negative integer"),
])
def test_bad_dump_metadata(dump, text, match):
    (dump / "rotationzoo_dump.json").write_text(text)
    refused(fit(dump), rf"rotationzoo_dump\.json: {match}", error=DumpError)


def test_invalid_utf8_metadata(dump):
    (dump / "rotationzoo_dump.json").write_bytes(b'{"model": "\xff"}')
    refused(fit(dump), r"rotationzoo_dump\.json: not valid JSON", error=DumpError)


# -- non-finite and degenerate data --------------------------------------------------------------


def test_nan_and_inf_are_refused_at_the_chunk_holding_them(dump):
    t = torch.randn(150, 8, 64).bfloat16()
    t[7, 3, 5] = float("nan")
    torch.save(t, dump / "layer_1" / "q" / "3.pt")
    refused(fit(dump), r"layer_1/q/3\.pt: holds non-finite values \(NaN or Inf\)", limit=DATA, error=DumpError)
    torch.save(torch.randn(150, 8, 64).bfloat16(), dump / "layer_1" / "q" / "3.pt")
    t = torch.randn(173, 2, 64).bfloat16()
    t[0, 0, 0] = float("-inf")
    torch.save(t, dump / "layer_0" / "v" / "2.pt")  # read in the second (sst) pass
    refused(fit(dump), r"layer_0/v/2\.pt: holds non-finite values", limit=DATA, error=DumpError)
    refused(fit(dump, objective="ktk_vtv"), r"layer_0/v/2\.pt: holds non-finite values", limit=DATA, error=DumpError)
    t = torch.randn(173, 2, 64).bfloat16()
    t[3, 1, 60] = float("inf")
    torch.save(torch.randn(173, 2, 64).bfloat16(), dump / "layer_0" / "v" / "2.pt")
    torch.save(t, dump / "layer_0" / "k" / "2.pt")
    refused(fit(dump), r"layer_0/k/2\.pt: holds non-finite values", limit=DATA, error=DumpError)


def test_all_zero_activations(tmp_path):
    zeros = lambda h: (lambda n: torch.zeros(n, h, 64))  # noqa: E731
    root = write_dump(tmp_path / "k0", {0: layer_chunks([6, 300], k=zeros(2))})
    refused(fit(root), r"layer 0 sst: the covariance is zero \(all-zero values, or keys no query attends to",
            limit=DATA, error=FitError)
    refused(fit(root, objective="ktk_vtv"), r"layer 0 ktk: the covariance is zero \(all-zero keys\)", limit=DATA)
    root = write_dump(tmp_path / "q0", {0: layer_chunks([6, 300], q=zeros(4))})
    refused(fit(root, objective="qqt"), r"layer 0 qqt: the covariance is zero \(all-zero queries\)", limit=DATA)
    root = write_dump(tmp_path / "v0", {0: layer_chunks([6, 300], v=zeros(2))})
    refused(fit(root), r"layer 0 sst: the covariance is zero", limit=DATA)
    refused(fit(root, objective="vtv", grouping="kv_head"), r"layer 0 KV head 0 vtv: the covariance is zero",
            limit=DATA)


def test_rank_deficient_covariances(tmp_path):
    g = torch.Generator().manual_seed(1)
    basis = torch.randn(3, 64, generator=g)
    low = lambda h: (lambda n: torch.randn(n, h, 3, generator=g) @ basis)  # noqa: E731
    root = write_dump(tmp_path / "rank3", {0: layer_chunks([6, 300], q=low(4), k=low(2), v=low(2))})
    refused(fit(root), r"layer 0 qqt: the covariance has rank 3 of 64: 61 directions never occur in the data",
            limit=DATA, error=FitError)
    # the same token repeated: rank 1 whatever the token count
    same = lambda h: (lambda n: torch.randn(1, h, 64, generator=g).expand(n, h, 64).contiguous())  # noqa: E731
    root = write_dump(tmp_path / "same", {0: layer_chunks([6, 300], k=same(2))})
    refused(fit(root, objective="ktk"), r"layer 0 ktk: the covariance has rank 2 of 64", limit=DATA)
    # one KV head degenerate: fine for the layer's shared rotation, refused for that head's own one
    half = lambda n: torch.cat([torch.randn(n, 1, 64, generator=g), torch.randn(n, 1, 3, generator=g) @ basis], 1)  # noqa: E731
    root = write_dump(tmp_path / "head1", {0: layer_chunks([6, 300], v=half)})
    assert fit_rotations(root, objective="vtv").v is not None
    refused(fit(root, objective="vtv", grouping="kv_head"), r"layer 0 KV head 1 vtv: the covariance has rank 3 of 64",
            limit=DATA)
    # fewer rows than channels, with min_tokens lowered to let it through to the rank check
    root = write_dump(tmp_path / "rows", {0: layer_chunks([6, 20], hq=2, hkv=1)})
    refused(fit(root, min_tokens=1), r"rank 40 of 64.*from 40 rows \(20 tokens x 2 heads\), fewer than head_dim 64",
            limit=DATA)


def test_too_few_tokens_and_the_min_tokens_knob(tmp_path, dump):
    root = write_dump(tmp_path / "few", {0: layer_chunks([6, 100])})
    assert DEFAULT_MIN_TOKENS == 256
    refused(fit(root), r"layer 0: 100 tokens, fewer than min_tokens=256; .*--min-tokens", error=FitError)
    assert fit_rotations(root, min_tokens=100).tokens == {0: 100}
    refused(fit(root, keep_first_chunk=True, min_tokens=107), r"layer 0: 106 tokens, fewer than min_tokens=107")
    refused(fit(dump, min_tokens=524), r"layer 0: 523 tokens \(and 1 more layers\), fewer than min_tokens=524")
    for bad in (0, -5, 2.5, True, "256"):
        refused(fit(root, min_tokens=bad), r"min_tokens must be a positive integer", error=FitError)
    refused(lambda: refine_dump(root, Refinement(steps=1)), r"layer 0: 100 tokens, fewer than min_tokens=256")
    from rotationzoo.fit import refine_fit

    samples = samples_from_dump(write_dump(tmp_path / "600", {0: layer_chunks([6, 300, 300])}), max_tokens=512)
    refused(lambda: refine_fit(samples, "hadamard", steps=1, min_tokens=601), r"layer 0: 600 tokens, fewer than min_tokens=601")


def test_refinement_refuses_degenerate_samples(tmp_path):
    from rotationzoo.fit import refine_fit
    root = write_dump(tmp_path / "k0", {0: layer_chunks([6, 512], k=lambda n: torch.zeros(n, 2, 64))})
    samples = samples_from_dump(root, max_tokens=512)
    refused(lambda: refine_fit(samples, "hadamard", steps=1), r"layer 0: the calibration samples hold all-zero keys",
            limit=DATA, error=FitError)
    t = torch.randn(512, 4, 64)
    t[9, 0, 0] = float("nan")
    root = write_dump(tmp_path / "nan", {0: layer_chunks([6, 512], q=lambda n: t[:n])})
    refused(lambda: refine_fit(samples_from_dump(root, max_tokens=512), "hadamard", steps=1),
            r"layer 0: the calibration samples hold non-finite queries", limit=DATA)


# -- the command line ----------------------------------------------------------------------------


def _main(args: list[str]) -> int:
    from rotationzoo.cli.main import main

    return main(args)


@pytest.mark.parametrize("case", ["fifo", "stride0", "deep_json", "nan", "few", "d1"])
def test_cli_refuses_with_one_line_and_writes_nothing(dump, tmp_path, capsys, case):
    if case == "fifo":
        f = dump / "layer_0" / "q" / "2.pt"
        f.unlink()
        os.mkfifo(f)
    elif case == "stride0":
        torch.save(torch.zeros(1, 8, 64).bfloat16().expand(2**34, 8, 64), dump / "layer_1" / "q" / "1.pt")
    elif case == "deep_json":
        (dump / "rotationzoo_dump.json").write_text("[" * 200_000)
    elif case == "nan":
        torch.save(torch.full((150, 2, 64), float("nan")), dump / "layer_1" / "k" / "3.pt")
    elif case == "few":
        dump = write_dump(tmp_path / "few", {0: layer_chunks([6, 100])})
    else:
        dump = write_dump(tmp_path / "d1", {0: layer_chunks([6, 300], d=1)})
    out = tmp_path / "out"
    for extra in ([], ["--refine", "1"]):
        t0 = time.perf_counter()
        assert _main(["fit", "--dump", str(dump), "--out", str(out), *extra]) == 1
        assert time.perf_counter() - t0 < DATA
        lines = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in lines if line.startswith("error: ")]
        assert len(errors) == 1 and lines[-1] == errors[0] and "internal error" not in errors[0], lines
        assert all(line.startswith(("fit: ", "refine: ")) for line in lines[:-1]), lines  # progress lines only
        assert not out.exists()


def test_cli_min_tokens_flag(tmp_path, capsys):
    root = write_dump(tmp_path / "few", {0: layer_chunks([6, 100])})
    assert _main(["fit", "--dump", str(root), "--out", str(tmp_path / "a")]) == 1
    assert "fewer than min_tokens=256" in capsys.readouterr().err
    assert _main(["fit", "--dump", str(root), "--out", str(tmp_path / "b"), "--min-tokens", "100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["result"]["tokens"] == 100
    assert _main(["fit", "--dump", str(root), "--out", str(tmp_path / "c"), "--min-tokens", "0"]) == 2
    from rotationzoo.cli.fit_cmds import MinTokensOpt

    help_text = MinTokensOpt.__metadata__[0].help
    assert f"(default {DEFAULT_MIN_TOKENS})" in help_text  # --help states the library's default


def test_a_good_dump_still_fits_and_its_plan_reads_nothing(good):
    d = open_dump(good)
    plan = d.plan()
    assert plan.tokens == {0: 523, 1: 523} and plan.chunks[0] == (1, 2, 3)
    assert (plan.shape.num_q_heads, plan.shape.num_kv_heads, plan.shape.head_dim) == (8, 2, 64)
    assert plan.bytes == 523 * (8 + 2 + 2) * 64 * 2 * 2
    res = fit_rotations(d)
    assert res.tokens == {0: 523, 1: 523} and res.prompts == 8


def test_a_chunk_changed_after_it_was_inspected_is_refused(dump):
    from rotationzoo.fit.dump_schema import load_chunk

    f = dump / "layer_0" / "k" / "1.pt"
    meta = inspect_chunk(f, str(f), "k", DumpLimits())
    torch.save(torch.zeros(1, 2, 64).bfloat16().expand(200, 2, 64), f)  # same shape, now a stride-0 view
    refused(lambda: load_chunk(meta), r"k/1\.pt: changed while it was read", error=DumpError)
    torch.save(torch.randn(200, 2, 64).bfloat16(), f)
    d = open_dump(dump)
    d.plan()
    torch.save(torch.randn(200, 2, 32).bfloat16(), f)  # after the plan: inspected again when read, and refused
    refused(fit(d), r"k/1\.pt: shape \(200, 2, 32\), expected \[n, 2, 64\] like the rest of the dump",
            limit=DATA, error=DumpError)


def test_calibrate_refuses_a_budget_below_min_tokens_before_the_model_loads(tmp_path, capsys):
    from rotationzoo.fit.fitter import check_token_budget

    refused(lambda: check_token_budget(100, 256), r"100 tokens per layer is fewer than min_tokens=256", error=FitError)
    check_token_budget(256, 256)
    (tmp_path / "t.txt").write_text("text")
    args = ["calibrate", "--model", str(tmp_path / "no-such-model"), "--text", str(tmp_path / "t.txt"), "--out",
            str(tmp_path / "out")]
    assert _main([*args, "--tokens", "100"]) == 1
    assert "fewer than min_tokens=256" in capsys.readouterr().err  # not "no such model": checked first
    assert _main([*args, "--tokens", "100", "--min-tokens", "50"]) == 1
    assert "min_tokens" not in capsys.readouterr().err


def test_overwriting_a_dump_never_follows_a_linked_layer_folder(tmp_path):
    from rotationzoo.fit import DumpWriter

    keep = tmp_path / "elsewhere"
    keep.mkdir()
    (keep / "notes.txt").write_text("keep me")
    root = tmp_path / "dump"
    root.mkdir()
    (root / "layer_0").symlink_to(keep)
    refused(lambda: DumpWriter(root, overwrite=True), r"layer_0: a link or a file, not a layer folder of this dump",
            error=DumpError)
    assert (keep / "notes.txt").read_text() == "keep me" and (root / "layer_0").is_symlink()


@pytest.mark.parametrize("foreign", ["layer_1/notes/thesis.tex", "layer_2/photo.jpg", "layer_0/q/notes.md",
                                     "layer_0/rank_0/analysis.txt"])
def test_overwriting_a_dump_removes_nothing_that_is_not_a_dump(tmp_path, foreign):
    """--overwrite-dump deleted whole layer_<L> folders whatever they held (a user's notes, another tool's
    files): a folder holding anything but kind folders and chunk files is refused, nothing removed."""
    from rotationzoo.fit import DumpWriter

    root = tmp_path / "dump"
    w = DumpWriter(root)
    for lid in range(3):
        w.write(lid, q=torch.randn(8, 1, 4), k=torch.randn(8, 1, 4), v=torch.randn(8, 1, 4), seq_lens=[8])
    w.write_info({"model": "m"})
    (root / foreign).parent.mkdir(parents=True, exist_ok=True)
    (root / foreign).write_text("keep me")
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    refused(lambda: DumpWriter(root, overwrite=True), "it is not part of a Q/K/V dump", error=DumpError)
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before and (root / foreign).read_text() == "keep me"
    if foreign.startswith("layer_0/q/"):
        return
    extra = root.joinpath(*Path(foreign).parts[:2])
    if extra.is_dir() and not extra.name.startswith("rank_"):
        shutil.rmtree(extra)  # a dump again: overwritten
    else:
        (root / foreign).unlink()
    DumpWriter(root, overwrite=True).finish()
    assert not any(root.glob("layer_*")) and not (root / "rotationzoo_dump.json").exists()


def test_an_overwrite_cut_short_leaves_a_dump_marked_unfinished(tmp_path, monkeypatch):
    """A removal that fails half way (EBUSY, Ctrl-C) had left some layers and the info file, unmarked: read as a
    whole dump of fewer layers. The dump is marked unfinished before anything is removed."""
    from rotationzoo.fit import DumpWriter, Dump
    from rotationzoo.fit import dump_writer

    root = tmp_path / "dump"
    w = DumpWriter(root)
    for lid in range(4):
        w.write(lid, q=torch.randn(8, 1, 4), k=torch.randn(8, 1, 4), v=torch.randn(8, 1, 4), seq_lens=[8])
    w.write_info({"model": "m"})
    real = shutil.rmtree

    def busy(path, *a, **kw):
        if Path(path).name == "layer_2":
            raise OSError(16, "Device or resource busy")
        return real(path, *a, **kw)

    monkeypatch.setattr(dump_writer.shutil, "rmtree", busy)
    refused(lambda: DumpWriter(root, overwrite=True), "cannot remove the old dump", error=DumpError)
    assert (root / ".rotationzoo_dump.unfinished").exists()
    refused(lambda: Dump(root), "unfinished", error=DumpError)


def test_two_captures_never_write_one_dump_folder(tmp_path):
    """Two calibrate runs with one --dump-out: the second wiped the first's chunks and the first's finish then
    marked the mix whole. The folder is locked while a capture writes."""
    from rotationzoo.fit import DumpWriter

    root = tmp_path / "dump"
    first = DumpWriter(root, overwrite=True, unfinished=True)
    refused(lambda: DumpWriter(root, overwrite=True, unfinished=True), "another capture is writing this dump",
            error=DumpError)
    first.finish()
    DumpWriter(root, overwrite=True, unfinished=True).finish()  # once it is done, the folder is free


def test_hadamard_refuses_files_no_reader_could_load(tmp_path):
    refused(lambda: fit_rotations(None, "hadamard", num_layers=4, head_dim=65536), r"beyond what a rotation file may hold",
            error=FitError)
    refused(lambda: fit_rotations(None, "hadamard", num_layers=10**6, head_dim=128), r"num_layers must be an integer "
            r"in \[1, 1024\]", error=FitError)
    refused(lambda: fit_rotations(None, "hadamard", num_layers=1024, head_dim=4096), r"1024 layers of head_dim 4096 "
            r"make rotation files of \d+ bytes", error=FitError)
    refused(lambda: fit_rotations(None, "hadamard", num_layers=2, head_dim=1), r"head_dim 1 is below 16", error=FitError)
    from rotationzoo.fit import DumpWriter

    w = DumpWriter(tmp_path / "wide", kinds=("k",))  # keys are all the data-free fit looks at
    for lid in range(64):
        for n in (6, 2):
            w.write(lid, k=torch.zeros(n, 1, 1024))
    refused(lambda: fit_rotations(w.root, "hadamard"), r"64 layers of head_dim 1024 make rotation files of",
            limit=DATA, error=FitError)  # 256 files inspected
    assert fit_rotations(None, "hadamard", num_layers=2, head_dim=128).k.rotations.shape == (2, 128, 128)
