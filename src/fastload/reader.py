"""Batched positional reads into caller-owned buffers.

The reader takes a batch of requests (a file path or open descriptor, an offset, a length, a
destination buffer and an offset in it) and fills the destinations on a pool of threads. Two
backends share this module's validation and error reporting:

* ``native``: ``fastload._native``, C++ threads calling ``pread`` with the GIL released for the
  whole batch;
* ``python``: the same on a ``ThreadPoolExecutor`` calling ``os.preadv`` (which also releases
  the GIL, but pays interpreter overhead per request).

The native one is used when the extension loads, unless ``FASTLOAD_NATIVE=0`` is set.
"""

from __future__ import annotations

import atexit
import errno as errno_codes
import importlib
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Literal, NamedTuple, TypeAlias

import numpy as np
import numpy.typing as npt

from fastload.errors import InvalidDestinationError, ReadError, ShortReadError
from fastload.resources import usable_cpus

log = logging.getLogger(__name__)

NATIVE_ENV = "FASTLOAD_NATIVE"
"""Set to ``0`` to force the pure-Python backend (both backends are tested this way)."""

Backend: TypeAlias = Literal["native", "python"]
Source: TypeAlias = "str | os.PathLike[str] | int"

_BYTE_FORMATS = frozenset({"B", "b", "c"})
_DEFAULT_CHUNK_BYTES = 8 << 20


def _load_native() -> tuple[ModuleType | None, str]:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None, f"disabled by {NATIVE_ENV}=0"
    try:  # by name, as decode.native_jpeg does: the extension module is built, not a source
        native = importlib.import_module("fastload._native")
    except ImportError as exc:  # a broken or missing build: fall back, but say so once
        log.warning("fastload native extension unavailable (%s); using the Python reader", exc)
        return None, f"failed to load: {exc}"
    return native, "loaded"


_native, _native_status = _load_native()
if _native is not None and hasattr(_native, "prepare_exit"):  # not on an older build
    # Registered before any loader's exit hook, so it runs after them (atexit runs the last
    # registered first): a read still in flight once the loader stopped waiting parks its
    # thread rather than ending the process with std::terminate (native/gil_release.hpp).
    atexit.register(_native.prepare_exit)


def native_available() -> bool:
    """Whether the C++ extension is loaded and active (``FASTLOAD_NATIVE=0`` turns it off)."""
    return _native is not None


def native_status() -> str:
    """Why the native backend is or is not active, for logs and ``fastload doctor``."""
    return _native_status


def default_num_threads() -> int:
    # Reads from page cache are memcpy-bound (one thread per core suffices) but reads from NVMe
    # or network disks want more requests in flight than there are cores.
    return min(32, max(4, 2 * usable_cpus()))


class ReadRequest(NamedTuple):
    """Read ``length`` bytes at ``offset`` of ``source`` into ``dest[dest_offset:]``."""

    source: Source
    offset: int
    length: int
    dest: Any
    dest_offset: int = 0


def _describe(source: str | int) -> str:
    return f"file descriptor {source}" if isinstance(source, int) else repr(source)


def _byte_view(dest: Any, index: int) -> memoryview:
    """A writable 1-D byte view of dest, or a clear error; never a silent copy."""
    where = f"destination {index} ({type(dest).__name__})"
    if type(dest).__module__ == "torch" and hasattr(dest, "numpy"):
        # torch tensors do not export the buffer protocol; a CPU tensor's numpy() shares memory.
        if dest.device.type != "cpu":
            raise InvalidDestinationError(f"{where} is on {dest.device}; read into a CPU tensor")
        if str(dest.dtype) != "torch.uint8":
            raise InvalidDestinationError(f"{where} has dtype {dest.dtype}; use torch.uint8")
        if not dest.is_contiguous():
            raise InvalidDestinationError(f"{where} is not contiguous; pass tensor.contiguous()")
        dest = dest.numpy()
    try:
        view = memoryview(dest)
    except TypeError:
        raise InvalidDestinationError(
            f"{where} does not export a buffer; use bytearray, a numpy uint8 array, "
            "a CPU uint8 torch tensor or fastload.aligned_empty()"
        ) from None
    if view.readonly:
        raise InvalidDestinationError(f"{where} is read-only; pass a writable buffer")
    if not view.c_contiguous:
        raise InvalidDestinationError(f"{where} is not C-contiguous; pass a contiguous copy")
    if view.itemsize != 1 or view.format not in _BYTE_FORMATS:
        raise InvalidDestinationError(
            f"{where} holds items of format {view.format!r} ({view.itemsize} bytes); "
            "destinations must hold bytes (uint8)"
        )
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class _Batch:
    """Requests in plain values: unique files, unique destinations, and an int64 table."""

    def __init__(self, requests: Iterable[ReadRequest | Sequence[Any]]) -> None:
        self.files: list[str | int] = []
        self.dests: list[memoryview] = []
        file_index: dict[str | int, int] = {}
        dest_index: dict[int, int] = {}
        keep_alive: list[Any] = []  # ids stay unique only while the objects live
        rows: list[tuple[int, int, int, int, int]] = []
        for i, request in enumerate(requests):
            source, offset, length, dest, dest_offset = ReadRequest(*request)
            if isinstance(source, bool) or not isinstance(source, (int, str, os.PathLike)):
                raise TypeError(f"request {i}: source must be a path or a file descriptor")
            key = source if isinstance(source, int) else os.fspath(source)
            if isinstance(key, int) and key < 0:
                raise ValueError(f"request {i}: file descriptor must be >= 0, got {key}")
            f = file_index.setdefault(key, len(self.files))
            if f == len(self.files):
                self.files.append(key)
            d = dest_index.get(id(dest))
            if d is None:
                d = dest_index[id(dest)] = len(self.dests)
                self.dests.append(_byte_view(dest, i))
                keep_alive.append(dest)
            if offset < 0 or length < 0 or dest_offset < 0:
                raise ValueError(
                    f"request {i} on {_describe(key)}: offset ({offset}), length ({length}) and "
                    f"destination offset ({dest_offset}) must be >= 0"
                )
            room = self.dests[d].nbytes
            if dest_offset + length > room:
                raise InvalidDestinationError(
                    f"request {i} on {_describe(key)}: destination holds {room} bytes, too small "
                    f"for {length} bytes at destination offset {dest_offset}"
                )
            rows.append((f, offset, length, d, dest_offset))
        self.table = np.array(rows, dtype=np.int64).reshape(-1, 5)

    @classmethod
    def of_spans(
        cls,
        files: Sequence[str],
        dest: Any,
        file_ids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        dest_offsets: npt.NDArray[np.int64],
    ) -> _Batch:
        """Requests into one destination given as columns, checked in array passes."""
        batch = cls.__new__(cls)
        batch.files = list(files)
        batch.dests = [_byte_view(dest, 0)]
        n = len(lengths)
        table = np.zeros((n, 5), dtype=np.int64)
        table[:, 0], table[:, 1], table[:, 2], table[:, 4] = (
            file_ids,
            offsets,
            lengths,
            dest_offsets,
        )
        if n:
            if table.min() < 0 or int(file_ids.max()) >= len(batch.files):
                raise ValueError("file ids, offsets, lengths and destination offsets must be >= 0")
            room = batch.dests[0].nbytes
            end = int((table[:, 4] + table[:, 2]).max())
            if end > room:
                raise InvalidDestinationError(
                    f"destination holds {room} bytes, too small for requests ending at {end}"
                )
        batch.table = table
        return batch

    def raise_for(self, result: npt.NDArray[np.int64], *, exact: bool) -> None:
        failed = np.flatnonzero(result < 0)
        if failed.size:
            i = int(failed[0])
            f, offset, length, _, _ = (int(x) for x in self.table[i])
            code = int(-result[i])
            others = f" ({failed.size - 1} other requests failed too)" if failed.size > 1 else ""
            raise ReadError(
                code,
                f"{os.strerror(code)}: reading {length} bytes at offset {offset} of "
                f"{_describe(self.files[f])} failed{others}",
                self.files[f] if isinstance(self.files[f], str) else None,
            )
        if exact:
            short = np.flatnonzero(result != self.table[:, 2])
            if short.size:
                i = int(short[0])
                f, offset, length, _, _ = (int(x) for x in self.table[i])
                raise ShortReadError(
                    errno_codes.EIO,
                    f"read only {int(result[i])} of {length} bytes at offset {offset} of "
                    f"{_describe(self.files[f])}: the file ends early; was it truncated or "
                    "replaced since its size was recorded?",
                    self.files[f] if isinstance(self.files[f], str) else None,
                )


class _PythonBackend:
    def __init__(self, num_threads: int, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.num_threads = max(1, num_threads)
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="fastload-read")

    def read(self, batch: _Batch) -> npt.NDArray[np.int64]:
        table = batch.table
        chunks = [
            (r, at, min(self.chunk_bytes, int(length) - at))
            for r, length in enumerate(table[:, 2].tolist())
            for at in range(0, max(int(length), 1), self.chunk_bytes)
        ]
        fds: dict[int, int] = {}
        lock = threading.Lock()

        def fd_for(f: int) -> int:
            source = batch.files[f]
            if isinstance(source, int):
                return source
            with lock:
                if f not in fds:
                    try:
                        fds[f] = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
                    except OSError as exc:
                        fds[f] = -exc.errno if exc.errno else -errno_codes.EIO
                return fds[f]

        def read_chunk(chunk: tuple[int, int, int]) -> int:
            r, at, length = chunk
            f, offset, _, d, dest_offset = table[r].tolist()
            fd = fd_for(f)
            if fd < 0:
                return fd
            view = batch.dests[d][dest_offset + at : dest_offset + at + length]
            done = 0
            while done < length:
                try:
                    got = os.preadv(fd, [view[done:]], offset + at + done)
                except InterruptedError:
                    continue
                except OSError as exc:
                    return -(exc.errno or errno_codes.EIO)
                if got == 0:
                    break
                done += got
            return done

        # One task per thread, not per chunk: a future per 100 KB read costs more than the read.
        groups = max(1, min(self.num_threads, len(chunks)))
        try:
            per_group = self._pool.map(
                lambda g: [read_chunk(c) for c in chunks[g::groups]], range(groups)
            )
            chunk_results = [0] * len(chunks)
            for g, results in enumerate(per_group):
                chunk_results[g::groups] = results
        finally:
            for fd in fds.values():
                if fd >= 0:
                    os.close(fd)
        result = np.zeros(len(table), dtype=np.int64)
        for (r, _, _), got in zip(chunks, chunk_results, strict=True):
            if result[r] >= 0:
                result[r] = got if got < 0 else result[r] + got
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# Objects whose threads were left behind in a parent process by fork(); destroying them in
# the child would try to join threads that do not exist there (and block for good in
# pthread_cond_destroy). Every reader alive at a fork, even one only waiting for the garbage
# collector, gives its pool up here in the child, so no destructor of it ever runs there.
_orphaned_by_fork: list[Any] = []
_readers: weakref.WeakSet[BatchReader] = weakref.WeakSet()


def _orphan_pools_in_child() -> None:
    for reader in list(_readers):
        if reader._impl is not None and reader._pid != os.getpid():
            _orphaned_by_fork.append(reader._impl)
            reader._impl = None


os.register_at_fork(after_in_child=_orphan_pools_in_child)


@atexit.register
def _close_readers() -> None:
    # Native pools still referenced at exit (a loader the script never closed) go now, while
    # the interpreter can still run their destructors, rather than being reported as leaks.
    for reader in list(_readers):
        reader.close()


class BatchReader:
    """Reads batches of :class:`ReadRequest` on a thread pool; see the module docstring.

    >>> buf = aligned_empty(4096)
    >>> with BatchReader() as reader:                                # doctest: +SKIP
    ...     reader.read([("/data/a.jpg", 0, 4096, buf)], exact=True)
    array([4096])
    """

    def __init__(
        self,
        *,
        num_threads: int | None = None,
        chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
        backend: Literal["auto", "native", "python"] = "auto",
    ) -> None:
        if num_threads is not None and num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {num_threads}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if backend not in ("auto", "native", "python"):
            raise ValueError(f"backend must be 'auto', 'native' or 'python', got {backend!r}")
        if backend == "native" and _native is None:
            raise ImportError(
                f"the native reader is not available ({_native_status}); "
                "reinstall fastload with a C++17 compiler present"
            )
        self.backend: Backend = "python" if backend == "python" or _native is None else "native"
        self.num_threads = default_num_threads() if num_threads is None else num_threads
        self.chunk_bytes = chunk_bytes
        self._impl: Any = None
        self._pid = -1
        self._closed = False
        _readers.add(self)

    def _backend(self) -> Any:
        if self._closed:
            raise ValueError("read on a closed BatchReader")
        if self._pid != os.getpid():  # first use, or first use after fork() (see above)
            if self.backend == "native":
                assert _native is not None
                # The calling thread works too, so the pool needs one thread fewer.
                self._impl = _native.Reader(max(0, self.num_threads - 1), self.chunk_bytes)
            else:
                self._impl = _PythonBackend(self.num_threads, self.chunk_bytes)
            self._pid = os.getpid()
        return self._impl

    def read(
        self, requests: Iterable[ReadRequest | Sequence[Any]], *, exact: bool = False
    ) -> npt.NDArray[np.int64]:
        """Fills every request's destination; returns the bytes read per request.

        Fewer bytes than asked means the file ended (with ``exact=True`` that raises
        :class:`ShortReadError`). A failed request raises :class:`ReadError` naming the file;
        a destination that is read-only, non-contiguous, not bytes or too small raises
        :class:`InvalidDestinationError` before anything is read.
        """
        batch = _Batch(requests)
        impl = self._backend()
        if self.backend == "native":
            result = impl.read(batch.files, batch.dests, batch.table)
        else:
            result = impl.read(batch)
        batch.raise_for(result, exact=exact)
        return result  # type: ignore[no-any-return]

    def read_spans(
        self,
        files: Sequence[str],
        dest: Any,
        file_ids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        dest_offsets: npt.NDArray[np.int64],
        *,
        exact: bool = False,
    ) -> npt.NDArray[np.int64]:
        """:meth:`read` of requests into one destination given as columns: request i reads
        ``lengths[i]`` bytes at ``offsets[i]`` of ``files[file_ids[i]]`` into ``dest`` at
        ``dest_offsets[i]``. No Python object per request (a batch loader's reads)."""
        batch = _Batch.of_spans(files, dest, file_ids, offsets, lengths, dest_offsets)
        impl = self._backend()
        if self.backend == "native":
            result = impl.read(batch.files, batch.dests, batch.table)
        else:
            result = impl.read(batch)
        batch.raise_for(result, exact=exact)
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stops the threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        impl, self._impl = self._impl, None
        if impl is not None and self._pid == os.getpid() and isinstance(impl, _PythonBackend):
            impl.close()
        # A native reader joins its threads when the last reference goes away.

    def __enter__(self) -> BatchReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aligned_empty(nbytes: int, *, alignment: int = 4096) -> npt.NDArray[np.uint8]:
    """An uninitialized 1-D uint8 array whose data starts on an ``alignment`` boundary.

    Zero-copy into torch with ``torch.frombuffer(array, dtype=torch.uint8)``. Page alignment is
    what ``O_DIRECT`` reads and ``cudaHostRegister`` want.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if _native is not None:
        return _native.aligned_empty(nbytes, max(alignment, 8))  # type: ignore[no-any-return]
    if alignment <= mmap.PAGESIZE:
        # Anonymous mappings always start on a page boundary.
        return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes]


def xxh3_spans(data: Any, spans: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    """XXH3-64 of ``data[offset:offset + length]`` for each row ``(offset, length)`` of spans:
    the checksums the cache's index records, for a batch's entries at once (natively, with
    the GIL released; a loop over Python's xxhash without the extension)."""
    spans = np.ascontiguousarray(spans, dtype=np.int64).reshape(-1, 2)
    native = getattr(_native, "xxh3_spans", None)  # None: no extension, or an older build
    if native is not None:
        return native(data, spans)  # type: ignore[no-any-return]
    import xxhash

    view = memoryview(data).cast("B")
    return np.array(
        [xxhash.xxh3_64_intdigest(view[a : a + n]) for a, n in spans.tolist()], dtype=np.uint64
    )
