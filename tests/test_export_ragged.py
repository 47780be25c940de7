"""GGUF export of a ragged pair (Gemma-4's shape: head_dim 256 on sliding-window layers, 512 on the
full-attention ones) in the layout the llama.cpp branch reads: one ``blk.{i}.attn_{k,v}_rot.weight``
per layer at that layer's own size, read back by this package and by gguf's own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import rotationzoo
from rotationzoo.cli.main import main
from rotationzoo.export import ExportError, export_gguf, read_exported_gguf
from rotationzoo.files.format import RotationSet, write_rotation
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.registry import get_entry

gguf = pytest.importorskip("gguf")

GEMMA = get_entry("gemma-4-12B-it").architecture
IDS = GEMMA.expected_layer_ids()


def ragged_set(seed: int, objective: str) -> RotationSet:
    """Per-layer Hadamard matrices with random column signs, at each layer's head_dim (fp32)."""
    g = torch.Generator().manual_seed(seed)
    rots = tuple((hadamard_matrix(GEMMA.head_dims(lid), dtype=torch.float32)
                  * (torch.randint(0, 2, (GEMMA.head_dims(lid),), generator=g) * 2 - 1)).contiguous() for lid in IDS)
    return RotationSet(rots, IDS, objective=objective)


@pytest.fixture(scope="module")
def gemma_pair(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gemma") / "rotations"
    write_rotation(d / "k_rotation_qqt_r_h_pbr.pt", ragged_set(1, "qqt_r_h_pbr"))
    write_rotation(d / "v_rotation_sst_r_h_pbr.pt", ragged_set(2, "sst_r_h_pbr"))
    return d


def test_a_ragged_pair_exports_layer_by_layer_and_reads_back(gemma_pair, tmp_path):
    out = export_gguf(gemma_pair, tmp_path / "gemma-rot.gguf")
    back = read_exported_gguf(out)
    k = rotationzoo.read_rotation(gemma_pair / "k_rotation_qqt_r_h_pbr.pt")
    assert back.layer_ids == IDS and str(back.head_dims) == str(GEMMA.head_dims)
    assert isinstance(back.k.rotations, tuple)
    assert all(torch.equal(a, b) for a, b in zip(back.k.rotations, k.rotations))
    # gguf's own reader: each layer's tensor at its own size, holding Mᵀ
    r = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in r.tensors}
    assert len(tensors) == 2 * len(IDS)
    for lid, m in zip(IDS, k.rotations):
        t = tensors[f"blk.{lid}.attn_k_rot.weight"]
        d = GEMMA.head_dims(lid)
        assert [int(n) for n in t.shape] == [d, d] and t.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(t.data), m.numpy().T)
    assert r.fields["rotationzoo.head_dim"].contents() == str(GEMMA.head_dims)


def gemma_base(path: Path, *, key_length: int = 512, key_length_swa: int = 256, blocks: int = 48) -> None:
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(blocks)
    w.add_head_count(16)
    w.add_key_length(key_length)
    w.add_uint32(gguf.Keys.Attention.KEY_LENGTH_SWA.format(arch="gemma4"), key_length_swa)
    w.add_tensor("token_embd.weight", np.ones((3, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_ragged_pair_merges_into_a_gemma_model_gguf(gemma_pair, tmp_path):
    base = tmp_path / "gemma-4-12b-q4km.gguf"
    gemma_base(base)
    out = export_gguf(gemma_pair, tmp_path / "gemma-4-12b-q4km-rot-kv.gguf", base_gguf=base)
    r = gguf.GGUFReader(str(out))
    assert r.fields["general.architecture"].contents() == "gemma4"
    assert {t.name for t in r.tensors} >= {"token_embd.weight", "blk.5.attn_v_rot.weight", "blk.4.attn_k_rot.weight"}
    assert read_exported_gguf(out).layer_ids == IDS
    wrong = tmp_path / "wrong.gguf"
    gemma_base(wrong, key_length=256, key_length_swa=128)
    with pytest.raises(ExportError, match="the model's head size is 128 and 256, the rotations are 256×256 and 512×512"):
        export_gguf(gemma_pair, tmp_path / "x.gguf", base_gguf=wrong)


def test_cli_export_of_a_ragged_pair_then_verify(gemma_pair, tmp_path, capsys):
    out = tmp_path / "g.gguf"
    assert main(["export", str(gemma_pair), "--to", "gguf", "--out", str(out)]) == 0
    assert "256,5:512" in capsys.readouterr().out
    assert main(["verify", str(out), "--head-dim", str(GEMMA.head_dims)]) == 0
