"""What every engine target's builder receives and returns, and the helpers they share (no torch)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import ServingError
from ..headdims import HeadDims
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: Decode splits over the BF16 windows (every SGLang launch of the authors).
SGLANG_HP_MAX_SPLITS = 8


@dataclass(frozen=True)
class RankHeads:
    """The KV heads tensor-parallel rank ``rank`` holds, of ``of`` KV heads in total."""

    rank: int
    kv_heads: tuple[int, ...]
    of: int

    def describe(self) -> str:
        h = self.kv_heads
        span = f"{h[0]}" if len(h) == 1 else f"{h[0]}-{h[-1]}"
        return f"rank {self.rank}: KV head{'s' if len(h) > 1 else ''} {span} of {self.of}"

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, "kv_heads": list(self.kv_heads), "of": self.of}


@dataclass(frozen=True)
class LatentLaunch:
    """An MLA latent set to launch with (see :class:`rotationzoo.registry.LatentSet`): its verified local
    folder of ``layer_<id>.pt`` files and the settings of the model's recipe.

    Attributes:
        folder: the local folder every latent layer file was verified in.
        rank: ``kv_lora_rank`` (the latent width each ``[rank, rank]`` rotation acts on).
        layers: how many latent layers the folder holds (all of them checked).
        bits: bits per latent value in the packed pool (2, or 4 where the latent is not INT2-representable).
        group_size: latent values sharing one scale/zero pair.
        lloyd_max: ``True`` / ``False`` to pin the Lloyd-Max levels, ``None`` for the pool's default.
        hp_subspace: the verified folder of ``[k, rank]`` high-precision subspaces, if the set has one.
        pp_size: pipeline-parallel stages of the recipe.
        attention_backend, prefill_attention_backend, decode_attention_backend: the recipe's backends.
        companions: some layers carry ``q_rotation`` (a non-orthogonal transform) or a ``mean``.
        layouts: the layer files' layouts: ``"tensor"`` (a bare ``[rank, rank]`` tensor) and/or ``"dict"``
            (the OSCAR-2 dict, even one holding only ``rotation``).
    """

    folder: str
    rank: int
    layers: int
    bits: int = 2
    group_size: int = 128
    lloyd_max: bool | None = None
    hp_subspace: str | None = None
    pp_size: int = 1
    attention_backend: str = "triton"
    prefill_attention_backend: str = "triton"
    decode_attention_backend: str = "triton"
    companions: bool = False
    layouts: tuple[str, ...] = ("tensor",)


@dataclass(frozen=True)
class LaunchInput:
    """Everything a builder needs, already checked: the settings, the files and what they hold.

    Attributes:
        config: the INT2 settings (the entry's ``serving``, or defaults for local files).
        launch: the launch knobs (the entry's ``launch`` with the caller's overrides applied).
        paths: local K and V files; ``None`` for a start-up calibration launch.
        model: what the engine loads (a model id, a folder, a GGUF).
        head_dims: ``d`` per layer (``None`` when unknown: a calibration launch without an architecture).
        kinds: what the files hold (:data:`rotationzoo.vocab.FILE_KINDS`).
        per_head_kv_heads: ``H_kv`` of a per-KV-head file (for the server's log line), else ``None``.
        absorb: whether V-rotation absorption is on (already decided by the absorption rule).
        absorb_note: why absorption was turned off against the entry's setting, if it was.
        ranks: the KV heads of each tensor-parallel rank (empty when the model's KV heads are unknown).
        sharded: whether ``ranks`` slice the rotations themselves (per-KV-head files).
        calibrate: a start-up calibration launch (no rotation files).
        model_kv_heads: the model's KV heads, when known.
        hybrid: the model mixes attention with linear-attention (Mamba-style) layers.
        block_size: the engine's KV block (page) size asked for, when the target takes one.
        gguf: the rotations GGUF the launch merges into the model GGUF (targets that read a GGUF).
        model_path: what the caller asked the engine to load (``--model-path``), if anything.
        latent: the MLA latent set to launch with, instead of K/V files.
        k_clip_per_layer, k_clip_per_head: checked K clip tables (a file, or a comma list per layer).
        model_id: the registry model the rotations are for, when known (the architecture checks use it).
    """

    config: Int2KVConfig
    launch: LaunchConfig
    paths: Mapping[str, str] | None
    model: str
    head_dims: HeadDims | None
    kinds: frozenset[str]
    per_head_kv_heads: int | None = None
    absorb: bool = False
    absorb_note: str | None = None
    ranks: tuple[RankHeads, ...] = ()
    sharded: bool = False
    calibrate: bool = False
    model_kv_heads: int | None = None
    hybrid: bool = False
    block_size: int | None = None
    gguf: str | None = None
    model_path: str | None = None
    latent: LatentLaunch | None = None
    k_clip_per_layer: str | None = None
    k_clip_per_head: str | None = None
    model_id: str | None = None


@dataclass
class Launch:
    """A builder's output: environment (in launch order), argv, caveats, log lines to look for, the
    commands to run first (``prepare``) and the local files the launch names beyond the rotations."""

    env: dict[str, str]
    args: list[str]
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    prepare: list[list[str]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)


#: How a model id names its llama.cpp architecture (GGUF ``general.architecture``), first match wins: the Qwen3
#: variants with graphs of their own (vision-language, the hybrid 3.5 / 3.8 line, mixture of experts) before
#: dense Qwen3.
_ARCHITECTURE_OF_NAME: tuple[tuple[str, str], ...] = (
    (r"qwen3[-_.]?vl", "qwen3vl"),
    (r"qwen3\.[1-9]", "qwen35"),
    (r"qwen3-.*-a\d+(\.\d+)?b(?![a-z0-9])", "qwen3moe"),
    (r"qwen3(?![0-9])", "qwen3"),
    (r"gemma-?4(?![0-9])", "gemma4"),
)


def llama_architecture(model_id: str) -> str | None:
    """llama.cpp's architecture name of a model, as far as its id tells (``Qwen/Qwen3-8B`` → ``qwen3``,
    ``Qwen/Qwen3-30B-A3B`` → ``qwen3moe``, ``google/gemma-4-12B-it`` → ``gemma4``); ``None`` for others."""
    name = str(model_id).rsplit("/", 1)[-1].lower()
    return next((arch for pattern, arch in _ARCHITECTURE_OF_NAME if re.search(pattern, name)), None)


def arg_path(path: str | Path) -> str:
    """A path as a command-line argument: a relative one starting with ``-`` gets ``./`` (never read as an option)."""
    text = str(path)
    return f"./{text}" if text.startswith("-") else text


def ratio(x: float) -> str:
    return repr(float(x))


def one_token_page(hp_dtype: str) -> int:
    """A page of one token (llama.cpp's cache cells): the planner rounds nothing."""
    return 1


def sglang_page_size(hp_dtype: str) -> int:
    """The SGLang INT2 cache's page size ``N_Q = 4 · itemsize(hp_dtype)`` (8 for bfloat16)."""
    try:
        return 4 * _DTYPE_BYTES[hp_dtype]
    except KeyError:
        raise ServingError(f"unknown hp_dtype {hp_dtype!r}; expected bfloat16, float16 or float32") from None


def group_size(config: Int2KVConfig, head_dims: HeadDims | None) -> int:
    """The INT2 group size to pass: the one group-size rule for one head_dim; for layers of different
    head_dims (Gemma-4: 256 and 512) the configuration's ``group_size``, which must divide each of them."""
    if head_dims is None or head_dims.uniform:
        if head_dims is None:
            if config.group_size is None:
                raise ServingError("the INT2 group size is unknown: the entry has no group_size and no head_dim")
            return config.group_size
        return config.group_for(head_dims.default)
    g = config.group_size
    dims = sorted({head_dims.default, *head_dims.overrides.values()})
    if g is None or any(d % g for d in dims):
        raise ServingError(f"layers have head_dims {', '.join(map(str, dims))}: the launch needs a group_size that "
                           f"divides each of them (the entry has {g})")
    return g


def window_notes(config: Int2KVConfig, engine: str) -> list[str]:
    """Windows that are not whole INT2 pages (the SGLang targets refuse them)."""
    nq = sglang_page_size(config.hp_dtype)
    return [f"{name}={val} is not a multiple of the quantised page size {nq}; {engine} rejects it"
            for name, val in (("prefix_tokens", config.prefix_tokens), ("recent_tokens", config.recent_tokens))
            if val % nq]


def rank_notes(inp: LaunchInput) -> list[str]:
    """One line per rank when the launch is tensor-parallel."""
    if inp.launch.tp_size < 2 or not inp.ranks:
        return []
    what = ("its slice of the per-KV-head rotations" if inp.sharded
            else "the per-layer rotations are the same on every rank")
    return [f"{r.describe()} ({what})" for r in inp.ranks]
