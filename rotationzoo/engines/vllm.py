"""The two vLLM OSCAR trees: ``vllm`` (the port of vLLM pull request 46774) and ``vllm-prototype``.

- ``vllm``: the pull request's tree (vllm-project/vllm #46774, head 57286d5d). ``VLLM_OSCAR_*``
  variables and ``--kv-cache-dtype oscar_int2``; BF16 windows ``VLLM_OSCAR_SINK_TOKENS`` /
  ``VLLM_OSCAR_RECENT_TOKENS`` kept in a staging arena of ``VLLM_OSCAR_STAGING_TOKENS`` tokens; one
  ``[d, d]`` rotation per layer; one quantization group per head vector (``group_size < head_dim``
  is refused by the port); no hybrid models; no CUDA graphs. The port rounds the sink *down* to whole
  KV blocks, so a sink shorter than the block size silently becomes 0: refused here in one line. Its
  MLA path fake-quantizes the shared latent at 2 bits from a folder of bare ``[rank, rank]`` tensors
  (``VLLM_OSCAR_MLA_KV_ROTATION_PATH``); a set with OSCAR-2 dict layer files, companions or not, is refused.
- ``vllm-prototype``: another vLLM OSCAR tree (justzhanghong/vllm) that spells the windows
  ``VLLM_OSCAR_PREFIX_TOKENS`` / ``VLLM_OSCAR_RECENT_TOKENS`` and can fold ``R_V`` into the weights
  (``VLLM_OSCAR_ABSORB_V_ROTATION``).
"""

from __future__ import annotations

import os

from ..errors import ServingError
from ..int2kv import Int2KVConfig
from .common import Launch, LaunchInput, group_size, rank_notes, ratio

#: vLLM's KV block size when ``--block-size`` is not given (its CUDA default).
VLLM_DEFAULT_BLOCK = 16
#: The port's BF16 staging arena for the window tokens (its default).
VLLM_STAGING_TOKENS = 8192
#: The second tree's prototype scope (``OscarConfig.validate_prototype_settings``; also clips 0.96 / 0.92 and a
#: recent window that is a positive multiple of 16).
_PROTOTYPE_SCOPE = {"head_dim": 128, "group_size": 128, "prefix_tokens": 64}


def vllm_page_size(hp_dtype: str) -> int:
    """vLLM's KV block: :data:`VLLM_DEFAULT_BLOCK` tokens."""
    return VLLM_DEFAULT_BLOCK


def vllm_env(config: Int2KVConfig, k_path: str | os.PathLike[str], v_path: str | os.PathLike[str],
             head_dim: int | None = None) -> dict[str, str]:
    """Environment of the pull request's tree: rotation paths, clip ratios, group size, windows, staging."""
    group = config.group_size if config.group_size is not None else head_dim
    env = {
        "VLLM_OSCAR_K_ROTATION_PATH": str(k_path),
        "VLLM_OSCAR_V_ROTATION_PATH": str(v_path),
        "VLLM_OSCAR_K_CLIP_RATIO": ratio(config.k_clip_ratio),
        "VLLM_OSCAR_V_CLIP_RATIO": ratio(config.v_clip_ratio),
    }
    if group is not None:
        env["VLLM_OSCAR_GROUP_SIZE"] = str(int(group))
    env["VLLM_OSCAR_SINK_TOKENS"] = str(int(config.prefix_tokens))
    env["VLLM_OSCAR_RECENT_TOKENS"] = str(int(config.recent_tokens))
    env["VLLM_OSCAR_STAGING_TOKENS"] = str(VLLM_STAGING_TOKENS)
    return env


def vllm_args(model_path: str, tp_size: int = 1, block_size: int | None = None,
              kv_cache_dtype: str | None = "oscar_int2", ep_size: int = 1) -> list[str]:
    """``vllm serve`` arguments; ``ep_size`` is 1 or ``tp_size`` (:func:`~.rules.check_expert_parallel`)."""
    args = ["vllm", "serve", model_path]
    if kv_cache_dtype:
        args += ["--kv-cache-dtype", kv_cache_dtype]
    if tp_size > 1:
        args += ["--tensor-parallel-size", str(tp_size)]
    if ep_size > 1:
        assert ep_size == tp_size, "vLLM's expert parallelism spans every TP rank"
        args.append("--enable-expert-parallel")
    if block_size is not None:
        args += ["--block-size", str(block_size)]
    return args


def check_sink(config: Int2KVConfig, block_size: int | None, engine: str) -> list[str]:
    """The port keeps ``(sink // block) * block`` sink tokens: refuse a sink that becomes 0, note a rounded one."""
    sink, block = int(config.prefix_tokens), block_size or VLLM_DEFAULT_BLOCK
    if sink == 0:
        return []
    kept = (sink // block) * block
    flag = f"--block-size {block}" if block_size else f"vLLM's default block size {block}"
    if kept == 0:
        raise ServingError(f"{engine}: the sink of {sink} tokens rounds down to 0 at {flag} (the port keeps whole "
                           f"KV blocks of the sink); use --block-size {_largest_block(sink)} or smaller, or a sink of "
                           f"at least {block} tokens")
    if kept != sink:
        return [f"the port keeps whole KV blocks of the sink: {sink} tokens become {kept} at {flag}"]
    return []


def _largest_block(sink: int) -> int:
    b = VLLM_DEFAULT_BLOCK
    while b * 2 <= sink:
        b *= 2
    return b


def _check_group(inp: LaunchInput, engine: str) -> int | None:
    dims = inp.head_dims
    g = group_size(inp.config, dims) if dims is not None or inp.config.group_size is not None else None
    if dims is not None and g is not None and g < dims.max:
        raise ServingError(f"{engine}: group_size {g} is smaller than head_dim {dims.max}; the port stores one "
                           f"quantization group per head vector (it refuses group_size < head_dim); serve with "
                           f"--engine sglang, or use an entry with group_size {dims.max}")
    return g


def _mla(inp: LaunchInput) -> Launch:
    lat = inp.latent
    assert lat is not None
    if lat.bits != 2:
        raise ServingError(f"vllm: the latent set is served at {lat.bits} bits; the port's MLA path quantizes the "
                           f"latent to INT2 only; serve it with --engine sglang (SGLANG_OSCAR_MLA_KV_BITS)")
    if lat.companions or "dict" in lat.layouts:
        raise ServingError("vllm: the latent set holds OSCAR-2 dict layer files ({rotation, …}); the port's MLA path "
                           "reads bare [rank, rank] tensors only (torch.load(path).shape); serve it with --engine "
                           "sglang")
    if lat.rank % lat.group_size:
        raise ServingError(f"vllm: VLLM_OSCAR_MLA_KV_GROUP_SIZE={lat.group_size} must divide kv_lora_rank={lat.rank}")
    env = {"VLLM_OSCAR_MLA_KV_ROTATION_PATH": lat.folder, "VLLM_OSCAR_MLA_KV_GROUP_SIZE": str(lat.group_size)}
    if lat.lloyd_max is not None:
        env["VLLM_OSCAR_LLOYD_MAX"] = "1" if lat.lloyd_max else "0"
    if lat.hp_subspace:
        env["VLLM_OSCAR_MLA_KV_HP_SUBSPACE_PATH"] = lat.hp_subspace
    notes = ["the port's MLA path fake-quantizes the latent into the model's own KV cache (quality only: memory is "
             "unchanged) and has no BF16 windows",
             f"the port replaces a missing layer_<id>.pt by identity with a warning; all {lat.layers} layer files "
             "were checked present"]
    if lat.pp_size > 1:
        notes.append(f"the recipe runs {lat.pp_size} pipeline stages; add --pipeline-parallel-size {lat.pp_size}")
    return Launch(env, vllm_args(inp.model, inp.launch.tp_size, inp.block_size, kv_cache_dtype=None,
                                        ep_size=inp.launch.ep_size), notes)


def build_vllm(inp: LaunchInput) -> Launch:
    if inp.latent is not None:
        return _mla(inp)
    assert inp.paths is not None  # the table refuses calibration
    _check_group(inp, "vllm")
    notes = check_sink(inp.config, inp.block_size, "vllm")
    env = vllm_env(inp.config, inp.paths["k"], inp.paths["v"], inp.head_dims.default if inp.head_dims else None)
    notes += ["needs the tree of vLLM pull request 46774 (unmerged, head 57286d5d); it runs without CUDA graphs",
              f"the BF16 sink and recent tokens are staged in a ring of {VLLM_STAGING_TOKENS} tokens "
              "(VLLM_OSCAR_STAGING_TOKENS); a token evicted from it is read from its INT2 copy",
              "the port stores fp16 scale/zero and replaces a missing layer by identity in some versions; every "
              "layer of these files was checked"]
    if inp.config.lloyd_max:
        notes.append("this entry was published with Lloyd-Max INT2 levels; the port's K/V path has no setting for them")
    return Launch(env, vllm_args(inp.model, inp.launch.tp_size, inp.block_size, ep_size=inp.launch.ep_size),
                  notes + rank_notes(inp))


def prototype_env(config: Int2KVConfig, k_path: str, v_path: str, head_dim: int | None, absorb: bool) -> dict[str, str]:
    """Environment of the prototype tree (``VLLM_OSCAR_PREFIX_TOKENS`` spelling)."""
    group = config.group_size if config.group_size is not None else head_dim
    env = {
        "VLLM_OSCAR_K_ROTATION_PATH": str(k_path),
        "VLLM_OSCAR_V_ROTATION_PATH": str(v_path),
        "VLLM_OSCAR_K_CLIP_RATIO": ratio(config.k_clip_ratio),
        "VLLM_OSCAR_V_CLIP_RATIO": ratio(config.v_clip_ratio),
    }
    if group is not None:
        env["VLLM_OSCAR_GROUP_SIZE"] = str(int(group))
    env["VLLM_OSCAR_PREFIX_TOKENS"] = str(int(config.prefix_tokens))
    env["VLLM_OSCAR_RECENT_TOKENS"] = str(int(config.recent_tokens))
    if absorb:
        env["VLLM_OSCAR_ABSORB_V_ROTATION"] = "1"
    return env


def build_prototype(inp: LaunchInput) -> Launch:
    assert inp.paths is not None  # the table refuses calibration and latent sets
    g = _check_group(inp, "vllm-prototype")
    d = inp.head_dims.default if inp.head_dims else None
    env = prototype_env(inp.config, inp.paths["k"], inp.paths["v"], d, inp.absorb)
    have = {"head_dim": d, "group_size": g, "prefix_tokens": inp.config.prefix_tokens}
    off = [f"{k}={have[k]} (expects {v})" for k, v in _PROTOTYPE_SCOPE.items() if have[k] is not None and have[k] != v]
    for side, want in (("k", 0.96), ("v", 0.92)):
        got = float(getattr(inp.config, f"{side}_clip_ratio"))
        if abs(got - want) > 1e-9:
            off.append(f"{side}_clip_ratio={got:g} (expects {want})")
    if inp.config.recent_tokens <= 0 or inp.config.recent_tokens % 16:
        off.append(f"recent_tokens={inp.config.recent_tokens} (expects a positive multiple of 16)")
    notes = ["needs the vLLM OSCAR prototype tree (justzhanghong/vllm: VLLM_OSCAR_PREFIX_TOKENS / RECENT_TOKENS); "
             "the tree of vLLM pull request 46774 is --engine vllm"]
    if off:
        notes.append("outside the prototype's checked scope (OscarConfig.validate_prototype_settings): " + ", ".join(off))
    if inp.config.lloyd_max:
        notes.append("this entry was published with Lloyd-Max INT2 levels; the prototype has no setting for them")
    if inp.absorb_note:
        notes.append(inp.absorb_note.replace("SGLANG_OSCAR_ABSORB_V_ROTATION=0", "VLLM_OSCAR_ABSORB_V_ROTATION unset"))
    return Launch(env, vllm_args(inp.model, inp.launch.tp_size, inp.block_size), notes + rank_notes(inp))


def vllm_plan_notes(config: Int2KVConfig, page: int) -> list[str]:
    return ["the vLLM port stores its own layout (fp16 scale/zero per head vector, BF16 windows staged in a ring "
            "outside the block pool); oscar_int2 here is the Int2KVConfig layout in 16-token blocks"]
