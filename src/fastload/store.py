"""A dataset's objects read through the local cache: fetched on demand, staged ahead on request.

Datasets (``fastload.datasets``) read every byte through a :class:`CachedStore`. It lists
the dataset once (the manifest), and on each read serves the cached file, or fetches the
object into the cache first, or, when the cache's policy turns the object away (a full
``pin`` cache), serves it from memory if a loader fetched it ahead (its :class:`Holding`),
else reads it straight from the remote. It pickles to its settings only, so a DataLoader
worker re-opens its own cache handle, filesystem and (empty) holding area after fork or
spawn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastload.cache import BudgetCounts, Cache, Location, Policy
from fastload.errors import RemoteNotFoundError
from fastload.manifest import Manifest, RemoteObject, load_manifest
from fastload.remote import integrity_error, open_filesystem, public_url, refuse_credentials
from fastload.remote.range_file import RangeFile
from fastload.resources import memory_share
from fastload.staging import FetchConfig, Holding, Stager, StageResult
from fastload.staging.planner import Range
from fastload.staging.range_pool import range_pool
from fastload.staging.stager import start_staging_process as start_process_ahead

# Bytes held in memory for objects the cache turns away, unless FetchConfig.hold_bytes or a
# loader (its look-ahead) says otherwise.
DEFAULT_HOLD_BYTES = memory_share(256 << 20, 1 / 16)  # lower in a small container
# Objects a store remembers having looked up (a few batches' worth; then it starts over).
_RECENT_OBJECTS = 1 << 14


@dataclass(frozen=True)
class RangeResult:
    """What staging one byte range did: the bytes fetched (0: cached already), or the
    error that failed it."""

    range: Range
    fetched: int
    error: Exception | None = None


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    url: str
    cache_dir: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    max_bytes: int | None = None
    policy: Policy = "lru"
    budget_counts: BudgetCounts = "disk"  # what max_bytes counts (fastload.cache.budget)
    refresh: bool = False
    ttl_s: float | None = None
    fetch: FetchConfig = field(default_factory=FetchConfig)
    verify_reads: bool = True  # cached bytes checked against their checksums on read

    def __post_init__(self) -> None:
        refuse_credentials(self.url)  # before the URL is listed, logged or kept anywhere


class CachedStore:
    """Reads a dataset's objects by key through the local cache (see the module docstring)."""

    def __init__(self, config: StoreConfig, manifest: Manifest | None = None) -> None:
        self.config = config
        self._cache: Cache | None = None
        self._stager: Stager | None = None
        self._holding: Holding | None = None
        self._pid = -1
        self._manifest = manifest
        self._recent: dict[str, RemoteObject] = {}  # objects looked up lately, by key

    @classmethod
    def open(cls, url: str, **settings: Any) -> CachedStore:
        return cls(StoreConfig(url=url, **settings))

    # --- lazily opened per process ---------------------------------------------------------

    @property
    def cache(self) -> Cache:
        self._open()
        assert self._cache is not None
        return self._cache

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            c = self.config
            if c.fetch.staging_process:  # always used: its start-up hides behind the listing
                self.start_staging_process()
            self._manifest = load_manifest(
                c.url, self.cache.dir, c.storage_options, refresh=c.refresh, ttl_s=c.ttl_s
            )
        return self._manifest

    def start_staging_process(self) -> None:
        """Starts the staging process now, where this store's rounds would go to one, for a
        caller that knows they will (``open_dataset`` of a file folder: many small objects):
        before the listing, which then hides its start-up. ``FetchConfig(staging_process=
        True)`` starts it at the listing; by default (None) a staging round starts it where
        it will be used (``Stager.stage``). A URL that cannot be opened is left to the
        listing to report."""
        try:
            fs, root = open_filesystem(self.config.url, self.config.storage_options)
        except Exception:
            return
        start_process_ahead(fs, root, self.cache, self.config.fetch)

    def _open(self) -> None:
        if self._pid == os.getpid():
            return
        c = self.config
        self._cache = Cache(
            c.cache_dir,
            max_bytes=c.max_bytes,
            policy=c.policy,
            budget_counts=c.budget_counts,
            verify_reads=c.verify_reads,
        )
        self._stager = None
        hold_bytes = c.fetch.hold_bytes
        self._holding = Holding(DEFAULT_HOLD_BYTES if hold_bytes is None else hold_bytes)
        self._pid = os.getpid()

    @property
    def holding(self) -> Holding:
        """This process's objects fetched ahead that the cache turned away."""
        self._open()
        assert self._holding is not None
        return self._holding

    @property
    def stager(self) -> Stager:
        self._open()
        if self._stager is None:
            fs, root = open_filesystem(self.config.url, self.config.storage_options)
            self._stager = Stager(
                cache=self.cache, manifest=self.manifest, fs=fs, root=root, config=self.config.fetch
            )
        return self._stager

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config, "manifest": self._manifest}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"], state["manifest"])  # type: ignore[misc]

    # --- objects ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.manifest.url

    def object(self, key: str) -> RemoteObject:
        return self.objects([key])[0]

    def objects(self, keys: Sequence[str]) -> list[RemoteObject]:
        """The listed object of each key: one vectorized lookup for those not looked up
        lately (a loader stages a batch's keys, then reads them)."""
        recent = self._recent  # shared by the loader's threads: read once per key
        got = {k: recent.get(k) for k in keys}
        missing = [k for k, o in got.items() if o is None]
        if missing:
            manifest = self.manifest
            found = manifest.indices_of(missing).tolist()
            if -1 in found:
                raise RemoteNotFoundError(
                    2,
                    f"{missing[found.index(-1)]!r} is not in the listing of "
                    f"{public_url(self.config.url)}; if the dataset changed, open it again "
                    "with refresh=True",
                )
            looked_up = dict(zip(missing, manifest.objects_at(found), strict=True))
            got.update(looked_up)
            if len(recent) > _RECENT_OBJECTS:
                recent.clear()
            recent.update(looked_up)
        return [got[k] for k in keys]  # type: ignore[misc]

    def object_url(self, key: str) -> str:
        return self.manifest.object_url(self.object(key))

    def object_keys(self) -> list[str]:
        """Every key of the listing (a Python string each: for small datasets; large ones
        work on ``manifest``'s columns)."""
        return self.manifest.keys()

    def stage(
        self,
        keys: Sequence[str],
        reads: Sequence[int] | None = None,
        *,
        here: bool = False,
    ) -> list[StageResult]:
        """Fetches keys into the cache now, concurrently, in this order of priority. With
        ``reads`` (how many reads of each key are coming), what the cache turns away is
        fetched too and held in memory for those reads (:meth:`held`). ``here``: in this
        process, for objects a reader waits for (see :meth:`Stager.stage`)."""
        objects = self.objects(keys)
        if reads is None or self.holding.max_bytes == 0:
            return self.stager.stage(objects, here=here)
        return self.stager.stage(objects, here=here, hold=self.holding, reads=reads)

    @property
    def holds_turned_away(self) -> bool:
        """Whether the cache will turn part of this dataset away (a ``pin`` budget smaller
        than the dataset) and those objects are held in memory when staged with their
        reads. (Other datasets may fill the budget too: their objects are held as well.)"""
        c = self.config
        return (
            c.policy == "pin"
            and c.max_bytes is not None
            and self.manifest.total_bytes > c.max_bytes
            and self.holding.max_bytes > 0
        )

    def held(self, key: str, reads: int = 1) -> memoryview | None:
        """key's bytes if they were fetched ahead into memory, counting ``reads`` reads of
        them (the last expected one drops them); None if they are not held."""
        if self._holding is None or self._pid != os.getpid():
            return None
        return self._holding.take(key, reads)

    def local_path(self, key: str) -> Location | None:
        """Where key's cached bytes are if it is cached (and current), without fetching."""
        obj = self.object(key)
        return self.cache.lookup(self.manifest.object_url(obj), version=obj.version, size=obj.size)

    def local_paths(self, keys: Sequence[str]) -> list[Location | None]:
        """:meth:`local_path` of many keys at once (see ``Cache.lookup_many``)."""
        objs = self.objects(keys)
        urls = [self.manifest.object_url(o) for o in objs]
        return self.cache.lookup_many(urls, [o.version for o in objs], [o.size for o in objs])

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Bytes [offset, offset + length) of key (to its end if length is None)."""
        obj = self.object(key)
        url = self.manifest.object_url(obj)
        for _ in range(3):  # a cached copy can be evicted between staging and reading
            with self.cache.use(url, version=obj.version) as where:
                if where is not None:
                    return where.read(offset, length)
            held = self.held(key)
            if held is not None:
                return bytes(held[offset : None if length is None else offset + length])
            (result,) = self.stager.stage([obj], here=True)  # the reader waits for it
            if result.outcome == "failed":
                raise self.stager.failure(obj, result)
            if result.outcome == "skipped":
                break  # the cache turned it away: read it from the remote
        return self._read_remote(obj, offset, length)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) of key, cached as an entry of their own when the
        whole object is not (a Parquet row group, a Zarr inner chunk, a range of a large
        shard): the object is never downloaded whole, and the same range is local next time.
        """
        data, _ = self._range(key, offset, length, read=True)
        assert data is not None
        return data

    def stage_range(self, key: str, offset: int, length: int) -> int:
        """Stages bytes [offset, offset + length) of key as a range entry unless the cache
        holds them (the range, or the whole object); the bytes fetched (0: none)."""
        data, fetched = self._range(key, offset, length, read=False)
        return len(data) if fetched and data is not None else 0

    def stage_ranges(
        self, ranges: Sequence[Range], done: Callable[[RangeResult], None] | None = None
    ) -> list[RangeResult]:
        """Stages each (key, offset, length) as :meth:`stage_range` does, ``fetch.jobs`` at
        a time (under the remote's AIMD limit), in order; a failure is reported, not
        raised. ``done`` is called with each result as it comes, in this thread."""

        def one(r: Range) -> RangeResult:
            try:
                return RangeResult(r, self.stage_range(*r))
            except Exception as exc:
                return RangeResult(r, 0, exc)

        if not ranges:
            return []
        futures = [range_pool().submit(one, r) for r in ranges]
        results = []
        try:
            for future in futures:
                results.append(future.result())
                if done is not None:
                    done(results[-1])  # may raise: the ranges not begun are then dropped
        finally:
            for future in futures:
                future.cancel()
        return results

    def _range(
        self, key: str, offset: int, length: int, *, read: bool
    ) -> tuple[bytes | None, bool]:
        """read_range's bytes (None if not ``read`` and cached) and whether they were
        fetched from the remote now."""
        obj = self.object(key)
        if offset < 0 or length < 0:
            raise ValueError(f"offset and length must be >= 0, got {offset}, {length}")
        if obj.size is not None:
            length = max(0, min(length, obj.size - offset))
        url = self.manifest.object_url(obj)
        with self.cache.use(url, version=obj.version) as whole:
            if whole is not None:
                return (whole.read(offset, length) if read else None), False
        span = (offset, length)
        for _ in range(3):  # a cached range can be evicted between publishing and reading
            with self.cache.use(url, version=obj.version, span=span) as where:
                if where is not None:
                    return (where.read() if read else None), False
            lock = self.cache.fetch_lock(url, span)  # waits while another process fetches it
            try:
                if self.cache.lookup(url, version=obj.version, span=span) is not None:
                    continue  # fetched by whoever held the lock
                data = self._read_remote(obj, offset, length)
                if len(data) != length:
                    raise integrity_error(url, f"received {len(data)} bytes, expected {length}")
                part = self.cache.new_part(url, span)
                part.write(data)
                self.cache.publish(part, version=obj.version)  # or turned away: still served
                return data, True
            finally:
                lock.release()
        return self._read_remote(obj, offset, length), True

    def stream(self, key: str, block_bytes: int) -> RangeFile:
        """key's object straight from the remote as a file, ``block_bytes`` a request, not
        cached: every request pinned at the listed version and retried as staged fetches are
        (an object that changed since the listing is a RemoteChangedError naming it)."""
        obj = self.object(key)
        return RangeFile(
            lambda start, end: self._read_remote(obj, start, end - start), obj.size, block_bytes
        )

    def _read_remote(self, obj: RemoteObject, offset: int, length: int | None) -> bytes:
        end = None if length is None else offset + length
        return self.stager.read_remote(obj, offset or None, end)

    def close(self) -> None:
        if self._cache is not None and self._pid == os.getpid():
            self._cache.close()
        self._cache = None
        self._stager = None
        self._holding = None
        self._pid = -1
