"""The cache on its own: publication, budget and policies, in-use protection, integrity."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from fastload.cache import Cache, PlanHint, checksum_bytes, default_cache_dir, object_id
from fastload.errors import CacheCorruptError


def put(cache: Cache, url: str, data: bytes, version: str | None = "v1") -> Path | None:
    lock = cache.fetch_lock(url)
    try:
        part = cache.new_part(url)
        part.write(data)
        return cache.publish(part, version=version)
    finally:
        lock.release()


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


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


def test_index_survives_reopening(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "http://h/a", b"abc")
    with Cache(tmp_path) as cache:
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
def test_hostile_keys_cannot_create_files_outside_the_cache(tmp_path: Path, url: str) -> None:
    cache_dir = tmp_path / "cache"
    outside_before = files_under(tmp_path) - files_under(cache_dir)
    with Cache(cache_dir) as cache:
        path = put(cache, url, b"payload")
        assert path is not None
        assert path.resolve().is_relative_to(cache_dir.resolve())
        assert path.name == object_id(url)
        assert cache.entry(url) is not None
    outside_after = files_under(tmp_path) - files_under(cache_dir)
    assert outside_after == outside_before


@pytest.mark.parametrize("policy", ["lru", "pin", "plan"])
def test_budget_is_never_exceeded(tmp_path: Path, policy) -> None:
    rng = random.Random(0)
    with Cache(tmp_path, max_bytes=10_000, policy=policy) as cache:
        cache.plan = PlanHint([f"s3://b/{rng.randrange(50)}" for _ in range(300)])
        for _ in range(300):
            i = rng.randrange(50)
            url = f"s3://b/{i}"
            if cache.lookup(url) is None:
                put(cache, url, os.urandom(rng.randrange(500, 3000)))
            with cache.use(url):
                pass
            assert cache.used_bytes() <= 10_000
            on_disk = sum(
                p.stat().st_size for p in (tmp_path / "objects").rglob("*") if p.is_file()
            )
            assert on_disk == cache.used_bytes()


def test_an_object_larger_than_the_budget_is_turned_away(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=100) as cache:
        assert put(cache, "s3://b/big", b"x" * 101) is None
        assert cache.entry("s3://b/big") is None
        assert list((tmp_path / "tmp").iterdir()) == []


def test_lru_evicts_the_least_recently_used(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=300, policy="lru") as cache:
        for name in "abc":
            put(cache, f"s3://b/{name}", b"x" * 100)
        cache.touch(["s3://b/a"])  # a is now the most recent; b the least
        put(cache, "s3://b/d", b"x" * 100)
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/c", "s3://b/d"}


def test_pin_keeps_what_it_has_and_turns_the_rest_away(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=300, policy="pin") as cache:
        for name in "abcd":
            put(cache, f"s3://b/{name}", b"x" * 100)
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/b", "s3://b/c"}


def test_plan_evicts_what_is_needed_furthest_in_the_future(tmp_path: Path) -> None:
    with Cache(tmp_path, max_bytes=200, policy="plan") as cache:
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
    with Cache(tmp_path, max_bytes=200, policy="plan") as cache:
        cache.plan = PlanHint(["s3://b/a", "s3://b/b", "s3://b/c", "s3://b/a", "s3://b/b"])
        put(cache, "s3://b/a", b"x" * 100)
        put(cache, "s3://b/b", b"x" * 100)
        assert put(cache, "s3://b/c", b"x" * 100) is None  # c is never needed again
        assert {e.url for e in cache.entries()} == {"s3://b/a", "s3://b/b"}


@pytest.mark.parametrize("policy", ["lru", "plan"])
def test_an_object_in_use_is_never_evicted(tmp_path: Path, policy) -> None:
    with Cache(tmp_path, max_bytes=200, policy=policy) as cache:
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
    with Cache(tmp_path, max_bytes=100) as cache:
        put(cache, "s3://b/a", b"a" * 100)
        with cache.use("s3://b/a"):
            assert put(cache, "s3://b/b", b"b" * 100) is None
        assert cache.used_bytes() == 100


def test_verify_reports_corrupt_and_missing_files_and_drops_them(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        for name in "abc":
            put(cache, f"s3://b/{name}", name.encode() * 1000)
        cache.path_for("s3://b/a").write_bytes(b"A" * 1000)  # same size, other bytes
        cache.path_for("s3://b/b").unlink()
        problems = dict(cache.verify())
        assert problems == {"s3://b/a": "checksum mismatch", "s3://b/b": "missing"}
        assert {e.url for e in cache.entries()} == {"s3://b/c"}
        assert cache.verify() == []


def test_a_truncated_file_is_a_miss_not_a_hit(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "s3://b/a", b"a" * 1000)
        cache.path_for("s3://b/a").write_bytes(b"a" * 10)
        assert cache.lookup("s3://b/a") is None
        assert cache.entry("s3://b/a") is None


def test_read_verified_refuses_corrupt_bytes(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        put(cache, "s3://b/a", b"a" * 1000)
        assert cache.read_verified("s3://b/a") == b"a" * 1000
        cache.path_for("s3://b/a").write_bytes(b"b" * 1000)
        with pytest.raises(CacheCorruptError, match="s3://b/a"):
            cache.read_verified("s3://b/a")
        assert cache.entry("s3://b/a") is None


def test_verify_removes_files_the_index_does_not_claim(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        orphan = cache.path_for("s3://b/orphan")
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(b"left by a crash between rename and commit")
        assert cache.verify() == []
        assert not orphan.exists()


def test_leftover_parts_of_dead_fetchers_are_removed_on_open(tmp_path: Path) -> None:
    Cache(tmp_path).close()
    stale = tmp_path / "tmp" / f"{object_id('s3://b/a')}.99999.0"
    stale.write_bytes(b"half")
    Cache(tmp_path).close()
    assert not stale.exists()


def test_fetch_lock_is_exclusive_within_a_process(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
        lock = cache.try_fetch_lock("s3://b/a")
        assert lock is not None
        assert cache.try_fetch_lock("s3://b/a") is None
        assert cache.try_fetch_lock("s3://b/other") is not None
        lock.release()
        lock.release()  # idempotent
        assert cache.try_fetch_lock("s3://b/a") is not None


def test_evict_and_clear(tmp_path: Path) -> None:
    with Cache(tmp_path) as cache:
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
