"""Synthetic buckets: layouts as pure functions, then served by S3FolderServer to boto3 and
s3fs (in this process and in one of its own), read-only, and counted."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import private_s3fs

from fastload.testing.s3_folder import S3FolderProcess, S3FolderServer
from fastload.testing.synthetic import (
    LAST_MODIFIED_S,
    ImageFolderLayout,
    SyntheticLayout,
    TarShardsLayout,
    jpeg_payloads,
    random_payloads,
    read_spec,
    write_spec,
)

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
from botocore.exceptions import ClientError  # noqa: E402

CLIENT_TIMEOUT_S = 10.0
PAYLOADS = (*random_payloads(3, 100), b"short")
MILLION = ImageFolderLayout(objects=1_000_000, classes=1000, payloads=PAYLOADS, seed=5)
SHARDS = TarShardsLayout(
    shards=4,
    samples_per_shard=6,
    payloads=(*random_payloads(3, 3000, seed=1), b"x" * 1700),
    classes=10,
    shard_index=True,
    prefix="train/",
)


def all_keys(layout: SyntheticLayout) -> list[str]:
    return [layout.key(i) for i in range(layout.count)]


# -- layouts, without a server ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("objects", "classes", "prefix"),
    [(0, 1, ""), (1, 1, ""), (7, 3, ""), (10, 10, "train/"), (5, 8, ""), (1001, 7, "a/b/")],
)
def test_image_folder_keys_are_in_order_and_spread_evenly(
    objects: int, classes: int, prefix: str
) -> None:
    layout = ImageFolderLayout(objects=objects, classes=classes, payloads=PAYLOADS, prefix=prefix)
    keys = all_keys(layout)
    assert keys == sorted(set(keys))
    assert [layout.index(k) for k in keys] == list(range(objects))
    assert layout.index(prefix + "n00000000/") is None
    assert layout.index(prefix + "n00000000/n00000000_00000000.jpeg") is None
    per_class = [sum(layout.label(i) == c for i in range(objects)) for c in range(classes)]
    assert max(per_class) - min(per_class) <= 1
    assert sorted(per_class, reverse=True) == per_class  # the first classes hold one more
    for i, key in enumerate(keys):
        label = layout.label(i)
        assert key.startswith(f"{prefix}n{label:08d}/n{label:08d}_")
        assert layout.content(i) in PAYLOADS
        assert layout.size(i) == len(layout.content(i))
    with pytest.raises(IndexError):
        layout.key(objects)


def test_objects_are_drawn_from_key_and_seed_and_etags_follow_the_layout() -> None:
    layout = ImageFolderLayout(objects=200, classes=4, payloads=PAYLOADS)
    reseeded = ImageFolderLayout(objects=200, classes=4, payloads=PAYLOADS, seed=1)
    contents = [layout.content(i) for i in range(200)]
    assert {len(c) for c in contents} == {100, 5}  # every payload is used
    assert contents != [reseeded.content(i) for i in range(200)]
    assert contents == [dataclasses.replace(layout).content(i) for i in range(200)]
    etags = {layout.etag(i) for i in range(200)}
    assert len(etags) == 200
    assert etags.isdisjoint(reseeded.etag(i) for i in range(200))


def test_tar_shards_are_tars_of_the_promised_samples_and_any_range_is_a_slice() -> None:
    layout = SHARDS
    assert all_keys(layout) == [
        *(f"train/shard-{s:06d}.tar" for s in range(4)),
        "train/shardindex.json",
    ]
    rng = random.Random(0)
    for shard in range(layout.shards):
        data = layout.content(shard)
        assert len(data) == layout.size(shard) == layout.shard_bytes
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = tar.getmembers()
            names = [m.name for m in members]
            samples = range(shard * 6, shard * 6 + 6)
            assert names == [f"{g:09d}.{ext}" for g in samples for ext in ("jpg", "cls")]
            for g, jpg, cls in zip(samples, members[::2], members[1::2], strict=True):
                body = tar.extractfile(jpg).read()  # type: ignore[union-attr]
                assert body == layout.jpg(g).ljust(layout.sample_bytes, b"\0")
                assert int(tar.extractfile(cls).read()) == layout.label(g)  # type: ignore[union-attr]
                assert 0 <= layout.label(g) < 10
        cuts = {0, len(data)} | {rng.randrange(len(data)) for _ in range(30)}
        cuts |= {c + d for c in (512, layout.shard_bytes - 1024) for d in (-1, 0, 1)}
        for start, end in itertools.pairwise(sorted(cuts)):
            assert b"".join(layout.read(shard, start, end)) == data[start:end], (start, end)
    index = json.loads(layout.content(layout.shards))
    assert index == {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": f"shard-{s:06d}.tar", "nsamples": 6} for s in range(4)],
    }


def test_jpeg_payloads_decode_even_zero_padded_and_specs_round_trip(tmp_path: Path) -> None:
    simplejpeg = pytest.importorskip("simplejpeg")
    photos = jpeg_payloads(2, width=64, height=48)
    assert len(set(photos)) == 2
    for photo in photos:
        assert simplejpeg.decode_jpeg(photo + bytes(300)).shape == (48, 64, 3)
    layouts = {"images": MILLION, "tars": SHARDS}
    write_spec(tmp_path, layouts)
    assert read_spec(tmp_path) == layouts
    assert read_spec(tmp_path / "elsewhere") == {}
    with pytest.raises(ValueError, match="prefix"):
        ImageFolderLayout(objects=1, classes=1, payloads=PAYLOADS, prefix="train")
    with pytest.raises(ValueError, match="payloads"):
        TarShardsLayout(shards=1, samples_per_shard=1, payloads=())


# -- served -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3FolderServer]:
    root = tmp_path_factory.mktemp("synthetic-root")
    with S3FolderServer(root, synthetic={"imagenet": MILLION, "shards": SHARDS}) as s:
        s.create_bucket("plain")
        yield s


@pytest.fixture
def client(server: S3FolderServer) -> Iterator[Any]:
    server.reset_stats()
    c = boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=boto3.session.Config(retries={"total_max_attempts": 1}),
    )
    yield c
    c.close()


def test_a_million_object_bucket_lists_its_first_and_last_pages(
    server: S3FolderServer, client: Any
) -> None:
    first = client.list_objects_v2(Bucket="imagenet")
    assert [o["Key"] for o in first["Contents"]] == [MILLION.key(i) for i in range(1000)]
    assert first["IsTruncated"]
    token = first["NextContinuationToken"]
    second = client.list_objects_v2(Bucket="imagenet", ContinuationToken=token, MaxKeys=3)
    assert [o["Key"] for o in second["Contents"]] == [MILLION.key(i) for i in range(1000, 1003)]
    last = client.list_objects_v2(Bucket="imagenet", StartAfter=MILLION.key(999_499))
    assert [o["Key"] for o in last["Contents"]] == [MILLION.key(i) for i in range(999_500, 10**6)]
    assert not last["IsTruncated"]
    v1_last = client.list_objects(Bucket="imagenet", Marker=MILLION.key(999_998))
    assert [o["Key"] for o in v1_last["Contents"]] == [MILLION.key(999_999)]

    classes = client.list_objects_v2(Bucket="imagenet", Delimiter="/")
    assert [p["Prefix"] for p in classes["CommonPrefixes"]] == [f"n{c:08d}/" for c in range(1000)]
    assert not classes["IsTruncated"]
    one_class = client.list_objects_v2(Bucket="imagenet", Prefix="n00000999/")
    assert [o["Key"] for o in one_class["Contents"]] == [
        MILLION.key(i) for i in range(999_000, 10**6)
    ]
    assert client.list_objects_v2(Bucket="imagenet", Prefix="n0000099/x")["KeyCount"] == 0
    assert server.read_stats().count("ListObjectsV2", "/imagenet") == 6
    assert server.read_stats().listings == 7


def test_list_head_and_get_agree_on_size_etag_and_bytes(
    server: S3FolderServer, client: Any
) -> None:
    indexes = [0, 1, 4_321, 500_000, 999_999]
    listed = {}
    for i in indexes:
        page = client.list_objects_v2(Bucket="imagenet", Prefix=MILLION.key(i))
        listed[i] = page["Contents"][0]
    for i in indexes:
        key, data = MILLION.key(i), MILLION.content(i)
        head = client.head_object(Bucket="imagenet", Key=key)
        got = client.get_object(Bucket="imagenet", Key=key)
        body = got["Body"].read()
        assert body == data
        assert listed[i]["Key"] == key
        assert listed[i]["Size"] == head["ContentLength"] == got["ContentLength"] == len(data)
        assert listed[i]["ETag"] == head["ETag"] == got["ETag"] == f'"{MILLION.etag(i)}"'
        assert (
            listed[i]["LastModified"].timestamp()
            == head["LastModified"].timestamp()
            == got["LastModified"].timestamp()
            == LAST_MODIFIED_S
        )
        ranged = client.get_object(Bucket="imagenet", Key=key, Range="bytes=2-3")
        assert ranged["Body"].read() == data[2:4]
        assert ranged["ContentRange"] == f"bytes 2-3/{len(data)}"
    stats, reads = server.stats(), server.read_stats()
    path = f"/imagenet/{MILLION.key(999_999)}"
    assert reads.count("HeadObject", path) == 1
    assert reads.count("GetObject", path) == stats.count(path, "GET") == 2
    assert reads.body_bytes[path] == MILLION.size(999_999) + 2
    with pytest.raises(ClientError) as caught:
        client.get_object(Bucket="imagenet", Key="n00000000/missing.JPEG")
    assert caught.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as caught:
        client.get_object(Bucket="imagenet", Key=MILLION.key(0), Range="bytes=100000-")
    assert caught.value.response["Error"]["Code"] == "InvalidRange"


def test_tarfile_reads_a_shard_through_ranged_gets(server: S3FolderServer) -> None:
    fs = private_s3fs(server.storage_options, timeout_s=CLIENT_TIMEOUT_S)
    path = "shards/train/shard-000002.tar"
    server.reset_stats()
    with (
        fs.open(path, "rb", block_size=4096, cache_type="none") as f,
        tarfile.open(fileobj=f, mode="r:") as tar,
    ):
        members = [(m.name, tar.extractfile(m).read()) for m in tar]  # type: ignore[union-attr]
    samples = range(12, 18)
    assert members == [
        (f"{g:09d}.{ext}", body)
        for g in samples
        for ext, body in (
            ("jpg", SHARDS.jpg(g).ljust(SHARDS.sample_bytes, b"\0")),
            ("cls", str(SHARDS.label(g)).encode()),
        )
    ]
    reads, stats = server.read_stats(), server.stats()
    gets = reads.count("GetObject", f"/{path}")
    assert gets >= 3  # a few ranges, never the whole shard at once
    assert reads.body_bytes[f"/{path}"] == stats.bytes_sent < gets * SHARDS.shard_bytes
    index = json.loads(fs.cat_file("shards/train/shardindex.json"))
    assert [s["url"] for s in index["shardlist"]] == [f"shard-{s:06d}.tar" for s in range(4)]
    assert fs.ls("shards/train") == [f"shards/{k}" for k in all_keys(SHARDS)]


def test_synthetic_buckets_are_read_only(server: S3FolderServer, client: Any) -> None:
    buckets = [b["Name"] for b in client.list_buckets()["Buckets"]]
    assert buckets == ["imagenet", "plain", "shards"]
    client.head_bucket(Bucket="imagenet")
    client.create_bucket(Bucket="imagenet")  # exists already, as S3 allows
    key = MILLION.key(3)
    refused = [
        lambda: client.put_object(Bucket="imagenet", Key="new.bin", Body=b"x"),
        lambda: client.put_object(Bucket="imagenet", Key=key, Body=b"x"),
        lambda: client.delete_object(Bucket="imagenet", Key=key),
        lambda: client.delete_objects(Bucket="imagenet", Delete={"Objects": [{"Key": key}]}),
        lambda: client.copy_object(
            Bucket="imagenet", Key="copy.bin", CopySource={"Bucket": "imagenet", "Key": key}
        ),
        lambda: client.create_multipart_upload(Bucket="imagenet", Key="big.bin"),
        lambda: client.delete_bucket(Bucket="imagenet"),
    ]
    for call in refused:
        with pytest.raises(ClientError) as caught:
            call()
        assert caught.value.response["Error"]["Code"] == "AccessDenied"
    assert client.get_object(Bucket="imagenet", Key=key)["Body"].read() == MILLION.content(3)
    # Copying out of a synthetic bucket is a read.
    client.copy_object(Bucket="plain", Key="copied", CopySource={"Bucket": "imagenet", "Key": key})
    assert (server.root / "plain" / "copied").read_bytes() == MILLION.content(3)
    with pytest.raises(ValueError, match="imagenet"):
        server.create_bucket("imagenet")
    with pytest.raises(ValueError, match="exists"):
        S3FolderServer(server.root, synthetic={"plain": SHARDS})


def test_a_server_in_its_own_process_serves_and_counts_synthetic_buckets(tmp_path: Path) -> None:
    (tmp_path / "root" / "plain").mkdir(parents=True)
    (tmp_path / "root" / "plain" / "a.bin").write_bytes(b"abc")
    with S3FolderProcess(tmp_path / "root", synthetic={"imagenet": MILLION}) as process:
        fs = private_s3fs(process.storage_options, timeout_s=CLIENT_TIMEOUT_S)
        assert fs.cat_file(f"imagenet/{MILLION.key(123_456)}") == MILLION.content(123_456)
        assert fs.cat_file("plain/a.bin") == b"abc"
        assert fs.ls("imagenet/n00000007/")[:2] == [
            f"imagenet/{MILLION.key(i)}" for i in (7000, 7001)
        ]
        reads = process.read_stats()
        assert reads.count("GetObject", f"/imagenet/{MILLION.key(123_456)}") == 1
        assert reads.body_bytes["/plain/a.bin"] == 3
        assert reads.count("ListObjectsV2", "/imagenet") == process.stats().count(
            "/imagenet", "GET"
        )
        process.reset_stats()
        assert process.read_stats().operations == {}
    assert not (tmp_path / "root" / ".s3folder-synthetic.json").exists()
