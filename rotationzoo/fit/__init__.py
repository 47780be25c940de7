"""Reference fitter: OSCAR rotations from post-RoPE Q/K/V, streamed in fp64.

Quick use::

    from rotationzoo.fit import fit_rotations, write_fitted

    result = fit_rotations("qkv_dumps/gpqa")                 # qqt_sst, r_h_pbr, chunk 0 skipped
    write_fitted(result, "rotations/", model="Qwen/Qwen3-8B", tag="gpqa-seq20000")
    # -> rotations/k_rotation_qqt_r_h_pbr.pt, rotations/v_rotation_sst_r_h_pbr.pt, rotations/rotationzoo.json
    per_head = fit_rotations("qkv_dumps/gpqa", grouping="kv_head")   # [L, H_kv, d, d]: one per KV head

Modules: :mod:`~.accumulate` (streaming fp64 covariances), :mod:`~.compose` (eigendecomposition and
the authors' compositions), :mod:`~.dump` (the SGLang Q/K/V dump layout; :mod:`~.dump_schema`, what a
dump may hold, checked before it is read; :mod:`~.dump_writer`), :mod:`~.stream` (a dump through the
accumulators), :mod:`~.dump_ranks` (per-TP-rank dumps), :mod:`~.fitter` (:func:`fit_rotations`),
:mod:`~.recipes` (the authors' V2 and OSCAR-2 recipes, centering), :mod:`~.sets` (statistics to rotation
sets), :mod:`~.result` (:class:`FitResult`), :mod:`~.output` (files and manifest);
learned rotations: :mod:`~.samples` (calibration blocks), :mod:`~.refine` (the optimizer),
:mod:`~.refine_loss`, :mod:`~.ste` (the INT2 loss) and :mod:`~.refine_fit` (:func:`refine_fit`).
The math, normalisations and compositions are those of the authors' fitter
(``rotation/compute_kv_rotation.py``); see ``docs/fitting.md``.
"""

from __future__ import annotations

from ..vocab import AUTHOR_COMPOSITIONS, COMPOSITIONS, OBJECTIVES
from .accumulate import TARGETS, LayerAccumulator
from .compose import hadamard_rotations
from .dump import Dump, DumpWriter, open_dump, write_dump
from .dump_plan import DumpPlan, DumpShape
from .dump_schema import DumpLimits
from ..recipe import DEFAULT_MIN_TOKENS, OBJECTIVE_TARGETS, RECIPES, FitRecipe, KeepRule, Refinement
from .fitter import fit_rotations
from .output import MANIFEST_NAME, FitOutput, build_manifest, output_file_names, write_fitted
from .recipes import V2_MAX_CHUNKS
from .refine_fit import refine_config, refine_dump, refine_fit, samples_from_dump
from .result import FitResult, FitStats

__all__ = [
    "AUTHOR_COMPOSITIONS",
    "COMPOSITIONS",
    "DEFAULT_MIN_TOKENS",
    "MANIFEST_NAME",
    "OBJECTIVES",
    "OBJECTIVE_TARGETS",
    "RECIPES",
    "V2_MAX_CHUNKS",
    "FitRecipe",
    "KeepRule",
    "Refinement",
    "TARGETS",
    "Dump",
    "DumpLimits",
    "DumpPlan",
    "DumpShape",
    "DumpWriter",
    "FitOutput",
    "FitResult",
    "FitStats",
    "LayerAccumulator",
    "build_manifest",
    "fit_rotations",
    "hadamard_rotations",
    "open_dump",
    "output_file_names",
    "refine_config",
    "refine_dump",
    "refine_fit",
    "samples_from_dump",
    "write_dump",
    "write_fitted",
]
