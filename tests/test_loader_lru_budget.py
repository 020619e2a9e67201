"""An ``lru`` cache half the dataset's size under a shuffled loader with default settings:
staging ahead never runs further than the budget keeps (nothing it stages is evicted before
its read), what a batch just found is not what eviction picks, and epochs after the first
read part of the data from the cache, as ``stats()`` counts it (a loopback HTTP server
counts the GETs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import fastload as fl
from fastload.cache import Cache
from fastload.datasets.base import ShardedDataset
from fastload.loader.lookahead import LOOKAHEAD_BUDGET_SHARE, lookahead_within_budget
from fastload.loader.staging_ahead import repeat_filter_size
from fastload.testing import RangeHTTPServer

OBJECTS = 120


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[tuple[RangeHTTPServer, dict[str, bytes]]]:
    rng = np.random.default_rng(3)
    files = {}
    for i in range(OBJECTS):
        key = f"class_{i % 4}/{i:03d}.bin"
        files[key] = rng.bytes(int(rng.integers(2_000, 4_000)))
        path = tmp_path / "source" / "ds" / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(files[key])
    with RangeHTTPServer(tmp_path / "source") as server:
        yield server, files


def open_lru(server: RangeHTTPServer, files: dict[str, bytes], cache: Path) -> ShardedDataset:
    return fl.open_dataset(
        server.url_for("ds"),
        format="files",
        cache_dir=str(cache),
        max_bytes=sum(map(len, files.values())) // 2,
        budget_counts="entries",
        policy="lru",
    )


def gets_by_key(server: RangeHTTPServer) -> dict[str, int]:
    return {
        path.removeprefix("/ds/"): n
        for (method, path), n in server.stats().requests.items()
        if method == "GET" and path.startswith("/ds/")
    }


def test_the_look_ahead_is_cut_to_a_share_of_an_evicting_budget_only() -> None:
    asked = 1 << 30
    assert lookahead_within_budget(asked, 1000, "lru") == int(1000 * LOOKAHEAD_BUDGET_SHARE)
    assert lookahead_within_budget(asked, 1000, "plan") == int(1000 * LOOKAHEAD_BUDGET_SHARE)
    assert lookahead_within_budget(asked, 1000, "pin") == asked  # pin evicts nothing
    assert lookahead_within_budget(asked, None, "lru") == asked
    assert lookahead_within_budget(100, 1000, "lru") == 100


@pytest.mark.parametrize("lookup", ["lookup_many", "placed"])
def test_lru_counts_a_batch_lookup_as_a_use(tmp_path: Path, lookup: str) -> None:
    """The loader finds a batch's objects with lookup_many (or, read as columns, with
    placed), then reads them: eviction in the meantime must not pick them (nor order by
    fetch time alone)."""
    with Cache(tmp_path, max_bytes=300, budget_counts="entries", policy="lru") as cache:
        for name in "abc":
            lock = cache.fetch_lock(f"s3://b/{name}")
            part = cache.new_part(f"s3://b/{name}")
            part.write(b"x" * 100)
            cache.publish(part, version="v1")
            lock.release()
        if lookup == "placed":
            assert cache.placed(["s3://b/a"], ["v1"], [100]).found.all()
        else:
            assert cache.lookup_many(["s3://b/a"], ["v1"], [100])[0] is not None
        lock = cache.fetch_lock("s3://b/d")
        part = cache.new_part("s3://b/d")
        part.write(b"x" * 100)
        cache.publish(part, version="v1")
        lock.release()
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/c", "s3://b/d"}


def publish(cache: Cache, name: str) -> None:
    lock = cache.fetch_lock(f"s3://b/{name}")
    part = cache.new_part(f"s3://b/{name}")
    part.write(b"x" * 100)
    cache.publish(part, version="v1")
    lock.release()


def test_a_use_buffered_before_another_process_fetched_again_does_not_age_the_new_copy(
    tmp_path: Path,
) -> None:
    """The race behind objects fetched twice in an epoch: a batch found ``a`` (a use
    buffered in the loader's process); the staging process evicted it, then staged it again
    for a near batch. The loader's next eviction wrote its buffered use, setting the fresh
    copy's recency back to the old read: lru picked it before that batch read it."""
    with Cache(tmp_path, max_bytes=300, budget_counts="entries", policy="lru") as cache:
        for name in "abc":
            publish(cache, name)
        assert cache.lookup_many(["s3://b/a"], ["v1"], [100])[0] is not None  # buffered
        other_process = f"""
            from fastload.cache import Cache
            with Cache(
                {str(tmp_path)!r}, max_bytes=300, budget_counts="entries", policy="lru"
            ) as cache:
                cache.touch(["s3://b/b", "s3://b/c"])  # used after the buffered use of a
                assert cache.drop("s3://b/a")  # evicted there, then staged again
                lock = cache.fetch_lock("s3://b/a")
                part = cache.new_part("s3://b/a")
                part.write(b"x" * 100)
                cache.publish(part, version="v1")
                lock.release()
        """
        subprocess.run([sys.executable, "-c", textwrap.dedent(other_process)], check=True)
        publish(cache, "d")  # makes room: writes the buffered use of a first
        kept = {e.url for e in cache.entries()}
    assert "s3://b/a" in kept  # the newest copy is not the least recently used
    assert kept == {"s3://b/a", "s3://b/c", "s3://b/d"}


def test_epochs_after_the_first_read_part_of_the_data_from_the_cache(
    remote: tuple[RangeHTTPServer, dict[str, bytes]], tmp_path: Path
) -> None:
    server, files = remote
    dataset = open_lru(server, files, tmp_path / "cache")
    with fl.DataLoader(
        dataset, batch_size=4, shuffle=True, num_workers=2, collate_fn=list
    ) as loader:
        before_hits, before_gets = 0, gets_by_key(server)
        for epoch in range(3):
            loader.set_epoch(epoch)
            samples = sorted(bytes(s) for batch in loader for s in batch)
            assert samples == sorted(files.values())  # never a wrong sample
            gets = gets_by_key(server)
            fetched = {k: gets.get(k, 0) - before_gets.get(k, 0) for k in files}
            # Nothing staged ahead was evicted before its read: one GET at most per epoch.
            assert max(fetched.values()) == 1, epoch
            hits = loader.stats()["counts"]["cache_hits"]
            if epoch > 0:
                assert sum(fetched.values()) < OBJECTS  # part of it came from the cache
                assert hits > before_hits
            before_hits, before_gets = hits, gets
    dataset.close()


def test_a_pass_over_several_orders_counts_its_hits(
    remote: tuple[RangeHTTPServer, dict[str, bytes]], tmp_path: Path
) -> None:
    """The doctor's budget phase: the first epoch staged, then one pass over three new
    orders (a 1 GB look-ahead over a budget of 180 KB staged all three ahead, evicting
    what the batches were about to read: more GETs than reads, and 0 hits counted)."""
    server, files = remote
    dataset = open_lru(server, files, tmp_path / "cache")
    dataset.warm()
    rng = np.random.default_rng(1)
    order = [int(i) for i in np.concatenate([rng.permutation(OBJECTS) for _ in range(3)])]
    before = gets_by_key(server)
    with fl.DataLoader(
        dataset, batch_size=4, sampler=order, num_workers=2, collate_fn=list
    ) as loader:
        assert sum(len(batch) for batch in loader) == len(order)
        counts = loader.stats()["counts"]
    gets = gets_by_key(server)
    per_object = [gets.get(k, 0) - before.get(k, 0) for k in files]
    # Nothing staged ahead was evicted before its read: at most one GET per read.
    assert max(per_object) <= 3
    assert sum(per_object) < len(order)
    assert counts["cache_hits"] > 0
    # Every read was counted once, as a hit or a miss (a later order's read too).
    assert counts["cache_hits"] + counts["cache_misses"] >= len(order) * 0.8
    dataset.close()


def test_staging_trusts_only_what_the_look_ahead_share_of_an_evicting_budget_holds(
    remote: tuple[RangeHTTPServer, dict[str, bytes]], tmp_path: Path
) -> None:
    """Objects staged longer ago may have been evicted: skipping them as staged left them
    to be fetched by their batch, one batch at a time, in every epoch after the first."""
    server, files = remote
    lru = open_lru(server, files, tmp_path / "lru")
    budget = sum(map(len, files.values())) // 2
    mean = sum(map(len, files.values())) // OBJECTS
    assert repeat_filter_size(lru) == int(budget * LOOKAHEAD_BUDGET_SHARE) // mean
    unbounded = fl.open_dataset(
        server.url_for("ds"), format="files", cache_dir=str(tmp_path / "all")
    )
    assert repeat_filter_size(unbounded) >= OBJECTS
    lru.close()
    unbounded.close()
