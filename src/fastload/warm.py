"""``fl.warm``: stage a dataset (or the part of it a node needs) into the local cache."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastload.cache import BudgetCounts, PlanHint, Policy, default_cache_dir, range_url
from fastload.errors import RemoteError
from fastload.manifest import install_snapshot
from fastload.plan import DEFAULT_WINDOW_SHARDS, ResumeState
from fastload.progress import Progress, ProgressBar
from fastload.remote import is_transient, public_url, scrub
from fastload.staging import FetchConfig, StageResult
from fastload.staging.planner import Range
from fastload.store import CachedStore, RangeResult

if TYPE_CHECKING:
    from fastload.datasets.base import ShardedDataset

# Batches per rank that ``warm --from-state`` stages by default: the job's first minutes on a
# replacement node, not the whole rest of the epoch (the loader prefetches that as it trains).
DEFAULT_STATE_BATCHES = 256


@dataclass(frozen=True, kw_only=True)
class NodeShare:
    """The ranks one node runs and the epochs to warm, with the plan settings of the job."""

    ranks: tuple[int, ...]
    world_size: int
    epochs: tuple[int, ...]
    format: str = "auto"
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    window_shards: int = DEFAULT_WINDOW_SHARDS
    # Where the first of ``epochs`` resumes (a loader's saved state): its rest, not all of it.
    resume: ResumeState | None = None
    # The first this many samples of each rank only (from the resume point), not the epochs'
    # whole: a replacement node warmed for its first batches, the loader prefetching the rest.
    samples: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.ranks or any(not 0 <= r < self.world_size for r in self.ranks):
            raise ValueError(f"ranks must be in [0, {self.world_size}), got {list(self.ranks)}")
        if not self.epochs or min(self.epochs) < 0:
            raise ValueError(f"epochs must be one or more epochs >= 0, got {list(self.epochs)}")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be >= 1 (or None: all), got {self.samples}")

    def staging(self, url: str, **open_options: Any) -> Staging:
        """What to stage for these ranks and epochs of the dataset at url (opened in
        ``format`` with open_options): see :meth:`staging_of`."""
        from fastload.datasets import open_dataset

        with open_dataset(url, format=self.format, **open_options) as dataset:
            return self.staging_of(dataset)

    def staging_of(self, dataset: ShardedDataset) -> Staging:
        """What to stage of dataset for these ranks and epochs (first needed first), and
        every cache entry they read, in order (for the ``plan`` policy)."""
        from fastload.plan import Plan

        plan = Plan(
            dataset.shard_sizes,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window_shards=self.window_shards,
        )
        future = plan.future(
            self.epochs,
            world_size=self.world_size,
            ranks=self.ranks,
            resume=self.resume,
            samples=self.samples,
        )
        keys, ranges = dataset.to_stage(future.first_needed)
        whole = set(keys)
        ranged = dataset.stages_by_range
        accesses: list[str] = []
        named: dict[int, list[str]] = {}  # a ranged shard's entries (it recurs by epoch)
        for shard in map(int, future.accesses()):
            entries = named.get(shard) or shard_entries(dataset, shard, whole)
            if ranged:
                named[shard] = entries
            accesses += entries
        return Staging(keys=keys, ranges=ranges, accesses=accesses)


def shard_entries(dataset: ShardedDataset, shard: int, whole: set[str]) -> list[str]:
    """The cache entries reading shard reads: its objects, or its byte ranges (their
    objects where those are staged whole)."""
    store = dataset.store
    spans = dataset.stage_ranges(shard)
    if spans is None:
        return [store.object_url(k) for k in dataset.shard_keys[shard]]
    names = (
        store.object_url(k) if k in whole else range_url(store.object_url(k), (o, n))
        for k, o, n in spans
    )
    return list(dict.fromkeys(names))


@dataclass(frozen=True, kw_only=True)
class Staging:
    """What a warm fetches, first needed first: objects whole, and byte ranges of others
    as cache entries of their own (a node's row groups of a Parquet file)."""

    keys: list[str]
    ranges: list[Range] = field(default_factory=list)
    accesses: list[str] | None = None  # cache entries in the order they are read


def dataset_staging(dataset: ShardedDataset) -> Staging:
    """What staging the whole dataset fetches, shard by shard."""
    keys, ranges = dataset.to_stage(range(len(dataset.shard_keys)))
    return Staging(keys=keys, ranges=ranges)


@dataclass(frozen=True, kw_only=True)
class WarmReport:
    """What a warm did; ``to_dict()`` is what ``fastload warm --json`` prints. ``objects``
    are staged whole, ``ranges`` as byte ranges of others; the counts after ``bytes`` count
    both."""

    url: str
    cache_dir: str
    objects: int
    bytes: int
    ranges: int = 0
    fetched: int = 0
    fetched_bytes: int = 0
    already_cached: int = 0
    skipped: int = 0  # turned away by the cache's budget
    failed: int = 0
    failures: list[dict[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def ok(self) -> bool:
        return self.failed == 0


def warm(
    url: str,
    *,
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    jobs: int | None = None,
    max_bytes: int | None = None,
    policy: Policy = "lru",
    keys: Sequence[str] | None = None,
    refresh: bool = False,
    ttl_s: float | None = None,
    dry_run: bool = False,
    progress: bool | Callable[[Progress], None] | None = None,
    fetch: FetchConfig | None = None,
    share: NodeShare | None = None,
    format: str | None = None,
    budget_counts: BudgetCounts = "disk",
) -> WarmReport:
    """Stages url's objects (or only ``keys``, in that order) into the cache.

    With ``share``, stages exactly the shards those ranks will read in those epochs, in the
    order they will read them (the dataset is opened with ``share.format`` to know its
    shards; the plan settings must match the training job's sampler). With the ``plan``
    policy the cache then also knows the future and evicts what is needed furthest ahead.
    With ``format`` (``"auto"`` detects it), the dataset is opened in that format first, so
    a URL that does not hold one fails before anything is staged, and only the objects the
    dataset reads are staged. Opening a tar dataset reads only its index where it has one
    (``fastload index``, or wids' ``shardindex.json``); without one it reads every shard
    through the cache, so a node's share then costs the whole dataset's download. A format
    read by byte range (Parquet: a shard is a row group) stages a share's parts of a file
    as range entries, or the file whole where they come to half of it or more
    (``ShardedDataset.to_stage``); the report counts those under ``ranges``.

    Resumable: objects already cached (same version) are not fetched again. A permanent
    failure (not found, access refused, full disk) raises; transient failures that outlast
    their retries are counted in the report's ``failed`` and listed in ``failures``.
    ``progress=None`` shows a bar when stderr is a terminal. ``max_bytes`` counts
    everything the cache puts on disk (``budget_counts="entries"``: the entries' bytes
    only, for tests and toys).
    """
    started = time.monotonic()
    if format is not None and (keys is not None or share is not None):
        raise ValueError("give one of keys, share and format (share has its own format)")
    if share is not None and keys is not None:
        raise ValueError("give keys or share, not both")
    config = fetch or (FetchConfig(jobs=jobs, min_jobs=min(2, jobs)) if jobs else FetchConfig())
    settings: dict[str, Any] = {
        "cache_dir": cache_dir,
        "storage_options": dict(storage_options or {}),
        "max_bytes": max_bytes,
        "policy": policy,
        "budget_counts": budget_counts,
        "refresh": refresh,
        "ttl_s": ttl_s,
        "fetch": config,
    }
    staging: Staging | None = None
    ranges: list[Range] = []
    opened_at = None
    # By default its staging process is not started at the listing, as a loader's is for a
    # file folder: a warm's one round starts it where it is used (not for what is cached).
    store = CachedStore.open(url, **settings)
    try:
        if format is not None or share is not None:
            # The dataset says what to stage; its store (one per warm) stages it.
            from fastload.datasets import open_on

            opened_at = time.time()  # what the open fetches (a tar shard without an index)
            dataset = open_on(store, format=share.format if share else str(format))
            staging = share.staging_of(dataset) if share else dataset_staging(dataset)
            keys, ranges = staging.keys, staging.ranges
        return _warm(store, keys, ranges, staging, dry_run, progress, started, opened_at)
    finally:
        store.close()


def _warm(
    store: CachedStore,
    keys: Sequence[str] | None,
    ranges: list[Range],
    staging: Staging | None,
    dry_run: bool,
    progress: bool | Callable[[Progress], None] | None,
    started: float,
    opened_at: float | None = None,
) -> WarmReport:
    cache, manifest = store.cache, store.manifest
    if staging is not None and staging.accesses is not None:
        cache.plan = PlanHint(staging.accesses)
    if keys is None:
        objects = list(manifest.objects)
    else:  # found through the listing's hash index: a share of 1.28 M costs its own size
        wanted = list(dict.fromkeys(keys))
        at = manifest.indices_of(wanted)
        unknown = [k for k, i in zip(wanted, at.tolist(), strict=True) if i < 0]
        if unknown:
            raise KeyError(
                f"{len(unknown)} keys are not in the listing of {manifest.url}, e.g. "
                f"{unknown[0]!r}; relist with refresh=True if the dataset changed"
            )
        objects = manifest.objects_at(at)
    range_bytes = sum(n for _, _, n in ranges)
    total_bytes = sum(o.size or 0 for o in objects) + range_bytes
    shown, cache_dir_text = public_url(store.config.url), str(cache.dir)
    if dry_run:
        missing = [
            o
            for o in objects
            if cache.lookup(manifest.object_url(o), version=o.version, size=o.size) is None
        ]
        missing_ranges = [r for r in ranges if not _range_cached(store, r)]
        return WarmReport(
            url=shown,
            cache_dir=cache_dir_text,
            objects=len(objects),
            ranges=len(ranges),
            bytes=sum(o.size or 0 for o in missing) + sum(n for _, _, n in missing_ranges),
            already_cached=len(objects) - len(missing) + len(ranges) - len(missing_ranges),
            fetched=0,
            dry_run=True,
            seconds=time.monotonic() - started,
        )
    callback = progress if callable(progress) else None
    if progress is None or progress is True:
        callback = ProgressBar(len(objects) + len(ranges), total_bytes)
    results = store.stager.stage(objects, progress=callback)
    cache.touch([r.url for r in results if r.outcome == "cached"])
    tracker = Progress(
        objects_done=len(results),
        bytes_done=sum(r.nbytes for r in results),
        fetched_bytes=sum(r.nbytes for r in results if r.outcome == "fetched"),
        callback=callback,
    )

    def done(result: RangeResult) -> None:
        staged = _staged_range(store, result)
        results.append(staged)
        tracker.add(staged.nbytes, fetched=staged.outcome == "fetched")

    store.stage_ranges(ranges, done=done)
    if opened_at is not None:
        results = [_fetched_by_open(store, r, opened_at) for r in results]
    failures = [{"url": r.url, "error": r.error or ""} for r in results if r.outcome == "failed"]
    return WarmReport(
        url=shown,
        cache_dir=cache_dir_text,
        objects=len(objects),
        ranges=len(ranges),
        bytes=total_bytes or sum(r.nbytes for r in results),
        fetched=sum(r.outcome == "fetched" for r in results),
        fetched_bytes=sum(r.nbytes for r in results if r.outcome == "fetched"),
        already_cached=sum(r.outcome == "cached" for r in results),
        skipped=sum(r.outcome == "skipped" for r in results),
        failed=len(failures),
        failures=failures,
        seconds=time.monotonic() - started,
    )


def _fetched_by_open(store: CachedStore, result: StageResult, opened_at: float) -> StageResult:
    """An object the dataset's open fetched (a tar shard read for want of an index) was in
    the cache when staging began and came back "cached"; this warm fetched it all the same."""
    if result.outcome != "cached":
        return result
    entry = store.cache.entry(result.url)
    if entry is None or entry.start is not None or entry.created < opened_at:
        return result
    return replace(result, outcome="fetched")


def _staged_range(store: CachedStore, result: RangeResult) -> StageResult:
    """A range's result as a staged object's (its URL naming the bytes); raises a
    permanent failure, as staging objects does."""
    key, offset, length = result.range
    url = f"{store.object_url(key)} (bytes {offset}-{offset + length - 1})"
    error = result.error
    if error is None:
        if result.fetched:
            return StageResult(url, "fetched", result.fetched)
        return StageResult(url, "cached", length)
    if not isinstance(error, RemoteError) or not is_transient(error):
        raise error
    return StageResult(url, "failed", error=error.reason or scrub(str(error)))


def _range_cached(store: CachedStore, r: Range) -> bool:
    """Whether the cache holds range r: as an entry of its own, or its whole object."""
    key, offset, length = r
    obj = store.object(key)
    url = store.manifest.object_url(obj)
    cache = store.cache
    if cache.lookup(url, version=obj.version) is not None:
        return True
    return cache.lookup(url, version=obj.version, span=(offset, length)) is not None


def warm_from_state(
    state_path: str | os.PathLike[str],
    *,
    ranks: Sequence[int] | None = None,
    world_size: int | None = None,
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    batches: int | None = DEFAULT_STATE_BATCHES,
    **warm_options: Any,
) -> WarmReport:
    """Stages exactly what a job resuming from a loader's saved state reads next (its next
    ``batches`` batches per rank, first batches first; None: the rest of its epoch) for
    ``ranks`` of ``world_size`` (default: every rank of the world that saved it). A bound
    lets the job start as soon as its first batches are here (its loader prefetches the
    rest); a state saved without its batch size is warmed whole. The dataset's listing
    comes from the manifest snapshot saved beside the state (``loader.save_manifest``, or
    ``on_preempt``), installed as this node's: neither this warm nor the job after it
    lists the remote. For a replacement node, while the job is being rescheduled."""
    path = Path(state_path)
    try:
        state = json.loads(path.read_text())
        dataset, plan = state["dataset"], state["plan"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a fastload loader state naming its dataset (loader.state_dict() "
            f"of a fastload dataset, or the file on_preempt= writes): {exc!r}"
        ) from None
    resume = ResumeState.from_dict(plan)
    world_size = world_size or int(state.get("world_size", 1))
    if batches is not None and batches < 1:
        raise ValueError(f"batches must be >= 1 (or None: the rest of the epoch), got {batches}")
    batch_size = state.get("batch_size")
    samples = None
    if batches is not None and isinstance(batch_size, int) and batch_size >= 1:
        samples = batches * batch_size
    share = NodeShare(
        ranks=tuple(ranks) if ranks is not None else tuple(range(world_size)),
        world_size=world_size,
        epochs=(resume.epoch,),
        format=str(dataset["format"]),
        seed=resume.seed,
        shuffle=resume.shuffle,
        drop_last=resume.drop_last,
        window_shards=resume.window_shards,
        resume=resume,
        samples=samples,
    )
    url = str(dataset["url"])
    if "manifest" in dataset:
        install_snapshot(
            path.parent,
            dataset["manifest"],
            Path(cache_dir) if cache_dir else default_cache_dir(),
            url,
        )
    return warm(
        url, cache_dir=cache_dir, storage_options=storage_options, share=share, **warm_options
    )
