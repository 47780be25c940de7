"""``sglang``: the authors' current SGLang tree (FutureMLS-Lab/OSCAR on upstream SGLang main, base 67eab57057).

Every setting follows their generic launch (``rotation/eval_oscar_gpqa.sh``) and the entry's
per-model recipe (``rotation/run/<model>.sh``): triton for the attention, prefill and decode
backends (FA3's INT2 prefill asserts on sliding-window layers), the prefix cache on
(``--disable-radix-cache`` only on request), ``SGLANG_OSCAR_ABSORB_V_ROTATION=0`` unless the entry
asks for absorption and the files allow it, ``SGLANG_LLOYD_MAX`` passed only when the entry uses
Lloyd-Max levels (unset, the pool's own default applies), windows, group size and TP size from the
entry. It reads one rotation per layer, one per KV head (``[per-head: N kv heads]`` in its log),
ragged layers, and the OSCAR-2 companions ``k_mean`` / ``q_rotation`` / ``o_rotation``; not
``v_mean``. Without rotation files (``calibrate``) it fits a shared pair at start-up.
"""

from __future__ import annotations

from ..int2kv import Int2KVConfig
from .common import SGLANG_HP_MAX_SPLITS, Launch, LaunchInput, group_size, rank_notes, ratio, window_notes

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


def sglang_args(inp: LaunchInput) -> list[str]:
    """``python -m sglang.launch_server`` arguments of the current tree for ``inp``."""
    lc = inp.launch
    args = [
        "python", "-m", "sglang.launch_server",
        "--model-path", inp.model,
        "--tensor-parallel-size", str(lc.tp_size),
        "--kv-cache-dtype", "int2",
        "--kv-cache-quant-group-size", str(group_size(inp.config, inp.head_dims)),
        "--attention-backend", lc.attention_backend,
        "--prefill-attention-backend", lc.prefill_attention_backend,
        "--decode-attention-backend", lc.decode_attention_backend,
    ]
    if lc.mamba_scheduler_strategy:
        args += ["--mamba-scheduler-strategy", lc.mamba_scheduler_strategy]
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
    if lc.prefill_attention_backend == "fa3" or lc.attention_backend == "fa3":
        notes.append("FA3's INT2 prefill asserts on sliding-window layers; use triton for models that have them")
    return notes + rank_notes(inp)


def build(inp: LaunchInput) -> Launch:
    paths = inp.paths or {}
    env = sglang_env(inp.config, paths.get("k"), paths.get("v"), absorb=inp.absorb)
    return Launch(env, sglang_args(inp), _notes(inp), _checks(inp))
