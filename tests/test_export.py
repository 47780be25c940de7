"""Exports: safetensors and GGUF round trips, GGUF layout checked with gguf's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rotationzoo
from rotationzoo.errors import InvalidRotationError, PairError, RotationFileError
from rotationzoo.export import (
    ExportError,
    export,
    export_gguf,
    export_safetensors,
    read_exported,
    read_exported_gguf,
    read_exported_safetensors,
)
from rotationzoo.files.format import RotationSet, write_rotation
from rotationzoo.hashing import sha256_file

from helpers import random_orthogonal, run_cli

gguf = pytest.importorskip("gguf")


def make_set(ids=(0, 1, 2, 3), d: int = 16, seed: int = 0, objective: str = "qqt_r_h_pbr", eig: bool = True) -> RotationSet:
    n = len(ids)
    ev = torch.rand(n, d, generator=torch.Generator().manual_seed(seed + 100)).sort(-1).values if eig else None
    return RotationSet(rotations=random_orthogonal(n, d, seed), layer_ids=tuple(ids), objective=objective, eigenvalues=ev)


@pytest.fixture
def pair_dir(tmp_path: Path) -> Path:
    d = tmp_path / "rotations"
    write_rotation(d / "k_rotation_qqt_r_h_pbr.pt", make_set(seed=1))
    write_rotation(d / "v_rotation_sst_r_h_pbr.pt", make_set(seed=2, objective="sst_r_h_pbr"))
    return d


# -- safetensors -----------------------------------------------------------------------------------


def test_safetensors_round_trip(pair_dir, tmp_path):
    from safetensors import safe_open

    k = rotationzoo.read_rotation(pair_dir / "k_rotation_qqt_r_h_pbr.pt")
    v = rotationzoo.read_rotation(pair_dir / "v_rotation_sst_r_h_pbr.pt")
    out = export_safetensors(pair_dir, tmp_path / "pair.safetensors")
    back = read_exported_safetensors(out)
    assert back.sides == ("k", "v")
    assert torch.equal(back.k.rotations, k.rotations) and torch.equal(back.v.rotations, v.rotations)
    assert torch.equal(back.k.eigenvalues, k.eigenvalues) and torch.equal(back.v.eigenvalues, v.eigenvalues)
    assert back.k.objective == "qqt_r_h_pbr" and back.v.objective == "sst_r_h_pbr"
    assert back.k.layer_ids == (0, 1, 2, 3)
    # independently of our reader: names, shapes, dtypes, metadata
    with safe_open(str(out), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        assert torch.equal(f.get_tensor("k.2.rotation"), k.rotations[2])
        assert f.get_tensor("v.3.eigenvalues").dtype == torch.float32
    assert keys == {f"{s}.{i}.{t}" for s in "kv" for i in range(4) for t in ("rotation", "eigenvalues")}
    assert meta["k.objective"] == "qqt_r_h_pbr" and meta["v.objective"] == "sst_r_h_pbr"
    assert meta["k.format_version"] == "1" and meta["export_format_version"] == "1"
    assert meta["layer_ids"] == "0,1,2,3" and meta["head_dim"] == "16"
    assert meta["format"] == "rotationzoo.rotations"
    assert len(meta["k.sha256"]) == 64


def test_safetensors_from_bundled_model_has_model_and_tag(tmp_path):
    out = export_safetensors("SmolLM2-135M-Instruct", tmp_path / "smol.safetensors")
    back = read_exported(out)
    pair = rotationzoo.load("SmolLM2-135M-Instruct")
    default = pair.entry.name
    assert back.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and back.tag == default
    assert back.metadata["model"] == back.model and back.metadata["tag"] == default
    assert torch.equal(back.k.rotations, pair.k.rotations) and torch.equal(back.k.k_mean, pair.k.k_mean)
    # the export records where it came from; reading it back is keyed by the export's own bytes
    assert {s: back.metadata[f"{s}.sha256"] for s in "kv"} == pair.sha256
    assert back.sha256 == {s: sha256_file(out) for s in "kv"}
    closed = "SmolLM2-135M-Instruct@emma-seq20000_prompt10-oscar2_center"  # a closed form: the fitter wrote eigenvalues
    fitted, back = rotationzoo.load(closed), read_exported(export_safetensors(closed, tmp_path / "c.safetensors"))
    assert fitted.k.eigenvalues is not None and fitted.v.eigenvalues is not None
    assert torch.equal(back.k.eigenvalues, fitted.k.eigenvalues) and torch.equal(back.v.eigenvalues, fitted.v.eigenvalues)


def test_export_accepts_pair_sets_and_single_side(pair_dir, tmp_path):
    k = rotationzoo.read_rotation(pair_dir / "k_rotation_qqt_r_h_pbr.pt")
    v = rotationzoo.read_rotation(pair_dir / "v_rotation_sst_r_h_pbr.pt")
    out = export_safetensors({"k": k, "v": v}, tmp_path / "a.safetensors")
    assert read_exported(out).sides == ("k", "v")
    out = export_safetensors(pair_dir / "v_rotation_sst_r_h_pbr.pt", tmp_path / "v.safetensors")
    assert read_exported(out).sides == ("v",)
    # a name that tells nothing: side from the objective, or given explicitly
    write_rotation(tmp_path / "mystery.pt", make_set(seed=5, objective="hadamard"))
    with pytest.raises(PairError, match="K or the V"):
        export_safetensors(tmp_path / "mystery.pt", tmp_path / "m.safetensors")
    out = export_gguf(tmp_path / "mystery.pt", tmp_path / "m.gguf", side="k")
    assert read_exported(out).sides == ("k",)
    # the other side of a pair file
    out = export_gguf(tmp_path / "a.safetensors", tmp_path / "only-v.gguf", side="v")
    assert torch.equal(read_exported(out).v.rotations, v.rotations)


# -- GGUF --------------------------------------------------------------------------------------------


def ggml_mul_mat(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml_mul_mat(a, b) on numpy views of ggml tensors (numpy shape = reversed ne).

    a: [ne1_a, ne0] (rows of length ne0), b: [n, ne0] → result [n, ne1_a] with
    result[j, i] = Σ_k a[i, k] · b[j, k] (ggml contracts ne0 of both operands).
    """
    return np.einsum("ik,jk->ji", a.astype(np.float64), b.astype(np.float64))


def test_gguf_round_trip_and_layout(pair_dir, tmp_path):
    k = rotationzoo.read_rotation(pair_dir / "k_rotation_qqt_r_h_pbr.pt")
    v = rotationzoo.read_rotation(pair_dir / "v_rotation_sst_r_h_pbr.pt")
    assert not torch.allclose(k.rotations[0], k.rotations[0].T)  # transposition is observable
    out = export_gguf(pair_dir, tmp_path / "rot.gguf")
    back = read_exported_gguf(out)
    assert torch.equal(back.k.rotations, k.rotations) and torch.equal(back.v.rotations, v.rotations)
    assert back.k.layer_ids == (0, 1, 2, 3) and back.k.objective == "qqt_r_h_pbr"

    # independently, with gguf's own reader
    r = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == {f"blk.{i}.attn_{s}_rot.weight" for i in range(4) for s in "kv"}
    x = torch.randn(5, 16, dtype=torch.float64)
    for i in range(4):
        for s, rs in (("k", k), ("v", v)):
            t = tensors[f"blk.{i}.attn_{s}_rot.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert [int(n) for n in t.shape] == [16, 16]
            m = rs.rotations[i].numpy()
            np.testing.assert_array_equal(t.data, m.T)  # stored Mᵀ
            # ggml_mul_mat(rot, K) == K @ M
            got = ggml_mul_mat(np.asarray(t.data), x.numpy())
            np.testing.assert_allclose(got, x.numpy() @ m.astype(np.float64), rtol=0, atol=1e-12)
    fields = {name: f.contents() for name, f in r.fields.items()}
    assert fields["general.architecture"] == "rotationzoo"
    assert fields["rotationzoo.layer_ids"] == [0, 1, 2, 3]
    assert fields["rotationzoo.head_dim"] == 16
    assert fields["rotationzoo.k.objective"] == "qqt_r_h_pbr" and fields["rotationzoo.v.objective"] == "sst_r_h_pbr"
    assert fields["rotationzoo.transposed"] is True


def test_gguf_sparse_layer_ids_name_the_blocks(tmp_path):
    d = tmp_path / "hybrid"
    write_rotation(d / "k_rotation.pt", make_set(ids=(3, 7, 11), d=32, seed=3))
    write_rotation(d / "v_rotation.pt", make_set(ids=(3, 7, 11), d=32, seed=4, objective="sst_r_h_pbr"))
    out = export_gguf(d, tmp_path / "h.gguf")
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert "blk.7.attn_v_rot.weight" in names and "blk.0.attn_k_rot.weight" not in names
    assert read_exported_gguf(out).v.layer_ids == (3, 7, 11)


def test_gguf_from_upstream_files(upstream_dir, tmp_path):
    src = upstream_dir / "qwen3-4b-thinking-2507"
    out = export_gguf(src, tmp_path / "q4b.gguf")
    back = read_exported_gguf(out)
    k = rotationzoo.read_rotation(src / "k_rotation_qqt_r_h_pbr.pt")
    assert back.k.rotations.shape == (36, 128, 128)
    assert torch.equal(back.k.rotations, k.rotations)


def fake_model_gguf(path: Path, *, blocks: int = 4, head_dim: int = 16, arch: str = "qwen3") -> dict[str, np.ndarray]:
    """A small model-like GGUF: arch keys, a string array, F32/F16 and Q8_0 tensors."""
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_head_count(2)
    w.add_embedding_length(2 * head_dim)
    w.add_key_length(head_dim)
    w.add_token_list(["<s>", "hello", "world"])
    w.add_string("general.name", "fake")
    rng = np.random.default_rng(0)
    data = {
        "token_embd.weight": rng.standard_normal((3, 2 * head_dim)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((2 * head_dim, 2 * head_dim)).astype(np.float16),
    }
    for name, arr in data.items():
        w.add_tensor(name, arr)
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.1.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    data["blk.1.ffn_up.weight"] = q8
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return data


def test_gguf_merge_into_model_copies_base_through(pair_dir, tmp_path):
    base = tmp_path / "model.gguf"
    data = fake_model_gguf(base)
    out = export_gguf(pair_dir, tmp_path / "model-rot-kv.gguf", base_gguf=base)
    r = gguf.GGUFReader(str(out))
    rb = gguf.GGUFReader(str(base))
    tensors = {t.name: t for t in r.tensors}
    for name, arr in data.items():
        assert np.array_equal(np.asarray(tensors[name].data), arr), name
        assert tensors[name].tensor_type == {t.name: t for t in rb.tensors}[name].tensor_type
    for name, f in rb.fields.items():
        if not name.startswith("GGUF."):
            assert r.fields[name].contents() == f.contents(), name
    assert r.fields["general.architecture"].contents() == "qwen3"
    assert r.fields["rotationzoo.sides"].contents() == "k,v"
    assert len(tensors) == len(data) + 8
    k = rotationzoo.read_rotation(pair_dir / "k_rotation_qqt_r_h_pbr.pt")
    assert torch.equal(read_exported_gguf(out).k.rotations, k.rotations)
    # merging again (from the merged file) replaces the rotation tensors instead of duplicating them
    other = tmp_path / "other"
    write_rotation(other / "k_rotation.pt", make_set(seed=11))
    write_rotation(other / "v_rotation.pt", make_set(seed=12, objective="sst_r_h_pbr"))
    out2 = export_gguf(other, tmp_path / "model-rot-kv2.gguf", base_gguf=out)
    r2 = gguf.GGUFReader(str(out2))
    assert len(r2.tensors) == len(data) + 8
    assert torch.equal(read_exported_gguf(out2).k.rotations, rotationzoo.read_rotation(other / "k_rotation.pt").rotations)


def test_gguf_merge_rejects_a_mismatched_model(pair_dir, tmp_path):
    small = tmp_path / "small.gguf"
    fake_model_gguf(small, blocks=2)
    with pytest.raises(ExportError, match="2 blocks"):
        export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=small)
    wide = tmp_path / "wide.gguf"
    fake_model_gguf(wide, head_dim=32)
    with pytest.raises(ExportError, match="head size is 32"):
        export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=wide)
    with pytest.raises(ExportError, match="not found"):
        export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ExportError, match="not a GGUF"):
        export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=tmp_path / "junk.gguf")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("alignment", [1 << 24, 1 << 17])
def test_gguf_merge_refuses_a_base_alignment_no_model_uses(pair_dir, tmp_path, alignment):
    """The base's general.alignment pads every tensor: 2^24 made a 1 GB file of a 177-byte base, 2^31 a
    17 GB buffer. A power of two up to 64 KiB is copied; anything else is one line, and nothing is written."""
    import struct

    def text(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    kv = [(b"general.architecture", 8, text(b"llama")), (b"llama.block_count", 4, struct.pack("<I", 4)),
          (b"llama.attention.key_length", 4, struct.pack("<I", 16)),
          (b"general.alignment", 4, struct.pack("<I", alignment))]
    base = tmp_path / "base.gguf"
    base.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(
        text(k) + struct.pack("<I", t) + v for k, t, v in kv))
    with pytest.raises(ExportError, match="general.alignment is .*; expected a power of two"):
        export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=base)
    assert not (tmp_path / "x.gguf").exists()


def _gstr(b: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(b)) + b


def hostile_gguf(path: Path, kv: list[tuple[bytes, int, bytes]], *, tensors: int = 0, keys: int | None = None,
                 tail: bytes = b"") -> Path:
    """A GGUF v3 header written byte by byte: ``(key, value type, value bytes)`` entries, then ``tail``."""
    import struct

    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, len(kv) if keys is None else keys)
                     + b"".join(_gstr(k) + struct.pack("<I", t) + v for k, t, v in kv) + tail)
    return path


def test_gguf_metadata_bomb_refused_before_the_reader_parses_it(pair_dir, tmp_path):
    """One key holding 200,000 empty strings (1.6 MB; 2M in 16 MB cost gguf.GGUFReader 33 s and 3.4 GB) is refused
    by the header pre-scan in milliseconds, with the memory of one read buffer, as a file and as --base-gguf."""
    import struct
    import time
    import tracemalloc

    n = 200_000
    bomb = hostile_gguf(tmp_path / "bomb.gguf", [(b"general.junk", 9, struct.pack("<IQ", 8, n) + bytes(8 * n))])
    match = (rf"bomb\.gguf: cannot read GGUF: key 'general\.junk' is an array of {n} STRING items, more metadata "
             rf"than a GGUF of {bomb.stat().st_size} bytes may hold \(at most \d+ units")
    for call in (lambda: read_exported_gguf(bomb), lambda: export_gguf(pair_dir, tmp_path / "x.gguf", base_gguf=bomb)):
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            with pytest.raises(ExportError, match=match) as ei:
                call()
            seconds, peak = time.perf_counter() - t0, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "\n" not in str(ei.value)
        assert seconds < 0.5, f"took {seconds:.2f} s"
        assert peak < 4 << 20, f"{peak} bytes allocated to refuse it"  # the reader: ~1.6 KB per string
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("case,match", [
    ("string past end", r"key 'general\.name' of 1099511627776 bytes at byte \d+ runs past the end of the file"),
    ("array past end", r"key 'a''s array of 4000 bytes at byte \d+ runs past the end of the file"),
    ("array string past end", r"a string of key 'a' of 4294967296 bytes .* runs past the end"),
    ("too many items", r"key 'a' is an array of 4194305 UINT8 items, more than 4194304 array items in all"),
    ("nested array", r"key 'a' is an array of ARRAY; GGUF arrays hold numbers or strings"),
    ("unknown type", r"key 'a' has unknown value type 13"),
    ("key count", r"the header declares 1099511627776 metadata keys and 0 tensors; a model GGUF holds at most 65536"),
    ("tensor count", r"the header declares 0 metadata keys and 1000000 tensors"),
    ("tensor dims", r"tensor 't' has 4294967295 dimensions; expected at most 4"),
    ("many tensors", r"the header, more metadata than a GGUF of \d+ bytes may hold"),
    ("truncated", r"the type of key 'a' of 4 bytes at byte \d+ runs past the end of the file"),
])
def test_gguf_hostile_headers_refused_by_the_pre_scan(tmp_path, monkeypatch, case, match):
    """Counts and lengths are checked against the bounds and the file's size before gguf.GGUFReader runs."""
    import struct

    def no_reader(*a, **k):
        raise AssertionError("gguf.GGUFReader reached")

    monkeypatch.setattr(gguf, "GGUFReader", no_reader)
    p = tmp_path / "h.gguf"
    if case == "string past end":
        hostile_gguf(p, [(b"general.name", 8, struct.pack("<Q", 1 << 40) + b"x")])
    elif case == "array past end":
        hostile_gguf(p, [(b"a", 9, struct.pack("<IQ", 4, 1000) + bytes(40))])
    elif case == "array string past end":
        hostile_gguf(p, [(b"a", 9, struct.pack("<IQQ", 8, 2, 0) + struct.pack("<Q", 1 << 32))])
    elif case == "too many items":
        hostile_gguf(p, [(b"a", 9, struct.pack("<IQ", 0, (1 << 22) + 1))])
    elif case == "nested array":
        hostile_gguf(p, [(b"a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 0, 0))])
    elif case == "unknown type":
        hostile_gguf(p, [(b"a", 13, b"")])
    elif case == "key count":
        hostile_gguf(p, [], keys=1 << 40)
    elif case == "tensor count":
        hostile_gguf(p, [], tensors=1_000_000)
    elif case == "tensor dims":
        hostile_gguf(p, [], tensors=1, tail=_gstr(b"t") + struct.pack("<I", 2**32 - 1))
    elif case == "many tensors":  # 24 bytes each on disk, ~5 KB each in the reader
        hostile_gguf(p, [], tensors=50_000, tail=(_gstr(b"") + struct.pack("<IIQ", 0, 0, 0)) * 50_000)
    else:
        hostile_gguf(p, [(b"a", 0, b"")], tail=b"")
        p.write_bytes(p.read_bytes()[:-4])
    with pytest.raises(ExportError, match=r"h\.gguf: cannot read GGUF: " + match):
        read_exported_gguf(p)


def test_gguf_pre_scan_passes_a_model_sized_tokenizer(tmp_path):
    """A model-like GGUF with a 32k-token tokenizer (tokens, scores, types, merges) passes the pre-scan quickly."""
    import time

    from rotationzoo.files.pairfile.gguf_header import scan_gguf_header

    vocab = 32_000
    path = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    toks = [f"tok{i}" for i in range(vocab)]
    w.add_token_list(toks)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"t{i % 97} k{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.zeros((vocab, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t0 = time.perf_counter()
    scan_gguf_header(path)
    assert time.perf_counter() - t0 < 1.0


# -- bad inputs ------------------------------------------------------------------------------------


def test_bad_inputs(pair_dir, tmp_path):
    with pytest.raises(PairError, match="no such file or folder"):
        export_safetensors(tmp_path / "nope.pt", tmp_path / "o.safetensors")
    with pytest.raises(PairError, match="not a file, a folder or a registry model"):
        export_safetensors("NoSuchModel-7B", tmp_path / "o.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PairError, match="no rotation pair found"):
        export_gguf(empty, tmp_path / "o.gguf")
    half = tmp_path / "half"
    write_rotation(half / "k_rotation_qqt_r_h_pbr.pt", make_set(seed=1))
    with pytest.raises(PairError, match="no v_rotation"):
        export_gguf(half, tmp_path / "o.gguf")
    bad = tmp_path / "bad"
    rs = make_set(seed=1)
    rs.rotations[2] *= 1.5
    write_rotation(bad / "k_rotation.pt", rs)
    write_rotation(bad / "v_rotation.pt", make_set(seed=2, objective="sst_r_h_pbr"))
    with pytest.raises(InvalidRotationError, match="layer 2: not orthogonal"):
        export_gguf(bad, tmp_path / "o.gguf")
    mismatch = tmp_path / "mismatch"
    write_rotation(mismatch / "k_rotation.pt", make_set(seed=1))
    write_rotation(mismatch / "v_rotation.pt", make_set(ids=(0, 1, 2), seed=2, objective="sst_r_h_pbr"))
    with pytest.raises(InvalidRotationError, match="disagree"):
        export_safetensors(mismatch, tmp_path / "o.safetensors")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF")
    with pytest.raises(ExportError, match="cannot read GGUF"):
        read_exported_gguf(tmp_path / "fake.gguf")
    base = tmp_path / "model.gguf"
    fake_model_gguf(base)
    with pytest.raises(ExportError, match="no blk"):
        read_exported_gguf(base)
    with pytest.raises(ExportError, match="is a folder"):
        export_safetensors(pair_dir, tmp_path)
    with pytest.raises(ExportError, match="unknown export format"):
        export(pair_dir, tmp_path / "o.onnx", to="onnx")
    with pytest.raises(RotationFileError):  # ExportError is a RotationFileError
        export_safetensors(pair_dir, tmp_path / "o.safetensors", tag="x")
    assert not list(tmp_path.glob("o.*"))


# -- CLI -------------------------------------------------------------------------------------------


def test_cli_export(pair_dir, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    rc, text, err = run_cli(capsys, "export", str(pair_dir), "--to", "gguf", "--out", str(out), "--json")
    assert rc == 0, err
    info = json.loads(text)
    assert info["out"] == str(out) and info["to"] == "gguf" and info["sides"] == ["k", "v"] and info["layers"] == 4 and info["head_dim"] == 16
    assert info["objectives"] == {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"}
    rc, text, err = run_cli(capsys, "export", "SmolLM2-135M-Instruct", "--to", "safetensors", "--out",
                            str(tmp_path / "s.safetensors"))
    assert rc == 0, err
    default = rotationzoo.get_model("SmolLM2-135M-Instruct").default_tag
    assert "30 layers" in text and f"HuggingFaceTB/SmolLM2-135M-Instruct@{default}" in text
    base = tmp_path / "model.gguf"
    fake_model_gguf(base)
    rc, text, err = run_cli(capsys, "export", str(out), "--to", "gguf", "--base-gguf", str(base),
                            "--out", str(tmp_path / "model-rot-kv.gguf"))
    assert rc == 0, err
    assert read_exported_gguf(tmp_path / "model-rot-kv.gguf").sides == ("k", "v")
    rc, _, err = run_cli(capsys, "export", str(pair_dir), "--to", "onnx", "--out", str(tmp_path / "x"))
    assert rc == 2 and "Invalid value for '--to'" in err and "'safetensors', 'gguf'" in err
    rc, _, err = run_cli(capsys, "export", str(pair_dir), "--to", "safetensors", "--base-gguf", str(base),
                         "--out", str(tmp_path / "x"))
    assert rc == 2 and "--base-gguf applies to --to gguf only" in err
    rc, _, err = run_cli(capsys, "export", str(tmp_path / "missing"), "--to", "gguf", "--out", str(tmp_path / "x"))
    assert rc == 1 and "no such file or folder" in err


def test_cli_export_then_verify_round_trips(pair_dir, tmp_path, capsys):
    """`export DIR --to safetensors` then `verify` of that file: a pair file, one row per side."""
    out = tmp_path / "p.safetensors"
    rc, _, err = run_cli(capsys, "export", str(pair_dir), "--to", "safetensors", "--out", str(out))
    assert rc == 0, err
    rc, text, err = run_cli(capsys, "verify", str(out))
    assert rc == 0, text + err
    assert f"{out} [k]" in text and f"{out} [v]" in text and "qqt_r_h_pbr" in text and "sst_r_h_pbr" in text
    rc, text, _ = run_cli(capsys, "verify", str(out), "--num-layers", "4", "--head-dim", "16", "--json")
    assert rc == 0 and [r["path"] for r in json.loads(text)] == [f"{out} [k]", f"{out} [v]"]


@pytest.mark.parametrize("source", ["folder", "SmolLM2-135M-Instruct@emma-seq20000_prompt10_group16-r_pbr_hg16"])
@pytest.mark.parametrize("to", ["safetensors", "gguf"])
def test_cli_export_side_is_honoured(pair_dir, tmp_path, capsys, source, to):
    src = str(pair_dir) if source == "folder" else source
    for side in ("k", "v"):
        out = tmp_path / f"{side}.{to}"
        rc, text, err = run_cli(capsys, "export", src, "--to", to, "--side", side, "--out", str(out))
        assert rc == 0, err
        assert f"sides {side.upper()}," in text
        assert read_exported(out).sides == (side,)
        rc, text, _ = run_cli(capsys, "verify", str(out), "--json")
        assert rc == 0 and [r["path"] for r in json.loads(text)] == [f"{out} [{side}]"]


def test_side_of_a_single_file_from_its_name_or_objective(tmp_path) -> None:
    """A single file's side comes from its name (k_/v_), else its objective (qqt/ktk → K, sst/vtv → V)."""
    from rotationzoo.files.pair import infer_side, read_pair

    assert infer_side(Path("k_rotation_x.pt"), "sst_r_h_pbr") == "k"  # the name wins
    assert infer_side(Path("rot.pt"), "qqt_r_h_pbr") == "k" and infer_side(Path("rot.pt"), "ktk_plain") == "k"
    assert infer_side(Path("rot.pt"), "sst_r_pbr_hg16") == "v" and infer_side(None, "identity-v") == "v"
    assert infer_side(Path("rot.pt"), "hadamard") is None
    rs = RotationSet(rotations=random_orthogonal(2, 16), layer_ids=(0, 1), objective="sst_r_h_pbr")
    write_rotation(tmp_path / "rot.pt", rs)
    assert read_pair(tmp_path / "rot.pt").sides == ("v",)
    out = export_safetensors(tmp_path / "rot.pt", tmp_path / "rot.safetensors")
    assert read_exported(out).sides == ("v",)
    rs.objective = "hadamard"
    write_rotation(tmp_path / "h.pt", rs)
    with pytest.raises(PairError, match="K or the V rotation"):
        read_pair(tmp_path / "h.pt")
    assert read_pair(tmp_path / "h.pt", side="k").sides == ("k",)


@pytest.mark.parametrize("to", ["safetensors", "gguf"])
def test_export_never_replaces_a_pipe_or_its_own_input(pair_dir, tmp_path, to, capsys):
    """A FIFO (or a device such as /dev/null) at --out is refused, not replaced by a regular file; an output
    that is the pair's file, a file inside the pair's folder or the base GGUF is refused before anything is
    read, and every input keeps its bytes."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ExportError, match="a device, a pipe or a socket"):
        export(pair_dir, fifo, to=to)
    assert fifo.is_fifo()
    before = {p: p.read_bytes() for p in pair_dir.iterdir()}
    k_file = pair_dir / "k_rotation_qqt_r_h_pbr.pt"
    for source, out in ((pair_dir, k_file), (pair_dir, pair_dir / "new.out"), (k_file, k_file)):
        with pytest.raises(ExportError, match="this run reads; give another file name"):
            export(source, out, to=to, side="k" if source == k_file else None)
    assert {p: p.read_bytes() for p in pair_dir.iterdir()} == before
    rc, _, err = run_cli(capsys, "export", str(pair_dir), "--to", to, "--out", str(k_file))
    assert rc == 1 and "inside" in err and {p: p.read_bytes() for p in pair_dir.iterdir()} == before
    if to == "gguf":
        base = tmp_path / "model.gguf"
        fake_model_gguf(base)
        kept = base.read_bytes()
        with pytest.raises(ExportError, match="this run reads"):
            export(pair_dir, base, to="gguf", base_gguf=base)
        assert base.read_bytes() == kept


@pytest.mark.parametrize("to", ["safetensors", "gguf"])
def test_export_never_writes_over_or_into_a_registry_ids_package_files(to, capsys):
    """A registry id names no file: the files it was read from (here, bundled with the package) are checked
    once resolved, and an output there or beside them is refused, nothing written."""
    bundled = rotationzoo.load("SmolLM2-135M-Instruct").paths["k"]
    kept = bundled.read_bytes()
    for out in (bundled, bundled.parent / "new.out"):
        with pytest.raises(ExportError, match="this run reads; give another file name"):
            export("SmolLM2-135M-Instruct", out, to=to)
    rc, _, err = run_cli(capsys, "export", "SmolLM2-135M-Instruct", "--to", to, "--out", str(bundled))
    assert rc == 1 and "a file this run reads" in err
    assert bundled.read_bytes() == kept and not (bundled.parent / "new.out").exists()


@pytest.mark.timeout(60)
def test_a_pipe_given_as_input_is_named_a_fifo_not_missing(tmp_path, capsys):
    """A FIFO (or another file that is not a regular file) given as the rotations of ``export`` or ``serve-args``
    is said to be one, not "no such file or folder"; nothing is read from it (a read would block)."""
    import os

    from rotationzoo.files.pair import resolve_pair

    fifo = tmp_path / "k_rotation_x.pt"
    os.mkfifo(fifo)
    with pytest.raises(PairError, match=r"k_rotation_x.pt: a FIFO, not a regular file or a folder"):
        resolve_pair(fifo)
    for argv in (["export", str(fifo), "--to", "safetensors", "--out", str(tmp_path / "o.safetensors")],
                 ["serve-args", str(fifo)]):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 1 and "a FIFO, not a regular file or a folder" in err and len(err.strip().splitlines()) == 1, err
    rc, _, err = run_cli(capsys, "serve-args", str(tmp_path / "missing.pt"))
    assert rc == 1 and "missing.pt: no such file or folder" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k_rotation_x.pt"]


def test_every_user_output_writer_refuses_a_pipe(tmp_path):
    """The writers that rename a finished file onto a user's path (rotation files, text reports and manifests)
    refuse a FIFO there at the moment of writing, and leave it."""
    import os

    from rotationzoo.errors import ConfigError
    from rotationzoo.safefile import write_text_atomic

    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    with pytest.raises(RotationFileError, match="a device, a pipe or a socket"):
        write_rotation(fifo, make_set())
    with pytest.raises(ConfigError, match="a device, a pipe or a socket"):
        write_text_atomic(fifo, "{}")
    assert fifo.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["pipe.pt"]  # no temporary file left


def test_safetensors_outputs_follow_the_umask(pair_dir, tmp_path):
    """safetensors creates its files 0600: an export and a rotation file in safetensors get 0666 less the umask,
    as the .pt and .gguf outputs do (0644 under umask 022), readable by those the user shares them with."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        export(pair_dir, tmp_path / "pair.safetensors", to="safetensors")
        write_rotation(tmp_path / "k.safetensors", make_set())
        export(pair_dir, tmp_path / "pair.gguf", to="gguf")
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE((tmp_path / name).stat().st_mode) for name in ("pair.safetensors", "k.safetensors",
                                                                              "pair.gguf")}
    assert modes == {"pair.safetensors": 0o644, "k.safetensors": 0o644, "pair.gguf": 0o644}


def test_a_link_to_a_pipe_at_the_output_is_refused(pair_dir, tmp_path):
    """A link is replaced itself, never written through, but not one to a device, pipe or socket: as root
    ``--out /dev/stdout`` (a link to /proc/self/fd/1) would have replaced the system's /dev/stdout."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "out.safetensors"
    link.symlink_to(fifo)
    with pytest.raises(ExportError, match="a link to a device, a pipe or a socket"):
        export(pair_dir, link, to="safetensors")
    assert link.is_symlink() and fifo.is_fifo()
    regular = tmp_path / "file.safetensors"
    regular.write_bytes(b"old")
    other = tmp_path / "other.safetensors"
    other.symlink_to(regular)
    export(pair_dir, other, to="safetensors")  # a link to a file: the link is replaced, the file keeps its bytes
    assert not other.is_symlink() and regular.read_bytes() == b"old"
