"""serve-args for the authors' current SGLang tree: per-model recipes, the engine targets' file kinds,
absorption rules, TP sharding of per-head files, start-up calibration, and MLA latent sets.

Qwen3-30B-A3B's cache is seeded with per-KV-head files ([48, 4, 128, 128] Hadamard matrices with random
column signs, written once per module) and verified-file markers, as the hub writes them; nothing
touches the network.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import layouts
import rotationzoo
from rotationzoo import hub
from rotationzoo.engines import TARGETS, absorption, pair_kinds, target
from rotationzoo.errors import ConfigError, RegistryError, ServingError, UnknownTagError
from rotationzoo.files.format import RotationSet, read_rotation, write_rotation
from rotationzoo.hadamard import hadamard_matrix
from rotationzoo.hashing import sha256_file
from rotationzoo.launch import LaunchConfig
from rotationzoo.planner import plan
from rotationzoo.registry import get_entry, get_model, load_registry
from rotationzoo.registry.lint import lint_registry
from rotationzoo.registry.load import parse_model
from rotationzoo.serving import launch_spec
from rotationzoo.sharding import kv_heads_per_rank

from helpers import run_cli

MOE = "Qwen3-30B-A3B"
REPO = Path(__file__).resolve().parents[1]


def split_shell(out: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(out.replace("\\\n", " "))
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=", 1)[0].isupper())
    return env, [w for w in words if not ("=" in w and w.split("=", 1)[0].isupper())]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.fixture(scope="module")
def perhead_files(tmp_path_factory) -> dict[str, Path]:
    """V2 per-KV-head K and V files of Qwen3-30B-A3B's geometry (written once for the module)."""
    entry = get_entry(MOE)
    arch = entry.architecture
    folder = tmp_path_factory.mktemp("perhead")
    out = {}
    h = hadamard_matrix(arch.head_dim, dtype=torch.float32)
    for seed, side in enumerate(("k", "v")):  # a Hadamard matrix with random column signs per (layer, head)
        g = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (arch.num_layers, arch.num_kv_heads, 1, arch.head_dim), generator=g) * 2 - 1
        rot = (h * signs).contiguous()
        rs = RotationSet(rotations=rot, layer_ids=tuple(range(arch.num_layers)), objective=entry.objectives[side])
        out[side] = write_rotation(folder / entry.files[side].filename, rs)
    return out


@pytest.fixture(scope="module")
def moe_pair(perhead_files) -> rotationzoo.RotationPair:
    """The registry entry with its per-head files, read once (what ``rotationzoo.load`` returns, unvalidated)."""
    from rotationzoo.files.format import read_rotation

    sets = {s: read_rotation(p) for s, p in perhead_files.items()}
    return rotationzoo.RotationPair(sets, entry=get_entry(MOE), paths=dict(perhead_files),
                                    sha256={s: sha256_file(p) for s, p in perhead_files.items()}, source=MOE)


@pytest.fixture
def moe_cache(cache_dir, perhead_files) -> dict[str, Path]:
    entry = get_entry(MOE)
    folder = hub.entry_dir(cache_dir, entry)
    folder.mkdir(parents=True)
    out = {}
    for side, src in perhead_files.items():
        dest = folder / src.name
        shutil.copyfile(src, dest)
        hub.record_verified(dest, entry, side, sha=sha256_file(dest), source="url:https://example.invalid/seeded")
        out[side] = dest
    return out


def seed_v1(cache_dir: Path, model: str, tag: str | None = None) -> dict[str, Path]:
    entry = get_entry(model, tag)
    arch = entry.architecture
    ids = arch.expected_layer_ids()
    folder = hub.entry_dir(cache_dir, entry)
    folder.mkdir(parents=True)
    out = {}
    for seed, side in enumerate(("k", "v")):
        rs = RotationSet(rotations=layouts.orthogonal(len(ids), arch.head_dim, arch.head_dim, seed=seed), layer_ids=ids,
                         objective=entry.objectives[side])
        p = write_rotation(folder / entry.files[side].filename, rs)
        hub.record_verified(p, entry, side, sha=sha256_file(p), source="url:https://example.invalid/seeded")
        out[side] = p
    return out


def local_pair(folder: Path, k: dict, v: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(k, folder / "k_rotation_test.pt")
    torch.save(v, folder / "v_rotation_test.pt")
    return folder


# -- the authors' current tree: Qwen3-30B-A3B, per KV head ------------------------------------------


def test_qwen3_30b_serves_with_its_recipe(moe_cache, capsys):
    rc, out, err = run_cli(capsys, "serve-args", MOE)
    assert rc == 0, err
    env, argv = split_shell(out)
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"
    assert (env["SGLANG_MIXED_KV_PREFIX_TOKENS"], env["SGLANG_MIXED_KV_RECENT_TOKENS"]) == ("128", "1024")
    assert env["SGLANG_OSCAR_K_ROTATION_PATH"] == str(moe_cache["k"]) and env["SGLANG_ENABLE_MIXED_KV_WINDOWS"] == "1"
    assert "SGLANG_LLOYD_MAX" not in env  # uniform levels: not forced, the pool's default applies
    for backend in ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
        assert flag(argv, backend) == "triton"
    assert flag(argv, "--tensor-parallel-size") == "2" and flag(argv, "--kv-cache-quant-group-size") == "128"
    for gone in ("--disable-radix-cache", "--disable-custom-all-reduce", "--page-size"):
        assert gone not in argv
    assert not {"SGLANG_OSCAR_ROTATION_MODE", "HADAMARD_ORDER"} & set(env)
    # stderr: the recipe, each rank's heads, and the log line that proves the per-head files were read
    assert "rotation/run/qwen3-30b-a3b.sh" in err
    assert "rank 0: KV heads 0-1 of 4" in err and "rank 1: KV heads 2-3 of 4" in err
    assert err.count("[per-head: 4 kv heads]") == 2


def test_tp_names_each_ranks_heads_and_json_says_the_same(moe_cache, moe_pair, capsys):
    rc, out, err = run_cli(capsys, "serve-args", MOE, "--tp", "8", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert flag(data["args"], "--tensor-parallel-size") == "8"
    # 4 KV heads over 8 ranks: each head replicated on two consecutive ranks
    assert [(r["rank"], r["kv_heads"], r["of"]) for r in data["ranks"]] == [
        (0, [0], 4), (1, [0], 4), (2, [1], 4), (3, [1], 4), (4, [2], 4), (5, [2], 4), (6, [3], 4), (7, [3], 4)]
    assert len(data["checks"]) == 2 and all("[per-head: 4 kv heads]" in c for c in data["checks"])
    spec = launch_spec(moe_pair, tp_size=4)
    assert [r["kv_heads"] for r in spec.ranks] == [[0], [1], [2], [3]]
    assert spec.ranks == [{"rank": r, "kv_heads": list(h), "of": 4} for r, h in enumerate(kv_heads_per_rank(4, 4))]


def test_a_loaded_pair_is_held_to_its_models_tp_rule_too(moe_pair):
    """launch_spec / serve_env of a pair whose entry has block-quantized MoE weights refuse a TP size that
    splits them into partial blocks, as serve-args does before a download (4 KV heads over 8 ranks is fine)."""
    import dataclasses

    entry = moe_pair.entry
    arch = dataclasses.replace(entry.architecture, moe_intermediate_size=1536, weight_block_size=128)
    pair = dataclasses.replace(moe_pair, entry=dataclasses.replace(entry, architecture=arch))
    assert launch_spec(pair, tp_size=4).ranks
    with pytest.raises(ConfigError, match=r"MoE weights cannot be split over 8 .* try --tp 2, 4, 12"):
        launch_spec(pair, tp_size=8)
    assert launch_spec(moe_pair, tp_size=8).ranks  # without the weights' rule: 8 ranks, each head on two


def test_expert_parallelism_is_printed_and_takes_the_tp_size_the_weights_refuse(moe_pair):
    """--ep-size N (SGLang) splits each expert over TP / N ranks: TP 8 with EP 2 passes the block rule that TP 8
    alone fails, the KV heads stay split over the 8 ranks, and vLLM's expert parallelism spans every rank."""
    import dataclasses

    entry = moe_pair.entry
    arch = dataclasses.replace(entry.architecture, moe_intermediate_size=1536, weight_block_size=128)
    pair = dataclasses.replace(moe_pair, entry=dataclasses.replace(entry, architecture=arch))
    spec = launch_spec(pair, tp_size=8, ep_size=2)
    assert flag(spec.args, "--tensor-parallel-size") == "8" and flag(spec.args, "--ep-size") == "2"
    assert spec.ranks == launch_spec(moe_pair, tp_size=8).ranks  # the KV heads do not follow the experts
    assert "--ep-size" not in launch_spec(pair, tp_size=4).args  # EP 1 (the recipes'): not printed
    with pytest.raises(ConfigError, match="over 8 tensor-parallel ranks: .* keep --tp 8 with --ep-size 2, 4 or 8"):
        launch_spec(pair, tp_size=8, ep_size=1)
    with pytest.raises(ConfigError, match="expert-parallel size 3: it does not divide the tensor-parallel size 8"):
        launch_spec(pair, tp_size=8, ep_size=3)
    with pytest.raises(ServingError, match="--ep-size does not apply to sglang-legacy"):
        launch_spec(pair, engine="sglang-legacy", tp_size=8, ep_size=2)


def test_vllm_expert_parallelism_spans_every_rank(cache_dir, capsys):
    seed_v1(cache_dir, "Qwen3-8B")
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "vllm", "--tp", "4", "--ep", "4", "--json")
    assert rc == 0, err
    args = json.loads(out)["args"]
    assert flag(args, "--tensor-parallel-size") == "4" and "--enable-expert-parallel" in args
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "vllm", "--tp", "4", "--ep", "2")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "vllm: expert-parallel size 2: expert parallelism here spans every tensor-parallel rank, so it is 1 or " \
           "the TP size (4); try --ep-size 4" in err
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "vllm", "--tp", "4", "--json")
    assert rc == 0 and "--enable-expert-parallel" not in json.loads(out)["args"]


def test_local_files_that_name_a_registry_model_follow_its_tp_rule(tmp_path):
    """A pair with no registry entry whose files record MiniMax-M2.7 (an exported pair, local files) is held to
    the model's TP rule too, as the registry model is."""
    entry = get_entry("MiniMax-M2.7")
    arch = entry.architecture
    sets, paths = {}, {}
    for side in "kv":
        rs = RotationSet(rotations=torch.eye(arch.head_dim).expand(arch.num_layers, -1, -1).contiguous(),
                         layer_ids=tuple(range(arch.num_layers)), objective=entry.objectives[side])
        paths[side] = write_rotation(tmp_path / f"{side}.pt", rs)
        sets[side] = read_rotation(paths[side])
    pair = rotationzoo.RotationPair(sets, entry=None, paths=paths, metadata={"model": entry.model_id}, source="local")
    with pytest.raises(ConfigError, match="MoE weights cannot be split over 8"):
        launch_spec(pair, tp_size=8)
    assert "--tensor-parallel-size" in launch_spec(pair, tp_size=4).args


def test_a_tp_size_the_heads_cannot_split_over_fails_with_one_line(moe_cache, capsys):
    rc, out, err = run_cli(capsys, "serve-args", MOE, "--tp", "3")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "4 KV heads cannot be split over 3" in err and "try --tp 1, 2, 4" in err
    # the registry knows the model's KV heads: refused before anything is downloaded (the cache is empty)
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-32B", "--tp", "3", "--offline")
    assert rc == 1 and "8 KV heads cannot be split over 3" in err and "offline" not in err, err
    # MiniMax-M2.7's FP8 MoE weights (intermediate size 1536, blocks of 128): TP 8 leaves 192-wide shards, which
    # SGLang refuses at start-up (the authors' recipe says so); refused here before anything is downloaded
    rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--tp", "8", "--offline")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "MoE weights cannot be split over 8" in err and "1536 / 8 = 192" in err and "try --tp 1, 2, 4" in err, err
    # a size the heads refuse: the sizes suggested pass both rules (8 splits the heads, not the weights)
    rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--tp", "6", "--offline")
    assert rc == 1 and "8 KV heads cannot be split over 6" in err and "try --tp 1, 2, 4" in err, err
    rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--tp", "2", "--offline")
    assert rc == 1 and "is not cached" in err, err  # TP 2 passes the rule: the files are what is missing
    # with expert parallelism each expert is split over TP / EP ranks: TP 8 with EP 2 passes (384-wide shards), EP 3
    # does not divide 8, and vLLM's expert parallelism spans every rank: all refused before a download
    rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--tp", "8", "--ep", "2", "--offline")
    assert rc == 1 and "is not cached" in err, err
    for extra, said in ((("--ep", "3"), "expert-parallel size 3: it does not divide the tensor-parallel size 8"),
                        (("--ep", "2", "-e", "vllm"), "so it is 1 or the TP size (8); try --ep-size 8"),
                        (("--ep", "2", "-e", "sglang-legacy"), "--ep-size does not apply to sglang-legacy")):
        rc, out, err = run_cli(capsys, "serve-args", "MiniMax-M2.7", "--tp", "8", *extra, "--offline")
        assert rc == 1 and out == "" and said in err and "offline" not in err, err
    for tp in ("0", "1025"):  # out of bounds: refused before anything is read
        rc, out, err = run_cli(capsys, "serve-args", "Qwen3-9B-nonexistent", "--tp", tp)
        assert rc == 1 and out == "" and "tp_size must be an integer from 1 to 1,024" in err, err


def test_per_head_files_are_refused_by_targets_that_cannot_read_them(moe_cache, moe_pair, cache_dir, capsys):
    rc, out, err = run_cli(capsys, "serve-args", MOE, "--engine", "vllm")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "per-KV-head rotations ([L, H_kv, d, d]) cannot be served by vllm" in err and "--engine sglang" in err
    # the llama.cpp branch has no graph for Qwen3-MoE at all: refused for the model, before the files are read
    rc, out, err = run_cli(capsys, "serve-args", MOE, "--engine", "llamacpp")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "Qwen/Qwen3-30B-A3B is a qwen3moe model" in err and "--engine sglang" in err
    assert not (cache_dir / "derived").exists()  # no GGUF was exported
    for engine in ("vllm", "sglang-legacy", "llama.cpp"):
        with pytest.raises(ServingError, match=r"per-KV-head rotations \(\[L, H_kv, d, d\]\) cannot be served by"):
            launch_spec(moe_pair, engine=engine)
        with pytest.raises(ServingError, match="cannot be served"):
            moe_pair.serve_env(engine)


def test_absorption_asked_for_per_head_files_is_refused(moe_cache, moe_pair, capsys):
    rc, out, err = run_cli(capsys, "serve-args", MOE, "--absorb-v-rotation")
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1
    assert "--absorb-v-rotation" in err and "per-KV-head" in err
    assert launch_spec(moe_pair, absorb_v_rotation=False).env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"


def test_the_python_api_gives_the_same_env(moe_pair):
    assert moe_pair.serve_env("sglang") == launch_spec(moe_pair).env
    assert moe_pair.serve_env("sglang")["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"
    assert launch_spec(moe_pair).model == "Qwen/Qwen3-30B-A3B"


# -- one rotation per layer on the current tree ----------------------------------------------------------


def test_qwen3_8b_current_line_has_its_windows_and_lloyd_max(cache_dir, capsys):
    seed_v1(cache_dir, "Qwen3-8B")
    entry = get_entry("Qwen3-8B")
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "-f", "env")
    assert rc == 0, err
    env = dict(line.split("=", 1) for line in out.strip().splitlines())
    assert env["SGLANG_MIXED_KV_RECENT_TOKENS"] == str(entry.serving.recent_tokens) == "2048"
    assert env["SGLANG_LLOYD_MAX"] == "1" and entry.serving.lloyd_max
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--absorb-v-rotation", "--disable-radix-cache", "--tp",
                           "2", "--json")
    data = json.loads(out)
    assert rc == 0 and data["env"]["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "1" and "--disable-radix-cache" in data["args"]
    assert [r["kv_heads"] for r in data["ranks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all("no '[per-head' suffix" in c for c in data["checks"])
    assert any("same on every rank" in n for n in data["notes"])


def test_knobs_a_target_does_not_take_are_refused(cache_dir, capsys):
    seed_v1(cache_dir, "Qwen3-8B")
    for engine, extra, what in (("vllm", "--disable-radix-cache", "--disable-radix-cache does not apply to vllm"),
                                ("llamacpp", "--tp=2", "--tp-size does not apply to llamacpp"),
                                ("vllm", "--absorb-v-rotation", "--absorb-v-rotation does not apply to vllm"),
                                ("sglang-legacy", "--calibrate", "--calibrate does not apply to sglang-legacy")):
        rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", engine, extra)
        assert rc == 1 and out == "" and what in err and len(err.strip().splitlines()) == 1, err
    rc, out, _ = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "vllm", "--tp", "2", "--json")
    assert rc == 0 and flag(json.loads(out)["args"], "--tensor-parallel-size") == "2"


def test_legacy_line_adds_tp_and_radix_flags_only_when_asked(cache_dir, capsys):
    seed_v1(cache_dir, "Qwen3-8B")
    rc, out, _ = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "sglang-legacy", "--json")
    plain = json.loads(out)["args"]
    assert rc == 0 and "--tensor-parallel-size" not in plain and "--disable-radix-cache" not in plain
    rc, out, _ = run_cli(capsys, "serve-args", "Qwen3-8B", "-e", "sglang-legacy", "--tp", "2", "--disable-radix-cache",
                         "--no-absorb-v-rotation", "--json")
    data = json.loads(out)
    assert flag(data["args"], "--tensor-parallel-size") == "2" and data["args"][-1] == "--disable-radix-cache"
    assert data["env"]["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0" and "--page-size" in data["args"]


def test_gemma_ragged_pair_absorbs_on_the_current_tree_and_is_refused_elsewhere(cache_dir, capsys):
    entry = get_entry("gemma-4-12B-it")
    arch = entry.architecture
    folder = hub.entry_dir(cache_dir, entry)
    folder.mkdir(parents=True)
    for seed, side in enumerate(("k", "v")):  # head_dim 256 on sliding layers, 512 on full ones; one file each
        g = torch.Generator().manual_seed(seed)
        layers = {lid: {"layer_id": lid, "rotation": (hadamard_matrix(arch.head_dims(lid), dtype=torch.float32)
                                                      * (torch.randint(0, 2, (arch.head_dims(lid),), generator=g) * 2 - 1)
                                                      ).contiguous()}
                  for lid in arch.expected_layer_ids()}
        p = folder / entry.files[side].filename
        torch.save({"format_version": 1, "objective": entry.objectives[side], "source_grouping": "layer",
                    "layers": layers}, p)
        hub.record_verified(p, entry, side, sha=sha256_file(p), source="url:https://example.invalid/seeded")
    rc, out, err = run_cli(capsys, "serve-args", "gemma-4-12B-it", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["env"]["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "1"  # one rotation per layer: the recipe's absorption
    assert flag(data["args"], "--kv-cache-quant-group-size") == "128"  # divides 256 and 512
    assert (data["env"]["SGLANG_MIXED_KV_PREFIX_TOKENS"], data["env"]["SGLANG_MIXED_KV_RECENT_TOKENS"]) == ("64", "512")
    pair = rotationzoo.load("gemma-4-12B-it")
    assert "ragged" in pair_kinds(pair)
    for engine in ("sglang-legacy", "vllm", "vllm-prototype"):
        with pytest.raises(ServingError, match="layers of different head_dim or KV-head count cannot be served by "
                                               + engine):
            launch_spec(pair, engine=engine)
    # the llama.cpp branch creates each layer's rotation at its own size (src/models/gemma4.cpp)
    spec = launch_spec("gemma-4-12B-it", engine="llamacpp", model_path="gemma-4-12b-it-q4km.gguf")
    assert spec.env["LLAMA_KV_V_ROT"] == "1" and spec.env["LLAMA_KV_FUSED_FA"] == "1"
    assert spec.prepare and spec.files["model_gguf"] == "gemma-4-12b-it-q4km-rot-kv.gguf"


# -- what each target reads ------------------------------------------------------------------------------


def test_centered_files_force_absorption_off_and_refuse_it(tmp_path, capsys):
    d = local_pair(tmp_path / "center", layouts.v3_key(2, 2, 64), layouts.v3_value(2, 2, 64))
    rc, out, err = run_cli(capsys, "serve-args", str(d), "-f", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["env"]["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0"
    assert any("k_mean" in n and "fused" in n for n in data["notes"])
    assert all("[per-head: 2 kv heads]" in c for c in data["checks"])
    rc, _, err = run_cli(capsys, "serve-args", str(d), "--absorb-v-rotation")
    assert rc == 1 and "key centering (k_mean)" in err and len(err.strip().splitlines()) == 1
    # an entry that asks for absorption gets it off, with a note, when its files forbid it
    kinds = pair_kinds(rotationzoo.load(d))
    assert {"v2", "v3", "k_mean"} <= kinds
    on, note = absorption(target("sglang"), kinds, LaunchConfig(absorb_v_rotation=True), None, False, "x")
    assert on is False and note is not None and "k_mean" in note
    assert absorption(target("sglang"), frozenset({"v1"}), LaunchConfig(absorb_v_rotation=True), None, False, "x") \
        == (True, None)


def test_shared_centered_files_are_refused_by_v1_targets(tmp_path, capsys):
    d = local_pair(tmp_path / "shared-center", layouts.v3_key(2, 2, 64, shared=True), layouts.v3_value(2, 2, 64, shared=True))
    for engine in ("vllm", "llamacpp", "sglang-legacy"):
        rc, out, err = run_cli(capsys, "serve-args", str(d), "-e", engine)
        assert rc == 1 and "key centering (k_mean) cannot be served by " + engine in err, err
    rc, _, err = run_cli(capsys, "serve-args", str(d))
    assert rc == 0, err


def test_non_orthogonal_companions_and_value_centering(tmp_path, capsys):
    d = local_pair(tmp_path / "whiten", layouts.v3_key(2, 2, 64, centered=False, orthogonal_transform=False),
                   layouts.v3_value(2, 2, 64, orthogonal_transform=False))
    assert "companions" in pair_kinds(rotationzoo.load(d))
    rc, out, err = run_cli(capsys, "serve-args", str(d), "-f", "env")
    assert rc == 0 and "SGLANG_OSCAR_ABSORB_V_ROTATION=0" in out, err
    rc, _, err = run_cli(capsys, "serve-args", str(d), "--absorb-v-rotation")
    assert rc == 1 and "non-orthogonal" in err
    # value centering is rotationzoo's own: the authors' engine does not read it
    vm = tmp_path / "vmean"
    vm.mkdir()
    rot = layouts.orthogonal(2, 64, 64)
    write_rotation(vm / "k_rotation_t.pt", RotationSet(rot, (0, 1), objective="qqt_r_h_pbr"))
    write_rotation(vm / "v_rotation_t.pt", RotationSet(rot, (0, 1), objective="sst_r_h_pbr", v_mean=torch.randn(2, 64)))
    rc, out, err = run_cli(capsys, "serve-args", str(vm))
    assert rc == 1 and out == "" and "value centering (v_mean" in err and "integrations.transformers" in err


def test_the_engine_table_in_the_docs_is_the_code():
    """docs/serving.md's table of which engine reads which file kind is TARGETS, row by row."""
    lines = (REPO / "docs" / "serving.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| target | V1 |"))
    header, rows = lines[start], []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    kinds = [c.strip() for c in header.strip("|").split("|")][1:]
    assert len(rows) == len(TARGETS)
    names = {"V1": "v1", "V2 (per KV head)": "v2", "V3": "v3", "`k_mean`": "k_mean",
             "`q_rotation` / `o_rotation`": "companions", "`v_mean`": "v_mean", "ragged": "ragged",
             "Lloyd-Max": "lloyd_max", "MLA latent": "mla", "PQ codebooks": "pq"}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        t = TARGETS[cells[0].strip("`")]
        said = {names[k] for k, c in zip(kinds, cells[1:]) if c.startswith("yes")}
        assert said == set(t.reads), t.name


def test_the_recipe_table_in_the_docs_is_the_registry():
    lines = (REPO / "docs" / "serving.md").read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| model | sink / recent | group | Lloyd-Max | TP |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append(ln)
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        t = get_entry(cells[0].strip("`"))
        s = t.serving
        assert cells[1] == f"{s.prefix_tokens} / {s.recent_tokens}" and cells[2] == str(s.group_size), t.key
        assert cells[3] == ("yes" if s.lloyd_max else "no") and cells[4] == str(t.launch.tp_size), t.key
        assert ("per KV head" in cells[5]) == (t.grouping == "kv_head"), t.key


# -- start-up calibration ------------------------------------------------------------------------------


def test_calibrate_prints_the_calibration_settings_and_fetches_nothing(cache_dir, capsys):
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--calibrate", "--offline")
    assert rc == 0, err
    env, argv = split_shell(out)
    assert "SGLANG_OSCAR_K_ROTATION_PATH" not in env and "SGLANG_OSCAR_V_ROTATION_PATH" not in env
    assert env["SGLANG_OSCAR_CALIBRATION_TOKENS"] == "30000" and env["SGLANG_OSCAR_CALIBRATION_PROMPTS_PATH"] == ""
    assert env["SGLANG_OSCAR_ABSORB_V_ROTATION"] == "0" and env["SGLANG_MIXED_KV_RECENT_TOKENS"] == "2048"
    assert flag(argv, "--model-path") == "Qwen/Qwen3-8B" and flag(argv, "--attention-backend") == "triton"
    # the folder the server writes: the authors' digest of model, revision, prompts and tokens
    digest = hashlib.sha256(b"Qwen/Qwen3-8B\0main\0openai-simple-evals/gpqa_diamond-seed0-v1\x0030000").hexdigest()[:12]
    assert f"oscar-rotations/Qwen3-8B-{digest}/" in err and "rotationzoo cache import" in err
    assert not cache_dir.exists() or not any(cache_dir.rglob("*.pt"))


def test_calibrate_refusals_and_warnings(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--calibrate", "-e", "vllm")
    assert rc == 1 and "start-up calibration is a feature of --engine sglang" in err
    rc, _, err = run_cli(capsys, "serve-args", "Qwen3-8B", "--calibrate", "--absorb-v-rotation")
    assert rc == 1 and "start-up calibration keeps the V rotation at runtime" in err
    d = local_pair(tmp_path / "p", layouts.v1(2, 64), layouts.v1(2, 64, seed=1, objective="sst_r_h_pbr"))
    rc, _, err = run_cli(capsys, "serve-args", str(d), "--calibrate")
    assert rc == 1 and "--calibrate takes a registry model" in err
    rc, _, err = run_cli(capsys, "serve-args", "gemma-4-12B-it", "--calibrate")
    assert rc == 1 and "two-geometry" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run_cli(capsys, "serve-args", MOE, "--calibrate")
    assert rc == 0 and "GPQA 43.9 shared against 58.6 per head" in err


# -- the registry's recipes, latent sets and the planner -------------------------------------------------


def test_registry_entries_carry_the_recipes():
    moe = get_model(MOE)
    assert moe.default_tag == "perhead" and set(moe.tags) == {"perhead", "shared"}
    per, shared = moe.tags["perhead"], moe.tags["shared"]
    assert per.grouping == "kv_head" and shared.grouping == "layer"
    assert per.files["k"].path == "Qwen3-30B-A3B/k_rotation_perhead.pt" and per.files["k"].sha256 is None
    assert shared.files["v"].path == "Qwen3-30B-A3B/v_rotation_sst_r_h_pbr.pt"
    assert (per.launch.tp_size, per.launch.absorb_v_rotation, per.serving.recent_tokens) == (2, False, 1024)
    assert get_entry("Qwen3-8B").serving.prefix_tokens == 128 and get_entry("Qwen3-8B").serving.lloyd_max
    assert get_entry("MiniMax-M3").files["k"].filename == "k_rotation_hadamard.pt"
    assert get_entry("gemma-4-12B-it").launch.absorb_v_rotation and not get_entry("gemma-4-12B-it").architecture.head_dims.uniform
    assert get_entry("Qwen3.5-4B").launch.mamba_scheduler_strategy == "extra_buffer"
    assert get_entry("Qwen3.5-35B-A3B").serving.group_size == 256
    for m in load_registry():  # every K/V entry names the recipe it comes from, or is rotationzoo's own
        for t in m.tags.values():
            assert t.launch.recipe or m.id.startswith(("HuggingFaceTB/", "Qwen/Qwen3-VL")), t.key


def test_mla_latent_sets_are_listed_and_refused_where_they_are_not_pairs(cache_dir, capsys):
    m = get_model("GLM-5.2")
    assert m.mla_latent is not None and m.default_tag is None and not m.tags
    rc, out, err = run_cli(capsys, "info", "GLM-5.2")
    assert rc == 0 and "GLM-5.2-FP8/c_kv_rcov_phblock_g128/layer_<id>.pt" in out, err
    assert "huggingface:Zhongzhu/OSCAR-RotationZoo@main" in out and "layers 0 … 77 (78)" in out
    rc, out, _ = run_cli(capsys, "info", "Kimi-K3", "--json")
    lat = json.loads(out)["mla_latent"]
    assert lat["bits"] == 4 and lat["layer_count"] == 24 and lat["sources"] == [] and lat["cache"]["cached_layers"] == 0
    # GLM-5.3 is not published: serving it needs an imported copy; plan needs a K/V architecture
    for argv, says in ((("serve-args", "GLM-5.3"), "not published in a hub"),
                       (("plan", "Kimi-K3", "--context", "4096"), "MLA latent rotation set")):
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 1 and out == "" and says in err and len(err.strip().splitlines()) == 1, argv
    with pytest.raises(UnknownTagError, match="not a K/V pair"):
        rotationzoo.load("Kimi-K3")
    rc, out, _ = run_cli(capsys, "list", "--plain")
    assert rc == 0 and "zai-org/GLM-5.3\tGLM-5.3\t?\t?\t(MLA latent set)" in out


def test_plan_uses_the_entrys_windows_and_says_per_head_changes_no_bytes():
    p = plan(MOE, context=32768)
    s = get_entry(MOE).serving
    assert p.format("oscar_int2").window_tokens == s.prefix_tokens + s.recent_tokens == 1152
    assert any("per-KV-head rotations change no KV bytes" in n for n in p.notes)
    assert plan(f"{MOE}@shared", context=32768).format("oscar_int2").sequence_bytes == p.format("oscar_int2").sequence_bytes
    assert not any("per-KV-head" in n for n in plan(f"{MOE}@shared", context=32768).notes)


def _model(**tag_changes) -> dict:
    tag = {"objectives": {"k": "a", "v": "b"}, "serving": {}, "files": {
        s: {"path": f"M/t/{s}_rotation.pt", "sha256": None, "size": None,
            "sources": [{"type": "url", "url": "https://example.invalid/x"}]} for s in ("k", "v")}}
    tag.update(tag_changes)
    return {"id": "ns/M", "architecture": {"num_layers": 4, "head_dim": 128, "num_kv_heads": 4}, "default_tag": "t",
            "tags": {"t": tag}}


@pytest.mark.parametrize("changes, message", [
    ({"launch": {"tp_size": 3}}, "cannot be split over 3"),
    ({"launch": {"tp_size": 0}}, "tp_size must be an integer from 1"),
    ({"launch": {"tp_size": 4, "ep_size": 3}}, "expert-parallel size 3: it does not divide the tensor-parallel size 4"),
    # the recipe's TP 8 with EP 2: 1536 / 4 = 384 fits; EP 1 would not (the same rule as serve-args)
    ({"launch": {"tp_size": 8, "ep_size": 1}, "architecture": {"num_kv_heads": 8, "moe_intermediate_size": 1536,
                                                                "weight_block_size": 128}},
     "try --tp 1, 2, 4, or keep --tp 8 with --ep-size 2, 4 or 8"),
    # 1280 / 4 = 320: no whole number of 128-wide blocks (TP 2 and 1 fit: the message names them)
    ({"launch": {"tp_size": 4}, "architecture": {"moe_intermediate_size": 1280, "weight_block_size": 128}},
     "MoE weights cannot be split over 4 tensor-parallel ranks: each rank's gate/up shard (intermediate size 1280 / 4 "
     "= 320) must be a whole number of the checkpoint's 128-wide quantization blocks; try --tp 1, 2"),
    ({"architecture": {"moe_intermediate_size": 1536}}, "moe_intermediate_size and weight_block_size go together"),
    ({"architecture": {"moe_intermediate_size": 1000, "weight_block_size": 128}}, "not a multiple of weight_block_size"),
    ({"architecture": {"gguf_architecture": "qwen3\n"}}, "gguf_architecture must be a llama.cpp architecture name"),
    ({"architecture": {"gguf_architecture": "Qwen3"}}, "gguf_architecture must be a llama.cpp architecture name"),
    ({"launch": {"prefill_attention_backend": "flashinfer"}}, "prefill_attention_backend must be one of triton, fa3"),
    ({"launch": {"decode_attention_backend": "fa3"}}, "decode_attention_backend must be triton"),
    ({"launch": {"tp": 2}}, "unknown key(s) tp"),
    ({"launch": {"recipe": "run.sh; rm -rf ~"}}, "recipe must be a path"),
    ({"launch": {"absorb_v_rotation": True}, "grouping": "kv_head"}, "absorb_v_rotation is true for per-KV-head"),
    ({"grouping": "head"}, "grouping must be one of layer, kv_head"),
])
def test_bad_launch_blocks_are_refused_by_loading_and_lint(changes, message):
    arch = changes.pop("architecture", {})
    raw = _model(**changes)
    raw["architecture"].update(arch)
    with pytest.raises(RegistryError, match=__import__("re").escape(message)):
        parse_model(raw, "models[0]", "test")
    report = lint_registry({"models": [raw]})
    assert any(message in e for e in report.errors), report.errors


def test_latent_models_have_no_tags():
    with pytest.raises(RegistryError, match="no K/V tags"):
        parse_model({"id": "ns/L", "mla_latent": {"location": "/x"}, "default_tag": "t", "tags": {"t": {}}}, "m", "t")
    with pytest.raises(RegistryError, match="location must be a printable"):
        parse_model({"id": "ns/L", "mla_latent": {"location": "a\nb"}}, "m", "t")
    assert lint_registry({"models": [{"id": "ns/L", "mla_latent": {"location": "/x", "recipe": "run/x.sh"}}]}).ok
    with pytest.raises(ConfigError):
        LaunchConfig(tp_size=True)


# -- a pair held in one file ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_a_one_file_pair_is_served_as_two_derived_pt_files(fmt, cache_dir, tmp_path, capsys):
    """SGLang reads a K and a V path: a pair file becomes two .pt files in the derived area, written
    once, re-written when tampered with, and holding exactly the pair (per-head V3 with k_mean here)."""
    from rotationzoo.export import export

    d = local_pair(tmp_path / "src", layouts.v3_key(2, 2, 64), layouts.v3_value(2, 2, 64))
    one = export(str(d), tmp_path / f"pair.{fmt}", to=fmt) if fmt == "safetensors" else None
    if one is None:  # GGUF exports refuse per-head sets: use shared V1 rotations for that format
        d = local_pair(tmp_path / "v1", layouts.v1(2, 64), layouts.v1(2, 64, seed=1, objective="sst_r_h_pbr"))
        one = export(str(d), tmp_path / "pair.gguf", to="gguf")
    rc, out, err = run_cli(capsys, "serve-args", str(one), "-f", "json")
    assert rc == 0, err
    data = json.loads(out)
    k, v = Path(data["files"]["k"]), Path(data["files"]["v"])
    assert k != v and k.name == "k_rotation.pt" and v.name == "v_rotation.pt"
    assert (cache_dir / "derived") in k.parents
    assert data["env"]["SGLANG_OSCAR_K_ROTATION_PATH"] == str(k) and any("one file" in n for n in data["notes"])
    want = rotationzoo.load(str(one))
    for side, p in (("k", k), ("v", v)):
        got = torch.load(p, weights_only=True)  # the authors' loader reads it
        assert got["format_version"] == want[side].layout_version
        assert torch.equal(rotationzoo.load(f"{k},{v}")[side].stacked(), want[side].stacked().float())
    assert (want["k"].k_mean is not None) == (fmt == "safetensors")
    stamp = k.stat().st_mtime_ns
    assert run_cli(capsys, "serve-args", str(one), "-f", "json")[0] == 0
    assert k.stat().st_mtime_ns == stamp  # reused
    k.write_bytes(b"tampered")
    assert run_cli(capsys, "serve-args", str(one), "-f", "json")[0] == 0
    assert torch.equal(rotationzoo.load(f"{k},{v}")["k"].stacked(), want["k"].stacked().float())


# -- hybrid models without the prefix cache ------------------------------------------------------------


@pytest.mark.parametrize("model", ["Qwen3.5-4B", "Qwen3.5-35B-A3B"])
def test_the_legacy_line_of_a_hybrid_model_is_the_authors_hybrid_recipe(model, cache_dir, capsys):
    """The May 2026 fork's Mamba radix cache (no_buffer, its default) forces page_size 1 for a hybrid model,
    and its INT2 cache then refuses the launch ("Unified mixed KV requires --page-size=8"); the authors ran
    Qwen3.5 there with --disable-radix-cache (rotation/qwen3.5-4B/eval_gpqa.sh@797e39c7)."""
    seed_v1(cache_dir, model)
    rc, out, err = run_cli(capsys, "serve-args", model, "-e", "sglang-legacy", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["args"][-1] == "--disable-radix-cache" and flag(data["args"], "--page-size") == "8"
    assert not any("mamba" in a for a in data["args"])
    assert any("eval_gpqa.sh@797e39c7" in n and "--page-size 8" in n for n in data["notes"])
    rc, out, _ = run_cli(capsys, "serve-args", model, "-e", "sglang-legacy", "--disable-radix-cache", "--json")
    assert rc == 0 and json.loads(out)["args"].count("--disable-radix-cache") == 1


def test_without_the_prefix_cache_the_mamba_strategy_is_left_out(cache_dir, capsys):
    """SGLang refuses --mamba-radix-cache-strategy extra_buffer with --disable-radix-cache ("mamba extra_buffer
    is not compatible with --disable-radix-cache"): the strategy of a cache that is off is not printed."""
    seed_v1(cache_dir, "Qwen3.5-4B")
    on = launch_spec("Qwen3.5-4B")
    assert flag(on.args, "--mamba-radix-cache-strategy") == "extra_buffer" and "--disable-radix-cache" not in on.args
    rc, out, err = run_cli(capsys, "serve-args", "Qwen3.5-4B", "--disable-radix-cache", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["args"][-1] == "--disable-radix-cache" and not any("mamba" in a for a in data["args"])
    assert any("extra_buffer (the entry's) is left out" in n and "no_buffer" in n for n in data["notes"])


# -- RotationPair.serve_env is launch_spec's environment ---------------------------------------------------


def _env_or_refusal(call) -> object:
    try:
        return call()
    except ServingError as exc:
        return ("refused", str(exc))


def test_serve_env_is_the_env_of_launch_spec(cache_dir):
    """serve_env reads a pair as launch_spec does (the model's hybrid layers, its architecture, absolute
    paths): the same environment, or the same one-line refusal."""
    from rotationzoo.vocab import ENGINES

    seed_v1(cache_dir, "Qwen3-8B")
    seed_v1(cache_dir, "Qwen3.5-4B")
    for model in ("Qwen3-8B", "Qwen3.5-4B"):
        pair = rotationzoo.load(model)
        for engine in ENGINES:
            want = _env_or_refusal(lambda: launch_spec(pair, engine=engine).env)
            assert _env_or_refusal(lambda: pair.serve_env(engine)) == want, (model, engine)
    hybrid = rotationzoo.load("Qwen3.5-4B")
    for engine, why in (("vllm", "a hybrid model"), ("llamacpp", "Qwen/Qwen3.5-4B is a qwen35 model")):
        with pytest.raises(ServingError, match=why):
            hybrid.serve_env(engine)


def test_serve_env_of_a_pair_held_in_one_file_names_launch_spec(cache_dir, tmp_path):
    """The engines read a K and a V .pt file: launch_spec writes them from a pair file; serve_env, which
    writes nothing, refuses in one line naming it instead of pointing the engine at the .safetensors."""
    from rotationzoo.export import export

    d = local_pair(tmp_path / "src", layouts.v1(2, 64), layouts.v1(2, 64, seed=1, objective="sst_r_h_pbr"))
    pair = rotationzoo.load(str(export(str(d), tmp_path / "pair.safetensors", to="safetensors")))
    for engine in ("sglang", "sglang-legacy", "vllm", "vllm-prototype"):
        with pytest.raises(ServingError, match=rf"pair.safetensors: holds K and V in one file, which {engine} cannot "
                                               rf"read as it is; rotationzoo.serving.launch_spec\(pair") as ei:
            pair.serve_env(engine)
        assert "\n" not in str(ei.value)
        env = launch_spec(pair, engine=engine).env
        paths = [v for k, v in env.items() if k.endswith("_ROTATION_PATH")]
        assert len(paths) == 2 and all(p.endswith(".pt") and Path(p).is_file() for p in paths), env
    assert pair.serve_env("llamacpp") == launch_spec(pair, engine="llamacpp").env  # no paths in its env


# -- flat layers and relative paths ---------------------------------------------------------------------------


def test_flat_layers_are_served_from_files_in_the_authors_layout(cache_dir, tmp_path, monkeypatch, capsys):
    """{"layers": {i: tensor}} validates, but the authors' SGLang loaders index each layer's "rotation": the
    launch serves the two files written in the authors' layout into the derived area (as for a pair held in
    one file), and serve_env says so."""
    rot = {s: layouts.orthogonal(2, 64, 64, seed=i) for i, s in enumerate("kv")}
    flat = tmp_path / "flat"
    flat.mkdir()
    for s, objective in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        torch.save({"format_version": 1, "objective": objective, "layers": {i: rot[s][i] for i in range(2)}},
                   flat / f"{s}_rotation_flat.pt")
    monkeypatch.chdir(tmp_path)
    for engine, var in (("sglang", "SGLANG_OSCAR_K_ROTATION_PATH"), ("vllm", "VLLM_OSCAR_K_ROTATION_PATH")):
        rc, out, err = run_cli(capsys, "serve-args", "flat", "-e", engine, "-f", "json")
        assert rc == 0, err
        data = json.loads(out)
        k = Path(data["env"][var])
        assert k.is_absolute() and (cache_dir / "derived") in k.parents and k.name == "k_rotation.pt"
        assert any("bare tensors" in n and "derived area" in n for n in data["notes"])
    got = torch.load(k, weights_only=True)  # what the authors' loader does: ldata["rotation"] per layer
    assert all(torch.equal(got["layers"][i]["rotation"], rot["k"][i]) for i in range(2))
    with pytest.raises(ServingError, match=r"keeps the layers of its K and V files as bare tensors .* "
                                           r"rotationzoo.serving.launch_spec\(pair, engine='sglang'\)"):
        rotationzoo.load("flat").serve_env("sglang")


def test_rotation_paths_are_printed_absolute(cache_dir, tmp_path, monkeypatch, capsys):
    """A launch started from another folder must read the same files (a relative path there is another file,
    or none: the server then calibrates at start-up without a word)."""
    d = local_pair(tmp_path / "rel", layouts.v1(2, 64), layouts.v1(2, 64, seed=1, objective="sst_r_h_pbr"))
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "serve-args", "rel", "-f", "json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["env"]["SGLANG_OSCAR_K_ROTATION_PATH"] == str(d / "k_rotation_test.pt") == data["files"]["k"]
    assert all(str(d) in c for c in data["checks"])
    assert rotationzoo.load("rel").serve_env("vllm")["VLLM_OSCAR_V_ROTATION_PATH"] == str(d / "v_rotation_test.pt")
    rc, out, _ = run_cli(capsys, "serve-args", "rel/k_rotation_test.pt,rel/v_rotation_test.pt", "-e", "sglang-legacy",
                         "-f", "env")
    assert rc == 0 and f"SGLANG_OSCAR_K_ROTATION_PATH={d / 'k_rotation_test.pt'}" in out.splitlines()


def test_a_launch_block_with_expert_parallelism_is_read():
    raw = _model(launch={"tp_size": 8, "ep_size": 2})
    raw["architecture"].update(num_kv_heads=8, moe_intermediate_size=1536, weight_block_size=128)
    entry = parse_model(raw, "models[0]", "test").tag()
    assert (entry.launch.tp_size, entry.launch.ep_size) == (8, 2) and entry.launch.to_json()["ep_size"] == 2
    assert not lint_registry({"models": [raw]}).errors


def test_an_entrys_expert_parallelism_is_kept_or_refused_before_a_download(tmp_path, monkeypatch, capsys):
    """An entry served with EP (TP 8, EP 2 on 1536-wide FP8 experts) is never printed as TP 8 alone on a target
    without expert parallelism, nor with an EP size vLLM cannot launch; both are refused before anything is
    fetched, and the sizes suggested are the target's."""
    raw = _model(launch={"tp_size": 8, "ep_size": 2})
    raw["architecture"].update(num_kv_heads=8, moe_intermediate_size=1536, weight_block_size=128)
    p = tmp_path / "overlay.json"
    p.write_text(json.dumps({"registry_version": 1, "models": [raw]}))
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(p))
    for extra, said in ((["-e", "sglang-legacy"], "expert parallelism (ep_size 2), which sglang-legacy"),
                        (["-e", "vllm-prototype"], "expert parallelism (ep_size 2), which vllm-prototype"),
                        (["-e", "vllm"], "1 or the TP size (8); try --ep-size 8 (the entry's TP 8"),
                        (["-e", "vllm", "--tp", "8", "--ep", "4"], "1 or the TP size (8); try --ep-size 8"),
                        (["-e", "sglang-legacy", "--ep", "1"], "MoE weights cannot be split over 8 tensor-parallel "
                                                               "ranks: each rank's gate/up shard (intermediate size "
                                                               "1536 / 8 = 192) must be a whole number of the "
                                                               "checkpoint's 128-wide quantization blocks; try --tp "
                                                               "1, 2, 4\n")):
        rc, out, err = run_cli(capsys, "serve-args", "ns/M", *extra, "--offline")
        assert rc == 1 and out == "" and said in err and "offline" not in err, (extra, err)
    rc, out, err = run_cli(capsys, "serve-args", "ns/M", "--offline")  # its own engine: the files are what is missing
    assert rc == 1 and "is not cached" in err, err
    rc, out, err = run_cli(capsys, "serve-args", "ns/M", "-e", "vllm", "--ep", "8", "--offline")
    assert rc == 1 and "is not cached" in err, err


def test_a_latent_sets_expert_parallelism_is_checked_before_its_fetch(cache_dir, capsys):
    for extra, said in ((["--ep", "3"], "sglang: expert-parallel size 3: it does not divide the tensor-parallel size 8"),
                        (["-e", "vllm", "--ep", "2"], "vllm: expert-parallel size 2: expert parallelism here spans")):
        rc, out, err = run_cli(capsys, "serve-args", "GLM-5.2", *extra, "--offline")
        assert rc == 1 and said in err and "not cached" not in err, err
    rc, out, err = run_cli(capsys, "serve-args", "GLM-5.2", "--ep", "2", "--offline")
    assert rc == 1 and "not cached" in err, err
