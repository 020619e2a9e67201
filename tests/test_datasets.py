"""File-folder datasets and the read-through store, against local, HTTP and S3 remotes."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from conftest import Remote, open_remote

from fastload.datasets import DatasetError, ImageFolderDataset, detect_format, open_dataset
from fastload.errors import RemoteNotFoundError


def test_imagefolder_samples_and_classes_match_the_source(remote: Remote, tmp_path: Path) -> None:
    remote.replace("class_1/sub/zz.jpg", b"jpeg-bytes")
    remote.replace("class_0/a.png", b"png-bytes")
    remote.replace("README.txt", b"not a sample")
    ds = open_dataset(
        remote.url,
        format="imagefolder",
        cache_dir=str(tmp_path / "c"),
        storage_options=remote.storage_options,
        refresh=True,
    )
    assert isinstance(ds, ImageFolderDataset)
    assert ds.classes == ["class_0", "class_1"]
    assert [ds[i] for i in range(len(ds))] == [
        (b"png-bytes", 0),
        (b"jpeg-bytes", 1),
    ]
    assert ds.suffix(0) == ".png"
    assert list(ds.shard_sizes) == [1, 1]


def test_files_dataset_reads_every_object(remote: Remote, tmp_path: Path) -> None:
    ds = open_dataset(
        remote.url,
        format="files",
        cache_dir=str(tmp_path / "c"),
        storage_options=remote.storage_options,
    )
    assert len(ds) == len(remote.files)
    assert {ds.keys[i]: ds[i] for i in range(len(ds))} == remote.files
    assert ds[-1] == remote.files[ds.keys[-1]]
    with pytest.raises(IndexError, match=str(len(ds))):
        ds[len(ds)]


def test_auto_detects_and_says_why(tmp_path: Path) -> None:
    with open_remote("local", tmp_path) as remote:
        ds = open_dataset(remote.url, cache_dir=str(tmp_path / "c"))
        assert ds.format == "files"  # .bin files, not images
        assert "no Zarr" in ds.format_reason
    assert detect_format(["a/x.jpg", "b/y.JPEG"])[0] == "imagefolder"
    assert detect_format(["x.jpg"])[0] == "files"
    assert detect_format(["s-000.tar", "s-001.tar", "meta.json"])[0] == "tar"
    assert detect_format(["images/.zarray", "images/0.0"])[0] == "zarr"
    assert detect_format(["zarr.json", "images/zarr.json"])[0] == "zarr"


def test_reads_fetch_on_demand_once(served: Remote, tmp_path: Path) -> None:
    ds = open_dataset(
        served.url,
        format="files",
        cache_dir=str(tmp_path / "c"),
        storage_options=served.storage_options,
    )
    key = ds.keys[4]
    assert served.gets(key) == 0  # opening lists; it fetches nothing
    for _ in range(3):
        assert ds[4] == served.files[key]
    assert served.gets(key) == 1
    assert ds.store.local_path(key) is not None


def test_a_full_pin_cache_reads_the_rest_straight_from_the_remote(
    served: Remote, tmp_path: Path
) -> None:
    budget = sum(sorted(map(len, served.files.values()))[:5])
    ds = open_dataset(
        served.url,
        format="files",
        cache_dir=str(tmp_path / "c"),
        storage_options=served.storage_options,
        max_bytes=budget,
        budget_counts="entries",
        policy="pin",
    )
    assert {ds.keys[i]: ds[i] for i in range(len(ds))} == served.files
    assert ds.store.cache.used_bytes() <= budget
    uncached = [k for k in ds.keys if ds.store.local_path(k) is None]
    assert uncached  # most of the dataset did not fit...
    assert all(served.gets(k) == 1 for k in uncached)  # ...and was read once, not cached


def test_warm_stages_shards_ahead(served: Remote, tmp_path: Path) -> None:
    ds = open_dataset(
        served.url,
        format="files",
        cache_dir=str(tmp_path / "c"),
        storage_options=served.storage_options,
    )
    ds.warm([3, 1])
    assert ds.store.local_path(ds.keys[3]) is not None
    assert ds.store.local_path(ds.keys[1]) is not None
    assert ds.store.local_path(ds.keys[0]) is None


def test_datasets_pickle_to_settings_and_reopen(tmp_path: Path) -> None:
    with open_remote("http", tmp_path) as remote:
        ds = open_dataset(remote.url, format="files", cache_dir=str(tmp_path / "c"))
        clone = pickle.loads(pickle.dumps(ds))
        assert clone[2] == remote.files[ds.keys[2]]
        assert len(pickle.dumps(ds)) < 10_000 + 200 * len(ds)  # settings and listing only


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_torch_dataloader_workers_read_the_dataset(tmp_path: Path, context) -> None:
    with open_remote("http", tmp_path, count=12) as remote:
        ds = open_dataset(remote.url, format="files", cache_dir=str(tmp_path / "c"))
        loader = torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=2, multiprocessing_context=context, timeout=60
        )
        got = list(loader)
        assert got == [remote.files[k] for k in ds.keys]
        assert all(remote.gets(k) == 1 for k in ds.keys)


def test_empty_and_missing_datasets_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises((DatasetError, RemoteNotFoundError, OSError), match="empty"):
        open_dataset(str(tmp_path / "empty"), format="files", cache_dir=str(tmp_path / "c"))
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "x.jpg").write_bytes(b"x")
    with pytest.raises(DatasetError, match="class folders"):
        open_dataset(str(tmp_path / "flat"), format="imagefolder", cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="format must be one of"):
        open_dataset(str(tmp_path / "flat"), format="csv")


def test_one_sample_dataset(tmp_path: Path) -> None:
    (tmp_path / "one" / "cls").mkdir(parents=True)
    (tmp_path / "one" / "cls" / "x.jpg").write_bytes(b"only")
    ds = open_dataset(str(tmp_path / "one"), cache_dir=str(tmp_path / "c"))
    assert ds.format == "imagefolder"
    assert len(ds) == 1
    assert ds[0] == (b"only", 0)
