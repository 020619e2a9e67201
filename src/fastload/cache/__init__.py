"""The cache stage: a directory on local disk plus a durable index, safe for many processes.

Layout under ``cache_dir``::

    index.sqlite        the index: what is cached, where, which version; its format  (index.py)
                        version is SQLite's user_version (older ones migrate on open)
    objects/ab/<id>     entries' bytes in files of their own (large ones)    (storage.py)
    segments/<n>.seg    small entries' bytes, packed                         (storage.py)
    tmp/                parts and segments being written, never read
    fetch.lock          one byte per entry, record-locked by its fetcher     (locks.py)
    manifests/          dataset listings and derived layouts (see fastload.manifest)
    indexes/            tar shards' indexes (see fastload.datasets.tar)

Eviction (``eviction.py``) reads victims in policy order through indexes and a heap, never
by ranking every entry; compaction (``compaction.py``) rewrites segments that are mostly
dead bytes.

Guarantees: a reader sees an entry's bytes whole or not at all, and published bytes never
change; locks are ``fcntl``/``flock``, so a killed process's locks vanish with it, and what
it left half-written is removed by the next process that opens the cache; an entry in use
is never evicted (readers hold a shared ``flock`` on its file, eviction needs an
exclusive one).

What ``max_bytes`` counts (``budget.py``), at every size: every file and folder under
``cache_dir`` by its allocated blocks: own files and whole segments (dead bytes included)
by their length plus one block each, and the metadata measured from the file system (the
index with room to grow, its WAL, counted at its limit, which commits hold it to, and
shared memory, ``fetch.lock``, ``tmp/``, ``manifests/``, ``indexes/``, the folders), with
index growth reserved per entry until the next measurement; ``fastload cache du`` reports
the same count beside the file system's. A budget that cannot hold the metadata (about
8 MiB) is refused with an error naming the minimum. ``budget_counts="entries"`` (tests,
toys) counts the entries' bytes only: own files and whole segments, not the disk. Parts
being fetched may exceed the budget until they are published or turned away, or the next
measurement.

Policies (``core.py``): ``lru``, ``pin`` (keep what is cached, turn the rest away; dead
bytes are won back by compaction) and ``plan`` (evict what the access order needs furthest
ahead).
"""

from fastload.cache.config import (
    BUDGET_COUNTS,
    CACHE_DIR_ENV,
    POLICIES,
    BudgetCounts,
    CacheConfig,
    Policy,
    default_cache_dir,
)
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
    "BUDGET_COUNTS",
    "CACHE_DIR_ENV",
    "POLICIES",
    "BudgetCounts",
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
