"""Experiment: which side's INT2 error the KL comes from. ``tools/bench_frontier.py`` with rows that quantize one side.

A row whose rotation name ends in ``_k`` quantizes only the keys (values read back exactly), one ending in ``_v``
only the values; everything else is the frontier tool's evaluation (the same tokens, windows and bits per element:
the bits printed are the format's, what a cache storing both sides would cost). ``hadamard_k`` and ``hadamard_v``
are built in; any other name is a ``--rotation NAME=SOURCE``::

    python tools/exp_sides.py --texts kjv,debianref,pystdlib --skip debianref=10000 --windows 1 --probes 0 \\
        --context 8192 --rotation default_k=SmolLM2-135M-Instruct --rotation default_v=SmolLM2-135M-Instruct \\
        --rows 'default_k@int2-g64-bf16-c0.92/0.92,default_v@int2-g64-bf16-c0.92/0.92,hadamard_k@int2-g64-bf16-c0.92/0.92,hadamard_v@int2-g64-bf16-c0.92/0.92' \\
        --baseline hadamard_k

Measured (docs/real-model.md, "Where the KL comes from"): the default's lead over Hadamard is in the keys.
"""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIDES = {"_k": {"quantize_v": False}, "_v": {"quantize_k": False}}


def main() -> int:
    import bench_frontier
    from rotationzoo.evaluate.methods import MethodSpec

    served = MethodSpec.oscar

    def oscar(self, *args, **kwargs):
        o = served(self, *args, **kwargs)
        side = next((SIDES[s] for s in SIDES if self.method.endswith(s)), None)
        return o.replace(**side) if o is not None and side else o

    rows_of = bench_frontier.rows_of

    def rows(text, rotations):
        builtin = {f"hadamard{s}": replace(MethodSpec.hadamard(), name=f"hadamard{s}", method=f"hadamard{s}")
                   for s in SIDES}
        return rows_of(text, {**builtin, **rotations})

    MethodSpec.oscar = oscar
    bench_frontier.rows_of = rows
    return bench_frontier.main()


if __name__ == "__main__":
    sys.exit(main())
