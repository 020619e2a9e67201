"""Drives one DALI pipeline the way DALI's own readers do: its prefetch queue kept full.

A decoder that feeds a batch, runs it and waits for it leaves the GPU idle while Python
prepares the next one (fastload's DALI backend ran at 0.58x DALI's own pipeline that way, and
a loader's threads queued behind it). Here one thread, the driver, owns the pipeline; the
loader's threads hand it their batches (:meth:`DALIFeeder.submit`) and wait for their own::

    submit(N), submit(N+1), submit(N+2) ...        (loader threads, any order of arrival)
        │
        ▼  driver thread, in submission order:
    feed N, feed N+1, feed N+2   ─ feed ahead: up to depth + 1 batches fed, not yet taken
    schedule_run                 ─ the first one runs ``depth`` iterations (DALI's prefetch)
    outputs(N) → convert → N's future      (only once N+1 is scheduled and N+2 fed)
    feed N+3, schedule_run (N+2), outputs(N+1) ...

so DALI always has the next batches while it works on one. The first ``schedule_run`` of a
pipeline consumes ``depth`` fed batches (DALI's ``_prefetch``): when fewer were submitted,
the first batch's inputs are fed again as padding and their outputs dropped.

Outputs: ``convert`` turns DALI's outputs into torch on the driver thread. On a GPU
(``stream`` given) DALI orders them on that stream; ``convert`` copies them there into
torch's memory, an event is recorded after it, and DALI's own buffers are kept until that
event has completed: torch's ``record_stream`` cannot protect memory torch did not allocate,
so handing DALI's buffer to a training step would let DALI reuse it under the step. The
caller's stream waits for the event (:attr:`Fed.ready`); nothing waits on the host. On the
CPU, ``convert`` may keep DALI's memory (DLPack, zero-copy): the default executor allocates
each run's outputs afresh and frees them when the last reference goes.

A failed run (a bad sample) invalidates a DALI pipeline and every run queued on it: each of
them fails with :class:`PipelineFailed`, the driver builds a fresh pipeline, and the callers
decide (the DALI backend then finds the bad sample on a pipeline of its own).
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastload.resources import lower_thread_priority

__all__ = ["DALIFeeder", "Fed", "PipelineFailed"]

_JOIN_S = 30.0  # close() waits this long for a run DALI is working on


class PipelineFailed(RuntimeError):
    """A run failed, taking the pipeline with it; ``error`` is DALI's. Runs queued behind it
    fail with the same error (they may be good: run them again)."""

    def __init__(self, error: BaseException, *, own: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.own = own  # whether this run's own outputs raised (else it was queued behind)


@dataclass(frozen=True, slots=True)
class Fed:
    """A run's converted outputs, and the CUDA event after which they may be used (None on
    the CPU): the consumer's stream waits on it."""

    value: Any
    ready: Any = None


@dataclass(slots=True)
class _Run:
    inputs: Mapping[str, Any]
    future: Future[Fed] | None  # None: padding for the first schedule_run


class DALIFeeder:
    """One DALI pipeline behind a driver thread (see the module docstring).

    ``build()`` returns a built pipeline whose ``prefetch_queue_depth`` is ``depth`` (called
    once here, on the caller's thread, so that its errors raise at construction, and again
    after a failed run); ``convert(outputs)`` turns one run's outputs into what callers get.
    ``stream``: the CUDA stream outputs are ordered and converted on (None on the CPU).
    ``nice``: the driver runs this many steps below the constructing thread's CPU priority
    (Linux), and builds the pipeline there, so DALI's own threads inherit it: a loader's
    ``thread_nice``, which keeps the training step on its core.
    """

    def __init__(
        self,
        build: Callable[[], Any],
        convert: Callable[[Any], Any],
        *,
        depth: int = 2,
        stream: Any = None,
        name: str = "fastload-dali",
        nice: int = 0,
    ) -> None:
        if depth < 2:
            raise ValueError(f"depth must be >= 2 (a run queued while one is taken), got {depth}")
        self._build, self._convert = build, convert
        self.depth = depth
        self._stream = stream
        self._nice = nice
        self._pipe: Any = None
        self._cv = threading.Condition()
        self._waiting: deque[_Run] = deque()  # submitted, not yet fed
        self._closed = False
        self.stats = {"runs": 0, "padding_runs": 0, "failed_runs": 0, "rebuilds": 0}
        self._built = threading.Event()
        self._build_errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._drive, name=name, daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_errors:  # raised here, on the constructing thread
            self._thread.join()
            raise self._build_errors[0]

    @property
    def pipeline(self) -> Any:
        """The pipeline now driven (for inspection; only the driver thread runs it)."""
        return self._pipe

    def submit(self, inputs: Mapping[str, Any]) -> Future[Fed]:
        """Queues one run: ``inputs`` maps each external source's name to its batch. The
        future gives a :class:`Fed`, or raises :class:`PipelineFailed`."""
        future: Future[Fed] = Future()
        with self._cv:
            if self._closed:
                raise ValueError("this DALI pipeline is closed")
            self._waiting.append(_Run(inputs, future))
            self._cv.notify_all()
        return future

    # -- the driver thread ---------------------------------------------------------------------

    def _drive(self) -> None:
        fed: deque[_Run] = deque()  # fed, not yet scheduled
        scheduled: deque[_Run] = deque()  # scheduled, outputs not yet taken
        kept: deque[tuple[Any, Any]] = deque()  # (event, DALI outputs) until the event is done
        stopped: BaseException = ValueError(
            "the DALI pipeline was closed before this batch was decoded"
        )
        lower_thread_priority(self._nice)
        try:
            self._pipe = self._build()
        except BaseException as e:
            self._build_errors.append(e)
            return
        finally:
            self._built.set()
        try:
            self._loop(fed, scheduled, kept)
        except BaseException as e:  # a bug here must not leave callers waiting forever
            stopped = RuntimeError(f"fastload's DALI driver thread stopped: {e!r}")
            with self._cv:
                self._closed = True
                fed.extend(self._waiting)
                self._waiting.clear()
            raise
        finally:
            for event, _ in kept:  # copies still reading DALI's memory: let them finish
                with contextlib.suppress(Exception):
                    event.synchronize()
            kept.clear()
            for run in [*fed, *scheduled]:
                if run.future is not None and not run.future.done():
                    run.future.set_exception(stopped)

    def _loop(self, fed: deque[_Run], scheduled: deque[_Run], kept: deque[tuple[Any, Any]]) -> None:
        primed = False  # whether the pipeline's first (prefetching) schedule_run happened
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not scheduled and not fed:
                    self._cv.wait()
                if self._closed:
                    return
                room = self.depth + 1 - len(fed) - len(scheduled)
                take = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            unfed = deque(take)
            try:
                while unfed:
                    self._feed(unfed[0])
                    fed.append(unfed.popleft())
                if not primed and fed:
                    # DALI's first schedule_run runs `depth` iterations: pad with copies.
                    while len(fed) < self.depth:
                        pad = _Run(fed[0].inputs, None)
                        self._feed(pad)
                        fed.append(pad)
                        self.stats["padding_runs"] += 1
                    self._pipe.schedule_run()
                    scheduled.extend(fed.popleft() for _ in range(self.depth))
                    primed = True
                while primed and fed and len(scheduled) < self.depth:
                    self._pipe.schedule_run()
                    scheduled.append(fed.popleft())
            except Exception as e:  # feeding or scheduling failed: every queued run with it
                fed.extend(unfed)
                self._fail(e, None, fed, scheduled)
                primed = False
                continue
            if take and len(scheduled) < self.depth:
                continue  # more may be waiting already: schedule before taking outputs
            if not scheduled:
                continue
            run = scheduled.popleft()
            try:
                value = self._take(kept)
            except Exception as e:
                self._fail(e, run, fed, scheduled)
                primed = False
                continue
            self.stats["runs"] += 1
            if run.future is not None:
                run.future.set_result(value)
            while kept and kept[0][0].query():  # DALI's buffers of copies that are done
                kept.popleft()

    def _feed(self, run: _Run) -> None:
        for name, data in run.inputs.items():
            self._pipe.feed_input(name, data)

    def _take(self, kept: deque[tuple[Any, Any]]) -> Fed:
        """The oldest scheduled run's outputs, converted (waits for DALI)."""
        if self._stream is None:
            return Fed(self._convert(self._pipe.outputs()))
        import torch

        with torch.cuda.stream(self._stream):
            outputs = self._pipe.outputs(cuda_stream=self._stream)
            value = self._convert(outputs)
            cuda: Any = torch.cuda  # its Event constructor is untyped
            ready = cuda.Event()
            ready.record(self._stream)
        kept.append((ready, outputs))  # DALI's memory outlives the copy out of it
        return Fed(value, ready)

    def _fail(
        self, error: BaseException, own: _Run | None, fed: deque[_Run], scheduled: deque[_Run]
    ) -> None:
        """Fails ``own`` and every run fed or scheduled behind it; a fresh pipeline follows."""
        self.stats["failed_runs"] += 1
        if own is not None and own.future is not None:
            own.future.set_exception(PipelineFailed(error, own=True))
        for run in [*scheduled, *fed]:
            if run.future is not None:
                run.future.set_exception(PipelineFailed(error, own=False))
        scheduled.clear()
        fed.clear()
        old, self._pipe = self._pipe, None
        shutdown_pipeline(old)
        try:
            self._pipe = self._build()
            self.stats["rebuilds"] += 1
        except Exception as e:  # cannot go on: fail what waits, and what comes
            with self._cv:
                self._closed = True
                waiting = list(self._waiting)
                self._waiting.clear()
            for run in waiting:
                if run.future is not None:
                    run.future.set_exception(PipelineFailed(e, own=False))

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the driver (after the run DALI is on) and the pipeline; idempotent. Runs not
        yet decoded fail with ``ValueError``; outputs already returned stay valid."""
        with self._cv:
            already = self._closed
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        closed = ValueError("the DALI pipeline was closed before this batch was decoded")
        for run in waiting:
            if run.future is not None and not run.future.done():
                run.future.set_exception(closed)
        if threading.current_thread() is not self._thread:
            self._thread.join(_JOIN_S)
        if already or self._thread.is_alive():
            return  # a run still in DALI: leave the pipeline to it
        pipe, self._pipe = self._pipe, None
        shutdown_pipeline(pipe)


def shutdown_pipeline(pipe: Any) -> None:
    """Stops a pipeline now rather than when it is garbage collected.

    DALI has no public close; ``Pipeline.__del__`` calls ``_shutdown``, which is what we call.
    """
    if pipe is None:
        return
    shutdown = getattr(pipe, "_shutdown", None)
    if callable(shutdown):
        with contextlib.suppress(Exception):
            shutdown()
