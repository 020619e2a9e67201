"""A staging round: the objects of one staging call fetched by this process's GET threads and
published into the cache a batch at a time (see :class:`Round`)."""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastload.cache import FetchLock, PartFile
from fastload.manifest import RemoteObject
from fastload.progress import Progress
from fastload.remote.transport import Buffer
from fastload.staging.config import Outcome, StageResult
from fastload.staging.holding import Holding
from fastload.staging.throttle import throttle_for

if TYPE_CHECKING:
    from fastload.staging.stager import Stager


@dataclass(slots=True)
class _Fetched:
    index: int
    data: Buffer | str | BaseException  # the bytes, why they could not be had, or a fatal error
    attempts: int = 0


class Round:
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
        self.throttle = throttle_for(self.transport, stager.config)
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
        self.tasks: queue.SimpleQueue[tuple[Round, int]] = queue.SimpleQueue()
        self._threads = 0
        self._lock = threading.Lock()

    def grow(self, count: int) -> None:
        with self._lock:
            for _ in range(count - self._threads):
                threading.Thread(target=self._serve, daemon=True, name="fastload-get").start()
                self._threads += 1

    def _serve(self) -> None:
        while True:
            # No local keeps the round: an idle thread would hold the last one it served,
            # and through it the stager, its cache's open files and the dataset, forever.
            self._get_one(*self.tasks.get())

    @staticmethod
    def _get_one(round_: Round, i: int) -> None:
        round_.get(i)


_get_threads: dict[int, _GetThreads] = {}
_get_threads_lock = threading.Lock()


def _getters() -> _GetThreads:
    """This process's GET threads (a forked child starts its own)."""
    with _get_threads_lock:
        getters = _get_threads.get(os.getpid())  # threads do not survive fork
        if getters is None:
            getters = _get_threads[os.getpid()] = _GetThreads()
        return getters
