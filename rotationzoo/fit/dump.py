"""Q/K/V dumps in the SGLang layout: a safe streaming reader and a writer.

Layout (what the OSCAR dump hook writes, one folder per attention layer)::

    <dump>/layer_<L>/q/<chunk>.pt          # [n, H_q, d]   post-RoPE queries (model dtype, e.g. bf16)
    <dump>/layer_<L>/k/<chunk>.pt          # [n, H_kv, d]  post-RoPE keys
    <dump>/layer_<L>/v/<chunk>.pt          # [n, H_kv, d]  values
    <dump>/layer_<L>/seq_lens/<chunk>.pt   # int32 [num_seqs], tokens per sequence in that chunk
    <dump>/rotationzoo_dump.json           # optional: written by rotationzoo (model, prompts, tokens)

``<chunk>`` is a per-layer counter 0, 1, 2, ... (one extend batch each). Chunk 0 of an SGLang dump
is the server's warm-up request, so readers skip it unless asked to keep it, exactly as the
authors' fitter does. Layer ids may be sparse (hybrid models dump only their full-attention
layers). Every file is read with ``torch.load(weights_only=True)`` (memory-mapped when the file
is a zip archive), so a dump can never run code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..errors import DumpError

#: Tensor kinds of a dump, in the order they are written.
KINDS: tuple[str, ...] = ("q", "k", "v")
#: Optional metadata file at the dump root (not part of the SGLang layout; ignored by other readers).
DUMP_INFO_NAME = "rotationzoo_dump.json"

_LAYER_RE = re.compile(r"^layer_(\d+)$")
_CHUNK_RE = re.compile(r"^(\d+)\.pt$")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def load_dump_file(path: Path) -> Any:
    """Load one dump file safely (``weights_only=True``; memory-mapped for zip archives).

    Raises:
        DumpError: unreadable, damaged, or a pickle that asks for anything but tensors/plain data.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise DumpError(f"{path}: cannot open ({_first_line(exc)})") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=magic == b"PK\x03\x04")
    except pickle.UnpicklingError as exc:
        raise DumpError(
            f"{path}: refused to load: the pickle asks for objects other than tensors and plain data "
            f"({_first_line(exc)})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise DumpError(f"{path}: cannot read ({_first_line(exc)}); the file is truncated or damaged") from None


@dataclass(frozen=True)
class DumpShape:
    """Head layout shared by every layer of a dump.

    Attributes:
        num_q_heads: ``H_q`` (``None`` when the dump has no queries).
        num_kv_heads: ``H_kv``.
        head_dim: ``d``.
        dtype: dtype name of the stored activations, e.g. ``"bfloat16"``.
    """

    num_q_heads: int | None
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def group_size(self) -> int | None:
        """Query heads per KV head, ``g = H_q // H_kv``."""
        return None if self.num_q_heads is None else self.num_q_heads // self.num_kv_heads


class Dump:
    """A Q/K/V dump folder, read lazily one chunk at a time.

    Args:
        root: the dump folder (the one holding ``layer_<L>/``).
        keep_first_chunk: also use chunk 0 (the SGLang warm-up batch; skipped by default, as the
            authors' fitter does).
        layers: only these layer ids (default: every ``layer_<L>`` folder).

    Raises:
        DumpError: the folder does not exist, holds no ``layer_<L>`` folders, or lacks a requested layer.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_first_chunk: bool = False,
        layers: Iterable[int] | None = None,
    ) -> None:
        self.root = Path(root)
        self.keep_first_chunk = bool(keep_first_chunk)
        if not self.root.exists():
            raise DumpError(f"dump directory {self.root} does not exist")
        if not self.root.is_dir():
            raise DumpError(f"{self.root} is not a directory; expected a dump folder with layer_<L>/ subfolders")
        found: dict[int, Path] = {}
        for child in self.root.iterdir():
            m = _LAYER_RE.match(child.name)
            if m and child.is_dir():
                found[int(m.group(1))] = child
        if not found:
            raise DumpError(
                f"{self.root}: no layer_<L>/ folders; not a Q/K/V dump "
                f"(expected layer_<L>/{{q,k,v,seq_lens}}/<chunk>.pt)"
            )
        if layers is not None:
            wanted = sorted({int(i) for i in layers})
            missing = [i for i in wanted if i not in found]
            if missing:
                raise DumpError(
                    f"{self.root}: no layer(s) {', '.join(map(str, missing))} in the dump "
                    f"(it has {_fmt_ids(sorted(found))})"
                )
            found = {i: found[i] for i in wanted}
        self._layer_dirs = dict(sorted(found.items()))
        self.layer_ids: tuple[int, ...] = tuple(self._layer_dirs)
        self._chunk_cache: dict[tuple[int, str], tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return f"Dump({str(self.root)!r}, layers={_fmt_ids(list(self.layer_ids))}, keep_first_chunk={self.keep_first_chunk})"

    # -- structure --------------------------------------------------------------------------------
    def _all_chunks(self, layer_id: int, kind: str) -> tuple[int, ...]:
        key = (layer_id, kind)
        if key not in self._chunk_cache:
            folder = self._layer_dirs[layer_id] / kind
            if not folder.is_dir():
                raise DumpError(f"{folder}: missing; a dump layer needs q/, k/ and v/ folders")
            ids = []
            for f in folder.iterdir():
                m = _CHUNK_RE.match(f.name)
                if m:
                    ids.append(int(m.group(1)))
            self._chunk_cache[key] = tuple(sorted(ids))
        return self._chunk_cache[key]

    def chunk_ids(self, layer_id: int, kinds: Sequence[str] = KINDS) -> tuple[int, ...]:
        """Chunk ids of a layer that the fit uses (chunk 0 dropped unless ``keep_first_chunk``).

        Args:
            layer_id: a layer of the dump.
            kinds: the tensor kinds that must all be present for every chunk.

        Raises:
            DumpError: a kind folder is missing, the kinds have different chunks, or no chunk is left.
        """
        if layer_id not in self._layer_dirs:
            raise DumpError(f"{self.root}: no layer {layer_id} (it has {_fmt_ids(list(self.layer_ids))})")
        per_kind = {kind: self._all_chunks(layer_id, kind) for kind in kinds}
        first_kind = kinds[0]
        ref = per_kind[first_kind]
        for kind in kinds[1:]:
            if per_kind[kind] != ref:
                only_a = sorted(set(ref) - set(per_kind[kind]))
                only_b = sorted(set(per_kind[kind]) - set(ref))
                detail = []
                if only_a:
                    detail.append(f"{kind}/ lacks chunk(s) {_fmt_ids(only_a)}")
                if only_b:
                    detail.append(f"{first_kind}/ lacks chunk(s) {_fmt_ids(only_b)}")
                raise DumpError(
                    f"{self._layer_dirs[layer_id]}: {first_kind}/ and {kind}/ hold different chunks ({'; '.join(detail)})"
                )
        used = ref if self.keep_first_chunk else tuple(c for c in ref if c != 0)
        if not used:
            if ref:
                raise DumpError(
                    f"{self._layer_dirs[layer_id]}: empty layer: only the warm-up chunk 0 is present "
                    f"(pass keep_first_chunk=True / --keep-first-chunk to fit on it)"
                )
            raise DumpError(f"{self._layer_dirs[layer_id]}: empty layer: no <chunk>.pt files in {', '.join(kinds)}")
        return used

    def path(self, layer_id: int, kind: str, chunk_id: int) -> Path:
        """``<root>/layer_<L>/<kind>/<chunk>.pt``."""
        return self._layer_dirs[layer_id] / kind / f"{chunk_id}.pt"

    # -- reading ----------------------------------------------------------------------------------
    def load(self, layer_id: int, kind: str, chunk_id: int) -> torch.Tensor:
        """One activation chunk, ``[n, H, d]`` in its stored dtype (CPU, possibly memory-mapped).

        Raises:
            DumpError: unreadable file, not a tensor, not 3-D floating point.
        """
        p = self.path(layer_id, kind, chunk_id)
        t = load_dump_file(p)
        if not isinstance(t, torch.Tensor):
            raise DumpError(f"{p}: expected a tensor [n, heads, head_dim], got {type(t).__name__}")
        if t.dim() != 3:
            raise DumpError(f"{p}: expected a tensor [n, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise DumpError(f"{p}: expected floating point activations, got dtype {t.dtype}")
        return t

    def seq_lens(self, layer_id: int, chunk_id: int) -> list[int] | None:
        """Per-sequence token counts of a chunk, or ``None`` when the dump has no ``seq_lens/``."""
        p = self.path(layer_id, "seq_lens", chunk_id)
        if not p.is_file():
            return None
        obj = load_dump_file(p)
        if isinstance(obj, torch.Tensor):
            return [int(x) for x in obj.reshape(-1).tolist()]
        if isinstance(obj, (list, tuple)):
            return [int(x) for x in obj]
        raise DumpError(f"{p}: expected a tensor or list of sequence lengths, got {type(obj).__name__}")

    def prompt_count(self) -> int | None:
        """The authors' ``prompt<N>`` tag value: Σ ``len(seq_lens)`` over every chunk of the first layer.

        Counts (sequence, chunk) segments including the warm-up chunk, as the authors' dump script
        does; ``None`` when the dump has no ``seq_lens/``.
        """
        layer = self.layer_ids[0]
        folder = self._layer_dirs[layer] / "seq_lens"
        if not folder.is_dir():
            return None
        total = 0
        for chunk in self._all_chunks(layer, "seq_lens"):
            lens = self.seq_lens(layer, chunk)
            total += len(lens or [])
        return total

    def info(self) -> dict[str, Any]:
        """Contents of ``rotationzoo_dump.json`` when present (``{}`` otherwise)."""
        p = self.root / DUMP_INFO_NAME
        if not p.is_file():
            return {}
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DumpError(f"{p}: not valid JSON ({_first_line(exc)})") from None
        return data if isinstance(data, dict) else {}

    def shape(self, kinds: Sequence[str] = KINDS) -> DumpShape:
        """Head layout, checked to be the same in every layer (first used chunk of each layer).

        Args:
            kinds: which kinds to inspect; ``"k"`` or ``"v"`` is needed for ``H_kv``.

        Raises:
            DumpError: inconsistent head_dim or head counts between kinds or layers, or
                ``H_q`` not a multiple of ``H_kv``.
        """
        kinds = tuple(kinds)
        result: DumpShape | None = None
        where = ""
        for layer in self.layer_ids:
            chunk = self.chunk_ids(layer, kinds)[0]
            heads: dict[str, tuple[int, int, torch.dtype]] = {}
            for kind in kinds:
                t = self.load(layer, kind, chunk)
                heads[kind] = (int(t.shape[1]), int(t.shape[2]), t.dtype)
                del t
            dims = {kind: h[1] for kind, h in heads.items()}
            if len(set(dims.values())) != 1:
                detail = ", ".join(f"{k}: {d}" for k, d in dims.items())
                raise DumpError(f"{self._layer_dirs[layer]}: inconsistent head dims within chunk {chunk} ({detail})")
            kv = [heads[k][0] for k in ("k", "v") if k in heads]
            if len(set(kv)) > 1:
                raise DumpError(
                    f"{self._layer_dirs[layer]}: k has {heads['k'][0]} heads but v has {heads['v'][0]} (chunk {chunk})"
                )
            if not kv:
                raise DumpError("internal: shape() needs 'k' or 'v' among kinds")
            hq = heads["q"][0] if "q" in heads else None
            if hq is not None and hq % kv[0]:
                raise DumpError(
                    f"{self._layer_dirs[layer]}: {hq} query heads is not a multiple of {kv[0]} KV heads"
                )
            dtype = str(next(iter(heads.values()))[2]).replace("torch.", "")
            cur = DumpShape(num_q_heads=hq, num_kv_heads=kv[0], head_dim=next(iter(dims.values())), dtype=dtype)
            if result is None:
                result, where = cur, f"layer {layer}"
            elif (cur.num_q_heads, cur.num_kv_heads, cur.head_dim) != (
                result.num_q_heads,
                result.num_kv_heads,
                result.head_dim,
            ):
                raise DumpError(
                    f"{self.root}: inconsistent head dims between layers: {where} has "
                    f"{_fmt_shape(result)}, layer {layer} has {_fmt_shape(cur)}"
                )
        assert result is not None
        return result


def open_dump(
    root: str | os.PathLike[str], *, keep_first_chunk: bool = False, layers: Iterable[int] | None = None
) -> Dump:
    """Open a dump folder; see :class:`Dump`."""
    return Dump(root, keep_first_chunk=keep_first_chunk, layers=layers)


def _fmt_shape(s: DumpShape) -> str:
    q = f"H_q={s.num_q_heads}, " if s.num_q_heads is not None else ""
    return f"{q}H_kv={s.num_kv_heads}, head_dim={s.head_dim}"


def _fmt_ids(ids: Sequence[int]) -> str:
    ids = list(ids)
    return ", ".join(map(str, ids[:12])) + (" ..." if len(ids) > 12 else "")


# -- writing -------------------------------------------------------------------------------------


def _save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class DumpWriter:
    """Write activations in the SGLang dump layout, with the dump hook's per-layer token budget.

    Each :meth:`write` call appends one chunk per layer. Once a layer has saved ``token_budget``
    tokens further writes are dropped; the chunk that crosses the budget is truncated to fit
    exactly (its ``seq_lens`` are truncated too), as the dump hook does.

    Args:
        root: output folder (created). It must not already hold ``layer_<L>/`` folders unless
            ``overwrite`` (which deletes them first).
        token_budget: per-layer token limit, or ``None`` for no limit.
        kinds: the tensor kinds written (``("k", "v")`` for a key/value-only spill).
        overwrite: replace an existing dump in ``root``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token_budget: int | None = None,
        kinds: Sequence[str] = KINDS,
        overwrite: bool = False,
    ) -> None:
        self.root = Path(root)
        self.token_budget = None if token_budget is None else int(token_budget)
        self.kinds = tuple(kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise DumpError(f"unknown dump kinds {bad}; expected a subset of {KINDS}")
        if self.root.exists() and not self.root.is_dir():
            raise DumpError(f"{self.root} exists and is not a directory")
        existing = [c for c in self.root.iterdir() if _LAYER_RE.match(c.name)] if self.root.is_dir() else []
        if existing:
            if not overwrite:
                raise DumpError(f"{self.root} already holds a dump ({len(existing)} layer folders); choose an empty folder")
            for c in existing:
                shutil.rmtree(c)
            (self.root / DUMP_INFO_NAME).unlink(missing_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self._next_chunk: dict[int, int] = {}
        self._saved: dict[int, int] = {}

    def tokens_saved(self, layer_id: int) -> int:
        """Tokens written so far for a layer."""
        return self._saved.get(int(layer_id), 0)

    def chunks_written(self, layer_id: int) -> int:
        """Chunks written so far for a layer."""
        return self._next_chunk.get(int(layer_id), 0)

    def is_full(self, layer_id: int) -> bool:
        """Whether the layer reached its token budget."""
        return self.token_budget is not None and self.tokens_saved(layer_id) >= self.token_budget

    def write(
        self,
        layer_id: int,
        *,
        q: torch.Tensor | None = None,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
    ) -> int:
        """Append one chunk to a layer.

        Args:
            layer_id: model layer index.
            q: ``[n, H_q, d]`` (required when ``"q"`` is among the writer's kinds).
            k: ``[n, H_kv, d]``.
            v: ``[n, H_kv, d]``.
            seq_lens: tokens per sequence in this chunk (default ``[n]``).

        Returns:
            The number of tokens written (0 once the budget is exhausted).
        """
        layer_id = int(layer_id)
        tensors = {"q": q, "k": k, "v": v}
        sizes = set()
        for kind in self.kinds:
            t = tensors[kind]
            if t is None:
                raise DumpError(f"DumpWriter.write: layer {layer_id}: missing {kind!r}")
            if t.dim() != 3:
                raise DumpError(f"DumpWriter.write: layer {layer_id}: {kind} must be [n, heads, d], got {tuple(t.shape)}")
            sizes.add(int(t.shape[0]))
        if len(sizes) != 1:
            raise DumpError(f"DumpWriter.write: layer {layer_id}: token counts differ between kinds ({sorted(sizes)})")
        n = sizes.pop()
        lens = [n] if seq_lens is None else [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
        if sum(lens) != n:
            raise DumpError(f"DumpWriter.write: layer {layer_id}: seq_lens sum to {sum(lens)}, but the chunk has {n} tokens")
        if self.token_budget is not None:
            remaining = self.token_budget - self.tokens_saved(layer_id)
            if remaining <= 0:
                return 0
            if n > remaining:
                n = remaining
                kept, acc = [], 0
                for length in lens:
                    take = min(length, n - acc)
                    if take <= 0:
                        break
                    kept.append(take)
                    acc += take
                lens = kept
        if n == 0:
            return 0
        chunk = self._next_chunk.get(layer_id, 0)
        base = self.root / f"layer_{layer_id}"
        for kind in self.kinds:
            t = tensors[kind]
            assert t is not None
            _save_atomic(t[:n].detach().to("cpu").contiguous().clone(), base / kind / f"{chunk}.pt")
        _save_atomic(torch.tensor(lens, dtype=torch.int32), base / "seq_lens" / f"{chunk}.pt")
        self._next_chunk[layer_id] = chunk + 1
        self._saved[layer_id] = self.tokens_saved(layer_id) + n
        return n

    def write_info(self, info: Mapping[str, Any]) -> Path:
        """Write ``rotationzoo_dump.json`` (model, prompts, tokens, ...) at the dump root."""
        p = self.root / DUMP_INFO_NAME
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=self.root)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(dict(info), f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, p)
        return p


def write_dump(
    root: str | os.PathLike[str],
    layers: Mapping[int, Sequence[Mapping[str, Any]]],
    *,
    token_budget: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a whole dump from memory (tests, benchmarks).

    Args:
        root: output folder.
        layers: ``{layer_id: [{"q": q, "k": k, "v": v, "seq_lens": [...]}, ...]}``, one dict per chunk
            (chunk 0 first).
        token_budget: per-layer token limit.
        overwrite: replace an existing dump.

    Returns:
        ``root`` as a :class:`~pathlib.Path`.
    """
    writer = DumpWriter(root, token_budget=token_budget, overwrite=overwrite)
    for layer_id, chunks in layers.items():
        for chunk in chunks:
            writer.write(layer_id, q=chunk["q"], k=chunk["k"], v=chunk["v"], seq_lens=chunk.get("seq_lens"))
    return writer.root
