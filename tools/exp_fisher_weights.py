"""Experiment: the served refinement loss with each drawn query weighted by its output gradient's norm.

The library's ``fisher`` loss (:mod:`rotationzoo.fit.refine_loss`) weights every (drawn query, INT2 key) pair by
its squared first-order effect on the calibration window's next-token NLL, from ``g_i``, the NLL's gradient with
respect to query ``i``'s attention output. This run keeps the served loss's pair weights and directions and only
scales each drawn query by ``w_i = |g_i|^FISHER_ALPHA`` (normalized to mean 1 per layer): keys
``sum_ij w_i a_ij (q_i . (k~_j - k_j))^2``, values ``sum_i w_i |sum_j a_ij (v~_j - v_j)|^2``. ``FISHER_ALPHA=2``
is the Fisher scalar, ``1`` (the default) a tempered form with less weight on the few positions the gradients
concentrate on.

It needs the gradients, so it runs ``rotationzoo calibrate`` or ``rotationzoo fit`` with ``--loss fisher`` (which
makes them be captured or read) in-process with the loss patched; nothing is written to the library::

    FISHER_ALPHA=1 python tools/exp_fisher_weights.py fit --dump dump8k_grads/ --refine 100 --loss fisher \\
        --init oscar --grouping kv_head --center k -g 64 --scale-dtype bfloat16 --k-clip-ratio 0 \\
        --v-clip-ratio 0.92 --seed 0 --sample-tokens 20480 --keep-text mansfieldpark.txt \\
        --keep-model SmolLM2-135M-Instruct.Q4_1.gguf --keep-k-clip-ratio 0.92 --keep-v-clip-ratio 0.92 --out fw/

Measured (docs/real-model.md): no gain over the served loss on the design text.
"""
import os
import sys
from dataclasses import replace

import torch

from rotationzoo.fit import refine, refine_loss

ALPHA = float(os.environ.get("FISHER_ALPHA", "1"))
_orig_layer_data = refine_loss.layer_data


def layer_data(samples, side, cfg, mean=None):
    """The served loss's layer data, each drawn query's weight (K) or output-error row (V) scaled by ``w_i``."""
    if cfg.loss != "fisher":
        return _orig_layer_data(samples, side, cfg, mean)
    served = replace(cfg, loss="served")
    data = _orig_layer_data(samples, side, served, mean)
    q, k, _, pos = samples.blocks()
    g = samples.grads()
    b, n, hq, _ = q.shape
    hkv = k.shape[2]
    grp = hq // hkv
    sel = refine_loss._drawn_queries(pos, n, served, samples.layer_id)  # the served loss's queries, in its order
    m = sel.shape[1]
    w = torch.stack([g[i, sel[i]].float().norm(dim=-1).permute(1, 0).reshape(hkv, grp * m) for i in range(b)])
    w = w.pow(ALPHA)
    w = w / w.mean()
    if side == "k":
        data.metric = data.metric * w[..., None]
        data.den = (data.metric * (data.queries @ data.x.transpose(-1, -2)).square()).sum(dim=(-1, -2)).to(torch.float64)
    else:  # the served V numerator squares each drawn query's output error: scale its row by sqrt(w)
        data.metric = data.metric * w.sqrt()[..., None]
    return data


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] not in (["calibrate"], ["fit"]) or "fisher" not in argv:
        sys.exit("usage: FISHER_ALPHA=A python tools/exp_fisher_weights.py calibrate|fit --loss fisher [rotationzoo options]")
    print(f"served loss, drawn queries weighted by |g|^{ALPHA:g}", file=sys.stderr)
    refine.layer_data = layer_data
    from rotationzoo.cli.main import main
    sys.exit(main(argv))
