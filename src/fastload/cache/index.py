"""The cache's index: one SQLite database (WAL mode), the record of what is cached where.

Tables:

- ``objects``: one row per entry: a whole remote object, or a byte range of one (``start``
  set; its id hashes the URL and the range). A row holds the entry's size, checksum,
  remote version and last use, and where its bytes are: a file of their own (``segment``
  NULL) or ``[position, position + size)`` of a segment file.
- ``segments``: the segment files, each with its size on disk (dead bytes included), its
  live bytes, and the latest use of an entry in it (what ``lru`` ranks a segment by).
- ``totals``: ``bytes``, the length of everything recorded (own files plus whole
  segments), and ``files``, how many files that is (each may take a block more on disk,
  see budget.py), kept by the same transactions that change the rows, so a budget check
  reads two rows.

A row is written only after its bytes are on disk, in the same transaction as the
totals, so a crash leaves at worst bytes no row claims (``Cache.verify`` and the next
open remove them), never a row without its bytes. Each process writes through one
connection under a lock; each thread reads through its own (WAL: reads never wait for a
write). Uses, which ``lru`` orders by, are buffered and written in batches.

The format's version is SQLite's ``user_version``. An older index (0: before segments
and ranges; 2: before segments carried their last use) is upgraded in place on open: its
rows keep their ids and files, so nothing cached is lost. A newer one is refused.

Eviction reads victims in order through indexes (``eviction.py``), never by sorting every
row: own files by ``(last_use, id)``, segments by ``(last_use, id)``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from fastload.cache.budget import WAL_BYTES, WAL_RESERVE
from fastload.errors import CacheError

FORMAT_VERSION = 3
_CONNECT_TIMEOUT_S = 60.0
_CHECKPOINT_WAIT_MS = 200  # how long a commit waits to reset a grown WAL (then: later)
# A write transaction starts only with the WAL at most this long, so one transaction's
# pages (an eviction is capped to fit: core.py) keep it within the reserve the budget
# counts it at (budget.py).
WAL_START_MAX = WAL_RESERVE // 2
_START_WAIT_MS = 1000  # per try to reset a WAL past WAL_START_MAX before a transaction
_RECENCY_FLUSH = 128  # uses buffered before they are written: ~3 pages each, within the WAL room
_COLUMNS = "id, url, size, checksum, version, created, last_use, segment, position, start"

_TABLES = """
CREATE TABLE IF NOT EXISTS objects (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    size INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    version TEXT,
    created REAL NOT NULL,
    last_use REAL NOT NULL,
    segment INTEGER,
    position INTEGER NOT NULL DEFAULT 0,
    start INTEGER
);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a stale reader cannot meet new bytes
    size INTEGER NOT NULL,
    live INTEGER NOT NULL,
    last_use REAL NOT NULL DEFAULT 0  -- the latest use of an entry in it; 0 when empty
);
CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_AFTER_UPGRADE = (
    "CREATE INDEX IF NOT EXISTS objects_by_segment ON objects (segment)",
    "INSERT OR IGNORE INTO totals SELECT 'bytes',"
    " (SELECT COALESCE(SUM(size), 0) FROM objects WHERE segment IS NULL)"
    " + (SELECT COALESCE(SUM(size), 0) FROM segments)",
    # format 3: eviction walks indexes on recency instead of sorting every row
    "DROP INDEX IF EXISTS objects_by_last_use",
    "UPDATE segments SET last_use = COALESCE("
    "(SELECT MAX(last_use) FROM objects WHERE segment = segments.id), 0)",
    "CREATE INDEX IF NOT EXISTS objects_files_by_use ON objects (last_use, id)"
    " WHERE segment IS NULL",
    "CREATE INDEX IF NOT EXISTS segments_by_use ON segments (last_use, id)",
    # packed entries by segment; own files (segment NULL) stay out of it, so publishing or
    # evicting one updates one B-tree fewer
    "DROP INDEX IF EXISTS objects_by_segment",
    "CREATE INDEX IF NOT EXISTS objects_packed ON objects (segment) WHERE segment IS NOT NULL",
    "INSERT OR IGNORE INTO totals SELECT 'files',"
    " (SELECT COUNT(*) FROM objects WHERE segment IS NULL) + (SELECT COUNT(*) FROM segments)",
)
_ADDED_COLUMNS = {  # columns an index of format 0 lacks
    "segment": "INTEGER",
    "position": "INTEGER NOT NULL DEFAULT 0",
    "start": "INTEGER",
}


class Placement(NamedTuple):
    """Where an entry's bytes are, and which version of which size they are."""

    size: int
    version: str | None
    segment: int | None  # None: a file of its own
    position: int
    checksum: str

    def holds(self, version: str | None, size: int | None) -> bool:
        """Whether this is the entry of that version and size (None: any); a stale one
        is not found, and the caller's fallback fetches it again."""
        return (version is None or self.version == version) and (size is None or self.size == size)


@dataclass(frozen=True, slots=True)
class Entry:
    """A cached entry as the index records it."""

    id: str
    url: str
    size: int
    checksum: str
    version: str | None
    created: float
    last_use: float
    segment: int | None = None  # None: a file of its own
    position: int = 0  # where the bytes start in the segment
    start: int | None = None  # a byte range of the object at url, from here; None: all of it


def _values(e: Entry) -> tuple[object, ...]:
    """The row of e, in _COLUMNS' order (not dataclasses.astuple: it deep-copies each field)."""
    return (
        e.id,
        e.url,
        e.size,
        e.checksum,
        e.version,
        e.created,
        e.last_use,
        e.segment,
        e.position,
        e.start,
    )


class Index:
    """The index of the cache in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "index.sqlite"
        self.lock = threading.RLock()  # serializes this process's writes
        self._db: sqlite3.Connection | None = None
        self._db_pid = -1
        self._readers = threading.local()
        self._reader_dbs: list[tuple[int, threading.Thread, sqlite3.Connection]] = []
        self._recent: dict[str, float] = {}  # uses not yet written
        self.writer()  # create or upgrade the schema before any reader looks

    # --- connections -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Switching a new database to WAL can answer "locked" at once, without waiting,
        # while another process creates it (8 ranks opening a fresh cache): so wait here.
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        delay = 0.005
        while True:
            db = sqlite3.connect(
                self.path, timeout=_CONNECT_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                # A small WAL, truncated after each checkpoint: the budget reserves it (budget.py).
                db.execute(f"PRAGMA journal_size_limit={WAL_BYTES}")
                db.execute(f"PRAGMA wal_autocheckpoint={WAL_BYTES // 4096}")
                # 32 MB of pages: a million-entry index's upper levels stay in memory
                db.execute("PRAGMA cache_size=-32768")
                return db
            except sqlite3.OperationalError as exc:
                db.close()
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise CacheError(errno.EIO, f"cache index {self.path}: {exc}") from exc
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    def writer(self) -> sqlite3.Connection:
        """The writing connection of this process (used under self.lock)."""
        if self._db is None or self._db_pid != os.getpid():
            db = self._connect()
            db.executescript(_TABLES)
            self._upgrade(db)
            self._db, self._db_pid = db, os.getpid()
        return self._db

    def _upgrade(self, db: sqlite3.Connection) -> None:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        if version == FORMAT_VERSION:
            return
        if version > FORMAT_VERSION:
            db.close()
            raise CacheError(
                errno.EPROTO,
                f"the cache index {self.path} is format {version}, newer than this fastload "
                f"reads ({FORMAT_VERSION}); upgrade fastload, or use another cache directory",
            )
        db.execute("BEGIN IMMEDIATE")  # one process upgrades; the others see it done
        try:
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version == FORMAT_VERSION:  # another process did it meanwhile
                db.execute("ROLLBACK")
                return
            have = {row[1] for row in db.execute("PRAGMA table_info(objects)")}
            for name, kind in _ADDED_COLUMNS.items():
                if name not in have:
                    db.execute(f"ALTER TABLE objects ADD COLUMN {name} {kind}")
            if "last_use" not in {row[1] for row in db.execute("PRAGMA table_info(segments)")}:
                db.execute("ALTER TABLE segments ADD COLUMN last_use REAL NOT NULL DEFAULT 0")
            for statement in _AFTER_UPGRADE:
                db.execute(statement)
            db.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def reader(self) -> sqlite3.Connection:
        """This thread's reading connection: lookups never queue behind a publish."""
        readers = self._readers
        if getattr(readers, "pid", None) != os.getpid():
            readers.db, readers.pid = self._connect(), os.getpid()
            with self.lock:
                # Threads come and go (a loader starts new ones each epoch): close what the
                # ended ones opened, or each would keep a file descriptor for good.
                alive = []
                for pid, thread, conn in self._reader_dbs:
                    if pid == os.getpid() and not thread.is_alive():
                        conn.close()
                    else:
                        alive.append((pid, thread, conn))
                alive.append((os.getpid(), threading.current_thread(), readers.db))
                self._reader_dbs = alive
        db: sqlite3.Connection = readers.db
        return db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction, serialized across every process using the cache."""
        with self.lock:
            db = self.writer()
            try:
                self._begin(db)
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                self._bound_wal(db)
            except sqlite3.OperationalError as exc:
                if "full" in str(exc):
                    raise CacheError(
                        errno.ENOSPC,
                        f"no space left on the device holding {self.path}; free space or "
                        "give the cache a max_bytes below the free space",
                        str(self.path),
                    ) from exc
                raise CacheError(errno.EIO, f"cache index {self.path}: {exc}") from exc

    def _begin(self, db: sqlite3.Connection) -> None:
        """BEGIN IMMEDIATE, with the WAL no longer than WAL_START_MAX. The WAL is sized
        under the write lock (no other process appends meanwhile); past it, the lock is let
        go and the WAL reset first, waiting for readers. Every process's next transaction
        does the same, so nothing appends until one reset is done: with a brief try after
        commits alone, four processes publishing at once still saw the WAL spike to tens
        of MB between two resets, 13 MB past max_bytes."""
        deadline = time.monotonic() + _CONNECT_TIMEOUT_S
        while True:
            db.execute("BEGIN IMMEDIATE")
            if self.wal_bytes() <= WAL_START_MAX or time.monotonic() > deadline:
                return  # past the deadline (a reader held a snapshot a minute): go on
            db.execute("ROLLBACK")
            self._checkpoint(db, _START_WAIT_MS)

    def wal_bytes(self) -> int:
        try:
            return os.stat(f"{self.path}-wal").st_size
        except OSError:
            return 0

    def _bound_wal(self, db: sqlite3.Connection) -> None:
        """Resets a WAL grown past WAL_START_MAX after a commit, waiting briefly (a
        publisher must not stall behind a long reader: a WAL still long is reset before
        the next transaction, see _begin). The automatic checkpoint (passive) never resets
        a WAL that other processes keep reading and writing; a TRUNCATE checkpoint waits
        (the busy timeout) for readers on older snapshots, then empties it."""
        if self.wal_bytes() > WAL_START_MAX:
            self._checkpoint(db, _CHECKPOINT_WAIT_MS)

    @staticmethod
    def _checkpoint(db: sqlite3.Connection, wait_ms: int) -> None:
        db.execute(f"PRAGMA busy_timeout={wait_ms}")
        try:
            with contextlib.suppress(sqlite3.OperationalError):  # busy: tried again later
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        finally:
            db.execute(f"PRAGMA busy_timeout={int(_CONNECT_TIMEOUT_S * 1000)}")

    def close(self) -> None:
        if self._db_pid == os.getpid():
            self.flush_uses()
        with self.lock:
            if self._db is not None and self._db_pid == os.getpid():
                self._db.close()
            self._db = None
            for pid, _, db in self._reader_dbs:
                if pid == os.getpid():  # a parent's connections are not ours to close
                    db.close()
            self._reader_dbs = []
            self._readers = threading.local()

    # --- reading -----------------------------------------------------------------------------

    def entry(self, oid: str) -> Entry | None:
        row = (
            self.reader().execute(f"SELECT {_COLUMNS} FROM objects WHERE id = ?", (oid,)).fetchone()
        )
        return Entry(*row) if row else None

    def placements_of(self, oids: Sequence[str]) -> dict[str, Placement]:
        """Where the entries of those ids that exist are, for a loader's batch: one query
        and one result row per 500 ids. Python's sqlite3 releases and retakes the GIL for
        every row it steps to: 64 rows a batch cost 64 waits for a training step holding the
        GIL (150 ms a batch measured), one JSON row costs one."""
        found: dict[str, Placement] = {}
        db = self.reader()
        for i in range(0, len(oids), 500):  # SQLite's limit on bound parameters
            chunk = list(oids[i : i + 500])
            marks = ", ".join("?" * len(chunk))
            try:
                (rows,) = db.execute(
                    "SELECT json_group_array("
                    "json_array(id, size, version, segment, position, checksum))"
                    f" FROM objects WHERE id IN ({marks})",
                    chunk,
                ).fetchone()
                placed = json.loads(rows)
            except sqlite3.OperationalError:  # an SQLite without JSON (before 3.38): by rows
                columns = "id, size, version, segment, position, checksum"
                query = f"SELECT {columns} FROM objects WHERE id IN ({marks})"
                placed = db.execute(query, chunk).fetchall()
            for oid, size, version, segment, position, checksum in placed:
                found[oid] = Placement(size, version, segment, position, checksum)
        return found

    def entries(self) -> list[Entry]:
        rows = self.reader().execute(f"SELECT {_COLUMNS} FROM objects ORDER BY url, start")
        return [Entry(*r) for r in rows.fetchall()]

    def used_bytes(self) -> int:
        row = self.reader().execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()
        return int(row[0])

    def file_count(self) -> int:
        row = self.reader().execute("SELECT value FROM totals WHERE name = 'files'").fetchone()
        return int(row[0])

    def file_bytes(self) -> int:
        """The size of the index's own files (database, WAL and its shared memory)."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(f"{self.path}{suffix}").st_size
        return total

    def segment_sizes(self) -> dict[int, int]:
        return dict(self.reader().execute("SELECT id, size FROM segments").fetchall())

    def segment_size(self, segment: int) -> int | None:
        found = self.reader().execute("SELECT size FROM segments WHERE id = ?", (segment,))
        row = found.fetchone()
        return None if row is None else int(row[0])

    # --- writing (inside a transaction) ------------------------------------------------------

    @staticmethod
    def total(db: sqlite3.Connection) -> int:
        (value,) = db.execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()
        return int(value)

    @staticmethod
    def files(db: sqlite3.Connection) -> int:
        (value,) = db.execute("SELECT value FROM totals WHERE name = 'files'").fetchone()
        return int(value)

    @staticmethod
    def totals(db: sqlite3.Connection) -> tuple[int, int]:
        """(bytes, files) in one query: asked on every publish under a budget."""
        found = dict(db.execute("SELECT name, value FROM totals WHERE name IN ('bytes', 'files')"))
        return int(found["bytes"]), int(found["files"])

    @staticmethod
    def budget_state(db: sqlite3.Connection, oid: str) -> tuple[int | None, int, int]:
        """(the size of oid's entry if it is an own file, else None; bytes; files) in one
        query: a publish's budget check."""
        size, nbytes, files = db.execute(
            "SELECT (SELECT size FROM objects WHERE id = ? AND segment IS NULL),"
            " (SELECT value FROM totals WHERE name = 'bytes'),"
            " (SELECT value FROM totals WHERE name = 'files')",
            (oid,),
        ).fetchone()
        return (None if size is None else int(size)), int(nbytes), int(files)

    @staticmethod
    def add_to_total(db: sqlite3.Connection, nbytes: int, files: int = 0) -> None:
        db.execute("UPDATE totals SET value = value + ? WHERE name = 'bytes'", (nbytes,))
        if files:
            db.execute("UPDATE totals SET value = value + ? WHERE name = 'files'", (files,))

    @staticmethod
    def row(db: sqlite3.Connection, oid: str) -> Entry | None:
        found = db.execute(f"SELECT {_COLUMNS} FROM objects WHERE id = ?", (oid,)).fetchone()
        return Entry(*found) if found else None

    def add(self, db: sqlite3.Connection, entries: Sequence[Entry]) -> None:
        """Records entries, replacing any rows of their ids (whose bytes the caller has dealt
        with): a few statements per batch, not per entry."""
        ids = [e.id for e in entries]
        for i in range(0, len(ids), 500):  # SQLite's limit on bound parameters
            chunk = ids[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            old = db.execute(f"SELECT {_COLUMNS} FROM objects WHERE id IN ({marks})", chunk)
            for row in old.fetchall():
                self.remove(db, Entry(*row))
        db.executemany(
            f"INSERT INTO objects ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [_values(e) for e in entries],
        )
        live: dict[int | None, tuple[int, float]] = {}
        for e in entries:
            nbytes, latest = live.get(e.segment, (0, 0.0))
            live[e.segment] = (nbytes + e.size, max(latest, e.last_use))
        for segment, (nbytes, latest) in live.items():
            if segment is None:
                self.add_to_total(db, nbytes, sum(1 for e in entries if e.segment is None))
            else:
                db.execute(
                    "UPDATE segments SET live = live + ?, last_use = MAX(last_use, ?) WHERE id = ?",
                    (nbytes, latest, segment),
                )

    def remove(self, db: sqlite3.Connection, entry: Entry) -> None:
        """Forgets entry. An own file's bytes leave the total; a segment's stay counted (they
        are on disk until the whole segment goes)."""
        db.execute("DELETE FROM objects WHERE id = ?", (entry.id,))
        if entry.segment is None:
            self.add_to_total(db, -entry.size, -1)
        else:
            # The segment's recency is that of its latest live entry: recomputed (over this
            # one segment, by its index) only when the entry that set it goes.
            db.execute(
                "UPDATE segments SET live = live - ?, last_use = CASE WHEN last_use > ? THEN"
                " last_use ELSE COALESCE((SELECT MAX(last_use) FROM objects WHERE segment = ?),"
                " 0) END WHERE id = ?",
                (entry.size, entry.last_use, entry.segment, entry.segment),
            )

    def remove_files(
        self, db: sqlite3.Connection, files: Sequence[tuple[str, str | int, int]]
    ) -> int:
        """Forgets own-file entries given as (kind, id, size); returns the bytes they held
        as the index had them (one gone or packed since the caller ranked it frees none).
        In id order, so the deletes walk the primary key's pages once, not at random."""
        ids = sorted(str(f[1]) for f in files)
        freed = count = 0
        for i in range(0, len(ids), 500):  # SQLite's limit on bound parameters
            chunk = ids[i : i + 500]
            marks = ", ".join("?" * len(chunk))
            sizes = db.execute(
                f"DELETE FROM objects WHERE id IN ({marks}) AND segment IS NULL RETURNING size",
                chunk,
            ).fetchall()
            freed += sum(size for (size,) in sizes)
            count += len(sizes)
        if count:
            self.add_to_total(db, -freed, -count)
        return freed

    @staticmethod
    def new_segment(db: sqlite3.Connection) -> int:
        cursor = db.execute("INSERT INTO segments (size, live) VALUES (0, 0)")
        db.execute("UPDATE totals SET value = value + 1 WHERE name = 'files'")
        assert cursor.lastrowid is not None
        return cursor.lastrowid

    def grow_segment(self, db: sqlite3.Connection, segment: int, nbytes: int) -> None:
        db.execute("UPDATE segments SET size = size + ? WHERE id = ?", (nbytes, segment))
        self.add_to_total(db, nbytes)

    def remove_segment(self, db: sqlite3.Connection, segment: int) -> None:
        """Forgets a segment and every entry in it."""
        found = db.execute("SELECT size FROM segments WHERE id = ?", (segment,)).fetchone()
        db.execute("DELETE FROM objects WHERE segment = ?", (segment,))
        db.execute("DELETE FROM segments WHERE id = ?", (segment,))
        if found:
            self.add_to_total(db, -int(found[0]), -1)

    @staticmethod
    def segment_live(db: sqlite3.Connection, segment: int) -> int | None:
        found = db.execute("SELECT live FROM segments WHERE id = ?", (segment,)).fetchone()
        return None if found is None else int(found[0])

    # --- uses --------------------------------------------------------------------------------

    def note_use(self, oid: str) -> None:
        """A use, buffered: writing the index on every read would cost more than the read."""
        with self.lock:
            self._recent[oid] = time.time()
            full = len(self._recent) >= _RECENCY_FLUSH
        if full:
            self.flush_uses()

    def note_uses_buffered(self, oids: list[str]) -> None:
        """Uses of many, buffered as :meth:`note_use`'s (this process's evictions write them
        first, so what a reader just found is not what they pick)."""
        now = time.time()
        with self.lock:
            self._recent.update((oid, now) for oid in oids)
            full = len(self._recent) >= _RECENCY_FLUSH
        if full:
            self.flush_uses()

    def note_uses(self, oids: Iterator[str] | list[str]) -> None:
        now = time.time()
        with self.lock:
            self._recent.update((oid, now) for oid in oids)
        self.flush_uses()

    def flush_uses(self) -> None:
        with self.lock:
            if self._recent:
                with self.transaction() as db:
                    self.write_uses(db)

    def write_uses(self, db: sqlite3.Connection) -> None:
        """Writes the buffered uses inside the caller's transaction. A use never makes an
        entry look older: one buffered here before another process fetched the entry again
        (evicted meanwhile) would have set the new copy's recency back to the old read, and
        lru then evicted it before the batch it was staged for read it (fetched twice)."""
        with self.lock:
            recent, self._recent = self._recent, {}
        uses = [(t, o) for o, t in recent.items()]
        db.executemany("UPDATE objects SET last_use = MAX(last_use, ?) WHERE id = ?", uses)
        db.executemany(
            "UPDATE segments SET last_use = MAX(last_use, ?)"
            " WHERE id = (SELECT segment FROM objects WHERE id = ?)",
            uses,
        )
