"""Names that are not plain ASCII (a non-ASCII letter, a combining accent, ``+``, ``%`` and
spaces) in every layout, through the loopback S3 server: tar shards and their members, Zarr
groups and array names, Parquet file names. Each reads exactly the samples a reference
reader (tarfile, zarr-python, pyarrow) gives, through ``dataset[i]`` and a loader epoch."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_dataset_tar import read_with_tarfile, tar_bytes

import fastload as fl
from fastload.testing import S3FolderServer

# a letter outside ASCII, a combining accent (e + U+0301), '+', '%' and spaces
NAMES = ["clåss", "cafe\u0301", "a+b", "50% off", "two  spaces"]


@pytest.fixture
def bucket(tmp_path: Path) -> Iterator[tuple[Path, S3FolderServer]]:
    root = tmp_path / "buckets" / "data"
    root.mkdir(parents=True)
    with S3FolderServer(tmp_path / "buckets") as server:
        yield root, server


def open_s3(server: S3FolderServer, prefix: str, cache: Path, **options: Any) -> Any:
    return fl.open_dataset(
        f"s3://data/{prefix}",
        cache_dir=str(cache),
        storage_options=server.storage_options,
        **options,
    )


def epoch(ds: Any) -> list[Any]:
    loader = fl.DataLoader(ds, batch_size=4, shuffle=False, collate_fn=list)
    return [s for batch in loader for s in batch]


def test_tar_shards_and_members_with_such_names(
    bucket: tuple[Path, S3FolderServer], tmp_path: Path
) -> None:
    root, server = bucket
    shards = {}
    for s, shard_name in enumerate(NAMES[:3]):
        members = []
        for j, name in enumerate(NAMES):
            stem = f"{name}/{j} {name}"
            members += [(f"{stem}.jpg", f"{s}:{j}:{name}".encode()), (f"{stem}.cls", b"%d" % j)]
        shards[f"{shard_name} {s}.tar"] = tar_bytes(members)
    (root / "tärs").mkdir()
    for name, data in shards.items():
        (root / "tärs" / name).write_bytes(data)
    want = read_with_tarfile(shards)
    ds = open_s3(server, "tärs", tmp_path / "c", format="tar")
    assert len(ds) == len(want) == 15

    def plain(sample: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in sample.items() if not k.startswith("__")}

    assert [plain(ds[i]) for i in range(len(ds))] == [plain(w) for w in want]
    assert [plain(s) for s in epoch(ds)] == [plain(w) for w in want]
    assert [ds.key(i) for i in range(len(ds))] == [w["__key__"] for w in want]


def test_zarr_group_and_array_names_with_such_names(
    bucket: tuple[Path, S3FolderServer], tmp_path: Path
) -> None:
    zarr = pytest.importorskip("zarr")
    root, server = bucket
    images_name, labels_name = f"bïlder {NAMES[1]}", f"läbels {NAMES[2]} {NAMES[3]}"
    group = zarr.group(str(root / "dätä +%.zarr"), zarr_format=3)
    rng = np.random.default_rng(0)
    images = group.create_array(images_name, shape=(11, 4, 4), chunks=(3, 4, 4), dtype="uint8")
    images[:] = rng.integers(0, 256, (11, 4, 4), dtype=np.uint8)
    labels = group.create_array(labels_name, shape=(11,), chunks=(4,), dtype="int64")
    labels[:] = np.arange(11) * 7
    want = zarr.open_group(str(root / "dätä +%.zarr"), mode="r")
    want_images, want_labels = np.asarray(want[images_name][:]), np.asarray(want[labels_name][:])

    ds = open_s3(
        server, "dätä +%.zarr", tmp_path / "c", format="zarr", arrays=[images_name, labels_name]
    )
    assert len(ds) == 11
    for i in range(11):
        np.testing.assert_array_equal(ds[i][images_name], want_images[i])
        assert int(ds[i][labels_name]) == want_labels[i]
    rows = epoch(ds)
    np.testing.assert_array_equal(np.stack([r[images_name] for r in rows]), want_images)
    np.testing.assert_array_equal(np.array([r[labels_name] for r in rows]), want_labels)


def test_parquet_file_names_with_such_names(
    bucket: tuple[Path, S3FolderServer], tmp_path: Path
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    root, server = bucket
    folder = root / "pärquet"
    folder.mkdir()
    want = []
    for f, name in enumerate(NAMES):
        images = [f"{name} row {r}".encode() for r in range(3 + f)]
        labels = [f * 10 + r for r in range(3 + f)]
        out = io.BytesIO()
        pq.write_table(pa.table({"image": images, "label": labels}), out, row_group_size=2)
        (folder / f"{f} {name}.parquet").write_bytes(out.getvalue())
        want.append([(i, lab) for i, lab in zip(images, labels, strict=True)])
    # the dataset reads files in the listing's order (sorted keys: "0 ...", "1 ...")
    expected = [row for rows in want for row in rows]
    ds = open_s3(server, "pärquet", tmp_path / "c", format="parquet")
    assert len(ds) == len(expected)

    def pair(sample: Any) -> tuple[bytes, int]:
        return bytes(sample["image"]), int(sample["label"])

    assert [pair(ds[i]) for i in range(len(ds))] == expected
    assert [pair(s) for s in epoch(ds)] == expected
