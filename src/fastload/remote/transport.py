"""The transport: GETs and listings of one remote behind one small, blocking interface, and
its fsspec implementation, which serves every filesystem and which the faster transports
(:mod:`fastload.remote.obstore`, :mod:`fastload.remote.hub`) fall back to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import fsspec

from fastload.remote.listing import Listing

Buffer = bytes | memoryview


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
        return data  # type: ignore[no-any-return]

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        return None
