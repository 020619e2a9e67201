"""Tar datasets opened from an index: fastload's own (``fastload index``) and wids'
``shardindex.json``; wrong and stale indexes; a node's share warmed without the rest.

Counts come from the loopback servers (which objects were fetched, how many bytes), never
from timing.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import struct
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Remote
from test_dataset_tar import read_with_tarfile, tar_bytes, webdataset_shards
from test_dataset_tar import serve as serve_dataset

from fastload import ShardedSampler, safe_files
from fastload.datasets import DatasetError, open_dataset
from fastload.datasets.tar import (
    INDEX_NAME,
    WIDS_INDEX_NAME,
    IndexFile,
    TarDataset,
    is_header_of,
    scan_tar,
    write_index,
)
from fastload.store import CachedStore, StoreConfig
from fastload.testing import HubServerProcess, S3FolderServer
from fastload.warm import NodeShare, warm

FASTLOAD = str(Path(sys.executable).parent / "fastload")


def serve(
    kind: str, base: Path, objects: dict[str, bytes]
) -> contextlib.AbstractContextManager[Remote]:
    """objects as a local folder, over HTTP or over S3 (a folder: an index can be written
    next to the shards)."""
    return serve_dataset(kind, base, objects, s3_folder=True)


def open_tar(remote: Remote, cache: Path, **options: Any) -> TarDataset:
    ds = open_dataset(
        remote.url, cache_dir=str(cache), storage_options=remote.storage_options, **options
    )
    assert isinstance(ds, TarDataset)
    return ds


def list_into(remote: Remote, cache: Path) -> None:
    """Lists the dataset into cache (the manifest), so that counts after it see only reads."""
    store = CachedStore(
        StoreConfig(url=remote.url, cache_dir=str(cache), storage_options=remote.storage_options)
    )
    store.object_keys()
    store.close()


def fetched_keys(remote: Remote) -> set[str]:
    """The dataset's objects (and index) the server sent (GET), by key."""
    return {k for k in {*remote.files, INDEX_NAME} if remote.gets(k)}


def index_of(remote: Remote, cache: Path, **options: Any) -> Any:
    return write_index(
        remote.url,
        cache_dir=str(cache),
        storage_options=remote.storage_options,
        progress=False,
        **options,
    )


@pytest.fixture(scope="module")
def shards() -> dict[str, bytes]:
    return webdataset_shards()


# --- fastload's own index --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "http", "s3"])
def test_an_indexed_dataset_opens_reading_only_its_index(
    kind: str, tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve(kind, tmp_path, {**shards, "README.md": b"not a shard"}) as remote:
        # a bucket gets the index beside its shards only when asked
        report = index_of(remote, tmp_path / "c", **({"to": "dataset"} if kind == "s3" else {}))
        assert (report.shards, report.samples) == (4, 40)
        assert report.shard_bytes == sum(map(len, shards.values()))
        if kind == "http":  # nowhere to write next to the shards: the cache holds it
            assert report.in_cache
            assert "HTTP" in report.why_in_cache
            assert report.written_to == str(tmp_path / "c" / "indexes")
            cache = tmp_path / "c"  # the index serves opens with this cache directory
        else:
            assert not report.in_cache
            assert report.written_to == f"{remote.url}/{INDEX_NAME}"
            cache = tmp_path / "fresh"  # any cache directory
        if remote.server is not None:
            assert all(remote.gets(k) >= 1 for k in shards)  # each shard streamed
            assert remote.gets("README.md") == 0
            list_into(remote, cache)
            remote.server.reset_stats()

        ds = open_tar(remote, cache, format="auto")
        assert ds.shard_sizes == [10, 10, 10, 10]
        if remote.server is not None:
            assert fetched_keys(remote) == (set() if kind == "http" else {INDEX_NAME})
        assert [ds[i] for i in range(len(ds))] == read_with_tarfile(shards)
        assert [ds.key(i) for i in range(len(ds))] == [
            s["__key__"] for s in read_with_tarfile(shards)
        ]
        fresh = open_tar(remote, cache, format="auto")  # no shard's members read yet
        pickled = pickle.dumps(fresh)
        index = (
            next((cache / "indexes").glob("*.flidx")).read_bytes()
            if kind == "http"
            else fresh.store.read(INDEX_NAME)
        )
        assert index[-48:] not in pickled  # a worker reads the members from the cache
        again = pickle.loads(pickled)
        assert [again[i] for i in (0, 17, 39)] == [ds[i] for i in (0, 17, 39)]


def test_the_index_is_refreshed_in_the_listing_and_opened_without_a_warning(
    tmp_path: Path, shards: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with serve("local", tmp_path, shards) as remote:
        before = open_tar(remote, tmp_path / "c")  # lists (and indexes the shards) first
        assert "fastload index" in caplog.text  # the advice, with what opening read
        assert "4 tar shard(s) (0.7 MB)" in caplog.text
        before.close()
        index_of(remote, tmp_path / "c")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastload"):
            ds = open_tar(remote, tmp_path / "c")
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert ds._promised[0].source == f"{remote.url}/{INDEX_NAME}"


def test_a_sample_of_an_indexed_shard_is_one_range_without_the_shard(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    """What a loader can do for a first batch: read a sample's ranges alone (cached as
    range entries), not the whole shard first."""
    with serve("s3", tmp_path, shards) as remote:
        index_of(remote, tmp_path / "c", to="dataset")
        ds = open_tar(remote, tmp_path / "fresh")
        assert remote.server is not None
        remote.server.reset_stats()
        ranges = ds.sample_ranges(13)
        assert ranges is not None
        parts = [ds.store.read_range(*r) for r in ranges]
        assert ds.assemble(13, parts) == read_with_tarfile(shards)[13]
        assert remote.server.stats().bytes_sent == sum(n for _, _, n in ranges)
        assert ds.store.read_range(*ranges[0]) == parts[0]  # now local
        assert remote.server.stats().count(method="GET") == len(ranges)


def test_an_index_file_round_trips_members() -> None:
    members = [("a.jpg", 512, 3), ("a.cls", 1536, 0), ("dir/\udcff.x", 2048, 10**10)]
    data = IndexFile.encode([("s.tar", None, "v1", members), ("empty.tar", 0, None, [])])
    index = IndexFile(data, "here")
    assert index.members("s.tar", "u") == members
    assert index.members("empty.tar", "u") == []
    assert index.current("s.tar", None, "v1") is not None
    assert index.current("s.tar", None, "v2") is None
    assert index.entries["s.tar"].samples == 2


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_member_headers_are_recognised_in_every_tar_format(fmt: int) -> None:
    names = ["short.jpg", "é-non-ascii.jpg", f"{'d' * 90}/{'n' * 60}.jpg", "x" * 150 + ".jpg"]
    if fmt == tarfile.USTAR_FORMAT:  # ASCII; a name over 100 bytes must split at a '/'
        names = [n for n in names if n.isascii() and (len(n) <= 100 or "/" in n)]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, name in enumerate(names):
            info = tarfile.TarInfo(name)
            info.size = 100 * i
            tf.addfile(info, io.BytesIO(bytes(info.size)))
    raw = buf.getvalue()
    members = scan_tar(io.BytesIO(raw), "t.tar", len(raw))
    assert [m[0] for m in members] == names
    for name, offset, size in members:
        assert is_header_of(raw[offset - 512 : offset], name, size)
        assert not is_header_of(raw[offset - 512 : offset], name, size + 1)
        assert not is_header_of(raw[offset - 512 : offset], "other.jpg", size)
        assert not is_header_of(raw[offset : offset + 512], name, size)


# --- wrong and stale indexes -----------------------------------------------------------------


def rewrite_index(folder: Path, change: Any) -> None:
    """Applies change(header) to the JSON header of folder's fastload index, sealed again
    (a checksum that holds: the numbers themselves must be checked)."""
    data = safe_files.unsealed((folder / INDEX_NAME).read_bytes())
    assert data is not None
    (length,) = struct.unpack_from("<Q", data, 8)
    header = json.loads(data[16 : 16 + length])
    change(header)
    text = json.dumps(header).encode()
    (folder / INDEX_NAME).write_bytes(
        safe_files.sealed(data[:8] + struct.pack("<Q", len(text)) + text + data[16 + length :])
    )


def test_an_index_whose_count_disagrees_with_its_members_is_refused(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve("local", tmp_path, shards) as remote:
        index_of(remote, tmp_path / "c")
        rewrite_index(Path(remote.url), lambda h: h["shards"][2].update(samples=11))
        ds = open_tar(remote, tmp_path / "fresh")
        assert ds.shard_sizes == [10, 10, 11, 10]
        assert ds[0] == read_with_tarfile(shards)[0]
        with pytest.raises(
            DatasetError, match=r"shard-002\.tar: .*flidx says it holds 11 samples.*fastload index"
        ):
            ds[25]


def test_an_offset_that_is_no_member_is_refused_naming_the_shard(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve("s3", tmp_path, shards) as remote:
        index_of(remote, tmp_path / "c", to="dataset")
        store = open_tar(remote, tmp_path / "c").store
        # shard-001's members at the offsets of shard-000's (same size and version kept)
        wrong = []
        for key in sorted(shards):
            members = scan_tar(io.BytesIO(shards["shard-000.tar"]), key, None)
            if key != "shard-001.tar":
                members = scan_tar(io.BytesIO(shards[key]), key, None)
            obj = store.object(key)
            wrong.append((key, obj.size, obj.version, members))
        assert isinstance(remote.server, S3FolderServer)
        remote.server.put("data", f"ds/{INDEX_NAME}", IndexFile.encode(wrong))
        ds = open_tar(remote, tmp_path / "fresh")
        assert ds[5] == read_with_tarfile(shards)[5]
        with pytest.raises(
            DatasetError,
            match=r"/ds/shard-001\.tar: no member '.*' of \d+ bytes starts at byte \d+, as "
            r"s3://data/ds/fastload\.flidx says; .*run `fastload index s3://data/ds` again",
        ):
            ds[10]


def test_an_unreadable_index_is_refused_at_open(tmp_path: Path, shards: dict[str, bytes]) -> None:
    with (
        serve("local", tmp_path, {**shards, INDEX_NAME: b"FLTARIDX\x05\x00"}) as remote,
        pytest.raises(DatasetError, match=r"fastload\.flidx is not a readable fastload index"),
    ):
        open_tar(remote, tmp_path / "c")


def test_a_changed_shard_is_indexed_again_the_rest_from_the_index(
    tmp_path: Path, shards: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with serve("s3", tmp_path, dict(shards)) as remote:
        index_of(remote, tmp_path / "c", to="dataset")
        changed = tar_bytes([("new.jpg", b"j"), ("new.cls", b"1")])
        assert isinstance(remote.server, S3FolderServer)
        remote.server.put("data", "ds/shard-001.tar", changed)
        list_into(remote, tmp_path / "fresh")
        remote.server.reset_stats()

        ds = open_tar(remote, tmp_path / "fresh")
        assert ds.shard_sizes == [10, 1, 10, 10]
        assert fetched_keys(remote) == {INDEX_NAME, "shard-001.tar"}
        assert "1 of the 4 tar shards" in caplog.text
        assert "fastload index s3://data/ds` again" in caplog.text
        assert ds[10] == {"__key__": "new", "__shard__": "shard-001.tar", "jpg": b"j", "cls": b"1"}
        assert ds[11] == read_with_tarfile(shards)[20]


# --- wids' shardindex.json -------------------------------------------------------------------


def wids_index(
    shards: dict[str, bytes], url_of: Any, counts: dict[str, int] | None = None
) -> bytes:
    counts = counts or {}
    return json.dumps(
        {
            "__kind__": "wids-shard-index-v1",
            "wids_version": 1,
            "shardlist": [
                {"url": url_of(k), "nsamples": counts.get(k, 10), "filesize": len(shards[k])}
                for k in sorted(shards)
            ],
        }
    ).encode()


def test_a_wids_index_gives_the_counts_and_each_shard_is_read_when_used(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve("s3", tmp_path, {**shards, WIDS_INDEX_NAME: wids_index(shards, str)}) as remote:
        list_into(remote, tmp_path / "c")
        assert remote.server is not None
        remote.server.reset_stats()
        ds = open_tar(remote, tmp_path / "c", format="auto")
        assert ds.shard_sizes == [10, 10, 10, 10]
        assert fetched_keys(remote) == {WIDS_INDEX_NAME}
        assert ds[25] == read_with_tarfile(shards)[25]
        assert fetched_keys(remote) == {WIDS_INDEX_NAME, "shard-002.tar"}
        assert [ds[i] for i in range(len(ds))] == read_with_tarfile(shards)

        # What was read is kept: the next open needs neither the shards nor the wids index.
        remote.server.reset_stats()
        again = open_tar(remote, tmp_path / "c")
        assert again.shard_sizes == ds.shard_sizes
        assert remote.server.stats().count(method="GET") == 0


def test_a_wids_index_with_absolute_urls(tmp_path: Path, shards: dict[str, bytes]) -> None:
    root = tmp_path / "source" / "ds"
    index = wids_index(shards, lambda k: f"{root}/{k}")
    with serve("local", tmp_path, {**shards, WIDS_INDEX_NAME: index}) as remote:
        ds = open_tar(remote, tmp_path / "c")
        assert all(s.index is None for s in ds._promised.values())  # all from the wids index
        assert [ds[i] for i in range(len(ds))] == read_with_tarfile(shards)


def test_a_wids_count_that_is_wrong_is_refused_naming_the_shard(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    index = wids_index(shards, str, {"shard-003.tar": 12})
    with serve("local", tmp_path, {**shards, WIDS_INDEX_NAME: index}) as remote:
        ds = open_tar(remote, tmp_path / "c")
        assert len(ds) == 42
        assert ds[29] == read_with_tarfile(shards)[29]
        with pytest.raises(
            DatasetError,
            match=r"shard-003\.tar holds 10 samples but .*shardindex\.json says 12; .*"
            r"run `fastload index",
        ):
            ds[30]


def test_an_unusable_wids_index_is_ignored_with_a_warning(
    tmp_path: Path, shards: dict[str, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    with serve("local", tmp_path, {**shards, WIDS_INDEX_NAME: b'{"__kind__": "other"}'}) as remote:
        ds = open_tar(remote, tmp_path / "c")
        assert ds.shard_sizes == [10, 10, 10, 10]
        assert "not a wids shard index" in caplog.text


# --- where the index goes ------------------------------------------------------------------


def test_a_bucket_gets_the_index_in_the_cache_unless_asked(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    """fastload writes to a remote only when asked: by default a bucket's index goes into
    the cache, without a PUT reaching the bucket, and opens with that cache read only it."""
    with serve("s3", tmp_path, shards) as remote:
        assert isinstance(remote.server, S3FolderServer)
        report = index_of(remote, tmp_path / "c")
        assert report.in_cache
        assert "only when asked" in report.why_in_cache
        writes = [m for (m, _) in remote.server.stats().requests if m in ("PUT", "POST", "DELETE")]
        assert writes == []
        assert not (tmp_path / "buckets" / "data" / "ds" / INDEX_NAME).exists()
        remote.server.reset_stats()
        ds = open_tar(remote, tmp_path / "c")
        assert ds.shard_sizes == [10] * 4
        assert fetched_keys(remote) == set()


def test_a_bucket_that_refuses_writes_fails_an_index_asked_beside_it(
    tmp_path: Path, shards: dict[str, bytes]
) -> None:
    with serve("s3", tmp_path, shards) as remote:
        assert remote.server is not None
        remote.server.fail_next(10, 403, code="AccessDenied", methods=["PUT", "POST"])
        with pytest.raises(DatasetError, match="refused"):
            index_of(remote, tmp_path / "c", to="dataset")


def test_a_url_naming_one_shard_is_indexed_into_the_cache(tmp_path: Path) -> None:
    with serve("local", tmp_path, {"one.tar": tar_bytes([("x.txt", b"hi")])}) as remote:
        url = remote.url + "/one.tar"
        report = write_index(url, cache_dir=str(tmp_path / "c"), progress=False)
        assert report.in_cache
        assert "one shard" in report.why_in_cache
        ds = open_dataset(url, format="tar", cache_dir=str(tmp_path / "c"))
        assert isinstance(ds, TarDataset)
        assert ds._promised[0].index is not None
        assert ds[0]["txt"] == b"hi"


# --- a node's share ------------------------------------------------------------------------


@pytest.mark.parametrize("index", ["fastload", "wids"])
def test_warming_a_node_share_fetches_exactly_its_shards(tmp_path: Path, index: str) -> None:
    shards = webdataset_shards(count=16, per_shard=3)
    objects = dict(shards)
    if index == "wids":
        objects[WIDS_INDEX_NAME] = wids_index(shards, str, dict.fromkeys(shards, 3))
    with serve("s3", tmp_path, objects) as remote:
        assert remote.server is not None
        if index == "fastload":
            index_of(remote, tmp_path / "indexing", to="dataset")
            objects[INDEX_NAME] = (tmp_path / "buckets" / "data" / "ds" / INDEX_NAME).read_bytes()
        index_key = INDEX_NAME if index == "fastload" else WIDS_INDEX_NAME
        share = NodeShare(ranks=(1, 2), world_size=8, epochs=(0,), format="auto", seed=3)

        # The shards the training job's ranks 1 and 2 read in epoch 0.
        probe = open_tar(remote, tmp_path / "probe")
        expected = set()
        for rank in share.ranks:
            sampler = ShardedSampler(probe, rank=rank, world_size=8, seed=3)
            sampler.set_epoch(0)
            expected |= {probe.shard_keys[probe.shard_of(i)][0] for i in sampler}
        assert 0 < len(expected) < len(shards)

        list_into(remote, tmp_path / "c")
        remote.server.reset_stats()
        report = warm(
            remote.url,
            cache_dir=str(tmp_path / "c"),
            storage_options=remote.storage_options,
            share=share,
            progress=False,
        )
        assert report.fetched == len(expected)
        assert fetched_keys(remote) == {index_key, *expected}
        assert all(remote.gets(k) == 1 for k in expected)
        assert remote.server.stats().bytes_sent == len(objects[index_key]) + sum(
            len(shards[k]) for k in expected
        )


# --- the command -----------------------------------------------------------------------------


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_cli_indexes_a_local_folder(tmp_path: Path, shards: dict[str, bytes]) -> None:
    with serve("local", tmp_path, shards) as remote:
        out = run_cli("index", remote.url, "--cache-dir", str(tmp_path / "c"))
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().startswith("indexed 4 tar shards (40 samples")
        assert f"wrote {remote.url}/{INDEX_NAME}" in out.stdout
        assert out.stderr == ""  # no progress bar off a terminal
        js = run_cli("index", remote.url, "--cache-dir", str(tmp_path / "c"), "--json")
        report = json.loads(js.stdout)
        assert (report["shards"], report["samples"], report["in_cache"]) == (4, 40, False)
        assert (Path(remote.url) / INDEX_NAME).stat().st_size == report["index_bytes"]


def test_cli_indexes_a_bucket(tmp_path: Path, shards: dict[str, bytes]) -> None:

    with serve("s3", tmp_path, shards) as remote:
        assert isinstance(remote.server, S3FolderServer)
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": remote.storage_options["key"],
            "AWS_SECRET_ACCESS_KEY": remote.storage_options["secret"],
            "AWS_ENDPOINT_URL": remote.server.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        args = ("--cache-dir", str(tmp_path / "c"), "--to", "dataset", "--json")
        out = run_cli("index", remote.url, *args, env=env)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["written_to"] == f"s3://data/ds/{INDEX_NAME}"
        assert (tmp_path / "buckets" / "data" / "ds" / INDEX_NAME).exists()
        remote.server.reset_stats()
        ds = open_tar(remote, tmp_path / "c")  # the command relisted this cache's copy
        assert ds.shard_sizes == [10] * 4
        assert fetched_keys(remote) == {INDEX_NAME}


@pytest.mark.parametrize(
    ("objects", "args", "code", "says"),
    [
        ({"a.txt": b"x"}, (), 1, "holds no .tar shards"),
        ({"a.tar": tar_bytes([("../x.jpg", b"x")])}, (), 1, "member '../x.jpg' is a path"),
        ({"a.tar": b"x" * 3000}, (), 1, "is not a readable (uncompressed) tar file"),
        ({"a.tar": tar_bytes([])}, ("--jobs", "0"), 2, "must be 1 or more"),
        ({"a.tar": tar_bytes([])}, ("--to", "bucket"), 2, "invalid choice"),
    ],
)
def test_cli_bad_input_gets_one_line(
    tmp_path: Path, objects: dict[str, bytes], args: tuple[str, ...], code: int, says: str
) -> None:
    with serve("local", tmp_path, objects) as remote:
        out = run_cli("index", remote.url, "--cache-dir", str(tmp_path / "c"), *args)
    assert out.returncode == code
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert says in lines[0]
    assert "Traceback" not in out.stderr


def test_cli_refuses_writing_next_to_shards_over_http(tmp_path: Path) -> None:
    with serve("http", tmp_path, {"a.tar": tar_bytes([("x.txt", b"hi")])}) as remote:
        out = run_cli("index", remote.url, "--cache-dir", str(tmp_path / "c"), "--to", "dataset")
        assert out.returncode == 1
        assert "HTTP servers take no uploads" in out.stderr
        assert remote.gets("a.tar") == 0  # refused before reading anything
        ok = run_cli("index", remote.url, "--cache-dir", str(tmp_path / "c"))
        assert ok.returncode == 0, ok.stderr
        assert f"into {tmp_path / 'c' / 'indexes'}" in ok.stdout
        assert "HTTP servers take no uploads" in ok.stdout


def test_a_first_batch_reads_large_indexed_shards_by_range(
    tmp_path: Path, shards: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch needing a few samples of a large shard not cached yet reads their ranges,
    not the shard: the first batch does not wait for whole 150 MB shards."""
    import fastload as fl
    from fastload.staging import planner

    monkeypatch.setattr(planner, "RANGED_MIN_BYTES", 1)  # these shards count as large
    with serve("s3", tmp_path, shards) as remote:
        index_of(remote, tmp_path / "c", to="dataset")
        ds = open_tar(remote, tmp_path / "fresh")
        assert remote.server is not None
        remote.server.reset_stats()
        loader = fl.DataLoader(ds, batch_size=3, num_workers=1, collate_fn=list, lookahead_bytes=0)
        first = next(iter(loader))
        sent = remote.server.stats().bytes_sent
        counts = loader.stats()["counts"]
        loader.close()
    expected = read_with_tarfile(shards)
    assert first == [expected[i] for i in range(3)]
    assert counts["range_reads"] >= 3  # and the batches read ahead meanwhile
    assert sent < len(shards[sorted(shards)[0]])  # a few samples' ranges, not the shard


# --- never a write to the Hub ------------------------------------------------------------------


@pytest.fixture
def hub_shards(
    tmp_path: Path, shards: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubServerProcess]:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    root = tmp_path / "repo"
    (root / "train").mkdir(parents=True)
    for name, data in shards.items():
        (root / "train" / name).write_bytes(data)
    # a write token: a commit would be accepted by the real Hub
    with HubServerProcess(root, token="hf_" + "w" * 34) as server:
        yield server


def test_indexing_a_hub_dataset_never_commits_to_it(
    tmp_path: Path, hub_shards: HubServerProcess
) -> None:
    env = {**os.environ, **hub_shards.env}
    url = hub_shards.url_for("train")
    out = run_cli("index", url, "--cache-dir", str(tmp_path / "c"), "--json", env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["in_cache"]
    assert "Hugging Face" in report["why_in_cache"]
    assert (report["shards"], report["samples"]) == (4, 40)
    assert hub_shards.stats().get("upload", 0) == 0
    assert not (tmp_path / "repo" / "train" / INDEX_NAME).exists()


def test_indexing_beside_a_hub_dataset_is_refused_in_one_line(
    tmp_path: Path, hub_shards: HubServerProcess
) -> None:
    env = {**os.environ, **hub_shards.env}
    url = hub_shards.url_for("train")
    out = run_cli("index", url, "--cache-dir", str(tmp_path / "c"), "--to", "dataset", env=env)
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "never commits to a Hugging Face repository" in lines[0]
    assert "Traceback" not in out.stderr
    stats = hub_shards.stats()
    assert stats.get("upload", 0) == 0
    assert stats.get("resolve", 0) == 0  # refused before a shard was read


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_fastload_index_reads_each_shard_at_its_listed_version(
    kind: str, tmp_path: Path, shards: dict[str, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Was: the writer streamed shards through ``fs.open``, unpinned: a shard rewritten
    while it was read was indexed from a mix of versions, under the listed one."""
    import threading

    from fastload.datasets.tar import writer
    from fastload.errors import RemoteChangedError
    from fastload.testing import RemoteBehavior

    name = sorted(shards)[0]
    data = shards[name]
    # The shard is rewritten (same size, another member layout) once the first read of it
    # has come, a second before its answer (the server's time to first byte); it is read
    # in two requests. (The first read: a GET over HTTP, whose listing sends HEADs; any
    # request over S3, where s3fs's HEAD would otherwise pin the new version.)
    monkeypatch.setattr(writer, "SCAN_READ_BYTES", (len(data) // 2 + 511) // 512 * 512)
    other = bytearray(data)
    other[512:1024] = bytes(512)  # the second member's header is gone
    with serve(kind, tmp_path, {name: data}) as remote:
        assert remote.server is not None
        remote.server.set_behavior(RemoteBehavior(latency_s=1.0))
        stop = threading.Event()
        path = f"{'/data/ds' if kind == 's3' else '/ds'}/{name}"
        method = None if kind == "s3" else "GET"

        def rewrite_after_the_first_read() -> None:
            while not stop.wait(0.01):
                if remote.server.stats().count(path=path, method=method) >= 1:
                    if isinstance(remote.server, S3FolderServer):
                        remote.server.put("data", f"ds/{name}", bytes(other))
                    else:
                        remote.replace(name, bytes(other))
                    return

        thread = threading.Thread(target=rewrite_after_the_first_read)
        thread.start()
        try:
            with pytest.raises(RemoteChangedError, match=name):
                index_of(remote, tmp_path / "c", to="cache")
        finally:
            stop.set()
            thread.join()
        assert not list((tmp_path / "c" / "indexes").glob("*.flidx"))
