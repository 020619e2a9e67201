"""``fl.DataLoader``'s fast path over fastload datasets: generated JPEGs in ImageFolder and tar
layouts, on local files and behind the loopback HTTP and S3 servers; a Zarr array; stats; and
a small real training loop that must give torch's loss curve exactly.

The helpers at the top (the generated dataset, where it is served from, the plan's order)
are shared with ``test_loader_resume.py`` and ``test_loader_faults.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tarfile
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import fastload as fl
from fastload.datasets.base import ShardedDataset
from fastload.decode import EvalPreset, TrainPreset, make_decoder
from fastload.remote import open_filesystem
from fastload.testing import RangeHTTPServer, RemoteControls, S3Server

CLASSES = 3
PER_CLASS = 20
TOTAL = CLASSES * PER_CLASS  # 60 samples
TAR_SHARDS = 3
SIZE = 32  # output side of the presets


# ---------------------------------------------------------------------------------------------
# The generated dataset and where it is served from (shared with the other loader tests)
# ---------------------------------------------------------------------------------------------


def jpeg(seed: int, height: int, width: int) -> bytes:
    """A small photo-like JPEG (a smooth field plus noise), different for every seed."""
    rng = np.random.default_rng(seed)
    small = torch.from_numpy(rng.uniform(0, 255, (1, 3, 4, 4)).astype(np.float32))
    smooth = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear")
    pixels = smooth[0].permute(1, 2, 0).numpy() + rng.normal(0, 8, (height, width, 3))
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


@dataclass
class Source:
    """One set of JPEGs written as ``root/folder`` (ImageFolder) and ``root/tars`` (WebDataset
    shards of the same images). ``images[i]``/``labels[i]`` are ImageFolder sample ``i``."""

    root: Path
    images: list[bytes]
    labels: list[int]
    names: list[str]  # ImageFolder key of each image ("class_1/img_07.jpg")
    by_digest: dict[str, int] = field(default_factory=dict)

    def index_of(self, data: bytes | memoryview) -> int:
        return self.by_digest[hashlib.md5(data).hexdigest()]

    @property
    def folder_bytes(self) -> int:
        return sum(len(b) for b in self.images)


def write_source(root: Path, seed: int = 0, *, corrupt: int | None = None) -> Source:
    """60 JPEGs of 32-64 px in 3 classes, as an ImageFolder and as 3 tar shards; image
    ``corrupt`` (if given) is cut in half, as a file left truncated by a failed upload."""
    rng = np.random.default_rng(seed)
    images, labels, names = [], [], []
    for c in range(CLASSES):
        for j in range(PER_CLASS):
            height, width = (int(v) for v in rng.integers(32, 65, 2))
            data = jpeg(seed * 10_000 + c * 100 + j, height, width)
            if len(images) == corrupt:
                data = data[: len(data) // 2]
            name = f"class_{c}/img_{j:02d}.jpg"
            (root / "folder" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "folder" / name).write_bytes(data)
            images.append(data)
            labels.append(c)
            names.append(name)
    (root / "tars").mkdir(parents=True, exist_ok=True)
    # Shards interleave the classes so that a shard is not one label.
    order = [int(i) for i in np.random.default_rng(seed + 1).permutation(TOTAL)]
    per_shard = TOTAL // TAR_SHARDS
    for s in range(TAR_SHARDS):
        with tarfile.open(root / "tars" / f"shard-{s:03d}.tar", "w") as tar:
            for i in order[s * per_shard : (s + 1) * per_shard]:
                for suffix, payload in (("jpg", images[i]), ("cls", str(labels[i]).encode())):
                    info = tarfile.TarInfo(f"sample{i:04d}.{suffix}")
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    by_digest = {hashlib.md5(b).hexdigest(): i for i, b in enumerate(images)}
    assert len(by_digest) == TOTAL, "two generated images are identical"
    return Source(root, images, labels, names, by_digest)


@dataclass
class Where:
    """The source on one kind of remote: ``url(layout)``, its storage options, its server."""

    kind: str
    source: Source
    storage_options: dict[str, Any]
    server: RemoteControls | None
    _base: str

    def url(self, layout: str) -> str:
        return f"{self._base}/{layout}"

    def open(self, layout: str, cache_dir: Path, **options: Any) -> ShardedDataset:
        return fl.open_dataset(
            self.url(layout),
            cache_dir=str(cache_dir),
            storage_options=dict(self.storage_options),
            **options,
        )


@contextlib.contextmanager
def served(kind: str, source: Source) -> Iterator[Where]:
    """``source`` as local files, behind the loopback HTTP server, or in moto's S3."""
    if kind == "local":
        yield Where(kind, source, {}, None, str(source.root))
    elif kind == "http":
        with RangeHTTPServer(source.root) as http:
            yield Where(kind, source, {}, http, http.url.rstrip("/"))
    else:
        with S3Server() as s3:
            for layout in ("folder", "tars"):
                s3.upload_dir(source.root / layout, "data", prefix=f"src/{layout}")
            yield Where(kind, source, s3.storage_options, s3, "s3://data/src")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    return write_source(tmp_path_factory.mktemp("jpegs"))


def plan_order(dataset: Any, *, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order fl.DataLoader reads a fastload dataset in (one rank): fastload's plan."""
    sampler = fl.ShardedSampler(dataset, rank=0, world_size=1, seed=seed, shuffle=shuffle)
    sampler.set_epoch(epoch)
    return list(sampler)


def encoded_image(dataset: ShardedDataset, index: int) -> bytes:
    sample = dataset[index]
    return bytes(sample["jpg"] if isinstance(sample, dict) else sample[0])


def label_of(dataset: ShardedDataset, index: int) -> int:
    sample = dataset[index]
    return int(sample["cls"]) if isinstance(sample, dict) else int(sample[1])


def raw_indices(source: Source, batch: list[Any]) -> list[int]:
    """Which generated images a raw batch (``collate_fn=list``) holds, checking each label."""
    out = []
    for sample in batch:
        image, label = (sample["jpg"], sample["cls"]) if isinstance(sample, dict) else sample
        i = source.index_of(image)
        assert int(label) == source.labels[i], f"{source.names[i]} came with label {label}"
        out.append(i)
    return out


def as_list(batches: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Decoded batches, copied (the CPU decoder reuses a batch's memory once it is dropped)."""
    return [(images.clone(), labels.clone()) for images, labels in batches]


def direct_decode(
    dataset: ShardedDataset, indices: list[int], *, preset: Any, seed: int, epoch: int
) -> torch.Tensor:
    """The same samples through fastload's CPU decoder called directly, not via the loader."""
    with make_decoder("cpu", transform=preset, seed=seed) as decoder:
        decoded = decoder.decode(
            [encoded_image(dataset, i) for i in indices], indices=indices, epoch=epoch
        )
        assert decoded.kept == list(range(len(indices)))
        images: torch.Tensor = decoded.images.clone()
    return images


# ---------------------------------------------------------------------------------------------
# Every sample once, labels, pixels: both layouts, three remotes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "http", "s3"])
@pytest.mark.parametrize("layout", ["folder", "tars"])
def test_each_epoch_delivers_every_sample_once_with_its_label_and_the_decoders_pixels(
    source: Source, tmp_path: Path, kind: str, layout: str
) -> None:
    seed = 4
    with served(kind, source) as where:
        dataset = where.open(layout, tmp_path / "cache")
        assert len(dataset) == TOTAL
        expected_format = "imagefolder" if layout == "folder" else "tar"
        assert dataset.format == expected_format
        raw = fl.DataLoader(
            dataset, batch_size=7, shuffle=True, num_workers=2, seed=seed, collate_fn=list
        )
        epochs = []
        for _ in range(2):
            seen = [i for batch in raw for i in raw_indices(source, batch)]
            assert sorted(seen) == list(range(TOTAL))  # each sample exactly once
            epochs.append(seen)
        assert epochs[0] != epochs[1]  # a new epoch, a new order
        raw.close()

        preset = TrainPreset(SIZE)
        decoded = fl.DataLoader(
            dataset,
            batch_size=8,
            shuffle=True,
            num_workers=2,
            seed=seed,
            decode="cpu",
            transform=preset,
        )
        batches = as_list(decoded)
        decoded.close()
    order = plan_order(dataset, seed=seed, epoch=0)
    assert [len(labels) for _, labels in batches] == [8] * 7 + [4]
    images = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    assert images.shape == (TOTAL, 3, SIZE, SIZE)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert labels.tolist() == [label_of(dataset, i) for i in order]
    expected = direct_decode(dataset, order, preset=preset, seed=seed, epoch=0)
    assert torch.equal(images, expected)


def test_without_a_transform_batches_are_uint8_chw_images_as_the_decoder_gives(
    source: Source, tmp_path: Path
) -> None:
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(dataset, batch_size=5, num_workers=1, decode="cpu")
    batches = list(loader)
    loader.close()
    images = [image for batch_images, _ in batches for image in batch_images]
    labels = torch.cat([labels for _, labels in batches])
    assert labels.tolist() == source.labels  # no shuffle: dataset order
    with make_decoder("cpu") as decoder:
        expected = decoder.decode(source.images, indices=list(range(TOTAL))).images
    assert len(images) == TOTAL
    for got, want, data in zip(images, expected, source.images, strict=True):
        assert got.dtype == torch.uint8
        assert got.shape[0] == 3
        assert tuple(got.shape[1:]) == Image.open(io.BytesIO(data)).size[::-1]  # H, W
        assert torch.equal(got, want)


@pytest.mark.parametrize("preset", [TrainPreset(SIZE), EvalPreset(SIZE)], ids=["train", "eval"])
def test_decoded_batches_equal_the_decoder_called_directly_in_later_epochs_too(
    source: Source, tmp_path: Path, preset: Any
) -> None:
    seed = 9
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=16,
        shuffle=True,
        num_workers=2,
        seed=seed,
        decode="cpu",
        transform=preset,
    )
    for epoch in range(3):
        assert loader.epoch == epoch  # each full pass moves to the next epoch
        images = torch.cat([images for images, _ in as_list(loader)])
        order = plan_order(dataset, seed=seed, epoch=epoch)
        assert torch.equal(
            images, direct_decode(dataset, order, preset=preset, seed=seed, epoch=epoch)
        )
    loader.close()


# ---------------------------------------------------------------------------------------------
# Workers, epochs, set_epoch
# ---------------------------------------------------------------------------------------------


def _train_loader(dataset: ShardedDataset, num_workers: int, seed: int = 2) -> Any:
    return fl.DataLoader(
        dataset,
        batch_size=6,
        shuffle=True,
        num_workers=num_workers,
        seed=seed,
        decode="cpu",
        transform=TrainPreset(SIZE),
    )


# 3 threads are more than this machine's 2 cores: torch warns about *processes* the fast path
# never starts (test_fast_path_does_not_warn_about_worker_processes_it_does_not_start).
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_num_workers_0_1_3_give_identical_batches(source: Source, tmp_path: Path) -> None:
    dataset = fl.open_dataset(str(source.root / "tars"), cache_dir=str(tmp_path))
    runs = []
    for workers in (0, 1, 3):
        loader = _train_loader(dataset, workers)
        runs.append([as_list(loader), as_list(loader)])  # two epochs
        loader.close()
    for other in runs[1:]:
        for epoch_a, epoch_b in zip(runs[0], other, strict=True):
            assert len(epoch_a) == len(epoch_b) == 10
            for (images_a, labels_a), (images_b, labels_b) in zip(epoch_a, epoch_b, strict=True):
                assert torch.equal(labels_a, labels_b)
                assert torch.equal(images_a, images_b)


def test_fast_path_does_not_warn_about_worker_processes_it_does_not_start(
    source: Source, tmp_path: Path
) -> None:
    """The fast path runs ``num_workers`` threads; torch's "will create N worker processes"
    warning (more workers than cores) is about processes, so it must not appear."""
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    workers = len(os.sched_getaffinity(0)) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = fl.DataLoader(dataset, batch_size=30, num_workers=workers, collate_fn=list)
        assert sum(len(b) for b in loader) == TOTAL
    loader.close()


def test_epochs_change_order_without_set_epoch_and_set_epoch_reproduces_one(
    source: Source, tmp_path: Path
) -> None:
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = _train_loader(dataset, num_workers=2)
    epochs = [as_list(loader) for _ in range(3)]
    labels = [torch.cat([lb for _, lb in e]).tolist() for e in epochs]
    assert len({tuple(lb) for lb in labels}) == 3  # three different orders
    assert loader.epoch == 3

    for epoch in (1, 0, 2):  # a new loader, or this one going back
        for target in (loader, _train_loader(dataset, num_workers=1)):
            target.set_epoch(epoch)
            again = as_list(target)
            assert len(again) == len(epochs[epoch])
            for (images, lb), (images_0, lb_0) in zip(again, epochs[epoch], strict=True):
                assert torch.equal(lb, lb_0)
                assert torch.equal(images, images_0)  # the augmentations too
            if target is not loader:
                target.close()
    loader.close()

    # Another seed, another order; shuffle=False reads the dataset in order, every epoch.
    other = _train_loader(dataset, num_workers=2, seed=3)
    assert torch.cat([lb for _, lb in as_list(other)]).tolist() != labels[0]
    other.close()
    in_order = fl.DataLoader(dataset, batch_size=9, num_workers=2, collate_fn=list)
    for _ in range(2):
        assert [i for b in in_order for i in raw_indices(source, b)] == list(range(TOTAL))
    in_order.close()


# ---------------------------------------------------------------------------------------------
# Zarr
# ---------------------------------------------------------------------------------------------


def test_zarr_rows_through_the_loader_equal_dataset_rows(tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    n = 47
    group = zarr.group(str(tmp_path / "z"), zarr_format=3)
    rng = np.random.default_rng(0)
    images = group.create_array("images", shape=(n, 6, 5), chunks=(8, 6, 5), dtype="uint8")
    images[:] = rng.integers(0, 256, (n, 6, 5), dtype=np.uint8)
    ids = group.create_array("ids", shape=(n,), chunks=(5,), dtype="int64")
    ids[:] = np.arange(n)
    dataset = fl.open_dataset(str(tmp_path / "z"), cache_dir=str(tmp_path / "cache"))
    assert dataset.format == "zarr"
    loader = fl.DataLoader(dataset, batch_size=5, shuffle=True, num_workers=2, seed=1)
    seen: list[int] = []
    for batch in loader:
        assert set(batch) == {"ids", "images"}
        assert batch["images"].dtype == torch.uint8
        for row, index in enumerate(batch["ids"].tolist()):
            expected = dataset[index]
            assert torch.equal(batch["images"][row], torch.from_numpy(expected["images"]))
            seen.append(index)
    loader.close()
    assert sorted(seen) == list(range(n))
    assert seen == plan_order(dataset, seed=1, epoch=0)


# ---------------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_stats_are_json_and_count_a_cold_then_a_warm_cache(
    source: Source, tmp_path: Path, kind: str, num_workers: int
) -> None:
    with served(kind, source) as where:
        assert where.server is not None
        cache = tmp_path / "cache"
        where.open("folder", cache)  # lists it: the loader below finds the listing cached

        def run() -> dict[str, Any]:
            where.server.reset_stats()  # type: ignore[union-attr]
            loader = fl.DataLoader(
                where.url("folder"),
                batch_size=8,
                shuffle=True,
                num_workers=num_workers,
                decode="cpu",
                transform=EvalPreset(SIZE),
                cache_dir=str(cache),
                storage_options=dict(where.storage_options),
            )
            assert sum(len(labels) for _, labels in loader) == TOTAL
            stats = loader.stats()
            loader.close()
            back: dict[str, Any] = json.loads(json.dumps(stats))
            assert back == stats  # plain values only
            return back

        # As in a new process: the listing comes from the cache, and the filesystem does not
        # remember the sizes it listed; still one GET per object and no HEAD.
        open_filesystem(where.url("folder"), where.storage_options)[0].invalidate_cache()
        cold = run()
        object_gets = where.server.stats().count(method="GET")
        cold_heads = where.server.stats().count(method="HEAD")
        sent = where.server.stats().bytes_sent
        warm = run()
        warm_gets = where.server.stats().count(method="GET")

    assert object_gets == TOTAL  # each image fetched once
    assert cold_heads == 0  # in one request: no HEAD first (s3fs sends one unless told not to)
    assert sent == source.folder_bytes
    for stats in (cold, warm):
        assert stats["path"] == "fastload"
        assert stats["decode_backend"] == "cpu"
        assert stats["num_workers"] == num_workers
        assert stats["samples"] == TOTAL
        assert stats["batches"] == 8
        assert stats["skipped_samples"] == 0
        assert 0.0 <= stats["wait_fraction"] <= 1.0
        assert stats["stages"]["decode"]["calls"] == TOTAL
        assert stats["stages"]["wait"]["calls"] == 8

    def cache_counts(stats: dict[str, Any]) -> dict[str, int]:
        counts = stats["counts"]
        return {k: counts.get(k, 0) for k in ("cache_misses", "cache_hits", "bytes_fetched")}

    # Every object is a miss on the cold cache and a hit on the warm one, exactly once.
    assert {"cold": cache_counts(cold), "warm": cache_counts(warm)} == {
        "cold": {"cache_misses": TOTAL, "cache_hits": 0, "bytes_fetched": source.folder_bytes},
        "warm": {"cache_misses": 0, "cache_hits": TOTAL, "bytes_fetched": 0},
    }
    assert warm_gets == 0


# ---------------------------------------------------------------------------------------------
# A small real training loop
# ---------------------------------------------------------------------------------------------


class _DecodedSamples(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """A plain torch dataset over the same files that decodes each sample on its own with
    fastload's CPU decoder, for the epoch its owner sets."""

    def __init__(self, dataset: ShardedDataset, preset: TrainPreset, seed: int) -> None:
        self.dataset = dataset
        self.decoder = make_decoder("cpu", transform=preset, seed=seed, num_threads=1)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.dataset[index]
        decoded = self.decoder.decode([image], indices=[index], epoch=self.epoch)
        return decoded.images[0].clone(), label


def _tiny_cnn() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, CLASSES),
    )


def _train(batches_per_epoch: Any, epochs: int) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _tiny_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        for images, labels in batches_per_epoch(epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def test_a_tiny_cnn_trains_to_the_same_loss_curve_as_with_torchs_loader(
    source: Source, tmp_path: Path
) -> None:
    """Why equality must hold, bit for bit: both loaders read the same order (torch's through
    ``fl.ShardedSampler``, the plan fl.DataLoader uses for one rank), each sample's pixels
    depend only on (seed, epoch, index) and the decoder handles each sample on its own (a
    batch's rows equal single-sample decodes), and the model starts from the same seed. With
    one intra-op thread the CPU kernels reduce in a fixed order, so every step is the same
    arithmetic on the same numbers."""
    seed, epochs, batch_size = 5, 2, 8
    preset = TrainPreset(SIZE)
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        samples = _DecodedSamples(dataset, preset, seed)
        sampler = fl.ShardedSampler(dataset, rank=0, world_size=1, seed=seed, shuffle=True)
        reference = torch.utils.data.DataLoader(samples, batch_size=batch_size, sampler=sampler)

        def torch_epoch(epoch: int) -> Any:
            sampler.set_epoch(epoch)
            samples.epoch = epoch
            return reference

        ours = fl.DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=2,
            seed=seed,
            decode="cpu",
            transform=preset,
        )
        expected_losses, expected_params = _train(torch_epoch, epochs)
        losses, params = _train(lambda epoch: ours, epochs)
        ours.close()
        samples.decoder.close()
    finally:
        torch.set_num_threads(threads)
    assert len(losses) == epochs * 8
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))
    assert losses[-1] != losses[0]  # it did train


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.filterwarnings("ignore:nvidia-dali-cuda.* is no longer shipped:Warning")
def test_gpu_decoded_batches_skip_the_ring_and_match_the_cpu_decoder(
    source: Source, tmp_path: Path
) -> None:
    seed, preset = 5, EvalPreset(SIZE)
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        seed=seed,
        decode="auto",
        device="cuda",
        transform=preset,
    )
    batches = list(loader)
    stats = loader.stats()
    loader.close()
    assert all(images.device.type == "cuda" for images, _ in batches)
    images = torch.cat([images.cpu() for images, _ in batches])
    labels = torch.cat([labels.cpu() for _, labels in batches])
    order = plan_order(dataset, seed=seed, epoch=0)
    assert labels.tolist() == [label_of(dataset, i) for i in order]
    expected = direct_decode(dataset, order, preset=preset, seed=seed, epoch=0)
    assert float((images - expected).abs().mean()) < 0.05
    # Decoded on the device: the images pass the ring, only the labels are packed and copied.
    assert stats["ring"]["on_device_tensors"] == len(batches)
    assert stats["ring"]["bytes_moved"] == labels.numel() * labels.element_size()


def test_loader_counts_line_up_with_the_datasets_it_reads(source: Source, tmp_path: Path) -> None:
    """len(), the batches of the last pass and the sample count agree, with drop_last too."""
    dataset = fl.open_dataset(str(source.root / "tars"), cache_dir=str(tmp_path))
    for drop_last, expected in ((False, [8] * 7 + [4]), (True, [8] * 7)):
        loader = fl.DataLoader(
            dataset,
            batch_size=8,
            shuffle=True,
            drop_last=drop_last,
            num_workers=2,
            collate_fn=list,
        )
        assert len(loader) == len(expected)
        sizes = [len(batch) for batch in loader]
        assert sizes == expected
        assert loader.stats()["samples"] == sum(expected)
        loader.close()


def _task_nice(tid: str) -> int:
    """A thread's nice value, from /proc (field 19 of its stat; the name may hold spaces)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_loaders_threads_and_the_native_ones_they_start_run_at_thread_nice(
    source: Source, tmp_path: Path
) -> None:
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    before = set(os.listdir("/proc/self/task"))
    base = _task_nice(str(threading.get_native_id()))
    loader = fl.DataLoader(
        dataset,
        batch_size=6,
        num_workers=2,
        decode="cpu",
        transform=TrainPreset(SIZE),
        thread_nice=7,
    )
    batches = iter(loader)
    next(batches)
    next(batches)
    started = set(os.listdir("/proc/self/task")) - before
    python_threads = {str(t.native_id) for t in threading.enumerate()}
    native = started - python_threads
    assert len(started & python_threads) >= 3  # the dispatcher and two workers at least
    assert native  # the native reader's and the JPEG transform's threads
    assert {tid: _task_nice(tid) for tid in started} == dict.fromkeys(started, min(19, base + 7))
    assert _task_nice(str(threading.get_native_id())) == base  # the caller's is untouched
    loader.close()
    with pytest.raises(ValueError, match="thread_nice"):
        fl.DataLoader(dataset, batch_size=6, num_workers=2, thread_nice=20)
