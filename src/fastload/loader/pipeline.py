"""One pass over a loader's batches on threads: dispatch → stage ahead → load → in order.

A dispatcher thread takes index batches from the sampler and stages their shards into the
cache up to ``lookahead`` batches ahead of the training step; ``workers`` threads load
batches (read, decode, collate, start the copy to the device) at most ``prefetch`` ahead;
the consumer takes them in sampler order. A pass's staging rounds start at one batch and
double, so its first batch waits for its own objects only (a first round of 8 batches
had batch 0's worker wait on objects the round had locked: a cold first batch took
0.7-1.3 s instead of 0.4 s). With ``load_after_stage``, a batch is loaded only once its
staging round is done (objects held in memory for a count of reads must not be read
before that count is set). Every wait is bounded and rechecks
``closed``, so ``close()`` (on ``break``, on garbage collection, at exit) stops every
thread, and an error in any thread reaches the consumer at the batch it belongs to, naming
the stage.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from fastload.loader.stats import LoaderStats
from fastload.resources import lower_thread_priority

# Threads wake at least this often to notice close(), whatever else they wait for.
_POLL_S = 0.1
# At exit, how long the loader's threads get to finish the batch in hand: one still inside a
# native call when the interpreter finalizes would otherwise be ended mid-call (see
# native/gil_release.hpp); past this, such a call parks its thread instead.
_EXIT_WAIT_S = 2.0


class LoaderTimeoutError(RuntimeError):
    """No batch arrived within the loader's ``timeout`` (torch raises RuntimeError too)."""


class _Failure:
    """An exception raised by a thread, kept for the consumer with the batch it hit."""

    def __init__(self, error: BaseException, stage: str, seq: int) -> None:
        self.error, self.stage, self.seq = error, stage, seq

    def raise_(self) -> None:
        error = self.error
        if hasattr(error, "add_note") and not getattr(error, "_fastload_noted", False):
            error.add_note(f"fastload: raised in the {self.stage} stage, batch {self.seq}")
            error._fastload_noted = True  # type: ignore[attr-defined]
        raise error


# Every pass with threads, until they have all ended (a thread keeps its pass alive): a
# pass dropped after `break` has its threads still finishing a batch.
_passes: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    """Stops every pass's threads before the interpreter finalizes, each after the batch in
    hand, waiting at most _EXIT_WAIT_S in all."""
    passes = list(_passes)
    for p in passes:
        p.close(wait_s=0.0)
    deadline = time.monotonic() + _EXIT_WAIT_S
    for p in passes:
        p.join(deadline)


class Pipeline:
    """The batches of one pass, loaded ahead on threads and handed out in order.

    ``load(seq, indices)`` builds batch ``seq``; ``stage(indices)`` (optional) fetches what
    those samples need into the cache. ``workers=0`` loads in the consumer's thread, as
    torch does without worker processes.
    """

    def __init__(
        self,
        batches: Iterator[Any],
        load: Callable[[int, Any], Any],
        *,
        workers: int,
        prefetch: int,
        stage: Callable[[list[Any]], None] | None = None,
        lookahead: int = 0,
        stage_round: int = 8,
        timeout_s: float = 0.0,
        load_after_stage: bool = False,
        stats: LoaderStats,
        nice: int = 0,
    ) -> None:
        self._batches = batches
        self._load = load
        self._stage = stage
        self._workers = workers
        self._prefetch = max(1, prefetch)
        self._lookahead = max(self._prefetch, lookahead)
        self._stage_round = max(1, stage_round)
        self._timeout_s = timeout_s
        self.stats = stats
        self._cv = threading.Condition()
        self._todo: deque[tuple[int, Any]] = deque()  # dispatched, not yet taken by a worker
        self._done: dict[int, Any] = {}  # seq -> batch or _Failure
        self._dispatched = 0  # batches taken from the sampler so far
        self._next = 0  # the seq the consumer takes next
        self._exhausted = False  # the sampler has no more batches
        self._wait_for_stage = load_after_stage and stage is not None
        self._staged = 0  # batches whose staging round is done (with _wait_for_stage)
        self._round = 1  # batches this round (then 2, 4, ... up to stage_round)
        self._closed = False
        self._nice = nice
        self._threads: list[threading.Thread] = []
        self._worker_threads: dict[int, threading.Thread] = {}
        if workers > 0:
            _passes.add(self)
            self._start(self._dispatch, "fastload-dispatch")
            self._start_workers()

    def _start_workers(self) -> None:
        for i in range(self._workers):
            thread = self._worker_threads.get(i)
            if thread is None or not thread.is_alive():
                self._worker_threads[i] = self._start(
                    functools.partial(self._work, i), f"fastload-worker-{i}"
                )

    def retune(self, *, workers: int, prefetch: int, lookahead: int) -> None:
        """Changes the threads, the batches loaded ahead and those staged ahead while the
        pass runs (an autotuner's move): a worker beyond ``workers`` stops after the batch
        in hand. The batches and their order are the same whatever these are."""
        if self._workers == 0 or workers < 1:
            raise ValueError("a pass with loader threads keeps at least one")
        with self._cv:
            if self._closed:
                return
            self._workers = workers
            self._prefetch = max(1, prefetch)
            self._lookahead = max(self._prefetch, lookahead)
            self._cv.notify_all()
            self._start_workers()

    def limit_prefetch(self, prefetch: int) -> None:
        """Loads at most ``prefetch`` batches ahead from now on (never more than before):
        batches that weigh more than expected must not fill the memory. Those already
        loaded stay; no new one starts until the consumer is within the new depth."""
        with self._cv:
            self._prefetch = max(1, min(self._prefetch, prefetch))

    def _start(self, target: Callable[[], None], name: str) -> threading.Thread:
        def run() -> None:
            lower_thread_priority(self._nice)
            target()

        thread = threading.Thread(target=run, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()
        return thread

    # --- threads -----------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Takes index batches from the sampler while within the look-ahead, then stages the
        newly taken ones (in sampler order) while the workers load the earlier ones."""
        while True:
            fresh: list[Any] = []
            with self._cv:
                while not self._closed and self._dispatched >= self._next + self._lookahead:
                    self._cv.wait(_POLL_S)
                if self._closed:
                    return
                room = min(self._round, self._next + self._lookahead - self._dispatched)
                self._round = min(2 * self._round, self._stage_round)
            for _ in range(room):
                try:
                    indices = next(self._batches)
                except StopIteration:
                    with self._cv:
                        self._exhausted = True
                        self._cv.notify_all()
                    break
                except BaseException as e:  # the sampler failed: the next batch carries it
                    with self._cv:
                        self._done[self._dispatched] = _Failure(e, "sampler", self._dispatched)
                        self._dispatched += 1
                        self._exhausted = True
                        self._cv.notify_all()
                    break
                with self._cv:
                    self._todo.append((self._dispatched, indices))
                    self._dispatched += 1
                    self._cv.notify_all()
                fresh.append(indices)
            try:
                if fresh and self._stage is not None:
                    with self.stats.timed("stage"):
                        self._stage(fresh)
            except Exception:
                # Not fatal: each worker reads through the cache, which fetches what is
                # missing and raises the error, with its URL, at the batch that needs it.
                self.stats.count("stage_errors")
            finally:
                with self._cv:
                    self._staged = self._dispatched
                    self._cv.notify_all()
            with self._cv:
                if self._exhausted:
                    return

    def _work(self, index: int) -> None:
        while True:
            with self._cv:
                while not self._closed and not (self._todo and self._ready(self._todo[0][0])):
                    if (self._exhausted and not self._todo) or index >= self._workers:
                        return
                    self._cv.wait(_POLL_S)
                if self._closed or index >= self._workers:
                    return
                seq, indices = self._todo.popleft()
            result: Any
            try:
                result = self._load(seq, indices)
            except BaseException as e:
                result = _Failure(e, getattr(e, "_fastload_stage", "load"), seq)
            with self._cv:
                self._done[seq] = result
                self._cv.notify_all()

    def _ready(self, seq: int) -> bool:
        """Whether batch seq may be loaded now (call with the lock held)."""
        staged = not self._wait_for_stage or seq < self._staged
        return staged and seq < self._next + self._prefetch

    # --- consumer ----------------------------------------------------------------------------

    def __iter__(self) -> Pipeline:
        return self

    def __next__(self) -> Any:
        if self._workers == 0:
            return self._next_inline()
        deadline = time.perf_counter() + self._timeout_s if self._timeout_s > 0 else None
        with self._cv:
            while self._next not in self._done:
                if self._closed:
                    raise StopIteration
                if self._exhausted and self._next >= self._dispatched:
                    raise StopIteration
                if deadline is not None and time.perf_counter() > deadline:
                    raise LoaderTimeoutError(
                        f"DataLoader timed out after {self._timeout_s} seconds waiting for "
                        f"batch {self._next}"
                    )
                if not any(t.is_alive() for t in self._threads[1:]):
                    raise RuntimeError("fastload's loader threads stopped without a result")
                self._cv.wait(_POLL_S)
            result = self._done.pop(self._next)
            self._next += 1
            self._cv.notify_all()
        if isinstance(result, _Failure):
            self.close()
            result.raise_()
        return result

    def _next_inline(self) -> Any:
        if self._closed:
            raise StopIteration
        indices = next(self._batches)  # StopIteration ends the pass
        seq, self._next = self._next, self._next + 1
        try:
            return self._load(seq, indices)
        except BaseException as e:
            _Failure(e, getattr(e, "_fastload_stage", "load"), seq).raise_()
            raise  # unreachable: raise_ raises

    def close(self, wait_s: float = _POLL_S) -> None:
        """Stops the threads (they finish the batch in hand, then exit), waiting at most
        wait_s for each; idempotent."""
        with self._cv:
            self._closed = True
            self._todo.clear()
            self._done.clear()
            self._cv.notify_all()
        if wait_s > 0:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=wait_s)

    def join(self, deadline: float) -> None:
        """Waits until the threads have ended, or time.monotonic() passes deadline."""
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def __del__(self) -> None:
        self.close()
