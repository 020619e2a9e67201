"""The holding area: objects a full cache turned away, fetched ahead and kept in memory until
the reads they were fetched for."""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass

from fastload.remote.transport import Buffer


@dataclass(slots=True)
class _Held:
    data: memoryview
    reads: int  # reads still expected; dropped at 0


class Holding:
    """Objects the cache turned away, fetched ahead like staged ones and kept in memory until
    read, by object key: a dataset larger than a ``pin`` cache then reads its uncached half
    from memory, whole batches at a time, instead of one synchronous GET per sample.

    Bounded by bytes: an object is dropped after the reads it was fetched for, and the
    oldest first when a new one needs room (it is then read from the remote, as without
    holding). One per dataset store and process; state per held object only.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.peak_bytes = 0
        self.dropped_unread = 0  # pushed out for room before their reads: fetched in vain
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._lock = threading.Lock()

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def put(self, key: str, data: Buffer, reads: int) -> bool:
        """Holds data for ``reads`` reads, making room oldest first; False if it cannot fit."""
        view = memoryview(data)
        if not self.fits(view.nbytes):
            return False
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self.nbytes -= old.data.nbytes
            while self.nbytes + view.nbytes > self.max_bytes:
                _, oldest = self._held.popitem(last=False)
                self.nbytes -= oldest.data.nbytes
                self.dropped_unread += 1
            self._held[key] = _Held(view, max(1, reads))
            self.nbytes += view.nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return True

    def expect(self, key: str, reads: int) -> bool:
        """Adds reads to a held object; False if it is not held."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.reads += reads
            return held is not None

    def take(self, key: str, reads: int = 1) -> memoryview | None:
        """A held object's bytes (None if not held), counting ``reads`` of its expected ones:
        after the last it is dropped (the caller keeps the bytes it got)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return None
            held.reads -= reads
            if held.reads <= 0:
                del self._held[key]
                self.nbytes -= held.data.nbytes
            return held.data

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            while self.nbytes > max_bytes:
                _, oldest = self._held.popitem(last=False)
                self.nbytes -= oldest.data.nbytes
                self.dropped_unread += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "objects": len(self._held),
                "bytes": self.nbytes,
                "peak_bytes": self.peak_bytes,
                "max_bytes": self.max_bytes,
                "dropped_unread": self.dropped_unread,
            }
