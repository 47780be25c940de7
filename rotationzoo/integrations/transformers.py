"""``transformers`` integration: post-RoPE Q/K/V capture and calibration.

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

The capture part is self-contained (``QKVCapture``, ``capture_attention_name``); other
attention paths may be added to this module independently.
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
    """Fit rotations from a live ``transformers`` model, streaming Q/K/V into the accumulators.

    Pass 1 runs the model once over the calibration windows; each captured Q (and K/V for
    ``ktk``/``vtv``) chunk goes straight into the fp64 accumulators. ``sst`` needs a second pass
    over K and V after the query statistics are final: the captured K/V chunks are spilled to
    disk (to ``dump_out`` when given, else a temporary folder) and read back once, so the model
    runs only once and memory stays bounded.

    With ``dump_out`` the full Q/K/V dump is written in the SGLang layout, preceded by a
    ``WARMUP_TOKENS``-token warm-up forward stored as chunk 0 (never fitted), so that
    ``fit_rotations(dump_out)`` with its default chunk-0 skip gives the same rotations.

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
    from ..fit import OBJECTIVES, fit_rotations
    from ..fit.accumulate import LayerAccumulator, Workspace, second_pass_from_dump
    from ..fit.compose import check_composition
    from ..fit.dump import Dump, DumpWriter

    if objective not in OBJECTIVES or objective == "hadamard":
        raise FitError(f"calibrate: objective must be one of {', '.join(o for o in OBJECTIVES if o != 'hadamard')}")
    check_composition(composition, group_size)
    k_target, v_target = OBJECTIVES[objective]
    targets = tuple(t for t in (k_target, v_target) if t is not None)
    raw_texts = read_texts(texts) if texts_are_paths else [str(t) for t in texts]
    windows = list(token_windows(tokenizer, raw_texts, tokens=tokens, seq_len=seq_len))
    if not windows:
        raise FitError("the calibration texts produced no tokens")
    total_tokens = sum(len(w) for w in windows)

    needs_kv_spill = "sst" in targets
    tmp: tempfile.TemporaryDirectory | None = None
    writer: DumpWriter | None = None
    if dump_out is not None:
        writer = DumpWriter(dump_out, overwrite=overwrite_dump)
    elif needs_kv_spill:
        tmp = tempfile.TemporaryDirectory(prefix="rotationzoo-kv-")
        writer = DumpWriter(tmp.name, kinds=("k", "v"))
    device = next(model.parameters()).device
    workspace = Workspace("cpu")
    accs: dict[int, LayerAccumulator] = {}
    state = {"warmup": False, "seq_len": 0}

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

    try:
        with torch.no_grad(), QKVCapture(model, on_qkv):
            if dump_out is not None:
                state["warmup"] = True
                warm = windows[0][:WARMUP_TOKENS]
                model(input_ids=torch.tensor([warm], device=device), use_cache=False)
                state["warmup"] = False
            done = 0
            for window in windows:
                model(input_ids=torch.tensor([window], device=device), use_cache=False)
                done += len(window)
                if progress is not None:
                    progress("tokens", done, total_tokens)
        if not accs:
            raise FitError("no attention layer reported Q/K/V; the model's attention does not use AttentionInterface")
        if needs_kv_spill:
            assert writer is not None
            spill = Dump(writer.root, keep_first_chunk=dump_out is None)
            for lid, acc in accs.items():
                second_pass_from_dump(
                    acc, spill, lid,
                    progress=(lambda l, d, t: progress(f"layer {l}", d, t)) if progress is not None else None,
                )
        info: dict[str, Any] = {
            "kind": "transformers",
            "model": model_id,
            "texts": [str(t) for t in texts] if texts_are_paths else len(raw_texts),
            "seq_len": seq_len,
            "token_budget": int(tokens),
            "prompts": len(windows),
        }
        if dump_out is not None:
            info["dump"] = str(dump_out)
            assert writer is not None
            writer.write_info({
                "model": model_id,
                "prompts": len(windows),
                "tokens": total_tokens,
                "seq_len": seq_len,
                "warmup_chunk": True,
                "texts": info["texts"],
                "writer": "rotationzoo calibrate",
            })
        return fit_rotations(
            accs, objective, composition, group_size=group_size, signs=signs, source_info=info,  # type: ignore[arg-type]
        )
    finally:
        if tmp is not None:
            tmp.cleanup()


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
