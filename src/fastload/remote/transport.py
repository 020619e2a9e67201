"""The transport: GETs and listings of one remote behind one small, blocking interface, and
its fsspec implementation, which serves every filesystem and which the faster transports
(:mod:`fastload.remote.obstore`, :mod:`fastload.remote.hub`) fall back to."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import fsspec

from fastload.remote.listing import Listing

Buffer = bytes | memoryview

log = logging.getLogger(__name__)


class Transport(Protocol):
    """GETs (blocking; the GIL is released while waiting where the backend allows it)."""

    def get(self, path: str, start: int | None = None, end: int | None = None) -> Buffer:
        """Bytes [start, end) of the object at path (a path of the fsspec filesystem);
        raises what :func:`fastload.remote.classify` sorts, never text with a secret."""
        ...

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        """Every object below root as columns (keys relative to root), without a dict per
        object kept; None where this transport does not list (fsspec's find does then).
        ``progress`` is called with the number of objects of each page listed."""
        ...


class FsspecTransport:
    """GETs through the fsspec filesystem itself (any protocol)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, timeout_s: float) -> None:
        self.fs = fs
        self.timeout_s = timeout_s

    def get(self, path: str, start: int | None = None, end: int | None = None) -> Buffer:
        fs: Any = self.fs
        if getattr(fs, "async_impl", False):
            try:
                data = fsspec.asyn.sync(
                    fs.loop, fs._cat_file, path, start=start, end=end, timeout=self.timeout_s
                )
            except fsspec.asyn.FSTimeoutError:
                raise TimeoutError(f"no complete answer within {self.timeout_s:g}s") from None
        else:
            data = fs.cat_file(path, start=start, end=end)
        return range_of_answer(data, start, end, path, lambda: self._size(path))

    def _size(self, path: str) -> int | None:
        try:
            size = self.fs.size(path)
        except (OSError, ValueError):
            return None
        return int(size) if size is not None else None

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        return None


_ignoring_range: set[str] = set()  # hosts already named in the log


def range_of_answer(
    data: Buffer,
    start: int | None,
    end: int | None,
    path: str,
    size_of: Callable[[], int | None] = lambda: None,
) -> Buffer:
    """Bytes [start, end) of an answer to a ranged GET. A server that ignores ``Range``
    (Python's http.server, many simple file servers) answers 200 with the whole object: the
    range is cut out of it. An answer longer than the range asked for can only be that (a
    206 is never longer); where the range's length depends on the object's size (no end, a
    negative end), ``size_of()`` gives the size, and an answer of exactly that many bytes is
    the whole object."""
    if start is None and end is None:
        return data
    if start is not None and start < 0 and end is None:
        wanted: int | None = -start  # the last -start bytes
    elif start is not None and end is not None and start >= 0 and end >= 0:
        wanted = max(end - start, 0)
    else:
        wanted = None
    if wanted is not None:
        if len(data) <= wanted:
            return data
    else:
        size = size_of()
        whole = slice(start, end).indices(size) if size is not None else (0, 0, 1)
        if size is None or len(data) != size or whole[:2] == (0, size):
            return data
    host = path.split("://", 1)[-1].split("/", 1)[0]
    if host not in _ignoring_range:
        _ignoring_range.add(host)
        log.warning(
            "%s ignores Range requests (it sends whole objects): every byte range read from "
            "it downloads its whole object; a server that honours Range is much faster",
            host,
        )
    return memoryview(data)[start:end]
