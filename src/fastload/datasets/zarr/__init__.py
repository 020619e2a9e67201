"""Zarr v2 and v3 arrays, read chunk by chunk through fastload's cache (see
:mod:`fastload.datasets.zarr.dataset`)."""

from __future__ import annotations

from fastload.datasets.zarr.dataset import (
    DEFAULT_CHUNK_CACHE_BYTES,
    DecodedChunkCache,
    ShardSpec,
    ZarrArray,
    ZarrDataset,
    ZarrPythonArray,
)

__all__ = [
    "DEFAULT_CHUNK_CACHE_BYTES",
    "DecodedChunkCache",
    "ShardSpec",
    "ZarrArray",
    "ZarrDataset",
    "ZarrPythonArray",
]
