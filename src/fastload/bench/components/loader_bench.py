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

The parts: :mod:`.loader_bench_setup` (settings, systems, data) and
:mod:`.loader_bench_child` (one system's process); this module runs the cases and makes
the rows.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastload.bench.components.loader_bench_child import (
    REPLY,
    MemorySampler,
    _training_step,
    child_main,
    matmuls_for,
)
from fastload.bench.components.loader_bench_setup import (
    CASES,
    MB,
    NOTES,
    SYSTEMS,
    LoaderBenchConfig,
    configured,
    prepare,
)
from fastload.bench.runner import (
    Measurement,
    Report,
    TrainingStep,
    relate,
    step_lost,
)
from fastload.staging.child_pipe import readable_within
from fastload.staging.lifetime import env_for_child


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
            env=env_for_child(),  # ends with this process, its loader workers after it
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
                if line.startswith(REPLY.encode()):
                    answer: dict[str, Any] = json.loads(line[len(REPLY) :])
                    return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._failure(
                    f"did not answer {command or 'at start'} within {self.timeout_s:g} s; raise "
                    "LoaderBenchConfig.timeout_s or use a smaller config"
                )
            if readable_within(fd, left):
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
    data = prepare(Path(data_dir), config)
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


# What callers and the tests use, wherever it is defined; ``child_main`` is what a system's
# process runs (by this module's name).
__all__ = [
    "CASES",
    "LoaderBenchConfig",
    "MemorySampler",
    "Report",
    "_training_step",
    "child_main",
    "configured",
    "matmuls_for",
    "run",
]
