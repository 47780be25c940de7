"""Pair files say only what their tensors say, and nothing derived from them outlives their bytes.

- a pair file's sha256 is that of its own bytes (never the ``k.sha256`` / ``v.sha256`` it records),
  so the llama.cpp GGUF that ``serve-args`` keeps in the cache is rebuilt when one matrix is swapped,
  and a cached GGUF that does not hold the rotations read is never served;
- re-exports record the hashes of what they read;
- metadata is checked against the tensors (versions, ids, tags, layer ids, head_dim, sides) with
  one typed line when it is refused, in both layouts and through every reader;
- ``verify FOLDER`` applies the K/V agreement rule ``export`` applies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rotationzoo import hub
from rotationzoo.errors import (
    CacheError,
    ExportError,
    IntegrityError,
    InvalidRotationError,
    RotationFileError,
    RotationZooError,
    UnsupportedFormatError,
)
from rotationzoo.export import export_safetensors, read_exported
from rotationzoo.files.format import KV_HEAD, RotationSet, write_rotation
from rotationzoo.hashing import read_hashed, sha256_file
from rotationzoo.files.pair import read_pair, resolve_pair, verify_path

from helpers import random_orthogonal, run_cli

gguf = pytest.importorskip("gguf")
T = gguf.GGUFValueType


def make_folder(d: Path, *, k_layers: int = 4, v_layers: int = 4, k_dim: int = 16, v_dim: int = 16) -> Path:
    write_rotation(d / "k_rotation_qqt_r_h_pbr.pt", RotationSet(rotations=random_orthogonal(k_layers, k_dim, 1),
                                                                layer_ids=tuple(range(k_layers)), objective="qqt_r_h_pbr"))
    write_rotation(d / "v_rotation_sst_r_h_pbr.pt", RotationSet(rotations=random_orthogonal(v_layers, v_dim, 2),
                                                                layer_ids=tuple(range(v_layers)), objective="sst_r_h_pbr"))
    return d


def rewrite_safetensors(path: Path, *, tensors: dict | None = None, meta: dict | None = None) -> None:
    """Rewrite a pair file with some tensors and/or metadata replaced, the rest kept as it was."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        old_meta, old = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    save_file({**old, **(tensors or {})}, str(path), metadata={**old_meta, **(meta or {})})


def gguf_pair(path: Path, kv: dict, *, n: int = 4, d: int = 16, names: str = "blk.{i}.attn_{s}_rot.weight") -> Path:
    """A rotations GGUF with the given ``rotationzoo.*`` keys (name: (value, type))."""
    w = gguf.GGUFWriter(str(path), "rotationzoo")
    for key, (value, vtype) in kv.items():
        w.add_key_value(key, value, vtype, sub_type=T.INT32 if vtype == T.ARRAY else None)
    for s, seed in (("k", 1), ("v", 2)):
        rot = random_orthogonal(n, d, seed).numpy()
        for i in range(n):
            w.add_tensor(names.format(i=i, s=s), np.ascontiguousarray(rot[i].T))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- 1. the stale GGUF ---------------------------------------------------------------------------------


def test_swapped_matrix_rebuilds_the_llamacpp_gguf(tmp_path, cache_dir, capsys) -> None:
    folder = make_folder(tmp_path / "rot")
    pair_file = tmp_path / "pair.safetensors"
    assert run_cli(capsys, "export", str(folder), "--to", "safetensors", "--out", str(pair_file))[0] == 0

    def served() -> tuple[Path, RotationSet]:
        rc, out, err = run_cli(capsys, "serve-args", str(pair_file), "--engine", "llamacpp", "--format", "json")
        assert rc == 0, err
        path = Path(json.loads(out)["files"]["gguf"])
        return path, read_exported(path).k

    first, k_first = served()
    assert torch.equal(k_first.rotations, read_exported(pair_file).k.rotations)
    # another orthogonal matrix for layer 2, metadata (and its k.sha256 / v.sha256) kept as they were
    meta_before = read_pair(pair_file).metadata
    new = random_orthogonal(1, 16, 99)[0]
    rewrite_safetensors(pair_file, tensors={"k.2.rotation": new})
    assert read_pair(pair_file).metadata == meta_before
    second, k_second = served()
    assert torch.equal(k_second.rotations[2], new), "serve-args handed out the GGUF of the old rotations"
    assert torch.equal(k_second.rotations, read_exported(pair_file).k.rotations)
    assert second != first and hub.derived_hit(second, {s: sha256_file(pair_file) for s in "kv"})
    assert read_exported(second).metadata["k.sha256"] == sha256_file(pair_file)


def test_a_cached_gguf_that_does_not_hold_the_rotations_is_rebuilt(tmp_path, cache_dir, capsys) -> None:
    """A GGUF planted where the pair's would be, with a marker recording the right inputs and its
    own (correct) sha256, is not served: its tensors are compared with the rotations read."""
    from rotationzoo.export import export_gguf
    from rotationzoo.serving import rotations_gguf_path

    folder = make_folder(tmp_path / "rot")
    pair = resolve_pair(folder)
    target = rotations_gguf_path(pair)
    other = make_folder(tmp_path / "other", k_layers=4)
    write_rotation(other / "k_rotation_qqt_r_h_pbr.pt", RotationSet(rotations=random_orthogonal(4, 16, 7),
                                                                    layer_ids=(0, 1, 2, 3), objective="qqt_r_h_pbr"))
    export_gguf(other, target)
    hub.record_derived(target, inputs=pair.sha256, entry=None)
    assert hub.derived_hit(target, pair.sha256)  # the marker alone would say: hit
    rc, out, err = run_cli(capsys, "serve-args", str(folder), "--engine", "llamacpp", "--format", "json")
    assert rc == 0, err
    assert Path(json.loads(out)["files"]["gguf"]) == target
    assert torch.equal(read_exported(target).k.rotations, pair.k.rotations)


def test_derived_paths_and_hits_are_strict(tmp_path, cache_dir) -> None:
    with pytest.raises(CacheError, match="needs the sha256 of the files"):
        hub.derived_path("x.gguf")
    with pytest.raises(CacheError, match="64-hex sha256"):
        hub.derived_path("x.gguf", inputs={"k": "not-a-sha", "v": "0" * 64})
    with pytest.raises(CacheError, match="plain file name"):
        hub.derived_path("../x.gguf", inputs={"k": "0" * 64, "v": "1" * 64})
    inputs = {"k": "0" * 64, "v": "1" * 64}
    p = hub.derived_path("x.gguf", inputs=inputs)
    assert p != hub.derived_path("x.gguf", inputs={**inputs, "v": "2" * 64})
    p.parent.mkdir(parents=True)
    real = tmp_path / "real.bin"
    real.write_bytes(b"rotations")
    p.symlink_to(real)
    hub.record_derived(p, inputs=inputs)  # a marker that matches the link's target
    assert not hub.derived_hit(p, inputs), "a symlink in the derived area was served"


# -- 2. hashes of what was read ---------------------------------------------------------------------------


def test_reexport_records_the_hash_of_the_file_it_read(tmp_path, capsys) -> None:
    folder = make_folder(tmp_path / "rot")
    a, b, c = (tmp_path / f"{x}.safetensors" for x in "abc")
    export_safetensors(folder, a)
    assert read_pair(a).metadata["k.sha256"] == sha256_file(folder / "k_rotation_qqt_r_h_pbr.pt")
    assert run_cli(capsys, "export", str(a), "--to", "safetensors", "--out", str(b))[0] == 0
    recorded_b = {s: read_pair(b).metadata[f"{s}.sha256"] for s in "kv"}
    assert recorded_b == {"k": sha256_file(a), "v": sha256_file(a)}  # not copied from a's metadata
    rewrite_safetensors(a, tensors={"v.1.rotation": random_orthogonal(1, 16, 50)[0]})
    export_safetensors(a, c)
    recorded_c = {s: read_pair(c).metadata[f"{s}.sha256"] for s in "kv"}
    assert recorded_c == {"k": sha256_file(a), "v": sha256_file(a)} and recorded_c != recorded_b
    g = tmp_path / "c.gguf"
    assert run_cli(capsys, "export", str(c), "--to", "gguf", "--out", str(g))[0] == 0
    assert read_pair(g).metadata["rotationzoo.k.sha256"] == sha256_file(c)
    assert read_pair(g).sha256 == {"k": sha256_file(g), "v": sha256_file(g)}


def test_a_file_changing_while_read_is_refused(tmp_path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(b"one")

    def read_and_change(path: Path) -> bytes:
        data = path.read_bytes()
        path.write_bytes(b"two")
        return data

    with pytest.raises(RotationFileError, match="changed while it was read"):
        read_hashed(p, read_and_change)
    assert read_hashed(p, Path.read_bytes) == (b"two", sha256_file(p))


def test_a_registry_file_changed_after_verification_is_refused(cache_dir, monkeypatch) -> None:
    """Between the fetch that verified it and the read, a cached file is swapped for another
    valid file: the read's own hash says so."""
    import rotationzoo.files.pair as pair_mod
    from rotationzoo.registry import get_entry
    from test_serving import QWEN, seed_cache

    seed_cache(cache_dir, get_entry(QWEN))
    real_fetch = pair_mod.fetch_entry

    def fetch_then_swap(entry, **kwargs):
        got = real_fetch(entry, **kwargs)
        k = got.files["k"].path
        assert k.is_relative_to(cache_dir)  # only ever the test's own cache copy
        rs = RotationSet(rotations=random_orthogonal(36, 128, 123), layer_ids=tuple(range(36)), objective="qqt_r_h_pbr")
        write_rotation(k, rs)  # valid, same shape, other bytes
        return got

    assert pair_mod.load_registered(QWEN, cache_dir=cache_dir).k.num_layers == 36
    monkeypatch.setattr(pair_mod, "fetch_entry", fetch_then_swap)
    with pytest.raises(IntegrityError, match="no longer the verified"):
        pair_mod.load_registered(QWEN, cache_dir=cache_dir)


# -- 3. metadata ---------------------------------------------------------------------------------------


SAFETENSORS_CASES = [
    # key, value, error, message
    ("k.format_version", "²", UnsupportedFormatError, "unknown format_version '²'"),
    ("k.format_version", "١", UnsupportedFormatError, "unknown format_version '١'"),
    ("k.format_version", "1.0", UnsupportedFormatError, "unknown format_version '1.0'"),
    ("k.format_version", str(2**70), UnsupportedFormatError, "unknown format_version"),
    ("k.format_version", "4", UnsupportedFormatError, "newer format version"),
    ("v.format_version", " 1", UnsupportedFormatError, "unknown format_version ' 1'"),
    ("export_format_version", "²", UnsupportedFormatError, "export_format_version '²' is not a version"),
    ("export_format_version", "1e0", UnsupportedFormatError, "is not a version"),
    ("export_format_version", "2", UnsupportedFormatError, "newer export format"),
    ("model", "/etc; rm -rf ~", ExportError, "metadata 'model': '/etc; rm -rf ~' is not a NAMESPACE/NAME id"),
    ("model", "a/../b", ExportError, "is not a NAMESPACE/NAME id"),
    ("model", "$(touch x)/y", ExportError, "is not a NAMESPACE/NAME id"),
    ("model", "x" * 5000, ExportError, "metadata 'model' must be a string of at most 1024 characters"),
    ("tag", "a/b", ExportError, "tag 'a/b' must be one name"),
    ("tag", "..", ExportError, "tag '..' must be one name"),
    ("layer_ids", "0,1,2", ExportError, "metadata says layer_ids '0,1,2', the K tensors hold layers 0,1,2,3"),
    ("layer_ids", "0,1,2,٣", ExportError, "metadata says layer_ids"),
    ("layer_ids", "", ExportError, "metadata says layer_ids ''"),
    ("head_dim", "32", ExportError, "metadata says head_dim '32', the K tensors have head_dim 16"),
    ("head_dim", "١٦", ExportError, "metadata says head_dim"),
    ("sides", "k", ExportError, "metadata says sides 'k', the tensors hold k,v"),
    ("k.sha256", "abc", ExportError, "'k.sha256' 'abc' is not 64 lowercase hex digits"),
    ("k.objective", "q" * 1025, RotationFileError, "'objective' must be a string of at most 1024 characters"),
]


@pytest.fixture
def pair_file(tmp_path) -> Path:
    return export_safetensors(make_folder(tmp_path / "rot"), tmp_path / "pair.safetensors")


@pytest.mark.parametrize("key, value, error, message", SAFETENSORS_CASES)
def test_hostile_safetensors_metadata_is_one_typed_line(pair_file, capsys, key, value, error, message) -> None:
    rewrite_safetensors(pair_file, meta={key: value})
    for read in (read_pair, read_exported, resolve_pair):
        with pytest.raises(error, match=message.replace("(", r"\(").replace("$", r"\$")) as ei:
            read(pair_file)
        assert str(pair_file) in str(ei.value) and "\n" not in str(ei.value)
    (report,) = verify_path(pair_file)
    assert not report.ok and message.split("'")[0] in report.problems[0]
    rc, out, err = run_cli(capsys, "export", str(pair_file), "--to", "gguf", "--out", str(pair_file.with_suffix(".gguf")))
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert not pair_file.with_suffix(".gguf").exists()


def test_metadata_that_says_what_the_tensors_say_is_accepted(pair_file) -> None:
    rewrite_safetensors(pair_file, meta={"k.format_version": "identity-v1", "model": "Org/Model-1.5", "tag": "a+b_c",
                                         "layer_ids": "0,1,2,3", "head_dim": "16", "sides": "k,v", "group_size": "²"})
    pair = read_pair(pair_file)
    assert pair.model == "Org/Model-1.5" and pair.tag == "a+b_c" and pair.k.format_version == "identity-v1"
    assert pair.fitted_group_size is None  # a non-ASCII number is no group size


GGUF_CASES = [
    ({"rotationzoo.k.format_version": ("²", T.STRING)}, UnsupportedFormatError, "unknown format_version '²'"),
    ({"rotationzoo.export_format_version": ("²", T.STRING)}, UnsupportedFormatError, "is not a version"),
    ({"rotationzoo.export_format_version": (1.0, T.FLOAT32)}, UnsupportedFormatError, "'1.0' is not a version"),
    ({"rotationzoo.export_format_version": (2, T.UINT32)}, UnsupportedFormatError, "newer export format"),
    ({"rotationzoo.model": ("/etc; rm -rf ~", T.STRING)}, ExportError, "is not a NAMESPACE/NAME id"),
    ({"rotationzoo.layer_ids": ([0, 1, 2], T.ARRAY)}, ExportError, "metadata says layer_ids '0,1,2'"),
    ({"rotationzoo.layer_ids": (list(range(5000)), T.ARRAY)}, ExportError, "holds an array of 5000 INT32 values"),
    ({"rotationzoo.head_dim": (32, T.UINT32)}, ExportError, "metadata says head_dim '32'"),
    ({"rotationzoo.head_dim": (16.5, T.FLOAT32)}, ExportError, "metadata says head_dim '16.5'"),
    ({"rotationzoo.transposed": (False, T.BOOL)}, ExportError, "transposed is 'False'"),
    ({"rotationzoo.k.objective": ("x" * 5000, T.STRING)}, ExportError, "holds a string of 5000 bytes"),
]


@pytest.mark.parametrize("kv, error, message", GGUF_CASES)
def test_hostile_gguf_metadata_is_one_typed_line(tmp_path, kv, error, message) -> None:
    path = gguf_pair(tmp_path / "p.gguf", kv)
    for read in (read_pair, read_exported, resolve_pair):
        with pytest.raises(error, match=message) as ei:
            read(path)
        assert str(path) in str(ei.value) and "\n" not in str(ei.value)
    (report,) = verify_path(path)
    assert not report.ok


def test_hostile_gguf_tensors_and_bytes(tmp_path) -> None:
    for names in ("blk.{i}².attn_{s}_rot.weight", "blk.0{i}.attn_{s}_rot.weight"):
        with pytest.raises(ExportError, match="has no plain layer number"):
            read_pair(gguf_pair(tmp_path / "n.gguf", {}, names=names))
    good = gguf_pair(tmp_path / "g.gguf", {"rotationzoo.model": ("Org/abcd", T.STRING),
                                           "general.name": ("n" * 5000, T.STRING)})
    assert read_pair(good).model == "Org/abcd"  # a model's own long key is not ours to refuse
    data = bytearray(good.read_bytes())
    data[data.index(b"Org/abcd")] = 0xFF  # not UTF-8
    good.write_bytes(bytes(data))
    with pytest.raises(ExportError, match="cannot read GGUF key 'rotationzoo.model' \\(UnicodeDecodeError"):
        read_pair(good)


def test_hostile_base_gguf_numbers(tmp_path, pair_file) -> None:
    from rotationzoo.export import export_gguf

    base = tmp_path / "base.gguf"
    w = gguf.GGUFWriter(str(base), "qwen3")
    w.add_key_value("qwen3.block_count", "²", T.STRING)
    w.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ExportError, match="qwen3.block_count is '²'; expected a non-negative integer"):
        export_gguf(pair_file, tmp_path / "out.gguf", base_gguf=base)


# -- 4. verify applies export's K/V rule ------------------------------------------------------------------


def _per_head_folder(d: Path, k_heads: int, v_heads: int) -> Path:
    for side, heads, seed in (("k", k_heads, 1), ("v", v_heads, 2)):
        rot = random_orthogonal(2 * heads, 8, seed).reshape(2, heads, 8, 8)
        write_rotation(d / f"{side}_rotation.pt", RotationSet(rotations=rot, layer_ids=(0, 1), source_grouping=KV_HEAD,
                                                              objective=f"{'qqt' if side == 'k' else 'sst'}_r_h_pbr"))
    return d


@pytest.mark.parametrize("case, says", [
    ("layers", "K has 4 layers (0, 1, 2, 3) × d 16, V has 3 layers (0, 1, 2) × d 16"),
    ("head_dim", "K has 4 layers (0, 1, 2, 3) × d 16, V has 4 layers (0, 1, 2, 3) × d 32"),
    ("kv_heads", "K has 2 KV heads, V has 4"),
])
def test_verify_folder_refuses_what_export_refuses(tmp_path, capsys, case, says) -> None:
    d = tmp_path / case
    if case == "layers":
        make_folder(d, v_layers=3)
    elif case == "head_dim":
        make_folder(d, v_dim=32)
    else:
        _per_head_folder(d, 2, 4)
    rc, out, err = run_cli(capsys, "export", str(d), "--to", "safetensors", "--out", str(tmp_path / "x.safetensors"))
    assert rc == 1 and f"K and V disagree: {says}" in err
    with pytest.raises(InvalidRotationError, match="K and V disagree"):
        resolve_pair(d)
    rc, out, _ = run_cli(capsys, "verify", str(d), "--json")
    reports = json.loads(out)
    assert rc == 1 and len(reports) == 2
    assert all(not r["ok"] and f"{d}: K and V disagree: {says}" in r["problems"] for r in reports)
    rc, out, _ = run_cli(capsys, "verify", str(d))
    assert rc == 1 and out.count("K and V disagree") == 1  # once, though both sides fail
    # each file on its own is fine
    assert all(r.ok for f in sorted(d.iterdir()) if f.suffix == ".pt" for r in verify_path(f))


def test_verify_pair_file_with_disagreeing_sides(tmp_path) -> None:
    from safetensors.torch import save_file

    tensors = {f"k.{i}.rotation": random_orthogonal(1, 16, i)[0] for i in range(4)}
    tensors.update({f"v.{i}.rotation": random_orthogonal(1, 16, 10 + i)[0] for i in range(3)})
    path = tmp_path / "p.safetensors"
    save_file(tensors, str(path), metadata={"format": "rotationzoo.rotations"})
    reports = verify_path(path)
    assert len(reports) == 2 and all(not r.ok and "K and V disagree" in r.problems[-1] for r in reports)
    with pytest.raises(InvalidRotationError, match="K and V disagree"):
        resolve_pair(path)
    assert all(r.ok for r in verify_path(make_folder(tmp_path / "fine")))

