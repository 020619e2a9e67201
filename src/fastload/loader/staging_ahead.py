"""Staging ahead: a loader's batches' shards fetched into the cache before their reads,
whole or by byte range as the planner (:mod:`fastload.staging.planner`) says, and what a
batch must have now staged for it here (``stage_own``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastload.datasets.base import Range, ShardedDataset
from fastload.loader.lookahead import LOOKAHEAD_BUDGET_SHARE
from fastload.loader.stats import LoaderStats
from fastload.staging import StageResult, planner
from fastload.staging.range_pool import range_pool

_REPEAT_FILTER = 65536  # staged keys (and ranges) remembered, where nothing is evicted


def repeat_filter_size(dataset: ShardedDataset) -> int:
    """How many staged keys the repeat filter trusts to be cached still. Under a budget that
    evicts (``lru``, ``plan``) an object staged long ago may be gone: skipping it would leave
    it to a synchronous fetch by its batch (an epoch after the first staged nothing ahead),
    so only as many are kept as the look-ahead's share of the budget holds."""
    config = dataset.store.config
    if config.max_bytes is None or config.policy == "pin":
        return _REPEAT_FILTER
    manifest = dataset.store.manifest
    mean_bytes = max(1, manifest.total_bytes // max(1, len(manifest)))
    kept = int(config.max_bytes * LOOKAHEAD_BUDGET_SHARE) // mean_bytes
    return max(0, min(_REPEAT_FILTER, kept))


class StagingAhead:
    """One loader's staging of a dataset; remembers what it staged (a bounded repeat
    filter) and which ranges its threads are fetching now."""

    def __init__(self, dataset: ShardedDataset, stats: LoaderStats) -> None:
        self.dataset = dataset
        self.stats = stats
        self._staged: dict[str, None] = {}  # recently staged keys (insertion-ordered, bounded)
        self._staged_ranges: dict[Range, None] = {}  # and ranges (the same, for stage_ranges)
        self._remembered = repeat_filter_size(dataset)
        # Whether the dataset stages some shards as byte ranges (its stage_ranges hook), and
        # those ranges by shard (None: the shard's objects are staged whole).
        self._ranged = dataset.stages_by_range
        self._ranges_of: dict[int, list[Range] | None] = {}
        self._fetching: dict[Range, threading.Event] = {}  # ranges being staged: set when done
        self._fetching_lock = threading.Lock()

    def stage(
        self,
        batches: Sequence[Any],
        batched: bool,
        read_already: Callable[[list[str]], set[str]] | None = None,
    ) -> None:
        """Stages the shards of batches (of sample indices, or single indices where not
        ``batched``) that are not staged yet: their objects whole (held in memory where
        the cache turns them away and the planner says so), or their byte ranges.
        ``read_already``: which objects the loading threads have read already (staging
        ahead fell behind them), left out."""
        ds = self.dataset
        indices = (index for batch in batches for index in (batch if batched else [batch]))
        reads, samples = self._ranges_staged(
            (ds.shard_of(int(index)) for index in indices), skip_staged=True
        )
        for key in read_already(list(reads)) if read_already is not None else ():
            del reads[key], samples[key]
        if not reads:
            return
        results = ds.store.stage(list(reads), self.hold_reads(reads, samples))
        for key, result in zip(reads, results, strict=True):
            if result.outcome != "held":  # a held one is staged again for its later reads
                self._staged[key] = None
        while len(self._staged) > self._remembered:  # forget the oldest: only a repeat filter
            del self._staged[next(iter(self._staged))]
        self.record(results)

    def _ranges_staged(
        self, shards: Iterable[int], *, skip_staged: bool
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Stages the byte ranges of those of shards read by range (one per sample read);
        for the others, the samples reading each object and the samples of its shard
        (``skip_staged``: leaving out objects staged recently)."""
        ds = self.dataset
        reads: dict[str, int] = {}
        samples: dict[str, int] = {}
        ranges: dict[Range, None] = {}
        for shard in shards:
            spans = self.ranges_of(shard)
            if spans is not None:
                ranges.update((r, None) for r in spans if r not in self._staged_ranges)
                continue
            for key in ds.shard_keys[shard]:
                if not (skip_staged and key in self._staged):
                    reads[key] = reads.get(key, 0) + 1
                    samples[key] = ds.shard_sizes[shard]
        if ranges:
            self.stage_by_range(list(ranges))
        return reads, samples

    def ranges_of(self, shard: int) -> list[Range] | None:
        """The dataset's ``stage_ranges(shard)``, asked once per shard."""
        if not self._ranged:
            return None
        try:
            return self._ranges_of[shard]
        except KeyError:
            pass
        spans = self.dataset.stage_ranges(shard)
        if len(self._ranges_of) > 65536:
            self._ranges_of.clear()
        self._ranges_of[shard] = spans
        return spans

    def stage_by_range(self, ranges: list[Range]) -> None:
        """Fetches ranges into the cache as range entries, concurrently on the range
        threads. What the cache holds already (the range, or its whole object) is not read;
        what another thread of this loader is staging now is waited for, not fetched again
        (the batch's own reads after this must not take the fetch from that thread, which
        counts it); the rest counts as fetched."""
        store = self.dataset.store
        keys = list(dict.fromkeys(key for key, _, _ in ranges))
        whole = dict(zip(keys, store.local_paths(keys), strict=True))
        todo = [r for r in ranges if whole[r[0]] is None]
        for r in ranges:
            if whole[r[0]] is not None:
                self._staged_ranges[r] = None

        def fetch(r: Range) -> tuple[Range, int | BaseException]:
            with self._fetching_lock:
                elsewhere = self._fetching.get(r)
                if elsewhere is None:
                    done = self._fetching[r] = threading.Event()
            if elsewhere is not None:
                elsewhere.wait()  # that fetch's own timeouts and retries bound it
                return r, 0
            try:
                return r, store.stage_range(*r)
            except Exception as e:  # the reader meets it again, and raises it at its batch
                return r, e
            finally:
                with self._fetching_lock:
                    del self._fetching[r]
                done.set()

        for r, got in range_pool().map(fetch, todo):
            if isinstance(got, BaseException):
                self.stats.count("stage_failed")
                continue
            self._staged_ranges[r] = None
            if got:
                self.stats.count("cache_misses")
                self.stats.count("bytes_fetched", got)
        while (
            len(self._staged_ranges) > self._remembered
        ):  # forget the oldest: only a repeat filter
            del self._staged_ranges[next(iter(self._staged_ranges))]

    def hold_reads(self, reads: dict[str, int], samples: dict[str, int]) -> list[int]:
        """The reads to stage each object with (:func:`~fastload.staging.planner.hold_reads`);
        an object not fetched into memory still has its reads counted, so a copy held for
        other batches serves them."""
        holding = self.dataset.store.holding
        held = planner.hold_reads(reads, samples)
        for key, n in held.items():
            if not n:
                holding.expect(key, reads[key])
        return list(held.values())

    def record(self, results: Sequence[StageResult]) -> None:
        # "cached" is not counted: it may mean another thread of this loader just fetched it.
        for r in results:
            if r.outcome == "cached" or (r.outcome == "held" and not r.attempts):
                continue  # nothing fetched (held without attempts: held already)
            if r.outcome in ("fetched", "held"):
                self.stats.count("cache_misses")
                self.stats.count("bytes_fetched", r.nbytes)
            if r.outcome != "fetched":
                self.stats.count(f"stage_{r.outcome}")

    # --- one batch ---------------------------------------------------------------------------

    def stage_own(self, shards: list[int]) -> None:
        """Stages now, as staging ahead would, what the shards this batch reads through
        ``dataset[index]`` (Zarr, Parquet) need and the cache lacks, rather than let the
        reads race ahead of staging with reads of their own: a shard's ``stage_ranges``
        (fetched concurrently, and counted), else its objects whole (a sharded Zarr shard's
        index and inner chunks were fetched by range, then the shard whole). Large objects
        the batch reads little of (``_by_range``) are left to the dataset's reads. (With
        ``holds``, batches are read after their staging round: no race.)"""
        reads, samples = self._ranges_staged(shards, skip_staged=False)
        if not reads:
            return
        store = self.dataset.store
        located = store.local_paths(list(reads))
        missing = [key for key, at in zip(reads, located, strict=True) if at is None]
        by_range = self.by_range(missing, reads, samples)
        wanted = [key for key in missing if key not in by_range]
        if wanted:  # here: this batch waits for them, not behind a staging round
            self.record(store.stager.stage(store.objects(wanted), here=True))

    def by_range(
        self, missing: list[str], reads: dict[str, int], shard_samples: dict[str, int]
    ) -> set[str]:
        """The missing objects this batch reads by byte range rather than waiting for them
        whole: large shards of which it needs a few samples (a 150 MB tar shard for one
        sample would hold the batch for seconds). Their ranges are cached as entries of
        their own; staging ahead still brings the shards whole for the batches after."""
        if not missing:
            return set()
        store = self.dataset.store
        objects = store.objects(missing)
        return {
            key
            for key, obj in zip(missing, objects, strict=True)
            if planner.read_by_range(obj.size, reads[key], shard_samples[key])
        }
