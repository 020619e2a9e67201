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

Tar has no table of contents, so each shard is read once to list its members (name, data
offset, size); that index is kept under ``<cache dir>/indexes/`` keyed by the shard's URL,
version and size, so the next open reads nothing. A sample is then one ranged read of the
shard (or one per field when its members lie far apart).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import DatasetError, Range, ShardedDataset
from fastload.store import CachedStore

log = logging.getLogger(__name__)

_INDEX_FORMAT = "fastload-tar-index/1"
# One read covers a whole sample when the bytes between its fields (tar headers, padding,
# fields left out by ``fields=``) are at most this much; otherwise each field is read alone.
_MAX_GAP_BYTES = 64 << 10
# Shards staged per round while indexing: bounds what must stay cached until it is parsed
# (a cache smaller than the dataset would otherwise evict shards before they are indexed).
_STAGE_ROUND = 16
_INDEX_THREADS = 4

Member = tuple[str, int, int]  # name, data offset, size


@dataclass(frozen=True)
class _Shard:
    """The samples of one shard; fields of sample j are entries starts[j]:starts[j+1]."""

    keys: list[str]
    starts: npt.NDArray[np.int64]
    field_ids: npt.NDArray[np.int32]
    offsets: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]


class TarDataset(ShardedDataset):
    """WebDataset-layout tar shards with random access (see the module docstring).

    ``dataset[i]`` is ``{"__key__": sample key, "__shard__": shard key, field: bytes, ...}``.
    ``fields`` keeps only those fields, and every sample must have all of them.
    Members that name no field (no ``.`` in the basename, or a hidden ``.name``) and
    directories are skipped; links, devices, FIFOs, absolute names and names with ``..``
    are refused with a :class:`DatasetError`. Nothing is ever extracted.
    """

    format = "tar"

    def __init__(self, store: CachedStore, *, fields: Sequence[str] | None = None) -> None:
        if isinstance(fields, str) or (fields is not None and not fields):
            raise ValueError(
                f"fields must be a non-empty list of field names such as ['jpg', 'cls'], "
                f"got {fields!r}"
            )
        self.fields: tuple[str, ...] | None = None if fields is None else tuple(fields)
        shard_keys = _shard_keys(store)
        members = _index_shards(store, shard_keys)
        self._field_names: list[str] = list(self.fields or ())
        self._field_ids = {f: i for i, f in enumerate(self._field_names)}
        self._shards = [
            self._group(store.object_url(k), m) for k, m in zip(shard_keys, members, strict=True)
        ]
        sizes = [len(s.keys) for s in self._shards]
        if sum(sizes) == 0:
            raise DatasetError(
                f"{store.url} holds no samples: its {len(shard_keys)} .tar shard(s) have no "
                "members named <key>.<field>; check that the shards are in WebDataset layout"
            )
        super().__init__(store, sizes, [[k] for k in shard_keys])

    # --- samples ---------------------------------------------------------------------------

    def key(self, index: int) -> str:
        """The key of sample index, without reading it."""
        index = self._check(int(index))
        s = self.shard_of(index)
        return self._shards[s].keys[index - int(self.shard_offsets[s])]

    def _fields(self, index: int) -> tuple[str, str, list[str], list[int], list[int]]:
        """(shard key, sample key, field names, offsets, sizes) of sample index."""
        s = self.shard_of(index)
        shard = self._shards[s]
        j = index - int(self.shard_offsets[s])
        lo, hi = int(shard.starts[j]), int(shard.starts[j + 1])
        names = [self._field_names[f] for f in shard.field_ids[lo:hi].tolist()]
        return (
            self.shard_keys[s][0],
            shard.keys[j],
            names,
            shard.offsets[lo:hi].tolist(),
            shard.sizes[lo:hi].tolist(),
        )

    def sample_ranges(self, index: int) -> list[Range] | None:
        key, _, _, offsets, sizes = self._fields(index)
        start = min(offsets)
        end = max(o + n for o, n in zip(offsets, sizes, strict=True))
        if end - start <= sum(sizes) + _MAX_GAP_BYTES:  # the usual case: fields side by side
            return [(key, start, end - start)]
        return [(key, o, n) for o, n in zip(offsets, sizes, strict=True)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        key, sample_key, names, offsets, sizes = self._fields(index)
        sample: dict[str, Any] = {"__key__": sample_key, "__shard__": key}
        own = bytes if copy else memoryview
        if len(parts) == 1:  # one range spanning every field
            start = min(offsets)
            whole = memoryview(parts[0])
            for name, o, n in zip(names, offsets, sizes, strict=True):
                sample[name] = own(whole[o - start : o - start + n])
        else:
            for name, part in zip(names, parts, strict=True):
                sample[name] = own(part)
        return sample

    # --- grouping --------------------------------------------------------------------------

    def _field_id(self, field: str) -> int | None:
        fid = self._field_ids.get(field)
        if fid is None and self.fields is None:
            fid = self._field_ids[field] = len(self._field_names)
            self._field_names.append(field)
        return fid

    def _group(self, shard_url: str, members: list[Member]) -> _Shard:
        """Samples in order of first appearance; a sample's fields in tar order (or in the
        order of ``fields=``)."""
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
        )


def split_name(name: str) -> tuple[str, str] | None:
    """(sample key, field) of a member name, or None when it names no field."""
    base = name.rfind("/") + 1
    dot = name.find(".", base)
    if dot <= base or dot == len(name) - 1:
        return None  # no dot, a hidden file (macOS "._x" files), or an empty field
    return name[:dot], name[dot + 1 :]


def _shard_keys(store: CachedStore) -> list[str]:
    keys = store.object_keys()
    if keys == [""] and store.url.endswith(".tar"):
        return keys  # the URL names one shard
    shards = sorted(k for k in keys if k.endswith(".tar"))
    if not shards:
        compressed = [k for k in keys if k.endswith((".tar.gz", ".tgz", ".tar.zst", ".tar.xz"))]
        hint = (
            f"; compressed shards such as {compressed[0]!r} cannot be read at random: "
            "decompress them to .tar"
            if compressed
            else "; pick another format= (files, imagefolder, zarr)"
        )
        raise DatasetError(
            f"{store.url} holds no .tar shards ({len(keys)} objects, e.g. {keys[:3]}){hint}"
        )
    return shards


# --- member indexes ------------------------------------------------------------------------


def index_path(store: CachedStore, key: str) -> Path:
    """Where the member index of shard key lives: it names the URL, version and size."""
    obj = store.object(key)
    ident = f"{_INDEX_FORMAT}\0{store.object_url(key)}\0{obj.version}\0{obj.size}"
    return store.cache.dir / "indexes" / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.json"


def _index_shards(store: CachedStore, keys: list[str]) -> list[list[Member]]:
    """The members of every shard: persisted indexes where they exist, else built now.

    Missing ones are staged a round at a time (concurrently, by the stager) and parsed on a
    few threads while the next round downloads.
    """
    found = {k: m for k in keys if (m := _load_index(store, k)) is not None}
    missing = [k for k in keys if k not in found]
    if missing:
        started = time.monotonic()
        with ThreadPoolExecutor(_INDEX_THREADS, thread_name_prefix="fastload-tar-index") as pool:
            futures: dict[str, Future[list[Member]]] = {}
            try:
                for r in range(0, len(missing), _STAGE_ROUND):
                    round_keys = missing[r : r + _STAGE_ROUND]
                    _stage(store, round_keys)
                    futures.update((k, pool.submit(_build_index, store, k)) for k in round_keys)
                    for f in futures.values():  # fail early, not after the last download
                        if f.done():
                            f.result()
                found.update((k, f.result()) for k, f in futures.items())
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        log.info(
            "fastload: indexed %d tar shards of %s in %.1f s",
            len(missing),
            store.url,
            time.monotonic() - started,
        )
    return [found[k] for k in keys]


def _stage(store: CachedStore, keys: list[str]) -> None:
    for key, result in zip(keys, store.stage(keys), strict=True):
        if result.outcome == "failed":
            raise store.stager.failure(store.object(key), result)
        # "skipped" (the cache turned it away) is fine: _build_index reads it remotely


def _build_index(store: CachedStore, key: str) -> list[Member]:
    url = store.object_url(key)
    size = store.object(key).size
    with _open_shard(store, key) as f:
        members = scan_tar(f, url, size)
    _save_index(index_path(store, key), url, members)
    return members


@contextlib.contextmanager
def _open_shard(store: CachedStore, key: str) -> Iterator[BinaryIO]:
    """The cached file when the shard has one (only headers get read), else its bytes."""
    where = store.local_path(key)
    if where is not None and where.offset == 0:
        try:
            f = open(where.path, "rb")  # noqa: SIM115 - closed below; survives eviction
        except FileNotFoundError:
            pass  # evicted since the lookup
        else:
            with f:
                yield f
            return
    yield io.BytesIO(store.read(key))


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


def _load_index(store: CachedStore, key: str) -> list[Member] | None:
    """The persisted members of shard key, or None when missing, unreadable or implausible."""
    path = index_path(store, key)
    size = store.object(key).size
    try:
        data = json.loads(path.read_text())
        if data["format"] != _INDEX_FORMAT or data["url"] != store.object_url(key):
            return None
        members = [(str(n), int(o), int(s)) for n, o, s in data["members"]]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("fastload: rebuilding the damaged tar index %s: %s", path, exc)
        return None
    if size is not None and any(o < 0 or s < 0 or o + s > size for _, o, s in members):
        log.warning("fastload: rebuilding the tar index %s: it points past the shard", path)
        return None
    return members


def _save_index(path: Path, url: str, members: list[Member]) -> None:
    """Writes the index atomically (a temporary file beside it, then os.replace)."""
    text = json.dumps({"format": _INDEX_FORMAT, "url": url, "members": members})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:  # the index only saves time: the dataset still opens without it
        log.warning(
            "fastload: cannot save the tar index %s (%s); it is rebuilt next time", path, exc
        )


__all__ = ["TarDataset", "index_path", "scan_tar", "split_name"]
