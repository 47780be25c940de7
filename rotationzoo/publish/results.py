"""What :func:`~rotationzoo.publish.publish` reports: files, per-hub outcomes, the registry entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class UploadFile:
    """One file of an upload.

    Attributes:
        role: ``"k"``, ``"v"``, ``"k-safetensors"``, ``"v-safetensors"`` or ``"manifest"``.
        local: the local file it comes from (safetensors copies live in a temporary folder removed when
            :func:`publish` returns).
        path: destination path inside the repository (``<model folder>/<tag>/<name>``).
        size: bytes (of the staged copy).
        sha256: hex digest (of the staged copy).
        staged: the private copy of ``local`` that was read, validated and hashed, and that is uploaded
            (never ``local`` itself, which may change meanwhile); in publish's temporary folder, removed
            when :func:`publish` returns.
    """

    role: str
    local: Path
    path: str
    size: int
    sha256: str
    staged: Path

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
        create_tag: the tag created on the new commit (``create_tag=``, ``--create-tag``; a dry run: the one it would
            create), if any.
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
    create_tag: str | None = None
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
            "model_entry": self.model_entry,
            "entry": self.entry,
            "registry_out": str(self.registry_out) if self.registry_out else None,
            "registry_changed": self.registry_changed,
            "warnings": list(self.warnings),
        }
