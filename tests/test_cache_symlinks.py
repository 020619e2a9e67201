"""The cache directory is safe to share: a symbolic link planted where fastload writes (a
folder of its own, a temporary file's predictable name, a manifest, a lock, a layout, an
index) is refused with an error naming it, and not one byte is written where it points."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_dataset_tar import tar_bytes

import fastload as fl
from fastload.cache import Cache
from fastload.cache.core import entry_id
from fastload.datasets.tar import write_index
from fastload.errors import FastloadError
from fastload.manifest import manifest_path
from fastload.store import CachedStore, StoreConfig
from fastload.testing import S3FolderServer

# non-ASCII names; the cat is large enough for a file of its own (a part in tmp/)
FILES = {"cat/ä 1.jpg": b"x" * (3 << 20), "dog/ö 2.jpg": b"y" * 2000}


OPTIONS: dict[str, Any] = {}


@pytest.fixture
def dataset(tmp_path: Path) -> Iterator[str]:
    """The dataset on a loopback S3 server: s3://data/ds."""
    root = tmp_path / "buckets" / "data" / "ds"
    for name, data in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with S3FolderServer(tmp_path / "buckets") as server:
        OPTIONS.clear()
        OPTIONS.update(server.storage_options)
        yield "s3://data/ds"


def store_of(url: str, cache: Path) -> CachedStore:
    return CachedStore(StoreConfig(url=url, cache_dir=str(cache), storage_options=OPTIONS))


def read_all(url: str, cache: Path) -> None:
    store = store_of(url, cache)
    try:
        for key in store.object_keys():
            store.read(key)
    finally:
        store.close()


def list_it(url: str, cache: Path) -> None:
    store = store_of(url, cache)
    try:
        store.object_keys()
    finally:
        store.close()


def open_folder(url: str, cache: Path) -> None:
    fl.open_dataset(url, format="imagefolder", cache_dir=str(cache), storage_options=OPTIONS)


# Each case: (where the link goes, relative to the cache, given the dataset; what to do)
Case = tuple[Callable[[str, Path], Path], bool, Callable[[str, Path], None]]


def _part(dataset: str, cache: Path) -> Path:
    return cache / "tmp" / entry_id(f"{dataset}/cat/ä 1.jpg")


def _manifest(dataset: str, cache: Path) -> Path:
    return manifest_path(cache, dataset)


CASES: dict[str, Case] = {
    "tmp folder": (lambda d, c: c / "tmp", True, read_all),
    "manifests folder": (lambda d, c: c / "manifests", True, list_it),
    "the manifest file": (_manifest, False, list_it),
    "the listing lock": (lambda d, c: _manifest(d, c).with_suffix(".lock"), False, list_it),
    "the fetch lock": (lambda d, c: c / "fetch.lock", False, read_all),
    "the index": (lambda d, c: c / "index.sqlite", False, read_all),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_planted_link_is_refused_and_nothing_is_written_through_it(
    case: str, dataset: str, tmp_path: Path
) -> None:
    where, folder, act = CASES[case]
    cache = tmp_path / "shared-cache"
    Cache(cache).close()  # the cache exists, as on a shared node
    outside = tmp_path / "outside"
    outside.mkdir()
    link = where(dataset, cache)
    if link.is_dir() and not link.is_symlink():
        link.rmdir()
    elif link.exists():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    target = outside if folder else outside / "victim"
    link.symlink_to(target)
    with pytest.raises(FastloadError) as caught:
        act(dataset, cache)
    assert isinstance(caught.value, OSError)
    assert str(link) in str(caught.value)
    assert "link" in str(caught.value)
    assert list(outside.iterdir()) == []  # not one byte written through the link


def test_a_link_at_a_parts_name_is_refused(dataset: str, tmp_path: Path) -> None:
    """Planted while the cache is open (opening it clears tmp/ of what the dead left)."""
    cache = tmp_path / "shared-cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    store = store_of(dataset, cache)
    try:
        store.object_keys()
        assert store.cache.dir == cache
        link = _part(dataset, cache)
        link.symlink_to(outside / "victim")
        with pytest.raises(FastloadError) as caught:
            store.read("cat/ä 1.jpg")
    finally:
        store.close()
    assert isinstance(caught.value, OSError)
    assert str(link) in str(caught.value)
    assert list(outside.iterdir()) == []


def test_a_planted_layout_link_is_refused(dataset: str, tmp_path: Path) -> None:
    cache = tmp_path / "shared-cache"
    open_folder(dataset, cache)  # lists, and keeps the layout beside the manifest
    (link,) = (cache / "manifests").glob("*.npz")
    link.unlink()
    outside = tmp_path / "outside"
    outside.mkdir()
    link.symlink_to(outside / "victim")
    with pytest.raises(FastloadError) as caught:
        open_folder(dataset, cache)
    assert str(link) in str(caught.value)
    assert list(outside.iterdir()) == []


def test_a_planted_indexes_folder_is_refused(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.tar").write_bytes(tar_bytes([("x.txt", b"hi")]))
    cache = tmp_path / "shared-cache"
    Cache(cache).close()
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache / "indexes").symlink_to(outside)
    with pytest.raises(FastloadError) as caught:
        write_index(str(shards / "a.tar"), cache_dir=str(cache), to="cache", progress=False)
    assert str(cache / "indexes") in str(caught.value)
    assert list(outside.iterdir()) == []


def test_a_stale_part_left_by_a_dead_process_is_replaced(dataset: str, tmp_path: Path) -> None:
    cache = tmp_path / "c"
    store = store_of(dataset, cache)
    try:
        store.object_keys()
        part = _part(dataset, store.cache.dir)
        part.write_bytes(b"left by a process that died")  # with the cache open, as in a race
        assert store.read("cat/ä 1.jpg") == FILES["cat/ä 1.jpg"]
    finally:
        store.close()
    assert not os.path.lexists(part)
