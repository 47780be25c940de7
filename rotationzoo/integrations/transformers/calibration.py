"""Calibration from a live model: capture Q/K/V over calibration text, fit rotations, or write a dump.

Example::

    from rotationzoo.integrations.transformers import calibrate, load_model

    model, tokenizer = load_model("models/Qwen3-8B")          # local folder or a .gguf file
    result = calibrate(model, tokenizer, ["calib.txt"], tokens=20000, dump_out="qkv_dump")
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import operator
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from ...errors import FitError
from ...vocab import Center, Grouping
from ...fit import fit_rotations, refine_config, refine_fit
from ...fit.accumulate import LayerAccumulator, Workspace
from ...fit.fitter import PROVENANCE_KEYS, check_token_budget
from ...recipe import (DEFAULT_MIN_TOKENS, OBJECTIVE_TARGETS, V2_COMPOSITION, V2_OBJECTIVE, Refinement,
                       check_composition, resolve_center, resolve_composition, resolve_grouping)
from ...fit.dump import Dump, DumpWriter
from ...fit.samples import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_TOKENS, CalibrationSamples
from ...progress import Progress, Tally
from ...fit.stream import second_pass_from_dump
from .capture import OutputGradCapture, QKVCapture
from .texts import check_text_files, read_token_ids, texts_sha256

#: Tokens of the warm-up forward written as chunk 0 of a dump (mirrors SGLang's warm-up batch).
WARMUP_TOKENS = 6
#: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): tokens captured (``"capture"``),
#: then the chunk reads of the second pass over K/V (``"K/V pass 2: layer <L>"``), then refinement.
CalibrationProgress = Progress


def check_capture_sizes(tokens: Any, seq_len: Any) -> None:
    """Refuse a capture of fewer than one token, or in sequences of fewer than one token, before a model loads
    (:func:`rotationzoo.workflows.calibrate` checks it with its other early checks).

    Raises:
        FitError: ``tokens`` or ``seq_len`` not an integer of at least 1.
    """
    for value, what, option in ((tokens, "tokens", "--tokens"), (seq_len, "seq_len", "--seq-len")):
        try:
            n = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            n = None
        if n is None or n < 1:
            raise FitError(f"{what} ({option}) must be an integer of at least 1 token, got {value!r}; give a positive "
                           f"{option}")


def token_windows(tokenizer: Any, texts: Iterable[str | os.PathLike[str]], *, tokens: int, seq_len: int,
                  texts_are_paths: bool = False) -> Iterator[list[int]]:
    """Token id windows for calibration.

    Each text is tokenized once (with the tokenizer's special tokens, e.g. a leading BOS) and cut
    into consecutive windows of ``seq_len`` tokens; each window is one independent sequence. The
    last window is truncated so that exactly ``tokens`` tokens are produced in total (fewer if
    the texts run out). Files (``texts_are_paths=True``, checked with :func:`check_text_files`)
    are read in bounded pieces and only as far as ``tokens`` (:func:`read_token_ids`).
    """
    check_capture_sizes(tokens, seq_len)
    for ids in read_token_ids(tokenizer, list(texts), limit=int(tokens), texts_are_paths=texts_are_paths,
                              what="calibration text"):
        for start in range(0, len(ids), seq_len):
            yield ids[start:start + seq_len]


def _objectives(objective: str | Sequence[str]) -> tuple[str, ...]:
    """The objective(s) statistics must serve, each checked (not ``hadamard``, which needs no data)."""
    names = (objective,) if isinstance(objective, str) else tuple(objective)
    for name in names:
        if name not in OBJECTIVE_TARGETS or name == "hadamard":
            raise FitError(f"objective must be one of {', '.join(o for o in OBJECTIVE_TARGETS if o != 'hadamard')}, "
                           f"got {name!r}")
    if not names:
        raise FitError("no objective given")
    return names


def prompt_sha256(windows: Sequence[Sequence[int]]) -> str:
    """The authors' ``prompt_sha256``: sha256 of the token-id sequences as compact JSON (``[[1,2],[3]]``)."""
    return hashlib.sha256(json.dumps([list(map(int, w)) for w in windows], separators=(",", ":")).encode()).hexdigest()


def calibrate(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str | os.PathLike[str]] | Sequence[str],
    *,
    tokens: int,
    seq_len: int = 2048,
    objective: str = "qqt_sst",
    composition: str | None = None,
    group_size: int | None = None,
    dump_out: str | os.PathLike[str] | None = None,
    overwrite_dump: bool = False,
    signs: str = "canonical",
    model_id: str | None = None,
    texts_are_paths: bool = True,
    progress: CalibrationProgress | None = None,
    refine: Refinement | None = None,
    grouping: Grouping | None = None,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    center: Center | None = None,
    provenance: Mapping[str, Any] | None = None,
    grads: bool = False,
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
        progress: ``progress(done, total, what)`` (:data:`CalibrationProgress`): the capture, the
            second pass over K/V, and refinement if asked for.
        refine: learn the rotations instead (:func:`rotationzoo.fit.refine_fit` on a reservoir of
            ``refine.sample_tokens`` tokens per layer, the OSCAR inits fitted from the full
            statistics; ``composition`` is not used then, ``group_size`` is the loss's INT2 group).
        grouping: ``"layer"`` or ``"kv_head"`` (one rotation per layer and KV head); default: the
            objective's own (see :func:`rotationzoo.fit.fit_rotations`).
        min_tokens: fewest tokens per layer to fit from (see :func:`rotationzoo.fit.fit_rotations`);
            a smaller ``tokens`` is refused before the model runs.
        center: ``"none"``, ``"k"`` or ``"kv"`` (see :func:`rotationzoo.fit.fit_rotations`; with
            ``refine``, the samples are centered and the means kept).
        provenance: facts about the model recorded in the files' ``calibration`` (``model_revision``,
            ``model_sha256``; see :func:`~rotationzoo.integrations.transformers.loading.model_provenance`).
        grads: also capture the output gradients (see :func:`collect_statistics`) into ``dump_out``; always on
            for a refinement with the ``"fisher"`` loss.

    Returns:
        A :class:`rotationzoo.fit.FitResult` (``prompts`` = number of sequences run); its files'
        ``calibration`` records ``prompt_sha256`` (the authors' definition, over the token windows run),
        ``text_sha256`` (of the text files), ``tokens`` and the model's revision.
    """
    _objectives(objective)
    group = resolve_grouping(objective, grouping)
    check_token_budget(tokens, min_tokens)  # before the model runs
    if refine is None:
        comp = resolve_composition(objective, composition)  # before the model runs
        if comp != V2_COMPOSITION:
            check_composition(comp, group_size)
        resolve_center(objective, center, OBJECTIVE_TARGETS[objective])
    elif objective != "qqt_sst":
        raise FitError("refinement fits its OSCAR inits from qqt_sst statistics; leave objective at qqt_sst")
    stats = collect_statistics(
        model, tokenizer, texts, tokens=tokens, seq_len=seq_len, objective=objective, model_id=model_id,
        texts_are_paths=texts_are_paths, progress=progress, dump_out=dump_out, overwrite_dump=overwrite_dump,
        sample_tokens=refine.sample_tokens if refine is not None else 0,
        sample_seed=refine.seed if refine is not None else 0, grouping=group, provenance=provenance,
        sample_block_size=refine.blocks if refine is not None else DEFAULT_BLOCK_SIZE,
        grads=grads or (refine is not None and refine.loss == "fisher"),
    )
    if refine is not None:
        assert stats.samples is not None
        if refine.loss != "fisher":
            stats.samples.drop_grads()  # captured for the dump (grads=True); this loss does not read them
        return refine_fit(stats.samples, refine.init, steps=refine.steps, group_size=group_size, seed=refine.seed,
                          config=refine_config(refine), steps_v=refine.steps_v,
                          statistics=stats.accumulators, source_info=stats.info, model=model_id,
                          grouping=group, progress=progress, min_tokens=min_tokens, center=center)  # type: ignore[arg-type]
    return fit_rotations(
        stats.accumulators, objective, composition, group_size=group_size, signs=signs,  # type: ignore[arg-type]
        source_info=stats.info, grouping=group, min_tokens=min_tokens, center=center,  # type: ignore[arg-type]
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
    writer = DumpWriter(dump_out, token_budget=token_budget, overwrite=overwrite, unfinished=True)
    device = next(model.parameters()).device

    def on_qkv(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        writer.write(layer_id, q=q.detach().cpu(), k=k.detach().cpu(), v=v.detach().cpu(), seq_lens=[q.shape[0]])

    with torch.no_grad(), QKVCapture(model, on_qkv):
        for ids in input_ids:
            t = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids))
            model(input_ids=t.reshape(1, -1).to(device), use_cache=False)
    if info is not None:
        writer.write_info(info)
    writer.finish()
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
        samples: the bounded reservoir of whole q/k/v token blocks per layer that learned
            refinement (:func:`rotationzoo.fit.refine_fit`) trains on, or ``None`` when
            ``sample_tokens=0``.
    """

    def __init__(self, accumulators: dict[int, Any], info: dict[str, Any], objective: str,
                 samples: CalibrationSamples | None = None) -> None:
        self.accumulators = accumulators
        self.info = info
        self.objective = objective
        self.samples = samples

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
    objective: str | Sequence[str] = "qqt_sst",
    model_id: str | None = None,
    texts_are_paths: bool = True,
    progress: CalibrationProgress | None = None,
    dump_out: str | os.PathLike[str] | None = None,
    overwrite_dump: bool = False,
    sample_tokens: int = DEFAULT_MAX_TOKENS,
    sample_seed: int = 0,
    sample_block_size: int = DEFAULT_BLOCK_SIZE,
    grouping: str = "layer",
    provenance: Mapping[str, Any] | None = None,
    grads: bool = False,
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
        objective: see :func:`rotationzoo.fit.fit_rotations` (not ``"hadamard"``), or several: the
            statistics then serve every one of them (e.g. ``("qqt_sst", "cov_eig_hadamard_perhead")``).
        model_id: model name recorded in ``info``.
        texts_are_paths: whether ``texts`` are file paths.
        progress: ``progress(done, total, what)`` (:data:`CalibrationProgress`): the capture, the
            second pass over K/V, and refinement if asked for.
        dump_out: also write an SGLang-layout dump here.
        overwrite_dump: replace an existing dump in ``dump_out``.
        sample_tokens: also keep a reservoir of up to this many tokens per layer (whole blocks of
            256 consecutive tokens, bf16 q/k/v) for learned refinement; default 14,336 (0.77 GiB
            for SmolLM2-135M, 5.91 GiB for 36 layers of 32 + 8 heads at ``d = 128``; see
            :mod:`rotationzoo.fit.samples`). ``0`` keeps none.
        sample_seed: reservoir seed.
        sample_block_size: tokens per kept block.
        grouping: ``"kv_head"`` accumulates ktk / vtv per KV head, so that per-head rotations can
            be fitted from them (qqt and sst statistics serve both groupings; the V2 recipe always
            accumulates them per head).
        provenance: facts recorded in ``info`` (``model_revision``, ``model_sha256``).
        grads: also run a backward pass per window (its next-token NLL) and keep each layer's output
            gradients (:class:`~.capture.OutputGradCapture`) with the reservoir's blocks and in the dump
            (``g/``), for the ``"fisher"`` refinement loss. About twice the capture's time, and memory grows
            with the window: SmolLM2-135M's 20,000 tokens in 8,192-token windows on CPU took 6 min 53 s against
            3 min 08 s, and the whole ``calibrate --loss fisher`` run peaked at 20.9 GiB resident.

    Returns:
        :class:`CapturedStatistics`; ``info`` holds ``prompt_sha256`` (sha256 of the windows' token ids
        as compact JSON, the authors' definition) and ``text_sha256`` (of the texts, in order).
    """
    names = _objectives(objective)
    if grads and dump_out is None and sample_tokens <= 0:
        raise FitError("output gradients are kept in the dump or the refinement samples; give dump_out or sample_tokens")
    targets = tuple(dict.fromkeys(t for name in names for t in OBJECTIVE_TARGETS[name] if t is not None))
    per_head = grouping == "kv_head" or V2_OBJECTIVE in names
    sources = check_text_files(texts, what="calibration text") if texts_are_paths else [str(t) for t in texts]
    windows = list(token_windows(tokenizer, sources, tokens=tokens, seq_len=seq_len, texts_are_paths=texts_are_paths))
    if not windows:
        raise FitError("the calibration texts produced no tokens")
    total = sum(len(w) for w in windows)
    info: dict[str, Any] = {
        "kind": "transformers", "model": model_id,
        "texts": [str(t) for t in texts] if texts_are_paths else len(sources),
        "seq_len": seq_len, "token_budget": int(tokens), "tokens": total, "prompts": len(windows),
        "prompt_sha256": prompt_sha256(windows),
        "text_sha256": texts_sha256(sources, texts_are_paths=texts_are_paths, what="calibration text"),
        **dict(provenance or {}),
    }
    spill = "sst" in targets  # sst needs K/V again once the query statistics are final
    tmp = tempfile.TemporaryDirectory(prefix="rotationzoo-kv-") if spill and dump_out is None else None
    writer = (DumpWriter(dump_out, overwrite=overwrite_dump, unfinished=True) if dump_out is not None
              else DumpWriter(tmp.name, kinds=("k", "v")) if tmp is not None else None)
    samples = (CalibrationSamples(max_tokens=sample_tokens, seed=sample_seed, block_size=sample_block_size)
               if sample_tokens > 0 else None)
    collector = _Collector(targets, writer, samples, per_head=per_head, grads=grads)
    try:
        _forward_windows(model, windows, collector, warmup=dump_out is not None, progress=progress)
        if not collector.accs:
            raise FitError("no attention layer reported Q/K/V; the model's attention does not use AttentionInterface")
        if dump_out is not None and writer is not None:  # every window captured: the dump is whole
            info["dump"] = str(dump_out)
            writer.write_info({"model": model_id, "prompts": len(windows), "tokens": total, "seq_len": seq_len,
                               "warmup_chunk": True, "texts": info["texts"], "writer": "rotationzoo calibrate",
                               **({"grads": "nll"} if grads else {}),
                               **{k: info[k] for k in PROVENANCE_KEYS if info.get(k) is not None}})
        if writer is not None and spill:
            # a dump written for the user keeps its warm-up chunk 0 on disk; skip it here
            kv = Dump(writer.root, keep_first_chunk=dump_out is None)
            tally = Tally(progress, sum(len(kv.chunk_ids(lid, ("k", "v"))) for lid in collector.accs), "K/V pass 2")
            tally.start()
            for lid, acc in collector.accs.items():
                second_pass_from_dump(acc, kv, lid, progress=lambda i, d, t: tally.set(i, d, f"K/V pass 2: layer {i}"))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return CapturedStatistics(collector.accs, info, names[0] if len(names) == 1 else ",".join(names), samples)


class _Collector:
    """Receives each attention layer's Q/K/V chunk: writes it to the dump (if any) and feeds pass 1
    of the layer's fp64 accumulators and its sample reservoir, if any (nothing is accumulated
    while ``warmup`` is set). With ``grads``, the reservoir's blocks wait for the backward pass
    (:meth:`on_grad` stores each layer's output gradients in the dump and offers the blocks with them)."""

    def __init__(self, targets: tuple[str, ...], writer: DumpWriter | None,
                 samples: CalibrationSamples | None = None, per_head: bool = False, grads: bool = False) -> None:
        self.targets, self.writer, self.samples, self.per_head = targets, writer, samples, per_head
        self.accs: dict[int, LayerAccumulator] = {}
        self.workspace = Workspace("cpu")
        self.warmup = False
        self.grads = grads
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # this window's q/k/v

    def on_grad(self, layer_id: int, g: torch.Tensor) -> None:
        """A backward pass's output gradients of one layer: stored beside the chunk its forward wrote (in the
        queries' dtype) and offered to the reservoir with the window's q/k/v (not the warm-up's)."""
        pending = self._pending.pop(layer_id, None)
        if pending is None:
            raise FitError(f"layer {layer_id}: output gradients arrived for an attention layer whose Q/K/V were not "
                           f"captured; this model's attention cannot be calibrated with gradients")
        q, k, v = pending
        g = g.detach().to("cpu", q.dtype)
        if self.writer is not None and "q" in self.writer.kinds:
            self.writer.write_grads(layer_id, g)
        if self.samples is not None and not self.warmup:
            self.samples.layer(layer_id).add_sequence(q, k, v, g=g)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        q, k, v = q.detach().to("cpu"), k.detach().to("cpu"), v.detach().to("cpu")
        if self.writer is not None:
            self.writer.write(layer_id, q=q if "q" in self.writer.kinds else None, k=k, v=v, seq_lens=[q.shape[0]])
        if self.grads:
            self._pending[layer_id] = (q, k, v)
        if self.warmup:
            return
        acc = self.accs.get(layer_id)
        if acc is None:
            acc = self.accs[layer_id] = LayerAccumulator(
                layer_id, num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=q.shape[2],
                targets=self.targets, workspace=self.workspace, per_head=self.per_head,
            )
        for kind in acc.pass1_kinds:
            {"q": acc.add_q, "k": acc.add_k, "v": acc.add_v}[kind]({"q": q, "k": k, "v": v}[kind])
        if self.samples is not None and not self.grads:
            self.samples.layer(layer_id).add_sequence(q, k, v)


def _forward_windows(model: Any, windows: list[list[int]], collector: _Collector, *, warmup: bool,
                     progress: CalibrationProgress | None) -> None:
    """Pass 1: one forward per window with Q/K/V captured (after a short warm-up forward when a
    dump is written, stored as its chunk 0 like the authors' server does); with ``collector.grads``
    each forward is followed by a backward pass of the window's next-token NLL whose output gradients go
    to :meth:`_Collector.on_grad`."""
    device = next(model.parameters()).device
    total = sum(len(w) for w in windows)
    grads = OutputGradCapture(model, collector.on_grad) if collector.grads else contextlib.nullcontext()
    with QKVCapture(model, collector), grads:
        if warmup:
            collector.warmup = True
            _run_window(model, windows[0][:WARMUP_TOKENS], device, collector.grads)
            collector.warmup = False
        done = 0
        if progress is not None:
            progress(0, total, "capture")
        for window in windows:
            _run_window(model, window, device, collector.grads)
            done += len(window)
            if progress is not None:
                progress(done, total, "capture")


def _run_window(model: Any, window: list[int], device: Any, grads: bool) -> None:
    """One forward of ``window`` (batch 1, no cache); with ``grads``, the gradient of its summed next-token
    NLL is taken back to the input embeddings (the weights' gradients are not computed)."""
    ids = torch.tensor([window], device=device)
    if not grads:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        return
    with torch.enable_grad():
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=emb, use_cache=False).logits[0]
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), ids[0, 1:], reduction="sum")
        del logits
        torch.autograd.grad(nll, [emb])
