"""The two hubs' write clients (Hugging Face Hub, ModelScope), tokens and hub arguments."""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import AuthError, PublishError
from ..hub.sources import hf_endpoint, ms_endpoint
from .plan import Plan

#: Hubs :func:`~rotationzoo.publish.publish` can write to, in the order they are written.
HUBS: tuple[str, str] = ("huggingface", "modelscope")
#: Environment variables holding each hub's write token.
TOKEN_ENV = {"huggingface": ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"), "modelscope": ("MODELSCOPE_API_TOKEN",)}
LOGIN_HINT = {
    "huggingface": "set HF_TOKEN, run `hf auth login`, or pass --token huggingface=<token>",
    "modelscope": ("set MODELSCOPE_API_TOKEN, run `modelscope login --token <token>`, "
                   "or pass --token modelscope=<token>"),
}
_HUB_ALIASES = {"huggingface": "huggingface", "hf": "huggingface", "modelscope": "modelscope", "ms": "modelscope"}
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


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


def per_hub(value: str | Mapping[str, str] | None, hub: str) -> str | None:
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
    given = per_hub(token, hub)
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

        return HubConfig(endpoint=ms_endpoint() or None).token or None
    return None


def require_token(hub: str, token: str | Mapping[str, str] | None) -> str:
    found = find_token(hub, token)
    if not found:
        raise AuthError(f"{hub}: no token to publish with; {LOGIN_HINT[hub]}")
    return found


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep the clients' progress bars and reports off stdout/stderr (stdout may carry JSON)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stale(hub: str, repo: str, branch: str, since: str, now: str | None,
           blobs: list[str] | None = None) -> PublishError:
    """The branch moved. ``blobs``: sha256 of LFS blobs already uploaded to the hub's storage."""
    now_s = f" (it is now at {now[:12]})" if now else " (another commit landed first)"
    if blobs:
        written = (f"no commit was made, but {len(blobs)} LFS blob(s) were already in the hub's storage, "
                   f"referenced by no commit (sha256 {', '.join(b[:12] for b in blobs)}; a re-run reuses them)")
    else:
        written = "nothing was written"
    return PublishError(
        f"{hub}: {repo}@{branch} changed since {since[:12]} was read{now_s}; {written}; "
        f"re-run to publish on top of the new head"
    )


@dataclass
class HubState:
    exists: bool
    branch_exists: bool = True
    head: str | None = None
    files: list[str] = field(default_factory=list)
    readme: str | None = None
    tags: set[str] = field(default_factory=set)


class HubClient:
    """Common checks; subclasses talk to one hub's client."""

    name = ""

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        self.repo = repo
        self.branch = branch
        self.token = token
        self.private = private

    # -- what each hub implements -------------------------------------------------------------------
    def endpoint(self) -> str | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def check_auth(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def read_state(self, staging: Path, want_tags: bool) -> HubState:  # pragma: no cover - overridden
        raise NotImplementedError

    def create_repo(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def commit(self, plan: Plan, parent: str, readme: bytes, deletions: list[str], message: str,
               description: str) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def tag(self, name: str, commit: str, message: str) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def problems(self, state: HubState, plan: Plan, *, force: bool, parent: str | None,
                 create_tag: str | None) -> list[str]:
        out = []
        if state.exists and not state.branch_exists:
            out.append(f"{self.name}: {self.repo} has no branch {self.branch!r}; create it first or pass "
                       f"another --branch")
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


class _HuggingFace(HubClient):
    name = "huggingface"

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        super().__init__(repo, branch, token, private)
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=hf_endpoint(), token=token)

    def endpoint(self) -> str | None:
        return self.api.endpoint

    def _fail(self, what: str, exc: Exception) -> PublishError:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return AuthError(f"huggingface: {what}: token rejected by {self.endpoint()} (HTTP {status}: "
                             f"{_first_line(exc)}); {LOGIN_HINT['huggingface']}")
        code = f"HTTP {status}: " if status else ""
        return PublishError(f"huggingface: {what} failed ({code}{_first_line(exc)})")

    def check_auth(self) -> None:
        try:
            self.api.whoami()
        except Exception as exc:
            raise self._fail("checking the token", exc) from None

    def read_state(self, staging: Path, want_tags: bool) -> HubState:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        try:
            info = self.api.repo_info(self.repo, revision=self.branch)
        except RepositoryNotFoundError:
            return HubState(exists=False)
        except RevisionNotFoundError:
            return HubState(exists=True, branch_exists=False)
        except Exception as exc:
            raise self._fail(f"reading {self.repo}", exc) from None
        files = sorted(s.rfilename for s in (getattr(info, "siblings", None) or []))
        state = HubState(exists=True, head=info.sha, files=files)
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
            sha = self.api.repo_info(self.repo, revision=self.branch).sha
        except Exception as exc:
            raise self._fail(f"creating {self.repo}", exc) from None
        if not sha:
            raise PublishError(f"huggingface: {self.repo} was created but its head could not be read")
        return sha

    def commit(self, plan: Plan, parent: str, readme: bytes, deletions: list[str], message: str,
               description: str) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        ops: list[Any] = [CommitOperationDelete(path_in_repo=p) for p in deletions]
        ops += [CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=str(f.staged)) for f in plan.files]
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
                # create_commit uploads LFS blobs before the commit that the hub refused
                blobs = sorted({f.sha256 for f in plan.files if f.lfs})
                raise _stale(self.name, self.repo, self.branch, parent, now, blobs) from None
            raise self._fail(f"committing to {self.repo}@{self.branch}", exc) from None
        return info.oid

    def tag(self, name: str, commit: str, message: str) -> None:
        try:
            self.api.create_tag(self.repo, tag=name, revision=commit, tag_message=message)
        except Exception as exc:
            raise self._fail(f"creating tag {name!r} (the commit {commit[:12]} is published)", exc) from None


class _ModelScope(HubClient):
    name = "modelscope"

    def __init__(self, repo: str, branch: str, token: str | None, private: bool = False) -> None:
        super().__init__(repo, branch, token, private)
        try:
            from modelscope_hub import HubApi
        except ImportError:
            raise PublishError("modelscope: publishing needs the modelscope_hub package that ships with current "
                               "modelscope releases (pip install -U modelscope)") from None
        self.api = HubApi(endpoint=ms_endpoint(), token=token)

    def endpoint(self) -> str | None:
        config = getattr(self.api, "_config", None)  # the client keeps its resolved endpoint there
        return getattr(config, "endpoint", None) or ms_endpoint()

    def _fail(self, what: str, exc: Exception) -> PublishError:
        from modelscope_hub.errors import AuthenticationError, PermissionDeniedError

        status = getattr(exc, "status_code", None)
        if isinstance(exc, (AuthenticationError, PermissionDeniedError)) or status in (401, 403):
            return AuthError(f"modelscope: {what}: token rejected by {self.endpoint()} ({_first_line(exc)}); "
                             f"{LOGIN_HINT['modelscope']}")
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
        return head, {str(t["Revision"]) for t in tags if t.get("Revision")}, exists

    def read_state(self, staging: Path, want_tags: bool) -> HubState:
        try:
            if not self.api.repo_exists(self.repo, "model"):
                return HubState(exists=False)
            head, tags, branch_exists = self.head()
            if not branch_exists:
                return HubState(exists=True, branch_exists=False, tags=tags)
            files = sorted(f.path for f in self.api.list_repo_files(self.repo, "model", revision=self.branch)
                           if (f.type or "blob") != "tree")
            state = HubState(exists=True, head=head, files=files, tags=tags)
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

    def commit(self, plan: Plan, parent: str, readme: bytes, deletions: list[str], message: str,
               description: str) -> str:
        import base64

        legacy = self.api.legacy
        ops: list[dict[str, Any]] = [
            {"action": "delete", "path": p, "type": "normal", "size": 0, "sha256": "", "content": "", "encoding": ""}
            for p in deletions
        ]
        uploaded: set[str] = set()
        try:
            lfs = [f for f in plan.files if f.lfs]
            if lfs:
                objects = list({f.sha256: {"oid": f.sha256, "size": f.size} for f in lfs}.values())
                hrefs = legacy.validate_blobs(self.repo, "model", objects)
                for f in lfs:
                    href = hrefs.get(f.sha256)
                    if href and f.sha256 not in uploaded:
                        with open(f.staged, "rb") as fh:
                            legacy.upload_blob(href, fh, f.size)
                        uploaded.add(f.sha256)
            for f in plan.files:
                if f.lfs:
                    ops.append({"action": "create", "path": f.path, "type": "lfs", "size": f.size,
                                "sha256": f.sha256, "content": "", "encoding": ""})
                else:
                    data = f.staged.read_bytes()
                    ops.append({"action": "create", "path": f.path, "type": "normal", "size": len(data),
                                "sha256": "", "content": base64.b64encode(data).decode(), "encoding": "base64"})
            ops.append({"action": "create", "path": "README.md", "type": "normal", "size": len(readme),
                        "sha256": "", "content": base64.b64encode(readme).decode(), "encoding": "base64"})
            # ModelScope commits carry no parent: compare the head once more right before committing
            now, _, _ = self.head()
        except Exception as exc:
            raise self._fail(f"uploading to {self.repo}", exc) from None
        if now != parent:
            raise _stale(self.name, self.repo, self.branch, parent, now, sorted(uploaded))
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


def hub_branch(hub: str, revision: str) -> str:
    """ModelScope's default branch is ``master``: ``main`` is mapped to it there."""
    return "master" if hub == "modelscope" and revision == "main" else revision


def make_client(hub: str, repo: str, branch: str, token: str | None, private: bool = False) -> HubClient:
    """The write client of ``hub``."""
    cls = _HuggingFace if hub == "huggingface" else _ModelScope
    return cls(repo, branch, token, private)


def parse_parents(expected_parent: str | Mapping[str, str] | None, hubs: Sequence[str]) -> dict[str, str]:
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
