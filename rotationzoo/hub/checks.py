"""What a downloaded (or cached) file must be before it is marked verified: the registry's size and
sha256, then the structure of what it holds, as a K/V rotation file of the entry's model or, for an
entry that stands for an MLA latent set, as one ``layer_<id>.pt`` of that set."""

from __future__ import annotations

from pathlib import Path

from ..errors import RotationZooError
from ..hashing import read_hashed, sha256_file
from ..registry import FileEntry, TagEntry


def check_downloaded(path: Path, f: FileEntry, entry: TagEntry) -> tuple[str | None, str]:
    """(problem or None, observed sha256). Size and sha256 against the registry, then structure; the
    bytes validated are the bytes hashed (:func:`~rotationzoo.hashing.read_hashed`)."""
    size = path.stat().st_size
    sha = sha256_file(path)
    if f.size is not None and size != f.size:
        return f"size {size} B, expected {f.size} B (truncated or wrong file); sha256 {sha}", sha
    if f.sha256 is not None and sha != f.sha256:
        return f"sha256 mismatch: expected {f.sha256}, got {sha}", sha
    if entry.latent is not None:
        return _check_latent(path, f, entry, sha)
    from ..files.format import read_rotation  # torch: only once bytes have arrived
    from ..files.validation import validate

    arch = entry.architecture
    ids = arch.expected_layer_ids()
    try:
        rs, read_sha = read_hashed(path, lambda p: read_rotation(
            p, head_dim=arch.head_dims, num_layers=len(ids) if ids else None, num_kv_heads=arch.num_kv_heads))
        if read_sha != sha:
            return f"changed while it was checked (sha256 {sha}, then {read_sha})", read_sha
        validate(rs, layer_ids=ids, head_dim=arch.head_dims, num_kv_heads=arch.num_kv_heads)
    except RotationZooError as exc:
        return f"not a valid rotation file for {entry.model_id}: {exc}", sha
    return None, sha


def _check_latent(path: Path, f: FileEntry, entry: TagEntry, sha: str) -> tuple[str | None, str]:
    """One latent layer file (or one subspace file of a ``-hp`` entry) of ``entry``'s set."""
    from ..files.latent import LatentRotations, read_latent_file, read_subspace_file, validate_latent

    lat = entry.latent
    assert lat is not None
    lid = int(f.side.rsplit("_", 1)[1])
    try:
        if entry.name.endswith("-hp"):
            _, read_sha = read_hashed(path, lambda p: read_subspace_file(p, rank=lat.rank))
        else:
            lay, read_sha = read_hashed(path, lambda p: read_latent_file(p, rank=lat.rank, layer_id=lid))
            report = validate_latent(LatentRotations({lid: lay}), layer_ids=[lid], rank=lat.rank)
            if not report.ok:
                return f"not a valid latent rotation of {entry.model_id}: {report.problems[0]}", sha
        if read_sha != sha:
            return f"changed while it was checked (sha256 {sha}, then {read_sha})", read_sha
    except RotationZooError as exc:
        return f"not a valid latent file of {entry.model_id}: {exc}", sha
    return None, sha
