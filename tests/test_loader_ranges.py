"""Staging formats read by range: a rank's Parquet row groups are staged as byte-range
entries (never whole files), by fl.DataLoader and by a warm of the node's share, and
sharded Zarr shards are fetched once each."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_dataset_tar import serve
from test_dataset_zarr_sharded import expected, gets, write_group
from test_dataset_zarr_sharded import serve as serve_zarr

import fastload as fl
from fastload.datasets import open_dataset
from fastload.datasets.parquet import ParquetDataset
from fastload.sampler import ShardedSampler
from fastload.warm import NodeShare, warm

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FILES = 2
GROUPS = 8  # row groups per file
ROWS = 8  # rows per row group
PAYLOAD = 2048  # random (incompressible) bytes per row


def parquet_file(first: int) -> bytes:
    """GROUPS row groups of ROWS rows: an id, a payload and a label per row."""
    n = GROUPS * ROWS
    rng = np.random.default_rng(first)
    t = pa.table(
        {
            "id": pa.array(range(first, first + n), pa.int64()),
            "payload": pa.array([rng.bytes(PAYLOAD) for _ in range(n)], pa.binary()),
            "label": pa.array([i % 5 for i in range(first, first + n)], pa.int64()),
        }
    )
    out = io.BytesIO()
    # no statistics of the payload (min/max values of 2 KB each would fill the footer)
    pq.write_table(
        t, out, row_group_size=ROWS, compression="snappy", write_statistics=["id", "label"]
    )
    return out.getvalue()


def rows_by_id(files: dict[str, bytes]) -> dict[int, dict[str, Any]]:
    rows: dict[int, dict[str, Any]] = {}
    for data in files.values():
        for row in pq.read_table(pa.BufferReader(data)).to_pylist():
            rows[row["id"]] = row
    return rows


def parquet_files() -> dict[str, bytes]:
    return {f"data/train-{i:05d}.parquet": parquet_file(i * GROUPS * ROWS) for i in range(FILES)}


def test_a_rank_stages_its_row_groups_as_ranges(tmp_path: Path) -> None:
    files = parquet_files()
    assert all(pq.ParquetFile(pa.BufferReader(d)).num_row_groups == GROUPS for d in files.values())
    total = sum(len(d) for d in files.values())
    want = rows_by_id(files)
    with serve("s3", tmp_path, files) as remote:
        assert remote.server is not None
        remote.server.reset_stats()
        ds = open_dataset(
            remote.url, cache_dir=str(tmp_path / "cache"), storage_options=remote.storage_options
        )
        assert isinstance(ds, ParquetDataset)
        assert len(ds.shard_sizes) == FILES * GROUPS
        spans = ds.stage_ranges(3)
        assert spans is not None
        assert {key for key, _, _ in spans} == {ds.files[0].key}
        opened = remote.server.stats().bytes_sent  # the listing and the footers
        loader = fl.DataLoader(
            ds,
            batch_size=4,
            num_workers=2,
            rank=0,
            world_size=4,
            collate_fn=lambda rows: rows,
        )
        seen: list[int] = []
        for batch in loader:
            for row in batch:
                assert row == want[row["id"]]
                seen.append(row["id"])
        assert len(seen) == len(set(seen)) == FILES * GROUPS * ROWS // 4
        groups = {i // ROWS for i in seen}  # row group g of the dataset is shard g
        assert len(groups) == FILES * GROUPS // 4  # the rank's row groups (locality)
        ranges = [r for g in groups for r in ds.stage_ranges(g) or []]
        sent = remote.server.stats().bytes_sent  # footers (opening) and the rank's groups
        assert sent < 0.5 * total, (sent, total)
        counts = loader.stats()["counts"]
        # each range fetched once, counted once (by staging, or by the batch that needed it
        # before its staging round)
        assert counts["bytes_fetched"] == sum(n for _, _, n in ranges) == sent - opened
        assert counts["bytes_fetched"] >= len(groups) * ROWS * PAYLOAD
        assert counts["cache_misses"] == len(ranges)
        assert counts["cache_hits"] == 0
        entries = [e for e in ds.store.cache.entries() if e.url.endswith(".parquet")]
        assert entries
        assert all(e.start is not None for e in entries)  # ranges, no whole file
        assert all(ds.store.local_path(f.key) is None for f in ds.files)
        # the same epoch again: every range is cached, nothing is fetched
        gets = remote.total_gets()
        loader.set_epoch(0)
        again = [row["id"] for batch in loader for row in batch]
        assert sorted(again) == sorted(seen)
        assert remote.total_gets() == gets
        again_counts = loader.stats()["counts"]
        assert again_counts["bytes_fetched"] == counts["bytes_fetched"]
        assert again_counts["cache_hits"] == len(ranges)  # this pass's ranges, all cached


def test_warming_a_nodes_share_stages_its_row_groups_and_the_epoch_reads_no_more(
    tmp_path: Path,
) -> None:
    """fastload warm --rank: rank 1 of 4's row groups as ranges (footers read by range to
    plan them); then its epoch fetches nothing. All ranks' share: the files whole."""
    files = parquet_files()
    want = rows_by_id(files)
    cache = str(tmp_path / "cache")
    with serve("s3", tmp_path, files) as remote:
        assert remote.server is not None
        remote.server.reset_stats()
        options = remote.storage_options
        ds = open_dataset(remote.url, cache_dir=cache, storage_options=options)
        opened = remote.server.stats().bytes_sent  # the listing and the footers
        groups = {ds.shard_of(i) for i in ShardedSampler(ds, rank=1, world_size=4, seed=5)}
        assert len(groups) < FILES * GROUPS
        ranges = {r for g in groups for r in ds.stage_ranges(g) or []}
        share = NodeShare(ranks=(1,), world_size=4, epochs=(0,), format="parquet", seed=5)
        dry = warm(remote.url, cache_dir=cache, storage_options=options, share=share, dry_run=True)
        assert (dry.objects, dry.ranges, dry.already_cached) == (0, len(ranges), 0)
        report = warm(remote.url, cache_dir=cache, storage_options=options, share=share)
        assert report.ok
        assert (report.objects, report.ranges, report.fetched) == (0, len(ranges), len(ranges))
        assert report.fetched_bytes == report.bytes == sum(n for _, _, n in ranges)
        assert report.bytes >= len(groups) * ROWS * PAYLOAD
        assert remote.server.stats().bytes_sent - opened == report.bytes  # the share only
        again = warm(remote.url, cache_dir=cache, storage_options=options, share=share)
        assert (again.fetched, again.already_cached) == (0, len(ranges))
        assert all(ds.store.local_path(f.key) is None for f in ds.files)  # no whole file
        loader = fl.DataLoader(
            ds,
            batch_size=4,
            shuffle=True,
            rank=1,
            world_size=4,
            seed=5,
            collate_fn=lambda rows: rows,
        )
        gets = remote.total_gets()
        rows = [row for batch in loader for row in batch]
        assert len(rows) == FILES * GROUPS * ROWS // 4
        assert all(row == want[row["id"]] for row in rows)
        assert remote.total_gets() == gets  # the warm staged exactly what the rank reads
        counts = loader.stats()["counts"]
        assert "bytes_fetched" not in counts
        assert counts["cache_hits"] > 0

        node = NodeShare(ranks=(0, 1, 2, 3), world_size=4, epochs=(0,), format="parquet")
        whole = warm(remote.url, cache_dir=cache, storage_options=options, share=node)
        assert (whole.objects, whole.ranges, whole.fetched) == (FILES, 0, FILES)
        assert all(ds.store.local_path(f.key) is not None for f in ds.files)


def test_ds_warm_stages_the_given_row_groups_by_range_and_raises_naming_a_lost_file(
    tmp_path: Path,
) -> None:
    files = parquet_files()
    with serve("http", tmp_path, files) as remote:
        ds = open_dataset(remote.url, cache_dir=str(tmp_path / "c"))
        assert isinstance(ds, ParquetDataset)
        shards = [1, GROUPS + 2]  # a row group of each file
        ds.warm(shards)
        assert all(ds.store.local_path(f.key) is None for f in ds.files)  # ranges only
        gets = remote.total_gets()
        rows = [ds[i] for s in shards for i in range(s * ROWS, (s + 1) * ROWS)]
        assert [row["id"] for row in rows] == [
            i for s in shards for i in range(s * ROWS, (s + 1) * ROWS)
        ]
        assert remote.total_gets() == gets  # staged, then read locally
        ds.warm([1])  # cached: nothing fetched
        assert remote.total_gets() == gets
        (remote.source_dir / "ds" / ds.files[0].key).unlink()
        with pytest.raises(FileNotFoundError, match=re.escape(ds.files[0].key)):
            ds.warm([3])


def test_the_warm_command_reports_byte_ranges(tmp_path: Path) -> None:
    with serve("http", tmp_path, parquet_files()) as remote:
        exe = str(Path(sys.executable).parent / "fastload")
        args = [exe, "warm", remote.url, "--cache-dir", str(tmp_path / "c")]
        args += ["--rank", "0", "--world-size", "4", "--epochs", "0"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        # rank 0 reads half of one file or more (staged whole), and less of the other
        assert re.match(r"1 object and \d+ byte ranges: fetched \d+ ", out.stdout), out.stdout
        dry = subprocess.run(
            [*args, "--dry-run", "--json"], capture_output=True, text=True, timeout=120
        )
        assert dry.returncode == 0, dry.stderr
        report = json.loads(dry.stdout)
        assert report["ranges"] > 0
        assert report["already_cached"] == report["ranges"] + 1


def test_sharded_zarr_first_epoch_gets_each_shard_once(tmp_path: Path) -> None:
    """fl.DataLoader with workers: one GET per shard object in the first epoch (the first
    batch waits for its shards fetched whole, not reading inner chunks by range first)."""
    write_group(tmp_path / "src" / "ds")
    want = expected(tmp_path / "src" / "ds")
    for attempt in range(3):  # the race it guards against shows in some runs only
        with serve_zarr("s3", tmp_path / "src") as (url, options, server):
            assert server is not None
            ds = open_dataset(url, cache_dir=str(tmp_path / f"c{attempt}"), storage_options=options)
            keys = {k for keys in ds.shard_keys for k in keys}
            loader = fl.DataLoader(ds, batch_size=4, num_workers=2, seed=1, rank=0, world_size=1)
            server.reset_stats()
            seen: list[int] = []
            for batch in loader:
                seen += np.asarray(batch["labels"]).tolist()
            assert sorted(seen) == sorted(want["labels"].tolist())
            for key in sorted(keys):
                assert gets(server, key) == 1, (attempt, key)
            assert server.stats().count(method="GET") == len(keys)
