"""Counters every stage of a loader adds to, read back as a plain dict by ``loader.stats()``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

# Skipped samples listed by name in stats(); beyond this only the count grows.
_SKIPPED_LISTED = 20


class LoaderStats:
    """Seconds and counts per stage, safe to add to from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: defaultdict[str, float] = defaultdict(float)
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._skipped: list[str] = []
        self._info: dict[str, Any] = {}
        self.started = time.perf_counter()
        self._cpu_started = time.process_time()

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._seconds[stage] += seconds
            self._counts[stage] += count

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def counted(self, name: str) -> int:
        """One count so far: a cheap read for a caller on every batch."""
        with self._lock:
            return self._counts.get(name, 0)

    @contextlib.contextmanager
    def timed(self, stage: str, count: int = 1) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - start, count)

    def set_info(self, name: str, value: Any) -> None:
        with self._lock:
            self._info[name] = value

    def skipped(self, reasons: list[str]) -> None:
        with self._lock:
            self._counts["skipped_samples"] += len(reasons)
            room = _SKIPPED_LISTED - len(self._skipped)
            self._skipped += reasons[: max(0, room)]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            seconds, counts = dict(self._seconds), dict(self._counts)
            skipped, info = list(self._skipped), dict(self._info)
        elapsed = time.perf_counter() - self.started
        cpu = time.process_time() - self._cpu_started
        stages = {
            name: {"seconds": round(seconds[name], 6), "calls": counts.get(name, 0)}
            for name in sorted(seconds)
        }
        batches, samples = counts.get("batches", 0), counts.get("samples", 0)
        wait, step = seconds.get("wait", 0.0), seconds.get("step", 0.0)
        # Objects read that this loader did not have to fetch were in the cache already.
        counts["cache_misses"] = counts.get("cache_misses", 0)
        counts["cache_hits"] = max(0, counts.pop("objects_needed", 0) - counts["cache_misses"])
        return {
            **info,
            "elapsed_s": round(elapsed, 6),
            "batches": batches,
            "samples": samples,
            "samples_per_s": round(samples / elapsed, 3) if elapsed > 0 else 0.0,
            # The share of the training loop's time spent waiting for the next batch, timed
            # inside the loader's __next__ (freeing the previous batch counts as the step).
            "wait_fraction": round(wait / (wait + step), 6) if wait + step > 0 else 0.0,
            # What `fl.doctor(loader)` starts from: the training step as it ran here, the
            # waits between steps, and the cores the process kept busy (loader and step).
            "step_s_mean": round(step / counts["step"], 6) if counts.get("step") else None,
            "wait_s_mean": round(wait / counts["wait"], 6) if counts.get("wait") else None,
            "cpu_cores": round(cpu / elapsed, 3) if elapsed > 0 else 0.0,
            # Calls per batch that release the GIL and wait to take it back: beside a step
            # that holds it, each may wait out a switch interval (5 ms).
            "gil_handoffs_per_batch": (
                round(counts.get("gil_handoffs", 0) / batches, 3) if batches else None
            ),
            "stages": stages,
            "counts": {k: v for k, v in sorted(counts.items()) if k not in stages},
            "skipped_samples": counts.get("skipped_samples", 0),
            # objects changed on the remote since the listing (on_change="skip")
            "changed_objects": counts.get("changed_objects", 0),
            "skipped_examples": skipped,
        }
