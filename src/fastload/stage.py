"""The stage stage: fetch the objects a plan needs into the cache, concurrently and patiently.

One staging thread per request in flight does, object after object: cache hit? → take the
object's fetch lock (or wait while another process fetches it) → GET through the
transport (``fastload.remote``; obstore's GETs release the GIL) with retries,
exponential backoff and jitter → verify the size → write and publish. Threads rather than
an event loop: a GET through obstore costs ~0.3 ms of CPU from a thread and ~0.45 ms as an
awaited future, and no hand-off between a loop and a writer thread is needed. Concurrency
adapts to the remote: it halves when the remote throttles and grows back by one per window
of successes (AIMD, as TCP does); the throttle, the threads and the transport's connections
live for the process, across staging calls. An object the cache turns away (a full ``pin``
cache) is skipped, or, for a caller that will read it soon (a loader), fetched all the same
into a :class:`Holding` in memory, where its reads find it.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import fsspec

from fastload.cache import Cache, FetchLock, PartFile
from fastload.errors import FastloadError, MissingBackendError, RemoteError
from fastload.manifest import Manifest, RemoteObject
from fastload.progress import Progress
from fastload.remote import (
    backoff_s,
    classify,
    clean_cause,
    integrity_error,
    is_throttling,
    is_transient,
    path_of,
    public_url,
    scrub,
    with_retries,
)
from fastload.remote.connect import transport_for
from fastload.remote.transport import Buffer, Transport

# "held": the cache turned the object away, so it was fetched into memory (:class:`Holding`).
Outcome = Literal["cached", "fetched", "held", "skipped", "failed"]


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
    # "auto": obstore where it can send the same requests (s3:// with the s3 extra), the
    # fsspec filesystem elsewhere; "fsspec": always the filesystem (see fastload.remote.connect).
    transport: Literal["auto", "fsspec"] = "auto"
    # Stage remote objects in a process of its own (fastload.stage_process), so staging
    # never waits for, nor takes, the GIL of a training step. Opt-in for now: its start-up
    # (a fresh interpreter) lands on the first batch of a cold epoch.
    staging_process: bool = False
    # Objects the cache turns away (a full ``pin`` cache) that a loader will read soon are
    # fetched ahead anyway and held in memory until read, in at most this many bytes
    # (0: not held, read from the remote when needed). None: a loader's look-ahead.
    hold_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.jobs < 1 or not 1 <= self.min_jobs <= self.jobs:
            raise ValueError(f"need 1 <= min_jobs <= jobs, got {self.min_jobs}, {self.jobs}")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0 and timeout_s > 0")
        if self.range_bytes <= 0 or self.range_threshold_bytes <= 0:
            raise ValueError("range_bytes and range_threshold_bytes must be > 0")
        if self.hold_bytes is not None and self.hold_bytes < 0:
            raise ValueError(f"hold_bytes must be >= 0 or None, got {self.hold_bytes}")
        if self.transport not in ("auto", "fsspec"):
            raise ValueError(f'transport must be "auto" or "fsspec", got {self.transport!r}')

    def in_process(self) -> FetchConfig:
        return dataclasses.replace(self, staging_process=False)


@dataclass(frozen=True, slots=True)
class StageResult:
    url: str
    outcome: Outcome
    nbytes: int = 0
    attempts: int = 0
    error: str | None = None


@dataclass(slots=True)
class _Held:
    data: memoryview
    reads: int  # reads still expected; dropped at 0


class Holding:
    """Objects the cache turned away, fetched ahead like staged ones and kept in memory until
    read, by object key: a dataset larger than a ``pin`` cache then reads its uncached half
    from memory, whole batches at a time, instead of one synchronous GET per sample.

    Bounded by bytes: an object is dropped after the reads it was fetched for, and the
    oldest first when a new one needs room (it is then read from the remote, as without
    holding). One per dataset store and process; state per held object only.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.peak_bytes = 0
        self.dropped_unread = 0  # pushed out for room before their reads: fetched in vain
        self._held: collections.OrderedDict[str, _Held] = collections.OrderedDict()
        self._lock = threading.Lock()

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def put(self, key: str, data: Buffer, reads: int) -> bool:
        """Holds data for ``reads`` reads, making room oldest first; False if it cannot fit."""
        view = memoryview(data)
        if not self.fits(view.nbytes):
            return False
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self.nbytes -= old.data.nbytes
            while self.nbytes + view.nbytes > self.max_bytes:
                _, oldest = self._held.popitem(last=False)
                self.nbytes -= oldest.data.nbytes
                self.dropped_unread += 1
            self._held[key] = _Held(view, max(1, reads))
            self.nbytes += view.nbytes
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return True

    def expect(self, key: str, reads: int) -> bool:
        """Adds reads to a held object; False if it is not held."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.reads += reads
            return held is not None

    def take(self, key: str, reads: int = 1) -> memoryview | None:
        """A held object's bytes (None if not held), counting ``reads`` of its expected ones:
        after the last it is dropped (the caller keeps the bytes it got)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return None
            held.reads -= reads
            if held.reads <= 0:
                del self._held[key]
                self.nbytes -= held.data.nbytes
            return held.data

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            while self.nbytes > max_bytes:
                _, oldest = self._held.popitem(last=False)
                self.nbytes -= oldest.data.nbytes
                self.dropped_unread += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "objects": len(self._held),
                "bytes": self.nbytes,
                "peak_bytes": self.peak_bytes,
                "max_bytes": self.max_bytes,
                "dropped_unread": self.dropped_unread,
            }


class _Throttle:
    """AIMD concurrency: halve on throttling, +1 after a window of successes. One per remote
    and process, kept across staging calls, so a round starts where the last one ended."""

    def __init__(self, config: FetchConfig) -> None:
        self.limit = config.jobs
        self.min = config.min_jobs
        self.max = config.jobs
        self.active = 0
        self._wins = 0
        self._last_cut = 0.0
        self._changed = threading.Condition()

    def __enter__(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.active < self.limit)
            self.active += 1

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self.active -= 1
            self._changed.notify()

    def throttled(self) -> None:
        with self._changed:
            now = time.monotonic()
            if now - self._last_cut > 0.1:  # one cut per burst of refusals
                self.limit = max(self.min, self.limit // 2)
                self._last_cut = now
            self._wins = 0

    def succeeded(self) -> None:
        with self._changed:
            self._wins += 1
            if self._wins >= self.limit and self.limit < self.max:
                self.limit += 1
                self._wins = 0
                self._changed.notify_all()


# A forked child (a DataLoader worker) stages in its own threads, not in a staging process.
_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)

_throttles: dict[tuple[int, int, int], _Throttle] = {}
_shared_lock = threading.Lock()


def _throttle_for(transport: Transport, config: FetchConfig) -> _Throttle:
    key = (id(transport), config.jobs, config.min_jobs)
    with _shared_lock:
        if key not in _throttles:
            _throttles[key] = _Throttle(config)
        return _throttles[key]


@dataclass
class Stager:
    """Brings a manifest's objects into a cache; see the module docstring."""

    cache: Cache
    manifest: Manifest
    fs: fsspec.AbstractFileSystem
    root: str
    config: FetchConfig = field(default_factory=FetchConfig)

    @property
    def transport(self) -> Transport:
        return transport_for(
            self.fs, self.config.timeout_s, fsspec_only=self.config.transport == "fsspec"
        )

    def remote_path(self, obj: RemoteObject) -> str:
        return path_of(self.fs, self.root, obj.key, obj.version)

    def failure(self, obj: RemoteObject, result: StageResult) -> RemoteError:
        """The error to raise for an object whose fetch failed after its retries."""
        error = RemoteError(5, f"{result.url} could not be fetched: {result.error}", result.url)
        error.reason = result.error or ""
        return error

    def stage(
        self,
        objects: Sequence[RemoteObject],
        *,
        progress: Callable[[Progress], None] | None = None,
        here: bool = False,
        hold: Holding | None = None,
        reads: Sequence[int] | None = None,
    ) -> list[StageResult]:
        """Fetches whatever of objects is not cached yet, in the given order of priority.

        A permanent failure (not found, access refused, full disk) stops everything and is
        raised; transient failures that outlast their retries are reported per object.
        ``here`` stages in this process even where a staging process would: for an object
        a reader is waiting for, which must not queue behind a round of staging ahead.
        With ``hold``, what the cache turns away is fetched all the same and held there
        for ``reads[i]`` reads (1 each by default; 0: not held): outcome "held".
        """
        if not objects:
            return []
        tracker = Progress(callback=progress)
        if not here and self._elsewhere():
            results = self._stage_in_staging_process(objects, tracker)
            if hold is not None:
                self._hold_skipped(objects, results, hold, reads)
            return results
        return _Round(self, objects, tracker, hold, reads).run()

    def _hold_skipped(
        self,
        objects: Sequence[RemoteObject],
        results: list[StageResult],
        hold: Holding,
        reads: Sequence[int] | None,
    ) -> None:
        """Fetches into ``hold``, in this process, what the staging process skipped: it
        keeps no memory of this process's, so the bytes would cross the pipe otherwise."""
        skipped = [i for i, r in enumerate(results) if r.outcome == "skipped"]
        if not skipped:
            return
        held = _Round(
            self,
            [objects[i] for i in skipped],
            Progress(),
            hold,
            None if reads is None else [reads[i] for i in skipped],
        ).run()
        for i, result in zip(skipped, held, strict=True):
            results[i] = result

    def _elsewhere(self) -> bool:
        """Whether to stage in a staging process: for remote objects, from a process that
        was not forked (a DataLoader worker stages in its own threads), and not for the
        ``plan`` policy's cache, whose eviction needs the access order this process holds."""
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return (
            self.config.staging_process
            and protocol not in ("file", "local")
            and self.cache.plan is None
            and not _forked
        )

    def _stage_in_staging_process(
        self, objects: Sequence[RemoteObject], tracker: Progress
    ) -> list[StageResult]:
        from fastload import stage_process

        process = stage_process.for_stager(self.fs, self.root, self.cache.config, self.config)

        def progress(objects_done: int, bytes_done: int, fetched_bytes: int) -> None:
            tracker.objects_done, tracker.bytes_done = objects_done, bytes_done
            tracker.fetched_bytes = fetched_bytes
            tracker.report()

        answers = process.stage(
            objects, self.manifest.url, progress if tracker.callback is not None else None
        )
        results = [StageResult(*answer) for answer in answers]  # type: ignore[arg-type]
        if tracker.callback is not None:  # the exact totals (progress comes at most 10/s)
            tracker.objects_done = len(results)
            tracker.bytes_done = sum(r.nbytes for r in results)
            tracker.fetched_bytes = sum(r.nbytes for r in results if r.outcome == "fetched")
            tracker.report()
        return results

    def _get_with_retries(
        self, obj: RemoteObject, url: str, transport: Transport, throttle: _Throttle
    ) -> tuple[Buffer | str, int]:
        """(the bytes, attempts), or (why it failed, attempts) once transient failures
        outlast the retries; raises a permanent failure."""
        attempts = 0
        while True:
            attempts += 1
            try:
                with throttle:
                    data = self._fetch(obj, url, transport)
                throttle.succeeded()
                return data, attempts
            except RemoteError as exc:
                if not is_transient(exc):
                    raise
                if is_throttling(exc):
                    throttle.throttled()
                if attempts > self.config.retries:
                    # The reason without the URL (the report lists it apart), e.g.
                    # "503 SlowDown (Please reduce your request rate.) after 9 attempts"
                    reason = exc.reason or scrub(exc.strerror or str(exc))
                    return f"{reason} after {attempts} attempts", attempts
                c = self.config
                time.sleep(backoff_s(attempts, c.backoff_s, c.backoff_max_s))

    def _fetch(self, obj: RemoteObject, url: str, transport: Transport) -> Buffer:
        path = self.remote_path(obj)
        size = obj.size
        try:
            if size is not None and size > self.config.range_threshold_bytes:
                step = self.config.range_bytes
                parts = _range_pool().map(
                    lambda start: transport.get(path, start, min(start + step, size)),
                    range(0, size, step),
                )
                data: Buffer = b"".join(parts)
            else:
                data = transport.get(path)
        except FastloadError:
            raise
        except ImportError as exc:  # no retry brings a package: fail now, saying which
            raise MissingBackendError(
                f"fetching {public_url(url)} needs a package that is not installed "
                f"({exc}); install fastload's extra for its protocol, e.g. "
                '`pip install "fastload[s3]"` or `"fastload[http]"`'
            ) from None
        except Exception as exc:
            raise classify(exc, url) from clean_cause(exc)
        if size is not None and len(data) != size:
            raise integrity_error(url, f"received {len(data)} bytes, expected {size}")
        expected_md5 = _md5_from_version(obj.version)
        if expected_md5 is not None and hashlib.md5(data).digest() != expected_md5:
            raise integrity_error(url, "MD5 does not match the one the remote advertised")
        return data

    def read_remote(self, obj: RemoteObject, start: int | None, end: int | None) -> bytes:
        """Bytes [start, end) of obj straight from the remote (what the cache turned away,
        or a byte range), retried like a staged fetch; a refusal for the request rate
        (S3's 503 SlowDown, the Hub's 429) cuts the remote's concurrency as it does there."""
        transport = self.transport
        throttle = _throttle_for(transport, self.config)
        path = self.remote_path(obj)
        url = self.manifest.object_url(obj)

        def get() -> Buffer:
            try:
                with throttle:  # under the remote's AIMD limit, as staged fetches are
                    data = transport.get(path, start, end)
            except Exception as exc:
                if is_throttling(classify(exc, url)):
                    throttle.throttled()
                raise
            throttle.succeeded()
            return data

        c = self.config
        return bytes(with_retries(get, url, retries=c.retries, base_s=c.backoff_s))


_range_pools: dict[int, ThreadPoolExecutor] = {}


def _range_pool() -> ThreadPoolExecutor:
    """Threads for the ranges of large objects (apart from the staging threads, which wait
    on them)."""
    with _shared_lock:
        pool = _range_pools.get(os.getpid())
        if pool is None:
            pool = _range_pools[os.getpid()] = ThreadPoolExecutor(
                32, thread_name_prefix="fastload-range"
            )
        return pool


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


@dataclass(slots=True)
class _Fetched:
    index: int
    data: Buffer | str | BaseException  # the bytes, why they could not be had, or a fatal error
    attempts: int = 0


class _Round:
    """One staging call, as a pipeline: this thread looks objects up, takes their fetch
    locks and hands them to the GET threads, which hold the GIL only between requests; the
    bytes come back here to be written and published, a batch per index transaction. Only
    this thread runs per-object Python beyond the GET, so the GET threads do not queue
    for the GIL behind it (64 threads each doing all the work spent 0.5 ms per object in
    futex calls)."""

    def __init__(
        self,
        stager: Stager,
        objects: Sequence[RemoteObject],
        tracker: Progress,
        hold: Holding | None = None,
        reads: Sequence[int] | None = None,
    ) -> None:
        self.stager = stager
        self.cache = stager.cache
        self.objects = objects
        self.hold = hold
        self.reads = reads
        self.holding: set[int] = set()  # fetched for the holding area, not the cache
        self.urls = [stager.manifest.object_url(o) for o in objects]
        self.tracker = tracker
        self.results: list[StageResult | None] = [None] * len(objects)
        self.locks: dict[int, FetchLock] = {}
        self.todo: collections.deque[int] = collections.deque(range(len(objects)))
        self.waiting: dict[int, float] = {}  # locked by another process: index -> deadline
        self.done: queue.SimpleQueue[_Fetched] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.in_flight = 0

    def run(self) -> list[StageResult]:
        stager = self.stager
        self.transport = stager.transport
        self.throttle = _throttle_for(self.transport, stager.config)
        self.getters = _getters()
        self.getters.grow(min(stager.config.jobs, len(self.objects)))
        ahead = 2 * stager.config.jobs  # objects locked and queued or in flight at most
        delay = 0.002
        try:
            while self.todo or self.waiting or self.in_flight:
                while self.todo and self.in_flight < ahead:
                    self._dispatch(self.todo.popleft())
                if self.in_flight:
                    try:
                        first = self.done.get(timeout=0.05 if self.waiting else None)
                    except queue.Empty:
                        pass
                    else:
                        self._finish(self._drain(first))
                elif self.waiting:
                    self.cache.fetch_locks.wait(delay)
                    delay = min(delay * 2, 0.05)
                if self.waiting:
                    self._retry_waiting()
        finally:
            self.stop.set()  # what is still queued for the GET threads is dropped
            for lock in self.locks.values():
                lock.release()
        return [r for r in self.results if r is not None]

    def _record(self, i: int, result: StageResult) -> None:
        self.results[i] = result
        self.tracker.add(result.nbytes, fetched=result.outcome == "fetched")

    def _cached(self, i: int) -> bool:
        obj, url, cache = self.objects[i], self.urls[i], self.cache
        where = cache.lookup(url, version=obj.version, size=obj.size)
        if where is None:
            return False
        self._record(i, StageResult(url, "cached", where.size))
        return True

    def _reads(self, i: int) -> int:
        return 1 if self.reads is None else self.reads[i]

    def _holds(self, i: int, size: int = 0) -> bool:
        """Whether i, of size bytes, goes to the holding area if the cache turns it away
        (not with 0 reads, nor if larger than the area)."""
        return self.hold is not None and self._reads(i) > 0 and self.hold.fits(size)

    def _held(self, i: int) -> bool:
        """Whether i is in the holding area already (its reads are added)."""
        if self.hold is None or not self.hold.expect(self.objects[i].key, self._reads(i)):
            return False
        obj = self.objects[i]
        self._record(i, StageResult(self.urls[i], "held", obj.size or 0))
        return True

    def _dispatch(self, i: int) -> None:
        """Looks i up; if it must be fetched and its lock is free, queues it for a GET."""
        if self._cached(i) or self._held(i):
            return
        lock = self.cache.try_fetch_lock(self.urls[i])
        if lock is None:
            self.waiting.setdefault(i, time.monotonic() + self.cache.config.lock_timeout_s)
            return
        self.locks[i] = lock
        obj = self.objects[i]
        # Whoever held the lock before us may have fetched it meanwhile.
        if self._cached(i) or self._held(i):
            self._release(i)
        elif obj.size is not None and not self.cache.would_admit(self.urls[i], obj.size):
            if self._holds(i, obj.size):
                self.holding.add(i)  # fetched all the same, its lock kept until it is held
                self.in_flight += 1
                self.getters.tasks.put((self, i))
                return
            self._release(i)
            self._record(i, StageResult(self.urls[i], "skipped", 0, error="over the cache budget"))
        else:
            self.in_flight += 1
            self.getters.tasks.put((self, i))

    def _retry_waiting(self) -> None:
        now = time.monotonic()
        for i, deadline in list(self.waiting.items()):
            if now > deadline:
                raise self.cache.lock_timeout(self.urls[i])
            lock = self.cache.try_fetch_lock(self.urls[i])
            if lock is not None:
                lock.release()  # free now: the other process is done; take it in priority order
                del self.waiting[i]
                self.todo.appendleft(i)

    def _release(self, i: int) -> None:
        lock = self.locks.pop(i, None)
        if lock is not None:
            lock.release()

    def _drain(self, first: _Fetched) -> list[_Fetched]:
        batch = [first]
        while True:
            try:
                batch.append(self.done.get_nowait())
            except queue.Empty:
                return batch

    def _finish(self, batch: list[_Fetched]) -> None:
        """Writes a batch of answers into the cache and publishes them in one transaction."""
        self.in_flight -= len(batch)
        for item in batch:
            if isinstance(item.data, BaseException):
                raise item.data
        parts: list[tuple[int, PartFile, str | None]] = []
        failure: BaseException | None = None
        for item in batch:
            i, url = item.index, self.urls[item.index]
            if isinstance(item.data, str):
                self._record(i, StageResult(url, "failed", 0, item.attempts, item.data))
                continue
            assert not isinstance(item.data, BaseException)  # raised above
            if i in self.holding:
                self._keep(i, item.data, item.attempts)
                continue
            try:
                part = self.cache.new_part(url)
                part.write(item.data)  # discards itself on failure
            except BaseException as exc:  # a full disk: publish what was written, then raise
                failure = exc
                break
            parts.append((i, part, self.objects[i].version))
        published = self.cache.publish_many([(part, version) for _, part, version in parts])
        fetched = {item.index: item for item in batch}
        for (i, part, _), where in zip(parts, published, strict=True):
            item = fetched[i]
            if where is None and self._holds(i):  # turned away at publication
                self._keep(i, item.data, item.attempts)  # type: ignore[arg-type]
                continue
            outcome: Outcome = "fetched" if where is not None else "skipped"
            self._record(i, StageResult(self.urls[i], outcome, part.size, item.attempts))
        for item in batch:
            self._release(item.index)
        if failure is not None:
            raise failure

    def _keep(self, i: int, data: Buffer, attempts: int) -> None:
        """Puts fetched bytes the cache does not take into the holding area."""
        assert self.hold is not None
        nbytes = len(data)
        if self.hold.put(self.objects[i].key, data, self._reads(i)):
            self._record(i, StageResult(self.urls[i], "held", nbytes, attempts))
        else:
            error = "over the cache budget and the holding area's"
            self._record(i, StageResult(self.urls[i], "skipped", 0, attempts, error))

    def get(self, i: int) -> None:
        """On a GET thread: fetches i and hands the answer to the round's thread."""
        if self.stop.is_set():
            return
        try:
            data, attempts = self.stager._get_with_retries(
                self.objects[i], self.urls[i], self.transport, self.throttle
            )
            self.done.put(_Fetched(i, data, attempts))
        except BaseException as exc:  # permanent: the round raises it
            self.done.put(_Fetched(i, exc))


class _GetThreads:
    """This process's GET threads, kept across rounds: a round that started its own paid a
    GIL hand-off per thread (``Thread.start`` waits for the thread to run), some 5 ms each
    beside a training step that holds the GIL. Daemons: a process that exits mid-round
    must not wait for them. The throttle, not their number, bounds requests in flight."""

    def __init__(self) -> None:
        self.tasks: queue.SimpleQueue[tuple[_Round, int]] = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()

    def grow(self, count: int) -> None:
        with self._lock:
            for _ in range(count - self._threads):
                threading.Thread(target=self._serve, daemon=True, name="fastload-get").start()
                self._threads += 1

    def _serve(self) -> None:
        while True:
            round_, i = self.tasks.get()
            round_.get(i)


_get_threads: dict[int, _GetThreads] = {}


def _getters() -> _GetThreads:
    with _shared_lock:
        getters = _get_threads.get(os.getpid())  # threads do not survive fork
        if getters is None:
            getters = _get_threads[os.getpid()] = _GetThreads()
        return getters
