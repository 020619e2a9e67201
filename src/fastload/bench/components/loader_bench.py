"""The whole loader under a training loop: ``fl.DataLoader`` against torch's DataLoader.

Three cases, each with ``workers`` workers and ``batch_size`` per batch for every system,
shuffled, ``persistent_workers=True`` (torch's best case; fastload's threads persist anyway):

* ``memory``: a generic in-memory map-style dataset (uint8 tensors, a small per-sample
  CPU transform: to float, random flip, normalize). ``fl.DataLoader`` hands plain torch
  datasets to torch, so the ratio should be about 1.0: the row shows the wrapper's cost.
* ``jpeg``: a JPEG ImageFolder (``decode_bench.generate``'s images) on local disk, opened
  with ``fl.open_dataset`` and warmed into fastload's cache before anything is timed;
  train preset at ``size`` px. ``fl.DataLoader(decode="cpu", transform=TrainPreset(size))``
  against torch's DataLoader over an ImageFolder-style dataset decoding with Pillow then
  torch ops (the reference, ``decode_bench``'s canonical baseline) and with simplejpeg.
* ``zarr``: a Zarr v3 group (``images`` uint8 rows of ``zarr_row_shape``, chunked by
  ``zarr_chunk_rows`` rows, plus int64 ``labels``) written by zarr-python, warmed into
  fastload's cache; ``fl.DataLoader`` against torch's DataLoader over a map-style dataset
  reading rows with zarr-python (opened in each worker). Each row is a dict of both arrays.

Every system runs in a Python process of its own (so its memory figures are its own); a
case's processes start together, make their loaders, then take turns epoch by epoch, so
drift on a shared machine hits them alike: ``epochs`` rounds with a simulated training
step after each batch (``step``: ``time.sleep(step_ms)``, or as many 256 x 256 matmuls as
took ``step_ms`` in the parent before any system started), then, with
``step_holds_gil``, ``epochs`` rounds with a step that holds the GIL (a pure-Python loop of
as many iterations as took ``step_ms`` alone in the parent, ``runner.TrainingStep``), then
``repeats`` rounds without. Figures per system:

* items/s: samples per second of the epochs without a step (median of ``repeats``);
  ``ratio`` is that over the case's reference (a torch DataLoader peer).
* ``wait_frac``: the share of the step epochs' wall time the training loop spent outside
  the step, i.e. waiting for data, as the benchmark measures it: ``iter()`` included, and
  freeing the previous batch (when ``batch = next(...)`` rebinds the name), which costs
  0.5-1.5 ms a batch here; ``stats_wait_frac``: what
  ``fl.DataLoader.stats()["wait_fraction"]`` says after the same epochs (its clock runs
  inside ``__next__``; everything between two calls, that free included, is the step).
* ``step_ms``: the step as measured, per batch: above ``step_ms`` where the loader's
  threads or processes slow the training loop down (the GIL, the cores);
  ``step_samples_per_s``: samples per second of the epochs with the step.
* with the GIL-holding step, beside those of the step above: ``gil_samples_per_s``,
  ``gil_ratio`` (that over the reference's, with the same step), ``gil_vs_step`` (that over
  the system's own rate with the step above: what holding the GIL in the step costs it),
  ``gil_wait_frac``, and ``gil_step_lost``: the share of the step's wall time in which it
  could not run (its wall time less its thread's CPU time: its rate against its own rate
  alone), i.e. what the loader took from it: threads in the training process take the
  GIL; worker processes do not, but on 2 cores the busy step also needs a core, so they
  take that instead (both count: this is what the step lost).
* ``peak_rss_mb`` and ``peak_pss_mb``: the largest resident (RSS) and proportional (PSS:
  shared pages split between the processes sharing them) memory of the whole process
  tree (the training process plus its DataLoader workers), sampled every
  ``memory_interval_s`` during the epochs; forked workers share pages with their parent,
  which RSS counts once per process and PSS once. The note lists the peak tree RSS of
  each step epoch, to show it stays flat; ``rss_growth``: the last one over the first,
  minus one.
* ``cpu_us_per_sample``: CPU time of the process tree per sample in the epochs without a
  step (median): what a sample costs whatever else the machine runs; on N idle cores
  samples/s can reach at most N / that.

The report's params keep every epoch each process answered (the time spent in ``iter()``,
the first batch, the final ``next()``; the load average) and fastload's ``stats()`` after
each epoch (per-stage seconds), for diagnosis.

Command (full size: 8,192 in-memory samples, 3,000 JPEGs, 8,192 Zarr rows; 5 epochs with
a 20 ms step, 3 without)::

    .venv/bin/python benchmarks/benchmark_loader.py --out fastload-bench
"""

from __future__ import annotations

import importlib
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.utils.data

from fastload.bench.components import decode_bench, zarr_bench
from fastload.bench.runner import (
    Measurement,
    Report,
    TrainingStep,
    cpu_seconds,
    process_tree,
    pss_bytes,
    relate,
    step_lost,
)
from fastload.decode.base import DecodeConfig
from fastload.decode.cpu import CPUDecoder
from fastload.decode.params import TrainPreset

CASES = ("memory", "jpeg", "zarr")
FASTLOAD = "fastload DataLoader"
SAME_DECODER = "torch DataLoader + fastload's decoder"
# Each case's systems, the reference (a torch DataLoader peer) first.
SYSTEMS: dict[str, tuple[str, ...]] = {
    "memory": ("torch DataLoader", FASTLOAD),
    "jpeg": (
        "torch DataLoader + Pillow",
        "torch DataLoader + simplejpeg",
        SAME_DECODER,
        f"{FASTLOAD}, decode='cpu'",
    ),
    "zarr": ("torch DataLoader + zarr-python", FASTLOAD),
}
NOTES = {
    ("memory", "torch DataLoader"): "processes",
    ("memory", FASTLOAD): "hands it to torch: processes",
    ("jpeg", "torch DataLoader + Pillow"): "processes, float32 torch ops",
    ("jpeg", "torch DataLoader + simplejpeg"): "processes, float32 torch ops",
    ("jpeg", SAME_DECODER): "processes, a batch per __getitems__, 1 decode thread each",
    ("jpeg", f"{FASTLOAD}, decode='cpu'"): "threads, from its cache",
    ("zarr", "torch DataLoader + zarr-python"): "processes",
    ("zarr", FASTLOAD): "threads, from its cache",
}
MEMORY_CLASSES = 100
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LoaderBenchConfig:
    batch_size: int = 64
    workers: int = 2  # processes for torch, threads for fastload's fast path
    epochs: int = 5  # epochs with the training step: wait fraction and memory per epoch
    repeats: int = 3  # epochs without a step after those: samples/s (median)
    step: Literal["sleep", "matmul"] = "sleep"
    step_ms: float = 20.0  # the simulated training step per batch
    step_holds_gil: bool = True  # also `epochs` epochs with a step that holds the GIL
    cases: tuple[str, ...] = CASES
    memory_samples: int = 8192
    memory_shape: tuple[int, ...] = (3, 64, 64)
    images: int = 3000
    size: int = 224
    zarr_rows: int = 8192
    zarr_row_shape: tuple[int, ...] = (64, 64, 3)
    zarr_chunk_rows: int = 64
    seed: int = 0
    memory_interval_s: float = 0.05  # RSS sampling period (PSS every fifth sample)
    timeout_s: float = 600.0  # for each answer of a system's process (an epoch, its start)

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "epochs",
            "repeats",
            "memory_samples",
            "images",
            "size",
            "zarr_rows",
            "zarr_chunk_rows",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.step not in ("sleep", "matmul"):
            raise ValueError(f"step must be 'sleep' or 'matmul', got {self.step!r}")
        if self.step_ms <= 0 or self.memory_interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("step_ms, memory_interval_s and timeout_s must be > 0")
        unknown = set(self.cases) - set(CASES)
        if unknown or not self.cases:
            raise ValueError(f"cases must be among {CASES}, got {self.cases}")
        if any(n <= 0 for n in (*self.memory_shape, *self.zarr_row_shape)):
            raise ValueError("every length of memory_shape and zarr_row_shape must be > 0")

    @classmethod
    def quick(cls) -> LoaderBenchConfig:
        """Small sizes, the configured step only (the GIL-holding one is in the full run)."""
        return cls(memory_samples=2048, images=320, zarr_rows=1024, step_holds_gil=False)


# --- data (made by the parent, before any system runs) ----------------------------------------


def _prepare(data_dir: Path, config: LoaderBenchConfig) -> dict[str, Any]:
    """Generates each case's data once (kept between runs) and warms fastload's cache."""
    from fastload.datasets import open_dataset

    root = data_dir / "loader"
    cache = root / "cache"
    data: dict[str, Any] = {"cache_dir": str(cache), "nbytes": {}}
    if "memory" in config.cases:
        data["nbytes"]["memory"] = config.memory_samples * int(np.prod(config.memory_shape))
    if "jpeg" in config.cases:
        folder = root / f"jpeg-{config.images}"  # its own folder: a listing sees only these
        paths = decode_bench.generate(folder, decode_bench.DecodeBenchConfig(images=config.images))
        data["jpeg_dir"] = str(folder)
        data["nbytes"]["jpeg"] = sum(p.stat().st_size for p in paths)
        with open_dataset(str(folder), format="imagefolder", cache_dir=str(cache)) as ds:
            ds.warm()
    if "zarr" in config.cases:
        shape = "x".join(map(str, config.zarr_row_shape))
        where = root / f"zarr-{config.zarr_rows}-{shape}-{config.zarr_chunk_rows}"
        path = zarr_bench.generate(
            where,
            zarr_bench.ZarrBenchConfig(
                rows=config.zarr_rows,
                row_shape=config.zarr_row_shape,
                chunk_rows=config.zarr_chunk_rows,
                sample_rows=1,
                seed=config.seed,
            ),
        )
        data["zarr_dir"] = str(path)
        data["nbytes"]["zarr"] = config.zarr_rows * (int(np.prod(config.zarr_row_shape)) + 8)
        with open_dataset(str(path), format="zarr", cache_dir=str(cache)) as ds:
            ds.warm()
            _check_zarr_rows(ds, path)
    return data


def _check_zarr_rows(ds: Any, path: Path) -> None:
    """fastload's loader and zarr-python must agree on the rows before speed means anything."""
    import zarr

    from fastload.loader import DataLoader

    group: Any = zarr.open_group(str(path), mode="r")
    rows = min(8, len(ds))
    loader = DataLoader(ds, batch_size=rows, shuffle=False, num_workers=0)
    with loader:
        batch = next(iter(loader))
    for name in ("images", "labels"):
        want = torch.from_numpy(np.asarray(group[name][:rows]))
        if not torch.equal(batch[name], want):
            raise AssertionError(f"fl.DataLoader and zarr-python disagree on {name} of {path}")


# --- the datasets of the torch peers ------------------------------------------------------------


class InMemoryTensors(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """uint8 CHW tensors in memory; each sample goes to float, maybe flipped, normalized."""

    def __init__(self, samples: int, shape: tuple[int, ...], seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, 256, (samples, *shape), dtype=torch.uint8, generator=generator)
        self.labels = torch.randint(0, MEMORY_CLASSES, (samples,), generator=generator)
        self.mean = torch.full((shape[0], *([1] * (len(shape) - 1))), 0.45)
        self.std = torch.full_like(self.mean, 0.225)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data[i].float().div_(255)
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x.sub_(self.mean).div_(self.std), self.labels[i]


class ZarrRows(torch.utils.data.Dataset[dict[str, Any]]):
    """Rows of a Zarr group as zarr-python reads them: ``{"images": row, "labels": label}``.

    The group is opened in each worker process on first use (zarr-python's event loop
    thread must not be inherited through fork); its length is given, not read.
    """

    def __init__(self, path: str, rows: int) -> None:
        self.path = path
        self.rows = rows
        self._arrays: tuple[Any, Any] | None = None

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._arrays is None:
            import zarr

            group: Any = zarr.open_group(self.path, mode="r")
            self._arrays = (group["images"], group["labels"])
        images, labels = self._arrays
        return {"images": images[i], "labels": labels[i]}


# --- one system, in its own process -----------------------------------------------------------


def _loader(spec: dict[str, Any]) -> torch.utils.data.DataLoader[Any]:
    """The DataLoader of ``spec["system"]`` for ``spec["case"]``, as a user would write it."""
    config = LoaderBenchConfig(**_tuples(spec["config"]))
    case, system, data = spec["case"], spec["system"], spec["data"]
    common: dict[str, Any] = {
        "batch_size": config.batch_size,
        "shuffle": True,
        "num_workers": config.workers,
        "persistent_workers": config.workers > 0,
    }
    fastload = system.startswith(FASTLOAD)
    DataLoader: Callable[..., torch.utils.data.DataLoader[Any]] = torch.utils.data.DataLoader
    if fastload:
        from fastload.loader import DataLoader
    dataset: Any
    if case == "memory":
        dataset = InMemoryTensors(config.memory_samples, config.memory_shape, config.seed)
        return DataLoader(dataset, **common)
    if case == "jpeg":
        preset = TrainPreset(config.size)
        if fastload:
            from fastload.datasets import open_dataset

            dataset = open_dataset(
                data["jpeg_dir"], format="imagefolder", cache_dir=data["cache_dir"]
            )
            return DataLoader(dataset, decode="cpu", transform=preset, seed=config.seed, **common)
        paths = sorted(Path(data["jpeg_dir"]).glob("class_*/*.jpg"))
        if len(paths) != config.images:
            raise FileNotFoundError(
                f"{data['jpeg_dir']} holds {len(paths)} JPEGs, expected {config.images}; "
                "run the benchmark through loader_bench.run, which generates them"
            )
        if system == SAME_DECODER:
            return DataLoader(DecodedFiles(paths, preset, config.seed), **common)
        read = decode_bench.pillow_rgb if system.endswith("Pillow") else decode_bench.simplejpeg_rgb
        dataset = decode_bench.ImageFiles(paths, preset, read)
        return DataLoader(dataset, **common)
    if fastload:
        from fastload.datasets import open_dataset

        dataset = open_dataset(data["zarr_dir"], format="zarr", cache_dir=data["cache_dir"])
        return DataLoader(dataset, seed=config.seed, **common)
    return DataLoader(ZarrRows(data["zarr_dir"], config.zarr_rows), **common)


class DecodedFiles(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Image files through fastload's CPU decoder in each worker process, a whole batch per
    call (torch's fetcher calls ``__getitems__`` with the batch's indices): the peer that
    runs fastload's decoder in torch's DataLoader, as a careful user would."""

    def __init__(self, paths: list[Path], preset: TrainPreset, seed: int) -> None:
        self.paths, self.preset, self.seed = paths, preset, seed
        self._decoder: CPUDecoder | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        if self._decoder is None:  # made in the worker process
            config = DecodeConfig(transform=self.preset, seed=self.seed, num_threads=1)
            self._decoder = CPUDecoder(config)
        data = [self.paths[i].read_bytes() for i in indices]
        images = self._decoder.decode(data, indices=indices).images
        return [
            (images[k], int(self.paths[i].parent.name.split("_")[1])) for k, i in enumerate(indices)
        ]


def _samples_in(batch: Any, case: str, config: LoaderBenchConfig) -> int:
    """How many samples a batch holds, after checking it has the case's shape."""
    if case == "zarr":
        images, labels = batch["images"], batch["labels"]
        row = config.zarr_row_shape
    else:
        images, labels = batch
        row = config.memory_shape if case == "memory" else (3, config.size, config.size)
    n = len(labels)
    if tuple(images.shape) != (n, *row):
        raise AssertionError(f"{case}: a batch of {n} has images of shape {tuple(images.shape)}")
    return n


_MATMUL_SIZE = 256


def matmuls_for(step_ms: float) -> int:
    """How many 256 x 256 float32 matmuls take ``step_ms`` here, now (best of 5 timings),
    measured once by the parent so every system runs the same step."""
    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        best = min(best, (time.perf_counter() - start) / 10)
    return max(1, round(step_ms / 1000 / best))


def _training_step(config: LoaderBenchConfig, matmuls: int) -> Callable[[], None]:
    """The simulated step: a sleep, or ``matmuls`` matmuls (the cores, as a CPU step uses)."""
    seconds = config.step_ms / 1000
    if config.step == "sleep":
        return TrainingStep("sleep", seconds)
    a = torch.randn(_MATMUL_SIZE, _MATMUL_SIZE)

    def step() -> None:
        for _ in range(matmuls):
            a @ a

    return step


class MemorySampler:
    """Samples the RSS (and every tenth time the PSS) of this process plus every process
    below it, on a thread, while an epoch runs: ``begin()`` and ``end()`` bracket one and
    ``end()`` returns its peak RSS. Idle between epochs, so a system waiting for its turn
    costs the others nothing."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.peak_rss = 0
        self.peak_pss = 0
        self._epoch_peak = 0
        self._lock = threading.Lock()
        self._active = threading.Event()
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            if not self._active.wait(self.interval_s):
                continue
            self.sample(pss=tick % 10 == 0)  # PSS costs milliseconds of kernel time
            tick += 1
            self._stop.wait(self.interval_s)

    def sample(self, *, pss: bool = True) -> None:
        pids = process_tree(os.getpid())
        rss = sum(self._rss(pid) for pid in pids)
        total_pss = sum(pss_bytes(pid) for pid in pids) if pss else 0
        with self._lock:
            self.peak_rss = max(self.peak_rss, rss)
            self.peak_pss = max(self.peak_pss, total_pss)
            self._epoch_peak = max(self._epoch_peak, rss)

    def _rss(self, pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, IndexError, ValueError):
            return 0  # the process ended between listing and reading

    def begin(self) -> None:
        with self._lock:
            self._epoch_peak = 0
        self.sample()
        self._active.set()

    def end(self) -> int:
        self._active.clear()
        self.sample()
        with self._lock:
            return self._epoch_peak

    def close(self) -> None:
        self._stop.set()
        self._active.set()
        self._thread.join(timeout=5)


class SystemRun:
    """One system in its own process: its loader, made once, runs an epoch when asked."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.config = LoaderBenchConfig(**_tuples(spec["config"]))
        self.case = spec["case"]
        self.expected = {
            "memory": self.config.memory_samples,
            "jpeg": self.config.images,
            "zarr": self.config.zarr_rows,
        }[self.case]
        self.step = _training_step(self.config, int(spec["data"].get("matmuls", 0)))
        self.gil_step = None  # the same work in every system: calibrated by the parent
        if "gil_rate" in spec["data"]:
            self.gil_step = TrainingStep(
                "gil",
                self.config.step_ms / 1000,
                iterations=spec["data"]["gil_iterations"],
                alone_rate=spec["data"]["gil_rate"],
            )
        self.memory = MemorySampler(self.config.memory_interval_s)
        start = time.perf_counter()
        self.loader = _loader(spec)
        self.startup_s = time.perf_counter() - start

    def epoch(self, step_kind: str | None) -> dict[str, Any]:
        """One pass over the loader, with a training step after each batch (``"gil"``: the
        GIL-holding one; any other: the configured one) or without (None); where the loop
        waited and the epoch's peak memory."""
        step = None if step_kind is None else self.step
        if step_kind == "gil":
            if self.gil_step is None:
                raise ValueError("a GIL-holding step was asked for, but none was calibrated")
            step = self.gil_step
        samples, stepping, waiting, first_s, end_s = 0, 0.0, 0.0, 0.0, 0.0
        waited_before = getattr(step, "waited_s", 0.0)  # a TrainingStep's time not running
        self.memory.begin()
        cpu_before = cpu_seconds(process_tree(os.getpid()))
        start = time.perf_counter()
        batches = iter(self.loader)
        iter_s = time.perf_counter() - start
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                end_s = time.perf_counter() - asked
                break
            got = time.perf_counter()
            waiting += got - asked
            if samples == 0:
                first_s = got - asked
            samples += _samples_in(batch, self.case, self.config)
            if step is not None:
                before = time.perf_counter()
                step()
                stepping += time.perf_counter() - before
        seconds = time.perf_counter() - start
        cpu_after = cpu_seconds(process_tree(os.getpid()))
        peak_rss = self.memory.end()
        if samples != self.expected:
            raise AssertionError(f"{self.case}: {samples} samples in an epoch, not {self.expected}")
        stats = getattr(self.loader, "stats", None)
        return {
            "seconds": seconds,
            "step_s": stepping,
            "step_waited_s": getattr(step, "waited_s", 0.0) - waited_before,
            "samples": samples,
            "batches_s": waiting,  # inside next() for a batch
            # CPU seconds of the process tree (workers too), sleeping steps cost none
            "cpu_s": sum(t - cpu_before.get(pid, 0.0) for pid, t in cpu_after.items()),
            # Where the loop waits at an epoch's edges: iter(), the first batch, the final
            # next() that ends the epoch.
            "iter_s": iter_s,
            "first_batch_s": first_s,
            "end_s": end_s,
            "peak_rss": peak_rss,
            "load_avg_1m": os.getloadavg()[0],  # how busy the machine was
            "stats": stats() if callable(stats) else None,
        }

    def finish(self) -> dict[str, Any]:
        close = getattr(self.loader, "close", None)
        if callable(close):
            close()
        iterator = getattr(self.loader, "_iterator", None)  # torch's persistent workers
        if iterator is not None:
            iterator._shutdown_workers()
        self.memory.close()
        return {
            "startup_s": self.startup_s,
            "peak_rss": self.memory.peak_rss,
            "peak_pss": self.memory.peak_pss,
        }


def _tuples(config: dict[str, Any]) -> dict[str, Any]:
    """A config from JSON: lists back to tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


_REPLY = "loader-bench-reply "


def child_main() -> None:
    """A system's process: builds its loader, then answers the parent's commands (one JSON
    line each on stdin: ``{"do": "epoch", "step": "sleep" | "matmul" | "gil" | null}`` or
    ``{"do": "finish"}``) with one JSON line each. Anything else written to stdout goes to
    stderr instead."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(value: dict[str, Any]) -> None:
        replies.write(_REPLY + json.dumps(value) + "\n")
        replies.flush()

    system = SystemRun(json.loads(Path(sys.argv[1]).read_text()))
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "finish":
            reply(system.finish())
            return
        reply(system.epoch(command["step"]))


class _Child:
    """The parent's handle on a system's process; every answer has a deadline."""

    def __init__(self, spec: dict[str, Any], timeout_s: float) -> None:
        self.name = f"{spec['system']} ({spec['case']})"
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="fastload-loader-bench-")
        spec_path = Path(self._tmp.name) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        self._stderr = open(Path(self._tmp.name) / "stderr", "w+b")  # noqa: SIM115
        code = "from fastload.bench.components.loader_bench import child_main; child_main()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code, str(spec_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self._buffer = b""

    def ask(self, command: dict[str, Any] | None) -> dict[str, Any]:
        """Sends ``command`` (None: nothing, e.g. to wait for "ready") and returns the answer."""
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        if command is not None:
            try:
                self._proc.stdin.write((json.dumps(command) + "\n").encode())
                self._proc.stdin.flush()
            except BrokenPipeError:
                raise self._failure("exited early") from None
        deadline = time.monotonic() + self.timeout_s
        fd = self._proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                if line.startswith(_REPLY.encode()):
                    answer: dict[str, Any] = json.loads(line[len(_REPLY) :])
                    return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(
                    f"did not answer {command or 'at start'} within {self.timeout_s:g} s; raise "
                    "LoaderBenchConfig.timeout_s or use a smaller config"
                )
            readable, _, _ = select.select([fd], [], [], left)
            if readable:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise self._failure("exited early")
                self._buffer += chunk

    def _failure(self, what: str) -> RuntimeError:
        self._proc.kill()
        code = self._proc.wait(timeout=30)
        self._stderr.seek(0)
        tail = "\n".join(self._stderr.read().decode(errors="replace").strip().splitlines()[-15:])
        return RuntimeError(f"{self.name} {what} (exit code {code}):\n{tail}")

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait(timeout=30)
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        self._stderr.close()
        self._tmp.cleanup()


def _measure_case(
    case: str, data: dict[str, Any], config: LoaderBenchConfig
) -> dict[str, dict[str, Any]]:
    """Every system of ``case`` in a process of its own, all started at once, then taking
    turns epoch by epoch (drift on a shared machine hits them alike): ``epochs`` rounds
    with the step, as many with the GIL-holding one where asked, ``repeats`` without."""
    children: dict[str, _Child] = {}
    try:
        for system in SYSTEMS[case]:
            spec = {"case": case, "system": system, "config": asdict(config), "data": data}
            children[system] = _Child(spec, config.timeout_s)
        for child in children.values():
            child.ask(None)  # its loader is made
        kinds = {config.step: "epochs", "gil": "gil_epochs", None: "plain"}
        results: dict[str, dict[str, Any]] = {s: {k: [] for k in kinds.values()} for s in children}
        rounds: list[str | None] = [config.step] * config.epochs
        rounds += ["gil"] * (config.epochs if config.step_holds_gil else 0)
        rounds += [None] * config.repeats
        for kind in rounds:
            for system, child in children.items():
                answer = child.ask({"do": "epoch", "step": kind})
                results[system][kinds[kind]].append(answer)
        for system, child in children.items():
            results[system].update(child.ask({"do": "finish"}))
        return results
    finally:
        for child in children.values():
            child.close()


# --- run --------------------------------------------------------------------------------------

_CASE_TITLES = {
    "memory": "(a) in-memory tensors",
    "jpeg": "(b) cached JPEG folder, train",
    "zarr": "(c) Zarr uint8 rows",
}


def _case_title(case: str, config: LoaderBenchConfig) -> str:
    detail = {
        "memory": f"{config.memory_samples:,} x {'x'.join(map(str, config.memory_shape))}",
        "jpeg": f"{config.images:,} images, {config.size} px",
        "zarr": f"{config.zarr_rows:,} x {'x'.join(map(str, config.zarr_row_shape))}, "
        f"{config.zarr_chunk_rows}-row chunks",
    }[case]
    return f"{_CASE_TITLES[case]} ({detail})"


def _with_step(epochs: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
    """What epochs with a step after each batch show: samples/s, the share of the time
    the loop waited outside the step, the step as measured (seconds per batch), and the
    share of the step's time in which it could not run (``runner.step_lost``; None for
    a step that does not count it)."""
    wall = sum(e["seconds"] for e in epochs)
    stepping = sum(e["step_s"] for e in epochs)
    batches = sum(-(-e["samples"] // batch_size) for e in epochs)
    return {
        "samples_per_s": sum(e["samples"] for e in epochs) / wall if wall > 0 else 0.0,
        "wait_frac": 1 - stepping / wall if wall > 0 else 0.0,
        "step_s": stepping / batches if batches else 0.0,
        "step_lost": step_lost(sum(e.get("step_waited_s", 0.0) for e in epochs), stepping),
    }


def _gil_figures(
    result: dict[str, Any], step: dict[str, Any], reference_gil: float | None
) -> dict[str, float]:
    """The GIL-holding step's figures of one system, beside those of its configured step."""
    gil = _with_step(result["gil_epochs"], result["batch_size"])
    extra = {
        "gil_samples_per_s": round(gil["samples_per_s"], 1),
        "gil_vs_step": round(gil["samples_per_s"] / step["samples_per_s"], 3),
        "gil_wait_frac": round(gil["wait_frac"], 4),
    }
    if reference_gil:
        extra["gil_ratio"] = round(gil["samples_per_s"] / reference_gil, 3)
    if gil["step_lost"] is not None:
        extra["gil_step_lost"] = round(gil["step_lost"], 4)
    return extra


def _row(
    case: str,
    title: str,
    system: str,
    result: dict[str, Any],
    nbytes: int,
    reference_gil: float | None,
) -> Measurement:
    step_epochs, plain = result["epochs"], result["plain"]
    samples = step_epochs[0]["samples"]
    step = _with_step(step_epochs, result["batch_size"])
    extra: dict[str, float] = {"wait_frac": round(step["wait_frac"], 4)}
    fl_stats = step_epochs[-1]["stats"]
    if fl_stats is not None:
        extra["stats_wait_frac"] = round(float(fl_stats["wait_fraction"]), 4)
    extra["step_ms"] = round(step["step_s"] * 1000, 2)  # the step as measured, per batch
    extra["step_samples_per_s"] = round(step["samples_per_s"], 1)
    if step["step_lost"] is not None:  # the sleeping step: time past its sleep
        extra["step_lost"] = round(step["step_lost"], 4)
    if result["gil_epochs"]:
        extra.update(_gil_figures(result, step, reference_gil))
    extra["peak_rss_mb"] = round(result["peak_rss"] / MB)
    extra["peak_pss_mb"] = round(result["peak_pss"] / MB)
    peaks = [e["peak_rss"] for e in step_epochs]
    if peaks[0] > 0:
        extra["rss_growth"] = round(peaks[-1] / peaks[0] - 1, 4) + 0.0  # no "-0"
    per_epoch = "/".join(str(round(p / MB)) for p in peaks)
    times = [e["seconds"] for e in plain]
    # What a sample costs in CPU time, all processes together: steadier than wall time on a
    # busy machine, and the ceiling of samples/s on N free cores is N / this.
    cpu_s = statistics.median(e["cpu_s"] for e in plain)
    extra["cpu_us_per_sample"] = round(cpu_s / samples * 1e6, 1)
    return Measurement(
        benchmark="loader",
        case=title,
        system=system,
        seconds=statistics.median(times),
        repeats=times,
        items=samples,
        nbytes=nbytes,
        note=f"{NOTES.get((case, system), '')}; RSS MB by epoch {per_epoch}",
        extra=extra,
    )


def run(data_dir: str | os.PathLike[str], config: LoaderBenchConfig | None = None) -> Report:
    config = config or LoaderBenchConfig()
    if "zarr" in config.cases:
        importlib.import_module("zarr")  # the peer: fail now, not in a child
    data = _prepare(Path(data_dir), config)
    if config.step == "matmul":
        data["matmuls"] = matmuls_for(config.step_ms)
    if config.step_holds_gil:
        gil_step = TrainingStep("gil", config.step_ms / 1000)  # its rate alone, before any system
        data.update(gil_iterations=gil_step.iterations, gil_rate=gil_step.alone_rate)
    report = Report(name="loader", params={**asdict(config), "data_dir": str(data_dir)})
    # Per case and system, everything its process answered: each epoch's timings, edges,
    # peak RSS and the machine's load, and for fastload its stats() after every epoch.
    details: dict[str, dict[str, Any]] = {}
    rows: list[Measurement] = []
    for case in config.cases:
        title = _case_title(case, config)
        results = _measure_case(case, data, config)
        for result in results.values():
            result["batch_size"] = config.batch_size
        details[case] = results
        reference = results[SYSTEMS[case][0]]
        reference_gil = None
        if reference["gil_epochs"]:
            reference_gil = _with_step(reference["gil_epochs"], config.batch_size)["samples_per_s"]
        measured = [
            _row(case, title, system, result, data["nbytes"][case], reference_gil)
            for system, result in results.items()
        ]
        rows += relate(measured, SYSTEMS[case][0])
    report.params["details"] = details
    report.rows = rows
    return report


def configured(base: LoaderBenchConfig, **overrides: Any) -> LoaderBenchConfig:
    """``base`` with the given fields replaced, skipping those given as None."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
