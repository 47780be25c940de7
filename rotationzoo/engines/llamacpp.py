"""``llamacpp``: the authors' llama.cpp branch (``zhongzhu/llamacpp`` in FutureMLS-Lab/OSCAR).

The branch reads one ``[d, d]`` rotation per layer from GGUF tensors ``blk.{i}.attn_{k,v}_rot.weight``
inside the model GGUF it loads (per-layer sizes: Gemma-4's 256 and 512), applies them in the graph,
and quantises the cache with its own ``q2_0`` type. Only two of its model graphs read those tensors: dense
Qwen3 (``src/models/qwen3.cpp@08ad957e``) and Gemma-4 (``src/models/gemma4.cpp@7e1019bf``); every other
architecture's graph (Qwen3-MoE, Qwen3-VL, the hybrid Qwen3.5 line, Llama, …) never creates them, so
registry models of other architectures are refused. The launch is the branch README's: the fused
mixed-precision flash-attention kernels (``-fa on``, ``LLAMA_KV_FUSED_FA=1``), every layer offloaded
(``-ngl 99``), the in-quant Hadamard skipped (``LLAMA_KV_NO_HADAMARD=1``: the calibrated rotation holds
one), one clip ratio, the BF16 sink and recent windows, and ``LLAMA_KV_V_ROT=1``, without which the
branch's Gemma-4 graph leaves V unrotated. The preparation step appends the rotations GGUF (written
by :mod:`rotationzoo.serving` into the cache's derived area) to the model GGUF.
"""

from __future__ import annotations

from pathlib import Path

from ..int2kv import Int2KVConfig
from .common import Launch, LaunchInput, arg_path, ratio

#: The sink and recent windows the branch's README recommends ("64 / 256 matches the official OSCAR setup").
BRANCH_WINDOWS = (64, 256)
#: The llama.cpp architectures (GGUF ``general.architecture``) whose graph in the branch applies the rotation
#: tensors, and what they are.
ROTATING_ARCHITECTURES = {"qwen3": "Qwen3 (dense; src/models/qwen3.cpp@08ad957e)",
                          "gemma4": "Gemma-4 (src/models/gemma4.cpp@7e1019bf)"}
#: What the launch loads when no ``--model-path`` names the model GGUF.
MODEL_GGUF_PLACEHOLDER = "MODEL.gguf"


def llamacpp_env(config: Int2KVConfig) -> dict[str, str]:
    """Environment of the branch (its README's run). One clip ratio for K and V: the K ratio is used."""
    return {
        "LLAMA_KV_FUSED_FA": "1",
        "LLAMA_KV_NO_HADAMARD": "1",
        "LLAMA_KV_CLIP_RATIO": ratio(config.k_clip_ratio),
        "LLAMA_KV_HP_SINK": str(int(config.prefix_tokens)),
        "LLAMA_KV_HP_RECENT": str(int(config.recent_tokens)),
        "LLAMA_KV_V_ROT": "1",
    }


def llamacpp_args(model_gguf: str) -> list[str]:
    return ["llama-server", "-m", model_gguf, "-fa", "on", "-ngl", "99", "--cache-type-k", "q2_0",
            "--cache-type-v", "q2_0"]


def llamacpp_notes(config: Int2KVConfig) -> list[str]:
    s = config
    notes: list[str] = []
    if s.v_clip_ratio != s.k_clip_ratio:
        notes.append(f"the branch has one clip ratio for K and V: using K's {s.k_clip_ratio} "
                     f"(the registry's V ratio is {s.v_clip_ratio})")
    if s.lloyd_max:
        notes.append("this entry was published with Lloyd-Max INT2 levels; the branch's q2_0 cache has no setting "
                     "for them")
    if (s.prefix_tokens, s.recent_tokens) != BRANCH_WINDOWS:
        notes.append(f"windows {s.prefix_tokens}/{s.recent_tokens} are the entry's (measured on SGLang); the branch's "
                     f"README recommends {BRANCH_WINDOWS[0]}/{BRANCH_WINDOWS[1]}, larger windows trade KV memory for "
                     "output closer to f16")
    notes.append("upstream llama.cpp's own Hadamard rotation of quantized caches is on in the branch for q2_0 "
                 "(head_dim a multiple of 64) and is applied on top of these rotations; LLAMA_ATTN_ROT_DISABLE=1 "
                 "turns it off (the load log prints attn_rot_k / attn_rot_v)")
    notes.append("-fa on is required (the INT2 cache runs through flash attention); LLAMA_KV_FUSED_FA=1 selects the "
                 "fused INT2+f16 kernels; without a GPU use -ngl 0, and LLAMA_KV_PF_NOMM=1 for the per-query prefill "
                 "kernel")
    notes.append("the branch quantises with its own q2_0 blocks (32 elements, fp16 scale/min), not SGLang's layout")
    return notes


def build_llamacpp(inp: LaunchInput) -> Launch:
    """The env, the command on the merged model GGUF, and the step that builds it from ``inp.gguf``."""
    files: dict[str, str] = {}
    if inp.model_path:
        base = Path(inp.model_path).expanduser()
        merged = str(base.with_name(f"{base.stem}-rot-kv.gguf"))
        files["base_gguf"] = str(base)
    else:
        base, merged = Path(MODEL_GGUF_PLACEHOLDER), MODEL_GGUF_PLACEHOLDER.replace(".gguf", "-rot-kv.gguf")
    files["model_gguf"] = merged
    prepare = []
    if inp.gguf is not None:
        files["gguf"] = inp.gguf
        prepare.append(["rotationzoo", "export", arg_path(inp.gguf), "--to", "gguf", "--base-gguf", arg_path(base),
                        "--out", arg_path(merged)])
    notes = llamacpp_notes(inp.config)
    if "ragged" in inp.kinds:
        notes.append("layers of two head_dims (Gemma-4): the branch's Gemma-4 graph rotates V only when LLAMA_KV_V_ROT "
                     "is set, which the launch does; K is always rotated")
    if inp.model_id is None:
        notes.append("the model of these rotations is not a registry model: the branch rotates the KV cache of "
                     f"{' and '.join(n.split(' (')[0] for n in ROTATING_ARCHITECTURES.values())} models only "
                     f"(general.architecture {' or '.join(ROTATING_ARCHITECTURES)}): check that the model GGUF is one")
    if not inp.model_path:
        notes.insert(0, f"replace {MODEL_GGUF_PLACEHOLDER} with the model's GGUF file (or pass --model-path)")
    return Launch(llamacpp_env(inp.config), llamacpp_args(arg_path(merged)), notes, prepare=prepare, files=files)


def llamacpp_plan_notes(config: Int2KVConfig, page: int) -> list[str]:
    return ["the llama.cpp branch stores q2_0 blocks (32 values, fp16 scale and min: 3.0 bits per element), "
            "not this layout; oscar_int2 here is the Int2KVConfig layout"]
