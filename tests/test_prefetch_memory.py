"""The batches a loader holds ahead of the training step fit a share of the container's memory
limit (``fastload.loader.prefetch_memory``): given a fake cgroup whose ``memory.max`` fits
three batches in that share, the default depth of 4 (2 threads x prefetch factor 2) drops to
2, from the preset's size before any batch, or from the first batch where nothing tells its
size before; the batches themselves are those of an unbounded loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fake_cgroup import limit_memory
from image_folders import jpeg_folder

import fastload as fl
from fastload.decode import TrainPreset
from fastload.loader.prefetch_memory import PREFETCH_MEMORY_FRACTION

BATCH = 4
SIDE = 64  # the generated images' height and width
OUT = 32  # the preset's output side


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return jpeg_folder(tmp_path_factory.mktemp("prefetch-memory"), 24, size=SIDE)


def limit_for(batches: int, batch_bytes: int) -> str:
    """A memory.max whose prefetch share holds ``batches`` batches (and not one more)."""
    return str(int(batches * batch_bytes / PREFETCH_MEMORY_FRACTION) + 1)


def run(folder: Path, cache: Path, **kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    loader = fl.DataLoader(
        str(folder), batch_size=BATCH, shuffle=True, num_workers=2, decode="cpu",
        cache_dir=str(cache), seed=5, **kwargs,
    )  # fmt: skip
    before = loader.stats()["prefetch"]
    batches = [(images.clone(), labels.clone()) for images, labels in _pairs(loader)]
    after = loader.stats()["prefetch"]
    loader.close()
    return batches, {"before": before, "after": after}


def _pairs(loader: Any) -> Any:
    for images, labels in loader:
        if isinstance(images, list):  # images of their own sizes: one tensor per image
            images = torch.stack(images)
        yield images, labels


def test_a_preset_batch_bounds_the_depth_before_the_first_batch(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset = TrainPreset(OUT)
    free, stats = run(folder, tmp_path / "cache", transform=preset)
    assert stats["before"]["batches"] == 4
    assert stats["before"]["memory_share_bytes"] is None
    images = BATCH * 3 * OUT * OUT * 4  # float32; the labels add BATCH int64s
    limit_memory(monkeypatch, tmp_path / "pod", limit_for(3, images + BATCH * 8))
    bounded, stats = run(folder, tmp_path / "cache", transform=preset)
    assert stats["before"]["batch_bytes"] == images
    assert stats["before"]["batches"] == 2  # 2 ahead and the one the step holds: 3
    assert stats["after"]["batches"] == 2
    assert all(a.equal(b) and x.equal(y) for (a, x), (b, y) in zip(free, bounded, strict=True))


def test_the_first_batch_tells_what_a_batch_holds(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Images decoded at their own sizes: the encoded bytes said less than they hold."""
    free, _ = run(folder, tmp_path / "cache")
    decoded = BATCH * 3 * SIDE * SIDE + BATCH * 8  # uint8 images and int64 labels
    limit_memory(monkeypatch, tmp_path / "pod", limit_for(3, decoded))
    bounded, stats = run(folder, tmp_path / "cache")
    assert stats["before"]["batch_bytes"] < decoded  # the encoded bytes
    assert stats["before"]["batches"] > 2
    assert stats["after"]["batch_bytes"] == decoded
    assert stats["after"]["batches"] == 2
    assert all(a.equal(b) and x.equal(y) for (a, x), (b, y) in zip(free, bounded, strict=True))


def test_a_depth_the_user_gives_is_kept(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit_memory(monkeypatch, tmp_path / "pod", limit_for(3, BATCH * 3 * OUT * OUT * 4 + BATCH * 8))
    _, stats = run(folder, tmp_path / "cache", transform=TrainPreset(OUT), prefetch_batches=6)
    assert stats["before"]["batches"] == stats["after"]["batches"] == 6
