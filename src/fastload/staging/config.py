"""How staging pulls from a remote (:class:`FetchConfig`), and what it says of each object
(:class:`StageResult`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

# "held": the cache turned the object away, so it was fetched into memory (:class:`Holding`).
Outcome = Literal["cached", "fetched", "held", "skipped", "failed"]


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    """How hard to pull from the remote. Units are in the names."""

    jobs: int = 64  # requests in flight at most
    min_jobs: int = 2  # throttling never pushes concurrency below this
    retries: int = 8  # attempts after the first, for transient failures
    backoff_s: float = 0.05  # first retry waits up to this, doubling each time
    backoff_max_s: float = 5.0
    timeout_s: float = 60.0  # per request
    range_threshold_bytes: int = 64 << 20  # objects larger than this are fetched in ranges
    range_bytes: int = 16 << 20
    # "auto": obstore where it can send the same requests (s3:// with the s3 extra), the
    # fsspec filesystem elsewhere; "fsspec": always the filesystem (see fastload.remote.connect).
    transport: Literal["auto", "fsspec"] = "auto"
    # Stage remote objects in a process of its own (fastload.staging.process), so staging
    # never waits for, nor takes, the GIL of a training step. None (the default): there,
    # for a remote dataset, started only where it will be used (a file folder's open
    # starts it before the listing; elsewhere a round missing more than a chunk of
    # objects: not for tar shards, Parquet files, a cached warm, a plan cache's loader);
    # until it has started, staging goes on in this process a chunk at a time (as a
    # batch's own misses always do), so nothing waits for its start-up; not where a pin
    # budget turns objects away (they would be fetched twice). Chosen by measurement
    # (benchmarks/benchmark_small_objects.py: 2,000 objects of 512 B beside a GIL-holding
    # thread, 2-core machine; issue #32): in this process the thread lost 2.0 ms of GIL
    # per object on a quiet machine (32 s); with the process 0.004-0.007 ms once started
    # (0.05 in this process on the same, loaded, machine). True: always there, started at
    # the listing, waiting for its start-up; False: always here.
    staging_process: bool | None = None
    # Objects the cache turns away (a full ``pin`` cache) that a loader will read soon are
    # fetched ahead anyway and held in memory until read, in at most this many bytes
    # (0: not held, read from the remote when needed). None: a loader's look-ahead.
    hold_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.jobs < 1 or not 1 <= self.min_jobs <= self.jobs:
            raise ValueError(f"need 1 <= min_jobs <= jobs, got {self.min_jobs}, {self.jobs}")
        if self.retries < 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise ValueError("retries and backoff_s must be >= 0 and timeout_s > 0")
        if self.range_bytes <= 0 or self.range_threshold_bytes <= 0:
            raise ValueError("range_bytes and range_threshold_bytes must be > 0")
        if self.hold_bytes is not None and self.hold_bytes < 0:
            raise ValueError(f"hold_bytes must be >= 0 or None, got {self.hold_bytes}")
        if self.transport not in ("auto", "fsspec"):
            raise ValueError(f'transport must be "auto" or "fsspec", got {self.transport!r}')

    def stages_in_process(self) -> bool:
        """Whether remote objects are staged in this process's threads (see
        ``staging_process``)."""
        return self.staging_process is False

    def in_process(self) -> FetchConfig:
        return dataclasses.replace(self, staging_process=False)


@dataclass(frozen=True, slots=True)
class StageResult:
    url: str
    outcome: Outcome
    nbytes: int = 0
    attempts: int = 0
    error: str | None = None
