"""Builds the batches of a fastload dataset: stage → native read → decode → collate.

Samples whose bytes are plain ranges of cached objects (file folders, tar shards) are read
many at a time by the native reader into a page-aligned buffer of the calling thread;
samples of objects the cache turned away are cut from the bytes staging fetched ahead into
memory (the store's holding area); the rest (Zarr rows, samples whose object is neither)
go through ``dataset[index]``, which reads through the cache and fetches what is missing.
With ``decode``, an image dataset's batch is ``(images, labels)`` (``images`` alone for a
folder without classes).
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import numpy as np
import torch
from torch.utils.data import default_collate

from fastload.cache import Location
from fastload.datasets.base import Range, ShardedDataset
from fastload.decode import DecodedBatch, DecodeError, Decoder
from fastload.errors import CacheCorruptError, FastloadError, RemoteChangedError
from fastload.loader.cache_plan import CachePlan
from fastload.loader.columnar_read import ColumnarRead, reads_columns
from fastload.loader.entry_checks import EntryChecks
from fastload.loader.staging_ahead import StagingAhead
from fastload.loader.stats import LoaderStats
from fastload.reader import BatchReader, aligned_empty
from fastload.sampler import ShardedSampler
from fastload.staging.range_pool import range_pool

# Batches whose objects a batch reading them again does not count again (hits and misses
# are per object read, not per sample: a tar shard read on by the next batch is one read).
_NEEDED_BATCHES = 2


def decodable(dataset: object) -> bool:
    """Whether ``decode=`` applies: a fastload dataset whose samples carry encoded images."""
    return isinstance(dataset, ShardedDataset) and dataset.decodable


def _noted(error: BaseException, stage: str) -> BaseException:
    error._fastload_stage = stage  # type: ignore[attr-defined]
    return error


class _ReadContext:
    """A native reader and its page-aligned buffer, lent to one batch at a time: kept across
    epochs (a loader's threads are not), so buffers are not reallocated each pass."""

    def __init__(self) -> None:
        self.reader = BatchReader(num_threads=2)
        self.buffer: Any = None

    def buffer_of(self, nbytes: int) -> Any:
        if self.buffer is None or self.buffer.nbytes < nbytes:
            self.buffer = aligned_empty(max(nbytes, 1 << 20) * 5 // 4)
        return self.buffer


class BatchBuilder:
    """``load(indices, epoch)`` → one batch; ``stage(batches)`` fetches their shards ahead
    (:mod:`fastload.loader.staging_ahead`)."""

    def __init__(
        self,
        dataset: ShardedDataset,
        *,
        collate_fn: Callable[[Any], Any],  # torch's resolved one: default_collate if not given
        batched: bool,
        decoder: Decoder | None,
        stats: LoaderStats,
        on_device: Callable[[Any], Any] | None = None,
        cuda_device: torch.device | None = None,
        on_change: str = "raise",
    ) -> None:
        self.dataset = dataset
        self.on_change = on_change
        self._changed: set[str] = set()  # URLs of objects found changed on the remote
        self._changed_lock = threading.Lock()
        self.collate_fn = collate_fn
        self.default_collate = collate_fn is default_collate
        self.batched = batched
        self.decoder = decoder
        self.stats = stats
        self.on_device = on_device
        # Decoding on a GPU: each loading thread queues its device work on a stream of its
        # own, not on the default stream the training step uses (there it waited behind the
        # step, and a pageable copy there waited for the step to finish); the ring orders
        # the batch before the consumer's use of it.
        self.cuda_device = cuda_device
        self._streams = threading.local()
        self._contexts: list[_ReadContext] = []  # idle ones
        self._contexts_lock = threading.Lock()
        self.ahead = StagingAhead(dataset, stats)
        self.cache_plan = CachePlan(dataset)  # a plan cache's future (cache_plan.py)
        # Objects (or ranges) this pass read lately, oldest first (see _note_needed).
        self._needed: OrderedDict[str | Range, None] = OrderedDict()
        self._needed_lock = threading.Lock()
        # Whether what the cache turns away is fetched ahead into memory: batches are then
        # read after their staging round, which counts the reads each object is held for
        # (a batch read before would have it fetched twice).
        self.holds = dataset.store.holds_turned_away
        # A decoded batch of whole-file samples, all cached: read as columns, no Python
        # call per sample (columnar_read.py); anything else goes through _read.
        self._columnar = (
            ColumnarRead(dataset, stats, self._note_keys)
            if decoder is not None and reads_columns(dataset) and not dataset.stages_by_range
            else None
        )

    def stage(self, batches: Sequence[Any]) -> None:
        """Fetches the shards of batches ahead of their reads (:class:`StagingAhead`)."""
        self.ahead.stage(batches, self.batched, self.cache_plan.read_already)

    def load(self, item: Any, epoch: int) -> Any:
        indices = [int(i) for i in item] if self.batched else [int(item)]
        with self._contexts_lock:
            context = self._contexts.pop() if self._contexts else None
        if context is None:
            context = _ReadContext()
        try:
            if self.cuda_device is None:
                return self._load(indices, epoch, context)
            with torch.cuda.device(self.cuda_device), torch.cuda.stream(self._stream()):
                return self._load(indices, epoch, context)
        finally:
            with self._contexts_lock:
                self._contexts.append(context)

    def _load(self, indices: list[int], epoch: int, context: _ReadContext) -> Any:
        with self.stats.timed("read", len(indices)):
            try:
                columns = None if self._columnar is None else self._columnar.read(indices, context)
                if columns is None:
                    indices, samples = self._read_unchanged(indices, context)
            except BaseException as e:
                raise _noted(e, "read") from None
        if self.cache_plan.active:
            self.cache_plan.reached([self.dataset.shard_of(i) for i in indices])
        if self.decoder is not None:
            start = time.perf_counter()
            self.stats.count("gil_handoffs")  # the decoder's native call
            try:
                encoded, labels = columns or self._split(indices, samples)
                batch = self._decode(indices, encoded, labels, epoch)
            except BaseException as e:
                raise _noted(e, "decode") from None
            self.stats.add("decode", time.perf_counter() - start, len(indices))
        else:
            with self.stats.timed("collate"):
                try:
                    batch = self.collate_fn(samples if self.batched else samples[0])
                except BaseException as e:
                    raise _noted(e, "collate") from None
        self.stats.count("samples", len(indices))
        self.stats.count("batches")
        if self.on_device is not None:
            with self.stats.timed("transfer"):
                try:
                    batch = self.on_device(batch)
                except BaseException as e:
                    raise _noted(e, "transfer") from None
        return batch

    def _stream(self) -> Any:
        """This thread's CUDA stream for loading."""
        stream = getattr(self._streams, "stream", None)
        if stream is None:
            cuda: Any = torch.cuda  # its Stream constructor is untyped
            stream = self._streams.stream = cuda.Stream(device=self.cuda_device)
        return stream

    def new_pass(self, sampler: ShardedSampler | None = None) -> None:
        """A pass starts (from ``sampler``'s resume point, where the loader has one)."""
        with self._needed_lock:
            self._needed.clear()
        self.cache_plan.start_pass(sampler)

    def _note_keys(self, keys: list[str]) -> None:
        """:meth:`_note_needed` of shards of one object each, by key."""
        self._count_needed([keys])

    def _note_needed(self, shards: Iterable[int]) -> None:
        """Counts each object a batch reads (each range, for shards staged as ranges) once,
        and not again while it stays among the objects of the pass's last ``_NEEDED_BATCHES``
        batches (the next batch reading on in a tar shard): hits are these minus what was
        fetched. An object read again later counts again (a pass over several orders, as
        the doctor's budget phase is, read it from the cache or fetched it again)."""
        needed: list[Sequence[str | Range]] = []
        for shard in shards:
            spans = self.ahead.ranges_of(shard)
            needed.append(self.dataset.shard_keys[shard] if spans is None else spans)
        self._count_needed(needed)

    def _count_needed(self, needed: Sequence[Sequence[str | Range]]) -> None:
        with self._needed_lock:
            recent, new, batch = self._needed, 0, sum(map(len, needed))
            for keys in needed:
                for key in keys:
                    if key in recent:
                        recent.move_to_end(key)
                    else:
                        recent[key] = None
                        new += 1
            while len(recent) > _NEEDED_BATCHES * batch:
                recent.popitem(last=False)
            self.stats.count("objects_needed", new)

    def _read_unchanged(
        self, indices: list[int], context: _ReadContext
    ) -> tuple[list[int], list[Any]]:
        """(indices, samples) of a batch. With ``on_change="skip"`` the samples of objects
        changed on the remote since the listing are left out, their places in the batch
        going to good samples of it (indices too, so a label stays with its sample), as a
        bad image's do with ``on_error="skip"``; each such object is counted once in
        ``stats()["counts"]["changed_objects"]``."""
        try:
            return indices, self._read(indices, context)
        except Exception as exc:
            if self.on_change == "raise" or not self.batched or _changed_error(exc) is None:
                raise
        kept: list[tuple[int, Any]] = []
        reasons: list[str] = []
        for index in indices:
            try:
                kept.append((index, self._read([index], context)[0]))
            except Exception as exc:
                changed = _changed_error(exc)
                if changed is None:
                    raise
                self._note_changed(changed)
                reasons.append(f"{self.dataset.describe(index)}: {changed.reason}")
        self.stats.skipped(reasons)
        if not kept:
            raise RemoteChangedError(
                errno.ESTALE,
                f"every sample of a batch is of an object changed on the remote since the "
                f"listing (samples {indices[:8]}...), so on_change='skip' has nothing to fill "
                f"it with; the first: {reasons[0]}. Open the dataset again with refresh=True",
            )
        spare = itertools.cycle(kept)
        filled = kept + [next(spare) for _ in range(len(indices) - len(kept))]
        return [i for i, _ in filled], [sample for _, sample in filled]

    def _note_changed(self, error: RemoteChangedError) -> None:
        url = str(error.filename)
        with self._changed_lock:
            if url in self._changed:
                return
            self._changed.add(url)
        self.stats.count("changed_objects")

    def _located(self, key: str) -> Location | None:
        return self.dataset.store.local_path(key)

    def _read(self, indices: list[int], context: _ReadContext) -> list[Any]:
        """Each sample, as ``dataset[index]`` gives it: natively read where its objects are
        cached, cut from memory where staging held them, through the cache (which fetches)
        otherwise."""
        ds = self.dataset
        store = ds.store
        ranges: list[list[Range] | None] = [ds.sample_ranges(i) for i in indices]
        shards = [ds.shard_of(i) for i in indices]
        reads: dict[str, int] = {}  # samples of this batch reading each object
        shard_samples: dict[str, int] = {}  # samples of the shard of each object
        for rs, shard in zip(ranges, shards, strict=True):
            for key in {key for key, _, _ in rs or ()}:
                if key not in reads:
                    shard_samples[key] = ds.shard_sizes[shard]
                reads[key] = reads.get(key, 0) + 1
        # One index query for the batch (each query releases and retakes the GIL).
        located = store.local_paths(list(reads))
        handoffs = 1  # calls of this batch's read that release the GIL and take it back
        paths: dict[str, Location | None] = dict(zip(reads, located, strict=True))
        self._note_needed(shards)
        if not self.holds and any(rs is None for rs in ranges):
            self.ahead.stage_own([s for rs, s in zip(ranges, shards, strict=True) if rs is None])
        held: dict[str, memoryview] = {}
        missing = [
            key for key, path in paths.items() if path is None and not self._take(key, reads, held)
        ]
        by_range = self.ahead.by_range(missing, reads, shard_samples)
        missing = [key for key in missing if key not in by_range]
        if missing:  # not staged ahead (yet): fetch this batch's objects together, here
            wanted = {key: reads[key] for key in missing}  # (not behind a round staging ahead)
            held_reads = self.ahead.hold_reads(wanted, shard_samples)
            self.ahead.record(store.stage(missing, held_reads, here=True))
            handoffs += 1 + len(missing)  # the round, then a lookup each
            for key in missing:
                paths[key] = self._located(key)
                if paths[key] is None:
                    self._take(key, reads, held)
        native = [rs is not None and all(paths[k] is not None for k, _, _ in rs) for rs in ranges]
        in_memory = [rs is not None and all(k in held for k, _, _ in rs) for rs in ranges]
        ranged = [
            rs is not None
            and not native[i]
            and not in_memory[i]
            and all(k in by_range for k, _, _ in rs)
            for i, rs in enumerate(ranges)
        ]
        fetched = self._read_ranges(ranges, ranged) if any(ranged) else {}
        handoffs += len(fetched)
        parts: list[list[memoryview] | None] = [None] * len(indices)
        if any(native):
            handoffs += 1
            try:
                parts = self._read_native(ranges, native, paths, context)
            except (OSError, FastloadError):
                # Evicted between lookup and read, or changed: the cache path copes.
                self.stats.count("native_read_fallbacks")
                native = [False] * len(indices)
                parts = [None] * len(indices)
        samples: list[Any] = []
        copy = self.decoder is None  # the decoder reads views before the buffer is reused
        for i, index in enumerate(indices):
            if native[i]:
                samples.append(ds.assemble(index, parts[i] or [], copy=copy))
            elif ranged[i]:
                self.stats.count("range_reads")
                rs = ranges[i] or []
                samples.append(ds.assemble(index, [fetched[r] for r in rs], copy=copy))
            elif in_memory[i]:
                self.stats.count("held_reads")
                rs = ranges[i] or []
                parts_i = [held[k][o : o + n] for k, o, n in rs]
                samples.append(ds.assemble(index, parts_i, copy=copy))
            else:
                self.stats.count("cache_reads")
                handoffs += 1
                samples.append(ds[index])
        self.stats.count("gil_handoffs", handoffs)
        return samples

    def _read_ranges(
        self, ranges: list[list[Range] | None], ranged: list[bool]
    ) -> dict[Range, bytes]:
        """The bytes of the ranged samples' ranges, fetched concurrently."""
        wanted = list(
            dict.fromkeys(r for rs, ok in zip(ranges, ranged, strict=True) if ok for r in rs or ())
        )
        store = self.dataset.store
        data = range_pool().map(lambda r: store.read_range(*r), wanted)
        return dict(zip(wanted, data, strict=True))

    def _take(self, key: str, reads: dict[str, int], held: dict[str, memoryview]) -> bool:
        """Takes key's bytes from the store's holding area for this batch's reads of it."""
        data = self.dataset.store.held(key, reads[key])
        if data is not None:
            held[key] = data
        return data is not None

    def _read_native(
        self,
        ranges: list[list[Range] | None],
        native: list[bool],
        paths: dict[str, Location | None],
        context: _ReadContext,
    ) -> list[list[memoryview] | None]:
        # The batch's reads as columns (one native call, no Python object per request).
        files: dict[str, int] = {}
        file_ids: list[int] = []
        offsets: list[int] = []
        lengths: list[int] = []
        first: list[int] = []  # each sample's first request (-1: not read natively)
        checks = EntryChecks(enabled=self.dataset.store.cache.read_checks.enabled)
        at = 0  # where each read lands in the batch's buffer
        for rs, ok in zip(ranges, native, strict=True):
            if not ok or rs is None:
                first.append(-1)
                continue
            first.append(len(lengths))
            for key, offset, length in rs:
                found = paths[key]
                assert found is not None  # native only where every object is located
                file_ids.append(files.setdefault(found.path, len(files)))
                offsets.append(found.offset + offset)
                lengths.append(length)
                checks.add(key, found, offset, length, at)
                at += length
        sizes = np.array(lengths, dtype=np.int64)
        ends = np.cumsum(sizes)
        total = int(ends[-1]) if len(ends) else 0
        buffer = context.buffer_of(total)
        starts = ends - sizes
        context.reader.read_spans(
            list(files),
            buffer,
            np.array(file_ids, dtype=np.int64),
            np.array(offsets, dtype=np.int64),
            sizes,
            starts,
            exact=True,
        )
        self.stats.count("bytes_read", total)
        if checks.hashes:
            self.stats.count("gil_handoffs")  # the checksums' native call
        self._check(checks, paths, buffer)
        view = memoryview(buffer)
        at, to = starts.tolist(), ends.tolist()
        parts: list[list[memoryview] | None] = []
        for rs, i in zip(ranges, first, strict=True):
            count = len(rs or ())
            parts.append(None if i < 0 else [view[at[j] : to[j]] for j in range(i, i + count)])
        return parts

    def _check(self, checks: EntryChecks, paths: dict[str, Location | None], buffer: Any) -> None:
        """Raises CacheCorruptError (the batch is then read through the cache, which fetches
        again) where an entry read does not match its checksum, dropping it first."""
        store = self.dataset.store
        bad = checks.failed(buffer, store.cache.read_checks, paths)
        if not bad:
            return
        for key in bad:
            store.cache.drop_corrupt(store.object_url(key))
        self.stats.count("corrupt_entries", len(bad))
        raise CacheCorruptError(
            errno.EIO, f"cached copies of {sorted(bad)[:3]} failed their checksums"
        )

    # --- decode ------------------------------------------------------------------------------

    def _split(self, indices: list[int], samples: list[Any]) -> tuple[list[Any], list[Any]]:
        """(encoded images, labels) of a batch's samples."""
        split = self.dataset.image_and_label
        pairs = [split(s, i) for s, i in zip(samples, indices, strict=True)]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def _decode(self, indices: list[int], encoded: list[Any], labels: list[Any], epoch: int) -> Any:
        assert self.decoder is not None
        unlabelled: set[int] = set()
        if any(label is None for label in labels) and any(label is not None for label in labels):
            # A null label among labelled samples (a null Parquet cell): torch could not
            # collate it; it is a bad sample, raised or skipped as one without an image.
            unlabelled = {pos for pos, label in enumerate(labels) if label is None}
            encoded = [None if pos in unlabelled else e for pos, e in enumerate(encoded)]
        decoded = self._decode_present(encoded, indices, epoch, unlabelled)
        images, kept = decoded.images, decoded.kept
        if decoded.skipped:
            self.stats.skipped([reason for _, reason in decoded.skipped])
            if not kept:
                raise DecodeError(
                    f"every sample of a batch failed to decode (samples {indices[:8]}...), so "
                    f"on_error='skip' has nothing to fill it with; the first: "
                    f"{decoded.skipped[0][1]}. Check those files (fastload cache verify "
                    "repairs damaged cached copies)"
                )
            # Full-sized batches: the places of bad samples go to good ones of the batch.
            row = {pos: r for r, pos in enumerate(kept)}
            spare = itertools.cycle(range(len(kept)))
            order = [row[pos] if pos in row else next(spare) for pos in range(len(indices))]
            if isinstance(images, torch.Tensor):
                images = images[order]
            else:
                images = [images[r] for r in order]
            labels = [labels[kept[r]] for r in order]
        has_labels = any(label is not None for label in labels)
        if not self.batched:
            image = images[0]
            return (image, labels[0]) if has_labels else image
        if not self.default_collate:
            per_sample = list(images.unbind(0)) if isinstance(images, torch.Tensor) else images
            items = list(zip(per_sample, labels, strict=True)) if has_labels else per_sample
            return self.collate_fn(items)
        if not has_labels:
            return images
        return images, default_collate(labels)

    def _no_label(self, index: int) -> str:
        return _no_label_reason(self.dataset.describe, index)

    def _decode_present(
        self, encoded: list[Any], indices: list[int], epoch: int, unlabelled: set[int]
    ) -> DecodedBatch:
        """The decoder's batch of the samples that have an image; those without one (a null
        Parquet cell) or without a label (``unlabelled`` positions) raise, or with
        ``on_error="skip"`` are skipped as a bad image is."""
        assert self.decoder is not None
        if not any(image is None for image in encoded):  # the common case
            names = _SampleNames(self.dataset.describe, indices)  # made only for an error
            return self.decoder.decode(encoded, indices=indices, epoch=epoch, names=names)
        present = [pos for pos, image in enumerate(encoded) if image is not None]
        missing = [
            (pos, self._no_label(i) if pos in unlabelled else self.dataset.no_image(i))
            for pos, i in enumerate(indices)
            if encoded[pos] is None
        ]
        if self.decoder.config.on_error == "raise":
            raise DecodeError(f"{missing[0][1]}; pass on_error='skip' to leave such samples out")
        if not present:
            return DecodedBatch([], [], missing)
        subset = [indices[pos] for pos in present]
        decoded = self.decoder.decode(
            [encoded[pos] for pos in present],
            indices=subset,
            epoch=epoch,
            names=_SampleNames(self.dataset.describe, subset),
        )
        skipped = missing + [(present[pos], why) for pos, why in decoded.skipped]
        return DecodedBatch(decoded.images, [present[k] for k in decoded.kept], skipped)


def _changed_error(exc: BaseException) -> RemoteChangedError | None:
    """The RemoteChangedError exc is, or was raised from (a staging thread's, re-raised)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, RemoteChangedError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _no_label_reason(describe: Callable[[int], str], index: int) -> str:
    return f"sample {index} ({describe(index)}) has no label (it is null) where others have one"


class _SampleNames(Sequence[str]):
    """The names (URL or key) of a batch's samples, each made when an error asks for it:
    a batch that decodes cleanly formats none."""

    def __init__(self, name: Callable[[int], str], indices: list[int]) -> None:
        self._name, self._indices = name, indices

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._name(k) for k in self._indices[i]]
        return self._name(self._indices[i])
