"""``transformers`` integration: post-RoPE Q/K/V capture and calibration, and an OSCAR INT2 KV path.

Capture works through ``transformers.AttentionInterface``: a registered attention function records
``query [B, H_q, S, d]``, ``key``/``value [B, H_kv, S, d]`` exactly as the model hands them to its
attention kernel (after q_norm/k_norm and RoPE, the same point where the OSCAR SGLang dump hook
reads them) and then calls the model's original implementation (``sdpa`` or ``eager``), so the
forward pass is unchanged. The matching mask function is registered too, so causal masking is
the original one.

Example::

    from rotationzoo.integrations.transformers import calibrate, load_model

    model, tokenizer = load_model("models/Qwen3-8B")          # local folder or a .gguf file
    result = calibrate(model, tokenizer, ["calib.txt"], tokens=20000, dump_out="qkv_dump")

``transformers`` is an optional dependency (``pip install rotationzoo[transformers]``) and is
imported only when these functions run. Nothing is downloaded: loading uses
``local_files_only=True``.

The capture part is self-contained (``QKVCapture``, ``capture_attention_name``).

The OSCAR INT2 KV path (``OscarKV``, ``oscar_kv``, ``OscarInt2Cache``) runs a model with keys and
values stored rotated, clipped and INT2-quantized by :mod:`rotationzoo.kernels` outside a BF16
sink/recent window; queries are rotated with ``R_K`` and attention outputs un-rotated with
``R_Vᵀ``::

    from rotationzoo.integrations.transformers import OscarKV, oscar_kv

    oscar = OscarKV.from_rotations(rotationzoo.load("SmolLM2-135M-Instruct"), group_size=64,
                                   clip_k=0.96, clip_v=0.92, prefix=64, recent=256)
    with oscar_kv(model, oscar) as kv:
        out = model.generate(**inputs, cache=kv.new_cache(), max_new_tokens=64)   # real INT2 cache
        logits = model(input_ids, use_cache=False).logits                          # decode-time simulation

It needs the layered cache API (``transformers.cache_utils.CacheLayerMixin``, transformers ≥ 4.56;
tested with 5.24) and wraps the ``sdpa`` or ``eager`` attention implementation.
"""

from __future__ import annotations

import contextvars
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ..errors import FitError

#: Prefix of the attention implementations registered for capture (one per base implementation).
CAPTURE_IMPL_PREFIX = "rotationzoo_qkv_capture"
#: Tokens of the warm-up forward written as chunk 0 of a dump (mirrors SGLang's warm-up batch).
WARMUP_TOKENS = 6

#: ``on_qkv(layer_id, q [n, H_q, d], k [n, H_kv, d], v [n, H_kv, d])``, called once per layer per forward.
QKVCallback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]
#: ``progress(stage, done, total)``; stage is ``"tokens"`` during capture, ``"layer <L>"`` in pass 2.
CalibrationProgress = Callable[[str, int, int], None]

_ACTIVE_CAPTURE: contextvars.ContextVar["QKVCapture | None"] = contextvars.ContextVar(
    "rotationzoo_active_capture", default=None
)


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:  # pragma: no cover - depends on the environment
        raise FitError(
            "this needs the optional 'transformers' dependency: pip install 'rotationzoo[transformers]'"
        ) from None
    return transformers


# -- loading ---------------------------------------------------------------------------------------


def load_model(
    model: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer from a local folder or a local ``.gguf`` file, offline.

    Args:
        model: a folder with ``config.json`` (``save_pretrained`` layout) or a ``.gguf`` file
            (dequantised by transformers; needs the ``gguf`` package).
        dtype: ``"auto"`` (the checkpoint's dtype), a dtype name (``"bfloat16"``, ...) or a
            ``torch.dtype``.
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        FitError: the path does not exist, is neither a folder nor a ``.gguf`` file, or loading fails.
    """
    transformers = _require_transformers()
    path = Path(model).expanduser()
    if not path.exists():
        raise FitError(f"model {path} not found; give a local model folder or a .gguf file (nothing is downloaded)")
    kwargs: dict[str, Any] = {"local_files_only": True}
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise FitError(f"{path}: not a .gguf file; give a model folder (config.json) or a .gguf file")
        folder, kwargs["gguf_file"] = path.parent, path.name
    else:
        folder = path
        if not (folder / "config.json").is_file():
            raise FitError(f"{folder}: no config.json; not a transformers model folder")
    torch_dtype: Any = dtype
    if isinstance(dtype, str) and dtype != "auto":
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise FitError(f"unknown dtype {dtype!r}; use auto, bfloat16, float16 or float32")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder), **kwargs)
        lm = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype, **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FitError(f"cannot load {path} with transformers: {msg}") from None
    lm.to(device)
    lm.eval()
    return lm, tok


# -- capture ---------------------------------------------------------------------------------------


def capture_attention_name(base: str) -> str:
    """Register (once) and return the capture implementation wrapping ``base`` (``"sdpa"``/``"eager"``)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:  # newer versions pick the mask builder by implementation name
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - older transformers build masks independently of the name
        ALL_MASK_ATTENTION_FUNCTIONS = AttentionMaskInterface = None  # type: ignore[assignment,misc]

    name = f"{CAPTURE_IMPL_PREFIX}_{base}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name
    if base != "eager" and base not in ALL_ATTENTION_FUNCTIONS:
        raise FitError(f"cannot capture attention implementation {base!r}; use 'sdpa' or 'eager'")

    def capture_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                  value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        capture = _ACTIVE_CAPTURE.get()
        if capture is not None:
            capture._record(module, query, key, value)
        return _base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, capture_attention_forward)
    if AttentionMaskInterface is not None:
        mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_base])
    return name


def _base_attention(module: torch.nn.Module, base: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise FitError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


class QKVCapture:
    """Context manager: while active, every attention call of ``model`` reports its Q/K/V.

    The callback receives per layer ``q [n, H_q, d]``, ``k [n, H_kv, d]``, ``v [n, H_kv, d]``
    (the model's dtype and device; views, copy them to keep them), ``n = B·S`` new tokens in batch
    order. Only the new tokens of a forward are reported (cached ones are not).

    Args:
        model: a ``transformers`` model whose attention goes through ``AttentionInterface``.
        on_qkv: the callback.

    Example::

        with QKVCapture(model, lambda layer, q, k, v: print(layer, q.shape)):
            model(input_ids, use_cache=False)
    """

    def __init__(self, model: Any, on_qkv: QKVCallback) -> None:
        _require_transformers()
        self.model = model
        self.on_qkv = on_qkv
        self._prev_impl: str | None = None
        self._token: contextvars.Token | None = None
        self._fallback_ids: dict[int, int] = {}

    def __enter__(self) -> "QKVCapture":
        if _ACTIVE_CAPTURE.get() is not None:
            raise FitError("a Q/K/V capture is already active in this context")
        prev = getattr(self.model.config, "_attn_implementation", None) or "sdpa"
        base = prev[len(CAPTURE_IMPL_PREFIX) + 1:] if prev.startswith(CAPTURE_IMPL_PREFIX) else prev
        if base not in ("sdpa", "eager"):
            base = "sdpa"
        name = capture_attention_name(base)
        self._prev_impl = prev
        self._set_impl(name)
        self._token = _ACTIVE_CAPTURE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE_CAPTURE.reset(self._token)
            self._token = None
        if self._prev_impl is not None:
            self._set_impl(self._prev_impl)

    def _set_impl(self, name: str) -> None:
        setter = getattr(self.model, "set_attn_implementation", None)
        if setter is not None:
            try:
                setter(name)
                if getattr(self.model.config, "_attn_implementation", None) == name:
                    return
            except (ValueError, KeyError, ImportError):
                pass
        for module in self.model.modules():  # older versions / models without the setter
            cfg = getattr(module, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = name

    def _layer_id(self, module: torch.nn.Module) -> int:
        lid = getattr(module, "layer_idx", None)
        if lid is None:
            lid = self._fallback_ids.setdefault(id(module), len(self._fallback_ids))
        return int(lid)

    def _record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        b, hq, s, d = query.shape
        hkv = key.shape[1]
        k = key[:, :, -s:, :]
        v = value[:, :, -s:, :]
        q_flat = query.transpose(1, 2).reshape(b * s, hq, d)
        k_flat = k.transpose(1, 2).reshape(b * s, hkv, d)
        v_flat = v.transpose(1, 2).reshape(b * s, hkv, v.shape[-1])
        self.on_qkv(self._layer_id(module), q_flat, k_flat, v_flat)


# -- calibration -----------------------------------------------------------------------------------


def read_texts(paths: Sequence[str | os.PathLike[str]]) -> list[str]:
    """Read UTF-8 text files (errors name the file)."""
    texts = []
    for p in paths:
        path = Path(p)
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise FitError(f"{path}: cannot read calibration text ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise FitError(f"{path}: not UTF-8 text") from None
    if not any(t.strip() for t in texts):
        raise FitError("the calibration texts are empty")
    return texts


def token_windows(tokenizer: Any, texts: Iterable[str], *, tokens: int, seq_len: int) -> Iterator[list[int]]:
    """Token id windows for calibration.

    Each text is tokenized once (with the tokenizer's special tokens, e.g. a leading BOS) and cut
    into consecutive windows of ``seq_len`` tokens; each window is one independent sequence. The
    last window is truncated so that exactly ``tokens`` tokens are produced in total (fewer if
    the texts run out).
    """
    if tokens < 1:
        raise FitError(f"tokens must be ≥ 1, got {tokens}")
    if seq_len < 1:
        raise FitError(f"seq_len must be ≥ 1, got {seq_len}")
    left = int(tokens)
    for text in texts:
        if not text.strip():
            continue
        ids = tokenizer(text)["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        for start in range(0, len(ids), seq_len):
            window = list(ids[start:start + seq_len])[:left]
            if not window:
                break
            yield window
            left -= len(window)
            if left <= 0:
                return


def calibrate(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str | os.PathLike[str]] | Sequence[str],
    *,
    tokens: int,
    seq_len: int = 2048,
    objective: str = "qqt_sst",
    composition: str = "r_h_pbr",
    group_size: int | None = None,
    dump_out: str | os.PathLike[str] | None = None,
    overwrite_dump: bool = False,
    signs: str = "canonical",
    model_id: str | None = None,
    texts_are_paths: bool = True,
    progress: CalibrationProgress | None = None,
) -> Any:
    """Fit rotations from a live ``transformers`` model: :func:`collect_statistics`, then one fit.

    The model runs once (see :func:`collect_statistics` for the passes, the K/V spill and the
    ``dump_out`` layout); the finished statistics are fitted with
    :func:`rotationzoo.fit.fit_rotations` for one ``composition``.

    Args:
        model: a causal LM (e.g. from :func:`load_model`).
        tokenizer: its tokenizer.
        texts: calibration text files (or strings with ``texts_are_paths=False``).
        tokens: per-layer token budget ``T``.
        seq_len: tokens per sequence (window).
        objective: see :func:`rotationzoo.fit.fit_rotations` (not ``"hadamard"``).
        composition: see :func:`rotationzoo.fit.fit_rotations`.
        group_size: ``G`` for ``r_pbr_hg``.
        dump_out: also write an SGLang-layout dump here.
        overwrite_dump: replace an existing dump in ``dump_out``.
        signs: eigenvector sign convention.
        model_id: model name recorded in the result/manifest.
        texts_are_paths: whether ``texts`` are file paths.
        progress: ``progress(stage, done, total)``.

    Returns:
        A :class:`rotationzoo.fit.FitResult` (``prompts`` = number of sequences run).
    """
    from ..fit import fit_rotations
    from ..fit.compose import check_composition

    check_composition(composition, group_size)  # before the model runs
    stats = collect_statistics(
        model, tokenizer, texts, tokens=tokens, seq_len=seq_len, objective=objective, model_id=model_id,
        texts_are_paths=texts_are_paths, progress=progress, dump_out=dump_out, overwrite_dump=overwrite_dump,
    )
    return fit_rotations(
        stats.accumulators, objective, composition, group_size=group_size, signs=signs,  # type: ignore[arg-type]
        source_info=stats.info,
    )


def capture_to_dump(
    model: Any,
    input_ids: Iterable[Sequence[int] | torch.Tensor],
    dump_out: str | os.PathLike[str],
    *,
    token_budget: int | None = None,
    overwrite: bool = False,
    info: Mapping[str, Any] | None = None,
) -> Path:
    """Run ``model`` over sequences of token ids and write an SGLang-layout Q/K/V dump.

    Chunk 0 is whatever the first sequence produces (pass a short warm-up sequence first to
    mirror SGLang, whose readers skip chunk 0).

    Args:
        model: a ``transformers`` causal LM.
        input_ids: sequences of token ids, each run as one forward (batch 1).
        dump_out: output folder.
        token_budget: per-layer token limit (the dump hook's ``DUMP_KVCACHE_TOKENS``).
        overwrite: replace an existing dump.
        info: written to ``rotationzoo_dump.json``.

    Returns:
        The dump folder.
    """
    from ..fit.dump import DumpWriter

    writer = DumpWriter(dump_out, token_budget=token_budget, overwrite=overwrite)
    device = next(model.parameters()).device

    def on_qkv(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        writer.write(layer_id, q=q.detach().cpu(), k=k.detach().cpu(), v=v.detach().cpu(), seq_lens=[q.shape[0]])

    with torch.no_grad(), QKVCapture(model, on_qkv):
        for ids in input_ids:
            t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids))
            model(input_ids=t.reshape(1, -1).to(device), use_cache=False)
    if info is not None:
        writer.write_info(info)
    return writer.root


# -- statistics for several fits -------------------------------------------------------------------


class CapturedStatistics:
    """Finished per-layer fp64 statistics from one pass over calibration text.

    Fit as many compositions as needed from them without running the model again::

        stats = collect_statistics(model, tokenizer, ["emma.txt"], tokens=20000)
        for comp, g in (("r_h_pbr", None), ("r_pbr_hg", 16)):
            result = fit_rotations(stats.accumulators, "qqt_sst", comp, group_size=g, source_info=stats.info)

    Attributes:
        accumulators: ``{layer_id: LayerAccumulator}`` with pass 1 (and pass 2 for ``sst``) done.
        info: what was run (``kind``, ``texts``, ``seq_len``, ``token_budget``, ``tokens``, ``prompts``).
        objective: the objective the statistics cover (e.g. ``"qqt_sst"``).
    """

    def __init__(self, accumulators: dict[int, Any], info: dict[str, Any], objective: str) -> None:
        self.accumulators = accumulators
        self.info = info
        self.objective = objective

    @property
    def tokens(self) -> int:
        """Tokens per layer seen in pass 1 (the smallest count over layers)."""
        return min(acc.num_tokens for acc in self.accumulators.values())


def collect_statistics(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str | os.PathLike[str]] | Sequence[str],
    *,
    tokens: int,
    seq_len: int = 2048,
    objective: str = "qqt_sst",
    model_id: str | None = None,
    texts_are_paths: bool = True,
    progress: CalibrationProgress | None = None,
    dump_out: str | os.PathLike[str] | None = None,
    overwrite_dump: bool = False,
) -> CapturedStatistics:
    """Run ``model`` once over calibration text and return the finished fp64 statistics.

    Pass 1 runs the model once over the calibration windows; each captured Q (and K/V for
    ``ktk``/``vtv``) chunk goes straight into the fp64 accumulators. ``sst`` needs a second pass
    over K and V after the query statistics are final: the captured K/V chunks are spilled to
    disk (to ``dump_out`` when given, else a temporary folder) and read back once, so the model
    runs only once and memory stays bounded. Several compositions (``r_h_pbr``, ``r_pbr_hg<G>``
    for several ``G``) can then be fitted from one capture; :func:`calibrate` fits one.

    With ``dump_out`` the full Q/K/V dump is written in the SGLang layout, preceded by a
    ``WARMUP_TOKENS``-token warm-up forward stored as chunk 0 (never accumulated), so that
    ``fit_rotations(dump_out)`` with its default chunk-0 skip gives the same rotations.

    Args:
        model: a causal LM (e.g. from :func:`load_model`).
        tokenizer: its tokenizer.
        texts: calibration text files (or strings with ``texts_are_paths=False``).
        tokens: per-layer token budget ``T``.
        seq_len: tokens per sequence (window).
        objective: see :func:`rotationzoo.fit.fit_rotations` (not ``"hadamard"``).
        model_id: model name recorded in ``info``.
        texts_are_paths: whether ``texts`` are file paths.
        progress: ``progress(stage, done, total)``.
        dump_out: also write an SGLang-layout dump here.
        overwrite_dump: replace an existing dump in ``dump_out``.

    Returns:
        :class:`CapturedStatistics`.
    """
    from ..fit import OBJECTIVES
    from ..fit.accumulate import LayerAccumulator, Workspace, second_pass_from_dump
    from ..fit.dump import Dump, DumpWriter

    if objective not in OBJECTIVES or objective == "hadamard":
        raise FitError(f"objective must be one of {', '.join(o for o in OBJECTIVES if o != 'hadamard')}")
    targets = tuple(t for t in OBJECTIVES[objective] if t is not None)
    raw_texts = read_texts(texts) if texts_are_paths else [str(t) for t in texts]
    windows = list(token_windows(tokenizer, raw_texts, tokens=tokens, seq_len=seq_len))
    if not windows:
        raise FitError("the calibration texts produced no tokens")
    total = sum(len(w) for w in windows)
    device = next(model.parameters()).device
    workspace = Workspace("cpu")
    accs: dict[int, LayerAccumulator] = {}
    spill = "sst" in targets
    tmp: tempfile.TemporaryDirectory | None = None
    writer: DumpWriter | None = None
    if dump_out is not None:
        writer = DumpWriter(dump_out, overwrite=overwrite_dump)
    elif spill:
        tmp = tempfile.TemporaryDirectory(prefix="rotationzoo-kv-")
        writer = DumpWriter(tmp.name, kinds=("k", "v"))
    state = {"warmup": False}

    def on_qkv(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        q, k, v = q.detach().to("cpu"), k.detach().to("cpu"), v.detach().to("cpu")
        if writer is not None:
            writer.write(layer_id, q=q if "q" in writer.kinds else None, k=k, v=v, seq_lens=[q.shape[0]])
        if state["warmup"]:
            return
        acc = accs.get(layer_id)
        if acc is None:
            acc = accs[layer_id] = LayerAccumulator(
                layer_id, num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                targets=targets, workspace=workspace,
            )
        for kind in acc.pass1_kinds:
            {"q": acc.add_q, "k": acc.add_k, "v": acc.add_v}[kind]({"q": q, "k": k, "v": v}[kind])

    info: dict[str, Any] = {
        "kind": "transformers",
        "model": model_id,
        "texts": [str(t) for t in texts] if texts_are_paths else len(raw_texts),
        "seq_len": seq_len,
        "token_budget": int(tokens),
        "tokens": total,
        "prompts": len(windows),
    }
    try:
        with torch.no_grad(), QKVCapture(model, on_qkv):
            if dump_out is not None:
                state["warmup"] = True
                model(input_ids=torch.tensor([windows[0][:WARMUP_TOKENS]], device=device), use_cache=False)
                state["warmup"] = False
            done = 0
            for window in windows:
                model(input_ids=torch.tensor([window], device=device), use_cache=False)
                done += len(window)
                if progress is not None:
                    progress("tokens", done, total)
        if not accs:
            raise FitError("no attention layer reported Q/K/V; the model's attention does not use AttentionInterface")
        if spill:
            assert writer is not None
            # a dump written for the user keeps its warm-up chunk 0 on disk; skip it here
            kv = Dump(writer.root, keep_first_chunk=dump_out is None)
            for lid, acc in accs.items():
                second_pass_from_dump(
                    acc, kv, lid,
                    progress=(lambda l, d, t: progress(f"layer {l}", d, t)) if progress is not None else None,
                )
        if dump_out is not None:
            assert writer is not None
            info["dump"] = str(dump_out)
            writer.write_info({
                "model": model_id,
                "prompts": len(windows),
                "tokens": total,
                "seq_len": seq_len,
                "warmup_chunk": True,
                "texts": info["texts"],
                "writer": "rotationzoo calibrate",
            })
    finally:
        if tmp is not None:
            tmp.cleanup()
    return CapturedStatistics(accs, info, objective)


# -- OSCAR INT2 KV cache ---------------------------------------------------------------------------
#
# Two ways to run a model with INT2 keys/values, both inside ``with oscar_kv(model, oscar):``
#
# * a real cache (``OscarInt2Cache``) for ``generate()``/incremental decoding: K/V are rotated,
#   the first ``prefix`` and the last ``recent`` tokens are kept in ``window_dtype`` and every
#   other token is stored only as INT2 codes + scales/zeros; attention reads the dequantized
#   codes in the rotated basis (query rotated with R_K, output un-rotated with R_Vᵀ);
# * a simulation for one-shot forwards (perplexity): each query position ``i`` sees key/value
#   ``j`` exactly as the cache would hold it while decoding token ``i`` (window tokens rounded to
#   ``window_dtype``, older ones INT2), all in one forward with masks.

#: Prefix of the attention implementations registered for the OSCAR path.
OSCAR_IMPL_PREFIX = "rotationzoo_oscar"
#: Attribute set on the key tensor an :class:`OscarInt2Cache` layer returns (its layer object).
_OSCAR_TAG = "_rotationzoo_oscar_layer"
_ACTIVE_OSCAR: contextvars.ContextVar["OscarSession | None"] = contextvars.ContextVar(
    "rotationzoo_active_oscar", default=None
)


class OscarKV:
    """Rotations and quantisation settings of the OSCAR INT2 KV path.

    Args:
        k_rotations: ``None`` (no rotation) or ``[L, d, d]`` applied as ``k @ R_K`` (queries too).
        v_rotations: ``None`` or ``[L, d, d]`` applied as ``v @ R_V``; outputs are un-rotated with
            ``R_Vᵀ``.
        layer_ids: model layer index of each matrix (default ``0 … L−1``).
        group_size: INT2 group size ``G`` (``None`` = ``head_dim``: one scale/zero pair per row).
        clip_k: per-row clip ratio for keys (``0`` disables; OSCAR uses 0.96).
        clip_v: per-row clip ratio for values (``0`` disables; OSCAR uses 0.92).
        prefix: tokens at the start kept in ``window_dtype`` (the BF16 sink; OSCAR uses 64).
        recent: most recent tokens kept in ``window_dtype`` besides the current one (OSCAR 256).
        scale_dtype: dtype of the stored scale/zero pairs (fp32, bf16 or fp16).
        window_dtype: dtype of the stored window tokens (bf16 as served; ``None`` = the model's dtype,
            i.e. windows exactly as computed).
        quantize_k: quantize keys (``False`` keeps them rotated in ``window_dtype``).
        quantize_v: quantize values.
        backend: kernel backend, ``"auto"`` (Triton for CUDA tensors, the PyTorch reference
            otherwise), ``"torch"`` or ``"triton"``.

    Rotations are applied in fp32 (``x.float() @ R``) and the rotated rows rounded to
    ``window_dtype``; INT2 tokens are quantized from those rounded rows, exactly as the SGLang fork
    demotes a BF16 window token to INT2.
    """

    def __init__(
        self,
        k_rotations: torch.Tensor | None = None,
        v_rotations: torch.Tensor | None = None,
        *,
        layer_ids: Sequence[int] | None = None,
        group_size: int | None = None,
        clip_k: float = 0.0,
        clip_v: float = 0.0,
        prefix: int = 64,
        recent: int = 256,
        scale_dtype: torch.dtype = torch.float32,
        window_dtype: torch.dtype | None = torch.bfloat16,
        quantize_k: bool = True,
        quantize_v: bool = True,
        backend: str = "auto",
    ) -> None:
        sizes = {int(r.shape[0]) for r in (k_rotations, v_rotations) if r is not None}
        for name, r in (("k_rotations", k_rotations), ("v_rotations", v_rotations)):
            if r is not None and (r.dim() != 3 or r.shape[-1] != r.shape[-2]):
                raise FitError(f"{name} must be [L, d, d], got {list(r.shape)}")
        if len(sizes) > 1:
            raise FitError(f"k_rotations and v_rotations hold different layer counts: {sorted(sizes)}")
        if layer_ids is not None:
            ids = tuple(int(i) for i in layer_ids)
            if sizes and len(ids) != next(iter(sizes)):
                raise FitError(f"{len(ids)} layer ids for {next(iter(sizes))} rotations")
        else:
            ids = tuple(range(next(iter(sizes)))) if sizes else ()
        if prefix < 0 or recent < 0:
            raise FitError(f"prefix and recent must be ≥ 0, got {prefix} and {recent}")
        self.k_rotations = k_rotations.float() if k_rotations is not None else None
        self.v_rotations = v_rotations.float() if v_rotations is not None else None
        self.layer_ids = ids
        self._index = {lid: i for i, lid in enumerate(ids)}
        self.group_size = group_size
        self.clip_k = float(clip_k)
        self.clip_v = float(clip_v)
        self.prefix = int(prefix)
        self.recent = int(recent)
        self.scale_dtype = scale_dtype
        self.window_dtype = window_dtype
        self.quantize_k = bool(quantize_k)
        self.quantize_v = bool(quantize_v)
        self.backend = backend
        self._device_cache: dict[tuple[str, int, str], torch.Tensor | None] = {}

    @classmethod
    def from_rotations(cls, rotations: Any, **settings: Any) -> "OscarKV":
        """Build from ``None``, a :class:`rotationzoo.api.RotationPair` (``.k``/``.v``), a
        :class:`rotationzoo.fit.FitResult`, or a ``(k_set, v_set)`` pair of
        :class:`rotationzoo.format.RotationSet`; ``settings`` as in the constructor."""
        if rotations is None:
            return cls(None, None, **settings)
        if isinstance(rotations, tuple) and len(rotations) == 2:
            k, v = rotations
        else:
            k, v = getattr(rotations, "k", None), getattr(rotations, "v", None)
        ids = None
        for s in (k, v):
            if s is not None:
                if ids is not None and tuple(s.layer_ids) != ids:
                    raise FitError("K and V rotation sets cover different layers")
                ids = tuple(s.layer_ids)
        return cls(
            k.rotations if k is not None else None,
            v.rotations if v is not None else None,
            layer_ids=ids,
            **settings,
        )

    def replace(self, **settings: Any) -> "OscarKV":
        """A copy with some settings changed (the rotations are shared)."""
        kw: dict[str, Any] = dict(
            layer_ids=self.layer_ids if self.layer_ids else None, group_size=self.group_size, clip_k=self.clip_k,
            clip_v=self.clip_v, prefix=self.prefix, recent=self.recent, scale_dtype=self.scale_dtype,
            window_dtype=self.window_dtype, quantize_k=self.quantize_k, quantize_v=self.quantize_v,
            backend=self.backend,
        )
        kw.update(settings)
        return OscarKV(self.k_rotations, self.v_rotations, **kw)

    def rotation(self, side: str, layer_id: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """Layer ``layer_id``'s ``[d, d]`` fp32 rotation for ``side`` (``"k"``/``"v"``) on ``device``,
        or ``None`` when this side is not rotated."""
        rots = self.k_rotations if side == "k" else self.v_rotations
        if rots is None:
            return None
        key = (side, int(layer_id), str(device))
        if key not in self._device_cache:
            if int(layer_id) not in self._index:
                raise FitError(f"no {side.upper()} rotation for layer {layer_id}; rotations cover layers {self.layer_ids}")
            self._device_cache[key] = rots[self._index[int(layer_id)]].to(device)
        return self._device_cache[key]

    def describe(self) -> dict[str, Any]:
        """JSON-friendly settings."""
        return {
            "group_size": self.group_size,
            "clip_k": self.clip_k,
            "clip_v": self.clip_v,
            "prefix": self.prefix,
            "recent": self.recent,
            "scale_dtype": str(self.scale_dtype).replace("torch.", ""),
            "window_dtype": str(self.window_dtype).replace("torch.", "") if self.window_dtype else None,
            "quantize_k": self.quantize_k,
            "quantize_v": self.quantize_v,
            "rotated": {"k": self.k_rotations is not None, "v": self.v_rotations is not None},
        }


def _rotate(x: torch.Tensor, r: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ R`` in fp32 (``x [..., d]``), cast to ``out_dtype``; ``R = None`` only casts."""
    if r is None:
        return x.to(out_dtype)
    return torch.matmul(x.float(), r.float()).to(out_dtype)


def _unrotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """``x @ Rᵀ`` in fp32, back in ``x``'s dtype."""
    if r is None:
        return x
    return torch.matmul(x.float(), r.float().T).to(x.dtype)


def _quantize_rows(x: torch.Tensor, oscar: OscarKV, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels import quantize_int2

    return quantize_int2(
        x.contiguous(), clip_ratio=clip, group_size=oscar.group_size, scale_dtype=oscar.scale_dtype,
        backend=oscar.backend,  # type: ignore[arg-type]
    )


def _dequantize_rows(codes: torch.Tensor, sz: torch.Tensor, oscar: OscarKV, dtype: torch.dtype) -> torch.Tensor:
    from ..kernels import dequantize_int2

    out_dtype = dtype if dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    return dequantize_int2(codes, sz, dtype=out_dtype, backend=oscar.backend).to(dtype)  # type: ignore[arg-type]


def _fake_quantize(x: torch.Tensor, oscar: OscarKV, clip: float, dtype: torch.dtype) -> torch.Tensor:
    codes, sz = _quantize_rows(x, oscar, clip)
    return _dequantize_rows(codes, sz, oscar, dtype)


class _LayerErrors:
    """Running ``Σ‖o − o_ref‖²`` and ``Σ‖o_ref‖²`` per layer (fp64)."""

    def __init__(self) -> None:
        self.num: dict[int, float] = {}
        self.den: dict[int, float] = {}

    def add(self, layer_id: int, out: torch.Tensor, ref: torch.Tensor) -> None:
        diff = (out.double() - ref.double()).pow(2).sum().item()
        norm = ref.double().pow(2).sum().item()
        self.num[layer_id] = self.num.get(layer_id, 0.0) + diff
        self.den[layer_id] = self.den.get(layer_id, 0.0) + norm

    def relative(self) -> dict[int, float]:
        """``{layer_id: ‖o − o_ref‖_F / ‖o_ref‖_F}`` over everything added."""
        return {lid: (self.num[lid] / self.den[lid]) ** 0.5 if self.den[lid] > 0 else 0.0 for lid in sorted(self.num)}


class OscarSession:
    """What :func:`oscar_kv` yields: the settings, a cache factory and per-layer error statistics.

    Attributes:
        model: the model.
        oscar: the :class:`OscarKV` settings.
        collect_errors: whether simulated forwards also run exact attention and record
            ``‖o − o_fp‖ / ‖o_fp‖`` per layer (one more attention per layer).
        errors: the running per-layer error sums (see :meth:`layer_errors`).
    """

    def __init__(self, model: Any, oscar: OscarKV, collect_errors: bool = False) -> None:
        self.model = model
        self.oscar = oscar
        self.collect_errors = collect_errors
        self.errors = _LayerErrors()

    def new_cache(self) -> Any:
        """A fresh :class:`OscarInt2Cache` for this model (pass it as ``cache=`` /
        ``past_key_values=`` to ``model(...)`` or ``model.generate(...)``)."""
        return _cache_classes()["OscarInt2Cache"](self.oscar, config=self.model.config)

    def layer_errors(self) -> dict[int, float]:
        """Per-layer relative attention-output error of the simulated forwards so far."""
        return self.errors.relative()

    def reset_errors(self) -> None:
        """Forget the error statistics."""
        self.errors = _LayerErrors()


def _bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An attention mask as booleans (True = may attend); additive float masks are converted."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Scaled dot-product attention with GQA (``q [B, Hq, S, d]``, ``k/v [B, Hkv, L, d]``)."""
    import torch.nn.functional as F

    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


#: Query rows per block of the simulated attention (bounds its masks to ``block × (block + window)``).
SIM_QUERY_BLOCK = 256


def simulated_int2_attention(
    query: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    k_int2: torch.Tensor,
    v_int2: torch.Tensor,
    *,
    prefix: int,
    recent: int,
    scale: float,
    attention_mask: torch.Tensor | None = None,
    block: int = SIM_QUERY_BLOCK,
) -> torch.Tensor:
    """Causal attention where each query reads window keys exactly and older keys as INT2.

    Query ``t`` (absolute position ``i = L − S + t``) reads key/value ``j ≤ i`` from
    ``k_exact``/``v_exact`` when ``j < prefix`` or ``i − j ≤ recent`` (the sink, the current token
    and the ``recent`` tokens before it) and from ``k_int2``/``v_int2`` otherwise: what a decode
    step at position ``i`` reads from the OSCAR cache. Blocks of ``block`` queries are attended
    at once over only the keys they need, so the cost is about that of one causal attention.

    Args:
        query: ``[B, Hq, S, d]`` (in the same basis as the keys).
        k_exact, v_exact: ``[B, Hkv, L, d]`` window versions (``L ≥ S``).
        k_int2, v_int2: ``[B, Hkv, L, d]`` dequantized INT2 versions.
        prefix, recent: window sizes.
        scale: softmax scale.
        attention_mask: optional ``[B or 1, 1, S, L]`` boolean (True = attend) or additive mask,
            combined with the causal rule (padding).
        block: query rows per block.

    Returns:
        ``[B, Hq, S, d]`` in ``query``'s dtype.
    """
    b, _, s, _ = query.shape
    length = k_exact.shape[2]
    offset = length - s
    dev = query.device
    mask = _bool_mask(attention_mask)
    outs = []
    p = min(prefix, length)
    for a in range(0, s, block):
        e = min(s, a + block)
        i = torch.arange(offset + a, offset + e, device=dev)[:, None]  # absolute query positions
        q_end = max(prefix, offset + e - 1 - recent)  # INT2 keys: prefix <= j <= i - recent - 1
        band = max(prefix, offset + a - recent)  # exact band: max(prefix, i - recent) <= j <= i
        band = min(band, offset + e)
        parts_k = [k_exact[:, :, :p], k_int2[:, :, prefix:q_end], k_exact[:, :, band:offset + e]]
        parts_v = [v_exact[:, :, :p], v_int2[:, :, prefix:q_end], v_exact[:, :, band:offset + e]]
        js = torch.arange(0, p, device=dev)[None, :]
        jq = torch.arange(prefix, max(prefix, q_end), device=dev)[None, :]
        jb = torch.arange(band, offset + e, device=dev)[None, :]
        m = torch.cat([js <= i, (i - jq) > recent, (jb <= i) & ((i - jb) <= recent)], dim=1)
        if mask is not None:
            cols = torch.cat([js[0], jq[0], jb[0]])
            m = m & mask[:, :, a:e][..., cols]
        else:
            m = m[None, None]
        o = _sdpa(query[:, :, a:e], torch.cat(parts_k, 2), torch.cat(parts_v, 2), m, scale)
        outs.append(o)
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return torch.nan_to_num(out, nan=0.0) if mask is not None else out


def _exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Plain causal attention ``[B, Hq, S, d]`` (bottom-right aligned when ``L > S``)."""
    import torch.nn.functional as F

    s, length = query.shape[2], key.shape[2]
    mask = _bool_mask(attention_mask)
    if mask is None and s == length:
        hq, hkv = query.shape[1], key.shape[1]
        if hq != hkv:
            key, value = key.repeat_interleave(hq // hkv, dim=1), value.repeat_interleave(hq // hkv, dim=1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    if mask is None:
        i = torch.arange(length - s, length, device=query.device)[:, None]
        mask = (torch.arange(length, device=query.device)[None, :] <= i)[None, None]
    return torch.nan_to_num(_sdpa(query, key, value, mask, scale), nan=0.0)


def _simulate(session: OscarSession, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """The simulated OSCAR attention of one layer; returns ``[B, S, Hq, d]`` like the base functions."""
    oscar = session.oscar
    lid = int(getattr(module, "layer_idx", 0))
    dtype = query.dtype
    wdt = oscar.window_dtype or dtype
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rk = oscar.rotation("k", lid, query.device)
    rv = oscar.rotation("v", lid, query.device)
    kr = _rotate(key, rk, wdt)
    vr = _rotate(value, rv, wdt)
    k_exact, v_exact = kr.to(dtype), vr.to(dtype)
    length = key.shape[2]
    needs_int2 = length > oscar.prefix + oscar.recent + 1
    k_q = _fake_quantize(kr, oscar, oscar.clip_k, dtype) if needs_int2 and oscar.quantize_k else k_exact
    v_q = _fake_quantize(vr, oscar, oscar.clip_v, dtype) if needs_int2 and oscar.quantize_v else v_exact
    q_r = _rotate(query, rk, dtype)
    out_r = simulated_int2_attention(
        q_r, k_exact, v_exact, k_q, v_q, prefix=oscar.prefix, recent=oscar.recent, scale=scale,
        attention_mask=attention_mask,
    )
    out = _unrotate(out_r, rv)
    if session.collect_errors:
        ref = _exact_attention(query, key, value, scale, attention_mask)
        session.errors.add(lid, out, ref)
    return out.transpose(1, 2).contiguous()


def oscar_attention_name(base: str = "sdpa") -> str:
    """Register (once) and return the OSCAR attention implementation wrapping ``base``.

    The registered function (for ``model.set_attn_implementation(name)``):

    * keys coming from an :class:`OscarInt2Cache` layer are already rotated: the query is rotated
      with ``R_K``, ``base`` (``"sdpa"`` or ``"eager"``) attends in the rotated basis, and the
      output is un-rotated with ``R_Vᵀ``;
    * otherwise, inside :func:`oscar_kv`, the layer runs the decode-time simulation
      (:func:`simulated_int2_attention`);
    * otherwise it is ``base`` unchanged.
    """
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # pragma: no cover - older transformers
        ALL_MASK_ATTENTION_FUNCTIONS = AttentionMaskInterface = None  # type: ignore[assignment,misc]

    if base not in ("sdpa", "eager"):
        raise FitError(f"the OSCAR attention wraps 'sdpa' or 'eager', got {base!r}")
    name = f"{OSCAR_IMPL_PREFIX}_{base}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def oscar_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:
        layer = getattr(key, _OSCAR_TAG, None)
        if layer is not None:  # real INT2 cache: keys/values are in the rotated basis
            layer._consumed = True
            rk, rv = layer.r_k, layer.r_v
            q = _rotate(query, rk, query.dtype)
            out, weights = _base_attention(module, base)(module, q, key.to(query.dtype), value.to(query.dtype),
                                                         attention_mask, **kwargs)
            return _unrotate(out, rv), weights
        session = _ACTIVE_OSCAR.get()
        if session is None:
            return _base_attention(module, base)(module, query, key, value, attention_mask, **kwargs)
        return _simulate(session, module, query, key, value, attention_mask, kwargs.get("scaling")), None

    AttentionInterface.register(name, oscar_attention_forward)
    if AttentionMaskInterface is not None:
        mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[mask_base])
    return name


def _switch_attention(model: Any, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            if getattr(model.config, "_attn_implementation", None) == name:
                return
        except (ValueError, KeyError, ImportError):
            pass
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


class oscar_kv:  # noqa: N801 - used as a context manager, like a function
    """Context manager: run ``model`` with OSCAR INT2 keys/values.

    Inside it, ``model(...)`` without a cache (or with an ordinary ``DynamicCache``) runs the
    decode-time simulation (each position sees its own windows exactly and older tokens as INT2),
    and ``model(...)``/``model.generate(...)`` with ``cache=session.new_cache()`` use the real
    INT2 cache. On exit the previous attention implementation is restored.

    Args:
        model: a ``transformers`` decoder whose attention calls ``cache.update`` with post-RoPE
            keys and dispatches through ``AttentionInterface`` (Llama, Mistral, Qwen2/3, ...).
        oscar: the settings and rotations.
        collect_errors: record the per-layer attention-output error of simulated forwards.

    Example::

        oscar = OscarKV.from_rotations(rotationzoo.load("SmolLM2-135M-Instruct"), group_size=64,
                                       clip_k=0.96, clip_v=0.92, prefix=64, recent=256)
        with oscar_kv(model, oscar) as kv:
            nll = model(ids, labels=ids, use_cache=False).loss          # simulated INT2 KV
            out = model.generate(ids, cache=kv.new_cache(), max_new_tokens=64)   # real INT2 cache
    """

    def __init__(self, model: Any, oscar: OscarKV, *, collect_errors: bool = False) -> None:
        _require_transformers()
        self.session = OscarSession(model, oscar, collect_errors)
        self._prev: str | None = None
        self._token: contextvars.Token | None = None

    def __enter__(self) -> OscarSession:
        if _ACTIVE_OSCAR.get() is not None:
            raise FitError("an OSCAR KV context is already active")
        model = self.session.model
        prev = getattr(model.config, "_attn_implementation", None) or "sdpa"
        base = prev[len(OSCAR_IMPL_PREFIX) + 1:] if prev.startswith(OSCAR_IMPL_PREFIX) else prev
        if base not in ("sdpa", "eager"):
            base = "sdpa"
        self._prev = prev
        _switch_attention(model, oscar_attention_name(base))
        self._token = _ACTIVE_OSCAR.set(self.session)
        return self.session

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _ACTIVE_OSCAR.reset(self._token)
            self._token = None
        if self._prev is not None:
            _switch_attention(self.session.model, self._prev)


_CACHE_CLASSES: dict[str, type] = {}


def _cache_classes() -> dict[str, type]:
    """Define (once, importing transformers) ``OscarInt2Layer`` and ``OscarInt2Cache``."""
    if _CACHE_CLASSES:
        return _CACHE_CLASSES
    _require_transformers()
    from transformers.cache_utils import Cache, CacheLayerMixin

    class OscarInt2Layer(CacheLayerMixin):
        """One layer of :class:`OscarInt2Cache`.

        Storage (all ``[B, H_kv, n, ·]``, in the rotated basis): ``sink_k/v`` (first ``prefix``
        tokens, ``window_dtype``), INT2 ``codes_k/v`` (uint8 ``[..., d/4]``) with ``sz_k/v``
        (``[..., 2·d/G]`` in ``scale_dtype``), and ``recent_k/v`` (the last ``recent`` tokens,
        ``window_dtype``). ``update`` returns the history dequantized plus the new tokens, tagged so
        that the OSCAR attention knows they are rotated.
        """

        is_compileable = False
        is_croppable = False
        is_sliding = False
        supports_early_init = False

        def __init__(self, oscar: OscarKV, layer_idx: int) -> None:
            super().__init__()
            self.oscar = oscar
            self.layer_idx = int(layer_idx)
            self.cumulative_length = 0
            self.r_k: torch.Tensor | None = None
            self.r_v: torch.Tensor | None = None
            self._consumed = True
            self._clear()

        def _clear(self) -> None:
            self.sink_k = self.sink_v = None
            self.recent_k = self.recent_v = None
            self.codes_k = self.codes_v = self.sz_k = self.sz_v = None
            self.cumulative_length = 0
            self._consumed = True

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.dtype = key_states.dtype
            wdt = self.oscar.window_dtype or key_states.dtype
            b, h, _, d = key_states.shape
            dv = value_states.shape[-1]
            self.r_k = self.oscar.rotation("k", self.layer_idx, self.device)
            self.r_v = self.oscar.rotation("v", self.layer_idx, self.device)
            empty = lambda n: key_states.new_zeros((b, h, 0, n), dtype=wdt)  # noqa: E731
            self.sink_k, self.recent_k = empty(d), empty(d)
            self.sink_v, self.recent_v = empty(dv), empty(dv)
            self.is_initialized = True

        def _int2(self, side: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
            return getattr(self, f"codes_{side}"), getattr(self, f"sz_{side}")

        def _history(self, side: str) -> torch.Tensor:
            sink, recent = getattr(self, f"sink_{side}"), getattr(self, f"recent_{side}")
            codes, sz = self._int2(side)
            parts = [sink.to(self.dtype)]
            if codes is not None and codes.shape[2]:
                if (self.oscar.quantize_k if side == "k" else self.oscar.quantize_v):
                    parts.append(_dequantize_rows(codes, sz, self.oscar, self.dtype))
                else:
                    parts.append(codes.to(self.dtype))  # kept unquantized (quantize_<side>=False)
            parts.append(recent.to(self.dtype))
            return torch.cat(parts, dim=2)

        def _store(self, side: str, x: torch.Tensor) -> None:
            """Append rotated window-dtype rows ``x [B, H, n, d]``; demote what leaves the window."""
            o = self.oscar
            sink = getattr(self, f"sink_{side}")
            take = min(max(o.prefix - sink.shape[2], 0), x.shape[2])
            if take:
                setattr(self, f"sink_{side}", torch.cat([sink, x[:, :, :take]], dim=2))
            recent = torch.cat([getattr(self, f"recent_{side}"), x[:, :, take:]], dim=2)
            extra = recent.shape[2] - o.recent
            if extra > 0:
                old, recent = recent[:, :, :extra], recent[:, :, extra:]
                codes, sz = self._int2(side)
                if o.quantize_k if side == "k" else o.quantize_v:
                    c, s = _quantize_rows(old, o, o.clip_k if side == "k" else o.clip_v)
                else:  # not quantized: keep the rows in the codes slot
                    c, s = old, old.new_zeros(old.shape[:-1] + (0,))
                setattr(self, f"codes_{side}", c if codes is None else torch.cat([codes, c], dim=2))
                setattr(self, f"sz_{side}", s if sz is None else torch.cat([sz, s], dim=2))
            setattr(self, f"recent_{side}", recent.contiguous())

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if not self._consumed:
                raise FitError(
                    "OscarInt2Cache returned rotated keys that were not read by the OSCAR attention: run the model "
                    "inside rotationzoo.integrations.transformers.oscar_kv(model, ...)"
                )
            wdt = self.oscar.window_dtype or self.dtype
            kr = _rotate(key_states, self.r_k, wdt)
            vr = _rotate(value_states, self.r_v, wdt)
            keys = torch.cat([self._history("k"), kr.to(self.dtype)], dim=2)
            values = torch.cat([self._history("v"), vr.to(self.dtype)], dim=2)
            self._store("k", kr)
            self._store("v", vr)
            self.cumulative_length += key_states.shape[2]
            setattr(keys, _OSCAR_TAG, self)
            self._consumed = False
            return keys, values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.cumulative_length + query_length, 0

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self._clear()
            self.is_initialized = False

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("OscarInt2Cache cannot be cropped (INT2 tokens cannot be restored)")

        def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
            for name in ("sink_k", "sink_v", "recent_k", "recent_v", "codes_k", "codes_v", "sz_k", "sz_v"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, fn(t))

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            if self.is_initialized:
                self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.is_initialized:
                self._map_batch(lambda t: t[indices, ...])

        def offload(self) -> None:  # pragma: no cover - not supported
            pass

        def prefetch(self) -> None:  # pragma: no cover - not supported
            pass

        def nbytes(self) -> int:
            """Bytes held by this layer (windows, codes, scales/zeros)."""
            total = 0
            for name in ("sink_k", "sink_v", "recent_k", "recent_v", "codes_k", "codes_v", "sz_k", "sz_v"):
                t = getattr(self, name)
                if t is not None:
                    total += t.numel() * t.element_size()
            return total

        def stored_tokens(self) -> dict[str, int]:
            """``{"prefix": …, "int2": …, "recent": …}`` token counts held."""
            if not self.is_initialized:
                return {"prefix": 0, "int2": 0, "recent": 0}
            n_int2 = self.codes_k.shape[2] if self.codes_k is not None else 0
            return {"prefix": self.sink_k.shape[2], "int2": n_int2, "recent": self.recent_k.shape[2]}

    class OscarInt2Cache(Cache):
        """A ``transformers`` cache that stores keys/values OSCAR-style: rotated, INT2 outside the windows.

        Use it inside :func:`oscar_kv` (whose attention rotates the query and un-rotates the
        output)::

            with oscar_kv(model, oscar) as kv:
                out = model.generate(**inputs, cache=kv.new_cache(), max_new_tokens=64)

        Per layer, the first ``prefix`` tokens and the last ``recent`` tokens are kept rotated in
        ``window_dtype``; each token leaving the recent window is clipped and INT2-quantized with
        :func:`rotationzoo.kernels.quantize_int2` (Triton on CUDA, the PyTorch reference on CPU) and
        only its codes and scales/zeros are kept. A forward over several new tokens (a prefill)
        attends to those new tokens exactly among themselves, as the SGLang fork's prefill does;
        decode steps read the INT2 history.

        Args:
            oscar: settings and rotations.
            config: the model config (for the layer count).
            num_layers: the layer count, if no config is given.
        """

        def __init__(self, oscar: OscarKV, config: Any = None, num_layers: int | None = None) -> None:
            if num_layers is None:
                if config is None:
                    raise FitError("OscarInt2Cache needs the model config or num_layers")
                text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
                num_layers = int(text.num_hidden_layers)
            self.oscar = oscar
            super().__init__(layers=[OscarInt2Layer(oscar, i) for i in range(num_layers)])

        def nbytes(self) -> int:
            """Bytes held by all layers."""
            return sum(layer.nbytes() for layer in self.layers)

        def bits_per_element(self) -> float:
            """Stored bits per cached K/V element (codes, scales/zeros and windows over all layers)."""
            elems = 0
            for layer in self.layers:
                if layer.is_initialized:
                    b, h, _, d = layer.sink_k.shape
                    elems += 2 * b * h * d * layer.cumulative_length
            return 8.0 * self.nbytes() / elems if elems else 0.0

    _CACHE_CLASSES.update(OscarInt2Layer=OscarInt2Layer, OscarInt2Cache=OscarInt2Cache)
    return _CACHE_CLASSES


def __getattr__(name: str) -> Any:
    if name in ("OscarInt2Cache", "OscarInt2Layer"):
        return _cache_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
