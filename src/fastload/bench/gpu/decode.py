"""The GPU check's ``decode`` section: the train preset on every backend (fastload's DALI and
CPU decoders, CPU decode with GPU transforms), against DALI's own mixed pipeline."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fastload.bench.gpu.config import DECODE_REFERENCE, MIXED_OPTIONS, GpuCheckConfig, Outcome
from fastload.bench.peers.peer_decoders import dali_train_ops
from fastload.bench.runner import Measurement, measure, relate
from fastload.decode.base import DecodeConfig
from fastload.decode.params import TrainPreset


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


# Threads calling fastload's DALI backend at once, as a loader's do: each hands its batch to the
# pipeline's driver, which keeps DALI's queue full (one caller would leave DALI idle while it
# prepares the next batch).
DALI_CALLERS = 3


def _decoder_epoch(
    decoder: Any, encoded: list[bytes], batch_size: int, callers: int = 1
) -> Callable[[int], int]:
    def epoch(e: int) -> int:
        def one(start: int) -> int:
            chunk = encoded[start : start + batch_size]
            indices = range(start, start + len(chunk))
            return len(decoder.decode(chunk, indices=indices, epoch=e).images)

        starts = range(0, len(encoded), batch_size)
        if callers == 1:
            return sum(one(start) for start in starts)
        with ThreadPoolExecutor(callers, thread_name_prefix="gpu-check-caller") as pool:
            return sum(pool.map(one, starts))

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

    def decoder_row(
        system: str, note: str, make: Callable[[], Any], callers: int = 1
    ) -> Measurement:
        with make() as decoder:
            epoch = _decoder_epoch(decoder, encoded, config.batch_size, callers)
            return _epochs_timed(epoch, system=system, note=note, **timed)

    def config_for(target: str) -> DecodeConfig:
        return DecodeConfig(transform=preset, device=target, num_threads=config.threads)

    if dali_installed():
        from fastload.decode.dali import DALIDecoder

        outcome.attempt(
            "fastload DALI, mixed",
            lambda: decoder_row(
                "fastload DALI, mixed",
                f"nvJPEG + HW decoder, our crop boxes; {DALI_CALLERS} callers",
                lambda: DALIDecoder(
                    config_for(str(device)),
                    batch_size_hint=config.batch_size,
                    **MIXED_OPTIONS,
                ),
                DALI_CALLERS,
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
