"""Engine targets as data: what each OSCAR-enabled engine reads, and the builder of its launch.

One :class:`EngineTarget` per engine in :data:`TARGETS`; nothing else in the package branches on an
engine's name. A target says which file kinds it reads (:data:`rotationzoo.vocab.FILE_KINDS`: one
rotation per layer ``v1``, per KV head ``v2``, ``format_version`` 3 files ``v3``, key centering
``k_mean``, the non-orthogonal ``companions`` ``q_rotation`` / ``o_rotation``, value centering
``v_mean``, ``ragged`` layers, and the ``lloyd_max`` levels), which launch knobs it takes, and how
its environment and command line are built. Rotations it cannot read are refused with one line
naming what the files hold (:func:`refuse`); Lloyd-Max levels, a setting rather than file content,
only get a note where a target has no switch for them.

============== ==== ==== ==== ====== ========== ====== ====== =========
target          v1   v2   v3  k_mean companions v_mean ragged lloyd_max
============== ==== ==== ==== ====== ========== ====== ====== =========
sglang          yes  yes  yes  yes    yes        no     yes    yes
sglang-legacy   yes  no   yes  no     no         no     no     yes
vllm            yes  no   yes  no     no         no     no     no
llamacpp        yes  no   yes  no     no         no     no     no
============== ==== ==== ==== ====== ========== ====== ====== =========

(``v3`` is a file read as its rotations: a ``format_version`` 3 file without companions is, to the
loaders, the same as V1 or V2.) Pure functions of settings and local paths: no fetching, no torch;
:mod:`rotationzoo.serving` resolves rotations and assembles a :class:`~rotationzoo.serving.LaunchSpec`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import ServingError
from ..headdims import HeadDims
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from ..sharding import kv_heads_per_rank
from ..vocab import ENGINES, FILE_KINDS, Engine
from . import legacy, ports, sglang
from .common import SGLANG_HP_MAX_SPLITS, Launch, LaunchInput, RankHeads, sglang_page_size
from .legacy import sglang_legacy_args, sglang_legacy_env
from .ports import llamacpp_args, llamacpp_env, vllm_args, vllm_env
from .sglang import CALIBRATION_ENV, sglang_env

#: Launch knobs a target may take: ``tp_size``, ``absorb_v_rotation``, ``disable_radix_cache``, ``calibrate``.
OPTIONS: tuple[str, ...] = ("tp_size", "absorb_v_rotation", "disable_radix_cache", "calibrate")
_ALIASES = {"llamacpp": "llamacpp", "llama": "llamacpp", "sglang": "sglang", "vllm": "vllm",
            "sglanglegacy": "sglang-legacy"}
_KIND_TEXT = {
    "v1": "one rotation per layer",
    "v2": "per-KV-head rotations ([L, H_kv, d, d])",
    "v3": "a format_version 3 file",
    "k_mean": "key centering (k_mean)",
    "companions": "a non-orthogonal transform (q_rotation / o_rotation)",
    "v_mean": "value centering (v_mean, a rotationzoo extension)",
    "ragged": "layers of different head_dim or KV-head count",
    "lloyd_max": "Lloyd-Max INT2 levels",
}
#: What absorption cannot be used with: it folds one orthogonal R_V per layer into the weights.
NO_ABSORPTION = frozenset({"v2", "k_mean", "companions", "v_mean"})


@dataclass(frozen=True)
class EngineTarget:
    """One engine target: its name, what it is, what it reads, which knobs it takes, its builder."""

    name: Engine
    title: str
    reads: frozenset[str]
    options: frozenset[str]
    build: Callable[[LaunchInput], Launch]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "reads": [k for k in FILE_KINDS if k in self.reads],
                "options": [o for o in OPTIONS if o in self.options]}


_V1_ONLY = frozenset({"v1", "v3"})
TARGETS: dict[str, EngineTarget] = {t.name: t for t in (
    EngineTarget("sglang", "the authors' current SGLang tree, upstream SGLang main plus OSCAR",
                 frozenset(FILE_KINDS) - {"v_mean"}, frozenset(OPTIONS), sglang.build),
    EngineTarget("sglang-legacy", "the authors' May 2026 SGLang fork, sglang-research/",
                 _V1_ONLY | {"lloyd_max"}, frozenset({"tp_size", "absorb_v_rotation", "disable_radix_cache"}),
                 legacy.build),
    EngineTarget("vllm", "the unmerged vLLM port, --kv-cache-dtype oscar_int2", _V1_ONLY, frozenset({"tp_size"}),
                 ports.build_vllm),
    EngineTarget("llamacpp", "the authors' llama.cpp branch, one rotation per layer in the model GGUF", _V1_ONLY,
                 frozenset(), ports.build_llamacpp),
)}
assert tuple(TARGETS) == ENGINES


def check_engine(engine: str) -> str:
    """The canonical engine name (``llama.cpp``, ``llama-cpp`` → ``llamacpp``; ``sglang_legacy`` → ``sglang-legacy``).

    Raises:
        ServingError: an unknown engine.
    """
    e = str(engine).strip().lower().replace(".", "").replace("-", "").replace("_", "")
    e = _ALIASES.get(e, e)
    if e not in TARGETS:
        raise ServingError(f"unknown engine {str(engine)[:40]!r}; expected one of {', '.join(ENGINES)}")
    return e


def target(engine: str) -> EngineTarget:
    """The :class:`EngineTarget` of ``engine`` (any spelling :func:`check_engine` accepts)."""
    return TARGETS[check_engine(engine)]


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
                           f"read {'it' if kind in ('v3', 'k_mean', 'v_mean') else 'them'}; {hint}")


def absorption(t: EngineTarget, kinds: frozenset[str], launch: LaunchConfig, requested: bool | None,
               calibrate: bool, source: str) -> tuple[bool, str | None]:
    """Whether V-rotation absorption is on, and a note when the entry's setting was overridden.

    The May 2026 fork always absorbs (its reference line) unless asked not to. On the current tree it
    is off by default, and off for per-KV-head, centered or non-orthogonal files and for start-up
    calibration: it folds one orthogonal ``R_V`` per layer into the weights (Qwen3-30B-A3B per head:
    GPQA 34.3 with it, 58.6 without).

    Raises:
        ServingError: absorption asked for (``--absorb-v-rotation``) where it is wrong.
    """
    if t.name == "sglang-legacy":
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


def prepare(t: EngineTarget, *, config: Int2KVConfig, launch: LaunchConfig, paths: Mapping[str, str] | None,
            model: str, head_dims: HeadDims | None, kinds: frozenset[str], source: str,
            kv_head_counts: tuple[int, ...] = (), model_kv_heads: int | None = None, tp_size: int | None = None,
            absorb_v_rotation: bool | None = None, disable_radix_cache: bool | None = None,
            calibrate: bool = False) -> LaunchInput:
    """Check the request against ``t`` and the files, apply the overrides, and decide absorption and sharding.

    ``kv_head_counts`` are the KV-head counts of a per-KV-head file's layers (empty for one rotation
    per layer); ``model_kv_heads`` the model's, when known.

    Raises:
        ServingError: a knob the target does not take, rotations it cannot read, absorption where it is wrong.
        ConfigError: a TP size outside 1 … 1024 or one the KV heads cannot be split over.
    """
    asked = {"tp_size": tp_size is not None, "absorb_v_rotation": absorb_v_rotation is not None,
             "disable_radix_cache": bool(disable_radix_cache), "calibrate": calibrate}
    for knob in OPTIONS:
        if asked[knob] and knob not in t.options:
            takes = [_flag(o) for o in OPTIONS if o in t.options]
            raise ServingError(f"{_flag(knob)} does not apply to {t.name} ({t.title})"
                               + (f"; it takes {', '.join(takes)}" if takes else "")
                               + ("; start-up calibration is a feature of --engine sglang" if knob == "calibrate"
                                  else ""))
    refuse(t, kinds, source)
    lc = launch.replace(tp_size=tp_size, disable_radix_cache=disable_radix_cache or None)
    absorb, note = absorption(t, kinds, lc, absorb_v_rotation, calibrate, source)
    counts = kv_head_counts or ((model_kv_heads,) if model_kv_heads else ())
    ranks = rank_heads(counts, lc.tp_size) if counts else ()
    return LaunchInput(config=config, launch=lc, paths=paths, model=model, head_dims=head_dims, kinds=kinds,
                       per_head_kv_heads=kv_head_counts[0] if kv_head_counts else None, absorb=absorb,
                       absorb_note=note, ranks=ranks, sharded=bool(kv_head_counts), calibrate=calibrate,
                       model_kv_heads=model_kv_heads)


def _flag(knob: str) -> str:
    """The ``serve-args`` flag of a launch knob (``tp_size`` → ``--tp-size``)."""
    return "--" + knob.replace("_", "-")


def serve_env(config: Int2KVConfig, engine: str, paths: Mapping[str, str | os.PathLike[str]],
              head_dim: int | None = None, *, pair: Any = None) -> dict[str, str]:
    """Environment variables for ``engine`` given INT2-KV settings and local ``paths`` ``{"k", "v"}``.

    Args:
        config: the serving settings (``entry.serving`` or ``pair.config()``).
        engine: a target of :data:`TARGETS` (``"sglang"``, ``"sglang-legacy"``, ``"vllm"``, ``"llamacpp"``).
        paths: local rotation files ``{"k": path, "v": path}`` (unused for llama.cpp, which
            reads the rotations from the model GGUF).
        head_dim: the model's head_dim, for a configuration whose ``group_size`` is ``None``.
        pair: the :class:`~rotationzoo.pair.RotationPair` the paths belong to, if any: its files decide
            what the target must read (and refuses) and whether absorption may be on; its registry entry
            gives the launch knobs.

    Returns:
        ``{NAME: value}`` as strings, in the engine's launch order.
    """
    t = target(engine)
    if t.name != "llamacpp":
        missing = [s for s in ("k", "v") if s not in paths]
        if missing:
            raise ServingError(f"serve_env needs local paths for k and v (missing {', '.join(missing)})")
    entry = getattr(pair, "entry", None)
    launch = entry.launch if entry is not None else LaunchConfig()
    kinds = pair_kinds(pair, config) if pair is not None else frozenset({"v1"})
    dims = pair.head_dims if pair is not None else HeadDims(head_dim) if head_dim else None
    inp = prepare(t, config=config, launch=launch, model="MODEL", head_dims=dims, kinds=kinds,
                  paths={s: str(p) for s, p in paths.items()}, kv_head_counts=kv_head_counts(pair) if pair else (),
                  source=str(getattr(pair, "source", "") or "rotations"))
    return t.build(inp).env


def kv_head_counts(sets: Any) -> tuple[int, ...]:
    """The KV-head count of each layer of the first per-KV-head side (empty for one rotation per layer)."""
    items = sets.items() if isinstance(sets, Mapping) else iter(sets)
    for _, rs in items:
        if rs.per_head:
            layers = rs.rotations if isinstance(rs.rotations, tuple) else rs.rotations.unbind(0)
            return tuple(int(r.shape[0]) for r in layers)
    return ()


__all__ = [
    "CALIBRATION_ENV",
    "ENGINES",
    "NO_ABSORPTION",
    "OPTIONS",
    "SGLANG_HP_MAX_SPLITS",
    "TARGETS",
    "Engine",
    "EngineTarget",
    "Launch",
    "LaunchInput",
    "RankHeads",
    "absorption",
    "check_engine",
    "kv_head_counts",
    "llamacpp_args",
    "llamacpp_env",
    "pair_kinds",
    "prepare",
    "rank_heads",
    "refuse",
    "serve_env",
    "sglang_env",
    "sglang_legacy_args",
    "sglang_legacy_env",
    "sglang_page_size",
    "target",
    "vllm_args",
    "vllm_env",
]
