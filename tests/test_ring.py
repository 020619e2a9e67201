"""DeviceRing: batches through page-aligned host slots to the device, with real threads.

Without CUDA the ring runs unpinned towards the CPU (``get`` copies out of the slot), which
exercises everything but the streams and pinning; those are the ``gpu`` tests at the end.
"""

from __future__ import annotations

import gc
import json
import queue
import threading
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from fastload.errors import FastloadError
from fastload.loader.ring import DeviceRing, RingClosedError, RingTimeoutError

HAS_CUDA = torch.cuda.is_available()
Pair = namedtuple("Pair", ["left", "right"])


def batch_for(i: int, n: int = 4) -> dict[str, Any]:
    """A loader-like batch whose every value follows from ``i`` (and a few odd tensors)."""
    g = torch.Generator().manual_seed(i)
    images = torch.rand(n, 3, 8, 8, generator=g)
    return {
        "images": images,
        "labels": torch.arange(i, i + n, dtype=torch.int64),
        "names": [f"sample-{i}-{k}" for k in range(n)],
        "pair": Pair(images[:, 0].transpose(1, 2), torch.tensor(i % 2 == 0)),
        "index": i,
    }


def assert_same(got: Any, want: Any) -> None:
    """Same structure, container types, dtypes, shapes and values."""
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert torch.equal(got.cpu(), want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same(a, b)
    else:
        assert got == want


def aliases(tensor: torch.Tensor, buffers: list[torch.Tensor]) -> bool:
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    for b in buffers:
        lo = b.data_ptr()
        if start < lo + b.numel() and lo < end:
            return True
    return False


@pytest.fixture
def ring() -> Any:
    with DeviceRing("cpu", slots=2) as r:
        yield r


# --- structure and values -----------------------------------------------------------------


def test_nested_batches_keep_structure_dtypes_shapes_and_values(ring: DeviceRing) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    batch = (
        OrderedDict(
            images=torch.randint(0, 255, (2, 3, 5, 7), dtype=torch.uint8),
            mask=torch.rand(5, 3) > 0.5,
            half=torch.rand(3, 3, dtype=torch.float16),
        ),
        [base.t(), base[:, ::2], base.expand(2, 4, 6)],  # non-contiguous, strided, expanded
        Pair(torch.tensor(3.5), torch.empty(0, 5, dtype=torch.int32)),  # 0-dim and empty
        {"complex": torch.randn(4, dtype=torch.complex64), "text": "label", "none": None},
        7,
    )
    out = ring.get(ring.put(batch))
    assert_same(out, batch)
    assert out[3]["text"] is batch[3]["text"]  # plain values are passed along, not copied
    assert out[1][0].is_contiguous()  # packed tensors come back dense


def test_a_batch_without_tensors_needs_no_slot(ring: DeviceRing) -> None:
    batch = {"a": [1, "two", (3.0,)]}
    transfers = [ring.put(batch) for _ in range(5)]  # more than the slots: none is taken
    assert all(ring.get(t) == batch for t in transfers)
    assert ring.stats()["slot_bytes_held"] == 0


def test_tensors_on_another_device_pass_through_untouched(ring: DeviceRing) -> None:
    meta = torch.empty(3, 4, device="meta")
    sparse = torch.eye(4).to_sparse()
    out = ring.get(ring.put({"meta": meta, "sparse": sparse, "dense": torch.ones(2)}))
    assert out["meta"] is meta
    assert out["sparse"].is_sparse
    assert torch.equal(out["sparse"].to_dense(), torch.eye(4))
    assert torch.equal(out["dense"], torch.ones(2))


def test_tensors_the_consumer_holds_survive_slot_reuse(ring: DeviceRing) -> None:
    """Two slots, twenty batches held at once: reuse must never touch a delivered batch."""
    held = [(i, ring.get(ring.put(batch_for(i)))) for i in range(20)]
    slots = ring.slot_buffers()
    assert len(slots) == 2
    for i, out in held:
        assert_same(out, batch_for(i))
        assert not aliases(out["images"], slots)
    assert ring.stats()["delivered"] == 20


# --- threads ------------------------------------------------------------------------------


def run_pipeline(ring: DeviceRing, producers: int, per_producer: int) -> list[int]:
    """Producers put batches into a queue of transfers; this thread takes and checks them."""
    transfers: queue.Queue[Any] = queue.Queue()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for k in range(per_producer):
                i = p * per_producer + k
                transfers.put((i, ring.put(batch_for(i, n=1 + i % 7), timeout_s=30)))
        except BaseException as e:
            errors.append(e)
            raise

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    seen = []
    for _ in range(producers * per_producer):
        i, transfer = transfers.get(timeout=30)
        assert_same(ring.get(transfer), batch_for(i, n=1 + i % 7))
        seen.append(i)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()
    assert not errors
    return seen


def test_one_producer_thread_and_the_consumer_move_every_batch_in_order() -> None:
    with DeviceRing("cpu", slots=3) as ring:
        assert run_pipeline(ring, producers=1, per_producer=200) == list(range(200))
        stats = ring.stats()
    assert stats["batches"] == stats["delivered"] == 200
    assert stats["in_flight"] == 0
    expected = sum(
        sum(v.numel() * v.element_size() for v in (b["images"], b["labels"], *b["pair"]))
        for b in (batch_for(i, n=1 + i % 7) for i in range(200))
    )
    assert stats["bytes_moved"] == expected


def test_several_producer_threads_share_the_ring() -> None:
    with DeviceRing("cpu", slots=2) as ring:
        seen = run_pipeline(ring, producers=3, per_producer=40)
    assert sorted(seen) == list(range(120))


def test_a_producer_waits_for_a_slot_until_the_consumer_takes_a_batch() -> None:
    with DeviceRing("cpu", slots=1) as ring:
        first = ring.put(batch_for(0))
        second: list[Any] = []
        producer = threading.Thread(target=lambda: second.append(ring.put(batch_for(1))))
        producer.start()
        producer.join(timeout=0.3)
        assert producer.is_alive()  # no free slot: it waits
        assert_same(ring.get(first), batch_for(0))
        producer.join(timeout=10)
        assert not producer.is_alive()
        assert_same(ring.get(second[0]), batch_for(1))
        assert ring.stats()["wait_slot_s"] > 0


def test_a_batch_discarded_or_dropped_before_get_frees_its_slot() -> None:
    """A consumer that stops early (a break out of the epoch) must not starve producers."""
    with DeviceRing("cpu", slots=1) as ring:
        transfer = ring.put(batch_for(0))
        ring.discard(transfer)
        with pytest.raises(ValueError, match="already taken"):
            ring.get(transfer)
        ring.put(batch_for(1), timeout_s=10)  # dropped at once: no reference is kept
        gc.collect()
        assert_same(ring.get(ring.put(batch_for(2), timeout_s=10)), batch_for(2))
        assert ring.stats()["in_flight"] == 0


# --- memory -------------------------------------------------------------------------------


def test_slots_grow_to_the_largest_batch_and_no_further() -> None:
    sizes = [1000, 300_000, 5000, 120_000, 300_000, 10, 250_000] * 3
    with DeviceRing("cpu", slots=3) as ring:
        for n in sizes:
            ring.get(ring.put(torch.ones(n, dtype=torch.uint8)))
        stats = ring.stats()
    largest = -(-max(sizes) // (64 << 10)) * (64 << 10)
    assert 0 < stats["slot_bytes_held"] <= 3 * largest
    # 64 KiB, 320 KiB, then the other two slots straight to the largest size seen.
    assert stats["grows"] == 4


def test_fixed_slot_bytes_refuse_a_larger_batch() -> None:
    with DeviceRing("cpu", slots=2, slot_bytes=4096) as ring:
        small = torch.arange(100, dtype=torch.int32)
        assert torch.equal(ring.get(ring.put(small)), small)
        assert torch.equal(ring.get(ring.put(small)), small)
        with pytest.raises(ValueError, match="slot_bytes=4,096"):
            ring.put(torch.zeros(5000, dtype=torch.uint8))
        assert ring.stats()["slot_bytes_held"] == 2 * 4096
        assert torch.equal(ring.get(ring.put(small)), small)  # the refusal took no slot


def test_closing_frees_the_slots_and_batches_taken_stay_valid() -> None:
    ring = DeviceRing("cpu", slots=2)
    out = ring.get(ring.put(batch_for(5)))
    ring.close()
    ring.close()  # idempotent
    assert ring.stats()["slot_bytes_held"] == 0
    assert_same(out, batch_for(5))


def test_a_dropped_ring_frees_its_slots() -> None:
    ring = DeviceRing("cpu", slots=2)
    ring.get(ring.put(batch_for(1)))
    slots = ring._slots
    del ring
    gc.collect()
    assert all(s.capacity == 0 for s in slots)


# --- stopping and errors ------------------------------------------------------------------


def test_close_wakes_a_producer_waiting_for_a_slot() -> None:
    ring = DeviceRing("cpu", slots=1)
    pending = ring.put(batch_for(0))  # held, never taken: the next put waits
    raised: list[BaseException] = []

    def produce() -> None:
        try:
            ring.put(batch_for(1))
        except BaseException as e:
            raised.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(timeout=0.3)
    assert producer.is_alive()
    ring.close()
    producer.join(timeout=10)
    assert not producer.is_alive()
    assert len(raised) == 1
    assert isinstance(raised[0], RingClosedError)
    assert isinstance(raised[0], FastloadError)
    assert "closed while put() waited" in str(raised[0])
    del pending


def test_put_gives_up_after_its_timeout(ring: DeviceRing) -> None:
    pending = [ring.put(batch_for(0)), ring.put(batch_for(1))]
    with pytest.raises(RingTimeoutError, match="not yet taken by get") as info:
        ring.put(batch_for(2), timeout_s=0.05)
    assert isinstance(info.value, TimeoutError)
    assert len(pending) == 2


def test_misuse_is_refused_with_a_clear_error(ring: DeviceRing) -> None:
    transfer = ring.put(batch_for(0))
    ring.get(transfer)
    with pytest.raises(ValueError, match="already taken"):
        ring.get(transfer)
    with DeviceRing("cpu") as other, pytest.raises(ValueError, match="another DeviceRing"):
        other.get(ring.put(batch_for(1)))
    pending = ring.put(batch_for(2))
    ring.close()
    with pytest.raises(RingClosedError, match="closed"):
        ring.get(pending)
    with pytest.raises(RingClosedError):
        ring.put(batch_for(3))


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="slots must be >= 1"):
        DeviceRing("cpu", slots=0)
    with pytest.raises(ValueError, match="slot_bytes"):
        DeviceRing("cpu", slot_bytes=-1)
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        DeviceRing("meta")


@pytest.mark.skipif(HAS_CUDA, reason="checks the errors given when there is no CUDA device")
def test_cuda_without_a_device_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="CUDA build of torch"):
        DeviceRing("cuda")
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        DeviceRing("cpu", pin=True)


def test_a_large_batch_is_packed_in_pieces_on_several_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("fastload.loader.ring._PACK_PIECE_BYTES", 4096)  # small batches split too
    g = torch.Generator().manual_seed(3)
    images = torch.rand(64, 3, 16, 16, generator=g)
    batch = {
        "images": images,
        "transposed": images[:, 0].transpose(1, 2),  # not contiguous: split rows still view
        "labels": torch.arange(64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    outs = {}
    for threads in (1, 4):
        with DeviceRing("cpu", slots=2, pack_threads=threads) as ring:
            outs[threads] = [ring.get(ring.put(batch)) for _ in range(3)]
            stats = ring.stats()
        assert stats["packs_split"] == (3 if threads > 1 else 0)
        for out in outs[threads]:
            assert_same(out, batch)
    with pytest.raises(ValueError, match="pack_threads"):
        DeviceRing("cpu", pack_threads=0)


def test_tensors_on_another_device_pass_through_unpacked(ring: DeviceRing) -> None:
    elsewhere = torch.empty(1000, 1000, device="meta")
    labels = torch.arange(4)
    out = ring.get(ring.put({"images": elsewhere, "labels": labels}))
    assert out["images"] is elsewhere
    assert_same(out["labels"], labels)
    stats = ring.stats()
    assert stats["bytes_moved"] == labels.numel() * labels.element_size()
    assert stats["on_device_tensors"] == 0  # only the ring's own device counts


def test_stats_are_plain_json(ring: DeviceRing) -> None:
    ring.get(ring.put(batch_for(0)))
    stats = json.loads(json.dumps(ring.stats()))
    assert stats["device"] == "cpu"
    assert stats["pinned"] is False
    assert stats["batches"] == stats["delivered"] == 1
    assert stats["slot_bytes_held"] >= stats["bytes_moved"] > 0
    assert {"wait_slot_s", "wait_copy_s", "pack_s", "slots", "in_flight"} <= set(stats)


# --- CUDA ---------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
SLEEP_CYCLES = 1_000_000_000  # ~0.5 s of GPU clock: keeps the side stream busy


def warm(ring: DeviceRing, batch: object) -> None:
    """Everything that may synchronize with the device happens before a test's sleep: each
    slot's cudaHostRegister and the device buffers' cudaMalloc (a batch through every
    slot), and the first launch of the kernel the tests run on a delivered batch (CUDA loads
    a kernel's module lazily, at its first launch, and that waits for the device: on an
    H200 the consumer's multiply waited out the sleep itself and the test saw nothing
    left to wait for, though the ring had ordered it right)."""
    transfers = [ring.put(batch) for _ in range(ring.stats()["slots"])]
    for transfer in transfers:
        out = ring.get(transfer)
    leaves = out.values() if isinstance(out, dict) else [out]
    for t in leaves:
        _ = t * 2
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_cuda_slots_are_pinned_and_batches_arrive_intact() -> None:
    with DeviceRing("cuda", slots=2) as ring:
        outs = [(i, ring.get(ring.put(batch_for(i)))) for i in range(6)]
        assert ring.pinned
        buffers = ring.slot_buffers()
        assert buffers
        assert all(b.is_pinned() for b in buffers)
    for i, out in outs:
        assert out["images"].device.type == "cuda"
        assert_same(out, batch_for(i))


@pytest.mark.gpu
@needs_cuda
def test_cuda_copy_runs_on_a_side_stream_that_the_consumer_waits_for() -> None:
    src = torch.rand(4 << 20)
    with DeviceRing("cuda", slots=2) as ring:
        assert ring.stream != torch.cuda.current_stream()
        # Other values: a device buffer reused from the warm-up holds zeros, not src.
        warm(ring, {"x": torch.zeros_like(src)})
        with torch.cuda.stream(ring.stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the copy queues behind this
        transfer = ring.put({"x": src})
        assert not ring.stream.query()  # put returned without waiting for the device
        out = ring.get(transfer)
        assert not ring.stream.query()  # nor did get
        doubled = out["x"] * 2
        consumer_done = torch.cuda.current_stream().query()
        # If the sleep is over, something above synchronized the device and the next check
        # would prove nothing: say so rather than blame the ring.
        assert not ring.stream.query(), "the device was synchronized before the check"
        assert not consumer_done  # the consumer's stream waits behind the copy
        # Had the consumer's stream not waited for the copy, these would read zeros.
        assert torch.equal(out["x"].cpu(), src)
        assert torch.equal(doubled.cpu(), src * 2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensors_already_on_the_device_are_not_packed_and_are_ordered() -> None:
    labels = torch.arange(8)
    with DeviceRing("cuda", slots=2) as ring:
        producer = torch.cuda.Stream()
        warm(ring, {"images": torch.zeros(1 << 20, device="cuda"), "labels": labels})
        with torch.cuda.stream(producer):  # the kernels below, loaded before the sleep
            torch.zeros(1 << 20, device="cuda").fill_(3.0).sum()
        torch.zeros(1 << 20, device="cuda").fill_(3.0).sum()
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):  # as a loader thread decoding on its own stream
            images = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(SLEEP_CYCLES)
            images.fill_(3.0)  # done only after the sleep
            transfer = ring.put({"images": images, "labels": labels})
        out = ring.get(transfer)
        assert out["images"] is images  # passed through, not packed
        summed = out["images"].sum()
        consumer_done = torch.cuda.current_stream().query()
        assert not producer.query(), "the device was synchronized before the check"
        assert not consumer_done  # the consumer's stream waits for the producer's
        assert float(summed) == 3.0 * (1 << 20)
        assert torch.equal(out["labels"].cpu(), labels)
        stats = ring.stats()
        assert stats["on_device_tensors"] == 3  # the warm-up's two (one a slot) and this one
        assert stats["bytes_moved"] == 3 * labels.numel() * labels.element_size()


@pytest.mark.gpu
@needs_cuda
def test_cuda_slot_is_reused_only_after_its_copy_completed() -> None:
    first, second = torch.rand(2 << 20), torch.rand(2 << 20)
    with DeviceRing("cuda", slots=1) as ring:
        warm(ring, first)
        with torch.cuda.stream(ring.stream):
            torch.cuda._sleep(SLEEP_CYCLES)
        a = ring.get(ring.put(first))  # its copy is still queued behind the sleep
        b = ring.get(ring.put(second))  # packing the one slot again must wait for it
        assert ring.stats()["wait_copy_s"] > 0
        assert torch.equal(a.cpu(), first)
        assert torch.equal(b.cpu(), second)


@pytest.mark.gpu
@needs_cuda
def test_cuda_memory_stays_bounded_when_batches_are_dropped() -> None:
    batch = torch.rand(2 << 20)  # 8 MB
    nbytes = batch.numel() * 4
    with DeviceRing("cuda", slots=3) as ring:
        ring.get(ring.put(batch))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(40):
            out = ring.get(ring.put(batch))
            out.sum()
            del out
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base <= 5 * nbytes
        assert ring.stats()["slot_bytes_held"] <= 3 * (nbytes + (64 << 10))
