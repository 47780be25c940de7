"""The vocabularies of rotationzoo's knobs: every accepted name, in one torch-free module.

Library modules take their ``Literal`` types and tuples from here and the CLI offers exactly
these choices, so a name means the same thing in Python, on the command line, in JSON and in the
docs. Importing this module is cheap (no torch, no hub clients).
"""

from __future__ import annotations

from typing import Literal, get_args

Side = Literal["k", "v"]
SIDES: tuple[str, str] = ("k", "v")

#: Where a registry file can come from (``registry.json`` source ``type``).
SourceType = Literal["huggingface", "modelscope", "url", "bundled"]
SOURCE_TYPES: tuple[str, ...] = get_args(SourceType)
#: What ``fetch(source=...)`` accepts: ``auto`` (the entry's order, with failover) or one type.
SourceChoice = Literal["auto", "huggingface", "modelscope", "url", "bundled"]
SOURCE_CHOICES: tuple[str, ...] = get_args(SourceChoice)

#: Hubs ``publish`` writes to, in the order they are written.
Hub = Literal["huggingface", "modelscope"]
HUBS: tuple[str, ...] = get_args(Hub)

#: Engine targets ``serve-args`` prepares a launch for: the authors' current SGLang tree (the
#: default), their May 2026 SGLang fork, the vLLM port of pull request 46774, a vLLM OSCAR prototype
#: tree with other window variable names, and the authors' llama.cpp branch.
Engine = Literal["sglang", "sglang-legacy", "vllm", "vllm-prototype", "llamacpp"]
ENGINES: tuple[str, ...] = get_args(Engine)
#: What an engine target may be asked to read (``rotationzoo.engines`` says which target reads which):
#: one rotation per layer (V1), one per KV head (V2), a ``format_version`` 3 file (read as its
#: rotations), key centering, the non-orthogonal companions ``q_rotation`` / ``o_rotation``,
#: value centering, layers of different shapes, the Lloyd-Max INT2 levels (a serving setting), and an
#: MLA latent rotation set (a folder of ``layer_<id>.pt`` files of the shared latent).
FileKind = Literal["v1", "v2", "v3", "k_mean", "companions", "v_mean", "ragged", "lloyd_max", "mla"]
FILE_KINDS: tuple[str, ...] = get_args(FileKind)
#: Attention backends of the SGLang targets (the OSCAR INT2 decode kernels are triton kernels).
AttentionBackend = Literal["triton", "fa3"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)
#: SGLang's Mamba radix-cache strategy for hybrid (linear-attention) models (``--mamba-radix-cache-strategy``,
#: formerly ``--mamba-scheduler-strategy``): ``extra_buffer`` keeps the prefix cache on with the INT2
#: cache's 8-token pages.
MambaSchedulerStrategy = Literal["extra_buffer"]
MAMBA_SCHEDULER_STRATEGIES: tuple[str, ...] = get_args(MambaSchedulerStrategy)
#: Renderings of a launch.
LaunchFormat = Literal["shell", "env", "json"]
LAUNCH_FORMATS: tuple[str, ...] = get_args(LaunchFormat)

#: File layouts ``export`` writes.
ExportFormat = Literal["safetensors", "gguf"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
#: Layouts of one side's rotation file.
FileFormat = Literal["pt", "safetensors"]
FILE_FORMATS: tuple[str, ...] = get_args(FileFormat)

#: dtypes of stored values, by name.
DtypeName = Literal["bfloat16", "float16", "float32"]
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)
#: dtypes of model weights (registry ``architecture.weight_dtype``): the KV/window dtypes plus
#: ``float8`` (one byte per parameter, any FP8 variant such as e4m3 block-scaled checkpoints).
WeightDtypeName = Literal["bfloat16", "float16", "float32", "float8"]
WEIGHT_DTYPE_NAMES: tuple[str, ...] = get_args(WeightDtypeName)
#: How a clip threshold is found (exact sort, or the decode flush's bisection).
ClipSearch = Literal["exact", "bisect"]
CLIP_SEARCHES: tuple[str, ...] = get_args(ClipSearch)

#: Fitter objectives: covariance targets for K and V (``hadamard`` is data-free), and the authors'
#: later recipes: ``cov_eig_hadamard_perhead`` (their V2 per-head fitter), ``oscar2_perhead`` and
#: ``oscar2_center`` (their OSCAR-2 fitter, per KV head; ``grouping="layer"`` is their ``--shared``).
Objective = Literal["qqt_sst", "ktk_vtv", "qqt", "sst", "ktk", "vtv", "hadamard", "cov_eig_hadamard_perhead",
                    "oscar2_perhead", "oscar2_center"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)
#: What is centered before rotation: nothing, the keys (``k_mean``), or keys and values (``v_mean`` too).
Center = Literal["none", "k", "kv"]
CENTERS: tuple[str, ...] = get_args(Center)
#: Compositions implemented exactly as in the authors' fitter.
AuthorComposition = Literal["plain", "pbr", "br", "br_h128", "r_h", "h_pbr", "h_r_pbr", "h_pbr_r", "r_h_pbr"]
AUTHOR_COMPOSITIONS: tuple[str, ...] = get_args(AuthorComposition)
#: Every accepted composition (``r_pbr_hg`` needs a group size).
Composition = Literal["plain", "pbr", "br", "br_h128", "r_h", "h_pbr", "h_r_pbr", "h_pbr_r", "r_h_pbr", "r_pbr_hg"]
COMPOSITIONS: tuple[str, ...] = get_args(Composition)
#: Eigenvector sign conventions.
SignConvention = Literal["canonical", "lapack"]
SIGN_CONVENTIONS: tuple[str, ...] = get_args(SignConvention)
#: How many rotations a layer has: one shared by all KV heads, or one per KV head.
Grouping = Literal["layer", "kv_head"]
GROUPINGS: tuple[str, ...] = get_args(Grouping)
#: Starting points of learned refinement.
RefineInit = Literal["hadamard", "oscar", "r_pbr_hg"]
REFINE_INITS: tuple[str, ...] = get_args(RefineInit)
#: Losses of learned refinement: the pairs INT2 when served (attention-weighted), or every pair of a block.
RefineLoss = Literal["served", "fisher", "block"]
REFINE_LOSSES: tuple[str, ...] = get_args(RefineLoss)
#: What learned refinement learns: the rotation (``expm``, ``cayley`` parametrisations) or only the init's column signs.
RefineParam = Literal["expm", "cayley", "signs"]
REFINE_PARAMS: tuple[str, ...] = get_args(RefineParam)

#: Kernel backends.
Backend = Literal["auto", "torch", "cpu", "triton"]
BACKENDS: tuple[str, ...] = get_args(Backend)
