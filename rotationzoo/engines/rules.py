"""The checks every launch goes through, driven by the engine table: file kinds a target does not
read, knobs it does not take, models it does not serve (hybrid ones, other architectures), V-rotation
absorption, tensor-parallel ranks; and :func:`pair_input`, the one reading of a rotation pair that
:func:`rotationzoo.serving.launch_spec` and :meth:`RotationPair.serve_env` share."""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import ConfigError, RotationZooError, ServingError
from ..headdims import HeadDims
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from ..registry import get_model
from ..sharding import check_ep_size, kv_heads_per_rank
from ..vocab import FILE_KINDS
from .common import LatentLaunch, LaunchInput, RankHeads, llama_architecture
from .table import OPTIONS, EngineTarget, target

_KIND_TEXT = {
    "v1": "one rotation per layer",
    "v2": "per-KV-head rotations ([L, H_kv, d, d])",
    "v3": "a format_version 3 file",
    "k_mean": "key centering (k_mean)",
    "companions": "a non-orthogonal transform (q_rotation / o_rotation)",
    "v_mean": "value centering (v_mean, a rotationzoo extension)",
    "ragged": "layers of different head_dim or KV-head count",
    "lloyd_max": "Lloyd-Max INT2 levels",
    "mla": "an MLA latent rotation set (layer_<id>.pt files)",
}
#: What absorption cannot be used with: it folds one orthogonal R_V per layer into the weights.
NO_ABSORPTION = frozenset({"v2", "k_mean", "companions", "v_mean", "mla"})


def pair_kinds(sets: Any, config: Int2KVConfig | None = None) -> frozenset[str]:
    """What rotation sets hold (``{"k": RotationSet, …}`` or a pair's ``(side, set)`` items), as file kinds."""
    items = sets.items() if isinstance(sets, Mapping) else iter(sets)
    kinds: set[str] = set()
    for _, rs in items:
        kinds.add("v2" if rs.per_head else "v1")
        if rs.layout_version == 3:
            kinds.add("v3")
        if rs.k_mean is not None:
            kinds.add("k_mean")
        if rs.v_mean is not None:
            kinds.add("v_mean")
        if rs.q_rotation is not None or rs.o_rotation is not None or not rs.orthogonal:
            kinds.add("companions")
        if rs.ragged:
            kinds.add("ragged")
    if config is not None and config.lloyd_max:
        kinds.add("lloyd_max")
    return frozenset(kinds)


def refuse(t: EngineTarget, kinds: frozenset[str], source: str) -> None:
    """Refuse, in one line, rotations holding a kind ``t`` does not read (Lloyd-Max levels only get a note).

    Raises:
        ServingError: names the kind, the target, and where such files are served.
    """
    for kind in FILE_KINDS:
        if kind not in kinds or kind in t.reads or kind == "lloyd_max":
            continue
        if kind == "v_mean":
            hint = "serve them with rotationzoo.integrations.transformers, or fit without value centering"
        else:
            hint = "serve them with --engine sglang (the authors' current tree)"
            if kind == "v2":
                hint += ", or fit with --grouping layer"
        raise ServingError(f"{source}: {_KIND_TEXT[kind]} cannot be served by {t.name} ({t.title}), which does not "
                           f"read {'it' if kind in ('v3', 'k_mean', 'v_mean', 'mla') else 'them'}; {hint}")


def absorption(t: EngineTarget, kinds: frozenset[str], launch: LaunchConfig, requested: bool | None,
               calibrate: bool, source: str) -> tuple[bool, str | None]:
    """Whether V-rotation absorption is on, and a note when the entry's setting was overridden.

    A target that ``absorbs`` ``"always"`` (the May 2026 fork's reference line) absorbs unless asked not
    to. Otherwise absorption is the entry's setting, and off for per-KV-head, centered or non-orthogonal
    files and for start-up calibration: it folds one orthogonal ``R_V`` per layer into the weights
    (Qwen3-30B-A3B per head: GPQA 34.3 with it, 58.6 without).

    Raises:
        ServingError: absorption asked for (``--absorb-v-rotation``) where it is wrong.
    """
    if t.absorbs == "always":
        return (True if requested is None else requested), None
    bad = sorted(kinds & NO_ABSORPTION)
    why = ("start-up calibration keeps the V rotation at runtime" if calibrate else
           f"the rotations hold {', '.join(_KIND_TEXT[k] for k in bad)}") if (calibrate or bad) else None
    if requested and why:
        raise ServingError(f"{source}: --absorb-v-rotation folds one orthogonal R_V per layer into the weights, but "
                           f"{why}; serve without it (Qwen3-30B-A3B per head: GPQA 34.3 with absorption, 58.6 "
                           "without)")
    wanted = launch.absorb_v_rotation if requested is None else requested
    if wanted and why:
        return False, f"SGLANG_OSCAR_ABSORB_V_ROTATION=0 although the entry asks for absorption: {why}"
    return wanted, None


def rank_heads(kv_head_counts: tuple[int, ...], tp_size: int) -> tuple[RankHeads, ...]:
    """The KV heads of each rank for every distinct head count (the authors' rule, :func:`kv_heads_per_rank`).

    Raises:
        ConfigError: heads that cannot be split over ``tp_size`` ranks (one line, with sizes that work).
    """
    out: list[RankHeads] = []
    for h in dict.fromkeys(kv_head_counts):
        out += [RankHeads(r, heads, h) for r, heads in enumerate(kv_heads_per_rank(h, tp_size))]
    return tuple(sorted(out, key=lambda r: (r.rank, r.of)))


_SWITCHES = frozenset({"disable_radix_cache", "calibrate"})
#: Values of a knob that ask for nothing a target must take (EP 1: no expert parallelism).
_ASKS_NOTHING = {"ep_size": 1}


def check_options(t: EngineTarget, **given: Any) -> None:
    """Refuse an option ``t`` does not take (:data:`~.table.OPTIONS`): one given, not ``None`` (for the
    on/off switches ``disable_radix_cache`` and ``calibrate``, one that is on).

    Raises:
        ServingError: one line naming the option and those the target takes.
    """
    for knob in OPTIONS:
        value = given.get(knob)
        asked = bool(value) if knob in _SWITCHES else value not in (None, _ASKS_NOTHING.get(knob))
        if asked and knob not in t.options:
            takes = [_flag(o) for o in OPTIONS if o in t.options]
            raise ServingError(f"{_flag(knob)} does not apply to {t.name} ({t.title})"
                               + (f"; it takes {', '.join(takes)}" if takes else "")
                               + ("; start-up calibration is a feature of --engine sglang" if knob == "calibrate"
                                  else ""))


def prepare(t: EngineTarget, *, config: Int2KVConfig, launch: LaunchConfig, paths: Mapping[str, str] | None,
            model: str, head_dims: HeadDims | None, kinds: frozenset[str], source: str,
            kv_head_counts: tuple[int, ...] = (), model_kv_heads: int | None = None, tp_size: int | None = None,
            ep_size: int | None = None, absorb_v_rotation: bool | None = None, disable_radix_cache: bool | None = None,
            calibrate: bool = False, block_size: int | None = None, hybrid: bool = False,
            model_path: str | None = None, latent: LatentLaunch | None = None,
            k_clip_per_layer: str | None = None, k_clip_per_head: str | None = None,
            model_id: str | None = None, architecture: Any = None) -> LaunchInput:
    """Check the request against ``t`` and the files, apply the overrides, and decide absorption and sharding.

    ``kv_head_counts`` are the KV-head counts of a per-KV-head file's layers (empty for one rotation
    per layer); ``model_kv_heads`` the model's, when known; ``hybrid`` whether the model mixes
    attention with linear-attention layers; ``latent`` an MLA latent set launched instead of K/V files;
    ``model_id`` the registry model the rotations are for, when known (:func:`check_architecture`);
    ``architecture`` its entry's, when the pair has one (else the registry's for ``model_id``), whose TP rule
    a ``tp_size`` or ``ep_size`` must pass.

    Raises:
        ServingError: a knob the target does not take, rotations or a model it cannot serve, absorption
            where it is wrong.
        ConfigError: a TP size outside 1 … 1024, an EP size that does not divide it, or sizes the KV heads or the
            registry model's block-quantized MoE weights cannot be split over
            (:meth:`~rotationzoo.registry.model.Architecture.check_tp_size`).
    """
    check_options(t, tp_size=tp_size, ep_size=ep_size, absorb_v_rotation=absorb_v_rotation, disable_radix_cache=disable_radix_cache,
                  calibrate=calibrate, block_size=block_size, k_clip_per_layer=k_clip_per_layer,
                  k_clip_per_head=k_clip_per_head)
    if latent is not None and (calibrate or absorb_v_rotation):
        raise ServingError(f"{source}: {'--calibrate' if calibrate else '--absorb-v-rotation'} is for K/V rotations; "
                           "an MLA latent set is served as it is")
    refuse(t, kinds, source)
    if hybrid and not t.hybrid_models and latent is None:
        raise ServingError(f"{source}: the model mixes attention with linear-attention layers (a hybrid model), "
                           f"which {t.name} ({t.title}) does not serve; serve it with --engine sglang")
    if latent is None:
        check_architecture(t, model_id, source)
    check_expert_parallel(t, launch, source, tp_size=tp_size, ep_size=ep_size)
    lc = launch.replace(tp_size=tp_size, ep_size=ep_size, disable_radix_cache=disable_radix_cache or None)
    asked = tp_size is not None or ep_size is not None  # an entry's own launch sizes were checked when read
    model_rules = (architecture or _model_architecture(model_id)) if asked else None
    if model_rules is not None:  # the model's TP rule
        model_rules.check_tp_size(lc.tp_size, lc.ep_size, t.expert_parallel)
    absorb, note = absorption(t, kinds, lc, absorb_v_rotation, calibrate, source)
    counts = kv_head_counts or ((model_kv_heads,) if model_kv_heads and latent is None else ())
    ranks = rank_heads(counts, lc.tp_size) if counts else ()
    return LaunchInput(config=config, launch=lc, paths=paths, model=model, head_dims=head_dims, kinds=kinds,
                       per_head_kv_heads=kv_head_counts[0] if kv_head_counts else None, absorb=absorb,
                       absorb_note=note, ranks=ranks, sharded=bool(kv_head_counts), calibrate=calibrate,
                       model_kv_heads=model_kv_heads, hybrid=hybrid, block_size=block_size,
                       model_path=model_path, latent=latent, k_clip_per_layer=k_clip_per_layer,
                       k_clip_per_head=k_clip_per_head, model_id=model_id)


def check_expert_parallel(t: EngineTarget, launch: LaunchConfig, source: str, *, tp_size: int | None = None,
                          ep_size: int | None = None) -> None:
    """Refuse, in one line, the expert-parallel size of ``launch`` with the overrides ``tp_size`` / ``ep_size``
    that ``t`` cannot launch: vLLM's spans every TP rank (1 or the TP size), SGLang's takes a divisor of the TP
    size, and a target with TP but no expert parallelism cannot serve an entry whose recipe uses it (printing TP
    alone would split the MoE weights the recipe splits over TP / EP ranks). llama.cpp has no TP: not checked.

    Raises:
        ServingError: an entry's expert parallelism on a target without it (naming ``--engine sglang``).
        ConfigError: a size the target's kind of expert parallelism does not take, naming those it does.
    """
    if "tp_size" not in t.options:
        return
    tp = tp_size if tp_size is not None else launch.tp_size
    ep = ep_size if ep_size is not None else launch.ep_size
    if ep == 1:
        return
    if t.expert_parallel == "none":  # only an entry's own: a flag was refused by check_options
        raise ServingError(f"{source}: the recipe serves with expert parallelism (ep_size {ep}), which {t.name} "
                           f"({t.title}) does not launch; serve it with --engine sglang")
    try:
        check_ep_size(ep, tp, t.expert_parallel)
    except ConfigError as exc:
        where = "" if tp_size is not None else f" (the entry's TP {tp}: give --tp to change it)"
        raise ConfigError(f"{t.name}: {exc}{where}") from None


def check_architecture(t: EngineTarget, model_id: str | None, source: str) -> None:
    """Refuse, in one line, a registry model ``t`` does not serve (:attr:`EngineTarget.architectures`, by the
    llama.cpp architecture its registry entry declares (``architecture.gguf_architecture``) or else its id
    names); any model when the target lists none, or the model is unknown.

    Raises:
        ServingError: names the model's architecture and the ones the target serves.
    """
    if t.architectures is None or model_id is None:
        return
    arch = _declared_gguf_architecture(model_id) or llama_architecture(model_id)
    if arch in t.architectures:
        return
    short = [what.split(" (")[0] for what in t.architectures.values()]
    desc = f"a {arch} model" if arch else f"not a {' or '.join(short)} model"
    raise ServingError(f"{source}: {model_id} is {desc}; {t.name} ({t.title}) rotates the KV cache of "
                       f"{' and '.join(t.architectures.values())} models only (general.architecture "
                       f"{', '.join(t.architectures)}); serve it with --engine sglang")


def _model_architecture(model_id: str | None) -> Any:
    """The registry's ``Architecture`` of ``model_id`` (``None``: not a registry model, or an MLA latent set's)."""
    if model_id is None:
        return None
    try:
        return get_model(model_id).architecture
    except RotationZooError:
        return None


def _declared_gguf_architecture(model_id: str) -> str | None:
    """The registry's ``architecture.gguf_architecture`` of ``model_id``, when it names one."""
    return getattr(_model_architecture(model_id), "gguf_architecture", None)


def known_model(pair: Any) -> str | None:
    """The registry model a pair is for: its entry's, or the registry model its files record; else ``None``."""
    if pair.entry is not None:
        return str(pair.entry.model_id)
    recorded = pair.model
    if not recorded:
        return None
    try:
        return get_model(str(recorded)).id
    except RotationZooError:
        return None


def pair_files(pair: Any) -> dict[str, str]:
    """A pair's local K and V files, as absolute paths (a launch from another folder reads the same files).

    Raises:
        ServingError: a side without a local file.
    """
    missing = [s for s in ("k", "v") if s not in pair.sets or s not in pair.paths]
    if missing:
        raise ServingError(f"{pair.source or 'rotations'}: a launch needs local K and V rotation files (missing "
                           f"{', '.join(missing)})")
    return {s: os.path.abspath(pair.paths[s]) for s in ("k", "v")}


def pair_input(t: EngineTarget, pair: Any, *, model: str, config: Int2KVConfig | None = None,
               paths: Mapping[str, str] | None = None, **knobs: Any) -> LaunchInput:
    """The :class:`LaunchInput` of a :class:`~rotationzoo.files.pair.RotationPair` on ``t``: the one reading of a
    pair that :func:`rotationzoo.serving.launch_spec` and :meth:`RotationPair.serve_env` share. Its files
    (:func:`pair_files`, or ``paths``), what they hold, its INT2 settings (or ``config``), its registry entry's
    launch knobs and model (KV heads, hybrid layers, architecture: :func:`known_model`), and ``knobs``
    (``tp_size``, ``model_path``, K clip tables …) go to :func:`prepare`.

    Raises:
        ServingError, ConfigError: as :func:`pair_files` and :func:`prepare`.
    """
    files = dict(paths) if paths is not None else pair_files(pair)
    cfg = config if config is not None else pair.config()
    entry = pair.entry
    arch = entry.architecture if entry is not None else None
    return prepare(t, config=cfg, launch=entry.launch if entry is not None else LaunchConfig(), paths=files,
                   model=model, head_dims=pair.head_dims, kinds=pair_kinds(pair, cfg),
                   source=pair.source or "rotations", kv_head_counts=kv_head_counts(pair),
                   model_kv_heads=arch.num_kv_heads if arch is not None else None,
                   hybrid=bool(arch is not None and arch.attention_layer_ids), model_id=known_model(pair),
                   architecture=arch, **knobs)


def _flag(knob: str) -> str:
    """The ``serve-args`` flag of a launch knob (``tp_size`` → ``--tp-size``)."""
    return "--" + knob.replace("_", "-")


def serve_env(config: Int2KVConfig, engine: str, paths: Mapping[str, str | os.PathLike[str]],
              head_dim: int | None = None, *, pair: Any = None) -> dict[str, str]:
    """Environment variables for ``engine`` given INT2-KV settings and local ``paths`` ``{"k", "v"}``.

    Args:
        config: the serving settings (``entry.serving`` or ``pair.config()``).
        engine: a target of :data:`~rotationzoo.engines.TARGETS` (``"sglang"``, ``"sglang-legacy"``,
            ``"vllm"``, ``"vllm-prototype"``, ``"llamacpp"``).
        paths: local rotation files ``{"k": path, "v": path}``, printed as absolute paths (unused by a target
            that reads the rotations from the model GGUF, and with ``pair``, whose own files are used).
        head_dim: the model's head_dim, for a configuration whose ``group_size`` is ``None``.
        pair: the :class:`~rotationzoo.files.pair.RotationPair` to serve: then this is
            ``rotationzoo.serving.launch_spec(pair, engine=engine).env`` (:func:`pair_input`: the same checks,
            refusals and settings), except that a pair whose own files the target cannot read as they are (one
            file holding K and V, layers stored as bare tensors: ``pair.engine_files_problem()``) is refused,
            naming ``launch_spec``, which writes the files it reads into the cache's derived area.

    Returns:
        ``{NAME: value}`` as strings, in the engine's launch order.

    Raises:
        ServingError: an unknown engine, missing paths, or (with ``pair``) what ``launch_spec`` refuses.
    """
    t = target(engine)
    if pair is not None:
        inp = pair_input(t, pair, model="MODEL", config=config)
        why = pair.engine_files_problem() if t.rotations_as == "pt" else None
        if why:
            raise ServingError(f"{pair.source or 'rotations'}: {why}, which {t.name} cannot read as it is; "
                               f"rotationzoo.serving.launch_spec(pair, engine={t.name!r}) (serve-args) writes the K "
                               "and V .pt files it reads into the cache's derived area and names them")
        return t.build(inp).env
    if t.rotations_as == "pt":
        missing = [s for s in ("k", "v") if s not in paths]
        if missing:
            raise ServingError(f"serve_env needs local paths for k and v (missing {', '.join(missing)})")
    dims = HeadDims(head_dim) if head_dim else None
    inp = prepare(t, config=config, launch=LaunchConfig(), model="MODEL", head_dims=dims, kinds=frozenset({"v1"}),
                  paths={s: os.path.abspath(p) for s, p in paths.items()}, source="rotations")
    return t.build(inp).env


def kv_head_counts(sets: Any) -> tuple[int, ...]:
    """The KV-head count of each layer of the first per-KV-head side (empty for one rotation per layer)."""
    items = sets.items() if isinstance(sets, Mapping) else iter(sets)
    for _, rs in items:
        if rs.per_head:
            layers = rs.rotations if isinstance(rs.rotations, tuple) else rs.rotations.unbind(0)
            return tuple(int(r.shape[0]) for r in layers)
    return ()
