"""Waiting on a child process's pipe with a deadline.

``poll``, never ``select.select``: select refuses a descriptor past 1023, and a training
process (or a long test run) may hold that many open files.
"""

from __future__ import annotations

import select
from typing import Any

__all__ = ["readable_within"]


def readable_within(pipe: Any, timeout_s: float) -> bool:
    """Whether pipe (a file object or a descriptor) has data, or its end, within timeout_s
    (0: without waiting)."""
    poller = select.poll()
    poller.register(pipe, select.POLLIN | select.POLLHUP)
    wait_ms = 0 if timeout_s <= 0 else max(1, int(timeout_s * 1000))
    return bool(poller.poll(wait_ms))
