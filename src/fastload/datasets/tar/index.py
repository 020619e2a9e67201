"""fastload's tar index file (``fastload.flidx``): its format, reading and checking it, writing it.

``FLTARIDX``, the header's length (uint64, little-endian), the header (JSON: ``format`` and
one entry per shard, ``{"name", "size", "version", "samples", "members", "at",
"length"}``), then each shard's section at ``at`` bytes past the header, zlib of
little-endian arrays: int64 gaps (a member's data offset minus the previous member's padded
end, so mostly 512), int64 sizes, uint32 ends of the names, then the UTF-8 names. Every
number read is checked against the shard it describes before it is used.

Format 3 ends in a checksum of all that (``fastload.safe_files.sealed``): a damaged index
is never read; the cache's copy is rebuilt. Format 2 (no checksum) is still read, its
numbers checked as ever: a dataset's ``fastload.flidx`` may have been written by an older
fastload.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload import safe_files
from fastload.datasets.base import (
    DatasetError,
)
from fastload.datasets.tar.members import BLOCK, Member, count_samples
from fastload.store import CachedStore

INDEX_NAME = "fastload.flidx"
_INDEX_FORMAT = "fastload-tar-index/3"
_UNSEALED_FORMAT = "fastload-tar-index/2"
_MAGIC = b"FLTARIDX"


@dataclass(frozen=True)
class _Entry:
    size: int | None
    version: str | None
    samples: int
    members: int
    at: int
    length: int


class IndexFile:
    """A fastload tar index (the format is in the module docstring): the header is parsed
    now, a shard's section when its members are asked for. ``ValueError`` if malformed."""

    def __init__(
        self, data: bytes, source: str, *, reread: Path | tuple[CachedStore, str] | None = None
    ) -> None:
        self.source = source
        # Where a worker reads the bytes again (a cached file; the dataset's object through
        # its cache): a pickled dataset then carries the header, not every shard's members.
        self._reread = reread
        if data[:8] != _MAGIC or len(data) < 16:
            raise ValueError("it does not start like a fastload index")
        (header_bytes,) = struct.unpack_from("<Q", data, 8)
        if header_bytes > len(data) - 16:
            raise ValueError(f"its header of {header_bytes} bytes is longer than the file")
        self._sections = 16 + header_bytes
        header = json.loads(data[16 : self._sections])
        found = header.get("format") if isinstance(header, dict) else header
        if found not in (_INDEX_FORMAT, _UNSEALED_FORMAT):
            raise ValueError(f"its format is {found!r}, not {_INDEX_FORMAT!r}")
        end = len(data)
        if found == _INDEX_FORMAT:
            _check_seal(data)
            end -= safe_files.SEAL_BYTES
        if not isinstance(header.get("shards"), list):
            raise ValueError("its header has no list of shards")
        self.entries = {}
        for e in header["shards"]:
            entry = _checked_entry(e, end - self._sections)
            self.entries[str(e["name"])] = entry
        self._data: bytes | None = data
        self._length = len(data)
        self._sealed = found == _INDEX_FORMAT

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._reread is not None:
            state["_data"] = None
        return state

    def _bytes(self) -> bytes:
        if self._data is None:
            assert self._reread is not None
            where = self._reread
            data = where.read_bytes() if isinstance(where, Path) else where[0].read(where[1])
            if len(data) != self._length:
                raise DatasetError(
                    f"{self.source} changed since the dataset was opened; open it again"
                )
            if self._sealed:
                try:
                    _check_seal(data)
                except ValueError as exc:
                    raise DatasetError(
                        f"{self.source} changed or was damaged since the dataset was opened "
                        f"({exc}); open the dataset again"
                    ) from None
            self._data = data
        return self._data

    def current(self, name: str, size: int | None, version: str | None) -> _Entry | None:
        """name's entry if the index has one for that size and version of the shard."""
        entry = self.entries.get(name)
        if entry is None or entry.size != size or entry.version != version:
            return None
        return entry

    def members(self, name: str, shard_url: str) -> list[Member]:
        entry = self.entries[name]
        at = self._sections + entry.at
        m = entry.members
        try:
            raw = _inflate(self._bytes()[at : at + entry.length], m, entry.size)
            gaps = np.frombuffer(raw, "<i8", m, 0)
            sizes = np.frombuffer(raw, "<i8", m, 8 * m)
            ends = np.frombuffer(raw, "<u4", m, 16 * m).astype(np.int64)
        except (zlib.error, ValueError) as exc:
            raise self._damaged(shard_url, f"it cannot be read: {exc}") from None
        blob = raw[20 * m :]
        starts = np.concatenate([[0], ends])[:-1]
        offsets = np.cumsum(gaps + np.concatenate([[0], _padded(sizes)])[:-1])
        if m and (
            int(ends[-1]) != len(blob)
            or bool((ends < starts).any())
            or int(offsets.min()) < BLOCK
            or int(sizes.min()) < 0
            or (entry.size is not None and int((offsets + sizes).max()) > entry.size)
        ):
            raise self._damaged(shard_url, "its names, offsets or sizes are out of place")
        names = [
            blob[a:b].decode("utf-8", "surrogateescape")
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
        return list(zip(names, offsets.tolist(), sizes.tolist(), strict=True))

    def _damaged(self, shard_url: str, why: str) -> DatasetError:
        return DatasetError(
            f"{shard_url}: its entry in {self.source} is damaged ({why}): run `fastload index` "
            "on the dataset again"
        )

    @staticmethod
    def encode(shards: Iterable[tuple[str, int | None, str | None, Sequence[Member]]]) -> bytes:
        """An index of (name, size, version, members) per shard."""
        entries = []
        sections = []
        at = 0
        for name, size, version, members in shards:
            section = _encode_members(members)
            entries.append(
                {
                    "name": name,
                    "size": size,
                    "version": version,
                    "samples": count_samples(members),
                    "members": len(members),
                    "at": at,
                    "length": len(section),
                }
            )
            sections.append(section)
            at += len(section)
        header = json.dumps({"format": _INDEX_FORMAT, "shards": entries}).encode()
        return safe_files.sealed(
            b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *sections])
        )


def _check_seal(data: bytes) -> None:
    if safe_files.unsealed(data) is None:
        raise ValueError("its checksum does not hold: it is damaged")


def _count(e: dict[str, Any], field: str, most: int) -> int:
    """An entry's field as an int in [0, most] (not a bool, a float or a string)."""
    value = e[field]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ValueError(f"shard {e.get('name')!r} has {field} {value!r}, expected 0 to {most}")
    return value


def _checked_entry(e: Any, sections: int) -> _Entry:
    """A shard's entry, every number checked against the bytes it describes: the section
    lies within the file; a member takes a tar header (512 bytes) of the shard at least, so
    there are no more members than the shard has blocks (or than the section can inflate to
    at zlib's ratio), and no more samples than members."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str):
        raise ValueError(f"a shard entry is {e!r}, expected an object with a name")
    size = None if e["size"] is None else _count(e, "size", 2**62)
    version = e["version"]
    if version is not None and not isinstance(version, str):
        raise ValueError(f"shard {e['name']!r} has version {version!r}, expected text")
    at = _count(e, "at", sections)
    length = _count(e, "length", sections - at)
    most = (size // BLOCK) if size is not None else length * _ZLIB_RATIO // _MEMBER_BYTES
    members = _count(e, "members", most)
    samples = _count(e, "samples", members)
    return _Entry(size, version, samples, members, at, length)


# zlib inflates at most ~1032:1; a member's columns take 20 bytes before its name.
_ZLIB_RATIO = 1032
_MEMBER_BYTES = 20
_MAX_NAME_BYTES = 1 << 16


def _inflate(section: bytes, members: int, shard_size: int | None) -> bytes:
    """A shard's section inflated to the size its header implies, never further (a section
    that inflates past it is damaged, or hostile: 1 MB can claim 1 GB)."""
    inflate = zlib.decompressobj()
    head_bytes = _MEMBER_BYTES * members
    # max_length 0 would mean "no limit": ask for one byte more than expected, at least one.
    head = inflate.decompress(section, head_bytes or 1)
    if len(head) != head_bytes:
        raise ValueError(
            f"it inflates to {len(head)} bytes where {members} members take {head_bytes}"
        )
    names = int(np.frombuffer(head, "<u4", 1, head_bytes - 4)[0]) if members else 0
    most = members * _MAX_NAME_BYTES if shard_size is None else shard_size
    if names > most:
        raise ValueError(f"its names claim {names} bytes, more than the shard can hold")
    body = inflate.decompress(inflate.unconsumed_tail or b"", names + 1)
    if len(body) != names or inflate.unconsumed_tail or not inflate.eof:
        raise ValueError(f"it does not inflate to the {head_bytes + names} bytes it claims")
    return head + body


def _encode_members(members: Sequence[Member]) -> bytes:
    names = [n.encode("utf-8", "surrogateescape") for n, _, _ in members]
    offsets = np.array([o for _, o, _ in members], dtype=np.int64)
    sizes = np.array([s for _, _, s in members], dtype=np.int64)
    gaps = offsets - np.concatenate([[0], offsets + _padded(sizes)])[:-1]
    ends = np.cumsum([len(n) for n in names], dtype=np.int64).astype("<u4")
    raw = b"".join(
        [gaps.astype("<i8").tobytes(), sizes.astype("<i8").tobytes(), ends.tobytes(), *names]
    )
    return zlib.compress(raw, 6)


def _padded(sizes: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Sizes rounded up to whole tar blocks: the space a member's data takes."""
    return (sizes + BLOCK - 1) // BLOCK * BLOCK


def index_path(store: CachedStore, key: str) -> Path:
    """Where the cache keeps the index of shard key: it names the URL, version and size."""
    obj = store.object(key)
    ident = f"{_INDEX_FORMAT}\0{store.object_url(key)}\0{obj.version}\0{obj.size}"
    return store.cache.dir / "indexes" / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.flidx"


def write_atomically(path: Path, data: bytes) -> None:
    """path whole or not at all, never written through a link (fastload.safe_files)."""
    safe_files.write_atomically(path, data)
