"""Files fastload writes in a directory others may share (the cache): created exclusively,
never through a symbolic link, renamed into place.

A cache directory shared by the users of a node is writable by them; a link planted where
fastload writes a temporary file or keeps a folder of its own (``tmp/``, ``manifests/``,
``indexes/``) would otherwise make fastload write object bytes or manifests wherever the link
points. So every temporary file is created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (an
existing name, a link included, is never opened), in a folder checked not to be a link, and
renamed over its final name (a rename replaces a link, never writes through it); a link
where fastload expects a file or folder of its own is an :class:`UnsafeCachePathError`
naming it.

Metadata files fastload writes for itself (a dataset's derived layout, a tar index) also
end in a checksum (:func:`sealed`); a file whose checksum fails is never used, only rebuilt
(:func:`unsealed`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import xxhash

from fastload.errors import UnsafeCachePathError

_EXCLUSIVE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def unsafe(path: str | os.PathLike[str], what: str) -> UnsafeCachePathError:
    shown = os.fspath(path)
    return UnsafeCachePathError(
        errno.ELOOP,
        f"{shown} is {what} where fastload keeps a file or folder of its own; nothing was "
        "written through it. Remove it (someone with write access to the cache directory "
        "planted it), or give fastload a cache directory only you can write",
        shown,
    )


def check_own(path: str | os.PathLike[str], *, folder: bool) -> None:
    """Raises UnsafeCachePathError where path is a symbolic link (or, for a folder, not a
    folder); a missing path is fine."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise unsafe(path, "a symbolic link")
    if folder and not stat.S_ISDIR(st.st_mode):
        raise unsafe(path, "not a folder")


def own_folder(path: str | os.PathLike[str]) -> None:
    """Makes folder path (and its parents) if missing; raises UnsafeCachePathError where it
    is a link or not a folder."""
    check_own(path, folder=True)
    os.makedirs(path, exist_ok=True)
    check_own(path, folder=True)  # not swapped for a link meanwhile


def open_exclusive(path: str, mode: int = 0o644) -> int:
    """A new file at path, opened for writing: never an existing one, never through a link.
    A stale regular file there (left by a process that died) is replaced; a link, or a
    parent folder that is one, raises UnsafeCachePathError."""
    check_own(os.path.dirname(path) or ".", folder=True)
    for _ in range(2):
        try:
            return os.open(path, _EXCLUSIVE, mode)
        except FileExistsError:
            check_own(path, folder=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a regular file: a part its writer left when it died
    return os.open(path, _EXCLUSIVE, mode)


def write_atomically(
    path: str | os.PathLike[str],
    data: bytes | Callable[[BinaryIO], None],
    *,
    fsync: bool = False,
) -> None:
    """Writes path whole or not at all: into a new temporary file beside it (a unique name,
    created exclusively), then renamed over it; the temporary is removed on any error.
    ``data`` is the bytes, or a function that writes them to the open file."""
    path = Path(path)
    own_folder(path.parent)
    check_own(path, folder=False)
    tmp = str(path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"))
    fd = os.open(tmp, _EXCLUSIVE, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- checksummed metadata ------------------------------------------------------------------

# The trailer of a checksummed file: this tag, then xxh3-64 of everything before it.
_SEAL_TAG = b"FLSEAL01"
SEAL_BYTES = len(_SEAL_TAG) + 8


def sealed(payload: bytes) -> bytes:
    """payload followed by its checksum trailer (what :func:`unsealed` checks)."""
    return payload + _SEAL_TAG + xxhash.xxh3_64_digest(payload)


def unsealed(data: bytes) -> bytes | None:
    """The payload of a file written as :func:`sealed`, or None where its checksum (or
    the trailer itself) does not hold: a damaged file, or one written without a seal."""
    if len(data) < SEAL_BYTES or data[-SEAL_BYTES:-8] != _SEAL_TAG:
        return None
    payload = data[:-SEAL_BYTES]
    if xxhash.xxh3_64_digest(payload) != data[-8:]:
        return None
    return payload
