"""The engine table: one :class:`EngineTarget` per engine, all of it data.

What each target reads (file kinds of :data:`rotationzoo.vocab.FILE_KINDS`), which launch knobs it
takes, its KV page size and planner notes, whether it is given K/V ``.pt`` paths or a model GGUF
holding the rotations, what its ``--model-path`` names, whether it absorbs ``R_V`` by default,
whether it serves hybrid models, which architectures it serves, and its builder. Nothing outside
:mod:`rotationzoo.engines` branches on an engine's name: callers read these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

from ..errors import ServingError
from ..int2kv import Int2KVConfig
from ..vocab import ENGINES, FILE_KINDS, Engine
from . import legacy, llamacpp, sglang, vllm
from .common import Launch, LaunchInput, one_token_page, sglang_page_size

#: Launch knobs a target may take: ``tp_size``, ``ep_size`` (expert parallelism), ``absorb_v_rotation``,
#: ``disable_radix_cache``, ``calibrate`` (start-up calibration), ``block_size`` (the engine's KV block),
#: ``k_clip_per_layer`` / ``k_clip_per_head`` (K clip tables).
OPTIONS: tuple[str, ...] = ("tp_size", "ep_size", "absorb_v_rotation", "disable_radix_cache", "calibrate", "block_size",
                            "k_clip_per_layer", "k_clip_per_head")
_ALIASES = {"llamacpp": "llamacpp", "llama": "llamacpp", "sglang": "sglang", "vllm": "vllm",
            "sglanglegacy": "sglang-legacy", "vllmprototype": "vllm-prototype"}


@dataclass(frozen=True)
class EngineTarget:
    """One engine target (see the module docstring).

    Attributes:
        name, title: the ``--engine`` name and what it is.
        reads: the file kinds it reads.
        options: the launch knobs of :data:`OPTIONS` it takes.
        build: makes the environment, command line, notes, checks and preparation steps.
        page_size: tokens per KV page for a window dtype (the memory planner rounds to it).
        plan_notes: caveats of the memory plan for this engine, given the settings and the page size.
        rotations_as: ``"pt"`` (K and V ``.pt`` paths) or ``"gguf"`` (the rotations appended to the model GGUF).
        model_file: what ``--model-path`` names: a ``"checkpoint"`` (id or folder) or a ``"gguf"`` file.
        absorbs: ``"always"`` (absorption on unless asked off) or ``"rule"`` (the entry's setting, off
            where the files forbid it).
        hybrid_models: whether it serves models mixing attention with linear-attention layers.
        architectures: the models it serves, by llama.cpp architecture name (:func:`~.common.llama_architecture`)
            and what each is; ``None``: any model.
        ep_every_rank: its expert parallelism spans every TP rank (vLLM's ``--enable-expert-parallel``), where
            SGLang's ``--ep-size`` takes groups of them.
    """

    name: Engine
    title: str
    reads: frozenset[str]
    options: frozenset[str]
    build: Callable[[LaunchInput], Launch]
    page_size: Callable[[str], int]
    plan_notes: Callable[[Int2KVConfig, int], list[str]]
    rotations_as: Literal["pt", "gguf"] = "pt"
    model_file: Literal["checkpoint", "gguf"] = "checkpoint"
    absorbs: Literal["always", "rule"] = "rule"
    hybrid_models: bool = True
    architectures: Mapping[str, str] | None = None
    ep_every_rank: bool = False

    @property
    def expert_parallel(self) -> str:
        """How it splits experts (:data:`rotationzoo.sharding.EXPERT_PARALLEL`): ``"groups"`` of TP ranks,
        ``"every_rank"``, or ``"none"``."""
        if "ep_size" not in self.options:
            return "none"
        return "every_rank" if self.ep_every_rank else "groups"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "reads": [k for k in FILE_KINDS if k in self.reads],
                "options": [o for o in OPTIONS if o in self.options], "rotations_as": self.rotations_as,
                "model_file": self.model_file, "hybrid_models": self.hybrid_models,
                "architectures": None if self.architectures is None else list(self.architectures)}


_V1_ONLY = frozenset({"v1", "v3"})
TARGETS: dict[str, EngineTarget] = {t.name: t for t in (
    EngineTarget("sglang", "the authors' current SGLang tree, upstream SGLang main plus OSCAR",
                 frozenset(FILE_KINDS) - {"v_mean"}, frozenset(OPTIONS) - {"block_size"}, sglang.build,
                 sglang_page_size, sglang.sglang_plan_notes),
    EngineTarget("sglang-legacy", "the authors' May 2026 SGLang fork, sglang-research/",
                 _V1_ONLY | {"lloyd_max"}, frozenset({"tp_size", "absorb_v_rotation", "disable_radix_cache"}),
                 legacy.build, sglang_page_size, sglang.sglang_plan_notes, absorbs="always"),
    EngineTarget("vllm", "the vLLM port of pull request 46774, --kv-cache-dtype oscar_int2",
                 _V1_ONLY | {"mla"}, frozenset({"tp_size", "ep_size", "block_size"}), vllm.build_vllm, vllm.vllm_page_size,
                 vllm.vllm_plan_notes, hybrid_models=False, ep_every_rank=True),
    EngineTarget("vllm-prototype", "a vLLM OSCAR prototype tree with VLLM_OSCAR_PREFIX_TOKENS windows",
                 _V1_ONLY, frozenset({"tp_size", "absorb_v_rotation", "block_size"}), vllm.build_prototype,
                 vllm.vllm_page_size, vllm.vllm_plan_notes),
    EngineTarget("llamacpp", "the authors' llama.cpp branch, one rotation per layer in the model GGUF",
                 _V1_ONLY | {"ragged"}, frozenset(), llamacpp.build_llamacpp, one_token_page,
                 llamacpp.llamacpp_plan_notes, rotations_as="gguf", model_file="gguf",
                 architectures=llamacpp.ROTATING_ARCHITECTURES),
)}
assert tuple(TARGETS) == ENGINES


def check_engine(engine: str) -> str:
    """The canonical engine name (``llama.cpp``, ``llama-cpp`` → ``llamacpp``; ``sglang_legacy`` → ``sglang-legacy``).

    Raises:
        ServingError: an unknown engine.
    """
    e = str(engine).strip().lower().replace(".", "").replace("-", "").replace("_", "")
    e = _ALIASES.get(e, e)
    if e not in TARGETS:
        raise ServingError(f"unknown engine {str(engine)[:40]!r}; expected one of {', '.join(ENGINES)}")
    return e


def target(engine: str) -> EngineTarget:
    """The :class:`EngineTarget` of ``engine`` (any spelling :func:`check_engine` accepts)."""
    return TARGETS[check_engine(engine)]
