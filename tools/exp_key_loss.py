"""Experiment: ``rotationzoo calibrate`` with the keys' served refinement loss replaced by what the softmax reads.

The library's served loss for K (:mod:`rotationzoo.fit.refine_loss`) is the attention-weighted squared score
error ``sum_ij a_ij d_ij^2`` over the (drawn query, far INT2 key) pairs, ``d_ij = q_i . (k~_j - k_j)``. Two things
that loss counts the softmax does not see, or sees differently:

* ``KEY_LOSS=var``: a score error shared by all of a query's keys moves nothing (softmax is shift-invariant);
  to second order the attention distribution's KL is ``1/2 (sum_j a_ij d_ij^2 - (sum_j a_ij d_ij)^2)`` (the sum
  over every key, the near and sink ones carrying ``d = 0``), so this run subtracts each query's squared mean.
* ``KEY_LOSS=out``: what the layer reads is the attention output; to first order a score error moves it by
  ``sum_j a_ij d_ij (v_j - o_i)`` (``o_i`` the exact output), so this run measures that vector's squared norm
  per drawn query, relative to the outputs' energy: score errors on keys whose values stand out count more.
* ``KEY_LOSS=iso:L``: the served loss with each drawn query's direction blended with isotropic ones of the same
  norm, ``(1 - L) sum_ij a_ij d_ij^2 + L sum_ij a_ij |q_i|^2 |k~_j - k_j|^2 / d`` (``L = 1``: the attention-
  weighted key error alone, blind to where the calibration text's queries point; a rotation fitted to one
  text's query directions may not carry to text whose queries point elsewhere).

Everything else is the command line's ``rotationzoo calibrate`` (or ``rotationzoo fit`` from a capture), run
in-process with the loss patched; nothing is written to the library::

    KEY_LOSS=out python tools/exp_key_loss.py calibrate --model SmolLM2-135M-Instruct.Q4_1.gguf --text emma.txt \\
        --tokens 20000 --seq-len 8192 --refine 100 --init oscar --grouping kv_head --center k -g 64 \\
        --scale-dtype bfloat16 --seed 2 --sample-tokens 20480 --keep-text mansfieldpark.txt --out kout/

Measured (docs/real-model.md): none of the three beats the served loss on the design texts.
"""
import os
import sys

import torch

from rotationzoo.fit import refine, refine_loss

MODE = os.environ.get("KEY_LOSS", "out")
_orig_layer_data = refine_loss.layer_data
_orig_num = refine_loss.numerators


def _values_and_outputs(samples, cfg):
    """Per block: the values ``[B, Hkv, n, d]`` and the drawn queries' exact outputs ``[B, Hkv, g m, d]`` (the
    queries the library's served loss draws, in its order) with their energy per KV head ``[B, Hkv]``."""
    q, k, v, pos = samples.blocks()
    shape = samples.shape
    scale = cfg.softmax_scale if cfg.softmax_scale is not None else shape.head_dim ** -0.5
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    sel = refine_loss._drawn_queries(pos, n, cfg, samples.layer_id)
    m = sel.shape[1]
    vals = refine_loss._heads_first(v)
    outs = torch.empty(b, hkv, g * m, d, dtype=torch.float32)
    cols = torch.arange(n)
    for i in range(b):
        qi = q[i, sel[i]].to(torch.float32).permute(1, 0, 2)
        ki = k[i].to(torch.float32).permute(1, 0, 2).repeat_interleave(g, dim=0)
        vi = v[i].to(torch.float32).permute(1, 0, 2).repeat_interleave(g, dim=0)
        scores = (qi @ ki.transpose(-1, -2)) * scale
        a = torch.softmax(scores.masked_fill(cols[None, :] > sel[i][:, None], float("-inf")), dim=-1)
        outs[i] = (a @ vi).reshape(hkv, g * m, d)
    energy = outs.square().sum(dim=(-1, -2)).to(torch.float64)
    return vals, outs, energy


def layer_data(samples, side, cfg, mean=None):
    """The library's layer data; the keys' also carry the values and outputs (``out``)."""
    data = _orig_layer_data(samples, side, cfg, mean)
    if side == "k" and data.loss == "served":
        data.key_mode = MODE
        if MODE == "out":
            data.vals, data.outs, data.den = _values_and_outputs(samples, cfg)
    return data


def numerators(r, data, idx, cfg):
    """The library's numerators, the keys' served loss as ``KEY_LOSS`` says."""
    mode = getattr(data, "key_mode", None)
    if mode is None:
        return _orig_num(r, data, idx, cfg)
    e = refine_loss.rotated_errors(r, data, idx, cfg)
    s = (data.queries[idx] @ r) @ e.transpose(-1, -2)  # [b, H, g m, n] score errors
    w = data.metric[idx]
    ws = w * s
    if mode == "var":
        num = (ws * s).sum(dim=(-1, -2)) - ws.sum(dim=-1).square().sum(dim=-1)
    elif mode.startswith("iso:"):
        lam = float(mode[4:])
        qn = data.queries[idx].square().sum(dim=-1) / e.shape[-1]  # [b, H, g m]
        iso = ((w * qn[..., None]) * e.square().sum(dim=-1)[..., None, :]).sum(dim=(-1, -2))
        num = (1.0 - lam) * (ws * s).sum(dim=(-1, -2)) + lam * iso
    elif mode == "out":
        dout = ws @ data.vals[idx] - ws.sum(dim=-1, keepdim=True) * data.outs[idx]  # [b, H, g m, d]
        num = dout.square().sum(dim=(-1, -2))
    else:
        raise SystemExit(f"KEY_LOSS must be var, out or iso:L, got {mode!r}")
    return num.sum(dim=0).to(torch.float64)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] not in (["calibrate"], ["fit"]):
        sys.exit("usage: KEY_LOSS=var|out|iso:L python tools/exp_key_loss.py calibrate|fit [rotationzoo options]")
    print(f"key loss: {MODE}", file=sys.stderr)
    refine.layer_data = layer_data
    refine.numerators = numerators
    refine_loss.numerators = numerators
    from rotationzoo.cli.main import main
    sys.exit(main(argv))
