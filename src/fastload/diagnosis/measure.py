"""The measured phases of a diagnosis (the differential method of DS-Analyzer, VLDB'21).

Each phase runs for a bounded time, whatever the step's length:

- ``prep``: the loader alone from a warm cache, taking batches as fast as it makes them:
  the most the loader delivers, and the CPU it takes per sample.
- ``ceiling``: the step alone on one batch already made (on the device): the most the
  step can take.
- ``train``: the loader and the step together from a warm cache, as training runs.
- ``cold``: the same from the remote into an empty cache (the first epoch of a job on a
  fresh node), reading only the batches it measures.
- ``h2d``: the host to device copy of a batch (on a GPU).

A phase's rate comes from the batches after its first third (at least one): by then the
prefetch queue is in its steady state (full when the loader is ahead, empty when behind),
so a queue filled while the first batches were made does not flatter the loader.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from fastload.diagnosis.report import Phase
from fastload.diagnosis.steps import Step

# A phase measures at least this many batches (its budget may run over to reach them):
# MIN_MEASURED of them in its steady part.
MIN_BATCHES = 6
MIN_MEASURED = 4
# A slow phase runs over its budget until it has MIN_BATCHES, up to this many times its
# budget; one that has fewer then is marked ``too_few`` and decides no verdict (a phase
# stopped at 3 batches measured the last two coming out of a full prefetch queue at the
# step's pace: the step-alone rate, not the phase's).
HARD_STOP = 5
# The ceiling (the step alone, no queue) stops at this many times its budget.
CEILING_STOP = 3
# The steady part must span at least this share of the time since the first batch
# arrived: a shorter one is the queue draining, not the phase's pace.
MIN_SPAN = 0.25
# Windows the steady part is cut into for the spread of its rate (rate_se), each of at
# least SE_WINDOW_BATCHES batches: batches leave a prefetch queue in bursts, so one
# batch's gap says little of the rate (a phase with fewer windows has no rate_se).
SE_WINDOWS = 6
SE_WINDOW_BATCHES = 3
# At most this many batches are queued up for a warm phase (it stops at its budget first).
MAX_WARM_BATCHES = 400


@dataclass
class Timeline:
    """When each batch of a phase arrived, and the process's CPU time then."""

    arrivals: list[float]
    cpu: list[float]
    samples: list[int]
    step_s: list[float]
    waits: list[float]

    def window(self) -> slice:
        n = len(self.arrivals)
        return slice(max(1, n // 3) if n > 1 else 0, n)

    def too_few(self) -> str | None:
        """Why the steady part does not give the phase's rate (None: it does)."""
        n = len(self.arrivals)
        measured = n - self.window().start
        if measured < MIN_MEASURED:
            return f"{measured} measured batches (fewer than {MIN_MEASURED}) by the hard stop"
        first = self.window().start
        span = self.arrivals[-1] - self.arrivals[first - 1]
        whole = self.arrivals[-1] - self.arrivals[0]
        if whole > 0 and span < MIN_SPAN * whole:
            return (
                f"the {measured} measured batches span {span:.2f} s of {whole:.2f} s: the "
                "prefetch queue draining"
            )
        return None

    def rate_se(self) -> float | None:
        """The standard error of the log of the steady rate: the steady part cut into
        up to SE_WINDOWS windows of equal batches (SE_WINDOW_BATCHES at least), the spread
        of their seconds; None with fewer than 3 windows."""
        n = len(self.arrivals)
        first = self.window().start
        gaps = [self.arrivals[i] - self.arrivals[i - 1] for i in range(max(first, 1), n)]
        k = min(SE_WINDOWS, len(gaps) // SE_WINDOW_BATCHES)
        if k < 3:
            return None
        size = len(gaps) // k
        windows = [sum(gaps[j * size : (j + 1) * size]) for j in range(k)]
        mean = sum(windows) / k
        if mean <= 0:
            return None
        var = sum((w - mean) ** 2 for w in windows) / (k - 1)
        return round(math.sqrt(var) / mean / math.sqrt(k), 4)

    def rate(self) -> tuple[int, float, float]:
        """(samples, seconds, cores) over the steady part: batches after the first third."""
        n = len(self.arrivals)
        if n < 2:
            return (sum(self.samples), 0.0, 0.0)
        first = self.window().start
        seconds = self.arrivals[-1] - self.arrivals[first - 1]
        samples = sum(self.samples[first:])
        cpu = self.cpu[-1] - self.cpu[first - 1]
        return samples, seconds, (cpu / seconds if seconds > 0 else 0.0)


class PhaseProgress:
    """One line on a terminal per phase, rewritten as it runs; silent elsewhere."""

    def __init__(self, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._last = 0.0

    def __call__(self, phase: str, elapsed: float, budget: float, batches: int) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.1:
            return
        self._last = now
        done = min(1.0, elapsed / budget) if budget > 0 else 1.0
        bar = "#" * round(20 * done)
        self.stream.write(f"\rdoctor: {phase:<8} [{bar:<20}] {elapsed:4.1f}s {batches:>5} batches")
        self.stream.flush()

    def done(self, phase: str, text: str) -> None:
        if self.enabled:
            self.stream.write(f"\rdoctor: {phase:<8} {text:<60}\n")
            self.stream.flush()


def _enough(elapsed: float, budget_s: float, batches: int) -> bool:
    if elapsed >= budget_s and batches >= MIN_BATCHES:
        return True
    return elapsed >= HARD_STOP * budget_s


def _settled(timeline: Timeline, elapsed: float, budget_s: float) -> bool:
    """Whether a loader phase can stop: enough batches whose steady part is the phase's
    pace, or its hard stop."""
    if not _enough(elapsed, budget_s, len(timeline.arrivals)):
        return False
    return elapsed >= HARD_STOP * budget_s or timeline.too_few() is None


def repeated(indices: Sequence[int], batches: int, batch_size: int) -> list[int]:
    """``indices`` over and over, up to ``batches`` batches: a warm phase that outlasts the
    samples measured cold reads them again (they are all cached by then)."""
    want = batches * batch_size
    rounds = max(1, math.ceil(want / max(1, len(indices))))
    return (list(indices) * rounds)[: max(want, len(indices))]


def batch_samples(batch: Any) -> int:
    from fastload.loader.dataloader import batch_length

    return batch_length(batch, True)


def run_loader(
    name: str,
    what: str,
    loader: Any,
    *,
    step: Step | None,
    budget_s: float,
    progress: PhaseProgress,
    keep_first: bool = False,
) -> tuple[Phase, Any]:
    """Iterates ``loader`` (running ``step`` after each batch) until ``budget_s`` has passed
    and at least MIN_BATCHES arrived, or the loader ends. Returns the phase and, with
    ``keep_first``, the first batch."""
    timeline = Timeline([], [], [], [], [])
    first: Any = None
    busy_before, cpu_before = machine_busy_s(), time.process_time()
    start = time.perf_counter()
    ready = start  # when the consumer asked for the next batch
    iterator: Iterator[Any] = iter(loader)
    try:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                break
            now = time.perf_counter()
            timeline.arrivals.append(now)
            timeline.cpu.append(time.process_time())
            timeline.samples.append(batch_samples(batch))
            timeline.waits.append(now - ready)
            if keep_first and first is None:  # a copy: the loader's buffers go with it
                first = _copied(batch)
            if step is not None:
                before = step.spent_s
                step(batch)
                timeline.step_s.append(step.spent_s - before)
            ready = time.perf_counter()
            elapsed = ready - start
            progress(name, elapsed, budget_s, len(timeline.arrivals))
            if _settled(timeline, elapsed, budget_s):
                break
            del batch
        stats = loader.stats()
    finally:
        loader.close()  # its threads, and the decoder's
    phase = _phase(name, what, timeline, stats)
    phase.others_cores = others_cores(busy_before, cpu_before, time.perf_counter() - start)
    progress.done(name, f"{phase.samples_per_s:,.0f} samples/s over {phase.batches} batches")
    return phase, first


def _phase(name: str, what: str, timeline: Timeline, stats: dict[str, Any]) -> Phase:
    samples, seconds, cores = timeline.rate()
    window = timeline.window()
    steps = timeline.step_s[window]
    waits = timeline.waits[window]
    made = max(1, int(stats.get("batches", 0)))  # batches the loader made, prefetched too
    stage_s = {
        stage: round(entry["seconds"] / made, 6)
        for stage, entry in stats.get("stages", {}).items()
        if stage in ("read", "decode", "collate", "transfer", "stage")
    }
    return Phase(
        name=name,
        what=what,
        batches=len(timeline.arrivals[window]),
        samples=samples,
        seconds=round(seconds, 6),
        samples_per_s=round(samples / seconds, 3) if seconds > 0 else 0.0,
        step_s=round(sum(steps) / len(steps), 6) if steps else None,
        wait_s=round(sum(waits) / len(waits), 6) if waits else None,
        cpu_cores=round(cores, 3),
        stage_s=stage_s,
        bytes_fetched=int(stats.get("counts", {}).get("bytes_fetched", 0)),
        hit_rate=_hit_rate(stats.get("counts", {})),
        rate_se=timeline.rate_se(),
        too_few=timeline.too_few(),
    )


def machine_busy_s() -> float | None:
    """The machine's busy CPU seconds so far, all cores (``/proc/stat``); None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def others_cores(busy_before: float | None, cpu_before: float, seconds: float) -> float | None:
    """The cores other processes kept busy since ``busy_before``: the machine's busy time
    less this process's, over the wall time (a loaded machine gives the loader less)."""
    busy = machine_busy_s()
    if busy is None or busy_before is None or seconds <= 0:
        return None
    ours = time.process_time() - cpu_before
    return round(max(0.0, (busy - busy_before - ours) / seconds), 3)


def _hit_rate(counts: dict[str, Any]) -> float | None:
    hits, misses = int(counts.get("cache_hits", 0)), int(counts.get("cache_misses", 0))
    return round(hits / (hits + misses), 4) if hits + misses else None


def run_step_alone(
    step: Step, batch: Any, batch_size: int, *, budget_s: float, progress: PhaseProgress
) -> Phase:
    """The ceiling: the step on one ready batch, over and over (3 calls at least)."""
    if step.kind in ("model", "callable"):
        step(batch)  # warm-up: a model's first step allocates
    step.reset()
    start, cpu = time.perf_counter(), time.process_time()
    while True:
        step(batch)
        elapsed = time.perf_counter() - start
        done = elapsed >= budget_s and step.calls >= MIN_BATCHES
        # (the step alone has no queue to drain: 3 calls by its hard stop give its time)
        if step.calls >= 1000 or done or (elapsed >= CEILING_STOP * budget_s and step.calls >= 3):
            break
        progress("ceiling", time.perf_counter() - start, budget_s, step.calls)
    wall = time.perf_counter() - start
    mean = step.mean_s
    phase = Phase(
        name="ceiling",
        what=f"the step alone on a ready batch: {step.description}",
        batches=step.calls,
        samples=step.calls * batch_size,
        seconds=round(wall, 6),
        samples_per_s=round(batch_size / mean, 3) if mean > 0 else 0.0,
        step_s=round(mean, 6),
        cpu_cores=round((time.process_time() - cpu) / wall, 3) if wall > 0 else 0.0,
    )
    step.reset()
    progress.done("ceiling", f"{mean * 1000:,.1f} ms a step")
    return phase


def run_h2d(batch: Any, device: Any, batch_size: int, *, budget_s: float) -> Phase:
    """The copy of one batch from pinned host memory to ``device``, repeated."""
    import torch

    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return Phase(
            name="h2d",
            what="the host to device copy",
            skipped="no GPU: batches stay in host memory (run on the training node to time it)",
        )
    host = [t.detach().to("cpu").pin_memory() for t in _tensors(batch)]
    nbytes = sum(t.numel() * t.element_size() for t in host)
    torch.cuda.synchronize()
    copies, start = 0, time.perf_counter()
    while copies < 5 or (time.perf_counter() - start < budget_s and copies < 500):
        for t in host:
            t.to(device, non_blocking=True)
        torch.cuda.synchronize()
        copies += 1
    per = (time.perf_counter() - start) / copies
    return Phase(
        name="h2d",
        what=f"copying a batch ({nbytes / 1e6:,.1f} MB) from pinned memory to {device}",
        batches=copies,
        samples=copies * batch_size,
        seconds=round(per * copies, 6),
        samples_per_s=round(batch_size / per, 3),
        step_s=round(per, 6),
        stage_s={"transfer": round(per, 6)},
    )


def _copied(batch: Any) -> Any:
    import torch

    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _copied(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_copied(v) for v in batch)
    return batch


def _tensors(batch: Any) -> Iterator[Any]:
    import torch

    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for value in batch.values():
            yield from _tensors(value)
    elif isinstance(batch, list | tuple):
        for value in batch:
            yield from _tensors(value)
