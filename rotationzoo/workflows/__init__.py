"""Workflows: what a command does, callable from Python with the command's defaults.

The floor between what users run (:mod:`rotationzoo.evaluate`, :mod:`rotationzoo.fit`,
:mod:`rotationzoo.integrations`) and the command line (:mod:`rotationzoo.cli`): policy that a command needs
and no lower layer owns lives here (which settings an evaluation uses, how methods and formats are named),
so that the CLI only turns flags into a request and prints.

Modules: :mod:`~.fitting` (``rotationzoo fit`` and ``rotationzoo calibrate``: :func:`fit_dump`, :func:`calibrate`,
each running a :class:`~rotationzoo.recipe.FitRecipe`); :mod:`~.evaluation` (``rotationzoo eval``:
:class:`EvalRequest`, :func:`run_evaluation`); :mod:`~.keep` (the keep rule of ``fit --refine`` and
``calibrate --refine``: :func:`load_judge`, :func:`apply_keep_rule`).
"""

from __future__ import annotations

from .evaluation import (
    SERVED,
    EvalPlan,
    EvalRequest,
    base_config,
    method_specs,
    model_path,
    parse_formats,
    parse_methods,
    plan_evaluation,
    run_evaluation,
)
from .fitting import calibrate, fit_dump
from .keep import apply_keep_rule, check_keep_options, keep_ids, keep_plan, load_judge

__all__ = ["SERVED", "EvalPlan", "EvalRequest", "apply_keep_rule", "base_config", "calibrate", "check_keep_options",
           "fit_dump", "keep_ids",
           "keep_plan", "load_judge", "method_specs", "model_path", "parse_formats", "parse_methods", "plan_evaluation",
           "run_evaluation"]
