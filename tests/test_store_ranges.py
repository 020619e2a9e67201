"""Byte ranges cached as entries of their own: read without downloading the whole object."""

from __future__ import annotations

from pathlib import Path

from conftest import Remote

from fastload.cache import Cache
from fastload.staging import FetchConfig
from fastload.store import CachedStore

QUICK = FetchConfig(jobs=4, retries=2, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10)


def big_key(remote: Remote) -> str:
    return max(remote.files, key=lambda k: len(remote.files[k]))


def test_a_range_is_fetched_once_and_then_read_locally(served: Remote, tmp_path: Path) -> None:
    store = CachedStore.open(
        served.url,
        cache_dir=str(tmp_path / "cache"),
        storage_options=served.storage_options,
        fetch=QUICK,
    )
    key = big_key(served)
    data = served.files[key]
    store.object_keys()  # lists the dataset before counting
    before = served.gets(key)
    assert store.read_range(key, 1000, 5000) == data[1000:6000]
    assert store.read_range(key, 1000, 5000) == data[1000:6000]
    assert served.gets(key) == before + 1  # one ranged GET, then the cache
    assert store.read_range(key, 0, 10) == data[:10]  # another range: another GET
    assert store.read_range(key, len(data) - 3, 100) == data[-3:]  # clipped at the end
    assert served.gets(key) == before + 3
    with Cache(tmp_path / "cache") as cache:
        url = store.object_url(key)
        assert cache.entry(url) is None  # the object was never downloaded whole
        assert {(e.start, e.size) for e in cache.entries()} == {
            (1000, 5000),
            (0, 10),
            (len(data) - 3, 3),
        }
        assert cache.verify() == []
    store.close()


def test_a_changed_object_is_never_served_from_a_stale_range(
    served: Remote, tmp_path: Path
) -> None:
    key = big_key(served)

    def fresh_store() -> CachedStore:
        return CachedStore.open(
            served.url,
            cache_dir=str(tmp_path / "cache"),
            storage_options=served.storage_options,
            fetch=QUICK,
            refresh=True,
        )

    store = fresh_store()
    assert store.read_range(key, 0, 100) == served.files[key][:100]
    store.close()
    served.replace(key, b"N" * len(served.files[key]))
    store = fresh_store()  # lists again: a new version
    assert store.read_range(key, 0, 100) == b"N" * 100
    store.close()
