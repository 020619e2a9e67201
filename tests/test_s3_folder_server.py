"""S3FolderServer through the real clients: s3fs (aiobotocore), boto3 (s3transfer) and
fastload itself, since what matters is that they all see a faithful S3."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import io
import os
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import private_s3fs

from fastload.testing import HTTPServerProcess, RemoteBehavior, S3FolderServer

s3fs = pytest.importorskip("s3fs")
boto3 = pytest.importorskip("boto3")
aiohttp = pytest.importorskip("aiohttp")
import botocore.config  # noqa: E402
from botocore.exceptions import ClientError, EndpointConnectionError  # noqa: E402

# Generous bounds on client calls: they only matter if something hangs.
CLIENT_TIMEOUT_S = 10.0
BUCKET = "fastload-test"
MANY = 2_500  # keys in the listing tests: more than two pages of 1,000
CLASSES = 25
ODD_KEYS = ("many/c00-first.bin", "many/with space+plus&amp.bin", "many/top.bin")
DATA = np.random.default_rng(7).integers(0, 256, 300_000, np.uint8).tobytes()


def md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


@pytest.fixture(scope="module")
def many_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bucket of MANY tiny objects in CLASSES folders, plus keys that sort oddly."""
    root = tmp_path_factory.mktemp("s3root")
    for i in range(MANY):
        path = root / BUCKET / f"many/c{i % CLASSES:02d}/{i:05d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(i.to_bytes(2, "big"))
    for key in ODD_KEYS:
        (root / BUCKET / key).write_bytes(key.encode())
    (root / BUCKET / "many" / "empty-folder").mkdir()  # holds no object: no prefix
    return root


def many_keys() -> list[str]:
    keys = [f"many/c{i % CLASSES:02d}/{i:05d}.bin" for i in range(MANY)]
    return sorted([*keys, *ODD_KEYS])


@pytest.fixture
def server(tmp_path: Path) -> Iterator[S3FolderServer]:
    with S3FolderServer(tmp_path / "root") as s:
        s.create_bucket(BUCKET)
        s.put(BUCKET, "data/blob.bin", DATA)
        s.put(BUCKET, "data/a.txt", b"hello world")
        s.reset_stats()
        yield s


def make_s3fs(server: S3FolderServer, retries: int = 1) -> Any:
    return private_s3fs(server.storage_options, timeout_s=CLIENT_TIMEOUT_S, retries=retries)


@pytest.fixture
def client(server: S3FolderServer) -> Iterator[Any]:
    c = boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id="anything",
        aws_secret_access_key="anything",
        config=botocore.config.Config(
            connect_timeout=CLIENT_TIMEOUT_S,
            read_timeout=CLIENT_TIMEOUT_S,
            retries={"total_max_attempts": 1},
        ),
    )
    yield c
    c.close()


def raw(
    server: S3FolderServer,
    method: str,
    path: str,
    body: bytes | Iterator[bytes] | None = None,
    headers: dict[str, str] | None = None,
    conn: http.client.HTTPConnection | None = None,
) -> tuple[int, dict[str, str], bytes]:
    own = conn is None
    conn = conn or http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        chunked = body is not None and not isinstance(body, bytes)
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        response = conn.getresponse()
        data = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, data
    finally:
        if own:
            conn.close()


# -- listings ---------------------------------------------------------------------------------


def test_find_and_ls_page_through_thousands_of_keys(many_root: Path) -> None:
    with S3FolderServer(many_root) as server:
        fs = make_s3fs(server)
        expected = many_keys()
        assert fs.find(f"{BUCKET}/many") == [f"{BUCKET}/{k}" for k in expected]
        # ListObjectsV2 pages of at most 1,000 keys, each page a request.
        assert server.stats().count(f"/{BUCKET}", "GET") == 3
        listing = fs.ls(f"{BUCKET}/many", detail=True)
        folders = sorted(e["name"] for e in listing if e["type"] == "directory")
        assert folders == [f"{BUCKET}/many/c{c:02d}" for c in range(CLASSES)]
        files = sorted(e["name"] for e in listing if e["type"] == "file")
        assert files == sorted(f"{BUCKET}/{k}" for k in ODD_KEYS)
        assert fs.ls(f"{BUCKET}/many/c03") == [f"{BUCKET}/{k}" for k in expected if "/c03/" in k]
        assert fs.cat_file(f"{BUCKET}/{ODD_KEYS[1]}") == ODD_KEYS[1].encode()
        assert not fs.exists(f"{BUCKET}/many/empty-folder")
        assert fs.ls("") == [BUCKET]


def test_boto3_paginators_keep_s3_order_and_roll_up_prefixes(many_root: Path) -> None:
    with S3FolderServer(many_root) as server:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=server.endpoint_url,
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        try:
            expected = many_keys()
            for operation in ("list_objects_v2", "list_objects"):
                pages = list(client.get_paginator(operation).paginate(Bucket=BUCKET, Prefix="m"))
                keys = [o["Key"] for p in pages for o in p["Contents"]]
                assert keys == expected, operation  # byte order: "c00-first" before "c00/"
                assert len(pages) == 3
                first = pages[0]["Contents"][0]
                assert first["Size"] == len(ODD_KEYS[0])
                assert first["ETag"] == f'"{md5(ODD_KEYS[0].encode())}"'
                assert first["StorageClass"] == "STANDARD"

            # Prefixes and keys share max-keys; no prefix comes twice across pages.
            pages = list(
                client.get_paginator("list_objects_v2").paginate(
                    Bucket=BUCKET,
                    Prefix="many/",
                    Delimiter="/",
                    PaginationConfig={"PageSize": 7},
                )
            )
            prefixes = [p["Prefix"] for page in pages for p in page.get("CommonPrefixes", [])]
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            assert prefixes == [f"many/c{c:02d}/" for c in range(CLASSES)]
            assert keys == sorted(ODD_KEYS)
            assert len(pages) == 4

            # Any delimiter; start-after.
            dashed = client.list_objects_v2(Bucket=BUCKET, Prefix="many/c0", Delimiter="-")
            assert [p["Prefix"] for p in dashed["CommonPrefixes"]] == ["many/c00-"]
            longer = client.list_objects_v2(Bucket=BUCKET, Prefix="many/c1", Delimiter="/0")
            assert [p["Prefix"] for p in longer["CommonPrefixes"]] == [
                f"many/c1{d}/0" for d in range(10)
            ]
            after = client.list_objects_v2(
                Bucket=BUCKET, Prefix="many/c24/", StartAfter="many/c24/02474.bin"
            )
            assert [o["Key"] for o in after["Contents"]] == ["many/c24/02499.bin"]
            assert not after["IsTruncated"]
            # A start-after inside a rolled-up folder still returns that folder's prefix.
            inside = client.list_objects_v2(
                Bucket=BUCKET, Prefix="many/", Delimiter="/", StartAfter="many/c05/00005.bin"
            )
            assert inside["CommonPrefixes"][0]["Prefix"] == "many/c05/"
            assert len(inside["CommonPrefixes"]) == CLASSES - 5
        finally:
            client.close()


# Keys that sort oddly (byte order: " " < "%" < "+" < "-" < "/" < "0" < "a" < "é" < "日"),
# many keys under one prefix (pages end inside it), and folders that hold no object.
TRICKY_KEYS = sorted(
    [
        "a b/c d.bin", "a b/c+d.bin", "a b/c%20d.bin", "a+b/x", "a%2Fb", "a%20b/x", "a-b",
        "a/b", "a0", "sort/a-b", "sort/a/b", "sort/a/c/d/e.bin", "sort/a0", "sort/a.",
        "ü/é.bin", "ü/日本語.txt", "ü/😀 smile.bin", "top.bin", "~tilde",
        *(f"pages/p{i % 4}/k{i:03d}.bin" for i in range(230)),
        *(f"pages/p0{i}.bin" for i in range(3)),
    ]
)  # fmt: skip
EMPTY_FOLDERS = ("sort/empty", "deep/empty/a/b", "ü/empty", "pages/p1/empty")


def s3_entries(keys: list[str], prefix: str, delimiter: str, after: str = "") -> list[str]:
    """What S3 lists: the keys after ``after``, in key order, those the delimiter rolls up
    as their common prefix, once (not at all if it is ``after``, where a page ended)."""
    entries: list[str] = []
    for key in sorted(keys):
        if not key.startswith(prefix) or key <= after:
            continue
        at = key.find(delimiter, len(prefix)) if delimiter else -1
        entry = key if at < 0 else key[: at + len(delimiter)]
        if entry != after and (not entries or entries[-1] != entry):
            entries.append(entry)
    return entries


@pytest.fixture(scope="module")
def tricky_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tricky")
    for key in TRICKY_KEYS:
        path = root / BUCKET / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    for folder in EMPTY_FOLDERS:
        (root / BUCKET / folder).mkdir(parents=True)
    return root


def list_pages(client: Any, v2: bool, page_size: int, **kwargs: Any) -> list[list[str]]:
    """Every page's keys and common prefixes, in key order, following the page tokens."""
    pages: list[list[str]] = []
    token: dict[str, str] = {}
    while True:
        if v2:
            page = client.list_objects_v2(Bucket=BUCKET, MaxKeys=page_size, **kwargs, **token)
        else:
            page = client.list_objects(Bucket=BUCKET, MaxKeys=page_size, **kwargs, **token)
        keys = [o["Key"] for o in page.get("Contents", [])]
        prefixes = [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        pages.append(sorted(keys + prefixes))
        if not page["IsTruncated"]:
            return pages
        if v2:
            token = {"ContinuationToken": page["NextContinuationToken"]}
        else:
            token = {"Marker": page["NextMarker"]}


@pytest.mark.parametrize(
    ("prefix", "delimiter"),
    [("", ""), ("", "/"), ("sort/", "/"), ("sort/a", "/"), ("pages/", "/"), ("pages/p0", ""),
     ("ü", ""), ("a", " "), ("pages/p", "1"), ("a b/", "%")],
)  # fmt: skip
def test_listing_pages_are_s3s_order_on_tricky_names(
    tricky_root: Path, prefix: str, delimiter: str
) -> None:
    expected = s3_entries(TRICKY_KEYS, prefix, delimiter)
    assert expected, "a case that lists nothing tests nothing"
    with S3FolderServer(tricky_root) as server:
        client = boto3.session.Session().client(
            "s3", endpoint_url=server.endpoint_url, aws_access_key_id="x",
            aws_secret_access_key="x",
        )  # fmt: skip
        try:
            for v2 in (True, False):
                page_size = 40
                pages = list_pages(client, v2, page_size, Prefix=prefix, Delimiter=delimiter)
                want = [expected[i : i + page_size] for i in range(0, len(expected), page_size)]
                assert pages == want, (v2, prefix, delimiter)
            for after in ["", "a", "a b/c d.bin", "pages/p1/k005.bin", "pages/p2/", "sort/a/",
                          "sort/a/c", "ü/é.bin", "zzz", prefix, prefix + "\U0010ffff"]:  # fmt: skip
                page = client.list_objects_v2(
                    Bucket=BUCKET, Prefix=prefix, Delimiter=delimiter, StartAfter=after
                )
                keys = [o["Key"] for o in page.get("Contents", [])]
                keys += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
                assert sorted(keys) == s3_entries(TRICKY_KEYS, prefix, delimiter, after), after
        finally:
            client.close()


def test_files_written_straight_into_the_folder_show_in_the_next_listing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / BUCKET / "c1").mkdir(parents=True)
    (root / BUCKET / "c1" / "a.bin").write_bytes(b"a")
    with S3FolderServer(root) as server:
        fs = make_s3fs(server)
        assert fs.find(BUCKET) == [f"{BUCKET}/c1/a.bin"]
        # No pause: the folders changed within a tick of the listing before.
        (root / BUCKET / "c1" / "b.bin").write_bytes(b"b")
        (root / BUCKET / "c2" / "deeper").mkdir(parents=True)
        (root / BUCKET / "c2" / "deeper" / "c.bin").write_bytes(b"c")
        fs.invalidate_cache()
        assert fs.find(BUCKET) == [
            f"{BUCKET}/c1/a.bin",
            f"{BUCKET}/c1/b.bin",
            f"{BUCKET}/c2/deeper/c.bin",
        ]
        (root / BUCKET / "c1" / "a.bin").unlink()
        fs.invalidate_cache()
        assert fs.find(BUCKET) == [f"{BUCKET}/c1/b.bin", f"{BUCKET}/c2/deeper/c.bin"]
        assert fs.ls(f"{BUCKET}/c2") == [f"{BUCKET}/c2/deeper"]


def test_a_listing_rescans_only_the_folders_that_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.testing import s3_folder

    scans: list[str] = []

    def counted_scan(directory: str) -> list[str]:
        scans.append(os.path.relpath(directory, root / BUCKET))
        return scan(directory)

    scan = s3_folder._scan_directory
    monkeypatch.setattr(s3_folder, "_scan_directory", counted_scan)
    # Keep every scan: the folders' timestamps were set well before the listings (the
    # pause is longer than a tick of the filesystem's clock), so each change moves them.
    monkeypatch.setattr(s3_folder, "_SETTLE_NS", 0)
    root = tmp_path / "root"
    for i in range(600):
        path = root / BUCKET / f"c{i % 20:02d}" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    time.sleep(0.05)
    with S3FolderServer(root) as server:
        client = boto3.session.Session().client(
            "s3", endpoint_url=server.endpoint_url, aws_access_key_id="x",
            aws_secret_access_key="x",
        )  # fmt: skip
        try:
            everything = [k for page in list_pages(client, True, 250) for k in page]
            assert len(everything) == 600
            assert sorted(scans) == [".", *(f"c{c:02d}" for c in range(20))]
            scans.clear()
            assert [k for page in list_pages(client, True, 250) for k in page] == everything
            assert scans == []  # every page a bisection into kept scans

            (root / BUCKET / "c03" / "new.bin").write_bytes(b"n")
            assert len([k for page in list_pages(client, True, 1000) for k in page]) == 601
            assert scans == ["c03"]
            scans.clear()
            client.put_object(Bucket=BUCKET, Key="c07/put.bin", Body=b"p")
            client.delete_object(Bucket=BUCKET, Key="c05/0005.bin")
            listed = [k for page in list_pages(client, True, 1000) for k in page]
            assert "c07/put.bin" in listed
            assert "c05/0005.bin" not in listed
            assert sorted(scans) == [".", "c05", "c07"]  # the server's writes: the key's path
        finally:
            client.close()


# -- objects ---------------------------------------------------------------------------------


def test_head_info_and_ranges(server: S3FolderServer, client: Any) -> None:
    fs = make_s3fs(server)
    path = f"{BUCKET}/data/blob.bin"
    info = fs.info(path)
    assert info["size"] == len(DATA)
    assert info["ETag"] == f'"{md5(DATA)}"'
    head = client.head_object(Bucket=BUCKET, Key="data/blob.bin")
    assert head["ContentLength"] == len(DATA)
    mtime = (server.root / BUCKET / "data/blob.bin").stat().st_mtime
    assert head["LastModified"] == parsedate_to_datetime(
        time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(mtime))
    )

    # The ETag is computed once per (path, size, mtime): a rewrite that keeps both is
    # not noticed (cheap requests matter more here); a new mtime is.
    on_disk = server.root / BUCKET / "data/a.txt"
    before = on_disk.stat()
    etag = client.head_object(Bucket=BUCKET, Key="data/a.txt")["ETag"]
    on_disk.write_bytes(b"HELLO WORLD")
    os.utime(on_disk, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert client.head_object(Bucket=BUCKET, Key="data/a.txt")["ETag"] == etag
    os.utime(on_disk, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert client.head_object(Bucket=BUCKET, Key="data/a.txt")["ETag"] == f'"{md5(b"HELLO WORLD")}"'

    server.reset_stats()
    assert fs.cat_file(path) == DATA
    assert fs.cat_file(path, start=10, end=20) == DATA[10:20]
    assert fs.cat_file(path, start=len(DATA) - 5) == DATA[-5:]
    assert fs.cat_file(path, start=len(DATA) - 3, end=len(DATA) + 100) == DATA[-3:]
    got = client.get_object(Bucket=BUCKET, Key="data/blob.bin", Range="bytes=-4")
    assert got["Body"].read() == DATA[-4:]
    assert got["ContentRange"] == f"bytes {len(DATA) - 4}-{len(DATA) - 1}/{len(DATA)}"
    assert server.stats().bytes_sent == len(DATA) + 10 + 5 + 3 + 4  # bodies, nothing else
    with pytest.raises(ClientError) as excinfo:
        client.get_object(Bucket=BUCKET, Key="data/blob.bin", Range=f"bytes={len(DATA)}-")
    assert excinfo.value.response["Error"]["Code"] == "InvalidRange"


@pytest.mark.parametrize("signature_version", ["s3", "s3v4"])
def test_presigned_urls_are_served(server: S3FolderServer, signature_version: str) -> None:
    client = boto3.session.Session().client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id="x",
        aws_secret_access_key="x",
        config=botocore.config.Config(signature_version=signature_version),
    )
    try:
        url = client.generate_presigned_url(
            "get_object", Params={"Bucket": BUCKET, "Key": "data/a.txt"}, ExpiresIn=60
        )
    finally:
        client.close()
    assert "Signature" in url
    status, _, body = raw(server, "GET", url.removeprefix(server.endpoint_url))
    assert (status, body) == (200, b"hello world")
    assert server.stats().count(f"/{BUCKET}/data/a.txt", "GET") == 1


def test_missing_keys_buckets_and_escapes(
    server: S3FolderServer, client: Any, tmp_path: Path
) -> None:
    (tmp_path / "secret.txt").write_bytes(b"outside root")
    fs = make_s3fs(server)
    with pytest.raises(FileNotFoundError):
        fs.cat_file(f"{BUCKET}/data/missing.bin")
    with pytest.raises(FileNotFoundError):
        fs.info(f"{BUCKET}/nope")
    for call in (client.get_object, client.head_object):
        with pytest.raises(ClientError) as excinfo:
            call(Bucket=BUCKET, Key="data/missing.bin")
        assert excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(ClientError) as excinfo:
        client.get_object(Bucket=BUCKET, Key="data/missing.bin")
    assert excinfo.value.response["Error"]["Code"] == "NoSuchKey"
    with pytest.raises(ClientError) as excinfo:
        client.list_objects_v2(Bucket="no-such-bucket")
    assert excinfo.value.response["Error"]["Code"] == "NoSuchBucket"
    for escape in ("/fastload-test/../secret.txt", "/fastload-test/%2e%2e/%2e%2e/secret.txt"):
        status, _, body = raw(server, "GET", escape)
        assert status == 404
        assert b"outside root" not in body
    status, headers, body = raw(server, "GET", f"/{BUCKET}?versioning")
    assert (status, headers["content-type"]) == (501, "application/xml")
    assert b"<Code>NotImplemented</Code>" in body
    status, _, body = raw(server, "PATCH", f"/{BUCKET}/data/a.txt")
    assert status == 501
    assert b"<Error>" in body


def test_put_copy_delete_and_buckets(server: S3FolderServer, client: Any) -> None:
    fs = make_s3fs(server)
    fs.pipe_file(f"{BUCKET}/new/x.bin", b"xyz")
    assert (server.root / BUCKET / "new/x.bin").read_bytes() == b"xyz"
    fs.copy(f"{BUCKET}/new/x.bin", f"{BUCKET}/new/y.bin")
    assert fs.cat_file(f"{BUCKET}/new/y.bin") == b"xyz"
    fs.rm(f"{BUCKET}/new", recursive=True)  # DeleteObjects
    assert not fs.exists(f"{BUCKET}/new/x.bin")
    assert fs.find(f"{BUCKET}/new") == []
    assert not any(p.name.startswith(".") for p in server.root.rglob("*"))  # no temp files
    client.create_bucket(Bucket="second")
    client.create_bucket(Bucket="second")  # idempotent
    client.head_bucket(Bucket="second")
    assert client.get_bucket_location(Bucket="second")["LocationConstraint"] is None
    client.delete_bucket(Bucket="second")
    with pytest.raises(ClientError):
        client.head_bucket(Bucket="second")
    with pytest.raises(ClientError) as excinfo:
        client.delete_bucket(Bucket=BUCKET)
    assert excinfo.value.response["Error"]["Code"] == "BucketNotEmpty"


def test_multipart_upload_file_and_download_file_round_trip(
    server: S3FolderServer, client: Any, tmp_path: Path
) -> None:
    big = np.random.default_rng(3).integers(0, 256, 20 << 20, np.uint8).tobytes()
    source = tmp_path / "big.bin"
    source.write_bytes(big)
    client.upload_file(str(source), BUCKET, "big/one.bin")  # s3transfer: multipart > 8 MB
    stats = server.stats()
    assert stats.count(f"/{BUCKET}/big/one.bin", "POST") == 2  # create, complete
    assert stats.count(f"/{BUCKET}/big/one.bin", "PUT") == 3  # 8 + 8 + 4 MB parts
    assert (server.root / BUCKET / "big/one.bin").read_bytes() == big
    assert client.head_object(Bucket=BUCKET, Key="big/one.bin")["ETag"] == f'"{md5(big)}"'
    back = tmp_path / "back.bin"
    client.download_file(BUCKET, "big/one.bin", str(back))
    assert back.read_bytes() == big

    make_s3fs(server).put_file(str(source), f"{BUCKET}/big/two.bin")  # one plain PUT
    assert (server.root / BUCKET / "big/two.bin").read_bytes() == big
    upload = client.create_multipart_upload(Bucket=BUCKET, Key="big/three.bin")
    client.upload_part(
        Bucket=BUCKET, Key="big/three.bin", UploadId=upload["UploadId"], PartNumber=1, Body=b"x"
    )
    client.abort_multipart_upload(Bucket=BUCKET, Key="big/three.bin", UploadId=upload["UploadId"])
    assert not (server.root / BUCKET / "big/three.bin").exists()
    assert not list((server.root / ".s3folder-uploads").iterdir())


@pytest.mark.parametrize("framing", ["http-chunked", "content-length"])
def test_aws_chunked_put_object(server: S3FolderServer, framing: str) -> None:
    """What botocore sends for a streaming upload over https, encoded by botocore itself."""
    from botocore.httpchecksum import AwsChunkedWrapper, Crc32Checksum

    data = DATA[:150_000]
    encoded = AwsChunkedWrapper(
        io.BytesIO(data),
        checksum_cls=Crc32Checksum,
        checksum_name="x-amz-checksum-crc32",
        chunk_size=64 * 1024,
    ).read()
    assert b"x-amz-checksum-crc32:" in encoded  # the trailer is there to be skipped
    headers = {
        "Content-Encoding": "aws-chunked",
        "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
        "x-amz-trailer": "x-amz-checksum-crc32",
        "x-amz-decoded-content-length": str(len(data)),
        "Expect": "100-continue",
    }
    body: bytes | Iterator[bytes]
    if framing == "http-chunked":
        body = iter([encoded[i : i + 10_000] for i in range(0, len(encoded), 10_000)])
    else:
        body = encoded
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        status, response_headers, _ = raw(server, "PUT", f"/{BUCKET}/up.bin", body, headers, conn)
        assert status == 200, _
        assert response_headers["etag"] == f'"{md5(data)}"'
        # The connection is still in step: the next request on it works.
        assert raw(server, "GET", f"/{BUCKET}/up.bin", conn=conn)[2] == data
    finally:
        conn.close()


# -- knobs, counters and faults ------------------------------------------------------------


def test_latency_knob_delays_every_request(server: S3FolderServer, client: Any) -> None:
    server.set_behavior(latency_s=0.2)
    cpu_before = server.cpu_s
    started = time.monotonic()
    client.head_object(Bucket=BUCKET, Key="data/a.txt")
    client.get_object(Bucket=BUCKET, Key="data/a.txt")["Body"].read()
    assert time.monotonic() - started >= 0.4
    assert 0 < server.cpu_s - cpu_before < 0.2  # the server's CPU: the waits are not in it


def test_bandwidth_knob_paces_and_bytes_are_counted(server: S3FolderServer) -> None:
    fs = make_s3fs(server)
    server.set_behavior(bandwidth_bytes_per_s=len(DATA) / 0.25)
    started = time.monotonic()
    assert fs.cat_file(f"{BUCKET}/data/blob.bin", start=0) == DATA
    assert time.monotonic() - started >= 0.2  # 0.25 s at the cap, less one pacing chunk
    stats = server.stats()
    assert stats.bytes_sent == len(DATA)
    assert stats.count(f"/{BUCKET}/data/blob.bin", "GET") == 1


def test_injected_faults_are_s3_errors_and_retried(server: S3FolderServer) -> None:
    path = f"{BUCKET}/data/a.txt"
    server.fail_next(1, 503, methods=["GET"])
    status, _, body = raw(server, "GET", f"/{path}")
    assert status == 503
    assert b"<Code>SlowDown</Code>" in body

    server.reset_stats()
    server.fail_next(1, 503, methods=["GET"])
    assert make_s3fs(server, retries=2).cat_file(path, start=0) == b"hello world"
    stats = server.stats()
    assert stats.count(f"/{path}", "GET") == 2
    assert stats.faults_injected == 1

    fs = make_s3fs(server)
    server.truncate_next()
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(f"{BUCKET}/data/blob.bin", start=0)
    server.reset_next(2)  # aiohttp retries one reset itself
    with pytest.raises(EndpointConnectionError):
        fs.cat_file(path, start=0)
    assert fs.cat_file(path, start=0) == b"hello world"

    server.fail_next(1, 503, methods=["PUT"])  # a refused body: the connection must not hang
    status, _, body = raw(server, "PUT", f"/{BUCKET}/data/c.bin", b"z" * 100_000)
    assert status == 503
    assert not (server.root / BUCKET / "data/c.bin").exists()


def test_close_with_a_client_stalled_mid_download(tmp_path: Path) -> None:
    size = 32 << 20  # more than the socket buffers hold, so the server blocks in a send
    server = S3FolderServer(tmp_path / "root")
    server.create_bucket(BUCKET)
    server.put(BUCKET, "big.bin", bytes(size))
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S)
    try:
        sock.sendall(f"GET /{BUCKET}/big.bin HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        received = len(sock.recv(65536))
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while server.stats().bytes_sent == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        closer = threading.Thread(target=server.close, daemon=True)
        closer.start()
        closer.join(CLIENT_TIMEOUT_S)
        assert not closer.is_alive(), "close() hung"
        # The client gets what was in flight, then EOF or a reset; a hang would time out.
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        assert received < size
    finally:
        sock.close()
        server.close()


# -- fastload on top ---------------------------------------------------------------------------


def test_fastload_opens_and_reads_a_dataset_through_it(tmp_path: Path) -> None:
    import fastload

    source = tmp_path / "source"
    files = {f"class_{i % 3}/img_{i:02d}.jpg": os.urandom(1000 + i) for i in range(12)}
    for rel, data in files.items():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(data)
    with S3FolderServer(tmp_path / "root") as server:
        keys = server.upload_dir(source, "data", prefix="ds")
        assert keys == [f"ds/{rel}" for rel in sorted(files)]
        ds = fastload.open_dataset(
            "s3://data/ds",
            storage_options=server.storage_options,
            cache_dir=str(tmp_path / "cache"),
        )
        assert ds.format == "imagefolder"
        assert ds.classes == ["class_0", "class_1", "class_2"]
        samples = [ds[i] for i in range(len(ds))]
        assert sorted(samples) == sorted((data, int(rel[6])) for rel, data in files.items())
        assert [ds[i] for i in range(len(ds))] == samples  # from the cache now
        stats = server.stats()
        for rel in files:
            assert stats.count(f"/data/ds/{rel}", "GET") == 1, rel


# -- https, and S3's bad days ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HTTPServerProcess]:
    """An https S3FolderServer in a process of its own, serving BUCKET/data/a.txt."""
    root = tmp_path_factory.mktemp("tls-root")
    (root / BUCKET / "data").mkdir(parents=True)
    (root / BUCKET / "data" / "a.txt").write_bytes(b"hello world")
    with HTTPServerProcess(root, s3=True, tls=True) as s:
        yield s


def _untrusted(options: dict[str, Any]) -> dict[str, Any]:
    """The same options without the trusted authority (``verify``)."""
    client_kwargs = {k: v for k, v in options["client_kwargs"].items() if k != "verify"}
    return {**options, "client_kwargs": client_kwargs}


def test_tls_s3fs_trusts_the_server_through_verify_and_only_so(
    tls_server: HTTPServerProcess,
) -> None:
    assert tls_server.url.startswith("https://")
    path = f"{BUCKET}/data/a.txt"
    tls_server.reset_stats()
    fs = private_s3fs(tls_server.storage_options, timeout_s=CLIENT_TIMEOUT_S)
    assert fs.cat_file(path) == b"hello world"
    assert tls_server.stats().count(f"/{path}", "GET") == 1

    tls_server.reset_stats()
    untrusted = private_s3fs(_untrusted(tls_server.storage_options), timeout_s=CLIENT_TIMEOUT_S)
    with pytest.raises(botocore.exceptions.SSLError, match="CERTIFICATE_VERIFY_FAILED"):
        untrusted.cat_file(path)
    assert tls_server.stats().total == 0  # refused in the handshake: no request got through


@pytest.mark.parametrize("trust", ["verify", "AWS_CA_BUNDLE"])
def test_tls_obstore_transport_trusts_what_s3fs_was_told(
    tls_server: HTTPServerProcess, trust: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastload.remote.obstore import ObjectStoreTransport

    options = tls_server.storage_options
    if trust == "AWS_CA_BUNDLE":
        options = _untrusted(options)
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tls_server.ca_file))
    path = f"{BUCKET}/data/a.txt"
    tls_server.reset_stats()
    transport = ObjectStoreTransport.from_s3fs(
        private_s3fs(options, timeout_s=CLIENT_TIMEOUT_S), CLIENT_TIMEOUT_S
    )
    assert transport is not None  # obstore itself, not the s3fs fallback
    assert bytes(transport.get(path)) == b"hello world"
    assert tls_server.stats().count(f"/{path}", "GET") == 1

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    tls_server.reset_stats()
    untrusted = ObjectStoreTransport.from_s3fs(
        private_s3fs(_untrusted(options), timeout_s=CLIENT_TIMEOUT_S), CLIENT_TIMEOUT_S
    )
    assert untrusted is not None
    with pytest.raises(ssl.SSLCertVerificationError, match="UnknownIssuer"):
        untrusted.get(path)
    assert tls_server.stats().total == 0


@pytest.mark.parametrize("transport", ["auto", "fsspec"])
def test_an_untrusted_certificate_fails_at_once_saying_how_to_trust_it(
    tls_server: HTTPServerProcess, transport: str, tmp_path: Path
) -> None:
    """Not eight retries of "error sending request": the handshake will fail every time."""
    from fastload.errors import RemoteAccessError
    from fastload.staging import FetchConfig
    from fastload.store import CachedStore

    store = CachedStore.open(
        f"s3://{BUCKET}/data",
        cache_dir=str(tmp_path / "cache"),
        storage_options=_untrusted(tls_server.storage_options),
        fetch=FetchConfig(transport=transport, retries=8, timeout_s=CLIENT_TIMEOUT_S),  # type: ignore[arg-type]
    )
    with pytest.raises(RemoteAccessError, match=r"certificate .* is not trusted") as caught:
        store.object_keys()  # the listing is the first request
    assert "'verify'" in str(caught.value)
    assert "AWS_CA_BUNDLE" in str(caught.value)
    store.close()


def test_slowdown_burst_is_answered_503_and_fastload_retries_through_it(tmp_path: Path) -> None:
    import fastload

    objects = 40
    with S3FolderServer(tmp_path / "root") as server:
        server.create_bucket(BUCKET)
        for i in range(objects):
            server.put(BUCKET, f"ds/c{i % 2}/{i:03d}.bin", os.urandom(100 + i))
        url, cache = f"s3://{BUCKET}/ds", str(tmp_path / "cache")
        options = server.storage_options
        fastload.warm(url, cache_dir=cache, storage_options=options, dry_run=True, progress=False)
        # The burst starts with staging's first GET and outlasts the first retries.
        server.set_behavior(RemoteBehavior(slowdown_every_s=3600.0, slowdown_for_s=0.5))
        server.reset_stats()
        report = fastload.warm(url, cache_dir=cache, storage_options=options, progress=False)
        assert report.ok, report
        assert report.fetched == objects
        stats = server.stats()
        slowed = stats.faults_injected
        assert slowed > 0
        gets = {p: n for (m, p), n in stats.requests.items() if m == "GET"}
        assert len(gets) == objects
        assert sum(gets.values()) == objects + slowed  # one more GET for each SlowDown

        server.set_behavior(RemoteBehavior(slowdown_every_s=3600.0, slowdown_for_s=3600.0))
        status, _, body = raw(server, "GET", f"/{BUCKET}/ds/c0/000.bin")
        assert status == 503
        assert b"<Code>SlowDown</Code>" in body
