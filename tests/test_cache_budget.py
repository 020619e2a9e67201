"""The budget is what the cache puts on disk (cache/budget.py), checked against the file
system's own block accounting, with real processes publishing at once; the format version
(index.py) migrates an old cache and refuses a newer one."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fastload.cache import Cache
from fastload.cache.budget import WAL_RESERVE, allocated_under
from fastload.cache.index import FORMAT_VERSION
from fastload.cli import main
from fastload.errors import CacheError

FIXTURE = Path(__file__).parent / "fixtures" / "v93b491a" / "cache"
BUDGET = 64 << 20

_PUBLISHER = textwrap.dedent(
    """
    import os, random, sys
    from fastload.cache import Cache
    from fastload.cache.budget import WAL_RESERVE, allocated_under

    directory, seed, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    os.makedirs(os.path.join(directory, "manifests"), exist_ok=True)
    with open(os.path.join(directory, "manifests", f"listing-{seed}.flm"), "wb") as f:
        f.write(os.urandom(1 << 20))  # a listing: metadata the budget counts too
    with Cache(directory, max_bytes=budget, policy="lru") as cache:
        for i in range(1500):
            url = f"s3://b/{seed}/{i}"
            size = rng.choice([rng.randrange(100, 60_000), rng.randrange(70_000, 400_000)])
            lock = cache.fetch_lock(url)
            try:
                part = cache.new_part(url)
                part.write(os.urandom(size))
                cache.publish(part, version="v1")
            finally:
                lock.release()
    print("done", flush=True)
    """
)


def test_the_budget_bounds_every_block_on_disk_with_processes_publishing_at_once(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PUBLISHER, str(tmp_path), str(seed), str(BUDGET)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for seed in range(3)
    ]
    try:
        for child in children:
            out, _ = child.communicate(timeout=600)
            assert child.returncode == 0
            assert out.strip() == b"done"
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            if child.stdout is not None:
                child.stdout.close()  # else a later test's garbage collection warns of it
    with Cache(tmp_path, max_bytes=BUDGET) as cache:
        counted = cache.used_bytes()
        entries = len(cache.entries())
    allocated = allocated_under(tmp_path)  # st_blocks * 512 of every file and folder
    assert entries > 100
    assert allocated <= counted <= BUDGET
    assert counted - allocated < BUDGET // 4  # an upper bound, but not a loose one
    assert allocated > BUDGET // 2  # the budget was in play: 3 x ~250 MB were published


def test_du_reports_what_the_budget_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Cache(tmp_path, max_bytes=BUDGET) as cache:
        for i in range(50):
            lock = cache.fetch_lock(f"s3://b/{i}")
            part = cache.new_part(f"s3://b/{i}")
            part.write(os.urandom(10_000 * (i + 1)))
            cache.publish(part, version="v1")
            lock.release()
    assert main(["cache", "du", "--json", "--cache-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    with Cache(tmp_path, max_bytes=BUDGET) as cache:
        assert report["disk_bytes"] == cache.disk_bytes() == cache.used_bytes()
    assert report["allocated_bytes"] <= report["disk_bytes"] <= BUDGET


def test_a_budget_that_cannot_hold_the_metadata_says_so(tmp_path: Path) -> None:
    with Cache(tmp_path):
        pass
    fd = os.open(tmp_path / "manifests" / "huge.flm", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, BUDGET + (1 << 20))  # allocated blocks, fast
    finally:
        os.close(fd)
    with pytest.raises(CacheError, match="cannot hold even the cache's own metadata"):
        Cache(tmp_path, max_bytes=BUDGET)


def test_a_budget_below_the_metadata_is_refused_naming_the_minimum(tmp_path: Path) -> None:
    """One counting rule at every size: a budget of a few KB is not quietly turned into a
    count of the entries' bytes; it is refused, saying how much the metadata takes."""
    with pytest.raises(CacheError) as raised:
        Cache(tmp_path, max_bytes=100_000)
    message = str(raised.value)
    assert "\n" not in message
    assert "max_bytes 100,000 cannot hold even the cache's own metadata" in message
    minimum = int(message.split("max_bytes of at least ")[1].split()[0].replace(",", ""))
    with Cache(tmp_path) as cache:  # what it named is what it counts (the WAL's index aside)
        assert abs(cache.metadata.measure() - minimum) < 1 << 16
    assert 100_000 < minimum < 16 << 20  # the WAL's and the index's reserves: ~8 MiB
    assert 'budget_counts="entries"' in message  # what tests and toys say instead
    with Cache(tmp_path, max_bytes=minimum + (1 << 20)) as cache:  # a budget that holds it
        assert cache.used_bytes() == cache.disk_bytes() > minimum


def test_parts_being_fetched_never_make_a_budget_refused(tmp_path: Path) -> None:
    """Parts in tmp/ are counted when measured (eviction makes room for them) but are
    transient: a budget that holds the lasting metadata is not refused over them."""
    with Cache(tmp_path) as probe:
        lasting = probe.metadata.measure()
    with Cache(tmp_path, max_bytes=lasting + (1 << 20)) as cache:
        fetching = cache.new_part("s3://b/big")
        fetching.write(os.urandom(2 << 20))  # more than the room the metadata leaves
        cache.metadata.measure()
        assert cache.metadata.bytes() > cache.config.max_bytes  # counted...
        lock = cache.fetch_lock("s3://b/small")
        part = cache.new_part("s3://b/small")
        part.write(b"x" * 1000)
        cache.publish(part, version="v1")  # ...but no "cannot hold the metadata" error
        lock.release()
        fetching.discard()


def test_an_entries_budget_counts_the_entries_bytes_only(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=1000, budget_counts="entries", segment_bytes=0) as cache:
        for name in "abc":
            lock = cache.fetch_lock(f"s3://b/{name}")
            part = cache.new_part(f"s3://b/{name}")
            part.write(b"x" * 400)
            cache.publish(part, version="v1")
            lock.release()
        assert cache.used_bytes() == 800  # two of 400 B: the first was evicted
        assert cache.disk_bytes() > 1000  # the disk is not what it counts
    with Cache(tmp_path) as cache:  # opened without saying so: the disk
        assert cache.used_bytes() == cache.disk_bytes()


def test_a_cache_of_the_previous_format_is_migrated_in_place(tmp_path: Path) -> None:
    shutil.copytree(FIXTURE, tmp_path / "cache")
    index = tmp_path / "cache" / "index.sqlite"
    with sqlite3.connect(index) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 2
        rows = sorted(db.execute("SELECT id, size, segment, position FROM objects"))
        latest = dict(
            db.execute("SELECT segment, MAX(last_use) FROM objects GROUP BY segment").fetchall()
        )
    with Cache(tmp_path / "cache", budget_counts="entries") as cache:
        assert cache.verify(repair=False) == []
        assert cache.used_bytes() == sum(
            p.stat().st_size for p in (tmp_path / "cache" / "segments").iterdir()
        )
    with sqlite3.connect(index) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
        assert sorted(db.execute("SELECT id, size, segment, position FROM objects")) == rows
        for segment, last_use in db.execute("SELECT id, last_use FROM segments"):
            assert last_use == latest.get(segment, 0)
        (files,) = db.execute("SELECT value FROM totals WHERE name = 'files'").fetchone()
        (segments,) = db.execute("SELECT COUNT(*) FROM segments").fetchone()
        (own,) = db.execute("SELECT COUNT(*) FROM objects WHERE segment IS NULL").fetchone()
        assert files == segments + own


def test_a_cache_of_a_newer_format_is_refused_in_one_line(tmp_path: Path) -> None:
    with Cache(tmp_path):
        pass
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    with pytest.raises(CacheError) as raised:
        Cache(tmp_path)
    message = str(raised.value)
    assert "newer than this fastload reads" in message
    assert "upgrade fastload" in message
    assert "\n" not in message


_SMALL_PUBLISHER = textwrap.dedent(
    """
    import os, sys
    from fastload.cache import Cache
    from fastload.cache.budget import WAL_RESERVE, allocated_under

    directory, worker, budget, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    check = int(sys.argv[5])
    payload = os.urandom(2048)
    worst = -budget  # the most the file system's blocks went past max_bytes at a check
    with Cache(directory, max_bytes=budget, policy="lru") as cache:
        for i in range(count):
            url = f"s3://b/{worker}/{i}"
            lock = cache.fetch_lock(url)
            try:
                part = cache.new_part(url)
                part.write(payload)
                cache.publish(part, version="v1")
            finally:
                lock.release()
            if (i + 1) % check == 0:
                worst = max(worst, allocated_under(directory) - budget)
    print(worst, flush=True)
    """
)


@pytest.mark.slow
def test_four_processes_publishing_small_entries_stay_within_the_budget_by_du(
    tmp_path: Path,
) -> None:
    """Small entries published by four processes at once commit without a pause, so the
    automatic (passive) checkpoint never resets the WAL: it grew to 80-100 MB against its
    1 MB limit. A commit after it resetting it briefly still let it spike to tens of MB
    between two resets (13 MB past max_bytes). Now no transaction starts while the WAL is
    past half its reserve (index.py): du, checked by each publisher every 1,000 of its
    publishes, stays within max_bytes, and the WAL within what the budget counts it at."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    wal = tmp_path / "index.sqlite-wal"
    with Cache(tmp_path, max_bytes=BUDGET):
        pass
    children = [
        subprocess.Popen(
            [
                sys.executable,
                *("-c", _SMALL_PUBLISHER, str(tmp_path), str(w), str(BUDGET), "10000", "1000"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for w in range(4)
    ]
    largest_wal = 0
    worst = []
    try:
        while any(child.poll() is None for child in children):
            with contextlib.suppress(FileNotFoundError):  # none between connections
                largest_wal = max(largest_wal, wal.stat().st_size)
            time.sleep(0.005)
        for child in children:
            out, err = child.communicate(timeout=600)
            assert child.returncode == 0, err.decode()[-2000:]
            worst.append(int(out))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert max(worst) <= 0, worst  # du -B1 <= max_bytes at every check
    assert largest_wal <= WAL_RESERVE, largest_wal
    with Cache(tmp_path, max_bytes=BUDGET) as cache:
        assert len(cache.entries()) > 10_000  # the budget was full: 40,000 were published
