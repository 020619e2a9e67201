"""The DALI feeder: the order it feeds, runs and takes batches in (against a pipeline that
records it, with DALI's prefetch rule), and the real DALI CPU pipeline fed that way: the same
batches as one run at a time, from many threads, and batches held by the caller intact."""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

from fastload.decode.dali_feed import DALIFeeder, PipelineFailed


class RecordingPipeline:
    """What DALIFeeder needs of a DALI pipeline, with DALI's rules: fed batches queue per
    input; the first schedule_run runs ``depth`` iterations (DALI's prefetch), later ones one;
    outputs() gives the oldest scheduled run's. Every call is logged."""

    def __init__(self, log: list[tuple[str, int]], depth: int, gate: threading.Event) -> None:
        self.log, self.depth, self.gate = log, depth, gate
        self.prefetch_queue_depth = depth
        self.queue: list[int] = []  # fed tags, not yet run
        self.done: list[int] = []  # run, outputs not yet taken
        self.first = True

    def feed_input(self, name: str, data: Any) -> None:
        self.gate.wait(10)  # the test submits every batch before the first feed goes in
        tag = int(data[0])
        self.log.append(("feed", tag))
        self.queue.append(tag)

    def schedule_run(self) -> None:
        runs = self.depth if self.first else 1
        self.first = False
        if len(self.queue) < runs:
            raise RuntimeError("DALI would fail: a run without fed data")
        if len(self.done) + runs > self.depth:
            raise RuntimeError("more runs scheduled than the prefetch queue holds")
        for _ in range(runs):
            tag = self.queue.pop(0)
            self.log.append(("run", tag))
            self.done.append(tag)

    def outputs(self, cuda_stream: Any = None) -> tuple[Any, ...]:
        tag = self.done.pop(0)
        self.log.append(("outputs", tag))
        if tag < 0:
            raise RuntimeError("Error in thread 0: bad sample")
        return (tag * 10,)


def recording_feeder(depth: int = 2) -> tuple[DALIFeeder, list[tuple[str, int]], threading.Event]:
    log: list[tuple[str, int]] = []
    gate = threading.Event()
    feeder = DALIFeeder(
        lambda: RecordingPipeline(log, depth, gate), lambda out: out[0], depth=depth
    )
    return feeder, log, gate


def test_the_next_batches_are_fed_and_scheduled_before_a_batch_is_taken() -> None:
    feeder, log, gate = recording_feeder(depth=2)
    futures = [feeder.submit({"encoded": np.array([k])}) for k in range(6)]
    gate.set()
    assert [f.result(10).value for f in futures] == [k * 10 for k in range(6)]
    feeder.close()
    for k in range(6):
        taken = log.index(("outputs", k))
        before = log[:taken]
        for later in (k + 1, k + 2):  # fed before batch k is taken
            if later < 6:
                assert ("feed", later) in before, (k, log)
        if k + 1 < 6:  # and the next one scheduled: DALI works on it meanwhile
            assert ("run", k + 1) in before, (k, log)
    assert [tag for what, tag in log if what == "outputs"] == list(range(6))
    assert feeder.stats["padding_runs"] == 0


def test_a_lone_batch_is_padded_for_dalis_first_prefetching_run() -> None:
    feeder, log, gate = recording_feeder(depth=3)
    gate.set()
    assert feeder.submit({"encoded": np.array([7])}).result(10).value == 70
    assert feeder.submit({"encoded": np.array([8])}).result(10).value == 80
    feeder.close()
    assert feeder.stats["padding_runs"] == 2  # the first run fed twice more
    assert [tag for what, tag in log if what == "outputs"][:1] == [7]


def test_a_failed_run_fails_the_runs_queued_behind_it_and_a_fresh_pipeline_follows() -> None:
    feeder, _, gate = recording_feeder(depth=2)
    futures = [feeder.submit({"encoded": np.array([k])}) for k in (1, -1, 2, 3)]
    gate.set()
    assert futures[0].result(10).value == 10
    with pytest.raises(PipelineFailed, match="bad sample") as own:
        futures[1].result(10)
    assert own.value.own
    for future in futures[2:]:  # queued on the pipeline that failed: theirs failed too
        with pytest.raises(PipelineFailed) as behind:
            future.result(10)
        assert not behind.value.own
    assert feeder.submit({"encoded": np.array([4])}).result(10).value == 40  # rebuilt
    assert feeder.stats["rebuilds"] == 1
    feeder.close()
    with pytest.raises(ValueError, match="closed"):
        feeder.submit({"encoded": np.array([5])})


def test_closing_fails_what_was_not_decoded_and_stops_the_driver() -> None:
    feeder, _, gate = recording_feeder(depth=2)
    future = feeder.submit({"encoded": np.array([1])})
    feeder.close()  # the first feed waits on the gate: the batch is not decoded
    gate.set()
    feeder.close()  # idempotent
    assert not feeder._thread.is_alive()
    if future.exception(10) is not None:
        assert isinstance(future.exception(), ValueError)


# -- the real DALI CPU pipeline -----------------------------------------------------------------

dali = pytest.importorskip(
    "nvidia.dali", reason="NVIDIA DALI is not installed (pip install nvidia-dali-cuda130)"
)

from fastload.decode.base import DecodeConfig  # noqa: E402
from fastload.decode.dali import DALIDecoder, image_size  # noqa: E402
from fastload.decode.params import TrainPreset  # noqa: E402


def jpegs(count: int) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(count):
        rng = np.random.default_rng(i)
        pixels = rng.integers(0, 255, (40 + i % 7, 48 + i % 5, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


IMAGES = jpegs(24)
BATCH = 4


def batch(k: int) -> tuple[list[memoryview], list[int]]:
    start = (k * BATCH) % len(IMAGES)
    return [memoryview(IMAGES[start + i]) for i in range(BATCH)], list(range(k * 100, k * 100 + 4))


def one_run_at_a_time(decoder: DALIDecoder, k: int) -> torch.Tensor:
    """Batch k as the backend decoded it before the feeder: one synchronous pipeline run."""
    encoded, indices = batch(k)
    arrays = [np.frombuffer(e, dtype=np.uint8) for e in encoded]
    boxes = decoder._boxes([image_size(e) for e in encoded], indices, epoch=k)
    return decoder._run(arrays, boxes).clone()


@pytest.fixture
def decoder() -> Any:
    config = DecodeConfig(transform=TrainPreset(size=16), seed=3, num_threads=2)
    with DALIDecoder(config, batch_size_hint=BATCH) as d:
        yield d


def test_the_fed_cpu_pipeline_gives_the_batches_of_one_run_at_a_time(decoder) -> None:
    expected = [one_run_at_a_time(decoder, k) for k in range(12)]

    def decode(k: int) -> torch.Tensor:
        encoded, indices = batch(k)
        return decoder.decode(encoded, indices=indices, epoch=k).images

    with ThreadPoolExecutor(4) as pool:  # as a loader's threads call it
        got = list(pool.map(decode, range(12)))
    for k in range(12):
        assert torch.equal(got[k], expected[k]), k
    assert decoder._feeder.stats["runs"] >= 12


def test_batches_held_by_the_caller_stay_intact_while_twenty_more_are_decoded(decoder) -> None:
    held = []
    for k in range(10):
        encoded, indices = batch(k)
        images = decoder.decode(encoded, indices=indices, epoch=k).images
        held.append((images, images.clone()))
    for k in range(10, 30):
        encoded, indices = batch(k)
        decoder.decode(encoded, indices=indices, epoch=k)
    for k, (images, copy) in enumerate(held):
        assert torch.equal(images, copy), f"batch {k} was overwritten"


def test_the_gpu_checks_decode_epoch_calls_the_backend_from_several_threads(decoder) -> None:
    from fastload.bench.gpu.decode import _decoder_epoch

    epoch = _decoder_epoch(decoder, IMAGES, BATCH, callers=3)
    assert epoch(0) == len(IMAGES)
    assert epoch(1) == len(IMAGES)


def test_a_bad_sample_among_many_callers_costs_only_itself() -> None:
    """A run DALI fails takes the runs queued behind it down too: those are decoded again,
    and only the bad sample is left out."""
    config = DecodeConfig(transform=TrainPreset(size=16), seed=3, num_threads=2, on_error="skip")
    cut = IMAGES[5][: len(IMAGES[5]) // 2]  # the header is whole: only DALI notices
    with DALIDecoder(config, batch_size_hint=BATCH) as d:
        expected = [one_run_at_a_time(d, k) for k in range(12)]

        def decode(k: int) -> Any:
            encoded, indices = batch(k)
            if k == 4:
                encoded = [*encoded[:1], memoryview(cut), *encoded[2:]]
            return d.decode(encoded, indices=indices, epoch=k)

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(decode, range(12)))
        assert d._feeder.stats["failed_runs"] >= 1
    for k in range(12):
        if k == 4:
            assert got[k].kept == [0, 2, 3]
            assert torch.equal(got[k].images, expected[k][[0, 2, 3]])
        else:
            assert got[k].kept == [0, 1, 2, 3]
            assert torch.equal(got[k].images, expected[k]), k


def test_a_batch_the_pipeline_refuses_fails_its_caller_and_the_ones_taken_with_it() -> None:
    feeder, _, gate = recording_feeder(depth=2)
    futures = [feeder.submit({"encoded": data}) for data in ([1], "not an array", [2])]
    gate.set()
    for future in futures:  # none waits forever
        assert isinstance(future.exception(10), PipelineFailed | ValueError)
    assert feeder.submit({"encoded": np.array([3])}).result(10).value == 30
    feeder.close()


def _task_nice(tid: str) -> int:
    """A thread's nice value, from /proc (field 19 of its stat; the name may hold spaces)."""
    import pathlib

    stat = pathlib.Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice is Linux's")
def test_the_pipelines_threads_run_at_thread_nice_below_the_caller() -> None:
    with DALIDecoder(DecodeConfig(num_threads=2)):  # DALI starts a global thread once
        pass
    base = _task_nice(str(threading.get_native_id()))
    before = set(os.listdir("/proc/self/task"))
    config = DecodeConfig(transform=TrainPreset(size=16), num_threads=2)
    with DALIDecoder(config, batch_size_hint=BATCH, thread_nice=6) as d:
        encoded, indices = batch(0)
        d.decode(encoded, indices=indices)
        started = set(os.listdir("/proc/self/task")) - before
        assert len(started) >= 3  # the driver and DALI's worker threads
        assert {t: _task_nice(t) for t in started} == dict.fromkeys(started, min(19, base + 6))
    assert _task_nice(str(threading.get_native_id())) == base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:nvidia-dali-cuda.* is no longer shipped:Warning")
def test_on_the_gpu_held_batches_stay_intact_and_nothing_synchronizes_the_host() -> None:
    config = DecodeConfig(transform=TrainPreset(size=16), seed=3, num_threads=2, device="cuda")
    with DALIDecoder(config, batch_size_hint=BATCH) as d:
        encoded, indices = batch(0)
        d.decode(encoded, indices=indices)  # start-up (the pipeline's first runs) may sync
        torch.cuda.synchronize()
        held = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for k in range(30):
                encoded, indices = batch(k)
                images = d.decode(encoded, indices=indices, epoch=k).images
                if k < 10:
                    held.append((images, images.clone()))  # the copy: ordered on this stream
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for k, (images, copy) in enumerate(held):
            assert images.device.type == "cuda"
            assert torch.equal(images, copy), f"batch {k} was overwritten"
        # The same batch run alone (the hardware decoder and nvJPEG may share it differently).
        alone = one_run_at_a_time(d, 3).cpu()
        assert float((held[3][0].cpu() - alone).abs().mean()) < 0.05
