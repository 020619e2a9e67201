"""A batch of whole-object samples (a folder's images) read as columns: their objects,
sizes and labels from the dataset's arrays (``ShardedDataset.sample_spans``), where the
cache holds them from one index query (``Cache.placed``), one native read, their checksums
in one native call, and a view per sample. No Python call per sample: every sample of a
training step's batch otherwise cost ~27 µs of the GIL in the general path (its ranges, a
``Location`` and a check each, ``assemble``, ``image_and_label``).

It takes only batches whose objects are all cached as listed; anything else (a miss, a
read that failed, a checksum that did not match) returns None and the general path of
``BatchBuilder`` does the batch (it stages, holds, falls back and raises as it always has).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from fastload.datasets.base import ShardedDataset
from fastload.errors import FastloadError
from fastload.loader.stats import LoaderStats
from fastload.reader import xxh3_spans

if TYPE_CHECKING:
    from fastload.loader.batches import _ReadContext


class Columns(NamedTuple):
    """A batch as the decoder takes it: each sample's encoded image, and its label."""

    encoded: list[memoryview]
    labels: list[Any]  # class indices, or None each for a folder without classes


def reads_columns(dataset: ShardedDataset) -> bool:
    """Whether the dataset's batches can be read as columns (its format says)."""
    return type(dataset).sample_spans is not ShardedDataset.sample_spans


class ColumnarRead:
    """``read(indices, context)`` → :class:`Columns`, or None: the general path then."""

    def __init__(
        self,
        dataset: ShardedDataset,
        stats: LoaderStats,
        note_needed: Callable[[list[str]], None],
    ) -> None:
        self.dataset = dataset
        self.stats = stats
        self.note_needed = note_needed  # counts each object a pass reads once

    def read(self, indices: list[int], context: _ReadContext) -> Columns | None:
        ds = self.dataset
        spans = ds.sample_spans(np.asarray(indices, dtype=np.int64))
        if spans is None:
            return None
        store = ds.store
        manifest = store.manifest
        urls = manifest.urls_of(spans.keys)
        sizes = spans.sizes
        placed = store.cache.placed(urls, manifest.versions_at(spans.objects), sizes.tolist())
        if not placed.found.all():
            return None  # missing (cold) or stale: staged and read by the general path
        self.note_needed(spans.keys)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        total = int(ends[-1]) if len(ends) else 0
        buffer = context.buffer_of(total)
        handoffs = 2  # the index query, the read
        try:
            context.reader.read_spans(
                placed.files, buffer, placed.file_ids, placed.offsets, sizes, starts, exact=True
            )
        except (OSError, FastloadError):
            # Evicted between lookup and read, or cut short: the general path copes.
            self.stats.count("native_read_fallbacks")
            self.stats.count("gil_handoffs", handoffs)
            return None
        self.stats.count("bytes_read", total)
        checked = placed.has_checksum & store.cache.read_checks.enabled
        if checked.any():
            handoffs += 1
            spans_checked = np.stack([starts[checked], sizes[checked]], axis=1)
            sums = xxh3_spans(buffer, spans_checked)
            wrong = np.flatnonzero(checked)[sums != placed.checksums[checked]]
            if len(wrong):
                self._drop_corrupt([urls[i] for i in wrong.tolist()])
                self.stats.count("gil_handoffs", handoffs)
                return None  # the general path reads them through the cache, which fetches
        self.stats.count("gil_handoffs", handoffs)
        self.stats.count("column_reads")  # batches read this way
        view = memoryview(buffer)
        encoded = [view[a:b] for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        labels = [None] * len(indices) if spans.labels is None else spans.labels.tolist()
        return Columns(encoded, labels)

    def _drop_corrupt(self, urls: list[str]) -> None:
        """Drops entries whose bytes failed their checksums (fetched again), counting them."""
        cache = self.dataset.store.cache
        for url in urls:
            cache.drop_corrupt(url)
        self.stats.count("corrupt_entries", len(urls))
