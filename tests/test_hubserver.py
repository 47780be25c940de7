"""Tests of the local test hub server, driven by the real huggingface_hub and modelscope clients.

Client isolation: the ``hub_env`` fixture (from ``hubserver``) points both clients at the server
and keeps their caches and credentials under ``tmp_path``. huggingface_hub freezes
``HF_ENDPOINT``/``HF_HUB_OFFLINE``/``HF_HUB_DISABLE_XET`` and cache paths at import time and
modelscope_hub keeps a process-wide config, so that fixture patches those module values as well
as the environment. Calls below still pass ``endpoint=``/``cache_dir=`` explicitly where the
client accepts them.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hubserver import (  # noqa: F401 - fixtures are used by name
    TEST_TOKEN,
    HubEnv,
    HubServer,
    configure_clients,
    git_blob_oid,
    hub_env,
    hub_server,
    hub_server_factory,
)

os.environ.setdefault("HF_HUB_DISABLE_XET", "1")

huggingface_hub = pytest.importorskip("huggingface_hub")

# huggingface_hub's LFS PUT passes a file object as ``data=``, which its HTTP library deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

HUBSERVER_SCRIPT = Path(__file__).with_name("hubserver.py")
REPO = "acme/demo"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    return sha256(Path(path).read_bytes())


def request(
    method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request with urllib; returns (status, headers, body) for any status."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers.items()), err.read()


def make_folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


def sequence(server: HubServer) -> list[tuple[str, str]]:
    return [(e["method"], e["target"]) for e in server.requests()]


@pytest.fixture
def payload() -> dict[str, bytes]:
    """A regular text file and an LFS-tracked binary file."""
    return {
        "README.txt": b"rotation zoo test repo\n",
        "rotations/llama/w.pt": bytes(range(256)) * 20,
    }


@pytest.fixture
def hf_api(hub_env: HubEnv) -> Any:
    return huggingface_hub.HfApi(endpoint=hub_env.url, token=TEST_TOKEN)


@pytest.fixture
def published(hf_api: Any, hub_env: HubEnv, tmp_path: Path, payload: dict[str, bytes]) -> dict[str, str]:
    """REPO with ``payload`` uploaded in one commit and tagged ``v1``; returns the commit shas."""
    hf_api.create_repo(REPO)
    folder = make_folder(tmp_path / "upload", payload)
    info = hf_api.upload_folder(repo_id=REPO, folder_path=folder, commit_message="add rotations")
    hf_api.create_tag(REPO, tag="v1", revision=info.oid)
    hub_env.server.clear_log()
    return {"v1": info.oid}


# ---------------------------------------------------------------------------------------------
# huggingface_hub
# ---------------------------------------------------------------------------------------------


def test_hf_upload_tag_and_download_at_branch_tag_and_sha(
    hf_api: Any, hub_env: HubEnv, tmp_path: Path, payload: dict[str, bytes]
) -> None:
    server = hub_env.server
    url = hf_api.create_repo(REPO)
    assert str(url).endswith(f"/{REPO}")
    info = hf_api.upload_folder(repo_id=REPO, folder_path=make_folder(tmp_path / "up", payload))
    assert len(info.oid) == 40 and int(info.oid, 16) >= 0
    hf_api.create_tag(REPO, tag="v1")

    stored = server.list_files(REPO)
    assert stored["rotations/llama/w.pt"]["lfs"] is True
    assert stored["README.txt"]["lfs"] is False
    assert stored["README.txt"]["oid"] == git_blob_oid(payload["README.txt"])
    assert any(e["method"] == "PUT" and "/_lfs/upload/" in e["path"] for e in server.requests())

    # The branch moves on: v1 and the old sha must keep the old content.
    new = hf_api.create_commit(
        REPO,
        operations=[huggingface_hub.CommitOperationAdd("README.txt", b"second version\n")],
        commit_message="update readme",
        parent_commit=info.oid,
    )
    assert new.oid != info.oid
    for i, (rev, expected) in enumerate(
        [("main", b"second version\n"), ("v1", payload["README.txt"]), (info.oid, payload["README.txt"])]
    ):
        path = huggingface_hub.hf_hub_download(
            REPO, "README.txt", revision=rev, endpoint=hub_env.url, cache_dir=tmp_path / f"cache{i}"
        )
        assert Path(path).read_bytes() == expected, rev
        lfs_path = huggingface_hub.hf_hub_download(
            REPO, "rotations/llama/w.pt", revision=rev, endpoint=hub_env.url, cache_dir=tmp_path / f"cache{i}"
        )
        assert file_sha256(lfs_path) == sha256(payload["rotations/llama/w.pt"])

    refs = hf_api.list_repo_refs(REPO)
    assert {b.name: b.target_commit for b in refs.branches} == {"main": new.oid}
    assert {t.name: t.target_commit for t in refs.tags} == {"v1": info.oid}
    assert [c.commit_id for c in hf_api.list_repo_commits(REPO)][:2] == [new.oid, info.oid]
    assert hf_api.repo_info(REPO, revision="v1").sha == info.oid


def test_hf_lfs_cache_blob_is_named_by_sha256(published: dict[str, str], hub_env: HubEnv, tmp_path: Path,
                                               payload: dict[str, bytes]) -> None:
    cache = tmp_path / "cache"
    huggingface_hub.hf_hub_download(REPO, "rotations/llama/w.pt", revision="v1", endpoint=hub_env.url, cache_dir=cache)
    huggingface_hub.hf_hub_download(REPO, "README.txt", revision="v1", endpoint=hub_env.url, cache_dir=cache)
    blobs = {p.name for p in (cache / "models--acme--demo" / "blobs").iterdir()}
    assert blobs == {sha256(payload["rotations/llama/w.pt"]), git_blob_oid(payload["README.txt"])}
    assert (cache / "models--acme--demo" / "refs" / "v1").read_text() == published["v1"]


def test_hf_stale_parent_commit_gets_412(published: dict[str, str], hf_api: Any, hub_env: HubEnv) -> None:
    add = huggingface_hub.CommitOperationAdd
    first = hf_api.create_commit(
        REPO, operations=[add("a.txt", b"a")], commit_message="a", parent_commit=published["v1"]
    )
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as excinfo:
        hf_api.create_commit(REPO, operations=[add("b.txt", b"b")], commit_message="b", parent_commit=published["v1"])
    assert excinfo.value.response.status_code == 412
    assert hub_env.server.head(REPO) == first.oid
    assert "b.txt" not in hub_env.server.list_files(REPO)


def test_hf_branches_tags_tree_and_paths_info(published: dict[str, str], hf_api: Any, hub_env: HubEnv,
                                              tmp_path: Path) -> None:
    hf_api.create_branch(REPO, branch="dev", revision="v1")
    hf_api.create_commit(
        REPO,
        operations=[huggingface_hub.CommitOperationAdd("dev.txt", b"dev only\n")],
        commit_message="dev",
        revision="dev",
    )
    path = huggingface_hub.hf_hub_download(REPO, "dev.txt", revision="dev", endpoint=hub_env.url, cache_dir=tmp_path)
    assert Path(path).read_bytes() == b"dev only\n"
    with pytest.raises(huggingface_hub.errors.EntryNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "dev.txt", revision="main", endpoint=hub_env.url, cache_dir=tmp_path)

    tree = {f.path: f for f in hf_api.list_repo_tree(REPO, revision="v1", recursive=True)}
    assert set(tree) == {".gitattributes", "README.txt", "rotations", "rotations/llama", "rotations/llama/w.pt"}
    assert tree["rotations/llama/w.pt"].lfs.sha256 == hub_env.server.list_files(REPO)["rotations/llama/w.pt"]["sha256"]
    top = {f.path for f in hf_api.list_repo_tree(REPO, revision="v1")}
    assert top == {".gitattributes", "README.txt", "rotations"}
    sub = {f.path for f in hf_api.list_repo_tree(REPO, path_in_repo="rotations", revision="v1")}
    assert sub == {"rotations/llama"}

    infos = hf_api.get_paths_info(REPO, ["README.txt", "rotations", "missing.txt"], revision="v1")
    assert sorted(i.path for i in infos) == ["README.txt", "rotations"]

    hf_api.delete_tag(REPO, tag="v1")
    hf_api.delete_branch(REPO, branch="dev")
    refs = hf_api.list_repo_refs(REPO)
    assert [b.name for b in refs.branches] == ["main"] and refs.tags == []
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as excinfo:
        hf_api.create_tag(REPO, tag="v2", revision="nope")
    assert excinfo.value.response.status_code == 404


def test_hf_dataset_repo(hf_api: Any, hub_env: HubEnv, tmp_path: Path) -> None:
    hf_api.create_repo(REPO, repo_type="dataset")
    hf_api.upload_file(path_or_fileobj=b"a,b\n1,2\n", path_in_repo="data.csv", repo_id=REPO, repo_type="dataset")
    path = huggingface_hub.hf_hub_download(
        REPO, "data.csv", repo_type="dataset", endpoint=hub_env.url, cache_dir=tmp_path
    )
    assert Path(path).read_bytes() == b"a,b\n1,2\n"
    assert Path(path).is_relative_to(tmp_path / "datasets--acme--demo")
    assert not hub_env.server.repo_exists(REPO)  # the model namespace is separate
    assert hf_api.dataset_info(REPO).sha == hub_env.server.head(REPO, repo_type="dataset")


def test_hf_snapshot_download_allow_patterns_then_offline(published: dict[str, str], hub_env: HubEnv, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server = hub_env.server
    cache = tmp_path / "cache"
    folder = huggingface_hub.snapshot_download(
        REPO, revision="v1", allow_patterns=["*.pt"], endpoint=hub_env.url, cache_dir=cache
    )
    files = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    assert files == ["rotations/llama/w.pt"]
    assert Path(folder).name == published["v1"]
    assert sequence(server) == [
        ("GET", f"/api/models/{REPO}/revision/v1"),
        ("GET", f"/api/models/{REPO}/tree/{published['v1']}?recursive=true&expand=false"),
        ("HEAD", f"/{REPO}/resolve/{published['v1']}/rotations/llama/w.pt"),
        ("GET", f"/{REPO}/resolve/{published['v1']}/rotations/llama/w.pt"),
    ]

    server.clear_log()
    again = huggingface_hub.snapshot_download(
        REPO, revision="v1", allow_patterns=["*.pt"], local_files_only=True, cache_dir=cache
    )
    assert again == folder
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = huggingface_hub.snapshot_download(REPO, revision="v1", allow_patterns=["*.pt"], cache_dir=cache)
    assert offline == folder
    single = huggingface_hub.hf_hub_download(REPO, "rotations/llama/w.pt", revision="v1", cache_dir=cache)
    assert Path(single).read_bytes() == Path(folder, "rotations/llama/w.pt").read_bytes()
    assert server.requests() == []


def test_hf_download_request_sequence_contract(published: dict[str, str], hub_env: HubEnv, tmp_path: Path) -> None:
    """The exact wire sequence of one download; a change here means the client drifted."""
    server = hub_env.server
    cache = tmp_path / "cache"
    target = f"/{REPO}/resolve/main/rotations/llama/w.pt"
    kwargs = {"endpoint": hub_env.url, "cache_dir": cache}
    huggingface_hub.hf_hub_download(REPO, "rotations/llama/w.pt", revision="main", **kwargs)
    log = server.requests()
    assert [(e["method"], e["target"], e["status"]) for e in log] == [("HEAD", target, 200), ("GET", target, 200)]
    assert log[1]["range"] is None and log[1]["bytes"] == 5120

    server.clear_log()  # warm cache at a branch: one HEAD to resolve the branch, no GET
    huggingface_hub.hf_hub_download(REPO, "rotations/llama/w.pt", revision="main", **kwargs)
    assert sequence(server) == [("HEAD", target)]

    server.clear_log()  # warm cache at a commit sha: nothing on the wire
    huggingface_hub.hf_hub_download(REPO, "rotations/llama/w.pt", revision=published["v1"], **kwargs)
    assert server.requests() == []


def test_hf_error_codes_map_to_client_errors(published: dict[str, str], hub_env: HubEnv, tmp_path: Path) -> None:
    errors = huggingface_hub.errors
    kwargs = {"endpoint": hub_env.url, "cache_dir": tmp_path}
    with pytest.raises(errors.RepositoryNotFoundError):
        huggingface_hub.hf_hub_download("acme/missing", "README.txt", **kwargs)
    with pytest.raises(errors.RevisionNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "README.txt", revision="nope", **kwargs)
    with pytest.raises(errors.EntryNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "nope.txt", **kwargs)
    status, headers, _ = request("HEAD", f"{hub_env.url}/{REPO}/resolve/main/nope.txt")
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound"
    assert headers["X-Repo-Commit"] == hub_env.server.head(REPO)
    status, headers, _ = request("GET", f"{hub_env.url}/api/models/acme/missing/revision/main")
    assert status == 404 and headers["X-Error-Code"] == "RepoNotFound"
    status, headers, _ = request("GET", f"{hub_env.url}/api/models/{REPO}/revision/nope")
    assert status == 404 and headers["X-Error-Code"] == "RevisionNotFound"


def test_resolve_headers_and_ranges(published: dict[str, str], hub_env: HubEnv, payload: dict[str, bytes]) -> None:
    data = payload["rotations/llama/w.pt"]
    url = f"{hub_env.url}/{REPO}/resolve/v1/rotations/llama/w.pt"
    status, headers, body = request("HEAD", url)
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == published["v1"]
    assert headers["X-Linked-Etag"] == f'"{sha256(data)}"'
    assert headers["X-Linked-Size"] == str(len(data))
    assert headers["Content-Length"] == str(len(data))
    assert "ETag" in headers and headers["Accept-Ranges"] == "bytes"
    status, headers, _ = request("HEAD", f"{hub_env.url}/{REPO}/resolve/v1/README.txt")
    assert headers["ETag"] == f'"{git_blob_oid(payload["README.txt"])}"' and "X-Linked-Etag" not in headers

    status, headers, body = request("GET", url, headers={"Range": "bytes=10-19"})
    assert status == 206 and body == data[10:20] and headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    status, _, body = request("GET", url, headers={"Range": "bytes=5000-"})
    assert status == 206 and body == data[5000:]
    status, _, body = request("GET", url, headers={"Range": "bytes=-7"})
    assert status == 206 and body == data[-7:]
    status, headers, _ = request("GET", url, headers={"Range": f"bytes={len(data)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"


@pytest.mark.parametrize(
    ("size", "keep", "retry_range"),
    [
        # The client buffers up to DOWNLOAD_CHUNK_SIZE (10 MiB) before writing, so a short body cut
        # early is fetched again whole, while a cut after the first chunk is resumed with Range.
        (5000, 1000, None),
        (11 * 2**20, 10 * 2**20 + 1000, f"bytes={10 * 2**20}-"),
    ],
    ids=["small-refetch", "large-range-resume"],
)
def test_hf_truncated_body_is_retried(hub_env: HubEnv, tmp_path: Path, size: int, keep: int,
                                      retry_range: str | None) -> None:
    server = hub_env.server
    data = os.urandom(size)
    server.commit_files(REPO, {"w.pt": data})
    server.arm_fault("/resolve/main/w.pt", "truncate", keep=keep)
    path = huggingface_hub.hf_hub_download(REPO, "w.pt", revision="main", endpoint=hub_env.url, cache_dir=tmp_path)
    assert file_sha256(path) == sha256(data)
    gets = server.requests(method="GET")
    assert [(g["fault"], g["range"], g["status"], g["bytes"]) for g in gets] == [
        ("truncate", None, 200, keep),
        (None, retry_range, 206 if retry_range else 200, size - 10 * 2**20 if retry_range else size),
    ]


def test_hf_client_accepts_corrupt_bytes(published: dict[str, str], hub_env: HubEnv, tmp_path: Path,
                                         payload: dict[str, bytes]) -> None:
    """huggingface_hub does not hash downloads: same-size wrong bytes end up in the cache."""
    hub_env.server.arm_fault("rotations/llama/w.pt", "corrupt")
    path = huggingface_hub.hf_hub_download(
        REPO, "rotations/llama/w.pt", revision="v1", endpoint=hub_env.url, cache_dir=tmp_path
    )
    good = payload["rotations/llama/w.pt"]
    assert Path(path).stat().st_size == len(good)
    assert file_sha256(path) != sha256(good)
    assert Path(path).resolve().name == sha256(good)  # stored under the advertised sha256
    fixed = huggingface_hub.hf_hub_download(
        REPO, "rotations/llama/w.pt", revision="v1", endpoint=hub_env.url, cache_dir=tmp_path, force_download=True
    )
    assert file_sha256(fixed) == sha256(good)


def test_cdn_redirect_mode(hub_server_factory: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = hub_server_factory(cdn_host="localhost")
    env = configure_clients(monkeypatch, server, tmp_path / "clients")
    data = os.urandom(4096)
    server.commit_files(REPO, {"w.pt": data})
    path = huggingface_hub.hf_hub_download(REPO, "w.pt", endpoint=env.url, cache_dir=tmp_path / "c")
    assert file_sha256(path) == sha256(data)
    assert [(e["method"], e["status"]) for e in server.requests()] == [("HEAD", 302), ("GET", 200)]
    assert server.requests()[1]["path"] == f"/_cdn/{sha256(data)}"


# ---------------------------------------------------------------------------------------------
# Token enforcement
# ---------------------------------------------------------------------------------------------


def test_token_required_for_writes_but_not_reads(hub_env: HubEnv, tmp_path: Path) -> None:
    server = hub_env.server
    errors = huggingface_hub.errors
    for token in ("wrong-token", False):
        api = huggingface_hub.HfApi(endpoint=hub_env.url, token=token)
        with pytest.raises(errors.HfHubHTTPError) as excinfo:
            api.create_repo(REPO)
        assert excinfo.value.response.status_code == 401
    assert not server.repo_exists(REPO)

    huggingface_hub.HfApi(endpoint=hub_env.url, token=TEST_TOKEN).create_repo(REPO)
    server.commit_files(REPO, {"x.txt": b"x"})
    status, headers, body = request(
        "POST", f"{hub_env.url}/api/models/{REPO}/commit/main",
        body=b'{"key":"header","value":{"summary":"s"}}\n', headers={"Authorization": "Bearer nope"},
    )
    assert status == 401 and b"Invalid credentials" in body
    status, _, _ = request("POST", f"{hub_env.url}/{REPO}.git/info/lfs/objects/batch", body=b'{"objects":[]}')
    assert status == 401
    anonymous = huggingface_hub.hf_hub_download(REPO, "x.txt", endpoint=hub_env.url, cache_dir=tmp_path, token=False)
    assert Path(anonymous).read_bytes() == b"x"
    with pytest.raises(errors.HfHubHTTPError):
        huggingface_hub.HfApi(endpoint=hub_env.url, token="wrong-token").whoami()
    assert huggingface_hub.HfApi(endpoint=hub_env.url, token=TEST_TOKEN).whoami()["name"] == "testuser"


def test_lfs_upload_checks_sha256_and_commit_needs_uploaded_object(hub_env: HubEnv) -> None:
    server = hub_env.server
    server.create_repo(REPO)
    auth = {"Authorization": f"Bearer {TEST_TOKEN}", "Content-Type": "application/json"}
    data = b"\x00payload" * 100
    batch = {"operation": "upload", "objects": [{"oid": sha256(data), "size": len(data)}], "hash_algo": "sha256"}
    batch_url = f"{hub_env.url}/{REPO}.git/info/lfs/objects/batch"
    status, _, body = request("POST", batch_url, json.dumps(batch).encode(), auth)
    assert status == 200
    actions = json.loads(body)["objects"][0]["actions"]
    status, _, body = request("PUT", actions["upload"]["href"], data[:-1] + b"!")
    assert status == 400 and b"sha256 mismatch" in body
    commit = "\n".join([
        json.dumps({"key": "header", "value": {"summary": "s"}}),
        json.dumps({"key": "lfsFile", "value": {"path": "w.bin", "algo": "sha256", "oid": sha256(data),
                                                 "size": len(data)}}),
    ]).encode()
    status, _, _ = request("POST", f"{hub_env.url}/api/models/{REPO}/commit/main", commit,
                        {**auth, "Content-Type": "application/x-ndjson"})
    assert status == 422
    status, _, _ = request("PUT", actions["upload"]["href"], data)
    assert status == 200
    verify = json.dumps({"oid": sha256(data), "size": len(data)}).encode()
    status, _, _ = request("POST", actions["verify"]["href"], verify, auth)
    assert status == 200
    status, _, body = request("POST", f"{hub_env.url}/api/models/{REPO}/commit/main", commit,
                           {**auth, "Content-Type": "application/x-ndjson"})
    assert status == 200 and server.file_bytes(REPO, "w.bin") == data
    # An object the server already has gets no upload action.
    status, _, body = request("POST", batch_url, json.dumps(batch).encode(), auth)
    assert "actions" not in json.loads(body)["objects"][0]


# ---------------------------------------------------------------------------------------------
# Faults, raw files, request log
# ---------------------------------------------------------------------------------------------


def test_fault_corrupt_returns_same_size_wrong_bytes(hub_server: HubServer) -> None:
    data = os.urandom(2000)
    url = hub_server.put_raw("weights/w.pt", data)
    hub_server.arm_fault("/raw/weights/w.pt", "corrupt")
    status, headers, body = request("GET", url)
    assert status == 200 and len(body) == len(data) and body != data
    assert headers["Content-Length"] == str(len(data))
    assert request("GET", url)[2] == data  # one-shot


def test_fault_truncate_cuts_the_body(hub_server: HubServer) -> None:
    data = os.urandom(4000)
    url = hub_server.put_raw("t.bin", data)
    hub_server.arm_fault("t.bin", "truncate", keep=100)
    with pytest.raises(http.client.IncompleteRead) as excinfo:
        with urllib.request.urlopen(url, timeout=10) as resp:
            resp.read()
    assert len(excinfo.value.partial) == 100
    assert request("GET", url)[2] == data


def test_fault_http500_and_count(hub_server: HubServer) -> None:
    url = hub_server.put_raw("f.bin", b"abc")
    hub_server.arm_fault("f.bin", "http500", count=2)
    assert request("GET", url)[0] == 500
    assert request("HEAD", url)[0] == 500
    assert request("GET", url)[0] == 200
    hub_server.arm_fault("f.bin", "http500", status=503)
    assert request("GET", url)[0] == 503


def test_fault_reset_drops_the_connection(hub_server: HubServer) -> None:
    url = hub_server.put_raw("r.bin", b"abc")
    hub_server.arm_fault("r.bin", "reset")
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError)):
        urllib.request.urlopen(url, timeout=10).read()
    assert request("GET", url)[2] == b"abc"
    assert [e["fault"] for e in hub_server.requests()] == ["reset", None]


def test_fault_slow_delays_the_answer(hub_server: HubServer) -> None:
    url = hub_server.put_raw("s.bin", b"abc")
    hub_server.arm_fault("s.bin", "slow", delay=0.4)
    start = time.perf_counter()
    assert request("GET", url)[2] == b"abc"
    assert time.perf_counter() - start >= 0.4
    start = time.perf_counter()
    request("GET", url)
    assert time.perf_counter() - start < 0.4


def _timed_read(url: str, method: str = "GET") -> tuple[float, float, bytes]:
    """(seconds to the end of the headers, seconds to the end of the body, body) of one request."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    start = time.perf_counter()
    try:
        conn.request(method, parts.path)
        resp = conn.getresponse()
        headers_done = time.perf_counter() - start
        body = resp.read()
        return headers_done, time.perf_counter() - start, body
    finally:
        conn.close()


def test_fault_drip_headers_sends_the_head_byte_by_byte(hub_server: HubServer) -> None:
    url = hub_server.put_raw("dh.bin", b"abc")
    hub_server.arm_fault("dh.bin", "drip_headers", interval=0.01, chunk=8)
    headers_done, _, body = _timed_read(url)
    head = hub_server.requests()[-1]
    assert body == b"abc" and head["fault"] == "drip_headers"
    # about 160 header bytes in 8-byte pieces 10 ms apart
    assert headers_done >= 0.1
    assert _timed_read(url)[0] < 0.1  # one-shot
    hub_server.arm_fault("dh.bin", "drip_headers", interval=0.01, chunk=8)
    assert _timed_read(url, "HEAD")[0] >= 0.1  # any method


def test_fault_drip_body_sends_the_body_byte_by_byte(hub_server: HubServer) -> None:
    data = os.urandom(40)
    url = hub_server.put_raw("db.bin", data)
    hub_server.arm_fault("db.bin", "drip_body", interval=0.01)
    headers_done, body_done, body = _timed_read(url)
    assert body == data and headers_done < 0.1 and body_done >= 0.39  # 39 pauses of 10 ms
    deadline = time.monotonic() + 2  # the log counts a piece just after sending it
    while hub_server.requests()[-1]["bytes"] < len(data) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub_server.requests()[-1]["bytes"] == len(data)
    assert _timed_read(url)[1] < 0.1  # one-shot


def test_fault_drip_stops_when_the_client_leaves_or_the_server_stops(hub_server_factory: Any) -> None:
    server = hub_server_factory()
    url = server.put_raw("dl.bin", os.urandom(1000))
    parts = urllib.parse.urlsplit(url)

    def dripping_answer(kind: str, interval: float) -> tuple[http.client.HTTPConnection, threading.Thread]:
        server.arm_fault("dl.bin", kind, interval=interval)
        before = set(threading.enumerate())
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        conn.request("GET", parts.path)
        time.sleep(0.2)
        (thread,) = [t for t in set(threading.enumerate()) - before if "process_request" in t.name]
        return conn, thread

    conn, thread = dripping_answer("drip_body", 0.05)
    resp = conn.getresponse()
    assert resp.read(3) and resp.status == 200
    conn.close()  # the client gives up: the server notices within a piece or two
    thread.join(timeout=3)
    assert not thread.is_alive() and server.requests()[-1]["bytes"] < 200

    conn, thread = dripping_answer("drip_headers", 30)
    server.stop()  # the 30 s pause is cut short
    thread.join(timeout=3)
    assert not thread.is_alive()
    conn.close()


def test_fault_method_filter_and_bad_kind(hub_server: HubServer) -> None:
    url = hub_server.put_raw("m.bin", b"abcdef")
    hub_server.arm_fault("m.bin", "corrupt")
    assert request("HEAD", url)[0] == 200  # body faults skip HEAD and stay armed
    assert request("GET", url)[2] != b"abcdef"
    hub_server.arm_fault("m.bin", "http500", method="GET")
    assert request("HEAD", url)[0] == 200
    assert request("GET", url)[0] == 500
    with pytest.raises(ValueError):
        hub_server.arm_fault("m.bin", "explode")


def test_raw_files_and_http_test_hooks(hub_server: HubServer) -> None:
    base = hub_server.url
    status, _, body = request("PUT", f"{base}/_test/raw/data/x.bin", b"0123456789")
    assert status == 200 and json.loads(body)["url"] == hub_server.raw_url("data/x.bin")
    status, headers, body = request("GET", hub_server.raw_url("data/x.bin"), headers={"Range": "bytes=2-4"})
    assert (status, body, headers["Content-Range"]) == (206, b"234", "bytes 2-4/10")
    assert request("GET", f"{base}/raw/missing.bin")[0] == 404

    fault = {"match": "/raw/data/x.bin", "kind": "http500", "count": 1}
    assert request("POST", f"{base}/_test/fault", json.dumps(fault).encode())[0] == 200
    assert request("POST", f"{base}/_test/fault", b'{"match": "x", "kind": "nope"}')[0] == 400
    assert request("GET", hub_server.raw_url("data/x.bin"))[0] == 500
    log = json.loads(request("GET", f"{base}/_test/log")[2])
    assert [(e["method"], e["path"], e["status"], e["fault"]) for e in log] == [
        ("GET", "/raw/data/x.bin", 206, None),
        ("GET", "/raw/missing.bin", 404, None),
        ("GET", "/raw/data/x.bin", 500, "http500"),
    ]
    filtered = json.loads(request("GET", f"{base}/_test/log?method=GET&contains=missing")[2])
    assert len(filtered) == 1
    assert request("POST", f"{base}/_test/log/clear", b"")[0] == 200
    assert json.loads(request("GET", f"{base}/_test/log")[2]) == []


def test_keep_alive_connection_serves_many_requests(hub_server: HubServer) -> None:
    hub_server.put_raw("k.bin", b"keep-alive")
    conn = http.client.HTTPConnection("127.0.0.1", hub_server.port, timeout=10)
    try:
        for method, path, expected in [
            ("GET", "/raw/k.bin", 200), ("HEAD", "/raw/k.bin", 200), ("GET", "/raw/none", 404),
            ("GET", "/api/models/x/y/refs", 404), ("GET", "/raw/k.bin", 200),
        ]:
            conn.request(method, path)
            resp = conn.getresponse()
            body = resp.read()
            assert resp.status == expected
            assert resp.getheader("Content-Length") == str(len(body)) or method == "HEAD"
        conn.putrequest("PUT", "/_test/raw/chunked.bin")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        for chunk in (b"abc", b"defgh"):
            conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        conn.send(b"0\r\n\r\n")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
    finally:
        conn.close()
    assert request("GET", hub_server.raw_url("chunked.bin"))[2] == b"abcdefgh"


def test_concurrent_requests(hub_server: HubServer) -> None:
    data = os.urandom(50_000)
    url = hub_server.put_raw("c.bin", data)
    hub_server.arm_fault("c.bin", "slow", delay=0.3)
    results: list[bytes] = []

    def fetch() -> None:
        results.append(request("GET", url)[2])

    threads = [threading.Thread(target=fetch) for _ in range(8)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.perf_counter() - start < 3
    assert results == [data] * 8
    assert len(hub_server.requests(method="GET", contains="c.bin")) == 8


# ---------------------------------------------------------------------------------------------
# Script mode and on-disk storage
# ---------------------------------------------------------------------------------------------


def start_script(*args: str) -> tuple[subprocess.Popen[str], str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, str(HUBSERVER_SCRIPT), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    elapsed = time.perf_counter() - start
    if not line.startswith("HUB_URL="):
        proc.kill()
        raise AssertionError(f"unexpected first line {line!r}: {proc.stderr.read() if proc.stderr else ''}")
    return proc, line[len("HUB_URL="):], elapsed


def stop_script(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_script_mode_prints_url_and_stops_on_sigterm() -> None:
    proc, url, elapsed = start_script("--host", "127.0.0.1", "--port", "0", "--token", "T")
    try:
        assert url.startswith("http://127.0.0.1:") and int(url.rsplit(":", 1)[1]) > 0
        assert elapsed < 10  # includes interpreter start-up on a loaded machine; typically ~0.3 s
        status, _, body = request("GET", f"{url}/_test/health")
        assert status == 200 and json.loads(body)["url"] == url
        status, _, _ = request("POST", f"{url}/api/repos/create", json.dumps({"name": "x"}).encode(),
                            {"Content-Type": "application/json"})
        assert status == 401
    finally:
        code = stop_script(proc)
    assert code == 0
    assert proc.stdout is not None and proc.stdout.read() == ""  # exactly one line


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "example.com"])
def test_non_loopback_host_is_refused(host: str) -> None:
    result = subprocess.run(
        [sys.executable, str(HUBSERVER_SCRIPT), "--host", host, "--port", "0"],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode != 0
    assert "loopback" in result.stderr and result.stdout == ""
    with pytest.raises(ValueError, match="loopback"):
        HubServer(host=host)


def test_data_dir_is_shared_between_two_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data_dir = tmp_path / "data"
    proc_a, url_a, _ = start_script("--port", "0", "--data", str(data_dir), "--token", TEST_TOKEN)
    proc_b, url_b, _ = start_script("--port", "0", "--data", str(data_dir), "--token", TEST_TOKEN)
    try:
        configure_clients(monkeypatch, url_a, tmp_path / "clients")
        api_a = huggingface_hub.HfApi(endpoint=url_a, token=TEST_TOKEN)
        api_b = huggingface_hub.HfApi(endpoint=url_b, token=TEST_TOKEN)
        api_a.create_repo(REPO)
        weights = os.urandom(3000)
        first = api_a.create_commit(
            REPO, operations=[huggingface_hub.CommitOperationAdd("w.pt", weights)], commit_message="w"
        )
        path = huggingface_hub.hf_hub_download(REPO, "w.pt", endpoint=url_b, cache_dir=tmp_path / "cb")
        assert file_sha256(path) == sha256(weights)
        api_b.create_tag(REPO, tag="v1")
        assert {t.name: t.target_commit for t in api_a.list_repo_refs(REPO).tags} == {"v1": first.oid}
        with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as excinfo:
            api_b.create_repo(REPO)
        assert excinfo.value.response.status_code == 409
    finally:
        assert stop_script(proc_a) == 0
        assert stop_script(proc_b) == 0
    # A third, in-process server over the same directory sees the repository too.
    with HubServer(data_dir=data_dir) as server:
        assert server.resolve(REPO, "v1") == first.oid
        assert server.file_bytes(REPO, "w.pt", "v1") == weights


# ---------------------------------------------------------------------------------------------
# modelscope
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def ms(hub_env: HubEnv) -> Any:
    """The modelscope client modules (imported lazily: importing modelscope takes seconds)."""
    pytest.importorskip("modelscope")
    from modelscope.hub.api import HubApi
    from modelscope.hub.file_download import model_file_download
    from modelscope.hub.snapshot_download import snapshot_download

    return types.SimpleNamespace(
        HubApi=HubApi, model_file_download=model_file_download, snapshot_download=snapshot_download
    )


def test_modelscope_login_create_upload_and_download(ms: Any, hub_env: HubEnv, tmp_path: Path,
                                                     payload: dict[str, bytes]) -> None:
    from modelscope_hub.errors import AlreadyExistsError

    server = hub_env.server
    api = ms.HubApi(endpoint=hub_env.url)
    api.login(TEST_TOKEN)
    assert (hub_env.ms_home / "credentials").is_dir()  # credentials stayed in the temporary home
    api.create_repo(REPO)
    with pytest.raises(AlreadyExistsError):
        api.create_repo(REPO)
    assert api.create_repo(REPO, exist_ok=True) is None
    api.upload_folder(repo_id=REPO, folder_path=str(make_folder(tmp_path / "up", payload)), commit_message="up")
    api.create_model_tag(REPO, "v1")
    assert server.resolve(REPO, "v1") == server.head(REPO)
    server.commit_files(REPO, {"README.txt": b"moved on\n"})  # master moves past v1

    path = ms.model_file_download(REPO, "rotations/llama/w.pt", revision="v1", cache_dir=str(tmp_path / "c1"))
    assert file_sha256(path) == sha256(payload["rotations/llama/w.pt"])
    master = ms.model_file_download(REPO, "README.txt", revision="master", cache_dir=str(tmp_path / "c1"))
    assert Path(master).read_bytes() == b"moved on\n"

    server.clear_log()
    folder = ms.snapshot_download(REPO, revision="v1", cache_dir=str(tmp_path / "c2"))
    got = {str(p.relative_to(folder)): p.read_bytes() for p in Path(folder).rglob("*") if p.is_file()}
    assert {k: v for k, v in got.items() if k != ".gitattributes"} == payload
    assert Path(folder).parts[-3:] == ("acme--demo", "snapshots", "v1")
    listings = server.requests(contains="/repo/files")
    assert listings and all("Revision=v1" in e["target"] for e in listings)
    downloads = server.requests(method="GET", contains="FilePath=")
    assert sorted(e["target"].split("FilePath=")[1] for e in downloads) == [
        ".gitattributes", "README.txt", "rotations/llama/w.pt"
    ]


def test_modelscope_snapshot_rejects_corrupt_bytes_file_download_does_not(
    ms: Any, hub_env: HubEnv, tmp_path: Path
) -> None:
    server = hub_env.server
    data = os.urandom(3000)
    server.commit_files(REPO, {"w.pt": data})
    server.create_tag(REPO, "v1")

    server.arm_fault("FilePath=w.pt", "corrupt")
    folder = ms.snapshot_download(REPO, revision="v1", cache_dir=str(tmp_path / "c1"), allow_patterns=["*.pt"])
    assert file_sha256(Path(folder) / "w.pt") == sha256(data)
    assert [e["fault"] for e in server.requests(method="GET", contains="FilePath=w.pt")] == ["corrupt", None]

    server.arm_fault("FilePath=w.pt", "corrupt")
    path = ms.model_file_download(REPO, "w.pt", revision="v1", cache_dir=str(tmp_path / "c2"))
    assert Path(path).stat().st_size == len(data) and file_sha256(path) != sha256(data)


def test_modelscope_wire_details(ms: Any, hub_env: HubEnv) -> None:
    server = hub_env.server
    server.commit_files(REPO, {"a/b.txt": b"hello"})
    server.create_tag(REPO, "v1")
    base = f"{hub_env.url}/api/v1/models/{REPO}"
    revisions = json.loads(request("GET", f"{base}/revisions")[2])["Data"]["RevisionMap"]
    assert [t["Revision"] for t in revisions["Tags"]] == ["v1"]
    assert {b["Revision"] for b in revisions["Branches"]} == {"master", "main"}
    files = json.loads(request("GET", f"{base}/repo/files?Revision=v1&Recursive=True")[2])["Data"]["Files"]
    blob = next(f for f in files if f["Path"] == "a/b.txt")
    assert blob["Sha256"] == sha256(b"hello") and blob["Type"] == "blob" and blob["Size"] == 5
    assert any(f["Path"] == "a" and f["Type"] == "tree" for f in files)
    status, headers, body = request("GET", f"{base}/repo?Revision=v1&FilePath=a/b.txt", headers={"Range": "bytes=1-"})
    assert (status, body) == (206, b"ello")
    probe = json.loads(request("GET", f"{hub_env.url}/api/v1/repos/internalAccelerationInfo")[2])
    assert probe["Code"] == 200 and "InternalRegionQueryAddress" not in probe["Data"]
    status, _, body = request("POST", f"{hub_env.url}/api/v1/login", json.dumps({"AccessToken": "bad"}).encode())
    assert status == 400 and json.loads(body)["Code"] == 10010103009
    login = json.dumps({"AccessToken": TEST_TOKEN}).encode()
    status, headers, _ = request("POST", f"{hub_env.url}/api/v1/login", login)
    assert status == 200 and headers["Set-Cookie"].startswith(f"m_session_id={TEST_TOKEN}")
    status, _, _ = request("POST", f"{hub_env.url}/api/v1/models", json.dumps({"Path": "acme", "Name": "n"}).encode(),
                        {"Cookie": "m_session_id=wrong"})
    assert status == 401
    status, _, _ = request("POST", f"{hub_env.url}/api/v1/models", json.dumps({"Path": "acme", "Name": "n"}).encode(),
                        {"Cookie": f"m_session_id={TEST_TOKEN}"})
    assert status == 200 and server.repo_exists("acme/n")


def test_modelscope_without_revision_takes_newest_tag_before_sdk_release(ms: Any, hub_env: HubEnv,
                                                                           tmp_path: Path) -> None:
    server = hub_env.server
    server.commit_files(REPO, {"a.txt": b"old"})
    server.create_tag(REPO, "v1", created_at=1_600_000_000)  # 2020, before any SDK release
    server.commit_files(REPO, {"a.txt": b"new"})
    server.create_tag(REPO, "v2")  # created now, after the installed SDK was released
    path = ms.model_file_download(REPO, "a.txt", cache_dir=str(tmp_path))
    assert Path(path).read_bytes() == b"old" and Path(path).parent.name == "v1"
    assert server.requests()[0]["path"] == f"/api/v1/models/{REPO}/revisions"
