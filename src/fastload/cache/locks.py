"""Fetch locks: at most one process fetches an object at a time, and a dead one never blocks.

One byte of ``fetch.lock`` per entry, locked with a POSIX record lock (``fcntl.lockf``):
the kernel drops a dead process's record locks, so nothing is ever left locked by a crash.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


class FetchLocks:
    """Per-entry locks across processes: POSIX record locks on one byte each of one file.

    Record locks belong to the process, not the thread, so a table of held ids serializes
    the threads of one process. The lock file stays open while the process holds a lock in
    it: closing any descriptor of it would drop every record lock the process holds (the
    POSIX rule).
    """

    _by_path: ClassVar[dict[str, FetchLocks]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def for_path(cls, path: Path) -> FetchLocks:
        """One table per lock file per process: two tables would both "own" every lock."""
        key = os.path.realpath(path)
        with cls._registry_lock:
            if key not in cls._by_path:
                cls._by_path[key] = cls(path)
            return cls._by_path[key]

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._pid = -1
        self._held: set[str] = set()
        self._mutex = threading.Lock()
        # Notified on every release: a thread waiting for an entry another thread of this
        # process is fetching wakes when it is done, not at its next poll (up to 50 ms).
        self._released = threading.Condition(self._mutex)

    def _file(self) -> int:
        if self._pid != os.getpid():  # record locks are not inherited by a forked child
            # O_NOFOLLOW: a link planted at the lock's name is refused, not written through
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o644)
            self._pid = os.getpid()
            self._held = set()
        return self._fd

    @staticmethod
    def _offset(oid: str) -> int:
        return int(oid[:15], 16)  # 60 bits: collisions between ids are negligible

    def try_acquire(self, oid: str) -> bool:
        with self._mutex:
            if oid in self._held:
                return False
            try:
                fcntl.lockf(self._file(), fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self._offset(oid))
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    return False
                raise
            self._held.add(oid)
            return True

    def release(self, oid: str) -> None:
        with self._mutex:
            if oid in self._held and self._pid == os.getpid():
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, self._offset(oid))
            self._held.discard(oid)
            if not self._held and self._pid == os.getpid():
                # Holding none, closing drops nothing: a process that used many caches
                # (a test suite, a sweep) would otherwise keep one descriptor per cache.
                os.close(self._fd)
                self._fd, self._pid = -1, -1
            self._released.notify_all()

    def wait(self, timeout_s: float) -> None:
        """Sleeps up to timeout_s, less if a lock of this process is released meanwhile
        (another process's release is seen only by polling: the kernel tells no one)."""
        with self._mutex:
            self._released.wait(timeout_s)


@dataclass
class FetchLock:
    """A held fetch lock on one entry; release() is idempotent."""

    locks: FetchLocks
    oid: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.locks.release(self.oid)
