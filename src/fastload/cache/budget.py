"""What ``max_bytes`` counts: everything the cache puts on disk, by allocated blocks.

The index records the entries' bytes; on disk each own file and each segment also takes up
to one block more than its length (``st_blocks``), so the budget charges every such file
one block on top of its length: an upper bound that needs no ``stat`` per file. Everything
else under the cache directory is *metadata*, measured from the file system
(``st_blocks * 512``): the index, its WAL and shared memory, ``fetch.lock``, ``tmp/`` (parts
being fetched), ``manifests/`` (listings and derived layouts), ``indexes/`` (tar indexes)
and the directories themselves. Metadata that must grow is reserved: the WAL is counted
at ``WAL_RESERVE`` however small it is now (no write transaction starts with it past half
that, and one transaction's pages fit the other half: ``index.py``), the index at its size
and room to grow, and each entry published since the last measurement is charged
``ROW_BYTES`` (its index rows and directory entry) until the next.

One rule at every size: a budget that cannot hold the metadata (about 8 MiB for an empty
cache: the WAL's and the index's reserves) is refused, naming the minimum. Tests and toys
that want a budget of a few KB say ``budget_counts="entries"``: the entries' bytes only
(own files and whole segments), which is not the disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path

from fastload.errors import CacheError

WAL_BYTES = 1 << 20  # the index checkpoints its WAL about here and truncates it to this
WAL_RESERVE = 4 * WAL_BYTES  # a WAL can outgrow its limit while readers hold old pages
ROW_BYTES = 1024  # index pages and directory entries one entry may add (an upper bound)
INDEX_GROWTH_MIN = 4 << 20  # the index may grow with no entry added (uses move rows in
# its recency index): reserved, and a quarter of its size if that is more
_REMEASURE_S = 1.0
_REMEASURE_ENTRIES = 1024
_INDEX_FILES = ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm")


def block_size(directory: Path) -> int:
    try:
        return max(os.statvfs(directory).f_frsize, 512)
    except OSError:
        return 4096


def allocated(path: str | os.PathLike[str]) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def allocated_under(directory: Path) -> int:
    """What the file system allocates for everything under directory (``du -s``'s sum of
    ``st_blocks``), the directory itself included."""
    total = allocated(directory)
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            total += allocated(os.path.join(root, name))
    return total


class Metadata:
    """The cache's metadata on disk, measured at most once a second (or per
    ``_REMEASURE_ENTRIES`` entries), with growth charged in between."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._measured = -1
        self._at = 0.0
        self._since = 0  # entries published since the measurement
        self._index_reserved = 0  # what the index is counted at: its size and room to grow
        self.parts = 0  # of the measurement, what tmp/ held: parts being fetched, transient

    def measure(self) -> int:
        """Everything under the directory but the entries' own files and segments."""
        root = self.dir
        total = allocated(root)
        for name in os.listdir(root):
            path = root / name
            if name in _INDEX_FILES:
                size = allocated(path)
                if name.endswith("-wal"):
                    total += max(size, WAL_RESERVE)
                elif name == "index.sqlite":  # room to grow by uses alone (pages split)
                    if size > self._index_reserved:  # grown into its room: reserve anew
                        self._index_reserved = size + max(INDEX_GROWTH_MIN, size // 4)
                    total += self._index_reserved
                else:
                    total += size
            elif name == "objects":  # the files are entries; their folders are metadata
                total += allocated(path)
                with contextlib.suppress(FileNotFoundError):
                    total += sum(e.stat().st_blocks * 512 for e in os.scandir(path))
            elif name == "segments":
                total += allocated(path)
            elif name == "tmp":
                self.parts = allocated_under(path) - allocated(path)
                total += allocated(path) + self.parts
            elif path.is_dir():
                total += allocated_under(path)
            else:
                total += allocated(path)
        if not (root / "index.sqlite-wal").exists():
            total += WAL_RESERVE
        self._measured, self._at, self._since = total, time.monotonic(), 0
        return total

    def bytes(self) -> int:
        stale = time.monotonic() - self._at > _REMEASURE_S or self._since >= _REMEASURE_ENTRIES
        if self._measured < 0 or stale:
            self.measure()
        return self._measured + self._since * ROW_BYTES

    def published(self, entries: int) -> None:
        self._since += entries

    def lasting(self) -> int:
        """:meth:`bytes` but the parts being fetched: what a budget must hold for good."""
        return self.bytes() - self.parts


def too_small(directory: Path, max_bytes: int, metadata: int) -> CacheError:
    return CacheError(
        errno.ENOSPC,
        f"max_bytes {max_bytes:,} cannot hold even the cache's own metadata in {directory}: "
        f"it takes {metadata:,} bytes (index and its growth, WAL, listings, tar indexes); give "
        f"max_bytes of at least {metadata:,} plus the data's size, `fastload cache clear` to "
        'drop listings and indexes, or (tests, toys) budget_counts="entries" to count only '
        "the entries' bytes, not the disk",
    )
