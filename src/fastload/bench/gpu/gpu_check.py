"""One command for a GPU machine: decode throughput on every backend, host->device bandwidth,
and whether the copies hide behind a training step.

Command (needs no network; meant to take under 4 minutes on one H200 with 16 cores, every
section; ``--quick`` for a smoke run of a minute or so)::

    benchmarks/gpu_check.sh [--quick] [--out DIR]
    .venv/bin/python -m fastload.bench.gpu.gpu_check [--quick] [--out DIR]   # the same, directly

It generates its own JPEGs (``files`` of them, like ``decode_bench``'s: 400-500 x 350-500 px,
quality 90, ImageFolder layout) under ``DIR/data`` and keeps them, writes
``DIR/gpu_check.json`` (with the machine) and prints a table per section. Exit status: 0 all
measured, 1 something failed (the others are still measured and written; the failures are in
the JSON's ``params.failures``), 2 no CUDA device or bad usage.

Sections:

* ``decode``: the train preset (RandomResizedCrop + flip + normalize to float32) at ``size``
  px, ``batch_size`` per batch, ``images`` per epoch (the files, cycled), encoded bytes in
  memory, images/s as a ratio to DALI's own pipeline:

  - ``fastload DALI, mixed``: :class:`~fastload.decode.dali.DALIDecoder` on the GPU (nvJPEG
    and the hardware JPEG decoder);
  - ``fastload CPU``: :class:`~fastload.decode.cpu.CPUDecoder`, one thread per core;
  - ``fastload CPU decode, GPU transforms``: the same decode, crop/resize/normalize on CUDA;
  - ``DALI's own mixed pipeline`` (reference): ``readers.file`` (from the page cache) +
    ``decoders.image_random_crop(device="mixed")`` + ``resize`` + ``crop_mirror_normalize``.

* ``copy``: host->device GB/s for one float32 train batch (N, 3, size, size), as a ratio to
  a pinned torch tensor (the peak): from pageable memory, from a slot of
  :class:`~fastload.loader.ring.DeviceRing` (page-aligned, ``cudaHostRegister``-ed), and through the
  whole ring (a producer thread packs batches, the consumer takes them; and batches written
  straight into a lent slot, as the CPU decoder writes them: no pack).

* ``overlap``: a simulated training step (a bf16 matmul loop of about ``step_ms``, reading
  the batch) fed by: data already on the GPU (reference), a pageable copy before each step
  (no overlap), the DeviceRing in a producer thread, decoding inline before each step
  (``decode="auto"``), and ``fastload.DataLoader(device="cuda")`` with ``decode="auto"``
  (DALI on the GPU, fed ahead) and ``decode="cpu"`` (the host decoder writing into the
  ring's pinned slots), each alone (no step) and feeding the step. Steps/s as a ratio to
  the reference: 1.0 means the data path is fully hidden; P8 asks the fed step to take at
  most 1.1x the longer of the step alone and the loader alone.

* ``ranks``: ``fl.DataLoader(decode="auto")`` in 1 and N rank processes at once
  (:mod:`.ranks`; N a rank per GPU, at least 2 sharing one): each rank's images/s and the
  CPU cores used per GPU.

* ``doctor``: ``fastload doctor`` on the GPU (:mod:`.doctor_check`): ``--model resnet50``
  (bf16, channels_last; the ``h2d`` phase), and a 20 ms step with ``--decode cpu --apply``
  (the DALI probe, ``--apply`` against its prediction).

One module per section (:mod:`.decode`, :mod:`.transfer`, :mod:`.overlap`,
:mod:`.doctor_check` for ``ranks`` and ``doctor``), on
:mod:`.config` and :mod:`.images`; this module checks for CUDA, runs them, prints and writes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from fastload.bench.gpu.config import (
    COPY_REFERENCE,
    DECODE_REFERENCE,
    SECTIONS,
    STEP_REFERENCE,
    GpuCheckConfig,
    NoCudaError,
    Outcome,
)
from fastload.bench.gpu.decode import dali_mixed_pipeline, measure_decode
from fastload.bench.gpu.doctor_check import measure_doctor, measure_ranks
from fastload.bench.gpu.images import generate
from fastload.bench.gpu.overlap import measure_overlap
from fastload.bench.gpu.transfer import measure_copy, relate_bandwidth
from fastload.bench.runner import Report, machine_info


def require_cuda(device: str = "cuda") -> torch.device:
    """The CUDA device to check, or :class:`NoCudaError` saying why there is none."""
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU build)"
        raise NoCudaError(
            f"no CUDA device: torch {torch.__version__} (CUDA {built}) sees none. Run this on "
            "a GPU machine with a CUDA build of torch (make install picks that build where "
            "nvidia-smi works)"
        )
    want = torch.device(device)
    index = want.index if want.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise NoCudaError(f"{device} asked for, but torch sees {torch.cuda.device_count()} GPUs")
    return torch.device("cuda", index)


def gpu_info(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_bytes": props.total_memory,
        "torch_cuda": torch.version.cuda,
    }


def run(out_dir: str | os.PathLike[str], config: GpuCheckConfig | None = None) -> Report:
    """Runs the selected sections; a failed measurement is recorded, not raised (see
    ``report.params["failures"]``)."""
    config = config or GpuCheckConfig()
    device = require_cuda(config.device)
    # The timings' torch.cuda.synchronize() and current_stream() act on the current device.
    torch.cuda.set_device(device)
    config = GpuCheckConfig(**{**asdict(config), "device": str(device)})
    out = Path(out_dir)
    started = time.perf_counter()
    print(f"gpu_check: generating {config.files} JPEGs in {out / 'data'}", file=sys.stderr)
    paths = generate(out / "data", config.files, config.threads)
    outcome = Outcome()
    sections: dict[str, Callable[[], None]] = {
        "decode": lambda: measure_decode(paths, config, outcome),
        "copy": lambda: measure_copy(config, outcome),
        "overlap": lambda: measure_overlap(paths, out, config, outcome),
        "ranks": lambda: measure_ranks(out / "data", out, config, outcome),
        "doctor": lambda: measure_doctor(out / "data", out, config, outcome),
    }
    for name in config.sections:
        print(f"gpu_check: {name}", file=sys.stderr, flush=True)
        try:  # what a section sets up before its measurements (a step, buffers) may fail too
            sections[name]()
        except Exception as e:
            outcome.failures[f"{name} section"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    return Report(
        name="gpu_check",
        rows=outcome.rows,
        machine=machine_info(out),
        params={
            **asdict(config),
            "gpu": gpu_info(device),
            "failures": outcome.failures,
            "skipped": outcome.skipped,
            "seconds": round(time.perf_counter() - started, 1),
        },
    )


def targets(report: Report) -> list[str]:
    """The figures TARGETS.md's P8 asks of one H200, where this run measured them."""
    found = {r.system: r for r in report.rows}
    lines = []
    dali = found.get("fastload DALI, mixed")
    if dali is not None:
        lines.append(
            f"P8 DALI mixed decode + train preset: {dali.items_per_s:,.0f} img/s (>= 15,000)"
        )
    for system in (
        "DeviceRing put/get, producer thread",
        "DeviceRing, batch written into the slot",
    ):
        ring = found.get(system)
        if ring is not None and ring.ratio is not None:
            lines.append(f"P8 {system}: {ring.ratio:.2f}x the pinned-copy peak (>= 0.8)")
    fed = found.get("DeviceRing, producer thread")
    if fed is not None and fed.ratio is not None:
        lines.append(f"P8 step fed by the DeviceRing: {fed.ratio:.2f}x the bare step (1.0: hidden)")
    step = found.get(STEP_REFERENCE)
    for decode in ("auto", "cpu"):
        name = f"fastload.DataLoader(decode={decode!r})"
        fed, alone = found.get(name), found.get(f"{name} alone")
        if step is not None and fed is not None and alone is not None:
            bound = max(step.seconds, alone.seconds)
            lines.append(
                f"P8 {name} feeding the step: {fed.seconds / bound:.2f}x max(step alone, "
                "loader alone) (<= 1.1)"
            )
    return lines


def tables(report: Report) -> str:
    """One table per case, the P8 figures, then what failed or was skipped."""
    parts = []
    for case in dict.fromkeys(r.case for r in report.rows):
        rows = [r for r in report.rows if r.case == case]
        parts.append(f"{case}\n{Report(name=report.name, rows=rows, machine={}).table()}")
    notes = targets(report)
    notes += [f"skipped {name}: {why}" for name, why in report.params.get("skipped", {}).items()]
    notes += [f"FAILED {name}: {why}" for name, why in report.params.get("failures", {}).items()]
    return "\n\n".join(parts + (["\n".join(notes)] if notes else []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="fastload-bench/gpu-check", help="results and data")
    parser.add_argument("--quick", action="store_true", help="small sizes: a minute or so")
    parser.add_argument(
        "--section", action="append", choices=SECTIONS, help="run only this (repeatable)"
    )
    parser.add_argument("--device", default=None, help="cuda or cuda:k (default: cuda)")
    for name in ("files", "images", "batch-size", "repeats", "threads", "steps", "ranks"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--step-ms", type=float, default=None)
    return parser


def config_from_args(args: argparse.Namespace) -> GpuCheckConfig:
    overrides = {
        "files": args.files,
        "images": args.images,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "threads": args.threads,
        "steps": args.steps,
        "ranks": args.ranks,
        "step_ms": args.step_ms,
        "device": args.device,
        "sections": tuple(dict.fromkeys(args.section)) if args.section else None,
    }
    given = {k: v for k, v in overrides.items() if v is not None}
    return GpuCheckConfig.quick(**given) if args.quick else GpuCheckConfig(**given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))  # exits 2
    try:
        require_cuda(config.device)
    except NoCudaError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    report = run(args.out, config)
    print(tables(report))
    path = report.write_json(args.out)
    print(f"wrote {path}")
    failures = report.params["failures"]
    if failures:
        print(f"gpu_check: {len(failures)} measurement(s) failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

# What callers and the tests use, wherever it is defined.
__all__ = [
    "COPY_REFERENCE",
    "DECODE_REFERENCE",
    "STEP_REFERENCE",
    "build_parser",
    "config_from_args",
    "dali_mixed_pipeline",
    "generate",
    "main",
    "relate_bandwidth",
    "run",
    "tables",
]
