"""The authors' later fitting recipes, and centering: what each objective means beyond its targets.

Besides the covariance targets of :mod:`rotationzoo.fit.accumulate`, an objective fixes here

* **its composition**: ``cov_eig_hadamard_perhead`` (the authors' V2 per-head fitter,
  ``rotation/fit_perhead_rotation.py``) is ``U_desc · H`` — the eigenvectors of the head's own raw
  second moment ``XᵀX / n`` ordered by descending eigenvalue, times the normalised Hadamard, no
  bit-reversal permutation; the OSCAR-2 objectives (``rotation/tools/fit_oscar2_variants.py``) are
  ``E · H · P_br`` of the head's query metric ``M_q`` (unit-mean normalised) and of its score-weighted
  value covariance ``S_v``; the others take ``composition``;
* **its grouping**: the recipes are per KV head unless ``grouping="layer"`` (the authors'
  ``--shared``: the per-head moments averaged into one basis per layer); V2 is per head only;
* **its centering** (``center``: ``"none"``, ``"k"``, ``"kv"``): ``oscar2_center`` subtracts each
  KV head's mean key before the key rotation and writes it as ``k_mean`` (the key basis is the query
  metric's, unchanged); ``"kv"`` also stores values as ``v − μ_v`` (``v_mean``, fitted on the
  centered values' score-weighted covariance) — a rotationzoo extension the authors' engine does not
  read. Centering composes with the qqt / sst objectives too; ``oscar2_perhead`` and the V2 recipe
  never center;
* **the V2 recipe's chunks**: per layer, the chunk files in lexicographic path order, the first
  :data:`V2_MAX_CHUNKS`, chunk 0 (the warm-up batch) included, exactly as the authors' script globs
  them;
* **what the files say**: the objective strings (``cov_eig_hadamard_perhead`` on both sides;
  ``oscar2_perhead`` / ``oscar2_center`` for K and ``oscar2_v_pre_wo`` for V), the ``transform``
  dict of the OSCAR-2 layout and the file-name markers.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import FitError
from ..hadamard import hadamard_matrix
from ..recipe import OSCAR2_OBJECTIVES, RECIPES, V2_OBJECTIVE
from .compose import canonicalize_signs, symmetric_eigh

#: The V2 recipe reads the first this many chunk files of each layer (``--max-files 20``).
V2_MAX_CHUNKS = 20
#: The OSCAR-2 value objective (the orthogonal ``pre_wo`` metric, the only one fitted here).
OSCAR2_V_OBJECTIVE = "oscar2_v_pre_wo"


def v2_chunks(chunk_ids: Sequence[int], max_chunks: int = V2_MAX_CHUNKS) -> tuple[int, ...]:
    """The chunks the V2 recipe reads: ``sorted(glob("layer_L/k/*.pt"))[:20]``, i.e. the file names in
    lexicographic order (``0, 1, 10, 11, …, 19, 2, 20, …``), the first ``max_chunks``; returned ascending."""
    chosen = sorted(chunk_ids, key=lambda c: f"{c}.pt")[:max_chunks]
    return tuple(sorted(chosen))


def v2_rotation(cov: torch.Tensor, *, signs: str, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``R = U[:, argsort(λ, descending)] · H_d`` of one head's raw second moment (fp64).

    Returns:
        ``(R [d, d] fp64, eigenvalues [d] fp64 ascending)``.
    """
    lam, u = symmetric_eigh(cov, what=what)
    if signs == "canonical":
        u = canonicalize_signs(u)
    d = int(u.shape[-1])
    r = u[:, torch.argsort(lam, descending=True)] @ hadamard_matrix(d, dtype=torch.float64)
    err = float((r @ r.T - torch.eye(d, dtype=r.dtype)).abs().max())
    if not err <= 1e-10:
        raise FitError(f"{what}: composed rotation is not orthogonal (max|RRᵀ−I| = {err:.3e} in fp64)")
    return r, lam


def unit_mean(cov: torch.Tensor) -> torch.Tensor:
    """``C / (tr C / d)`` per matrix: the authors' unit-mean normalisation of the OSCAR-2 key metric
    (the eigenvectors are unchanged; the stored eigenvalues average 1)."""
    d = cov.shape[-1]
    tr = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)
    return cov / (tr / d).clamp_min(1e-300)[..., None, None]


def side_objective(objective: str, side: str) -> str | None:
    """The objective string a recipe writes in its K or V file (``None``: not a recipe)."""
    if objective == V2_OBJECTIVE:
        return V2_OBJECTIVE
    if objective in OSCAR2_OBJECTIVES:
        return objective if side == "k" else OSCAR2_V_OBJECTIVE
    return None


def transform(objective: str, side: str, center: str, target: str | None) -> dict[str, Any] | None:
    """The ``transform`` dict of a side (``None``: a plain V1 / V2 file). OSCAR-2 files always have one, as
    the authors write them; other objectives get one when that side is centered."""
    centered = center == "kv" or (center == "k" and side == "k")
    if objective in OSCAR2_OBJECTIVES:
        if side == "k":
            return {"key": objective.removeprefix("oscar2_"), "centered": centered, "orthogonal": True}
        return {"value": "pre_wo", "orthogonal": True, **({"centered": True} if centered else {})}
    if not centered:
        return None
    return {"key" if side == "k" else "value": target, "centered": True, "orthogonal": True}


def file_marker(objective: str, grouping: str, center: str) -> str:
    """The file-name marker that keeps a variant from overwriting or passing for another: ``-kv_head``
    (per-head form of a per-layer objective), ``-shared`` (per-layer form of a recipe), ``-center_k`` /
    ``-center_kv`` (centering beyond the objective's own)."""
    marker = ""
    if objective in RECIPES:
        marker += "-shared" if grouping == "layer" else ""
    elif grouping != "layer":
        marker += f"-{grouping}"
    own = "k" if objective == "oscar2_center" else "none"
    if center != own:
        marker += f"-center_{center}"
    return marker


__all__ = ["OSCAR2_V_OBJECTIVE", "V2_MAX_CHUNKS", 
           "file_marker", "side_objective", "transform",
           "unit_mean", "v2_chunks", "v2_rotation"]
