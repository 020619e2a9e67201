"""The GPU check's ``overlap`` section: whether the data path hides behind a simulated
training step (a bf16 matmul loop), fed each way, against data already on the GPU."""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fastload.bench.gpu.config import STEP_REFERENCE, GpuCheckConfig, Outcome
from fastload.bench.gpu.transfer import host_batch, ring_feed
from fastload.bench.runner import Measurement, relate
from fastload.decode.params import TrainPreset


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


def _touch(images: torch.Tensor) -> torch.Tensor:
    """The least a consumer does with a batch: one kernel that reads it."""
    return images.sum()


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
    from fastload.loader.ring import DeviceRing

    device = torch.device(config.device)
    step = SimulatedStep(device, config.step_ms)
    case = f"training step of {step.step_ms:.1f} ms, batch {config.batch_size}"
    host = [host_batch(config, 3), host_batch(config, 4)]
    rows_before = len(outcome.rows)

    def row(
        system: str,
        note: str,
        batches: Callable[[], contextlib.AbstractContextManager[Any]],
        *,
        alone: bool = False,
    ) -> None:
        def measure() -> Measurement:
            times = []
            for _ in range(config.repeats):
                with batches() as it:
                    times.append(time_steps(iter(it), _touch if alone else step, config.steps))
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

    def loader(decode: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        @contextlib.contextmanager
        def batches_of() -> Iterator[Iterator[Any]]:
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
                decode=decode,
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
                print(  # where its time went
                    f"fastload.DataLoader(decode={decode!r}) stages:",
                    json.dumps(
                        {k: stats.get(k) for k in ("decode_backend", "stages", "counts", "ring")}
                    ),
                )
                dl.close()

        return batches_of

    for decode in ("auto", "cpu"):
        name = f"fastload.DataLoader(decode={decode!r})"
        row(f"{name} alone", "no step: what the loader delivers", loader(decode), alone=True)
        row(name, "decode + ring, overlapped with the step", loader(decode))
        if config.profile_steps:
            try:
                profile_fed_steps(loader(decode), step, config.profile_steps, out_dir, decode)
            except Exception as e:  # a profile is a help, not a figure
                outcome.skipped[f"profile of {name}"] = f"{type(e).__name__}: {e}"
    outcome.rows[rows_before:] = relate(outcome.rows[rows_before:], STEP_REFERENCE)


def profile_fed_steps(
    batches: Callable[[], contextlib.AbstractContextManager[Any]],
    step: Callable[[torch.Tensor], Any],
    steps: int,
    out_dir: Path,
    decode: str,
) -> Path:
    """torch.profiler over ``steps`` fed steps (every thread's ops, CPU and CUDA): where a
    fed step's time goes, for the closing note of a target the run missed. Writes
    ``profile-<decode>.txt`` (the top ops by CUDA time, then by CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # (runs on the CPU too: how it is tested)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with batches() as it:
        source = iter(it)
        step(next(source)[0])  # start-up is not what is profiled
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(steps):
                step(next(source)[0])
            if cuda:
                torch.cuda.synchronize()
    averages = prof.key_averages()
    by_device = "cuda_time_total" if cuda else "cpu_time_total"
    path = out_dir / f"profile-{decode}.txt"
    path.write_text(
        f"{steps} fed steps, fastload.DataLoader(decode={decode!r})\n\nby {by_device}\n"
        + averages.table(sort_by=by_device, row_limit=25)
        + "\n\nby CPU time\n"
        + averages.table(sort_by="cpu_time_total", row_limit=25)
    )
    return path
