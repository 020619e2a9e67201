"""A bit flipped in a cached entry is never returned: every read checks the checksum the
cache recorded at publish, drops an entry that fails (naming it in the log) and fetches it
again. Whole entries read by the loader's native batch path (files of a folder, in segments
or in files of their own), entries read in part (tar members of a cached shard) and reads
through the store (``dataset[i]``), from a loopback S3 server in its own process."""

from __future__ import annotations

import io
import logging
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fastload as fl
from fastload.cache import Cache
from fastload.testing import S3FolderServer

FILES = {
    f"ds/class{i % 2}/{i:02d}-ä.bin": (f"{i:02d}:".encode() * 50)[: 100 + 37 * i] for i in range(12)
}
BIG = "ds/class0/big.bin"  # a file of its own (not packed in a segment)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[S3FolderServer, dict[str, bytes]]]:
    files = {**FILES, BIG: bytes(range(256)) * (5 << 12)}
    for key, data in files.items():
        path = tmp_path / "buckets" / "data" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with S3FolderServer(tmp_path / "buckets") as server:
        yield server, files


def flip_a_bit(cache_dir: Path, url: str, at: int = 0) -> None:
    cache = Cache(cache_dir, create=False)
    try:
        entry = cache.entry(url)
        assert entry is not None, f"{url} is not cached"
        where = cache.location_of(entry)
    finally:
        cache.close()
    with open(where.path, "r+b") as f:
        f.seek(where.offset + at)
        byte = f.read(1)
        f.seek(where.offset + at)
        f.write(bytes([byte[0] ^ 0x10]))


def gets(server: S3FolderServer, key: str) -> int:
    return server.stats().count(path=f"/data/{key}", method="GET")


def open_files(server: S3FolderServer, cache: Path) -> Any:
    return fl.open_dataset(
        "s3://data/ds", format="files", cache_dir=str(cache), storage_options=server.storage_options
    )


@pytest.mark.parametrize("damaged", [f"ds/class1/{3:02d}-ä.bin", BIG], ids=["packed", "own"])
def test_a_damaged_entry_read_whole_by_the_loader_is_refetched(
    served: tuple[S3FolderServer, dict[str, bytes]],
    damaged: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, files = served
    cache = tmp_path / "c"
    ds = open_files(server, cache)
    keys = [ds.keys[i] for i in range(len(ds))]
    first = fl.DataLoader(ds, batch_size=len(ds), shuffle=False, collate_fn=list)
    assert next(iter(first)) == [files[f"ds/{k}"] for k in keys]  # now cached
    flip_a_bit(cache, f"s3://data/{damaged}", at=5)
    before = gets(server, damaged)

    ds = open_files(server, cache)
    loader = fl.DataLoader(ds, batch_size=len(ds), shuffle=False, collate_fn=list)
    with caplog.at_level(logging.WARNING, logger="fastload"):
        (batch,) = list(loader)
    assert batch == [files[f"ds/{k}"] for k in keys]
    assert gets(server, damaged) == before + 1  # fetched again, once
    named = [r.getMessage() for r in caplog.records if "checksum" in r.getMessage()]
    assert len(named) == 1, caplog.text
    assert damaged.split("/")[-1] in named[0]
    assert "fastload cache verify" in named[0]
    assert loader.stats()["counts"]["corrupt_entries"] == 1
    # and again, from the refetched copy: no more requests
    again = fl.DataLoader(open_files(server, cache), batch_size=4, shuffle=False, collate_fn=list)
    assert [s for batch in again for s in batch] == batch
    assert gets(server, damaged) == before + 1


def test_a_damaged_entry_read_through_the_store_is_refetched(
    served: tuple[S3FolderServer, dict[str, bytes]], tmp_path: Path
) -> None:
    server, files = served
    cache = tmp_path / "c"
    ds = open_files(server, cache)
    index = next(i for i in range(len(ds)) if ds.keys[i] == "class0/big.bin")
    assert ds[index] == files[BIG]
    flip_a_bit(cache, f"s3://data/{BIG}", at=1000)
    assert open_files(server, cache)[index] == files[BIG]
    assert gets(server, BIG) == 2


def _shard(s: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for j in range(6):
            for ext, data in (("bin", f"shard {s} sample {j} ".encode() * 40), ("cls", b"%d" % j)):
                info = tarfile.TarInfo(f"s{s}-{j}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def test_a_damaged_tar_shard_read_in_part_is_refetched(tmp_path: Path) -> None:
    shards = {f"tars/shard-{s}.tar": _shard(s) for s in range(3)}
    for key, data in shards.items():
        path = tmp_path / "buckets" / "data" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    with S3FolderServer(tmp_path / "buckets") as server:
        cache = tmp_path / "c"

        def samples() -> list[Any]:
            ds = fl.open_dataset(
                "s3://data/tars",
                format="tar",
                cache_dir=str(cache),
                storage_options=server.storage_options,
            )
            loader = fl.DataLoader(ds, batch_size=6, shuffle=False, collate_fn=list)
            return [s for batch in loader for s in batch]

        right = samples()
        assert len(right) == 18
        assert right[7]["bin"] == b"shard 1 sample 1 " * 40
        flip_a_bit(cache, "s3://data/tars/shard-1.tar", at=512 * 3 + 20)  # in s1-1.bin
        before = gets(server, "tars/shard-1.tar")
        assert samples() == right
        assert gets(server, "tars/shard-1.tar") == before + 1


def test_verify_reads_false_trusts_the_cached_bytes(
    served: tuple[S3FolderServer, dict[str, bytes]], tmp_path: Path
) -> None:
    """The opt-out reads what is on disk, as before the checks (``fastload cache verify``
    still finds it)."""
    server, files = served
    cache = tmp_path / "c"
    ds = open_files(server, cache)
    assert next(iter(fl.DataLoader(ds, batch_size=len(ds), collate_fn=list)))
    flip_a_bit(cache, f"s3://data/{BIG}", at=5)
    trusting = fl.open_dataset(
        "s3://data/ds",
        format="files",
        cache_dir=str(cache),
        storage_options=server.storage_options,
        verify_reads=False,
    )
    (batch,) = list(fl.DataLoader(trusting, batch_size=len(ds), shuffle=False, collate_fn=list))
    assert files[BIG] not in batch  # the damaged copy, as it is on disk
    assert gets(server, BIG) == 1
    with Cache(cache, create=False) as c:
        assert [url for url, _ in c.verify(repair=False)] == [f"s3://data/{BIG}"]
