"""A remote object read as a file, a block of byte ranges at a time, each fetched by the
caller's pinned GET (``fastload index`` streams a shard through it: the same listed version
on every request, nothing cached). tarfile's small reads and forward seeks become one
request per block, as fsspec's readahead file makes them, but never of another version."""

from __future__ import annotations

import io
from collections.abc import Callable


class RangeFile(io.RawIOBase):
    """Bytes [0, size) of one object, read through ``get(start, end)`` ``block_bytes`` at
    a time. ``size`` None: unknown, the object ends where an answer comes back short."""

    def __init__(
        self, get: Callable[[int, int], bytes], size: int | None, block_bytes: int
    ) -> None:
        super().__init__()
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be 1 or more, got {block_bytes}")
        self._get, self._size, self._block_bytes = get, size, block_bytes
        self._pos = 0
        self._block = b""
        self._block_at = 0
        self._ended_at: int | None = size  # where the object ends, once known

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END and self._size is not None:
            pos = self._size + offset
        else:
            raise io.UnsupportedOperation("seek from the end of an object of unknown size")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out):
            chunk = self._at(self._pos)
            if not chunk:
                break
            n = min(len(chunk), len(out) - done)
            out[done : done + n] = chunk[:n]
            done += n
            self._pos += n
        return done

    def _at(self, pos: int) -> memoryview:
        """The bytes from pos to the end of their block (fetched now if not held); empty
        at or past the object's end."""
        if self._ended_at is not None and pos >= self._ended_at:
            return memoryview(b"")
        if not self._block_at <= pos < self._block_at + len(self._block):
            end = pos + self._block_bytes
            if self._ended_at is not None:
                end = min(end, self._ended_at)
            self._block, self._block_at = self._get(pos, end), pos
            if len(self._block) < end - pos:
                self._ended_at = pos + len(self._block)
        return memoryview(self._block)[pos - self._block_at :]
