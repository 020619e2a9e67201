"""S3 objects staged and listed through obstore (fastload.remote.obstore), against moto, with
s3fs as the fallback for what obstore does not carry."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Remote, open_remote, private_s3fs

import fastload.remote.obstore as transport
from fastload.cache import Cache
from fastload.errors import RemoteNotFoundError
from fastload.manifest import RemoteObject, list_dataset
from fastload.remote import open_filesystem
from fastload.remote.transport import FsspecTransport
from fastload.staging import FetchConfig
from fastload.store import CachedStore
from fastload.testing import S3FolderServer

# In this process: these tests watch the transport from here.
QUICK = FetchConfig(
    jobs=8, retries=4, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10, staging_process=False
)


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[Remote]:
    with open_remote("s3", tmp_path) as r:
        yield r


@pytest.fixture
def served_by_obstore(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The (path, start, end) of every GET obstore answered (s3fs's answers are left out)."""
    answered: list[tuple[Any, ...]] = []
    fallbacks: list[tuple[Any, ...]] = []
    real_get = transport.ObjectStoreTransport.get
    real_fallback = FsspecTransport.get

    def get(self: transport.ObjectStoreTransport, *args: Any) -> Any:
        data = real_get(self, *args)
        if fallbacks and fallbacks[-1][0] == args[0]:
            fallbacks.pop()
        else:
            answered.append(args)
        return data

    def fallback(self: FsspecTransport, *args: Any) -> Any:
        fallbacks.append(args)
        return real_fallback(self, *args)

    monkeypatch.setattr(transport.ObjectStoreTransport, "get", get)
    monkeypatch.setattr(FsspecTransport, "get", fallback)
    return answered


def open_store(remote: Remote, cache_dir: Path, **options: Any) -> CachedStore:
    return CachedStore.open(
        remote.url,
        cache_dir=str(cache_dir),
        storage_options={**remote.storage_options, **options},
        fetch=QUICK,
    )


def cached(cache_dir: Path, remote: Remote) -> dict[str, bytes]:
    with Cache(cache_dir) as cache:
        found = {k: cache.lookup(f"{remote.url.rstrip('/')}/{k}") for k in remote.files}
        return {k: p.read_bytes() for k, p in found.items() if p is not None}


def test_every_object_arrives_whole_in_one_get_through_obstore(
    s3: Remote, tmp_path: Path, served_by_obstore: list[tuple[Any, ...]]
) -> None:
    store = open_store(s3, tmp_path / "cache")
    keys = store.object_keys()  # lists the bucket
    s3.server.reset_stats()  # type: ignore[union-attr]
    results = store.stage(keys)
    assert {r.outcome for r in results} == {"fetched"}
    assert cached(tmp_path / "cache", s3) == s3.files
    assert len(served_by_obstore) == len(s3.files)
    stats = s3.server.stats()  # type: ignore[union-attr]
    assert stats.count(method="GET") == len(s3.files)
    assert stats.count(method="HEAD") == 0


def test_large_objects_come_in_ranges_that_join_to_the_object(
    s3: Remote, tmp_path: Path, served_by_obstore: list[tuple[Any, ...]]
) -> None:
    big = max(s3.files, key=lambda k: len(s3.files[k]))
    size = len(s3.files[big])
    store = CachedStore.open(
        s3.url,
        cache_dir=str(tmp_path / "cache"),
        storage_options=s3.storage_options,
        fetch=FetchConfig(
            range_threshold_bytes=size // 3, range_bytes=size // 3 - 1, staging_process=False
        ),
    )
    store.stage([big])
    assert store.read(big) == s3.files[big]
    ranges = sorted((start, end) for _, start, end, *_ in served_by_obstore)
    assert len(ranges) >= 3
    assert ranges[0][0] == 0
    assert ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # no gap, no overlap


@pytest.mark.parametrize(
    "fault", ["503 SlowDown", "500", "truncated body", "connection reset"], ids=str
)
def test_transient_faults_on_obstore_gets_are_retried_by_fastload_alone(
    s3: Remote, tmp_path: Path, fault: str
) -> None:
    server = s3.server
    assert server is not None
    key = sorted(s3.files)[0]
    if fault == "truncated body":
        server.truncate_next(2, path_contains=key)
    elif fault == "connection reset":
        server.reset_next(2, path_contains=key, methods=["GET"])
    else:
        server.fail_next(2, int(fault.split()[0]), path_contains=key, methods=["GET"])
    store = open_store(s3, tmp_path / "cache")
    (result,) = store.stage([key])
    assert result.outcome == "fetched"
    assert result.attempts == 3  # obstore's own retries are off: fastload's AIMD decides
    assert s3.gets(key) == 3
    assert store.read(key) == s3.files[key]


def test_a_missing_object_fails_fast_naming_its_url(s3: Remote, tmp_path: Path) -> None:
    store = open_store(s3, tmp_path / "cache")
    gone = RemoteObject("no/such/object.bin", 10, None)
    with pytest.raises(RemoteNotFoundError, match=r"s3://.*/no/such/object\.bin"):
        store.stager.stage([gone])
    assert s3.gets("no/such/object.bin") == 1


@pytest.mark.parametrize(
    "code", ["AuthorizationHeaderMalformed", "IllegalLocationConstraintException"]
)
def test_a_response_it_does_not_handle_leaves_this_and_later_objects_to_s3fs(
    s3: Remote, tmp_path: Path, served_by_obstore: list[tuple[Any, ...]], code: str | None
) -> None:
    first, *rest = sorted(s3.files)
    # S3 answers 400 to a request signed for another region; s3fs follows it.
    s3.server.fail_next(1, 400, code=code, path_contains=first, methods=["GET"])  # type: ignore[union-attr]
    store = CachedStore.open(  # one GET at a time: "later" is well defined
        s3.url,
        cache_dir=str(tmp_path / "cache"),
        storage_options=s3.storage_options,
        fetch=FetchConfig(jobs=1, min_jobs=1, staging_process=False),
    )
    # The first alone, then the rest: two objects queued at once may reach the GET
    # threads' throttle in either order (seen under load), and "later" must be later.
    results = store.stage([first]) + store.stage(rest)
    assert {r.outcome for r in results} == {"fetched"}
    assert cached(tmp_path / "cache", s3) == s3.files
    assert served_by_obstore == []  # s3fs answered all of them
    assert s3.gets(first) == 2
    assert all(s3.gets(k) == 1 for k in rest)


def test_settings_obstore_cannot_carry_leave_the_gets_to_s3fs_one_request_each(
    s3: Remote, tmp_path: Path, served_by_obstore: list[tuple[Any, ...]]
) -> None:
    options = {**s3.storage_options, "s3_additional_kwargs": {"ChecksumMode": "ENABLED"}}
    store = open_store(s3, tmp_path / "cache", **options)
    keys = store.object_keys()
    # As in a new process: the listing comes from the cache and s3fs knows no sizes; it
    # would then HEAD each object before its GET, unless told not to split objects.
    open_filesystem(s3.url, options)[0].invalidate_cache()
    s3.server.reset_stats()  # type: ignore[union-attr]
    results = store.stage(keys)
    assert {r.outcome for r in results} == {"fetched"}
    assert cached(tmp_path / "cache", s3) == s3.files
    assert served_by_obstore == []
    stats = s3.server.stats()  # type: ignore[union-attr]
    assert stats.count(method="HEAD") == 0
    # One GET per object, but botocore may resend a GET once on a pooled connection the
    # server had closed (seen once in CI: 8 resends, one per connection of QUICK's pool).
    assert len(s3.files) <= stats.count(method="GET") <= len(s3.files) + QUICK.jobs


# --- listings --------------------------------------------------------------------------------


def test_an_obstore_listing_equals_s3fs_find_across_pages_and_odd_names(tmp_path: Path) -> None:
    names = [f"c{i % 3}/{i:04d} a+b%20 ü.bin" for i in range(1_050)]  # two pages of 1,000
    with S3FolderServer(tmp_path) as server:
        for i, name in enumerate(names):
            path = tmp_path / "odd-names" / "ds" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(bytes(i % 7))
        (tmp_path / "odd-names" / "dsx").mkdir()
        (tmp_path / "odd-names" / "dsx" / "outside.bin").write_bytes(b"not below ds/")
        fast = list_dataset("s3://odd-names/ds", server.storage_options)
        fs = private_s3fs(server.storage_options, timeout_s=10)
        slow = fs.find("odd-names/ds", detail=True, withdirs=False)
    assert [o.key for o in fast] == sorted(names)
    assert set(slow) == {f"odd-names/ds/{n}" for n in names}
    for obj in fast:
        info = slow[f"odd-names/ds/{obj.key}"]
        assert obj.size == info["size"]
        # The same version string as from s3fs: a cache made either way stays valid.
        assert obj.version == f"ETag={info['ETag']};LastModified={info['LastModified']}"


def test_folder_markers_are_no_objects_of_the_dataset(s3: Remote) -> None:
    s3.server.put("data", "ds/a-folder-marker/", b"")  # type: ignore[union-attr]
    manifest = list_dataset(s3.url, s3.storage_options)
    assert {o.key for o in manifest} == set(s3.files)


def test_a_declined_listing_is_left_to_s3fs(s3: Remote) -> None:
    s3.server.fail_next(  # type: ignore[union-attr]
        1, 400, code="AuthorizationHeaderMalformed", path_contains="/data", methods=["GET"]
    )
    manifest = list_dataset(s3.url, s3.storage_options)
    assert {o.key: o.size for o in manifest} == {k: len(v) for k, v in s3.files.items()}
    assert s3.server.stats().faults_injected == 1  # type: ignore[union-attr]


# --- fork ------------------------------------------------------------------------------------


def _read_in_child(store: CachedStore, key: str, out: Any) -> None:
    out.put((type(store.stager.transport).__name__, store.read(key)))


def test_a_forked_child_of_a_process_that_used_obstore_reads_through_s3fs(
    s3: Remote, tmp_path: Path
) -> None:
    import multiprocessing

    first, second = sorted(s3.files)[:2]
    store = open_store(s3, tmp_path / "cache")
    store.stage([first])  # the parent's obstore runtime is up now
    assert type(store.stager.transport).__name__ == "ObjectStoreTransport"
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_read_in_child, args=(store, second, out))
    child.start()
    child.join(60)  # obstore in a forked child would hang here
    assert child.exitcode == 0
    assert out.get(timeout=5) == ("FsspecTransport", s3.files[second])
