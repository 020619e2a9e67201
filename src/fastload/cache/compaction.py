"""Compaction: winning back the bytes dead inside segments.

A dropped packed entry (a stale version, a failed check) leaves its bytes in its segment,
counted, until the whole segment goes; under ``pin`` nothing else ever makes a segment go,
so a changed dataset would be turned away for good. Compaction rewrites a segment whose
live fraction is low: its live entries are copied, in order, into a new segment, the rows
are moved to it and the old segment forgotten in one index transaction, and the old file is
unlinked only after that commits.

Safety, the same rules as eviction and publication:

- the old segment is locked exclusively (``flock``, without waiting) for the whole
  rewrite, so one a reader holds is never compacted, and a reader arriving meanwhile waits,
  then sees the file replaced and looks the entry up again;
- the new segment is written under ``tmp/`` with a shared lock and renamed into
  ``segments/`` before the transaction; a crash before the commit leaves a segment file the
  index does not know (removed by the next open, as a dead writer's), a crash after it
  leaves the old file unknown (removed the same way). Nothing is ever counted twice: the
  totals change in the transaction that moves the rows.

It runs on a budget of I/O: when ``pin`` is over budget, compaction may copy what credit
allows, least live segment first; credit is one segment's worth when the cache opens, grows
by ``IO_PER_BYTE`` bytes per byte a publish needs, and is capped at two segments' worth, so
no publish copies more than that. ``Cache.compact`` (``fastload cache compact``) has no
limit.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastload.cache.storage import disk_error, pread_exactly

if TYPE_CHECKING:
    from fastload.cache.core import Cache

LIVE_FRACTION = 0.75  # `fastload cache compact` rewrites segments less live than this
IO_PER_BYTE = 4  # bytes a publish under pressure may copy, per byte it publishes
_CANDIDATES = 16  # segments considered per call, least live first


@dataclass
class Rewrite:
    """A segment rewritten in an open transaction: the old file to unlink once it commits,
    the new one to remove if it does not."""

    old_path: str
    old_fd: int
    new_path: str | None = None  # None: nothing was live, nothing written
    new_fd: int = -1

    def finish(self, committed: bool) -> None:
        gone = self.old_path if committed else self.new_path
        if gone is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(gone)
        os.close(self.old_fd)  # readers waiting on it now find it gone, and look again
        if self.new_fd >= 0:
            os.close(self.new_fd)
            self.new_fd = -1


def io_budget(size: int) -> int:
    return IO_PER_BYTE * size


def compact(
    cache: Cache,
    db: sqlite3.Connection,
    *,
    need_bytes: int | None = None,
    io_bytes: int | None = None,
    live_fraction: float = LIVE_FRACTION,
) -> int:
    """Rewrites segments, least live first, inside the caller's transaction; the bytes
    freed. With ``need_bytes`` it stops once that much is freed and considers any segment
    with dead bytes; ``io_bytes`` (added to what earlier calls left unspent) bounds the
    bytes copied. The caller must call ``cache.finish_rewrites(committed)`` after the
    transaction."""
    if io_bytes is not None:
        cheapest = cache.storage.segment_bytes or io_bytes
        cache.compaction_credit = min(cache.compaction_credit + io_bytes, 2 * cheapest)
    threshold = 1.0 if need_bytes is not None else live_fraction
    freed = 0
    active = cache.storage.active_segment()
    rows = db.execute(
        "SELECT id, size, live FROM segments WHERE live < size * ? AND size > 0"
        " ORDER BY CAST(live AS REAL) / size, id LIMIT ?",
        (threshold, _CANDIDATES),
    ).fetchall()
    for segment, size, live in rows:
        if need_bytes is not None and freed >= need_bytes:
            break
        if segment == active:
            continue
        if io_bytes is not None:
            if live > cache.compaction_credit:
                continue
            cache.compaction_credit -= live
        rewrite = rewrite_segment(cache, db, segment)
        if rewrite is not None:
            freed += size - live
    return freed


def rewrite_segment(cache: Cache, db: sqlite3.Connection, segment: int) -> Rewrite | None:
    """Copies segment's live entries into a new segment and moves their rows to it; None
    if a reader holds it. The old file stays until :meth:`Rewrite.finish`."""
    storage, index = cache.storage, cache.index
    old_path = storage.segment_path(segment)
    old_fd = storage.lock_unused(old_path)
    if old_fd is None:
        return None
    members = db.execute(
        "SELECT id, position, size FROM objects WHERE segment = ? ORDER BY position", (segment,)
    ).fetchall()
    if not members:  # nothing live: it simply goes
        index.remove_segment(db, segment)
        rewrite = Rewrite(old_path, old_fd)
        cache.pending_rewrites.append(rewrite)
        return rewrite
    (last_use,) = db.execute("SELECT last_use FROM segments WHERE id = ?", (segment,)).fetchone()
    number = index.new_segment(db)
    part = f"{storage.dir}/tmp/segment-{number}.{os.getpid()}"
    new_path = storage.segment_path(number)
    try:
        new_fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        os.close(old_fd)
        raise disk_error(exc, part) from exc
    rewrite = Rewrite(old_path, old_fd, part, new_fd)
    try:
        fcntl.flock(new_fd, fcntl.LOCK_SH)  # before it is visible, as a writer's segment
        moved: list[tuple[int, int, str]] = []
        at = 0
        for oid, position, size in members:
            data = pread_exactly(old_fd, size, position, old_path)
            written = os.pwrite(new_fd, data, at)
            if written != size:
                raise OSError(28, "short write", part)
            moved.append((number, at, oid))
            at += size
        if storage.fsync:
            os.fdatasync(new_fd)
        os.replace(part, new_path)
        rewrite.new_path = new_path
    except OSError as exc:
        rewrite.finish(committed=False)
        raise disk_error(exc, part) from exc
    except BaseException:
        rewrite.finish(committed=False)
        raise
    db.executemany("UPDATE objects SET segment = ?, position = ? WHERE id = ?", moved)
    index.grow_segment(db, number, at)
    db.execute("UPDATE segments SET live = ?, last_use = ? WHERE id = ?", (at, last_use, number))
    index.remove_segment(db, segment)  # its rows moved: forgets the file and its bytes
    cache.pending_rewrites.append(rewrite)
    return rewrite


def dead_bytes(db: sqlite3.Connection) -> int:
    """Bytes inside segments that no entry uses any more."""
    (value,) = db.execute("SELECT COALESCE(SUM(size - live), 0) FROM segments").fetchone()
    return int(value)
