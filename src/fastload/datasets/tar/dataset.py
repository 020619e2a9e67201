"""Tar shards in WebDataset layout, read at random through a per-shard member index.

A shard is a ``.tar`` object under the dataset root (shards in key order). Its members
group into samples by key: the member path up to the first ``.`` of its basename
(``a/b/000123.jpg`` and ``a/b/000123.cls`` are the fields ``jpg`` and ``cls`` of sample
``a/b/000123``; ``x.seg.png`` is field ``seg.png`` of ``x``)::

    shard-000.tar                          dataset
      000000.jpg  000000.cls     ──►  [0] {"__key__": "000000", "jpg": b.., "cls": b..}
      000001.jpg  000001.cls     ──►  [1] {"__key__": "000001", ...}
    shard-001.tar
      000002.jpg  000002.cls     ──►  [2] ...

Tar has no table of contents. Where each shard's sample count and members come from, first
found first:

1. ``fastload.flidx`` next to the shards, written once by ``fastload index URL``
   (:func:`write_index`): per shard its size, version and sample count, and its members
   (names, data offsets, sizes) in a compressed section read when the shard is first used.
   Opening reads only this file; an entry whose shard changed since (size or version) is
   ignored, and the shard is indexed as in 3.
2. ``<cache dir>/indexes/``: a file per shard, keyed by its URL, version and size, kept
   when a shard was indexed before (3), or written there by ``fastload index`` where the
   dataset's folder is not writable (HTTP, a read-only bucket).
3. wids' ``shardindex.json`` at the dataset root gives sample counts only (enough for the
   plan and ``len()``); a shard's members are read from the shard when it is first used
   (it is staged to read a sample anyway) and must add up to that count.
4. Without any of these, opening reads every shard once to list its members.

Every sample read checks the tar header before each field's data (its name and size), so
an index that does not match its shard raises a :class:`DatasetError` naming the shard
instead of giving wrong bytes. A sample is one ranged read of the shard (or one per field
when its members lie far apart).

The index file: ``FLTARIDX``, the header's length (uint64, little-endian), the header (JSON:
``format`` and one entry per shard, ``{"name", "size", "version", "samples", "members",
"at", "length"}``), then each shard's section at ``at`` bytes past the header, zlib of
little-endian arrays: int64 gaps (a member's data offset minus the previous member's padded
end, so mostly 512), int64 sizes, uint32 ends of the names, then the UTF-8 names.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import posixpath
import struct
import tarfile
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import (
    DatasetError,
    Range,
    ShardedDataset,
    StoreFile,
    keys_ending,
)
from fastload.errors import RemoteAccessError
from fastload.progress import Progress, ProgressBar
from fastload.remote import (
    classify,
    clean_cause,
    is_http,
    open_filesystem,
    path_of,
    remote_url,
    with_retries,
)
from fastload.store import CachedStore, StoreConfig

log = logging.getLogger(__name__)

INDEX_NAME = "fastload.flidx"
WIDS_INDEX_NAME = "shardindex.json"
_INDEX_FORMAT = "fastload-tar-index/2"
_MAGIC = b"FLTARIDX"
_WIDS_KIND = "wids-shard-index-v1"
_BLOCK = 512  # a tar header; a member's data starts right after its own
# One read covers a whole sample when the bytes between its fields (tar headers, padding,
# fields left out by ``fields=``) are at most this much; otherwise each field is read alone.
_MAX_GAP_BYTES = 64 << 10
# Shards staged per round while indexing: bounds what must stay cached until it is parsed
# (a cache smaller than the dataset would otherwise evict shards before they are indexed).
_STAGE_ROUND = 16
_INDEX_THREADS = 4
# Reads while listing a shard's members: tarfile's 512-byte reads and seeks become a few
# large reads (through the cache) or requests (``fastload index``, which streams shards).
_SCAN_READ_BYTES = 8 << 20
INDEX_JOBS = 8

Member = tuple[str, int, int]  # name, data offset, size


@dataclass(frozen=True)
class _Shard:
    """The samples of one shard; fields of sample j are entries starts[j]:starts[j+1]."""

    keys: list[str]
    starts: npt.NDArray[np.int64]
    field_ids: npt.NDArray[np.int32]
    offsets: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    source: str | None  # the index file its members came from; None: read from the shard


@dataclass(frozen=True)
class _Promise:
    """A shard whose sample count an index gives; its members are read on first use."""

    samples: int
    index: IndexFile | None  # holds its members; None: list them from the shard (wids)
    name: str  # the shard's name in that index
    source: str  # the index, as errors name it


class TarDataset(ShardedDataset):
    """WebDataset-layout tar shards with random access (see the module docstring).

    ``dataset[i]`` is ``{"__key__": sample key, "__shard__": shard key, field: bytes, ...}``.
    ``fields`` keeps only those fields, and every sample must have all of them (checked when
    a shard is first read). Members that name no field (no ``.`` in the basename, or a
    hidden ``.name``) and directories are skipped; links, devices, FIFOs, absolute names and
    names with ``..`` are refused with a :class:`DatasetError`. Nothing is ever extracted.
    """

    format = "tar"

    def __init__(self, store: CachedStore, *, fields: Sequence[str] | None = None) -> None:
        if isinstance(fields, str) or (fields is not None and not fields):
            raise ValueError(
                f"fields must be a non-empty list of field names such as ['jpg', 'cls'], "
                f"got {fields!r}"
            )
        self.fields: tuple[str, ...] | None = None if fields is None else tuple(fields)
        self._field_names: list[str] = list(self.fields or ())
        self._field_ids = {f: i for i, f in enumerate(self._field_names)}
        self._lock = threading.Lock()  # the field table, and which shard is being read
        self._reading: dict[int, threading.Lock] = {}
        shard_keys = _shard_keys(store)
        promised = _promised_shards(store, shard_keys)
        scanned = _index_shards(store, [k for k in shard_keys if k not in promised])
        self._promised: dict[int, _Promise] = {}
        self._shards: list[_Shard | None] = []
        sizes = []
        for s, key in enumerate(shard_keys):
            if key in promised:
                self._promised[s] = promised[key]
                self._shards.append(None)
                sizes.append(promised[key].samples)
            else:
                shard = self._group(store.object_url(key), scanned[key], None)
                self._shards.append(shard)
                sizes.append(len(shard.keys))
        if sum(sizes) == 0:
            raise DatasetError(
                f"{store.url} holds no samples: its {len(shard_keys)} .tar shard(s) have no "
                "members named <key>.<field>; check that the shards are in WebDataset layout"
            )
        super().__init__(store, sizes, [[k] for k in shard_keys])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"], state["_reading"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._reading = {}

    # --- samples ---------------------------------------------------------------------------

    def key(self, index: int) -> str:
        """The key of sample index (reads the shard's members if not read yet)."""
        index = self._check(int(index))
        s = self.shard_of(index)
        return self._shard(s).keys[index - int(self.shard_offsets[s])]

    def _fields(self, index: int) -> tuple[int, str, list[str], list[int], list[int]]:
        """(shard, sample key, field names, data offsets, sizes) of sample index."""
        s = self.shard_of(index)
        shard = self._shard(s)
        j = index - int(self.shard_offsets[s])
        lo, hi = int(shard.starts[j]), int(shard.starts[j + 1])
        names = [self._field_names[f] for f in shard.field_ids[lo:hi].tolist()]
        return s, shard.keys[j], names, shard.offsets[lo:hi].tolist(), shard.sizes[lo:hi].tolist()

    def sample_ranges(self, index: int) -> list[Range] | None:
        """Each range starts at a field's tar header, which :meth:`assemble` checks."""
        s, _, _, offsets, sizes = self._fields(index)
        key = self.shard_keys[s][0]
        start = min(offsets) - _BLOCK
        end = max(o + n for o, n in zip(offsets, sizes, strict=True))
        if end - start <= sum(sizes) + _BLOCK * len(sizes) + _MAX_GAP_BYTES:  # side by side
            return [(key, start, end - start)]
        return [(key, o - _BLOCK, n + _BLOCK) for o, n in zip(offsets, sizes, strict=True)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        s, sample_key, names, offsets, sizes = self._fields(index)
        key = self.shard_keys[s][0]
        if len(parts) == 1:  # one range spanning every field, from the first one's header
            start = min(offsets) - _BLOCK
            whole = memoryview(parts[0])
            views = [
                whole[o - start - _BLOCK : o - start + n]
                for o, n in zip(offsets, sizes, strict=True)
            ]
        else:
            views = [memoryview(p) for p in parts]
        sample: dict[str, Any] = {"__key__": sample_key, "__shard__": key}
        own = bytes if copy else memoryview
        for name, view, offset, size in zip(names, views, offsets, sizes, strict=True):
            member = f"{sample_key}.{name}"
            if not is_header_of(view[:_BLOCK], member, size):
                raise self._not_a_member(s, member, offset, size)
            sample[name] = own(view[_BLOCK:])
        return sample

    def _not_a_member(self, s: int, member: str, offset: int, size: int) -> DatasetError:
        shard = self._shards[s]
        url = self.store.object_url(self.shard_keys[s][0])
        where = f"no member {member!r} of {size} bytes starts at byte {offset}"
        if shard is not None and shard.source is not None:
            return DatasetError(
                f"{url}: {where}, as {shard.source} says; the index does not match the shard: "
                f"run `fastload index {self.store.url}` again"
            )
        return DatasetError(
            f"{url}: {where} any more; the shard changed since the dataset was opened: open "
            "it again with refresh=True"
        )

    # --- members, read on first use of a shard ---------------------------------------------

    def _shard(self, s: int) -> _Shard:
        shard = self._shards[s]
        if shard is not None:
            return shard
        with self._lock:
            reading = self._reading.setdefault(s, threading.Lock())
        with reading:  # one thread reads a shard's members; others wait for them
            shard = self._shards[s]
            if shard is None:
                shard = self._shards[s] = self._read_promised(s)
        return shard

    def _read_promised(self, s: int) -> _Shard:
        promise = self._promised[s]
        key = self.shard_keys[s][0]
        url = self.store.object_url(key)
        if promise.index is not None:
            members = promise.index.members(promise.name, url)
            shard = self._group(url, members, promise.source)
            if len(shard.keys) != promise.samples:
                raise DatasetError(
                    f"{url}: {promise.source} says it holds {promise.samples} samples but lists "
                    f"members of {len(shard.keys)}; the index is damaged: run `fastload index "
                    f"{self.store.url}` again"
                )
            return shard
        shard = self._group(url, _scan_shard(self.store, key), None)
        if len(shard.keys) != promise.samples:
            raise DatasetError(
                f"{url} holds {len(shard.keys)} samples but {promise.source} says "
                f"{promise.samples}; that index is out of date: run `fastload index "
                f"{self.store.url}` (fastload reads its own index first) or rebuild it"
            )
        return shard

    # --- grouping --------------------------------------------------------------------------

    def _field_id(self, field: str) -> int | None:
        fid = self._field_ids.get(field)
        if fid is None and self.fields is None:
            fid = self._field_ids[field] = len(self._field_names)
            self._field_names.append(field)
        return fid

    def _group(self, shard_url: str, members: Iterable[Member], source: str | None) -> _Shard:
        """Samples in order of first appearance; a sample's fields in tar order (or in the
        order of ``fields=``)."""
        with self._lock:  # the field table is shared by the shards
            return self._group_locked(shard_url, members, source)

    def _group_locked(
        self, shard_url: str, members: Iterable[Member], source: str | None
    ) -> _Shard:
        samples: dict[str, dict[int, tuple[int, int]]] = {}
        for name, offset, size in members:
            split = split_name(name)
            if split is None:
                continue
            key, field = split
            fields = samples.setdefault(key, {})
            fid = self._field_id(field)
            if fid is None:
                continue  # not asked for
            if fid in fields:
                raise DatasetError(
                    f"{shard_url}: member {name!r} appears twice; a sample's fields must be "
                    "unique: rebuild the shard without the duplicate"
                )
            fields[fid] = (offset, size)
        starts = [0]
        field_ids: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        for key, fields in samples.items():
            if self.fields is not None:
                missing = [f for f in self.fields if self._field_ids[f] not in fields]
                if missing:
                    raise DatasetError(
                        f"{shard_url}: sample {key!r} has no field {missing[0]!r} (fields= asks "
                        f"for {list(self.fields)}); drop it from fields= or fix the shard"
                    )
                order = sorted(fields)  # ids follow the order of fields=
            else:
                order = list(fields)
            for fid in order:
                field_ids.append(fid)
                offsets.append(fields[fid][0])
                sizes.append(fields[fid][1])
            starts.append(len(field_ids))
        return _Shard(
            keys=list(samples),
            starts=np.array(starts, dtype=np.int64),
            field_ids=np.array(field_ids, dtype=np.int32),
            offsets=np.array(offsets, dtype=np.int64),
            sizes=np.array(sizes, dtype=np.int64),
            source=source,
        )


def split_name(name: str) -> tuple[str, str] | None:
    """(sample key, field) of a member name, or None when it names no field."""
    base = name.rfind("/") + 1
    dot = name.find(".", base)
    if dot <= base or dot == len(name) - 1:
        return None  # no dot, a hidden file (macOS "._x" files), or an empty field
    return name[:dot], name[dot + 1 :]


def count_samples(members: Iterable[Member]) -> int:
    """How many samples members group into (distinct keys of members that name a field)."""
    return len({split[0] for name, _, _ in members if (split := split_name(name)) is not None})


def is_header_of(block: bytes | memoryview, name: str, size: int) -> bool:
    """Whether block, the 512 bytes before a member's data, is the tar header of a regular
    file of that name and size. A long or non-ASCII name lives in a pax or GNU header
    before this one, which then holds its first 100 bytes (or an ASCII stand-in)."""
    block = bytes(block)
    if len(block) != _BLOCK or block[257:262] != b"ustar" or block[156:157] not in b"\x0007":
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
    for encoded in (name.encode("utf-8", "surrogateescape"), name.encode("ascii", "replace")):
        if full == encoded or (truncated and encoded.startswith(stored_name)):
            return True
    return False


def _shard_keys(store: CachedStore) -> list[str]:
    shards = keys_ending(store, ".tar")
    if not shards:
        keys = store.object_keys()
        compressed = [k for k in keys if k.endswith((".tar.gz", ".tgz", ".tar.zst", ".tar.xz"))]
        hint = (
            f"; compressed shards such as {compressed[0]!r} cannot be read at random: "
            "decompress them to .tar"
            if compressed
            else "; pick another format= (files, imagefolder, parquet, zarr)"
        )
        raise DatasetError(
            f"{store.url} holds no .tar shards ({len(keys)} objects, e.g. {keys[:3]}){hint}"
        )
    return shards


# --- index files ---------------------------------------------------------------------------


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
        self._sections = 16 + header_bytes
        header = json.loads(data[16 : self._sections])
        if header["format"] != _INDEX_FORMAT:
            raise ValueError(f"its format is {header['format']!r}, not {_INDEX_FORMAT!r}")
        self.entries = {
            str(e["name"]): _Entry(
                size=None if e["size"] is None else int(e["size"]),
                version=None if e["version"] is None else str(e["version"]),
                samples=int(e["samples"]),
                members=int(e["members"]),
                at=int(e["at"]),
                length=int(e["length"]),
            )
            for e in header["shards"]
        }
        if any(self._sections + e.at + e.length > len(data) for e in self.entries.values()):
            raise ValueError("it is cut short")
        self._data: bytes | None = data
        self._length = len(data)

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
            raw = zlib.decompress(self._bytes()[at : at + entry.length])
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
            or int(offsets.min()) < _BLOCK
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
        return b"".join([_MAGIC, struct.pack("<Q", len(header)), header, *sections])


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
    return (sizes + _BLOCK - 1) // _BLOCK * _BLOCK


def index_path(store: CachedStore, key: str) -> Path:
    """Where the cache keeps the index of shard key: it names the URL, version and size."""
    obj = store.object(key)
    ident = f"{_INDEX_FORMAT}\0{store.object_url(key)}\0{obj.version}\0{obj.size}"
    return store.cache.dir / "indexes" / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.flidx"


def _promised_shards(store: CachedStore, shard_keys: list[str]) -> dict[str, _Promise]:
    """The shards whose sample counts an index gives (see the module docstring)."""
    listed = set(store.object_keys())
    promised: dict[str, _Promise] = {}
    if INDEX_NAME in listed:
        index = _dataset_index(store)
        for key in shard_keys:
            obj = store.object(key)
            entry = index.current(key, obj.size, obj.version)
            if entry is not None:
                promised[key] = _Promise(entry.samples, index, key, index.source)
        left = len(shard_keys) - len(promised)
        if left:
            log.warning(
                "fastload: %d of the %d tar shards of %s are new or changed since %s was "
                "written; they are indexed now: run `fastload index %s` again",
                left,
                len(shard_keys),
                store.url,
                index.source,
                store.url,
            )
    for key in shard_keys:
        if key not in promised and (cached := _cached_index(store, key)) is not None:
            url = store.object_url(key)
            promised[key] = _Promise(cached.entries[url].samples, cached, url, cached.source)
    if WIDS_INDEX_NAME in listed:
        counts = _wids_counts(store, [k for k in shard_keys if k not in promised])
        source = store.object_url(WIDS_INDEX_NAME)
        promised.update((k, _Promise(n, None, k, source)) for k, n in counts.items())
    return promised


def _dataset_index(store: CachedStore) -> IndexFile:
    source = store.object_url(INDEX_NAME)
    try:
        return IndexFile(store.read(INDEX_NAME), source, reread=(store, INDEX_NAME))
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(
            f"{source} is not a readable fastload index ({exc}); run `fastload index "
            f"{store.url}` again to rewrite it, or delete it"
        ) from None


def _cached_index(store: CachedStore, key: str) -> IndexFile | None:
    """The cache's index of shard key, or None when missing, unreadable or implausible."""
    path = index_path(store, key)
    try:
        index = IndexFile(path.read_bytes(), str(path), reread=path)
        obj = store.object(key)
        if index.current(store.object_url(key), obj.size, obj.version) is None:
            raise ValueError("it is for another shard")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("fastload: rebuilding the damaged tar index %s: %s", path, exc)
        return None
    return index


def _wids_counts(store: CachedStore, keys: list[str]) -> dict[str, int]:
    """Sample counts of keys from wids' shardindex.json (those it lists for their size)."""
    source = store.object_url(WIDS_INDEX_NAME)
    try:
        data = json.loads(store.read(WIDS_INDEX_NAME))
        if data.get("__kind__") != _WIDS_KIND:
            raise ValueError(f"its __kind__ is {data.get('__kind__')!r}, not {_WIDS_KIND!r}")
        listed: dict[str, dict[str, Any]] = {}
        for shard in data["shardlist"]:
            key = _key_of(store.url, str(shard["url"]))
            if key is not None:
                listed[key] = shard
        counts = {}
        for key in keys:
            shard = listed.get(key)
            size = store.object(key).size
            if shard is None or shard.get("filesize", size) != size:
                continue  # not in it, or changed since: indexed from the shard
            counts[key] = int(shard["nsamples"])
            if counts[key] < 0:
                raise ValueError(f"nsamples of {key} is {counts[key]}")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("fastload: ignoring %s, which is not a wids shard index: %s", source, exc)
        return {}
    return counts


def _key_of(root: str, url: str) -> str | None:
    """The key below root of a shard URL of a wids index at root (relative, or absolute)."""
    if "://" in url or url.startswith("/"):
        prefix = root.rstrip("/") + "/"
        return url[len(prefix) :] if url.startswith(prefix) else None
    key = posixpath.normpath(url)
    return None if key == ".." or key.startswith("../") else key


# --- reading shards ------------------------------------------------------------------------


def _index_shards(store: CachedStore, keys: list[str]) -> dict[str, list[Member]]:
    """The members of shards no index knows, read from the shards now (and kept in the cache).

    They are staged a round at a time (concurrently, by the stager) and read on a few
    threads while the next round downloads.
    """
    if not keys:
        return {}
    total = sum(store.object(k).size or 0 for k in keys)
    log.warning(
        "fastload: opening %s reads %d tar shard(s) (%.1f MB) to find their samples; run "
        "`fastload index %s` once and opening it reads only an index",
        store.url,
        len(keys),
        total / 1e6,
        store.url,
    )
    started = time.monotonic()
    found: dict[str, list[Member]] = {}
    with ThreadPoolExecutor(_INDEX_THREADS, thread_name_prefix="fastload-tar-index") as pool:
        futures: dict[str, Future[list[Member]]] = {}
        try:
            for r in range(0, len(keys), _STAGE_ROUND):
                round_keys = keys[r : r + _STAGE_ROUND]
                store.stage(round_keys)  # a failure is raised by the read that needs it
                futures.update((k, pool.submit(_scan_shard, store, k)) for k in round_keys)
                for f in futures.values():  # fail early, not after the last download
                    if f.done():
                        f.result()
            found.update((k, f.result()) for k, f in futures.items())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    log.info(
        "fastload: indexed %d tar shards of %s in %.1f s",
        len(keys),
        store.url,
        time.monotonic() - started,
    )
    return found


def _scan_shard(store: CachedStore, key: str) -> list[Member]:
    """The members of shard key, read through the cache, kept in the cache's indexes."""
    url = store.object_url(key)
    obj = store.object(key)
    raw = StoreFile(store, key, obj.size)
    with io.BufferedReader(raw, _SCAN_READ_BYTES) as f:
        members = scan_tar(f, url, obj.size)
    _save(index_path(store, key), IndexFile.encode([(url, obj.size, obj.version, members)]))
    return members


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


def _save(path: Path, data: bytes) -> None:
    """Writes a cache index atomically (a temporary file beside it, then os.replace)."""
    try:
        _write_atomically(path, data)
    except OSError as exc:  # the index only saves time: the dataset still opens without it
        log.warning(
            "fastload: cannot save the tar index %s (%s); it is rebuilt next time", path, exc
        )


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- fastload index ------------------------------------------------------------------------

Where = Literal["auto", "dataset", "cache"]


@dataclass(frozen=True, kw_only=True)
class IndexReport:
    """What :func:`write_index` did; ``to_dict()`` is what ``fastload index --json`` prints."""

    url: str
    written_to: str  # the index file next to the shards, or the cache's index folder
    in_cache: bool
    why_in_cache: str  # empty when written next to the shards
    shards: int
    samples: int
    shard_bytes: int  # the shards' size, each read once
    index_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_index(
    url: str,
    *,
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    jobs: int = INDEX_JOBS,
    to: Where = "auto",
    progress: bool | Callable[[Progress], None] | None = None,
) -> IndexReport:
    """Reads each tar shard at url once (streamed, ``jobs`` at a time, not cached) and
    writes fastload's index of them, so that opening the dataset reads only the index.

    ``to="dataset"`` writes ``fastload.flidx`` next to the shards (a local folder, a bucket
    with write access); ``"cache"`` writes a file per shard into ``<cache dir>/indexes/``,
    which serves opens that use this cache directory; ``"auto"`` writes next to the shards
    where it can (not over HTTP, nor into a read-only folder or bucket), else into the
    cache. The listing in the cache is refreshed, so the next open sees the index.
    ``progress=None`` shows a bar when stderr is a terminal.
    """
    if to not in ("auto", "dataset", "cache"):
        raise ValueError(f"to must be 'auto', 'dataset' or 'cache', got {to!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be 1 or more, got {jobs}")
    started = time.monotonic()
    config = StoreConfig(
        url=url, cache_dir=cache_dir, storage_options=dict(storage_options or {}), refresh=True
    )
    store = CachedStore(config)  # listed afresh: the index is of the shards there now
    try:
        keys = _shard_keys(store)
        fs, root = open_filesystem(url, config.storage_options)
        why = "asked for" if to == "cache" else _why_not_beside(fs, keys)
        if to == "dataset" and why:
            raise DatasetError(f"cannot write an index next to the shards of {store.url}: {why}")
        objects = [store.object(k) for k in keys]
        # At the listed versions (an hf:// shard at the listed commit, not the branch's).
        where = [path_of(fs, root, k, o.version) for k, o in zip(keys, objects, strict=True)]
        urls = [store.object_url(k) for k in keys]
        members = _stream_members(
            fs, list(zip(where, urls, [o.size for o in objects], strict=True)), jobs, progress
        )
        if not why:
            data = IndexFile.encode(
                (k, o.size, o.version, m) for k, o, m in zip(keys, objects, members, strict=True)
            )
            try:
                written = _write_beside(fs, root, data)
            except _NotWritable as exc:
                if to == "dataset":
                    raise DatasetError(
                        f"cannot write an index next to the shards of {store.url}: {exc}"
                    ) from None
                why = str(exc)
            else:
                index_bytes = len(data)
                relisted = CachedStore(config)  # so that opens with this cache see the file
                try:
                    relisted.object_keys()
                finally:
                    relisted.close()
        if why:
            written = str(store.cache.dir / "indexes")
            index_bytes = 0
            for key, obj, m in zip(keys, objects, members, strict=True):
                data = IndexFile.encode([(store.object_url(key), obj.size, obj.version, m)])
                _write_atomically(index_path(store, key), data)
                index_bytes += len(data)
        return IndexReport(
            url=store.url,
            written_to=written,
            in_cache=bool(why),
            why_in_cache=why,
            shards=len(keys),
            samples=sum(count_samples(m) for m in members),
            shard_bytes=sum(o.size or 0 for o in objects),
            index_bytes=index_bytes,
            seconds=time.monotonic() - started,
        )
    finally:
        store.close()


def _stream_members(
    fs: Any,
    shards: list[tuple[str, str, int | None]],
    jobs: int,
    progress: bool | Callable[[Progress], None] | None,
) -> list[list[Member]]:
    """The members of each (path, URL, size) shard, ``jobs`` shards streamed at a time."""
    callback = progress if callable(progress) else None
    if progress is None or progress is True:
        callback = ProgressBar(len(shards), sum(size or 0 for _, _, size in shards))
    counts = Progress(callback=callback)
    found: list[list[Member]] = [[] for _ in shards]
    with ThreadPoolExecutor(jobs, thread_name_prefix="fastload-tar-index") as pool:
        futures = {pool.submit(_stream_scan, fs, *shard): i for i, shard in enumerate(shards)}
        try:
            for future in as_completed(futures):
                i = futures[future]
                found[i] = future.result()
                counts.add(shards[i][2] or 0, fetched=True)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return found


def _stream_scan(fs: Any, path: str, url: str, size: int | None) -> list[Member]:
    """The members of one shard, streamed in large reads (retried whole), not cached."""

    def scan() -> list[Member] | DatasetError:
        with fs.open(path, "rb", block_size=_SCAN_READ_BYTES, cache_type="readahead") as f:
            try:
                return scan_tar(f, url, size)
            except DatasetError as exc:  # the shard's fault: not worth a retry
                return exc

    found = with_retries(scan, url)
    if isinstance(found, DatasetError):
        raise found
    return found


class _NotWritable(Exception):
    """The dataset's folder does not take an index file; the message says why."""


def _why_not_beside(fs: Any, keys: list[str]) -> str:
    """Why an index cannot go next to the shards, or "" if it may."""
    if keys == [""]:
        return "the URL names one shard, not a folder"
    if is_http(fs):
        return "HTTP servers take no uploads"
    return ""


def _write_beside(fs: Any, root: str, data: bytes) -> str:
    """Writes fastload.flidx next to the shards; its URL. Raises _NotWritable if refused."""
    path = path_of(fs, root, INDEX_NAME)
    shown = remote_url(fs, path)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    try:
        if any(p in ("file", "local") for p in protocols):
            _write_atomically(Path(path), data)
        else:
            fs.pipe_file(path, data)  # one PUT: an object appears whole or not at all
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _NotWritable(f"{shown} is not writable ({exc.strerror})") from None
        error = classify(exc, shown)
        if isinstance(error, RemoteAccessError):
            raise _NotWritable(f"writing {shown} was refused ({error.reason})") from None
        raise error from clean_cause(exc)
    return shown


__all__ = [
    "INDEX_NAME",
    "WIDS_INDEX_NAME",
    "IndexFile",
    "IndexReport",
    "TarDataset",
    "count_samples",
    "index_path",
    "is_header_of",
    "scan_tar",
    "split_name",
    "write_index",
]
