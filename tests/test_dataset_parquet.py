"""Parquet files (row groups as shards) on local, HTTP and S3 remotes, checked by pyarrow."""

from __future__ import annotations

import collections
import io
import json
import pickle
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Remote
from PIL import Image
from test_dataset_tar import serve

import fastload as fl
from fastload.datasets import DatasetError, detect_format, open_dataset
from fastload.datasets.parquet import ParquetDataset
from fastload.decode import DecodeError, TrainPreset
from fastload.sampler import ShardedSampler

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

LABELS = ["cat", "dog", "fox"]
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
# Two files of a Hub-style split: 23 rows in row groups of 5 (snappy), 17 in groups of 4 (zstd).
LAYOUT = {
    "data/train-00000-of-00002.parquet": (23, 5, "snappy"),
    "data/train-00001-of-00002.parquet": (17, 4, "zstd"),
}
NOTES = {"README.md": b"# a dataset card", ".gitattributes": b"*.parquet lfs", "x.json": b"{}"}


def jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (int(rng.integers(12, 40)), int(rng.integers(12, 40)), 3))
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, "JPEG", quality=85)
    return out.getvalue()


def table(rows: int, start: int, *, null_image: int | None = None) -> Any:
    """Rows start..start+rows: an HF Image struct, a dictionary label, columns with nulls."""
    images = [
        None if i == null_image else {"bytes": jpeg(i), "path": None if i % 4 else f"{i}.jpg"}
        for i in range(start, start + rows)
    ]
    labels = pa.DictionaryArray.from_arrays(
        pa.array([i % 3 for i in range(start, start + rows)], pa.int32()), pa.array(LABELS)
    )
    return pa.table(
        {
            "image": pa.array(images, IMAGE_TYPE),
            "label": labels,
            "caption": pa.array(
                [None if i % 3 == 1 else f"row {i}" for i in range(start, start + rows)]
            ),
            "score": pa.array([None if i % 5 == 2 else i / 2 for i in range(start, start + rows)]),
        }
    )


def parquet_bytes(t: Any, row_group_size: int, compression: str = "snappy") -> bytes:
    buf = io.BytesIO()
    pq.write_table(t, buf, row_group_size=row_group_size, compression=compression)
    return buf.getvalue()


def hub_files() -> dict[str, bytes]:
    files, start = {}, 0
    for key, (rows, per_group, compression) in LAYOUT.items():
        files[key] = parquet_bytes(table(rows, start), per_group, compression)
        start += rows
    return files


def read_with_pyarrow(files: dict[str, bytes]) -> list[dict[str, Any]]:
    """Every row as the dataset should give it, from pyarrow.parquet.read_table."""
    rows: list[dict[str, Any]] = []
    for key in sorted(k for k in files if k.endswith(".parquet")):
        t = pq.read_table(pa.BufferReader(files[key]))
        columns: dict[str, list[Any]] = {}
        for name in t.column_names:
            values: list[Any] = []
            for chunk in t.column(name).chunks:
                if name == "label":
                    values += chunk.indices.to_pylist()
                elif name == "image":
                    values += [None if v is None else v["bytes"] for v in chunk.to_pylist()]
                else:
                    values += chunk.to_pylist()
            columns[name] = values
        rows += [{n: columns[n][i] for n in t.column_names} for i in range(t.num_rows)]
    return rows


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return hub_files()


@pytest.fixture(params=["local", "http", "s3"])
def hub(
    request: pytest.FixtureRequest, tmp_path: Path, files: dict[str, bytes]
) -> Iterator[Remote]:
    with serve(request.param, tmp_path, {**files, **NOTES}) as r:
        yield r


def open_parquet(remote: Remote, cache: Path, **options: Any) -> ParquetDataset:
    ds = open_dataset(
        remote.url, cache_dir=str(cache), storage_options=remote.storage_options, **options
    )
    assert isinstance(ds, ParquetDataset)
    return ds


def whole_files_cached(ds: ParquetDataset) -> list[str]:
    return [f.key for f in ds.files if ds.store.local_path(f.key) is not None]


def test_every_row_matches_pyarrow_and_only_ranges_are_read(
    hub: Remote, tmp_path: Path, files: dict[str, bytes]
) -> None:
    ds = open_parquet(hub, tmp_path / "c")  # format="auto"
    keys = sorted(LAYOUT)
    assert ds.format == "parquet"
    assert "2 of 5 objects are .parquet files" in ds.format_reason
    assert ds.shard_sizes == [5, 5, 5, 5, 3, 4, 4, 4, 4, 1]
    assert ds.shard_keys == [[keys[0]]] * 5 + [[keys[1]]] * 5
    assert ds.image_column == "image"
    assert ds.label_column == "label"
    assert ds.columns == ("image", "label", "caption", "score")
    entries = ds.store.cache.entries()
    assert len(entries) == 4
    assert all(e.start is not None for e in entries)
    if hub.server is not None:
        assert [hub.gets(k) for k in keys] == [2, 2]

    expected = read_with_pyarrow(files)
    assert len(ds) == len(expected) == 40
    assert [ds[i] for i in range(len(ds))] == expected
    assert ds[-1] == expected[-1]
    assert ds[4]["caption"] is None
    assert ds[2]["score"] is None
    assert ds[1]["label"] == 1
    assert ds[0]["image"][:2] == b"\xff\xd8"
    assert ds.where(24) == (keys[1], 0, 1)
    assert ds.decoded.stats()["misses"] == 10  # each row group decoded once
    assert whole_files_cached(ds) == []  # row groups were read as ranges
    if hub.server is not None:
        # one range per row group, and one more per row group once per dataset: its label
        # column chunk, read for ds.classes (the dictionary label's global class list)
        assert [hub.gets(k) for k in keys] == [2 + 5 + 5, 2 + 5 + 5]

        again = open_parquet(hub, tmp_path / "c")  # footers and row groups come from the cache
        assert again[39] == expected[39]
        assert [hub.gets(k) for k in keys] == [12, 12]  # ds.classes kept beside the listing
    with pytest.raises(IndexError, match="40 samples"):
        ds[40]


def test_whole_cached_files_serve_the_reads(tmp_path: Path, files: dict[str, bytes]) -> None:
    with serve("http", tmp_path, files) as remote:
        ds = open_parquet(remote, tmp_path / "c", format="parquet")
        ds.warm()  # the loader stages shards: whole files
        assert whole_files_cached(ds) == sorted(LAYOUT)
        gets = remote.total_gets()
        assert [ds[i] for i in range(len(ds))] == read_with_pyarrow(files)
        assert remote.total_gets() == gets


def test_columns_pick_fields_and_nulls_read_as_none(tmp_path: Path) -> None:
    t = table(9, 0, null_image=2)
    with serve("local", tmp_path, {"one.parquet": parquet_bytes(t, 4)}) as remote:
        ds = open_parquet(remote, tmp_path / "c")
        assert ds[2]["image"] is None
        assert ds[3]["image"] is not None
        assert ds.shard_sizes == [4, 4, 1]
        only = open_parquet(remote, tmp_path / "c", columns=["caption", "label"])
        assert only.image_column is None
        assert only.label_column == "label"
        assert only[0] == {"caption": "row 0", "label": 0}
        picked = open_parquet(remote, tmp_path / "c", columns=["score"], image_column="image")
        assert picked.columns == ("score", "image")
        assert picked[8] == {"score": 4.0, "image": jpeg(8)}
        with pytest.raises(ValueError, match="decode= decodes"):
            fl.DataLoader(only, batch_size=2, decode="cpu")


def test_plain_binary_columns_and_int_labels_are_detected(tmp_path: Path) -> None:
    t = pa.table({"jpg": [jpeg(i) for i in range(6)], "cls": pa.array(range(6), pa.int64())})
    with serve("local", tmp_path, {"a.parquet": parquet_bytes(t, 6)}) as remote:
        ds = open_parquet(remote, tmp_path / "c")
        assert (ds.image_column, ds.label_column) == ("jpg", "cls")
        assert ds[5] == {"jpg": jpeg(5), "cls": 5}


def test_a_file_without_the_image_column_names_its_columns(tmp_path: Path) -> None:
    other = table(6, 0).drop_columns(["image"])
    objects = {"a.parquet": parquet_bytes(table(6, 0), 3), "b.parquet": parquet_bytes(other, 3)}
    with serve("local", tmp_path, objects) as remote:
        for options in ({}, {"image_column": "image"}):
            with pytest.raises(
                DatasetError,
                match=r"b\.parquet has no column 'image'; its "
                r"columns are label, caption, score",
            ):
                open_parquet(remote, tmp_path / "c", **options)
        with pytest.raises(DatasetError, match=r"a\.parquet has no column 'photo'"):
            open_parquet(remote, tmp_path / "c", image_column="photo")
        with pytest.raises(DatasetError, match=r"column 'caption' is string, not an image"):
            open_parquet(remote, tmp_path / "c", image_column="caption")


def test_files_with_different_schemas_are_named(tmp_path: Path) -> None:
    other = table(6, 0).set_column(3, "score", pa.array(range(6), pa.int64()))
    objects = {"a.parquet": parquet_bytes(table(6, 0), 3), "b.parquet": parquet_bytes(other, 3)}
    with serve("local", tmp_path, objects) as remote:
        with pytest.raises(
            DatasetError, match=r"b\.parquet and .*a\.parquet have different schemas"
        ):
            open_parquet(remote, tmp_path / "c")
        ds = open_parquet(remote, tmp_path / "c", columns=["image", "label"])  # what they share
        assert len(ds) == 12


def damaged(files: dict[str, bytes], how: str) -> bytes:
    data = files[sorted(LAYOUT)[1]]
    length = struct.unpack("<I", data[-8:-4])[0]
    if how == "truncated":
        return data[: len(data) // 2]
    if how == "garbage footer":
        return data[: -8 - length] + b"\x07" * length + data[-8:]
    if how == "footer too long":
        return data[:-8] + struct.pack("<I", len(data)) + b"PAR1"
    return data[: -8 - length - 2000] + data[-8 - length :]  # row groups cut out: "short data"


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated", "does not end with the Parquet magic PAR1"),
        ("garbage footer", "its footer cannot be parsed"),
        ("footer too long", "more than the file's"),
        ("short data", "past the data"),
    ],
)
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_damaged_files_are_named(
    kind: str, how: str, message: str, tmp_path: Path, files: dict[str, bytes]
) -> None:
    objects = {**files, sorted(LAYOUT)[1]: damaged(files, how)}
    with (
        serve(kind, tmp_path, objects) as remote,
        pytest.raises(DatasetError, match=r"train-00001-of-00002\.parquet.*" + message),
    ):
        open_parquet(remote, tmp_path / "c", format="parquet")


def test_detection_and_a_url_naming_one_file(tmp_path: Path, files: dict[str, bytes]) -> None:
    assert detect_format(["a.parquet", "README.md", ".gitattributes"])[0] == "parquet"
    assert detect_format(["a.parquet", "b.bin", "c.bin", "d.bin"])[0] == "files"
    with serve("local", tmp_path, files) as remote:
        one = open_dataset(f"{remote.url}/{sorted(LAYOUT)[0]}", cache_dir=str(tmp_path / "c"))
        assert isinstance(one, ParquetDataset)
        assert one.format_reason == "the URL names a .parquet file"
        assert len(one) == 23


def test_pickles_small_and_rereads_footers(tmp_path: Path, files: dict[str, bytes]) -> None:
    with serve("local", tmp_path, files) as remote:
        ds = open_parquet(remote, tmp_path / "c")
        ds[0]
        data = pickle.dumps(ds)
        assert len(data) < 4000
        copy = pickle.loads(data)
        assert copy.decoded.stats()["entries"] == 0
        assert [copy[i] for i in (0, 22, 23, 39)] == [ds[i] for i in (0, 22, 23, 39)]


def test_missing_pyarrow_says_what_to_install(
    tmp_path: Path, files: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve("local", tmp_path, files) as remote:
        monkeypatch.setitem(sys.modules, "pyarrow", None)  # what a missing package looks like
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
        with pytest.raises(ImportError, match=r"pip install 'fastload\[parquet\]'"):
            open_parquet(remote, tmp_path / "c")


def test_loader_decodes_images_with_their_labels(tmp_path: Path, files: dict[str, bytes]) -> None:
    with serve("s3", tmp_path, files) as remote:
        ds = open_parquet(remote, tmp_path / "c")
        loader = fl.DataLoader(ds, batch_size=4, decode="cpu", transform=TrainPreset(32))
        labels: list[int] = []
        for images, batch_labels in loader:
            assert images.shape == (4, 3, 32, 32)
            assert images.dtype == torch.float32
            labels += batch_labels.tolist()
        assert collections.Counter(labels) == collections.Counter(i % 3 for i in range(40))


def test_a_null_image_raises_naming_its_row_or_is_skipped(tmp_path: Path) -> None:
    t = table(9, 0, null_image=2)
    with serve("local", tmp_path, {"one.parquet": parquet_bytes(t, 4)}) as remote:
        ds = open_parquet(remote, tmp_path / "c")
        settings: dict[str, Any] = {"batch_size": 4, "decode": "cpu", "transform": TrainPreset(32)}
        with pytest.raises(DecodeError, match=r"sample 2 \(row 2 of row group 0 of .*one\.parquet"):
            list(fl.DataLoader(ds, **settings))
        loader = fl.DataLoader(ds, on_error="skip", **settings)
        batches = list(loader)
        assert [len(labels) for _, labels in batches] == [4, 4, 1]  # full batches
        # sample 2's place goes to another sample of its batch
        assert batches[0][1].tolist() == [0, 1, 0, 0]
        assert torch.equal(batches[0][0][2], batches[0][0][0])
        stats = loader.stats()
        assert stats["skipped_samples"] == 1
        assert "its 'image' is null" in stats["skipped_examples"][0]


def test_sampler_covers_every_row_once_and_resumes_on_more_ranks(
    tmp_path: Path, files: dict[str, bytes]
) -> None:
    with serve("local", tmp_path, files) as remote:
        ds = open_parquet(remote, tmp_path / "c")

        def sampler(rank: int, world: int) -> ShardedSampler:
            return ShardedSampler(ds, rank=rank, world_size=world, seed=3)

        ranks = [list(sampler(r, 2)) for r in range(2)]
        assert sorted(ranks[0] + ranks[1]) == list(range(40))
        old = [sampler(r, 2) for r in range(2)]
        iterators = [iter(s) for s in old]
        consumed = [next(it) for it in iterators for _ in range(5)]
        state = json.loads(json.dumps(old[0].state_dict()))
        rest = []
        for r in range(3):
            fresh = sampler(r, 3)
            fresh.load_state_dict(state)
            rest += list(fresh)
        assert sorted(consumed + rest) == list(range(40))
        assert [ds[i]["label"] for i in consumed + rest] == [(i % 3) for i in consumed + rest]


@pytest.mark.parametrize("dictionary", [False, True])
def test_text_that_is_not_utf8_in_a_page_is_named(tmp_path: Path, dictionary: bool) -> None:
    """A damaged page whose text is not UTF-8 (pyarrow reads it without checking) is a
    DatasetError naming the file and row group, never a bare UnicodeDecodeError: the
    string column as plain text and the label column as a dictionary (read at open)."""
    words = pa.array(["dög", "cat", "fox", "owl"] * 2)
    column = words.dictionary_encode() if dictionary else words
    t = pa.table({"image": [jpeg(i) for i in range(8)], "label": column})
    sink = pa.BufferOutputStream()
    pq.write_table(t, sink, row_group_size=8, compression="none", use_dictionary=dictionary)
    data = sink.getvalue().to_pybytes()
    assert data.count(b"f\x6fx") >= 1
    broken = data.replace(b"fox", b"f\xffx")  # same length: the offsets stay right

    def read_all(remote: Remote) -> list[dict[str, Any]]:
        ds = open_parquet(remote, tmp_path / "c", image_column="image")
        return [ds[i] for i in range(len(ds))]

    with (
        serve("local", tmp_path, {"a.parquet": broken}) as remote,
        pytest.raises(DatasetError, match=r"a\.parquet: row group 0 cannot be read"),
    ):
        read_all(remote)
