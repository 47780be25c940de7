"""Experiment: ``rotationzoo calibrate`` with the values' served refinement loss weighted by the output projection.

The library's served loss for V (:mod:`rotationzoo.fit.refine_loss`) measures the error that the far INT2
values add to the drawn queries' attention outputs in the head's value space, ``||A_j E||^2`` per query head
``j``. The model reads that output through ``o_proj``: head ``j``'s share of the hidden state is ``A_j E R^T W_j``
(``W_j`` the head's ``d x hidden`` slice of ``o_proj``'s transpose), so this run measures
``tr((A_j E) R^T G_j R (A_j E)^T)`` with ``G_j = W_j W_j^T`` (each layer's Grams scaled to mean trace 1)
instead. Everything else is the command line's ``rotationzoo`` command, run in-process with the loss patched;
nothing is written to the library. docs/real-model.md reports the run (a null result)::

    python tools/exp_value_loss.py calibrate --model SmolLM2-135M-Instruct.Q4_1.gguf --text emma.txt \
        --tokens 20000 --seq-len 8192 --refine 100 --init oscar --grouping kv_head --center k -g 64 \
        --scale-dtype bfloat16 --seed 2 --sample-tokens 20480 --keep-text mansfieldpark.txt --out vloss/
"""
import sys

import torch

from rotationzoo.fit import refine, refine_loss
from rotationzoo.integrations.transformers.loading import load_model

GRAMS: dict[int, torch.Tensor] = {}
_orig_layer_data = refine_loss.layer_data
_orig_num = refine_loss.numerators


def _grams(model_path: str) -> None:
    """``GRAMS[layer]``: ``G_j = W_j W_j^T`` of each query head, ``[H_kv, g, d, d]`` (the KV heads' query groups)."""
    model, _ = load_model(model_path)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq if getattr(cfg, "head_dim", None) is None else cfg.head_dim
    g = hq // hkv
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().to(torch.float64)  # [hidden, hq*d]
        gr = torch.stack([w[:, j * d:(j + 1) * d].T @ w[:, j * d:(j + 1) * d] for j in range(hq)])  # [hq, d, d]
        gr = gr / gr.diagonal(dim1=-2, dim2=-1).sum(-1).mean()  # scale-free: mean trace 1
        GRAMS[i] = gr.reshape(hkv, g, d, d).to(torch.float32)
    del model


def layer_data(samples, side, cfg, mean=None):
    """The library's layer data, the values' carrying their layer's output-projection Grams."""
    data = _orig_layer_data(samples, side, cfg, mean)
    if side == "v" and data.loss == "served":
        data.vgram = GRAMS[samples.layer_id]
    return data


def numerators(r, data, idx, cfg):
    """The library's numerators, the values' served loss measured through the output projection."""
    gram = getattr(data, "vgram", None)
    if gram is None:
        return _orig_num(r, data, idx, cfg)
    y = data.metric[idx] @ refine_loss.rotated_errors(r, data, idx, cfg)  # [b, H, g*m, d]
    b, h, gm, d = y.shape
    g = gram.shape[1]
    y = y.reshape(b, h, g, gm // g, d)
    rr = r[:, None]  # [P, 1, d, d]
    m = rr.transpose(-1, -2) @ gram @ rr  # [H, g, d, d] in the rotated basis
    num = ((y @ m[None]) * y).sum(dim=(-1, -2, -3))
    return num.sum(dim=0).to(torch.float64)


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--model" not in argv or argv[:1] != ["calibrate"]:
        sys.exit("usage: python tools/exp_value_loss.py calibrate --model MODEL [rotationzoo calibrate options]")
    _grams(argv[argv.index("--model") + 1])
    refine.layer_data = layer_data
    refine.numerators = numerators
    refine_loss.numerators = numerators
    from rotationzoo.cli.main import main
    sys.exit(main(argv))
