"""The cache's own CPU cost at ImageNet scale: per publish and per evicted object, with 10k,
100k and 1.28 M entries cached, for ``lru``, ``pin`` and ``plan``; no remote, no network.

Per scale N and policy: an index of N synthetic entries (rows of ``ENTRY_BYTES`` each, the
first N of a 2N-object dataset, written straight into SQLite: their files do not exist,
so evicting one unlinks nothing) under a budget that holds exactly them and the metadata,
everything on disk counted (half the dataset): every publish needs room, so eviction runs
all along (``lru`` and ``plan`` must evict: a run that evicted nothing is an error). Then
``accesses`` accesses in a shuffled order of the 2N: a hit does what ``Cache.use`` does to
the index (a use, the plan advanced), a miss publishes real bytes (``fetch_lock``,
``new_part``, ``publish``), so eviction makes room by policy. ``plan`` gets the next
accesses as its plan. Figures:

- ``CPU us/publish``: ``time.process_time`` inside ``publish`` per publish (the eviction
  included);
- ``CPU us/evicted``: that inside ``_make_room`` (every publish's budget check, and the
  eviction) per entry evicted; ``evict-only us``: that inside the eviction (``_evict``:
  ranking, locking, unlinking, deleting the rows) per entry evicted;
- ``index MB``: the index's files on disk; ``hit rate``; ``du<=max``: 1 if the file
  system's blocks (``st_blocks``) and the budget's count stayed within ``max_bytes`` at
  every check (each ``check_every`` publishes).

Targets (issue #31): CPU per evicted object at 1.28 M <= 1.5x its value at 10k, and
<= 50 us.

Command::

    .venv/bin/python benchmarks/benchmark_cache_scale.py --out fastload-bench
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastload.bench.runner import Measurement, Report
from fastload.cache import POLICIES, Cache, PlanHint, Policy, object_id
from fastload.cache.budget import allocated_under

ENTRY_BYTES = 8192  # more than a block, so 10k entries make a budget that counts the disk
_PREFILL_BATCH = 50_000


@dataclass(frozen=True, kw_only=True)
class CacheScaleBenchConfig:
    scales: tuple[int, ...] = (10_000, 100_000, 1_280_000)
    accesses: int = 20_000
    check_every: int = 10_000
    seed: int = 0
    policies: tuple[Policy, ...] = POLICIES

    def __post_init__(self) -> None:
        if not self.scales or min(self.scales) <= 0:
            raise ValueError(f"scales must be > 0, got {self.scales}")
        if self.accesses <= 0 or self.check_every <= 0:
            raise ValueError("accesses and check_every must be > 0")
        unknown = set(self.policies) - set(POLICIES)
        if unknown or not self.policies:
            raise ValueError(f"policies must be some of {POLICIES}, got {self.policies}")

    @classmethod
    def quick(cls) -> CacheScaleBenchConfig:
        return cls(scales=(10_000, 100_000), accesses=5_000)

    @classmethod
    def components(cls, quick: bool) -> CacheScaleBenchConfig:
        """Its part in ``fastload bench --components``: 10k entries when quick (seconds)."""
        return cls(scales=(10_000,), accesses=2_000) if quick else cls.quick()


def url_of(i: int) -> str:
    return f"s3://bench/train/{i:08d}.jpg"


def prefill(cache_dir: Path, n: int) -> None:
    """N synthetic own-file entries, least recently used first, straight into the index."""
    with Cache(cache_dir, segment_bytes=0):
        pass
    db = sqlite3.connect(cache_dir / "index.sqlite")
    try:
        _insert(db, n)
        # Its WAL (hundreds of MB at 1.28 M) emptied now: the budget is measured next.
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()


def _insert(db: sqlite3.Connection, n: int) -> None:
    with db:
        for start in range(0, n, _PREFILL_BATCH):
            rows = [
                (object_id(url_of(i)), url_of(i), ENTRY_BYTES, float(i))
                for i in range(start, min(n, start + _PREFILL_BATCH))
            ]
            db.executemany(
                "INSERT INTO objects (id, url, size, checksum, version, created, last_use,"
                " position) VALUES (?, ?, ?, 'xxh3:0', 'v1', 0, ?, 0)",
                rows,
            )
        db.execute("UPDATE totals SET value = ? WHERE name = 'bytes'", (n * ENTRY_BYTES,))
        db.execute("UPDATE totals SET value = ? WHERE name = 'files'", (n,))


@dataclass
class Result:
    publishes: int = 0
    admitted: int = 0
    publish_cpu_s: float = 0.0
    evict_cpu_s: float = 0.0
    evict_only_cpu_s: float = 0.0
    evicted: int = 0
    hits: int = 0
    accesses: int = 0
    index_bytes: int = 0
    within_budget: bool = True
    open_s: float = 0.0
    max_bytes: int = 0
    over_bytes: int = -(1 << 62)  # the most the budget's count or st_blocks went past it


def simulate(cache_dir: Path, policy: Policy, n: int, config: CacheScaleBenchConfig) -> Result:
    prefill(cache_dir, n)
    rng = random.Random(config.seed)
    order = [url_of(i) for i in rng.sample(range(2 * n), min(config.accesses, 2 * n))]
    with Cache(cache_dir, segment_bytes=0) as probe:
        # N entries and the metadata with its reserves, no more: the first publish evicts.
        # (A few MB of room more let the index's growth reserve absorb the publishes of a
        # whole run at 1.28 M: it evicted nothing.)
        max_bytes = probe.disk_bytes()
    result = Result(max_bytes=max_bytes)
    start = time.perf_counter()
    cache = Cache(cache_dir, max_bytes=max_bytes, policy=policy)
    result.open_s = time.perf_counter() - start
    payload = os.urandom(ENTRY_BYTES)
    make_room, evict = cache._make_room, cache._evict
    counted = [0.0, 0.0]  # CPU in _make_room (every publish's budget check too), in _evict

    def timed_make_room(*args: object, **kwargs: object) -> bool:
        t = time.process_time()
        try:
            return make_room(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            counted[0] += time.process_time() - t

    def timed_evict(*args: object, **kwargs: object) -> bool:
        t = time.process_time()
        try:
            return evict(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            counted[1] += time.process_time() - t

    cache._make_room = timed_make_room  # type: ignore[method-assign]
    cache._evict = timed_evict  # type: ignore[method-assign]
    try:
        if policy == "plan":
            cache.plan = PlanHint(order)
            with cache.index.transaction() as db:  # build its ranking before timing
                list(zip(range(1), cache._victims(db, ""), strict=False))
                if cache._ranking is not None:
                    cache._ranking.settle([])
        for url in order:
            result.accesses += 1
            entry = cache.entry(url)
            if entry is not None:  # what use() does to the index, without a file to hold
                result.hits += 1
                if cache.plan is not None:
                    cache.plan.advance(entry.id)
                cache.index.note_use(entry.id)
                continue
            lock = cache.fetch_lock(url)
            try:
                part = cache.new_part(url)
                part.write(payload)
                t = time.process_time()
                admitted = cache.publish(part, version="v1") is not None
                result.publish_cpu_s += time.process_time() - t
            finally:
                lock.release()
            result.publishes += 1
            result.admitted += admitted
            if result.publishes % config.check_every == 0:
                result.within_budget &= _within(cache, max_bytes, result)
        result.within_budget &= _within(cache, max_bytes, result)
        with cache.index.transaction() as db:
            (left,) = db.execute("SELECT COUNT(*) FROM objects").fetchone()
        result.evicted = n + result.admitted - left
        result.evict_cpu_s, result.evict_only_cpu_s = counted
        result.index_bytes = cache.index.file_bytes()
    finally:
        cache.close()
    if policy != "pin" and result.publishes and not result.evicted:
        raise RuntimeError(
            f"cache_scale: {policy} at {n:,} entries published {result.publishes:,} objects "
            f"over a full budget of {max_bytes:,} bytes and evicted none: no eviction measured"
        )
    return result


def _within(cache: Cache, max_bytes: int, result: Result) -> bool:
    counted, allocated = cache.used_bytes(), allocated_under(cache.dir)
    result.over_bytes = max(result.over_bytes, counted - max_bytes, allocated - max_bytes)
    return counted <= max_bytes and allocated <= max_bytes


def run(work_dir: str | os.PathLike[str], config: CacheScaleBenchConfig | None = None) -> Report:
    config = config or CacheScaleBenchConfig()
    report = Report(
        name="cache_scale",
        params={**config.__dict__, "entry_bytes": ENTRY_BYTES, "work_dir": str(work_dir)},
    )
    scratch = Path(work_dir)
    scratch.mkdir(parents=True, exist_ok=True)
    for n in config.scales:
        for policy in config.policies:
            cache_dir = Path(tempfile.mkdtemp(dir=scratch))
            try:
                r = simulate(cache_dir, policy, n, config)
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            report.rows.append(
                Measurement(
                    benchmark="cache_scale",
                    case=f"{n:,} cached",
                    system=policy,
                    seconds=r.publish_cpu_s,
                    repeats=[r.publish_cpu_s],
                    items=r.publishes,
                    extra={
                        "CPU us/publish": 1e6 * r.publish_cpu_s / max(r.publishes, 1),
                        "CPU us/evicted": 1e6 * r.evict_cpu_s / r.evicted if r.evicted else 0,
                        "evict-only us": 1e6 * r.evict_only_cpu_s / r.evicted if r.evicted else 0,
                        "evicted": r.evicted,
                        "admitted": r.admitted,
                        "index MB": r.index_bytes / 1e6,
                        "hit rate": r.hits / max(r.accesses, 1),
                        "du<=max": float(r.within_budget),
                        "over KB": max(r.over_bytes, 0) / 1e3,
                        "open s": r.open_s,
                    },
                    note="seconds: CPU inside publish",
                )
            )
    return report


TARGET_US_PER_EVICTED = 50.0
TARGET_GROWTH = 1.5  # CPU per evicted object at the largest scale over the smallest


def target_lines(report: Report) -> list[str]:
    """CPU per evicted object against issue #31's targets, per evicting policy."""
    lines = []
    for policy in ("lru", "plan"):
        by_scale = {
            int(r.case.split()[0].replace(",", "")): r.extra["CPU us/evicted"]
            for r in report.rows
            if r.system == policy and r.extra["evicted"]
        }
        if not by_scale:
            continue
        small, large = min(by_scale), max(by_scale)
        us, growth = by_scale[large], by_scale[large] / max(by_scale[small], 1e-9)
        met = us <= TARGET_US_PER_EVICTED and growth <= TARGET_GROWTH
        lines.append(
            f"target: {policy} CPU per evicted object at {large:,} entries {us:.1f} us "
            f"(<= {TARGET_US_PER_EVICTED:.0f}), {growth:.2f}x its value at {small:,} "
            f"(<= {TARGET_GROWTH}): {'met' if met else 'missed'}"
        )
    return lines
