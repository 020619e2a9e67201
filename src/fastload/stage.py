"""The stage stage: fetch the objects a plan needs into the cache, concurrently and patiently.

One coroutine per object does: cache hit? → take the object's fetch lock (or wait while
another process fetches it) → fetch with retries, exponential backoff and jitter → verify
the size → publish. Async fsspec backends (s3, gcs, http, ...) run it on fsspec's event
loop; others run the same coroutine with the blocking calls on threads. Concurrency adapts
to the remote: it halves when the remote throttles and grows back by one per window of
successes (AIMD, as TCP does).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import fsspec.asyn

from fastload.cache import Cache, FetchLock
from fastload.errors import CacheError, FastloadError, RemoteError
from fastload.manifest import Manifest, RemoteObject
from fastload.presigned import NotHandled, PresignedGets
from fastload.remote import (
    backoff_s,
    classify,
    clean_cause,
    integrity_error,
    is_throttling,
    is_transient,
    path_of,
    scrub,
)

Outcome = Literal["cached", "fetched", "skipped", "failed"]


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How hard to pull from the remote. Units are in the names."""

    jobs: int = 64  # requests in flight at most
    min_jobs: int = 2  # throttling never pushes concurrency below this
    retries: int = 8  # attempts after the first, for transient failures
    backoff_s: float = 0.05  # first retry waits up to this, doubling each time
    backoff_max_s: float = 5.0
    timeout_s: float = 60.0  # per request
    range_threshold_bytes: int = 64 << 20  # objects larger than this are fetched in ranges
    range_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.jobs < 1 or not 1 <= self.min_jobs <= self.jobs:
            raise ValueError(f"need 1 <= min_jobs <= jobs, got {self.min_jobs}, {self.jobs}")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0 and timeout_s > 0")
        if self.range_bytes <= 0 or self.range_threshold_bytes <= 0:
            raise ValueError("range_bytes and range_threshold_bytes must be > 0")


@dataclass(frozen=True, slots=True)
class StageResult:
    url: str
    outcome: Outcome
    nbytes: int = 0
    attempts: int = 0
    error: str | None = None


@dataclass
class _Progress:
    objects_done: int = 0
    bytes_done: int = 0
    fetched_bytes: int = 0
    callback: Callable[[_Progress], None] | None = None

    def add(self, result: StageResult) -> None:
        self.objects_done += 1
        self.bytes_done += result.nbytes
        if result.outcome == "fetched":
            self.fetched_bytes += result.nbytes
        if self.callback is not None:
            self.callback(self)


class _Throttle:
    """AIMD concurrency: halve on throttling, +1 after a window of successes."""

    def __init__(self, config: FetchConfig) -> None:
        self.limit = config.jobs
        self.min = config.min_jobs
        self.max = config.jobs
        self.active = 0
        self._wins = 0
        self._last_cut = 0.0
        self._changed = asyncio.Condition()

    async def __aenter__(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.active < self.limit)
            self.active += 1

    async def __aexit__(self, *exc: object) -> None:
        async with self._changed:
            self.active -= 1
            self._changed.notify_all()

    async def throttled(self) -> None:
        async with self._changed:
            now = time.monotonic()
            if now - self._last_cut > 0.1:  # one cut per burst of refusals
                self.limit = max(self.min, self.limit // 2)
                self._last_cut = now
            self._wins = 0

    async def succeeded(self) -> None:
        async with self._changed:
            self._wins += 1
            if self._wins >= self.limit and self.limit < self.max:
                self.limit += 1
                self._wins = 0
                self._changed.notify_all()


@dataclass
class Stager:
    """Brings a manifest's objects into a cache; see the module docstring."""

    cache: Cache
    manifest: Manifest
    fs: fsspec.AbstractFileSystem
    root: str
    config: FetchConfig = field(default_factory=FetchConfig)

    def remote_path(self, obj: RemoteObject) -> str:
        return path_of(self.fs, self.root, obj.key)

    def failure(self, obj: RemoteObject, result: StageResult) -> RemoteError:
        """The error to raise for an object whose fetch failed after its retries."""
        error = RemoteError(5, f"{result.url} could not be fetched: {result.error}", result.url)
        error.reason = result.error or ""
        return error

    def stage(
        self,
        objects: Sequence[RemoteObject],
        *,
        progress: Callable[[_Progress], None] | None = None,
    ) -> list[StageResult]:
        """Fetches whatever of objects is not cached yet, in the given order of priority.

        A permanent failure (not found, access refused, full disk) stops everything and is
        raised; transient failures that outlast their retries are reported per object.
        """
        tracker = _Progress(callback=progress)
        if getattr(self.fs, "async_impl", False):
            return fsspec.asyn.sync(self.fs.loop, self._stage_all, objects, tracker)  # type: ignore[no-any-return]
        return asyncio.run(self._stage_all(objects, tracker))

    async def _stage_all(
        self, objects: Sequence[RemoteObject], tracker: _Progress
    ) -> list[StageResult]:
        throttle = _Throttle(self.config)
        results: list[StageResult | None] = [None] * len(objects)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(objects)):
            queue.put_nowait(i)
        fatal: list[BaseException] = []

        async def worker() -> None:
            while not fatal:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                try:
                    result = await self._stage_one(objects[i], throttle, presigned)
                except (RemoteError, CacheError) as exc:
                    if isinstance(exc, RemoteError) and is_transient(exc):
                        raise  # _stage_one reports those; anything else is a bug
                    fatal.append(exc)
                    return
                results[i] = result
                tracker.add(result)

        presigned = await PresignedGets.open(self.fs, self.config.jobs)
        workers = [
            asyncio.ensure_future(worker()) for _ in range(min(self.config.jobs, len(objects)))
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            if presigned is not None:
                await presigned.close()
        if fatal:
            raise fatal[0]
        return [r for r in results if r is not None]

    async def _stage_one(
        self, obj: RemoteObject, throttle: _Throttle, presigned: PresignedGets | None
    ) -> StageResult:
        url = self.manifest.object_url(obj)
        cache = self.cache
        if cache.lookup(url, version=obj.version, size=obj.size) is not None:
            return StageResult(url, "cached", obj.size or cache.path_for(url).stat().st_size)
        lock = await self._fetch_lock(url)
        try:
            # Whoever held the lock before us may have fetched it meanwhile.
            if cache.lookup(url, version=obj.version, size=obj.size) is not None:
                return StageResult(url, "cached", obj.size or cache.path_for(url).stat().st_size)
            if obj.size is not None and not cache.would_admit(url, obj.size):
                return StageResult(url, "skipped", 0, error="over the cache budget")
            attempts = 0
            while True:
                attempts += 1
                try:
                    async with throttle:
                        data = await self._fetch(obj, url, presigned)
                    await throttle.succeeded()
                    break
                except RemoteError as exc:
                    if not is_transient(exc):
                        raise
                    if is_throttling(exc):
                        await throttle.throttled()
                    if attempts > self.config.retries:
                        # The reason without the URL (the report lists it apart), e.g.
                        # "503 SlowDown (Please reduce your request rate.) after 9 attempts"
                        reason = exc.reason or scrub(exc.strerror or str(exc))
                        error = f"{reason} after {attempts} attempts"
                        return StageResult(url, "failed", 0, attempts, error)
                    c = self.config
                    await asyncio.sleep(backoff_s(attempts, c.backoff_s, c.backoff_max_s))
            published = await asyncio.to_thread(self._write_and_publish, url, obj, data)
            outcome: Outcome = "fetched" if published else "skipped"
            return StageResult(url, outcome, len(data), attempts)
        finally:
            lock.release()

    async def _fetch_lock(self, url: str) -> FetchLock:
        """The object's fetch lock; while another process holds it, wait without blocking."""
        deadline = time.monotonic() + self.cache.config.lock_timeout_s
        delay = 0.002
        while (lock := self.cache.try_fetch_lock(url)) is None:
            if time.monotonic() > deadline:
                raise self.cache.lock_timeout(url)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
        return lock

    async def _fetch(self, obj: RemoteObject, url: str, presigned: PresignedGets | None) -> bytes:
        path = self.remote_path(obj)
        size = obj.size
        try:
            if size is not None and size > self.config.range_threshold_bytes:
                step = self.config.range_bytes
                parts = await asyncio.gather(
                    *(
                        self._cat(path, start, min(start + step, size), presigned)
                        for start in range(0, size, step)
                    )
                )
                data = b"".join(parts)
            else:
                data = await self._cat(path, None, None, presigned)
        except FastloadError:
            raise
        except Exception as exc:
            raise classify(exc, url) from clean_cause(exc)
        if size is not None and len(data) != size:
            raise integrity_error(url, f"received {len(data)} bytes, expected {size}")
        expected_md5 = _md5_from_version(obj.version)
        if expected_md5 is not None and hashlib.md5(data).digest() != expected_md5:
            raise integrity_error(url, "MD5 does not match the one the remote advertised")
        return data

    async def _cat(
        self, path: str, start: int | None, end: int | None, presigned: PresignedGets | None
    ) -> bytes:
        if presigned is not None and not presigned.declined:
            try:
                return await self._within_timeout(path, presigned.get(path, start, end))
            except NotHandled:
                pass  # s3fs's to answer: it follows regions and redirects
        fs: Any = self.fs
        if getattr(fs, "async_impl", False):
            call = fs._cat_file(path, start=start, end=end)
        else:
            call = asyncio.to_thread(fs.cat_file, path, start=start, end=end)
        return await self._within_timeout(path, call)

    async def _within_timeout(self, path: str, call: Awaitable[bytes]) -> bytes:
        try:
            return await asyncio.wait_for(call, self.config.timeout_s)
        except TimeoutError:
            # _fetch makes it a RemoteError naming the object's URL
            raise TimeoutError(f"no complete answer within {self.config.timeout_s:g}s") from None

    def _write_and_publish(self, url: str, obj: RemoteObject, data: bytes) -> bool:
        part = self.cache.new_part(url)
        try:
            part.write(data)
        except BaseException:
            part.discard()
            raise
        return self.cache.publish(part, version=obj.version) is not None


def _md5_from_version(version: str | None) -> bytes | None:
    """The MD5 a backend vouches for (GCS md5Hash), if the manifest recorded one."""
    if not version:
        return None
    for part in version.split(";"):
        key, _, value = part.partition("=")
        if key == "md5Hash" and value:
            try:
                return base64.b64decode(value)
            except ValueError:
                return None
    return None
