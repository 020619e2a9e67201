"""What every benchmark shares: timing, a description of the machine, JSON and table output."""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from fastload.diagnosis.steps import busy_loop
from fastload.resources import usable_cpus


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One system's figure in one case of a benchmark; ratios are filled in by :func:`relate`."""

    benchmark: str
    case: str
    system: str
    seconds: float  # median over repeats
    repeats: list[float]
    items: int = 0
    nbytes: int = 0
    ratio: float | None = None  # throughput relative to the case's reference system
    reference: str | None = None
    note: str = ""
    # Figures a benchmark adds beyond time and throughput (a hit rate, requests per object);
    # the table prints one column per name.
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds if self.seconds > 0 else float("nan")

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each process so far: this one's to the nanosecond,
    others' (``/proc/<pid>/stat``) to the clock tick."""
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in pids:
        if pid == os.getpid():
            found[pid] = time.process_time()
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            found[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return found


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (Linux: each thread's ``children`` list)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # ended meanwhile
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return found


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (shared pages split among their users); 0 if it
    ended or the kernel does not say."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


STEP_KINDS = ("sleep", "gil")
STEP_NAMES = {"sleep": "sleeping step", "gil": "GIL-holding step"}


def busy_rate(*, seconds: float = 0.05, repeats: int = 5) -> float:
    """Iterations per second of :func:`busy_loop` alone, here and now: the median of
    ``repeats`` timings of about ``seconds`` each (the median, not the best: on a shared
    machine it is the rate a step meets, not one it is lucky to meet)."""
    chunk = 10_000
    start = time.perf_counter()
    busy_loop(chunk)  # also warms the loop up
    chunk = max(chunk, round(chunk * seconds / max(time.perf_counter() - start, 1e-9)))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        busy_loop(chunk)
        rates.append(chunk / (time.perf_counter() - start))
    return statistics.median(rates)


class TrainingStep:
    """The simulated training step a benchmark runs after each batch.

    ``sleep``: ``time.sleep(seconds)``, the GIL free, as a step waiting on its GPU kernels.
    ``gil``: :func:`busy_loop` for as many iterations as take ``seconds`` alone (its rate
    measured on construction, before any loader runs, or given), so the same work each
    time, holding the GIL as a real step's Python does.

    ``spent_s`` counts the steps' wall time and ``waited_s`` the part of it in which the
    step could not run: for the busy step, its wall time minus its thread's CPU time (the
    GIL held by a loader's thread, or, on few cores, the core taken by a loader's threads
    or processes), i.e. its rate against its own rate running alone, measured in the same
    calls and so immune to the machine's drift; for the sleeping step, the time past its
    sleep (getting the GIL back). :func:`step_lost` makes a share of it.
    """

    def __init__(
        self,
        kind: str,
        seconds: float,
        *,
        iterations: int | None = None,
        alone_rate: float | None = None,
    ) -> None:
        if kind not in STEP_KINDS:
            raise ValueError(f"step must be one of {STEP_KINDS}, got {kind!r}")
        if seconds < 0:
            raise ValueError(f"the step's seconds must be >= 0, got {seconds}")
        self.kind, self.seconds = kind, seconds
        self.alone_rate = alone_rate
        self.iterations = 0
        if kind == "gil":
            if self.alone_rate is None:
                self.alone_rate = busy_rate()
            self.iterations = (
                iterations if iterations is not None else round(self.alone_rate * seconds)
            )
        self.spent_s = 0.0
        self.waited_s = 0.0
        self.calls = 0

    def __call__(self) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        if self.kind == "gil":
            busy_loop(self.iterations)
        else:
            time.sleep(self.seconds)
        wall = time.perf_counter() - start
        ran = time.thread_time() - cpu if self.kind == "gil" else self.seconds
        self.spent_s += wall
        self.waited_s += max(0.0, wall - ran)
        self.calls += 1

    def record(self) -> dict[str, Any]:
        """The step as a JSON-able dict: what it was, and its work's rate alone."""
        return {
            "kind": self.kind,
            "seconds": self.seconds,
            "iterations": self.iterations,
            "alone_rate": self.alone_rate,
        }


def step_lost(waited_s: float, spent_s: float) -> float | None:
    """The share of the steps' wall time (``spent_s``) in which they could not run
    (``waited_s``, :class:`TrainingStep`): what a loader took from the training step. None
    where no step ran."""
    return waited_s / spent_s if spent_s > 0 else None


def time_median(fn: Callable[[], object], *, repeats: int = 3, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(
    fn: Callable[[], object],
    *,
    benchmark: str,
    case: str,
    system: str,
    items: int = 0,
    nbytes: int = 0,
    repeats: int = 3,
    warmup: int = 1,
    note: str = "",
) -> Measurement:
    times = time_median(fn, repeats=repeats, warmup=warmup)
    return Measurement(
        benchmark=benchmark,
        case=case,
        system=system,
        seconds=statistics.median(times),
        repeats=times,
        items=items,
        nbytes=nbytes,
        note=note,
    )


def relate(rows: Sequence[Measurement], reference: str) -> list[Measurement]:
    """Each row's throughput as a ratio to the ``reference`` system's in the same case.

    Throughput is items per second where both rows count items (a system may be measured on
    a subset), else the inverse of the time.
    """
    ref = {r.case: r for r in rows if r.system == reference}
    out = []
    for r in rows:
        base = ref.get(r.case)
        ratio = None
        if base is not None and r.seconds > 0:
            if base.items > 0 and r.items > 0 and base.seconds > 0:
                ratio = r.items_per_s / base.items_per_s
            else:
                ratio = base.seconds / r.seconds
        out.append(
            Measurement(**{**asdict(r), "ratio": ratio, "reference": reference if ratio else None})
        )
    return out


def _first_line(cmd: Sequence[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()
    return line[0] if out.returncode == 0 and line else None


def machine_info(path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """CPU, cores, memory, the disk under ``path``, GPU and library versions, for the record."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal"))
    except (OSError, StopIteration):
        pass
    disk = shutil.disk_usage(path)
    libraries: dict[str, str] = {}
    for name in ("fastload", "torch", "numpy", "fsspec", "s3fs", "nvidia-dali-cuda130"):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            continue
    from fastload.reader import native_status

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable_cpus(),  # affinity and cgroup quota: what the run may use
        "memory_bytes": memory,
        "disk_total_bytes": disk.total,
        "disk_free_bytes": disk.free,
        "gpu": _first_line(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        ),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "libraries": libraries,
        "fastload_native": native_status(),
    }


@dataclass
class Report:
    """Rows of one benchmark run plus the machine they ran on."""

    name: str
    rows: list[Measurement] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=machine_info)
    params: dict[str, Any] = field(default_factory=dict)

    def write_json(self, out_dir: str | os.PathLike[str]) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{self.name}.json"
        payload = {
            "benchmark": self.name,
            "params": self.params,
            "machine": self.machine,
            "rows": [
                {
                    **asdict(r),
                    "items_per_s": r.items_per_s if r.items else None,
                    "gb_per_s": r.gb_per_s if r.nbytes else None,
                }
                for r in self.rows
            ],
        }
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(payload, indent=2, allow_nan=False, default=str))
        os.replace(tmp, path)
        return path

    def table(self) -> str:
        extras = list(dict.fromkeys(name for r in self.rows for name in r.extra))
        headers = ["case", "system", "median s", "GB/s", "items/s", "ratio", *extras, "note"]
        body = [
            [
                r.case,
                r.system,
                f"{r.seconds:.3f}",
                f"{r.gb_per_s:.2f}" if r.nbytes else "",
                f"{r.items_per_s:,.0f}" if r.items else "",
                f"{r.ratio:.2f}x {r.reference}" if r.ratio is not None else "",
                *(_figure(r.extra.get(name)) for name in extras),
                r.note,
            ]
            for r in self.rows
        ]
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
        lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
        lines.append("  ".join("-" * w for w in widths))
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in body]
        return "\n".join(line.rstrip() for line in lines)


def _figure(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:.3f}"
