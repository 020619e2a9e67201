"""Checksums checked as cached entries are read: a bit flipped on disk is never returned.

Every entry carries the checksum (xxh3) computed when it was published. A read that covers
the whole entry is checked on every read: the loader hashes a batch's entries natively in
the buffer it read them into (``fastload.reader.xxh3_spans``, one call per batch). A read
of part of an entry (a tar member of a cached shard, a row group of a cached file) cannot
be checked from its own bytes, so the entry is hashed whole once per process before its
first read, here (mapped, hashed natively with the GIL released), and remembered while it
is among the last ``_REMEMBERED`` entries so checked. An entry that fails is dropped by the
cache and fetched again (:meth:`fastload.cache.Cache.drop_corrupt`).
"""

from __future__ import annotations

import mmap
import threading
from collections import OrderedDict

import numpy as np

from fastload.cache.storage import Location
from fastload.reader import xxh3_spans

_PREFIX = "xxh3:"
# Entries remembered as checked (of those read in part: shards, not samples): a few MB.
_REMEMBERED = 1 << 16


def checksum_value(text: str | None) -> int | None:
    """The xxh3 value an index row records (``"xxh3:<hex>"``); None for another kind."""
    if text is None or not text.startswith(_PREFIX):
        return None
    try:
        return int(text[len(_PREFIX) :], 16)
    except ValueError:
        return None


def entry_checksum(location: Location) -> int:
    """xxh3 of the entry's bytes as they are on disk now."""
    if location.size == 0:
        return int(xxh3_spans(b"", np.zeros((1, 2), np.int64))[0])
    start = location.offset - location.offset % mmap.ALLOCATIONGRANULARITY
    with (
        open(location.path, "rb") as f,
        mmap.mmap(
            f.fileno(),
            location.offset + location.size - start,
            offset=start,
            access=mmap.ACCESS_READ,
        ) as mapped,
    ):
        span = np.array([[location.offset - start, location.size]], np.int64)
        return int(xxh3_spans(mapped, span)[0])


class ReadChecks:
    """Entries of this process already found to match their checksum (see the module
    docstring); thread-safe."""

    def __init__(self, *, enabled: bool = True, remembered: int = _REMEMBERED) -> None:
        self.enabled = enabled  # off: every read trusts the bytes (``verify_reads=False``)
        self._remembered = remembered
        self._checked: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._lock = threading.Lock()

    def whole_entry_holds(self, location: Location) -> bool:
        """Whether location's bytes match its checksum (hashed now unless they were lately;
        True where the index records no xxh3 checksum)."""
        if not self.enabled or location.checksum is None:
            return True
        key = (location.path, location.offset, location.checksum)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return True
        try:
            holds = entry_checksum(location) == location.checksum
        except (OSError, ValueError):
            return False  # missing or cut short: not the bytes recorded
        if holds:
            with self._lock:
                self._checked[key] = None
                while len(self._checked) > self._remembered:
                    self._checked.popitem(last=False)
        return holds
