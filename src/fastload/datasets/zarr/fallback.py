"""Arrays fastload's own reader refuses (variable-length strings, structured dtypes,
storage transformers, unknown codecs), read through zarr-python 3 over the same cache."""

from __future__ import annotations

import importlib
import itertools
import math
import os
from typing import Any

import numpy as np

from fastload.datasets.base import DatasetError
from fastload.datasets.zarr.chunks import Array
from fastload.errors import FastloadError
from fastload.store import CachedStore


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
        try:
            return np.asarray(self.zarr_array[start:stop])
        except (ImportError, FastloadError):
            raise
        except Exception as e:  # a chunk zarr-python cannot decode: name the array
            raise DatasetError(
                f"{self._store.url}/{self.name}: zarr-python cannot read rows [{start}, "
                f"{stop}) ({type(e).__name__}: {e}); a chunk is damaged or does not match the "
                "metadata: rewrite it, or open the dataset with refresh=True if it changed"
            ) from e
