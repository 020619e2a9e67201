"""Progress of long work (staging, warming, indexing, listing) and the terminal line that
shows it. The ground floor: it imports nothing of fastload, so every layer may report."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO


@dataclass
class Progress:
    """Objects and bytes done so far; ``callback`` sees it after each change."""

    objects_done: int = 0
    bytes_done: int = 0
    fetched_bytes: int = 0  # of bytes_done, those that came from the remote
    callback: Callable[[Progress], None] | None = None

    def add(self, nbytes: int, *, fetched: bool) -> None:
        self.objects_done += 1
        self.bytes_done += nbytes
        if fetched:
            self.fetched_bytes += nbytes
        self.report()

    def report(self) -> None:
        if self.callback is not None:
            self.callback(self)


class ProgressBar:
    """One line on a terminal, rewritten at most ten times a second; silent elsewhere."""

    def __init__(self, total_objects: int, total_bytes: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.total_objects = total_objects
        self.total_bytes = total_bytes
        self.start = time.monotonic()
        self._last = 0.0

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and p.objects_done < self.total_objects):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        rate = p.fetched_bytes / elapsed
        left = max(self.total_bytes - p.bytes_done, 0)
        eta = f"{left / rate:5.0f}s" if rate > 0 else "    ?"
        self.stream.write(
            f"\r{p.objects_done:>9,}/{self.total_objects:,} objects  "
            f"{p.bytes_done / 1e6:>9,.1f}/{self.total_bytes / 1e6:,.1f} MB  "
            f"{rate / 1e6:7.1f} MB/s  ETA {eta}"
        )
        if p.objects_done >= self.total_objects:
            self.stream.write("\n")
        self.stream.flush()
