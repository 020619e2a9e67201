"""One system of the loader benchmark in a process of its own: its loader (fastload's, or
torch's over the peers' datasets), the training step, the memory sampler, and the epochs
it runs when the parent says so, answered as JSON lines."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from fastload.bench.components import decode_bench
from fastload.bench.components.loader_bench_setup import (
    FASTLOAD,
    MEMORY_CLASSES,
    SAME_DECODER,
    LoaderBenchConfig,
)
from fastload.bench.runner import (
    TrainingStep,
    cpu_seconds,
    process_tree,
    pss_bytes,
)
from fastload.decode.base import DecodeConfig
from fastload.decode.cpu import CPUDecoder
from fastload.decode.params import TrainPreset


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


REPLY = "loader-bench-reply "


def child_main() -> None:
    """A system's process: builds its loader, then answers the parent's commands (one JSON
    line each on stdin: ``{"do": "epoch", "step": "sleep" | "matmul" | "gil" | null}`` or
    ``{"do": "finish"}``) with one JSON line each. Anything else written to stdout goes to
    stderr instead."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(value: dict[str, Any]) -> None:
        replies.write(REPLY + json.dumps(value) + "\n")
        replies.flush()

    system = SystemRun(json.loads(Path(sys.argv[1]).read_text()))
    reply({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "finish":
            reply(system.finish())
            return
        reply(system.epoch(command["step"]))
