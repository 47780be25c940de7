"""Download, verify and cache rotation files from an entry's sources; manage the cache.

Sources are tried in the entry's order (or only the one asked for): Hugging Face through
``huggingface_hub``, ModelScope through ``modelscope``, a plain ``url``, or data ``bundled`` with
the package. Modules: :mod:`~rotationzoo.hub.layout` (where things live, markers),
:mod:`~rotationzoo.hub.sources` (one downloader per source type), :mod:`~rotationzoo.hub.fetch`
(failover, verification, locking), :mod:`~rotationzoo.hub.cache` (list, verify, remove),
:mod:`~rotationzoo.hub.derived` (files derived from verified ones).
"""

from __future__ import annotations

from .cache import CacheRecord, cache_records, check_removal, removal_plan, remove_cached, verify_cache
from .derived import derived_hit, derived_path, record_derived, writing_derived
from .fetch import (
    SOURCE_CHOICES,
    CachedFile,
    EntryFiles,
    Reporter,
    UnpinnedEntryWarning,
    fetch_entry,
    fetch_file,
    offline_reason,
    record_verified,
    warm_hit,
)
from . import network, pins
from .layout import MARKER_SUFFIX, cache_root, entry_dir, lock_path, marker_path, read_marker
from .sources import DOWNLOADERS, Download, describe_exc

__all__ = [
    "DOWNLOADERS",
    "MARKER_SUFFIX",
    "SOURCE_CHOICES",
    "CacheRecord",
    "CachedFile",
    "Download",
    "EntryFiles",
    "Reporter",
    "UnpinnedEntryWarning",
    "cache_records",
    "cache_root",
    "check_removal",
    "derived_hit",
    "derived_path",
    "describe_exc",
    "entry_dir",
    "fetch_entry",
    "fetch_file",
    "lock_path",
    "marker_path",
    "offline_reason",
    "read_marker",
    "record_derived",
    "record_verified",
    "removal_plan",
    "remove_cached",
    "verify_cache",
    "warm_hit",
    "writing_derived",
]
