"""Engine targets as data: what each OSCAR-enabled engine reads, and the builder of its launch.

One :class:`EngineTarget` per engine in :data:`TARGETS` (:mod:`.table`); nothing else in the package
branches on an engine's name. A target says which file kinds it reads
(:data:`rotationzoo.vocab.FILE_KINDS`: one rotation per layer ``v1``, per KV head ``v2``,
``format_version`` 3 files ``v3``, key centering ``k_mean``, the non-orthogonal ``companions``
``q_rotation`` / ``o_rotation``, value centering ``v_mean``, ``ragged`` layers, the ``lloyd_max``
levels, and ``mla`` latent sets), which launch knobs it takes, which models it serves (hybrid ones;
for llama.cpp the architectures whose graphs apply the rotations), its KV page size and planner notes,
how it is given the rotations (K/V ``.pt`` paths or a model GGUF), what ``--model-path`` names, and
how its environment and command line are built. Rotations it cannot read are refused with one line
naming what the files hold (:func:`refuse`); Lloyd-Max levels, a setting rather than file content,
only get a note where a target has no switch for them.

============== ==== ==== ==== ====== ========== ====== ====== ========= ===
target          v1   v2   v3  k_mean companions v_mean ragged lloyd_max mla
============== ==== ==== ==== ====== ========== ====== ====== ========= ===
sglang          yes  yes  yes  yes    yes        no     yes    yes       yes
sglang-legacy   yes  no   yes  no     no         no     no     yes       no
vllm            yes  no   yes  no     no         no     no     no        yes
vllm-prototype  yes  no   yes  no     no         no     no     no        no
llamacpp        yes  no   yes  no     no         no     yes    no        no
============== ==== ==== ==== ====== ========== ====== ====== ========= ===

(``v3`` is a file read as its rotations: a ``format_version`` 3 file without companions is, to the
loaders, the same as V1 or V2.) Pure functions of settings and local paths: no fetching, no torch;
:mod:`rotationzoo.serving` resolves rotations and assembles a :class:`~rotationzoo.serving.LaunchSpec`.
"""

from __future__ import annotations

from ..vocab import ENGINES, Engine
from .common import (
    SGLANG_HP_MAX_SPLITS,
    LatentLaunch,
    Launch,
    LaunchInput,
    RankHeads,
    arg_path,
    llama_architecture,
    sglang_page_size,
)
from .legacy import sglang_legacy_args, sglang_legacy_env
from .llamacpp import llamacpp_args, llamacpp_env
from .rules import (
    NO_ABSORPTION,
    absorption,
    check_architecture,
    check_expert_parallel,
    check_options,
    known_model,
    kv_head_counts,
    pair_files,
    pair_input,
    pair_kinds,
    prepare,
    rank_heads,
    refuse,
    serve_env,
)
from .sglang import CALIBRATION_ENV, MAMBA_FLAG, sglang_env
from .table import OPTIONS, TARGETS, EngineTarget, check_engine, target
from .vllm import VLLM_DEFAULT_BLOCK, VLLM_STAGING_TOKENS, vllm_args, vllm_env

__all__ = [
    "CALIBRATION_ENV",
    "ENGINES",
    "MAMBA_FLAG",
    "NO_ABSORPTION",
    "OPTIONS",
    "SGLANG_HP_MAX_SPLITS",
    "TARGETS",
    "VLLM_DEFAULT_BLOCK",
    "VLLM_STAGING_TOKENS",
    "Engine",
    "EngineTarget",
    "LatentLaunch",
    "Launch",
    "LaunchInput",
    "RankHeads",
    "absorption",
    "arg_path",
    "check_architecture",
    "check_engine",
    "check_expert_parallel",
    "check_options",
    "known_model",
    "kv_head_counts",
    "llama_architecture",
    "llamacpp_args",
    "llamacpp_env",
    "pair_files",
    "pair_input",
    "pair_kinds",
    "prepare",
    "rank_heads",
    "refuse",
    "serve_env",
    "sglang_env",
    "sglang_legacy_args",
    "sglang_legacy_env",
    "sglang_page_size",
    "target",
    "vllm_args",
    "vllm_env",
]
