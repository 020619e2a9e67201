"""AIMD concurrency per remote: halve when the remote throttles, grow back by one per window
of successes (as TCP does). One per remote and process, shared by everything that sends it
requests: staging's GETs and range reads, and listings' pages.

It lives in ``remote/`` (below ``staging/``) so the listing code can take its turn in the
same throttle as the GETs without importing upward.
"""

from __future__ import annotations

import threading
import time


class Throttle:
    """AIMD concurrency: halve on throttling, +1 after a window of successes. One per remote
    and process, kept across staging calls, so a round starts where the last one ended."""

    def __init__(self, jobs: int, min_jobs: int = 1) -> None:
        self.limit = jobs
        self.min = min_jobs
        self.max = jobs
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
_latest: dict[int, Throttle] = {}  # a remote's throttle most recently asked for
_throttles_lock = threading.Lock()


def throttle_of(remote: object, jobs: int, min_jobs: int) -> Throttle:
    """The throttle of remote (its transport) for these limits, in this process."""
    key = (id(remote), jobs, min_jobs)
    with _throttles_lock:
        if key not in _throttles:
            _throttles[key] = Throttle(jobs, min_jobs)
        _latest[id(remote)] = _throttles[key]
        return _throttles[key]


def shared_throttle(remote: object, default_jobs: int) -> Throttle:
    """The throttle staging uses for remote if it has one (a listing then takes turns with
    the GETs), else one of default_jobs that staging's would not share."""
    with _throttles_lock:
        found = _latest.get(id(remote))
    return found if found is not None else throttle_of(remote, default_jobs, 1)
