#!/usr/bin/env python
"""Client-side timings: warm ``load()`` overhead beyond tensor loading, and ``rotationzoo list``.

Usage::

    python tools/bench_client.py [--repeat 20] [--json-out bench-out/client.json]

It seeds a private cache through the in-repo test hub server (127.0.0.1 only) with a
Qwen3-8B-shaped pair (36 × 128 × 128, pinned sha256), then measures in this process:

* ``read+validate``: reading both files and validating them (the tensor-loading floor);
* ``load() warm``: the public call on a warm cache (registry lookup, cache markers, read, validate);
* overhead = ``load() warm`` − ``read+validate`` (budget: ≤ 20 ms), and the HTTP requests it made (must be 0);
* ``rotationzoo list --json`` / ``rotationzoo list`` wall time in a fresh process (budget: ≤ 0.3 s).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="rz-bench-"))
    os.environ.update({"ROTATIONZOO_CACHE": str(tmp / "cache"), "HF_HOME": str(tmp / "hf"),
                       "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from hubserver import HubServer

    import rotationzoo
    from rotationzoo import RotationSet, read_rotation, validate, write_rotation

    with HubServer() as hub:
        os.environ["HF_ENDPOINT"] = hub.url
        files = {}
        for side, obj, seed in (("k", "qqt_r_h_pbr", 1), ("v", "sst_r_h_pbr", 2)):
            q, _ = torch.linalg.qr(torch.randn(36, 128, 128, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(seed)))
            p = write_rotation(tmp / f"{side}_rotation_{obj}.pt", RotationSet(q.float(), range(36), obj, torch.rand(36, 128)))
            files[side] = (f"Qwen3-8B/bench/{p.name}", p.read_bytes())
        commit = hub.commit_files("bench/zoo", {k: v for k, v in files.values()})
        reg = json.loads((ROOT / "registry.json").read_text())
        qwen = next(m for m in reg["models"] if m["id"] == "Qwen/Qwen3-8B")
        tag = qwen["tags"][qwen["default_tag"]]
        tag.pop("sources", None)
        for side, (path, data) in files.items():
            tag["files"][side] = {"path": path, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                                  "sources": [{"type": "huggingface", "repo": "bench/zoo", "revision": commit}]}
        (tmp / "registry.json").write_text(json.dumps({"registry_version": 1, "models": [qwen]}))
        os.environ["ROTATIONZOO_REGISTRY"] = str(tmp / "registry.json")

        t0 = time.perf_counter()
        pair = rotationzoo.load("Qwen3-8B")
        cold_ms = (time.perf_counter() - t0) * 1e3
        hub.clear_log()

        def read_validate():
            for side in "kv":
                validate(read_rotation(pair.paths[side]), num_layers=36, head_dim=128)

        floor = _median_ms(read_validate, args.repeat)
        warm = _median_ms(lambda: rotationzoo.load("Qwen3-8B"), args.repeat)
        fetch_warm = _median_ms(lambda: rotationzoo.fetch("Qwen3-8B"), args.repeat)
        bundled = _median_ms(lambda: rotationzoo.load("SmolLM2-135M-Instruct"), args.repeat)
        requests = len(hub.requests())

    def cli(argv):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "rotationzoo.cli.main", *argv], check=True,
                           stdout=subprocess.DEVNULL, env={**os.environ, "ROTATIONZOO_REGISTRY": ""})
            best = min(best, time.perf_counter() - t0)
        return best * 1e3

    list_json = cli(["list", "--json"])
    list_table = cli(["list"])
    rows = [
        ("cold load() (2 × 2.4 MB from the local hub)", cold_ms, None),
        ("read + validate both files (floor)", floor, None),
        ("warm load()", warm, None),
        ("warm load() overhead beyond read + validate", warm - floor, 20.0),
        ("warm fetch() (paths only)", fetch_warm, 20.0),
        ("warm load() of the bundled SmolLM2 entry", bundled, None),
        ("rotationzoo list --json (fresh process)", list_json, 300.0),
        ("rotationzoo list (table, fresh process)", list_table, 300.0),
    ]
    print(f"{'measurement':<48} {'ms':>9} {'budget':>8}")
    for name, ms, budget in rows:
        print(f"{name:<48} {ms:9.2f} {('≤ %g' % budget) if budget else '':>8}")
    print(f"HTTP requests during warm calls: {requests}")
    out = {"rows": [{"name": n, "ms": round(v, 3), "budget_ms": b} for n, v, b in rows],
           "warm_requests": requests, "python": sys.version.split()[0], "torch": torch.__version__}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=2))
    return 0 if requests == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
