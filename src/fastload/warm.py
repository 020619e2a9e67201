"""``fl.warm``: stage a dataset (or the part of it a node needs) into the local cache."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, TextIO

from fastload.cache import Cache, PlanHint, Policy
from fastload.manifest import load_manifest
from fastload.plan import DEFAULT_WINDOW_SHARDS
from fastload.remote import open_filesystem, public_url
from fastload.stage import FetchConfig, Stager, _Progress


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

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.ranks or any(not 0 <= r < self.world_size for r in self.ranks):
            raise ValueError(f"ranks must be in [0, {self.world_size}), got {list(self.ranks)}")
        if not self.epochs or min(self.epochs) < 0:
            raise ValueError(f"epochs must be one or more epochs >= 0, got {list(self.epochs)}")

    def keys_and_accesses(self, url: str, **open_options: Any) -> tuple[list[str], list[str]]:
        """The object keys to stage (first needed first) and every object access in order."""
        from fastload.datasets import open_dataset
        from fastload.plan import Plan

        with open_dataset(url, format=self.format, **open_options) as dataset:
            plan = Plan(
                dataset.shard_sizes,
                seed=self.seed,
                shuffle=self.shuffle,
                drop_last=self.drop_last,
                window_shards=self.window_shards,
            )
            future = plan.future(self.epochs, world_size=self.world_size, ranks=self.ranks)
            keys = [k for s in future.first_needed for k in dataset.shard_keys[int(s)]]
            store = dataset.store
            accesses = [
                store.object_url(k) for s in future.accesses() for k in dataset.shard_keys[int(s)]
            ]
        return list(dict.fromkeys(keys)), accesses


def dataset_keys(url: str, format: str, **open_options: Any) -> list[str]:
    """Every object key the dataset at url reads when opened in format, shard by shard."""
    from fastload.datasets import open_dataset

    with open_dataset(url, format=format, **open_options) as dataset:
        return list(dict.fromkeys(k for keys in dataset.shard_keys for k in keys))


@dataclass(frozen=True, kw_only=True)
class WarmReport:
    """What a warm did; ``to_dict()`` is what ``fastload warm --json`` prints."""

    url: str
    cache_dir: str
    objects: int
    bytes: int
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


class Progress(Protocol):
    """Counts so far, as the stager (and ``fastload index``) report them."""

    objects_done: int
    bytes_done: int
    fetched_bytes: int


class ProgressBar:
    """One line on a terminal, rewritten at most ten times a second; silent elsewhere."""

    def __init__(self, total_objects: int, total_bytes: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.total_objects = total_objects
        self.total_bytes = total_bytes
        self.start = time.monotonic()
        self._last = 0.0

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and p.objects_done < self.total_objects):
            return
        self._last = now
        elapsed = max(now - self.start, 1e-9)
        rate = p.fetched_bytes / elapsed
        left = max(self.total_bytes - p.bytes_done, 0)
        eta = f"{left / rate:5.0f}s" if rate > 0 else "    ?"
        self.stream.write(
            f"\r{p.objects_done:>9,}/{self.total_objects:,} objects  "
            f"{p.bytes_done / 1e6:>9,.1f}/{self.total_bytes / 1e6:,.1f} MB  "
            f"{rate / 1e6:7.1f} MB/s  ETA {eta}"
        )
        if p.objects_done >= self.total_objects:
            self.stream.write("\n")
        self.stream.flush()


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
    progress: bool | Callable[[_Progress], None] | None = None,
    fetch: FetchConfig | None = None,
    share: NodeShare | None = None,
    format: str | None = None,
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
    through the cache, so a node's share then costs the whole dataset's download.

    Resumable: objects already cached (same version) are not fetched again. A permanent
    failure (not found, access refused, full disk) raises; transient failures that outlast
    their retries are counted in the report's ``failed`` and listed in ``failures``.
    ``progress=None`` shows a bar when stderr is a terminal.
    """
    started = time.monotonic()
    hint: list[str] | None = None
    if format is not None:
        if keys is not None or share is not None:
            raise ValueError("give one of keys, share and format (share has its own format)")
        keys = dataset_keys(
            url,
            format,
            cache_dir=cache_dir,
            storage_options=storage_options,
            refresh=refresh,
            ttl_s=ttl_s,
        )
        refresh = False  # listed just now
    if share is not None:
        if keys is not None:
            raise ValueError("give keys or share, not both")
        keys, hint = share.keys_and_accesses(
            url, cache_dir=cache_dir, storage_options=storage_options, refresh=refresh, ttl_s=ttl_s
        )
        refresh = False  # listed just now
    with Cache(cache_dir, max_bytes=max_bytes, policy=policy) as cache:
        if hint is not None:
            cache.plan = PlanHint(hint)
        manifest = load_manifest(url, cache.dir, storage_options, refresh=refresh, ttl_s=ttl_s)
        objects = list(manifest.objects)
        if keys is not None:
            by_key = {o.key: o for o in objects}
            unknown = [k for k in keys if k not in by_key]
            if unknown:
                raise KeyError(
                    f"{len(unknown)} keys are not in the listing of {manifest.url}, e.g. "
                    f"{unknown[0]!r}; relist with refresh=True if the dataset changed"
                )
            objects = [by_key[k] for k in dict.fromkeys(keys)]
        total_bytes = sum(o.size or 0 for o in objects)
        shown, cache_dir_text = public_url(url), str(cache.dir)
        if dry_run:
            missing = [
                o
                for o in objects
                if cache.lookup(manifest.object_url(o), version=o.version, size=o.size) is None
            ]
            return WarmReport(
                url=shown,
                cache_dir=cache_dir_text,
                objects=len(objects),
                bytes=sum(o.size or 0 for o in missing),
                already_cached=len(objects) - len(missing),
                fetched=0,
                dry_run=True,
                seconds=time.monotonic() - started,
            )
        fs, root = open_filesystem(url, storage_options)
        config = fetch or (FetchConfig(jobs=jobs, min_jobs=min(2, jobs)) if jobs else FetchConfig())
        callback = progress if callable(progress) else None
        if progress is None or progress is True:
            callback = ProgressBar(len(objects), total_bytes)
        stager = Stager(cache=cache, manifest=manifest, fs=fs, root=root, config=config)
        results = stager.stage(objects, progress=callback)
        cache.touch([r.url for r in results if r.outcome == "cached"])
    failures = [{"url": r.url, "error": r.error or ""} for r in results if r.outcome == "failed"]
    return WarmReport(
        url=shown,
        cache_dir=cache_dir_text,
        objects=len(objects),
        bytes=total_bytes or sum(r.nbytes for r in results),
        fetched=sum(r.outcome == "fetched" for r in results),
        fetched_bytes=sum(r.nbytes for r in results if r.outcome == "fetched"),
        already_cached=sum(r.outcome == "cached" for r in results),
        skipped=sum(r.outcome == "skipped" for r in results),
        failed=len(failures),
        failures=failures,
        seconds=time.monotonic() - started,
    )
