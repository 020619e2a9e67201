"""The cache stage: a directory on local disk plus a durable index, safe for many processes.

Layout under ``cache_dir``::

    index.sqlite        the index: what is cached, where, which version (index.py)
    objects/ab/<id>     entries' bytes in files of their own (large ones)    (storage.py)
    segments/<n>.seg    small entries' bytes, packed                         (storage.py)
    tmp/                parts and segments being written, never read
    fetch.lock          one byte per entry, record-locked by its fetcher     (locks.py)
    manifests/          dataset listings (see fastload.manifest)

An entry is a remote object, or a byte range of one (a Parquet row group, a range of a tar
shard), keyed by (url, range) and checked against the remote's version on every lookup.
Ids hash the URL, so no remote key can name a path outside the cache, however hostile.

Guarantees: a reader sees an entry's bytes whole or not at all, and published bytes never
change; locks are ``fcntl``/``flock``, so a killed process's locks vanish with it, and what
it left half-written is removed by the next process that opens the cache; an entry in use
is never evicted (readers hold a shared ``flock`` on its file, eviction needs an
exclusive one). ``max_bytes`` bounds the bytes on disk: files, whole segments (dead bytes
included) and the index; parts being fetched may exceed it until they are published or
turned away. Policies (``core.py``): ``lru``, ``pin`` (keep what is cached, turn the rest
away) and ``plan`` (evict what the access order needs furthest ahead).
"""

from fastload.cache.config import CACHE_DIR_ENV, POLICIES, CacheConfig, Policy, default_cache_dir
from fastload.cache.core import (
    Cache,
    PlanHint,
    Span,
    checksum_bytes,
    checksum_file,
    entry_id,
    object_id,
    printable,
    range_url,
)
from fastload.cache.index import Entry
from fastload.cache.locks import FetchLock, FetchLocks
from fastload.cache.storage import Location, PartFile

__all__ = [
    "CACHE_DIR_ENV",
    "POLICIES",
    "Cache",
    "CacheConfig",
    "Entry",
    "FetchLock",
    "FetchLocks",
    "Location",
    "PartFile",
    "PlanHint",
    "Policy",
    "Span",
    "checksum_bytes",
    "checksum_file",
    "default_cache_dir",
    "entry_id",
    "object_id",
    "printable",
    "range_url",
]
