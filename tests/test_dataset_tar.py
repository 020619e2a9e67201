"""Tar shards in WebDataset layout, against local, HTTP and S3 remotes, checked by tarfile."""

from __future__ import annotations

import contextlib
import io
import pickle
import posixpath
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Remote

from fastload.datasets import DatasetError, open_dataset
from fastload.datasets.tar import TarDataset, split_name
from fastload.testing import RangeHTTPServer, S3FolderServer, S3Server

# A member: (name, bytes), or a TarInfo made by the test (links, devices, directories).
Member = tuple[str, bytes] | tarfile.TarInfo


def tar_bytes(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                tf.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                tf.addfile(info, io.BytesIO(m[1]))
    return buf.getvalue()


def webdataset_shards(count: int = 4, per_shard: int = 10, seed: int = 0) -> dict[str, bytes]:
    """Shards of jpg-like random bytes + a cls text; some keys in folders, one 3-part name."""
    rng = np.random.default_rng(seed)
    shards = {}
    for s in range(count):
        members: list[Member] = []
        for i in range(per_shard):
            key = f"{s * per_shard + i:06d}" if i % 3 else f"dir/sub.d/{s * per_shard + i:06d}"
            jpg = rng.integers(0, 256, int(rng.integers(1, 30_000)), dtype=np.uint8).tobytes()
            members += [(f"{key}.jpg", jpg), (f"{key}.cls", str(i % 7).encode())]
            if i == 4:
                members.append((f"{key}.seg.png", b"mask"))
        shards[f"shard-{s:03d}.tar"] = tar_bytes(members)
    return shards


def read_with_tarfile(shards: dict[str, bytes]) -> list[dict[str, Any]]:
    """The samples as WebDataset defines them, read straight from the tars."""
    samples: list[dict[str, Any]] = []
    for shard in sorted(shards):
        by_key: dict[str, dict[str, Any]] = {}
        with tarfile.open(fileobj=io.BytesIO(shards[shard])) as tf:
            for info in tf:
                if not info.isfile():
                    continue
                folder, base = posixpath.split(info.name)
                stem, _, field = base.partition(".")
                key = posixpath.join(folder, stem)
                sample = by_key.setdefault(key, {"__key__": key, "__shard__": shard})
                f = tf.extractfile(info)
                assert f is not None
                with f:
                    sample[field] = f.read()
        samples += by_key.values()
    return samples


@contextlib.contextmanager
def serve(
    kind: str, base: Path, objects: dict[str, bytes], *, s3_folder: bool = False
) -> Iterator[Remote]:
    """objects written under base/source/ds and served as a local path, over HTTP or S3
    (moto, or with ``s3_folder`` an S3FolderServer holding copies of the files)."""
    source = base / "source"
    for key, data in objects.items():
        (source / "ds" / key).parent.mkdir(parents=True, exist_ok=True)
        (source / "ds" / key).write_bytes(data)
    if kind == "local":
        yield Remote(kind, str(source / "ds"), {}, None, objects, source)
    elif kind == "http":
        with RangeHTTPServer(source) as server:
            yield Remote(kind, server.url_for("ds"), {}, server, objects, source, "/ds")
    else:
        with S3FolderServer(base / "buckets") if s3_folder else S3Server() as server:
            if isinstance(server, S3FolderServer):  # copies: writes must not reach the source
                server.upload_dir(source / "ds", "data", prefix="ds", hard_link=False)
            else:
                server.upload_dir(source / "ds", "data", prefix="ds")
            yield Remote(
                kind, "s3://data/ds", server.storage_options, server, objects, source, "/data/ds"
            )


def open_tar(remote: Remote, cache: Path, **options: Any) -> TarDataset:
    ds = open_dataset(
        remote.url, cache_dir=str(cache), storage_options=remote.storage_options, **options
    )
    assert isinstance(ds, TarDataset)
    return ds


@pytest.fixture(scope="module")
def shards() -> dict[str, bytes]:
    return webdataset_shards()


@pytest.fixture(params=["local", "http", "s3"])
def tars(
    request: pytest.FixtureRequest, tmp_path: Path, shards: dict[str, bytes]
) -> Iterator[Remote]:
    """Four WebDataset shards (plus an object that is not a shard) on each kind of remote."""
    with serve(request.param, tmp_path, {**shards, "README.md": b"not a shard"}) as r:
        yield r


@pytest.mark.parametrize("format", ["tar", "auto"])
def test_every_sample_matches_tarfile(
    tars: Remote, tmp_path: Path, shards: dict[str, bytes], format: str
) -> None:
    ds = open_tar(tars, tmp_path / "c", format=format)
    expected = read_with_tarfile(shards)
    assert ds.format == "tar"
    if format == "auto":
        assert ".tar shards" in ds.format_reason
    assert ds.shard_keys == [[k] for k in sorted(shards)]
    assert ds.shard_sizes == [10, 10, 10, 10]
    assert len(ds) == len(expected) == 40
    assert [ds[i] for i in range(len(ds))] == expected
    assert ds[-1] == expected[-1]
    assert ds[4]["seg.png"] == b"mask"
    assert ds[3]["__key__"] == "dir/sub.d/000003"
    assert [ds.key(i) for i in range(len(ds))] == [s["__key__"] for s in expected]
    with pytest.raises(IndexError, match="40 samples"):
        ds[40]


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_second_open_reuses_the_indexes_and_fetches_nothing(
    kind: str, tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve(kind, tmp_path, shards) as remote:
        first = open_tar(remote, tmp_path / "c", format="tar")
        assert all(remote.gets(k) == 1 for k in shards)  # each shard fetched once, to index it
        indexes = sorted((tmp_path / "c" / "indexes").iterdir())
        assert len(indexes) == len(shards)
        for k in shards:  # without the shards, only the indexes can tell the members
            assert first.store.cache.drop(first.store.object_url(k))
        gets = remote.total_gets()

        second = open_tar(remote, tmp_path / "c", format="tar")
        assert remote.total_gets() == gets
        assert second.shard_sizes == first.shard_sizes
        assert sorted((tmp_path / "c" / "indexes").iterdir()) == indexes
        assert second[25] == read_with_tarfile(shards)[25]  # reading fetches again, once
        assert remote.total_gets() == gets + 1


def test_a_changed_shard_gets_a_new_index(tmp_path: Path) -> None:
    shards = webdataset_shards(count=2, per_shard=3)
    with serve("s3", tmp_path, shards) as remote:
        before = open_tar(remote, tmp_path / "c", format="tar")
        assert before.shard_sizes == [3, 3]
        changed = tar_bytes([("new.jpg", b"j"), ("new.cls", b"1")])
        assert isinstance(remote.server, S3Server)
        remote.server.put("data", "ds/shard-001.tar", changed)
        after = open_tar(remote, tmp_path / "c", format="tar", refresh=True)
        assert after.shard_sizes == [3, 1]
        assert after[3] == {
            "__key__": "new",
            "__shard__": "shard-001.tar",
            "jpg": b"j",
            "cls": b"1",
        }
        assert len(list((tmp_path / "c" / "indexes").iterdir())) == 3


def test_shards_the_cache_turns_away_are_indexed_from_the_remote(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve("http", tmp_path, shards) as remote:
        ds = open_tar(
            remote,
            tmp_path / "c",
            format="tar",
            max_bytes=1000,
            budget_counts="entries",
            policy="pin",
        )
        assert all(ds.store.local_path(k) is None for k in shards)
        assert [ds[i] for i in range(len(ds))] == read_with_tarfile(shards)


def hostile(kind: str) -> Member:
    """A member that must be refused."""
    if kind in ("../evil.jpg", "/abs.jpg", "a/../../b.jpg"):
        return (kind, b"x")
    info = tarfile.TarInfo("000000.jpg")
    info.type = {
        "symlink": tarfile.SYMTYPE,
        "hardlink": tarfile.LNKTYPE,
        "fifo": tarfile.FIFOTYPE,
        "chardev": tarfile.CHRTYPE,
        "blockdev": tarfile.BLKTYPE,
    }[kind]
    if kind.endswith("link"):
        info.linkname = "/etc/passwd"
    return info


@pytest.mark.parametrize(
    "kind",
    [
        "../evil.jpg",
        "/abs.jpg",
        "a/../../b.jpg",
        "symlink",
        "hardlink",
        "fifo",
        "chardev",
        "blockdev",
    ],
)
def test_hostile_members_are_refused_naming_the_shard(kind: str, tmp_path: Path) -> None:
    good = tar_bytes([("000001.jpg", b"j"), ("000001.cls", b"0")])
    bad = tar_bytes([("000001.jpg", b"j"), hostile(kind), ("000002.cls", b"0")])
    with serve("local", tmp_path, {"a.tar": good, "b.tar": bad}) as remote:
        for _ in range(2):  # and no index is kept for it: the next open refuses it again
            with pytest.raises(DatasetError, match=r"b\.tar: member") as err:
                open_tar(remote, tmp_path / "c", format="tar")
            name = kind if "/" in kind else "000000.jpg"
            assert repr(name) in str(err.value)
        assert len(list((tmp_path / "c" / "indexes").iterdir())) == 1  # a.tar's


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_hostile_members_are_refused_on_remotes(kind: str, tmp_path: Path) -> None:
    bad = tar_bytes([("ok.jpg", b"j"), ("../evil.jpg", b"x")])
    with (
        serve(kind, tmp_path, {"a.tar": bad}) as remote,
        pytest.raises(DatasetError, match=r"/ds/a\.tar: member '\.\./evil\.jpg' is a path"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")


def test_empty_shards_skipped_members_and_scattered_samples(tmp_path: Path) -> None:
    folder = tarfile.TarInfo("dir")
    folder.type = tarfile.DIRTYPE
    big = bytes(200_000)  # puts the fields of sample "far" further apart than one read spans
    objects = {
        "0-empty.tar": tar_bytes([]),
        "1-zero-bytes.tar": b"",
        "2.tar": tar_bytes(
            [
                folder,
                ("dir/far.jpg", b"far-jpg"),
                ("README", b"no field"),
                ("._far.jpg", b"macOS resource fork"),
                ("dir/near.jpg", b"near-jpg"),
                ("dir/filler.npy", big),
                ("dir/far.cls", b"far-cls"),
                ("dir/near.cls", b"near-cls"),
            ]
        ),
        "3-only-a-folder.tar": tar_bytes([folder]),
        "notes.txt": b"ignored",
    }
    with serve("local", tmp_path, objects) as remote:
        ds = open_tar(remote, tmp_path / "c", format="tar")
        assert ds.shard_sizes == [0, 0, 3, 0]
        assert [ds[i] for i in range(3)] == [
            {"__key__": "dir/far", "__shard__": "2.tar", "jpg": b"far-jpg", "cls": b"far-cls"},
            {"__key__": "dir/near", "__shard__": "2.tar", "jpg": b"near-jpg", "cls": b"near-cls"},
            {"__key__": "dir/filler", "__shard__": "2.tar", "npy": big},
        ]


def test_one_sample_dataset(tmp_path: Path) -> None:
    with serve("local", tmp_path, {"only.tar": tar_bytes([("x.txt", b"hello")])}) as remote:
        ds = open_tar(remote, tmp_path / "c", format="auto")
        assert len(ds) == 1
        assert ds[0] == ds[-1] == {"__key__": "x", "__shard__": "only.tar", "txt": b"hello"}
        with pytest.raises(IndexError):
            ds[1]
        again = pickle.loads(pickle.dumps(ds))
        assert again[0] == ds[0]


def test_a_url_naming_one_tar_is_one_shard(tmp_path: Path) -> None:
    with serve("local", tmp_path, {"one.tar": tar_bytes([("x.txt", b"hi")])}) as remote:
        ds = open_dataset(remote.url + "/one.tar", format="tar", cache_dir=str(tmp_path / "c"))
        assert ds.shard_keys == [[""]]
        assert ds[0]["txt"] == b"hi"


def test_fields_keeps_only_those_and_requires_them(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    expected = read_with_tarfile(shards)
    with serve("local", tmp_path, shards) as remote:
        ds = open_tar(remote, tmp_path / "c", format="tar", fields=["cls", "jpg"])
        assert ds.fields == ("cls", "jpg")
        assert [ds[i] for i in range(len(ds))] == [
            {k: s[k] for k in ("__key__", "__shard__", "cls", "jpg")} for s in expected
        ]
        assert list(ds[4]) == ["__key__", "__shard__", "cls", "jpg"]  # in the order asked
        # Opened again, the shards' members come from the cache's indexes: they are grouped
        # (and checked) when a shard is first read.
        wanting = open_tar(remote, tmp_path / "c", format="tar", fields=["jpg", "seg.png"])
        with pytest.raises(
            DatasetError,
            match=r"shard-000\.tar: sample 'dir/sub\.d/000000' has no field 'seg\.png'",
        ):
            wanting[0]
        with pytest.raises(ValueError, match="non-empty list of field names"):
            open_tar(remote, tmp_path / "c", format="tar", fields="jpg")


def test_datasets_without_samples_or_shards_fail_clearly(tmp_path: Path) -> None:
    with (
        serve("local", tmp_path / "a", {"a.tar": tar_bytes([]), "b.tar": b""}) as remote,
        pytest.raises(DatasetError, match=r"holds no samples: its 2 \.tar shard"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")
    with (
        serve("local", tmp_path / "b", {"x.tar.gz": b"gz", "y.txt": b""}) as remote,
        pytest.raises(DatasetError, match=r"ds holds no \.tar shards.*decompress"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")


def test_broken_tars_fail_naming_the_shard(tmp_path: Path) -> None:
    whole = tar_bytes([("a.jpg", bytes(5000)), ("b.jpg", bytes(5000))])
    cut = whole[: 512 + 5000 + 512 + 1000]  # b.jpg's header survives, most of its data not
    with (
        serve("local", tmp_path / "a", {"cut.tar": cut}) as remote,
        pytest.raises(DatasetError, match=r"cut\.tar: member 'b\.jpg' ends at byte"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")
    with (
        serve("local", tmp_path / "b", {"junk.tar": b"x" * 3000}) as remote,
        pytest.raises(DatasetError, match=r"junk\.tar is not a readable"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")


def test_duplicate_members_are_refused(tmp_path: Path) -> None:
    dup = tar_bytes([("a.jpg", b"1"), ("a.jpg", b"2")])
    with (
        serve("local", tmp_path, {"d.tar": dup}) as remote,
        pytest.raises(DatasetError, match=r"d\.tar: member 'a\.jpg' appears twice"),
    ):
        open_tar(remote, tmp_path / "c", format="tar")


def test_damaged_index_is_rebuilt(tmp_path: Path, shards: dict[str, bytes]) -> None:
    with serve("local", tmp_path, shards) as remote:
        first = open_tar(remote, tmp_path / "c", format="tar")
        for path in (tmp_path / "c" / "indexes").iterdir():
            path.write_text("{not json")
        second = open_tar(remote, tmp_path / "c", format="tar")
        assert [second[i] for i in range(len(second))] == [first[i] for i in range(len(first))]


@pytest.mark.parametrize(
    ("name", "split"),
    [
        ("a/b/000123.jpg", ("a/b/000123", "jpg")),
        ("x.seg.png", ("x", "seg.png")),
        ("a.b/c.txt", ("a.b/c", "txt")),
        ("README", None),
        ("dir/.hidden", None),
        ("x.", None),
    ],
)
def test_split_name(name: str, split: tuple[str, str] | None) -> None:
    assert split_name(name) == split
