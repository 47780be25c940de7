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
from ..format import MAX_BYTES, MAX_HEAD_DIM, MAX_LAYERS, RotationSet
from ..progress import Progress, Tally
from ..validation import validate
from ..vocab import GROUPINGS, Grouping, SignConvention
from .accumulate import LayerAccumulator, kinds_for, statistics_bytes
from .compose import check_composition, check_head_dim, composition_label, hadamard_rotations, rotation_from_covariance
from .dump import Dump, DumpPlan, DumpShape, open_dump
from .dump_schema import MIN_HEAD_DIM
from .stream import accumulate_dump_layer, layer_reads, thread_workspace
from .result import OBJECTIVE_TARGETS, FitResult, FitStats, peak_rss_bytes
from .stream import accumulate_dump_layer, thread_workspace

#: Upper bound of the default number of concurrent layers (each holds one fp64 workspace).
MAX_DEFAULT_WORKERS = 8
#: Fewest tokens per layer a rotation is fitted from (``min_tokens``, ``--min-tokens``): one
#: calibration block of the learned refinement, twice the published head_dim. The published
#: rotations were fitted from 10,000 to 150,000 tokens per layer; below this the fit is noise.
DEFAULT_MIN_TOKENS = 256
#: A covariance whose smallest eigenvalue is at most this fraction of its largest is rank-deficient:
#: the directions it does not see would be rotated arbitrarily. fp64 rounding leaves a missing
#: direction near 1e-16 of the largest; real activations stay far above 1e-10.
RANK_RTOL = 1e-10


def _parse_objective(objective: str) -> tuple[str | None, str | None]:
    if objective not in OBJECTIVE_TARGETS:
        raise FitError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVE_TARGETS)}")
    return OBJECTIVE_TARGETS[objective]


def _as_dump(source: Any, keep_first_chunk: bool, layers: Iterable[int] | None) -> Dump:
    """Open a dump path; an opened :class:`Dump` keeps its own chunk-0 rule and limits (``layers`` still applies)."""
    if isinstance(source, Dump):
        if layers is None:
            return source
        return open_dump(source.root, keep_first_chunk=source.keep_first_chunk, layers=layers, limits=source.limits)
    return open_dump(source, keep_first_chunk=keep_first_chunk, layers=layers)


def check_min_tokens(min_tokens: Any) -> int:
    """``min_tokens`` as a positive int (a :class:`FitError` otherwise)."""
    if type(min_tokens) is not int or min_tokens < 1:
        raise FitError(f"min_tokens must be a positive integer (tokens per layer), got {min_tokens!r:.40}")
    return min_tokens


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


def check_grouping(grouping: str, objective: str | None = None) -> bool:
    """Whether ``grouping`` asks for one rotation per KV head (refusing an unknown grouping, and
    ``kv_head`` with the data-free ``hadamard`` objective)."""
    if grouping not in GROUPINGS:
        raise FitError(f"unknown grouping {grouping!r}; expected one of {', '.join(GROUPINGS)}")
    if grouping == "kv_head" and objective == "hadamard":
        raise FitError("objective 'hadamard' is data-free and the same for every KV head; use grouping='layer'")
    return grouping == "kv_head"


def _resolve_workers(num_workers: int | None, n_layers: int) -> int:
    if num_workers is None:
        num_workers = min(MAX_DEFAULT_WORKERS, torch.get_num_threads())
    if int(num_workers) < 1:
        raise FitError(f"num_workers must be ≥ 1, got {num_workers}")
    return max(1, min(int(num_workers), n_layers))


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


def _from_dump(dump: Dump, shape: DumpShape, targets: tuple[str, ...], *, num_workers: int | None,
               device: torch.device | str, progress: Progress | None, stats: FitStats,
               per_head: bool = False) -> dict[int, LayerAccumulator]:
    """Stream every layer of a dump through the accumulators (layers on a thread pool); progress
    counts the chunk reads of all layers."""
    n_workers = _resolve_workers(num_workers, len(dump.layer_ids))
    stats.num_workers = n_workers
    workspaces: list[Any] = []
    tally = Tally(progress, sum(layer_reads(dump, lid, targets) for lid in dump.layer_ids) if progress else 0,
                  "reading the dump")
    tally.start()
    layer_progress = (lambda lid, done, total: tally.set(lid, done, f"layer {lid}")) if progress else None

    def run(layer_id: int) -> tuple[int, LayerAccumulator, dict[str, int]]:
        ws = thread_workspace(device)
        if ws not in workspaces:
            workspaces.append(ws)
        acc, io = accumulate_dump_layer(dump, layer_id, shape, targets, device=device, workspace=ws,
                                        progress=layer_progress, per_head=per_head)
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


_ZERO_HINT = {"qqt": "all-zero queries", "ktk": "all-zero keys", "vtv": "all-zero values",
              "sst": "all-zero values, or keys no query attends to (all-zero keys)"}


def _rotation(c: torch.Tensor, acc: LayerAccumulator, target: str, head: int | None, composition: str,
              group_size: int | None, signs: SignConvention) -> tuple[torch.Tensor, torch.Tensor]:
    """One covariance's rotation and eigenvalues, refused when the covariance is zero or rank-deficient:
    a rotation of directions the data never shows is arbitrary, and would still load and serve."""
    what = f"layer {acc.layer_id} {target}" if head is None else f"layer {acc.layer_id} KV head {head} {target}"
    d = int(c.shape[-1])
    if not float(torch.diagonal(c).sum()) > 0:  # the trace of a PSD matrix: 0 only for 0 (NaN refused below)
        if bool(torch.isfinite(c).all()):
            raise FitError(f"{what}: the covariance is zero ({_ZERO_HINT[target]}); there is nothing to fit a "
                           "rotation to (re-dump the model)")
    r, lam = rotation_from_covariance(c, composition, group_size=group_size, signs=signs, what=what)
    rank = int((lam > RANK_RTOL * float(lam[-1])).sum()) if float(lam[-1]) > 0 else 0
    if rank < d:
        t = acc.num_tokens
        heads = (acc.group if head is not None else acc.num_q_heads) if target == "qqt" else \
            (1 if head is not None else acc.num_kv_heads)
        rows = t * int(heads or 1)
        few = f", fewer than head_dim {d}" if rows < d else ""
        raise FitError(f"{what}: the covariance has rank {rank} of {d}: {d - rank} directions never occur in the data "
                       f"and would be rotated arbitrarily. It comes from {rows} rows ({t} tokens x {heads} heads){few}; "
                       "fit on more tokens (or the data has channels that are always zero)")
    return r, lam


def _layer_rotation(acc: LayerAccumulator, lid: int, target: str, composition: str, group_size: int | None,
                    signs: SignConvention, per_head: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's symmetrised covariance, rotation and eigenvalues (each with a leading ``H_kv``
    axis when ``per_head``: every KV head's own covariance, eigendecomposed on its own)."""
    c = acc.covariance(target, per_head=per_head).to("cpu", torch.float64)
    c = (c + c.transpose(-1, -2)) / 2
    if not per_head:
        r, lam = _rotation(c, acc, target, None, composition, group_size, signs)
        return r, lam, c
    pairs = [_rotation(c[h], acc, target, h, composition, group_size, signs) for h in range(c.shape[0])]
    return torch.stack([r for r, _ in pairs]), torch.stack([lam for _, lam in pairs]), c


def _rotations(accs: Mapping[int, LayerAccumulator], side_targets: Mapping[str, str | None], composition: str,
               group_size: int | None, signs: SignConvention, d: int, per_head: bool = False
               ) -> tuple[dict[str, RotationSet | None], dict[str, torch.Tensor]]:
    """Per side: eigendecompose each layer's (or each KV head's) symmetrised covariance and compose its rotation."""
    ids = tuple(accs)
    sides: dict[str, RotationSet | None] = {"k": None, "v": None}
    covs: dict[str, torch.Tensor] = {}
    label = composition_label(composition, group_size)
    for side, target in side_targets.items():
        if target is None:
            continue
        done = [_layer_rotation(acc, lid, target, composition, group_size, signs, per_head) for lid, acc in accs.items()]
        rs = RotationSet(rotations=torch.stack([r for r, _, _ in done]).to(torch.float32).contiguous(), layer_ids=ids,
                         objective=f"{target}_{label}",
                         eigenvalues=torch.stack([lam for _, lam, _ in done]).to(torch.float32).contiguous(),
                         source_grouping="kv_head" if per_head else "layer")
        validate(rs, head_dim=d, layer_ids=ids)
        sides[side] = rs
        covs[side] = torch.stack([c for _, _, c in done])
    return sides, covs


def _open_source(source: Any, layers: Iterable[int] | None, targets: tuple[str, ...], objective: str,
                 keep_first_chunk: bool, info: dict[str, Any]) -> tuple[Any, DumpPlan | None]:
    """``(accumulators, None)`` for finished statistics, else ``(dump, plan)`` of an opened dump: every
    chunk the fit reads inspected, nothing loaded."""
    if isinstance(source, Mapping):
        info.setdefault("kind", "statistics")
        return _from_statistics(source, layers, targets, objective), None
    if source is None:
        raise FitError(f"objective {objective!r} needs a dump or captured statistics")
    dump = _as_dump(source, keep_first_chunk, layers)
    info.setdefault("kind", "dump")
    info.setdefault("path", str(dump.root))
    return dump, dump.plan(kinds_for(targets))


def fit_rotations(
    source: str | os.PathLike[str] | Dump | Mapping[int, LayerAccumulator] | None,
    objective: str = "qqt_sst",
    composition: str = "r_h_pbr",
    *,
    group_size: int | None = None,
    keep_first_chunk: bool = False,
    layers: Iterable[int] | None = None,
    num_workers: int | None = None,
    progress: Progress | None = None,
    signs: SignConvention = "canonical",
    device: torch.device | str = "cpu",
    num_layers: int | None = None,
    head_dim: int | None = None,
    source_info: Mapping[str, Any] | None = None,
    grouping: Grouping = "layer",
    min_tokens: int = DEFAULT_MIN_TOKENS,
) -> FitResult:
    """Fit per-layer (or per-KV-head) K and V rotations.

    Args:
        source: a dump folder (SGLang layout) or an opened :class:`Dump`; or finished
            :class:`LayerAccumulator` objects by layer id (live capture, see
            :mod:`rotationzoo.integrations.transformers`); or ``None`` for ``objective="hadamard"``
            with ``num_layers``/``layers`` and ``head_dim``.
        objective: ``"qqt_sst"`` (OSCAR), ``"ktk_vtv"``, ``"qqt"``, ``"sst"``, ``"ktk"``,
            ``"vtv"`` or ``"hadamard"`` (data-free).
        composition: one of :data:`~rotationzoo.vocab.COMPOSITIONS` (default ``"r_h_pbr"``, the authors' best).
        group_size: ``G`` for the ``r_pbr_hg`` composition.
        keep_first_chunk: use dump chunk 0 (the SGLang warm-up batch, skipped by default).
        layers: fit only these layer ids.
        num_workers: layers processed concurrently (threads), each with
            ``torch.get_num_threads() // num_workers`` intra-op threads while the fit runs.
            Default: ``min(8, torch.get_num_threads(), number of layers)``.
        progress: ``progress(done, total, what)`` (:mod:`rotationzoo.progress`): chunk reads of
            every layer (``what``: ``"layer <L>"``), from the worker threads.
        signs: eigenvector signs, ``"canonical"`` (default) or ``"lapack"`` (as ``eigh`` returns).
        device: accumulation device (fp64 everywhere; ``eigh`` always runs on CPU).
        num_layers: layer count for ``hadamard`` without a dump (ids ``0 … num_layers−1``).
        head_dim: ``d`` for ``hadamard`` without a dump.
        source_info: extra facts recorded in :attr:`FitResult.source`.
        grouping: ``"layer"`` (one rotation per layer, the authors' files) or ``"kv_head"`` (one per
            layer and KV head, each from that head's own covariance: ``[L, H_kv, d, d]`` sets with
            ``source_grouping = "kv_head"``; not for ``hadamard``). Finished statistics fit ktk /
            vtv per head only when accumulated per head (``LayerAccumulator(per_head=True)``).
        min_tokens: fewest tokens per layer to fit from (default :data:`DEFAULT_MIN_TOKENS`, 256);
            a dump is checked before any activation is read.

    Returns:
        A :class:`FitResult` with fp32 rotation sets (fp64-accurate, validated to 1e-5).

    Raises:
        DumpError: a missing, inconsistent or hostile dump (see ``docs/security.md``): refused from
            its files' metadata before any activation is read, or at the chunk holding NaN / Inf.
        FitError: bad arguments; fewer tokens than ``min_tokens``; a zero, rank-deficient or
            non-finite covariance; a rotation that is not orthogonal.
    """
    t0 = time.perf_counter()
    k_target, v_target = _parse_objective(objective)
    per_head = check_grouping(grouping, objective)
    stats = FitStats(device=str(torch.device(device)))
    info: dict[str, Any] = dict(source_info or {})
    if objective == "hadamard":
        return _fit_hadamard(source, layers=layers, num_layers=num_layers, head_dim=head_dim,
                             keep_first_chunk=keep_first_chunk, info=info, stats=stats, t0=t0, signs=signs)
    check_composition(composition, group_size)
    min_tokens = check_min_tokens(min_tokens)
    _resolve_workers(num_workers, 1)  # bad arguments first, before any file is read
    targets = tuple(t for t in (k_target, v_target) if t is not None)
    model, prompts = info.get("model"), info.get("prompts")
    opened, plan = _open_source(source, layers, targets, objective, keep_first_chunk, info)
    if plan is None:
        accs = opened
        first = next(iter(accs.values()))
        d, hq, hkv = first.head_dim, first.num_q_heads, first.num_kv_heads
        _check_fit_shape(len(accs), d, hkv if per_head else 1, composition, group_size)
        check_tokens({lid: acc.num_tokens for lid, acc in accs.items()}, min_tokens)
    else:
        keep_first_chunk = opened.keep_first_chunk
        shape = plan.shape
        d, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
        _check_fit_shape(len(plan.tokens), d, hkv if per_head else 1, composition, group_size)
        check_tokens(plan.tokens, min_tokens)
        _check_cost(opened, plan, targets, per_head)
        dump_info = opened.info()
        model = model or dump_info.get("model")
        prompts = prompts if prompts is not None else dump_info.get("prompts", opened.prompt_count())
        accs = _from_dump(opened, shape, targets, num_workers=num_workers, device=device, progress=progress,
                          stats=stats, per_head=per_head)
    sides, covs = _rotations(accs, {"k": k_target, "v": v_target}, composition, group_size, signs, d, per_head)
    stats.wall_s = time.perf_counter() - t0
    stats.peak_rss_bytes = peak_rss_bytes()
    return FitResult(
        k=sides["k"], v=sides["v"], objective=objective, composition=composition,
        group_size=int(group_size) if composition == "r_pbr_hg" and group_size is not None else None,
        targets={"k": k_target, "v": v_target}, layer_ids=tuple(accs), head_dim=d, num_q_heads=hq, num_kv_heads=hkv,
        tokens={lid: acc.num_tokens for lid, acc in accs.items()}, prompts=prompts, covariances=covs, stats=stats,
        source=info, model=model, keep_first_chunk=keep_first_chunk, signs=signs,
    )
