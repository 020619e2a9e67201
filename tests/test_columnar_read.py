"""A decoded batch of a folder's images, all cached, is read as columns (no Python call
per sample: ``fastload.loader.columnar_read``): the same images and labels as the
decoder called directly on each file, a damaged cached copy fetched again, a cold batch
read by the general path; from a loopback S3 server in its own process."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastload as fl
from fastload.cache import Cache
from fastload.datasets.columns import IndexRuns
from fastload.decode import EvalPreset, make_decoder
from fastload.testing import S3FolderServer
from fastload.testing.synthetic import jpeg_payloads

SIZE = 32
PHOTOS = jpeg_payloads(10, width=64, height=48, seed=3)
FILES = {f"ds/class{i % 3}/{i:02d}-ä.jpg": photo for i, photo in enumerate(PHOTOS)}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[S3FolderServer]:
    for key, data in FILES.items():
        path = tmp_path / "buckets" / "data" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with S3FolderServer(tmp_path / "buckets") as s3:
        yield s3


def open_folder(server: S3FolderServer, cache: Path, fmt: str = "imagefolder") -> Any:
    return fl.open_dataset(
        "s3://data/ds", format=fmt, cache_dir=str(cache), storage_options=server.storage_options
    )


def loader_of(dataset: Any) -> Any:
    return fl.DataLoader(
        dataset, batch_size=4, shuffle=True, seed=5, decode="cpu", transform=EvalPreset(SIZE)
    )


def expected(dataset: Any, order: list[int]) -> torch.Tensor:
    """The decoder called directly on each sample's file, as the source has it."""
    photos = [FILES[f"ds/{dataset.keys[i]}"] for i in order]
    with make_decoder("cpu", transform=EvalPreset(SIZE), seed=5) as decoder:
        images: torch.Tensor = decoder.decode(photos, indices=order, epoch=0).images.clone()
    return images


def epoch(loader: Any) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def test_a_cached_folder_is_read_as_columns_with_the_right_images_and_labels(
    server: S3FolderServer, tmp_path: Path
) -> None:
    dataset = open_folder(server, tmp_path / "c")
    dataset.warm()
    loader = loader_of(dataset)
    order = [i for batch in loader.batch_sampler for i in batch]
    images, labels = epoch(loader)
    counts = loader.stats()["counts"]
    assert counts["column_reads"] == counts["batches"] == 3  # every batch, as columns
    assert labels.dtype == torch.int64
    assert labels.tolist() == [dataset.target(i) for i in order]
    assert torch.equal(images, expected(dataset, order))


def test_a_folder_without_classes_gives_images_alone(
    server: S3FolderServer, tmp_path: Path
) -> None:
    dataset = open_folder(server, tmp_path / "c", fmt="files")
    dataset.warm()
    loader = fl.DataLoader(dataset, batch_size=4, decode="cpu", transform=EvalPreset(SIZE))
    batches = list(loader)
    assert all(isinstance(b, torch.Tensor) for b in batches)
    assert loader.stats()["counts"]["column_reads"] == 3
    assert torch.equal(torch.cat(batches), expected(dataset, list(range(len(dataset)))))


def test_a_cold_batch_goes_through_the_general_path_then_columns(
    server: S3FolderServer, tmp_path: Path
) -> None:
    reads = []
    for _ in range(2):  # cold, then cached
        dataset = open_folder(server, tmp_path / "c")
        loader = loader_of(dataset)
        order = [i for batch in loader.batch_sampler for i in batch]
        images, labels = epoch(loader)
        assert labels.tolist() == [dataset.target(i) for i in order]
        assert torch.equal(images, expected(dataset, order))
        reads.append(loader.stats()["counts"].get("column_reads", 0))
    assert reads[0] < 3  # the first batch at least was not cached yet
    assert reads[1] == 3


def test_a_damaged_cached_image_is_fetched_again_not_decoded(
    server: S3FolderServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "c"
    open_folder(server, cache).warm()
    damaged = "ds/class1/04-ä.jpg"
    store = Cache(cache, create=False)
    try:
        entry = store.entry(f"s3://data/{damaged}")
        assert entry is not None
        where = store.location_of(entry)
    finally:
        store.close()
    with open(where.path, "r+b") as f:  # a bit flipped in the image data, past its headers
        at = where.offset + where.size // 2
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    path = f"/data/{damaged}"
    before = server.stats().count(path=path, method="GET")

    dataset = open_folder(server, cache)
    loader = loader_of(dataset)
    order = [i for batch in loader.batch_sampler for i in batch]
    with caplog.at_level(logging.WARNING, logger="fastload"):
        images, labels = epoch(loader)
    assert torch.equal(images, expected(dataset, order))
    assert labels.tolist() == [dataset.target(i) for i in order]
    assert server.stats().count(path=path, method="GET") == before + 1  # fetched again, once
    counts = loader.stats()["counts"]
    assert counts["corrupt_entries"] == 1
    assert counts["column_reads"] == 2  # the batch with the damaged copy: the general path
    assert "04-ä.jpg" in caplog.text


def test_index_runs_at_is_each_index_of_the_runs() -> None:
    order = np.array([5, 6, 7, 0, 1, 9, 3, 4], dtype=np.int64)
    runs = IndexRuns(order)
    indices = np.array([7, 0, 3, 4, 2, 5, 6, 1], dtype=np.int64)
    assert runs.at(indices).tolist() == [runs[i] for i in indices.tolist()]
    assert runs.at(indices).tolist() == order[indices].tolist()
