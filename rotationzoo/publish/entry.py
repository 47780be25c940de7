"""The registry entry of an upload, and checking its merge into a registry file before uploading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypeGuard

from .._version import __version__
from ..int2kv import Int2KVConfig
from ..registry import SIDES, lint_registry, parse_tag_name
from ..registry.edit import empty_registry, load_schema, merge_into_registry, raw_model, read_for_update
from .plan import Plan
from .results import HubResult


def _architecture_json(plan: Plan) -> dict[str, Any]:
    ids = list(plan.layer_ids)
    arch: dict[str, Any] = {}
    if ids == list(range(len(ids))):
        arch["num_layers"] = len(ids)
    else:
        arch["attention_layer_ids"] = ids
    arch["head_dim"] = plan.head_dim
    m = plan.manifest or {}
    for key, src in (("num_kv_heads", "num_kv_heads"), ("num_attention_heads", "num_q_heads")):
        if isinstance(m.get(src), int) and m[src] > 0:
            arch[key] = m[src]
    return arch


def _sources_json(hubs: Iterable[HubResult]) -> list[dict[str, Any]]:
    return [{"type": h.hub, "repo": h.repo, "revision": h.revision or h.branch} for h in hubs]


def _tag_json(plan: Plan, hubs: Sequence[HubResult], existing: Mapping[str, Any] | None,
              description: str | None, dataset: str | None) -> dict[str, Any]:
    """The registry tag entry; fields of an ``existing`` entry (description, serving, results) are kept."""
    files = {
        side: {"path": plan.pair(side).path, "sha256": plan.pair(side).sha256, "size": plan.pair(side).size}
        for side in SIDES
    }
    sources = _sources_json(hubs)
    if existing is not None:
        tag = json.loads(json.dumps(existing))
        old_files = tag.get("files") or {}
        same_bytes = all(isinstance(old_files.get(s), Mapping) and old_files[s].get("sha256") == files[s]["sha256"]
                         and old_files[s].get("path") == files[s]["path"] for s in SIDES)
        if same_bytes:  # the same bytes published to one more place: keep the other sources, in their order
            fresh = {(s["type"], s["repo"]): s for s in sources}
            merged = [fresh.pop((s.get("type"), s.get("repo")), s) for s in tag.get("sources", [])]
            sources = merged + list(fresh.values())
        if description:
            tag["description"] = description
        if dataset:
            tag.setdefault("calibration", {})["dataset"] = dataset
        tag["objectives"] = dict(plan.objectives)
        _set_grouping(tag, plan)
        tag["sources"] = sources
        tag["files"] = files
        return tag
    m = plan.manifest or {}
    manifest_dataset = m.get("dataset") if isinstance(m.get("dataset"), str) else None
    calibration: dict[str, Any] = {"dataset": dataset or manifest_dataset}
    parsed = parse_tag_name(plan.tag) or {}
    for key, src in (("tokens", "tokens"), ("prompts", "prompts"), ("group_size", "group_size")):
        value = m.get(src)
        if isinstance(value, int) and not isinstance(value, bool) and value >= (1 if key == "group_size" else 0):
            if parsed.get(key) is None or parsed[key] == value:
                calibration[key] = value
    serving = _new_serving(plan, m, parsed.get("group_size") or calibration.get("group_size"))
    if not description:
        how = f" ({m['composition']})" if isinstance(m.get("composition"), str) else ""
        description = f"Fitted rotations{how}, published with rotationzoo {__version__}"
    tag = {
        "description": description,
        "calibration": calibration,
        "objectives": dict(plan.objectives),
        "serving": serving,
        "results": [],
        "sources": sources,
        "files": files,
    }
    _set_grouping(tag, plan)
    return tag


def _set_grouping(tag: dict[str, Any], plan: Plan) -> None:
    """The entry's ``grouping``: ``kv_head`` for per-KV-head files (what ``info``, ``plan`` and ``serve-args``
    read before anything is downloaded); absent, the registry's default ``layer``, otherwise."""
    if plan.grouping == "kv_head":
        tag["grouping"] = "kv_head"
    else:
        tag.pop("grouping", None)


def _is_clip(value: Any, *, zero_ok: bool) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (0 <= value if zero_ok else 0 < value) \
        and value <= 1


def _new_serving(plan: Plan, manifest: Mapping[str, Any], group: Any) -> dict[str, Any]:
    """Serving defaults of a new entry: the authors' recipe with the manifest's clip ratios and the tag's
    group size (head_dim when the tag does not name one). A clip the keep rule was told the files will be
    served at (the recipe's ``keep.k_clip_ratio`` / ``keep.v_clip_ratio``: ``fit --keep-k-clip-ratio``) wins
    over the clip they were trained at (the ``int2kv`` block; ``clip_ratio`` in manifests written before it)."""
    changes: dict[str, Any] = {}
    block = manifest.get("int2kv")
    if isinstance(block, Mapping):
        clip: dict[str, Any] = {side: block.get(f"{side}_clip_ratio") for side in SIDES}
    else:
        raw = manifest.get("clip_ratio")
        clip = dict(raw) if isinstance(raw, Mapping) else {}
    recipe = manifest.get("recipe")
    keep = recipe.get("keep") if isinstance(recipe, Mapping) else None
    served = {side: keep.get(f"{side}_clip_ratio") for side in SIDES} if isinstance(keep, Mapping) else {}
    for side in SIDES:
        # a keep clip of 0 says "served unclipped"; a training clip of 0 (none) says nothing about serving
        kept, trained = served.get(side), clip.get(side)
        if _is_clip(kept, zero_ok=True):
            changes[f"{side}_clip_ratio"] = float(kept)
        elif _is_clip(trained, zero_ok=False):
            changes[f"{side}_clip_ratio"] = float(trained)
    ok = isinstance(group, int) and 16 <= group <= plan.head_dim and not group & (group - 1)
    changes["group_size"] = group if ok else plan.head_dim
    return Int2KVConfig(**changes).to_json()


def _model_json(plan: Plan, tag_json: dict[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model entry holding ``tag_json``: ``base`` (with its other tags) or a new model."""
    if base is not None:
        model = json.loads(json.dumps(base))
        model.setdefault("tags", {})[plan.tag] = tag_json
        return model
    return {
        "id": plan.model_id,
        "aliases": [plan.model_folder],
        "description": "",
        "architecture": _architecture_json(plan),
        "default_tag": plan.tag,
        "tags": {plan.tag: tag_json},
    }


def merged_registry(path: Path | None, plan: Plan, hubs: Sequence[HubResult], description: str | None,
                     dataset: str | None) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(merged document, model entry with only this tag, problems the merge would introduce)."""
    data = read_for_update(path) if path is not None else empty_registry()
    in_file = next((m for m in data["models"] if isinstance(m, dict) and m.get("id") == plan.model_id), None)
    problems: list[str] = []
    arch = (in_file or {}).get("architecture") if plan.known_model is None else None
    if isinstance(arch, Mapping) and arch.get("head_dim"):  # a model only this file knows: same checks
        ids = arch.get("attention_layer_ids") or (list(range(arch["num_layers"])) if arch.get("num_layers") else None)
        if arch["head_dim"] != plan.head_dim or (ids is not None and list(ids) != list(plan.layer_ids)):
            problems.append(f"{plan.model_id} in {path} needs {len(ids) if ids else '?'} layers × "
                            f"d {arch['head_dim']}, "
                            f"the files have {len(plan.layer_ids)} layers × d {plan.head_dim}")
    known_raw = raw_model(plan.model_id) if plan.known_model is not None else None
    base = in_file if in_file is not None else known_raw
    existing_tag = (base or {}).get("tags", {}).get(plan.tag) if base is not None else None
    tag_json = _tag_json(plan, hubs, existing_tag, description, dataset)
    full = _model_json(plan, tag_json, base)
    only = dict(full)
    only["tags"] = {plan.tag: tag_json}
    if base is not None and only.get("default_tag") != plan.tag:
        only["default_tag"] = plan.tag  # the single-tag view must name a tag it holds
    schema = load_schema()
    before = set(lint_registry(data, schema=schema).errors)
    merged = merge_into_registry(json.loads(json.dumps(data)), full, plan.tag)
    after = lint_registry(merged, schema=schema).errors
    return merged, only, problems + [e for e in after if e not in before]
