"""A read-only zarr-python 3 store over fastload's cache.

:class:`~fastload.datasets.zarr.ZarrDataset` reads most arrays itself; an array its own
reader refuses (variable-length strings, structured dtypes, codecs it does not know) is
opened with ``zarr.open_array(store=CachedZarrStore(...), mode="r")`` instead, so its
bytes still come through :class:`~fastload.store.CachedStore`: whole objects with
``read``, byte ranges (a shard's index and inner chunks) with ``read_range``, and the
listing from the dataset's manifest. This module imports zarr-python when it is imported;
the rest of fastload imports it only where the fallback is used.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from fastload.store import CachedStore


class CachedZarrStore(Store):
    """zarr-python's view of a dataset's objects, read through fastload's cache (read-only).

    ``keys`` is the listing (every key of the manifest unless given)."""

    def __init__(self, store: CachedStore, keys: Iterable[str] | None = None) -> None:
        super().__init__(read_only=True)
        self.store = store
        self._keys = frozenset(store.object_keys() if keys is None else keys)
        self._sorted: list[str] | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CachedZarrStore) and other.store.config == self.store.config

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> dict[str, Any]:
        return {"store": self.store, "keys": self._keys}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["store"], state["keys"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"CachedZarrStore({self.store.url!r})"

    # --- reads -------------------------------------------------------------------------------

    def _read(self, key: str, byte_range: ByteRequest | None) -> bytes | None:
        if byte_range is not None and not isinstance(
            byte_range, RangeByteRequest | OffsetByteRequest | SuffixByteRequest
        ):  # zarr's own stores say so in these words (its store tests match them)
            raise TypeError(f"Unexpected byte_range, got {byte_range!r}")
        if key not in self._keys:
            return None
        if byte_range is None:
            return self.store.read(key)
        size = self.store.object(key).size
        start: int
        stop: int | None
        if isinstance(byte_range, RangeByteRequest):
            start, stop = byte_range.start, byte_range.end
        elif isinstance(byte_range, OffsetByteRequest):
            start, stop = byte_range.offset, size
        elif isinstance(byte_range, SuffixByteRequest):
            if size is None:  # no size in the listing: the whole object, then its tail
                return self.store.read(key)[-byte_range.suffix :]
            start, stop = max(0, size - byte_range.suffix), size
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"Unexpected byte_range, got {byte_range!r}: {key} starts at 0")
        if stop is None:
            return self.store.read(key)[start:]
        if size is not None:
            stop = min(stop, size)  # a range past the end reads to the end, as zarr's do
            start = min(start, stop)
        return self.store.read_range(key, start, max(0, stop - start))

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        data = await asyncio.to_thread(self._read, key, byte_range)
        return None if data is None else prototype.buffer.from_bytes(data)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        return key in self._keys

    # --- no writes -----------------------------------------------------------------------------

    @property
    def supports_writes(self) -> bool:
        return False

    @property
    def supports_deletes(self) -> bool:
        return False

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()

    async def delete(self, key: str) -> None:
        self._check_writable()

    # --- listing -------------------------------------------------------------------------------

    @property
    def supports_listing(self) -> bool:
        return True

    def _all(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self._keys)
        return self._sorted

    async def list(self) -> AsyncIterator[str]:
        for key in self._all():
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._all():
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        seen: set[str] = set()
        for key in self._all():
            if key.startswith(prefix):
                child = key[len(prefix) :].split("/", 1)[0]
                if child not in seen:
                    seen.add(child)
                    yield child


__all__ = ["CachedZarrStore"]
