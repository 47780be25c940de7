"""Launch settings for the engines that serve OSCAR INT2 KV caches.

:func:`launch_spec` resolves rotations (a registry entry, fetched and verified if needed, or any
source :func:`~rotationzoo.files.pair.resolve_pair` accepts), takes the INT2-KV settings from the entry's
``serving`` block and the launch knobs from its ``launch`` block, checks the files against what the
engine target reads, and assembles the environment, command line, preparation steps, caveats, the
KV heads of each tensor-parallel rank and the server log lines to look for (see
:mod:`rotationzoo.engines` for each target). For llama.cpp it also exports a rotations GGUF into
the cache's derived area (``rotationzoo cache ls`` lists it) and prints the step that appends it to
a model GGUF. With ``calibrate=True`` nothing is fetched: the launch makes the authors' server fit
a pair at start-up.

Example::

    from rotationzoo.serving import launch_spec
    spec = launch_spec("Qwen3-30B-A3B")            # the authors' current SGLang tree
    print(spec.render("shell"))          # env prefix + python -m sglang.launch_server ...
    spec.env["SGLANG_OSCAR_K_ROTATION_PATH"], spec.ranks, spec.checks

    pair = rotationzoo.load("Qwen3-8B")
    pair.serve_env("vllm")               # {"VLLM_OSCAR_K_ROTATION_PATH": ..., ...}
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from .engines import (
    ENGINES,
    EngineTarget,
    check_architecture,
    check_expert_parallel,
    check_options,
    kv_head_counts,
    llamacpp_env,
    pair_files,
    pair_input,
    prepare,
    serve_env,
    sglang_env,
    sglang_page_size,
    target,
    vllm_env,
)
from .files.derived import ensure_rotation_files, ensure_rotations_gguf, rotations_gguf_path
from .errors import ConfigError, RegistryError, RotationZooError, ServingError
from .launch import LaunchConfig
from .sharding import check_ep_size
from .numbers import check_int, check_real, shown
from .launchspec import OUTPUT_FORMATS, LaunchSpec, check_printable
from .serving_mla import latent_model, latent_spec
from .files.pair import RotationPair, looks_like_path, resolve_pair
from .registry import get_entry, get_model, split_model_tag
from .registry.safety import check_model_id

#: What the launch loads when the rotations name no usable model id and no ``--model-path`` is given.
MODEL_PLACEHOLDER = "MODEL"
#: Largest KV block a launch may name (``--block-size``).
MAX_BLOCK_TOKENS = 1 << 16


def _engine_model(pair: RotationPair, model_path: str | None) -> tuple[str, str | None]:
    """What the engine loads, and a note when that is :data:`MODEL_PLACEHOLDER`.

    ``--model-path`` when given (refused if it starts with ``-``, which an engine would read as an
    option); else the registry id; else a ``NAMESPACE/NAME`` model id recorded in the pair file.
    Anything else a file records (a path, ``--model-path /etc; rm -rf ~`` …) never reaches the
    command line: the placeholder does, with a note saying what to put there.
    """
    if model_path is not None:
        if str(model_path).startswith("-"):
            raise ServingError(f"--model-path {shown(model_path)} starts with '-', which the engine would read as an "
                               "option; write ./ before a relative path")
        return check_printable(str(model_path), "--model-path"), None
    recorded = pair.model
    try:
        return check_model_id(recorded, "model"), None  # the registry's rule for model ids
    except RegistryError:
        pass
    why = (f"the rotations record the model as {shown(recorded)}, which is not a NAMESPACE/NAME model id"
           if recorded else "the rotations do not name their model")
    return MODEL_PLACEHOLDER, f"{why}: replace {MODEL_PLACEHOLDER} with the model's id or checkpoint folder (or pass --model-path)"


def launch_spec(
    model: Any,
    tag: str | None = None,
    *,
    engine: str = "sglang",
    model_path: str | None = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
    tp_size: int | None = None,
    ep_size: int | None = None,
    absorb_v_rotation: bool | None = None,
    disable_radix_cache: bool | None = None,
    calibrate: bool = False,
    block_size: int | None = None,
    k_clip_per_layer: str | os.PathLike[str] | Sequence[float] | None = None,
    k_clip_per_head: str | os.PathLike[str] | None = None,
) -> LaunchSpec:
    """Resolve rotations (fetching and verifying registry files if needed) and build a launch.

    Args:
        model: a registry id or alias (``MODEL[@TAG]``), a :class:`~rotationzoo.files.pair.RotationPair`,
            or any source :func:`~rotationzoo.files.pair.resolve_pair` accepts (a folder, ``k.pt,v.pt``).
        tag: calibration tag (the model's default when ``None``).
        engine: a target of :data:`rotationzoo.engines.TARGETS`: ``"sglang"`` (the authors' current
            tree, the default), ``"sglang-legacy"`` (their May 2026 fork), ``"vllm"`` (the port of
            vLLM pull request 46774), ``"vllm-prototype"``, ``"llamacpp"``.
        model_path: what the engine loads instead of the registry model id: a local checkpoint
            folder, or for a target that reads the rotations from a model GGUF (llama.cpp) the
            model's GGUF file (without rotations); the launch then uses ``<stem>-rot-kv.gguf``
            beside it, built by the ``prepare`` step.
        source, revision, cache_dir, offline, timeout: the fetch options, as for :func:`rotationzoo.fetch`.
        tp_size: tensor-parallel ranks instead of the entry's (``launch.tp_size``); the KV heads must
            split over them by the authors' rule, and block-quantized MoE weights into whole blocks
            (:func:`rotationzoo.sharding.check_tp_size`).
        ep_size: expert-parallel groups of the TP ranks for MoE layers instead of the entry's (``launch.ep_size``,
            1: none; SGLang's ``--ep-size``, a divisor of the TP size; vLLM's ``--enable-expert-parallel``, equal
            to it): each expert's weights are then split over ``tp_size / ep_size`` ranks, which is what the
            block rule checks; the KV heads stay split over all TP ranks.
        absorb_v_rotation: ask for V-rotation absorption on (``True``) or off (``False``) instead of
            the entry's setting; on is refused for per-KV-head, centered or non-orthogonal files.
        disable_radix_cache: serve without the prefix cache (SGLang targets).
        calibrate: print the settings that make the authors' current tree fit a pair at start-up
            instead of rotation paths (a registry model; nothing is fetched).
        block_size: the engine's KV block size (vLLM targets' ``--block-size``); the vLLM port keeps
            whole blocks of the sink, so a sink shorter than one block is refused.
        k_clip_per_layer, k_clip_per_head: K clip tables for the current tree, read and checked against the
            rotations' layers and KV heads first (:mod:`rotationzoo.files.artefacts`): per layer a JSON file
            (``{layer: ratio}`` or a list in global layer order), a comma list ``"0.9,0.95,..."`` or a Python
            list of ratios in global layer order; per head a JSON file.

    Returns:
        A :class:`LaunchSpec`; ``render("shell" | "env" | "json")`` prints it.

    Raises:
        ServingError: an unknown engine, rotations or a knob the target cannot take (one line).
        ConfigError: a TP size the KV heads cannot be split over.
    """
    k_clip_per_layer = _clip_list(k_clip_per_layer)
    if k_clip_per_head is not None and not isinstance(k_clip_per_head, (str, os.PathLike)):
        raise ConfigError(f"k_clip_per_head (--k-clip-per-head) is a JSON file {{\"<layer>,<head>\": ratio}}: give its "
                          f"path, got {type(k_clip_per_head).__name__}")
    t = target(engine)
    if t.model_file == "gguf" and model_path and Path(model_path).suffix.lower() != ".gguf":
        raise ServingError(f"--model-path for {t.name} is the model's GGUF file, got {model_path!r}")
    knobs: dict[str, Any] = {"tp_size": tp_size, "ep_size": ep_size, "absorb_v_rotation": absorb_v_rotation,
                             "disable_radix_cache": disable_radix_cache, "block_size": block_size}
    check_options(t, **knobs, calibrate=calibrate, k_clip_per_layer=k_clip_per_layer, k_clip_per_head=k_clip_per_head)
    if block_size is not None:
        check_int(block_size, "block_size", low=1, high=MAX_BLOCK_TOKENS, hint=" tokens")
    if tp_size is not None:
        LaunchConfig(tp_size=tp_size)  # its bounds, before anything is downloaded
    if ep_size is not None and tp_size is None:  # its bounds (the target's rule: below, with the entry's TP)
        check_ep_size(ep_size, ep_size, t.expert_parallel)
    elif ep_size is not None:  # with --tp: the target's rule, before anything is downloaded
        check_expert_parallel(t, LaunchConfig(), "rotations", tp_size=tp_size, ep_size=ep_size)
    if not calibrate:
        _precheck(t, model, tag, tp_size, ep_size)
    if calibrate:
        return _calibration_spec(t, model, tag, model_path, knobs)
    latent = latent_model(model, tag)
    if latent is not None:
        return latent_spec(t, latent, model_path=model_path, source=source, revision=revision, cache_dir=cache_dir,
                           offline=offline, timeout=timeout, knobs=knobs)
    pair = resolve_pair(model, tag, source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                        timeout=timeout)
    files = pair_files(pair)  # absolute: a launch from another folder must read the same files
    cfg = pair.config()
    name = pair.model or pair.source
    loads, unnamed = _engine_model(pair, model_path)
    arch = pair.entry.architecture if pair.entry is not None else None
    heads = kv_head_counts(pair)
    clip_layer, clip_head = _clip_tables(k_clip_per_layer, k_clip_per_head, pair.k.layer_ids,
                                         heads[0] if heads else arch.num_kv_heads if arch is not None else None)
    inp = pair_input(t, pair, model=loads, config=cfg, paths=files, model_path=model_path,
                     k_clip_per_layer=clip_layer, k_clip_per_head=clip_head, **knobs)
    notes_first = []
    why = pair.engine_files_problem() if t.rotations_as == "pt" else None
    if t.rotations_as == "gguf":  # the engine reads the rotations from the model GGUF: export them once
        inp = replace(inp, gguf=str(ensure_rotations_gguf(pair, cache_dir=cache_dir)))
    elif why:  # one file holds both sides, or a layout the loaders cannot index: write the two files they read
        own = pair if files["k"] == files["v"] else replace(pair, paths={})
        files.update({s: str(p) for s, p in ensure_rotation_files(own, cache_dir=cache_dir).items()})
        notes_first = [f"{pair.source} {why}; the launch reads the K and V .pt files written from it in the "
                       f"authors' layout into the cache's derived area"]
        inp = replace(inp, paths=dict(files))
    built = t.build(inp)
    files.update(built.files)
    notes = notes_first + built.notes
    if pair.entry is None:
        notes.insert(0, "these rotations are not from the registry: default INT2-KV settings "
                        f"({cfg.label(pair.head_dims.default)}) were used")
    if unnamed and t.model_file == "checkpoint":
        notes.insert(0, unnamed)
    if pair.entry is not None:
        notes += [c.describe() for c in pair.entry.conflicts]
        prebuilt = get_model(pair.entry.model_id).prebuilt_gguf if t.model_file == "gguf" else ()
        if prebuilt:
            notes.append(f"ready-made model GGUFs with the authors' rotations appended: {', '.join(prebuilt)} "
                         "(Hugging Face)")
    return LaunchSpec(engine=t.name, model=name, tag=pair.tag, env=built.env, args=built.args, files=files,
                      prepare=built.prepare, notes=notes, ranks=[r.to_json() for r in inp.ranks], checks=built.checks)


def _clip_list(per_layer: Any) -> str | os.PathLike[str] | None:
    """``k_clip_per_layer`` as the launch names it: a path or a comma list as given, a list of ratios (in global
    layer order) as the comma list of the same ratios; anything else refused with one line."""
    if per_layer is None or isinstance(per_layer, (str, os.PathLike)):
        return per_layer
    if isinstance(per_layer, (list, tuple)) and per_layer:
        return ",".join(repr(check_real(r, f"k_clip_per_layer[{i}]", low=0.0, high=1.0, hint=" (a clip ratio)"))
                        for i, r in enumerate(per_layer))
    raise ConfigError(f"k_clip_per_layer (--k-clip-per-layer) is a JSON file, a comma list '0.9,0.95,...' or a "
                      f"non-empty list of clip ratios in global layer order, got {type(per_layer).__name__} "
                      f"{shown(per_layer)}")


def _clip_tables(per_layer: str | os.PathLike[str] | None, per_head: str | os.PathLike[str] | None,
                 layer_ids: tuple[int, ...], kv_heads: int | None) -> tuple[str | None, str | None]:
    """K clip tables checked against the rotations (:mod:`rotationzoo.files.artefacts`), as the launch names them
    (per layer, per head): a table file by its absolute path, a comma list as given."""
    from .files.artefacts import read_k_clip_per_head, read_k_clip_per_layer

    layer = head = None
    if per_layer is not None:
        read_k_clip_per_layer(per_layer, layer_ids)
        p = Path(os.fspath(per_layer)).expanduser()
        layer = check_printable(str(p.resolve()) if p.is_file() else os.fspath(per_layer), "--k-clip-per-layer")
    if per_head is not None:
        read_k_clip_per_head(per_head, layer_ids, kv_heads)
        head = check_printable(str(Path(os.fspath(per_head)).expanduser().resolve()), "--k-clip-per-head")
    return layer, head


def _precheck(t: EngineTarget, model: Any, tag: str | None, tp_size: int | None, ep_size: int | None) -> None:
    """For a registry model, refuse before its files are downloaded what the launch would refuse after:
    a hybrid model or an architecture the target does not serve, TP / EP sizes its KV heads cannot be split
    over or its block-quantized MoE weights cannot (the files' own heads are checked again once read)."""
    if not isinstance(model, str) or Path(model).expanduser().exists() or looks_like_path(model):
        return
    base, at_tag = split_model_tag(model)
    try:
        entry = get_entry(base, at_tag or tag)
    except RotationZooError:
        return  # resolve_pair reports it, with the same message
    arch = entry.architecture
    if arch.attention_layer_ids and not t.hybrid_models:
        prepare(t, config=entry.serving, launch=entry.launch, paths=None, model=entry.model_id, head_dims=None,
                kinds=frozenset(), source=entry.key, hybrid=True)
    check_architecture(t, entry.model_id, entry.key)
    check_expert_parallel(t, entry.launch, entry.key, tp_size=tp_size, ep_size=ep_size)  # the entry's own EP too
    if tp_size is not None or ep_size is not None:
        lc = entry.launch.replace(tp_size=tp_size, ep_size=ep_size)
        arch.check_tp_size(lc.tp_size, lc.ep_size, t.expert_parallel)


def _calibration_spec(t: Any, model: Any, tag: str | None, model_path: str | None,
                      knobs: dict[str, Any]) -> LaunchSpec:
    """A start-up calibration launch of a registry model: its settings, no rotation paths, nothing fetched."""
    if not isinstance(model, str) or Path(model).expanduser().exists() or looks_like_path(model):
        raise ServingError("--calibrate takes a registry model (MODEL[@TAG]): the server fits the rotations itself, "
                           "so there are no rotation files to give")
    base, at_tag = split_model_tag(model)
    entry = get_entry(base, at_tag or tag)
    arch = entry.architecture
    if not arch.head_dims.uniform:
        raise ServingError(f"{entry.model_id}: layers differ in head_dim ({arch.head_dims}); start-up calibration "
                           "does not run on such two-geometry models: serve the entry's files")
    if model_path is not None and str(model_path).startswith("-"):
        raise ServingError(f"--model-path {shown(model_path)} starts with '-', which the engine would read as an "
                           "option; write ./ before a relative path")
    loads = check_printable(str(model_path), "--model-path") if model_path is not None else entry.model_id
    kinds = frozenset({"v1", "lloyd_max"} if entry.serving.lloyd_max else {"v1"})
    inp = prepare(t, config=entry.serving, launch=entry.launch, paths=None, model=loads, head_dims=arch.head_dims,
                  kinds=kinds, source=entry.key, model_kv_heads=arch.num_kv_heads, calibrate=True, **knobs)
    built = t.build(inp)
    notes = [_calibration_destination(loads, model_path is None), *built.notes,
             "start-up calibration needs a single node, DP = PP = 1, no HiCache and no torch.compile; "
             "SGLANG_OSCAR_CALIBRATION_PROMPTS_PATH names a JSONL of {\"messages\": …} prompts (empty: GPQA-Diamond)",
             *(c.describe() for c in entry.conflicts)]
    if entry.grouping == "kv_head":
        notes.insert(0, f"start-up calibration fits one shared rotation per layer, but {entry.key} serves per-KV-head "
                        "rotations: on such models a shared rotation can collapse accuracy (Qwen3-30B-A3B: GPQA 43.9 "
                        "shared against 58.6 per head); serve the entry's files instead")
    return LaunchSpec(engine=t.name, model=entry.model_id, tag=entry.name, env=built.env, args=built.args, files={},
                      notes=notes, ranks=[r.to_json() for r in inp.ranks], checks=built.checks)


def _calibration_destination(loads: str, hub_id: bool) -> str:
    from .files.calibrated import calibration_folder_name

    folder = calibration_folder_name(loads) if hub_id else f"{Path(loads).name or 'model'}-<digest12>"
    return (f"the server fits the pair at start-up and writes it to $HF_HOME/oscar-rotations/{folder}/ (for the "
            "model's main revision and the printed prompts and tokens); once it is complete, `rotationzoo cache "
            "import` that folder to keep it, serve it or publish it")


__all__ = [
    "ENGINES",
    "MODEL_PLACEHOLDER",
    "OUTPUT_FORMATS",
    "LaunchSpec",
    "ServingError",
    "ensure_rotation_files",
    "ensure_rotations_gguf",
    "launch_spec",
    "llamacpp_env",
    "rotations_gguf_path",
    "serve_env",
    "sglang_env",
    "sglang_page_size",
    "vllm_env",
]
