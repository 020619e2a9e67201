"""The ring's slots without CUDA: batches written straight into a lent slot (no pack), and
slot ownership against a copy engine whose copies complete late, as a side stream's do.

The engine below stands for CUDA's: a copy out of a slot reads the slot when its event
completes (a few polls after it was issued, or when the test synchronizes), so a slot
reused too early shows up as another batch's values in the device buffer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fastload.loader.ring import DeviceRing


class LateEvent:
    """An event whose copy runs when it is queried the third time (or on finish())."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.polls = 0

    def query(self) -> bool:
        if self.pending is not None:
            self.polls += 1
            if self.polls >= 3:
                self.finish()
        return self.pending is None

    def finish(self) -> None:
        if self.pending is not None:
            dst, src = self.pending
            dst.copy_(src)  # what the copy engine reads is the slot as it is now
            self.pending = None


class LateEngine:
    """A copy engine whose copies complete late; it records the consumer's waits."""

    stream = "side stream"

    def __init__(self) -> None:
        self.events: list[LateEvent] = []
        self.waits: list[LateEvent] = []

    def event(self) -> LateEvent:
        event = LateEvent()
        self.events.append(event)
        return event

    def copy_out(self, host: torch.Tensor, event: LateEvent) -> torch.Tensor:
        assert event.pending is None, "a slot's copy was issued before its last one completed"
        buffer = torch.full_like(host, 0xEE)  # "device memory": garbage until the copy runs
        event.pending, event.polls = (buffer, host), 0
        return buffer

    def consumer_waits(self, event: LateEvent, buffer: torch.Tensor) -> None:
        self.waits.append(event)

    def synchronize(self) -> None:
        for event in self.events:
            event.finish()


def images_for(k: int) -> torch.Tensor:
    return torch.full((4, 3, 8, 8), float(k)) + torch.arange(8.0)


def test_a_batch_written_into_a_lent_slot_is_copied_without_packing() -> None:
    with DeviceRing("cpu", slots=2) as ring:
        for k in range(5):
            images = ring.empty((4, 3, 8, 8))
            images.copy_(images_for(k))  # the decoder's writes, straight into the slot
            labels = torch.arange(4) + k
            out_images, out_labels = ring.get(ring.put((images, labels)))
            assert torch.equal(out_images, images_for(k))
            assert torch.equal(out_labels, labels)
        stats = ring.stats()
    assert stats["written_in_slot"] == 5  # the images: never packed
    assert stats["batches"] == 5


def test_views_of_a_lent_slot_and_tensors_elsewhere_both_arrive() -> None:
    with DeviceRing("cpu", slots=1) as ring:
        images = ring.empty((4, 3, 8, 8))
        images.copy_(images_for(3))
        elsewhere = images_for(9)[:2]  # e.g. a skipped sample's replacement: packed after
        out = ring.get(ring.put({"a": images[1:3], "b": elsewhere, "c": images[::2]}))
        assert torch.equal(out["a"], images_for(3)[1:3])
        assert torch.equal(out["b"], images_for(9)[:2])
        assert torch.equal(out["c"], images_for(3)[::2])  # not contiguous: packed
        assert ring.stats()["written_in_slot"] == 1


def test_a_lent_slot_that_is_not_put_is_released_or_reused() -> None:
    with DeviceRing("cpu", slots=1) as ring:
        ring.empty((2, 2))
        ring.release()
        first = ring.empty((2, 2))
        again = ring.empty((4, 4))  # a thread that gave up a batch: the same slot again
        assert again.data_ptr() == first.data_ptr()
        again.fill_(1.0)
        assert torch.equal(ring.get(ring.put(again)), torch.ones(4, 4))
        with pytest.raises(ValueError, match="slot_bytes"):
            DeviceRing("cpu", slots=1, slot_bytes=1 << 10).empty((1 << 10,))


def test_a_slot_is_written_again_only_after_its_copy_completed() -> None:
    """Two batches through one slot: the second waits for the first's copy, which would
    otherwise read the second batch's values."""
    for lend in (False, True):
        engine = LateEngine()
        with DeviceRing("cpu", slots=1, engine=engine) as ring:
            outs = []
            for k in range(4):
                if lend:
                    images = ring.empty((4, 3, 8, 8))
                    images.copy_(images_for(k))
                else:
                    images = images_for(k)
                outs.append(ring.get(ring.put({"images": images})))
            assert ring.stats()["wait_copy_s"] > 0
            assert len(engine.waits) == 4  # each get ordered the consumer after the copy
            engine.synchronize()
            for k, out in enumerate(outs):
                assert torch.equal(out["images"], images_for(k)), (lend, k)


def test_batches_the_consumer_holds_are_intact_after_twenty_more() -> None:
    engine = LateEngine()
    with DeviceRing("cpu", slots=2, engine=engine) as ring:
        held: list[Any] = []
        for k in range(30):
            images = ring.empty((4, 3, 8, 8))
            images.copy_(images_for(k))
            out = ring.get(ring.put((images, torch.tensor([k]))))
            if k < 10:
                held.append(out)
        engine.synchronize()
        for k, (images, label) in enumerate(held):
            assert torch.equal(images, images_for(k)), k
            assert int(label) == k


class HeldEvent(LateEvent):
    """An event whose copy runs only when the test synchronizes."""

    def query(self) -> bool:
        return self.pending is None


class HeldEngine(LateEngine):
    def event(self) -> LateEvent:
        event = HeldEvent()
        self.events.append(event)
        return event


def test_a_lowered_limit_frees_the_free_slots_now_and_busy_ones_once_copied() -> None:
    """limit_slots (a loader whose prefetch depth came down): free slots over the limit
    leave at once, a slot holding a batch when its batch is taken, and its memory only once
    its copy completed; the batches after it go through the slots that stay, intact."""
    engine = HeldEngine()
    with DeviceRing("cpu", slots=4, engine=engine) as ring:
        # Every slot carries a batch: each holds a batch's memory.
        outs = [ring.get(ring.put({"images": images_for(k)})) for k in range(4)]
        engine.synchronize()
        held = ring.stats()["slot_bytes_held"]
        assert ring.stats()["slots"] == 4
        pending = ring.put({"images": images_for(4)})  # its copy still running
        ring.limit_slots(2)
        stats = ring.stats()
        assert stats["slots"] == 2  # two free ones left at once, the busy one stays
        assert stats["slots_taken_out"] == 2
        assert stats["slot_bytes_held"] == held // 2
        second = ring.put({"images": images_for(5)})  # both slots busy now
        ring.limit_slots(1)  # one must go, but only once its batch is taken and copied
        assert ring.stats()["slots"] == 2
        outs.append(ring.get(pending))
        assert ring.stats()["slots"] == 1
        assert ring.stats()["slot_bytes_held"] == held // 2  # its copy has not completed
        engine.synchronize()
        assert ring.stats()["slot_bytes_held"] == held // 4
        outs.append(ring.get(second))
        for k in range(6, 12):
            engine.synchronize()  # (a held copy completes only here)
            outs.append(ring.get(ring.put({"images": images_for(k)})))
        engine.synchronize()
        assert len(ring.slot_buffers()) == 1
        for k, out in enumerate(outs):
            assert torch.equal(out["images"], images_for(k)), k
        ring.limit_slots(3)  # never more than before
        assert ring.stats()["slots"] == 1
