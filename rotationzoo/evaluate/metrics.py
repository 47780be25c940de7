"""Per-token metrics of one forward against the unquantized model, computed in chunks.

A forward is run through the model's decoder only (hidden states after the final norm, ``[T,
hidden]``: small); logits are then made chunk by chunk with the output embedding, so the full
``[T, vocab]`` logits of a long window are never held: per chunk the unquantized model's
log-probabilities are computed once and compared with those of every method.

Per scored token: ``nll = −log p_method(target)``, ``kl = KL(p_fp ‖ p_method) = Σ p_fp (log p_fp −
log p_method)`` in nats, ``agree = [argmax p_method == argmax p_fp]``, ``correct = [argmax p_method
== target]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch

from ..integrations.transformers import OscarKV, oscar_kv

#: Target tokens per chunk of logits.
LOGIT_CHUNK = 1024


@dataclass
class TokenMetrics:
    """Per-token metrics of one forward (fp32 ``[n]`` each; ``kl``/``agree`` are 0/1 for the fp model)."""

    nll: torch.Tensor
    kl: torch.Tensor
    agree: torch.Tensor
    correct: torch.Tensor


def _decoder(model: Any) -> Any:
    get = getattr(model, "get_decoder", None)
    return get() if get is not None else model.model


def _logits(model: Any, h: torch.Tensor) -> torch.Tensor:
    out = model.get_output_embeddings()(h).float()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap:
        out = torch.tanh(out / cap) * cap
    return out


def hidden_states(model: Any, ids: Sequence[int], oscar: OscarKV | None = None, *,
                  collect_errors: bool = False) -> tuple[torch.Tensor, dict[Any, float]]:
    """Final hidden states ``[T, hidden]`` of one forward over ``ids`` (with ``oscar``'s INT2 KV if
    given) and, when ``collect_errors``, the attention-output errors per layer (``int`` keys) and per
    (layer, KV head) (``(layer, head)`` keys)."""
    device = next(model.parameters()).device
    x = torch.tensor([list(ids)], device=device)
    ctx = oscar_kv(model, oscar, collect_errors=collect_errors) if oscar is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx as session:
        h = _decoder(model)(input_ids=x, use_cache=False).last_hidden_state[0]
        errors: dict[Any, float] = ({**session.layer_errors(), **session.head_errors()}
                                    if session is not None and collect_errors else {})
    return h, errors


def _chunks(first: int, end: int, size: int) -> Iterator[tuple[int, int]]:
    for a in range(first, end, size):
        yield a, min(end, a + size)


def compare(model: Any, ids: Sequence[int], first: int, h_fp: torch.Tensor,
            others: Mapping[Any, torch.Tensor], *, chunk: int = LOGIT_CHUNK) -> tuple[TokenMetrics, dict[Any, TokenMetrics]]:
    """Metrics of the targets ``ids[first:]`` (predicted from positions ``first − 1 …``) for the fp
    hidden states and for each of ``others`` (same window), making each chunk's fp logits once."""
    device = h_fp.device
    targets = torch.tensor(list(ids), device=device)
    parts: dict[Any, list[TokenMetrics]] = {k: [] for k in others}
    fp_parts: list[TokenMetrics] = []
    with torch.no_grad():
        for a, b in _chunks(first, len(ids), chunk):
            tgt = targets[a:b]
            lp_fp = torch.log_softmax(_logits(model, h_fp[a - 1:b - 1]), dim=-1)
            top_fp = lp_fp.argmax(-1)
            fp_parts.append(TokenMetrics(-lp_fp.gather(1, tgt[:, None])[:, 0], torch.zeros(b - a, device=device),
                                         torch.ones(b - a, device=device), (top_fp == tgt).float()))
            p_fp = lp_fp.exp()
            for key, h in others.items():
                lp = torch.log_softmax(_logits(model, h[a - 1:b - 1]), dim=-1)
                top = lp.argmax(-1)
                kl = (p_fp * (lp_fp - lp)).sum(-1).clamp_min(0.0)
                parts[key].append(TokenMetrics(-lp.gather(1, tgt[:, None])[:, 0], kl, (top == top_fp).float(),
                                               (top == tgt).float()))
                del lp
    return _cat(fp_parts), {k: _cat(v) for k, v in parts.items()}


def _cat(parts: list[TokenMetrics]) -> TokenMetrics:
    return TokenMetrics(*(torch.cat([getattr(p, f) for p in parts]).float().cpu()
                          for f in ("nll", "kl", "agree", "correct")))
