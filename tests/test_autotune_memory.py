"""Memory bounds that hold on the default settings, in a pod (a fake cgroup ``memory.max``):
autotune's deepest prefetch is the depth whose batches, and the one the step holds, fit the
same share as the untuned depth (``fastload.loader.prefetch_memory``), from what a pass's
first batch holds; and the ring that carries batches to the device gives up the slots a
lowered depth no longer needs. The tuner's rates come from a clock the test drives (a deeper
prefetch always pays), so its moves are the same on every run; how fast anything ran is not
asserted."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fake_cgroup import limit_memory
from PIL import Image

import fastload as fl
from fastload.loader import autotune as tuning
from fastload.loader.prefetch_memory import PREFETCH_MEMORY_FRACTION, depth_within

IMAGES = 96
BATCH = 4
SIDE = (40, 48)
# Decoded at their own sizes (no preset): uint8 CHW images and int64 labels. Before the first
# batch the loader knows only the encoded bytes (~2.4 kB an image), a third of this.
DECODED = BATCH * 3 * SIDE[0] * SIDE[1] + BATCH * 8
# Every window one batch; a move is kept where the rate rises by 5%.
STEADY = {"window_batches": 1, "window_s": 0.0, "gain": 1.05, "keeps_pace": 0.0, "max_workers": 2}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("autotune-memory")
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (*SIDE, 3), dtype=np.uint8)).save(buf, "JPEG")
        path = root / f"class_{i % 3}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root


def holding(batches: int) -> str:
    """A memory.max whose prefetch share holds ``batches`` decoded batches, not one more."""
    return str(int(batches * DECODED / PREFETCH_MEMORY_FRACTION) + 1)


def _loader(folder: Path, cache: Path, **kwargs: Any) -> fl.DataLoader:
    return fl.DataLoader(
        str(folder), batch_size=BATCH, shuffle=True, seed=3, decode="cpu",
        cache_dir=str(cache), **kwargs,
    )  # fmt: skip


def _tune(
    monkeypatch: pytest.MonkeyPatch, loader: fl.DataLoader, deeper_than: int = 32
) -> list[tuple[int, int]]:
    """Runs passes until the tuner settles (or its depth passes ``deeper_than``), on a clock
    where the step takes 0.1 s and waits 1/depth s for its batch (a deeper prefetch always
    pays; threads and look-ahead never do). Returns, per batch, the tuner's depth and the
    running pass's."""
    real, clock, seen = tuning.follow, [0.0], []

    def on_the_clock(tuner: Any, ld: Any, source: Any, *args: Any) -> None:
        asked = clock[0] + 0.1
        clock[0] = asked + 1.0 / tuner.knobs.prefetch_batches
        real(tuner, ld, source, asked, clock[0], *args[2:])
        seen.append((tuner.knobs.prefetch_batches, source._prefetch))

    monkeypatch.setattr(tuning, "follow", on_the_clock)
    for _ in range(12):
        for _batch in loader:
            pass
        report = loader.stats()["autotune"]
        if report["converged"] or report["prefetch_batches"] > deeper_than:
            return seen
    raise AssertionError(f"the tuner neither settled nor went deeper than {deeper_than}")


def test_autotune_stays_inside_the_pods_prefetch_share(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit_memory(monkeypatch, tmp_path / "pod", holding(4))  # 3 ahead and the step's
    with _loader(folder, tmp_path / "c", num_workers=1, prefetch_batches=1, autotune=STEADY) as ld:
        share = ld.stats()["prefetch"]["memory_share_bytes"]
        estimated = ld.stats()["prefetch"]["batch_bytes"]
        seen = _tune(monkeypatch, ld)
        stats = ld.stats()
    assert share == int(int(holding(4)) * PREFETCH_MEMORY_FRACTION)
    assert stats["prefetch"]["batch_bytes"] == DECODED
    # The encoded bytes would have let it go deeper: the first batch's measure is what holds.
    assert depth_within(32, estimated, share) > 3
    assert stats["autotune"]["bounds"]["max_prefetch_bytes"] == share
    assert stats["autotune"]["bounds"]["max_prefetch"] == 3
    assert max(max(tuner, running) for tuner, running in seen) <= 3
    assert stats["autotune"]["prefetch_batches"] == 3  # it climbed to the bound, not past
    assert stats["autotune"]["converged"]


def test_without_a_limit_the_same_tuning_goes_deeper(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the bound stops: on the same clock, a pod without a memory limit climbs on."""
    limit_memory(monkeypatch, tmp_path / "pod", "max")
    with _loader(folder, tmp_path / "c", num_workers=1, prefetch_batches=1, autotune=STEADY) as ld:
        _tune(monkeypatch, ld, deeper_than=3)
        stats = ld.stats()
    assert stats["prefetch"]["memory_share_bytes"] is None
    assert stats["autotune"]["bounds"]["max_prefetch_bytes"] is None
    assert stats["autotune"]["prefetch_batches"] > 3


def test_the_ring_gives_up_the_slots_a_lowered_depth_no_longer_needs(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ring runs on the CPU here as it does on CUDA (``_moves_to_device`` as for a GPU,
    copies done by the host engine): created from the encoded bytes' depth before any batch,
    it keeps one slot a batch ahead and one for the step once the first batch is weighed.
    The batches are those of a loader without a ring or a limit."""
    with _loader(folder, tmp_path / "c", num_workers=2) as plain:
        expected = [(list(images), labels) for images, labels in plain]
    limit_memory(monkeypatch, tmp_path / "pod", holding(3))  # 2 ahead and the step's
    with _loader(folder, tmp_path / "c", num_workers=2, device="cpu") as ld:
        monkeypatch.setattr(ld, "_moves_to_device", lambda: True)
        depth_before = ld.stats()["prefetch"]["batches"]
        got, slots = [], []
        for images, labels in ld:
            got.append((list(images), labels))
            slots.append(ld.stats()["ring"]["slots"])
        stats = ld.stats()
    assert depth_before > 2
    assert stats["prefetch"]["batches"] == 2
    assert stats["ring"]["slots"] == 3
    assert stats["ring"]["slots_taken_out"] == depth_before + 1 - 3
    assert max(slots) == 3  # from the first batch delivered on
    assert len(got) == len(expected)
    for (a, x), (b, y) in zip(expected, got, strict=True):
        assert torch.equal(x, y)
        assert all(torch.equal(i, j) for i, j in zip(a, b, strict=True))
