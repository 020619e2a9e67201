"""Sharded Zarr v3 arrays (codec ``sharding_indexed``): a shard object holds a grid of inner
chunks and an index of their (offset, length). The index is read by range and checked with
its crc32c, then inner chunks by range, or the whole shard where a call needs most of it."""

from __future__ import annotations

import json
from typing import Any, Literal

import numpy as np

from fastload.datasets.base import DatasetError, ShardedDataset
from fastload.datasets.zarr.chunks import (
    ENTRY_OVERHEAD_BYTES,
    Array,
    DecodedChunkCache,
    ShardSpec,
    ZarrArray,
    _codec,
)
from fastload.staging import planner

# The shard-index cache's second slot per shard key: this process reads that shard whole.
_READ_WHOLE = 1
_NOTHING = np.empty(0, dtype=np.uint8)
_EMPTY = 2**64 - 1  # a shard index's (offset, nbytes) of an inner chunk never written
SHARD_INDEX_CACHE_BYTES = 64 << 20


class ShardedReads(ShardedDataset):
    """The reads of :class:`~fastload.datasets.zarr.ZarrDataset` that go through a shard's
    index: which inner chunk lies where, and whether to read the shard whole."""

    shard_reads: Literal["auto", "whole", "ranges"]
    shard_indices: DecodedChunkCache  # shard indexes, and which shards this process reads whole
    _existing: frozenset[str]

    def _inner_chunk(
        self, a: ZarrArray, spec: ShardSpec, index: tuple[int, ...], asked: tuple[int, int]
    ) -> Array | None:
        """Inner chunk ``index`` (in the array's grid of inner chunks) of a sharded array."""
        outer = tuple(i // p for i, p in zip(index, spec.per_shard, strict=True))
        key = a.chunk_key(outer)
        if key not in self._existing:
            return None  # the shard was never written: the fill value
        # A shard this process read whole is read from its whole copy after that, without
        # deciding again (the decision tries a fetch lock: ~24 us an inner chunk).
        whole = self.shard_indices.get((key, _READ_WHOLE)) is not None
        if not whole:  # cached whole already (one index lookup), or worth reading whole
            whole = self.store.local_path(key) is not None or self._reads_whole(
                a, spec, key, outer[0], asked
            )
            if whole:
                self.shard_indices.put((key, _READ_WHOLE), _NOTHING, ENTRY_OVERHEAD_BYTES)
        table = self._shard_index(spec, key, whole)
        local = tuple(i % p for i, p in zip(index, spec.per_shard, strict=True))
        offset, nbytes = (int(v) for v in table[np.ravel_multi_index(local, spec.per_shard)])
        if offset == _EMPTY and nbytes == _EMPTY:
            return None  # an inner chunk never written: the fill value
        if whole:
            raw = self.store.read(key, offset, nbytes)  # the whole shard into the cache first
        else:
            raw = self.store.read_range(key, offset, nbytes)
        if len(raw) != nbytes:
            raise DatasetError(
                f"{self.store.object_url(key)}: read {len(raw)} bytes of inner chunk {local} "
                f"at offset {offset}, expected {nbytes}; the shard changed since the dataset "
                "was opened: open it again with refresh=True"
            )
        return a.decode(raw, f"{self.store.url}/{key} (inner chunk {local})")

    def _reads_whole(
        self, a: ZarrArray, spec: ShardSpec, key: str, shard_row: int, asked: tuple[int, int]
    ) -> bool:
        """Whether this call reads shard ``key`` whole: asked to, or (the planner's rule)
        its rows need half of the shard's inner chunks or more (within the array's extent;
        a block spans the other axes, so the inner chunk-rows along axis 0 count), or half
        or more of a dataset shard that reads this object (a secondary array's shards need
        not line up with the primary's: a rank reading that dataset shard reads them too)."""
        if self.shard_reads != "auto":
            return self.shard_reads == "whole"
        if self._fetching_whole(key):
            return True  # staged right now (a loader's look-ahead): wait for it, not a range
        c = a.chunks[0]
        first = shard_row * spec.shape[0]
        last = min(a.shape[0], first + spec.shape[0]) - 1
        lo, hi = max(asked[0], first), min(asked[1] - 1, last)
        needed = hi // c - lo // c + 1 if hi >= lo else 1
        if planner.fetch_whole(needed, last // c - first // c + 1):
            return True
        start, stop = asked
        for s in range(self.shard_of(start), self.shard_of(max(start, stop - 1)) + 1):
            begin, end = int(self.shard_offsets[s]), int(self.shard_offsets[s + 1])
            covered = min(stop, end) - max(start, begin)
            if planner.fetch_whole(covered, end - begin) and key in self.shard_keys[s]:
                return True
        return False

    def _fetching_whole(self, key: str) -> bool:
        """Whether another thread or process is fetching the whole object ``key`` now."""
        cache = self.store.cache
        lock = cache.try_fetch_lock(self.store.object_url(key))
        if lock is None:
            return True
        lock.release()
        return False

    def _shard_index(self, spec: ShardSpec, key: str, whole: bool) -> Array:
        """The (inner chunks, 2) uint64 (offset, nbytes) of shard ``key``, crc32c checked."""
        cached = self.shard_indices.get((key, 0))
        if cached is not None:
            return cached
        n = spec.index_nbytes
        size = self.store.object(key).size
        if size is None:  # no size in the listing: read the whole object
            data = self.store.read(key)
            size = len(data)
            raw = data[:n] if spec.index_at_start else data[len(data) - n :]
        else:
            at = 0 if spec.index_at_start else size - n
            if at < 0:
                raw = b""
            elif whole:
                raw = self.store.read(key, at, n)
            else:
                raw = self.store.read_range(key, at, n)
        url = self.store.object_url(key)
        if len(raw) != n:
            raise DatasetError(
                f"{url}: the shard has {size} bytes, too few for its index of {n} bytes; "
                "the shard is damaged or was not written with this metadata; rewrite it"
            )
        body: Any = raw
        if spec.index_crc32c:
            try:
                body = _codec(json.dumps({"id": "crc32c"})).decode(raw)
            except ImportError:
                raise
            except Exception as e:
                raise DatasetError(
                    f"{url}: the shard index fails its crc32c check ({e}); the shard is "
                    "damaged or changed while it was read; open the dataset with "
                    "refresh=True if it changed, else rewrite the shard"
                ) from e
        table = np.frombuffer(body, dtype=spec.index_dtype).reshape(spec.inner_chunks, 2)
        written = ~((table[:, 0] == _EMPTY) & (table[:, 1] == _EMPTY))
        offsets, lengths = table[written, 0], table[written, 1]
        if np.any((offsets > size) | (lengths > np.uint64(size) - offsets)):
            raise DatasetError(
                f"{url}: the shard index points past the shard's {size} bytes; the shard is "
                "damaged or was not written with this metadata; rewrite it"
            )
        table = table.astype(np.uint64)  # native order, and a copy the cache owns
        table.setflags(write=False)
        self.shard_indices.put((key, 0), table, table.nbytes + ENTRY_OVERHEAD_BYTES)
        return table
