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

Tar has no table of contents: where each shard's sample count and members come from is
:mod:`fastload.datasets.tar.sources` (an index beside the shards, the cache's, wids'
``shardindex.json``, or a scan of the shards).

Every sample read checks the tar header before each field's data (its name and size), so
an index that does not match its shard raises a :class:`DatasetError` naming the shard
instead of giving wrong bytes. A sample is one ranged read of the shard (or one per field
when its members lie far apart).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.datasets.base import (
    DatasetError,
    Range,
    ShardedDataset,
)
from fastload.datasets.tar.members import BLOCK, Member, is_header_of, split_name
from fastload.datasets.tar.sources import (
    _Promise,
    index_shards,
    list_shards,
    promised_shards,
    scan_shard,
)
from fastload.errors import DecodeError
from fastload.store import CachedStore

# Fields taken as the image / the label when decoding (WebDataset's usual names).
IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "tif", "tiff")
LABEL_FIELDS = ("cls", "label", "target", "class")
# One read covers a whole sample when the bytes between its fields (tar headers, padding,
# fields left out by ``fields=``) are at most this much; otherwise each field is read alone.
_MAX_GAP_BYTES = 64 << 10


@dataclass(frozen=True)
class _Shard:
    """The samples of one shard; fields of sample j are entries starts[j]:starts[j+1]."""

    keys: list[str]
    starts: npt.NDArray[np.int64]
    field_ids: npt.NDArray[np.int32]
    offsets: npt.NDArray[np.int64]
    sizes: npt.NDArray[np.int64]
    source: str | None  # the index file its members came from; None: read from the shard


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
        shard_keys = list_shards(store)
        promised = promised_shards(store, shard_keys)
        scanned = index_shards(store, [k for k in shard_keys if k not in promised])
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
        start = min(offsets) - BLOCK
        end = max(o + n for o, n in zip(offsets, sizes, strict=True))
        if end - start <= sum(sizes) + BLOCK * len(sizes) + _MAX_GAP_BYTES:  # side by side
            return [(key, start, end - start)]
        return [(key, o - BLOCK, n + BLOCK) for o, n in zip(offsets, sizes, strict=True)]

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        s, sample_key, names, offsets, sizes = self._fields(index)
        key = self.shard_keys[s][0]
        if len(parts) == 1:  # one range spanning every field, from the first one's header
            start = min(offsets) - BLOCK
            whole = memoryview(parts[0])
            views = [
                whole[o - start - BLOCK : o - start + n]
                for o, n in zip(offsets, sizes, strict=True)
            ]
        else:
            views = [memoryview(p) for p in parts]
        sample: dict[str, Any] = {"__key__": sample_key, "__shard__": key}
        own = bytes if copy else memoryview
        for name, view, offset, size in zip(names, views, offsets, sizes, strict=True):
            member = f"{sample_key}.{name}"
            if not is_header_of(view[:BLOCK], member, size, field_at=len(sample_key) + 1):
                raise self._not_a_member(s, member, offset, size)
            sample[name] = own(view[BLOCK:])
        return sample

    # --- what the loader's decoder asks of a sample ---------------------------------------

    @property
    def decodable(self) -> bool:
        """Samples hold an image field (one of ``IMAGE_FIELDS``), or decoding says not."""
        return True

    def image_and_label(self, sample: Any, index: int) -> tuple[Any, Any]:
        """The first of ``IMAGE_FIELDS`` the sample has, and the first of ``LABEL_FIELDS``
        (an integer where its text is one)."""
        image = next((sample[f] for f in IMAGE_FIELDS if f in sample), None)
        if image is None:
            where = self.store.object_url(sample["__shard__"])
            raise DecodeError(
                f"sample {index} ({sample['__key__']} in {where}) has no image field"
                f" ({', '.join(IMAGE_FIELDS)}); its fields are "
                f"{', '.join(k for k in sample if not k.startswith('__'))}"
            )
        label = next((sample[f] for f in LABEL_FIELDS if f in sample), None)
        if isinstance(label, bytes | bytearray | memoryview):
            text = bytes(label).decode("utf-8", "replace").strip()
            label = int(text) if text.lstrip("-").isdigit() else text
        return image, label

    def describe(self, index: int) -> str:
        shard = self.shard_keys[self.shard_of(index)][0]
        return f"{self.key(index)} in {self.store.object_url(shard)}"

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
        shard = self._group(url, scan_shard(self.store, key), None)
        if len(shard.keys) != promise.samples:
            raise DatasetError(
                f"{url} holds {len(shard.keys)} samples but {promise.source} says "
                f"{promise.samples}; that index is wrong for a shard of this size: rebuild it, "
                f"or run `fastload index {self.store.url}` (fastload reads its own index first)"
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
