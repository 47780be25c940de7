"""Streaming fp64 accumulators for the OSCAR covariance targets.

The targets, exactly as the authors' fitter (``rotation/compute_kv_rotation.py``) defines them.
``T`` tokens per layer, ``q [T, H_q, d]``, ``k, v [T, H_kv, d]``, ``g = H_q / H_kv``; KV head ``h``
owns query heads ``h·g … (h+1)·g − 1``::

    ktk:  C = K_flatᵀ K_flat / (T·H_kv)                      K_flat = k.reshape(-1, d)
    vtv:  C = V_flatᵀ V_flat / (T·H_kv)
    qqt:  C = (1/H_kv) Σ_h A_h                               A_h = Q_hᵀ Q_h / (T·g)
    sst:  w_{t,h} = k_{t,h}ᵀ A_h k_{t,h}
          w_h     = w_h / max(Σ_t w_{t,h}, 1e-12) · T        (each head normalised to mean 1)
          C_h     = (v_h·√w_h)ᵀ (v_h·√w_h) / T
          C       = (1/H_kv) Σ_h C_h

``sst`` needs the final ``A_h`` before any weight can be computed, so a layer is read in two
passes: pass 1 reads Q (and K / V for ``ktk`` / ``vtv``) and accumulates the per-group query
Gram matrices; pass 2 reads K and V, computes the weights and accumulates ``Σ_t w_t v_t v_tᵀ`` and
``Σ_t w_t``. The normalisation by ``T / max(Σ w, 1e-12)`` is applied at the end (it is a per-head
scalar, so this equals the authors' per-token form). Every file is therefore read once, and only
one chunk of activations (converted into a reusable fp64 workspace) is held per layer at a time.

All sums are fp64 (bf16/fp16/fp32 inputs convert exactly); results agree with the authors'
load-everything implementation to rounding (~1e-15 relative).

Per KV head (``covariance(target, per_head=True)``) the targets are not averaged: ``A_h``, ``C_h``,
and ``K_hᵀK_h / T`` / ``V_hᵀV_h / T`` (those Grams accumulated per head: ``per_head=True``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from ..errors import FitError

#: The covariance targets.
TARGETS: tuple[str, ...] = ("qqt", "sst", "ktk", "vtv")
#: Which side (K or V file) each target fits.
TARGET_SIDE: dict[str, str] = {"qqt": "k", "ktk": "k", "sst": "v", "vtv": "v"}

#: Largest fp64 slice of a chunk converted at once (per worker): 16 MiB.
DEFAULT_BLOCK_BYTES = 16 * 2**20

#: ``progress(layer_id, done, total)``: called after each chunk read (done counts chunk reads of
#: every pass of that layer).
ProgressFn = Callable[[int, int, int], None]


class Workspace:
    """Grow-only fp64 scratch buffers, reused across chunks and layers (one per worker thread).

    Re-using buffers avoids the page-fault cost of fresh allocations, which on CPU costs more
    than the bf16→fp64 conversion itself.

    Args:
        device: where the buffers live.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A contiguous tensor of ``shape`` backed by the named buffer (contents undefined)."""
        numel = 1
        for s in shape:
            numel *= int(s)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=self.device)
            self._bufs[name] = buf
        return buf[:numel].view(*shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


class LayerAccumulator:
    """fp64 sufficient statistics of one layer for the requested targets.

    Feed pass 1 with :meth:`add_q` / :meth:`add_k` / :meth:`add_v`, then (only when ``"sst"`` is
    among the targets) call :meth:`start_second_pass` and feed the same chunks to :meth:`add_kv`.
    :meth:`covariance` returns the finished target.

    Args:
        layer_id: model layer index (for messages).
        num_q_heads: ``H_q`` (may be ``None`` when neither ``qqt`` nor ``sst`` is requested).
        num_kv_heads: ``H_kv``.
        head_dim: ``d``.
        targets: subset of :data:`TARGETS`.
        device: where accumulation runs (``"cpu"`` or a CUDA device; fp64 throughout).
        workspace: scratch buffers to reuse (a private one by default).
        block_bytes: chunks are converted to fp64 in token slices of at most this many bytes,
            which bounds the workspace independently of the chunk size.
        per_head: accumulate the ktk / vtv Grams per KV head (``[H_kv, d, d]``), not over all
            heads together (qqt and sst are always kept per head).
    """

    def __init__(
        self,
        layer_id: int,
        *,
        num_q_heads: int | None,
        num_kv_heads: int,
        head_dim: int,
        targets: Iterable[str],
        device: torch.device | str = "cpu",
        workspace: Workspace | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        per_head: bool = False,
    ) -> None:
        self.layer_id = int(layer_id)
        self.block_bytes = int(block_bytes)
        self.targets = tuple(dict.fromkeys(targets))
        bad = [t for t in self.targets if t not in TARGETS]
        if bad:
            raise FitError(f"unknown target(s) {bad}; expected some of {', '.join(TARGETS)}")
        self.needs_q = "qqt" in self.targets or "sst" in self.targets
        if self.needs_q and not num_q_heads:
            raise FitError(f"layer {layer_id}: targets {self.targets} need the number of query heads")
        if self.needs_q and num_q_heads % num_kv_heads:  # type: ignore[operator]
            raise FitError(f"layer {layer_id}: {num_q_heads} query heads is not a multiple of {num_kv_heads} KV heads")
        self.num_q_heads = num_q_heads
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.group = (num_q_heads // num_kv_heads) if num_q_heads else None
        self.device = torch.device(device)
        self.ws = workspace if workspace is not None else Workspace(self.device)
        d, hkv = self.head_dim, self.num_kv_heads
        self.tokens: dict[str, int] = {"q": 0, "k": 0, "v": 0}
        self.tokens_second_pass = 0

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=self.device)

        self.per_head = bool(per_head)
        self_shape = (hkv, d, d) if self.per_head else (d, d)
        self.qgram = zeros(hkv, d, d) if self.needs_q else None  # Σ Q_hᵀQ_h per group
        self.kgram = zeros(*self_shape) if "ktk" in self.targets else None  # Σ K_flatᵀK_flat (or per head)
        self.vgram = zeros(*self_shape) if "vtv" in self.targets else None
        self.wsum = zeros(hkv) if "sst" in self.targets else None  # Σ_t w_{t,h}
        self.vwgram = zeros(hkv, d, d) if "sst" in self.targets else None  # Σ_t w v vᵀ
        # first moments, for centering: Σ_t k_t, Σ_t v_t per KV head wherever keys / values are read
        # (pass 1 for ktk / vtv, else pass 2 for sst), and Σ_t w_t v_t for the centered sst target
        self.ksum, self.vsum = zeros(hkv, d), zeros(hkv, d)
        self.wvsum = zeros(hkv, d) if "sst" in self.targets else None
        self._a: torch.Tensor | None = None

    # -- helpers ----------------------------------------------------------------------------------
    @property
    def needs_second_pass(self) -> bool:
        """Whether ``sst`` is requested (K and V must be read again after pass 1)."""
        return "sst" in self.targets

    @property
    def pass1_kinds(self) -> tuple[str, ...]:
        """Kinds read in pass 1: ``q`` for qqt/sst, ``k`` for ktk, ``v`` for vtv."""
        return pass1_kinds(self.targets)

    @property
    def num_tokens(self) -> int:
        """``T``: tokens seen in pass 1 (all kinds read in pass 1 must agree)."""
        counts = {self.tokens[k] for k in self.pass1_kinds}
        if len(counts) > 1:
            raise FitError(f"layer {self.layer_id}: token counts differ between kinds: {self.tokens}")
        return counts.pop() if counts else 0

    def _check(self, x: torch.Tensor, heads: int | None, kind: str) -> int:
        if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != self.head_dim:
            raise FitError(
                f"layer {self.layer_id}: {kind} chunk has shape {tuple(x.shape)}, expected [n, {heads}, {self.head_dim}]"
            )
        if not x.is_floating_point():
            raise FitError(f"layer {self.layer_id}: {kind} chunk has dtype {x.dtype}, expected floating point")
        return int(x.shape[0])

    def _grams_into(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        """``acc[h] += x[h]ᵀ x[h]`` for ``x [B, N, d]``, upper block triangle only.

        The Gram is symmetric, so only the column-block panels ``x_iᵀ x[:, i·w:]`` are computed
        (``(b+1)/(2b)`` of the FLOPs for ``b`` blocks); :func:`_mirror_blocks` fills in the rest.
        """
        w = _block_width(self.head_dim)
        for h in range(x.shape[0]):
            xh = x[h]
            for i in range(0, self.head_dim, w):
                acc[h, i:i + w, i:].addmm_(xh[:, i:i + w].T, xh[:, i:])

    def _slices(self, n: int, row_bytes: int) -> Iterable[slice]:
        """Token slices of a chunk, each converting to at most ``block_bytes`` of fp64."""
        step = max(16, self.block_bytes // max(1, row_bytes))
        return (slice(s, min(n, s + step)) for s in range(0, n, step))

    # -- pass 1 -----------------------------------------------------------------------------------
    def add_q(self, q: torch.Tensor) -> None:
        """Accumulate a query chunk ``q [n, H_q, d]`` (any float dtype) into the per-group Grams."""
        if self.qgram is None:
            return
        n = self._check(q, self.num_q_heads, "q")
        hkv, g, d = self.num_kv_heads, self.group, self.head_dim
        for sl in self._slices(n, hkv * g * d * 8):  # type: ignore[operator]
            m = sl.stop - sl.start
            buf = self.ws.get("q", (hkv, m, g, d))  # type: ignore[arg-type]
            # convert and regroup in one copy: buf[h, t, j] = q[t, h·g + j]
            buf.copy_(q[sl].to(self.device, non_blocking=True).reshape(m, hkv, g, d).permute(1, 0, 2, 3))  # type: ignore[arg-type]
            self._grams_into(self.qgram, buf.view(hkv, m * g, d))
        self.tokens["q"] += n

    def _add_flat(self, x: torch.Tensor, gram: torch.Tensor, name: str) -> None:
        n, heads, d = x.shape
        total = self.ksum if name == "k" else self.vsum
        for sl in self._slices(n, heads * d * 8):
            m = sl.stop - sl.start
            if self.per_head:  # buf[h, t] = x[t, h]
                buf = self.ws.get(name, (heads, m, d))
                buf.copy_(x[sl].to(self.device, non_blocking=True).permute(1, 0, 2))
                self._grams_into(gram, buf)
                total.add_(buf.sum(dim=1))
                continue
            buf = self.ws.get(name, (1, m * heads, d))
            buf.copy_(x[sl].to(self.device, non_blocking=True).reshape(1, m * heads, d))
            self._grams_into(gram.unsqueeze(0), buf)
            total.add_(buf.view(m, heads, d).sum(dim=0))

    def add_k(self, k: torch.Tensor) -> None:
        """Accumulate a key chunk ``k [n, H_kv, d]`` for ``ktk``."""
        n = self._check(k, self.num_kv_heads, "k")
        if self.kgram is not None:
            self._add_flat(k, self.kgram, "k")
        self.tokens["k"] += n

    def add_v(self, v: torch.Tensor) -> None:
        """Accumulate a value chunk ``v [n, H_kv, d]`` for ``vtv``."""
        n = self._check(v, self.num_kv_heads, "v")
        if self.vgram is not None:
            self._add_flat(v, self.vgram, "v")
        self.tokens["v"] += n

    # -- pass 2 (sst) -----------------------------------------------------------------------------
    def query_covariances(self) -> torch.Tensor:
        """``A_h = Q_hᵀQ_h / (T·g)`` for every KV group, fp64 ``[H_kv, d, d]``."""
        if self.qgram is None:
            raise FitError(f"layer {self.layer_id}: no query statistics were requested")
        t = self.tokens["q"]
        if t == 0:
            raise FitError(f"layer {self.layer_id}: no query tokens were accumulated")
        return _mirror_blocks(self.qgram) / (t * self.group)  # type: ignore[operator]

    def start_second_pass(self) -> None:
        """Freeze the per-group query covariances ``A_h`` used by :meth:`add_kv`."""
        if not self.needs_second_pass:
            return
        self._a = self.query_covariances()

    def add_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Pass 2 for ``sst``: weights ``w_{t,h} = k_{t,h}ᵀ A_h k_{t,h}``; accumulate ``Σ w``, ``Σ w v vᵀ``.

        Args:
            k: ``[n, H_kv, d]`` keys of a chunk already seen in pass 1.
            v: ``[n, H_kv, d]`` values of the same chunk.
        """
        if not self.needs_second_pass:
            return
        if self._a is None:
            raise FitError(f"layer {self.layer_id}: call start_second_pass() after pass 1, before add_kv()")
        n = self._check(k, self.num_kv_heads, "k")
        if self._check(v, self.num_kv_heads, "v") != n:
            raise FitError(f"layer {self.layer_id}: k has {n} tokens but v has {v.shape[0]}")
        hkv, d = self.num_kv_heads, self.head_dim
        for sl in self._slices(n, hkv * d * 8 * 3):
            m = sl.stop - sl.start
            kb = self.ws.get("k2", (hkv, m, d))
            kb.copy_(k[sl].to(self.device, non_blocking=True).permute(1, 0, 2))
            vb = self.ws.get("v2", (hkv, m, d))
            vb.copy_(v[sl].to(self.device, non_blocking=True).permute(1, 0, 2))
            ka = self.ws.get("ka", (hkv, m, d))
            torch.bmm(kb, self._a, out=ka)  # k_t A_h
            ka.mul_(kb)
            w = ka.sum(dim=-1)  # [H_kv, n]: k_tᵀ A_h k_t  (≥ 0 up to rounding)
            self.wsum += w.sum(dim=-1)  # type: ignore[operator]
            if self.kgram is None:  # keys not read in pass 1: their sum comes from here
                self.ksum.add_(kb.sum(dim=1))
            if self.vgram is None:
                self.vsum.add_(vb.sum(dim=1))
            # √w of a PSD form; clamp the rare −1e-17 rounding to 0 instead of producing NaN
            w.clamp_(min=0)
            self.wvsum.add_(torch.bmm(w.unsqueeze(1), vb).squeeze(1))  # type: ignore[union-attr]  # Σ w v
            vb.mul_(w.sqrt_().unsqueeze(-1))
            self._grams_into(self.vwgram, vb)  # type: ignore[arg-type]
        self.tokens_second_pass += n

    def finite(self, kind: str) -> bool:
        """Whether the statistics fed by ``kind`` (``"q"``, ``"k"``, ``"v"``, or ``"kv"`` for pass 2) are
        still finite. Costs O(H·d): a NaN or Inf in any input reaches the trace of its Gram (x² on the
        diagonal), and stays there, so checking after every chunk names the first bad one."""
        gram = {"q": self.qgram, "k": self.kgram, "v": self.vgram, "kv": self.vwgram}[kind]
        if gram is None:
            return True
        total = torch.diagonal(gram, dim1=-2, dim2=-1).sum()
        if kind == "kv":
            total = total + self.wsum.sum()  # type: ignore[union-attr]
        return bool(torch.isfinite(total))

    # -- results ----------------------------------------------------------------------------------
    def covariance(self, target: str, *, per_head: bool = False, mean: torch.Tensor | None = None) -> torch.Tensor:
        """The finished target, fp64 ``[d, d]``, or ``[H_kv, d, d]`` (one per KV head) with
        ``per_head`` (not yet symmetrised).

        ``mean`` (``sst`` only; ``[H_kv, d]`` or ``[d]``) gives the target of the centered values
        ``v − μ`` that a value-centered file stores: ``Σ w (v−μ)(v−μ)ᵀ / Σ w``.

        Raises:
            FitError: the target was not requested, no tokens were seen, pass 2 saw a different
                number of tokens than pass 1, or ktk / vtv per head were not accumulated per head.
        """
        if target not in self.targets:
            raise FitError(f"layer {self.layer_id}: target {target!r} was not accumulated (have {self.targets})")
        if mean is not None and target != "sst":
            raise FitError(f"layer {self.layer_id}: only the sst target has a centered form, not {target!r}")
        t = self.num_tokens
        if t == 0:
            raise FitError(f"layer {self.layer_id}: no tokens were accumulated")
        if target == "qqt":
            a = self.query_covariances()
            return a if per_head else a.mean(dim=0)
        if target in ("ktk", "vtv"):
            return self._self_covariance(target, per_head)
        # sst
        if self.tokens_second_pass != self.tokens["q"]:
            raise FitError(
                f"layer {self.layer_id}: sst pass 2 saw {self.tokens_second_pass} tokens but pass 1 saw "
                f"{self.tokens['q']} (k/v and q chunks do not match)"
            )
        tq = float(self.tokens["q"])
        scale = tq / self.wsum.clamp(min=1e-12)  # type: ignore[union-attr]  # w ← w·T/max(Σw, 1e-12)
        heads = _mirror_blocks(self.vwgram) * scale.view(-1, 1, 1) / tq  # type: ignore[arg-type]
        if mean is not None:  # Σw(v−μ)(v−μ)ᵀ/Σw = C − (m μᵀ + μ mᵀ) + μμᵀ, m = Σ w v / Σ w
            mu = mean.to(heads).expand(self.num_kv_heads, self.head_dim)
            assert self.wvsum is not None and self.wsum is not None
            m = self.wvsum / self.wsum.clamp(min=1e-12).view(-1, 1)
            cross = m[:, :, None] * mu[:, None, :]
            heads = heads - cross - cross.transpose(-1, -2) + mu[:, :, None] * mu[:, None, :]
        return heads if per_head else heads.mean(dim=0)

    def mean(self, kind: str) -> torch.Tensor:
        """``μ_h``, the mean key (``kind="k"``) or value (``"v"``) of every KV head, fp64 ``[H_kv, d]``.

        Raises:
            FitError: the keys / values were not read (``qqt`` alone reads no keys, ``ktk`` no values).
        """
        read_pass1 = (self.kgram if kind == "k" else self.vgram) is not None
        count = self.tokens[kind] if read_pass1 else (self.tokens_second_pass if self.needs_second_pass else 0)
        if count == 0:
            what = "keys" if kind == "k" else "values"
            raise FitError(f"layer {self.layer_id}: no {what} were read for targets {self.targets}; centering needs "
                           "them (use the qqt_sst / oscar2 objectives)")
        return (self.ksum if kind == "k" else self.vsum) / count

    def _self_covariance(self, target: str, per_head: bool) -> torch.Tensor:
        """ktk / vtv: ``X_flatᵀX_flat / (T·H_kv)``, or ``X_hᵀX_h / T`` per head."""
        gram, t = (self.kgram, self.tokens["k"]) if target == "ktk" else (self.vgram, self.tokens["v"])
        assert gram is not None
        if not self.per_head:
            if per_head:
                raise FitError(f"layer {self.layer_id}: {target} was accumulated over all KV heads together; "
                               f"per-head rotations need it per head (LayerAccumulator(per_head=True))")
            return _mirror_blocks(gram) / (t * self.num_kv_heads)
        c = _mirror_blocks(gram) / t
        return c if per_head else c.mean(dim=0)


def _block_width(d: int) -> int:
    """Column-block width of the symmetric Gram (4 blocks when d allows, else the whole matrix)."""
    return d // _GRAM_BLOCKS if d % _GRAM_BLOCKS == 0 and d >= 8 * _GRAM_BLOCKS else d


def _mirror_blocks(acc: torch.Tensor) -> torch.Tensor:
    """Full Gram from one accumulated by :meth:`LayerAccumulator._grams_into` (``[..., d, d]``).

    Blocks below the block diagonal are taken from the transposed blocks above it; the
    diagonal blocks are kept as computed (the final target is symmetrised anyway, as the
    authors do).
    """
    d = acc.shape[-1]
    w = _block_width(d)
    out = acc.clone()
    for i in range(0, d, w):
        for j in range(0, i, w):
            out[..., i:i + w, j:j + w] = acc[..., j:j + w, i:i + w].transpose(-1, -2)
    return out


#: Number of column blocks of the symmetric Gram.
_GRAM_BLOCKS = 4


def pass1_kinds(targets: Iterable[str]) -> tuple[str, ...]:
    """Kinds read in pass 1 for ``targets``: ``q`` for qqt/sst, ``k`` for ktk, ``v`` for vtv."""
    t = set(targets)
    return tuple(kind for kind, need in (("q", bool(t & {"qqt", "sst"})), ("k", "ktk" in t), ("v", "vtv" in t)) if need)


def kinds_for(targets: Iterable[str]) -> tuple[str, ...]:
    """The dump kinds a fit of ``targets`` depends on: ``q`` for qqt/sst, ``k`` for ktk/sst and for
    ``H_kv`` of qqt (whose keys are not read), ``v`` for vtv/sst."""
    t = set(targets)
    need = {"q": bool(t & {"qqt", "sst"}), "k": bool(t & {"ktk", "sst", "qqt"}), "v": bool(t & {"vtv", "sst"})}
    return tuple(kind for kind in ("q", "k", "v") if need[kind])


def statistics_bytes(num_kv_heads: int, head_dim: int, targets: Iterable[str], *, per_head: bool = False) -> int:
    """fp64 bytes one layer's fit keeps: its :class:`LayerAccumulator` Grams and its finished covariances.

    Per layer: ``H_kv·d²`` values for the query Grams (qqt, sst) and again for the sst sums; ``d²``
    (``H_kv·d²`` per head) for each of ktk and vtv; and one covariance per target (``H_kv`` of them
    per head), 8 bytes each.
    """
    t = set(targets)
    per_target = num_kv_heads if per_head else 1
    mats = num_kv_heads * (bool(t & {"qqt", "sst"}) + ("sst" in t)) + per_target * (("ktk" in t) + ("vtv" in t))
    return (mats + per_target * len(t)) * head_dim * head_dim * 8
