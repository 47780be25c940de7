"""Rotation files: reading the authors' format safely, writing, validation errors."""

from __future__ import annotations

import hashlib
import pickle
import re
import zipfile
from pathlib import Path

import pytest
import torch

from rotationzoo import RotationSet, read_rotation, validate, write_rotation
from rotationzoo.errors import (
    InvalidRotationError,
    RotationFileError,
    RotationZooError,
    UnsafeRotationFileError,
    UnsupportedFormatError,
)
from rotationzoo.hadamard import bit_reversal_permutation, hadamard_matrix
from rotationzoo.files.validation import verify_file

from helpers import random_orthogonal

SOURCES_ROW = re.compile(r"^\| `(?P<file>[^`]+)` \| `[^`]+` \| `[0-9a-f]{40}` \| `[^`]+` \| `(?P<sha>[0-9a-f]{64})` \| (?P<size>\d+) \|")


def make_set(n_layers: int = 4, d: int = 16, **kw) -> RotationSet:
    return RotationSet(rotations=random_orthogonal(n_layers, d), layer_ids=tuple(range(n_layers)),
                       objective="qqt_r_h_pbr", eigenvalues=torch.rand(n_layers, d), **kw)


# -- the authors' published files ----------------------------------------------------------------


def test_all_upstream_files_verify(upstream_dir: Path) -> None:
    rows = [SOURCES_ROW.match(line) for line in (upstream_dir / "SOURCES.md").read_text().splitlines()]
    rows = [r for r in rows if r]
    assert len(rows) == 16
    for r in rows:
        path = upstream_dir / r["file"]
        report = verify_file(path)
        assert report.ok, report.problems
        assert report.sha256 == r["sha"] and report.size == int(r["size"])
        assert report.max_orthogonality_error < 1e-6
        assert report.head_dim in (128, 256)
        if "qwen3.5" in r["file"]:
            assert report.layer_ids[:3] == [3, 7, 11] and report.head_dim == 256
        else:
            assert report.layer_ids == list(range(36))


def test_shared_storage_hadamard_loads_as_independent_tensors(upstream_dir: Path) -> None:
    path = upstream_dir / "qwen3.5-4B/hadamard/k_rotation.pt"
    raw = torch.load(path, weights_only=True)
    l0, l1 = raw["layers"][3]["rotation"], raw["layers"][7]["rotation"]
    assert l0.untyped_storage().data_ptr() == l1.untyped_storage().data_ptr()  # shared in the file
    rs = read_rotation(path)
    before = rs[7].clone()
    rs.rotations[0].mul_(2.0)
    assert torch.equal(rs[7], before)  # independent after loading
    assert torch.allclose(rs[3] / 2, hadamard_matrix(256, dtype=torch.float32), atol=1e-7)


def test_upstream_matches_fresh_hadamard(upstream_dir: Path) -> None:
    rs = read_rotation(upstream_dir / "qwen3.5-35B-A3B/hadamard/v_rotation.pt")
    h = hadamard_matrix(256, dtype=torch.float64)
    assert (rs.rotations.double() - h).abs().max() < 1e-7


# -- writing -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_round_trip(tmp_path: Path, suffix: str) -> None:
    rs = make_set()
    out = write_rotation(tmp_path / f"k_rotation_qqt_r_h_pbr{suffix}", rs)
    back = read_rotation(out)
    assert torch.equal(back.rotations, rs.rotations)
    assert torch.equal(back.eigenvalues, rs.eigenvalues)
    assert back.layer_ids == rs.layer_ids and back.objective == "qqt_r_h_pbr" and back.format_version == 1
    validate(back, num_layers=4, head_dim=16)


def test_pt_matches_authors_schema(tmp_path: Path) -> None:
    out = write_rotation(tmp_path / "v_rotation_sst_r_h_pbr.pt", make_set())
    raw = torch.load(out, weights_only=True)
    assert raw["format_version"] == 1 and raw["source_grouping"] == "layer"
    assert all(isinstance(k, int) for k in raw["layers"])
    entry = raw["layers"][2]
    assert entry["layer_id"] == 2 and entry["rotation"].dtype == torch.float32
    assert entry["rotation"].is_contiguous() and entry["eigenvalues"].shape == (16,)
    with zipfile.ZipFile(out) as zf:  # archive folder named after the stem, as torch.save does
        assert zf.namelist()[0].startswith("v_rotation_sst_r_h_pbr/")
    assert not list(tmp_path.glob(".*"))  # no temp leftovers


def test_identical_layers_share_storage_on_write(tmp_path: Path) -> None:
    h = hadamard_matrix(64, dtype=torch.float32)
    rs = RotationSet(rotations=h.expand(30, 64, 64).clone(), layer_ids=range(30), objective="hadamard")
    out = write_rotation(tmp_path / "k_rotation_hadamard.pt", rs)
    assert out.stat().st_size < 64 * 64 * 4 * 2  # one stored matrix, not 30


def test_sparse_string_keys_and_identity_variant(tmp_path: Path) -> None:
    eye = torch.eye(32)
    obj = {"format_version": "identity-v1", "objective": "identity-k", "source_grouping": "identity",
           "layers": {"7": {"layer_id": 7, "rotation": eye}, "3": {"layer_id": 3, "rotation": eye}}}
    torch.save(obj, tmp_path / "k.pt")
    rs = read_rotation(tmp_path / "k.pt")
    assert rs.layer_ids == (3, 7) and rs.eigenvalues is None and rs.format_version == "identity-v1"
    validate(rs, layer_ids=[3, 7], head_dim=32)


# -- refusals and typed errors -------------------------------------------------------------------


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("legacy", [False, True])
def test_pickle_that_runs_code_is_refused(tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "k.pt"
    payload = {"format_version": 1, "layers": {0: {"rotation": torch.eye(4), "x": _Exploit(marker)}}}
    if legacy:
        with open(bad, "wb") as f:
            f.write(b"\x80\x02")  # a plain pickle stream, not a zip archive
            pickle.dump(payload, f, protocol=2)
    else:
        torch.save(payload, bad)
    with pytest.raises(UnsafeRotationFileError, match="refused"):
        read_rotation(bad)
    assert not marker.exists()
    report = verify_file(bad)
    assert not report.ok and "refused" in report.problems[0]
    assert not marker.exists()


def test_perturbed_layer_is_named(tmp_path: Path) -> None:
    rs = make_set(n_layers=6)
    rs.rotations[4, 2, 3] += 0.05
    path = write_rotation(tmp_path / "k.pt", rs)
    with pytest.raises(InvalidRotationError, match=r"layer 4: not orthogonal, max\|RRᵀ−I\| = [0-9.e+-]+ > 1e-05") as ei:
        validate(read_rotation(path))
    assert str(path) in str(ei.value) and len(ei.value.problems) == 1
    # a looser tolerance accepts it
    validate(read_rotation(path), atol=0.2)


def test_truncated_file(tmp_path: Path) -> None:
    good = write_rotation(tmp_path / "good.pt", make_set())
    data = good.read_bytes()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(RotationFileError, match="truncated|damaged"):
        read_rotation(bad)
    st = write_rotation(tmp_path / "good.safetensors", make_set())
    (tmp_path / "bad.safetensors").write_bytes(st.read_bytes()[:-100])
    with pytest.raises(RotationFileError, match="truncated|damaged"):
        read_rotation(tmp_path / "bad.safetensors")


def test_corrupted_member_is_detected(tmp_path: Path) -> None:
    good = write_rotation(tmp_path / "good.pt", make_set())
    data = bytearray(good.read_bytes())
    # flip bytes inside the tensor data (same size): the zip CRC catches it
    with zipfile.ZipFile(good) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename)
    n_name = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little")
    n_extra = int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
    off = info.header_offset + 30 + n_name + n_extra + 8
    data[off:off + 4] = b"\x00\x01\x02\x03"
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(RotationFileError, match="damaged|CRC"):
        read_rotation(bad)


@pytest.mark.parametrize(
    "obj, error, pattern",
    [
        ({"format_version": 1, "objective": "x"}, RotationFileError, "no 'layers'"),
        ({"format_version": 1, "layers": {}}, RotationFileError, "non-empty"),
        ({"format_version": 1, "layers": {0: {"rotation": torch.zeros(4, 3)}}}, RotationFileError, r"rotation must be \[d, d\].*\[4, 3\]"),
        ({"format_version": 1, "layers": {0: {"rotation": torch.eye(4, dtype=torch.int32)}}}, RotationFileError, "not floating"),
        ({"format_version": 4, "layers": {0: {"rotation": torch.eye(4)}}}, UnsupportedFormatError, "newer format version .4.; .*upgrade rotationzoo"),
        ({"format_version": "v9", "layers": {0: {"rotation": torch.eye(4)}}}, UnsupportedFormatError, "unknown format_version"),
        ({"layers": {0: {"rotation": torch.eye(4)}, 1: {"rotation": torch.eye(8)[None]}}}, RotationFileError, "mixes per-KV-head and per-layer"),
        ({"layers": {0: {"rotation": torch.eye(4), "eigenvalues": torch.ones(3)}}}, RotationFileError, r"eigenvalues must have shape \[4\]"),
        ({"layers": {"a": {"rotation": torch.eye(4)}}}, RotationFileError, "not an integer"),
        ([1, 2, 3], RotationFileError, "expected a dict"),
    ],
)
def test_malformed_content(tmp_path: Path, obj, error, pattern) -> None:
    path = tmp_path / "x.pt"
    torch.save(obj, path)
    with pytest.raises(error, match=pattern) as ei:
        read_rotation(path)
    assert isinstance(ei.value, RotationZooError) and str(path) in str(ei.value)


def test_nan_layer(tmp_path: Path) -> None:
    rs = make_set()
    rs.rotations[2, 0, 0] = float("nan")
    rs.rotations[3, 1, 1] = float("inf")
    path = write_rotation(tmp_path / "k.pt", rs)
    with pytest.raises(InvalidRotationError) as ei:
        validate(read_rotation(path))
    assert "layer 2: 1 non-finite" in str(ei.value) and "layer 3: 1 non-finite" in str(ei.value)


def test_expectations(tmp_path: Path) -> None:
    rs = make_set(n_layers=4, d=16)
    with pytest.raises(InvalidRotationError, match="head_dim 16, but the model needs 128"):
        validate(rs, head_dim=128)
    with pytest.raises(InvalidRotationError, match=r"has 4 layers, the model needs 6 \(missing layers 4, 5\)"):
        validate(rs, num_layers=6)
    with pytest.raises(InvalidRotationError, match="unexpected layers 0, 1, 2"):
        validate(rs, layer_ids=[3, 7])
    report = validate(rs, num_layers=6, raise_on_error=False)
    assert not report.ok and report.problems


def test_not_a_rotation_file(tmp_path: Path) -> None:
    p = tmp_path / "x.pt"
    p.write_text("hello world, not a tensor file")
    with pytest.raises(RotationFileError, match="not a rotation file"):
        read_rotation(p)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(RotationFileError, match="empty"):
        read_rotation(tmp_path / "empty.pt")
    with pytest.raises(RotationFileError, match="no such file"):
        read_rotation(tmp_path / "missing.pt")


def test_hadamard_helpers() -> None:
    h = hadamard_matrix(8)
    assert torch.allclose(h @ h, torch.eye(8, dtype=torch.float64))
    assert torch.equal(h, h.T) and abs(float(h[0, 0]) - 8**-0.5) < 1e-15
    assert bit_reversal_permutation(8) == [0, 4, 2, 6, 1, 5, 3, 7]
    assert bit_reversal_permutation(128)[:4] == [0, 64, 32, 96]
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(96)


def test_bundled_files_hash_as_registered() -> None:
    from rotationzoo.config import package_data_dir
    from rotationzoo.registry import list_models

    bundled = [(f, s) for m in list_models() for t in m.tags.values() for f in t.files.values()
               for s in f.sources if s.type == "bundled"]
    assert bundled
    for f, s in bundled:
        data = (package_data_dir() / s.path).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f.sha256 and len(data) == f.size
