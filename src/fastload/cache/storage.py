"""The cache's bytes on disk: small entries packed into segment files, large ones in files
of their own.

A file per 512-byte object costs a create, a write, a close and a rename (about 0.15 ms of
CPU here, most of it in the kernel), and a 4 KB block on disk. So entries up to
``segment_entry_max`` bytes are appended to the writing process's *segment*, one
``pwritev`` per published batch; larger ones are written to ``tmp/`` and renamed into
``objects/``. Layout::

    objects/ab/<id>     an entry's bytes (id hashes its URL, and its range if it is one)
    segments/<n>.seg    many entries' bytes; n is never reused
    tmp/                parts and new segments being written; never read

Rules that keep readers safe without a lock per read:

- Bytes, once published, never change: a segment is only appended to (by the one process
  that created it, which holds a shared ``flock`` on it while it does) and is removed
  whole; an own file is replaced only by a rename.
- Whoever uses an entry holds a shared ``flock`` on its file; eviction takes an exclusive
  one without waiting and skips what it cannot lock, so what is in use is never evicted.
- Bytes appended but not yet recorded by the index (a writer killed mid-publish) lie
  past the segment's recorded size; the next open of the cache cuts them off.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from fastload.cache.config import CacheConfig
from fastload.cache.locks import FetchLocks
from fastload.errors import CacheError, UnsafeCachePathError
from fastload.safe_files import check_own, open_exclusive, own_folder

SEGMENT_BYTES_MAX = 64 << 20
SEGMENT_BYTES_MIN = 1 << 20  # a budget too small for 64 such segments packs nothing
ENTRY_IN_SEGMENT_MAX = 1 << 20
_IOV_MAX = 1024  # buffers per pwritev (Linux's IOV_MAX)
_SEGMENT_PART = "segment-"  # prefix of segments being created in tmp/
_INDEX_ROOM = 128 << 10  # left free on a full disk for the index's pages of a batch


def segment_bytes_for(max_bytes: int | None) -> int:
    """Segments are at most 1/64 of the budget, so evicting one frees a small share of it;
    0 (no packing) where that would make them smaller than 1 MB."""
    if max_bytes is None:
        return SEGMENT_BYTES_MAX
    size = min(SEGMENT_BYTES_MAX, max_bytes // 64)
    return size if size >= SEGMENT_BYTES_MIN else 0


@dataclass(frozen=True, slots=True)
class Location:
    """Where an entry's bytes are: ``[offset, offset + size)`` of the file at ``path``."""

    path: str
    offset: int
    size: int
    # xxh3 of the bytes, as the index records it (read_checks.py): what they are, not where
    checksum: int | None = field(default=None, compare=False)

    def read(self, start: int = 0, length: int | None = None) -> bytes:
        """Bytes [start, start + length) of the entry (to its end if length is None)."""
        start = min(start, self.size)
        length = self.size - start if length is None else min(length, self.size - start)
        with open(self.path, "rb", buffering=0) as f:
            return pread_exactly(f.fileno(), length, self.offset + start, self.path)

    def read_bytes(self) -> bytes:
        return self.read()


def pread_exactly(fd: int, length: int, offset: int, path: str) -> bytes:
    data = os.pread(fd, length, offset)
    while len(data) < length:  # a short read: more, or the file is shorter than recorded
        more = os.pread(fd, length - len(data), offset + len(data))
        if not more:
            raise CacheError(
                errno.EIO,
                f"{path} ends before the cached entry it holds (changed outside fastload?); "
                "run `fastload cache verify` to drop what is damaged, and it is refetched",
                path,
            )
        data += more
    return data


def disk_error(exc: OSError, path: Path | str) -> CacheError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return CacheError(
            exc.errno,
            f"no space left on the device holding {path} while caching; free space or give "
            "the cache a max_bytes below the free space (fastload warm --max-bytes)",
            str(path),
        )
    return CacheError(exc.errno or errno.EIO, f"cannot write {path}: {exc.strerror}", str(path))


# Files and folders of the cache directory that fastload writes, checked not to be links
# when the cache opens (sqlite and the lock files would write through one).
_OWN_NAMES = (
    "manifests",
    "indexes",
    "index.sqlite",
    "index.sqlite-wal",
    "index.sqlite-shm",
    "index.sqlite-journal",
    "fetch.lock",
)


class PartFile:
    """An entry's bytes on their way into the cache, hashed as written.

    Up to ``memory_limit`` bytes stay in memory (as the caller's buffers, not copied), for
    a segment; past that they go to a file in ``tmp/``. Published or discarded, never read.
    """

    def __init__(
        self, path: str, url: str, span: tuple[int, int] | None = None, memory_limit: int = 0
    ) -> None:
        self.path = path
        self.url = url
        self.span = span  # (start, length) of a range entry
        self.size = 0
        self.chunks: list[memoryview] | None = [] if memory_limit > 0 else None
        self._memory_limit = memory_limit
        self._hash = xxhash.xxh3_64()
        self._fd = -1
        if self.chunks is None:
            self._open()

    def _open(self) -> None:
        try:  # never through a link planted at the part's (predictable) name
            self._fd = open_exclusive(self.path)
        except UnsafeCachePathError:
            raise
        except OSError as exc:
            raise disk_error(exc, self.path) from exc

    @property
    def in_memory(self) -> bool:
        return self.chunks is not None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.chunks is not None:
            if self.size + len(view) <= self._memory_limit:
                self.chunks.append(view)
                self.size += len(view)
                self._hash.update(view)
                return
            chunks, self.chunks = self.chunks, None  # too large for a segment: spill
            self._open()
            for chunk in chunks:
                self._write(chunk)
        self._write(view)
        self.size += len(view)
        self._hash.update(view)

    def _write(self, view: memoryview) -> None:
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self.discard()
            raise disk_error(exc, self.path) from exc

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

    def to_file(self, *, fsync: bool) -> None:
        """Writes in-memory bytes to the part's file (for an entry that gets a file)."""
        if self.chunks is not None:
            chunks, self.chunks = self.chunks, None
            self._open()
            for chunk in chunks:
                self._write(chunk)
        self.close(fsync=fsync)

    def discard(self) -> None:
        self.chunks = None
        self.close(fsync=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _Segment:
    """The segment this process appends to: it holds a shared flock on it meanwhile. The
    descriptor closes with the object too: a cache dropped without ``close()`` (a loader
    nobody closed) must not keep the file open, and unevictable, for the life of the
    process."""

    def __init__(self, number: int, fd: int) -> None:
        self.id, self.fd, self.size, self.pid = number, fd, 0, os.getpid()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0 and self.pid == os.getpid():  # a parent's descriptor is not ours
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class Storage:
    """Files and segments under a cache directory (see the module docstring)."""

    def __init__(self, directory: Path, config: CacheConfig) -> None:
        self.dir = directory
        self.fsync = config.fsync
        chosen = config.segment_bytes
        self.segment_bytes = segment_bytes_for(config.max_bytes) if chosen is None else chosen
        self.segment_entry_max = min(ENTRY_IN_SEGMENT_MAX, self.segment_bytes // 16)
        self._objects = str(directory / "objects")
        self._segments = str(directory / "segments")
        self._tmp = str(directory / "tmp")
        self._active: _Segment | None = None
        self._grown: list[tuple[int, int]] = []
        for sub in ("objects", "segments", "tmp"):
            own_folder(directory / sub)  # a link there would take every write elsewhere
        for name in _OWN_NAMES:
            check_own(directory / name, folder=name in ("manifests", "indexes"))

    # --- where ---------------------------------------------------------------------------------

    def object_path(self, oid: str) -> str:
        return f"{self._objects}/{oid[:2]}/{oid}"  # not pathlib: this is per entry

    def segment_path(self, segment: int) -> str:
        return f"{self._segments}/{segment}.seg"

    def location(
        self, oid: str, segment: int | None, position: int, size: int, checksum: int | None = None
    ) -> Location:
        if segment is None:
            return Location(self.object_path(oid), 0, size, checksum)
        return Location(self.segment_path(segment), position, size, checksum)

    @staticmethod
    def intact(location: Location, *, packed: bool) -> bool:
        """Whether the file is there and of the right length (a cheap check, not a checksum)."""
        try:
            length = os.stat(location.path).st_size
        except FileNotFoundError:
            return False
        return length >= location.offset + location.size if packed else length == location.size

    # --- writing -----------------------------------------------------------------------------

    def new_part(self, oid: str, url: str, span: tuple[int, int] | None, packs: bool) -> PartFile:
        memory_limit = self.segment_entry_max if packs else 0
        return PartFile(f"{self._tmp}/{oid}", url, span, memory_limit)

    def place_file(self, part: PartFile, oid: str) -> str:
        """Moves a part into its own file (os.replace: readers see all of it or nothing)."""
        part.to_file(fsync=self.fsync)
        final = self.object_path(oid)
        check_own(os.path.dirname(final), folder=True)
        try:
            os.replace(part.path, final)
        except FileNotFoundError:  # the subfolder's first entry
            os.makedirs(os.path.dirname(final), exist_ok=True)
            os.replace(part.path, final)
        return final

    def append(
        self, parts: Sequence[PartFile], new_segment: Callable[[], int]
    ) -> tuple[list[tuple[int, int]], CacheError | None]:
        """Appends in-memory parts to this process's segment(s): (segment, position) of each
        part written whole, in order, and the error that stopped the rest (a full disk):
        what fitted is still published.

        ``new_segment()`` registers a segment in the caller's index transaction and returns
        its number; :meth:`take_growth` then says how much each segment grew. The caller
        records both in that transaction; if it fails, it must call :meth:`seal` (the
        bytes then lie unrecorded past the segment's recorded size and are cut off later).
        """
        placed: list[tuple[int, int]] = []
        run: list[memoryview] = []
        ends: list[int] = []  # where each part of the run ends, from the run's start
        try:
            for part in parts:
                run_bytes = ends[-1] if ends else 0
                active = self._active
                if (
                    active is None
                    or active.pid != os.getpid()
                    or active.size + run_bytes + part.size > self.segment_bytes
                ):
                    self._flush(run, ends)
                    run, ends, run_bytes = [], [], 0
                    active = self._open_segment(new_segment)
                placed.append((active.id, active.size + run_bytes))
                run.extend(part.chunks or ())
                ends.append(run_bytes + part.size)
            self._flush(run, ends)
        except _ShortWrite as short:
            return placed[: len(placed) - len(ends) + short.whole_parts], short.error
        except CacheError as exc:  # no room for a new segment: what was flushed stays
            return placed, exc
        return placed, None

    def _open_segment(self, new_segment: Callable[[], int]) -> _Segment:
        """Seals the active segment (it may be evicted from then on) and starts a new one."""
        if self._active is not None:
            self._active.close()
        self._active = None
        number = new_segment()
        part = f"{self.dir}/tmp/{_SEGMENT_PART}{number}.{os.getpid()}"
        try:
            fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)  # before it is visible: held while we append
            os.replace(part, self.segment_path(number))
        except OSError as exc:
            raise disk_error(exc, part) from exc
        self._active = _Segment(number, fd)
        return self._active

    def _flush(self, run: list[memoryview], ends: list[int]) -> None:
        active = self._active
        if not run or active is None:
            return
        path = self.segment_path(active.id)
        try:
            written = _pwritev_all(active.fd, run, active.size, path)
        except _ShortWrite as short:
            # Stop appending after the torn part (cut off here, or at the next open).
            # Parts written whole are kept, less what leaves the index room to record them.
            short.whole_parts = bisect.bisect_right(ends, short.written - _INDEX_ROOM)
            kept = ends[short.whole_parts - 1] if short.whole_parts else 0
            self._grown.append((active.id, kept))
            with contextlib.suppress(OSError):  # the torn part's bytes: room for the index
                os.ftruncate(active.fd, active.size + kept)
            active.size += kept
            active.close()
            self._active = None
            raise
        if self.fsync:
            os.fdatasync(active.fd)
        active.size += written
        self._grown.append((active.id, written))

    def take_growth(self) -> list[tuple[int, int]]:
        """(segment, bytes) appended since the last call."""
        grown, self._grown = self._grown, []
        return grown

    def seal(self) -> None:
        """Stops appending to the active segment: at close, or when its last bytes were
        never recorded."""
        active, self._active = self._active, None
        self._grown = []
        if active is not None:
            active.close()

    def active_segment(self) -> int | None:
        active = self._active
        return active.id if active is not None and active.pid == os.getpid() else None

    # --- removing ----------------------------------------------------------------------------

    def lock_unused(self, path: str) -> int | None:
        """An exclusive flock on path if nobody holds it, as an open descriptor (a missing
        file is free to drop: a descriptor of /dev/null)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def remove(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # --- holding -----------------------------------------------------------------------------

    def hold(self, location: Location) -> int | None:
        """A descriptor with a shared flock on the location's current file, or None if it
        is gone (evicted, or replaced: the caller looks again)."""
        try:
            fd = os.open(location.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            current = os.stat(location.path).st_ino
        except FileNotFoundError:
            current = -1
        if os.fstat(fd).st_ino != current:
            os.close(fd)
            return None
        return fd

    # --- after crashes -----------------------------------------------------------------------

    def sweep(
        self,
        recorded: dict[int, int],
        recorded_now: Callable[[int], int | None],
        fetch_locks: FetchLocks,
    ) -> None:
        """Removes what dead writers left: parts whose fetch lock is free, segments being
        created by nobody, segment files the index does not know, and bytes past a segment's
        recorded size. Anything a live process holds is left alone.

        ``recorded`` is a snapshot of the segments' recorded sizes; ``recorded_now(n)``
        reads one afresh, which is asked again once a segment is locked: its writer may
        have recorded more, and let go of it, since the snapshot."""
        for entry in os.scandir(self.dir / "tmp"):
            if entry.name.startswith(_SEGMENT_PART):
                # Its creator locks it only after creating it: a live one's is left alone.
                pid = entry.name.rpartition(".")[2]
                if not (pid.isdigit() and _alive(int(pid))):
                    self._remove_unheld(entry.path)
                continue
            oid = entry.name.split(".", 1)[0]
            if fetch_locks.try_acquire(oid):  # else someone is writing it now
                try:
                    self.remove(entry.path)
                finally:
                    fetch_locks.release(oid)
        for entry in os.scandir(self.dir / "segments"):
            number = _segment_number(entry.name)
            if number is None or number == self.active_segment():
                continue
            if number in recorded and entry.stat().st_size <= recorded[number]:
                continue  # the usual case: nothing past its recorded end, no lock taken
            fd = self.lock_unused(entry.path)
            if fd is None:
                continue  # its writer is alive
            try:
                size = recorded_now(number)
                if size is None:
                    self.remove(entry.path)
                elif os.fstat(fd).st_size > size:
                    os.truncate(entry.path, size)
            finally:
                os.close(fd)

    def _remove_unheld(self, path: str) -> None:
        fd = self.lock_unused(path)
        if fd is not None:
            try:
                self.remove(path)
            finally:
                os.close(fd)

    def segment_files(self) -> Iterable[tuple[int, str]]:
        for entry in os.scandir(self.dir / "segments"):
            number = _segment_number(entry.name)
            if number is not None:
                yield number, entry.path


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _segment_number(name: str) -> int | None:
    stem, dot, suffix = name.partition(".")
    return int(stem) if dot and suffix == "seg" and stem.isdigit() else None


class _ShortWrite(Exception):
    """A write that stopped part way (a full disk): how far it got, and why."""

    def __init__(self, written: int, error: CacheError) -> None:
        super().__init__(str(error))
        self.written = written
        self.error = error
        self.whole_parts = 0


def _pwritev_all(fd: int, chunks: list[memoryview], offset: int, path: str) -> int:
    """Writes chunks at offset, however short the kernel's writes are; the bytes written.
    Raises _ShortWrite, saying how many bytes did get written, when the kernel refuses."""
    total = 0
    i = 0
    pending = list(chunks)
    try:
        while i < len(pending):
            n = os.pwritev(fd, pending[i : i + _IOV_MAX], offset + total)
            total += n
            while i < len(pending) and n >= len(pending[i]):
                n -= len(pending[i])
                i += 1
            if n:
                pending[i] = pending[i][n:]
    except OSError as exc:
        raise _ShortWrite(total, disk_error(exc, path)) from exc
    return total
