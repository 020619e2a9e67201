"""AIMD concurrency per remote: halve when the remote throttles, grow back by one per window
of successes (as TCP does). One per remote and process, across staging calls and range
reads alike."""

from __future__ import annotations

import threading
import time

from fastload.remote.transport import Transport
from fastload.staging.config import FetchConfig


class Throttle:
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


_throttles: dict[tuple[int, int, int], Throttle] = {}
_throttles_lock = threading.Lock()


def throttle_for(transport: Transport, config: FetchConfig) -> Throttle:
    """The throttle of transport's remote in this process."""
    key = (id(transport), config.jobs, config.min_jobs)
    with _throttles_lock:
        if key not in _throttles:
            _throttles[key] = Throttle(config)
        return _throttles[key]
