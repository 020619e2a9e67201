"""The tar format itself: a shard's members (listed from its headers, hostile ones refused),
how their names split into sample key and field, and the check that a header is a member's.

A member is ``(name, data offset, size)``; a member's data starts right after its own
512-byte header, which :func:`is_header_of` checks before any read is trusted.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterable
from typing import BinaryIO

from fastload.datasets.base import (
    DatasetError,
)

BLOCK = 512  # a tar header; a member's data starts right after its own
# Reads while listing a shard's members: tarfile's 512-byte reads and seeks become a few
# large reads (through the cache) or requests (``fastload index``, which streams shards).
SCAN_READ_BYTES = 8 << 20

Member = tuple[str, int, int]  # name, data offset, size


def split_name(name: str) -> tuple[str, str] | None:
    """(sample key, field) of a member name, or None when it names no field. The field is
    lower-cased, as webdataset does (``IMG_1.JPG`` is field ``jpg`` of ``IMG_1``)."""
    base = name.rfind("/") + 1
    dot = name.find(".", base)
    if dot <= base or dot == len(name) - 1:
        return None  # no dot, a hidden file (macOS "._x" files), or an empty field
    return name[:dot], name[dot + 1 :].lower()


def count_samples(members: Iterable[Member]) -> int:
    """How many samples members group into (distinct keys of members that name a field)."""
    return len({split[0] for name, _, _ in members if (split := split_name(name)) is not None})


def is_header_of(
    block: bytes | memoryview, name: str, size: int, *, field_at: int | None = None
) -> bool:
    """Whether block, the 512 bytes before a member's data, is the tar header of a regular
    file of that name and size. A long or non-ASCII name lives in a pax or GNU header
    before this one, which then holds its first 100 bytes (or an ASCII stand-in).
    ``field_at``: where the (lower-cased) field starts in name; the stored name's field
    may be in any case there."""
    block = bytes(block)
    if len(block) != BLOCK or block[257:262] != b"ustar" or block[156:157] not in b"\x0007":
        return False
    field = block[124:136]
    try:
        stored = (
            int.from_bytes(field[1:], "big") if field[0] & 0x80 else int(field.strip(b" \0"), 8)
        )
    except ValueError:
        return False
    if stored != size and not (stored == 0 and size >= 8**11):  # pax holds sizes >= 8 GiB
        return False
    stored_name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0] if block[257:263] == b"ustar\0" else b""
    full = prefix + b"/" + stored_name if prefix else stored_name
    truncated = b"\0" not in block[:100]
    for text, wanted in (
        (full.decode("utf-8", "surrogateescape"), name),
        (full.decode("ascii", "replace"), name.encode("ascii", "replace").decode()),
    ):
        if field_at is not None:
            text = text[:field_at] + text[field_at:].lower()
        if text == wanted or (truncated and wanted.startswith(text)):
            return True
    return False


def scan_tar(f: BinaryIO, url: str, size: int | None) -> list[Member]:
    """(name, data offset, size) of every regular file in the tar f; refuses hostile members.

    Only headers are parsed: nothing is extracted and no link is followed.
    """
    members: list[Member] = []
    if size == 0:
        return members  # an empty object: an empty shard
    try:
        with tarfile.open(fileobj=f, mode="r:", encoding="utf-8", errors="surrogateescape") as tf:
            while (info := tf.next()) is not None:
                _check_member(info, url)
                if info.isdir():
                    continue
                if size is not None and info.offset_data + info.size > size:
                    raise DatasetError(
                        f"{url}: member {info.name!r} ends at byte {info.offset_data + info.size}"
                        f" but the shard has {size} bytes; the shard is truncated: rewrite it"
                    )
                members.append((info.name, info.offset_data, info.size))
    except tarfile.TarError as exc:
        raise DatasetError(
            f"{url} is not a readable (uncompressed) tar file: {exc}; shards must be plain "
            ".tar files"
        ) from exc
    return members


def _check_member(info: tarfile.TarInfo, url: str) -> None:
    name = info.name
    what = None
    if name.startswith("/"):
        what = "an absolute path"
    elif ".." in name.split("/"):
        what = "a path with a '..' component"
    elif info.issym():
        what = f"a symbolic link to {info.linkname!r}"
    elif info.islnk():
        what = f"a hard link to {info.linkname!r}"
    elif info.ischr() or info.isblk():
        what = "a device file"
    elif info.isfifo():
        what = "a FIFO"
    elif info.issparse():
        what = "a sparse file"
    elif not (info.isreg() or info.isdir()):
        what = f"an entry of tar type {info.type!r}"
    if what is not None:
        raise DatasetError(
            f"{url}: member {name!r} is {what}; tar shards may hold only regular files (and "
            "directories) with relative names: rebuild the shard without it"
        )
