"""The plan: how fast one rank's order is computed, how many shards a rank reads, how fast
a mid-epoch resume starts, each beside ``torch.utils.data.DistributedSampler``.

Dataset: ``num_shards`` shards of ``shard_samples`` samples (default 10,000 x 1,000 = 10
million), ``world_size`` ranks, rank 0, shuffled. Cases:

* **plan one epoch**: the rank's indices for an epoch, as a list (what a DataLoader
  iterates). ``DistributedSampler`` draws a global ``randperm`` and takes every
  ``world_size``-th index; fastload permutes shards, shuffles within windows of
  ``window_shards`` shards and computes only the rank's contiguous share.
* **distinct shards per rank per epoch**: the shards (units of caching) a rank touches;
  the ideal is ``num_shards / world_size``. ``DistributedSampler``'s strided global shuffle
  touches nearly all of them. Column ``shards``; ratio = the reference's shards / these.
* **resume mid-epoch** at ``resume_samples`` samples, stopped halfway through the epoch:
  fastload's ``load_state_dict`` + first index (no replay: the rest is computed directly),
  at the same and at half the world size, beside what torchdata's
  ``StatefulDistributedSampler`` does (regenerate the whole permutation, skip what was
  yielded; emulated here on ``DistributedSampler``, as torchdata is not a dependency).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import DistributedSampler

from fastload.bench.runner import Measurement, Report, measure, relate
from fastload.plan import DEFAULT_WINDOW_SHARDS, Plan
from fastload.sampler import ShardedSampler

PEER = "torch DistributedSampler"


@dataclass(frozen=True, kw_only=True)
class PlanBenchConfig:
    num_shards: int = 10_000
    shard_samples: int = 1_000
    world_size: int = 8
    window_shards: int = DEFAULT_WINDOW_SHARDS
    resume_samples: int = 1_000_000
    seed: int = 0
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("num_shards", "shard_samples", "world_size", "window_shards", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.resume_samples < 2 * self.world_size:
            raise ValueError(
                f"resume_samples must be >= 2 * world_size ({2 * self.world_size}), "
                f"got {self.resume_samples}"
            )

    @classmethod
    def quick(cls) -> PlanBenchConfig:
        return cls(num_shards=1_000)  # 1 million samples; resume stays at 1 million

    @property
    def num_samples(self) -> int:
        return self.num_shards * self.shard_samples


class _Sized:
    """What the samplers need of a dataset: its length (and, for fastload, its shards)."""

    def __init__(self, num_samples: int, shard_sizes: Sequence[int] | None = None) -> None:
        self._len = num_samples
        if shard_sizes is not None:
            self.shard_sizes = shard_sizes

    def __len__(self) -> int:
        return self._len


def _dataset(shards: int, per_shard: int) -> _Sized:
    return _Sized(shards * per_shard, np.full(shards, per_shard, dtype=np.int64).tolist())


def _peer(n: int, config: PlanBenchConfig, rank: int = 0) -> DistributedSampler[int]:
    sampler: DistributedSampler[int] = DistributedSampler(
        _Sized(n),  # type: ignore[arg-type]
        num_replicas=config.world_size,
        rank=rank,
        shuffle=True,
        seed=config.seed,
    )
    return sampler


def _ours(ds: _Sized, config: PlanBenchConfig, world_size: int | None = None) -> ShardedSampler:
    return ShardedSampler(
        ds,
        rank=0,
        world_size=world_size or config.world_size,
        seed=config.seed,
        window_shards=config.window_shards,
    )


def run(config: PlanBenchConfig | None = None) -> Report:
    config = config or PlanBenchConfig()
    report = Report(name="plan", params={**config.__dict__, "num_samples": config.num_samples})
    n, w = config.num_samples, config.world_size
    ds = _dataset(config.num_shards, config.shard_samples)
    rows: list[Measurement] = []

    def add(case: str, system: str, fn: Callable[[], object], items: int, note: str = "") -> None:
        rows.append(
            measure(
                fn,
                benchmark="plan",
                case=case,
                system=system,
                items=items,
                repeats=config.repeats,
                note=note,
            )
        )

    # -- plan one epoch ----------------------------------------------------------------
    per_rank = -(-n // w)
    epoch_case = f"plan one epoch: {n:,} samples in {config.num_shards:,} shards, rank 0 of {w}"
    add(epoch_case, PEER, lambda: list(_peer(n, config)), per_rank, "global randperm, strided")
    add(
        epoch_case,
        "fastload ShardedSampler",
        lambda: list(_ours(ds, config)),
        per_rank,
        "includes building the plan",
    )
    plan = Plan(ds.shard_sizes, seed=config.seed, window_shards=config.window_shards)
    add(
        epoch_case,
        "fastload Plan.rank_order",
        lambda: Plan(
            ds.shard_sizes, seed=config.seed, window_shards=config.window_shards
        ).rank_order(0, world_size=w, rank=0),
        per_rank,
        "numpy array, plan built each time",
    )
    add(
        f"whole epoch order, {n:,} samples (every rank's)",
        "fastload Plan.epoch_order",
        lambda: plan.epoch_order(0),
        n,
    )

    # -- resume --------------------------------------------------------------------------
    rn = config.resume_samples
    rshards = max(1, rn // config.shard_samples)
    rds = _dataset(rshards, rn // rshards)
    rn = len(rds)
    resume_case = f"resume mid-epoch: {rn:,} samples, {w} ranks stopped halfway"
    yielded = -(-rn // w) // 2
    state = _stopped_state(rds, config, yielded)

    def torchdata_like() -> int:
        # StatefulDistributedSampler.__iter__: the whole permutation again, then islice.
        return next(itertools.islice(iter(_peer(rn, config)), yielded, None))

    def ours(world_size: int) -> Callable[[], int]:
        def resume() -> int:
            sampler = _ours(rds, config, world_size)
            sampler.load_state_dict(state)
            return next(iter(sampler))

        return resume

    add(resume_case, PEER, torchdata_like, 0, "torchdata's way: regenerate, skip yielded")
    add(resume_case, "fastload, same world size", ours(w), 0, "construct + load + first index")
    add(resume_case, f"fastload, world {w} -> {max(1, w // 2)}", ours(max(1, w // 2)), 0)

    rows = relate(rows, PEER)
    rows.extend(_locality(config, plan))
    report.rows = rows
    return report


def _stopped_state(ds: _Sized, config: PlanBenchConfig, yielded: int) -> dict[str, Any]:
    sampler = _ours(ds, config)
    it = iter(sampler)
    for _ in range(yielded):
        next(it)
    return sampler.state_dict()


def _locality(config: PlanBenchConfig, plan: Plan) -> list[Measurement]:
    """Distinct shards per rank per epoch, the mean over the first and the last rank; a
    count, not a time (the rows' seconds are 0)."""
    n, w, size = config.num_samples, config.world_size, config.shard_samples
    ranks = sorted({0, w - 1})
    peer = float(
        np.mean([len(np.unique(np.asarray(list(_peer(n, config, r))) // size)) for r in ranks])
    )
    ours = float(
        np.mean(
            [len(np.unique(plan.shard_of(plan.rank_order(0, world_size=w, rank=r)))) for r in ranks]
        )
    )
    case = (
        f"distinct shards per rank per epoch (of {config.num_shards:,}; "
        f"ideal {config.num_shards / w:,.0f})"
    )
    return [
        Measurement(
            benchmark="plan",
            case=case,
            system=system,
            seconds=0.0,
            repeats=[],
            ratio=peer / shards,  # how many times fewer shards than the reference
            reference=PEER,
            note=f"{shards / config.num_shards:.1%} of the shards; ratio: fewer shards",
            extra={"shards": shards},
        )
        for system, shards in ((PEER, peer), ("fastload plan", ours))
    ]
