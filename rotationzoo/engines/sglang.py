"""``sglang``: the authors' current SGLang tree (FutureMLS-Lab/OSCAR on upstream SGLang main, base 67eab57057).

Every setting follows their generic launch (``rotation/eval_oscar_gpqa.sh``) and the entry's
per-model recipe (``rotation/run/<model>.sh``): triton for the attention, prefill and decode
backends (FA3's INT2 prefill asserts on sliding-window layers), the prefix cache on
(``--disable-radix-cache`` only on request), ``SGLANG_OSCAR_ABSORB_V_ROTATION=0`` unless the entry
asks for absorption and the files allow it, ``SGLANG_LLOYD_MAX`` passed only when the entry uses
Lloyd-Max levels (unset, the pool's own default applies), windows, group size and TP size from the
entry. It reads one rotation per layer, one per KV head (``[per-head: N kv heads]`` in its log),
ragged layers, and the OSCAR-2 companions ``k_mean`` / ``q_rotation`` / ``o_rotation``; not
``v_mean``. Without rotation files (``calibrate``) it fits a shared pair at start-up. A hybrid model's
Mamba radix-cache strategy (``--mamba-radix-cache-strategy extra_buffer``, the entry's) is a strategy of
the prefix cache: with ``--disable-radix-cache`` it is left out, since SGLang refuses the pair ("mamba
extra_buffer is not compatible with --disable-radix-cache … Please use --mamba-scheduler-strategy
no_buffer instead": ``_handle_mamba_radix_cache`` in ``sglang-research/python/sglang/srt/server_args.py``
of FutureMLS-Lab/OSCAR at 797e39c7), and the default ``no_buffer`` applies.

MLA models (GLM-5.2, GLM-5.3, Kimi-K3) quantise their shared latent instead: a folder of
``layer_<id>.pt`` latent rotations through ``SGLANG_OSCAR_MLA_KV_ROTATION_PATH``, packed
(``SGLANG_OSCAR_MLA_KV_PACKED=1``) at ``SGLANG_OSCAR_MLA_KV_BITS`` bits, in a KV cache pinned to
``bfloat16`` (``int2`` aborts on a DSA model; ``auto`` follows the GPU generation), with no
``--kv-cache-quant-group-size`` (the pool reads ``SGLANG_OSCAR_MLA_KV_GROUP_SIZE``).
"""

from __future__ import annotations

from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from .common import SGLANG_HP_MAX_SPLITS, Launch, LaunchInput, group_size, rank_notes, ratio, window_notes

#: SGLang's flag for the Mamba radix cache of hybrid models (``--mamba-scheduler-strategy`` is its old alias).
MAMBA_FLAG = "--mamba-radix-cache-strategy"

#: Start-up calibration settings and the defaults of the authors' tree (``SGLANG_OSCAR_CALIBRATION_*``).
CALIBRATION_ENV: dict[str, str] = {
    "SGLANG_OSCAR_CALIBRATION_PROMPTS_PATH": "",  # empty: GPQA-Diamond (openai-simple-evals, seed 0)
    "SGLANG_OSCAR_CALIBRATION_TOKENS": "30000",
    "SGLANG_OSCAR_CALIBRATION_BATCH_SIZE": "32",
    "SGLANG_OSCAR_CALIBRATION_TIMEOUT": "1800",
}


def sglang_env(config: Int2KVConfig, k_path: str | None, v_path: str | None, *, absorb: bool = False) -> dict[str, str]:
    """Environment of the current tree: rotation paths, or (both ``None``) the start-up calibration settings."""
    env = {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_OSCAR_ABSORB_V_ROTATION": "1" if absorb else "0",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(int(config.prefix_tokens)),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(int(config.recent_tokens)),
        "SGLANG_MIXED_KV_HP_MAX_SPLITS": str(SGLANG_HP_MAX_SPLITS),
        "SGLANG_MIXED_KV_HP_DTYPE": config.hp_dtype,
        "SGLANG_MIXED_KV_SCALE_DTYPE": config.scale_dtype,
    }
    if k_path is None or v_path is None:
        env.update(CALIBRATION_ENV)
    else:
        env["SGLANG_OSCAR_K_ROTATION_PATH"] = str(k_path)
        env["SGLANG_OSCAR_V_ROTATION_PATH"] = str(v_path)
    env["SGLANG_OSCAR_K_CLIP_RATIO"] = ratio(config.k_clip_ratio)
    env["SGLANG_OSCAR_V_CLIP_RATIO"] = ratio(config.v_clip_ratio)
    if config.lloyd_max:
        env["SGLANG_LLOYD_MAX"] = "1"
    return env


def ep_args(lc: LaunchConfig) -> list[str]:
    """SGLang's expert-parallel size, when there is one (its ranks are the TP ranks: ``ep_size`` divides ``tp_size``)."""
    return ["--ep-size", str(lc.ep_size)] if lc.ep_size > 1 else []


def mamba_args(lc: LaunchConfig) -> list[str]:
    """The Mamba radix-cache strategy flag: the entry's, unless the prefix cache is off (see the module docstring)."""
    if lc.mamba_scheduler_strategy and not lc.disable_radix_cache:
        return [MAMBA_FLAG, lc.mamba_scheduler_strategy]
    return []


def mamba_notes(lc: LaunchConfig) -> list[str]:
    if lc.mamba_scheduler_strategy and lc.disable_radix_cache:
        return [f"{MAMBA_FLAG} {lc.mamba_scheduler_strategy} (the entry's) is left out: it is a strategy of the "
                "prefix cache, which is off, and SGLang refuses it with --disable-radix-cache; the Mamba state "
                "needs no buffer then (no_buffer, the default)"]
    return []


def sglang_args(inp: LaunchInput) -> list[str]:
    """``python -m sglang.launch_server`` arguments of the current tree for ``inp``."""
    lc = inp.launch
    args = [
        "python", "-m", "sglang.launch_server",
        "--model-path", inp.model,
        "--tensor-parallel-size", str(lc.tp_size), *ep_args(lc),
        "--kv-cache-dtype", "int2",
        "--kv-cache-quant-group-size", str(group_size(inp.config, inp.head_dims)),
        "--attention-backend", lc.attention_backend,
        "--prefill-attention-backend", lc.prefill_attention_backend,
        "--decode-attention-backend", lc.decode_attention_backend,
    ]
    args += mamba_args(lc)
    if lc.disable_radix_cache:
        args.append("--disable-radix-cache")
    return args


def _checks(inp: LaunchInput) -> list[str]:
    if inp.paths is None:
        return []
    if inp.per_head_kv_heads is not None:
        return [f"the server log says '[oscar] loaded rotation from {inp.paths[s]} … [per-head: "
                f"{inp.per_head_kv_heads} kv heads]' for the {s.upper()} file; without the suffix the per-head "
                f"rotations were not read" for s in ("k", "v")]
    return [f"the server log says '[oscar] loaded rotation from {inp.paths[s]} …' for the {s.upper()} file, "
            f"with no '[per-head' suffix" for s in ("k", "v")]


def _notes(inp: LaunchInput) -> list[str]:
    lc, cfg = inp.launch, inp.config
    notes = window_notes(cfg, "the INT2 cache")
    if lc.recipe:
        notes.append(f"settings from the authors' recipe {lc.recipe} (FutureMLS-Lab/OSCAR)")
    notes.append("needs the authors' current SGLang tree (FutureMLS-Lab/OSCAR: upstream SGLang main plus OSCAR, "
                 "python/sglang at the repository root); the May 2026 fork is --engine sglang-legacy")
    if inp.absorb_note:
        notes.append(inp.absorb_note)
    if "k_mean" in inp.kinds:
        notes.append("the K file centers keys (k_mean): the fused rotate-clip-quantise write kernel stays off "
                     "(SGLANG_OSCAR_FUSED_ROTATE_CLIP_QUANT is not set)")
    if not cfg.lloyd_max:
        notes.append("SGLANG_LLOYD_MAX is not set: the pool's own default applies (uniform levels for this cache)")
    if lc.disable_radix_cache:
        notes.append("the prefix cache is off on request; the two defects that forced it off are fixed in this tree")
    notes += mamba_notes(lc)
    if lc.prefill_attention_backend == "fa3" or lc.attention_backend == "fa3":
        notes.append("FA3's INT2 prefill asserts on sliding-window layers; use triton for models that have them")
    return notes + rank_notes(inp)


def mla_env(inp: LaunchInput) -> dict[str, str]:
    """Environment of the current tree for an MLA latent set (the generic driver's MLA branch)."""
    lat, cfg = inp.latent, inp.config
    assert lat is not None
    env = {
        "SGLANG_ENABLE_MIXED_KV_WINDOWS": "1",
        "SGLANG_MIXED_KV_PREFIX_TOKENS": str(int(cfg.prefix_tokens)),
        "SGLANG_MIXED_KV_RECENT_TOKENS": str(int(cfg.recent_tokens)),
        "SGLANG_OSCAR_MLA_KV_ROTATION_PATH": lat.folder,
        "SGLANG_OSCAR_MLA_KV_GROUP_SIZE": str(lat.group_size),
        "SGLANG_OSCAR_MLA_KV_PACKED": "1",
        "SGLANG_OSCAR_MLA_KV_BITS": str(lat.bits),
    }
    if lat.hp_subspace:
        env["SGLANG_OSCAR_MLA_KV_HP_SUBSPACE_PATH"] = lat.hp_subspace
    if lat.bits != 2:  # the group-factored decode is 2-bit only and turns itself on at 8K context
        env["SGLANG_OSCAR_MLA_PACKED_GF"] = "0"
    lloyd = False if lat.bits != 2 else lat.lloyd_max  # Lloyd-Max levels are a 2-bit codebook
    if lloyd is not None:
        env["SGLANG_LLOYD_MAX"] = "1" if lloyd else "0"
    return env


def mla_args(inp: LaunchInput) -> list[str]:
    lat, lc = inp.latent, inp.launch
    assert lat is not None
    args = ["python", "-m", "sglang.launch_server", "--model-path", inp.model,
            "--tensor-parallel-size", str(lc.tp_size), *ep_args(lc)]
    if lat.pp_size > 1:
        args += ["--pipeline-parallel-size", str(lat.pp_size)]
    args += ["--kv-cache-dtype", "bfloat16", "--attention-backend", lat.attention_backend,
             "--prefill-attention-backend", lat.prefill_attention_backend,
             "--decode-attention-backend", lat.decode_attention_backend]
    args += mamba_args(lc)
    if lc.disable_radix_cache:
        args.append("--disable-radix-cache")
    return args


def _mla_notes(inp: LaunchInput) -> list[str]:
    lat, lc = inp.latent, inp.launch
    assert lat is not None
    notes = []
    if lc.recipe:
        notes.append(f"settings from the authors' recipe {lc.recipe} (FutureMLS-Lab/OSCAR)")
    notes.append(f"the latent folder holds {lat.layers} layer_<id>.pt files, each checked (the server would replace a "
                 "missing one by identity)")
    notes.append("--kv-cache-dtype bfloat16 is pinned: int2 aborts on a DSA model, and auto gives fp8_e4m3 on SM100+, "
                 "which cannot hold the rotations")
    if lat.bits != 2:
        notes.append(f"{lat.bits}-bit latent: SGLANG_OSCAR_MLA_PACKED_GF=0 (the group-factored decode is 2-bit only) "
                     "and SGLANG_LLOYD_MAX=0 (a 2-bit codebook)")
    elif lat.lloyd_max is None:
        notes.append("SGLANG_LLOYD_MAX is not set: the packed pool's own default applies (Lloyd-Max on at 2 bits)")
    notes += mamba_notes(lc)
    if lat.pp_size > 1 or lc.tp_size * lat.pp_size > 8:
        notes.append("the recipe spans more than one node: add --nnodes, --node-rank and --dist-init-addr per node")
    return notes


def _mla_checks(inp: LaunchInput) -> list[str]:
    lat, cfg = inp.latent, inp.config
    assert lat is not None
    return [f"the server log says 'loaded {lat.layers} rotations' from {lat.folder}; a log saying 'not found — no "
            "rotation' means the path was not read",
            f"the server log says 'BF16 latent windows: sink={cfg.prefix_tokens} recent={cfg.recent_tokens}'"]


def build(inp: LaunchInput) -> Launch:
    if inp.latent is not None:
        return Launch(mla_env(inp), mla_args(inp), _mla_notes(inp) + rank_notes(inp), _mla_checks(inp))
    paths = inp.paths or {}
    env = sglang_env(inp.config, paths.get("k"), paths.get("v"), absorb=inp.absorb)
    if inp.k_clip_per_layer is not None:  # the tree's per-layer / per-head K clip tables (unified_kv_pool.py)
        env["SGLANG_OSCAR_K_CLIP_PER_LAYER"] = inp.k_clip_per_layer
    if inp.k_clip_per_head is not None:
        env["SGLANG_OSCAR_K_CLIP_PER_HEAD"] = inp.k_clip_per_head
    return Launch(env, sglang_args(inp), _notes(inp), _checks(inp))


def sglang_plan_notes(config: Int2KVConfig, page: int) -> list[str]:
    """Windows that are not whole quantised pages (SGLang's INT2 cache rejects them)."""
    return [f"{name}={getattr(config, name)} is not a multiple of the quantised page size {page}; SGLang's INT2 cache "
            "rejects it" for name in ("prefix_tokens", "recent_tokens") if getattr(config, name) % page]
