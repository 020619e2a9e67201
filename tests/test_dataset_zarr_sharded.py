"""Sharded Zarr v3 (sharding_indexed) and the zarr-python fallback, against zarr-python."""

from __future__ import annotations

import contextlib
import json
import pickle
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec, TransposeCodec, ZstdCodec

from fastload.datasets import DatasetError, open_dataset
from fastload.datasets.zarr import ZarrArray, ZarrDataset, ZarrPythonArray
from fastload.sampler import ShardedSampler
from fastload.testing import S3Server

N = 23  # not a multiple of any shard or inner chunk length below
NAMES = ("images", "labels", "weights")


def write_group(root: Path) -> None:
    """images: 6-row shards split along axis 1 (7 = 6 + a partial edge shard), inner chunks
    (2, 3, 5, 3); rows 14.. never written, so shard-row 2 is part fill value and shard-row 3
    has no objects. labels: 9-row shards of 3-row inner chunks, zstd + crc32c inside, a
    missing inner chunk (rows 10..14). weights: index at the start, transposed inner chunks
    (4, 2) of (8, 4) shards, first column pair of the first shard never written."""
    group = zarr.group(str(root), zarr_format=3)
    rng = np.random.default_rng(0)
    images = group.create_array(
        "images",
        shape=(N, 7, 5, 3),
        chunks=(2, 3, 5, 3),
        shards=(6, 6, 5, 3),
        dtype="uint8",
        fill_value=7,
        compressors=BloscCodec(cname="lz4", shuffle="bitshuffle"),
    )
    images[:14] = rng.integers(0, 256, (14, 7, 5, 3), dtype=np.uint8)
    labels = group.create_array(
        "labels",
        shape=(N,),
        chunks=(3,),
        shards=(9,),
        dtype="int64",
        fill_value=-1,
        compressors=[ZstdCodec(level=3), Crc32cCodec()],
    )
    labels[:10] = np.arange(10)
    labels[15:] = np.arange(15, N)
    weights = group.create_array(
        "weights",
        shape=(N, 4),
        chunks=(4, 2),
        shards={"shape": (8, 4), "index_location": "start"},
        dtype="float32",
        fill_value=np.nan,
        filters=TransposeCodec(order=(1, 0)),
        compressors=None,
    )
    weights[:, 2:] = rng.random((N, 2), dtype=np.float32)
    weights[8:, :2] = rng.random((N - 8, 2), dtype=np.float32)


def expected(path: Path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(group[name][:]) for name in NAMES}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the sharded group as ``ds``."""
    base = tmp_path_factory.mktemp("zarr_sharded")
    write_group(base / "ds")
    return base


@contextlib.contextmanager
def serve(kind: str, base: Path) -> Iterator[tuple[str, dict[str, Any], S3Server | None]]:
    """(url, storage_options, server) of ``base/ds`` on a local path or S3 (loopback)."""
    if kind == "local":
        yield str(base / "ds"), {}, None
    else:
        with S3Server() as s3:
            s3.upload_dir(base / "ds", "data", prefix="ds")
            yield "s3://data/ds", s3.storage_options, s3


def gets(server: S3Server, key: str) -> int:
    return server.stats().count(path=f"/data/ds/{key}", method="GET")


def open_local(path: Path, cache: Path, **options: Any) -> Any:
    return open_dataset(str(path), format="zarr", cache_dir=str(cache), **options)


def test_the_metadata_reads_as_shards_of_inner_chunks(source: Path, tmp_path: Path) -> None:
    ds = open_local(source / "ds", tmp_path)
    assert all(isinstance(a, ZarrArray) for a in ds.arrays.values())
    images = ds.arrays["images"]
    assert images.chunks == (2, 3, 5, 3)
    assert images.shard is not None
    assert (images.shard.shape, images.shard.per_shard) == ((6, 6, 5, 3), (3, 2, 1, 1))
    assert images.shard.index_crc32c
    assert not images.shard.index_at_start
    assert ds.arrays["weights"].shard.index_at_start
    assert ds.shard_sizes == [6, 6, 6, 5]  # shard-rows of images
    # shard-row 1 (rows 6..11): images' two shards along axis 1, labels shard 0 (rows 0..8)
    # and 1 (9..17), weights shards 0 (0..7) and 1 (8..15)
    assert ds.shard_keys[1] == [
        "images/c/1/0/0/0",
        "images/c/1/1/0/0",
        "labels/c/0",
        "labels/c/1",
        "weights/c/0/0",
        "weights/c/1/0",
    ]
    # shard-row 3 (rows 18..22): no images shard was written
    assert ds.shard_keys[3] == ["labels/c/2", "weights/c/2/0"]


@pytest.mark.parametrize("shard_reads", ["auto", "whole", "ranges"])
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_every_row_matches_zarr_python(
    kind: str, shard_reads: str, source: Path, tmp_path: Path
) -> None:
    want = expected(source / "ds")
    with serve(kind, source) as (url, options, server):
        ds = open_dataset(
            url,
            format="auto",
            cache_dir=str(tmp_path),
            storage_options=options,
            shard_reads=shard_reads,
        )
        assert isinstance(ds, ZarrDataset)
        assert (ds.zarr_format, ds.is_group, len(ds)) == (3, True, N)
        for _ in range(2):
            for i in range(N):
                row = ds[i]
                assert list(row) == list(NAMES)
                for name, values in want.items():
                    assert row[name].dtype == values.dtype
                    assert row[name].shape == values.shape[1:]
                    np.testing.assert_array_equal(row[name], values[i])
        for lo, hi in [(0, N), (3, 17), (13, 14), (20, 20)]:
            batch = ds.get_rows(lo, hi)
            for name, values in want.items():
                np.testing.assert_array_equal(batch[name], values[lo:hi])
        # fill values where nothing was written: a missing shard, missing inner chunks
        np.testing.assert_array_equal(ds[20]["images"], np.full((7, 5, 3), 7, np.uint8))
        np.testing.assert_array_equal(ds[15]["images"], np.full((7, 5, 3), 7, np.uint8))
        assert ds[12]["labels"] == -1
        assert np.isnan(ds[3]["weights"][:2]).all()
        assert not np.isnan(ds[3]["weights"][2:]).any()
        if server is not None and shard_reads == "whole":  # each shard crossed once, whole
            for key in {k for keys in ds.shard_keys for k in keys}:
                assert gets(server, key) == 1, key


def test_a_whole_pass_reads_each_shard_once(source: Path, tmp_path: Path) -> None:
    """A rank reading whole shards: one GET per shard object, with shard_reads="whole",
    get_rows over each shard, or warm() (what fl.DataLoader's staging does)."""
    want = expected(source / "ds")
    with serve("s3", source) as (url, options, server):
        assert server is not None
        for how in ["whole", "get_rows", "warm"]:
            server.reset_stats()
            ds = open_dataset(
                url,
                cache_dir=str(tmp_path / how),
                storage_options=options,
                shard_reads="whole" if how == "whole" else "auto",
            )
            listing = server.stats().count(method="GET")  # the manifest's listing requests
            if how == "warm":
                ds.warm()
            for s, size in enumerate(ds.shard_sizes):
                lo = int(ds.shard_offsets[s])
                if how == "get_rows":
                    got = ds.get_rows(lo, lo + size)
                    for name, values in want.items():
                        np.testing.assert_array_equal(got[name], values[lo : lo + size])
                else:
                    for j in range(lo, lo + size):
                        np.testing.assert_array_equal(ds[j]["images"], want["images"][j])
            keys = {k for keys in ds.shard_keys for k in keys}
            for key in keys:
                assert gets(server, key) == 1, (how, key)
            assert server.stats().count(method="GET") - listing == len(keys), how
            assert all(ds.store.local_path(k) is not None for k in keys)  # whole, cached


def test_a_few_rows_read_the_index_and_inner_chunks_by_range(source: Path, tmp_path: Path) -> None:
    want = expected(source / "ds")
    with serve("s3", source) as (url, options, server):
        assert server is not None
        ds = open_dataset(url, cache_dir=str(tmp_path), storage_options=options, arrays="images")
        key = "images/c/0/0/0/0"  # rows 0..5, axis-1 rows 0..5: 3 x 2 inner chunks
        size = ds.store.object(key).size
        server.reset_stats()
        np.testing.assert_array_equal(ds[0]["images"], want["images"][0])
        assert gets(server, key) == 3  # the index, the two inner chunks of inner row 0
        assert gets(server, "images/c/0/1/0/0") == 2  # the edge shard: index + its 1 chunk
        np.testing.assert_array_equal(ds[1]["images"], want["images"][1])  # decoded already
        assert gets(server, key) == 3
        np.testing.assert_array_equal(ds[4]["images"], want["images"][4])
        assert gets(server, key) == 5  # the index is known: two more inner chunks
        assert ds.store.local_path(key) is None  # never fetched whole
        assert server.stats().bytes_sent < 2 * size
        # a second dataset over the same cache reads the cached ranges, not the remote
        again = open_dataset(url, cache_dir=str(tmp_path), storage_options=options, arrays="images")
        np.testing.assert_array_equal(again[0]["images"], want["images"][0])
        assert gets(server, key) == 5
        # get_rows over most of shard-row 1 reads its shards whole
        np.testing.assert_array_equal(ds.get_rows(6, 11)["images"], want["images"][6:11])
        assert gets(server, "images/c/1/0/0/0") == 1
        assert ds.store.local_path("images/c/1/0/0/0") is not None
        ranged = open_dataset(
            url,
            cache_dir=str(tmp_path / "ranges"),
            storage_options=options,
            arrays="images",
            shard_reads="ranges",
        )
        np.testing.assert_array_equal(ranged.get_rows(12, 18)["images"], want["images"][12:18])
        assert gets(server, "images/c/2/0/0/0") == 3  # index + inner row 6 (2 chunks); 7, 8 empty
        assert ranged.store.local_path("images/c/2/0/0/0") is None


def test_a_corrupt_shard_index_names_the_shard(source: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(source / "ds", copy)
    shard = copy / "images" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # inside the index at the shard's end
    shard.write_bytes(bytes(data))
    ds = open_local(copy, tmp_path / "cache")
    ds[0]
    with pytest.raises(DatasetError, match=r"images/c/1/0/0/0: the shard index fails its crc32c"):
        ds[6]


def test_an_index_pointing_past_the_shard_is_refused(source: Path, tmp_path: Path) -> None:
    """Without a crc32c (the metadata rewritten to say there is none), an offset past the
    shard's end is caught by the bounds check."""
    copy = tmp_path / "ds"
    shutil.copytree(source / "ds", copy)
    meta_path = copy / "labels" / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"][0]["configuration"]["index_codecs"] = [
        {"name": "bytes", "configuration": {"endian": "little"}}
    ]
    meta_path.write_text(json.dumps(meta))
    shard = copy / "labels" / "c" / "0"
    data = bytearray(shard.read_bytes())
    n = 3 * 16 + 4
    index = np.frombuffer(bytes(data[-n:-4]), "<u8").copy()
    index[0] = len(data) + 100
    data[-n:] = index.tobytes()  # drop the crc too: the metadata says there is none
    shard.write_bytes(bytes(data))
    ds = open_local(copy, tmp_path / "cache", arrays="labels")
    with pytest.raises(DatasetError, match=r"labels/c/0: the shard index points past"):
        ds[0]


def test_pickles_and_keeps_reading(source: Path, tmp_path: Path) -> None:
    ds = open_local(source / "ds", tmp_path)
    first = ds[7]
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.shard_indices.stats()["entries"] == 0
    for name in NAMES:
        np.testing.assert_array_equal(copy[7][name], first[name])


def test_sampler_resumes_exactly_once_from_2_to_3_ranks(source: Path, tmp_path: Path) -> None:
    ds = open_local(source / "ds", tmp_path)
    want = expected(source / "ds")

    def make(rank: int, world: int) -> ShardedSampler:
        s = ShardedSampler(ds, rank=rank, world_size=world, seed=3, drop_last=True)
        s.set_epoch(1)
        return s

    old = [make(r, 2) for r in range(2)]
    iterators = [iter(s) for s in old]
    consumed = [[next(it) for _ in range(4)] for it in iterators]
    state = json.loads(json.dumps(old[0].state_dict()))
    resumed = []
    for r in range(3):
        fresh = make(r, 3)
        fresh.load_state_dict(state)
        resumed.append(list(fresh))
    everything = [i for part in consumed + resumed for i in part]
    assert len(everything) == len(set(everything))  # exactly once
    assert N - len(everything) < 3  # drop_last drops fewer than a rank's share
    for part in consumed + resumed:
        for i in part:
            np.testing.assert_array_equal(ds[i]["labels"], want["labels"][i])


# --- zarr-python for what fastload's own reader refuses ---------------------------------------


def write_mixed(root: Path, zarr_format: int) -> dict[str, np.ndarray]:
    """values (numeric, fastload's own reader), names (variable-length strings) and, for v3,
    pairs (a structured dtype); returns what zarr-python reads."""
    group = zarr.group(str(root), zarr_format=zarr_format)
    values = group.create_array("values", shape=(N, 2), chunks=(5, 2), dtype="int32")
    values[:] = np.arange(2 * N).reshape(N, 2)
    shards = {"shards": (8,)} if zarr_format == 3 else {}  # sharded strings: zarr-python's
    names = group.create_array("names", shape=(N,), chunks=(4,), dtype=str, **shards)
    names[:] = [f"row {i}" * (i % 4) for i in range(N)]
    if zarr_format == 3:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # structured dtypes have no v3 spec yet
            pairs = group.create_array(
                "pairs", shape=(N,), chunks=(6,), dtype=[("x", "<i4"), ("y", "<f8")]
            )
            pairs[:10] = np.array([(i, i / 2) for i in range(10)], dtype=pairs.dtype)
    group = zarr.open_group(str(root), mode="r")
    return {name: np.asarray(group[name][:]) for name in group.array_keys()}


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_refused_arrays_read_through_zarr_python(
    kind: str, zarr_format: int, tmp_path: Path
) -> None:
    want = write_mixed(tmp_path / "src" / "ds", zarr_format)
    with warnings.catch_warnings(), serve(kind, tmp_path / "src") as (url, options, server):
        warnings.simplefilter("ignore")
        ds = open_dataset(url, cache_dir=str(tmp_path / "cache"), storage_options=options)
        assert isinstance(ds.arrays["values"], ZarrArray)  # the fast path where it can
        assert isinstance(ds.arrays["names"], ZarrPythonArray)
        assert "names: read through zarr-python: variable-length strings are not read by " in (
            ds.format_reason
        )
        assert ds.format_reason.startswith("the listing holds Zarr metadata")
        if zarr_format == 3:
            assert "pairs: read through zarr-python: structured dtypes" in ds.format_reason
        rows = [ds[i] for i in range(N)]
        if server is not None:  # zarr-python's reads came through fastload's cache
            meta = "names/zarr.json" if zarr_format == 3 else "names/.zarray"
            assert gets(server, meta) == 1
            assert all(gets(server, k) >= 1 for k in ds.shard_keys[0] if k.startswith("names"))
            before = server.stats().count(method="GET")
            again = open_dataset(url, cache_dir=str(tmp_path / "cache"), storage_options=options)
            for i in range(N):  # a fresh decoded cache: every chunk (or range) from the cache
                np.testing.assert_array_equal(again[i]["names"], rows[i]["names"])
            assert server.stats().count(method="GET") == before
        reader = zarr.open_group(str(tmp_path / "src" / "ds"), mode="r")
        for i, row in enumerate(rows):
            for name, values in want.items():
                assert row[name].dtype == values.dtype
                np.testing.assert_array_equal(row[name], values[i])
                np.testing.assert_array_equal(row[name], np.asarray(reader[name][i]))
        batch = ds.get_rows(2, 19)
        for name, values in want.items():
            np.testing.assert_array_equal(batch[name], values[2:19])
        copy = pickle.loads(pickle.dumps(ds))
        np.testing.assert_array_equal(copy[5]["names"], want["names"][5])


def test_without_zarr_python_the_refusal_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_mixed(tmp_path / "ds", 3)
    monkeypatch.setitem(sys.modules, "zarr", None)  # what a missing package looks like
    with pytest.raises(DatasetError, match=r"data_type 'string' .* pip install zarr"):
        open_local(tmp_path / "ds", tmp_path / "cache", arrays=["values", "names"])
    ds = open_local(tmp_path / "ds", tmp_path / "cache", arrays=["values"])
    assert ds.format_reason == "asked for"


def test_fastload_dataloader_stages_whole_shards(source: Path, tmp_path: Path) -> None:
    """fl.DataLoader stages the shards ahead whole (the first batches may read a few inner
    chunks by range before their staging starts); the next epoch fetches nothing."""
    import fastload as fl

    want = expected(source / "ds")
    with serve("s3", source) as (url, options, server):
        assert server is not None
        ds = open_dataset(url, cache_dir=str(tmp_path), storage_options=options)
        loader = fl.DataLoader(ds, batch_size=4, num_workers=2, seed=1, rank=0, world_size=1)
        seen = []
        for batch in loader:
            labels = np.asarray(batch["labels"])
            seen += labels.tolist()
            assert np.asarray(batch["images"]).shape[1:] == (7, 5, 3)
        assert sorted(seen) == sorted(want["labels"].tolist())
        keys = {k for keys in ds.shard_keys for k in keys}
        assert all(ds.store.local_path(k) is not None for k in keys)  # each fetched whole
        before = server.stats().count(method="GET")
        assert len(list(loader)) == len(seen) // 4 + (len(seen) % 4 > 0)
        assert server.stats().count(method="GET") == before


def test_torch_workers_read_both_paths(tmp_path: Path) -> None:
    """Forked DataLoader workers: the sharded reader and zarr-python each in their process."""
    import torch.utils.data

    want = write_mixed(tmp_path / "ds", 3)
    ds = open_local(tmp_path / "ds", tmp_path / "cache", arrays=["values", "names"])
    ds[0]  # the parent has used both readers before the fork
    loader = torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=2, collate_fn=lambda row: row
    )
    rows = list(loader)
    assert len(rows) == N
    for i, row in enumerate(rows):
        np.testing.assert_array_equal(row["values"], want["values"][i])
        assert str(row["names"]) == want["names"][i]
