"""The cache stage: a directory on local disk plus a durable index, safe for many processes.

Layout under ``cache_dir``::

    index.sqlite        one row per published object (WAL mode: readers never block)
    objects/ab/<id>     published bytes; <id> hashes the object's URL, so no remote
                        key can name a path outside the cache, however hostile
    tmp/<id>.<pid>.<n>  bytes being written; published by os.replace, never read
    fetch.lock          one byte per object, record-locked by whoever is fetching it
    manifests/          dataset listings (see manifest.py)

Guarantees: a reader sees a whole file or none (atomic ``os.replace``); locks are
``fcntl``/``flock``, so a killed process's locks vanish with it; its leftovers in ``tmp/``
are removed by the next process that fetches the same object or opens the cache. A reader holds a
shared ``flock`` on the file it uses, and eviction skips files it cannot lock exclusively,
so an object in use is never evicted. ``max_bytes`` bounds the published bytes; objects
being fetched may exceed it until they are published or turned away.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, TypeAlias

import xxhash

from fastload.errors import CacheCorruptError, CacheError

Policy: TypeAlias = Literal["lru", "pin", "plan"]
POLICIES: tuple[Policy, ...] = ("lru", "pin", "plan")
CACHE_DIR_ENV = "FASTLOAD_CACHE_DIR"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS objects (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    size INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    version TEXT,
    created REAL NOT NULL,
    last_use REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS objects_by_last_use ON objects (last_use);
-- The published bytes, kept by the same transactions that add and remove objects, so the
-- budget check costs one row read rather than a sum over the whole index.
CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO totals SELECT 'bytes', COALESCE(SUM(size), 0) FROM objects;
"""
_RECENCY_FLUSH = 256  # uses buffered in memory before they are written to the index


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE_DIR``, else the per-user cache folder (``$XDG_CACHE_HOME/fastload``)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastload"


@functools.lru_cache(maxsize=8192)  # staging asks for the same ids 4-5 times per object
def object_id(url: str) -> str:
    return hashlib.sha256(url.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def printable(url: str) -> str:
    """url as the index stores and shows it: undecodable bytes of a key become escapes."""
    return url.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def checksum_bytes(data: bytes | memoryview) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(data)


def checksum_file(path: Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "xxh3:" + h.hexdigest()


@dataclass(frozen=True, slots=True)
class Entry:
    """A published object as the index records it."""

    id: str
    url: str
    size: int
    checksum: str
    version: str | None
    created: float
    last_use: float


class FetchLocks:
    """Per-object locks across processes: POSIX record locks on one byte each of one file.

    The kernel drops a dead process's record locks. Record locks belong to the process, not
    the thread, so a table of held ids serializes the threads of one process. The lock file
    stays open for the life of the process: closing any descriptor of it would drop every
    record lock the process holds (the POSIX rule).
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

    def _file(self) -> int:
        if self._pid != os.getpid():  # record locks are not inherited by a forked child
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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


@dataclass
class FetchLock:
    """A held fetch lock on one object; release() is idempotent."""

    locks: FetchLocks
    oid: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.locks.release(self.oid)


class PlanHint:
    """A future access order (object URLs); ``next_use`` says when each is needed next."""

    def __init__(self, order: Sequence[str]) -> None:
        self._positions: dict[str, list[int]] = {}
        for i, url in enumerate(order):
            self._positions.setdefault(object_id(url), []).append(i)
        self.position = 0
        self.length = len(order)

    def next_use(self, oid: str) -> float:
        positions = self._positions.get(oid)
        if not positions:
            return float("inf")
        i = bisect.bisect_left(positions, self.position)
        return positions[i] if i < len(positions) else float("inf")

    def advance(self, oid: str) -> None:
        """The consumer has reached the next use of oid."""
        nxt = self.next_use(oid)
        if nxt != float("inf"):
            self.position = int(nxt) + 1


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    cache_dir: Path
    max_bytes: int | None = None
    policy: Policy = "lru"
    lock_timeout_s: float = 600.0
    fsync: bool = False  # survive power loss, not only process death, at a cost per file

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {self.max_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0, got {self.lock_timeout_s}")


class PartFile:
    """Bytes of one object on their way into the cache: hashed as written, published or removed."""

    def __init__(self, path: Path, url: str) -> None:
        self.path = path
        self.url = url
        self.size = 0
        self._hash = xxhash.xxh3_64()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.discard()
            raise _disk_error(exc, self.path) from exc
        self.size += len(data)
        self._hash.update(data)

    @property
    def checksum(self) -> str:
        return "xxh3:" + self._hash.hexdigest()

    def close(self, *, fsync: bool) -> None:
        if self._fd >= 0:
            try:
                if fsync:
                    os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1

    def discard(self) -> None:
        self.close(fsync=False)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _disk_error(exc: OSError, path: Path) -> CacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheError(
            exc.errno,
            f"no space left on the device holding {path} while caching; free space or give "
            "the cache a max_bytes below the free space (fastload warm --max-bytes)",
            str(path),
        )
    return CacheError(exc.errno or errno.EIO, f"cannot write {path}: {exc.strerror}", str(path))


@dataclass(slots=True)
class _Publication:
    part: PartFile
    version: str | None
    path: Path | None = None
    error: BaseException | None = None
    done: bool = False


class Cache:
    """fastload's local cache. Thread-safe; one instance per process (re-opens after fork)."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str] | None = None,
        *,
        max_bytes: int | None = None,
        policy: Policy = "lru",
        lock_timeout_s: float = 600.0,
        fsync: bool = False,
        create: bool = True,
    ) -> None:
        """``create=False`` opens only an existing cache (a CacheError names the folder
        otherwise), for tools that inspect one rather than fill it."""
        self.config = CacheConfig(
            cache_dir=Path(cache_dir) if cache_dir is not None else default_cache_dir(),
            max_bytes=max_bytes,
            policy=policy,
            lock_timeout_s=lock_timeout_s,
            fsync=fsync,
        )
        self.dir = self.config.cache_dir
        if not create and not (self.dir / "index.sqlite").is_file():
            raise CacheError(
                errno.ENOENT,
                f"there is no fastload cache in {self.dir}; check the cache directory "
                "(cache_dir, --cache-dir or $FASTLOAD_CACHE_DIR)",
            )
        # objects/<xx>/ subfolders are made at their first publish: making all 256 up front
        # costs half a second on some disks, before a new cache's first batch.
        try:
            for sub in ("objects", "tmp", "manifests"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheError(
                exc.errno,
                f"cannot use {self.dir} as the cache directory ({exc.strerror}: "
                f"{exc.filename}); choose a writable folder with cache_dir, --cache-dir or "
                "$FASTLOAD_CACHE_DIR",
            ) from exc
        self.fetch_locks = FetchLocks.for_path(self.dir / "fetch.lock")
        self._objects_dir = str(self.dir / "objects")
        self._lock = threading.RLock()  # serializes this process's writes
        self._db: sqlite3.Connection | None = None
        self._db_pid = -1
        self._readers = threading.local()  # WAL: each thread reads without waiting for writes
        self._reader_dbs: list[tuple[int, threading.Thread, sqlite3.Connection]] = []
        self._recent: dict[str, float] = {}  # uses not yet written to the index
        self._pending: list[_Publication] = []  # parts waiting for the next group commit
        self._pending_lock = threading.Lock()
        self.plan: PlanHint | None = None
        self._conn()  # create the schema before any reader looks
        self._sweep_tmp()

    # --- index -------------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(
            self.dir / "index.sqlite", timeout=60.0, isolation_level=None, check_same_thread=False
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=60000")
        return db

    def _conn(self) -> sqlite3.Connection:
        """The writing connection of this process (used under self._lock)."""
        if self._db is None or self._db_pid != os.getpid():
            db = self._connect()
            db.executescript(_SCHEMA)
            self._db, self._db_pid = db, os.getpid()
        return self._db

    def _reader(self) -> sqlite3.Connection:
        """This thread's reading connection: lookups never queue behind a publish."""
        readers = self._readers
        if getattr(readers, "pid", None) != os.getpid():
            readers.db, readers.pid = self._connect(), os.getpid()
            with self._lock:
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
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction, serialized across every process using the cache."""
        with self._lock:
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.OperationalError as exc:
                if "full" in str(exc):
                    raise _disk_error(OSError(errno.ENOSPC, str(exc)), self.dir) from exc
                raise CacheError(
                    errno.EIO, f"cache index {self.dir / 'index.sqlite'}: {exc}"
                ) from exc

    def entry(self, url: str) -> Entry | None:
        return self.entry_by_id(object_id(url))

    def entry_by_id(self, oid: str) -> Entry | None:
        row = self._reader().execute("SELECT * FROM objects WHERE id = ?", (oid,)).fetchone()
        return Entry(*row) if row else None

    def entries(self) -> list[Entry]:
        rows = self._reader().execute("SELECT * FROM objects ORDER BY url").fetchall()
        return [Entry(*r) for r in rows]

    def used_bytes(self) -> int:
        (total,) = (
            self._reader().execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()
        )
        return int(total)

    def touch(self, urls: Sequence[str]) -> None:
        """Records a use of each url now (what ``lru`` orders by)."""
        now = time.time()
        with self._lock:
            self._recent.update((object_id(u), now) for u in urls)
        self._flush_recent()

    def _note_use(self, oid: str) -> None:
        """A use, buffered: writing the index on every read would cost more than the read."""
        if self.plan is not None:
            self.plan.advance(oid)
        with self._lock:
            self._recent[oid] = time.time()
            full = len(self._recent) >= _RECENCY_FLUSH
        if full:
            self._flush_recent()

    def _flush_recent(self) -> None:
        with self._lock:
            recent, self._recent = self._recent, {}
            if recent:
                with self._transaction() as db:
                    db.executemany(
                        "UPDATE objects SET last_use = ? WHERE id = ?",
                        [(t, oid) for oid, t in recent.items()],
                    )

    # --- paths -------------------------------------------------------------------------------

    def path_for(self, url: str) -> Path:
        return Path(self._object_path(object_id(url)))

    def _object_path(self, oid: str) -> str:
        return f"{self._objects_dir}/{oid[:2]}/{oid}"  # not pathlib: this is per object

    def _sweep_tmp(self) -> None:
        """Removes parts left by dead fetchers: those whose fetch lock is free."""
        for part in os.scandir(self.dir / "tmp"):
            oid = part.name.split(".", 1)[0]
            if self.fetch_locks.try_acquire(oid):  # else someone is writing it now
                try:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(part.path)
                finally:
                    self.fetch_locks.release(oid)

    # --- lookup and use ----------------------------------------------------------------------

    def lookup(
        self, url: str, *, version: str | None = None, size: int | None = None
    ) -> Path | None:
        """The cached file for url if it holds that version (and size), else None.

        A stale version or a file whose size no longer matches the index is dropped here,
        so it is refetched rather than returned.
        """
        entry = self.entry(url)
        if entry is None:
            return None
        path = self.path_for(url)
        stale = (version is not None and entry.version != version) or (
            size is not None and entry.size != size
        )
        try:
            damaged = path.stat().st_size != entry.size
        except FileNotFoundError:
            damaged = True
        if stale or damaged:
            self.drop(url)
            return None
        return path

    @contextlib.contextmanager
    def use(self, url: str, *, version: str | None = None) -> Iterator[Path | None]:
        """Holds url's cached file (or yields None on a miss, or when ``version`` is given and
        the cached copy is another version) so eviction leaves it alone."""
        fd = self._hold(url, version)
        try:
            yield None if fd is None else self.path_for(url)
        finally:
            if fd is not None:
                os.close(fd)

    def _hold(self, url: str, version: str | None = None) -> int | None:
        """A descriptor with a shared flock on url's current file, or None on a miss."""
        path = self.path_for(url)
        for _ in range(3):  # the file can be replaced or evicted between lookup and lock
            entry = self.entry(url)
            if entry is None or (version is not None and entry.version != version):
                return None
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = -1
            if os.fstat(fd).st_ino == current:
                self._note_use(object_id(url))
                return fd
            os.close(fd)  # replaced meanwhile: hold the current one instead
        return None

    # --- fetching and publishing -------------------------------------------------------------

    def try_fetch_lock(self, url: str) -> FetchLock | None:
        """The fetch lock of url if it is free now, else None (someone else is fetching it).

        The part is named by the object alone: the lock makes its holder the only writer, and
        a part left by a holder that died is simply overwritten.
        """
        oid = object_id(url)
        if not self.fetch_locks.try_acquire(oid):
            return None
        return FetchLock(self.fetch_locks, oid)

    def fetch_lock(self, url: str) -> FetchLock:
        """The fetch lock of url, waiting (up to lock_timeout_s) while another process holds it."""
        deadline = time.monotonic() + self.config.lock_timeout_s
        delay = 0.001
        while (lock := self.try_fetch_lock(url)) is None:
            if time.monotonic() >= deadline:
                raise self.lock_timeout(url)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return lock

    def lock_timeout(self, url: str) -> CacheError:
        return CacheError(
            errno.ETIMEDOUT,
            f"waited {self.config.lock_timeout_s:.0f}s for another process fetching {url}; "
            f"it may be stuck: `fuser -v {self.dir / 'fetch.lock'}` lists the candidates",
        )

    def new_part(self, url: str) -> PartFile:
        """Where url's bytes are written before publication; hold its fetch lock."""
        path = self.dir / "tmp" / object_id(url)
        try:
            return PartFile(path, url)
        except OSError as exc:
            raise _disk_error(exc, path) from exc

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

    def publish(self, part: PartFile, *, version: str | None) -> Path | None:
        """Moves a finished part into the cache, evicting by policy to stay within max_bytes.

        Returns the published path, or None when the policy turns the object away (the cache
        is full under ``pin``, or under ``plan`` everything cached is needed sooner); the
        part is then removed. Threads publishing at once share one index transaction (group
        commit): whoever gets the lock publishes everything queued so far.
        """
        part.close(fsync=self.config.fsync)
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
        return item.path

    def publish_many(self, parts: Sequence[tuple[PartFile, str | None]]) -> list[Path | None]:
        """:meth:`publish` for a batch of (part, version) in one index transaction; the
        paths in order (None where the policy turned a part away). A failure is raised
        after the others are published."""
        items = []
        for part, version in parts:
            part.close(fsync=self.config.fsync)
            items.append(_Publication(part, version))
        if items:
            with self._lock:
                self._publish_batch(items)
        for item in items:
            if item.error is not None:
                raise item.error
        return [item.path for item in items]

    def _publish_batch(self, batch: list[_Publication]) -> None:
        try:
            with self._transaction() as db:
                for item in batch:
                    part = item.part
                    oid = object_id(part.url)
                    try:
                        if self._make_room(db, oid, part.size):
                            final = self.path_for(part.url)
                            try:
                                os.replace(part.path, final)
                            except FileNotFoundError:  # the subfolder's first object
                                final.parent.mkdir(exist_ok=True)
                                os.replace(part.path, final)
                            self._index_add(
                                db, oid, part.url, part.size, part.checksum, item.version
                            )
                            item.path = final
                        else:
                            part.discard()
                    except OSError as exc:
                        part.discard()
                        item.error = _disk_error(exc, part.path)
        except BaseException as exc:
            for item in batch:
                if item.path is None and item.error is None:
                    item.part.discard()
                    item.error = exc
                elif item.path is not None:  # renamed, but the index never recorded it
                    item.path, item.error = None, exc
            if not isinstance(exc, Exception):
                raise
        finally:
            for item in batch:
                item.done = True

    @staticmethod
    def _size_of(db: sqlite3.Connection, oid: str) -> int:
        row = db.execute("SELECT size FROM objects WHERE id = ?", (oid,)).fetchone()
        return int(row[0]) if row else 0

    def _index_add(
        self,
        db: sqlite3.Connection,
        oid: str,
        url: str,
        size: int,
        checksum: str,
        version: str | None,
    ) -> None:
        old = self._size_of(db, oid)
        now = time.time()
        db.execute(
            "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?, ?, ?, ?)",
            (oid, printable(url), size, checksum, version, now, now),
        )
        db.execute("UPDATE totals SET value = value + ? WHERE name = 'bytes'", (size - old,))

    def _index_remove(self, db: sqlite3.Connection, oid: str) -> None:
        old = self._size_of(db, oid)
        db.execute("DELETE FROM objects WHERE id = ?", (oid,))
        db.execute("UPDATE totals SET value = value - ? WHERE name = 'bytes'", (old,))

    def _make_room(self, db: sqlite3.Connection, oid: str, size: int) -> bool:
        max_bytes = self.config.max_bytes
        if max_bytes is None:
            return True
        (total,) = db.execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()
        need = total - self._size_of(db, oid) + size - max_bytes
        if need <= 0:
            return True
        if size > max_bytes or self.config.policy == "pin":
            return False
        victims: Iterator[tuple[str, int]]
        plan = self.plan
        if self.config.policy == "plan" and plan is not None:
            # Furthest next use first; never admit what is needed later than all of them.
            rows = db.execute("SELECT id, size FROM objects WHERE id != ?", (oid,)).fetchall()
            mine = plan.next_use(oid)
            ranked = sorted(((plan.next_use(r[0]), r) for r in rows), reverse=True)
            victims = (r for when, r in ranked if when > mine)
        else:  # lru, and plan without a plan: least recently used first
            with self._lock:
                recent, self._recent = self._recent, {}
            db.executemany(
                "UPDATE objects SET last_use = ? WHERE id = ?", [(t, o) for o, t in recent.items()]
            )
            victims = (
                db.execute("SELECT id, size FROM objects WHERE id != ? ORDER BY last_use", (oid,))
                .fetchall()
                .__iter__()
            )
        chosen: list[tuple[str, int]] = []
        freed = 0
        try:
            for victim_id, victim_size in victims:
                if freed >= need:
                    break
                fd = self._lock_unused(victim_id)
                if fd is None:
                    continue  # in use: never evicted
                chosen.append((victim_id, fd))
                freed += victim_size
            if freed < need:
                return False
            for victim_id, _ in chosen:
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / "objects" / victim_id[:2] / victim_id).unlink()
                self._index_remove(db, victim_id)
            return True
        finally:
            for _, fd in chosen:
                os.close(fd)

    def _lock_unused(self, oid: str) -> int | None:
        """An exclusive lock on oid's file if no reader holds it, as an open descriptor."""
        try:
            fd = os.open(self.dir / "objects" / oid[:2] / oid, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # gone already: free to drop
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    # --- maintenance -------------------------------------------------------------------------

    def drop(self, url: str) -> bool:
        """Removes url from the cache unless a reader holds it; True if it is gone."""
        return self._drop(object_id(url))

    def _drop(self, oid: str) -> bool:
        with self._transaction() as db:
            fd = self._lock_unused(oid)
            if fd is None:
                return False
            try:
                with contextlib.suppress(FileNotFoundError):
                    (self.dir / "objects" / oid[:2] / oid).unlink()
                self._index_remove(db, oid)
            finally:
                os.close(fd)
        return True

    def verify(self, *, repair: bool = True) -> list[tuple[str, str]]:
        """Recomputes every checksum; returns (url, problem) for each bad entry.

        With ``repair`` the bad entries are dropped (refetched on next use), and files that
        no index row claims (left by a crash between publish and commit) are removed.
        """
        problems: list[tuple[str, str]] = []
        bad: list[str] = []
        for entry in self.entries():
            path = self.dir / "objects" / entry.id[:2] / entry.id
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                problem = "missing"
            else:
                problem = ""
                if size != entry.size:
                    problem = f"size {size} != recorded {entry.size}"
                elif checksum_file(path) != entry.checksum:
                    problem = "checksum mismatch"
            if problem:
                problems.append((entry.url, problem))
                bad.append(entry.id)
        if repair:
            for oid in bad:
                self._drop(oid)
            known = {e.id for e in self.entries()}
            for path in (self.dir / "objects").glob("*/*"):
                if path.name not in known and self.fetch_locks.try_acquire(path.name):
                    try:
                        if self.entry_by_id(path.name) is None:
                            path.unlink(missing_ok=True)
                    finally:
                        self.fetch_locks.release(path.name)
        return problems

    def read_verified(self, url: str) -> bytes:
        """The bytes of a cached object after checking them against the index."""
        entry = self.entry(url)
        if entry is None:
            raise CacheError(errno.ENOENT, f"{url} is not cached")
        data = self.path_for(url).read_bytes()
        if len(data) != entry.size or checksum_bytes(data) != entry.checksum:
            self.drop(url)
            raise CacheCorruptError(
                errno.EIO, f"cached copy of {url} is corrupt; it was dropped and will be refetched"
            )
        return data

    def evict(self, *, to_bytes: int = 0) -> int:
        """Evicts unused objects, least recently used first, until at most to_bytes remain."""
        removed = 0
        for entry in sorted(self.entries(), key=lambda e: e.last_use):
            if self.used_bytes() <= to_bytes:
                break
            if self._drop(entry.id):
                removed += 1
        return removed

    def clear(self) -> int:
        """Removes every object not in use, and the listings and format indexes derived from
        the remote (they are rebuilt on next use); returns how many objects were removed."""
        removed = self.evict(to_bytes=0)
        for derived in ("manifests", "indexes"):
            for path in (self.dir / derived).glob("*"):
                if path.is_file():
                    path.unlink(missing_ok=True)
        return removed

    def close(self) -> None:
        """Writes buffered uses to the index and closes this process's connections."""
        if self._db_pid == os.getpid():
            self._flush_recent()
        with self._lock:
            if self._db is not None and self._db_pid == os.getpid():
                self._db.close()
            self._db = None
            for pid, _, db in self._reader_dbs:
                if pid == os.getpid():  # a parent's connections are not ours to close
                    db.close()
            self._reader_dbs = []
            self._readers = threading.local()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
