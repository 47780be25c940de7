"""The zoo's entries as the authors' recipes read them: zoo folders found by pattern at the source
(exactly one match, as the recipes' need_rot), Qwen3.8-27B, Kimi-K3's 4-bit latent, the MiniMax-M2.7
conflict, the prebuilt llama.cpp GGUFs, the current Mamba flag, and the other files of the authors'
tree (PQ codebooks, K clip tables) recognised by kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hubserver import hub_env, hub_server  # noqa: F401  (fixtures)
from rotationzoo.files.artefacts import identify_torch_file, read_k_clip_per_head, read_k_clip_per_layer
from rotationzoo.errors import ConfigError, RotationFileError
from rotationzoo.files.format import RotationSet, read_rotation, write_rotation
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.registry import get_entry, get_model
from rotationzoo.serving import launch_spec

from helpers import run_cli

ZOO = "Zhongzhu/OSCAR-RotationZoo"


def pair_bytes(tmp: Path, model: str, seed: int = 0) -> dict[str, bytes]:
    """A K and a V file for ``model``'s attention layers (Hadamard with random signs), as bytes."""
    arch = get_entry(model).architecture
    ids = arch.expected_layer_ids()
    out = {}
    for i, side in enumerate(("k", "v")):
        g = torch.Generator().manual_seed(seed + i)
        signs = torch.randint(0, 2, (len(ids), 1, arch.head_dim), generator=g) * 2 - 1
        rot = hadamard_matrix(arch.head_dim, dtype=torch.float32).expand(len(ids), -1, -1) * signs
        p = write_rotation(tmp / f"{side}-{seed}.pt", RotationSet(rotations=rot.contiguous(), layer_ids=ids,
                                                                  objective="qqt_r_h_pbr" if side == "k" else "sst_r_h_pbr"))
        out[side] = p.read_bytes()
    return out


# -- zoo folders found by pattern ----------------------------------------------------------------------


def test_a_zoo_folder_is_fetched_by_its_one_matching_file(hub_env, tmp_path, cache_dir, capsys):
    """Qwen3.5-4B's default tag is the zoo folder the recipe reads: one k_rotation_*.pt, one v_rotation_*.pt."""
    pair = pair_bytes(tmp_path, "Qwen3.5-4B")
    hub_env.server.commit_files(ZOO, {"Qwen3.5-4B/k_rotation_qqt_r_h_pbr.pt": pair["k"],
                                      "Qwen3.5-4B/v_rotation_sst_r_h_pbr.pt": pair["v"],
                                      "Qwen3.5-4B/README.md": b"notes"})
    rc, out, err = run_cli(capsys, "fetch", "Qwen3.5-4B", "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert got["tag"] == "zoo"
    k = read_rotation(got["k"]["path"])
    assert k.layer_ids == (3, 7, 11, 15, 19, 23, 27, 31) and k.head_dim == 256
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3.5-4B")
    assert rc == 0, err
    assert "--mamba-radix-cache-strategy extra_buffer" in out and "--mamba-scheduler-strategy" not in out


@pytest.mark.parametrize("files, says", [
    ({"Qwen3.5-4B/k_rotation_a.pt": b"x", "Qwen3.5-4B/k_rotation_b.pt": b"y"},
     "several files match Qwen3.5-4B/k_rotation_*.pt (k_rotation_a.pt, k_rotation_b.pt); the registry must name one"),
    ({"Qwen3.5-4B/README.md": b"notes", "Qwen3.5-4B/old/k_rotation_x.pt": b"z"},
     "no file matches Qwen3.5-4B/k_rotation_*.pt"),
])
def test_a_zoo_folder_with_none_or_several_matches_is_refused_naming_them(hub_env, cache_dir, capsys, files, says):
    hub_env.server.commit_files(ZOO, files)
    rc, out, err = run_cli(capsys, "fetch", "Qwen3.5-4B")
    assert rc == 1 and out == "" and says in err, err
    assert not list(cache_dir.rglob("k_rotation*.pt"))


def test_git_branch_files_are_a_separate_tag_pinned_by_sha256():
    zoo, git = get_entry("Qwen3.5-4B", "zoo"), get_entry("Qwen3.5-4B", "calibrated")
    assert get_model("Qwen3.5-4B").default_tag == "zoo" and zoo.files["k"].sha256 is None
    assert zoo.files["k"].path == "Qwen3.5-4B/k_rotation_*.pt"
    assert git.files["k"].sha256 == "8412173572e9ee6a50cc444c2e8ad479fb219dde94db48f8183bf57f186bf32e"
    assert get_entry("Qwen3.5-35B-A3B").files["v"].path == "Qwen3.5-35B-A3B/v_rotation_*.pt"


# -- Qwen3.8-27B -----------------------------------------------------------------------------------------


def test_qwen3_8_27b_is_registered_from_its_recipe(hub_env, tmp_path, cache_dir, capsys):
    e = get_entry("Qwen3.8-27B")
    arch = e.architecture
    assert arch.expected_layer_ids() == tuple(range(3, 64, 4)) and arch.num_kv_heads == 4 and arch.head_dim == 256
    assert e.serving.group_size == 256 and not e.serving.lloyd_max and e.launch.tp_size == 2
    assert e.launch.recipe == "rotation/run/qwen3.8-27b.sh@bccb8a77"
    pair = pair_bytes(tmp_path, "Qwen3.8-27B", seed=4)
    hub_env.server.commit_files(ZOO, {"Qwen3.8-27B/k_rotation_qqt_r_h_pbr.pt": pair["k"],
                                      "Qwen3.8-27B/v_rotation_sst_r_h_pbr.pt": pair["v"]})
    spec = launch_spec("Qwen3.8-27B")
    assert spec.env["SGLANG_MIXED_KV_PREFIX_TOKENS"] == "64" and spec.env["SGLANG_MIXED_KV_RECENT_TOKENS"] == "256"
    a = spec.args
    assert a[a.index("--tensor-parallel-size") + 1] == "2" and a[a.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    capsys.readouterr()
    # the vLLM port refuses hybrid models in one line
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3.8-27B", "--engine", "vllm")
    assert rc == 1 and "hybrid" in err and len(err.strip().splitlines()) == 1, err


# -- Kimi-K3: the latent at 4 bits ------------------------------------------------------------------------


def test_kimi_k3_serve_args_print_four_bits_once_its_set_is_cached(tmp_path, cache_dir, capsys):
    folder = tmp_path / "k3_latent_rot"
    folder.mkdir()
    h = hadamard_matrix(512, dtype=torch.float32)
    ids = range(3, 96, 4)  # 24 gated-MLA layers
    for i in ids:
        g = torch.Generator().manual_seed(i)
        torch.save((h * (torch.randint(0, 2, (512,), generator=g) * 2 - 1)).contiguous(), folder / f"layer_{i}.pt")
    rc, out, err = run_cli(capsys, "cache", "import", str(folder), "--latent", "Kimi-K3", "--json")
    assert rc == 0, err
    assert json.loads(out)["layers"] == 24
    rc, out, err = run_cli(capsys, "serve-args", "Kimi-K3", "--engine", "sglang")
    assert rc == 0, err
    assert "SGLANG_OSCAR_MLA_KV_BITS=4" in out.split()
    assert "--kv-cache-dtype bfloat16" in out and "--pipeline-parallel-size 2" in out
    rc, out, err = run_cli(capsys, "serve-args", "Kimi-K3", "--engine", "sglang", "--format", "env")
    env = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert Path(env["SGLANG_OSCAR_MLA_KV_ROTATION_PATH"]).is_dir()
    rc, out, err = run_cli(capsys, "info", "Kimi-K3", "--json")
    assert json.loads(out)["mla_latent"]["cache"]["cached_layers"] == 24


# -- conflicts and prebuilt files in info ---------------------------------------------------------------


def test_minimax_conflict_is_shown_with_both_sources(capsys):
    rc, out, err = run_cli(capsys, "info", "MiniMax-M2.7")
    assert rc == 0, err
    assert "conflict: Lloyd-Max levels and the BF16 windows" in out
    assert "rotation/run/minimax-m2.7.sh@51b618f1: LLOYD_MAX=1, windows 128/1024" in out
    assert "rotation/MiniMax-M2.7/README.md@05b9ea85: Lloyd-Max refuted" in out
    rc, out, _ = run_cli(capsys, "info", "MiniMax-M2.7", "--json")
    (c,) = json.loads(out)["tag"]["conflicts"]
    assert {s["source"] for s in c["sources"]} == {"rotation/run/minimax-m2.7.sh@51b618f1",
                                                   "rotation/MiniMax-M2.7/README.md@05b9ea85"}
    assert c["chosen"] == "rotation/run/minimax-m2.7.sh@51b618f1"
    rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--calibrate")
    assert rc == 0 and "note: the authors' sources disagree on Lloyd-Max levels" in err and "Lloyd-Max refuted" in err, err


def test_prebuilt_llamacpp_ggufs_are_listed(capsys):
    for model, repo in (("Qwen3-32B", "Zhongzhu/OSCAR-LLAMACPP-Qwen3-32B-INT2-KV"),
                        ("Qwen3-4B-Thinking-2507", "Zhongzhu/OSCAR-LLAMACPP-Qwen3-4B-Thinking-2507-INT2-KV"),
                        ("gemma-4-12B-it", "Zhongzhu/OSCAR-LLAMACPP-Gemma-4-12B-it-INT2-KV")):
        rc, out, err = run_cli(capsys, "info", model)
        assert rc == 0 and f"huggingface:{repo}" in out, (model, err)
        rc, out, _ = run_cli(capsys, "info", model, "--json")
        assert json.loads(out)["prebuilt_gguf"] == [repo]


# -- PQ codebooks and K clip tables ---------------------------------------------------------------------


def pq_file(path: Path) -> Path:
    torch.save({"layer_ids": [0, 1], "n_sub": 16, "sub_dim": 8, "n_centroids": 256,
                "codebooks_per_layer": torch.randn(2, 16, 256, 8), "rotation_path": "/oscar/k_rotation.pt"}, path)
    return path


def test_a_pq_codebook_file_is_named_not_loaded(tmp_path, capsys):
    p = pq_file(tmp_path / "k_pq.pt")
    assert "a PQ codebook file" in (identify_torch_file(p) or "")
    assert identify_torch_file(tmp_path / "absent.pt") is None
    rc, out, err = run_cli(capsys, "verify", str(p))
    lines = (out + err).strip().splitlines()
    assert rc == 1 and any("a PQ codebook file" in ln and "SGLANG_OSCAR_PQ_K_CODEBOOK" in ln for ln in lines), out + err
    with pytest.raises(RotationFileError, match="a PQ codebook file"):
        read_rotation(p)


def test_k_clip_tables_are_read_checked_and_served(tmp_path, cache_dir, capsys):
    from test_serving import seed_cache

    seed_cache(cache_dir, get_entry("Qwen3-8B"))
    ids = get_entry("Qwen3-8B").architecture.expected_layer_ids()
    per_layer = tmp_path / "clip.json"
    per_layer.write_text(json.dumps({"0": 0.9, "35": 1.0}))
    assert read_k_clip_per_layer(per_layer, ids) == {0: 0.9, 35: 1.0}
    assert read_k_clip_per_layer("0.9,0.95", None) == {0: 0.9, 1: 0.95}
    per_head = tmp_path / "heads.json"
    per_head.write_text(json.dumps({"3,7": 0.8}))
    assert read_k_clip_per_head(per_head, ids, 8) == {(3, 7): 0.8}
    for bad, says in (({"36": 0.9}, "layer 36 is not an attention layer"), ({"1": 1.5}, "must be in [0, 1]")):
        per_layer.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
            read_k_clip_per_layer(per_layer, ids)
    per_head.write_text(json.dumps({"3,8": 0.8}))
    with pytest.raises(ConfigError, match="KV head 8 of layer 3, but the model has 8 KV heads"):
        read_k_clip_per_head(per_head, ids, 8)
    per_layer.write_text(json.dumps({"0": 0.9}))
    per_head.write_text(json.dumps({"3,7": 0.8}))
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--k-clip-per-layer", str(per_layer),
                           "--k-clip-per-head", str(per_head), "--json")
    assert rc == 0, err
    env = json.loads(out)["env"]
    assert env["SGLANG_OSCAR_K_CLIP_PER_LAYER"] == str(per_layer.resolve())
    assert env["SGLANG_OSCAR_K_CLIP_PER_HEAD"] == str(per_head.resolve())
    per_head.write_text(json.dumps({"3,8": 0.8}))
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--k-clip-per-head", str(per_head))
    assert rc == 1 and out == "" and "KV head 8 of layer 3" in err and len(err.strip().splitlines()) == 1
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--engine", "vllm", "--k-clip-per-layer", "0.9")
    assert rc == 1 and "--k-clip-per-layer does not apply to vllm" in err, err



def test_a_k_clip_table_that_cannot_be_read_says_why(tmp_path):
    import os

    with pytest.raises(ConfigError, match=r"cannot read the per-head K clip table \(No such file"):
        read_k_clip_per_head(tmp_path / "missing.json", None, 8)
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(ConfigError, match="a FIFO, not a regular file"):  # the reason, not "must be JSON"
        read_k_clip_per_head(tmp_path / "fifo.json", None, 8)
    big = tmp_path / "big.json"
    big.write_text(" " * (4 << 20))
    with pytest.raises(ConfigError, match="more than the"):
        read_k_clip_per_head(big, None, 8)
