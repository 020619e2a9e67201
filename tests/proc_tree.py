"""The process tree from /proc: who descends from whom, and waiting for processes to go."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable


def parents() -> dict[int, int]:
    """pid -> parent pid of every process now (zombies included)."""
    found: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # the name may hold spaces
        found[int(entry)] = int(fields[1])
    return found


def descendants(pid: int) -> set[int]:
    tree = parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        children = {p for p, parent in tree.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def alive(pids: Iterable[int]) -> set[int]:
    """The ones still running (a zombie has finished: only its parent's wait is missing)."""
    running = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X"):
            running.add(pid)
    return running


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def wait_gone(pids: Iterable[int], deadline_s: float) -> set[int]:
    """Waits until none of pids runs, or deadline_s passes (a guard against hanging, not a
    measurement); returns those still running."""
    pids = set(pids)
    end = time.monotonic() + deadline_s
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.1)
    return alive(pids)
