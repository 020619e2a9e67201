"""Eviction order at a cost that does not grow with the cache.

Making room used to sort every entry (``lru``) or ask the plan about every entry
(``plan``) for each object published: 6 ms of CPU per publish at 4,000 entries, and
linear beyond. Here victims come in the same order, read lazily:

- ``lru``: own files through the index on ``(last_use, id)`` and segments through the one
  on their latest use, a page at a time, merged. A victim costs O(log n).
- ``plan``: own files in a heap keyed by their next use, furthest first, with their sizes
  beside it (a victim needs no look-up in the index: the delete says what it freed, and
  a victim gone since it was ranked frees nothing). As the plan advances, only the
  entries whose next use was passed get a new key (each plan position is passed once, so
  an epoch costs O(plan length) in all); stale keys are dropped when they reach the top.
  Segments (``plan`` packs nothing; they are left by other policies) are ranked by the
  soonest next use of their live entries, computed over those entries.

Ties are broken the same way everywhere: by kind (own files first), then by id.
"""

from __future__ import annotations

import heapq
import sqlite3
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from fastload.cache.core import PlanHint

_PAGE = 256  # victims read per query


class Victim(NamedTuple):
    kind: str  # "file" or "segment"
    key: str | int  # an entry id, or a segment number
    size: int


def lru_order(db: sqlite3.Connection, exclude: str) -> Iterator[Victim]:
    """Least recently used first: own files by last use, segments by their latest live
    entry's (0 when empty); ties: files first, then by id. Rows deleted while iterating
    are simply not met again (keyset pages, not one open cursor)."""
    files = _pages(
        db,
        "SELECT last_use, id, size FROM objects INDEXED BY objects_files_by_use"
        " WHERE segment IS NULL AND (last_use, id) > (?, ?) ORDER BY last_use, id LIMIT ?",
        (float("-inf"), ""),
    )
    segments = _pages(
        db,
        "SELECT last_use, id, size FROM segments INDEXED BY segments_by_use"
        " WHERE (last_use, id) > (?, ?) ORDER BY last_use, id LIMIT ?",
        (float("-inf"), -1),
    )
    ranked = heapq.merge(
        ((when, 0, key, size) for when, key, size in files if key != exclude),
        ((when, 1, key, size) for when, key, size in segments),
    )
    for _, kind, key, size in ranked:
        yield Victim("file" if kind == 0 else "segment", key, size)


def _pages(
    db: sqlite3.Connection, query: str, after: tuple[float, str | int]
) -> Iterator[tuple[float, str | int, int]]:
    while True:
        rows = db.execute(query, (*after, _PAGE)).fetchall()
        yield from rows
        if len(rows) < _PAGE:
            return
        after = (rows[-1][0], rows[-1][1])


class PlanRanking:
    """The own files of one cache ordered by their next use in ``plan``, furthest first.

    Knows the entries this process published or found at the last rebuild; one that
    another process published since is picked up by :meth:`refresh` (a rebuild at most
    once per tenth of the entries published, so its cost is amortized)."""

    def __init__(self, plan: PlanHint, db: sqlite3.Connection) -> None:
        self.plan = plan
        self._infinite = plan.length  # later than any position: never needed again
        self._key: dict[str, int] = {}  # entry id -> its next use, as the heap has it
        self._size: dict[str, int] = {}  # entry id -> its size, as last published or read
        self._heap: list[tuple[int, str]] = []  # (-next use, id); stale rows are skipped
        self._applied = plan.position
        self._taken: list[tuple[int, str]] = []  # popped while choosing, not yet settled
        self._added = 0
        self._data_version = -1
        self.rebuild(db)

    def rebuild(self, db: sqlite3.Connection) -> None:
        self._applied = self.plan.position
        self._size = dict(db.execute("SELECT id, size FROM objects WHERE segment IS NULL"))
        self._key = {oid: self._next_use(oid) for oid in self._size}
        self._heap = [(-key, oid) for oid, key in self._key.items()]
        heapq.heapify(self._heap)
        self._added = 0
        self._data_version = _data_version(db)

    def refresh(self, db: sqlite3.Connection) -> None:
        """Rebuilds if other processes changed the index and enough was published since."""
        if self._added * 10 >= max(len(self._key), 10_000):
            version = _data_version(db)
            if version != self._data_version:
                self.rebuild(db)
            self._added = 0
            self._data_version = version

    def _next_use(self, oid: str) -> int:
        when = self.plan.next_use(oid)
        return self._infinite if when == float("inf") else int(when)

    def next_use(self, oid: str) -> int:
        return self._next_use(oid)

    def add(self, oid: str, size: int) -> None:
        self._catch_up()
        self._size[oid] = size
        key = self._next_use(oid)
        if self._key.get(oid) != key:
            self._key[oid] = key
            heapq.heappush(self._heap, (-key, oid))
        self._added += 1

    def discard(self, oid: str) -> None:
        self._key.pop(oid, None)
        self._size.pop(oid, None)

    def _catch_up(self) -> None:
        """New keys for the entries whose next use the plan has passed since last time."""
        start, end = self._applied, self.plan.position
        if end <= start:
            return
        order, keys = self.plan.order_ids, self._key
        for position in range(start, min(end, len(order))):
            oid = order[position]
            if keys.get(oid) == position:
                key = self._next_use(oid)
                keys[oid] = key
                heapq.heappush(self._heap, (-key, oid))
        self._applied = end
        if len(self._heap) > 2 * len(keys) + 1024:  # mostly stale rows: start afresh
            self._heap = [(-key, oid) for oid, key in keys.items()]
            heapq.heapify(self._heap)

    def candidates(self, later_than: int, exclude: str) -> Iterator[Victim]:
        """Own files needed later than ``later_than``, furthest first, ties by id, with
        their sizes as this process last knew them. Each is held aside until
        :meth:`settle`."""
        self._catch_up()
        heap, keys, sizes = self._heap, self._key, self._size
        seen: set[str] = set()
        while heap:
            negative, oid = heap[0]
            if keys.get(oid) != -negative or oid in seen:
                heapq.heappop(heap)  # stale (its key changed, or it left), or a duplicate
                continue
            if -negative <= later_than:
                return
            heapq.heappop(heap)
            seen.add(oid)
            self._taken.append((negative, oid))
            if oid != exclude:
                yield Victim("file", oid, sizes[oid])

    def settle(self, evicted: Sequence[str]) -> None:
        """Forgets the evicted entries; what was held aside but kept goes back."""
        for oid in evicted:
            self._key.pop(oid, None)
            self._size.pop(oid, None)
        for row in self._taken:
            if row[1] in self._key:
                heapq.heappush(self._heap, row)
        self._taken = []


def plan_order(
    db: sqlite3.Connection, ranking: PlanRanking, oid: str, segments: bool
) -> Iterator[Victim]:
    """``plan``'s victims: what is needed furthest ahead first, and nothing needed as soon
    as oid or sooner. ``segments``: whether any exist (then they are ranked as units, over
    their live entries: ``plan`` itself packs nothing, so they are what others left)."""
    mine = ranking.next_use(oid)
    files = ranking.candidates(mine, oid)
    if not segments:
        yield from files
        return
    never = ranking.plan.length
    soonest: dict[int, int] = {}
    for member, segment in db.execute("SELECT id, segment FROM objects WHERE segment IS NOT NULL"):
        soonest[segment] = min(soonest.get(segment, never), ranking.next_use(member))
    ranked = [
        (-soonest.get(segment, never), 1, segment, size)
        for segment, size in db.execute("SELECT id, size FROM segments")
    ]
    ranked.sort()
    merged = heapq.merge(
        ((-ranking.next_use(str(v.key)), 0, v.key, v.size) for v in files),
        (row for row in ranked if -row[0] > mine),
    )
    for _, kind, key, size in merged:
        yield Victim("file" if kind == 0 else "segment", key, size)


def _data_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA data_version").fetchone()[0])
