"""The GPU check's ``copy`` section: host->device bandwidth of a train batch from pageable
memory, a :class:`~fastload.loader.ring.DeviceRing` slot and the whole ring, against a pinned
tensor."""

from __future__ import annotations

import contextlib
import itertools
import queue
import statistics
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from fastload.bench.gpu.config import CLASSES, COPY_REFERENCE, WAIT_S, GpuCheckConfig, Outcome
from fastload.bench.runner import Measurement, measure


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
    from fastload.loader.ring import RingClosedError

    transfers: queue.Queue[Any] = queue.Queue()
    errors: list[BaseException] = []
    finished: list[bool] = []

    def produce() -> None:
        try:
            for i in range(count) if count is not None else itertools.count():
                batch = batches[i % len(batches)]
                if callable(batch):  # writes the batch into a slot the ring lends it
                    batch = batch(ring)
                transfers.put(ring.put(batch, timeout_s=WAIT_S))
        except RingClosedError:
            pass
        except BaseException as e:
            errors.append(e)
        transfers.put(None)

    def consume() -> Iterator[Any]:
        while True:
            transfer = transfers.get(timeout=WAIT_S)
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
        producer.join(timeout=WAIT_S)


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
    from fastload.loader.ring import DeviceRing

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

    def written_in_slot() -> Measurement:
        labels = host_batch(config, 1)["labels"]
        shape = (config.batch_size, 3, config.size, config.size)

        def decoded_into(ring: Any) -> dict[str, torch.Tensor]:
            images = ring.empty(shape)  # a decoder's output buffer: the pinned slot itself
            images[0, 0, 0, :8] = 1.0  # (the decoder's writes; their cost is decode's)
            return {"images": images, "labels": labels}

        moved = config.batch_bytes + labels.numel() * labels.element_size()
        times = []
        with DeviceRing(device, slots=4) as ring:
            for r in range(1 + max(3, config.repeats)):  # the first run grows the slots
                start = time.perf_counter()
                with ring_feed(ring, [decoded_into], config.ring_batches) as got:
                    for _ in got:
                        pass
                torch.cuda.synchronize()
                if r:
                    times.append(time.perf_counter() - start)
            stats = ring.stats()
        if stats["written_in_slot"] < config.ring_batches:
            raise RuntimeError(f"only {stats['written_in_slot']} batches were written in a slot")
        return Measurement(
            benchmark="gpu_check",
            case=case,
            system="DeviceRing, batch written into the slot",
            seconds=statistics.median(times),
            repeats=times,
            nbytes=moved * config.ring_batches,
            note="no pack: copy only, 4 slots",
        )

    outcome.attempt("DeviceRing, batch written into the slot", written_in_slot)
    outcome.rows[rows_before:] = relate_bandwidth(outcome.rows[rows_before:], COPY_REFERENCE)
