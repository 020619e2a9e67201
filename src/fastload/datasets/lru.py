"""An LRU of decoded pieces (Zarr chunk-rows, Parquet row groups), bounded by bytes and
private to one process: it pickles to its budget only and empties itself after a fork, so
DataLoader workers each keep their own (and never inherit a lock held by another thread).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ProcessLRU(Generic[K, V]):
    """``get``/``put`` by key, least recently used out first once past ``max_bytes``."""

    setting = "max_bytes"  # the option that sets the budget, for the error message

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"{self.setting} must be >= 0 (0 turns it off), got {max_bytes}")
        self.max_bytes = max_bytes
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (type(self), (self.max_bytes,))

    def get(self, key: K, *, count: bool = True) -> V | None:
        """The entry of key, counted as a hit or a miss unless ``count`` is False."""
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += count
                return None
            self._items.move_to_end(key)
            self.hits += count
            return item[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            return  # larger than the whole budget: keeping it would only evict the rest
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._items[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.nbytes -= n

    def clear(self) -> None:
        """Drops every entry and zeroes the counters."""
        with self._lock:
            self._items.clear()
            self.nbytes = self.hits = self.misses = 0

    def stats(self) -> dict[str, int]:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "entries": len(self._items),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }
