"""The columnar manifest: its file, lookups, sharing between processes, the listing that
makes it (parallel, Arrow, once per node), and the folder datasets built on it."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import posixpath
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastload.manifest as manifest_module
import fastload.remote.listing as listing_module
import fastload.remote.obstore as transport
from fastload.datasets import ImageFolderDataset, detect_format, open_dataset
from fastload.manifest import (
    Manifest,
    RemoteObject,
    list_dataset,
    load_manifest,
    manifest_path,
    seal,
)
from fastload.testing import S3FolderServer
from fastload.testing.s3_folder import S3FolderProcess
from fastload.testing.synthetic import ImageFolderLayout, random_payloads

ODD_KEYS = [
    "a b/c+d%20e.jpg",
    "a-b/x.jpg",
    "a/ü/ñ.JPEG",
    "a/z.png",
    "a.txt",
    "日本/語.jpg",
    "x" * 300,
    "",
]


def odd_objects() -> list[RemoteObject]:
    return [
        RemoteObject(k, None if i == 3 else i * 7, None if i == 2 else f'ETag="{i}";x')
        for i, k in enumerate(ODD_KEYS)
    ]


def columns(m: Manifest) -> list[tuple[str, int | None, str | None]]:
    return [(o.key, o.size, o.version) for o in m]


def test_a_saved_manifest_maps_back_the_same_objects_in_key_order(tmp_path: Path) -> None:
    built = Manifest("s3://b/ds", odd_objects(), listed_at=12.5)
    expected = sorted((o.key, o.size, o.version) for o in odd_objects())
    assert columns(built) == expected
    built.save(tmp_path / "m.flm")
    loaded = Manifest.load(tmp_path / "m.flm")
    assert (loaded.url, loaded.listed_at, columns(loaded)) == ("s3://b/ds", 12.5, expected)
    assert loaded.keys() == [k for k, _, _ in expected]
    assert loaded.total_bytes == sum(s or 0 for _, s, _ in expected)
    for i, (key, _, _) in enumerate(expected):
        assert loaded.index_of(key) == i
        assert loaded.search(key) == i
    assert loaded.indices_of(["a/z.png", "missing", "a"]).tolist() == [
        expected.index(("a/z.png", None, 'ETag="3";x')),
        -1,
        -1,
    ]


def test_a_truncated_or_foreign_file_is_refused(tmp_path: Path) -> None:
    Manifest("s3://b/ds", odd_objects()).save(tmp_path / "m.flm")
    data = (tmp_path / "m.flm").read_bytes()
    (tmp_path / "cut.flm").write_bytes(data[:-3])
    (tmp_path / "other.flm").write_bytes(b"PK\x03\x04" + data[4:])
    for name in ("cut.flm", "other.flm"):
        with pytest.raises(ValueError, match=r"manifest|truncated"):
            Manifest.load(tmp_path / name)


def test_lookups_stay_right_when_every_key_hashes_alike(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(manifest_module.xxhash, "xxh3_64_intdigest", lambda b: 7)
    m = Manifest("s3://b/ds", odd_objects())
    keys = m.keys()
    assert m.indices_of([*reversed(keys), "nope"]).tolist() == [*reversed(range(len(keys))), -1]


def test_a_pickled_manifest_is_its_path_and_an_unsaved_one_its_columns(tmp_path: Path) -> None:
    objects = [RemoteObject(f"c/{i:06d}.jpg", i, f"v{i}") for i in range(20_000)]
    saved = Manifest("s3://b/ds", objects)
    saved.save(tmp_path / "m.flm")
    mapped = Manifest.load(tmp_path / "m.flm")
    assert len(pickle.dumps(mapped)) < 500
    assert columns(pickle.loads(pickle.dumps(mapped))) == columns(saved)
    unsaved = Manifest("s3://b/ds", objects[:10])
    assert columns(pickle.loads(pickle.dumps(unsaved))) == columns(unsaved)
    Manifest("s3://b/ds", objects[:5], listed_at=99.0).save(tmp_path / "m.flm")  # refreshed
    with pytest.raises(OSError, match="was refreshed"):
        pickle.loads(pickle.dumps(mapped))


def _mapping_in_child(manifest: Manifest, out: Any) -> None:
    assert manifest.path is not None
    sum(len(o.key) for o in manifest)  # touch every key page
    out.put(_smaps_of(manifest.path))
    out.get()  # hold the mapping until the parent has looked


def _smaps_of(path: Path) -> dict[str, int]:
    """Summed smaps fields (kB) of this process's mappings of path."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = line.rstrip().endswith(str(path))
            elif inside and head[0].endswith(":") and len(head) >= 2 and head[1].isdigit():
                fields[head[0][:-1]] = fields.get(head[0][:-1], 0) + int(head[1])
    return fields


def test_two_processes_share_one_read_only_mapping_of_the_manifest(tmp_path: Path) -> None:
    objects = [RemoteObject(f"c{i % 9}/{i:07d}.jpg", i, f'"{i:032x}"') for i in range(60_000)]
    Manifest("s3://b/ds", objects).save(tmp_path / "m.flm")
    seal(tmp_path / "m.flm")  # as load_manifest publishes it: only a sealed file is mapped
    mapped = Manifest.load(tmp_path / "m.flm")
    sum(len(o.key) for o in mapped)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_mapping_in_child, args=(mapped, queue))
    child.start()
    try:
        theirs = queue.get(timeout=120)
        ours = _smaps_of(tmp_path / "m.flm")
        queue.put("done")
    finally:
        child.join(60)
    assert child.exitcode == 0
    for smaps in (ours, theirs):
        assert smaps["Shared_Clean"] > 1000  # kB of the file's pages, mapped by both
        assert smaps["Private_Dirty"] == 0  # nobody's copy


def test_a_manifest_of_the_json_format_converts_without_listing_again(tmp_path: Path) -> None:
    with S3FolderServer(tmp_path / "remote") as server:
        for key in ("c0/a.jpg", "c1/b b.jpg"):
            path = tmp_path / "remote" / "bkt" / "ds" / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * 10)
        listed = load_manifest("s3://bkt/ds", tmp_path / "cache", server.storage_options)
        saved = manifest_path(tmp_path / "cache", "s3://bkt/ds")
        saved.unlink()
        old = {  # what fastload wrote before the columnar manifest
            "url": listed.url,
            "listed_at": listed.listed_at,
            "objects": [[o.key, o.size, o.version] for o in listed],
        }
        saved.with_suffix(".json").write_text(json.dumps(old))
        server.reset_stats()
        again = load_manifest("s3://bkt/ds", tmp_path / "cache", server.storage_options)
        assert server.read_stats().listings == 0
    assert columns(again) == columns(listed)
    assert saved.exists()
    assert not saved.with_suffix(".json").exists()


# --- listings ------------------------------------------------------------------------------

TRICKY_NAMES = [
    *(f"big/{i:05d} a+b%20.bin" for i in range(1_050)),  # a page boundary inside a prefix
    "a b/x.bin",
    "a+b/ü.bin",
    "a-b/y.bin",
    "a/z.bin",
    "a.bin",  # between "a-b/..." and "a/..." in key order
    "n/deep/er/k.bin",
    "zz%41/q.bin",
    "zz.bin",  # with "a.bin", loose objects on both sides of most folders
    "日本/語.bin",
]


@pytest.mark.parametrize("arrow", [True, False], ids=["arrow", "dicts"])
def test_a_parallel_listing_equals_s3fs_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arrow: bool
) -> None:
    if not arrow:
        monkeypatch.setattr(transport, "_has_arro3", lambda: False)

    def merged_a_key_at_a_time(*args: Any) -> None:
        raise AssertionError("the parts of a listing overlapped")

    # Objects beside folders ("a.bin") are pieces of their own between the folders' parts.
    monkeypatch.setattr(listing_module, "_python_columns", merged_a_key_at_a_time)
    with S3FolderServer(tmp_path) as server:
        for i, name in enumerate(TRICKY_NAMES):
            path = tmp_path / "bkt" / "root" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(1 + i % 5))
        (tmp_path / "bkt" / "root" / "empty-folder").mkdir()
        fast = list_dataset("s3://bkt/root", server.storage_options)
        monkeypatch.setattr(transport.ObjectStoreTransport, "list_columns", lambda *a: None)
        slow = list_dataset("s3://bkt/root", server.storage_options)  # s3fs's find
        pages = server.read_stats().listings
    assert fast.keys() == sorted(TRICKY_NAMES)
    assert columns(fast) == columns(slow)
    assert pages > 10  # the folders were listed one by one (concurrently), not in one chain


def test_a_listing_under_a_single_folder_splits_on_the_folders_below_it(tmp_path: Path) -> None:
    with S3FolderServer(tmp_path) as server:
        for name in ("train/c0/a.jpg", "train/c1/b.jpg", "train/c2/c.jpg", "train/x.txt"):
            path = tmp_path / "bkt" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"data")
        listed = list_dataset("s3://bkt", server.storage_options)
        pages = server.read_stats().listings
    assert listed.keys() == ["train/c0/a.jpg", "train/c1/b.jpg", "train/c2/c.jpg", "train/x.txt"]
    assert pages >= 2 + 3  # the root and train/ by delimiter, then each class (not train/ whole)


def _open_in_child(url: str, cache_dir: str, options: dict[str, Any], out: Any) -> None:
    out.put("starting")
    out.put(len(load_manifest(url, Path(cache_dir), options)))


def test_processes_starting_together_on_a_node_list_the_bucket_once(tmp_path: Path) -> None:
    layout = ImageFolderLayout(objects=3_000, classes=30, payloads=random_payloads(2, 64))
    cache = tmp_path / "cache"
    with S3FolderProcess(synthetic={"imgs": layout}) as server:
        list_dataset("s3://imgs", server.storage_options)
        one_listing = server.read_stats().listings
        server.reset_stats()
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        ranks = [
            context.Process(
                target=_open_in_child,
                args=("s3://imgs", str(cache), server.storage_options, queue),
            )
            for _ in range(6)
        ]
        lock = manifest_path(cache, "s3://imgs").with_suffix(".lock")
        lock.parent.mkdir(parents=True)
        with manifest_module._ListingLock(lock, "s3://imgs"):  # this process lists first
            for rank in ranks:
                rank.start()
            assert [queue.get(timeout=300) for _ in ranks] == ["starting"] * len(ranks)
            time.sleep(0.5)  # the ranks reach the lock and wait
            list_dataset("s3://imgs", server.storage_options).save(lock.with_suffix(".flm"))
        sizes = [queue.get(timeout=300) for _ in ranks]
        for rank in ranks:
            rank.join(60)
        assert server.read_stats().listings == one_listing  # this process's, no rank's
    assert sizes == [3_000] * len(ranks)


def test_a_million_object_bucket_opens_as_an_imagefolder(tmp_path: Path) -> None:
    layout = ImageFolderLayout(objects=1_000_000, classes=1_000, payloads=random_payloads(3, 32))
    with S3FolderProcess(synthetic={"big": layout}) as server:
        ds = open_dataset(
            "s3://big", cache_dir=str(tmp_path), storage_options=server.storage_options
        )
        again = open_dataset(
            "s3://big", cache_dir=str(tmp_path), storage_options=server.storage_options
        )
    assert isinstance(ds, ImageFolderDataset)
    assert isinstance(again, ImageFolderDataset)
    assert len(ds) == len(again) == 1_000_000
    assert len(ds.classes) == 1_000
    assert len(pickle.dumps(ds)) < 100_000
    for i in (0, 999, 1_000, 543_210, 999_999):
        key, _, size = (ds.sample_ranges(i) or [("", 0, 0)])[0]
        assert (key, size) == (layout.key(i), layout.size(i))
        assert ds.target(i) == again.target(i) == layout.label(i)


# --- folder datasets over the manifest -----------------------------------------------------


def torchvision_order(keys: list[str], extensions: tuple[str, ...]) -> list[tuple[str, int]]:
    """ImageFolder's (key, class) pairs as torchvision makes them: classes sorted, then
    folders (os.walk's roots sorted), then names."""
    by_class: dict[str, list[str]] = {}
    for key in keys:
        if "/" in key and key.lower().endswith(extensions):
            by_class.setdefault(key.split("/", 1)[0], []).append(key)
    out = []
    for label, name in enumerate(sorted(by_class)):
        out += [(k, label) for k in sorted(by_class[name], key=posixpath.split)]
    return out


FOLDER_KEYS = [
    "cls/b.jpg",
    "cls/a/x.JPG",
    "cls/a b/y.png",
    "cls/a-c.jpeg",
    "cls-a/z.webp",
    "cls.b/w.jpg",
    "cls.txt",
    "cls/notes.txt",
    "Zeta/q.PNG",
    "ünï/k.jpg",
    "root.jpg",
]


def test_imagefolder_orders_samples_as_torchvision_on_first_and_cached_open(
    tmp_path: Path,
) -> None:
    for key in FOLDER_KEYS:
        path = tmp_path / "ds" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    extensions = (".jpg", ".jpeg", ".png", ".webp")
    expected = torchvision_order(FOLDER_KEYS, extensions)
    for _ in range(2):  # the second open reads the layout kept beside the manifest
        ds = open_dataset(
            str(tmp_path / "ds"),
            format="imagefolder",
            cache_dir=str(tmp_path / "cache"),
            extensions=extensions,
        )
        assert isinstance(ds, ImageFolderDataset)
        assert [(ds.keys[i], ds.target(i)) for i in range(len(ds))] == expected
        assert ds.targets.tolist() == [label for _, label in expected]
        assert [ds[i] for i in range(len(ds))] == [(k.encode(), c) for k, c in expected]
        clone = pickle.loads(pickle.dumps(ds))
        assert [clone.keys[i] for i in range(len(clone))] == [k for k, _ in expected]


@pytest.mark.parametrize(
    "keys",
    [
        FOLDER_KEYS,
        ["a/.zarray", "a/0.0"],
        ["g/zarr.json", "g/c/0"],
        ["x.tar", "y.tar", "readme"],
        ["img.jpg", "c/img.jpg"],
        ["data.bin"],
    ],
)
def test_detect_format_reads_the_columns_as_it_read_the_keys(keys: list[str]) -> None:
    fmt, _ = detect_format(keys)
    assert detect_format(Manifest("s3://b", [RemoteObject(k, 1, None) for k in keys]))[0] == fmt


def test_index_runs_give_back_the_order_they_were_made_of() -> None:
    from fastload.datasets.columns import IndexRuns

    order = np.array([5, 6, 7, 0, 1, 9, 3, 4], dtype=np.int64)
    runs = IndexRuns(order)
    assert [runs[i] for i in range(len(runs))] == order.tolist()
    assert len(runs.starts) == 4
    whole = IndexRuns.whole(4)
    assert [whole[i] for i in range(4)] == [0, 1, 2, 3]
    assert len(IndexRuns.whole(0)) == 0


def test_pickles_of_the_folder_datasets_do_not_grow_with_the_samples(tmp_path: Path) -> None:
    objects = [RemoteObject(f"c{i % 10}/{i:06d}.jpg", 10, None) for i in range(50_000)]
    path = manifest_path(tmp_path, "s3://b/ds")
    Manifest("s3://b/ds", objects, listed_at=1.0).save(path)
    ds = open_dataset("s3://b/ds", cache_dir=str(tmp_path), format="imagefolder")
    assert len(ds) == 50_000
    assert len(pickle.dumps(ds)) < 20_000
    assert os.path.exists(path)


@pytest.mark.parametrize("etags", [['"a"', '"bb"', '"ccc"'], ['"aa"', '"bb"', '"cc"']])
def test_an_arrow_page_gives_the_versions_a_key_at_a_time_would(etags: list[str]) -> None:
    arro3 = pytest.importorskip("arro3.core")
    from fastload.remote.listing import from_arrow

    seconds = [1_767_225_600, 1_767_225_601, 1_767_225_600]
    page = arro3.RecordBatch.from_pydict(
        {
            "path": arro3.Array(["ds/a b", "ds/ü/x", "ds/z"], arro3.DataType.string()),
            "last_modified": arro3.Array(
                [s * 1_000_000 for s in seconds], arro3.DataType.int64()
            ).cast(arro3.DataType.timestamp("us", tz="UTC")),
            "size": arro3.Array([1, 2, 3], arro3.DataType.uint64()),
            "e_tag": arro3.Array(etags, arro3.DataType.string()),
        }
    )
    listed = from_arrow(page, len(b"ds/"))
    assert listed is not None
    manifest = Manifest.of_listing("s3://b/ds", 0.0, listed)
    expected = [
        transport._entries(  # the per-entry path, from obstore's dicts
            [
                {
                    "path": p,
                    "size": n,
                    "e_tag": e,
                    "last_modified": datetime.datetime.fromtimestamp(s, datetime.UTC),
                }
            ],
            len(b"ds/"),
            None,
        )
        for p, n, e, s in zip(["ds/a b", "ds/ü/x", "ds/z"], [1, 2, 3], etags, seconds, strict=True)
    ]
    assert columns(manifest) == [
        o for one in expected if one is not None for o in columns(Manifest.of_listing("", 0, one))
    ]
