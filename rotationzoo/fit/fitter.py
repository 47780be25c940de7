"""The fitter: per-layer K and V rotations from covariance statistics (a dump or a live capture).

The math, normalisations and compositions are those of the authors' fitter
(``rotation/compute_kv_rotation.py``); see :mod:`rotationzoo.fit.accumulate` and
:mod:`rotationzoo.fit.compose`, and ``docs/fitting.md``.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Mapping

import torch

from ..errors import DumpError, FitError
from ..files.format import MAX_BYTES, MAX_HEAD_DIM, MAX_LAYERS, RotationSet
from ..progress import Progress, Tally
from ..recipe import (DEFAULT_MIN_TOKENS, OBJECTIVE_TARGETS, V2_COMPOSITION, V2_OBJECTIVE, check_composition,
                      check_min_tokens, check_workers, resolve_center, resolve_composition, resolve_grouping)
from ..vocab import Center, Grouping, SignConvention
from .accumulate import LayerAccumulator, kinds_for, statistics_bytes
from .compose import check_head_dim, hadamard_rotations
from .dump import Dump, open_dump
from .dump_plan import DumpPlan, DumpShape
from .dump_schema import MIN_HEAD_DIM
from .recipes import V2_MAX_CHUNKS, v2_chunks
from .result import FitResult, FitStats, peak_rss_bytes
from .sets import build_sets, fitted_means
from .stream import accumulate_dump_layer, layer_reads, thread_workspace

#: Provenance a dump's ``rotationzoo_dump.json`` may carry into the files' ``calibration`` record.
PROVENANCE_KEYS = ("prompt_sha256", "text_sha256", "model_revision", "model_sha256")
#: Upper bound of the default number of concurrent layers (each holds one fp64 workspace).
MAX_DEFAULT_WORKERS = 8


def dump_provenance(dump_info: Mapping[str, Any]) -> dict[str, str]:
    """What a dump's ``rotationzoo_dump.json`` knows of the calibration (:data:`PROVENANCE_KEYS`, each a short
    printable string), for the files' ``calibration`` record of any fit from that dump."""
    out = {}
    for key in PROVENANCE_KEYS:
        value = dump_info.get(key)
        if isinstance(value, str) and 0 < len(value) <= 128 and value.isprintable():
            out[key] = value
    return out


def _parse_objective(objective: str) -> tuple[str | None, str | None]:
    if objective not in OBJECTIVE_TARGETS:
        raise FitError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVE_TARGETS)}")
    return OBJECTIVE_TARGETS[objective]


def _as_dump(source: Any, keep_first_chunk: bool, layers: Iterable[int] | None, *, force_first: bool = False) -> Dump:
    """Open a dump path; an opened :class:`Dump` keeps its own chunk-0 rule, limits and ``tp_size``
    (``layers`` still applies; ``force_first`` keeps chunk 0, as the V2 recipe reads it)."""
    if isinstance(source, Dump):
        if layers is None and (source.keep_first_chunk or not force_first):
            return source
        return source.reopen(keep_first_chunk=source.keep_first_chunk or force_first, layers=layers)
    return open_dump(source, keep_first_chunk=keep_first_chunk or force_first, layers=layers)


def check_token_budget(tokens: Any, min_tokens: Any) -> None:
    """Refuse a capture budget of fewer than ``min_tokens`` tokens per layer (before a model runs)."""
    min_tokens = check_min_tokens(min_tokens)
    if type(tokens) is int and tokens < min_tokens:
        raise FitError(f"{tokens} tokens per layer is fewer than min_tokens={min_tokens}; rotations fitted from so "
                       "few are noise (the published ones use 10,000 to 150,000 per layer). Capture more tokens, "
                       "or lower min_tokens (--min-tokens) to fit anyway")


def check_tokens(tokens: Mapping[int, int], min_tokens: int) -> None:
    """Refuse layers with fewer than ``min_tokens`` tokens (before anything is accumulated, for a dump)."""
    few = {lid: t for lid, t in tokens.items() if t < min_tokens}
    if few:
        lid, t = next(iter(few.items()))
        more = f" (and {len(few) - 1} more layers)" if len(few) > 1 else ""
        raise FitError(f"layer {lid}: {t} tokens{more}, fewer than min_tokens={min_tokens}; rotations fitted from so "
                       "few are noise (the published ones use 10,000 to 150,000 per layer). Dump or capture more "
                       "tokens, or lower min_tokens (--min-tokens) to fit anyway")


def _check_output(n_layers: int, d: int, heads: int = 1) -> None:
    """Refuse a fit whose rotation files could not be read back within the format's limits."""
    if d < MIN_HEAD_DIM:
        raise FitError(f"head_dim {d} is below {MIN_HEAD_DIM}, the smallest the INT2 kernels serve; "
                       "not a model's attention heads")
    loaded = n_layers * heads * (d * d + d) * 4
    if n_layers > MAX_LAYERS or d > MAX_HEAD_DIM or loaded > MAX_BYTES:
        per = f" x {heads} KV heads" if heads > 1 else ""
        raise FitError(f"{n_layers} layers of head_dim {d}{per} make rotation files of {loaded} bytes, beyond what a "
                       f"rotation file may hold (max_layers={MAX_LAYERS}, max_head_dim={MAX_HEAD_DIM}, max_bytes="
                       f"{MAX_BYTES}); fit fewer layers at a time")


def _check_fit_shape(n_layers: int, d: int, heads: int, composition: str, group_size: int | None) -> None:
    """What the composition and the rotation files need of the shape, checked before any data is read."""
    _check_output(n_layers, d, heads)
    if composition == V2_COMPOSITION:  # U_desc·H_d: any power-of-two head_dim (the authors' script: 128 only)
        check_head_dim("r_h", d)
        return
    check_composition(composition, group_size, d)
    check_head_dim(composition, d)


def _check_cost(dump: Dump, plan: DumpPlan, targets: tuple[str, ...], per_head: bool) -> None:
    """Refuse a fit whose fp64 statistics would exceed ``DumpLimits.max_statistics_bytes``."""
    s = plan.shape
    need = len(plan.tokens) * statistics_bytes(s.num_kv_heads, s.head_dim, targets, per_head=per_head)
    cap = dump.limits.max_statistics_bytes
    if need > cap:
        raise DumpError(f"{dump.root}: fitting {len(plan.tokens)} layers of head_dim {s.head_dim} with {s.num_kv_heads} "
                        f"KV heads keeps {need / 2**30:.2f} GiB of fp64 statistics, more than max_statistics_bytes="
                        f"{cap} (DumpLimits); fit fewer layers at a time (--layers) or raise the limit")


def check_grouping(grouping: str | None, objective: str = "qqt_sst") -> bool:
    """Whether ``grouping`` (``None``: the objective's own) asks for one rotation per KV head, refusing an
    unknown grouping and one the objective has no form for (see :func:`~.recipes.resolve_grouping`)."""
    return resolve_grouping(objective, grouping) == "kv_head"


def _resolve_workers(workers: int | None, n_layers: int) -> int:
    workers = check_workers(workers, "workers")
    if workers is None:
        workers = min(MAX_DEFAULT_WORKERS, torch.get_num_threads())
    return max(1, min(workers, n_layers))


def _fit_hadamard(source: Any, *, layers: Iterable[int] | None, num_layers: int | None, head_dim: int | None,
                  keep_first_chunk: bool, info: dict[str, Any], stats: FitStats, t0: float, signs: str) -> FitResult:
    """The data-free baseline: ``H_d`` for every layer, both sides."""
    model = info.get("model")
    shape: DumpShape | None = None
    if source is None:
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                       or not 1 <= num_layers <= MAX_LAYERS):
            raise FitError(f"num_layers must be an integer in [1, {MAX_LAYERS}] (the most layers a rotation file "
                           f"holds), got {str(num_layers)[:40]}")
        if layers is not None:
            ids = tuple(sorted({int(i) for i in layers}))
            if len(ids) > MAX_LAYERS or any(not 0 <= i < 1 << 31 for i in ids):
                raise FitError(f"layer ids must be at most {MAX_LAYERS} integers in [0, 2^31)")
            stray = [i for i in ids if i >= num_layers] if num_layers is not None else []
            if stray and num_layers is not None:
                raise FitError(f"layer {stray[0]} is not one of the {num_layers} layers num_layers names (ids 0 to "
                               f"{num_layers - 1}); give layer ids below num_layers (--num-layers), or leave it unset")
        elif num_layers is not None:
            ids = tuple(range(int(num_layers)))
        else:
            raise FitError("hadamard without a dump needs num_layers (--num-layers) or layer ids")
        if head_dim is None:
            raise FitError("hadamard without a dump needs head_dim (--head-dim)")
        d = int(head_dim)
        info.setdefault("kind", "none")
    else:
        dump = _as_dump(source, keep_first_chunk, layers)
        shape = dump.shape(("k",))
        if head_dim is not None and int(head_dim) != shape.head_dim:
            raise FitError(f"head_dim {head_dim} given, but the dump has head_dim {shape.head_dim}")
        ids, d = dump.layer_ids, shape.head_dim
        info.setdefault("kind", "dump")
        info.setdefault("path", str(dump.root))
        model = model or dump.info().get("model")
    _check_output(len(ids), d)
    h = hadamard_rotations(ids, d)
    stats.wall_s = time.perf_counter() - t0
    stats.peak_rss_bytes = peak_rss_bytes()
    v = RotationSet(rotations=h.stacked().clone(), layer_ids=h.layer_ids, objective="hadamard",
                    eigenvalues=h.stacked("eigenvalues").clone() if h.eigenvalues is not None else None)
    return FitResult(
        k=h, v=v, objective="hadamard", composition="none", group_size=None, targets={"k": None, "v": None},
        layer_ids=ids, head_dim=d, num_q_heads=shape.num_q_heads if shape else None,
        num_kv_heads=shape.num_kv_heads if shape else None, stats=stats, source=info, model=model,
        keep_first_chunk=keep_first_chunk, signs=signs,
    )


def _from_statistics(source: Mapping[int, LayerAccumulator], layers: Iterable[int] | None, targets: tuple[str, ...],
                     objective: str) -> dict[int, LayerAccumulator]:
    if layers is not None:
        wanted = {int(i) for i in layers}
        missing = sorted(wanted - set(source))
        if missing:
            raise FitError(f"no statistics for layer(s) {missing}")
        accs = {int(i): source[i] for i in sorted(wanted)}
    else:
        accs = {int(i): source[i] for i in sorted(source)}
    if not accs:
        raise FitError("no layer statistics to fit")
    for lid, acc in accs.items():
        missing_t = [t for t in targets if t not in acc.targets]
        if missing_t:
            raise FitError(f"layer {lid}: statistics lack target(s) {missing_t} needed by {objective!r}")
    return accs


def _from_dump(dump: Dump, shape: DumpShape, targets: tuple[str, ...], *, workers: int | None,
               device: torch.device | str, progress: Progress | None, stats: FitStats,
               per_head: bool = False, chunks: Mapping[int, tuple[int, ...]] | None = None
               ) -> dict[int, LayerAccumulator]:
    """Stream every layer of a dump through the accumulators (layers on a thread pool); progress
    counts the chunk reads of all layers. ``chunks``: only these chunks per layer (default: every used one)."""
    n_workers = _resolve_workers(workers, len(dump.layer_ids))
    stats.workers = n_workers
    workspaces: list[Any] = []
    picked = (lambda lid: chunks[lid]) if chunks is not None else (lambda lid: None)
    tally = Tally(progress, sum(layer_reads(dump, lid, targets, picked(lid)) for lid in dump.layer_ids)
                  if progress else 0, "reading the dump")
    tally.start()
    layer_progress = (lambda lid, done, total: tally.set(lid, done, f"layer {lid}")) if progress else None

    def run(layer_id: int) -> tuple[int, LayerAccumulator, dict[str, int]]:
        ws = thread_workspace(device)
        if ws not in workspaces:
            workspaces.append(ws)
        acc, io = accumulate_dump_layer(dump, layer_id, shape, targets, device=device, workspace=ws,
                                        progress=layer_progress, per_head=per_head, chunks=picked(layer_id))
        return layer_id, acc, io

    if n_workers == 1:
        results = [run(lid) for lid in dump.layer_ids]
    else:
        # one layer per worker, each with its share of the intra-op threads: independent
        # single-threaded GEMMs scale better (and degrade more gracefully on a busy machine)
        # than several multi-threaded GEMMs competing for the same cores
        threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, threads_before // n_workers))
        try:
            with ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="rotationzoo-fit") as pool:
                results = list(pool.map(run, dump.layer_ids))
        finally:
            torch.set_num_threads(threads_before)
    accs = {}
    for lid, acc, io in results:
        accs[lid] = acc
        stats.bytes_read += io["bytes_read"]
        stats.chunks_read += io["chunks_read"]
    stats.workspace_bytes = sum(ws.nbytes for ws in workspaces)
    return accs


def _open_source(source: Any, layers: Iterable[int] | None, targets: tuple[str, ...], objective: str,
                 keep_first_chunk: bool, info: dict[str, Any]) -> tuple[Any, DumpPlan | None]:
    """``(accumulators, None)`` for finished statistics, else ``(dump, plan)`` of an opened dump: every
    chunk the fit reads inspected, nothing loaded."""
    if isinstance(source, Mapping):
        info.setdefault("kind", "statistics")
        return _from_statistics(source, layers, targets, objective), None
    if source is None:
        raise FitError(f"objective {objective!r} needs a dump or captured statistics")
    dump = _as_dump(source, keep_first_chunk, layers, force_first=objective == V2_OBJECTIVE)
    info.setdefault("kind", "dump")
    info.setdefault("path", str(dump.root))
    if dump.tp_size is not None:
        info.setdefault("tp_size", dump.tp_size)
    return dump, dump.plan(kinds_for(targets))


def _v2_selection(dump: Dump, plan: DumpPlan, info: dict[str, Any]) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """The V2 recipe's chunks per layer (:func:`~.recipes.v2_chunks`) and their tokens, from the plan's metadata."""
    chunks = {lid: v2_chunks(plan.chunks[lid]) for lid in plan.chunks}
    tokens = {lid: sum(dump.meta(lid, "k", c).rows for c in ids) for lid, ids in chunks.items()}
    info["chunks"] = (f"the first {V2_MAX_CHUNKS} chunk files of each layer in lexicographic order, chunk 0 included "
                      "(the V2 recipe)")
    return chunks, tokens


def fit_rotations(
    source: str | os.PathLike[str] | Dump | Mapping[int, LayerAccumulator] | None,
    objective: str = "qqt_sst",
    composition: str | None = None,
    *,
    group_size: int | None = None,
    keep_first_chunk: bool = False,
    layers: Iterable[int] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
    signs: SignConvention = "canonical",
    device: torch.device | str = "cpu",
    num_layers: int | None = None,
    head_dim: int | None = None,
    source_info: Mapping[str, Any] | None = None,
    grouping: Grouping | None = None,
    min_tokens: int = DEFAULT_MIN_TOKENS,
    center: Center | None = None,
) -> FitResult:
    """Fit per-layer (or per-KV-head) K and V rotations.

    Args:
        source: a dump folder (SGLang layout, one folder per layer or per TP rank) or an opened
            :class:`Dump`; or finished :class:`LayerAccumulator` objects by layer id (live capture, see
            :mod:`rotationzoo.integrations.transformers`); or ``None`` for ``objective="hadamard"``
            with ``num_layers``/``layers`` and ``head_dim``.
        objective: ``"qqt_sst"`` (OSCAR), ``"ktk_vtv"``, ``"qqt"``, ``"sst"``, ``"ktk"``, ``"vtv"``,
            ``"hadamard"`` (data-free), or the authors' later recipes (:mod:`~.recipes`):
            ``"cov_eig_hadamard_perhead"`` (their V2 per-head fitter: raw ``KᵀK/n`` / ``VᵀV/n`` per
            KV head, ``U_desc·H``, from a dump the first 20 chunk files in lexicographic order with
            chunk 0), ``"oscar2_perhead"`` and ``"oscar2_center"`` (OSCAR-2: per-head ``M_q`` /
            ``S_v``, ``E·H·P_br``; ``center`` writes ``k_mean``).
        composition: one of :data:`~rotationzoo.vocab.COMPOSITIONS` (default ``"r_h_pbr"``, the
            authors' best); the recipes fix their own and refuse another.
        group_size: ``G`` for the ``r_pbr_hg`` composition.
        keep_first_chunk: use dump chunk 0 (the SGLang warm-up batch, skipped by default; the V2
            recipe always reads it).
        layers: fit only these layer ids.
        workers: layers processed concurrently (threads), each with
            ``torch.get_num_threads() // workers`` intra-op threads while the fit runs.
            Default: ``min(8, torch.get_num_threads(), number of layers)``.
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): chunk reads of
            every layer (``what``: ``"layer <L>"``), from the worker threads.
        signs: eigenvector signs, ``"canonical"`` (default) or ``"lapack"`` (as ``eigh`` returns).
        device: accumulation device (fp64 everywhere; ``eigh`` always runs on CPU).
        num_layers: layer count for ``hadamard`` without a dump (ids ``0 … num_layers−1``).
        head_dim: ``d`` for ``hadamard`` without a dump.
        source_info: extra facts recorded in :attr:`FitResult.source` (and the files' ``calibration``).
        grouping: ``"layer"`` (one rotation per layer) or ``"kv_head"`` (one per layer and KV head:
            ``[L, H_kv, d, d]`` sets); default ``"kv_head"`` for the recipes (``"layer"`` is the
            authors' ``--shared``; V2 has no shared form), ``"layer"`` otherwise; not for
            ``hadamard``. Finished statistics fit ktk / vtv per head only when accumulated per head
            (``LayerAccumulator(per_head=True)``).
        min_tokens: fewest tokens per layer to fit from (default :data:`DEFAULT_MIN_TOKENS`, 256);
            a dump is checked before any activation is read.
        center: ``"none"``, ``"k"`` (subtract each KV head's mean key before rotation, written as
            ``k_mean``) or ``"kv"`` (values too: ``v_mean``, the V rotation fitted on the centered
            values); default ``"k"`` for ``oscar2_center``, else ``"none"``. Only with the qqt / sst
            targets (``qqt_sst``, ``oscar2_center``).

    Returns:
        A :class:`FitResult` with fp32 rotation sets (fp64-accurate, validated to 1e-5).

    Raises:
        DumpError: a missing, inconsistent, partial or hostile dump (see ``docs/security.md``):
            refused from its files' metadata before any activation is read, or at the chunk holding
            NaN / Inf (or a replicated KV head that differs between TP ranks).
        FitError: bad arguments; fewer tokens than ``min_tokens``; a zero, rank-deficient or
            non-finite covariance; a rotation that is not orthogonal.
    """
    t0 = time.perf_counter()
    k_target, v_target = _parse_objective(objective)
    per_head = resolve_grouping(objective, grouping) == "kv_head"
    centered = resolve_center(objective, center, (k_target, v_target))
    stats = FitStats(device=str(torch.device(device)))
    info: dict[str, Any] = dict(source_info or {})
    check_workers(workers, "workers")  # 0 or a negative count is refused, never taken as auto
    comp = resolve_composition(objective, composition)  # bad arguments first, before any file is read
    if objective == "hadamard":
        return _fit_hadamard(source, layers=layers, num_layers=num_layers, head_dim=head_dim,
                             keep_first_chunk=keep_first_chunk, info=info, stats=stats, t0=t0, signs=signs)
    if comp != V2_COMPOSITION:
        check_composition(comp, group_size)
    min_tokens = check_min_tokens(min_tokens)
    targets = tuple(t for t in (k_target, v_target) if t is not None)
    model, prompts = info.get("model"), info.get("prompts")
    opened, plan = _open_source(source, layers, targets, objective, keep_first_chunk, info)
    if plan is None:
        accs = opened
        first = next(iter(accs.values()))
        d, hq, hkv = first.head_dim, first.num_q_heads, first.num_kv_heads
        _check_fit_shape(len(accs), d, hkv if per_head else 1, comp, group_size)
        check_tokens({lid: acc.num_tokens for lid, acc in accs.items()}, min_tokens)
    else:
        keep_first_chunk = opened.keep_first_chunk
        shape = plan.shape
        d, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
        _check_fit_shape(len(plan.tokens), d, hkv if per_head else 1, comp, group_size)
        chunks, tokens = _v2_selection(opened, plan, info) if objective == V2_OBJECTIVE else (None, plan.tokens)
        check_tokens(tokens, min_tokens)
        _check_cost(opened, plan, targets, per_head)
        dump_info = opened.info()
        for key, value in dump_provenance(dump_info).items():
            info.setdefault(key, value)
        model = model or dump_info.get("model")
        prompts = prompts if prompts is not None else dump_info.get("prompts", opened.prompt_count())
        accs = _from_dump(opened, shape, targets, workers=workers, device=device, progress=progress,
                          stats=stats, per_head=per_head, chunks=chunks)
    sides, covs = build_sets(accs, {"k": k_target, "v": v_target}, objective=objective, composition=comp,
                             group_size=group_size, signs=signs, d=d, per_head=per_head, center=centered)
    stats.wall_s = time.perf_counter() - t0
    stats.peak_rss_bytes = peak_rss_bytes()
    result = FitResult(
        k=sides["k"], v=sides["v"], objective=objective, composition=comp,
        group_size=int(group_size) if comp == "r_pbr_hg" and group_size is not None else None,
        targets={"k": k_target, "v": v_target}, layer_ids=tuple(accs), head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
        tokens={lid: acc.num_tokens for lid, acc in accs.items()}, prompts=prompts, covariances=covs, stats=stats,
        source=info, model=model, keep_first_chunk=keep_first_chunk, signs=signs, center=centered,
        means=fitted_means(accs),
    )
    result.attach_calibration()
    return result
