"""Cold epochs against warm ones, fastload alone, and where a cold epoch's CPU goes.

The end-to-end benchmark's fastload runs (:mod:`fastload.bench.e2e.e2e_bench`: the same
generated data, S3 server, latency, bandwidth, step and child process) on the layouts
asked for, each step kind, ``repeats`` times alternated, reporting per run: cold and warm
samples/s and their ratio (P6), the first batch, the open (listing, a tar dataset's
indexing), and the CPU seconds of each epoch split by process: the training process, its
staging process, and the S3 server (which shares the cores, as a real remote does not). On
2 cores a cold epoch is CPU-bound: its ratio cannot pass warm CPU / (warm CPU + what
staging and the server add), which the report gives as ``cpu bound``.

``boost`` weights the measured process tree as nice -20 against the machine's other
sessions (Linux autogroups; root): on a busy shared machine, near-quiet figures for a short
run (a 2-core VM at load 20 gave a warm folder epoch 1,053 samples/s boosted, ~200 not).

Command (about a minute a layout and step)::

    .venv/bin/python benchmarks/benchmark_cold.py --layout folder --layout tar \
        --layout parquet --step-holds-gil --boost
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fastload.bench.e2e import e2e_bench
from fastload.bench.e2e.e2e_data import generate, with_parquet
from fastload.bench.e2e.e2e_process import run_child
from fastload.bench.runner import process_tree
from fastload.testing import RemoteBehavior, S3FolderServer

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_SAMPLE_S = 0.05


def _cpu_by_kind(parent: int) -> dict[str, float]:
    """CPU seconds of the trees of parent's children, by kind: the measured training
    process ("training") and its staging process ("staging")."""
    found: dict[str, float] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and _field(int(name), 1) == parent:
            for pid in process_tree(int(name)):
                try:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                kind = "staging" if b"staging.process_main" in command else "training"
                ticks = (_field(pid, 11) or 0) + (_field(pid, 12) or 0)
                found[kind] = found.get(kind, 0.0) + ticks / _CLOCK_TICKS
    return found


def _field(pid: int, index: int) -> int | None:
    """Field ``index`` of /proc/pid/stat after the command (1: ppid, 11: utime, 12: stime)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text.rsplit(")", 1)[1].split()[index])


class _CpuSampler:
    """Samples :func:`_cpu_by_kind` of this process's children while a run goes on."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cold-cpu", daemon=True)

    def __enter__(self) -> _CpuSampler:
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            self.samples.append((time.perf_counter() - self.start, _cpu_by_kind(os.getpid())))

    def at(self, at_s: float) -> dict[str, float]:
        """The last sample taken by ``at_s`` seconds into the run."""
        last: dict[str, float] = {}
        for when, cpu in self.samples:
            if when > at_s:
                break
            last = cpu
        return last


def _boosting_python(work: Path) -> str:
    """A script that runs this Python with its session weighted as nice -20."""
    script = work / "boosted-python"
    script.write_text(
        f'#!/bin/sh\necho -20 > /proc/self/autogroup 2>/dev/null\nexec {sys.executable} "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def run(
    out_dir: str | os.PathLike[str],
    layouts: tuple[str, ...] = ("folder", "tar", "parquet"),
    steps: tuple[str, ...] = ("sleep",),
    repeats: int = 1,
    boost: bool = False,
    config: e2e_bench.E2EConfig | None = None,
) -> list[dict[str, Any]]:
    """One row per (repeat, layout, step); see the module docstring."""
    config = dataclasses.replace(
        config or e2e_bench.E2EConfig(), resume=False, steps=steps, layouts=layouts
    )
    if boost:
        try:
            Path("/proc/self/autogroup").write_text("-20")  # the server's share
        except OSError as e:  # not Linux, no autogroups, or not permitted: unweighted
            print(f"--boost: cannot weight this session ({e}); figures are unboosted")
    out = Path(out_dir)
    data = generate(out / "data" / f"e2e-{config.data.samples}", config.data)
    if "parquet" in layouts:
        data = with_parquet(data, config.data)
    local = {"folder": data.folder, "tar": data.tar, "zarr": data.zarr, "parquet": data.parquet}
    work = out / "work" / "cold"
    work.mkdir(parents=True, exist_ok=True)
    python = _boosting_python(work) if boost else sys.executable
    busy = e2e_bench._busy_iterations(config)
    rows: list[dict[str, Any]] = []
    with S3FolderServer(work / "s3") as server:
        for layout in layouts:
            path = local[layout]
            if path is None:
                raise ValueError(f"no {layout} layout: its package (zarr, pyarrow) is missing")
            e2e_bench.upload(server, path, layout)
        server.set_behavior(
            RemoteBehavior(
                latency_s=config.latency_s, bandwidth_bytes_per_s=config.bandwidth_bytes_per_s
            )
        )
        for repeat in range(repeats):
            for layout in layouts:
                for step in steps:
                    run_dir = work / f"{layout}-{step}-{repeat + 1}"
                    spec = e2e_bench._spec(
                        config, e2e_bench.FASTLOAD, layout, step, f"s3://{e2e_bench.BUCKET}/{layout}",
                        storage_options=server.storage_options, endpoint_url=server.endpoint_url,
                        work_dir=str(run_dir / "data"), samples=data.samples,
                        step_iterations=busy,
                    )  # fmt: skip
                    with _CpuSampler() as cpu:
                        one = run_child(python, spec, run_dir, server, config.run_timeout_s)
                    rows.append(_row(one, cpu, layout, step, repeat))
                    print(line(rows[-1]), flush=True)
    return rows


def _row(one: Any, cpu: _CpuSampler, layout: str, step: str, repeat: int) -> dict[str, Any]:
    row: dict[str, Any] = {"layout": layout, "step": step, "repeat": repeat + 1}
    if one.status != "ok":
        return {**row, "failed": one.note}
    result = one.result
    epochs = result["epochs"]
    cold, warm = epochs[0], epochs[1:]
    warm_rate = sum(e["samples"] for e in warm) / sum(e["seconds"] for e in warm)
    # CPU per epoch by process, between the child's marks (the first from its start: its
    # interpreter's imports are in it).
    spans, before = [], cpu.at(0.0)
    for mark in one.marks:
        now = cpu.at(mark["at_s"])
        spans.append({k: round(now.get(k, 0.0) - before.get(k, 0.0), 2) for k in now})
        before = now
    row.update(
        cold_per_s=cold["samples"] / cold["seconds"],
        warm_per_s=warm_rate,
        ratio=cold["samples"] / cold["seconds"] / warm_rate,
        first_batch_s=cold["first_batch_s"],
        open_s=result["open_s"],
        cpu_by_epoch=spans,
        server_cpu_s=one.server_cpu_s,
        requests=one.remote_requests,
        load=os.getloadavg()[0],
    )
    return row


def line(row: dict[str, Any]) -> str:
    where = f"{row['layout']:8s} {row['step']:5s} #{row['repeat']}"
    if "failed" in row:
        return f"{where} failed: {row['failed']}"
    spans = row["cpu_by_epoch"]
    cold_cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(spans[0].items())) if spans else "?"
    warm = [s.get("training", 0.0) for s in spans[1:]]
    warm_cpu = sum(warm) / len(warm) if warm else float("nan")
    return (
        f"{where} cold {row['cold_per_s']:6.0f}/s warm {row['warm_per_s']:6.0f}/s "
        f"ratio {row['ratio']:.2f}  first batch {row['first_batch_s']:.2f} s, open "
        f"{row['open_s']:.2f} s; CPU s: cold epoch (with start-up) {cold_cpu}, server "
        f"{row['server_cpu_s'] or 0:.2f}; warm epoch training {warm_cpu:.2f}; load "
        f"{row['load']:.1f}"
    )
