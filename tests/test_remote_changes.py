"""Never a wrong sample: every GET carries the listed version (S3 ``If-Match``/``versionId``,
HTTP ``If-Match``), and the answer's size is checked against the listing. An object
rewritten on the remote after the dataset was listed (same size, or grown) fails its batch
with an error naming it (``on_change="raise"``, the default) or is left out and counted
(``on_change="skip"``); no byte of the new version reaches the cache under the old entry.
Every transport: obstore and fsspec, for S3 (the loopback folder server and moto) and HTTP.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import fastload as fl
from fastload.errors import RemoteChangedError, RemoteError
from fastload.staging import FetchConfig
from fastload.staging import process as staging_process
from fastload.testing import HubServerProcess, RangeHTTPServer, S3FolderServer, S3Server

N = 10
CHANGED = {3: "same size", 5: "grown"}


def key(i: int) -> str:
    return f"f{i}-é.bin"  # non-ASCII names travel too


def first(i: int) -> bytes:
    return f"v1:{i:02d}".encode().ljust(64, b".")


def second(i: int) -> bytes:
    new = f"v2:{i:02d}".encode().ljust(64, b"!")
    return new if CHANGED[i] == "same size" else new + b"!" * 40


@dataclass
class Served:
    url: str
    storage_options: dict[str, Any]
    rewrite: Any  # (key, bytes) -> None


@contextlib.contextmanager
def serve(kind: str, base: Path) -> Iterator[Served]:
    folder = base / "buckets" / "data" / "ds"
    folder.mkdir(parents=True)
    for i in range(N):
        (folder / key(i)).write_bytes(first(i))

    def rewrite_file(name: str, data: bytes) -> None:
        path = folder / name
        path.write_bytes(data)
        later = time.time_ns() + 10**9  # a new mtime, so a new ETag even at the same size
        os.utime(path, ns=(later, later))

    if kind == "s3-folder":
        with S3FolderServer(base / "buckets") as server:
            yield Served("s3://data/ds", server.storage_options, rewrite_file)
    elif kind == "s3-moto":
        with S3Server() as moto:
            moto.upload_dir(folder, "data", prefix="ds")
            yield Served(
                "s3://data/ds",
                moto.storage_options,
                lambda name, data: moto.put("data", f"ds/{name}", data),
            )
    else:
        with RangeHTTPServer(base / "buckets" / "data") as http:
            yield Served(http.url_for("ds"), {}, rewrite_file)


KINDS = ["s3-folder", "s3-moto", "http"]
TRANSPORTS = ["auto", "fsspec"]  # auto: obstore for S3 and HTTP


def fetch_config(transport: str, ranged: bool) -> FetchConfig:
    ranges = {"range_threshold_bytes": 32, "range_bytes": 16} if ranged else {}
    return FetchConfig(transport=transport, retries=2, backoff_s=0.01, **ranges)  # type: ignore[arg-type]


def open_changed(served: Served, cache: Path, fetch: FetchConfig) -> fl.ShardedDataset:
    ds = fl.open_dataset(
        served.url,
        format="files",
        cache_dir=str(cache),
        storage_options=served.storage_options,
        fetch=fetch,
    )
    assert len(ds) == N  # listed: the versions are those of now
    for i in CHANGED:
        served.rewrite(key(i), second(i))
    return ds


def assert_no_new_bytes_cached(cache: Path) -> None:
    for path in cache.rglob("*"):
        if path.is_file():
            assert b"v2:" not in path.read_bytes(), f"{path} holds bytes of the new version"


@pytest.mark.parametrize("ranged", [False, True], ids=["whole", "ranges"])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", KINDS)
def test_an_object_changed_after_listing_fails_naming_it(
    kind: str, transport: str, ranged: bool, tmp_path: Path
) -> None:
    with serve(kind, tmp_path) as served:
        ds = open_changed(served, tmp_path / "c", fetch_config(transport, ranged))
        loader = fl.DataLoader(ds, batch_size=N, shuffle=False, collate_fn=list)
        with pytest.raises(RemoteChangedError) as caught:
            list(loader)
        error = caught.value
        assert isinstance(error, RemoteError)
        assert isinstance(error, OSError)
        text = str(error)
        assert any(key(i) in text for i in CHANGED), text
        assert "changed on the remote since it was listed" in text
        assert "refresh=True" in text
        # the samples of unchanged objects read as listed
        assert all(ds[i] == first(i) for i in range(N) if i not in CHANGED)
        for i in CHANGED:
            with pytest.raises(RemoteChangedError, match=f"f{i}-"):
                ds[i]
    assert_no_new_bytes_cached(tmp_path / "c")


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", KINDS)
def test_on_change_skip_leaves_changed_objects_out_and_counts_them(
    kind: str, transport: str, tmp_path: Path
) -> None:
    with serve(kind, tmp_path) as served:
        ds = open_changed(served, tmp_path / "c", fetch_config(transport, False))
        loader = fl.DataLoader(ds, batch_size=5, shuffle=False, collate_fn=list, on_change="skip")
        batches = list(loader)
        assert [len(b) for b in batches] == [5, 5]  # full batches, as on_error="skip" keeps
        samples = [s for b in batches for s in b]
        assert all(s.startswith(b"v1:") for s in samples)
        assert {first(i) for i in range(N) if i not in CHANGED} == set(samples)
        stats = loader.stats()
        assert stats["changed_objects"] == len(CHANGED)
        assert stats["skipped_samples"] == len(CHANGED)
        assert any(key(3) in why for why in stats["skipped_examples"])
    assert_no_new_bytes_cached(tmp_path / "c")


def test_refresh_reads_the_new_version(tmp_path: Path) -> None:
    with serve("s3-folder", tmp_path) as served:
        open_changed(served, tmp_path / "c", fetch_config("auto", False))
        again = fl.open_dataset(
            served.url,
            format="files",
            cache_dir=str(tmp_path / "c"),
            storage_options=served.storage_options,
            refresh=True,
        )
        assert [again[i] for i in CHANGED] == [second(i) for i in CHANGED]


def test_on_change_is_checked() -> None:
    with pytest.raises(ValueError, match="on_change"):
        fl.DataLoader([1, 2], on_change="ignore")


def test_a_hub_object_is_read_at_the_listed_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf:// is pinned at the listed commit: a commit pushed after the listing does not mix
    in (and the answer's size is checked against the listing all the same)."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    root = tmp_path / "repo" / "train"
    root.mkdir(parents=True)
    for i in range(N):
        (root / key(i)).write_bytes(first(i))
    with HubServerProcess(tmp_path / "repo", token="hf_" + "r" * 34) as hub:
        options = {"cache_dir": str(tmp_path / "c"), "storage_options": hub.storage_options}
        ds = fl.open_dataset(hub.url_for("train"), format="files", **options)
        for i in CHANGED:
            (root / key(i)).write_bytes(second(i))
        hub.commit()  # main moves on
        assert [ds[i] for i in range(N)] == [first(i) for i in range(N)]
        again = fl.open_dataset(hub.url_for("train"), format="files", refresh=True, **options)
        assert [again[i] for i in CHANGED] == [second(i) for i in CHANGED]


def test_a_change_found_in_the_staging_process_reaches_the_loop_as_itself(
    tmp_path: Path,
) -> None:
    with serve("s3-folder", tmp_path) as served:
        fetch = FetchConfig(staging_process=True, retries=2, backoff_s=0.01)
        ds = open_changed(served, tmp_path / "c", fetch)
        try:
            with pytest.raises(RemoteChangedError, match="changed on the remote") as caught:
                ds.warm()
        finally:
            staging_process.close_all()  # it would live on for the next test's rounds
        assert caught.value.what  # how it showed (a 412 to If-Match) crossed the pipe
    assert_no_new_bytes_cached(tmp_path / "c")
