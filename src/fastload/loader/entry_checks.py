"""A batch's native reads of cached entries, checked against the checksums the cache
recorded when it published them (``fastload.cache.read_checks``): an entry read whole is
hashed in the batch's buffer, all of them in one native call; an entry read in part (a
tar member of a cached shard) is hashed whole once per process. Per sample this costs a
few list appends; the hashing is native."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastload.cache import Location
from fastload.cache.read_checks import ReadChecks
from fastload.reader import xxh3_spans


class EntryChecks:
    """The checks of one batch: :meth:`add` each read as it is planned, :meth:`failed`
    after the reader filled the buffer."""

    def __init__(self, *, enabled: bool = True) -> None:
        self._enabled = enabled
        self._keys: list[str] = []  # entries read whole: their key, where, expected checksum
        self._spans: list[tuple[int, int]] = []
        self._expected: list[int] = []
        self._partial: dict[str, None] = {}  # entries read in part (ordered, unique)

    def add(self, key: str, location: Location, offset: int, length: int, at: int) -> None:
        """A read of length bytes at offset of key's entry at location, into buffer[at:]."""
        if not self._enabled or location.checksum is None:
            return  # off, or recorded without an xxh3 checksum: nothing to check against
        if offset == 0 and length == location.size:
            self._keys.append(key)
            self._spans.append((at, length))
            self._expected.append(location.checksum)
        else:
            self._partial[key] = None

    @property
    def hashes(self) -> bool:
        """Whether :meth:`failed` hashes entries natively (one more GIL hand-off)."""
        return bool(self._spans)

    def failed(
        self, buffer: Any, read_checks: ReadChecks, paths: dict[str, Location | None]
    ) -> set[str]:
        """The keys whose entries do not match their checksums."""
        bad: set[str] = set()
        for key in self._partial:
            where = paths[key]
            if where is not None and not read_checks.whole_entry_holds(where):
                bad.add(key)
        if self._spans:
            sums = xxh3_spans(buffer, np.array(self._spans, dtype=np.int64))
            wrong = np.flatnonzero(sums != np.array(self._expected, dtype=np.uint64))
            bad.update(self._keys[i] for i in wrong.tolist())
        return bad
