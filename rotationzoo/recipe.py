"""What a fit is asked for, as one value: :class:`FitRecipe`, with an optional :class:`Refinement` and
:class:`KeepRule`.

``rotationzoo fit`` and ``rotationzoo calibrate`` turn their flags into a recipe and run it through
:func:`rotationzoo.workflows.fit_dump` and :func:`rotationzoo.workflows.calibrate`, which Python calls the same
way (the fitter's functions, :func:`rotationzoo.fit.fit_rotations` and :func:`rotationzoo.fit.refine_dump`, take
the recipe's fields); the fitted folder's ``rotationzoo.json`` records it (``recipe``: :meth:`FitRecipe.to_json`,
read back by :meth:`FitRecipe.from_json`)::

    from rotationzoo.recipe import FitRecipe, KeepRule, Refinement

    FitRecipe()                                             # OSCAR: qqt_sst, r_h_pbr, one rotation per layer
    FitRecipe(objective="oscar2_center")                    # the authors' OSCAR-2 recipe, k_mean written
    FitRecipe(grouping="kv_head", center="k", group_size=16,
              refine=Refinement(steps=100, init="oscar", int2kv=get_entry("Qwen3-8B").serving),
              keep=KeepRule(texts=("held_out.txt",)))       # learned, judged by the model on held-out text

:meth:`FitRecipe.check` makes every refusal a recipe can earn (an unknown objective, a composition a recipe
fixes, centering without the OSCAR targets, a refinement setting out of range, a keep rule without a
refinement, ...) before any dump is opened or model loaded; the rules it applies
(:func:`resolve_grouping`, :func:`resolve_center`, :func:`resolve_composition`) are the fitter's.

This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from .errors import ConfigError, FitError
from .int2kv import Int2KVConfig
from .numbers import check_int
from .vocab import (
    CENTERS,
    COMPOSITIONS,
    GROUPINGS,
    OBJECTIVES,
    REFINE_INITS,
    REFINE_LOSSES,
    REFINE_PARAMS,
    SIGN_CONVENTIONS,
    Center,
    Composition,
    Grouping,
    Objective,
    RefineInit,
    RefineLoss,
    RefineParam,
    SignConvention,
)

#: Covariance targets of each objective: ``(K target, V target)`` (``None``: that side is not fitted).
OBJECTIVE_TARGETS: dict[str, tuple[str | None, str | None]] = {
    "qqt_sst": ("qqt", "sst"),
    "ktk_vtv": ("ktk", "vtv"),
    "qqt": ("qqt", None),
    "sst": (None, "sst"),
    "ktk": ("ktk", None),
    "vtv": (None, "vtv"),
    "hadamard": (None, None),
    "cov_eig_hadamard_perhead": ("ktk", "vtv"),
    "oscar2_perhead": ("qqt", "sst"),
    "oscar2_center": ("qqt", "sst"),
}
#: The authors' V2 per-head fitter.
V2_OBJECTIVE = "cov_eig_hadamard_perhead"
#: The authors' orthogonal OSCAR-2 variants (their non-orthogonal ones are not fitted here).
OSCAR2_OBJECTIVES: tuple[str, ...] = ("oscar2_perhead", "oscar2_center")
#: Objectives whose composition, grouping and names are fixed by the authors' recipe.
RECIPES: tuple[str, ...] = (V2_OBJECTIVE, *OSCAR2_OBJECTIVES)
#: The composition label of the V2 recipe (``U_desc · H``); not a ``--composition`` choice.
V2_COMPOSITION = "r_desc_h"
#: Fewest tokens per layer a rotation is fitted from (``min_tokens``, ``--min-tokens``): one
#: calibration block of the learned refinement, twice the published head_dim. The published
#: rotations were fitted from 10,000 to 150,000 tokens per layer; below this the fit is noise.
DEFAULT_MIN_TOKENS = 256

#: Default optimizer steps per layer and side.
DEFAULT_STEPS = 200
#: Calibration tokens kept per layer for refinement (a reservoir of whole blocks; see :mod:`rotationzoo.fit.samples`).
DEFAULT_SAMPLE_TOKENS = 14336
#: Tokens per calibration block of the ``block`` loss.
DEFAULT_BLOCK_SIZE = 256
#: Calibration block length the served loss is meant for (its pairs need ``i − j > recent_tokens``).
SERVED_BLOCK_SIZE = 1024
#: The losses that count only the pairs that are INT2 when served (blocks of :data:`SERVED_BLOCK_SIZE`, drawn queries).
SERVED_LOSSES: tuple[str, ...] = ("served", "fisher")
#: Queries drawn per block by the served loss.
DEFAULT_QUERIES_PER_BLOCK = 64
#: Refinement init → the composition of the closed form it starts from (``None``: ``H_d``, data-free).
INIT_COMPOSITIONS: dict[str, str | None] = {"hadamard": None, "oscar": "r_h_pbr", "r_pbr_hg": "r_pbr_hg"}
#: Fewest tokens the keep rule judges on, and per window (``--keep-tokens`` / ``--keep-context``).
MIN_KEEP_TOKENS = 512
#: Most layers (or refinement jobs) a fit processes concurrently (``workers``, ``--workers``).
MAX_WORKERS = 1024


# -- the rules (the fitter applies the same) ------------------------------------------------------


def resolve_grouping(objective: str, grouping: str | None) -> str:
    """``grouping`` (``None``: per KV head for the recipes, per layer otherwise), checked against the objective."""
    if grouping is None:
        return "kv_head" if objective in RECIPES else "layer"
    if grouping not in GROUPINGS:
        raise FitError(f"unknown grouping {grouping!r}; expected one of {', '.join(GROUPINGS)}")
    if objective == V2_OBJECTIVE and grouping != "kv_head":
        raise FitError(f"{V2_OBJECTIVE} is the authors' per-head V2 recipe; it has no shared form (for one rotation "
                       "per layer from the raw moments use objective 'ktk_vtv')")
    if objective == "hadamard" and grouping == "kv_head":
        raise FitError("objective 'hadamard' is data-free and the same for every KV head; use grouping='layer'")
    return grouping


def resolve_center(objective: str, center: str | None, targets: tuple[str | None, str | None] | None = None) -> str:
    """``center`` (``None``: ``"k"`` for ``oscar2_center``, else ``"none"``), refused where it means nothing.

    ``targets``: the objective's covariance targets (default: :data:`OBJECTIVE_TARGETS`'s).
    """
    targets = OBJECTIVE_TARGETS.get(objective, (None, None)) if targets is None else targets
    if center is None:
        return "k" if objective == "oscar2_center" else "none"
    if center not in CENTERS:
        raise FitError(f"unknown center {center!r}; expected one of {', '.join(CENTERS)}")
    if center == "none":
        if objective == "oscar2_center":
            raise FitError("oscar2_center centers the keys; for no centering use objective 'oscar2_perhead'")
        return center
    if objective == "oscar2_perhead":
        raise FitError("oscar2_perhead does not center; key centering is objective 'oscar2_center' "
                       "(center='kv' there centers the values too)")
    if objective in (V2_OBJECTIVE, "hadamard") or targets[0] not in (None, "qqt") or targets[1] not in (None, "sst"):
        raise FitError(f"center={center!r} needs the OSCAR targets (qqt for K, sst for V): objective 'oscar2_center' "
                       f"or 'qqt_sst', not {objective!r}")
    if targets != ("qqt", "sst"):
        raise FitError(f"center={center!r} needs both keys and values read and both files written: use objective "
                       f"'qqt_sst' or 'oscar2_center', not {objective!r}")
    return center


def resolve_composition(objective: str, composition: str | None) -> str:
    """The composition an objective uses (``None``: ``r_h_pbr``; the recipes fix theirs; ``hadamard``: ``"none"``)."""
    if objective == "hadamard":
        if composition is not None:
            raise FitError(f"objective 'hadamard' is data-free (H_d for every layer): composition {composition!r} "
                           f"does not apply (--composition); leave it unset")
        return "none"
    if objective == V2_OBJECTIVE:
        if composition is not None:
            raise FitError(f"{V2_OBJECTIVE} composes U_desc·H as the authors' V2 fitter does; composition "
                           f"{composition!r} does not apply (leave it unset)")
        return V2_COMPOSITION
    if objective in OSCAR2_OBJECTIVES and composition not in (None, "r_h_pbr"):
        raise FitError(f"{objective} composes E·H·P_br (r_h_pbr) as the authors' OSCAR-2 fitter does; composition "
                       f"{composition!r} does not apply")
    comp = composition or "r_h_pbr"
    if comp not in COMPOSITIONS:
        raise FitError(f"unknown composition {comp!r}; expected one of {', '.join(COMPOSITIONS)}")
    return comp


def check_composition(composition: str, group_size: int | None = None, head_dim: int | None = None) -> None:
    """Raise :class:`FitError` for an unknown composition or a bad group size."""
    if composition not in COMPOSITIONS:
        raise FitError(f"unknown composition {composition!r}; expected one of {', '.join(COMPOSITIONS)}")
    if composition == "r_pbr_hg":
        if group_size is None:
            raise FitError("composition 'r_pbr_hg' needs a group size (group_size=G, --group-size G)")
        g = int(group_size)
        if g < 1 or g & (g - 1):
            raise FitError(f"group size {group_size} is not a power of two")
        if head_dim is not None and (g > head_dim or head_dim % g):
            raise FitError(f"group size {g} does not divide head_dim {head_dim}")


def check_min_tokens(min_tokens: Any) -> int:
    """``min_tokens`` as a positive int (a :class:`FitError` otherwise)."""
    if type(min_tokens) is not int or min_tokens < 1:
        raise FitError(f"min_tokens must be a positive integer (tokens per layer), got {min_tokens!r:.40}")
    return min_tokens


def check_trained_store(int2kv: Any) -> None:
    """Refuse an INT2 store refinement cannot train for (not an :class:`~rotationzoo.int2kv.Int2KVConfig`,
    Lloyd-Max levels, a clip search other than the exact one); a :class:`FitError` names the setting."""
    if not isinstance(int2kv, Int2KVConfig):
        raise FitError(f"int2kv must be an Int2KVConfig, got {type(int2kv).__name__}")
    if int2kv.lloyd_max:
        raise FitError("refinement learns against uniform INT2 levels; int2kv.lloyd_max=True is not modelled: "
                       "refine with lloyd_max=False (the rotations serve with either)")
    if int2kv.clip_search != "exact":
        raise FitError(f"refinement clips rows at their exact thresholds; int2kv.clip_search="
                       f"{int2kv.clip_search!r} is not modelled: refine with clip_search='exact'")


def check_workers(workers: Any, what: str = "workers") -> int | None:
    """``workers`` (layers or jobs processed concurrently): ``None`` (auto) or an integer from 1 to
    :data:`MAX_WORKERS`; a :class:`FitError` otherwise (0 or a negative count is never taken as auto)."""
    return None if workers is None else check_int(workers, what, low=1, high=MAX_WORKERS, error=FitError)


def _count(value: Any, what: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise FitError(f"{what} must be an integer ≥ {low}, got {value!r:.40}")


def _choice(value: Any, what: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise FitError(f"{what} must be one of {', '.join(choices)}, got {value!r:.40}")


# -- the recipe ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Refinement:
    """Learned rotations: what ``--refine STEPS --init NAME --loss L ...`` ask for.

    Attributes:
        steps: optimizer steps per layer and side (sweeps over the columns with ``param="signs"``).
        init: where every layer starts: ``"hadamard"`` (``H_d``), ``"oscar"`` (OSCAR's closed form
            ``U·H·P_br``, fitted from the full statistics) or ``"r_pbr_hg"`` (``U·P_br·H_G``).
        loss: ``"served"`` (the pairs that are INT2 when served) or ``"block"`` (every pair of a block).
        sample_tokens: calibration tokens kept per layer (a reservoir of whole blocks).
        seed: seeds the reservoir, the train/held-out split and the minibatches.
        block_size: tokens per calibration block (``None``: 1,024 for ``served``, 256 for ``block``).
        queries_per_block: queries drawn per block by the served loss (``None``: 64); a step's cost is linear in it.
        param: what is learned: the rotation (``expm``, ``cayley``) or only the init's column signs (``signs``).
        int2kv: the INT2 store the loss trains for (``None``: :class:`~rotationzoo.int2kv.Int2KVConfig`'s defaults):
            scale/zero dtype, windows, clip ratios and group size
            (a registry entry's ``serving`` settings, e.g.); the recipe's ``group_size``, when given, is its group.
        steps_v: V steps when they differ from ``steps`` (0: V stays at its init, as K-only recipes do).
    """

    steps: int = DEFAULT_STEPS
    init: RefineInit = "hadamard"
    loss: RefineLoss = "served"
    sample_tokens: int = DEFAULT_SAMPLE_TOKENS
    seed: int = 0
    block_size: int | None = None
    queries_per_block: int | None = None
    param: RefineParam = "expm"
    int2kv: Int2KVConfig | None = None
    steps_v: int | None = None

    def __post_init__(self) -> None:
        self.check()

    @property
    def blocks(self) -> int:
        """The calibration block length in effect."""
        if self.block_size is not None:
            return self.block_size
        return SERVED_BLOCK_SIZE if self.loss in SERVED_LOSSES else DEFAULT_BLOCK_SIZE

    def check(self) -> "Refinement":
        """Refuse anything out of range (a :class:`FitError`); ``self`` otherwise."""
        if self.init not in INIT_COMPOSITIONS:
            raise FitError(f"unknown init {self.init!r}; expected one of {', '.join(REFINE_INITS)}")
        _choice(self.loss, "loss", REFINE_LOSSES)
        _choice(self.param, "param", REFINE_PARAMS)
        _count(self.steps, "refinement steps", 0)
        if self.steps_v is not None:
            _count(self.steps_v, "steps_v", 0)
        _count(self.seed, "seed", 0)
        _count(self.sample_tokens, "sample_tokens", 1)
        if self.block_size is not None:
            _count(self.block_size, "block_size", 1)
            if not 16 <= self.block_size <= self.sample_tokens:
                raise FitError(f"block_size must be from 16 to sample_tokens ({self.sample_tokens}), got "
                               f"{self.block_size}")
        if self.queries_per_block is not None:
            if self.loss not in SERVED_LOSSES:
                raise FitError(f"queries_per_block is a setting of the served losses; drop it or use loss 'served' or 'fisher', not "
                               f"{self.loss!r}")
            _count(self.queries_per_block, "queries_per_block", 1)
        if self.sample_tokens < self.blocks:
            raise FitError(f"sample_tokens must be ≥ {self.blocks} (one block), got {self.sample_tokens}")
        if self.int2kv is not None:
            check_trained_store(self.int2kv)
        return self

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["int2kv"] = None if self.int2kv is None else self.int2kv.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Refinement":
        raw = dict(data)
        if raw.get("int2kv") is not None:
            raw["int2kv"] = Int2KVConfig.from_json(raw["int2kv"], where="recipe.refine.int2kv")
        return cls(**_known(cls, raw, "recipe.refine"))


@dataclass(frozen=True)
class KeepRule:
    """Judge the refined rotations on held-out text: the model runs the init, refined and mixed K/V pairs on
    ``tokens`` tokens of ``texts`` in windows of ``context`` tokens and keeps the lowest KL
    (:func:`rotationzoo.evaluate.keep.keep_by_text`).

    Attributes:
        texts: held-out text files (not the calibration text).
        tokens: held-out tokens judged (``None``: 4,096, at least one window); at least :data:`MIN_KEEP_TOKENS`.
        context: tokens per window (``None``: the context the refinement saw: the dump's longest prompt, or
            ``calibrate``'s ``seq_len``); at least :data:`MIN_KEEP_TOKENS`.
        model: the judge, a local transformers folder or ``.gguf`` file, for a fit from a dump (``None``: the
            SmolLM2-135M-Instruct GGUF, as ``rotationzoo eval``); ``calibrate`` judges with the model it runs.
        k_clip_ratio, v_clip_ratio: the clips the candidates are judged at, where they will be served at
            other clips than they were refined for (keys refined without a clip and served at 0.92, say);
            ``None``: the INT2 store the refinement trained for.
    """

    texts: tuple[str, ...]
    tokens: int | None = None
    context: int | None = None
    model: str | None = None
    k_clip_ratio: float | None = None
    v_clip_ratio: float | None = None

    def __post_init__(self) -> None:
        given: Any = self.texts
        if isinstance(given, (str, os.PathLike)):
            given = (given,)
        object.__setattr__(self, "texts", tuple(os.fspath(t) for t in given))
        if self.model is not None:
            object.__setattr__(self, "model", os.fspath(self.model))

    def check(self) -> "KeepRule":
        """Refuse a rule without texts or with counts out of range; ``self`` otherwise."""
        if not self.texts:
            raise FitError("the keep rule judges on held-out text; give at least one text file (--keep-text)")
        if self.tokens is not None:
            _count(self.tokens, "keep tokens (--keep-tokens)", MIN_KEEP_TOKENS)
        if self.context is not None:
            _count(self.context, "keep context (--keep-context)", MIN_KEEP_TOKENS)
        try:
            self.judged_store(Int2KVConfig())
        except ConfigError as e:
            raise FitError(f"the keep rule's clip (--keep-k-clip-ratio / --keep-v-clip-ratio): {e}") from None
        return self

    def judged_store(self, trained: Int2KVConfig) -> Int2KVConfig:
        """The INT2 store the candidates are judged in: ``trained`` with this rule's clips, where given."""
        return trained.replace(k_clip_ratio=self.k_clip_ratio, v_clip_ratio=self.v_clip_ratio)

    def to_json(self) -> dict[str, Any]:
        return {"texts": list(self.texts), "tokens": self.tokens, "context": self.context, "model": self.model,
                "k_clip_ratio": self.k_clip_ratio, "v_clip_ratio": self.v_clip_ratio}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "KeepRule":
        return cls(**_known(cls, data, "recipe.keep"))


@dataclass(frozen=True)
class FitRecipe:
    """Everything a fit is asked for, independent of where its data comes from.

    Attributes:
        objective: ``"qqt_sst"`` (OSCAR), ``"ktk_vtv"``, ``"qqt"``, ``"sst"``, ``"ktk"``, ``"vtv"``, ``"hadamard"``
            (data-free), or the authors' recipes ``"cov_eig_hadamard_perhead"``, ``"oscar2_perhead"``,
            ``"oscar2_center"`` (see :func:`rotationzoo.fit.fit_rotations`). A refinement's inits are
            ``qqt_sst`` fits: leave it at ``qqt_sst`` then.
        composition: ``None`` (``r_h_pbr``, or the recipe's own) or one of :data:`~rotationzoo.vocab.COMPOSITIONS`;
            not with a refinement (its ``init`` says where it starts), nor with ``"hadamard"`` (data-free).
        group_size: ``G`` of ``r_pbr_hg``; with a refinement, the INT2 group its loss trains for.
        grouping: ``"layer"`` or ``"kv_head"`` (``None``: ``kv_head`` for the recipes, else ``layer``).
        center: ``"none"``, ``"k"`` or ``"kv"`` (``None``: ``k`` for ``oscar2_center``, else ``none``).
        signs: eigenvector signs of the closed form, ``"canonical"`` or ``"lapack"``.
        min_tokens: fewest tokens per layer to fit from.
        refine: learn the rotations against the INT2 store's error (:class:`Refinement`), or ``None``.
        keep: judge the refinement on held-out text (:class:`KeepRule`), or ``None``; needs ``refine``.
    """

    objective: Objective = "qqt_sst"
    composition: Composition | None = None
    group_size: int | None = None
    grouping: Grouping | None = None
    center: Center | None = None
    signs: SignConvention = "canonical"
    min_tokens: int = DEFAULT_MIN_TOKENS
    refine: Refinement | None = None
    keep: KeepRule | None = None

    def check(self) -> "FitRecipe":
        """Make every refusal the recipe can earn, before any dump is opened or model loaded; ``self`` otherwise.

        Raises:
            FitError: an unknown name, a combination the fitter refuses (a composition a recipe fixes, a
                grouping or centering an objective has no form for, ``r_pbr_hg`` without a power-of-two group
                size), a refinement setting out of range or in conflict, a keep rule without a refinement.
        """
        if self.objective not in OBJECTIVES:
            raise FitError(f"unknown objective {self.objective!r}; expected one of {', '.join(OBJECTIVE_TARGETS)}")
        _choice(self.signs, "signs", SIGN_CONVENTIONS)
        check_min_tokens(self.min_tokens)
        if self.group_size is not None:
            _count(self.group_size, "group_size", 1)
        self.resolved_grouping()
        if self.refine is not None:
            self._check_refinement(self.refine)
        else:
            self.resolved_center()
            comp = resolve_composition(self.objective, self.composition)
            if self.objective != "hadamard" and comp != V2_COMPOSITION:
                check_composition(comp, self.group_size)
        if self.keep is not None:
            if not isinstance(self.keep, KeepRule):
                raise FitError(f"keep must be a KeepRule, got {type(self.keep).__name__}")
            if self.refine is None:
                raise FitError("the keep rule judges a refinement's result; give refine=Refinement(...) "
                               "(--refine STEPS)")
            self.keep.check()
        return self

    def _check_refinement(self, refine: Refinement) -> None:
        if not isinstance(refine, Refinement):
            raise FitError(f"refine must be a Refinement, got {type(refine).__name__}")
        refine.check()
        if self.objective != "qqt_sst":
            raise FitError("refinement fits its OSCAR inits from qqt_sst statistics; leave objective at qqt_sst")
        if self.composition is not None:
            raise FitError(f"a refinement starts from its init ({refine.init!r}), not composition "
                           f"{self.composition!r}; leave composition unset")
        resolve_center("qqt_sst", self.center, ("qqt", "sst"))
        self.store()  # the group-size rule (the recipe's group_size, when given, is the store's group)

    # -- what the recipe resolves to ---------------------------------------------------------------

    def resolved_grouping(self) -> Grouping:
        """``"layer"`` or ``"kv_head"``: the given grouping, or the objective's own."""
        return "kv_head" if resolve_grouping("qqt_sst" if self.refine else self.objective, self.grouping) == "kv_head" \
            else "layer"

    def resolved_center(self) -> str:
        """``"none"``, ``"k"`` or ``"kv"``: the given centering, or the objective's own."""
        if self.refine is not None:
            return resolve_center("qqt_sst", self.center, ("qqt", "sst"))
        return resolve_center(self.objective, self.center)

    def store(self) -> Int2KVConfig:
        """The INT2 store a refinement trains for: ``refine.int2kv`` at the recipe's ``group_size`` when given.

        Raises:
            FitError: no refinement, or a group size no kernel runs.
        """
        if self.refine is None:
            raise FitError("only a refinement trains for an INT2 store; this recipe has no refine")
        cfg = self.refine.int2kv or Int2KVConfig()
        if self.group_size is None:
            return cfg
        try:
            return cfg.replace(group_size=self.group_size)
        except ConfigError as exc:
            raise FitError(str(exc)) from None

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The recipe as given (``None`` = the default), for the manifest's ``recipe``."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("refine", "keep")}
        out["refine"] = self.refine.to_json() if self.refine is not None else None
        out["keep"] = self.keep.to_json() if self.keep is not None else None
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "FitRecipe":
        """A recipe from :meth:`to_json` (e.g. a manifest's ``recipe``); unknown keys refused."""
        raw = _known(cls, data, "recipe")
        if raw.get("refine") is not None:
            raw["refine"] = Refinement.from_json(raw["refine"])
        if raw.get("keep") is not None:
            raw["keep"] = KeepRule.from_json(raw["keep"])
        return cls(**raw)

    def replace(self, **changes: Any) -> "FitRecipe":
        """A copy with some fields changed."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return FitRecipe(**values)


def _known(cls: Any, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise FitError(f"{where} must be a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise FitError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; expected {', '.join(sorted(names))}")
    return dict(data)


__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_TOKENS", "DEFAULT_QUERIES_PER_BLOCK", "DEFAULT_SAMPLE_TOKENS",
           "DEFAULT_STEPS", "INIT_COMPOSITIONS", "MAX_WORKERS", "MIN_KEEP_TOKENS", "OBJECTIVE_TARGETS",
           "OSCAR2_OBJECTIVES", "RECIPES", "SERVED_BLOCK_SIZE", "V2_COMPOSITION", "V2_OBJECTIVE", "FitRecipe", "KeepRule",
           "Refinement", "check_composition", "check_min_tokens", "check_trained_store", "check_workers",
           "resolve_center", "resolve_composition", "resolve_grouping"]
