"""What a fit returns: the rotation sets, what they were fitted on, and what the fit cost."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .._version import __version__
from ..errors import FitError
from ..files.format import RotationSet
from ..files.rotation_set import grouping_of
from ..int2kv import Int2KVConfig
from .compose import composition_label
from ..recipe import V2_COMPOSITION
from .recipes import side_objective

#: Target of a side the keep rule left at its init (its objective: ``refined_kept_init_<init>``).
KEPT_INIT = "kept_init"


def learned_objective(objective: str | None) -> bool:
    """Whether a file's ``objective`` names a rotation learned by refinement (``refined_k_served_score_…``).

    A learned rotation is fitted to the INT2 store's rounding, which is not symmetric under flipping
    the signs of its columns, so ``R·D`` is another, unlearned rotation; a closed form's column signs
    are a convention. A side the keep rule left at its init (``refined_kept_init_…``) is a closed form.
    """
    return objective is not None and objective.startswith("refined_") and not objective.startswith(f"refined_{KEPT_INIT}_")


def peak_rss_bytes() -> int:
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
        workers: layers processed concurrently.
        device: accumulation device.
    """

    wall_s: float = 0.0
    bytes_read: int = 0
    chunks_read: int = 0
    workspace_bytes: int = 0
    peak_rss_bytes: int = 0
    workers: int = 1
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
        covariances: ``{"k": fp64 [L, d, d], "v": ...}`` (``[L, H_kv, d, d]`` per KV head), the
            symmetrised targets.
        stats: cost of the fit.
        source: where the activations came from (``{"kind": "dump", "path": ...}``, ...).
        model: model id recorded by the source, if any.
        keep_first_chunk: whether dump chunk 0 was used.
        signs: eigenvector sign convention.
        refinement: for learned rotations (``objective = "refined"``, see
            :func:`rotationzoo.fit.refine_fit`): init, losses, steps, seed and the per-layer held-out
            losses, written to the manifest's ``refinement``; ``None`` otherwise.
        center: what the sets center: ``"none"``, ``"k"`` (K carries ``k_mean``), ``"kv"`` (V
            carries ``v_mean`` too).
        means: ``{"k": fp64 [L, H_kv, d], "v": ...}``, every KV head's mean key and value over the
            fitted tokens (a side is absent when its activations were not read).
        int2kv: the INT2-KV settings the rotations were fitted for (the refinement's
            ``config.int2kv``; for closed forms ``None``: :meth:`serving_config` gives the defaults at
            :attr:`group_size`), written once, as the manifest's ``int2kv`` block.
        init: for learned rotations, the ``(K, V)`` sets refinement started from (with the same
            means), what a keep rule judged on text may fall back to; not written.
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
    refinement: dict[str, Any] | None = None
    center: str = "none"
    means: dict[str, torch.Tensor] = field(default_factory=dict)
    int2kv: Int2KVConfig | None = None
    init: tuple[RotationSet, RotationSet] | None = None

    def serving_config(self) -> Int2KVConfig:
        """The INT2-KV settings to serve these rotations with: :attr:`int2kv`, else the defaults at the
        group size the fit depends on (``r_pbr_hg<G>``), else the defaults."""
        if self.int2kv is not None:
            return self.int2kv
        return Int2KVConfig(group_size=self.group_size) if self.group_size else Int2KVConfig()

    def calibration_record(self, model: str | None = None) -> dict[str, Any]:
        """The files' ``calibration`` dict, the keys of the authors' (``model_path``, ``model_revision``,
        ``prompt_sha256``, ``tokens``, ``global_q_heads``, ``global_kv_heads``, ``tp_size``, ``post_rope``,
        ``accumulator_dtype``) plus what rotationzoo knows of the source (``text_sha256``, ``prompts``, the
        dump's chunk rule, the fitter). No creation time: the same fit gives the same bytes (the manifest
        has ``created``)."""
        src = self.source
        out: dict[str, Any] = {
            "model_path": model if model is not None else self.model,
            "model_revision": src.get("model_revision"),
            "prompt_sha256": src.get("prompt_sha256"),
            "tokens": self.token_count,
            "global_q_heads": self.num_q_heads,
            "global_kv_heads": self.num_kv_heads,
            "tp_size": src.get("tp_size", 1),
            "post_rope": True,
            "accumulator_dtype": "float64",
        }
        extra = {"text_sha256": src.get("text_sha256"), "model_sha256": src.get("model_sha256"),
                 "prompts": self.prompts, "source": src.get("kind"), "keep_first_chunk": self.keep_first_chunk,
                 "chunks": src.get("chunks"), "fitter": f"rotationzoo {__version__}"}
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    def attach_calibration(self, model: str | None = None) -> None:
        """Set :meth:`calibration_record` on both sets (data-free ``hadamard`` sets get none)."""
        if self.objective == "hadamard":
            return
        record = self.calibration_record(model)
        for rs in (self.k, self.v):
            if rs is not None:
                rs.calibration = dict(record)

    @property
    def grouping(self) -> str:
        """``"kv_head"`` when the sets hold one rotation per layer and KV head (``[L, H_kv, d, d]``),
        else ``"layer"`` (``[L, d, d]``)."""
        return grouping_of(self.k, self.v)

    @property
    def composition_label(self) -> str:
        """Composition as written in objective strings and file names (``r_pbr_hg32``, ...;
        ``refined_<init>`` for learned rotations)."""
        if self.objective == "hadamard":
            return "hadamard"
        if self.objective == "refined":
            return f"refined_{self.composition}"
        if self.composition == V2_COMPOSITION:
            return V2_COMPOSITION
        return composition_label(self.composition, self.group_size)

    @property
    def token_count(self) -> int:
        """Tokens fitted per layer (the smallest count when layers differ)."""
        return min(self.tokens.values()) if self.tokens else 0

    def side_objective(self, side: str) -> str:
        """The ``objective`` string stored in the K or V file (``"qqt_r_h_pbr"``, ``"hadamard"``)."""
        if self.objective == "hadamard":
            return "hadamard"
        recipe = side_objective(self.objective, side)
        if recipe is not None:
            return recipe
        target = self.targets.get(side)
        if self.objective == "refined" and target is not None:
            return f"refined_{target}_{self.composition}"  # refined_k_logit_hadamard, refined_kept_init_hadamard
        if target is None:
            raise FitError(f"objective {self.objective!r} produces no {side.upper()} rotations")
        return f"{target}_{self.composition_label}"

    def summary(self) -> dict[str, Any]:
        """JSON-friendly description (no tensors)."""
        return {
            "objective": self.objective,
            "composition": self.composition_label,
            "grouping": self.grouping,
            "center": self.center,
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
            "refinement": self.refinement,
            "source": self.source,
            "model": self.model,
            "stats": vars(self.stats).copy(),
        }
