"""What a Zarr chunk is to fastload: an array's normalized metadata (its chunk grid and
keys, v2 and v3 alike), the numcodecs chain that decodes a chunk's bytes, and the
per-process cache of decoded chunk-rows."""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import DatasetError
from fastload.datasets.lru import ProcessLRU
from fastload.resources import memory_share

DEFAULT_CHUNK_CACHE_BYTES = memory_share(256 << 20, 1 / 16)  # lower in a small container
ENTRY_OVERHEAD_BYTES = 256  # counted per cached entry, so fill-only ones are bounded too

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
    def chunk_nbytes(self) -> int:
        """The bytes one decoded chunk holds."""
        return math.prod(self.chunks) * self.stored_dtype.itemsize

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
        """A chunk's bytes as an array of ``chunks`` shape in ``dtype`` (read-only).

        No step inflates past what the chunk can hold: the last codec (the compressor, in
        decoding order the first) gives exactly the chunk's bytes, an earlier one at most
        a few times that (a filter's dtype may differ)."""
        data: Any = raw
        nbytes = self.chunk_nbytes
        for step, config in enumerate(self.codecs):
            most = nbytes if step == len(self.codecs) - 1 else 8 * nbytes + (1 << 16)
            try:
                data = _bounded_decode(config, data, most)
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


# Gzip and zlib decoded here, with a bound; others' headers checked first where they say.
_WBITS = {"gzip": 16 + 15, "zlib": 15}


def _bounded_decode(config: str, data: Any, most: int) -> Any:
    """One codec's decode, refusing output past ``most`` bytes before it is made."""
    codec_id = json.loads(config)["id"]
    if codec_id in _WBITS:
        inflate = zlib.decompressobj(_WBITS[codec_id])
        out = inflate.decompress(bytes(data), most + 1)
        if len(out) > most or inflate.unconsumed_tail:
            raise ValueError(f"it inflates past the chunk's {most} bytes")
        if not inflate.eof:
            raise ValueError("the compressed stream is cut short")
        return out
    claimed = _claimed_size(codec_id, bytes(data[:18]) if len(data) >= 18 else bytes(data))
    if claimed is not None and claimed > most:
        raise ValueError(f"its header claims {claimed} bytes, more than the chunk's {most}")
    return _codec(config).decode(data)


def _claimed_size(codec_id: str, head: bytes) -> int | None:
    """The decoded size a blosc or zstd frame's header claims (None where it says none)."""
    if codec_id == "blosc" and len(head) >= 16:
        return int.from_bytes(head[4:8], "little")  # nbytes, after version and flags
    if codec_id == "zstd" and len(head) >= 6 and head[:4] == b"\x28\xb5\x2f\xfd":
        descriptor = head[4]
        single = (descriptor >> 5) & 1
        at = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
        width = (single, 2, 4, 8)[descriptor >> 6]
        if not width or len(head) < at + width:
            return None
        size = int.from_bytes(head[at : at + width], "little")
        return size + 256 if width == 2 else size
    return None


class DecodedChunkCache(ProcessLRU[tuple[str, int], Array]):
    """Decoded chunk-rows (and shard indexes) by (chunk key, row)."""

    setting = "chunk_cache_bytes"

    def __init__(self, max_bytes: int = DEFAULT_CHUNK_CACHE_BYTES) -> None:
        super().__init__(max_bytes)
