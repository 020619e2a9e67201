"""Eviction without a scan (cache/eviction.py) chooses what today's policy chose.

The reference below is the policy as it was written before (sort every own file and every
segment; ``plan`` asks the plan about each entry), kept here with its ties broken the one
way the new code breaks them (own files first, then by id). Hypothesis drives random
traces of publishes, uses, drops and plan steps, and the lazy order must equal it."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastload.cache import Cache, PlanHint, object_id

Victim = tuple[str, str | int, int]


def reference_order(cache: Cache, db: sqlite3.Connection, oid: str) -> list[Victim]:
    """Today's ``_victims``: every entry ranked, then sorted."""
    cache.index.write_uses(db)
    plan = cache.plan
    files = db.execute(
        "SELECT id, size, last_use FROM objects WHERE segment IS NULL AND id != ?", (oid,)
    ).fetchall()
    members = db.execute(
        "SELECT id, segment, last_use FROM objects WHERE segment IS NOT NULL"
    ).fetchall()
    segments = db.execute("SELECT id, size FROM segments").fetchall()
    if cache.config.policy != "plan" or plan is None:
        latest: dict[int, float] = {}
        for _, segment, used in members:
            latest[segment] = max(latest.get(segment, 0.0), used)
        ranked = [(used, 0, key, size) for key, size, used in files]
        ranked += [(latest.get(key, 0.0), 1, key, size) for key, size in segments]
        ranked.sort(key=lambda r: (r[0], r[1], r[2]))
        return [("file" if kind == 0 else "segment", key, size) for _, kind, key, size in ranked]
    mine = plan.next_use(oid)
    soonest: dict[int, float] = {}
    for member, segment, _ in members:
        soonest[segment] = min(soonest.get(segment, float("inf")), plan.next_use(member))
    ranked_plan = [(plan.next_use(key), 0, key, size) for key, size, _ in files]
    ranked_plan += [(soonest.get(key, float("inf")), 1, key, size) for key, size in segments]
    ranked_plan.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [
        ("file" if kind == 0 else "segment", key, size)
        for when, kind, key, size in ranked_plan
        if when > mine
    ]


def lazy_order(cache: Cache, db: sqlite3.Connection, oid: str) -> list[Victim]:
    victims = [(v.kind, v.key, v.size) for v in cache._victims(db, oid)]
    if cache._ranking is not None:
        cache._ranking.settle([])
    return victims


def put(cache: Cache, url: str, size: int) -> bool:
    lock = cache.fetch_lock(url)
    try:
        part = cache.new_part(url)
        part.write(os.urandom(size))
        return cache.publish(part, version="v1") is not None
    finally:
        lock.release()


URLS = [f"s3://b/{i}" for i in range(12)]
step = st.one_of(
    st.tuples(st.just("put"), st.sampled_from(URLS), st.integers(20, 300)),
    st.tuples(st.just("use"), st.sampled_from(URLS), st.just(0)),
    st.tuples(st.just("drop"), st.sampled_from(URLS), st.just(0)),
)
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def run_trace(cache: Cache, trace: list[tuple[str, str, int]], check: object) -> None:
    for op, url, size in trace:
        if op == "put":
            put(cache, url, size)
        elif op == "use":
            with cache.use(url):
                pass
        else:
            cache.drop(url)
        time.sleep(0.0002)  # distinct times, mostly; equal ones are broken by id both ways
        assert callable(check)
        check(url)


@pytest.mark.parametrize("segment_bytes", [0, 1024], ids=["files", "segments"])
@given(trace=st.lists(step, min_size=1, max_size=40))
@SETTINGS
def test_lru_order_is_the_reference_order(
    tmp_path_factory: pytest.TempPathFactory, segment_bytes: int, trace: list
) -> None:
    with Cache(tmp_path_factory.mktemp("c"), policy="lru", segment_bytes=segment_bytes) as cache:

        def check(url: str) -> None:
            with cache.index.transaction() as db:
                for oid in (object_id(url), object_id(URLS[int(url.rsplit("/", 1)[1]) * 7 % 12])):
                    assert lazy_order(cache, db, oid) == reference_order(cache, db, oid)

        run_trace(cache, trace, check)


@pytest.mark.parametrize("segment_bytes", [0, 1024], ids=["files", "segments"])
@given(
    trace=st.lists(step, min_size=1, max_size=40),
    order=st.lists(st.sampled_from(URLS), min_size=1, max_size=60),
)
@SETTINGS
def test_plan_order_is_the_reference_order_as_the_plan_advances(
    tmp_path_factory: pytest.TempPathFactory, segment_bytes: int, trace: list, order: list
) -> None:
    directory = tmp_path_factory.mktemp("c")
    if segment_bytes:  # plan packs nothing: segments are what an lru process left
        with Cache(directory, policy="lru", segment_bytes=segment_bytes) as lru:
            for url in URLS[::3]:
                put(lru, url, 100)
    with Cache(directory, policy="plan") as cache:
        cache.plan = PlanHint(order)

        def check(url: str) -> None:
            with cache.index.transaction() as db:
                for oid in (object_id(url), object_id(URLS[int(url.rsplit("/", 1)[1]) * 7 % 12])):
                    assert lazy_order(cache, db, oid) == reference_order(cache, db, oid)

        run_trace(cache, trace, check)


def expected_eviction(cache: Cache, oid: str, size: int) -> tuple[set[str | int], bool]:
    """What today's policy evicts for a publish, plus the low-water rule: after the bytes
    needed, victims go on in order while the total freed stays within 1% of the budget."""
    budget = cache.config.max_bytes
    assert budget is not None
    with cache.index.transaction() as db:
        (total,) = db.execute("SELECT value FROM totals WHERE name = 'bytes'").fetchone()
        old = db.execute("SELECT size, segment FROM objects WHERE id = ?", (oid,)).fetchone()
        replacing = old[0] if old is not None and old[1] is None else 0
        need = total - replacing + size - budget
        if need <= 0:
            return set(), True
        if size > budget:
            return set(), False
        chosen: set[str | int] = set()
        freed = 0
        for _, key, nbytes in reference_order(cache, db, oid):
            if freed >= need and freed + nbytes > need + budget // 100:
                break
            chosen.add(key)
            freed += nbytes
        return (chosen, True) if freed >= need else (set(), False)


def keys_of(cache: Cache) -> set[str | int]:
    with cache.index.transaction() as db:
        files = db.execute("SELECT id FROM objects WHERE segment IS NULL").fetchall()
        segments = db.execute("SELECT id FROM segments").fetchall()
    return {r[0] for r in files} | {r[0] for r in segments}


@pytest.mark.parametrize(
    ("policy", "segment_bytes"), [("lru", 0), ("lru", 1024), ("plan", 0)], ids=str
)
@given(
    trace=st.lists(step, min_size=1, max_size=40),
    order=st.lists(st.sampled_from(URLS), min_size=1, max_size=60),
)
@SETTINGS
def test_a_publish_evicts_what_the_reference_evicts(
    tmp_path_factory: pytest.TempPathFactory,
    policy: str,
    segment_bytes: int,
    trace: list,
    order: list,
) -> None:
    with Cache(
        tmp_path_factory.mktemp("c"),
        max_bytes=1500,
        budget_counts="entries",
        policy=policy,
        segment_bytes=segment_bytes,
    ) as cache:  # type: ignore[arg-type]
        cache.plan = PlanHint(order)
        for op, url, size in trace:
            if op != "put":
                with cache.use(url):
                    pass
                time.sleep(0.0002)
                continue
            active = cache.storage.active_segment()
            evicted, admitted = expected_eviction(cache, object_id(url), size)
            before = keys_of(cache)
            assert put(cache, url, size) is admitted
            after = keys_of(cache)
            gone = (before - after) - {object_id(url)}
            assert gone == evicted - {object_id(url)}
            assert active is None or active not in evicted or not admitted
            time.sleep(0.0002)


def test_a_million_entry_cache_opens_and_evicts_least_recent_first(tmp_path: Path) -> None:
    """Synthetic rows (no files: eviction of a missing file is a no-op) at toy sizes."""
    n, size = 1_000_000, 60
    with Cache(tmp_path, segment_bytes=0):
        pass
    with sqlite3.connect(tmp_path / "index.sqlite") as db:
        db.executemany(
            "INSERT INTO objects (id, url, size, checksum, version, created, last_use, position)"
            " VALUES (?, ?, ?, 'xxh3:0', 'v', 0, ?, 0)",
            ((f"{i:032x}", f"s3://b/{i}", size, float(i)) for i in range(n)),
        )
        db.execute("UPDATE totals SET value = ? WHERE name = 'bytes'", (n * size,))
        db.execute("UPDATE totals SET value = ? WHERE name = 'files'", (n,))
    for counts in ("entries", "disk"):  # the entries' bytes only (tests, toys); all on disk
        with Cache(tmp_path, segment_bytes=0, budget_counts=counts) as cache:
            max_bytes = cache.used_bytes()
        with Cache(tmp_path, max_bytes=max_bytes, segment_bytes=0, budget_counts=counts) as cache:
            with cache.index.transaction() as db:
                (before,) = db.execute("SELECT COUNT(*) FROM objects").fetchone()
                (oldest_before,) = db.execute("SELECT MIN(last_use) FROM objects").fetchone()
            assert put(cache, f"s3://b/new{max_bytes}", 1000)
            with cache.index.transaction() as db:
                (left,) = db.execute("SELECT COUNT(*) FROM objects").fetchone()
                (oldest,) = db.execute("SELECT MIN(last_use) FROM objects").fetchone()
            evicted = before + 1 - left
            # what was needed, then on to the low-water mark (1% of the budget)
            assert 1 <= evicted <= (1000 + max_bytes // 100) // size + 2
            assert oldest == oldest_before + evicted  # exactly the least recently used went
            assert cache.counts_disk is (counts == "disk")
            assert cache.used_bytes() <= max_bytes


def test_plan_victims_evicted_elsewhere_free_nothing_and_the_budget_still_holds(
    tmp_path: Path,
) -> None:
    """``plan`` ranks victims with the sizes it last knew (no look-up per victim). Entries
    another process evicted since free nothing: the totals follow what the deletes
    removed, and eviction goes on to the next victims until the new entry fits."""
    urls = [f"s3://b/{i}" for i in range(10)]
    with Cache(
        tmp_path, max_bytes=1000, budget_counts="entries", policy="plan", segment_bytes=0
    ) as cache:
        cache.plan = PlanHint(["s3://b/a", "s3://b/b", *urls])  # a and b first, then 0..9
        for url in urls:
            assert put(cache, url, 100)
        assert put(cache, "s3://b/a", 100)  # ranks the entries; 9 is evicted
        with Cache(tmp_path, segment_bytes=0) as other:  # the furthest-needed left go
            for url in urls[6:9]:
                assert other.drop(url)
        assert put(cache, "s3://b/b", 500)
        with cache.index.transaction() as db:
            rows = db.execute("SELECT COUNT(*), SUM(size) FROM objects").fetchone()
        assert rows == (6, 1000)  # 0..3, a and b: 4 and 5 evicted, 6..8 were gone
        assert cache.used_bytes() == 1000  # the totals count what is there
