"""One command for a GPU machine: decode throughput on every backend, host->device bandwidth,
and whether the copies hide behind a training step.

Command (needs no network; under 5 minutes on one H200 with 16 cores; ``--quick`` for a
smoke run of a minute or so)::

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
  :class:`~fastload.ring.DeviceRing` (page-aligned, ``cudaHostRegister``-ed), and through the
  whole ring (a producer thread packs batches, the consumer takes them).

* ``overlap``: a simulated training step (a bf16 matmul loop of about ``step_ms``, reading
  the batch) fed by: data already on the GPU (reference), a pageable copy before each step
  (no overlap), the DeviceRing in a producer thread, decoding inline before each step
  (``decode="auto"``), and ``fastload.DataLoader(decode="auto", device="cuda")``. Steps/s as
  a ratio to the reference: 1.0 means the data path is fully hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import itertools
import json
import os
import queue
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastload.bench.components.decode_bench import dali_train_ops
from fastload.bench.runner import Measurement, Report, machine_info, measure, relate
from fastload.decode.base import DecodeConfig
from fastload.decode.params import TrainPreset

SECTIONS = ("decode", "copy", "overlap")
DECODE_REFERENCE = "DALI's own mixed pipeline"
COPY_REFERENCE = "pinned tensor (torch)"
STEP_REFERENCE = "step alone (batch already on the GPU)"
CLASSES = 100
MAX_SIDE = 500  # the generated images' largest side: the hardware decoder's preallocation hint
# What fastload's DALIDecoder uses by default, given to DALI's own pipeline too.
MIXED_OPTIONS: dict[str, Any] = {
    "hw_decoder_load": 0.65,
    "device_memory_padding": 16 << 20,
    "host_memory_padding": 8 << 20,
    "preallocate_width_hint": MAX_SIDE,
    "preallocate_height_hint": MAX_SIDE,
}
_WAIT_S = 120.0  # any single batch taking longer than this is a hang, not a slow run


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):  # what this process may use, not what the host has
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class NoCudaError(RuntimeError):
    """There is no CUDA device to check."""


@dataclass(frozen=True, kw_only=True)
class GpuCheckConfig:
    files: int = 2048  # distinct JPEGs generated
    images: int = 4096  # images per decode epoch (the files, cycled)
    batch_size: int = 256
    size: int = 224
    repeats: int = 3
    threads: int = field(default_factory=lambda: _usable_cores())
    copies: int = 8  # host->device copies of one batch per timed repeat
    ring_batches: int = 48
    steps: int = 40
    step_ms: float = 20.0
    sections: tuple[str, ...] = SECTIONS
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("files", "images", "batch_size", "size", "repeats", "threads", "copies"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("ring_batches", "steps"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.step_ms <= 0:
            raise ValueError(f"step_ms must be > 0, got {self.step_ms}")
        unknown = sorted(set(self.sections) - set(SECTIONS))
        if unknown or not self.sections:
            raise ValueError(f"sections must be among {', '.join(SECTIONS)}, got {self.sections}")
        if self.files < self.batch_size:
            raise ValueError(f"files ({self.files}) must be >= batch_size ({self.batch_size})")
        if not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cuda' or 'cuda:k', got {self.device!r}")

    @classmethod
    def quick(cls, **overrides: Any) -> GpuCheckConfig:
        settings: dict[str, Any] = {
            "files": 256,
            "images": 512,
            "batch_size": 64,
            "repeats": 1,
            "copies": 2,
            "ring_batches": 8,
            "steps": 8,
            "step_ms": 10.0,
        }
        return cls(**{**settings, **overrides})

    @property
    def batch_bytes(self) -> int:
        """Bytes of one float32 train batch: what the copy section moves."""
        return self.batch_size * 3 * self.size * self.size * 4


@dataclass
class Outcome:
    """What one run produced: rows, and what could not be measured (and why)."""

    rows: list[Measurement] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def attempt(self, name: str, measure: Callable[[], Measurement | None]) -> None:
        """Runs one measurement; an exception is recorded (and printed) instead of raised."""
        print(f"  {name} ...", file=sys.stderr, flush=True)
        try:
            row = measure()
        except Exception as e:
            self.failures[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return
        if row is not None:
            self.rows.append(row)


# --- data -------------------------------------------------------------------------------------


def image_path(data_dir: Path, i: int) -> Path:
    return data_dir / f"class_{i % CLASSES:03d}" / f"{i:06d}.jpg"


def _make_jpeg(path: Path, i: int) -> None:
    from PIL import Image

    from fastload.bench.components.decode_bench import natural_image

    rng = np.random.default_rng([i, 105])  # decode_bench's recipe: the same image i
    height, width = int(rng.integers(350, MAX_SIDE + 1)), int(rng.integers(400, MAX_SIDE + 1))
    buf = io.BytesIO()
    Image.fromarray(natural_image(rng, height, width)).save(buf, "JPEG", quality=90)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def generate(data_dir: Path, count: int, threads: int) -> list[Path]:
    """``count`` JPEGs like ``decode_bench.generate``'s, made on ``threads`` threads (they
    scale: the work releases the GIL); files already there are kept."""
    paths = [image_path(data_dir, i) for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    if missing:
        intra = torch.get_num_threads()
        torch.set_num_threads(1)  # the pool is the parallelism
        try:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: _make_jpeg(paths[i], i), missing))
        finally:
            torch.set_num_threads(intra)
    return paths


# --- decode -----------------------------------------------------------------------------------


def dali_mixed_pipeline(
    files: Sequence[str], config: GpuCheckConfig, *, device_id: int
) -> tuple[Any, Any]:
    """DALI's own train pipeline on the GPU, defined but not built: (pipeline, its output).

    Apart from building, defining it needs no GPU, which lets a CPU machine check it against
    DALI's operator schemas.
    """
    dali: Any = importlib.import_module("nvidia.dali")
    fn = dali.fn
    preset = TrainPreset(size=config.size)
    pipe = dali.Pipeline(
        batch_size=config.batch_size,
        num_threads=config.threads,
        device_id=device_id,
        seed=0,
    )
    with pipe:
        jpegs, _ = fn.readers.file(files=list(files), name="reader")
        output = dali_train_ops(dali, jpegs, preset, device="mixed", **MIXED_OPTIONS)
        pipe.set_outputs(output)
    return pipe, output


def _epochs_timed(
    epoch: Callable[[int], int], *, images: int, repeats: int, system: str, case: str, note: str
) -> Measurement:
    """One untimed warm-up epoch, then ``repeats`` timed ones (each ends in a device sync)."""
    made = epoch(0)
    torch.cuda.synchronize()
    if made != images:
        raise RuntimeError(f"{system} made {made} images of {images}")
    epochs = itertools.count(1)

    def timed_epoch() -> None:
        epoch(next(epochs))
        torch.cuda.synchronize()

    return measure(
        timed_epoch,
        benchmark="gpu_check",
        case=case,
        system=system,
        items=images,
        repeats=repeats,
        warmup=0,
        note=note,
    )


def _decoder_epoch(decoder: Any, encoded: list[bytes], batch_size: int) -> Callable[[int], int]:
    def epoch(e: int) -> int:
        done = 0
        for start in range(0, len(encoded), batch_size):
            chunk = encoded[start : start + batch_size]
            indices = range(start, start + len(chunk))
            done += len(decoder.decode(chunk, indices=indices, epoch=e).images)
        return done

    return epoch


def measure_decode(paths: list[Path], config: GpuCheckConfig, outcome: Outcome) -> None:
    from fastload.decode import dali_installed
    from fastload.decode.cpu import CPUDecoder

    cycled = [paths[i % len(paths)] for i in range(config.images)]
    encoded = [p.read_bytes() for p in cycled]
    case = f"decode, train preset {config.size} px, batch {config.batch_size}"
    preset = TrainPreset(size=config.size)
    device = torch.device(config.device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    timed: dict[str, Any] = {"images": config.images, "repeats": config.repeats, "case": case}
    rows_before = len(outcome.rows)

    def decoder_row(system: str, note: str, make: Callable[[], Any]) -> Measurement:
        with make() as decoder:
            epoch = _decoder_epoch(decoder, encoded, config.batch_size)
            return _epochs_timed(epoch, system=system, note=note, **timed)

    def config_for(target: str) -> DecodeConfig:
        return DecodeConfig(transform=preset, device=target, num_threads=config.threads)

    if dali_installed():
        from fastload.decode.dali import DALIDecoder

        outcome.attempt(
            "fastload DALI, mixed",
            lambda: decoder_row(
                "fastload DALI, mixed",
                "nvJPEG + HW decoder, our crop boxes",
                lambda: DALIDecoder(
                    config_for(str(device)),
                    batch_size_hint=config.batch_size,
                    **MIXED_OPTIONS,
                ),
            ),
        )
    else:
        outcome.skipped["fastload DALI, mixed"] = "DALI not installed (pip install fastload[dali])"
    outcome.attempt(
        "fastload CPU",
        lambda: decoder_row(
            "fastload CPU",
            f"{config.threads} threads",
            lambda: CPUDecoder(config_for("cpu")),
        ),
    )
    outcome.attempt(
        "fastload CPU decode, GPU transforms",
        lambda: decoder_row(
            "fastload CPU decode, GPU transforms",
            f"{config.threads} threads",
            lambda: CPUDecoder(config_for(str(device))),
        ),
    )
    if dali_installed():

        def dali_own() -> Measurement:
            pipe, _ = dali_mixed_pipeline([str(p) for p in cycled], config, device_id=index)
            pipe.build()
            runs = -(-config.images // config.batch_size)

            def epoch(e: int) -> int:
                done = 0
                for _ in range(runs):
                    (out,) = pipe.run()
                    done += len(out)
                return min(done, config.images)  # the reader pads the last batch

            try:
                return _epochs_timed(
                    epoch, system=DECODE_REFERENCE, note="readers.file + its random crop", **timed
                )
            finally:
                del pipe

        outcome.attempt(DECODE_REFERENCE, dali_own)
    else:
        outcome.skipped[DECODE_REFERENCE] = "DALI not installed (pip install fastload[dali])"
    outcome.rows[rows_before:] = relate(outcome.rows[rows_before:], DECODE_REFERENCE)


# --- host -> device ---------------------------------------------------------------------------


def host_batch(config: GpuCheckConfig, seed: int) -> dict[str, torch.Tensor]:
    """A float32 train batch and its labels in pageable memory (touched, so resident)."""
    g = torch.Generator().manual_seed(seed)
    n, s = config.batch_size, config.size
    return {
        "images": torch.rand(n, 3, s, s, generator=g),
        "labels": torch.randint(0, CLASSES, (n,), generator=g),
    }


@contextlib.contextmanager
def ring_feed(
    ring: Any, batches: Sequence[Any], count: int | None = None
) -> Iterator[Iterator[Any]]:
    """Batches through ``ring``: a producer thread puts them (cycling ``batches``, ``count``
    in all or forever), the caller's iterator gets them on the device. Leaving the block
    before the producer is done closes the ring, which wakes the producer if it waits for a
    slot; otherwise the ring stays open for more."""
    from fastload.ring import RingClosedError

    transfers: queue.Queue[Any] = queue.Queue()
    errors: list[BaseException] = []
    finished: list[bool] = []

    def produce() -> None:
        try:
            for i in range(count) if count is not None else itertools.count():
                transfers.put(ring.put(batches[i % len(batches)], timeout_s=_WAIT_S))
        except RingClosedError:
            pass
        except BaseException as e:
            errors.append(e)
        transfers.put(None)

    def consume() -> Iterator[Any]:
        while True:
            transfer = transfers.get(timeout=_WAIT_S)
            if transfer is None:
                finished.append(True)
                if errors:
                    raise RuntimeError(f"the ring's producer failed: {errors[0]!r}") from errors[0]
                return
            yield ring.get(transfer)

    producer = threading.Thread(target=produce, name="gpu-check-producer", daemon=True)
    producer.start()
    try:
        yield consume()
    finally:
        if not finished:
            ring.close()
        producer.join(timeout=_WAIT_S)


def relate_bandwidth(rows: Sequence[Measurement], reference: str) -> list[Measurement]:
    """Each row's GB/s as a ratio to the reference's. ``relate`` compares times, which holds
    only for equal bytes; the whole ring moves more batches (and labels) than the copies."""
    base = next((r for r in rows if r.system == reference), None)
    if base is None or not base.nbytes or base.seconds <= 0:
        return [replace(r, ratio=None, reference=None) for r in rows]
    return [
        replace(r, ratio=r.gb_per_s / base.gb_per_s, reference=reference)
        if r.nbytes and r.seconds > 0
        else replace(r, ratio=None, reference=None)
        for r in rows
    ]


def measure_copy(config: GpuCheckConfig, outcome: Outcome) -> None:
    from fastload.ring import DeviceRing

    device = torch.device(config.device)
    nbytes = config.batch_bytes
    case = f"host->device, {nbytes / 1e6:,.0f} MB float32 batch"
    pageable = host_batch(config, 0)["images"].view(-1).view(torch.uint8)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copies(source: torch.Tensor, system: str, note: str) -> Measurement:
        def run() -> None:
            for _ in range(config.copies):
                dest.copy_(source, non_blocking=True)
            torch.cuda.synchronize()

        return measure(
            run,
            benchmark="gpu_check",
            case=case,
            system=system,
            nbytes=nbytes * config.copies,
            repeats=max(3, config.repeats),
            note=note,
        )

    rows_before = len(outcome.rows)
    outcome.attempt("pageable tensor", lambda: copies(pageable, "pageable tensor", ""))
    outcome.attempt(
        COPY_REFERENCE,
        lambda: copies(pageable.pin_memory(), COPY_REFERENCE, "the peak"),
    )

    def registered() -> Measurement:
        with DeviceRing(device, slots=1) as ring:
            ring.get(ring.put(pageable))
            (slot,) = ring.slot_buffers()
            if not slot.is_pinned():
                raise RuntimeError("the ring's slot is not pinned memory")
            return copies(slot[:nbytes], "DeviceRing slot (registered)", "aligned_empty")

    outcome.attempt("DeviceRing slot (registered)", registered)

    def whole_ring() -> Measurement:
        batches = [host_batch(config, 1), host_batch(config, 2)]
        moved = sum(t.numel() * t.element_size() for t in batches[0].values())
        times = []
        with DeviceRing(device, slots=4) as ring:
            for r in range(1 + max(3, config.repeats)):  # the first run grows the slots
                start = time.perf_counter()
                with ring_feed(ring, batches, config.ring_batches) as got:
                    for _ in got:
                        pass
                torch.cuda.synchronize()
                if r:
                    times.append(time.perf_counter() - start)
            stats = ring.stats()
        pack_gb_s = stats["bytes_moved"] / stats["pack_s"] / 1e9 if stats["pack_s"] else 0.0
        return Measurement(
            benchmark="gpu_check",
            case=case,
            system="DeviceRing put/get, producer thread",
            seconds=statistics.median(times),
            repeats=times,
            nbytes=moved * config.ring_batches,
            note="pack + copy, 4 slots",
            extra={"pack GB/s": pack_gb_s},
        )

    outcome.attempt("DeviceRing put/get, producer thread", whole_ring)
    outcome.rows[rows_before:] = relate_bandwidth(outcome.rows[rows_before:], COPY_REFERENCE)


# --- overlap with a training step -------------------------------------------------------------


class SimulatedStep:
    """A training step's GPU time without a model: a bf16 matmul loop of about ``step_ms``
    that also reads the batch (so the step depends on the data having arrived)."""

    def __init__(self, device: torch.device, step_ms: float, *, side: int = 8192) -> None:
        self.a = torch.randn(side, side, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(side, side, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.matmuls = 1
        for _ in range(3):  # warm up (cuBLAS picks its kernel)
            torch.mm(self.a, self.b, out=self.c)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            torch.mm(self.a, self.b, out=self.c)
        torch.cuda.synchronize()
        per_matmul_ms = (time.perf_counter() - start) * 100
        self.matmuls = max(1, round(step_ms / per_matmul_ms))
        self.step_ms = self.matmuls * per_matmul_ms

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        for _ in range(self.matmuls):
            torch.mm(self.a, self.b, out=self.c)
        return images.float().mean() + self.c[0, 0]


def time_steps(batches: Iterator[Any], step: Callable[[torch.Tensor], Any], steps: int) -> float:
    """Seconds for ``steps`` steps after a first, untimed one; batches are (images, ...)."""
    first = next(batches)
    step(first[0] if isinstance(first, tuple | list) else first["images"])
    torch.cuda.synchronize()
    start = time.perf_counter()
    done = 0
    for batch in batches:
        step(batch[0] if isinstance(batch, tuple | list) else batch["images"])
        done += 1
        if done == steps:
            break
    torch.cuda.synchronize()
    if done < steps:
        raise RuntimeError(f"the batches ran out after {done} of {steps} steps")
    return time.perf_counter() - start


def measure_overlap(
    paths: list[Path], out_dir: Path, config: GpuCheckConfig, outcome: Outcome
) -> None:
    import fastload
    from fastload.decode import make_decoder
    from fastload.ring import DeviceRing

    device = torch.device(config.device)
    step = SimulatedStep(device, config.step_ms)
    case = f"training step of {step.step_ms:.1f} ms, batch {config.batch_size}"
    host = [host_batch(config, 3), host_batch(config, 4)]
    rows_before = len(outcome.rows)

    def row(
        system: str, note: str, batches: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> None:
        def measure() -> Measurement:
            times = []
            for _ in range(config.repeats):
                with batches() as it:
                    times.append(time_steps(iter(it), step, config.steps))
            seconds = statistics.median(times)
            return Measurement(
                benchmark="gpu_check",
                case=case,
                system=system,
                seconds=seconds,
                repeats=times,
                items=config.steps,
                note=note,
                extra={"ms/step": 1000 * seconds / config.steps},
            )

        outcome.attempt(system, measure)

    on_device = {k: v.to(device) for k, v in host[0].items()}
    row(STEP_REFERENCE, "no data path", lambda: contextlib.nullcontext(itertools.repeat(on_device)))

    @contextlib.contextmanager
    def pageable() -> Iterator[Iterator[Any]]:
        yield ({k: v.to(device) for k, v in host[i % 2].items()} for i in itertools.count())

    row("pageable copy, then step", "no overlap", pageable)

    @contextlib.contextmanager
    def ring() -> Iterator[Iterator[Any]]:
        with DeviceRing(device, slots=4) as r, ring_feed(r, host) as got:
            yield got

    row("DeviceRing, producer thread", "copy overlapped", ring)

    encoded = [p.read_bytes() for p in paths]

    @contextlib.contextmanager
    def inline() -> Iterator[Iterator[Any]]:
        decoder = make_decoder(
            "auto",
            transform=TrainPreset(size=config.size),
            device=str(device),
            num_threads=config.threads,
        )
        with decoder:

            def batches() -> Iterator[Any]:
                b = config.batch_size
                starts = range(0, len(encoded) - b + 1, b)
                for k in itertools.count():
                    start = starts[k % len(starts)]
                    images = decoder.decode(
                        encoded[start : start + b], indices=range(start, start + b), epoch=k
                    ).images
                    yield (images.to(device),)

            yield batches()

    row("decode='auto' inline, then step", "no overlap", inline)

    if importlib.util.find_spec("fastload.loader") is not None:

        @contextlib.contextmanager
        def loader() -> Iterator[Iterator[Any]]:
            dataset = fastload.open_dataset(
                str(paths[0].parent.parent), cache_dir=str(out_dir / "cache")
            )
            dl = fastload.DataLoader(
                dataset,
                batch_size=config.batch_size,
                shuffle=True,
                drop_last=True,
                num_workers=config.threads,
                device=str(device),
                decode="auto",
                transform=TrainPreset(size=config.size),
            )

            def batches() -> Iterator[Any]:
                for epoch in itertools.count():
                    dl.set_epoch(epoch)
                    yield from dl

            try:
                yield batches()
            finally:
                stats = dl.stats()
                print(  # where its time went, for the GPU path's first runs
                    "fastload.DataLoader stages:",
                    json.dumps({k: stats.get(k) for k in ("decode_backend", "stages", "counts")}),
                )
                dl.close()

        row("fastload.DataLoader(decode='auto')", "decode + ring, overlapped", loader)
    else:
        outcome.skipped["fastload.DataLoader"] = "not in this version of fastload"
    outcome.rows[rows_before:] = relate(outcome.rows[rows_before:], STEP_REFERENCE)


# --- run --------------------------------------------------------------------------------------


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
    ring = found.get("DeviceRing put/get, producer thread")
    if ring is not None and ring.ratio is not None:
        lines.append(f"P8 DeviceRing: {ring.ratio:.2f}x the pinned-copy peak (>= 0.8)")
    fed = found.get("DeviceRing, producer thread")
    if fed is not None and fed.ratio is not None:
        lines.append(f"P8 step fed by the DeviceRing: {fed.ratio:.2f}x the bare step (1.0: hidden)")
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
    for name in ("files", "images", "batch-size", "repeats", "threads", "steps"):
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
