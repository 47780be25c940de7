"""Reference fitter: OSCAR rotations from post-RoPE Q/K/V, streamed in fp64.

Quick use::

    from rotationzoo.fit import fit_rotations, write_fitted

    result = fit_rotations("qkv_dumps/gpqa")                 # qqt_sst, r_h_pbr, chunk 0 skipped
    write_fitted(result, "rotations/", model="Qwen/Qwen3-8B", tag="gpqa-seq20000")
    # -> rotations/k_rotation_qqt_r_h_pbr.pt, rotations/v_rotation_sst_r_h_pbr.pt, rotations/rotationzoo.json

The math, normalisations and compositions are those of the authors' fitter
(``rotation/compute_kv_rotation.py``); see :mod:`rotationzoo.fit.accumulate` and
:mod:`rotationzoo.fit.compose`, and ``docs/fitting.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .._version import __version__
from ..errors import FitError
from ..format import RotationSet, write_rotation
from ..validation import sha256_file, validate
from .accumulate import TARGETS, LayerAccumulator, ProgressFn, accumulate_dump_layer, thread_workspace
from .compose import (
    AUTHOR_COMPOSITIONS,
    COMPOSITIONS,
    SignConvention,
    check_composition,
    composition_label,
    hadamard_rotations,
    rotation_from_covariance,
)
from .dump import Dump, DumpShape, DumpWriter, open_dump, write_dump

__all__ = [
    "AUTHOR_COMPOSITIONS",
    "COMPOSITIONS",
    "DEFAULT_CLIP_RATIOS",
    "MANIFEST_NAME",
    "OBJECTIVES",
    "TARGETS",
    "Dump",
    "DumpShape",
    "DumpWriter",
    "FitOutput",
    "FitResult",
    "FitStats",
    "LayerAccumulator",
    "fit_rotations",
    "hadamard_rotations",
    "open_dump",
    "output_file_names",
    "write_dump",
    "write_fitted",
]

#: objective → (K target, V target); ``None`` = that file is not produced.
OBJECTIVES: dict[str, tuple[str | None, str | None]] = {
    "qqt_sst": ("qqt", "sst"),
    "ktk_vtv": ("ktk", "vtv"),
    "qqt": ("qqt", None),
    "sst": (None, "sst"),
    "ktk": ("ktk", None),
    "vtv": (None, "vtv"),
    "hadamard": (None, None),
}
#: The authors' serving defaults (``rotation/eval_oscar_gpqa.sh``); stored in the manifest.
DEFAULT_CLIP_RATIOS: dict[str, float] = {"k": 0.96, "v": 0.92}
#: Upper bound of the default number of concurrent layers (each holds one fp64 workspace).
MAX_DEFAULT_WORKERS = 8
#: Manifest written next to the rotation files.
MANIFEST_NAME = "rotationzoo.json"


def _peak_rss_bytes() -> int:
    """Peak RSS of this process (``VmHWM`` on Linux, else ``getrusage``)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


@dataclass
class FitStats:
    """What a fit cost.

    Attributes:
        wall_s: wall time of :func:`fit_rotations`.
        bytes_read: activation bytes read from the dump (all passes).
        chunks_read: activation files read.
        workspace_bytes: peak bytes of the fp64 chunk workspaces (all workers): the fitter's own
            activation memory, independent of the dump size.
        peak_rss_bytes: the process's peak resident set size so far (includes everything the
            process did before).
        num_workers: layers processed concurrently.
        device: accumulation device.
    """

    wall_s: float = 0.0
    bytes_read: int = 0
    chunks_read: int = 0
    workspace_bytes: int = 0
    peak_rss_bytes: int = 0
    num_workers: int = 1
    device: str = "cpu"


@dataclass
class FitResult:
    """Fitted K and V rotation sets and what they were fitted on.

    Attributes:
        k: K rotations (``objective = "<target>_<composition>"``) or ``None`` when the objective
            fits only V.
        v: V rotations or ``None``.
        objective: e.g. ``"qqt_sst"`` or ``"hadamard"``.
        composition: e.g. ``"r_h_pbr"`` (``"none"`` for ``hadamard``).
        group_size: ``G`` for ``r_pbr_hg``.
        targets: ``{"k": "qqt", "v": "sst"}``.
        layer_ids: fitted layers, ascending.
        head_dim: ``d``.
        num_q_heads: ``H_q`` (``None`` if unknown).
        num_kv_heads: ``H_kv`` (``None`` if unknown).
        tokens: tokens fitted per layer (chunk 0 excluded unless kept).
        prompts: the dump's ``prompt<N>`` count, or the number of calibration sequences.
        covariances: ``{"k": fp64 [L, d, d], "v": ...}``, the symmetrised targets.
        stats: cost of the fit.
        source: where the activations came from (``{"kind": "dump", "path": ...}``, ...).
        model: model id recorded by the source, if any.
        keep_first_chunk: whether dump chunk 0 was used.
        signs: eigenvector sign convention.
    """

    k: RotationSet | None
    v: RotationSet | None
    objective: str
    composition: str
    group_size: int | None
    targets: dict[str, str | None]
    layer_ids: tuple[int, ...]
    head_dim: int
    num_q_heads: int | None = None
    num_kv_heads: int | None = None
    tokens: dict[int, int] = field(default_factory=dict)
    prompts: int | None = None
    covariances: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: FitStats = field(default_factory=FitStats)
    source: dict[str, Any] = field(default_factory=dict)
    model: str | None = None
    keep_first_chunk: bool = False
    signs: str = "canonical"

    @property
    def composition_label(self) -> str:
        """Composition as written in objective strings and file names (``r_pbr_hg32``, ...)."""
        if self.objective == "hadamard":
            return "hadamard"
        return composition_label(self.composition, self.group_size)

    @property
    def token_count(self) -> int:
        """Tokens fitted per layer (the smallest count when layers differ)."""
        return min(self.tokens.values()) if self.tokens else 0

    def side_objective(self, side: str) -> str:
        """The ``objective`` string stored in the K or V file (``"qqt_r_h_pbr"``, ``"hadamard"``)."""
        if self.objective == "hadamard":
            return "hadamard"
        target = self.targets.get(side)
        if target is None:
            raise FitError(f"objective {self.objective!r} produces no {side.upper()} rotations")
        return f"{target}_{self.composition_label}"

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description (no tensors)."""
        return {
            "objective": self.objective,
            "composition": self.composition_label,
            "group_size": self.group_size,
            "targets": self.targets,
            "layer_ids": list(self.layer_ids),
            "head_dim": self.head_dim,
            "num_q_heads": self.num_q_heads,
            "num_kv_heads": self.num_kv_heads,
            "tokens": self.token_count,
            "tokens_per_layer": {str(k): v for k, v in self.tokens.items()},
            "prompts": self.prompts,
            "keep_first_chunk": self.keep_first_chunk,
            "signs": self.signs,
            "source": self.source,
            "model": self.model,
            "stats": vars(self.stats).copy(),
        }


def _parse_objective(objective: str) -> tuple[str | None, str | None]:
    if objective not in OBJECTIVES:
        raise FitError(f"unknown objective {objective!r}; expected one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[objective]


def fit_rotations(
    source: str | os.PathLike[str] | Dump | Mapping[int, LayerAccumulator] | None,
    objective: str = "qqt_sst",
    composition: str = "r_h_pbr",
    *,
    group_size: int | None = None,
    keep_first_chunk: bool = False,
    layers: Iterable[int] | None = None,
    num_workers: int | None = None,
    progress: ProgressFn | None = None,
    signs: SignConvention = "canonical",
    device: torch.device | str = "cpu",
    num_layers: int | None = None,
    head_dim: int | None = None,
    source_info: Mapping[str, Any] | None = None,
) -> FitResult:
    """Fit per-layer K and V rotations.

    Args:
        source: a dump folder (SGLang layout) or an opened :class:`Dump`; or finished
            :class:`LayerAccumulator` objects by layer id (live capture, see
            :mod:`rotationzoo.integrations.transformers`); or ``None`` for ``objective="hadamard"``
            with ``num_layers``/``layers`` and ``head_dim``.
        objective: ``"qqt_sst"`` (OSCAR), ``"ktk_vtv"``, ``"qqt"``, ``"sst"``, ``"ktk"``,
            ``"vtv"`` or ``"hadamard"`` (data-free).
        composition: one of :data:`COMPOSITIONS` (default ``"r_h_pbr"``, the authors' best).
        group_size: ``G`` for the ``r_pbr_hg`` composition.
        keep_first_chunk: use dump chunk 0 (the SGLang warm-up batch, skipped by default).
        layers: fit only these layer ids.
        num_workers: layers processed concurrently (threads), each with
            ``torch.get_num_threads() // num_workers`` intra-op threads while the fit runs.
            Default: ``min(8, torch.get_num_threads(), number of layers)``.
        progress: ``progress(layer_id, done, total)`` after each chunk read.
        signs: eigenvector signs, ``"canonical"`` (default) or ``"lapack"`` (as ``eigh`` returns).
        device: accumulation device (fp64 everywhere; ``eigh`` always runs on CPU).
        num_layers: layer count for ``hadamard`` without a dump (ids ``0 … num_layers−1``).
        head_dim: ``d`` for ``hadamard`` without a dump.
        source_info: extra facts recorded in :attr:`FitResult.source`.

    Returns:
        A :class:`FitResult` with fp32 rotation sets (fp64-accurate, validated to 1e-5).

    Raises:
        DumpError: missing or inconsistent dump.
        FitError: bad arguments, or a covariance/rotation that is not finite or not orthogonal.
    """
    t0 = time.perf_counter()
    k_target, v_target = _parse_objective(objective)
    if objective != "hadamard":
        check_composition(composition, group_size)
    targets = tuple(t for t in (k_target, v_target) if t is not None)
    stats = FitStats(device=str(torch.device(device)))
    info: dict[str, Any] = dict(source_info or {})
    model = info.get("model")
    prompts = info.get("prompts")

    # ---- data-free --------------------------------------------------------------------------------
    if objective == "hadamard":
        if source is None:
            if layers is not None:
                ids = tuple(sorted({int(i) for i in layers}))
            elif num_layers is not None:
                ids = tuple(range(int(num_layers)))
            else:
                raise FitError("hadamard without a dump needs num_layers (--num-layers) or layer ids")
            if head_dim is None:
                raise FitError("hadamard without a dump needs head_dim (--head-dim)")
            d = int(head_dim)
            shape = None
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
        h = hadamard_rotations(ids, d)
        stats.wall_s = time.perf_counter() - t0
        stats.peak_rss_bytes = _peak_rss_bytes()
        return FitResult(
            k=h,
            v=RotationSet(rotations=h.rotations.clone(), layer_ids=h.layer_ids, objective="hadamard",
                          eigenvalues=h.eigenvalues.clone() if h.eigenvalues is not None else None),
            objective="hadamard",
            composition="none",
            group_size=None,
            targets={"k": None, "v": None},
            layer_ids=ids,
            head_dim=d,
            num_q_heads=shape.num_q_heads if shape else None,
            num_kv_heads=shape.num_kv_heads if shape else None,
            stats=stats,
            source=info,
            model=model,
            keep_first_chunk=keep_first_chunk,
            signs=signs,
        )

    # ---- statistics ---------------------------------------------------------------------------------
    accs: dict[int, LayerAccumulator]
    if isinstance(source, Mapping):
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
        first = next(iter(accs.values()))
        d, hq, hkv = first.head_dim, first.num_q_heads, first.num_kv_heads
        info.setdefault("kind", "statistics")
    elif source is None:
        raise FitError(f"objective {objective!r} needs a dump or captured statistics")
    else:
        dump = _as_dump(source, keep_first_chunk, layers)
        keep_first_chunk = dump.keep_first_chunk
        need_q = any(t in ("qqt", "sst") for t in targets)
        shape = dump.shape(("q", "k") if need_q else ("k", "v"))
        d, hq, hkv = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
        info.setdefault("kind", "dump")
        info.setdefault("path", str(dump.root))
        dump_info = dump.info()
        model = model or dump_info.get("model")
        if prompts is None:
            prompts = dump_info.get("prompts", dump.prompt_count())
        n_workers = _resolve_workers(num_workers, len(dump.layer_ids))
        stats.num_workers = n_workers
        workspaces = []

        def run(layer_id: int) -> tuple[int, LayerAccumulator, dict[str, int]]:
            ws = thread_workspace(device)
            if ws not in workspaces:
                workspaces.append(ws)
            acc, io = accumulate_dump_layer(dump, layer_id, shape, targets, device=device, workspace=ws, progress=progress)
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

    # ---- rotations ---------------------------------------------------------------------------------
    ids = tuple(accs)
    sides: dict[str, RotationSet | None] = {"k": None, "v": None}
    covs: dict[str, torch.Tensor] = {}
    label = composition_label(composition, group_size)
    for side, target in (("k", k_target), ("v", v_target)):
        if target is None:
            continue
        rots, eigs, cs = [], [], []
        for lid, acc in accs.items():
            c = acc.covariance(target).to("cpu", torch.float64)
            c = (c + c.T) / 2
            r, lam = rotation_from_covariance(
                c, composition, group_size=group_size, signs=signs, what=f"layer {lid} {target}"
            )
            rots.append(r)
            eigs.append(lam)
            cs.append(c)
        rs = RotationSet(
            rotations=torch.stack(rots).to(torch.float32).contiguous(),
            layer_ids=ids,
            objective=f"{target}_{label}",
            eigenvalues=torch.stack(eigs).to(torch.float32).contiguous(),
        )
        validate(rs, head_dim=d, layer_ids=ids)
        sides[side] = rs
        covs[side] = torch.stack(cs)
    stats.wall_s = time.perf_counter() - t0
    stats.peak_rss_bytes = _peak_rss_bytes()
    return FitResult(
        k=sides["k"],
        v=sides["v"],
        objective=objective,
        composition=composition,
        group_size=int(group_size) if composition == "r_pbr_hg" and group_size is not None else None,
        targets={"k": k_target, "v": v_target},
        layer_ids=ids,
        head_dim=d,
        num_q_heads=hq,
        num_kv_heads=hkv,
        tokens={lid: acc.num_tokens for lid, acc in accs.items()},
        prompts=prompts,
        covariances=covs,
        stats=stats,
        source=info,
        model=model,
        keep_first_chunk=keep_first_chunk,
        signs=signs,
    )


def _as_dump(source: Any, keep_first_chunk: bool, layers: Iterable[int] | None) -> Dump:
    """Open a dump path; an opened :class:`Dump` keeps its own chunk-0 rule (``layers`` still applies)."""
    if isinstance(source, Dump):
        if layers is None:
            return source
        return open_dump(source.root, keep_first_chunk=source.keep_first_chunk, layers=layers)
    return open_dump(source, keep_first_chunk=keep_first_chunk, layers=layers)


def _resolve_workers(num_workers: int | None, n_layers: int) -> int:
    if num_workers is None:
        num_workers = min(MAX_DEFAULT_WORKERS, torch.get_num_threads())
    if int(num_workers) < 1:
        raise FitError(f"num_workers must be ≥ 1, got {num_workers}")
    return max(1, min(int(num_workers), n_layers))


# -- writing ---------------------------------------------------------------------------------------


def output_file_names(result: FitResult, *, fmt: str = "pt") -> dict[str, str]:
    """The authors' file names: ``{"k": "k_rotation_qqt_r_h_pbr.pt", "v": "v_rotation_sst_r_h_pbr.pt"}``.

    ``hadamard`` gives ``k_rotation_hadamard.pt`` / ``v_rotation_hadamard.pt``; ``fmt="safetensors"``
    swaps the suffix.
    """
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    names = {}
    for side in ("k", "v"):
        if getattr(result, side) is not None:
            names[side] = f"{side}_rotation_{result.side_objective(side)}{suffix}"
    return names


@dataclass
class FitOutput:
    """Files written by :func:`write_fitted`.

    Attributes:
        paths: ``{"k": Path, "v": Path}`` of the rotation files.
        manifest_path: the ``rotationzoo.json`` path.
        manifest: its content.
    """

    paths: dict[str, Path]
    manifest_path: Path
    manifest: dict[str, Any]


def write_fitted(
    result: FitResult,
    out_dir: str | os.PathLike[str],
    *,
    model: str | None = None,
    tag: str | None = None,
    prompts: int | None = None,
    clip_ratios: Mapping[str, float] | None = None,
    fmt: str = "pt",
    extra: Mapping[str, Any] | None = None,
) -> FitOutput:
    """Validate, then write the rotation files and the ``rotationzoo.json`` manifest.

    Args:
        result: from :func:`fit_rotations`.
        out_dir: destination folder (created).
        model: model id for the manifest (default: what the source recorded).
        tag: calibration tag for the manifest (e.g. ``"gpqa-seq20000"``).
        prompts: prompt count for the manifest (default: ``result.prompts``).
        clip_ratios: ``{"k": 0.96, "v": 0.92}`` by default (the authors' serving defaults).
        fmt: ``"pt"`` (the authors' format) or ``"safetensors"``.
        extra: more manifest fields.

    Returns:
        A :class:`FitOutput`.

    Raises:
        InvalidRotationError: a set fails validation (nothing is written then).
    """
    if fmt not in ("pt", "safetensors"):
        raise FitError(f"unknown output format {fmt!r}; expected 'pt' or 'safetensors'")
    out = Path(out_dir)
    names = output_file_names(result, fmt=fmt)
    if not names:
        raise FitError("nothing to write: the result has neither K nor V rotations")
    sets = {side: getattr(result, side) for side in names}
    for side, rs in sets.items():  # everything validated before anything is written
        rs.objective = result.side_objective(side)
        validate(rs, layer_ids=result.layer_ids, head_dim=result.head_dim)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    files: dict[str, dict[str, Any]] = {}
    for side, rs in sets.items():
        p = write_rotation(out / names[side], rs, fmt=fmt)
        paths[side] = p
        files[side] = {"name": p.name, "objective": rs.objective, "sha256": sha256_file(p), "size": p.stat().st_size}
    ratios = dict(DEFAULT_CLIP_RATIOS)
    ratios.update(clip_ratios or {})
    tokens = result.token_count
    manifest: dict[str, Any] = {
        "manifest_version": 1,
        "model": model if model is not None else result.model,
        "tag": tag,
        "tokens": tokens,
        "prompts": prompts if prompts is not None else result.prompts,
        "head_dim": result.head_dim,
        "num_layers": len(result.layer_ids),
        "layer_ids": list(result.layer_ids),
        "num_q_heads": result.num_q_heads,
        "num_kv_heads": result.num_kv_heads,
        "objective": result.objective,
        "objectives": {side: files[side]["objective"] for side in files},
        "composition": result.composition_label,
        "group_size": result.group_size,
        "signs": result.signs,
        "keep_first_chunk": result.keep_first_chunk,
        "clip_ratio": {side: ratios[side] for side in ("k", "v")},
        "format": fmt,
        "format_version": 1,
        "source": result.source,
        "library": {"name": "rotationzoo", "version": __version__},
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "files": files,
    }
    if result.tokens and len(set(result.tokens.values())) > 1:
        manifest["tokens_per_layer"] = {str(k): v for k, v in result.tokens.items()}
    manifest.update(extra or {})
    mpath = out / MANIFEST_NAME
    fd, tmp = tempfile.mkstemp(prefix=f".{MANIFEST_NAME}.", dir=out)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, mpath)
    return FitOutput(paths=paths, manifest_path=mpath, manifest=manifest)

