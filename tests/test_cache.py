"""The cache on its own: publication, budget and policies, in-use protection, integrity."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from fastload.cache import Cache, Location, PlanHint, checksum_bytes, default_cache_dir, object_id
from fastload.errors import CacheCorruptError

# segment_bytes: 0 keeps every entry in a file of its own; 4096 packs entries up to 256 B.
LAYOUTS = pytest.mark.parametrize("segment_bytes", [0, 4096], ids=["files", "segments"])


def put(cache: Cache, url: str, data: bytes, version: str | None = "v1") -> Location | None:
    lock = cache.fetch_lock(url)
    try:
        part = cache.new_part(url)
        part.write(data)
        return cache.publish(part, version=version)
    finally:
        lock.release()


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


def bytes_on_disk(cache_dir: Path) -> int:
    """What ``du --apparent-size`` counts of the cached bytes: own files and segments."""
    return sum(
        p.stat().st_size for sub in ("objects", "segments") for p in files_under(cache_dir / sub)
    )


def overwrite(where: Location, data: bytes) -> None:
    fd = os.open(where.path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, where.offset)
    finally:
        os.close(fd)


def test_published_object_is_found_with_its_size_checksum_and_version(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        path = put(cache, "s3://b/k", b"hello", version="etag1")
        assert path is not None
        assert path.read_bytes() == b"hello"
        entry = cache.entry("s3://b/k")
        assert entry is not None
        assert (entry.size, entry.checksum, entry.version) == (5, checksum_bytes(b"hello"), "etag1")
        assert cache.lookup("s3://b/k", version="etag1", size=5) == path
        assert list((tmp_path / "tmp").iterdir()) == []  # nothing half-written left behind


def test_a_changed_remote_version_is_never_served_from_the_stale_copy(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "s3://b/k", b"old", version="etag1")
        assert cache.lookup("s3://b/k", version="etag2") is None
        assert cache.entry("s3://b/k") is None  # dropped, so it is refetched


def test_lookup_many_answers_as_lookup_does_for_a_whole_batch(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        urls = [f"s3://b/{i}" for i in range(700)]  # more than one query's 500 ids
        for i, url in enumerate(urls[:600]):
            put(cache, url, b"x" * (i % 7 + 1), version=f"v{i}")
        versions: list[str | None] = [f"v{i}" for i in range(700)]
        sizes: list[int | None] = [i % 7 + 1 for i in range(700)]
        versions[3], sizes[4], versions[5], sizes[5] = "other", 99, None, None
        got = cache.lookup_many(urls, versions, sizes)
        assert got[3] is None  # another version: refetched by the caller
        assert got[4] is None  # another size
        assert got[600:] == [None] * 100  # never cached
        for i in [0, 5, 6, 599]:
            assert got[i] == cache.lookup(urls[i])
            assert got[i] is not None
            assert Path(got[i].path).read_bytes()[: i % 7 + 1] == b"x" * (i % 7 + 1)


def test_index_survives_reopening(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "http://h/a", b"abc")
    with Cache(tmp_path, budget_counts="entries") as cache:
        assert cache.lookup("http://h/a") is not None
        assert cache.used_bytes() == 3


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/../../etc/passwd",
        "s3://bucket//absolute/key",
        "http://h/" + "x" * 5000,
        "s3://bucket/\udcff\udcfe-not-utf8",
        "s3://bucket/a\nb\x00c",
        "/" + "../" * 20 + "tmp/evil",
    ],
)
@LAYOUTS
def test_hostile_keys_cannot_create_files_outside_the_cache(
    tmp_path: Path, url: str, segment_bytes: int
) -> None:
    cache_dir = tmp_path / "cache"
    outside_before = files_under(tmp_path) - files_under(cache_dir)
    with Cache(cache_dir, segment_bytes=segment_bytes) as cache:
        where = put(cache, url, b"payload")
        assert where is not None
        assert Path(where.path).resolve().is_relative_to(cache_dir.resolve())
        if not segment_bytes:
            assert Path(where.path).name == object_id(url)
        assert cache.entry(url) is not None
        assert cache.read_verified(url) == b"payload"
    outside_after = files_under(tmp_path) - files_under(cache_dir)
    assert outside_after == outside_before


@pytest.mark.parametrize("policy", ["lru", "pin", "plan"])
def test_budget_is_never_exceeded(tmp_path: Path, policy) -> None:
    rng = random.Random(0)
    with Cache(tmp_path, max_bytes=10_000, budget_counts="entries", policy=policy) as cache:
        cache.plan = PlanHint([f"s3://b/{rng.randrange(50)}" for _ in range(300)])
        for _ in range(300):
            i = rng.randrange(50)
            url = f"s3://b/{i}"
            if cache.lookup(url) is None:
                put(cache, url, os.urandom(rng.randrange(500, 3000)))
            with cache.use(url):
                pass
            assert cache.used_bytes() <= 10_000
            assert bytes_on_disk(tmp_path) == cache.used_bytes()


@pytest.mark.parametrize("policy", ["lru", "pin"])  # plan keeps entries in files of their own
def test_budget_counts_whole_segments_and_is_never_exceeded(tmp_path: Path, policy) -> None:
    """Packed entries are evicted a segment at a time; dead bytes in a segment still count."""
    rng = random.Random(1)
    urls = [f"s3://b/{i}" for i in range(200)]
    with Cache(
        tmp_path, max_bytes=12_000, budget_counts="entries", policy=policy, segment_bytes=2000
    ) as cache:
        cache.plan = PlanHint([rng.choice(urls) for _ in range(2000)])
        for _ in range(2000):
            url = rng.choice(urls)
            if cache.lookup(url) is None:
                put(cache, url, os.urandom(rng.randrange(20, 125)))
            if rng.random() < 0.05:
                cache.drop(url)  # dead bytes in its segment
            with cache.use(url):
                pass
            assert bytes_on_disk(tmp_path) == cache.used_bytes() <= 12_000
        assert len(files_under(tmp_path / "segments")) > 1
        assert not files_under(tmp_path / "objects")
        assert cache.verify() == []


def test_an_object_larger_than_the_budget_is_turned_away(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=100, budget_counts="entries") as cache:
        assert put(cache, "s3://b/big", b"x" * 101) is None
        assert cache.entry("s3://b/big") is None
        assert list((tmp_path / "tmp").iterdir()) == []


def test_lru_evicts_the_least_recently_used(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=300, budget_counts="entries", policy="lru") as cache:
        for name in "abc":
            put(cache, f"s3://b/{name}", b"x" * 100)
        cache.touch(["s3://b/a"])  # a is now the most recent; b the least
        put(cache, "s3://b/d", b"x" * 100)
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/c", "s3://b/d"}


def test_pin_keeps_what_it_has_and_turns_the_rest_away(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=300, budget_counts="entries", policy="pin") as cache:
        for name in "abcd":
            put(cache, f"s3://b/{name}", b"x" * 100)
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/b", "s3://b/c"}


def test_plan_evicts_what_is_needed_furthest_in_the_future(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=200, budget_counts="entries", policy="plan") as cache:
        cache.plan = PlanHint(["s3://b/a", "s3://b/b", "s3://b/c", "s3://b/a", "s3://b/c"])
        put(cache, "s3://b/a", b"x" * 100)
        with cache.use("s3://b/a"):
            pass
        put(cache, "s3://b/b", b"x" * 100)
        with cache.use("s3://b/b"):
            pass
        put(cache, "s3://b/c", b"x" * 100)  # b is never used again: it goes
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/c"}


def test_plan_turns_away_what_is_needed_later_than_everything_cached(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=200, budget_counts="entries", policy="plan") as cache:
        cache.plan = PlanHint(["s3://b/a", "s3://b/b", "s3://b/c", "s3://b/a", "s3://b/b"])
        put(cache, "s3://b/a", b"x" * 100)
        put(cache, "s3://b/b", b"x" * 100)
        assert put(cache, "s3://b/c", b"x" * 100) is None  # c is never needed again
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/b"}


@pytest.mark.parametrize("policy", ["lru", "plan"])
def test_an_object_in_use_is_never_evicted(tmp_path: Path, policy) -> None:
    with Cache(tmp_path, max_bytes=200, budget_counts="entries", policy=policy) as cache:
        put(cache, "s3://b/a", b"a" * 100)
        put(cache, "s3://b/b", b"b" * 100)
        cache.touch(["s3://b/b"])  # a is the LRU victim...
        with cache.use("s3://b/a") as held:
            assert held is not None
            put(cache, "s3://b/c", b"c" * 100)  # ...but it is in use, so b goes instead
            assert cache.entry("s3://b/a") is not None
            assert held.read_bytes() == b"a" * 100
            assert cache.drop("s3://b/a") is False
        assert cache.entry("s3://b/b") is None
        assert cache.drop("s3://b/a") is True


def test_when_everything_is_in_use_the_newcomer_is_turned_away(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=100, budget_counts="entries") as cache:
        put(cache, "s3://b/a", b"a" * 100)
        with cache.use("s3://b/a"):
            assert put(cache, "s3://b/b", b"b" * 100) is None
        assert cache.used_bytes() == 100


def test_verify_reports_corrupt_and_missing_files_and_drops_them(tmp_path: Path) -> None:
    with Cache(tmp_path, segment_bytes=0) as cache:
        for name in "abc":
            put(cache, f"s3://b/{name}", name.encode() * 1000)
        Path(cache.lookup("s3://b/a").path).write_bytes(b"A" * 1000)  # same size, other bytes
        Path(cache.lookup("s3://b/b").path).unlink()
        problems = dict(cache.verify())
        assert problems == {"s3://b/a": "checksum mismatch", "s3://b/b": "missing"}
        assert {e.url for e in cache.entries()} == {"s3://b/c"}
        assert cache.verify() == []


def test_verify_finds_corrupt_and_cut_off_entries_in_a_segment(tmp_path: Path) -> None:
    with Cache(tmp_path, segment_bytes=4096) as cache:
        where = {name: put(cache, f"s3://b/{name}", name.encode() * 200) for name in "abc"}
        assert len({w.path for w in where.values()}) == 1  # one segment
        overwrite(where["a"], b"A" * 200)
        os.truncate(where["c"].path, where["c"].offset + 50)
        problems = dict(cache.verify())
        assert problems == {
            "s3://b/a": "checksum mismatch",
            "s3://b/c": "its segment ends 150 bytes early",
        }
        assert {e.url for e in cache.entries()} == {"s3://b/b"}
        assert cache.read_verified("s3://b/b") == b"b" * 200


@LAYOUTS
def test_a_truncated_file_is_a_miss_not_a_hit(tmp_path: Path, segment_bytes: int) -> None:
    with Cache(tmp_path, segment_bytes=segment_bytes) as cache:
        where = put(cache, "s3://b/a", b"a" * 200)
        os.truncate(where.path, where.offset + 10)
        assert cache.lookup("s3://b/a") is None
        assert cache.entry("s3://b/a") is None


@LAYOUTS
def test_read_verified_refuses_corrupt_bytes(tmp_path: Path, segment_bytes: int) -> None:
    with Cache(tmp_path, segment_bytes=segment_bytes) as cache:
        where = put(cache, "s3://b/a", b"a" * 200)
        assert cache.read_verified("s3://b/a") == b"a" * 200
        overwrite(where, b"b" * 200)
        with pytest.raises(CacheCorruptError, match="s3://b/a"):
            cache.read_verified("s3://b/a")
        assert cache.entry("s3://b/a") is None


def test_verify_removes_files_the_index_does_not_claim(tmp_path: Path) -> None:
    with Cache(tmp_path, segment_bytes=4096) as cache:
        orphan = Path(cache.storage.object_path(object_id("s3://b/orphan")))
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(b"left by a crash between rename and commit")
        unknown_segment = tmp_path / "segments" / "999.seg"
        unknown_segment.write_bytes(b"a segment whose creating transaction never committed")
        where = put(cache, "s3://b/kept", b"k" * 100)
        cache.close()  # seals the segment, which a writer would otherwise hold
        with open(where.path, "ab") as f:
            f.write(b"appended by a writer killed before its commit")
        assert cache.verify() == []
        assert not orphan.exists()
        assert not unknown_segment.exists()
        assert os.path.getsize(where.path) == where.offset + 100
        assert cache.read_verified("s3://b/kept") == b"k" * 100


def test_leftover_parts_of_dead_fetchers_are_removed_on_open(tmp_path: Path) -> None:
    Cache(tmp_path).close()
    stale = tmp_path / "tmp" / f"{object_id('s3://b/a')}.99999.0"
    stale.write_bytes(b"half")
    stale_segment = tmp_path / "tmp" / "segment-7.99999"
    stale_segment.write_bytes(b"a segment its creator never renamed into place")
    Cache(tmp_path).close()
    assert not stale.exists()
    assert not stale_segment.exists()


def test_fetch_lock_is_exclusive_within_a_process(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        lock = cache.try_fetch_lock("s3://b/a")
        assert lock is not None
        assert cache.try_fetch_lock("s3://b/a") is None
        assert cache.try_fetch_lock("s3://b/other") is not None
        lock.release()
        lock.release()  # idempotent
        assert cache.try_fetch_lock("s3://b/a") is not None


def test_a_release_wakes_the_threads_of_its_process_waiting_for_locks(tmp_path: Path) -> None:
    """Another process's release is seen by polling; a thread of this one (a loader's batch
    waiting on its staging round) is woken by the release itself."""
    with Cache(tmp_path) as cache:
        lock = cache.try_fetch_lock("s3://b/a")
        assert lock is not None
        waiter = threading.Thread(target=cache.fetch_locks.wait, args=(600.0,))
        waiter.start()
        for _ in range(1000):  # until it waits (Condition's own list of its waiters)
            if cache.fetch_locks._released._waiters:  # type: ignore[attr-defined]
                break
            time.sleep(0.01)
        assert waiter.is_alive()  # nothing released yet
        lock.release()
        waiter.join(60)  # far less than its 600 s: only the release can have woken it
        assert not waiter.is_alive()
        assert cache.try_fetch_lock("s3://b/a") is not None


def test_evict_and_clear(tmp_path: Path) -> None:
    with Cache(tmp_path, budget_counts="entries", segment_bytes=0) as cache:
        for name in "abcd":
            put(cache, f"s3://b/{name}", b"x" * 100)
        assert cache.evict(to_bytes=200) == 2
        assert cache.used_bytes() == 200
        (tmp_path / "manifests" / "x.json").write_text("{}")
        (tmp_path / "indexes").mkdir()
        (tmp_path / "indexes" / "y.json").write_text("{}")
        assert cache.clear() == 2
        assert cache.entries() == []
        assert not list((tmp_path / "manifests").iterdir())
        assert not list((tmp_path / "indexes").iterdir())


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FASTLOAD_CACHE_DIR", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("FASTLOAD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "fastload"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_bytes": -1}, "max_bytes"),
        ({"policy": "fifo"}, "policy"),
        ({"lock_timeout_s": 0}, "lock"),
        ({"budget_counts": "blocks"}, "budget_counts"),
    ],
)
def test_bad_settings_are_refused(tmp_path: Path, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        Cache(tmp_path, **kwargs)


def test_use_with_a_version_misses_on_another_version(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "s3://b/a", b"old", version="etag1")
        with cache.use("s3://b/a", version="etag2") as held:
            assert held is None
        with cache.use("s3://b/a", version="etag1") as held:
            assert held is not None
            assert held.read_bytes() == b"old"


def test_small_entries_are_packed_into_segments_and_survive_reopening(tmp_path: Path) -> None:
    blobs = {f"s3://b/{i}": os.urandom(512) for i in range(1000)}
    with Cache(
        tmp_path, budget_counts="entries"
    ) as cache:  # no budget: 64 MB segments, entries up to 1 MB packed
        for url, data in blobs.items():
            put(cache, url, data)
        assert cache.used_bytes() == 512_000 == bytes_on_disk(tmp_path)
    assert len(files_under(tmp_path / "segments")) == 1
    assert not files_under(tmp_path / "objects")
    with Cache(tmp_path) as cache:
        for url, data in blobs.items():
            where = cache.lookup(url)
            assert where is not None
            assert where.read() == data
            assert where.read(100, 16) == data[100:116]


def test_a_segment_with_an_entry_in_use_is_never_evicted(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=3000, budget_counts="entries", segment_bytes=1000) as cache:
        for i in range(10):  # segments 1 and 2, 10 entries of 60 B (plus room for 6 more)
            put(cache, f"s3://b/{i}", bytes([i]) * 60)
        old = cache.lookup("s3://b/0")
        assert old is not None
        with cache.use("s3://b/0") as held:  # holds segment 1, the least recently used
            assert held == old
            for i in range(10, 40):
                put(cache, f"s3://b/{i}", bytes([i]) * 60)
            assert cache.entry("s3://b/0") is not None  # its segment stayed
            assert held.read() == bytes([0]) * 60
            assert cache.used_bytes() <= 3000
        assert cache.verify() == []


def test_byte_ranges_are_entries_of_their_own(tmp_path: Path) -> None:
    url = "s3://b/shard.tar"
    with Cache(tmp_path, segment_bytes=4096) as cache:
        for start, data in ((0, b"head"), (1000, b"middle-range")):
            span = (start, len(data))
            lock = cache.fetch_lock(url, span)
            try:
                part = cache.new_part(url, span)
                part.write(data)
                assert cache.publish(part, version="etag1") is not None
            finally:
                lock.release()
        assert cache.entry(url) is None  # the whole object is not cached, two ranges are
        where = cache.lookup(url, span=(1000, 12), version="etag1")
        assert where is not None
        assert where.read() == b"middle-range"
        assert cache.read_verified(url, (0, 4)) == b"head"
        assert cache.entry(url, (1000, 12)).start == 1000
        assert cache.lookup(url, span=(1000, 13)) is None  # another range
        assert cache.lookup(url, span=(0, 4), version="etag2") is None  # the object changed
        assert cache.entry(url, (0, 4)) is None
        assert cache.drop(url, (1000, 12))
        assert cache.entries() == []


def test_an_index_of_the_format_before_segments_is_upgraded_in_place(tmp_path: Path) -> None:
    import sqlite3

    from fastload.cache import checksum_bytes as checksum

    url, data = "s3://b/old", b"cached by fastload 0.1"
    oid = object_id(url)
    (tmp_path / "objects" / oid[:2]).mkdir(parents=True)
    (tmp_path / "objects" / oid[:2] / oid).write_bytes(data)
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.executescript(
        """
        CREATE TABLE objects (id TEXT PRIMARY KEY, url TEXT NOT NULL, size INTEGER NOT NULL,
            checksum TEXT NOT NULL, version TEXT, created REAL NOT NULL, last_use REAL NOT NULL);
        CREATE INDEX objects_by_last_use ON objects (last_use);
        CREATE TABLE totals (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
        """
    )
    db.execute(
        "INSERT INTO objects VALUES (?, ?, ?, ?, ?, 1.0, 1.0)",
        (oid, url, len(data), checksum(data), "etag1"),
    )
    db.execute("INSERT INTO totals VALUES ('bytes', ?)", (len(data),))
    db.commit()
    db.close()
    with Cache(tmp_path, budget_counts="entries") as cache:
        assert cache.used_bytes() == len(data)
        where = cache.lookup(url, version="etag1", size=len(data))
        assert where is not None
        assert where.read() == data
        put(cache, "s3://b/new", b"packed")
        assert cache.verify() == []
        assert cache.used_bytes() == len(data) + len(b"packed")


def test_a_sweep_with_a_stale_snapshot_removes_nothing_recorded_since(tmp_path: Path) -> None:
    """Another process opening the cache may have read the segments' sizes before a writer
    recorded more and let go of its segment: what was recorded meanwhile stays."""
    with Cache(tmp_path, segment_bytes=4096) as cache:
        put(cache, "s3://b/a", b"a" * 100)
        stale = cache.index.segment_sizes()  # a's segment, 100 bytes long
        put(cache, "s3://b/b", b"b" * 100)  # the same segment grows...
        cache.storage.seal()  # ...and its writer lets go of it
        before_b = {}  # and a segment nobody had recorded yet at the snapshot
        cache.storage.sweep(before_b, cache.index.segment_size, cache.fetch_locks)
        cache.storage.sweep(stale, cache.index.segment_size, cache.fetch_locks)
        assert cache.read_verified("s3://b/a") == b"a" * 100
        assert cache.read_verified("s3://b/b") == b"b" * 100


def test_eight_processes_can_create_one_cache_at_once(tmp_path: Path) -> None:
    """Eight ranks of a node start on an empty cache directory together."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from fastload.cache import Cache\n"
        "for i in range(20):\n"
        "    with Cache(sys.argv[1]) as cache:\n"
        "        part = cache.new_part(f's3://b/{sys.argv[2]}-{i}')\n"
        "        part.write(b'x')\n"
        "        cache.publish(part, version=None)\n"
    )
    for attempt in range(3):
        folder = str(tmp_path / f"cache{attempt}")
        procs = [
            subprocess.Popen([sys.executable, "-c", code, folder, str(rank)]) for rank in range(8)
        ]
        assert [p.wait(timeout=120) for p in procs] == [0] * 8
        with Cache(folder) as cache:
            assert len(cache.entries()) == 8 * 20
            assert cache.verify() == []
