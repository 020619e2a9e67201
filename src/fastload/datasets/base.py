"""What every dataset format shares: shards, the mapping from sample index to shard, reads."""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.errors import FastloadError
from fastload.staging import planner
from fastload.staging.planner import Range as Range  # (object key, offset, length)
from fastload.store import CachedStore


def keys_ending(store: CachedStore, suffix: str) -> list[str]:
    """The sorted keys of the objects whose name ends with ``suffix`` (a format's files);
    ``[""]`` where the URL names one such object itself."""
    keys = store.object_keys()
    if keys == [""] and store.url.endswith(suffix):
        return keys
    return sorted(k for k in keys if k.endswith(suffix))


class DatasetError(FastloadError, ValueError):
    """A dataset cannot be opened as asked (empty, malformed, hostile); the message says where."""


class StoreFile(io.RawIOBase):
    """Object ``key`` of a store as a seekable file (for ``tarfile``, pyarrow): each read
    one ``_fetch``, by default ``store.read`` (from the cache, fetching it first if need
    be)."""

    def __init__(self, store: CachedStore, key: str, size: int | None) -> None:
        self._store, self._key, self._size = store, key, size
        self._pos = 0

    def _fetch(self, offset: int, length: int) -> bytes:
        return self._store.read(self._key, offset, length)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_END:
            if self._size is None:
                raise io.UnsupportedOperation("the size of this object is not known")
            offset += self._size
        elif whence == io.SEEK_CUR:
            offset += self._pos
        self._pos = max(offset, 0)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view) if self._size is None else min(len(view), self._size - self._pos)
        if want <= 0:
            return 0
        data = self._fetch(self._pos, want)
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


@dataclass(frozen=True)
class SampleSpans:
    """A batch's samples as columns, for a format whose sample is one whole object (a file
    of a folder): the loader reads and decodes the batch without a Python call per sample.
    """

    objects: npt.NDArray[np.int64]  # each sample's object, as the manifest indexes it
    keys: list[str]  # and its key
    sizes: npt.NDArray[np.int64]  # its bytes (the whole object)
    labels: npt.NDArray[np.int64] | None  # the class of each sample, where it has one


class ShardedDataset:
    """A map-style dataset whose samples live in shards, the unit of caching.

    Subclasses set ``shard_sizes`` (samples per shard, in shard order) and ``shard_keys``
    (the objects each shard reads) and implement ``_load(index)``. Sample indices are global:
    shard ``s`` holds ``[shard_offsets[s], shard_offsets[s + 1])``.
    """

    format: str = "?"
    format_reason: str = ""
    # Whether the format's samples are objects of their own (a file folder's files): its
    # staging rounds bring many small objects, worth the staging process that
    # ``open_dataset`` then starts before the listing (fastload.staging.process). A format
    # of few large shards leaves it to staging, which starts it where it will be used.
    stages_many_objects: bool = False

    def __init__(
        self,
        store: CachedStore,
        shard_sizes: Sequence[int] | npt.NDArray[np.int64],
        shard_keys: Sequence[Sequence[str]],
    ) -> None:
        if len(shard_sizes) != len(shard_keys):
            raise ValueError("one list of keys per shard")
        # A list, or an array where a list of one int per sample would cost too much.
        self.shard_sizes: Sequence[int] | npt.NDArray[np.int64] = (
            shard_sizes if isinstance(shard_sizes, np.ndarray) else [int(n) for n in shard_sizes]
        )
        if not np.sum(self.shard_sizes):
            raise DatasetError(f"{store.url} holds no samples")
        self.store = store
        self.shard_keys = shard_keys
        self.shard_offsets = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.shard_offsets[-1])

    @property
    def fingerprint(self) -> str:
        """The digest of the dataset's listing (its keys, sizes and versions): equal on two
        nodes exactly when they see the same dataset, hence make the same plan."""
        return self.store.manifest.fingerprint

    def shard_of(self, index: int) -> int:
        return int(np.searchsorted(self.shard_offsets, index, side="right")) - 1

    def _check(self, index: int) -> int:
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"sample {index} is out of range for {self.store.url} ({n} samples)")
        return index

    def __getitem__(self, index: int) -> Any:
        return self._load(self._check(int(index)))

    def _load(self, index: int) -> Any:
        ranges = self.sample_ranges(index)
        if ranges is None:
            raise NotImplementedError(f"{type(self).__name__} must implement _load")
        return self.assemble(index, [self.read_range(*r) for r in ranges])

    def sample_ranges(self, index: int) -> list[Range] | None:
        """The byte ranges sample ``index`` is made of, in order, for readers that fetch the
        bytes themselves (``fl.DataLoader`` reads them natively, many samples per call);
        None where the format does not map samples to plain byte ranges (Zarr)."""
        return None

    def sample_spans(self, indices: npt.NDArray[np.int64]) -> SampleSpans | None:
        """The batch ``indices`` as :class:`SampleSpans` (each sample one whole object, the
        image that :meth:`image_and_label` gives); None where the format's samples are not
        that, or where a size is not listed: the loader then goes sample by sample."""
        return None

    @property
    def stages_by_range(self) -> bool:
        """Whether the format stages shards as byte ranges (overrides :meth:`stage_ranges`)."""
        return type(self).stage_ranges is not ShardedDataset.stage_ranges

    def stage_ranges(self, shard: int) -> list[Range] | None:
        """The byte ranges to stage for ``shard`` ahead of its reads, each cached as an
        entry of its own (``CachedStore.read_range``), where a reader fetches only parts of
        the shard's objects (a Parquet row group of a file); None: stage the shard's
        objects whole."""
        return None

    def assemble(
        self, index: int, parts: Sequence[bytes | memoryview], *, copy: bool = True
    ) -> Any:
        """Sample ``index`` from the bytes of its ``sample_ranges`` (the same value
        ``dataset[index]`` returns). ``copy=False`` may return views of ``parts`` (valid as
        long as they are: the loader decodes them before reusing its buffer) instead of
        copying each sample's bytes, ~100 KB under the GIL for a photo."""
        raise NotImplementedError(f"{type(self).__name__} has no byte ranges to assemble")

    # --- what the loader's decoder asks of a sample (a format that holds images says) ------

    @property
    def decodable(self) -> bool:
        """Whether samples carry an encoded image that ``fl.DataLoader(decode=...)`` decodes
        (then :meth:`image_and_label` finds it)."""
        return False

    def image_and_label(self, sample: Any, index: int) -> tuple[Any, Any]:
        """(encoded image, label or None) of sample ``index``, as ``dataset[index]`` gave it.
        The image is None where the sample has none (a null cell): :meth:`no_image` says
        why, and the loader raises or skips it as it does a bad image."""
        return sample, None

    def describe(self, index: int) -> str:
        """Sample ``index`` as errors name it (its file, its tar member, ...)."""
        return f"{self.store.url}[{index}]"

    def no_image(self, index: int) -> str:
        """Why sample ``index``, whose :meth:`image_and_label` gave no image, cannot be
        decoded."""
        return f"sample {index} ({self.describe(index)}) has no image"

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        data = self.store.read(key, offset, length)
        if len(data) != length:
            raise DatasetError(
                f"{self.store.object_url(key)}: read {len(data)} bytes at offset {offset}, "
                f"expected {length}; the object changed since the dataset was opened: open "
                "it again with refresh=True"
            )
        return data

    def warm(self, shards: Sequence[int] | None = None) -> None:
        """Stages the given shards (all by default) into the cache now, in that order, as
        :meth:`to_stage` says: whole objects, or byte ranges of them."""
        order = range(len(self.shard_keys)) if shards is None else shards
        keys, ranges = self.to_stage(order)
        results = self.store.stage(keys)
        failed = [r for r in results if r.outcome == "failed"]
        if failed:
            raise self.store.stager.failure(self.store.object(keys[0]), failed[0])
        for r in self.store.stage_ranges(ranges):
            if r.error is not None:
                raise r.error

    def to_stage(self, shards: Iterable[int]) -> tuple[list[str], list[Range]]:
        """What staging ``shards`` fetches, first needed first: the objects to stage whole,
        and the byte ranges to stage as entries of their own (shards whose
        :meth:`stage_ranges` gives ranges). An object whose ranges here come to half its
        size or more is staged whole instead: one request, for little more."""
        keys: dict[str, None] = {}
        ranges: dict[Range, None] = {}
        for shard in shards:
            spans = self.stage_ranges(int(shard))
            if spans is None:
                keys.update(dict.fromkeys(self.shard_keys[shard]))
            else:
                ranges.update(dict.fromkeys(spans))
        if not ranges:
            return list(keys), []
        ranged_keys = list(dict.fromkeys(key for key, _, _ in ranges))
        sizes = {o.key: o.size for o in self.store.objects(ranged_keys)}
        whole, left = planner.whole_or_ranges(ranges, sizes)
        keys.update(dict.fromkeys(whole))
        return list(keys), left

    def close(self) -> None:
        """Closes the cache handle; the dataset re-opens it if used again."""
        self.store.close()

    def __enter__(self) -> ShardedDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.store.url!r}, {len(self)} samples in "
            f"{len(self.shard_sizes)} shards)"
        )
