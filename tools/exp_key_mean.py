#!/usr/bin/env python
"""Experiment: a centered rotation set with its key means (``k_mean``) taken from another capture.

A centered K file stores the per-KV-head key means of its calibration text and quantizes ``k - k_mean``; a
key mean shifts every score of a query alike, so any mean is exact and only the INT2 error depends on it. This
writes a copy of a fitted folder whose K file carries the means of ``--dump`` instead (rotations, values and
everything else unchanged; the manifest's K hash updated), to measure how much the centering's text matters::

    rotationzoo calibrate --model SmolLM2-135M-Instruct.Q4_1.gguf --text pydocutils.txt --tokens 8192 \\
        --seq-len 8192 --objective oscar2_center --grouping kv_head --out pydoc_cf/ --dump-out dump_pydoc8k/
    python tools/exp_key_mean.py --dump dump_pydoc8k/ --rotations rotationzoo/data/rotations/SmolLM2-135M-Instruct/<tag> \\
        --out kmean_pydoc/

Measured (docs/real-model.md, "Why code misses"): the default with the means of the very window it is evaluated
on is level with the default there.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))


def key_means(dump_dir: Path, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """``[L, H_kv, d]`` means of the captured (post-RoPE) keys per KV head, the warm-up chunk left out."""
    from rotationzoo.fit.dump import Dump

    dump = Dump(dump_dir)
    missing = sorted(set(layer_ids) - set(dump.layer_ids))
    if missing:
        sys.exit(f"{dump_dir} has no keys for layers {missing}")
    means = []
    for lid in layer_ids:
        chunks = [c for c in dump.chunk_ids(lid) if c != 0]
        k = torch.cat([dump.load(lid, "k", c).double() for c in chunks])  # [T, H_kv, d]
        means.append(k.mean(0))
    return torch.stack(means).float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", required=True, type=Path, help="a capture (--dump-out) of the text to take the means from")
    ap.add_argument("--rotations", required=True, type=Path, help="a fitted folder with a centered K file")
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args()
    from exp_stretch import rewrite_k_file
    from rotationzoo.files.format import read_rotation

    if a.out.exists():
        sys.exit(f"{a.out} exists: give a new folder")
    kfiles = sorted(a.rotations.glob("k_rotation_*.pt"))
    if len(kfiles) != 1:
        sys.exit(f"{a.rotations}: expected one k_rotation_*.pt, found {len(kfiles)}")
    rs = read_rotation(kfiles[0])
    if rs.k_mean is None:
        sys.exit(f"{kfiles[0]} is not centered (no k_mean): nothing to replace")
    new_mean = key_means(a.dump, rs.layer_ids)
    if new_mean.shape != rs.k_mean.shape:
        sys.exit(f"the capture's means are {tuple(new_mean.shape)}, the file's k_mean {tuple(rs.k_mean.shape)}")
    shutil.copytree(a.rotations, a.out)
    rewrite_k_file(a.out / kfiles[0].name, replace(rs, k_mean=new_mean, format_version=None, path=None),
                   k_mean_from=str(a.dump))
    shift = (new_mean - rs.k_mean).norm(dim=-1) / rs.k_mean.norm(dim=-1).clamp_min(1e-12)
    print(f"wrote {a.out}: k_mean from {a.dump} (moved by {shift.min():.2f}-{shift.max():.2f} of its norm per head)")


if __name__ == "__main__":
    main()
