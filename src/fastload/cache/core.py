"""The Cache: lookup, use, publish and eviction over the index (``index.py``), the bytes on
disk (``storage.py``) and the fetch locks (``locks.py``). See the package docstring."""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import xxhash

from fastload.cache import budget, compaction
from fastload.cache.config import BudgetCounts, CacheConfig, Policy, default_cache_dir
from fastload.cache.eviction import PlanRanking, Victim, lru_order, plan_order
from fastload.cache.index import Entry, Index
from fastload.cache.locks import FetchLock, FetchLocks
from fastload.cache.placed import Placed, placed_columns
from fastload.cache.read_checks import ReadChecks, checksum_value
from fastload.cache.storage import Location, PartFile, Storage, disk_error
from fastload.errors import CacheCorruptError, CacheError

log = logging.getLogger(__name__)

Span: TypeAlias = tuple[int, int]  # (start, length) of a byte range of an object


@functools.lru_cache(maxsize=8192)  # staging asks for the same ids 4-5 times per object
def object_id(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def entry_id(url: str, span: Span | None = None) -> str:
    """The id of url's whole object, or of its byte range span."""
    return object_id(url if span is None else range_url(url, span))


def range_url(url: str, span: Span) -> str:
    """The name of url's byte range span as a cache entry (as a plan's access names it)."""
    start, length = span
    return f"{url}\0bytes={start}+{length}"  # no URL holds a NUL


def printable(url: str) -> str:
    """url as the index stores and shows it: undecodable bytes of a key become escapes."""
    return url.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def checksum_bytes(data: bytes | memoryview) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(data)


def checksum_file(path: Path | str, offset: int = 0, size: int | None = None) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        f.seek(offset)
        left = size
        while chunk := f.read(1 << 20 if left is None else min(1 << 20, left)):
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return "xxh3:" + h.hexdigest()


class PlanHint:
    """A future access order (object URLs); ``next_use`` says when each is needed next."""

    def __init__(self, order: Sequence[str], *, current: int | None = None) -> None:
        """``current``: how many of order's first entries the reader is reading now (a
        loader's pass; the rest is the next epoch): a use never moves the position past
        them (a late read of an earlier batch must not jump the plan a pass ahead)."""
        self._positions: dict[str, list[int]] = {}
        self.order_ids = [object_id(url) for url in order]  # the entry id at each position
        for i, oid in enumerate(self.order_ids):
            self._positions.setdefault(oid, []).append(i)
        self.position = 0
        self.length = len(order)
        self.current = self.length if current is None else current

    def next_use(self, oid: str) -> float:
        positions = self._positions.get(oid)
        if not positions:
            return float("inf")
        i = bisect.bisect_left(positions, self.position)
        return positions[i] if i < len(positions) else float("inf")

    def advance(self, oid: str) -> None:
        """The consumer has reached the next use of oid."""
        nxt = self.next_use(oid)
        if nxt < self.current:
            self.position = int(nxt) + 1


@dataclass(slots=True)
class _Publication:
    part: PartFile
    version: str | None
    oid: str = ""
    location: Location | None = None
    error: BaseException | None = None
    done: bool = False


_LOW_WATER = 0.01  # one eviction may free this share of max_bytes beyond what is needed
_EVICTION_ROUNDS = 8  # a round short only by victims gone since they were ranked is retried
# Victims past what is needed stop here too: each dirties index pages of its own (a random
# one in the primary key), and one transaction's pages must fit the WAL's room
# (index.WAL_START_MAX: 2 MiB, some 500 pages).
_LOW_WATER_VICTIMS = 128


def _same_bytes(a: Entry, b: Entry) -> bool:
    """Whether two rows of one id describe the same stored bytes (uses may differ)."""
    return (a.created, a.segment, a.position, a.checksum) == (
        b.created,
        b.segment,
        b.position,
        b.checksum,
    )


class Cache:
    """fastload's local cache. Thread-safe; one instance per process (re-opens after fork)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        policy: Policy = "lru",
        budget_counts: BudgetCounts = "disk",
        lock_timeout_s: float = 600.0,
        fsync: bool = False,
        segment_bytes: int | None = None,
        create: bool = True,
        verify_reads: bool = True,
    ) -> None:
        """``create=False`` opens only an existing cache (a CacheError names the folder
        otherwise), for tools that inspect one rather than fill it. ``verify_reads=False``
        trusts cached bytes on read (see read_checks.py; ``fastload cache verify`` still
        checks them). ``budget_counts``: what ``max_bytes`` counts (budget.py): everything
        on disk, or (``"entries"``: tests, toys) the entries' bytes only."""
        self.config = CacheConfig(
            cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
            max_bytes=max_bytes,
            policy=policy,
            budget_counts=budget_counts,
            lock_timeout_s=lock_timeout_s,
            fsync=fsync,
            segment_bytes=segment_bytes,
        )
        self.dir = self.config.cache_dir
        if not create and not (self.dir / "index.sqlite").is_file():
            raise CacheError(
                errno.ENOENT,
                f"there is no fastload cache in {self.dir}; check the cache directory "
                "(cache_dir, --cache-dir or $FASTLOAD_CACHE_DIR)",
            )
        try:
            (self.dir / "manifests").mkdir(parents=True, exist_ok=True)
            self.storage = Storage(self.dir, self.config)
        except OSError as exc:
            raise CacheError(
                exc.errno,
                f"cannot use {self.dir} as the cache directory ({exc.strerror}: "
                f"{exc.filename}); choose a writable folder with cache_dir, --cache-dir or "
                "$FASTLOAD_CACHE_DIR",
            ) from exc
        self.fetch_locks = FetchLocks.for_path(self.dir / "fetch.lock")
        self.index = Index(self.dir)
        # What the budget counts (budget.py): everything on disk, or (tests, toys) entries.
        self.counts_disk = budget_counts == "disk"
        self._block = budget.block_size(self.dir) if self.counts_disk else 0
        self.metadata = budget.Metadata(self.dir)
        overhead = self.metadata.lasting() if self.counts_disk else 0
        if max_bytes is not None and self.counts_disk and overhead >= max_bytes:
            self.index.close()
            raise budget.too_small(self.dir, max_bytes, overhead)
        self._lock = self.index.lock  # serializes this process's writes
        self._pending: list[_Publication] = []  # parts waiting for the next group commit
        self._pending_lock = threading.Lock()
        # ``plan`` ranks entries one by one, so it keeps each in a file of its own.
        self._packs = policy != "plan" and self.storage.segment_entry_max > 0
        self.plan: PlanHint | None = None
        self._ranking: PlanRanking | None = None  # plan's victims, kept in step with self.plan
        # Bytes compaction may still copy (compaction.py): one segment's worth to start with.
        self.compaction_credit = self.storage.segment_bytes
        self.pending_rewrites: list[compaction.Rewrite] = []  # done when their commit is
        self.read_checks = ReadChecks(enabled=verify_reads)  # read_checks.py
        self._sweep()

    def _sweep(self) -> None:
        """Removes what writers killed mid-write left behind (see Storage.sweep)."""
        index = self.index
        self.storage.sweep(index.segment_sizes(), index.segment_size, self.fetch_locks)

    # --- the index ---------------------------------------------------------------------------

    def entry(self, url: str, span: Span | None = None) -> Entry | None:
        return self.index.entry(entry_id(url, span))

    def entry_by_id(self, oid: str) -> Entry | None:
        return self.index.entry(oid)

    def entries(self) -> list[Entry]:
        return self.index.entries()

    def used_bytes(self) -> int:
        """What the budget counts (budget.py): everything on disk (entries by their blocks,
        and the metadata); with ``budget_counts="entries"``, the entries' bytes: own files,
        and segments whole (dead bytes included)."""
        return self.disk_bytes() if self.counts_disk else self.index.used_bytes()

    def disk_bytes(self) -> int:
        """Everything the cache has on disk as the budget counts it: the entries, a block
        more per file, and the metadata measured (budget.py)."""
        index, block = self.index, self._block or budget.block_size(self.dir)
        return index.used_bytes() + index.file_count() * block + self.metadata.bytes()

    def touch(self, urls: Sequence[str]) -> None:
        """Records a use of each url now (what ``lru`` orders by)."""
        self.index.note_uses([object_id(u) for u in urls])

    def location_of(self, entry: Entry) -> Location:
        return self.storage.location(
            entry.id, entry.segment, entry.position, entry.size, checksum_value(entry.checksum)
        )

    # --- lookup and use ----------------------------------------------------------------------

    def lookup(
        self,
        url: str,
        *,
        version: str | None = None,
        size: int | None = None,
        span: Span | None = None,
    ) -> Location | None:
        """Where url's cached bytes (of span, if given) are, if it holds that version (and
        size), else None.

        A stale version, or a file shorter than the index says, is dropped here, so it is
        refetched rather than returned.
        """
        entry = self.entry(url, span)
        if entry is None:
            return None
        location = self.location_of(entry)
        stale = (version is not None and entry.version != version) or (
            size is not None and span is None and entry.size != size
        )
        if stale or not self.storage.intact(location, packed=entry.segment is not None):
            self._drop(entry.id)
            return None
        return location

    def lookup_many(
        self, urls: Sequence[str], versions: Sequence[str | None], sizes: Sequence[int | None]
    ) -> list[Location | None]:
        """:meth:`lookup` of whole objects, in one index query and without a ``stat`` per
        file: a stale version is None (refetched by the caller's fallback), and a file cut
        short shows as a short read, which the native reader reports."""
        oids = [object_id(u) for u in urls]
        found = self.index.placements_of(oids)
        out: list[Location | None] = []
        for oid, version, size in zip(oids, versions, sizes, strict=True):
            at = found.get(oid)
            if at is None or not at.holds(version, size):
                out.append(None)
            else:
                checksum = checksum_value(at.checksum)
                out.append(self.storage.location(oid, at.segment, at.position, at.size, checksum))
        # A use now: lru must not evict what the caller is about to read (nor order by the
        # time of the fetch alone, which made it first-in first-out).
        self.index.note_uses_buffered([oid for oid, at in zip(oids, out, strict=True) if at])
        return out

    def count_missing(
        self, urls: Sequence[str], versions: Sequence[str | None], sizes: Sequence[int | None]
    ) -> int:
        """How many of these whole objects (at that version and size) the index does not
        hold, in one query; not a use of those it holds (nothing is read)."""
        oids = [object_id(u) for u in urls]
        found = self.index.placements_of(oids)
        return sum(
            1
            for oid, version, size in zip(oids, versions, sizes, strict=True)
            if (at := found.get(oid)) is None or not at.holds(version, size)
        )

    def placed(
        self, urls: Sequence[str], versions: Sequence[str | None], sizes: Sequence[int | None]
    ) -> Placed:
        """:meth:`lookup_many` as columns (``fastload.cache.placed``): a loader's batch."""
        oids = [object_id(u) for u in urls]
        placed = placed_columns(self.storage, oids, self.index.placements_of(oids), versions, sizes)
        # Uses, as lookup_many's: a batch read as columns must not leave lru first-in first-out.
        hits = [oid for oid, hit in zip(oids, placed.found, strict=True) if hit]
        self.index.note_uses_buffered(hits)
        return placed

    @contextlib.contextmanager
    def use(
        self, url: str, *, version: str | None = None, span: Span | None = None
    ) -> Iterator[Location | None]:
        """Holds url's cached bytes (or yields None on a miss, or when ``version`` is given
        and the cached copy is another version) so eviction leaves them alone."""
        held = self._hold(entry_id(url, span), version)
        try:
            yield None if held is None else held[1]
        finally:
            if held is not None:
                os.close(held[0])

    def _hold(self, oid: str, version: str | None) -> tuple[int, Location] | None:
        for _ in range(3):  # the file can be replaced or evicted between lookup and lock
            entry = self.index.entry(oid)
            if entry is None or (version is not None and entry.version != version):
                return None
            location = self.location_of(entry)
            fd = self.storage.hold(location)
            if fd is None:
                continue
            # A segment's bytes never change (hold saw it was not evicted); an own file can be
            # replaced by a new version under the same name, so that needs the index again.
            now = entry if entry.segment is not None else self.index.entry(oid)
            if now is not None and _same_bytes(now, entry):  # still the one whose file we hold
                if not self.read_checks.whole_entry_holds(location):
                    os.close(fd)
                    self.drop_corrupt(
                        entry.url, None if entry.start is None else (entry.start, entry.size)
                    )
                    return None  # the caller fetches it again
                if self.plan is not None:
                    self.plan.advance(oid)
                self.index.note_use(oid)
                return fd, location
            os.close(fd)
        return None

    def drop_corrupt(self, url: str, span: Span | None = None) -> None:
        """Drops an entry whose bytes failed their checksum on read (it is fetched again),
        saying so once, naming it."""
        if self.drop(url, span):
            log.warning(
                "fastload: the cached copy of %s%s did not match its checksum (damaged on "
                "disk); it was dropped and is fetched again. `fastload cache verify` checks "
                "the whole cache",
                printable(url),
                "" if span is None else f" (bytes {span[0]}+{span[1]})",
            )

    # --- fetching and publishing -------------------------------------------------------------

    def try_fetch_lock(self, url: str, span: Span | None = None) -> FetchLock | None:
        """The fetch lock of url (of span) if it is free now, else None (someone else is
        fetching it). A part is named by its entry alone: the lock makes its holder the only
        writer, and a part left by a holder that died is simply overwritten."""
        oid = entry_id(url, span)
        if not self.fetch_locks.try_acquire(oid):
            return None
        return FetchLock(self.fetch_locks, oid)

    def fetch_lock(self, url: str, span: Span | None = None) -> FetchLock:
        """The fetch lock of url, waiting (up to lock_timeout_s) while another process holds it."""
        deadline = time.monotonic() + self.config.lock_timeout_s
        delay = 0.001
        while (lock := self.try_fetch_lock(url, span)) is None:
            if time.monotonic() >= deadline:
                raise self.lock_timeout(url)
            self.fetch_locks.wait(delay)
            delay = min(delay * 2, 0.05)
        return lock

    def lock_timeout(self, url: str) -> CacheError:
        return CacheError(
            errno.ETIMEDOUT,
            f"waited {self.config.lock_timeout_s:.0f}s for another process fetching {url}; "
            f"it may be stuck: `fuser -v {self.dir / 'fetch.lock'}` lists the candidates",
        )

    def new_part(self, url: str, span: Span | None = None) -> PartFile:
        """Where url's bytes (or those of its range span) are written before publication;
        hold its fetch lock."""
        return self.storage.new_part(entry_id(url, span), url, span, self._packs)

    def would_admit(self, url: str, size: int) -> bool:
        """Whether publishing size bytes of url could succeed now (a cheap pre-check)."""
        max_bytes = self.config.max_bytes
        if max_bytes is None:
            return True
        if size > max_bytes:
            return False
        if self.config.policy == "pin":
            return self.used_bytes() + size <= max_bytes
        return True

    def publish(self, part: PartFile, *, version: str | None) -> Location | None:
        """Moves a finished part into the cache, evicting by policy to stay within max_bytes.

        Returns where its bytes now are, or None when the policy turns the entry away (the
        cache is full under ``pin``, or under ``plan`` everything cached is needed sooner);
        the part is then removed. Threads publishing at once share one index transaction
        (group commit): whoever gets the lock publishes everything queued so far.
        """
        item = _Publication(part, version)
        with self._pending_lock:
            self._pending.append(item)
        with self._lock:
            if not item.done:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._publish_batch(batch)
        if item.error is not None:
            raise item.error
        return item.location

    def publish_many(self, parts: Sequence[tuple[PartFile, str | None]]) -> list[Location | None]:
        """:meth:`publish` for a batch of (part, version) in one index transaction; the
        locations in order (None where the policy turned a part away). A failure is raised
        after the others are published."""
        items = [_Publication(part, version) for part, version in parts]
        if items:
            with self._lock:
                self._publish_batch(items)
        for item in items:
            if item.error is not None:
                raise item.error
        return [item.location for item in items]

    def _publish_batch(self, batch: list[_Publication]) -> None:
        """Admits each part by policy, writes the packed ones with one append, and records
        everything in one transaction."""
        storage = self.storage
        try:
            with self.index.transaction() as db:
                packed: list[_Publication] = []
                queued = 0  # packed bytes admitted, recorded only after the loop
                for item in batch:
                    part = item.part
                    item.oid = entry_id(part.url, part.span)
                    try:
                        if not self._make_room(db, item.oid, part.size, queued):
                            part.discard()
                            continue
                        if part.in_memory:
                            packed.append(item)
                            queued += part.size
                        else:
                            path = storage.place_file(part, item.oid)
                            self.index.add(db, [self._entry(item, None, 0)])
                            item.location = Location(path, 0, part.size)
                            if self._ranking is not None:
                                self._ranking.add(item.oid, part.size)
                    except CacheError as exc:
                        part.discard()
                        item.error = exc
                    except OSError as exc:
                        part.discard()
                        item.error = disk_error(exc, part.path)
                if packed:
                    placed, failure = storage.append(
                        [item.part for item in packed], lambda: self.index.new_segment(db)
                    )
                    for item in packed[len(placed) :]:  # the disk filled up: what fitted stays
                        item.part.discard()
                        item.error = failure
                    packed = packed[: len(placed)]
                    for segment, grown in storage.take_growth():
                        self.index.grow_segment(db, segment, grown)
                    self.index.add(
                        db,
                        [
                            self._entry(item, segment, position)
                            for item, (segment, position) in zip(packed, placed, strict=True)
                        ],
                    )
                    for item, (segment, position) in zip(packed, placed, strict=True):
                        item.location = storage.location(
                            item.oid, segment, position, item.part.size
                        )
                        item.part.chunks = None
            self.finish_rewrites(committed=True)
            self.metadata.published(sum(item.location is not None for item in batch))
        except BaseException as exc:
            self.finish_rewrites(committed=False)
            # Bytes appended but not recorded: never append after them (a later record would
            # lie past the recorded size). The next open cuts them off.
            storage.seal()
            for item in batch:
                if item.location is None and item.error is None:
                    item.part.discard()
                    item.error = exc
                elif item.location is not None:  # written, but the index never recorded it
                    item.location, item.error = None, exc
            if not isinstance(exc, Exception):
                raise
        finally:
            for item in batch:
                item.done = True

    @staticmethod
    def _entry(item: _Publication, segment: int | None, position: int) -> Entry:
        part, now = item.part, time.time()
        start = None if part.span is None else part.span[0]
        return Entry(
            item.oid,
            printable(part.url),
            part.size,
            part.checksum,
            item.version,
            now,
            now,
            segment,
            position,
            start,
        )

    # --- eviction ----------------------------------------------------------------------------

    def _make_room(self, db: sqlite3.Connection, oid: str, size: int, queued: int = 0) -> bool:
        """Evicts by policy until size more bytes fit (after ``queued`` bytes admitted
        earlier in the same batch), and then on down to a low-water mark (up to 1% of
        max_bytes more, and _LOW_WATER_VICTIMS victims, in victim order) so the next
        publishes need no eviction: its cost is shared by many publishes."""
        max_bytes = self.config.max_bytes
        if max_bytes is None:
            return True
        need = self._overshoot(db, oid, size + queued, max_bytes)
        if need <= 0:
            return True
        if size + self._charge(0) > max_bytes:
            return False
        # (parts being fetched, in tmp/, make eviction free more, but never refuse a budget)
        if self.counts_disk and (overhead := self.metadata.lasting()) >= max_bytes:
            raise budget.too_small(self.dir, max_bytes, overhead)
        if self.config.policy == "pin":
            # Nothing cached is given up; space dead inside segments is won back instead.
            compaction.compact(self, db, need_bytes=need, io_bytes=compaction.io_budget(size))
            return self._overshoot(db, oid, size + queued, max_bytes) <= 0
        slack = int(max_bytes * _LOW_WATER)
        for _ in range(_EVICTION_ROUNDS):
            if not self._evict(db, oid, need, slack):
                return False
            # plan's victims carry the sizes this process last knew: one evicted by another
            # process (or by evict()) since freed nothing, so look again.
            need = self._overshoot(db, oid, size + queued, max_bytes)
            if need <= 0:
                return True
        return False

    def _evict(self, db: sqlite3.Connection, oid: str, need: int, slack: int) -> bool:
        """Evicts victims in policy order until they free need bytes (by their sizes as
        ranked), and on while within slack; False if the unused ones cannot free need."""
        chosen: list[tuple[Victim, int]] = []
        chosen_files: list[str] = []
        freed = 0
        try:
            for victim in self._victims(db, oid):
                if freed >= need and (
                    freed + self._charge(victim.size) > need + slack
                    or len(chosen) >= _LOW_WATER_VICTIMS
                ):
                    break
                fd = self.storage.lock_unused(self._victim_path(victim))
                if fd is None:
                    continue  # in use: never evicted
                chosen.append((victim, fd))
                freed += self._charge(victim.size)
            if freed < need:
                return False
            chosen_files = [str(v.key) for v, _ in chosen if v.kind == "file"]
            for (kind, key, _), _fd in chosen:
                if kind == "segment":
                    assert isinstance(key, int)
                    self.storage.remove(self.storage.segment_path(key))
                    self.index.remove_segment(db, key)
                else:
                    assert isinstance(key, str)
                    self.storage.remove(self.storage.object_path(key))
            # Own files leave the index in a few statements, in id order.
            self.index.remove_files(db, [v for v, _ in chosen if v.kind == "file"])
            return True
        finally:
            for _, fd in chosen:
                os.close(fd)
            if self._ranking is not None:
                self._ranking.settle(chosen_files)

    def _charge(self, size: int) -> int:
        """What a file of size bytes counts against the budget (budget.py)."""
        return size + self._block if self.counts_disk else size

    def _overshoot(self, db: sqlite3.Connection, oid: str, size: int, max_bytes: int) -> int:
        """By how much publishing size bytes as oid would exceed max_bytes (<= 0: it fits)."""
        old, total, files = Index.budget_state(db, oid)  # asked on every publish: one query
        replacing = 0 if old is None else self._charge(old)
        added = self._charge(size) + budget.ROW_BYTES if self.counts_disk else size
        return self._count(total, files) - replacing + added - max_bytes

    def _counted(self, db: sqlite3.Connection) -> int:
        """:meth:`used_bytes` inside a transaction."""
        return self._count(*Index.totals(db))

    def _count(self, total: int, files: int) -> int:
        if not self.counts_disk:
            return total
        return total + files * self._block + self.metadata.bytes()

    def _victim_path(self, victim: Victim) -> str:
        if victim.kind == "segment":
            assert isinstance(victim.key, int)
            return self.storage.segment_path(victim.key)
        assert isinstance(victim.key, str)
        return self.storage.object_path(victim.key)

    def _victims(self, db: sqlite3.Connection, oid: str) -> Iterator[Victim]:
        """What to evict first to make room for oid, lazily (``eviction.py``): ``plan``:
        furthest next use first, and nothing needed sooner than oid; ``lru`` (and ``plan``
        without a plan): least recently used first. A segment goes whole: it counts as used
        when any entry in it was, and as needed when any entry in it is."""
        plan = self.plan
        if self.config.policy != "plan" or plan is None:
            self.index.write_uses(db)
            return lru_order(db, oid)
        ranking = self._ranking
        if ranking is None or ranking.plan is not plan:
            ranking = self._ranking = PlanRanking(plan, db)
        else:
            ranking.refresh(db)
        segments = db.execute("SELECT 1 FROM segments LIMIT 1").fetchone() is not None
        return plan_order(db, ranking, oid, segments)

    # --- maintenance -------------------------------------------------------------------------

    def finish_rewrites(self, *, committed: bool) -> None:
        """After the transaction that moved rows to rewritten segments (compaction.py)."""
        rewrites, self.pending_rewrites = self.pending_rewrites, []
        for rewrite in rewrites:
            rewrite.finish(committed)

    def compact(self, *, live_fraction: float = compaction.LIVE_FRACTION) -> tuple[int, int]:
        """Rewrites every segment less live than live_fraction that no reader holds, one
        transaction each (see compaction.py); returns (segments rewritten, bytes freed)."""
        if not 0 < live_fraction <= 1:
            raise ValueError(f"live_fraction must be in (0, 1], got {live_fraction}")
        rewritten = freed = 0
        done: set[int] = set()
        while True:
            with self._lock:
                try:
                    with self.index.transaction() as db:
                        rows = db.execute(
                            "SELECT id, size, live FROM segments WHERE live < size * ?"
                            " AND size > 0 ORDER BY id",
                            (live_fraction,),
                        ).fetchall()
                        todo = [r for r in rows if r[0] not in done and r[0] != self._active()]
                        if not todo:
                            return rewritten, freed
                        segment, size, live = todo[0]
                        done.add(segment)
                        if compaction.rewrite_segment(self, db, segment) is not None:
                            rewritten += 1
                            freed += size - live
                except BaseException:
                    self.finish_rewrites(committed=False)
                    raise
                self.finish_rewrites(committed=True)

    def _active(self) -> int | None:
        return self.storage.active_segment()

    def drop(self, url: str, span: Span | None = None) -> bool:
        """Removes url (its range span) from the cache unless a reader holds it; True if it
        is gone. A packed entry's bytes stay on disk (and counted) until its segment goes."""
        return self._drop(entry_id(url, span))

    def _drop(self, oid: str) -> bool:
        with self.index.transaction() as db:
            entry = Index.row(db, oid)
            if entry is None:
                return True
            if entry.segment is not None:
                self.index.remove(db, entry)
                if Index.segment_live(db, entry.segment) == 0:
                    self._remove_segment_if_unused(db, entry.segment)
                return True
            fd = self.storage.lock_unused(self.storage.object_path(oid))
            if fd is None:
                return False
            try:
                self.storage.remove(self.storage.object_path(oid))
                self.index.remove(db, entry)
                if self._ranking is not None:
                    self._ranking.discard(oid)
            finally:
                os.close(fd)
        return True

    def _remove_segment_if_unused(self, db: sqlite3.Connection, segment: int) -> bool:
        if segment == self.storage.active_segment():
            return False
        path = self.storage.segment_path(segment)
        fd = self.storage.lock_unused(path)
        if fd is None:
            return False
        try:
            self.storage.remove(path)
            self.index.remove_segment(db, segment)
        finally:
            os.close(fd)
        return True

    def verify(self, *, repair: bool = True) -> list[tuple[str, str]]:
        """Recomputes every checksum; returns (url, problem) for each bad entry.

        With ``repair`` the bad entries are dropped (refetched on next use), and files that
        no index row claims (left by a crash between writing and recording) are removed.
        """
        problems: list[tuple[str, str]] = []
        bad: list[str] = []
        for entry in self.entries():
            location = self.location_of(entry)
            problem = ""
            try:
                length = os.stat(location.path).st_size
            except FileNotFoundError:
                problem = "missing"
            else:
                own = entry.segment is None
                if own and length != entry.size:
                    problem = f"size {length} != recorded {entry.size}"
                elif not own and length < entry.position + entry.size:
                    problem = f"its segment ends {entry.position + entry.size - length} bytes early"
                elif checksum_file(location.path, location.offset, entry.size) != entry.checksum:
                    problem = "checksum mismatch"
            if problem:
                name = entry.url if entry.start is None else f"{entry.url} from byte {entry.start}"
                problems.append((name, problem))
                bad.append(entry.id)
        if repair:
            for oid in bad:
                self._drop(oid)
            self._remove_unclaimed()
        return problems

    def _remove_unclaimed(self) -> None:
        known = {e.id for e in self.entries()}
        for path in (self.dir / "objects").glob("*/*"):
            if path.name not in known and self.fetch_locks.try_acquire(path.name):
                try:
                    if self.entry_by_id(path.name) is None:
                        path.unlink(missing_ok=True)
                finally:
                    self.fetch_locks.release(path.name)
        self._sweep()

    def read_verified(self, url: str, span: Span | None = None) -> bytes:
        """The bytes of a cached entry after checking them against the index."""
        entry = self.entry(url, span)
        if entry is None:
            raise CacheError(errno.ENOENT, f"{url} is not cached")
        data = self.location_of(entry).read()
        if len(data) != entry.size or checksum_bytes(data) != entry.checksum:
            self.drop(url, span)
            raise CacheCorruptError(
                errno.EIO, f"cached copy of {url} is corrupt; it was dropped and will be refetched"
            )
        return data

    def evict(self, *, to_bytes: int = 0) -> int:
        """Evicts unused entries, least recently used first (a segment whole, as one), until
        the budget counts at most to_bytes (:meth:`used_bytes`); returns how many entries
        were removed."""
        removed = 0
        with self.index.transaction() as db:
            self.index.write_uses(db)
            for kind, key, _ in lru_order(db, ""):
                if self._counted(db) <= to_bytes:
                    break
                if kind == "segment":
                    assert isinstance(key, int)
                    members = db.execute(
                        "SELECT COUNT(*) FROM objects WHERE segment = ?", (key,)
                    ).fetchone()[0]
                    if self._remove_segment_if_unused(db, key):
                        removed += members
                else:
                    assert isinstance(key, str)
                    fd = self.storage.lock_unused(self.storage.object_path(key))
                    if fd is None:
                        continue
                    try:
                        self.storage.remove(self.storage.object_path(key))
                        row = Index.row(db, key)
                        if row is not None:
                            self.index.remove(db, row)
                            removed += 1
                    finally:
                        os.close(fd)
        return removed

    def clear(self) -> int:
        """Removes every entry not in use, and the listings and format indexes derived from
        the remote (they are rebuilt on next use); returns how many entries were removed."""
        self.storage.seal()  # our own segment may go too
        removed = self.evict(to_bytes=0)
        for derived in ("manifests", "indexes"):
            for path in (self.dir / derived).glob("*"):
                if path.is_file():
                    path.unlink(missing_ok=True)
        return removed

    def close(self) -> None:
        """Writes buffered uses to the index, seals this process's segment and closes its
        connections."""
        with self._lock:
            self.storage.seal()
        self.index.close()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
