"""Zarr v2 and v3 arrays, read chunk by chunk through fastload's cache.

fastload reads Zarr itself: it parses the metadata (``.zarray``/``.zgroup`` for v2,
``zarr.json`` for v3), fetches chunk files through :class:`~fastload.store.CachedStore`
and decodes them with ``numcodecs`` (imported when the first codec is needed). zarr-python
is not used. A sample is one row (index along axis 0) of every array::

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
``"ranges"`` never does.

An array this reader refuses (variable-length strings, structured dtypes, storage
transformers, codecs it does not know) is read through zarr-python 3 over the same cache
(:mod:`fastload.datasets.zarr.store`); ``format_reason`` says which and why.
"""

from __future__ import annotations

import base64
import functools
import importlib
import itertools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import DatasetError, ShardedDataset
from fastload.datasets.lru import ProcessLRU
from fastload.store import CachedStore

DEFAULT_CHUNK_CACHE_BYTES = 256 << 20
_ENTRY_OVERHEAD_BYTES = 256  # counted per cached entry, so fill-only ones are bounded too
# The shard-index cache's second slot per shard key: this process reads that shard whole.
_READ_WHOLE = 1
_NOTHING = np.empty(0, dtype=np.uint8)

# v3 core data types -> numpy kinds; the byte order comes from the "bytes" codec.
_V3_DTYPES = {
    "bool": "b1",
    "int8": "i1",
    "int16": "i2",
    "int32": "i4",
    "int64": "i8",
    "uint8": "u1",
    "uint16": "u2",
    "uint32": "u4",
    "uint64": "u8",
    "float16": "f2",
    "float32": "f4",
    "float64": "f8",
    "complex64": "c8",
    "complex128": "c16",
}
# v3 bytes-to-bytes codecs -> numcodecs ids (blosc, gzip and zstd frames describe themselves,
# so their configuration is not needed to decode).
_V3_BYTES_CODECS = {"blosc": "blosc", "gzip": "gzip", "zstd": "zstd", "crc32c": "crc32c"}

Array = npt.NDArray[Any]


def _numcodecs() -> Any:
    try:
        return importlib.import_module("numcodecs")
    except ImportError as e:
        raise ImportError(
            "reading Zarr needs numcodecs: pip install numcodecs (or pip install 'fastload[zarr]')"
        ) from e


@functools.lru_cache(maxsize=64)
def _codec(config_json: str) -> Any:
    """A numcodecs codec from its JSON config, made once per process."""
    config = json.loads(config_json)
    numcodecs = _numcodecs()
    if config["id"] == "crc32c" and not hasattr(numcodecs, "CRC32C"):
        raise ImportError(
            "this Zarr array checks chunks with crc32c, which numcodecs computes with "
            "google-crc32c: pip install google-crc32c"
        )
    return numcodecs.get_codec(config)


_EMPTY = 2**64 - 1  # a shard index's (offset, nbytes) of an inner chunk never written
_SHARD_INDEX_CACHE_BYTES = 64 << 20


class _Unsupported(DatasetError):
    """What fastload's own reader does not read (zarr-python may): ``why`` in a few words."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """A sharded v3 array's outer grid: ``shape`` of a shard, ``per_shard`` inner chunks
    along each axis, and how its index is stored."""

    shape: tuple[int, ...]
    per_shard: tuple[int, ...]
    index_at_start: bool
    index_dtype: np.dtype[Any]  # uint64 in the index's byte order
    index_crc32c: bool

    @property
    def inner_chunks(self) -> int:
        return math.prod(self.per_shard)

    @property
    def index_nbytes(self) -> int:
        return self.inner_chunks * 16 + (4 if self.index_crc32c else 0)


@dataclass(frozen=True, kw_only=True)
class ZarrArray:
    """One array's metadata, normalized across Zarr v2 and v3.

    ``dtype`` is the dtype rows come out in (native byte order); ``codecs`` are numcodecs
    configs in decoding order; a chunk's bytes hold ``encoded_shape`` in ``order``, turned
    back with ``permutation`` (v3 ``transpose``). A sharded array's ``chunks`` are its
    inner chunks (what decodes), ``shard`` its shards (the objects, keyed by shard index).
    """

    name: str  # "" for an array at the dataset root
    zarr_format: int
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    stored_dtype: np.dtype[Any]
    fill_value: Array  # 0-d, in dtype
    codecs: tuple[str, ...]  # JSON of numcodecs configs, in decoding order
    order: Literal["C", "F"] = "C"
    permutation: tuple[int, ...] | None = None
    key_prefix: str = ""  # "images/" + ("c/" for v3 default encoding)
    separator: str = "."
    shard: ShardSpec | None = None

    @property
    def rows_per_chunk(self) -> int:
        return self.chunks[0]

    @property
    def rows_per_object(self) -> int:
        """Rows of one object-row: a chunk-row, or a shard-row of a sharded array."""
        return self.chunks[0] if self.shard is None else self.shard.shape[0]

    def object_row_keys(self, row: int) -> list[str]:
        """Keys of every object (chunk or shard) in object-row ``row``."""
        if self.shard is None:
            return self.chunk_row_keys(row)
        grid = (math.ceil(s / c) for s, c in zip(self.shape[1:], self.shard.shape[1:], strict=True))
        return [self.chunk_key((row, *rest)) for rest in itertools.product(*map(range, grid))]

    @property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each axis."""
        return tuple(math.ceil(s / c) for s, c in zip(self.shape, self.chunks, strict=True))

    def chunk_key(self, index: Sequence[int]) -> str:
        return self.key_prefix + self.separator.join(str(i) for i in index)

    def chunk_row_keys(self, row: int) -> list[str]:
        """Keys of every chunk in chunk-row ``row`` (all chunks along the other axes)."""
        return [
            self.chunk_key((row, *rest)) for rest in itertools.product(*map(range, self.grid[1:]))
        ]

    def decode(self, raw: bytes, where: str) -> Array:
        """A chunk's bytes as an array of ``chunks`` shape in ``dtype`` (read-only)."""
        data: Any = raw
        for config in self.codecs:
            try:
                data = _codec(config).decode(data)
            except ImportError:
                raise
            except Exception as e:
                raise DatasetError(
                    f"{where}: decoding with {json.loads(config)['id']} failed ({e}); the chunk "
                    "file is damaged or was not written with this metadata; open the dataset "
                    "with refresh=True if it changed, else rewrite the chunk"
                ) from e
        flat = (
            np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            if isinstance(data, np.ndarray)
            else np.frombuffer(data, dtype=np.uint8)
        )
        encoded_shape = self.chunks
        if self.permutation is not None:
            encoded_shape = tuple(self.chunks[p] for p in self.permutation)
        expected = math.prod(encoded_shape) * self.stored_dtype.itemsize
        if flat.nbytes != expected:
            raise DatasetError(
                f"{where}: decoded chunk has {flat.nbytes} bytes, expected {expected} "
                f"({self.chunks} of {self.stored_dtype}); the chunk file does not match the "
                "array's metadata; rewrite it or open the dataset with refresh=True"
            )
        chunk = flat.view(self.stored_dtype).reshape(encoded_shape, order=self.order)
        if self.permutation is not None:
            chunk = chunk.transpose(np.argsort(self.permutation))
        if chunk.dtype != self.dtype:
            chunk = chunk.astype(self.dtype)
        chunk.setflags(write=False)
        return chunk


class ZarrPythonArray:
    """An array fastload's own reader refuses, read through zarr-python 3 over the cache.

    ``reason`` says why (e.g. "variable-length strings are not read by fastload's own
    reader"); rows come from ``zarr.Array`` one inner chunk-row at a time.
    """

    def __init__(
        self, *, name: str, store: CachedStore, existing: frozenset[str], reason: str
    ) -> None:
        self.name = name
        self.reason = reason
        self._store = store
        self._existing = existing
        self._pid = -1
        self._array: Any = None
        arr = self.zarr_array
        self.zarr_format: int = arr.metadata.zarr_format
        self.shape: tuple[int, ...] = tuple(int(s) for s in arr.shape)
        self.dtype: np.dtype[Any] = np.dtype(arr.dtype)
        self.rows_per_chunk: int = int(arr.chunks[0])
        outer = arr.shards or arr.chunks
        self._outer: tuple[int, ...] = tuple(int(c) for c in outer)
        self.rows_per_object: int = self._outer[0]

    @property
    def zarr_array(self) -> Any:
        """The ``zarr.Array`` (opened once per process)."""
        if self._pid != os.getpid():
            zarr = importlib.import_module("zarr")
            from fastload.datasets.zarr.store import CachedZarrStore

            store = CachedZarrStore(self._store, self._existing)
            self._array = zarr.open_array(store=store, path=self.name, mode="r")
            self._pid = os.getpid()
        return self._array

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None, "_pid": -1}

    def object_row_keys(self, row: int) -> list[str]:
        encode = self.zarr_array.metadata.encode_chunk_key
        prefix = f"{self.name}/" if self.name else ""
        grid = (math.ceil(s / c) for s, c in zip(self.shape[1:], self._outer[1:], strict=True))
        return [prefix + encode((row, *rest)) for rest in itertools.product(*map(range, grid))]

    def read(self, start: int, stop: int) -> Array:
        return np.asarray(self.zarr_array[start:stop])


class DecodedChunkCache(ProcessLRU[tuple[str, int], Array]):
    """Decoded chunk-rows (and shard indexes) by (chunk key, row)."""

    setting = "chunk_cache_bytes"

    def __init__(self, max_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> None:
        super().__init__(max_bytes)


class ZarrDataset(ShardedDataset):
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
        self.shard_indices = DecodedChunkCache(_SHARD_INDEX_CACHE_BYTES)
        keys = store.object_keys()
        self._existing = frozenset(keys)
        self.is_group, self.arrays = _open_root(store, self._existing, arrays)
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
            nbytes = block.nbytes + _ENTRY_OVERHEAD_BYTES
        elif all(g == 1 for g in a.grid[1:]):
            # One chunk spans the other axes: a view of it, no copy.
            chunk = self._chunk(a, (block_row,) + (0,) * (len(shape) - 1), asked)
            if chunk is None:  # never written: the fill value, broadcast without memory
                block, nbytes = np.broadcast_to(a.fill_value, shape), _ENTRY_OVERHEAD_BYTES
            else:
                block = chunk[tuple(slice(0, s) for s in shape)]
                nbytes = chunk.nbytes + _ENTRY_OVERHEAD_BYTES
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
            nbytes = block.nbytes + _ENTRY_OVERHEAD_BYTES
        self.decoded.put((a.name, block_row), block, nbytes)
        return block

    def _chunk(self, a: ZarrArray, index: tuple[int, ...], asked: tuple[int, int]) -> Array | None:
        if a.shard is not None:
            return self._inner_chunk(a, a.shard, index, asked)
        key = a.chunk_key(index)
        if key not in self._existing:
            return None  # never written: the fill value
        return a.decode(self.store.read(key), f"{self.store.url}/{key}")

    # --- sharded arrays ----------------------------------------------------------------------

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
                self.shard_indices.put((key, _READ_WHOLE), _NOTHING, _ENTRY_OVERHEAD_BYTES)
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
        """Whether this call reads shard ``key`` whole: asked to, or its rows need more than
        half of the shard's inner chunks (within the array's extent; a block spans the
        other axes, so the inner chunk-rows along axis 0 count), or more than half of a
        dataset shard that reads this object (a secondary array's shards need not line up
        with the primary's: a rank reading that dataset shard reads them too)."""
        if self.shard_reads != "auto":
            return self.shard_reads == "whole"
        if self._fetching_whole(key):
            return True  # staged right now (a loader's look-ahead): wait for it, not a range
        c = a.chunks[0]
        first = shard_row * spec.shape[0]
        last = min(a.shape[0], first + spec.shape[0]) - 1
        lo, hi = max(asked[0], first), min(asked[1] - 1, last)
        needed = hi // c - lo // c + 1 if hi >= lo else 1
        if 2 * needed > last // c - first // c + 1:
            return True
        start, stop = asked
        for s in range(self.shard_of(start), self.shard_of(max(start, stop - 1)) + 1):
            begin, end = int(self.shard_offsets[s]), int(self.shard_offsets[s + 1])
            covered = min(stop, end) - max(start, begin)
            if 2 * covered > end - begin and key in self.shard_keys[s]:
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
        self.shard_indices.put((key, 0), table, table.nbytes + _ENTRY_OVERHEAD_BYTES)
        return table


# --- metadata ------------------------------------------------------------------------------


def _open_root(
    store: CachedStore, existing: frozenset[str], arrays: Sequence[str] | str | None
) -> tuple[bool, dict[str, ZarrArray | ZarrPythonArray]]:
    """(is the root a group, its arrays by name in sample order)."""
    url = store.url
    root = _read_node(store, existing, "")
    if root is None:
        nested = sorted(
            k.rsplit("/", 1)[0]
            for k in existing
            if k.rsplit("/", 1)[-1] in (".zarray", ".zgroup", "zarr.json")
        )
        hint = (
            f"; Zarr metadata sits below it, e.g. in {nested[0]!r}: open {url}/{nested[0]}"
            if nested
            else "; expected the root of a Zarr v2 or v3 array or group"
        )
        raise DatasetError(f"{url} has no .zarray, .zgroup or zarr.json at its root{hint}")
    kind, meta = root
    if kind == "array":
        if arrays is not None:
            raise DatasetError(
                f"{url} is a single Zarr array, not a group; drop arrays={list(arrays)!r}"
            )
        found: dict[str, ZarrArray | ZarrPythonArray] = {"": _array(store, existing, "", meta)}
    else:
        names = [arrays] if isinstance(arrays, str) else arrays
        if names is None:
            names = _child_nodes(existing)
        found = {}
        for name in dict.fromkeys(n.strip("/") for n in names):
            node = _read_node(store, existing, name)
            if node is not None and node[0] == "array":
                found[name] = _array(store, existing, name, node[1])
            elif arrays is not None:
                raise DatasetError(
                    f"{url} has no array {name!r}; nodes directly in the group: "
                    f"{', '.join(_child_nodes(existing)) or 'none'}"
                )
        if not found:
            raise DatasetError(f"{url} is a Zarr group without arrays; expected at least one")
    for name, a in found.items():
        if len(a.shape) == 0 or a.shape[0] == 0:
            raise DatasetError(
                f"Zarr array {name or url!r} has shape {a.shape}: no rows to sample; "
                "expected at least one row along axis 0"
            )
    lengths = {name: a.shape[0] for name, a in found.items()}
    if len(set(lengths.values())) > 1:
        listed = ", ".join(f"{n!r} has {rows}" for n, rows in lengths.items())
        raise DatasetError(
            f"the arrays of {url} must share their first axis (one row per sample): {listed} "
            "rows; pick arrays that line up with arrays=[...]"
        )
    return kind == "group", found


def _array(
    store: CachedStore, existing: frozenset[str], name: str, meta: dict[str, Any]
) -> ZarrArray | ZarrPythonArray:
    """fastload's own reader of the array, else zarr-python's where fastload's refuses it."""
    try:
        return _parse_array(store.url, name, meta)
    except _Unsupported as e:
        try:
            importlib.import_module("zarr")
        except ImportError:
            raise DatasetError(
                f"{e}; zarr-python 3 reads it through fastload's cache: pip install zarr"
            ) from e
        return ZarrPythonArray(
            name=name,
            store=store,
            existing=existing,
            reason=f"{e.why} are not read by fastload's own reader",
        )


def _child_nodes(existing: frozenset[str]) -> list[str]:
    """Names of the arrays (and v3 groups) directly in the root group."""
    return sorted(
        k.rsplit("/", 1)[0]
        for k in existing
        if k.count("/") == 1 and k.endswith(("/.zarray", "/zarr.json"))
    )


def _read_node(
    store: CachedStore, existing: frozenset[str], path: str
) -> tuple[str, dict[str, Any]] | None:
    """("array" or "group", metadata) of the node at path, or None where there is none."""
    prefix = f"{path}/" if path else ""
    if prefix + "zarr.json" in existing:
        meta = _read_json(store, prefix + "zarr.json")
        kind = meta.get("node_type")
        if meta.get("zarr_format") != 3 or kind not in ("array", "group"):
            raise DatasetError(
                f"{store.url}/{prefix}zarr.json is not Zarr v3 metadata (zarr_format "
                f"{meta.get('zarr_format')!r}, node_type {kind!r}); expected zarr_format 3 and "
                "node_type 'array' or 'group'"
            )
        return kind, {**meta, "_prefix": prefix}
    if prefix + ".zarray" in existing:
        return "array", {**_read_json(store, prefix + ".zarray"), "_prefix": prefix}
    if prefix + ".zgroup" in existing:
        return "group", {}
    return None


def _read_json(store: CachedStore, key: str) -> dict[str, Any]:
    try:
        meta = json.loads(store.read(key))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{store.url}/{key} is not valid JSON ({e}); rewrite it") from e
    if not isinstance(meta, dict):
        raise DatasetError(f"{store.url}/{key} holds {type(meta).__name__}, expected an object")
    return meta


def _parse_array(url: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    where = f"{url}/{meta['_prefix']}{'zarr.json' if meta.get('zarr_format') == 3 else '.zarray'}"
    try:
        if meta.get("zarr_format") == 3:
            return _parse_v3(where, name, meta)
        return _parse_v2(where, name, meta)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DatasetError):
            raise
        raise DatasetError(f"{where} is malformed ({type(e).__name__}: {e}); rewrite it") from e


def _shape(where: str, shape: Any, chunks: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape, chunks = tuple(int(s) for s in shape), tuple(int(c) for c in chunks)
    if len(shape) != len(chunks) or any(s < 0 for s in shape) or any(c <= 0 for c in chunks):
        raise DatasetError(
            f"{where}: shape {shape} and chunks {chunks} do not fit; expected one chunk length "
            "> 0 per axis"
        )
    return shape, chunks


def _native(dtype: np.dtype[Any]) -> np.dtype[Any]:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def _parse_v2(where: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    if meta.get("zarr_format") != 2:
        raise DatasetError(f"{where}: zarr_format {meta.get('zarr_format')!r}, expected 2")
    if not isinstance(meta["dtype"], str):
        raise _Unsupported(
            f"{where}: structured dtype {meta['dtype']} is not read by fastload's own reader",
            "structured dtypes",
        )
    stored = np.dtype(meta["dtype"])
    if stored.hasobject:
        raise _Unsupported(
            f"{where}: dtype {meta['dtype']!r} holds Python objects (variable-length strings); "
            "fastload's own reader reads fixed-size dtypes only",
            "variable-length strings",
        )
    shape, chunks = _shape(where, meta["shape"], meta["chunks"])
    order = meta.get("order", "C")
    if order not in ("C", "F"):
        raise DatasetError(f"{where}: order {order!r}, expected 'C' or 'F'")
    codecs = []
    if meta.get("compressor") is not None:
        codecs.append(meta["compressor"])
    codecs += reversed(meta.get("filters") or [])  # filters were applied before compressing
    separator = meta.get("dimension_separator") or "."
    dtype = _native(stored)
    return ZarrArray(
        name=name,
        zarr_format=2,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        stored_dtype=stored,
        fill_value=_fill_v2(where, meta.get("fill_value"), dtype),
        codecs=_checked_codecs(where, codecs),
        order=order,
        key_prefix=meta["_prefix"],
        separator=separator,
    )


def _parse_v3(where: str, name: str, meta: dict[str, Any]) -> ZarrArray:
    data_type = meta["data_type"]
    if not isinstance(data_type, str) or data_type not in _V3_DTYPES:
        kind = data_type.get("name") if isinstance(data_type, dict) else data_type
        why = (
            "variable-length strings"
            if kind in ("string", "variable_length_utf8")
            else "structured dtypes"
            if kind == "structured"
            else f"arrays of data_type {kind!r}"
        )
        raise _Unsupported(
            f"{where}: data_type {data_type!r} is not read by fastload's own reader; it reads "
            f"{', '.join(_V3_DTYPES)}",
            why,
        )
    grid = meta["chunk_grid"]
    if grid.get("name") != "regular":
        raise _Unsupported(
            f"{where}: chunk_grid {grid.get('name')!r}, fastload's own reader reads 'regular'",
            f"chunk grids {grid.get('name')!r}",
        )
    shape, chunks = _shape(where, meta["shape"], grid["configuration"]["chunk_shape"])
    if meta.get("storage_transformers"):
        raise _Unsupported(
            f"{where}: storage transformers are not read by fastload's own reader",
            "storage transformers",
        )
    encoding = meta.get("chunk_key_encoding", {"name": "default"})
    separator = (encoding.get("configuration") or {}).get(
        "separator", "/" if encoding["name"] == "default" else "."
    )
    if encoding["name"] == "default":
        key_prefix = meta["_prefix"] + "c" + separator
    elif encoding["name"] == "v2":
        key_prefix = meta["_prefix"]
    else:
        raise _Unsupported(
            f"{where}: chunk_key_encoding {encoding['name']!r}, fastload's own reader reads "
            "'default' or 'v2'",
            f"chunk key encodings {encoding['name']!r}",
        )
    codecs = meta["codecs"]
    shard: ShardSpec | None = None
    if any(c["name"] == "sharding_indexed" for c in codecs):
        if len(codecs) != 1:
            raise _Unsupported(
                f"{where}: codecs {[c['name'] for c in codecs]} around sharding_indexed; "
                "fastload's own reader reads sharding_indexed alone",
                "codecs around sharding_indexed",
            )
        config = codecs[0]["configuration"]
        inner = _shape(where, shape, config["chunk_shape"])[1]
        if any(s % c for s, c in zip(chunks, inner, strict=True)):
            raise DatasetError(
                f"{where}: shards {chunks} are not a whole number of inner chunks {inner}; "
                "rewrite the metadata"
            )
        shard = _shard_spec(where, chunks, inner, config)
        chunks, codecs = inner, config["codecs"]
    permutation, endian, after_bytes = _v3_chain(where, codecs, len(shape))
    stored = np.dtype(("<" if endian == "little" else ">") + _V3_DTYPES[data_type])
    dtype = _native(stored)
    return ZarrArray(
        name=name,
        zarr_format=3,
        shape=shape,
        chunks=chunks,
        dtype=dtype,
        stored_dtype=stored,
        fill_value=_fill_v3(where, meta.get("fill_value"), dtype),
        codecs=_checked_codecs(where, list(reversed(after_bytes))),
        permutation=permutation,
        key_prefix=key_prefix,
        separator=separator,
        shard=shard,
    )


def _v3_chain(
    where: str, codecs: list[dict[str, Any]], ndim: int
) -> tuple[tuple[int, ...] | None, str, list[dict[str, Any]]]:
    """(transpose permutation, bytes endian, numcodecs configs in encoding order) of a v3
    codec chain (an array's, or the inner chunks' of a shard)."""
    permutation: tuple[int, ...] | None = None
    endian: str | None = None
    after_bytes: list[dict[str, Any]] = []
    for codec in codecs:
        codec_name, config = codec["name"], codec.get("configuration") or {}
        if endian is None and codec_name == "transpose":
            order = config["order"]
            step = (
                tuple(range(ndim))
                if order == "C"
                else tuple(reversed(range(ndim)))
                if order == "F"
                else tuple(int(i) for i in order)
            )
            if sorted(step) != list(range(ndim)):
                raise DatasetError(f"{where}: transpose order {order!r} is not a permutation")
            permutation = step if permutation is None else tuple(permutation[i] for i in step)
        elif endian is None and codec_name == "bytes":
            endian = config.get("endian", "little")
        elif endian is not None and codec_name in _V3_BYTES_CODECS:
            after_bytes.append({"id": _V3_BYTES_CODECS[codec_name]})
        elif endian is not None and codec_name.startswith("numcodecs."):
            after_bytes.append({**config, "id": codec_name.removeprefix("numcodecs.")})
        else:
            raise _Unsupported(
                f"{where}: codec {codec_name!r} is not read by fastload's own reader; it reads "
                "[transpose], bytes, then blosc/gzip/zstd/crc32c/numcodecs.* compressors "
                "(sharded or not)",
                f"arrays with codec {codec_name!r}",
            )
    if endian is None:
        raise DatasetError(f"{where}: no 'bytes' codec; expected one to turn chunks into bytes")
    if endian not in ("little", "big"):
        raise DatasetError(f"{where}: bytes endian {endian!r}, expected 'little' or 'big'")
    return permutation, endian, after_bytes


def _shard_spec(
    where: str, shards: tuple[int, ...], inner: tuple[int, ...], config: dict[str, Any]
) -> ShardSpec:
    location = config.get("index_location", "end")
    if location not in ("start", "end"):
        raise DatasetError(f"{where}: index_location {location!r}, expected 'start' or 'end'")
    names = [c["name"] for c in config.get("index_codecs") or []]
    if names not in (["bytes"], ["bytes", "crc32c"]):
        raise _Unsupported(
            f"{where}: shard index codecs {names}; fastload's own reader reads bytes, then "
            "an optional crc32c",
            f"shard index codecs {names}",
        )
    endian = (config["index_codecs"][0].get("configuration") or {}).get("endian", "little")
    if endian not in ("little", "big"):
        raise DatasetError(f"{where}: index bytes endian {endian!r}, expected 'little' or 'big'")
    if names[-1] == "crc32c":
        _checked_codecs(where, [{"id": "crc32c"}])  # google-crc32c is there, or say so now
    return ShardSpec(
        shape=shards,
        per_shard=tuple(s // c for s, c in zip(shards, inner, strict=True)),
        index_at_start=location == "start",
        index_dtype=np.dtype("<u8" if endian == "little" else ">u8"),
        index_crc32c=names[-1] == "crc32c",
    )


def _checked_codecs(where: str, configs: list[dict[str, Any]]) -> tuple[str, ...]:
    """Codec configs as JSON, each made once now so an unknown one fails at open."""
    out = tuple(json.dumps(c, sort_keys=True) for c in configs)
    for c in out:
        try:
            _codec(c)
        except ImportError:
            raise
        except Exception as e:
            raise _Unsupported(
                f"{where}: numcodecs cannot make codec {json.loads(c)} ({e}); upgrade "
                "numcodecs or register the codec",
                f"arrays with codec {json.loads(c).get('id')!r}",
            ) from e
    return out


_FLOAT_WORDS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _float(value: Any, itemsize: int) -> Any:
    if isinstance(value, str) and value.startswith("0x"):  # v3: the float's bits in hex
        return np.array(int(value, 16), dtype=f"u{itemsize}").view(f"f{itemsize}")[()]
    if isinstance(value, str):
        return _FLOAT_WORDS[value]
    return float(value)


def _scalar(value: Any, dtype: np.dtype[Any]) -> Array:
    if dtype.kind == "f":
        value = _float(value, dtype.itemsize)
    elif dtype.kind == "c":
        re, im = value if isinstance(value, list) else (value, 0)
        value = complex(_float(re, dtype.itemsize // 2), _float(im, dtype.itemsize // 2))
    return np.array(value, dtype=dtype)


def _fill_v2(where: str, value: Any, dtype: np.dtype[Any]) -> Array:
    try:
        if value is None:
            return np.zeros((), dtype=dtype)  # undefined in v2; zarr-python reads zeros too
        if dtype.kind in "SV":
            return np.frombuffer(base64.b64decode(value), dtype=dtype).reshape(())
        if dtype.kind in "mM":
            return np.array(int(value), dtype="i8").view(dtype)
        return _scalar(value, dtype)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{where}: fill_value {value!r} does not fit dtype {dtype}") from e


def _fill_v3(where: str, value: Any, dtype: np.dtype[Any]) -> Array:
    try:
        return _scalar(value, dtype)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{where}: fill_value {value!r} does not fit {dtype}") from e


__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DecodedChunkCache",
    "ShardSpec",
    "ZarrArray",
    "ZarrDataset",
    "ZarrPythonArray",
]
