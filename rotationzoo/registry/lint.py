"""Integrity checks of a registry document beyond what parsing needs (``tools/check_registry.py``,
``rotationzoo verify --registry`` and publishing use them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import ConfigError, RegistryError
from ..int2kv import Int2KVConfig
from ..launch import LaunchConfig
from . import bounds, safety
from .model import HEX40, SIDES


def _safe(check: Any, value: Any, where: str, rep: "LintReport") -> bool:
    """Run one :mod:`.safety` or :mod:`.bounds` check; a refusal becomes a lint error."""
    try:
        check(value, where)
    except (RegistryError, ConfigError) as exc:
        rep.errors.append(str(exc))
        return False
    return True


def _architecture(raw: Any, where: str) -> None:
    """The numbers of an ``architecture`` object, by the rule loading applies (:mod:`.bounds`)."""
    from .load import parse_architecture

    parse_architecture(raw, where)


def _launch(raw: Any, arch: Any, grouping: Any, where: str) -> None:
    """A ``launch`` block and a ``grouping``, by the rules loading applies."""
    from .load import parse_architecture, parse_grouping, parse_launch

    g = parse_grouping(grouping, f"{where}.grouping")
    try:
        model_arch = parse_architecture(arch, where)
    except RegistryError:  # reported once, by _architecture; the block is still checked on its own
        LaunchConfig.from_json(raw, where=where)
        return
    parse_launch(raw, model_arch, g, where)


def _serving(raw: Any, arch: Any, where: str) -> None:
    """A ``serving`` block, by the rule loading applies (against the architecture when it is valid)."""
    from .load import parse_architecture, parse_serving

    try:
        model_arch = parse_architecture(arch, where)
    except RegistryError:  # reported once, by _architecture
        Int2KVConfig.from_json(raw if raw is not None else {}, where=where)
        return
    parse_serving(raw, model_arch, where)


@dataclass
class LintReport:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    unpinned_files: int = 0
    unpinned_sources: int = 0
    files: int = 0
    tags: int = 0
    models: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors


def lint_registry(data: Mapping[str, Any], *, schema: Mapping[str, Any] | None = None) -> LintReport:
    """Check a registry document beyond what parsing needs.

    Schema (when ``jsonschema`` and ``schema`` are available), unique ids and aliases across models,
    default tag exists, every number within :mod:`.bounds` (architecture, serving, calibration,
    results, sha256 and sizes: the rules loading applies), sources well-formed, revisions either
    40-hex commits or counted as unpinned, and paths consistent with the tag they belong to.
    """
    rep = LintReport()
    if schema is not None:
        _lint_schema(data, schema, rep)
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, list):
        rep.errors.append("'models' must be a list")
        return rep
    seen: dict[str, str] = {}
    for i, m in enumerate(models):
        if not isinstance(m, Mapping):
            rep.errors.append(f"models[{i}]: not an object")
            continue
        _lint_model(m, str(m.get("id", f"models[{i}]")), seen, rep)
    return rep


def _lint_schema(data: Any, schema: Mapping[str, Any], rep: LintReport) -> None:
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - dev extra
        rep.warnings.append("jsonschema is not installed; schema not checked")
        return
    validator = jsonschema.Draft202012Validator(schema)
    for err in sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
        where = "/".join(map(str, err.absolute_path)) or "(root)"
        rep.errors.append(f"schema: {where}: {err.message}")


def _lint_model(m: Mapping[str, Any], mid: str, seen: dict[str, str], rep: LintReport) -> None:
    rep.models += 1
    _safe(safety.check_model_id, m.get("id"), f"{mid}: id", rep)
    for alias in m.get("aliases", []):
        _safe(safety.check_alias, alias, f"{mid}: aliases", rep)
    names = [mid, *m.get("aliases", []), mid.split("/", 1)[-1]]
    for n in dict.fromkeys(x.lower() for x in names):
        if n in seen and seen[n] != mid:
            rep.errors.append(f"{mid}: name '{n}' is also used by {seen[n]} (ids and aliases must be unique)")
        else:
            seen[n] = mid
    if "mla_latent" in m:
        from .load import parse_model

        _safe(lambda raw, at: parse_model(raw, at, "lint"), m, mid, rep)
        return
    _safe(_architecture, m.get("architecture"), mid, rep)
    tags = m.get("tags") or {}
    if m.get("default_tag") not in tags:
        rep.errors.append(f"{mid}: default_tag '{m.get('default_tag')}' is not one of its tags ({', '.join(tags)})")
    for tname, t in tags.items():
        rep.tags += 1
        _safe(safety.check_tag, tname, f"{mid}@{tname}", rep)
        if not isinstance(t, Mapping):
            rep.errors.append(f"{mid}@{tname}: not an object")
            continue
        _safe(lambda raw, at: _serving(raw, m.get("architecture"), at), t.get("serving"), f"{mid}@{tname}: serving",
              rep)
        _safe(lambda raw, at: _launch(raw, m.get("architecture"), t.get("grouping"), at), t.get("launch"),
              f"{mid}@{tname}: launch", rep)
        if isinstance(t.get("calibration"), Mapping):
            _safe(bounds.check_calibration, t["calibration"], f"{mid}@{tname}: calibration", rep)
        _safe(bounds.check_results, t.get("results", []), f"{mid}@{tname}: results", rep)
        files = t.get("files") or {}
        for side in SIDES:
            f = files.get(side)
            if not isinstance(f, Mapping):
                rep.errors.append(f"{mid}@{tname}: missing files.{side}")
                continue
            _lint_file(f, side, tname, t.get("sources", []), f"{mid}@{tname}", rep)


def _lint_file(f: Mapping[str, Any], side: str, tname: str, tag_sources: Any, where: str, rep: LintReport) -> None:
    rep.files += 1
    sha, size, path = f.get("sha256"), f.get("size"), str(f.get("path", ""))
    if sha is None:
        rep.unpinned_files += 1
    _safe(lambda value, at: bounds.check_file_numbers(value, size, at), sha, f"{where}: files.{side}", rep)
    if (sha is None) != (size is None):
        rep.warnings.append(f"{where}: files.{side} has {'size' if sha is None else 'sha256'} but not the other")
    _safe(safety.check_file_path, path, f"{where}: files.{side}", rep)
    srcs = f.get("sources", tag_sources)
    if not srcs:
        rep.errors.append(f"{where}: files.{side} has no sources")
    hub_paths = [s for s in srcs if isinstance(s, Mapping) and s.get("type") in ("huggingface", "modelscope")
                 and not s.get("path")]
    flat = len(path.split("/")) == 2  # the zoo's flat model folders (Qwen3-30B-A3B/k_rotation_perhead.pt)
    if hub_paths and not flat and tname.split("/")[-1] not in path.split("/") and tname not in path:
        rep.errors.append(f"{where}: files.{side}.path {path!r} is not under a folder named after the tag "
                          "(or directly in the model's folder)")
    if path and not path.split("/")[-1].startswith(f"{side}_"):
        rep.errors.append(f"{where}: files.{side}.path {path!r} does not name a {side.upper()} file ({side}_…)")
    for j, s in enumerate(srcs):
        _lint_source(s, f"{where}: files.{side}.sources[{j}]", rep)


def _lint_source(s: Any, where: str, rep: LintReport) -> None:
    if not isinstance(s, Mapping) or "type" not in s:
        rep.errors.append(f"{where}: not a source object")
        return
    typ = s["type"]
    if typ in ("huggingface", "modelscope"):
        repo, rev = s.get("repo"), s.get("revision")
        _safe(safety.check_model_id, repo, f"{where}: repo", rep)
        if not rev:
            rep.errors.append(f"{where}: no revision (always pin or name one)")
        elif _safe(safety.check_revision, rev, where, rep) and not HEX40.match(str(rev)):
            rep.unpinned_sources += 1
        if s.get("path") is not None:
            _safe(safety.check_relpath, s.get("path"), where, rep)
    elif typ == "url":
        _safe(safety.check_url, s.get("url"), where, rep)
    elif typ == "bundled":
        if not s.get("path"):
            rep.errors.append(f"{where}: bundled source needs a path")
        else:
            _safe(safety.bundled_file, s.get("path"), where, rep)
    else:
        rep.errors.append(f"{where}: unknown source type {typ!r}")
