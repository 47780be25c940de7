"""Writing Q/K/V dumps in the SGLang layout (see :mod:`rotationzoo.fit.dump` for the layout and the reader)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..errors import DumpError
from ..safefile import temp_beside, write_text_atomic
from .dump_ranks import LAYER_KINDS, RANK_PREFIX
from .dump_schema import DUMP_INFO_NAME, DUMP_UNFINISHED_NAME, GRAD_KIND, KINDS, parse_index


def _is_layer_dir_name(name: str) -> bool:
    return name.startswith("layer_") and parse_index(name[6:]) is not None


def _save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_beside(path)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: The lock a capture holds on its dump folder while it writes (hidden: readers ignore it).
WRITER_LOCK_NAME = ".rotationzoo_dump.lock"
#: What a layer folder of a dump holds: a folder per kind (and ``rank_<r>/`` folders of them), chunk files in them.
_LAYER_ENTRIES = (*LAYER_KINDS, GRAD_KIND)


def _take_writer_lock(root: Path) -> Any:
    """The held lock of a dump folder, or :class:`DumpError` when another capture holds it."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(root / WRITER_LOCK_NAME), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise DumpError(f"{root}: another capture is writing this dump; wait for it, or give another --dump-out") \
            from None
    except OSError as exc:
        raise DumpError(f"{root}: cannot lock the dump folder ({exc.strerror or exc})") from None
    return lock


def _not_dump_content(layer: Path) -> str | None:
    """Why ``layer`` (a ``layer_<L>`` entry) holds something a dump does not (None: only kind folders, ``rank_<r>/``
    folders of them, and chunk files ``<n>.pt``, with the writers' hidden temporary files)."""
    if layer.is_symlink() or not layer.is_dir():  # never followed, never removed: what it points to is not the dump's
        return f"{layer}: a link or a file, not a layer folder of this dump"
    for e in sorted(layer.iterdir()):
        if e.name.startswith(".") and e.is_file() and not e.is_symlink():
            continue
        if (e.name.startswith(RANK_PREFIX) and parse_index(e.name[len(RANK_PREFIX):]) is not None and e.is_dir()
                and not e.is_symlink()):
            problem = _not_dump_content(e)
            if problem is not None:
                return problem
            continue
        if e.name not in _LAYER_ENTRIES or e.is_symlink() or not e.is_dir():
            return f"{e}"
        for chunk in sorted(e.iterdir()):
            ok = (not chunk.is_symlink() and chunk.is_file()
                  and (chunk.name.startswith(".") or (chunk.suffix == ".pt" and parse_index(chunk.stem) is not None)))
            if not ok:
                return f"{chunk}"
    return None


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
        unfinished: mark the dump unfinished (:data:`DUMP_UNFINISHED_NAME`) until :meth:`write_info` or
            :meth:`finish`, so that a capture killed half way leaves a dump no reader takes for whole.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token_budget: int | None = None,
        kinds: Sequence[str] = KINDS,
        overwrite: bool = False,
        unfinished: bool = False,
    ) -> None:
        self.root = Path(root)
        self.token_budget = None if token_budget is None else int(token_budget)
        self.kinds = tuple(kinds)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise DumpError(f"unknown dump kinds {bad}; expected a subset of {KINDS}")
        if self.root.exists() and not self.root.is_dir():
            raise DumpError(f"{self.root} exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = _take_writer_lock(self.root)  # one capture at a time: another would mix its chunks in
        try:
            existing = [c for c in self.root.iterdir() if _is_layer_dir_name(c.name)]
            if existing:
                if not overwrite:
                    raise DumpError(f"{self.root} already holds a dump ({len(existing)} layer folders); choose an "
                                    f"empty folder")
                for c in existing:  # everything is checked before anything goes
                    problem = _not_dump_content(c)
                    if problem is not None:
                        raise DumpError(f"{problem}; it is not part of a Q/K/V dump, so the dump is not overwritten: "
                                        f"move it out, or give another --dump-out")
            if unfinished or existing:  # marked before the old layers go: a removal cut short is never read as whole
                (self.root / DUMP_UNFINISHED_NAME).write_text("a capture is writing this dump\n", encoding="utf-8")
            try:
                for c in existing:
                    shutil.rmtree(c)
                if existing:
                    (self.root / DUMP_INFO_NAME).unlink(missing_ok=True)
            except OSError as exc:
                raise DumpError(f"{self.root}: cannot remove the old dump ({exc}); it stays marked unfinished; "
                                f"remove it yourself") from None
        except BaseException:
            self._lock.release()
            raise
        self._next_chunk: dict[int, int] = {}
        self._saved: dict[int, int] = {}
        self._last: dict[int, tuple[int, int] | None] = {}  # layer → (chunk, rows) of its last write() (None: nothing)

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
        if parse_index(str(layer_id)) is None:
            raise DumpError(f"DumpWriter.write: layer id {layer_id} is not a non-negative integer below 10**9")
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
            self._last[layer_id] = None
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
        self._last[layer_id] = (chunk, n)
        return n

    def write_grads(self, layer_id: int, g: torch.Tensor) -> int:
        """Store the output gradients ``g [n, H_q, d]`` of the chunk the last :meth:`write` of ``layer_id`` wrote
        (as ``layer_<L>/g/<chunk>.pt``, its first rows when the token budget cut that chunk short).

        Returns:
            Rows written (0 when that write stored nothing).

        Raises:
            DumpError: ``g`` is not 3-D, has fewer rows than the chunk, or no chunk was written for the layer.
        """
        layer_id = int(layer_id)
        if layer_id not in self._last:
            raise DumpError(f"DumpWriter.write_grads: layer {layer_id}: no chunk written yet")
        last = self._last[layer_id]
        if last is None:
            return 0
        chunk, n = last
        if g.dim() != 3 or g.shape[0] < n:
            raise DumpError(f"DumpWriter.write_grads: layer {layer_id}: g must be [n ≥ {n}, heads, d], got {tuple(g.shape)}")
        _save_atomic(g[:n].detach().to("cpu").contiguous().clone(), self.root / f"layer_{layer_id}" / GRAD_KIND / f"{chunk}.pt")
        return n

    def write_info(self, info: Mapping[str, Any]) -> Path:
        """Write ``rotationzoo_dump.json`` (model, prompts, tokens, ...) at the dump root."""
        p = write_text_atomic(self.root / DUMP_INFO_NAME, json.dumps(dict(info), indent=2, default=str) + "\n")
        self.finish()
        return p

    def finish(self) -> None:
        """Mark the dump whole (readers refuse it while it is marked unfinished) and let another capture write
        into the folder."""
        (self.root / DUMP_UNFINISHED_NAME).unlink(missing_ok=True)
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()


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
