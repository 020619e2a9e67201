"""Zarr v2 and v3 arrays, read chunk by chunk through fastload's cache.

- :mod:`.dataset`: :class:`ZarrDataset`, rows of every array as samples
- :mod:`.metadata`: v2/v3 metadata parsed and checked into :class:`ZarrArray`
- :mod:`.chunks`: an array's chunk grid and keys, decoding a chunk, the decoded-chunk cache
- :mod:`.sharding`: sharded v3 arrays (a shard's index, its inner chunks)
- :mod:`.fallback`: arrays the own reader refuses, read by zarr-python over the cache
- :mod:`.store`: :class:`~.store.CachedZarrStore`, zarr-python's view of the cache (imports
  zarr-python, so it is imported only when the fallback is used)
"""

from __future__ import annotations

from fastload.datasets.zarr.chunks import (
    DEFAULT_CHUNK_CACHE_BYTES,
    DecodedChunkCache,
    ShardSpec,
    ZarrArray,
)
from fastload.datasets.zarr.dataset import ZarrDataset
from fastload.datasets.zarr.fallback import ZarrPythonArray

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DecodedChunkCache",
    "ShardSpec",
    "ZarrArray",
    "ZarrDataset",
    "ZarrPythonArray",
]
