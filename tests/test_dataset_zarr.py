"""ZarrDataset against zarr-python reading the same store, on local files, HTTP and S3."""

from __future__ import annotations

import contextlib
import pickle
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numcodecs
import numpy as np
import pytest
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, TransposeCodec, ZstdCodec

from fastload.bench.components import zarr_bench
from fastload.datasets import DatasetError, open_dataset
from fastload.datasets.zarr import ZarrDataset
from fastload.datasets.zarr import chunks as fzarr
from fastload.testing import RangeHTTPServer, S3Server

N = 23  # not a multiple of any chunk length below


def write_group(root: Path, zarr_format: int) -> None:
    """images (7-row chunks, split along axis 2), labels (5-row chunks), weights (4 x 2 chunks,
    F order / transposed); the last images chunk-rows, a labels chunk, the first weights
    chunk-row and the last weights column are never written (fill values)."""
    group = zarr.group(str(root), zarr_format=zarr_format)
    if zarr_format == 2:
        images_kw: dict[str, Any] = {
            "compressors": numcodecs.Blosc(cname="lz4", shuffle=numcodecs.Blosc.BITSHUFFLE)
        }
        labels_kw: dict[str, Any] = {
            "compressors": numcodecs.Zstd(level=3),
            "chunk_key_encoding": {"name": "v2", "separator": "/"},
        }
        weights_kw: dict[str, Any] = {
            "compressors": numcodecs.GZip(level=5),
            "order": "F",
            "filters": [numcodecs.Delta(dtype="<f4")],
        }
        labels_dtype = ">i8"
    else:
        images_kw = {"compressors": BloscCodec(cname="zstd", shuffle="bitshuffle")}
        labels_kw = {
            "compressors": [ZstdCodec(level=3), Crc32cCodec()],
            "serializer": BytesCodec(endian="big"),
            "chunk_key_encoding": {"name": "v2", "separator": "."},
        }
        weights_kw = {"compressors": GzipCodec(level=5), "filters": [TransposeCodec(order=(1, 0))]}
        labels_dtype = "int64"
    rng = np.random.default_rng(zarr_format)
    images = group.create_array(
        "images", shape=(N, 8, 8, 3), chunks=(7, 8, 4, 3), dtype="uint8", fill_value=7, **images_kw
    )
    images[:14] = rng.integers(0, 256, (14, 8, 8, 3), dtype=np.uint8)
    labels = group.create_array(
        "labels", shape=(N,), chunks=(5,), dtype=labels_dtype, fill_value=-1, **labels_kw
    )
    labels[:10] = np.arange(10)
    labels[15:] = np.arange(15, N)
    weights = group.create_array(
        "weights", shape=(N, 5), chunks=(4, 2), dtype="float32", fill_value=np.nan, **weights_kw
    )
    weights[4:, :4] = rng.random((N - 4, 4), dtype=np.float32)


def expected(path: Path) -> dict[str, np.ndarray]:
    group = zarr.open_group(str(path), mode="r")
    return {name: np.asarray(group[name][:]) for name in ("images", "labels", "weights")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A directory per Zarr format, each holding the group as ``ds``."""
    out = {}
    for zarr_format in (2, 3):
        base = tmp_path_factory.mktemp(f"zarr_v{zarr_format}")
        write_group(base / "ds", zarr_format)
        out[zarr_format] = base
    return out


@contextlib.contextmanager
def serve(kind: str, base: Path) -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(url, storage_options, server) of ``base/ds`` on a local path, HTTP or S3."""
    if kind == "local":
        yield str(base / "ds"), {}, None
    elif kind == "http":
        with RangeHTTPServer(base) as http:
            yield http.url_for("ds"), {}, http
    else:
        with S3Server() as s3:
            s3.upload_dir(base / "ds", "data", prefix="ds")
            yield "s3://data/ds", s3.storage_options, s3


def open_local(path: Path, cache: Path, **options: Any) -> Any:
    return open_dataset(str(path), format="zarr", cache_dir=str(cache), **options)


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("kind", ["local", "http", "s3"])
def test_every_row_matches_zarr_python(
    kind: str, zarr_format: int, sources: dict[int, Path], tmp_path: Path
) -> None:
    want = expected(sources[zarr_format] / "ds")
    fmt = "zarr" if kind == "local" else "auto"
    with serve(kind, sources[zarr_format]) as (url, options, server):
        ds = open_dataset(url, format=fmt, cache_dir=str(tmp_path), storage_options=options)
        assert isinstance(ds, ZarrDataset)
        assert (ds.format, ds.zarr_format, ds.is_group) == ("zarr", zarr_format, True)
        assert list(ds.arrays) == ["images", "labels", "weights"]
        assert len(ds) == N
        assert ds.shard_sizes == [7, 7, 7, 2]  # chunk-rows of images, the primary array
        for _ in range(2):
            for i in range(N):
                row = ds[i]
                assert list(row) == ["images", "labels", "weights"]
                for name, values in want.items():
                    assert row[name].dtype == values.dtype.newbyteorder("=")
                    assert row[name].shape == values.shape[1:]
                    np.testing.assert_array_equal(row[name], values[i])
        batch = ds.get_rows(3, 17)
        for name, values in want.items():
            np.testing.assert_array_equal(batch[name], values[3:17])
        if server is not None:  # each chunk file crossed the network once
            prefix = "/ds" if kind == "http" else "/data/ds"
            for key in {k for keys in ds.shard_keys for k in keys}:
                assert server.stats().count(path=f"{prefix}/{key}", method="GET") == 1, key


def test_shards_hold_every_overlapping_chunk_of_every_array(
    sources: dict[int, Path], tmp_path: Path
) -> None:
    ds = open_local(sources[3] / "ds", tmp_path, arrays=["labels", "images"])
    assert list(ds.arrays) == ["labels", "images"]
    assert ds.shard_sizes == [5, 5, 5, 5, 3]  # labels is the primary array now
    # rows 5..9: labels chunk 1; images chunk-rows 0 (rows 0-6) and 1 (rows 7-13), both halves
    assert ds.shard_keys[1] == [
        "labels/1",
        "images/c/0/0/0/0",
        "images/c/0/0/1/0",
        "images/c/1/0/0/0",
        "images/c/1/0/1/0",
    ]
    # rows 10..14: labels/2 and images chunk-row 2 were never written, so only images row 1
    assert ds.shard_keys[2] == ["images/c/1/0/0/0", "images/c/1/0/1/0"]
    assert ds.shard_of(14) == 2
    want = expected(sources[3] / "ds")
    np.testing.assert_array_equal(ds[14]["images"], np.full((8, 8, 3), 7, np.uint8))
    assert ds[14]["labels"] == -1
    for i in range(N):
        np.testing.assert_array_equal(ds[-N + i]["images"], want["images"][i])
    rows = ds.get_rows(0, N)
    np.testing.assert_array_equal(rows["labels"], want["labels"])
    assert ds.get_rows(4, 4)["images"].shape == (0, 8, 8, 3)


def test_consecutive_rows_decode_each_chunk_row_once(
    sources: dict[int, Path], tmp_path: Path
) -> None:
    ds = open_local(sources[2] / "ds", tmp_path)
    for i in range(7):
        ds[i]
    # images: chunk-row 0; labels: 0 and 1 (5-row chunks); weights: 0 and 1 (4-row chunks)
    assert ds.decoded.stats()["misses"] == 5
    assert ds.decoded.stats()["hits"] == 7 * 3 - 5
    no_cache = open_local(sources[2] / "ds", tmp_path, chunk_cache_bytes=0)
    np.testing.assert_array_equal(no_cache[5]["weights"], ds[5]["weights"])
    assert no_cache.decoded.stats()["entries"] == 0


def test_pickles_to_a_fresh_decoded_cache(sources: dict[int, Path], tmp_path: Path) -> None:
    ds = open_local(sources[3] / "ds", tmp_path, chunk_cache_bytes=1 << 20)
    first = ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.decoded.stats()["entries"] == 0
    assert copy.decoded.max_bytes == 1 << 20
    np.testing.assert_array_equal(copy[0]["images"], first["images"])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_a_single_array_gives_rows_not_dicts(
    zarr_format: int, sources: dict[int, Path], tmp_path: Path
) -> None:
    path = sources[zarr_format] / "ds" / "weights"
    ds = open_dataset(str(path), format="auto", cache_dir=str(tmp_path))
    assert isinstance(ds, ZarrDataset)
    assert not ds.is_group
    want = expected(sources[zarr_format] / "ds")["weights"]
    for i in range(N):
        np.testing.assert_array_equal(ds[i], want[i])
    np.testing.assert_array_equal(ds.get_rows(2, 9), want[2:9])
    with pytest.raises(DatasetError, match="single Zarr array"):
        open_local(path, tmp_path, arrays=["weights"])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_one_row_array(zarr_format: int, tmp_path: Path) -> None:
    z = zarr.create_array(
        str(tmp_path / "one"), shape=(1, 3), chunks=(4, 2), dtype="int16", zarr_format=zarr_format
    )
    z[:] = [[1, 2, 3]]
    ds = open_local(tmp_path / "one", tmp_path / "cache")
    assert len(ds) == 1
    assert ds.shard_sizes == [1]
    np.testing.assert_array_equal(ds[0], [1, 2, 3])
    with pytest.raises(IndexError, match="out of range"):
        ds[1]
    with pytest.raises(IndexError, match="not within"):
        ds.get_rows(0, 2)


def test_arrays_of_different_lengths_are_refused(tmp_path: Path) -> None:
    group = zarr.group(str(tmp_path / "g"), zarr_format=3)
    group.create_array("a", shape=(10,), chunks=(4,), dtype="int8")
    group.create_array("b", shape=(9, 2), chunks=(4, 2), dtype="int8")
    with pytest.raises(DatasetError, match=r"'a' has 10, 'b' has 9 rows"):
        open_local(tmp_path / "g", tmp_path / "cache")
    ds = open_local(tmp_path / "g", tmp_path / "cache", arrays=["b"])
    assert len(ds) == 9
    with pytest.raises(DatasetError, match=r"no array 'c'; nodes directly in the group: a, b"):
        open_local(tmp_path / "g", tmp_path / "cache", arrays=["b", "c"])


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_an_empty_array_is_refused(zarr_format: int, tmp_path: Path) -> None:
    zarr.create_array(
        str(tmp_path / "e"), shape=(0, 4), chunks=(3, 4), dtype="uint8", zarr_format=zarr_format
    )
    with pytest.raises(DatasetError, match=r"shape \(0, 4\): no rows"):
        open_local(tmp_path / "e", tmp_path / "cache")


def test_a_folder_above_the_zarr_root_gets_a_hint(sources: dict[int, Path], tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"no \.zarray, \.zgroup or zarr\.json .* open .*/ds"):
        open_dataset(str(sources[2]), format="zarr", cache_dir=str(tmp_path))


def test_a_corrupt_chunk_names_its_key(sources: dict[int, Path], tmp_path: Path) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(sources[3] / "ds", copy)
    (copy / "labels" / "1").write_bytes(b"\0" * 40)
    ds = open_local(copy, tmp_path / "cache")
    ds[0]
    with pytest.raises(DatasetError, match=r"labels/1: decoding with crc32c failed"):
        ds[5]


def test_missing_numcodecs_says_what_to_install(
    sources: dict[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fzarr._codec.cache_clear()
    monkeypatch.setitem(sys.modules, "numcodecs", None)  # what a missing package looks like
    try:
        with pytest.raises(ImportError, match=r"pip install numcodecs .*fastload\[zarr\]"):
            open_local(sources[2] / "ds", tmp_path)
    finally:
        fzarr._codec.cache_clear()


def test_zarr_benchmark_runs_every_system_on_the_same_rows(tmp_path: Path) -> None:
    config = zarr_bench.ZarrBenchConfig(
        rows=50, row_shape=(4, 4, 3), chunk_rows=8, sample_rows=6, latency_s=0.001, repeats=1
    )
    report = zarr_bench.run(tmp_path, config)
    random_rows = [r for r in report.rows if not r.case.startswith("sharding:")]
    assert [r.system for r in random_rows] == [
        "zarr-python over HTTP (1 ms)",
        "zarr-python, local copy",
        "fastload, cached, decoded-chunk LRU",
        "fastload, cached, LRU off",
    ]
    assert all(r.items == 6 and r.ratio is not None for r in random_rows)
    assert "zarr-python over HTTP" in report.table()
    # The sharding cases: each once unsharded (the reference) and once sharded.
    sharding = [r for r in report.rows if r.case.startswith("sharding:")]
    assert len(sharding) == 6
    assert {r.system.split(" (")[0] for r in sharding} == {
        "fastload, unsharded",
        "fastload, sharded",
    }
    assert all(r.ratio is not None for r in sharding)
