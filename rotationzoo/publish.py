"""Publish fitted rotation pairs to the Hugging Face Hub and ModelScope, and check the published zoo.

:func:`publish` takes a folder written by the fitter (``k_rotation_*.pt``, ``v_rotation_*.pt`` and
optionally the ``rotationzoo.json`` manifest), validates everything locally, then uploads the pair
under ``<model folder>/<tag>/`` of a hub repository in **one commit per hub**, updating the
repository's model card row in that same commit. It returns the registry entry for the upload,
pinned to the Hugging Face commit sha, and can merge it into a registry file.

Example::

    from rotationzoo.publish import publish

    res = publish("rotations/", repo="me/RotationZoo", model="Qwen/Qwen3-8B",
                  tag="seq20000_prompt83_group128", registry_out="my-registry.json")
    res.hubs[0].commit          # 40-hex commit sha on the Hugging Face Hub
    res.entry["files"]["k"]     # {"path": "Qwen3-8B/seq20000_prompt83_group128/k_...", "sha256": ..., "size": ...}

Safety properties:

- nothing leaves the machine before both files (and the manifest) are validated;
- every hub's remote state is read and checked (existing tag folder, branch, immutable tags,
  expected parent commit) before anything is written to any hub;
- on the Hugging Face Hub the commit carries ``parent_commit``, so a concurrent change makes the
  server refuse it (HTTP 412) and nothing is written; ModelScope has no such check, so the branch
  head is read again right before its commit.

:func:`verify_registry` checks every registry entry (files in the cache, or downloaded) and backs
``rotationzoo verify --registry``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from ._version import __version__
from .errors import AuthError, InvalidRotationError, PublishError, RegistryError, RotationZooError, UnknownModelError
from .registry import DEFAULT_SERVING, SIDES, lint_registry, parse_tag_name

log = logging.getLogger("rotationzoo")

#: The fitter's manifest, uploaded next to the rotation files when present.
MANIFEST_NAME = "rotationzoo.json"
#: Hubs :func:`publish` can write to, in the order they are written.
HUBS: tuple[str, str] = ("huggingface", "modelscope")
#: Marker comments that delimit the rotation table in a repository's ``README.md``.
CARD_BEGIN = "<!-- rotationzoo:table:begin -->"
CARD_END = "<!-- rotationzoo:table:end -->"
CARD_HEADER = (
    "| model | tag | layers × d | objectives (K / V) | files | sha256 (K / V) |\n"
    "|---|---|---|---|---|---|\n"
)
#: Environment variables holding each hub's write token.
TOKEN_ENV = {"huggingface": ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"), "modelscope": ("MODELSCOPE_API_TOKEN",)}
_LOGIN_HINT = {
    "huggingface": "set HF_TOKEN, run `hf auth login`, or pass --token huggingface=<token>",
    "modelscope": ("set MODELSCOPE_API_TOKEN, run `modelscope login --token <token>`, "
                   "or pass --token modelscope=<token>"),
}
_HUB_ALIASES = {"huggingface": "huggingface", "hf": "huggingface", "modelscope": "modelscope", "ms": "modelscope"}
_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")

#: Called with one line of human-readable progress.
Reporter = Callable[[str], None]


# -- results -------------------------------------------------------------------------------------


@dataclass
class UploadFile:
    """One file of an upload.

    Attributes:
        role: ``"k"``, ``"v"``, ``"k-safetensors"``, ``"v-safetensors"`` or ``"manifest"``.
        local: the local file (safetensors copies live in a temporary folder removed when
            :func:`publish` returns).
        path: destination path inside the repository (``<model folder>/<tag>/<name>``).
        size: bytes.
        sha256: hex digest.
    """

    role: str
    local: Path
    path: str
    size: int
    sha256: str

    @property
    def lfs(self) -> bool:
        """Rotation files go through LFS; the manifest and the model card are plain text."""
        return self.role != "manifest"

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "local": str(self.local), "path": self.path, "size": self.size,
                "sha256": self.sha256}


@dataclass
class HubResult:
    """What happened (or, in a dry run, would happen) on one hub.

    Attributes:
        hub: ``"huggingface"`` or ``"modelscope"``.
        repo: ``namespace/name``.
        branch: the branch committed to (ModelScope's ``master`` when ``main`` was asked for).
        endpoint: the hub URL used.
        exists: whether the repository existed before.
        parent: branch head read before committing (the commit's parent).
        commit: the new commit sha (None in a dry run).
        tag: the tag created, if any.
        revision: the revision the registry entry pins for this hub (HF: the commit sha;
            ModelScope: the created tag, else the branch).
        replaced: files under the tag folder that existed before and were overwritten or removed.
        card: what happened to ``README.md``: ``"created"``, ``"section added"``, ``"row added"``,
            ``"row replaced"``.
        problems: reasons the upload would be refused (dry run only; a real run raises instead).
    """

    hub: str
    repo: str
    branch: str
    endpoint: str | None = None
    exists: bool | None = None
    parent: str | None = None
    commit: str | None = None
    tag: str | None = None
    revision: str | None = None
    replaced: list[str] = field(default_factory=list)
    card: str | None = None
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PublishResult:
    """Outcome of :func:`publish`.

    Attributes:
        model: the full model id (``Qwen/Qwen3-8B``).
        tag: the calibration tag.
        repo: the destination repository (of the first hub; each :class:`HubResult` has its own).
        folder: ``<model folder>/<tag>``, the folder the files went to in the repository.
        dry_run: True when nothing was written.
        files: the uploaded files (rotation pair first).
        hubs: one :class:`HubResult` per hub, in upload order.
        layer_ids: layers the pair covers.
        head_dim: ``d``.
        objectives: ``{"k": ..., "v": ...}`` from the files.
        model_entry: registry JSON of the model holding only this tag (same schema as
            ``registry.json``); see :attr:`entry` for the tag alone.
        registry_out: the registry file the entry was merged into, if any.
        registry_changed: whether that file's bytes changed.
        warnings: non-fatal findings (manifest disagreeing with the arguments, ...).
    """

    model: str
    tag: str
    repo: str
    folder: str
    dry_run: bool
    files: list[UploadFile]
    hubs: list[HubResult]
    layer_ids: tuple[int, ...]
    head_dim: int
    objectives: dict[str, str]
    model_entry: dict[str, Any]
    registry_out: Path | None = None
    registry_changed: bool = False
    warnings: list[str] = field(default_factory=list)

    @property
    def entry(self) -> dict[str, Any]:
        """The registry tag entry (``files``, ``sources``, ``objectives``, ``serving``, ...)."""
        return self.model_entry["tags"][self.tag]

    @property
    def ok(self) -> bool:
        """False when a dry run found a reason the upload would be refused."""
        return not any(h.problems for h in self.hubs)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "tag": self.tag,
            "repo": self.repo,
            "folder": self.folder,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "layers": len(self.layer_ids),
            "layer_ids": list(self.layer_ids),
            "head_dim": self.head_dim,
            "objectives": dict(self.objectives),
            "files": [f.to_json() for f in self.files],
            "hubs": [h.to_json() for h in self.hubs],
            "entry": self.model_entry,
            "registry_out": str(self.registry_out) if self.registry_out else None,
            "registry_changed": self.registry_changed,
            "warnings": list(self.warnings),
        }


# -- local preparation (no network) --------------------------------------------------------------


@dataclass
class _Plan:
    directory: Path
    model_id: str
    model_folder: str
    tag: str
    known_model: Any  # ModelEntry | None
    files: list[UploadFile]
    layer_ids: tuple[int, ...]
    head_dim: int
    objectives: dict[str, str]
    manifest: dict[str, Any] | None
    warnings: list[str] = field(default_factory=list)

    @property
    def folder(self) -> str:
        return f"{self.model_folder}/{self.tag}"

    def pair(self, side: str) -> UploadFile:
        return next(f for f in self.files if f.role == side)


def find_pair(directory: str | os.PathLike[str]) -> tuple[Path, Path, Path | None]:
    """The K file, the V file and the manifest (or None) of a fitter output folder.

    The manifest's ``files`` names win when it names files that exist; otherwise exactly one
    ``k_rotation*.pt`` and one ``v_rotation*.pt`` must be present (``.safetensors`` when there is
    no ``.pt`` pair).

    Raises:
        PublishError: the folder is missing, or the pair is missing or ambiguous.
    """
    d = Path(directory)
    if not d.is_dir():
        raise PublishError(f"{d}: not a folder; give the folder the fitter wrote (rotation files + {MANIFEST_NAME})")
    manifest = d / MANIFEST_NAME
    manifest_path = manifest if manifest.is_file() else None
    if manifest_path is not None:
        try:
            named = (json.loads(manifest.read_text(encoding="utf-8")).get("files") or {})
            picked = {s: d / str(named[s]["name"]) for s in SIDES if isinstance(named.get(s), Mapping)
                      and named[s].get("name")}
        except (OSError, ValueError, AttributeError, TypeError):
            picked = {}
        if len(picked) == 2 and all(p.is_file() for p in picked.values()):
            return picked["k"], picked["v"], manifest_path
    found: dict[str, list[Path]] = {}
    for suffix in (".pt", ".safetensors"):
        found = {s: sorted(p for p in d.glob(f"{s}_rotation*{suffix}") if p.is_file()) for s in SIDES}
        if found["k"] or found["v"]:
            break
    for side in SIDES:
        if not found[side]:
            raise PublishError(
                f"{d}: no {side.upper()} rotation file ({side}_rotation*.pt or {side}_rotation*.safetensors); "
                f"publish needs both the K and the V file"
            )
        if len(found[side]) > 1:
            names = ", ".join(p.name for p in found[side])
            raise PublishError(
                f"{d}: {len(found[side])} {side.upper()} rotation files ({names}); keep exactly one of each "
                f"(or name them in {MANIFEST_NAME})"
            )
    return found["k"][0], found["v"][0], manifest_path


def _registry() -> Any:
    """The registry as :func:`~rotationzoo.registry.load_registry` sees it, except that overlay files
    which do not exist yet are skipped (the usual first ``--registry-out`` target)."""
    from . import config
    from .registry import Registry, bundled_registry_path

    overlays = [p for p in config.registry_overlays() if p.exists()]
    return Registry.from_files([bundled_registry_path(), *overlays], origins=["bundled", *map(str, overlays)])


def _resolve_model(model: str) -> tuple[str, Any]:
    """(full model id, ModelEntry or None). Unknown models need a full ``NS/NAME`` id."""
    try:
        known = _registry().resolve(model)
    except UnknownModelError:
        known = None
    if known is not None:
        return known.id, known
    if not _MODEL_ID_RE.match(model.strip()):
        raise PublishError(
            f"unknown model '{model}': for a model that is not in the registry, give its full id "
            f"NAMESPACE/NAME as on the Hugging Face Hub (e.g. Qwen/Qwen3-8B)"
        )
    return model.strip(), None


def _check_name(what: str, value: str) -> None:
    if not value or not _NAME_RE.match(value) or value in (".", ".."):
        raise PublishError(f"{what} {value!r} must be one path component of letters, digits and . _ + -")


def _prepare(
    directory: str | os.PathLike[str],
    *,
    model: str,
    tag: str,
    safetensors: bool,
    atol: float,
    staging: Path | None,
) -> _Plan:
    """Read, validate and hash everything locally. Raises before any network access."""
    from .format import read_rotation, write_rotation
    from .validation import sha256_file, validate

    _check_name("tag", tag)
    model_id, known = _resolve_model(model)
    folder = model_id.split("/", 1)[1]
    k_path, v_path, manifest_path = find_pair(directory)
    warn: list[str] = []
    arch = known.architecture if known is not None else None
    expected_ids = arch.expected_layer_ids() if arch is not None else None
    sets = {}
    for side, p in (("k", k_path), ("v", v_path)):
        try:
            rs = read_rotation(p)
        except RotationZooError as exc:
            raise InvalidRotationError(f"refusing to publish: {exc}") from None
        try:
            validate(rs, atol=atol, layer_ids=expected_ids, head_dim=arch.head_dim if arch else None)
        except InvalidRotationError as exc:
            where = f" for {model_id}" if arch is not None else ""
            raise InvalidRotationError(f"refusing to publish {p.name}{where}: {exc}", exc.problems) from None
        sets[side] = rs
    k, v = sets["k"], sets["v"]
    if k.layer_ids != v.layer_ids or k.head_dim != v.head_dim:
        raise InvalidRotationError(
            f"refusing to publish: K and V files disagree: {k_path.name} has {len(k.layer_ids)} layers × "
            f"d {k.head_dim} "
            f"(ids {_short(k.layer_ids)}), {v_path.name} has {len(v.layer_ids)} layers × d {v.head_dim} "
            f"(ids {_short(v.layer_ids)})"
        )
    files = [
        UploadFile(side, p, f"{folder}/{tag}/{p.name}", p.stat().st_size, sha256_file(p))
        for side, p in (("k", k_path), ("v", v_path))
    ]
    manifest = None
    if manifest_path is not None:
        manifest = _check_manifest(manifest_path, files, k, model_id, tag, warn)
    if safetensors:
        if k_path.suffix == ".safetensors":
            warn.append("the rotation files are safetensors already; no extra copies made")
        else:
            assert staging is not None
            for side, p in (("k", k_path), ("v", v_path)):
                out = write_rotation(staging / "safetensors" / f"{p.stem}.safetensors", sets[side], fmt="safetensors")
                files.append(UploadFile(f"{side}-safetensors", out, f"{folder}/{tag}/{out.name}",
                                        out.stat().st_size, sha256_file(out)))
    if manifest_path is not None:
        files.append(UploadFile("manifest", manifest_path, f"{folder}/{tag}/{MANIFEST_NAME}",
                                manifest_path.stat().st_size, sha256_file(manifest_path)))
    return _Plan(
        directory=Path(directory), model_id=model_id, model_folder=folder, tag=tag, known_model=known,
        files=files, layer_ids=k.layer_ids, head_dim=k.head_dim,
        objectives={"k": k.objective, "v": v.objective}, manifest=manifest, warnings=warn,
    )


def _short(ids: Sequence[int]) -> str:
    return ", ".join(map(str, list(ids)[:10])) + (" ..." if len(ids) > 10 else "")


def _check_manifest(path: Path, files: list[UploadFile], rs: Any, model_id: str, tag: str,
                    warn: list[str]) -> dict[str, Any]:
    """The manifest must describe exactly these files; disagreements on names are warnings."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PublishError(f"{path}: not valid JSON ({exc}); fix or remove the manifest") from None
    if not isinstance(manifest, dict):
        raise PublishError(f"{path}: expected a JSON object")
    listed = manifest.get("files") or {}
    for f in files:
        entry = listed.get(f.role) if isinstance(listed, Mapping) else None
        if not isinstance(entry, Mapping):
            raise PublishError(f"{path}: no files.{f.role} entry; the manifest does not describe {f.local.name}")
        if entry.get("name") not in (None, f.local.name):
            raise PublishError(f"{path}: files.{f.role}.name is {entry.get('name')!r} but the {f.role.upper()} "
                               f"file is {f.local.name}")
        if entry.get("sha256") != f.sha256:
            raise PublishError(
                f"{path}: files.{f.role}.sha256 is {entry.get('sha256')} but {f.local.name} has sha256 {f.sha256}; "
                f"the file changed after fitting (re-run the fitter, or fix the manifest)"
            )
        if entry.get("size") is not None and entry.get("size") != f.size:
            raise PublishError(f"{path}: files.{f.role}.size is {entry.get('size')} but {f.local.name} has {f.size} B")
    if manifest.get("head_dim") is not None and manifest["head_dim"] != rs.head_dim:
        raise PublishError(f"{path}: head_dim {manifest['head_dim']} but the files have d = {rs.head_dim}")
    ids = manifest.get("layer_ids")
    if ids is not None and [int(i) for i in ids] != list(rs.layer_ids):
        raise PublishError(f"{path}: layer_ids {_short(ids)} but the files cover {_short(rs.layer_ids)}")
    m = manifest.get("model")
    if m and str(m).lower() != model_id.lower() and str(m).split("/")[-1].lower() != model_id.split("/")[-1].lower():
        warn.append(f"{MANIFEST_NAME} names model {m!r}, publishing as {model_id}")
    if manifest.get("tag") and manifest["tag"] != tag:
        warn.append(f"{MANIFEST_NAME} names tag {manifest['tag']!r}, publishing as {tag!r}")
    return manifest


# -- model card ----------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row_key(line: str) -> tuple[str, str] | None:
    if not line.lstrip().startswith("|"):
        return None
    cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())]
    if len(cells) < 4:
        return None
    return cells[1], cells[2]


def card_row(model_folder: str, tag: str, layers: int, head_dim: int, objectives: Mapping[str, str],
             files: Mapping[str, tuple[str, str]]) -> str:
    """One table row (no newline); ``files`` maps ``k``/``v`` to ``(repo path, sha256)``."""
    links = " · ".join(f"[{s.upper()}]({files[s][0]})" for s in SIDES)
    shas = " / ".join(f"`{files[s][1][:12]}`" for s in SIDES)
    cells = [model_folder, tag, f"{layers} × {head_dim}", f"{objectives['k']} / {objectives['v']}", links, shas]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def update_model_card(text: str, key: tuple[str, str], row: str, *, title: str = "") -> tuple[str, str]:
    """``README.md`` text with the row for ``key`` (model folder, tag) added or replaced.

    Only the table between :data:`CARD_BEGIN` and :data:`CARD_END` is touched, and in it only the
    row whose first two cells are ``key``; every other byte stays as it was. Without the markers,
    a section holding them is appended (or a new card is written when ``text`` is empty).

    Returns:
        ``(new text, what happened)`` where what happened is ``"created"``, ``"section added"``,
        ``"row added"`` or ``"row replaced"``.
    """
    begin = text.find(CARD_BEGIN)
    end = text.find(CARD_END, begin + len(CARD_BEGIN)) if begin >= 0 else -1
    if begin < 0 or end < 0:
        section = f"## Rotations\n\n{CARD_BEGIN}\n{CARD_HEADER}{row}\n{CARD_END}\n"
        if not text.strip():
            front = "---\ntags:\n- rotationzoo\n- kv-cache-quantization\n---\n\n"
            intro = (f"# {title}\n\n" if title else "") + (
                "OSCAR rotations for 2-bit (INT2) KV caches: one orthogonal matrix per attention layer for "
                "the keys and one for the values. Load them with "
                "[rotationzoo](https://pypi.org/project/rotationzoo/): `rotationzoo.load(MODEL, TAG)`.\n\n"
            )
            return front + intro + section, "created"
        sep = "\n" if text.endswith("\n") else "\n\n"
        return text + sep + section, "section added"
    head, inner, tail = text[: begin + len(CARD_BEGIN)], text[begin + len(CARD_BEGIN): end], text[end:]
    lines = inner.splitlines(keepends=True)
    out: list[str] = []
    replaced = False
    for line in lines:
        if _row_key(line) == key and not set(line.strip()) <= set("|-: "):
            if not replaced:
                ending = line[len(line.rstrip("\r\n")):] or "\n"
                out.append(row + ending)
                replaced = True
            continue  # a duplicate row of the same entry is dropped
        out.append(line)
    if replaced:
        return head + "".join(out) + tail, "row replaced"
    body = "".join(out)
    if not body.endswith("\n"):
        body += "\n"
    if not any(line.lstrip().startswith("|") for line in out):
        body += CARD_HEADER
    return head + body + row + "\n" + tail, "row added"


# -- registry entry ------------------------------------------------------------------------------


def _raw_models() -> list[dict[str, Any]]:
    """Model dicts of the bundled registry and the ``ROTATIONZOO_REGISTRY`` overlays, in order."""
    from . import config
    from .registry import bundled_registry_path

    out = []
    for p in [bundled_registry_path(), *config.registry_overlays()]:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        out.extend(m for m in data.get("models", []) if isinstance(m, dict))
    return out


def _raw_model(model_id: str) -> dict[str, Any] | None:
    found = None
    for m in _raw_models():
        if m.get("id") == model_id:
            found = m  # overlays come later and win
    return json.loads(json.dumps(found)) if found is not None else None


def _architecture_json(plan: _Plan) -> dict[str, Any]:
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


def _tag_json(plan: _Plan, hubs: Sequence[HubResult], existing: Mapping[str, Any] | None,
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
    serving = dict(DEFAULT_SERVING)
    clip = m.get("clip_ratio") if isinstance(m.get("clip_ratio"), Mapping) else {}
    for side in SIDES:
        value = clip.get(side)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
            serving[f"{side}_clip_ratio"] = float(value)
    group = parsed.get("group_size") or calibration.get("group_size")
    if isinstance(group, int) and group >= 16:
        serving["group_size"] = group
    if not description:
        how = f" ({m['composition']})" if isinstance(m.get("composition"), str) else ""
        description = f"Fitted rotations{how}, published with rotationzoo {__version__}"
    return {
        "description": description,
        "calibration": calibration,
        "objectives": dict(plan.objectives),
        "serving": serving,
        "results": [],
        "sources": sources,
        "files": files,
    }


def _model_json(plan: _Plan, tag_json: dict[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any]:
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


def _read_registry_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"registry_version": 1, "models": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path}: not a readable registry file ({exc}); refusing to overwrite it") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise RegistryError(f"{path}: expected an object with a 'models' list; refusing to overwrite it")
    return data


def merge_into_registry(data: dict[str, Any], model: Mapping[str, Any], tag: str) -> dict[str, Any]:
    """Add or replace ``model``'s tag ``tag`` in a registry document (in place; also returned).

    A model already in ``data`` keeps its other fields and tags (and their order); only the one tag
    is added (at the end) or replaced (in place). A model not in ``data`` is appended whole.
    """
    models = data.setdefault("models", [])
    for m in models:
        if isinstance(m, dict) and m.get("id") == model["id"]:
            m.setdefault("tags", {})[tag] = json.loads(json.dumps(model["tags"][tag]))
            return data
    models.append(json.loads(json.dumps(dict(model))))
    return data


def registry_text(data: Mapping[str, Any]) -> str:
    """The canonical bytes of a registry file: ``json.dumps(indent=2)`` plus a newline."""
    return json.dumps(data, indent=2) + "\n"


def _merged_registry(path: Path | None, plan: _Plan, hubs: Sequence[HubResult], description: str | None,
                     dataset: str | None) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(merged document, model entry with only this tag, problems the merge would introduce)."""
    from .registry import schema_path

    data = _read_registry_file(path) if path is not None else {"registry_version": 1, "models": []}
    in_file = next((m for m in data["models"] if isinstance(m, dict) and m.get("id") == plan.model_id), None)
    problems: list[str] = []
    arch = (in_file or {}).get("architecture") if plan.known_model is None else None
    if isinstance(arch, Mapping) and arch.get("head_dim"):  # a model only this file knows: same checks
        ids = arch.get("attention_layer_ids") or (list(range(arch["num_layers"])) if arch.get("num_layers") else None)
        if arch["head_dim"] != plan.head_dim or (ids is not None and list(ids) != list(plan.layer_ids)):
            problems.append(f"{plan.model_id} in {path} needs {len(ids) if ids else '?'} layers × "
                            f"d {arch['head_dim']}, "
                            f"the files have {len(plan.layer_ids)} layers × d {plan.head_dim}")
    known_raw = _raw_model(plan.model_id) if plan.known_model is not None else None
    base = in_file if in_file is not None else known_raw
    existing_tag = (base or {}).get("tags", {}).get(plan.tag) if base is not None else None
    tag_json = _tag_json(plan, hubs, existing_tag, description, dataset)
    full = _model_json(plan, tag_json, base)
    only = dict(full)
    only["tags"] = {plan.tag: tag_json}
    if base is not None and only.get("default_tag") != plan.tag:
        only["default_tag"] = plan.tag  # the single-tag view must name a tag it holds
    schema = None
    try:
        schema = json.loads(schema_path().read_text(encoding="utf-8"))
        import jsonschema  # noqa: F401
    except (ImportError, OSError, ValueError):
        schema = None
    before = set(lint_registry(data, schema=schema).errors)
    merged = merge_into_registry(json.loads(json.dumps(data)), full, plan.tag)
    after = lint_registry(merged, schema=schema).errors
    return merged, only, problems + [e for e in after if e not in before]


def write_registry_file(path: str | os.PathLike[str], data: Mapping[str, Any]) -> bool:
    """Write ``data`` atomically in the canonical format; returns whether the bytes changed."""
    p = Path(path)
    text = registry_text(data)
    try:
        if p.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True


# -- tokens and arguments ------------------------------------------------------------------------


def parse_hubs(to: str | Iterable[str]) -> list[str]:
    """``"huggingface,modelscope"`` (or ``hf``/``ms``) → hub names in upload order, deduplicated."""
    items = [to] if isinstance(to, str) else list(to)
    names: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip().lower()
            if not part:
                continue
            if part not in _HUB_ALIASES:
                raise PublishError(f"unknown hub {part!r}; expected huggingface and/or modelscope")
            if _HUB_ALIASES[part] not in names:
                names.append(_HUB_ALIASES[part])
    if not names:
        raise PublishError("no hub to publish to; give huggingface and/or modelscope")
    return [h for h in HUBS if h in names]


def _per_hub(value: str | Mapping[str, str] | None, hub: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        for key, v in value.items():
            if _HUB_ALIASES.get(str(key).strip().lower()) == hub and v:
                return v
        return None
    return value or None


def find_token(hub: str, token: str | Mapping[str, str] | None = None) -> str | None:
    """The write token for ``hub``: ``token``, then the environment, then the client's stored login."""
    given = _per_hub(token, hub)
    if given:
        return given
    for name in TOKEN_ENV[hub]:
        if os.environ.get(name, "").strip():
            return os.environ[name].strip()
    if hub == "huggingface":
        with contextlib.suppress(Exception):
            from huggingface_hub import get_token

            return get_token() or None
        return None
    with contextlib.suppress(Exception):
        from modelscope_hub.config import HubConfig

        return HubConfig(endpoint=_ms_endpoint() or None).token or None
    return None


def _require_token(hub: str, token: str | Mapping[str, str] | None) -> str:
    found = find_token(hub, token)
    if not found:
        raise AuthError(f"{hub}: no token to publish with; {_LOGIN_HINT[hub]}")
    return found


def _hf_endpoint() -> str | None:
    from .hub import _hf_endpoint as ep

    return ep()


def _ms_endpoint() -> str | None:
    from .hub import _ms_endpoint as ep

    return ep()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep the clients' progress bars and reports off stdout/stderr (stdout may carry JSON)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stale(hub: str, repo: str, branch: str, since: str, now: str | None) -> PublishError:
    now_s = f" (it is now at {now[:12]})" if now else " (another commit landed first)"
    return PublishError(
        f"{hub}: {repo}@{branch} changed since {since[:12]} was read{now_s}; nothing was written; "
        f"re-run to publish on top of the new head"
    )


# -- the hubs ------------------------------------------------------------------------------------


@dataclass
class _State:
    exists: bool
    branch_exists: bool = True
    head: str | None = None
    files: list[str] = field(default_factory=list)
    readme: str | None = None
    tags: set[str] = field(default_factory=set)


class _Hub:
    """Common checks; subclasses talk to one hub's client."""

    name = ""

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        self.repo = repo
        self.branch = branch
        self.token = token
        self.private = private

    def endpoint(self) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def problems(self, state: _State, plan: _Plan, *, force: bool, parent: str | None,
                 create_tag: str | None) -> list[str]:
        out = []
        if state.exists and not state.branch_exists:
            out.append(f"{self.name}: {self.repo} has no branch {self.branch!r}; create it first or pass "
                       f"another --revision")
        if not state.exists and self.branch not in ("main", "master"):
            out.append(f"{self.name}: {self.repo} does not exist; a new repository only has its default branch, "
                       f"not {self.branch!r}")
        if parent is not None and not state.exists:
            out.append(f"{self.name}: {self.repo} does not exist, so its head cannot be the expected parent "
                       f"{parent[:12]}; nothing was written")
        elif parent is not None and state.head != parent:
            out.append(str(_stale(self.name, self.repo, self.branch, parent, state.head)))
        prefix = plan.folder + "/"
        existing = [p for p in state.files if p.startswith(prefix)]
        if existing and not force:
            shown = ", ".join(p[len(prefix):] for p in existing[:4]) + (" ..." if len(existing) > 4 else "")
            out.append(f"{self.name}: {self.repo}@{self.branch} already has {plan.folder}/ ({shown}); "
                       f"pass --force to replace it")
        if create_tag and create_tag in state.tags:
            out.append(f"{self.name}: tag {create_tag!r} already exists in {self.repo}; tags are never moved "
                       f"(a registry may pin them); choose another --create-tag name")
        return out


class _HuggingFace(_Hub):
    name = "huggingface"

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        super().__init__(repo, branch, token, private)
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=_hf_endpoint(), token=token)

    def endpoint(self) -> str | None:
        return self.api.endpoint

    def _fail(self, what: str, exc: Exception) -> PublishError:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return AuthError(f"huggingface: {what}: token rejected by {self.endpoint()} (HTTP {status}: "
                             f"{_first_line(exc)}); {_LOGIN_HINT['huggingface']}")
        code = f"HTTP {status}: " if status else ""
        return PublishError(f"huggingface: {what} failed ({code}{_first_line(exc)})")

    def check_auth(self) -> None:
        try:
            self.api.whoami()
        except Exception as exc:
            raise self._fail("checking the token", exc) from None

    def read_state(self, staging: Path, want_tags: bool) -> _State:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            info = self.api.repo_info(self.repo, revision=self.branch)
        except RepositoryNotFoundError:
            return _State(exists=False)
        except RevisionNotFoundError:
            return _State(exists=True, branch_exists=False)
        except Exception as exc:
            raise self._fail(f"reading {self.repo}", exc) from None
        files = sorted(s.rfilename for s in (info.siblings or []))
        state = _State(exists=True, head=info.sha, files=files)
        try:
            if "README.md" in files:
                with _quiet():
                    p = hf_hub_download(self.repo, "README.md", revision=info.sha, cache_dir=str(staging / "hf-read"),
                                        endpoint=self.endpoint(), token=self.token)
                state.readme = Path(p).read_text(encoding="utf-8")
            if want_tags:
                state.tags = {t.name for t in self.api.list_repo_refs(self.repo).tags}
        except Exception as exc:
            raise self._fail(f"reading {self.repo}", exc) from None
        return state

    def create_repo(self) -> str:
        try:
            self.api.create_repo(self.repo, exist_ok=True, private=self.private)
            return self.api.repo_info(self.repo, revision=self.branch).sha
        except Exception as exc:
            raise self._fail(f"creating {self.repo}", exc) from None

    def commit(self, plan: _Plan, parent: str, readme: bytes, deletions: list[str], message: str,
               description: str) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in deletions]
        ops += [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(f.local)) for f in plan.files]
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=readme))
        try:
            with _quiet():
                info = self.api.create_commit(self.repo, operations=ops, commit_message=message,
                                              commit_description=description, revision=self.branch,
                                              parent_commit=parent)
        except Exception as exc:
            if getattr(getattr(exc, "response", None), "status_code", None) == 412:
                now = None
                with contextlib.suppress(Exception):
                    now = self.api.repo_info(self.repo, revision=self.branch).sha
                raise _stale(self.name, self.repo, self.branch, parent, now) from None
            raise self._fail(f"committing to {self.repo}@{self.branch}", exc) from None
        return info.oid

    def tag(self, name: str, commit: str, message: str) -> None:
        try:
            self.api.create_tag(self.repo, tag=name, revision=commit, tag_message=message)
        except Exception as exc:
            raise self._fail(f"creating tag {name!r} (the commit {commit[:12]} is published)", exc) from None


class _ModelScope(_Hub):
    name = "modelscope"

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        super().__init__(repo, branch, token, private)
        try:
            from modelscope_hub import HubApi
        except ImportError:
            raise PublishError("modelscope: publishing needs the modelscope_hub package that ships with current "
                               "modelscope releases (pip install -U modelscope)") from None
        self.api = HubApi(endpoint=_ms_endpoint(), token=token)

    def endpoint(self) -> str | None:
        config = getattr(self.api, "_config", None)  # the client keeps its resolved endpoint there
        return getattr(config, "endpoint", None) or _ms_endpoint()

    def _fail(self, what: str, exc: Exception) -> PublishError:
        from modelscope_hub.errors import AuthenticationError, PermissionDeniedError

        status = getattr(exc, "status_code", None)
        if isinstance(exc, (AuthenticationError, PermissionDeniedError)) or status in (401, 403):
            return AuthError(f"modelscope: {what}: token rejected by {self.endpoint()} ({_first_line(exc)}); "
                             f"{_LOGIN_HINT['modelscope']}")
        return PublishError(f"modelscope: {what} failed ({_first_line(exc)})")

    def check_auth(self) -> None:
        try:
            self.api.whoami()
        except Exception as exc:
            raise self._fail("checking the token", exc) from None

    def head(self) -> tuple[str | None, set[str], bool]:
        branches, tags = self.api.legacy.list_revisions_detail(self.repo, "model")
        head = next((b.get("CommitId") for b in branches if b.get("Revision") == self.branch), None)
        exists = any(b.get("Revision") == self.branch for b in branches)
        return head, {t.get("Revision") for t in tags if t.get("Revision")}, exists

    def read_state(self, staging: Path, want_tags: bool) -> _State:
        try:
            if not self.api.repo_exists(self.repo, "model"):
                return _State(exists=False)
            head, tags, branch_exists = self.head()
            if not branch_exists:
                return _State(exists=True, branch_exists=False, tags=tags)
            files = sorted(f.path for f in self.api.list_repo_files(self.repo, "model", revision=self.branch)
                           if (f.type or "blob") != "tree")
            state = _State(exists=True, head=head, files=files, tags=tags)
            if "README.md" in files:
                with _quiet():
                    p = self.api.download_file(self.repo, "model", "README.md", revision=self.branch,
                                               cache_dir=staging / "ms-read")
                state.readme = Path(p).read_text(encoding="utf-8")
        except PublishError:
            raise
        except Exception as exc:
            raise self._fail(f"reading {self.repo}", exc) from None
        return state

    def create_repo(self) -> str:
        from modelscope_hub.errors import AlreadyExistsError

        try:
            with contextlib.suppress(AlreadyExistsError):
                self.api.create_repo(self.repo, "model", visibility="private" if self.private else "public")
            head, _, _ = self.head()
        except Exception as exc:
            raise self._fail(f"creating {self.repo}", exc) from None
        if head is None:
            raise PublishError(f"modelscope: {self.repo} was created but has no branch {self.branch!r}")
        return head

    def commit(self, plan: _Plan, parent: str, readme: bytes, deletions: list[str], message: str,
               description: str) -> str:
        import base64

        legacy = self.api.legacy
        ops: list[dict[str, Any]] = [
            {"action": "delete", "path": p, "type": "normal", "size": 0, "sha256": "", "content": "", "encoding": ""}
            for p in deletions
        ]
        try:
            lfs = [f for f in plan.files if f.lfs]
            if lfs:
                objects = list({f.sha256: {"oid": f.sha256, "size": f.size} for f in lfs}.values())
                hrefs = legacy.validate_blobs(self.repo, "model", objects)
                uploaded: set[str] = set()
                for f in lfs:
                    href = hrefs.get(f.sha256)
                    if href and f.sha256 not in uploaded:
                        with open(f.local, "rb") as fh:
                            legacy.upload_blob(href, fh, f.size)
                        uploaded.add(f.sha256)
            for f in plan.files:
                if f.lfs:
                    ops.append({"action": "create", "path": f.path, "type": "lfs", "size": f.size,
                                "sha256": f.sha256, "content": "", "encoding": ""})
                else:
                    data = f.local.read_bytes()
                    ops.append({"action": "create", "path": f.path, "type": "normal", "size": len(data),
                                "sha256": "", "content": base64.b64encode(data).decode(), "encoding": "base64"})
            ops.append({"action": "create", "path": "README.md", "type": "normal", "size": len(readme),
                        "sha256": "", "content": base64.b64encode(readme).decode(), "encoding": "base64"})
            # ModelScope commits carry no parent: compare the head once more right before committing
            now, _, _ = self.head()
        except Exception as exc:
            raise self._fail(f"uploading to {self.repo}", exc) from None
        if now != parent:
            raise _stale(self.name, self.repo, self.branch, parent, now)
        try:
            body = legacy.create_commit(self.repo, "model", ops, f"{message}\n\n{description}".strip(),
                                        revision=self.branch)
        except Exception as exc:
            raise self._fail(f"committing to {self.repo}@{self.branch}", exc) from None
        sha = body.get("CommitId") if isinstance(body, Mapping) else None
        if not sha:
            with contextlib.suppress(Exception):
                sha, _, _ = self.head()
        return str(sha or "")

    def tag(self, name: str, commit: str, message: str) -> None:
        try:
            self.api.create_repo_tag(self.repo, "model", name, revision=commit or self.branch)
        except Exception as exc:
            raise self._fail(f"creating tag {name!r} (the commit {commit[:12]} is published)", exc) from None


def _hub_branch(hub: str, revision: str) -> str:
    """ModelScope's default branch is ``master``: ``main`` is mapped to it there."""
    return "master" if hub == "modelscope" and revision == "main" else revision


def _parse_parents(expected_parent: str | Mapping[str, str] | None, hubs: Sequence[str]) -> dict[str, str]:
    if expected_parent is None:
        return {}
    if isinstance(expected_parent, Mapping):
        out = {parse_hubs(k)[0]: v for k, v in expected_parent.items() if v}
    else:
        out = {h: expected_parent for h in hubs}
    for hub, sha in out.items():
        if not _HEX40.match(sha):
            raise PublishError(f"expected parent for {hub} {sha!r} is not a 40-hex commit sha")
    return out


# -- publish -------------------------------------------------------------------------------------


def publish(
    directory: str | os.PathLike[str],
    *,
    repo: str | Mapping[str, str],
    model: str,
    tag: str,
    to: str | Iterable[str] = HUBS,
    revision: str = "main",
    create_tag: str | None = None,
    registry_out: str | os.PathLike[str] | None = None,
    dry_run: bool = False,
    force: bool = False,
    token: str | Mapping[str, str] | None = None,
    expected_parent: str | Mapping[str, str] | None = None,
    safetensors: bool = False,
    description: str | None = None,
    dataset: str | None = None,
    commit_message: str | None = None,
    private: bool = False,
    atol: float = 1e-5,
    report: Reporter | None = None,
) -> PublishResult:
    """Validate a fitted K/V pair and upload it under ``<model folder>/<tag>/`` in one commit per hub.

    Args:
        directory: folder with ``k_rotation*.pt`` and ``v_rotation*.pt`` (or ``.safetensors``) and
            optionally the fitter's ``rotationzoo.json`` (uploaded too; its sha256s must match).
        repo: destination repository ``namespace/name`` on every hub, or one per hub
            (``{"huggingface": "me/RotationZoo", "modelscope": "me2/RotationZoo"}``).
        model: registry model (id or alias) or, for a new model, its full ``NAMESPACE/NAME`` id.
            The files go to the folder named after the part after ``/``.
        tag: calibration tag, e.g. ``seq20000_prompt83_group128``.
        to: hubs, ``"huggingface,modelscope"`` by default.
        revision: branch to commit to; on ModelScope ``main`` means its default branch ``master``.
        create_tag: also tag the new commit with this name (never moved once created); the
            ModelScope source of the registry entry then pins it.
        registry_out: merge the registry entry into this registry file (created if missing); only
            this model's tag is added or replaced, everything else keeps its bytes.
        dry_run: read the hubs and report what would be uploaded; write nothing anywhere.
        force: replace an existing ``<model folder>/<tag>/`` (files no longer published are removed
            in the same commit on the Hugging Face Hub).
        token: write token for every hub, or ``{"huggingface": ..., "modelscope": ...}``. Default:
            ``HF_TOKEN`` / ``MODELSCOPE_API_TOKEN``, then the clients' stored logins.
        expected_parent: compare-and-swap: refuse unless the branch head is this commit sha (a
            ``{hub: sha}`` mapping gives one per hub).
        safetensors: also upload safetensors copies of the ``.pt`` files.
        description: description of the registry tag entry.
        dataset: calibration dataset recorded in the registry entry.
        commit_message: first line of the commit message.
        private: create a missing repository as private (default public).
        atol: orthogonality tolerance of the validation.
        report: called with one-line progress messages.

    Returns:
        A :class:`PublishResult` (``result.entry`` is the registry tag entry, pinned to the Hugging
        Face commit sha and holding the sha256 and size of both files).

    Raises:
        InvalidRotationError: a file is not a valid rotation set, K and V disagree, or they do not
            fit the registry model (nothing was sent anywhere).
        AuthError: a token is missing or was rejected (nothing was written).
        PublishError: the tag folder exists (without ``force``), the branch moved (stale parent),
            the manifest does not match the files, or a hub refused the upload.
    """
    say: Reporter = report or (lambda msg: log.info(msg))
    hubs = parse_hubs(to)
    repos = {h: _per_hub(repo, h) or "" for h in hubs}
    for h, r in repos.items():
        if not _MODEL_ID_RE.match(r):
            raise PublishError(f"{h}: repository {r!r} must be NAMESPACE/NAME (--repo)")
    _check_name("revision", revision)
    if create_tag is not None:
        _check_name("tag name", create_tag)
    parents = _parse_parents(expected_parent, hubs)
    out_path = Path(registry_out) if registry_out is not None else None
    with tempfile.TemporaryDirectory(prefix="rotationzoo-publish-") as tmp:
        staging = Path(tmp)
        plan = _prepare(directory, model=model, tag=tag, safetensors=safetensors, atol=atol, staging=staging)
        for w in plan.warnings:
            say(f"warning: {w}")
        results = [HubResult(hub=h, repo=repos[h], branch=_hub_branch(h, revision), tag=create_tag) for h in hubs]
        # the registry merge is checked before anything is uploaded (with placeholder revisions)
        for r in results:
            r.revision = create_tag if (r.hub == "modelscope" and create_tag) else (
                "0" * 40 if r.hub == "huggingface" else r.branch)
        if out_path is not None:
            _, _, errors = _merged_registry(out_path, plan, results, description, dataset)
            if errors:
                raise PublishError(f"merging into {out_path} would make it invalid: {'; '.join(errors[:3])}; "
                                   f"nothing was uploaded")
        tokens = {h: (find_token(h, token) if dry_run else _require_token(h, token)) for h in hubs}
        clients: list[_Hub] = []
        for r in results:
            cls = _HuggingFace if r.hub == "huggingface" else _ModelScope
            client = cls(r.repo, r.branch, tokens[r.hub], private)
            r.endpoint = client.endpoint()
            clients.append(client)
        # 1. read every hub and refuse before writing anything anywhere
        states: list[_State] = []
        for client, r in zip(clients, results):
            if not dry_run:
                client.check_auth()
            elif not tokens[r.hub]:
                plan.warnings.append(f"{r.hub}: no token found; the upload will need one ({_LOGIN_HINT[r.hub]})")
            try:
                state = client.read_state(staging, want_tags=create_tag is not None)
            except PublishError as exc:
                if not dry_run:
                    raise
                r.problems.append(str(exc))
                states.append(_State(exists=False))
                continue
            states.append(state)
            r.exists, r.parent = state.exists, state.head
            r.replaced = [p for p in state.files if p.startswith(plan.folder + "/")]
            problems = client.problems(state, plan, force=force, parent=parents.get(r.hub), create_tag=create_tag)
            if problems and not dry_run:
                raise PublishError(problems[0] + ("" if len(problems) == 1 else f" (and: {'; '.join(problems[1:])})"))
            r.problems.extend(problems)
            say(f"{r.hub}: {r.repo}@{r.branch} " + (f"at {state.head[:12]}" if state.head else "(new repository)"))
        key = (plan.model_folder, plan.tag)
        row = card_row(plan.model_folder, plan.tag, len(plan.layer_ids), plan.head_dim, plan.objectives,
                       {s: (plan.pair(s).path, plan.pair(s).sha256) for s in SIDES})
        message = commit_message or f"Publish {plan.model_id} {plan.tag} rotations"
        body = "\n".join(
            [f"rotationzoo {__version__}: {len(plan.layer_ids)} layers × d {plan.head_dim}"]
            + [f"{f.path}  sha256 {f.sha256}  {f.size} B" for f in plan.files]
        )
        if dry_run:
            for state, r in zip(states, results):
                _, r.card = update_model_card(state.readme or "", key, row, title=r.repo.split("/", 1)[1])
                r.revision = None
            return _finish(plan, results, out_path=None, dry_run=True, description=description,
                           dataset=dataset, say=say)
        # 2. write, hub by hub
        done: list[HubResult] = []
        for client, state, r in zip(clients, states, results):
            try:
                parent = state.head
                if not state.exists:
                    say(f"{r.hub}: creating {r.repo}")
                    parent = client.create_repo()
                    r.parent = parent
                if parent is None:
                    raise PublishError(f"{r.hub}: could not read the head of {r.repo}@{r.branch}; nothing was written")
                text, r.card = update_model_card(state.readme or "", key, row, title=r.repo.split("/", 1)[1])
                new_paths = {f.path for f in plan.files}
                deletions = [p for p in r.replaced if p not in new_paths]
                say(f"{r.hub}: uploading {len(plan.files)} files to {r.repo}/{plan.folder}/ in one commit")
                r.commit = client.commit(plan, parent, text.encode("utf-8"), deletions, message, body)
                say(f"{r.hub}: committed {r.commit[:12]} on {r.branch}")
                if create_tag:
                    client.tag(create_tag, r.commit, message)
                    say(f"{r.hub}: tagged {r.commit[:12]} as {create_tag}")
                r.revision = r.commit if r.hub == "huggingface" else (create_tag or r.branch)
            except PublishError as exc:
                if not done:
                    raise
                partial = _finish(plan, done, out_path=out_path, dry_run=False, description=description,
                                  dataset=dataset, say=say)
                where = ", ".join(f"{d.hub} at {d.commit}" for d in done)
                wrote = f"; the registry entry for those was merged into {out_path}" if out_path else ""
                rest = ",".join(x.hub for x in results[len(done):])
                err = type(exc)(f"{exc} (already published: {where}{wrote}; re-run with --to {rest} to finish)")
                err.result = partial  # type: ignore[attr-defined]
                raise err from None
            done.append(r)
        return _finish(plan, results, out_path=out_path, dry_run=False, description=description,
                       dataset=dataset, say=say)


def _finish(plan: _Plan, hubs: list[HubResult], *, out_path: Path | None, dry_run: bool,
            description: str | None, dataset: str | None, say: Reporter) -> PublishResult:
    merged, only, _ = _merged_registry(out_path, plan, hubs, description, dataset)
    changed = False
    if out_path is not None and not dry_run:
        changed = write_registry_file(out_path, merged)
        say(f"registry entry {'merged into' if changed else 'already in'} {out_path}")
    return PublishResult(
        model=plan.model_id, tag=plan.tag, repo=hubs[0].repo if hubs else "", folder=plan.folder,
        dry_run=dry_run, files=plan.files, hubs=hubs, layer_ids=plan.layer_ids, head_dim=plan.head_dim,
        objectives=plan.objectives,
        model_entry=only, registry_out=out_path if not dry_run else None, registry_changed=changed,
        warnings=list(plan.warnings),
    )


# -- checking the published zoo ------------------------------------------------------------------


@dataclass
class EntryCheck:
    """Outcome of checking one registry tag.

    ``status`` is ``"ok"`` (files present, sha256 as pinned, valid), ``"unpinned"`` (valid, but the
    registry has no sha256 to compare with: the observed ones are in ``files``), ``"missing"``
    (not in the cache and no download asked for) or ``"failed"``.
    """

    model: str
    tag: str
    status: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "tag": self.tag, "status": self.status, "files": self.files,
                "problems": list(self.problems)}


def verify_registry(
    *,
    download: bool = False,
    model: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    source: str = "auto",
    atol: float = 1e-5,
    report: Reporter | None = None,
) -> list[EntryCheck]:
    """Check every registry entry: files present (cached, bundled, or downloaded), sha256, structure.

    Args:
        download: fetch entries that are not cached (through :func:`rotationzoo.fetch`, which
            verifies on download); otherwise only cached and bundled files are checked.
        model: only this model (id or alias).
        cache_dir: cache root (default ``ROTATIONZOO_CACHE`` or the user cache dir).
        source: as for :func:`rotationzoo.fetch`.
        atol: orthogonality tolerance.
        report: called with one line per entry.

    Returns:
        One :class:`EntryCheck` per tag, in registry order. Cached files are hashed again (a warm
        cache hit alone would not notice a file changed on disk).
    """
    from .api import fetch
    from .errors import OfflineError
    from .hub import UnpinnedEntryWarning
    from .registry import get_model, load_registry
    from .validation import sha256_file, verify_file

    say: Reporter = report or (lambda msg: log.info(msg))
    models = [get_model(model)] if model is not None else list(load_registry())
    checks: list[EntryCheck] = []
    for m in models:
        ids = m.architecture.expected_layer_ids()
        for tname, entry in m.tags.items():
            check = EntryCheck(m.id, tname, "failed")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UnpinnedEntryWarning)
                    res = fetch(m.id, tname, source=source, cache_dir=cache_dir, offline=not download)
            except OfflineError:
                check.status = "missing"
                check.problems.append("not in the cache (pass --download to fetch it)")
            except RotationZooError as exc:
                check.problems.append(str(exc))
            else:
                layouts = {}
                for side in SIDES:
                    f = entry.files[side]
                    p = res.paths[side]
                    sha = sha256_file(p)
                    rep = verify_file(p, atol=atol, layer_ids=ids, head_dim=m.architecture.head_dim, with_hash=False)
                    check.files[side] = {"path": str(p), "sha256": sha, "registry_sha256": f.sha256,
                                         "size": p.stat().st_size, "source": res.sources[side]}
                    if f.sha256 is not None and sha != f.sha256:
                        check.problems.append(f"{side.upper()} file {p}: sha256 {sha}, the registry pins {f.sha256}")
                    if f.size is not None and p.stat().st_size != f.size:
                        check.problems.append(
                            f"{side.upper()} file {p}: {p.stat().st_size} B, the registry says {f.size} B")
                    check.problems.extend(rep.problems)
                    layouts[side] = (tuple(rep.layer_ids), rep.head_dim)
                if not check.problems and layouts["k"] != layouts["v"]:
                    check.problems.append("K and V files disagree on layers or head_dim")
                if not check.problems:
                    check.status = "ok" if entry.pinned else "unpinned"
            say(f"{m.id}@{tname}: {check.status}" + (f" ({check.problems[0]})" if check.status == "failed" else ""))
            checks.append(check)
    return checks
