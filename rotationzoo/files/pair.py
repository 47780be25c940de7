"""One K/V rotation pair, and the one resolver that turns anything naming rotations into it.

:func:`resolve_pair` accepts, everywhere in the library and the CLI (``eval``, ``export``,
``publish``, ``serve-args``, ``verify``):

- a folder holding a pair (``k_rotation*.pt`` + ``v_rotation*.pt``, or ``.safetensors``; the
  names listed in its ``rotationzoo.json`` manifest win; see :func:`find_pair_files`);
- ``"k.pt,v.pt"``: two rotation files;
- one rotation file (``.pt`` / ``.safetensors``): a single side, named ``k_…`` / ``v_…`` or with a
  ``qqt…`` / ``sst…`` objective (or ``side=``);
- a pair file written by :mod:`rotationzoo.export` (safetensors) or a GGUF holding the llama.cpp
  branch's rotation tensors;
- a registry id ``MODEL`` or ``MODEL@TAG`` (fetched, verified and cached; bundled entries offline);
- an object already holding rotations: a :class:`RotationPair`, ``{"k": RotationSet, ...}``, a
  :class:`~rotationzoo.files.format.RotationSet`, or anything with ``.k`` / ``.v`` sets (a ``FitResult``).

Example::

    from rotationzoo.files.pair import resolve_pair
    pair = resolve_pair("Qwen3-8B")                   # registry: pair.entry, pair.serving
    pair = resolve_pair("rotations/")                 # a fitter output folder
    pair.k.rotations.shape, pair.layer_ids, pair.head_dim
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

from .limits import parse_index
from ..errors import IntegrityError, InvalidRotationError, PairError, RotationFileError, RotationZooError
from ..errors import ConfigError, UnknownModelError
from .format import RotationSet, read_rotation
from ..hashing import read_hashed
from ..headdims import HeadDims
from ..hub import fetch_entry
from ..int2kv import Int2KVConfig
from .pairfile import file_kind, read_pair_file
from ..registry import SIDES, TagEntry, get_entry, load_registry, split_model_tag
from .manifest import MANIFEST_NAME, manifest_metadata  # noqa: F401  (MANIFEST_NAME re-exported)
from .localpair import (  # noqa: F401  (public names of this module)
    ROTATION_SUFFIXES,
    check_not_pending,
    find_pair_files,
    infer_side,
    verify_path,
)
from .validation import DEFAULT_ATOL, pair_disagreement, validate
from .archive import inspect_torch_zip
from .schema import flat_layers, make_limits
from ..safefile import open_regular

if TYPE_CHECKING:  # pragma: no cover
    import torch



@dataclass(eq=False)
class RotationPair:
    """The K and/or V rotations of one model, with where they came from and how to serve them.

    Attributes:
        sets: ``{"k": RotationSet, "v": RotationSet}`` (one side may be absent, e.g. a single
            exported side); each holds ``rotations [L, d, d]`` applied as ``x_rot = x @ R``.
        entry: the registry entry when resolved from the registry, else ``None``.
        paths: local files per side (the same file for both sides of a pair file).
        sha256: sha256 of the bytes each side was read from (a pair file's own; a registry entry's
            verified file), computed while reading, never taken from metadata; derived files are
            keyed by it and exports record it as ``k.sha256`` / ``v.sha256``.
        metadata: metadata of a pair file (strings, checked against its tensors); for a fitted
            folder, the ``group_size`` its ``rotationzoo.json`` records; else empty.
        source: what it was resolved from (``"Qwen/Qwen3-8B@tag"``, a path, ``"k.pt,v.pt"``).
    """

    sets: dict[str, RotationSet]
    entry: TagEntry | None = None
    paths: dict[str, Path] = field(default_factory=dict)
    sha256: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def _side(self, side: str) -> RotationSet:
        try:
            return self.sets[side]
        except KeyError:
            raise RotationFileError(f"{self.source or 'rotation pair'}: has no {side.upper()} rotations "
                                    f"(sides: {', '.join(self.sides) or 'none'})") from None

    @property
    def k(self) -> RotationSet:
        """The K-side rotation set (``k.rotations [L, d, d]``)."""
        return self._side("k")

    @property
    def v(self) -> RotationSet:
        """The V-side rotation set."""
        return self._side("v")

    @property
    def sides(self) -> tuple[str, ...]:
        return tuple(s for s in SIDES if s in self.sets)

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.sets[self.sides[0]].layer_ids

    @property
    def head_dim(self) -> int:
        """``d`` (refused for a ragged pair: see :attr:`head_dims`)."""
        return self.sets[self.sides[0]].head_dim

    @property
    def head_dims(self) -> HeadDims:
        """``d`` per layer."""
        return self.sets[self.sides[0]].head_dims

    @property
    def centered(self) -> bool:
        """Whether keys or values are centered (``k_mean`` / ``v_mean``)."""
        return any(rs.centered for _, rs in self)

    @property
    def orthogonal(self) -> bool:
        """Whether every side's transform is orthogonal (no ``q_rotation`` / ``o_rotation`` needed)."""
        return all(rs.orthogonal for _, rs in self)

    @property
    def per_head(self) -> bool:
        """Whether a side holds per-KV-head rotations (``[L, H_kv, d, d]``, ``source_grouping="kv_head"``)."""
        return any(rs.per_head for _, rs in self)

    @property
    def model(self) -> str | None:
        """The registry model id (or the one recorded in a pair file)."""
        return self.entry.model_id if self.entry is not None else self.metadata.get("model")

    @property
    def tag(self) -> str | None:
        return self.entry.name if self.entry is not None else self.metadata.get("tag")

    @property
    def serving(self) -> Int2KVConfig | None:
        """The entry's published INT2-KV settings (``None`` for rotations not from the registry)."""
        return self.entry.serving if self.entry is not None else None

    @property
    def fitted_group_size(self) -> int | None:
        """The INT2 group size the rotations were fitted for (``r_pbr_hg<G>``, ``--refine -g G``), from
        a fitted folder's ``rotationzoo.json``; ``None`` when not recorded (or group-independent)."""
        g = parse_index(self.metadata.get("group_size"))
        return g if g is not None and g > 0 else None

    @property
    def recorded_config(self) -> Int2KVConfig | None:
        """The INT2-KV settings the rotations come with: the entry's serving defaults, else a fitted
        folder's ``int2kv`` block (``rotationzoo.json``), else :class:`Int2KVConfig`'s at the group size
        they were fitted for; ``None`` when none is known.

        Raises:
            ConfigError: the recorded ``int2kv`` block is not a valid set of settings.
        """
        if self.serving is not None:
            return self.serving
        block = self.metadata.get("int2kv")
        if block:
            where = f"{self.paths.get('k') or self.source}: {MANIFEST_NAME} int2kv"
            try:
                raw = json.loads(block)
            except ValueError:
                raise ConfigError(f"{where} is not JSON; fit the rotations again") from None
            return Int2KVConfig.from_json(raw, where=where)
        g = self.fitted_group_size
        return Int2KVConfig(group_size=g) if g is not None else None

    def config(self) -> Int2KVConfig:
        """The INT2-KV settings to use: :attr:`recorded_config`, else :class:`Int2KVConfig`'s."""
        return self.recorded_config or Int2KVConfig()

    @property
    def objectives(self) -> dict[str, str]:
        return {s: rs.objective for s, rs in self}

    def __getitem__(self, side: str) -> RotationSet:
        return self._side(side)

    def __iter__(self) -> Iterator[tuple[str, RotationSet]]:
        return iter((s, self.sets[s]) for s in self.sides)

    def only(self, side: str | None) -> "RotationPair":
        """This pair reduced to ``side`` (``None`` keeps every side)."""
        if side is None:
            return self
        rs = self._side(side)
        return RotationPair({side: rs}, self.entry, {k: p for k, p in self.paths.items() if k == side},
                            {k: h for k, h in self.sha256.items() if k == side}, dict(self.metadata), self.source)

    def to(self, device: "str | torch.device | None" = None, dtype: "torch.dtype | None" = None) -> "RotationPair":
        """A copy with every set moved / cast (see :meth:`RotationSet.to`)."""
        sets = {s: rs.to(device=device, dtype=dtype) for s, rs in self}
        return RotationPair(sets, self.entry, dict(self.paths), dict(self.sha256), dict(self.metadata), self.source)

    def validate(self, *, atol: float = DEFAULT_ATOL, layer_ids: Sequence[int] | None = None,
                 head_dim: int | HeadDims | None = None, sides_checked: bool = False) -> "RotationPair":
        """Check every side (orthogonality, finiteness, expected layers / ``d``) and K/V agreement.

        Raises:
            InvalidRotationError: a side fails, a companion is on the wrong side (``k_mean`` /
                ``q_rotation`` belong to K, ``o_rotation`` / ``v_mean`` to V), or K and V cover different
                layers, ``d`` or KV heads.

        ``sides_checked=True`` skips the per-side numerics (the caller validated each side already,
        against the model) and checks only what is about the pair.
        """
        name = self.source or "rotation pair"
        if not self.sets:
            raise InvalidRotationError(f"{name}: no K or V rotations")
        for side, rs in self:
            if not sides_checked:
                validate(rs, atol=atol, layer_ids=layer_ids, head_dim=head_dim)
            wrong = [f for f in _OTHER_SIDE[side] if getattr(rs, f) is not None]
            if wrong:
                raise InvalidRotationError(f"{name}: the {side.upper()} rotations carry {', '.join(wrong)}, which "
                                           f"belongs to the other side; check which file is K and which is V")
        if len(self.sets) == 2:
            problem = pair_disagreement(self.sets["k"], self.sets["v"])
            if problem is not None:
                raise InvalidRotationError(f"{name}: {problem}", [problem])
        return self

    def serve_env(self, engine: str) -> dict[str, str]:
        """Environment variables that serve this pair with ``engine`` (``"sglang"``, ``"sglang-legacy"``,
        ``"vllm"``, ``"vllm-prototype"`` or ``"llamacpp"``): ``rotationzoo.serving.launch_spec(pair,
        engine=engine).env``, from the same reading of the pair (:func:`rotationzoo.engines.pair_input`: its
        absolute paths, settings and refusals). A pair whose own files the engine cannot read as they are
        (:meth:`engine_files_problem`) is refused, naming ``launch_spec``, which writes the files it reads.
        """
        from ..engines import serve_env

        return serve_env(self.config(), engine, {s: str(p) for s, p in self.paths.items()}, pair=self)

    def engine_files_problem(self) -> str | None:
        """Why an engine reading a K and a V ``.pt`` file cannot be handed this pair's own files, else ``None``:
        one file holds both sides (a pair file, a rotations GGUF), or a side keeps its layers as bare tensors
        (``{"layers": {i: tensor}}``, which the authors' SGLang loaders cannot index). ``launch_spec`` then
        writes both sides in the authors' layout into the cache's derived area."""
        k, v = self.paths.get("k"), self.paths.get("v")
        if k is None or v is None:
            return None
        if Path(k) == Path(v):
            return "holds K and V in one file"
        flat = [s.upper() for s in ("k", "v") if _stored_flat(self.paths[s])]
        if flat:
            return (f"keeps the layers of its {' and '.join(flat)} file{'s' if len(flat) > 1 else ''} as bare tensors "
                    f"({{'layers': {{i: tensor}}}}, not {{'rotation': tensor}} dicts)")
        return None

    def __repr__(self) -> str:
        what = self.entry.key if self.entry is not None else (self.source or "local files")
        objs = ", ".join(f"{s}={rs.objective}" for s, rs in self)
        return f"RotationPair({what}, layers={len(self.layer_ids)}, d={self.head_dim}, {objs})"


def _stored_flat(path: Path) -> bool:
    """Whether the ``.pt`` file at ``path`` is the flat variant (:func:`~rotationzoo.files.schema.flat_layers`): its
    pickle inspected again, nothing loaded; ``False`` for safetensors or a file that cannot be inspected."""
    try:
        with open_regular(Path(path), what="rotation file", error=RotationFileError) as f:
            if f.read(4) != b"PK\x03\x04":
                return False
            f.seek(0)
            return flat_layers(inspect_torch_zip(Path(path), make_limits(), fileobj=f, check_crc=False)[0])
    except RotationZooError:
        return False


#: Companions that belong to the other side of the pair.
_OTHER_SIDE = {"k": ("o_rotation", "v_mean"), "v": ("q_rotation", "k_mean")}


# -- local files ---------------------------------------------------------------------------------


def _read_sides(files: Mapping[str, Path], source: str, metadata: Mapping[str, str] | None = None) -> RotationPair:
    read = {s: read_hashed(p, read_rotation) for s, p in files.items()}
    return RotationPair({s: rs for s, (rs, _) in read.items()}, paths=dict(files),
                        sha256={s: sha for s, (_, sha) in read.items()}, metadata=dict(metadata or {}),
                        source=source)


def _not_a_file(p: Path) -> str:
    """Why nothing can be read at ``p`` (not a folder, not a regular file): missing, or what it is instead."""
    from ..safefile import file_kind as mode_kind

    try:
        mode = p.stat().st_mode
    except OSError:  # missing, or a link to nothing
        return f"{p}: no such file or folder"
    return (f"{p}: {mode_kind(mode)}, not a regular file or a folder; give rotation files, a pair file or a pair "
            f"folder (nothing was read from it)")


def read_pair(path: str | os.PathLike[str], *, side: str | None = None) -> RotationPair:
    """Rotations from a local folder, ``"k.pt,v.pt"``, a pair file or one rotation file (not validated).

    Raises:
        PairError: nothing usable at ``path`` (the message says what was expected).
        RotationFileError: a file cannot be read.
    """
    text = os.fspath(path)
    p = Path(text).expanduser()
    if p.is_dir():
        return _read_sides(find_pair_files(p), str(p), manifest_metadata(p))
    if "," in text and not p.exists():
        parts = [Path(x.strip()).expanduser() for x in text.split(",")]
        if len(parts) != 2 or not all(q.is_file() for q in parts):
            raise PairError(f"{text}: expected two existing rotation files 'K_FILE,V_FILE'")
        for folder in {q.parent for q in parts}:
            check_not_pending(folder)
        return _read_sides({"k": parts[0], "v": parts[1]}, text)
    if not p.is_file():
        raise PairError(_not_a_file(p))
    if file_kind(p) is not None:
        (sets, meta), sha = read_hashed(p, read_pair_file)  # the file's own k.sha256 / v.sha256 are provenance only
        return RotationPair(sets, paths={s: p for s in sets}, sha256={s: sha for s in sets}, metadata=meta,
                            source=str(p))
    check_not_pending(p.parent)
    rs, sha = read_hashed(p, read_rotation)
    s = side or infer_side(p, rs.objective)
    if s is None:
        raise PairError(
            f"{p}: cannot tell whether this is the K or the V rotation (name does not start with k_/v_, "
            f"objective {rs.objective!r}); pass side='k' or side='v' (--side)"
        )
    return RotationPair({s: rs}, paths={s: p}, sha256={s: sha}, source=str(p))


# -- the resolver ----------------------------------------------------------------------------------


def _from_object(obj: Any, side: str | None) -> RotationPair | None:
    if isinstance(obj, RotationPair):
        return obj
    if isinstance(obj, RotationSet):
        s = side or infer_side(obj.path, obj.objective)
        if s is None:
            raise PairError(f"{obj.path or 'rotation set'}: cannot tell whether it is the K or the V side "
                              f"(objective {obj.objective!r}); pass side='k' or side='v'")
        return RotationPair({s: obj}, source=str(obj.path or ""))
    if isinstance(obj, Mapping):
        if not obj or any(k not in SIDES for k in obj):
            raise PairError(f"expected a mapping with keys 'k' and/or 'v', got keys {sorted(map(str, obj))}")
        return RotationPair({s: obj[s] for s in SIDES if s in obj})
    sets = {s: getattr(obj, s) for s in SIDES if isinstance(getattr(obj, s, None), RotationSet)}
    if sets:  # FitResult and similar holders
        return RotationPair(sets, source=type(obj).__name__)
    return None


def looks_like_path(text: str) -> bool:
    """Whether a source string names a file rather than a registry model."""
    return (Path(text).suffix in (*ROTATION_SUFFIXES, ".gguf") or text.startswith((".", "/", "~"))
            or text.count("/") > 1 or "," in text)


def resolve_pair(
    rotations: Any,
    tag: str | None = None,
    *,
    side: str | None = None,
    validate_pair: bool = True,
    atol: float = DEFAULT_ATOL,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
) -> RotationPair:
    """Turn anything naming rotations into a :class:`RotationPair` (see the module docstring).

    Args:
        rotations: a path, ``"k.pt,v.pt"``, ``MODEL[@TAG]``, or an object holding rotations.
        tag: calibration tag for a registry model (``MODEL@TAG`` works too).
        side: keep only this side (``"k"`` / ``"v"``); also names the side of a single file whose
            name and objective do not tell.
        validate_pair: check orthogonality (``atol``) and K/V agreement (and, for registry
            entries, the model's layers and ``d``).
        atol: orthogonality tolerance.
        source, revision, cache_dir, offline, timeout: the fetch options of a registry id (see
            :func:`rotationzoo.fetch`); they do not apply to local files.

    Raises:
        PairError: a path that holds no usable rotations, or a name that is neither a path nor a
            registry model.
        InvalidRotationError: validation failed.
        UnknownTagError, FetchError, OfflineError, IntegrityError: registry resolution failed.
    """
    if side is not None and side not in SIDES:
        raise PairError(f"side must be 'k' or 'v', got {side!r}")
    pair = _from_object(rotations, side) if not isinstance(rotations, (str, os.PathLike)) else None
    if pair is None and not isinstance(rotations, (str, os.PathLike)):
        raise PairError(f"cannot read rotations from a {type(rotations).__name__}; give a path, a model id or a pair")
    if pair is None:
        pair = _resolve_text(os.fspath(rotations), tag, side=side, atol=atol,
                             fetch=dict(source=source, revision=revision, cache_dir=cache_dir, offline=offline,
                                        timeout=timeout))
    pair = pair.only(side)
    if validate_pair and pair.entry is None:
        pair.validate(atol=atol)
    return pair


def _resolve_text(text: str, tag: str | None, *, side: str | None, atol: float, fetch: dict[str, Any]) -> RotationPair:
    if Path(text).expanduser().exists() or "," in text:
        if tag is not None:
            raise PairError(f"{text}: a tag applies to registry models, not to files or folders")
        return read_pair(text, side=side)
    model, at_tag = split_model_tag(text)
    try:
        load_registry().resolve(model)
    except UnknownModelError as exc:
        if looks_like_path(text):
            raise PairError(f"{text}: no such file or folder") from None
        raise PairError(f"{text}: not a file, a folder or a registry model; {exc}") from None
    if at_tag is not None and tag is not None and at_tag != tag:
        raise PairError(f"{text}: names tag {at_tag!r} but tag {tag!r} was also given")
    return load_registered(model, at_tag or tag, atol=atol, **fetch)


def cached_details(entry: TagEntry, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """What the verified cached (or bundled) files of ``entry`` hold, per side, without the network:
    path, format and layout versions, grouping, companions, ``calibration`` and ``transform``. Sides
    not cached are absent; a file that cannot be read says why under ``"problem"``."""
    from ..hub import cache_root
    from ..hub.fetch import cached_copy
    from ..hub.sources import bundled_path

    out: dict[str, dict[str, Any]] = {}
    for s in SIDES:
        f = entry.files[s]
        try:
            path = bundled_path(f.sources[0]) if f.bundled else None
            if path is None:
                hit = cached_copy(entry, s, cache_root(cache_dir))
                path = hit.path if hit is not None else None
            if path is None or not path.is_file():
                continue
            rs = read_rotation(path)
        except RotationZooError as exc:
            out[s] = {"problem": str(exc)}
            continue
        out[s] = {"path": str(path), "format_version": rs.format_version, "layout_version": rs.layout_version,
                  "source_grouping": rs.source_grouping, "companions": list(rs.companions),
                  "calibration": rs.calibration, "transform": rs.transform}
    return out


def load_registered(
    model: str,
    tag: str | None = None,
    *,
    device: "str | torch.device" = "cpu",
    dtype: "torch.dtype | None" = None,
    source: str = "auto",
    revision: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    offline: bool | None = None,
    timeout: float | None = None,
    force: bool = False,
    accept_new: bool = False,
    atol: float = DEFAULT_ATOL,
) -> RotationPair:
    """Fetch (if needed), read and validate a registry entry's pair; see :func:`rotationzoo.load`."""
    entry = get_entry(model, tag)
    got = fetch_entry(entry, cache_dir=cache_dir, source=source, revision=revision, offline=offline,
                      timeout=timeout, force=force, accept_new=accept_new)
    arch = entry.architecture
    ids = arch.expected_layer_ids()
    sets = {}
    for s in SIDES:
        rs, sha = read_hashed(got.files[s].path, lambda p: read_rotation(
            p, head_dim=arch.head_dims, num_layers=len(ids) if ids else None, num_kv_heads=arch.num_kv_heads))
        if sha != got.files[s].sha256:
            raise IntegrityError(f"{got.files[s].path}: sha256 {sha} is no longer the verified {got.files[s].sha256} "
                                 f"(changed after verification); fetch again ({shlex.join(['rotationzoo', 'fetch', entry.key, '--force'])})")
        validate(rs, atol=atol, layer_ids=ids, head_dim=arch.head_dims, num_kv_heads=arch.num_kv_heads)
        if dtype is not None or str(device) != "cpu":
            rs = rs.to(device=device, dtype=dtype)
        sets[s] = rs
    pair = RotationPair(sets, entry=entry, paths={s: got.files[s].path for s in SIDES},
                        sha256={s: got.files[s].sha256 for s in SIDES}, source=entry.key)
    return pair.validate(atol=atol, sides_checked=True)  # each side was validated against the model above
