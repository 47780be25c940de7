"""Real-model evaluation of OSCAR INT2 KV caches you can trust.

For each method (the unquantized model, INT2 without rotation, Hadamard, any rotation pair) over
long scoring windows (default: the model's context length): perplexity, mean per-token
``KL(p_fp ‖ p_method)``, top-1 agreement with the unquantized model, INT2 exposure, a copy probe
that reads a passage back from the INT2 history, and paired differences to a baseline with block
bootstrap confidence intervals over token blocks of each method's as-served rotation. Sign draws
(``EvalProtocol(draws=N)``: equally valid variants of a rotation), when requested, are reported as a
spread beside the as-served result (``kl_spread``, ``draw_kl``); they are not in the intervals.

Quick use::

    from rotationzoo.evaluate import EvalProtocol, MethodSpec, evaluate, find_smollm2_gguf, tokenize_texts
    from rotationzoo.integrations.transformers import load_model

    model, tok = load_model(find_smollm2_gguf())
    ids = tokenize_texts(tok, ["persuasion.txt"], tokens=8192)
    pair = rotationzoo.load("SmolLM2-135M-Instruct")
    methods = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard(), MethodSpec.from_source("oscar", pair)]
    report = evaluate(model, ids, methods, pair.config(), EvalProtocol(draws=4))

Every INT2 method runs the model inside :func:`rotationzoo.integrations.transformers.oscar_kv`:
one forward per window in which each position reads its own sink and recent window exactly
(rounded to ``hp_dtype``) and every older key/value as clipped, INT2-quantized rows (the
project's kernels): what a decode step at that position reads from the OSCAR cache.

Modules: :mod:`~.protocol` (windows, exposure, copy probe), :mod:`~.methods` (what is evaluated,
sign draws), :mod:`~.metrics` (chunked per-token metrics), :mod:`~.stats` (block bootstrap),
:mod:`~.run` (:func:`evaluate`), :mod:`~.report`, :mod:`~.plot`, :mod:`~.inputs`.
"""

from __future__ import annotations

from .inputs import (
    SMOLLM2_ENTRY,
    SMOLLM2_GGUF,
    check_texts,
    find_smollm2_gguf,
    tokenize_texts,
)
from .methods import BUILTIN_METHODS, MethodSpec, formats_grid, sign_flip
from .plot import plot_frontier, plot_report
from .protocol import (
    CopyProbe,
    EvalProtocol,
    check_int2_window,
    min_int2_window,
    probe_sequences,
    windows,
)
from .report import EvalReport, MethodResult, environment, results_table, summary_line
from .run import Progress, check_evaluation, evaluate
from .stats import PairedDifference, paired_difference

__all__ = [
    "BUILTIN_METHODS",
    "SMOLLM2_ENTRY",
    "SMOLLM2_GGUF",
    "CopyProbe",
    "EvalProtocol",
    "EvalReport",
    "MethodResult",
    "MethodSpec",
    "PairedDifference",
    "Progress",
    "check_evaluation",
    "check_int2_window",
    "check_texts",
    "environment",
    "evaluate",
    "find_smollm2_gguf",
    "formats_grid",
    "min_int2_window",
    "paired_difference",
    "plot_frontier",
    "plot_report",
    "probe_sequences",
    "results_table",
    "sign_flip",
    "summary_line",
    "tokenize_texts",
    "windows",
]
