"""Zarr v2 and v3 arrays, read chunk by chunk through fastload's cache.

fastload reads most Zarr arrays itself: it parses the metadata (``.zarray``/``.zgroup``
for v2, ``zarr.json`` for v3; :mod:`.metadata`), fetches chunk files through
:class:`~fastload.store.CachedStore` and decodes them with ``numcodecs`` (imported when the
first codec is needed; :mod:`.chunks`). zarr-python is only the fallback for arrays this
reader refuses (below). A sample is one row (index along axis 0) of every array::

    root/                     dataset[i] == {"images": images[i], "labels": labels[i]}
      images/ (N, 8, 8, 3)    shard s == chunk-row s of the first (primary) array:
      labels/ (N,)              rows [s * 7, (s + 1) * 7) with images chunked (7, 8, 4, 3);
                                its keys: every images chunk of that chunk-row plus the
                                labels chunks (any chunking) that overlap those rows

A root that is a single array gives the row itself. Missing chunk files read as the
array's fill value. Decoded chunk-rows are kept in a small per-process LRU, bounded by
bytes, so consecutive rows decode each chunk once.

Sharded Zarr v3 arrays (codec ``sharding_indexed``) are read the same way: a shard object
holds a grid of inner chunks and an index of their (offset, length); the dataset's shard
``s`` is shard-row ``s`` of the primary array (every shard at index ``s`` along axis 0), so
a sampler keeps a rank on whole shard objects. Rows decode by inner chunk-row. A shard's
index is read by range (and checked with its crc32c), then its inner chunks by range; a
call whose rows need more than half of a shard's inner chunks (``get_rows`` over most of
it, or an inner chunk-row that is most of it) reads the whole object instead, as do
``warm()`` and ``fl.DataLoader``, which stage whole shards. ``shard_reads="whole"`` reads
every shard whole on first touch (one GET per shard when a rank reads them all),
``"ranges"`` never does (:mod:`.sharding`).

An array this reader refuses (variable-length strings, structured dtypes, storage
transformers, codecs it does not know) is read through zarr-python 3 over the same cache
(:mod:`.fallback`, :mod:`.store`); ``format_reason`` says which and why.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from fastload.datasets.base import DatasetError
from fastload.datasets.zarr.chunks import (
    DEFAULT_CHUNK_CACHE_BYTES,
    ENTRY_OVERHEAD_BYTES,
    Array,
    DecodedChunkCache,
    ZarrArray,
)
from fastload.datasets.zarr.fallback import ZarrPythonArray
from fastload.datasets.zarr.metadata import open_root
from fastload.datasets.zarr.sharding import SHARD_INDEX_CACHE_BYTES, ShardedReads
from fastload.store import CachedStore


class ZarrDataset(ShardedReads):
    """A Zarr v2/v3 array or group whose sample ``i`` is row ``i`` of each array.

    ``arrays`` picks arrays of a group (default: every array directly in it, sorted by
    name); they must share the length of axis 0, and the first is the primary array whose
    chunk-rows (shard-rows, if sharded) are the shards. ``chunk_cache_bytes`` bounds the
    per-process cache of decoded chunk-rows (0 turns it off; make it larger than one
    chunk-row of all arrays). ``shard_reads`` says how sharded arrays' shards are read:
    ``"auto"`` (by range, or whole when a call needs more than half of one), ``"whole"``
    or ``"ranges"``.
    """

    format = "zarr"

    def __init__(
        self,
        store: CachedStore,
        *,
        arrays: Sequence[str] | str | None = None,
        chunk_cache_bytes: int = DEFAULT_CHUNK_CACHE_BYTES,
        shard_reads: Literal["auto", "whole", "ranges"] = "auto",
    ) -> None:
        if shard_reads not in ("auto", "whole", "ranges"):
            raise ValueError(
                f"shard_reads must be 'auto', 'whole' or 'ranges', got {shard_reads!r}"
            )
        self.shard_reads = shard_reads
        self._format_reason = ""
        self.decoded = DecodedChunkCache(chunk_cache_bytes)
        self.shard_indices = DecodedChunkCache(SHARD_INDEX_CACHE_BYTES)
        keys = store.object_keys()
        self._existing = frozenset(keys)
        self.is_group, self.arrays = open_root(store, self._existing, arrays)
        for a in self.arrays.values():
            _check_extent(store.url, a, self._existing)
        primary = next(iter(self.arrays.values()))
        self.zarr_format = primary.zarr_format
        n, per = primary.shape[0], primary.rows_per_object
        sizes = [min(per, n - start) for start in range(0, n, per)]
        shard_keys: list[list[str]] = []
        for s, size in enumerate(sizes):
            start, stop = s * per, s * per + size
            wanted = (
                k
                for a in self.arrays.values()
                for row in range(start // a.rows_per_object, (stop - 1) // a.rows_per_object + 1)
                for k in a.object_row_keys(row)
            )
            shard_keys.append([k for k in dict.fromkeys(wanted) if k in self._existing])
        super().__init__(store, sizes, shard_keys)

    @property
    def format_reason(self) -> str:
        """Why the format was picked, then which arrays zarr-python reads and why."""
        notes = [
            f"{a.name or 'the array'}: read through zarr-python: {a.reason}"
            for a in self.arrays.values()
            if isinstance(a, ZarrPythonArray)
        ]
        return "; ".join(r for r in [self._format_reason, *notes] if r)

    @format_reason.setter
    def format_reason(self, value: str) -> None:
        self._format_reason = value

    # --- samples ---------------------------------------------------------------------------

    def _load(self, index: int) -> Any:
        rows = {name: self._row(a, index) for name, a in self.arrays.items()}
        return rows if self.is_group else rows[""]

    def get_rows(self, start: int, stop: int) -> Any:
        """Rows ``[start, stop)`` of each array as one array per name (a dict for a group)."""
        n = len(self)
        if not 0 <= start <= stop <= n:
            raise IndexError(
                f"rows [{start}, {stop}) are not within [0, {n}] of {self.store.url}; "
                "expected 0 <= start <= stop <= len(dataset)"
            )
        out = {name: self._rows(a, start, stop) for name, a in self.arrays.items()}
        return out if self.is_group else out[""]

    def _row(self, a: ZarrArray | ZarrPythonArray, index: int) -> Array:
        block_row, at = divmod(index, a.rows_per_chunk)
        block = self._block(a, block_row, (index, index + 1))
        return np.array(block[at], dtype=block.dtype)  # a copy: the cached block stays intact

    def _rows(self, a: ZarrArray | ZarrPythonArray, start: int, stop: int) -> Array:
        out = np.empty((stop - start, *a.shape[1:]), dtype=a.dtype)
        per = a.rows_per_chunk
        for block_row in range(start // per, (stop - 1) // per + 1 if stop > start else 0):
            lo, hi = max(start, block_row * per), min(stop, (block_row + 1) * per)
            block = self._block(a, block_row, (start, stop))
            out[lo - start : hi - start] = block[lo - block_row * per : hi - block_row * per]
        return out

    def _block(
        self, a: ZarrArray | ZarrPythonArray, block_row: int, asked: tuple[int, int]
    ) -> Array:
        """Chunk-row ``block_row`` of ``a`` decoded and trimmed to the array's extent
        (``asked``: the rows the call wants, which decide how a shard is read)."""
        cached = self.decoded.get((a.name, block_row))
        if cached is not None:
            return cached
        rows = min(a.rows_per_chunk, a.shape[0] - block_row * a.rows_per_chunk)
        shape = (rows, *a.shape[1:])
        if isinstance(a, ZarrPythonArray):
            start = block_row * a.rows_per_chunk
            block = a.read(start, start + rows)
            block.setflags(write=False)
            nbytes = block.nbytes + ENTRY_OVERHEAD_BYTES
        elif all(g == 1 for g in a.grid[1:]):
            # One chunk spans the other axes: a view of it, no copy.
            chunk = self._chunk(a, (block_row,) + (0,) * (len(shape) - 1), asked)
            if chunk is None:  # never written: the fill value, broadcast without memory
                block, nbytes = np.broadcast_to(a.fill_value, shape), ENTRY_OVERHEAD_BYTES
            else:
                block = chunk[tuple(slice(0, s) for s in shape)]
                nbytes = chunk.nbytes + ENTRY_OVERHEAD_BYTES
        else:
            block = np.empty(shape, dtype=a.dtype)
            for rest in itertools.product(*map(range, a.grid[1:])):
                region = tuple(
                    slice(i * c, min((i + 1) * c, s))
                    for i, c, s in zip(rest, a.chunks[1:], a.shape[1:], strict=True)
                )
                part = self._chunk(a, (block_row, *rest), asked)
                dest = block[(slice(None), *region)]
                if part is None:
                    dest[...] = a.fill_value
                else:
                    dest[...] = part[
                        (slice(0, rows), *(slice(0, r.stop - r.start) for r in region))
                    ]
            block.setflags(write=False)
            nbytes = block.nbytes + ENTRY_OVERHEAD_BYTES
        self.decoded.put((a.name, block_row), block, nbytes)
        return block

    def _chunk(self, a: ZarrArray, index: tuple[int, ...], asked: tuple[int, int]) -> Array | None:
        if a.shard is not None:
            return self._inner_chunk(a, a.shard, index, asked)
        key = a.chunk_key(index)
        if key not in self._existing:
            return None  # never written: the fill value
        return a.decode(self.store.read(key), f"{self.store.url}/{key}")


# An array may leave chunks unwritten (they read as its fill value), but the work of opening
# it (a shard per object-row, a key per object) follows its claimed shape: that shape may
# claim at most this many objects per object listed under the array (plus a small margin).
_CLAIMED_PER_LISTED = 16
_CLAIMED_MARGIN = 4096


def _check_extent(url: str, a: ZarrArray | ZarrPythonArray, existing: frozenset[str]) -> None:
    """Refuses a shape that claims far more chunk (or shard) objects than the listing holds
    for the array (a 550-byte zarr.json can claim 1e9 rows): work stays proportional to the
    objects that exist."""
    outer = a.shard.shape if isinstance(a, ZarrArray) and a.shard is not None else None
    if outer is None:
        outer = a.chunks if isinstance(a, ZarrArray) else a._outer
    claimed = math.prod(math.ceil(s / c) for s, c in zip(a.shape, outer, strict=True))
    prefix = f"{a.name}/" if a.name else ""
    listed = sum(1 for k in existing if k.startswith(prefix))
    if claimed > _CLAIMED_PER_LISTED * listed + _CLAIMED_MARGIN:
        where = f"{url}/{prefix}{'zarr.json' if a.zarr_format == 3 else '.zarray'}"
        raise DatasetError(
            f"{where}: shape {a.shape} in objects of {tuple(outer)} claims {claimed} chunk "
            f"objects, but the listing holds {listed} under the array; the shape is wrong, or "
            "the array is almost all unwritten (fill value): rewrite its metadata, or open "
            "the dataset with refresh=True if it was being written"
        )
