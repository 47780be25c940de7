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

- offline mode (``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE`` / ``offline=True``) refuses at once, before
  any request (a dry run too: it reads the hubs);
- nothing leaves the machine before both files (and the manifest) are validated, and what leaves
  is exactly what was validated and hashed: each file is copied into a private staging folder
  first, and the copy is read, validated, hashed and uploaded (a file changed afterwards is not);
- every hub's remote state is read and checked (existing tag folder, branch, immutable tags,
  expected parent commit) before anything is written to any hub;
- on the Hugging Face Hub the commit carries ``parent_commit``, so a concurrent change makes the
  server refuse it (HTTP 412) and nothing is written; ModelScope has no such check, so the branch
  head is read again right before its commit;
- a repository this run created is never deleted: when its commit then fails, the error names it
  as created by this run and left in place.

Modules: :mod:`~rotationzoo.publish.plan` (local checks), :mod:`~rotationzoo.publish.card` (model
card), :mod:`~rotationzoo.publish.entry` (registry entry), :mod:`~rotationzoo.publish.clients`
(the hubs), :mod:`~rotationzoo.publish.verify` (:func:`verify_registry`, behind
``rotationzoo verify --registry``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .. import config
from .._version import __version__
from ..errors import OfflineError, PublishError
from ..files.manifest import MANIFEST_NAME
from ..registry import SIDES
from ..registry.edit import merge_into_registry, registry_text, write_registry_file
from .card import CARD_BEGIN, CARD_END, CARD_HEADER, card_row, update_model_card
from .clients import HUBS, LOGIN_HINT, TOKEN_ENV, HubClient, HubState, find_token, hub_branch, make_client, parse_hubs, parse_parents, per_hub, require_token
from .entry import merged_registry
from ..registry.safety import MODEL_ID
from ..safefile import check_output_path
from .plan import Plan, check_name, find_pair, prepare
from .results import HubResult, PublishResult, UploadFile
from .verify import EntryCheck, verify_registry

log = logging.getLogger("rotationzoo")
#: Called with one line of human-readable progress.
Reporter = Callable[[str], None]


def publish(
    rotations: Any,
    *,
    repo: str | Mapping[str, str],
    model: str,
    tag: str,
    to: str | Iterable[str] = HUBS,
    branch: str = "main",
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
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
) -> PublishResult:
    """Validate a fitted K/V pair and upload it under ``<model folder>/<tag>/`` in one commit per hub.

    Args:
        rotations: what to publish: anything :func:`~rotationzoo.files.pair.resolve_pair` takes with both
            sides: a folder with ``k_rotation*.pt`` and ``v_rotation*.pt`` (or ``.safetensors``) and
            optionally the fitter's ``rotationzoo.json`` (uploaded too; its sha256s must match),
            ``"K.pt,V.pt"``, an exported pair file (its sides are written as ``.pt`` files first), or a
            registry id ``MODEL[@TAG]`` (fetched and verified first: a mirror of a zoo entry).
        repo: destination repository ``namespace/name`` on every hub, or one per hub
            (``{"huggingface": "me/RotationZoo", "modelscope": "me2/RotationZoo"}``).
        model: registry model (id or alias) or, for a new model, its full ``NAMESPACE/NAME`` id.
            The files go to the folder named after the part after ``/``.
        tag: calibration tag, e.g. ``seq20000_prompt83_group128``.
        to: hubs, ``"huggingface,modelscope"`` by default.
        branch: branch to commit to; on ModelScope ``main`` means its default branch ``master``.
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
        source, revision, cache_dir, timeout: the fetch options of a registry id given as
            ``rotations`` (see :func:`rotationzoo.fetch`); ``revision`` is the source's, not ``branch``.
        offline: offline mode (default: ``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE``, as for
            :func:`rotationzoo.fetch`): publish is refused at once, before any request (a dry run
            too, as it reads the hubs).

    Returns:
        A :class:`PublishResult` (``result.entry`` is the registry tag entry, pinned to the Hugging
        Face commit sha and holding the sha256 and size of both files).

    Raises:
        OfflineError: offline mode is on (nothing was read or sent).
        InvalidRotationError: a file is not a valid rotation set, K and V disagree, or they do not
            fit the registry model (nothing was sent anywhere).
        AuthError: a token is missing or was rejected (nothing was written).
        PublishError: the tag folder exists (without ``force``), the branch moved (stale parent),
            the manifest does not match the files, or a hub refused the upload (a repository this
            run created is named, and left in place).
    """
    say: Reporter = report or (lambda msg: log.info(msg))
    _refuse_offline(offline)
    hubs = parse_hubs(to)
    repos = _check_names(repo, hubs, branch, create_tag)
    parents = parse_parents(expected_parent, hubs)
    out_path = Path(registry_out) if registry_out is not None else None
    with tempfile.TemporaryDirectory(prefix="rotationzoo-publish-") as tmp:
        staging = Path(tmp)
        plan = prepare(rotations, model=model, tag=tag, safetensors=safetensors, atol=atol, staging=staging,
                       fetch=dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                                  timeout=timeout))
        for w in plan.warnings:
            say(f"warning: {w}")
        run = _Run(plan, [HubResult(hub=h, repo=repos[h], branch=hub_branch(h, branch), create_tag=create_tag) for h in hubs],
                   out_path, description, dataset, create_tag, dry_run, say)
        _check_registry_merge(run)
        tokens = {h: (find_token(h, token) if dry_run else require_token(h, token)) for h in hubs}
        for r in run.results:
            run.clients.append(make_client(r.hub, r.repo, r.branch, tokens[r.hub], private))
            r.endpoint = run.clients[-1].endpoint()
        _read_hubs(run, tokens, staging, force=force, parents=parents)
        if dry_run:
            _preview_cards(run)
            return _finish(plan, run.results, out_path=None, dry_run=True, description=description,
                           dataset=dataset, say=say)
        _write_hubs(run, commit_message)
        return _finish(plan, run.results, out_path=out_path, dry_run=False, description=description,
                       dataset=dataset, say=say)


def _refuse_offline(offline: bool | None) -> None:
    """Refuse to publish in offline mode, before any request (the resolution :func:`rotationzoo.fetch` uses).

    Raises:
        OfflineError: ``offline`` is true, or it is ``None`` and ``ROTATIONZOO_OFFLINE`` / ``HF_HUB_OFFLINE`` is set.
        ConfigError: one of those variables has a value that is not a boolean.
    """
    if config.offline() if offline is None else offline:
        raise OfflineError(f"offline mode: publish needs the network (it reads every hub before writing, a --dry-run "
                           f"too); nothing was read or sent; publish with offline mode off (offline because "
                           f"{config.offline_reason()})")


def _check_names(repo: str | Mapping[str, str], hubs: list[str], branch: str,
                 create_tag: str | None) -> dict[str, str]:
    """The destination repository per hub, after checking every name the user gave."""
    repos = {h: per_hub(repo, h) or "" for h in hubs}
    for h, name in repos.items():
        if not MODEL_ID.match(name):
            raise PublishError(f"{h}: repository {name!r} must be NAMESPACE/NAME (--repo)")
    check_name("branch", branch)
    if create_tag is not None:
        check_name("tag name", create_tag)
    return repos


def _preview_cards(run: _Run) -> None:
    """Dry run: the model card each hub would get; no revision was written."""
    for state, r in zip(run.states, run.results):
        _, r.card = update_model_card(state.readme or "", run.card_key, run.card_row(),
                                      title=r.repo.split("/", 1)[1])
        r.revision = None


@dataclass
class _Run:
    """One publish in progress: the plan, one result / client / remote state per hub, the options."""

    plan: Plan
    results: list[HubResult]
    out_path: Path | None
    description: str | None
    dataset: str | None
    create_tag: str | None
    dry_run: bool
    say: Reporter
    clients: list[HubClient] = field(default_factory=list)
    states: list[HubState] = field(default_factory=list)

    @property
    def card_key(self) -> tuple[str, str]:
        return self.plan.model_folder, self.plan.tag

    def card_row(self) -> str:
        p = self.plan
        return card_row(p.model_folder, p.tag, len(p.layer_ids), p.head_dim, p.objectives,
                        {s: (p.pair(s).path, p.pair(s).sha256) for s in SIDES})


def _check_registry_merge(run: _Run) -> None:
    """Refuse before uploading when merging the entry into ``--registry-out`` would make it invalid
    (checked with placeholder revisions)."""
    for r in run.results:
        r.revision = run.create_tag if (r.hub == "modelscope" and run.create_tag) else (
            "0" * 40 if r.hub == "huggingface" else r.branch)
    if run.out_path is not None:
        # before the hubs, not after; where a link there leads, as the registry file is written there
        check_output_path(os.path.realpath(run.out_path), what="--registry-out", error=PublishError)
        _, _, errors = merged_registry(run.out_path, run.plan, run.results, run.description, run.dataset)
        if errors:
            raise PublishError(f"merging into {run.out_path} would make it invalid: {'; '.join(errors[:3])}; "
                               f"nothing was uploaded")


def _read_hubs(run: _Run, tokens: Mapping[str, str | None], staging: Path, *, force: bool,
               parents: Mapping[str, str]) -> None:
    """Read every hub and refuse before writing anything anywhere (a dry run records the problems)."""
    for client, r in zip(run.clients, run.results):
        if not run.dry_run:
            client.check_auth()
        elif not tokens[r.hub]:
            run.plan.warnings.append(f"{r.hub}: no token found; the upload will need one ({LOGIN_HINT[r.hub]})")
        try:
            state = client.read_state(staging, want_tags=run.create_tag is not None)
        except PublishError as exc:
            if not run.dry_run:
                raise
            r.problems.append(str(exc))
            run.states.append(HubState(exists=False))
            continue
        run.states.append(state)
        r.exists, r.parent = state.exists, state.head
        r.replaced = [p for p in state.files if p.startswith(run.plan.folder + "/")]
        problems = client.problems(state, run.plan, force=force, parent=parents.get(r.hub),
                                   create_tag=run.create_tag)
        if problems and not run.dry_run:
            raise PublishError(problems[0] + ("" if len(problems) == 1 else f" (and: {'; '.join(problems[1:])})"))
        r.problems.extend(problems)
        run.say(f"{r.hub}: {r.repo}@{r.branch} " + (f"at {state.head[:12]}" if state.head else "(new repository)"))


def _write_hub(run: _Run, client: HubClient, state: HubState, r: HubResult, message: str, body: str) -> None:
    plan = run.plan
    parent = state.head
    if not state.exists:
        run.say(f"{r.hub}: creating {r.repo}")
        parent = client.create_repo()
        r.parent = parent
    if parent is None:
        raise PublishError(f"{r.hub}: could not read the head of {r.repo}@{r.branch}; nothing was written")
    text, r.card = update_model_card(state.readme or "", run.card_key, run.card_row(), title=r.repo.split("/", 1)[1])
    new_paths = {f.path for f in plan.files}
    deletions = [p for p in r.replaced if p not in new_paths]
    run.say(f"{r.hub}: uploading {len(plan.files)} files to {r.repo}/{plan.folder}/ in one commit")
    try:
        r.commit = client.commit(plan, parent, text.encode("utf-8"), deletions, message, body)
    except PublishError as exc:
        if state.exists:
            raise
        raise type(exc)(f"{exc}; the repository {r.repo} did not exist and was created by this run; it is "
                        f"left in place ({'private' if client.private else 'public'}, without this commit): delete "
                        f"it, or re-run to publish into it", exc.result) from None
    run.say(f"{r.hub}: committed {r.commit[:12]} on {r.branch}")
    if run.create_tag:
        client.tag(run.create_tag, r.commit, message)
        run.say(f"{r.hub}: tagged {r.commit[:12]} as {run.create_tag}")
    r.revision = r.commit if r.hub == "huggingface" else (run.create_tag or r.branch)


def _write_hubs(run: _Run, commit_message: str | None) -> None:
    """Write hub by hub; a failure after one hub was written reports what is already published."""
    plan = run.plan
    message = commit_message or f"Publish {plan.model_id} {plan.tag} rotations"
    body = "\n".join(
        [f"rotationzoo {__version__}: {len(plan.layer_ids)} layers × d {plan.head_dim}"]
        + [f"{f.path}  sha256 {f.sha256}  {f.size} B" for f in plan.files]
    )
    done: list[HubResult] = []
    for client, state, r in zip(run.clients, run.states, run.results):
        try:
            _write_hub(run, client, state, r, message, body)
        except PublishError as exc:
            if not done:
                raise
            partial = _finish(plan, done, out_path=run.out_path, dry_run=False, description=run.description,
                              dataset=run.dataset, say=run.say)
            where = ", ".join(f"{d.hub} at {d.commit}" for d in done)
            wrote = f"; the registry entry for those was merged into {run.out_path}" if run.out_path else ""
            rest = ",".join(x.hub for x in run.results[len(done):])
            raise type(exc)(f"{exc} (already published: {where}{wrote}; re-run with --to {rest} to finish)",
                            partial) from None
        done.append(r)


def _finish(plan: Plan, hubs: list[HubResult], *, out_path: Path | None, dry_run: bool,
            description: str | None, dataset: str | None, say: Reporter) -> PublishResult:
    merged, only, _ = merged_registry(out_path, plan, hubs, description, dataset)
    changed = False
    result = PublishResult(
        model=plan.model_id, tag=plan.tag, repo=hubs[0].repo if hubs else "", folder=plan.folder,
        dry_run=dry_run, files=plan.files, hubs=hubs, layer_ids=plan.layer_ids, head_dim=plan.head_dim,
        objectives=plan.objectives,
        model_entry=only, registry_out=out_path if not dry_run else None, registry_changed=changed,
        warnings=list(plan.warnings),
    )
    if out_path is not None and not dry_run:
        try:
            result.registry_changed = write_registry_file(out_path, merged)
        except OSError as exc:  # published already: the entry pinned to its commits must not be lost
            where = ", ".join(f"{h.hub} at {h.commit}" for h in hubs)
            raise PublishError(f"published ({where}) but cannot write {out_path} ({exc.strerror or exc}); add this "
                               f"entry to a registry yourself: {json.dumps(only, sort_keys=True)}", result) from None
        say(f"registry entry {'merged into' if result.registry_changed else 'already in'} {out_path}")
    return result


__all__ = [
    "CARD_BEGIN",
    "CARD_END",
    "CARD_HEADER",
    "HUBS",
    "MANIFEST_NAME",
    "TOKEN_ENV",
    "EntryCheck",
    "HubResult",
    "PublishResult",
    "UploadFile",
    "card_row",
    "find_pair",
    "find_token",
    "merge_into_registry",
    "parse_hubs",
    "publish",
    "registry_text",
    "update_model_card",
    "verify_registry",
    "write_registry_file",
]
