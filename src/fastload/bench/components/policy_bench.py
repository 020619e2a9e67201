"""Cache hit rates of the ``lru``, ``pin`` and ``plan`` policies on a shuffled dataset.

A dataset twice the cache's budget (default 400 objects of 4 KB, budget half the bytes) is
read for three epochs, each a fresh seeded permutation, as a shuffling loader reads it. The
"remote" is a local folder: this measures the policies, not a network. Per access::

    with cache.use(url) as where:    # a hit holds the cached bytes while it is read
        ...                          # hit: read it, cache.touch([url]) (what lru orders by)
    # miss: read the remote file, publish it (fetch_lock, new_part, publish)

``plan`` gets the whole order of all epochs up front (``cache.plan = PlanHint(order)``).
Epoch 1 misses everywhere, so rows start at epoch 2. The most any policy can hit in a
uniformly shuffled epoch is budget / dataset (0.5 here; Belady's rule reaches it), shown as
the computed ``optimum`` row. ``lru`` suffers most: the order is new each epoch, so what it
kept last is what the next epoch needs least predictably; it hits about 0.15.

Figures: ``hit rate`` per epoch, ``of optimum`` (hit rate / optimum) and ``MB fetched``
(bytes the misses read from the remote); items/s are accesses per second, the cache's own
cost per access on this disk. Hit rates are deterministic for a seed; times are one run.

Command::

    .venv/bin/python benchmarks/benchmark_policy.py --out fastload-bench
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastload.bench.runner import Measurement, Report
from fastload.cache import POLICIES, Cache, PlanHint, Policy

OPTIMUM = "optimum"
DATASET = "objects"


@dataclass(frozen=True, kw_only=True)
class PolicyBenchConfig:
    objects: int = 400
    object_bytes: int = 4096
    budget_fraction: float = 0.5  # of the dataset's bytes
    epochs: int = 3
    seed: int = 0
    policies: tuple[Policy, ...] = POLICIES

    def __post_init__(self) -> None:
        for name in ("objects", "object_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.epochs < 2:
            raise ValueError(f"epochs must be >= 2 (epoch 1 only fills), got {self.epochs}")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {self.budget_fraction}")
        unknown = set(self.policies) - set(POLICIES)
        if unknown or not self.policies:
            raise ValueError(f"policies must be some of {POLICIES}, got {self.policies}")

    @classmethod
    def quick(cls) -> PolicyBenchConfig:
        return cls()  # the full size already takes a second or two

    @property
    def budget_bytes(self) -> int:
        return int(self.objects * self.object_bytes * self.budget_fraction)


@dataclass(frozen=True)
class EpochResult:
    hits: int
    accesses: int
    fetched_bytes: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses


def generate(data_dir: Path, config: PolicyBenchConfig) -> list[Path]:
    """The objects under data_dir/objects; right-sized leftovers stay, others go."""
    folder = data_dir / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:06d}.bin" for i in range(config.objects)]
    wanted = {p.name for p in paths}
    for stale in folder.iterdir():
        if stale.name not in wanted:
            stale.unlink()
    rng = np.random.default_rng(config.seed)
    for path in paths:
        if not path.exists() or path.stat().st_size != config.object_bytes:
            path.write_bytes(rng.integers(0, 256, config.object_bytes, dtype=np.uint8).tobytes())
    return paths


def epoch_orders(urls: list[str], config: PolicyBenchConfig) -> list[list[str]]:
    """One seeded permutation of urls per epoch (the same for every policy)."""
    rng = random.Random(config.seed)
    orders = []
    for _ in range(config.epochs):
        order = list(urls)
        rng.shuffle(order)
        orders.append(order)
    return orders


def _access(cache: Cache, url: str) -> tuple[bool, int]:
    """One read through the cache: (hit, bytes fetched from the remote)."""
    with cache.use(url) as where:
        if where is not None:
            where.read()
    if where is not None:
        cache.touch([url])
        return True, 0
    data = Path(url).read_bytes()  # the "remote" is a local folder
    lock = cache.fetch_lock(url)
    try:
        part = cache.new_part(url)
        part.write(data)
        cache.publish(part, version=None)
    finally:
        lock.release()
    return False, len(data)


def simulate(
    cache_dir: Path, policy: Policy, orders: list[list[str]], config: PolicyBenchConfig
) -> list[EpochResult]:
    """Every epoch's accesses through a fresh cache of the budget, under policy."""
    results = []
    # a share of the data's bytes: the budget counts the entries (the metadata aside)
    with Cache(
        cache_dir, max_bytes=config.budget_bytes, policy=policy, budget_counts="entries"
    ) as cache:
        if policy == "plan":
            cache.plan = PlanHint([url for order in orders for url in order])
        for order in orders:
            hits = fetched = 0
            start = time.perf_counter()
            for url in order:
                hit, nbytes = _access(cache, url)
                hits += hit
                fetched += nbytes
            results.append(EpochResult(hits, len(order), fetched, time.perf_counter() - start))
    return results


def run(data_dir: str | os.PathLike[str], config: PolicyBenchConfig | None = None) -> Report:
    config = config or PolicyBenchConfig()
    data_dir = Path(data_dir)
    urls = [str(p) for p in generate(data_dir, config)]
    orders = epoch_orders(urls, config)
    optimum = config.budget_bytes // config.object_bytes / config.objects
    report = Report(
        name="policy",
        params={
            **config.__dict__,
            "data_dir": str(data_dir),
            "budget_bytes": config.budget_bytes,
            "optimum_hit_rate": optimum,
        },
    )
    scratch = data_dir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    by_policy: dict[Policy, list[EpochResult]] = {}
    try:
        for policy in config.policies:
            cache_dir = Path(tempfile.mkdtemp(dir=scratch))
            try:
                by_policy[policy] = simulate(cache_dir, policy, orders, config)
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    rows: list[Measurement] = []
    for epoch in range(1, config.epochs):
        case = f"epoch {epoch + 1}"
        for policy, results in by_policy.items():
            r = results[epoch]
            rows.append(
                Measurement(
                    benchmark="policy",
                    case=case,
                    system=policy,
                    seconds=r.seconds,
                    repeats=[r.seconds],
                    items=r.accesses,
                    extra={
                        "hit rate": r.hit_rate,
                        "of optimum": r.hit_rate / optimum,
                        "MB fetched": r.fetched_bytes / 1e6,
                    },
                )
            )
        rows.append(
            Measurement(
                benchmark="policy",
                case=case,
                system=OPTIMUM,
                seconds=0.0,
                repeats=[],
                note="computed, not measured: budget / dataset",
                extra={"hit rate": optimum, "of optimum": 1.0},
            )
        )
    report.rows = rows
    return report
