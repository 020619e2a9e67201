"""The loader's device path: the CPU decoder writing batches straight into the ring's slots
(on the CPU through ``ring_slots``, the same code as on CUDA without the pinning), and, marked
``gpu``, the path on a CUDA device: the CPU path's crops and flips, exact resume, and no
synchronization of the host in the steady state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_loader import SIZE, TOTAL, Source, direct_decode, label_of, plan_order, write_source

import fastload as fl
from fastload.decode import EvalPreset, TrainPreset

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    return write_source(tmp_path_factory.mktemp("jpegs"))


def test_cpu_decoded_batches_are_written_into_the_rings_slots_and_held_ones_stay_intact(
    source: Source, tmp_path: Path
) -> None:
    seed, preset = 6, TrainPreset(SIZE)
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        num_workers=2,
        seed=seed,
        decode="cpu",
        transform=preset,
        device="cpu",
        ring_slots=2,
    )
    held = []
    for _ in range(2):  # 30 batches, every one held (not copied) while the rest pass
        for images, labels in loader:
            held.append((images, labels))
    stats = loader.stats()
    loader.close()
    assert len(held) == 2 * TOTAL // 4
    assert stats["ring"]["written_in_slot"] == len(held)  # never packed
    for epoch in range(2):
        order = plan_order(dataset, seed=seed, epoch=epoch)
        part = held[epoch * 15 : (epoch + 1) * 15]
        images = torch.cat([images for images, _ in part])
        labels = torch.cat([labels for _, labels in part])
        assert labels.tolist() == [label_of(dataset, i) for i in order]
        assert torch.equal(
            images, direct_decode(dataset, order, preset=preset, seed=seed, epoch=epoch)
        )


# -- on a CUDA device -----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
dali_warning = pytest.mark.filterwarnings("ignore:nvidia-dali-cuda.* is no longer shipped:Warning")


def cuda_loader(dataset: Any, decode: str, preset: Any, seed: int = 3) -> Any:
    return fl.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=3,
        seed=seed,
        decode=decode,
        device="cuda",
        transform=preset,
    )


@pytest.mark.gpu
@needs_cuda
@dali_warning
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_on_cuda_batches_have_the_cpu_paths_crops_and_flips(
    source: Source, tmp_path: Path, decode: str
) -> None:
    seed, preset = 3, TrainPreset(SIZE)
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = cuda_loader(dataset, decode, preset, seed)
    batches = [(images.cpu(), labels.cpu()) for images, labels in loader]
    stats = loader.stats()
    loader.close()
    order = plan_order(dataset, seed=seed, epoch=0)
    images = torch.cat([b[0] for b in batches])
    assert torch.cat([b[1] for b in batches]).tolist() == [label_of(dataset, i) for i in order]
    expected = direct_decode(dataset, order, preset=preset, seed=seed, epoch=0)
    if decode == "cpu":  # the host's own pixels, one copy to the device
        assert torch.equal(images, expected)
        assert stats["ring"]["written_in_slot"] == len(batches)
    else:  # nvJPEG's IDCT differs from libjpeg-turbo's by a level or so
        assert float((images - expected).abs().mean()) < 0.05


@pytest.mark.gpu
@needs_cuda
@dali_warning
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_on_cuda_a_resumed_loader_delivers_exactly_the_rest(
    source: Source, tmp_path: Path, decode: str
) -> None:
    preset = EvalPreset(SIZE)
    dataset = fl.open_dataset(str(source.root / "tars"), cache_dir=str(tmp_path))
    loader = cuda_loader(dataset, decode, preset)
    full = [(images.cpu(), labels.cpu()) for images, labels in loader]
    loader.set_epoch(0)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    loader.close()
    resumed = cuda_loader(dataset, decode, preset)
    resumed.load_state_dict(state)
    rest = [(images.cpu(), labels.cpu()) for images, labels in resumed]
    resumed.close()
    assert len(rest) == len(full) - 3
    for (a, la), (b, lb) in zip(full[3:], rest, strict=True):
        assert torch.equal(la, lb)
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
@dali_warning
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_on_cuda_the_steady_state_never_synchronizes_the_host(
    source: Source, tmp_path: Path, decode: str
) -> None:
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = cuda_loader(dataset, decode, TrainPreset(SIZE))
    weights = torch.randn(3 * SIZE * SIZE, 10, device="cuda")
    it = iter(loader)
    for _ in range(2):  # start-up (pipelines, pinned slots, kernels' modules) may synchronize
        images, _labels = next(it)
        (images.flatten(1) @ weights).sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any implicit synchronization now raises
    try:
        steps = 0
        for images, _labels in it:
            (images.flatten(1) @ weights).sum()  # a step on the delivered batch
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    loader.close()
    assert steps == TOTAL // 8 - 2 + (1 if TOTAL % 8 else 0)
