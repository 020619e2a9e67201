"""The source stage: one listing of a dataset root, kept in the cache as a manifest.

A manifest records, for every object under the root, its key (the path below the root,
``/``-separated), its size and its version (ETag, version id, mtime, whatever the backend
gives), so later stages never list the remote again unless asked to (``refresh``) or the
listing is older than its time-to-live.

At ImageNet size (1.28 M objects) a manifest of Python objects costs ~600 bytes a sample in
every rank and worker and tens of MB to pickle. So a manifest is columnar, in one file under
the cache (``manifests/<id>.flm``) that every process on the node memory-maps: keys sorted
by code point (UTF-8 in one blob, with offsets), sizes, versions. The pages are the page
cache's, shared by all ranks and workers; a pickled manifest is its file's path. The first
process to need a listing lists, holding ``manifests/<id>.lock``; the others on the node
wait for it and map what it wrote.

File layout (little-endian): the magic ``FLMANIF1``, a uint64 header length, the header
(JSON: url, listed_at, count, blob sizes), padding to 8 bytes, then int64 key offsets
(count + 1), int64 sizes (-1: unknown), int64 version offsets (count + 1), the keys' xxh3
hashes sorted (uint64) and the index of each (int64) -- a key's index in a few vectorized
steps, not a bisect over strings --, uint8 version-present flags, the key blob, the version
blob.
"""

from __future__ import annotations

import codecs
import ctypes
import errno
import fcntl
import glob
import hashlib
import io
import itertools
import json
import logging
import mmap
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, overload

import numpy as np
import numpy.typing as npt
import xxhash

from fastload.errors import RemoteError
from fastload.remote import public_url
from fastload.remote.crawl import list_remote
from fastload.remote.listing import ENCODING as _ENCODING
from fastload.remote.listing import Listing
from fastload.safe_files import (
    open_exclusive,
    own_folder,
    sealed,
    unsafe,
    unsealed,
    write_atomically,
)

log = logging.getLogger(__name__)

_MAGIC = b"FLMANIF1"
_SUFFIX = ".flm"


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One object of a dataset: ``key`` is its path below the dataset root."""

    key: str
    size: int | None
    version: str | None


Int64s = npt.NDArray[np.int64]


def _saved_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays :meth:`Manifest.derived` saved at path, or None where there are none, or
    none to trust: a file whose checksum fails (damaged, or written before files carried
    one) is named in the log and made again."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("fastload: rebuilding %s, which cannot be read: %s", path, exc)
        return None
    payload = unsealed(data)
    if payload is None:
        log.warning(
            "fastload: rebuilding %s: its checksum does not hold (damaged, or written by "
            "a fastload older than checksums)",
            path,
        )
        return None
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as saved:
            return {k: saved[k] for k in saved.files}
    except (OSError, ValueError, KeyError, EOFError) as exc:
        log.warning("fastload: rebuilding %s, which cannot be read: %s", path, exc)
        return None


class Manifest:
    """A dataset's listing in columns (see the module docstring), sorted by key.

    ``Manifest(url, objects, listed_at)`` builds one in memory; :meth:`load` maps a saved
    one. Index ``i`` names the i-th object in key order: :meth:`key`, :meth:`size`,
    :meth:`version`, :meth:`index_of`; iterating gives :class:`RemoteObject` values.
    """

    def __init__(
        self, url: str, objects: Iterable[RemoteObject] = (), listed_at: float = 0.0
    ) -> None:
        found = list(objects)
        listing = Listing.of(
            [o.key for o in found], [o.size for o in found], [o.version for o in found]
        )
        self._init_columns(url, listed_at, listing)

    @classmethod
    def of_listing(cls, url: str, listed_at: float, listing: Listing) -> Manifest:
        self = cls.__new__(cls)
        self._init_columns(url, listed_at, listing)
        return self

    def _init_columns(self, url: str, listed_at: float, listing: Listing) -> None:
        self.url = url
        self.listed_at = float(listed_at)
        self._key_blob: bytes | memoryview = listing.key_blob
        self._key_offsets = listing.key_offsets
        self._sizes = listing.sizes
        self._version_blob: bytes | memoryview = listing.version_blob
        self._version_offsets = listing.version_offsets
        self._version_present = listing.version_present
        blob, offsets = listing.key_blob, listing.key_offsets.tolist()
        keys = (blob[s:e] for s, e in itertools.pairwise(offsets))
        hashes = np.fromiter(map(xxhash.xxh3_64_intdigest, keys), np.uint64, len(listing))
        self._hash_order = np.argsort(hashes, kind="stable").astype(np.int64)
        self._key_hashes = hashes[self._hash_order]
        self._total_bytes: int | None = None
        self._fingerprint: str | None = None
        self.path: Path | None = None

    # --- reading ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def fingerprint(self) -> str:
        """A digest of what was listed: every key, size and version (xxh3-128 over the
        columns themselves, no object per entry; computed once). Two listings with the same
        fingerprint give the same plan; ranks that see different ones must not train."""
        if self._fingerprint is None:
            self._fingerprint = self.fingerprint_of(0, len(self))
        return self._fingerprint

    def fingerprint_of(self, start: int, end: int) -> str:
        """The digest of objects [start, end): their keys, sizes and versions."""
        digest = xxhash.xxh3_128()
        for offsets, blob in (
            (self._key_offsets, self._key_blob),
            (self._version_offsets, self._version_blob),
        ):
            lo, hi = int(offsets[start]), int(offsets[end])
            digest.update(np.ascontiguousarray(offsets[start : end + 1] - lo, "<i8").data)
            digest.update(blob[lo:hi])
        digest.update(np.ascontiguousarray(self._sizes[start:end], "<i8").data)
        digest.update(np.ascontiguousarray(self._version_present[start:end], "u1").data)
        return digest.hexdigest()

    def key(self, i: int) -> str:
        o = self._key_offsets
        return str(self._key_blob[o[i] : o[i + 1]], *_ENCODING)

    def size(self, i: int) -> int | None:
        s = int(self._sizes[i])
        return None if s < 0 else s

    def version(self, i: int) -> str | None:
        if not self._version_present[i]:
            return None
        o = self._version_offsets
        return str(self._version_blob[o[i] : o[i + 1]], *_ENCODING)

    def object_at(self, i: int) -> RemoteObject:
        return RemoteObject(self.key(i), self.size(i), self.version(i))

    def objects_at(self, indices: Sequence[int] | Int64s) -> list[RemoteObject]:
        """:meth:`object_at` of many indices, their columns gathered at once."""
        at = np.asarray(indices, dtype=np.int64)
        k, v = self._key_offsets, self._version_offsets
        keys, versions = self._key_blob, self._version_blob
        out = []
        for ks, ke, size, vs, ve, has in zip(
            k[at].tolist(),
            k[at + 1].tolist(),
            self._sizes[at].tolist(),
            v[at].tolist(),
            v[at + 1].tolist(),
            self._version_present[at].tolist(),
            strict=True,
        ):
            out.append(
                RemoteObject(
                    str(keys[ks:ke], *_ENCODING),
                    None if size < 0 else size,
                    str(versions[vs:ve], *_ENCODING) if has else None,
                )
            )
        return out

    def keys_at(self, at: Int64s) -> list[str]:
        """The keys of objects ``at`` (a batch's), sliced from the key column at once."""
        o, blob = self._key_offsets, self._key_blob
        starts, ends = o[at].tolist(), o[at + 1].tolist()
        return [str(blob[s:e], *_ENCODING) for s, e in zip(starts, ends, strict=True)]

    def sizes_at(self, at: Int64s) -> Int64s:
        """The sizes of objects ``at``; -1 where the listing has none."""
        return np.asarray(self._sizes[at], dtype=np.int64)

    def versions_at(self, at: Int64s) -> list[str | None]:
        """The versions of objects ``at`` (None where the listing has none)."""
        o, blob = self._version_offsets, self._version_blob
        return [
            str(blob[s:e], *_ENCODING) if has else None
            for s, e, has in zip(
                o[at].tolist(),
                o[at + 1].tolist(),
                self._version_present[at].tolist(),
                strict=True,
            )
        ]

    def urls_of(self, keys: Sequence[str]) -> list[str]:
        """:meth:`object_url` of many keys."""
        root = self.url.rstrip("/") + "/"
        return [root + key if key else self.url for key in keys]

    def index_of(self, key: str) -> int:
        """The index of key, or -1 if the listing does not hold it."""
        return int(self.indices_of([key])[0])

    def indices_of(self, keys: Sequence[str]) -> Int64s:
        """The index of each key (-1 for a key the listing does not hold): one vectorized
        search of the keys' hashes, then each candidate's bytes compared."""
        encoded = [k.encode(*_ENCODING) for k in keys]
        wanted = np.fromiter(map(xxhash.xxh3_64_intdigest, encoded), np.uint64, len(encoded))
        hashes, order, offsets = self._key_hashes, self._hash_order, self._key_offsets
        if not len(hashes):
            return np.full(len(encoded), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(hashes, wanted), len(hashes) - 1)
        found = np.where(hashes[at] == wanted, order[at], -1)
        starts, ends = offsets[found].tolist(), offsets[found + 1].tolist()
        blob = self._key_blob
        for j, i in enumerate(found.tolist()):
            if i >= 0 and blob[starts[j] : ends[j]] != encoded[j]:
                found[j] = self._colliding(encoded[j], int(at[j]))
        return found

    def _colliding(self, target: bytes, at: int) -> int:
        """The index of target among the keys after position ``at`` of the sorted hashes
        that share its hash (a collision), or -1."""
        hashes, order, offsets = self._key_hashes, self._hash_order, self._key_offsets
        h = hashes[at]
        for p in range(at + 1, len(hashes)):
            if hashes[p] != h:
                break
            i = int(order[p])
            if self._key_blob[offsets[i] : offsets[i + 1]] == target:
                return i
        return -1

    def search(self, key: str) -> int:
        """Where key is, or would go, in key order (``bisect_left`` over the keys)."""
        target = key.encode(*_ENCODING)
        blob, offsets = self._key_blob, self._key_offsets
        lo, hi = 0, len(self)
        while lo < hi:
            mid = (lo + hi) // 2
            if bytes(blob[offsets[mid] : offsets[mid + 1]]) < target:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @property
    def objects(self) -> _Objects:
        """The objects in key order, as a sequence made on access (none are kept)."""
        return _Objects(self)

    def __iter__(self) -> Iterator[RemoteObject]:
        return iter(self.objects)

    @property
    def key_blob(self) -> bytes | memoryview:
        """The keys, UTF-8, back to back in key order; key i is
        ``key_blob[key_offsets[i]:key_offsets[i + 1]]``. For column-wide work in numpy."""
        return self._key_blob

    @property
    def key_offsets(self) -> Int64s:
        return self._key_offsets

    @property
    def total_bytes(self) -> int:
        if self._total_bytes is None:
            self._total_bytes = int(self._sizes[self._sizes > 0].sum())
        return self._total_bytes

    def object_url(self, obj: RemoteObject) -> str:
        return self.url if obj.key == "" else f"{self.url.rstrip('/')}/{obj.key}"

    def keys(self) -> list[str]:
        """Every key in order, as Python strings (O(n) objects: for small datasets and
        tools, not for a sample's path)."""
        blob, o = self._key_blob, self._key_offsets.tolist()
        return [str(blob[o[i] : o[i + 1]], *_ENCODING) for i in range(len(self))]

    def derived(self, name: str, make: Callable[[], dict[str, Any]]) -> dict[str, np.ndarray]:
        """Arrays made from this listing by ``make`` (a dataset's layout: its classes, its
        samples' order), kept beside the manifest's file so that the next open of the
        same listing reads them rather than computing them again."""
        if self.path is None:
            return {k: np.asarray(v) for k, v in make().items()}
        path = self.path.with_name(f"{self.path.stem}.{name}.npz")
        saved = _saved_arrays(path)
        if saved is not None and float(saved.pop("listed_at", np.nan)) == self.listed_at:
            return saved
        arrays = {k: np.asarray(v) for k, v in make().items()}
        payload: dict[str, Any] = {"listed_at": np.float64(self.listed_at), **arrays}
        out = io.BytesIO()
        np.savez(out, **payload)
        # checksummed: a damaged file is made again, never read as labels or a format
        write_atomically(path, sealed(out.getvalue()))  # never through a link
        return arrays

    # --- the file --------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Writes the manifest to path atomically (a reader never sees half a file)."""
        header = json.dumps(
            {
                "url": self.url,
                "listed_at": self.listed_at,
                "count": len(self),
                "key_bytes": len(self._key_blob),
                "version_bytes": len(self._version_blob),
            }
        ).encode()
        head = _MAGIC + np.uint64(len(header)).tobytes() + header
        head += b"\0" * (-len(head) % 8)

        def write(f: BinaryIO) -> None:
            f.write(head)
            for array in (self._key_offsets, self._sizes, self._version_offsets):
                f.write(np.ascontiguousarray(array, dtype="<i8").tobytes())
            f.write(np.ascontiguousarray(self._key_hashes, dtype="<u8").tobytes())
            f.write(np.ascontiguousarray(self._hash_order, dtype="<i8").tobytes())
            f.write(np.ascontiguousarray(self._version_present, dtype=np.uint8).tobytes())
            f.write(self._key_blob)
            f.write(self._version_blob)

        # A new file (never through a link planted in manifests/), whole on disk before it
        # is renamed into place.
        write_atomically(path, write, fsync=True)
        self.path = path

    @classmethod
    def load(cls, path: Path) -> Manifest:
        """The manifest saved at path. Raises ValueError if the file is not a whole, sound
        manifest: every count and offset is checked against the file before it is used.

        A sealed file (read-only to everyone, see :func:`seal`: how fastload publishes
        one, never writing it again) is mapped, shared with every process mapping it. Any
        other file is read into a private copy: a mapped file truncated in place kills its
        reader with SIGBUS, which no check made at open can prevent. (root may still
        truncate a sealed file; fastload itself only ever replaces one.)"""
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            size = stat.st_size
            if size < len(_MAGIC) + 8:
                raise ValueError(f"{path} is not a fastload manifest")
            if _sealed(stat):
                data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                data = f.read()
        if len(data) != size:
            raise ValueError(f"{path} changed while it was read")
        view = memoryview(data)
        if bytes(view[: len(_MAGIC)]) != _MAGIC:
            raise ValueError(f"{path} is not a fastload manifest")
        header_len = int(np.frombuffer(view, "<u8", 1, len(_MAGIC))[0])
        start = len(_MAGIC) + 8
        if header_len > size - start:
            raise ValueError(f"{path}: its header of {header_len} bytes is longer than the file")
        try:
            header = json.loads(bytes(view[start : start + header_len]))
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError too
            raise ValueError(f"{path}: its header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: its header is not an object")
        n, key_bytes, version_bytes = (
            _count(header, name, size, path) for name in ("count", "key_bytes", "version_bytes")
        )
        at = start + header_len + (-(start + header_len) % 8)
        if size != at + 8 * (5 * n + 2) + n + key_bytes + version_bytes:
            raise ValueError(f"{path} is truncated")
        url, listed_at = header.get("url"), header.get("listed_at")
        if (
            not isinstance(url, str)
            or not isinstance(listed_at, int | float)
            or isinstance(listed_at, bool)
        ):
            raise ValueError(f"{path}: its header has no url and listed_at")
        self = cls.__new__(cls)
        self.url, self.listed_at = url, float(listed_at)
        arrays = []
        for count in (n + 1, n, n + 1):
            arrays.append(np.frombuffer(view, "<i8", count, at))
            at += 8 * count
        self._key_offsets, self._sizes, self._version_offsets = arrays
        self._key_hashes = np.frombuffer(view, "<u8", n, at)
        self._hash_order = np.frombuffer(view, "<i8", n, at + 8 * n)
        at += 16 * n
        self._version_present = np.frombuffer(view, np.uint8, n, at)
        at += n
        self._key_blob = view[at : at + key_bytes]
        self._version_blob = view[at + key_bytes : at + key_bytes + version_bytes]
        self._check_columns(path, key_bytes, version_bytes)
        self._total_bytes = None
        self._fingerprint = None
        self.path = path
        return self

    def _check_columns(self, path: Path, key_bytes: int, version_bytes: int) -> None:
        """The columns describe the blobs they index (a few vectorized passes: ~10 ms at
        1.28 M keys): offsets from 0 to the blob's end, never backwards; sizes -1 or more;
        the hash order within the indices, its hashes sorted."""
        n = len(self._sizes)
        for offsets, blob, what in (
            (self._key_offsets, key_bytes, "key"),
            (self._version_offsets, version_bytes, "version"),
        ):
            if offsets[0] != 0 or offsets[-1] != blob or bool((np.diff(offsets) < 0).any()):
                raise ValueError(f"{path}: its {what} offsets do not index its {what}s")
        for text, what in ((self._key_blob, "keys"), (self._version_blob, "versions")):
            decoder = codecs.getincrementaldecoder(_ENCODING[0])(_ENCODING[1])
            try:  # a MB at a time: the text is not kept (~20 ms for 1.28 M keys)
                for at in range(0, len(text), 1 << 20):
                    decoder.decode(text[at : at + (1 << 20)])
                decoder.decode(b"", final=True)
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: its {what} are not UTF-8 ({e})") from None
        if n and (
            int(self._sizes.min()) < -1
            or bool((np.diff(self._key_hashes.view(np.uint64)) < 0).any())
            or int(self._hash_order.min()) < 0
            or int(self._hash_order.max()) >= n  # a lookup compares the key's bytes too
            or int(self._version_present.max()) > 1
        ):
            raise ValueError(f"{path}: its sizes, hashes or flags are out of range")

    def __getstate__(self) -> dict[str, Any]:
        if self.path is not None:  # workers map the node's copy: the path, not the arrays
            return {"path": str(self.path), "url": self.url, "listed_at": self.listed_at}
        state = dict(self.__dict__)
        state["_key_blob"], state["_version_blob"] = (
            bytes(self._key_blob),
            bytes(self._version_blob),
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "path" not in state or state["path"] is None:
            self.__dict__.update(state)
            return
        loaded = Manifest.load(Path(state["path"]))
        if loaded.url != state["url"] or loaded.listed_at != state["listed_at"]:
            raise RemoteError(
                116,  # ESTALE
                f"the listing of {state['url']} was refreshed since this dataset was opened "
                f"({state['path']} changed); open the dataset again",
            )
        self.__dict__.update(loaded.__dict__)

    # --- the format before 0.2 ---------------------------------------------------------------

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """A manifest saved as JSON (fastload before the columnar format)."""
        data = json.loads(text)
        objects = [RemoteObject(k, s, v) for k, s, v in data["objects"]]
        return cls(data["url"], objects, float(data["listed_at"]))


def _count(header: dict[str, Any], name: str, most: int, path: Path) -> int:
    """A header's count: an int from 0 to most (the file's size bounds every count)."""
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= most:
        raise ValueError(f"{path}: its {name} is {value!r}, expected 0 to {most}")
    return value


def _sealed(stat: os.stat_result) -> bool:
    """Whether a manifest's file is as :func:`seal` leaves it: read-only to everyone."""
    return not stat.st_mode & 0o222


def seal(path: Path) -> None:
    """Makes a just-written manifest read-only to everyone: fastload never writes it in
    place again (a new listing replaces it), so it may be mapped (:meth:`Manifest.load`)."""
    os.chmod(path, 0o444)


class _Objects(Sequence[RemoteObject]):
    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest

    def __len__(self) -> int:
        return len(self._manifest)

    @overload
    def __getitem__(self, i: int) -> RemoteObject: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RemoteObject]: ...
    def __getitem__(self, i: int | slice) -> RemoteObject | Sequence[RemoteObject]:
        if isinstance(i, slice):
            return [self._manifest.object_at(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._manifest.object_at(i % len(self))

    def __iter__(self) -> Iterator[RemoteObject]:
        m = self._manifest
        return (m.object_at(i) for i in range(len(m)))


# --- listing -----------------------------------------------------------------------------


def list_dataset(
    url: str, storage_options: dict[str, Any] | None = None, *, progress: bool = False
) -> Manifest:
    """Lists every object under url (or the one object url names) into a manifest
    (:func:`fastload.remote.crawl.list_remote`)."""
    root_url, columns = list_remote(url, storage_options, progress=progress)
    return Manifest.of_listing(root_url, time.time(), columns)


# --- the cached manifest -------------------------------------------------------------------


def manifest_path(cache_dir: Path, url: str) -> Path:
    return cache_dir / "manifests" / (_manifest_id(url) + _SUFFIX)


def _manifest_id(url: str) -> str:
    return hashlib.sha256(public_url(url).encode()).hexdigest()[:24]


def _load_saved(path: Path, ttl_s: float | None, newer_than: float | None) -> Manifest | None:
    """The manifest at path if there is a whole one, fresh enough; else None. A manifest
    of the JSON format before this one is converted (the same versions: nothing cached is
    refetched)."""
    manifest: Manifest | None
    try:
        manifest = Manifest.load(path)
    except FileNotFoundError:
        manifest = _converted(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable: list again
    if manifest is None:
        return None
    age_ok = ttl_s is None or time.time() - manifest.listed_at <= ttl_s
    if newer_than is not None and manifest.listed_at < newer_than:
        return None
    return manifest if age_ok else None


def _converted(path: Path) -> Manifest | None:
    legacy = path.with_suffix(".json")
    try:
        manifest = Manifest.from_json(legacy.read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    manifest.save(path)
    seal(path)
    legacy.unlink(missing_ok=True)
    return Manifest.load(path)


def load_manifest(
    url: str,
    cache_dir: Path,
    storage_options: dict[str, Any] | None = None,
    *,
    refresh: bool = False,
    ttl_s: float | None = None,
    progress: bool | None = None,
) -> Manifest:
    """The cached listing of url, or a fresh one (kept for next time) when asked or stale.

    One process per node lists: the others wait on ``manifests/<id>.lock`` and map what it
    wrote (with ``refresh``, a listing made after they asked counts as fresh).
    ``progress`` (default: when stderr is a terminal) shows the listing's count.
    """
    path = manifest_path(cache_dir, url)
    asked_at = time.time()
    if not refresh:
        manifest = _load_saved(path, ttl_s, None)
        if manifest is not None:
            return manifest
    own_folder(path.parent)
    with _ListingLock(path.with_suffix(".lock"), public_url(url)):
        manifest = _load_saved(path, ttl_s, asked_at if refresh else None)
        if manifest is not None:
            return manifest  # listed by another process while this one waited
        listed = list_dataset(
            url, storage_options, progress=sys.stderr.isatty() if progress is None else progress
        )
        listed.save(path)
        seal(path)
    del listed
    _return_freed_heap()  # the listing's columns are in the file now
    return Manifest.load(path)


def _return_freed_heap() -> None:
    """Gives the heap the listing used back to the system (glibc keeps freed memory for
    reuse: ~140 MB after listing 1.28 M objects, private to the process that listed)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc
    libc.malloc_trim(0)


class _ListingLock:
    """An exclusive ``flock`` on a file of the cache: dropped by the kernel if its holder
    dies, so a crashed lister never blocks the node."""

    def __init__(self, path: Path, url: str) -> None:
        self.path = path
        self.url = url
        self._fd = -1

    def __enter__(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise unsafe(self.path, "a symbolic link") from None
            raise
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("fastload: waiting for another process listing %s", self.url)
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # the holder's listing has its own timeouts
        except BaseException:
            os.close(self._fd)
            raise

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)  # closing drops the lock


# --- snapshots beside a checkpoint ------------------------------------------------------------


def save_snapshot(manifest: Manifest, directory: Path) -> dict[str, str]:
    """manifest saved into directory as ``manifest-<digest>.flm`` (beside a checkpoint, for a
    restart that must not list the remote again); returns ``{"file": name, "sha256": ...}``
    for the state to name it by. The same listing saved again gives the same file, and is
    not copied again where it is there already (a restarted job's loader saves it at every
    start: 1.28 M objects, ~190 MB copied and hashed, ~0.5 s)."""
    own_folder(directory)
    record = directory / f".manifest-{manifest.fingerprint[:32]}.json"
    saved = _saved_snapshot(record, manifest.url)
    if saved is not None:
        if manifest.path is not None:
            _copy_derived(manifest.path, directory / saved["file"])
        return saved
    staged = directory / f".manifest.{os.getpid()}.{secrets.token_hex(6)}.tmp.flm"
    try:
        if manifest.path is not None and manifest.path.exists():
            with (
                open(manifest.path, "rb") as src,
                os.fdopen(open_exclusive(str(staged)), "wb") as out,
            ):
                shutil.copyfileobj(src, out, 1 << 20)
        else:  # an in-memory listing; saving it must not repoint the one the dataset maps
            mapped = manifest.path
            manifest.save(staged)
            manifest.path = mapped
        with open(staged, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()  # streamed, not loaded whole
        name = f"manifest-{digest[:24]}.flm"
        size = os.stat(staged).st_size
        os.replace(staged, directory / name)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    entry = {"file": name, "sha256": digest}
    record_text = json.dumps({**entry, "url": manifest.url, "bytes": size})
    write_atomically(record, record_text.encode())
    if manifest.path is not None:
        _copy_derived(manifest.path, directory / name)
    return entry


def _copy_derived(source: Path, target: Path) -> None:
    """What :meth:`Manifest.derived` kept beside the manifest file source (a dataset's
    layout: its classes and sample order, ~0.5 s to make again at 1.28 M images) copied
    beside target, where missing there. Each file is checksummed: a damaged copy is made
    again from the listing, never used."""
    for made in source.parent.glob(f"{glob.escape(source.stem)}.*.npz"):
        copy = target.with_name(target.stem + made.name[len(source.stem) :])
        if not copy.exists():
            write_atomically(copy, made.read_bytes())


def _saved_snapshot(record: Path, url: str) -> dict[str, str] | None:
    """The entry of a snapshot of the same listing (the record is named by its fingerprint)
    saved before in the record's folder, if its file is still there at its size; a restore
    checks its sha256 as always."""
    try:
        known = json.loads(record.read_text())
        name = str(known["file"])
        if (
            known["url"] == url
            and Path(name).name == name  # a file of this folder, nowhere else
            and (record.parent / name).stat().st_size == known["bytes"]
        ):
            return {"file": name, "sha256": str(known["sha256"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def install_snapshot(directory: Path, entry: dict[str, str], cache_dir: Path, url: str) -> None:
    """The snapshot a state names (``save_snapshot``'s entry, in directory) made the node's
    listing of url in cache_dir, as if it had been listed there, unless the node holds a
    listing of its own already. One pass over the file: copied into the cache while its
    sha256 is checked, then checked as a manifest and sealed, so every process on the node
    maps it (1.28 M objects: ~190 MB, which an unsealed copy would read into each); the
    dataset's layout saved with it comes along."""
    source = directory / str(entry["file"])
    path = manifest_path(cache_dir, url)
    if _load_saved(path, None, None) is not None:
        return
    own_folder(path.parent)
    staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        with open(source, "rb") as src, os.fdopen(open_exclusive(str(staged)), "wb") as out:
            digest = hashlib.sha256()
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != entry["sha256"]:
            raise ValueError(
                f"{source} is not the manifest snapshot this state names (its sha256 differs): "
                "copy the one saved with the state"
            )
        seal(staged)
        Manifest.load(staged)  # a whole, sound manifest, or ValueError naming it
        os.replace(staged, path)
        _copy_derived(source, path)
    except FileNotFoundError as exc:
        if exc.filename != str(source):
            raise
        raise FileNotFoundError(
            f"{source}: the manifest snapshot this state names is missing; copy it beside the "
            "state file (it was saved there with the state), or warm by URL instead"
        ) from None
    finally:
        staged.unlink(missing_ok=True)
