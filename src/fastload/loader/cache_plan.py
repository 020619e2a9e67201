"""The loader's plan for a ``plan`` cache: what this rank reads next, handed to the cache.

The ``plan`` policy evicts what is needed furthest ahead (``fastload.cache.eviction``),
which it can only do if the cache knows the future. The loader's sampler does: at the start
of each pass the cache gets, as a :class:`~fastload.cache.PlanHint`, the entries this rank
reads in the rest of this epoch and in the next one (so what the end of an epoch keeps is
what the next one reads first), and as each batch is read the hint moves past it. Without
a hint the cache orders as ``lru`` (``fastload warm`` gives it one of its own).

Only a loader sharded by fastload's plan (its own :class:`~fastload.ShardedSampler`) knows
its future; under a sampler of the user's the cache is left without a hint.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from fastload.cache import PlanHint, object_id
from fastload.datasets.base import ShardedDataset
from fastload.sampler import ShardedSampler
from fastload.warm import shard_entries

# Epochs the hint covers from the current one: this one and the next.
_EPOCHS_AHEAD = 2


class CachePlan:
    """Gives a dataset's ``plan`` cache the loader's future and moves it on as batches are
    read; does nothing for other policies."""

    def __init__(self, dataset: ShardedDataset) -> None:
        self.dataset = dataset
        cache = dataset.store.cache
        self.active = cache.config.policy == "plan" and cache.config.max_bytes is not None
        self._entries: dict[int, list[str]] = {}  # a shard's entries, as the plan names them
        self._read = np.zeros(0, dtype=bool)
        self._lock = threading.Lock()  # loading threads report their batches at once

    def start_pass(self, sampler: ShardedSampler | None) -> None:
        """Hands the cache the entries the pass about to start (from the sampler's resume
        point) and the next epoch read, in order; none without fastload's sampler."""
        if not self.active:
            return
        cache = self.dataset.store.cache
        if sampler is None:
            cache.plan = None
            return
        this = self._urls(sampler.future_shards().accesses().tolist())
        after = sampler.future_shards(epochs=[sampler.epoch + 1]).accesses().tolist()
        with self._lock:
            self._read = np.zeros(len(this), dtype=bool)  # which of this pass's entries were read
            cache.plan = PlanHint(this + self._urls(after), current=len(this))

    def reached(self, shards: Sequence[int]) -> None:
        """A batch of these shards was read: the plan moves past every entry read so far
        without a gap. Batches read out of order (several loading threads) leave the plan
        at the first entry not read yet: an earlier batch's objects, looked up and staged
        but not read, must not look needed only next epoch (eviction would pick them)."""
        plan = self.dataset.store.cache.plan
        if not self.active or plan is None:
            return
        with self._lock:
            for shard in dict.fromkeys(shards):
                for url in self._of(shard):
                    use = plan.next_use(object_id(url))
                    if use < plan.current:
                        self._read[int(use)] = True
            at = plan.position
            while at < plan.current and self._read[at]:
                at += 1
            plan.position = at

    def read_already(self, keys: list[str]) -> set[str]:
        """Those of keys (object keys) whose read in this pass is done: staging ahead that
        fell behind the loading threads must not fetch them again (``plan`` evicts an
        object once read, when it is needed only next epoch)."""
        plan = self.dataset.store.cache.plan
        if not self.active or plan is None:
            return set()
        store = self.dataset.store
        done = set()
        with self._lock:
            for key in keys:
                use = plan.next_use(object_id(store.object_url(key)))
                if use >= plan.current or self._read[int(use)]:
                    done.add(key)
        return done

    def _urls(self, shards: list[int]) -> list[str]:
        return [url for shard in shards for url in self._of(shard)]

    def _of(self, shard: int) -> list[str]:
        entries = self._entries.get(shard)
        if entries is None:
            if len(self._entries) > 1 << 20:  # bounded: a shard's entries are cheap to redo
                self._entries.clear()
            entries = self._entries[shard] = shard_entries(self.dataset, shard, set())
        return entries
