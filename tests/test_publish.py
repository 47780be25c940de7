"""``rotationzoo publish`` against the in-repo hub server, with the real huggingface_hub and modelscope clients.

The Hugging Face side and the ModelScope side are two separate test servers (as the real hubs are
two services); ``MODELSCOPE_ENDPOINT`` points at the second one.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import random_orthogonal
from hubserver import TEST_TOKEN, hub_env, hub_server, hub_server_factory  # noqa: F401  (fixtures)

import rotationzoo
from rotationzoo import RotationSet, write_rotation
from rotationzoo.cli.main import main
from rotationzoo.errors import AuthError, InvalidRotationError, OfflineError, PublishError
from rotationzoo.publish import (
    CARD_BEGIN,
    CARD_END,
    CARD_HEADER,
    card_row,
    find_pair,
    merge_into_registry,
    publish,
    registry_text,
    update_model_card,
    write_registry_file,
)

pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "zoo/RotationZoo"
MODEL = "acme/Tiny-LM"
TAG = "seq100_prompt2_group16"
FOLDER = f"Tiny-LM/{TAG}"
L, D = 4, 16
WRITE_METHODS = ("POST", "PUT", "DELETE", "PATCH")


def _orthogonal(seed: int, layers: int = L, d: int = D) -> torch.Tensor:
    return random_orthogonal(layers, d, seed)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def make_fitted(out: Path, *, seeds: tuple[int, int] = (1, 2), objectives: tuple[str, str] = ("qqt_r_h_pbr", "sst_r_h_pbr"),
                layers: int = L, d: int = D, manifest: bool = True, model: str = MODEL, tag: str = TAG) -> Path:
    """A fitter-style output folder: K/V ``.pt`` files plus ``rotationzoo.json``."""
    files = {}
    for side, obj, seed in (("k", objectives[0], seeds[0]), ("v", objectives[1], seeds[1])):
        g = torch.Generator().manual_seed(seed + 100)
        rs = RotationSet(_orthogonal(seed, layers, d), range(layers), obj, torch.rand(layers, d, generator=g))
        p = write_rotation(out / f"{side}_rotation_{obj}.pt", rs)
        files[side] = {"name": p.name, "objective": obj, "sha256": _sha(p), "size": p.stat().st_size}
    if manifest:
        doc = {
            "manifest_version": 1, "model": model, "tag": tag, "tokens": 100, "prompts": 2, "head_dim": d,
            "num_layers": layers, "layer_ids": list(range(layers)), "num_q_heads": 4, "num_kv_heads": 2,
            "objective": "qqt_sst", "objectives": {"k": objectives[0], "v": objectives[1]},
            "composition": "r_h_pbr", "group_size": 16, "clip_ratio": {"k": 0.96, "v": 0.92}, "format": "pt",
            "format_version": 1, "library": {"name": "rotationzoo", "version": rotationzoo.__version__},
            "files": files,
        }
        (out / "rotationzoo.json").write_text(json.dumps(doc, indent=2) + "\n")
    return out


def writes(server) -> list[dict]:
    return [e for e in server.requests() if e["method"] in WRITE_METHODS]


@pytest.fixture
def hubs(hub_env, hub_server_factory, tmp_path, monkeypatch):
    """Two test hubs (HF = ``hub_env``'s, ModelScope = a second server), tokens set, caches isolated."""
    ms = hub_server_factory(token=TEST_TOKEN)
    monkeypatch.setenv("MODELSCOPE_ENDPOINT", ms.url)
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("ROTATIONZOO_CACHE", str(tmp_path / "rz-cache"))
    return type("Hubs", (), {"hf": hub_env.server, "ms": ms, "env": hub_env})


@pytest.fixture
def fitted(tmp_path) -> Path:
    return make_fitted(tmp_path / "fitted")


def _clear(hubs) -> None:
    hubs.hf.clear_log()
    hubs.ms.clear_log()


# -- the full round trip -------------------------------------------------------------------------


def test_publish_both_hubs_registry_out_then_fetch_and_load(hubs, fitted, tmp_path, monkeypatch) -> None:
    reg = tmp_path / "registry.json"
    res = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg, create_tag="tiny-v1")
    hf, ms = res.hubs
    assert (hf.hub, ms.hub) == ("huggingface", "modelscope") and res.ok and not res.dry_run
    assert hf.commit == hubs.hf.head(REPO_ID) and len(hf.commit) == 40
    assert ms.commit == hubs.ms.head(REPO_ID) and ms.branch == "master"
    assert hubs.hf.resolve(REPO_ID, "tiny-v1") == hf.commit and hubs.ms.resolve(REPO_ID, "tiny-v1") == ms.commit
    assert hf.create_tag == ms.create_tag == "tiny-v1" and res.to_json()["hubs"][0]["create_tag"] == "tiny-v1"
    # one commit per hub, holding the pair, the manifest and the model card
    for server in (hubs.hf, hubs.ms):
        assert len(server.requests("POST", contains="/commit/")) == 1
        stored = server.list_files(REPO_ID)
        assert {p for p in stored if p.startswith(FOLDER + "/")} == {
            f"{FOLDER}/k_rotation_qqt_r_h_pbr.pt", f"{FOLDER}/v_rotation_sst_r_h_pbr.pt", f"{FOLDER}/rotationzoo.json"}
        for name in ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "rotationzoo.json"):
            assert server.file_bytes(REPO_ID, f"{FOLDER}/{name}") == (fitted / name).read_bytes()
        card = server.file_bytes(REPO_ID, "README.md").decode()
        assert CARD_BEGIN in card and f"| Tiny-LM | {TAG} | 4 × 16 |" in card
    # the registry entry: HF pinned to the commit, ModelScope to the created tag, sha256 + size
    entry = res.entry
    assert entry["sources"] == [
        {"type": "huggingface", "repo": REPO_ID, "revision": hf.commit},
        {"type": "modelscope", "repo": REPO_ID, "revision": "tiny-v1"},
    ]
    for side, name in (("k", "k_rotation_qqt_r_h_pbr.pt"), ("v", "v_rotation_sst_r_h_pbr.pt")):
        assert entry["files"][side] == {"path": f"{FOLDER}/{name}", "sha256": _sha(fitted / name),
                                        "size": (fitted / name).stat().st_size}
    assert entry["calibration"] == {"dataset": None, "tokens": 100, "prompts": 2, "group_size": 16}
    assert entry["serving"]["group_size"] == 16 and entry["objectives"] == {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"}
    assert res.model_entry["architecture"] == {"num_layers": 4, "head_dim": 16, "num_kv_heads": 2,
                                               "num_attention_heads": 4}
    assert json.loads(reg.read_text()) == {"registry_version": 1, "models": [res.model_entry]}
    assert reg.read_text() == registry_text(json.loads(reg.read_text()))
    check = subprocess.run([sys.executable, str(ROOT / "tools" / "check_registry.py"), str(reg)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr

    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(reg))
    originals = {"k": _orthogonal(1), "v": _orthogonal(2)}
    for source in ("huggingface", "modelscope"):
        got = rotationzoo.fetch(MODEL, TAG, source=source, cache_dir=tmp_path / f"cache-{source}")
        assert got.source.startswith(source)
        assert got.sha256 == {"k": entry["files"]["k"]["sha256"], "v": entry["files"]["v"]["sha256"]}
        pair = rotationzoo.load("tiny-lm", TAG, source=source, cache_dir=tmp_path / f"cache-{source}")
        assert torch.equal(pair.k.rotations, originals["k"]) and torch.equal(pair.v.rotations, originals["v"])
        assert pair.entry.files["k"].sources[0].revision == hf.commit and pair.entry.files["k"].sources[0].pinned


def test_publish_safetensors_copies_and_single_hub(hubs, fitted) -> None:
    res = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="hf", safetensors=True)
    assert [h.hub for h in res.hubs] == ["huggingface"] and hubs.ms.requests() == []
    stored = hubs.hf.list_files(REPO_ID)
    for side, obj in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        path = f"{FOLDER}/{side}_rotation_{obj}.safetensors"
        assert stored[path]["lfs"]
        st = rotationzoo.read_rotation(_write(hubs.hf.file_bytes(REPO_ID, path), fitted.parent / f"{side}.safetensors"))
        assert torch.equal(st.rotations, _orthogonal(1 if side == "k" else 2)) and st.objective == obj
    assert res.entry["files"]["k"]["path"].endswith(".pt")  # the registry points at the .pt files
    assert [s["type"] for s in res.entry["sources"]] == ["huggingface"]


def _write(data: bytes, p: Path) -> Path:
    p.write_bytes(data)
    return p


@pytest.mark.parametrize("spec", ["k,v", "pair_file"])
def test_publish_takes_what_the_resolver_takes(hubs, fitted, tmp_path, spec) -> None:
    """Two files or an exported pair file publish the same matrices as the fitter's folder."""
    from rotationzoo.export import export_safetensors

    k, v = sorted(fitted.glob("k_rotation*.pt"))[0], sorted(fitted.glob("v_rotation*.pt"))[0]
    rotations = f"{k},{v}" if spec == "k,v" else str(export_safetensors(fitted, tmp_path / "pair.safetensors"))
    res = publish(rotations, repo=REPO_ID, model=MODEL, tag=TAG, to="hf", branch="main")
    stored = hubs.hf.list_files(REPO_ID)
    for side, obj in (("k", "qqt_r_h_pbr"), ("v", "sst_r_h_pbr")):
        path = f"{FOLDER}/{side}_rotation_{obj}.pt"
        got = rotationzoo.read_rotation(_write(hubs.hf.file_bytes(REPO_ID, path), tmp_path / f"{side}-{spec}.pt"))
        assert torch.equal(got.rotations, _orthogonal(1 if side == "k" else 2))
    assert f"{FOLDER}/rotationzoo.json" not in stored  # no manifest outside a fitted folder
    assert res.entry["files"]["k"]["path"].endswith("k_rotation_qqt_r_h_pbr.pt")


# -- refused before anything leaves the machine ---------------------------------------------------


@pytest.mark.parametrize("breakage", ["not_orthogonal", "layers_differ", "head_dims_differ", "junk_file",
                                      "manifest_sha", "wrong_model_arch", "two_k_files", "no_v_file"])
def test_invalid_input_uploads_nothing(hubs, tmp_path, breakage) -> None:
    out = make_fitted(tmp_path / "fitted")
    model = MODEL
    expected: type[Exception] = InvalidRotationError
    if breakage == "not_orthogonal":
        rs = rotationzoo.read_rotation(out / "k_rotation_qqt_r_h_pbr.pt")
        rs.rotations[2] *= 1.01
        write_rotation(out / "k_rotation_qqt_r_h_pbr.pt", rs)
        (out / "rotationzoo.json").unlink()
    elif breakage == "layers_differ":
        make_fitted(out, layers=3, manifest=False, objectives=("qqt_r_h_pbr", "sst_r_h_pbr"))
        make_fitted(tmp_path / "other", manifest=False)
        (out / "k_rotation_qqt_r_h_pbr.pt").write_bytes((tmp_path / "other" / "k_rotation_qqt_r_h_pbr.pt").read_bytes())
        (out / "rotationzoo.json").unlink()
    elif breakage == "head_dims_differ":
        make_fitted(tmp_path / "other", d=32, manifest=False)
        (out / "v_rotation_sst_r_h_pbr.pt").write_bytes((tmp_path / "other" / "v_rotation_sst_r_h_pbr.pt").read_bytes())
        (out / "rotationzoo.json").unlink()
    elif breakage == "junk_file":
        (out / "v_rotation_sst_r_h_pbr.pt").write_bytes(b"PK\x03\x04 not a zip at all")
        (out / "rotationzoo.json").unlink()
    elif breakage == "manifest_sha":
        rs = rotationzoo.read_rotation(out / "v_rotation_sst_r_h_pbr.pt")
        rs.objective = "edited"
        write_rotation(out / "v_rotation_sst_r_h_pbr.pt", rs)
        expected = PublishError
    elif breakage == "wrong_model_arch":
        model = "SmolLM2-135M-Instruct"  # 30 layers × 64 in the registry
    elif breakage == "two_k_files":
        (out / "k_rotation_other.pt").write_bytes((out / "k_rotation_qqt_r_h_pbr.pt").read_bytes())
        (out / "rotationzoo.json").unlink()
        expected = PublishError
    elif breakage == "no_v_file":
        (out / "v_rotation_sst_r_h_pbr.pt").unlink()
        (out / "rotationzoo.json").unlink()
        expected = PublishError
    with pytest.raises(expected) as excinfo:
        publish(out, repo=REPO_ID, model=model, tag=TAG)
    message = str(excinfo.value)
    says = {
        "not_orthogonal": ["refusing to publish k_rotation_qqt_r_h_pbr.pt", "layer 2: not orthogonal"],
        "layers_differ": ["refusing to publish", "K and V disagree", "3 layers", "4 layers"],
        "head_dims_differ": ["refusing to publish", "K and V disagree", "d 16", "d 32"],
        "junk_file": ["refusing to publish", "v_rotation_sst_r_h_pbr.pt"],
        "manifest_sha": ["files.v.sha256", "changed after fitting"],
        "wrong_model_arch": ["refusing to publish", "for HuggingFaceTB/SmolLM2-135M-Instruct", "head_dim 16, but the model needs 64"],
        "two_k_files": ["several K rotation files", "k_rotation_other.pt", "k_rotation_qqt_r_h_pbr.pt"],
        "no_v_file": ["no v_rotation", "publish needs both the K and the V file"],
    }[breakage]
    assert all(part in message for part in says), message
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []


@pytest.mark.parametrize("swap", ["rewritten", "link_retargeted"])
def test_what_is_uploaded_is_the_checked_copy_not_a_file_changed_afterwards(hubs, tmp_path, monkeypatch, swap) -> None:
    """The files are copied, then the copies are validated, hashed and uploaded: a K file rewritten (or a
    link retargeted at another valid file) and a manifest edited after the check reach no hub, and the
    staging folder is gone afterwards."""
    import tempfile

    out = make_fitted(tmp_path / "fitted")
    k, manifest = out / "k_rotation_qqt_r_h_pbr.pt", out / "rotationzoo.json"
    names = ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "rotationzoo.json")
    checked = {n: (out / n).read_bytes() for n in names}
    other = out / "other.bin"  # a valid K file of another fit, in the folder (a folder's links stay inside it)
    other.write_bytes((make_fitted(tmp_path / "other", seeds=(5, 6), manifest=False) / k.name).read_bytes())
    if swap == "link_retargeted":
        k.rename(out / "checked.bin")
        k.symlink_to("checked.bin")
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    swapped: list[str] = []

    def report(msg: str) -> None:  # the hubs are being read: everything local is checked, nothing written yet
        if msg.startswith("huggingface: ") and not swapped:
            swapped.append(msg)
            if swap == "rewritten":
                k.write_bytes(b"NOT A ROTATION: private data\n")
            else:
                k.unlink()
                k.symlink_to(other.name)
            manifest.write_text("{}\n")

    res = publish(out, repo=REPO_ID, model=MODEL, tag=TAG, report=report)
    assert swapped and writes(hubs.hf) and writes(hubs.ms)
    for server in (hubs.hf, hubs.ms):
        for name in names:
            assert server.file_bytes(REPO_ID, f"{FOLDER}/{name}") == checked[name], (server, name)
    assert res.entry["files"]["k"]["sha256"] == hashlib.sha256(checked[k.name]).hexdigest()
    assert all(f.staged != f.local and not f.staged.exists() for f in res.files)
    assert not any(p.name.startswith("rotationzoo-publish-") for p in temp.iterdir())


def test_manifest_names_the_pair_and_a_different_tag_is_a_warning(hubs, tmp_path) -> None:
    out = make_fitted(tmp_path / "fitted", tag="gpqa-run")
    (out / "k_rotation_zz_old.pt").write_bytes((out / "k_rotation_qqt_r_h_pbr.pt").read_bytes())  # ignored
    k, v, manifest = find_pair(out)
    assert (k.name, v.name, manifest.name) == ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt",
                                               "rotationzoo.json")
    res = publish(out, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface", dry_run=True)
    assert any("gpqa-run" in w for w in res.warnings)


def test_unknown_model_needs_a_full_id(hubs, fitted) -> None:
    with pytest.raises(PublishError, match="full id"):
        publish(fitted, repo=REPO_ID, model="Tiny-LM", tag=TAG)
    with pytest.raises(PublishError, match="NAMESPACE/NAME"):
        publish(fitted, repo="no-namespace", model=MODEL, tag=TAG)
    with pytest.raises(PublishError, match="unknown hub"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="github")
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []


# -- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize("hub,env_var,hint", [("huggingface", "HF_TOKEN", "hf auth login"),
                                              ("modelscope", "MODELSCOPE_API_TOKEN", "modelscope login")])
def test_missing_token_is_a_clear_auth_error(hubs, fitted, monkeypatch, hub, env_var, hint) -> None:
    monkeypatch.delenv(env_var)
    with pytest.raises(AuthError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    assert env_var in str(excinfo.value) and hint in str(excinfo.value) and hub in str(excinfo.value)
    assert isinstance(excinfo.value, PublishError) and isinstance(excinfo.value, PermissionError)
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []


@pytest.mark.parametrize("hub", ["huggingface", "modelscope"])
def test_rejected_token_is_an_auth_error_and_writes_nothing(hubs, fitted, hub) -> None:
    tokens = {"huggingface": TEST_TOKEN, "modelscope": TEST_TOKEN, hub: "wrong-token"}
    with pytest.raises(AuthError, match=f"{hub}: checking the token: token rejected"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, token=tokens)
    assert writes(hubs.hf) == [] and writes(hubs.ms) == []
    assert not hubs.hf.repo_exists(REPO_ID) and not hubs.ms.repo_exists(REPO_ID)


@pytest.mark.parametrize("how", ["ROTATIONZOO_OFFLINE", "HF_HUB_OFFLINE", "offline=True", "--offline"])
def test_offline_mode_refuses_publish_before_any_request(hubs, fitted, monkeypatch, capsys, how) -> None:
    """Offline mode stops publish at once (a dry run too: it reads the hubs), with one line saying why."""
    if how.endswith("_OFFLINE"):
        monkeypatch.setenv(how, "1")
    if how == "--offline":
        args = ["publish", str(fitted), "--repo", REPO_ID, "--model", MODEL, "--tag", TAG, "--offline", "--json"]
        assert main(args) == 1
        error = json.loads(capsys.readouterr().out)["error"]
        assert error["type"] == "OfflineError"
        messages = [error["message"]]
    else:
        messages = []
        for dry_run in (False, True):
            with pytest.raises(OfflineError) as excinfo:
                publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, dry_run=dry_run,
                        offline=True if how == "offline=True" else None)
            messages.append(str(excinfo.value))
    reason = {"ROTATIONZOO_OFFLINE": "ROTATIONZOO_OFFLINE is set", "HF_HUB_OFFLINE": "HF_HUB_OFFLINE is set"}.get(
        how, "--offline (offline=True) was given")
    for msg in messages:
        assert msg.startswith("offline mode: publish needs the network") and "nothing was read or sent" in msg
        assert f"offline because {reason}" in msg and "\n" not in msg
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []
    assert not hubs.hf.repo_exists(REPO_ID) and not hubs.ms.repo_exists(REPO_ID)


# -- existing tags, races ------------------------------------------------------------------------


def test_second_publish_needs_force_and_force_replaces_in_one_commit(hubs, fitted, tmp_path) -> None:
    first = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    heads = (hubs.hf.head(REPO_ID), hubs.ms.head(REPO_ID))
    _clear(hubs)
    with pytest.raises(PublishError, match="already has Tiny-LM/seq100_prompt2_group16/.*pass --force"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    assert (hubs.hf.head(REPO_ID), hubs.ms.head(REPO_ID)) == heads
    assert writes(hubs.hf) == [] and writes(hubs.ms) == []

    # a refit with another V objective: --force replaces the folder; the old V file goes in the same commit
    refit = make_fitted(tmp_path / "refit", seeds=(3, 4), objectives=("qqt_r_h_pbr", "vtv_r_h_pbr"))
    _clear(hubs)
    second = publish(refit, repo=REPO_ID, model=MODEL, tag=TAG, force=True)
    for server, h, old in zip((hubs.hf, hubs.ms), second.hubs, first.hubs):
        assert len(server.requests("POST", contains="/commit/")) == 1
        assert h.parent == old.commit and h.commit == server.head(REPO_ID)
        assert sorted(h.replaced) == sorted(f"{FOLDER}/{n}" for n in (
            "k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "rotationzoo.json"))
        stored = {p for p in server.list_files(REPO_ID) if p.startswith(FOLDER)}
        assert stored == {f"{FOLDER}/k_rotation_qqt_r_h_pbr.pt", f"{FOLDER}/v_rotation_vtv_r_h_pbr.pt",
                          f"{FOLDER}/rotationzoo.json"}
        assert server.file_bytes(REPO_ID, f"{FOLDER}/k_rotation_qqt_r_h_pbr.pt") == \
            (refit / "k_rotation_qqt_r_h_pbr.pt").read_bytes()
        card = server.file_bytes(REPO_ID, "README.md").decode()
        assert card.count(f"| Tiny-LM | {TAG} |") == 1 and "qqt_r_h_pbr / vtv_r_h_pbr" in card
        assert h.card == "row replaced"


def test_stale_expected_parent_fails_cleanly(hubs, fitted) -> None:
    first = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface")
    moved = hubs.hf.commit_files(REPO_ID, {"NOTES.md": b"someone else was here\n"})
    files_before = hubs.hf.list_files(REPO_ID)
    hubs.hf.clear_log()
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface", force=True,
                expected_parent=first.hubs[0].commit)
    msg = str(excinfo.value)
    assert f"changed since {first.hubs[0].commit[:12]}" in msg and "nothing was written" in msg and "re-run" in msg
    assert moved[:12] in msg
    assert hubs.hf.head(REPO_ID) == moved and hubs.hf.list_files(REPO_ID) == files_before
    assert writes(hubs.hf) == []
    # the right parent goes through
    ok = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface", force=True, expected_parent=moved)
    assert ok.hubs[0].parent == moved and hubs.hf.head(REPO_ID) == ok.hubs[0].commit


def test_hf_commit_racing_a_concurrent_push_gets_412_and_writes_nothing(hubs, fitted, monkeypatch) -> None:
    import huggingface_hub

    original = huggingface_hub.HfApi.create_commit
    racer: dict[str, str] = {}

    def racing_create_commit(self, *args, **kwargs):
        racer["sha"] = hubs.hf.commit_files(REPO_ID, {"OTHER.md": b"concurrent push\n"})
        return original(self, *args, **kwargs)

    hubs.hf.create_repo(REPO_ID)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", racing_create_commit)
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    msg = str(excinfo.value)
    assert msg.startswith("huggingface:") and "changed since" in msg and "no commit was made" in msg
    # the LFS blobs went up before the refused commit: the message says which
    puts = hubs.hf.requests("PUT")
    assert puts and f"{len(puts)} LFS blob(s) were already in the hub's storage" in msg
    assert racer["sha"][:12] in msg
    assert hubs.hf.head(REPO_ID) == racer["sha"]
    assert not any(p.startswith("Tiny-LM/") for p in hubs.hf.list_files(REPO_ID))
    assert [e["status"] for e in hubs.hf.requests("POST", contains="/commit/")] == [412]
    assert writes(hubs.ms) == []  # Hugging Face goes first: ModelScope was never written


def test_modelscope_head_moving_before_commit_writes_nothing(hubs, fitted, monkeypatch) -> None:
    from modelscope_hub._legacy_api import LegacyClient

    original = LegacyClient.validate_blobs
    racer: dict[str, str] = {}

    def racing_validate(self, *args, **kwargs):
        racer["sha"] = hubs.ms.commit_files(REPO_ID, {"OTHER.md": b"concurrent push\n"})
        return original(self, *args, **kwargs)

    hubs.ms.create_repo(REPO_ID)
    monkeypatch.setattr(LegacyClient, "validate_blobs", racing_validate)
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="modelscope")
    msg = str(excinfo.value)
    assert msg.startswith("modelscope:") and "changed since" in msg and "no commit was made" in msg
    assert "LFS blob(s) were already in the hub's storage" in msg, msg
    assert hubs.ms.head(REPO_ID) == racer["sha"]
    assert not any(p.startswith("Tiny-LM/") for p in hubs.ms.list_files(REPO_ID))
    assert hubs.ms.requests("POST", contains="/commit/") == []


def test_existing_tag_name_is_refused_before_any_write(hubs, fitted) -> None:
    hubs.ms.commit_files(REPO_ID, {"x.txt": b"x"})
    hubs.ms.create_tag(REPO_ID, "v1")
    with pytest.raises(PublishError, match="tag 'v1' already exists"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, create_tag="v1")
    assert writes(hubs.hf) == [] and writes(hubs.ms) == []


# -- dry run -------------------------------------------------------------------------------------


def test_dry_run_reads_but_never_writes(hubs, fitted, monkeypatch) -> None:
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("MODELSCOPE_API_TOKEN")
    res = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, dry_run=True, safetensors=True)
    assert res.dry_run and res.ok and res.registry_out is None
    assert [f.path for f in res.files] == [f"{FOLDER}/{n}" for n in (
        "k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt", "k_rotation_qqt_r_h_pbr.safetensors",
        "v_rotation_sst_r_h_pbr.safetensors", "rotationzoo.json")]
    assert all(h.exists is False and h.card == "created" and h.commit is None for h in res.hubs)
    assert any("no token found" in w for w in res.warnings)
    assert writes(hubs.hf) == [] and writes(hubs.ms) == []

    # against an existing entry: the refusal shows up as a problem, still without writes
    monkeypatch.setenv("HF_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TEST_TOKEN)
    publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    _clear(hubs)
    res = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, dry_run=True)
    assert not res.ok and all("pass --force" in h.problems[0] for h in res.hubs)
    assert all(h.card == "row replaced" and h.parent == s.head(REPO_ID) for h, s in zip(res.hubs, (hubs.hf, hubs.ms)))
    assert hubs.hf.requests() and writes(hubs.hf) == [] and writes(hubs.ms) == []


# -- model card ----------------------------------------------------------------------------------


CARD = (
    "---\nlicense: mit\n---\n\n# OSCAR RotationZoo\n\nIntro text | with a pipe.\n\n"
    f"{CARD_BEGIN}\n{CARD_HEADER}"
    "| Qwen3-8B | seq20000_prompt83_group128 | 36 × 128 | qqt_r_h_pbr / sst_r_h_pbr | [K](a) · [V](b) | `x` / `y` |\n"
    "|  GLM-4.7-FP8|seq10000_prompt43_group128|92 × 128| odd spacing kept |  | |\n"
    f"{CARD_END}\n\n## Citation\n\nSee the paper.\n"
)


def test_model_card_row_update_keeps_everything_else(hubs, fitted) -> None:
    for server in (hubs.hf, hubs.ms):
        server.commit_files(REPO_ID, {"README.md": CARD.encode()})
    publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG)
    for server in (hubs.hf, hubs.ms):
        card = server.file_bytes(REPO_ID, "README.md").decode()
        ours = [line for line in card.splitlines(keepends=True) if line.startswith("| Tiny-LM |")]
        assert len(ours) == 1
        assert card.replace(ours[0], "") == CARD  # every other byte as it was
        assert card.index(ours[0]) < card.index(CARD_END)


def test_update_model_card_unit() -> None:
    row = card_row("M", "t", 4, 16, {"k": "a", "v": "b"}, {"k": ("M/t/k.pt", "0" * 64), "v": ("M/t/v.pt", "1" * 64)})
    assert row.startswith("| M | t | 4 × 16 | a / b | [K](M/t/k.pt) · [V](M/t/v.pt) | `000000000000` /")
    new, what = update_model_card("", ("M", "t"), row, title="Zoo")
    assert what == "created" and new.startswith("---\n") and "# Zoo" in new and row in new
    text = "# Mine\n\nno table yet"
    new, what = update_model_card(text, ("M", "t"), row)
    assert what == "section added" and new.startswith(text + "\n\n## Rotations\n\n" + CARD_BEGIN)
    added, what = update_model_card(CARD, ("M", "t"), row)
    assert what == "row added" and added.replace(row + "\n", "") == CARD
    row2 = row.replace("a / b", "c / d")
    replaced, what = update_model_card(added, ("M", "t"), row2)
    assert what == "row replaced" and replaced == added.replace(row, row2)
    # the key is the first two cells, whatever their spacing
    glm = card_row("GLM-4.7-FP8", "seq10000_prompt43_group128", 92, 128, {"k": "q", "v": "s"},
                   {"k": ("p", "a" * 64), "v": ("p", "b" * 64)})
    replaced, what = update_model_card(CARD, ("GLM-4.7-FP8", "seq10000_prompt43_group128"), glm)
    assert what == "row replaced" and "odd spacing kept" not in replaced and "Qwen3-8B | seq20000" in replaced
    # markers without a table get the header
    bare = f"x\n{CARD_BEGIN}\n{CARD_END}\n"
    new, _ = update_model_card(bare, ("M", "t"), row)
    assert new == f"x\n{CARD_BEGIN}\n{CARD_HEADER}{row}\n{CARD_END}\n"
    # pipes inside cells are escaped, so they do not split the row
    odd = card_row("M", "t", 1, 16, {"k": "a|b", "v": "c"}, {"k": ("p", "0" * 64), "v": ("p", "1" * 64)})
    assert "a\\|b" in odd


# -- registry file merge -------------------------------------------------------------------------


def _other_model() -> dict:
    return {"id": "other/Model", "aliases": ["Other"], "description": "kept as is",
            "architecture": {"num_layers": 2, "head_dim": 64}, "default_tag": "a",
            "tags": {"a": {"objectives": {"k": "x", "v": "y"}, "serving": {},
                           "files": {s: {"path": f"Model/a/{s}_r.pt", "sha256": None, "size": None,
                                         "sources": [{"type": "url", "url": "https://example.invalid/f"}]}
                                     for s in "kv"}}}}


def test_registry_out_merge_keeps_other_entries_and_is_idempotent(hubs, fitted, tmp_path) -> None:
    reg = tmp_path / "reg.json"
    mine_other_tag = {"objectives": {"k": "x", "v": "y"}, "serving": {}, "description": "older tag",
                      "files": {s: {"path": f"Tiny-LM/old/{s}_r.pt", "sha256": None, "size": None,
                                    "sources": [{"type": "url", "url": "https://example.invalid/g"}]} for s in "kv"}}
    start = {"registry_version": 1, "models": [
        _other_model(),
        {"id": MODEL, "aliases": ["tiny"], "architecture": {"num_layers": 4, "head_dim": 16}, "default_tag": "old",
         "tags": {"old": mine_other_tag}},
    ]}
    reg.write_text(json.dumps(start, indent=2) + "\n")
    res = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg, to="huggingface")
    data = json.loads(reg.read_text())
    assert data["models"][0] == _other_model()
    mine = data["models"][1]
    assert list(mine["tags"]) == ["old", TAG] and mine["tags"]["old"] == mine_other_tag
    assert mine["aliases"] == ["tiny"] and mine["default_tag"] == "old"
    assert mine["tags"][TAG] == res.entry and res.registry_changed
    text = reg.read_text()
    assert text == json.dumps(data, indent=2) + "\n"
    # merging the same entry again changes no byte
    again = merge_into_registry(json.loads(text), res.model_entry, TAG)
    assert registry_text(again) == text and write_registry_file(reg, again) is False
    # a re-publish of the same bytes to the other hub adds its source and keeps the pinned one
    res2 = publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg, to="modelscope")
    sources = json.loads(reg.read_text())["models"][1]["tags"][TAG]["sources"]
    assert sources == [res.entry["sources"][0], {"type": "modelscope", "repo": REPO_ID, "revision": "master"}]
    assert res2.entry["sources"] == sources
    assert list(json.loads(reg.read_text())["models"][1]["tags"]) == ["old", TAG]


def test_known_model_gets_its_registry_architecture_and_keeps_bundled_tags(hubs, tmp_path, monkeypatch) -> None:
    out = make_fitted(tmp_path / "smol", layers=30, d=64, model="HuggingFaceTB/SmolLM2-135M-Instruct", tag="mytag")
    reg = tmp_path / "overlay.json"
    res = publish(out, repo=REPO_ID, model="smollm2-135m", tag="mytag", to="huggingface", registry_out=reg,
                  description="my calibration", dataset="GPQA-diamond")
    assert res.model == "HuggingFaceTB/SmolLM2-135M-Instruct" and res.folder == "SmolLM2-135M-Instruct/mytag"
    model = json.loads(reg.read_text())["models"][0]
    bundled = json.loads((ROOT / "registry.json").read_text())["models"][0]
    assert bundled["id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert list(model["tags"]) == [*bundled["tags"], "mytag"] and model["default_tag"] == bundled["default_tag"]
    assert model["architecture"]["num_layers"] == 30 and model["architecture"]["num_kv_heads"] == 3
    assert model["tags"]["mytag"]["description"] == "my calibration"
    assert model["tags"]["mytag"]["calibration"]["dataset"] == "GPQA-diamond"
    check = subprocess.run([sys.executable, str(ROOT / "tools" / "check_registry.py"), str(reg)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(reg))
    assert rotationzoo.load("smollm2-135m").entry.name == bundled["default_tag"]  # the bundled default still loads
    pair = rotationzoo.load("smollm2-135m", "mytag", cache_dir=tmp_path / "c")
    assert torch.equal(pair.k.rotations, _orthogonal(1, 30, 64))


def test_per_head_files_get_grouping_and_the_keep_rules_clips_become_the_serving_clips(hubs, tmp_path) -> None:
    # a fitted folder of per-KV-head files whose recipe trained the keys without a clip and told the keep rule
    # they will be served at 0.92 / 0.90 (fit --keep-k-clip-ratio 0.92 --keep-v-clip-ratio 0.90)
    out = tmp_path / "perhead"
    out.mkdir()
    files = {}
    for side, obj, seed in (("k", "refined_k_served_score_r_h_pbr", 1), ("v", "refined_v_served_out_r_h_pbr", 2)):
        rs = RotationSet(_orthogonal(seed, L * 2, D).reshape(L, 2, D, D), range(L), obj)
        p = write_rotation(out / f"{side}_rotation_{obj}-kv_head.pt", rs)
        files[side] = {"name": p.name, "objective": obj, "sha256": _sha(p), "size": p.stat().st_size}
    doc = {"manifest_version": 1, "model": MODEL, "tag": TAG, "tokens": 100, "prompts": 2, "head_dim": D,
           "num_layers": L, "layer_ids": list(range(L)), "num_q_heads": 4, "num_kv_heads": 2, "objective": "refined",
           "objectives": {"k": files["k"]["objective"], "v": files["v"]["objective"]}, "grouping": "kv_head",
           "group_size": 16, "format": "pt", "format_version": 2, "files": files,
           "int2kv": {"k_clip_ratio": 0.0, "v_clip_ratio": 0.92, "group_size": 16},
           "recipe": {"keep": {"texts": ["held_out.txt"], "k_clip_ratio": 0.92, "v_clip_ratio": 0.90}},
           "library": {"name": "rotationzoo", "version": rotationzoo.__version__}}
    (out / "rotationzoo.json").write_text(json.dumps(doc, indent=2) + "\n")
    reg = tmp_path / "reg.json"
    publish(out, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface", registry_out=reg)
    tag = json.loads(reg.read_text())["models"][0]["tags"][TAG]
    assert tag["grouping"] == "kv_head"
    assert (tag["serving"]["k_clip_ratio"], tag["serving"]["v_clip_ratio"]) == (0.92, 0.90)
    # without the keep clips: the training clip where it is one (V 0.92), the authors' K clip where none (0)
    del doc["recipe"]
    (out / "rotationzoo.json").write_text(json.dumps(doc, indent=2) + "\n")
    publish(out, repo=REPO_ID, model=MODEL, tag="other", to="huggingface", registry_out=reg)
    tag = json.loads(reg.read_text())["models"][0]["tags"]["other"]
    assert (tag["serving"]["k_clip_ratio"], tag["serving"]["v_clip_ratio"]) == (0.96, 0.92)
    # per-layer files carry no grouping (the registry's default, layer)
    publish(make_fitted(tmp_path / "layer"), repo=REPO_ID, model=MODEL, tag="layer", to="huggingface",
            registry_out=reg)
    assert "grouping" not in json.loads(reg.read_text())["models"][0]["tags"]["layer"]


def test_a_registry_out_that_cannot_be_written_is_refused_before_upload(hubs, fitted, tmp_path, monkeypatch) -> None:
    (tmp_path / "registries").write_text("a file where a folder was meant\n")
    with pytest.raises(PublishError, match="--registry-out .*is not a folder"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=tmp_path / "registries" / "reg.json")
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []
    # a disk that fills after the upload: the error carries the entry pinned to the commits, not lost
    import rotationzoo.publish as publishing

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publishing, "write_registry_file", full)
    with pytest.raises(PublishError, match="published \\(huggingface at [0-9a-f]{40}.*No space left.*add this entry") as info:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to="huggingface", registry_out=tmp_path / "reg.json")
    entry = json.loads(str(info.value).split("yourself: ", 1)[1])
    assert entry == info.value.result.model_entry and entry["id"] == MODEL and TAG in entry["tags"]


def test_a_merge_that_would_break_the_registry_is_refused_before_upload(hubs, fitted, tmp_path) -> None:
    reg = tmp_path / "reg.json"
    clash = _other_model()
    clash["aliases"].append("Tiny-LM")  # the new model's name is taken
    reg.write_text(json.dumps({"registry_version": 1, "models": [clash]}, indent=2) + "\n")
    before = reg.read_bytes()
    with pytest.raises(PublishError, match="would make it invalid.*tiny-lm.*nothing was uploaded"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg)
    assert reg.read_bytes() == before and hubs.hf.requests() == [] and hubs.ms.requests() == []
    # a model only that file knows is held to its architecture too
    eight = {"id": MODEL, "architecture": {"num_layers": 8, "head_dim": D}, "default_tag": "a",
             "tags": {"a": _other_model()["tags"]["a"]}}
    reg.write_text(json.dumps({"registry_version": 1, "models": [eight]}, indent=2) + "\n")
    with pytest.raises(PublishError, match="needs 8 layers × d 16, the files have 4 layers × d 16"):
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg)
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []


# -- CLI -----------------------------------------------------------------------------------------


def test_cli_publish_json(hubs, fitted, tmp_path, capsys) -> None:
    reg = tmp_path / "reg.json"
    args = ["publish", str(fitted), "--repo", REPO_ID, "--model", MODEL, "--tag", TAG, "--registry-out", str(reg)]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [h["hub"] for h in out["hubs"]] == ["huggingface", "modelscope"]
    assert out["hubs"][0]["commit"] == hubs.hf.head(REPO_ID) == out["model_entry"]["tags"][TAG]["sources"][0]["revision"]
    assert out["registry_out"] == str(reg) and json.loads(reg.read_text())["models"][0] == out["model_entry"]
    assert out["entry"] == out["model_entry"]["tags"][TAG] and set(out["entry"]["files"]) == {"k", "v"}
    assert any("committed" in m for m in out["messages"])
    # the same again: refused, exit 1, the error as JSON (with --json) naming the fix
    assert main([*args, "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "" and "pass --force" in json.loads(captured.out)["error"]["message"]
    assert main([*args, "--force", "--json", "--token", f"hf={TEST_TOKEN}", "--token", f"ms={TEST_TOKEN}"]) == 0


def test_cli_publish_dry_run_and_human_output(hubs, fitted, capsys) -> None:
    args = ["publish", str(fitted), "--repo", REPO_ID, "--model", MODEL, "--tag", TAG]
    assert main([*args, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "dry run: nothing was uploaded" in out and f"{FOLDER}/k_rotation_qqt_r_h_pbr.pt" in out
    assert "huggingface: would commit to zoo/RotationZoo@main" in out and "modelscope" in out
    assert writes(hubs.hf) == [] and writes(hubs.ms) == []
    assert main([*args, "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["dry_run"] and dry["files"][0]["sha256"] == _sha(fitted / "k_rotation_qqt_r_h_pbr.pt")
    assert main([*args, "--commit-message", "Add the tag"]) == 0  # the flag named as publish(commit_message=)
    out = capsys.readouterr().out
    assert "published" in out and hubs.hf.head(REPO_ID) in out and '"sources"' in out
    with hubs.hf.store.transaction() as state:
        assert state["repos"][f"model:{REPO_ID}"]["commits"][hubs.hf.head(REPO_ID)]["title"] == "Add the tag"
    assert main([*args, "--dry-run"]) == 1  # now the tag exists: the dry run says the upload would be refused
    assert "pass --force" in capsys.readouterr().out


def test_cli_publish_errors(hubs, fitted, tmp_path, capsys) -> None:
    base = ["publish", str(fitted), "--repo", REPO_ID, "--tag", TAG]
    assert main([*base, "--model", MODEL, "--to", "github"]) == 1
    assert "unknown hub" in capsys.readouterr().err
    assert main([*base, "--model", MODEL, "--atol", "nan"]) == 2  # as verify --atol: a usage error, nothing read
    assert "--atol must be a finite number" in capsys.readouterr().err
    # the tolerance reaches the validation: float32 rotations are orthogonal to about 1e-7, not to 0
    assert main([*base, "--model", MODEL, "--atol", "0", "--dry-run"]) == 1
    assert "not orthogonal, max|RRᵀ−I| = " in capsys.readouterr().err
    for flag in ("--expected-parent", "--parent-commit"):  # publish(expected_parent=); the earlier name its alias
        assert main([*base, "--model", MODEL, flag, "abc"]) == 1
        assert "not a 40-hex commit sha" in capsys.readouterr().err
    assert main([*base, "--model", MODEL, "--token", "a", "--token", "b"]) == 2
    assert "HUB=VALUE" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "nope"), "--repo", REPO_ID, "--tag", TAG, "--model", MODEL]) == 1
    assert "no such file or folder" in capsys.readouterr().err
    assert main([*base, "--model", "SmolLM2-135M-Instruct"]) == 1
    assert "refusing to publish" in capsys.readouterr().err
    assert main(["publish", str(fitted), "--repo", REPO_ID, "--model", MODEL]) == 2  # --tag is required
    assert hubs.hf.requests() == [] and hubs.ms.requests() == []


def test_cli_modules_do_not_import_the_hub_clients_or_torch() -> None:
    code = ("import sys; from rotationzoo.cli.main import main; "
            "bad = [m for m in ('torch', 'huggingface_hub', 'modelscope', 'modelscope_hub') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_per_hub_repos_private_and_an_overlay_that_does_not_exist_yet(hubs, fitted, tmp_path, monkeypatch,
                                                                         capsys) -> None:
    reg = tmp_path / "mine.json"
    monkeypatch.setenv("ROTATIONZOO_REGISTRY", str(reg))  # the usual set-up before the first publish
    args = ["publish", str(fitted), "--repo", "hf=zoo/HF-Zoo", "--repo", "modelscope=other/MS-Zoo", "--model", MODEL,
            "--tag", TAG, "--registry-out", str(reg), "--private", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(h["hub"], h["repo"]) for h in out["hubs"]] == [("huggingface", "zoo/HF-Zoo"), ("modelscope", "other/MS-Zoo")]
    assert hubs.hf.repo_exists("zoo/HF-Zoo") and not hubs.hf.repo_exists("other/MS-Zoo")
    assert hubs.ms.repo_exists("other/MS-Zoo") and not hubs.ms.repo_exists("zoo/HF-Zoo")
    for server, name in ((hubs.hf, "zoo/HF-Zoo"), (hubs.ms, "other/MS-Zoo")):
        with server.store.transaction() as state:
            assert state["repos"][f"model:{name}"]["private"] is True
    sources = json.loads(reg.read_text())["models"][0]["tags"][TAG]["sources"]
    assert [(s["type"], s["repo"]) for s in sources] == [("huggingface", "zoo/HF-Zoo"), ("modelscope", "other/MS-Zoo")]
    got = rotationzoo.fetch(MODEL, TAG, source="modelscope", cache_dir=tmp_path / "c")
    assert got.paths["k"].read_bytes() == (fitted / "k_rotation_qqt_r_h_pbr.pt").read_bytes()


def test_a_hub_failing_after_another_was_written_says_what_is_published(hubs, fitted, tmp_path) -> None:
    reg = tmp_path / "reg.json"
    hubs.ms.arm_fault("/commit/master", "http500", count=10, status=400, message="commit rejected by policy")
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg)
    msg = str(excinfo.value)
    hf_head = hubs.hf.head(REPO_ID)
    assert msg.startswith("modelscope: committing") and f"already published: huggingface at {hf_head}" in msg
    assert "re-run with --to modelscope" in msg
    partial = excinfo.value.result
    assert [h.hub for h in partial.hubs] == ["huggingface"] and partial.registry_out == reg
    sources = json.loads(reg.read_text())["models"][0]["tags"][TAG]["sources"]
    assert sources == [{"type": "huggingface", "repo": REPO_ID, "revision": hf_head}]
    assert not any(p.startswith("Tiny-LM/") for p in hubs.ms.list_files(REPO_ID))
    # finishing the job adds the ModelScope source and keeps the pinned Hugging Face one
    hubs.ms.clear_faults()
    publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, registry_out=reg, to="modelscope")
    sources = json.loads(reg.read_text())["models"][0]["tags"][TAG]["sources"]
    assert [s["type"] for s in sources] == ["huggingface", "modelscope"] and sources[0]["revision"] == hf_head


@pytest.mark.parametrize("hub", ["huggingface", "modelscope"])
def test_a_failed_commit_to_a_repository_this_run_created_names_it_and_leaves_it(hubs, fitted, hub) -> None:
    server = hubs.hf if hub == "huggingface" else hubs.ms
    commit = "/commit/main" if hub == "huggingface" else "/commit/master"
    private = hub == "modelscope"
    server.arm_fault(commit, "http500", count=10)
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to=hub, private=private)
    msg = str(excinfo.value)
    assert msg.startswith(f"{hub}: committing to {REPO_ID}") and "\n" not in msg
    assert f"the repository {REPO_ID} did not exist and was created by this run; it is left in place " \
           f"({'private' if private else 'public'}, without this commit): delete it, or re-run" in msg, msg
    assert server.repo_exists(REPO_ID) and server.requests("DELETE") == []  # never deleted for the user
    # a repository that existed before: the failure says nothing about creating it
    server.clear_faults()
    server.arm_fault(commit, "http500", count=10)
    with pytest.raises(PublishError) as excinfo:
        publish(fitted, repo=REPO_ID, model=MODEL, tag=TAG, to=hub)
    assert "created by this run" not in str(excinfo.value)
    server.clear_faults()
