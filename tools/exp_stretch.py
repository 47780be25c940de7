"""Experiment: a non-orthogonal key transform (the authors' ``stretch`` idea) under the default's recipe.

The learned default's lead over Hadamard is in its keys (docs/real-model.md, "Where the KL comes from"). An
orthogonal ``R`` cannot change the keys' spectrum; a non-orthogonal ``T`` can, at no cost in bits, when the
queries read the inverse (``q_rotation = T^-T``, which the authors' V3 files carry and their tree serves):
``(q T^-T)·(k T) = q·k``. For a per-row quantizer whose error grows with the row's energy, the score error of
``T = P R`` (``P`` symmetric positive definite, ``R`` orthogonal) scales as ``tr(P S P) · tr(P^-1 M P^-1)``
(``S`` the KV head's centered key covariance, ``M`` the second moment of the queries that read it), smallest at
``P² = X = S^-1/2 (S^1/2 M S^1/2)^1/2 S^-1/2`` (the matrix geometric mean of ``S^-1`` and ``M``, the
authors' ``stretch`` metric); ``--alpha`` takes ``P = X^(alpha/2)`` (0: orthogonal, 1: the optimum).

``transform``: write a copy of a capture (``rotationzoo calibrate --dump-out``) with each KV head's keys
multiplied by ``P`` and its queries by ``P^-1`` (values, sequence lengths and metadata unchanged; every score
exact), and ``P`` per (layer, KV head) beside it (``stretch_p.pt``); prints the model's predicted factor
``(tr (S^1/2 M S^1/2)^1/2)² / (tr S · tr M)`` per layer::

    python tools/exp_stretch.py transform --dump bench-out/dump8k_g64 --out bench-out/dump8k_g64_stretch

then any fitter on the copy (``rotationzoo fit --dump bench-out/dump8k_g64_stretch ...``: the fitted
rotations ``R`` live in the transformed basis), and ``compose`` turns its output into a set for the model's
basis: K ``rotation = P R``, ``q_rotation = P^-1 R`` (``= (P R)^-T``), ``k_mean`` mapped back by ``P^-1``;
V unchanged::

    python tools/exp_stretch.py compose --fitted out_in_stretch_basis/ --p bench-out/dump8k_g64_stretch \\
        --out bench-out/rotations/stretch_closed

The composed folder is evaluated like any other (``tools/bench_frontier.py --rotation name=folder``).
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

P_FILE = "stretch_p.pt"


def _sqrtm(a: torch.Tensor, power: float = 0.5, floor: float = 1e-6) -> torch.Tensor:
    """``a^power`` of a symmetric positive semi-definite matrix, eigenvalues floored at ``floor · max``."""
    ev, u = torch.linalg.eigh((a + a.T) / 2)
    ev = ev.clamp_min(float(ev.max()) * floor)
    return (u * ev.pow(power)) @ u.T


def stretch_p(s: torch.Tensor, m: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """``(P, predicted factor)`` for one KV head: ``P = X^(alpha/2)``, scaled so that ``tr(P S P) = tr S``."""
    sh, shi = _sqrtm(s, 0.5), _sqrtm(s, -0.5)
    inner = _sqrtm(sh @ m @ sh, 0.5)
    x = shi @ inner @ shi
    p = _sqrtm(x, alpha / 2)
    p = p * (torch.trace(s) / torch.trace(p @ s @ p)).sqrt()
    predicted = float(torch.trace(inner) ** 2 / (torch.trace(s) * torch.trace(m)))
    return p, predicted


def cmd_transform(a) -> None:
    from rotationzoo.fit.dump import Dump
    src, out = Path(a.dump), Path(a.out)
    if out.exists():
        sys.exit(f"{out} exists: give a new folder")
    dump = Dump(src)
    shutil.copytree(src, out)
    ps: dict[int, torch.Tensor] = {}
    for lid in dump.layer_ids:
        chunks = [c for c in dump.chunk_ids(lid) if c != 0]  # the warm-up chunk (a few tokens) left out
        q = torch.cat([dump.load(lid, "q", c).double() for c in chunks])
        k = torch.cat([dump.load(lid, "k", c).double() for c in chunks])
        h_kv, g = k.shape[1], q.shape[1] // k.shape[1]
        mats, pred = [], []
        for h in range(h_kv):
            kh = k[:, h] - k[:, h].mean(0)
            qh = q[:, h * g:(h + 1) * g].reshape(-1, q.shape[-1])
            p, f = stretch_p(kh.T @ kh / len(kh), qh.T @ qh / len(qh), a.alpha)
            mats.append(p)
            pred.append(f)
        ps[lid] = torch.stack(mats)
        pinv = torch.linalg.inv(ps[lid])
        for c in dump.all_chunk_ids(lid, "k"):
            for kind, mat in (("k", ps[lid]), ("q", pinv)):
                path = out / f"layer_{lid}" / kind / f"{c}.pt"
                x = torch.load(path, weights_only=True)
                heads = x.shape[1] // h_kv
                y = torch.einsum("thd,hde->the", x.double(), mat.repeat_interleave(heads, 0)).to(x.dtype)
                torch.save(y.contiguous(), path)
        print(f"layer {lid}: predicted score-error factor per KV head " + " ".join(f"{f:.3f}" for f in pred), flush=True)
    layer_ids = sorted(ps)
    torch.save({"layer_ids": layer_ids, "p": torch.stack([ps[i] for i in layer_ids]).float(), "alpha": a.alpha},
               out / P_FILE)
    print(f"wrote {out} (and {out / P_FILE})")


def rewrite_k_file(kfile: Path, new, **record) -> None:
    """Write the K set ``new`` over ``kfile`` in a copied fitted folder and give its manifest (if any) the new
    file's sha256 and size, plus ``record``'s keys (what was changed)."""
    from rotationzoo.files.format import write_rotation
    from rotationzoo.files.manifest import MANIFEST_NAME, read_manifest, write_manifest
    from rotationzoo.hashing import sha256_file

    write_rotation(kfile, new)
    if (kfile.parent / MANIFEST_NAME).exists():
        m = read_manifest(kfile.parent / MANIFEST_NAME)
        for entry in (m.get("files") or {}).values():
            if isinstance(entry, dict) and entry.get("name") == kfile.name:
                entry["sha256"], entry["size"] = sha256_file(kfile), kfile.stat().st_size
        write_manifest(kfile.parent, {**m, **record})


def cmd_compose(a) -> None:
    from rotationzoo.files.format import read_rotation
    fitted, out = Path(a.fitted), Path(a.out)
    saved = torch.load(Path(a.p) / P_FILE, weights_only=True)
    p = saved["p"].double()
    if out.exists():
        sys.exit(f"{out} exists: give a new folder")
    shutil.copytree(fitted, out)
    kfile = next(out.glob("k_rotation_*.pt"))
    rs = read_rotation(kfile)
    if list(rs.layer_ids) != list(saved["layer_ids"]) or rs.rotations.dim() != 4:
        sys.exit("the fitted K set must be per KV head over the transformed capture's layers")
    r = rs.rotations.double()
    pinv = torch.linalg.inv(p)
    k_mean = None if rs.k_mean is None else torch.einsum("lhd,lhde->lhe", rs.k_mean.double(), pinv).float()
    new = replace(rs, rotations=(p @ r).float(), q_rotation=(pinv @ r).float(), k_mean=k_mean, eigenvalues=None,
                  format_version=None, path=None,
                  transform={**(rs.transform or {}), "orthogonal": False, "stretch_alpha": float(saved["alpha"])})
    rewrite_k_file(kfile, new)
    print(f"wrote {out} (K: P R with q_rotation P^-1 R; V as fitted)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("transform", help="a copy of a capture in the stretched key basis")
    t.add_argument("--dump", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--alpha", type=float, default=1.0, help="P = X^(alpha/2): 0 orthogonal, 1 the optimum (default)")
    c = sub.add_parser("compose", help="a fitted set in the stretched basis, back in the model's basis")
    c.add_argument("--fitted", required=True)
    c.add_argument("--p", required=True, help="the transformed capture (its stretch_p.pt)")
    c.add_argument("--out", required=True)
    a = ap.parse_args()
    {"transform": cmd_transform, "compose": cmd_compose}[a.cmd](a)


if __name__ == "__main__":
    main()
