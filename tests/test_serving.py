"""serve-args / RotationPair.serve_env: launch settings for SGLang (the May 2026 fork and what every
target shares), vLLM and llama.cpp; the authors' current tree is tests/test_serving_current.py.

Qwen3-8B's cache is pre-seeded with random orthogonal [36, 128, 128] files (verified-file markers
written as the hub does), so nothing touches the network.
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path

import pytest
import torch

import rotationzoo
from rotationzoo import hub
from rotationzoo.errors import OfflineError, RotationZooError
from rotationzoo.files.format import RotationSet, write_rotation
from rotationzoo.hashing import sha256_file
from rotationzoo.registry import get_entry, load_registry
from rotationzoo.serving import ServingError, launch_spec, serve_env

from helpers import run_cli

#: the bundled shared (one rotation per layer) SmolLM2 pair, which every engine reads
SMOL_SHARED = "SmolLM2-135M-Instruct@emma-seq20000_prompt10_group16-r_pbr_hg16"
QWEN = "Qwen3-8B"


def random_orthogonal(n_layers: int, d: int, seed: int) -> torch.Tensor:
    """``[n_layers, d, d]`` fp32 random orthogonal matrices (QR of Gaussian, sign-fixed)."""
    return _random_orthogonal(n_layers, d, seed).clone()


@functools.lru_cache(maxsize=8)
def _random_orthogonal(n_layers: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n_layers, d, d, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
    return q.float()


def write_pair(folder: Path, entry, *, seed: int = 0) -> dict[str, Path]:
    """Write random K/V files under the entry's file names in ``folder``; return the paths."""
    arch = entry.architecture
    ids = arch.expected_layer_ids()
    paths = {}
    for i, side in enumerate(("k", "v")):
        rs = RotationSet(
            rotations=random_orthogonal(len(ids), arch.head_dim, seed + i),
            layer_ids=ids,
            objective=entry.objectives[side],
            eigenvalues=torch.rand(len(ids), arch.head_dim, generator=torch.Generator().manual_seed(seed + 10 + i)).sort(-1).values,
        )
        paths[side] = write_rotation(folder / entry.files[side].filename, rs)
    return paths


def seed_cache(root: Path, entry, *, seed: int = 0, source: str = "url:https://example.invalid/seeded") -> dict[str, Path]:
    """Put a verified copy of ``entry``'s files into the cache at ``root`` (as hub.fetch_file does), as if
    downloaded from ``source`` (unpinned entries are pinned per source on first use)."""
    folder = hub.entry_dir(root, entry)
    folder.mkdir(parents=True, exist_ok=True)
    paths = write_pair(folder, entry, seed=seed)
    for side, p in paths.items():
        hub.record_verified(p, entry, side, sha=sha256_file(p), source=source)
    return paths


@pytest.fixture
def qwen_cache(cache_dir: Path) -> dict[str, Path]:
    return seed_cache(cache_dir, get_entry(QWEN))


@pytest.fixture
def tuned_qwen(cache_dir: Path, tmp_path: Path, monkeypatch) -> dict[str, Path]:
    """An overlay registry pinning Qwen/Qwen3-8B to seeded files with non-default serving values."""
    base = get_entry(QWEN)
    staging = tmp_path / "staging"
    staging.mkdir()
    files = write_pair(staging, base, seed=7)
    tag = "seq20000_prompt83_group128"
    overlay = {
        "registry_version": 1,
        "models": [{
            "id": "Qwen/Qwen3-8B",
            "aliases": ["Qwen3-8B"],
            "architecture": {"num_layers": 36, "head_dim": 128, "num_kv_heads": 8, "num_attention_heads": 32},
            "default_tag": tag,
            "tags": {tag: {
                "description": "test entry",
                "calibration": {"dataset": "GPQA-diamond"},
                "objectives": {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"},
                "serving": {"k_clip_ratio": 0.97, "v_clip_ratio": 0.9, "prefix_tokens": 32, "recent_tokens": 512,
                            "group_size": 128, "hp_dtype": "bfloat16", "scale_dtype": "bfloat16", "lloyd_max": True},
                "files": {side: {"path": f"Qwen3-8B/{tag}/{files[side].name}", "sha256": sha256_file(files[side]),
                                 "size": files[side].stat().st_size,
                                 "sources": [{"type": "url", "url": f"https://example.invalid/{files[side].name}"}]}
                          for side in ("k", "v")},
            }},
        }],
    }
    reg = tmp_path / "overlay.json"
    reg.write_text(json.dumps(overlay))
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(reg))
    entry = get_entry(QWEN)
    assert entry.serving.k_clip_ratio == 0.97  # the overlay is in effect
    folder = hub.entry_dir(cache_dir, entry)
    folder.mkdir(parents=True)
    out = {}
    for side in ("k", "v"):
        dest = folder / files[side].name
        dest.write_bytes(files[side].read_bytes())
        hub.record_verified(dest, entry, side, sha=sha256_file(dest), source="url:https://example.invalid")
        out[side] = dest
    return out


# -- SGLang --------------------------------------------------------------------------------------


def test_sglang_legacy_is_the_may_2026_line(qwen_cache, capsys):
    """--engine sglang-legacy prints the May 2026 fork's reference line byte for byte, with the entry's values."""
    s = get_entry(QWEN).serving
    rc, out, err = run_cli(capsys, "serve-args", QWEN, "--engine", "sglang-legacy")
    assert rc == 0, err
    assert f"SGLANG_OSCAR_K_ROTATION_PATH={qwen_cache['k']}" in out
    assert f"SGLANG_OSCAR_V_ROTATION_PATH={qwen_cache['v']}" in out
    # the shell text is one command: continuation lines joined, it splits into env + argv
    words = shlex.split(out.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    argv = [w for w in words if not ("=" in w and w.split("=", 1)[0].isupper())]
    assert list(env.items()) == [
        ("SGLANG_ENABLE_MIXED_KV_WINDOWS", "1"), ("SGLANG_OSCAR_ABSORB_V_ROTATION", "1"),
        ("SGLANG_MIXED_KV_PREFIX_TOKENS", str(s.prefix_tokens)), ("SGLANG_MIXED_KV_RECENT_TOKENS", str(s.recent_tokens)),
        ("SGLANG_MIXED_KV_HP_MAX_SPLITS", "8"), ("SGLANG_MIXED_KV_HP_DTYPE", "bfloat16"),
        ("SGLANG_MIXED_KV_SCALE_DTYPE", "float32"), ("SGLANG_OSCAR_K_ROTATION_PATH", str(qwen_cache["k"])),
        ("SGLANG_OSCAR_V_ROTATION_PATH", str(qwen_cache["v"])), ("SGLANG_OSCAR_K_CLIP_RATIO", "0.96"),
        ("SGLANG_OSCAR_V_CLIP_RATIO", "0.92"), ("SGLANG_LLOYD_MAX", "1" if s.lloyd_max else "0")]
    assert argv == ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-8B", "--kv-cache-dtype", "int2",
                    "--kv-cache-quant-group-size", "128", "--prefill-attention-backend", "fa3",
                    "--decode-attention-backend", "triton", "--page-size", "8"]
    assert "--engine sglang" in err  # the note names the current tree's target


def test_json_parses_and_carries_everything(qwen_cache, capsys):
    rc, out, _ = run_cli(capsys, "serve-args", "qwen3-8b", "--engine", "sglang", "--format", "json")
    assert rc == 0
    data = json.loads(out)
    assert {"engine", "model", "tag", "env", "args", "command", "files"} <= set(data)
    assert data["engine"] == "sglang" and data["model"] == "Qwen/Qwen3-8B"
    assert data["tag"] == "seq20000_prompt83_group128"
    assert data["files"] == {"k": str(qwen_cache["k"]), "v": str(qwen_cache["v"])}
    assert data["env"]["SGLANG_OSCAR_V_CLIP_RATIO"] == "0.92"
    assert data["args"][0] == "python"
    assert shlex.split(data["command"])[-len(data["args"]):] == data["args"]


def test_env_format_is_key_value_lines(qwen_cache, capsys):
    rc, out, _ = run_cli(capsys, "serve-args", QWEN, "-e", "sglang-legacy", "-f", "env")
    assert rc == 0
    lines = out.strip().splitlines()
    parsed = dict(line.split("=", 1) for line in lines)
    assert len(parsed) == len(lines) == 12
    assert parsed["SGLANG_OSCAR_K_ROTATION_PATH"] == shlex.quote(str(qwen_cache["k"]))
    assert parsed["SGLANG_MIXED_KV_RECENT_TOKENS"] == str(get_entry(QWEN).serving.recent_tokens)


def test_values_come_from_the_registry_entry(tuned_qwen, capsys):
    rc, out, _ = run_cli(capsys, "serve-args", QWEN, "-e", "sglang", "-f", "json")
    assert rc == 0
    env = json.loads(out)["env"]
    assert env["SGLANG_OSCAR_K_CLIP_RATIO"] == "0.97"
    assert env["SGLANG_OSCAR_V_CLIP_RATIO"] == "0.9"
    assert env["SGLANG_MIXED_KV_PREFIX_TOKENS"] == "32"
    assert env["SGLANG_MIXED_KV_RECENT_TOKENS"] == "512"
    assert env["SGLANG_MIXED_KV_SCALE_DTYPE"] == "bfloat16"
    assert env["SGLANG_LLOYD_MAX"] == "1"
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == str(tuned_qwen["k"])
    rc, out, _ = run_cli(capsys, "serve-args", QWEN, "-e", "vllm", "-f", "json")
    data = json.loads(out)
    assert data["env"]["VLLM_OSCAR_K_CLIP_RATIO"] == "0.97"
    assert any("Lloyd-Max" in n for n in data["notes"])


def test_model_path_override(qwen_cache):
    spec = launch_spec(QWEN, engine="sglang", model_path="/models/qwen3-8b")
    assert spec.args[spec.args.index("--model-path") + 1] == "/models/qwen3-8b"
    spec = launch_spec(QWEN, engine="vllm", model_path="/models/qwen3-8b")
    assert spec.args[:3] == ["vllm", "serve", "/models/qwen3-8b"]


# -- vLLM ----------------------------------------------------------------------------------------


def test_vllm(qwen_cache, capsys):
    """The port of vLLM pull request 46774: the entry's windows as SINK / RECENT, its staging arena."""
    rc, out, err = run_cli(capsys, "serve-args", QWEN, "--engine", "vllm", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    s = get_entry(QWEN).serving
    assert data["env"] == {
        "VLLM_OSCAR_K_ROTATION_PATH": str(qwen_cache["k"]),
        "VLLM_OSCAR_V_ROTATION_PATH": str(qwen_cache["v"]),
        "VLLM_OSCAR_K_CLIP_RATIO": "0.96",
        "VLLM_OSCAR_V_CLIP_RATIO": "0.92",
        "VLLM_OSCAR_GROUP_SIZE": "128",
        "VLLM_OSCAR_SINK_TOKENS": str(s.prefix_tokens),
        "VLLM_OSCAR_RECENT_TOKENS": str(s.recent_tokens),
        "VLLM_OSCAR_STAGING_TOKENS": "8192",
    }
    assert data["args"] == ["vllm", "serve", "Qwen/Qwen3-8B", "--kv-cache-dtype", "oscar_int2"]
    assert any("pull request 46774" in n for n in data["notes"])


def test_vllm_sink_rounded_to_zero_by_the_block_size_is_refused(qwen_cache, capsys):
    """The port keeps whole KV blocks of the sink: Qwen3-8B's sink of 128 tokens is 0 blocks of 256."""
    assert get_entry(QWEN).serving.prefix_tokens == 128
    rc, out, err = run_cli(capsys, "serve-args", QWEN, "--engine", "vllm", "--block-size", "256")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "sink of 128 tokens rounds down to 0 at --block-size 256" in err and "--block-size 128" in err
    spec = launch_spec(QWEN, engine="vllm", block_size=128)  # one whole block: kept
    assert spec.args[-2:] == ["--block-size", "128"] and spec.env["VLLM_OSCAR_SINK_TOKENS"] == "128"
    spec = launch_spec(QWEN, engine="vllm", block_size=96)  # rounded down, said so
    assert any("128 tokens become 96 at --block-size 96" in n for n in spec.notes)
    with pytest.raises(ServingError, match="--block-size does not apply to sglang"):
        launch_spec(QWEN, engine="sglang", block_size=64)


def test_vllm_refuses_hybrid_models_and_groups_below_head_dim(cache_dir, capsys):
    from rotationzoo.engines import TARGETS

    assert not TARGETS["vllm"].hybrid_models and TARGETS["vllm-prototype"].hybrid_models
    hybrid = get_entry("Qwen3.5-4B")
    seed_cache(cache_dir, hybrid)
    with pytest.raises(ServingError, match="hybrid model"):
        launch_spec("Qwen3.5-4B", engine="vllm")
    from rotationzoo.engines import LaunchInput, target
    from rotationzoo.headdims import HeadDims
    from rotationzoo.int2kv import Int2KVConfig
    from rotationzoo.launch import LaunchConfig

    inp = LaunchInput(config=Int2KVConfig(group_size=64), launch=LaunchConfig(), paths={"k": "k", "v": "v"},
                      model="m", head_dims=HeadDims(128), kinds=frozenset({"v1"}))
    with pytest.raises(ServingError, match="group_size 64 is smaller than head_dim 128"):
        target("vllm").build(inp)


def test_vllm_prototype_spells_the_windows_its_way(qwen_cache, capsys):
    rc, out, err = run_cli(capsys, "serve-args", QWEN, "--engine", "vllm-prototype", "--format", "json")
    assert rc == 0, err
    data = json.loads(out)
    s = get_entry(QWEN).serving
    assert data["env"]["VLLM_OSCAR_PREFIX_TOKENS"] == str(s.prefix_tokens)
    assert data["env"]["VLLM_OSCAR_RECENT_TOKENS"] == str(s.recent_tokens)
    assert "VLLM_OSCAR_SINK_TOKENS" not in data["env"] and "VLLM_OSCAR_ABSORB_V_ROTATION" not in data["env"]
    assert any("validate_prototype_settings" in n and "prefix_tokens=128 (expects 64)" in n for n in data["notes"])


# -- llama.cpp -----------------------------------------------------------------------------------


def test_llamacpp_exports_the_rotation_gguf(qwen_cache, capsys, tmp_path):
    from rotationzoo.export import read_exported_gguf

    got = rotationzoo.fetch(QWEN)
    gguf_path = hub.derived_path("oscar-rot-kv.gguf", entry=get_entry(QWEN), inputs=got.sha256)
    assert not gguf_path.exists()
    base = tmp_path / "qwen3-8b-q4_k_m.gguf"
    rc, out, err = run_cli(capsys, "serve-args", QWEN, "-e", "llamacpp", "-f", "json", "--model-path", str(base))
    assert rc == 0, err
    data = json.loads(out)
    assert data["files"]["gguf"] == str(gguf_path) and gguf_path.is_file()
    s = get_entry(QWEN).serving
    assert data["env"] == {"LLAMA_KV_FUSED_FA": "1", "LLAMA_KV_NO_HADAMARD": "1", "LLAMA_KV_CLIP_RATIO": "0.96",
                           "LLAMA_KV_HP_SINK": str(s.prefix_tokens), "LLAMA_KV_HP_RECENT": str(s.recent_tokens),
                           "LLAMA_KV_V_ROT": "1"}
    merged = str(tmp_path / "qwen3-8b-q4_k_m-rot-kv.gguf")
    assert data["args"] == ["llama-server", "-m", merged, "-fa", "on", "-ngl", "99", "--cache-type-k", "q2_0",
                            "--cache-type-v", "q2_0"]
    assert any("LLAMA_ATTN_ROT_DISABLE=1" in n and "on top of these rotations" in n for n in data["notes"])
    assert data["prepare"] == [shlex.join(["rotationzoo", "export", str(gguf_path), "--to", "gguf",
                                           "--base-gguf", str(base), "--out", merged])]
    back = read_exported_gguf(gguf_path)
    pair = rotationzoo.load(QWEN)
    assert torch.equal(back.k.rotations, pair.k.rotations)
    assert torch.equal(back.v.rotations, pair.v.rotations)
    assert back.model == "Qwen/Qwen3-8B" and {s: back.metadata[f"{s}.sha256"] for s in "kv"} == pair.sha256
    # reused when present and made from the same files
    mtime = gguf_path.stat().st_mtime_ns
    rc, out, _ = run_cli(capsys, "serve-args", QWEN, "-e", "llamacpp")
    assert rc == 0 and gguf_path.stat().st_mtime_ns == mtime
    assert "--cache-type-k q2_0" in out and f"LLAMA_KV_HP_RECENT={s.recent_tokens}" in out
    assert out.splitlines()[0].startswith("rotationzoo export ") and out.splitlines()[0].endswith("&& \\")


def test_llamacpp_gguf_is_rebuilt_for_other_files(qwen_cache, cache_dir):
    spec = launch_spec(QWEN, engine="llamacpp")
    gguf_path = Path(spec.files["gguf"])
    first = gguf_path.read_bytes()
    entry = get_entry(QWEN)
    seed_cache(cache_dir, entry, seed=99, source="url:https://example.invalid/other")  # new bytes, new sha256
    spec2 = launch_spec(QWEN, engine="llamacpp")
    from rotationzoo.export import read_exported_gguf

    got = read_exported_gguf(spec2.files["gguf"])
    assert got.metadata["k.sha256"] == sha256_file(Path(spec2.files["k"]))
    # other input bytes (another revision, a re-publish) get another file: the one an earlier launch was
    # given is never rewritten under it; cache verify then removes it as built from files no longer verified
    assert Path(spec2.files["gguf"]).parent.parent == gguf_path.parent.parent and Path(spec2.files["gguf"]) != gguf_path
    assert gguf_path.read_bytes() == first
    bad = [r for r in hub.verify_cache(cache_dir) if not r.ok]
    assert [r.path for r in bad] == [gguf_path] and "(stale)" in str(bad[0].problem)
    assert not gguf_path.exists() and Path(spec2.files["gguf"]).is_file()


def test_the_gguf_is_a_derived_file_the_cache_knows(qwen_cache, cache_dir, capsys):
    """serve-args writes its GGUF into the derived area; cache ls lists it and cache verify keeps it."""
    rc, _, err = run_cli(capsys, "serve-args", QWEN, "--engine", "llamacpp")
    assert rc == 0, err
    gguf = hub.derived_path("oscar-rot-kv.gguf", entry=get_entry(QWEN), inputs=rotationzoo.fetch(QWEN).sha256)
    assert gguf.is_file()
    rc, out, err = run_cli(capsys, "cache", "verify", "--json")
    assert rc == 0, out + err
    report = json.loads(out)
    assert report["bad"] == 0 and str(gguf) in [f["path"] for f in report["files"]] and gguf.is_file()
    rc, out, _ = run_cli(capsys, "cache", "ls", "--json")
    (rec,) = [f for f in json.loads(out)["files"] if f["area"] == "derived"]
    assert rec["size"] == gguf.stat().st_size and rec["model"].endswith("Qwen3-8B")
    # a derived file whose bytes changed is reported and removed; a rebuilt one is valid again
    gguf.write_bytes(gguf.read_bytes()[:-1] + b"\0")
    rc, out, _ = run_cli(capsys, "cache", "verify", "--json")
    assert rc == 1 and json.loads(out)["bad"] == 1 and not gguf.exists()
    launch_spec(QWEN, engine="llamacpp")
    assert run_cli(capsys, "cache", "verify")[0] == 0


def test_llamacpp_serves_the_architectures_its_branch_rotates(qwen_cache, cache_dir, capsys, tmp_path):
    """The branch's graphs apply the rotation tensors for dense Qwen3 and Gemma-4 only: a registry model of
    another architecture is refused in one line naming the ones it serves, before anything is fetched or
    exported; a local pair that names no registry model gets a note instead."""
    from rotationzoo.engines import llama_architecture

    assert [llama_architecture(m) for m in ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B-Thinking-2507", "Qwen/Qwen3-32B",
                                            "google/gemma-4-12B-it", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-VL-4B-Instruct",
                                            "Qwen/Qwen3.5-35B-A3B", "HuggingFaceTB/SmolLM2-135M-Instruct")] == \
        ["qwen3", "qwen3", "qwen3", "gemma4", "qwen3moe", "qwen3vl", "qwen35", None]
    for model in (SMOL_SHARED, "Qwen3-30B-A3B@shared", "Qwen3-VL-4B", "MiniMax-M3", "GLM-4.7"):
        rc, out, err = run_cli(capsys, "serve-args", model, "--engine", "llamacpp", "--offline")
        assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, (model, err)
        assert "rotates the KV cache of Qwen3 (dense" in err and "Gemma-4 (" in err and "--engine sglang" in err, err
    assert "SmolLM2-135M-Instruct is not a Qwen3 or Gemma-4 model" in run_cli(
        capsys, "serve-args", SMOL_SHARED, "--engine", "llamacpp")[2]
    with pytest.raises(ServingError, match="Qwen3-VL-4B-Instruct is a qwen3vl model"):
        launch_spec("Qwen3-VL-4B", engine="llamacpp", offline=True)
    with pytest.raises(ServingError, match="not a Qwen3 or Gemma-4 model"):
        rotationzoo.load(SMOL_SHARED.split("@")[0], SMOL_SHARED.split("@")[1]).serve_env("llamacpp")
    assert not (cache_dir / "derived").exists()  # nothing exported for a refused model
    # a model whose id does not tell its architecture: the registry's gguf_architecture decides
    for declared, refused in ((None, True), ("qwen3", False), ("llama", True)):
        model = {"id": "acme/SuperChat-8B", "architecture": {"num_layers": 2, "head_dim": 128, "gguf_architecture": declared},
                 "default_tag": "t", "tags": {"t": {"objectives": {"k": "qqt", "v": "sst"}, "serving": {}, "files": {
                     s: {"path": f"SuperChat/t/{s}_rotation.pt", "sha256": None, "size": None,
                         "sources": [{"type": "url", "url": f"https://example.invalid/{s}.pt"}]} for s in "kv"}}}}
        reg = tmp_path / f"overlay-{declared}.json"
        reg.write_text(json.dumps({"registry_version": 1, "models": [model]}))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("ROTATIONZOO_REGISTRY", str(reg))
            rc, out, err = run_cli(capsys, "serve-args", "acme/SuperChat-8B", "--engine", "llamacpp", "--offline")
        assert rc == 1 and ("rotates the KV cache of Qwen3" in err) == refused and (
            "is not cached" in err) != refused, (declared, err)
        assert (f"is a {declared} model" in err) == (declared == "llama"), err
    # Qwen3 (dense) is served; rotations that name no registry model get a note to check the GGUF
    spec = launch_spec(QWEN, engine="llamacpp")
    assert spec.env["LLAMA_KV_V_ROT"] == "1" and Path(spec.files["gguf"]).is_relative_to(cache_dir)
    assert spec.notes[0].startswith("replace MODEL.gguf") and not any("not a registry model" in n for n in spec.notes)
    folder = cache_dir.parent / "local"
    folder.mkdir()
    for side in ("k", "v"):
        (folder / qwen_cache[side].name).write_bytes(qwen_cache[side].read_bytes())
    spec = launch_spec(str(folder), engine="llamacpp")
    assert any("not a registry model" in n and "general.architecture qwen3 or gemma4" in n for n in spec.notes)


# -- Python API ------------------------------------------------------------------------------------


def test_rotation_pair_serve_env(qwen_cache):
    pair = rotationzoo.load(QWEN)
    env = pair.serve_env("sglang")
    assert env == launch_spec(QWEN, engine="sglang").env
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == str(qwen_cache["k"])
    assert pair.serve_env("vllm")["VLLM_OSCAR_GROUP_SIZE"] == "128"
    assert pair.serve_env("llama.cpp")["LLAMA_KV_CLIP_RATIO"] == "0.96"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_bundled_pair_serve_env():
    pair = rotationzoo.load("SmolLM2-135M-Instruct")
    env = pair.serve_env("sglang")
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == str(pair.paths["k"])
    spec = launch_spec(pair, engine="sglang")
    group = str(pair.serving.group_size)  # this entry's group size (not the 128 of the zoo entries)
    assert group != "128" and spec.args[spec.args.index("--kv-cache-quant-group-size") + 1] == group


def test_sglang_page_size_follows_the_window_dtype():
    """The fork's quantised page size is 4 · itemsize(hp_dtype), and windows must be multiples of it."""
    from rotationzoo.engines import sglang_legacy_args, sglang_page_size
    from rotationzoo.engines.legacy import legacy_notes
    from rotationzoo.int2kv import Int2KVConfig

    assert [sglang_page_size(t) for t in ("bfloat16", "float16", "float32")] == [8, 8, 16]
    args = sglang_legacy_args(Int2KVConfig(hp_dtype="float32"), "m", 128)
    assert args[args.index("--page-size") + 1] == "16"
    assert args[args.index("--kv-cache-quant-group-size") + 1] == "128"
    notes = legacy_notes(Int2KVConfig(hp_dtype="float32", prefix_tokens=24, recent_tokens=256), 128)
    assert any("prefix_tokens=24 is not a multiple of the quantised page size 16" in n for n in notes)
    assert not any("recent_tokens" in n for n in notes)
    with pytest.raises(ServingError, match="unknown hp_dtype"):
        sglang_page_size("int8")


def test_every_registry_entry_renders_for_every_engine():
    paths = {"k": "/x/k.pt", "v": "/x/v.pt"}
    for model in load_registry():
        for entry in model.tags.values():
            for engine in ("sglang", "sglang-legacy", "vllm", "vllm-prototype", "llamacpp"):
                env = serve_env(entry.serving, engine, paths)
                assert env and all(isinstance(v, str) and v for v in env.values())


# -- errors ----------------------------------------------------------------------------------------


def test_bad_inputs(qwen_cache, capsys):
    with pytest.raises(ServingError, match="unknown engine 'tgi'"):
        launch_spec(QWEN, engine="tgi")
    with pytest.raises(ServingError):
        rotationzoo.load("SmolLM2-135M-Instruct").serve_env("trt")
    rc, _, err = run_cli(capsys, "serve-args", QWEN, "--engine", "tgi")
    assert rc == 1 and "unknown engine 'tgi'; expected one of sglang, sglang-legacy, vllm, vllm-prototype, llamacpp" in err
    rc, _, err = run_cli(capsys, "serve-args", QWEN, "--engine", "vllm", "--format", "yaml")
    assert rc == 2 and "Invalid value for '--format'" in err
    rc, _, err = run_cli(capsys, "serve-args", "Qwen3-9B", "--engine", "vllm")
    assert rc == 1 and "unknown model 'Qwen3-9B'" in err
    rc, _, err = run_cli(capsys, "serve-args", QWEN, "--engine", "vllm", "--tag", "nope")
    assert rc == 1 and "has no tag 'nope'" in err
    with pytest.raises(ServingError, match="model's GGUF file"):
        launch_spec(QWEN, engine="llamacpp", model_path="/models/qwen3-8b")


def test_offline_without_cache_is_a_clear_error(cache_dir, capsys):
    with pytest.raises(OfflineError, match="not cached"):
        launch_spec(QWEN, engine="sglang", offline=True)
    rc, _, err = run_cli(capsys, "serve-args", QWEN, "-e", "sglang", "--offline", "--cache-dir", str(cache_dir))
    assert rc == 1 and "offline mode" in err and "rotationzoo fetch" in err


def test_render_rejects_unknown_format(qwen_cache):
    spec = launch_spec(QWEN, engine="vllm")
    with pytest.raises(RotationZooError, match="unknown output format"):
        spec.render("toml")
