"""``fastload doctor --local-world-size N``: the node's N ranks measured, not only predicted.

The doctor's phases run in one process; with N ranks on a node the model predicts each
rank's rate for the node's cores over N. Here N loader processes run on the node at once
(:mod:`fastload.diagnosis.rank_process`), each rank reading its own share of epoch 0 from
a warm cache with the step after each batch, as the job's ranks would, and each measures
its samples/s: the contention the model predicted, measured.

    parent                      rank processes (one per node rank)
    stage every rank's samples  start, tie their life to the parent, build the loader
    send each its job  ───────► print "ready"
    all ready: send "go" ─────► one train phase (phase_s), print its Phase as JSON
    read, compare, report  ◄───

The job (dataset, settings, step) goes over the child's stdin, never into a file: the
dataset's storage options may hold credentials. A child that fails or hangs is killed
and the ranks are reported skipped with its last error line; none outlives the parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO, Any

from fastload.diagnosis.report import Phase, Ranks
from fastload.staging.child_pipe import readable_within
from fastload.staging.lifetime import env_for_child

# Seconds a rank process may take to start (import torch, open the dataset) on a busy node.
START_S = 120.0
# Seconds past the phase's hard stop (measure.HARD_STOP budgets) to wait for its result.
FINISH_SLACK_S = 60.0


@dataclass(frozen=True)
class RankJob:
    """What one rank process runs: pickled to its stdin."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    dataset: Any  # the ShardedDataset over the warm cache (pickles to its settings)
    indices: list[int]  # this rank's measured samples, repeated for the phase
    settings: dict[str, Any]  # fl.DataLoader settings
    step: tuple[Any, ...]  # see rank_process.build_step
    phase_s: float


def node_ranks(rank: int, world_size: int, local_world_size: int) -> tuple[list[int], int]:
    """(the ranks on this rank's node, the world they belong to). A world smaller than the
    node (a single-process run asked about N ranks) is taken as the node's N ranks."""
    first = rank - rank % local_world_size
    world = max(world_size, first + local_world_size)
    return list(range(first, first + local_world_size)), world


def run(
    jobs: list[RankJob],
    *,
    predicted_samples_per_s: float,
    alone_samples_per_s: float,
    cores_per_rank: float,
) -> Ranks:
    """Starts a process per job, starts their phases together, and reports each rank's
    measured rate beside the prediction."""
    lws = jobs[0].local_world_size
    ranks = [job.rank for job in jobs]

    def skipped(why: str) -> Ranks:
        return not_measured(
            ranks,
            predicted_samples_per_s=predicted_samples_per_s,
            alone_samples_per_s=alone_samples_per_s,
            cores_per_rank=cores_per_rank,
            why=why,
        )

    children: list[_Child] = []
    try:
        # (extend keeps the children started before one that fails to start: all stopped)
        children.extend(_Child.start(job) for job in jobs)
        deadline = time.monotonic() + START_S
        for child in children:
            if not child.expect("ready", deadline):
                return skipped(child.failure("did not start"))
        for child in children:  # all at once: the phases overlap
            child.send(b"go\n")
        hard_stop = 3 * max(job.phase_s for job in jobs) + FINISH_SLACK_S
        deadline = time.monotonic() + hard_stop
        results: list[dict[str, Any]] = []
        for child in children:
            result = child.result(deadline)
            if result is None:
                return skipped(child.failure("gave no result"))
            results.append(result)
            child.finished = True
    finally:
        for child in children:
            child.stop()
    phases = [Phase(**r["phase"]) for r in results]
    measured = [p.samples_per_s for p in phases]
    mean = sum(measured) / len(measured)
    return Ranks(
        local_world_size=lws,
        ranks=ranks,
        cores_per_rank=round(cores_per_rank, 3),
        predicted_samples_per_s=round(predicted_samples_per_s, 3),
        measured_samples_per_s=measured,
        alone_samples_per_s=round(alone_samples_per_s, 3),
        error=round(mean / max(predicted_samples_per_s, 1e-9) - 1, 4),
        overlap=_overlap([(r["start"], r["end"]) for r in results]),
        phases=phases,
    )


def not_measured(
    ranks: list[int],
    *,
    predicted_samples_per_s: float,
    alone_samples_per_s: float,
    cores_per_rank: float,
    why: str,
) -> Ranks:
    """The report of ranks that could not be measured, saying why."""
    return Ranks(
        local_world_size=len(ranks),
        ranks=ranks,
        cores_per_rank=round(cores_per_rank, 3),
        predicted_samples_per_s=round(predicted_samples_per_s, 3),
        measured_samples_per_s=[],
        alone_samples_per_s=round(alone_samples_per_s, 3),
        error=0.0,
        overlap=0.0,
        skipped=why,
    )


def _overlap(windows: list[tuple[float, float]]) -> float:
    """The share of the ranks' mean measured time during which every rank was measuring."""
    together = min(end for _, end in windows) - max(start for start, _ in windows)
    mean = sum(end - start for start, end in windows) / len(windows)
    return round(max(0.0, together) / mean, 3) if mean > 0 else 0.0


class _Child:
    """One rank process: its pipes, and its stderr in a temporary file (read on failure)."""

    def __init__(self, process: subprocess.Popen[bytes], errors: IO[bytes], rank: int) -> None:
        self.process, self.errors, self.rank = process, errors, rank
        self._buffer = b""
        self.finished = False  # it printed its result

    @classmethod
    def start(cls, job: RankJob) -> _Child:
        errors = tempfile.TemporaryFile()  # noqa: SIM115  (closed by stop(): it outlives this call)
        process = subprocess.Popen(
            [sys.executable, "-m", "fastload.diagnosis.rank_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=env_for_child(),  # the child dies with this process, however it ends
        )
        child = cls(process, errors, job.rank)
        payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        child.send(b"%d\n" % len(payload) + payload)
        return child

    def send(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(data)
            self.process.stdin.flush()
        except BrokenPipeError:  # it died: its stderr says why, read by failure()
            pass

    def read_line(self, deadline: float) -> str | None:
        """The child's next stdout line, None at EOF or past ``deadline``."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if readable_within(fd, min(left, 1.0)):
                chunk = os.read(fd, 65536)
                if not chunk:
                    return None
                self._buffer += chunk
            elif self.process.poll() is not None and not self._buffer:
                return None
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def expect(self, word: str, deadline: float) -> bool:
        """Whether the child says ``word`` by ``deadline`` (lines a library printed before it
        are passed over)."""
        while (line := self.read_line(deadline)) is not None:
            if line.strip() == word:
                return True
        return False

    def result(self, deadline: float) -> dict[str, Any] | None:
        """The child's result: its first line that is a JSON object."""
        while (line := self.read_line(deadline)) is not None:
            if line.startswith("{"):
                try:
                    found: dict[str, Any] = json.loads(line)
                except ValueError:
                    continue
                return found
        return None

    def failure(self, what: str) -> str:
        self._end()
        self.errors.seek(0)
        lines = [x for x in self.errors.read().decode(errors="replace").splitlines() if x]
        last = lines[-1] if lines else f"exit status {self.process.returncode}"
        return f"rank {self.rank}'s loader process {what}: {last}"

    def _end(self, grace_s: float = 0.0) -> None:
        if grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """Ends the process (a child done with its result exits by itself: it gets a
        moment to close its loader) and closes its pipes and files."""
        self._end(grace_s=10.0 if self.finished else 0.0)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.errors.close()
