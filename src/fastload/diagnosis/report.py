"""What ``fastload doctor`` found, as plain dataclasses: the JSON schema is their ``asdict``.

Schema (``SCHEMA_VERSION``; fields are added, never renamed or removed, within a version):

- ``bottleneck``: the stage the step waits on — ``none`` (the step itself binds: the GPU is
  the bottleneck), ``fetch`` (the remote: the cache does not hold the data), ``read``,
  ``decode``, ``collate`` (the loader's CPU work), ``gil`` (the loader's threads slow a
  step that holds the GIL), ``h2d`` (the host to device copy).
- ``verdict``: utilization, samples/s, time and cost per epoch, the cost lost to waiting.
- ``phases``: each measured phase (``ceiling``, ``prep``, ``train``, ``cold``, ``h2d``).
- ``fixes``: settings ranked by predicted gain, each with its predicted figures.
- ``applied``: with ``--apply``, the top applicable fix re-measured: predicted vs measured;
  ``applied_fixes``: every applicable fix re-measured, the top one first.
- ``cache``: the cache's budget and policy for this node's disk and share (``cache_advice``).
- ``ranks``: with a local world size above 1, a loader process per rank of the node run at
  once: each rank's measured samples/s against the one-process model's prediction.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1
BOTTLENECKS = ("none", "fetch", "read", "decode", "collate", "gil", "h2d")


@dataclass
class Phase:
    """One measured phase: the loader (or the step alone) over ``batches`` batches."""

    name: str  # ceiling | prep | train | cold | h2d
    what: str  # one line: what ran
    batches: int = 0
    samples: int = 0
    seconds: float = 0.0  # wall time of the measured batches (after the warm-up ones)
    samples_per_s: float = 0.0
    step_s: float | None = None  # mean wall time of one step (phases with a step)
    wait_s: float | None = None  # mean wait for the next batch (phases with a loader)
    cpu_cores: float = 0.0  # the process's CPU time over wall time: cores kept busy
    # Seconds per batch spent in each loader stage (summed over its threads, so a stage
    # on W threads in parallel takes this / W of the wall time): read, decode, collate,
    # transfer, stage (fetching ahead).
    stage_s: dict[str, float] = field(default_factory=dict)
    bytes_fetched: int = 0
    hit_rate: float | None = None  # of the objects the loader read, the share cached already
    others_cores: float | None = None  # cores other processes kept busy meanwhile
    skipped: str | None = None  # why the phase did not run
    # The standard error of log(samples_per_s), from the spread of the rates of the steady
    # part's windows (None: too few batches to tell).
    rate_se: float | None = None
    # Why the rate is not trusted (too few measured batches by the phase's hard stop: the
    # steady part may be the prefetch queue draining); such a phase decides no verdict.
    too_few: str | None = None


@dataclass
class Fix:
    """A setting and what it predicts."""

    name: str  # num_workers | prefetch_batches | lookahead_bytes | max_bytes | warm | cores | dali
    change: dict[str, Any]  # loader settings it changes, e.g. {"num_workers": 2}
    why: str
    predicted_samples_per_s: float
    predicted_utilization: float
    predicted_epoch_s: float
    predicted_epoch_usd: float | None
    gain: float  # predicted samples/s over the current figure
    command: str | None = None  # a command line to run it (fastload warm ...), if any
    applicable: bool = True  # whether --apply can run it on this machine


@dataclass
class Applied:
    """``--apply``: the fix re-measured in the same way as the figure it improves."""

    fix: str
    change: dict[str, Any]
    predicted_samples_per_s: float
    measured_samples_per_s: float
    predicted_utilization: float
    measured_utilization: float
    error: float  # measured / predicted - 1
    phase: Phase | None = None


@dataclass
class Ranks:
    """The node's ranks measured: a loader process per rank, all at once, each reading its
    rank's share with the step, against what the one-process phases predicted for a rank
    with the node's cores over its local world size."""

    local_world_size: int
    ranks: list[int]  # the node's ranks, as the job numbers them
    cores_per_rank: float
    predicted_samples_per_s: float  # each rank's, from the one-process model
    measured_samples_per_s: list[float]  # each rank's, measured in its own process
    alone_samples_per_s: float  # one process with the node to itself (the train phase)
    error: float  # the ranks' mean measured / predicted - 1
    overlap: float  # the share of the ranks' measured time they all ran at once
    phases: list[Phase] = field(default_factory=list)
    skipped: str | None = None  # why the ranks were not measured


@dataclass
class Verdict:
    utilization: float  # the share of the time the step runs (1.0: never waits)
    samples_per_s: float  # this rank's
    ceiling_samples_per_s: float  # the step alone
    epoch_s: float  # one epoch of this rank's share at samples_per_s
    epoch_usd: float | None  # the job's GPUs for epoch_s at the hourly price
    lost_usd_per_epoch: float | None  # the part of it spent waiting
    lost_usd_per_day: float | None  # at epochs_per_day, when given
    basis: str  # which phase the figures come from (train: warm cache; cold: first epoch)
    summary: str  # one sentence
    # How far the deciding measurement is from the line between two verdicts, as the share
    # of repeated runs expected to name the same bottleneck (0.5: a coin toss, 1: certain).
    confidence: float = 1.0
    # What binds once the cache holds the data ("fetch now, decode once warm").
    once_warm: str | None = None


@dataclass
class Report:
    schema: int
    fastload_version: str
    url: str
    dataset: dict[str, Any]  # samples, bytes, format, cached_fraction
    loader: dict[str, Any]  # batch_size, num_workers, decode, transform, prefetch_batches, ...
    node: dict[str, Any]  # cores, local_world_size, world_size, cores_per_rank, device, gpu
    step: dict[str, Any]  # kind (sleep | gil | model | callable), ms, model, note
    price: dict[str, Any]  # gpu, usd_per_gpu_hour, spot, spot_discount, gpus, source
    phases: dict[str, Phase]
    bottleneck: str
    verdict: Verdict
    fixes: list[Fix]
    applied: Applied | None = None
    applied_fixes: list[Applied] = field(default_factory=list)
    cache: dict[str, Any] | None = None
    ranks: Ranks | None = None
    notes: list[str] = field(default_factory=list)
    budget_s: float = 0.0  # the diagnosis's own wall time
    chart: str | None = None  # path of the PNG, when written

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @property
    def top_fix(self) -> Fix | None:
        return self.fixes[0] if self.fixes else None
