"""Staging a dataset into the cache from local paths, HTTP and S3 servers on loopback."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Remote, open_remote

from fastload.cache import Cache, checksum_bytes
from fastload.errors import (
    CacheError,
    MissingBackendError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
)
from fastload.staging import FetchConfig
from fastload.warm import warm

QUICK_RETRIES = FetchConfig(jobs=8, retries=6, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10)


def cached_bytes(cache_dir: Path, remote: Remote) -> dict[str, bytes]:
    with Cache(cache_dir) as cache:
        out = {}
        for key in remote.files:
            url = f"{remote.url.rstrip('/')}/{key}"
            path = cache.lookup(url)
            if path is not None:
                out[key] = path.read_bytes()
        return out


def assert_all_cached_and_right(cache_dir: Path, remote: Remote) -> None:
    assert cached_bytes(cache_dir, remote) == remote.files
    with Cache(cache_dir) as cache:
        assert cache.verify(repair=False) == []


def test_warm_stages_every_object_once(remote: Remote, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    report = warm(
        remote.url, cache_dir=str(cache_dir), storage_options=remote.storage_options, progress=False
    )
    assert report.ok
    assert report.objects == len(remote.files)
    assert report.fetched == len(remote.files)
    assert report.fetched_bytes == sum(map(len, remote.files.values()))
    assert_all_cached_and_right(cache_dir, remote)
    before = remote.total_gets() if remote.server else 0

    again = warm(
        remote.url, cache_dir=str(cache_dir), storage_options=remote.storage_options, progress=False
    )
    assert (again.fetched, again.already_cached) == (0, len(remote.files))
    if remote.server:
        assert remote.total_gets() == before  # nothing fetched twice, not even listed again
        assert all(remote.gets(k) == 1 for k in remote.files)


def test_dry_run_says_what_would_be_fetched_and_fetches_nothing(
    remote: Remote, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    keys = sorted(remote.files)[:10]
    warm(
        remote.url,
        cache_dir=str(cache_dir),
        storage_options=remote.storage_options,
        keys=keys[:4],
        progress=False,
    )
    report = warm(
        remote.url,
        cache_dir=str(cache_dir),
        storage_options=remote.storage_options,
        keys=keys,
        dry_run=True,
    )
    assert report.dry_run
    assert report.already_cached == 4
    assert report.bytes == sum(len(remote.files[k]) for k in keys[4:])
    assert set(cached_bytes(cache_dir, remote)) == set(keys[:4])


def test_unknown_keys_are_refused_naming_one(remote: Remote, tmp_path: Path) -> None:
    with pytest.raises(KeyError, match=r"nope\.bin"):
        warm(
            remote.url,
            cache_dir=str(tmp_path),
            storage_options=remote.storage_options,
            keys=["nope.bin"],
            progress=False,
        )


def test_a_changed_remote_object_is_refetched_after_relisting(
    remote: Remote, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    opts = remote.storage_options
    warm(remote.url, cache_dir=str(cache_dir), storage_options=opts, progress=False)
    key = sorted(remote.files)[3]
    remote.replace(key, b"a new version of this object")
    stale = warm(remote.url, cache_dir=str(cache_dir), storage_options=opts, progress=False)
    assert stale.fetched == 0  # the listing is reused until refreshed or expired
    fresh = warm(
        remote.url, cache_dir=str(cache_dir), storage_options=opts, refresh=True, progress=False
    )
    assert fresh.fetched == 1
    assert_all_cached_and_right(cache_dir, remote)


def test_a_missing_dataset_fails_naming_the_url(remote: Remote, tmp_path: Path) -> None:
    url = remote.url.rstrip("/") + "-missing"
    with pytest.raises(RemoteError, match=url.split("://")[-1]):
        warm(url, cache_dir=str(tmp_path), storage_options=remote.storage_options, progress=False)


# --- faults -----------------------------------------------------------------------------------


def test_transient_faults_are_retried_and_every_byte_is_right(
    served: Remote, tmp_path: Path
) -> None:
    server = served.server
    assert server is not None
    warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=[],
        progress=False,
    )  # list first: these faults are for the objects
    server.fail_next(4, 503, methods=["GET"])
    server.fail_next(3, 500, methods=["GET"])
    server.truncate_next(3)
    server.reset_next(3, methods=["GET"])
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        fetch=QUICK_RETRIES,
        progress=False,
    )
    assert report.ok, report.failures
    assert server.pending_faults == 0
    assert_all_cached_and_right(tmp_path, served)


def test_slow_responses_past_the_timeout_are_retried(served: Remote, tmp_path: Path) -> None:
    served.server.set_behavior(latency_s=0.5)
    keys = sorted(served.files)[:2]
    warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=keys[:1],
        progress=False,
    )  # lists while slow, within the default timeout
    config = FetchConfig(jobs=2, retries=1, backoff_s=0.01, timeout_s=0.2)
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=keys,
        fetch=config,
        progress=False,
    )
    assert report.failed == 1
    assert "within" in report.failures[0]["error"]
    served.server.set_behavior(latency_s=0.0)
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=keys,
        fetch=config,
        progress=False,
    )
    assert report.ok


def test_transient_failures_that_outlast_retries_are_reported(
    served: Remote, tmp_path: Path
) -> None:
    key = sorted(served.files)[5]
    served.server.fail_next(100, 500, path_contains=key.split("/")[-1], methods=["GET"])
    config = FetchConfig(jobs=4, retries=2, backoff_s=0.01, backoff_max_s=0.02)
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        fetch=config,
        progress=False,
    )
    assert report.failed == 1
    assert report.failures[0]["url"].endswith(key)
    assert report.fetched == len(served.files) - 1


@pytest.mark.parametrize(
    ("status", "error"), [(404, RemoteNotFoundError), (403, RemoteAccessError)]
)
def test_permanent_failures_fail_fast_naming_the_url(
    served: Remote, tmp_path: Path, status, error
) -> None:
    cache_dir = tmp_path / "cache"
    warm(
        served.url,
        cache_dir=str(cache_dir),
        storage_options=served.storage_options,
        keys=[],
        progress=False,
    )  # list first, so the fault hits a GET of an object
    key = sorted(served.files)[5]
    served.server.fail_next(50, status, path_contains=key.split("/")[-1], methods=["GET"])
    with pytest.raises(error, match=key.split("/")[-1]):
        warm(
            served.url,
            cache_dir=str(cache_dir),
            storage_options=served.storage_options,
            fetch=QUICK_RETRIES,
            progress=False,
        )
    assert served.gets(key) <= 2  # no retry storm (s3fs may retry once on its own)


def test_throttling_halves_concurrency_and_it_recovers() -> None:
    from fastload.staging.throttle import Throttle as _Throttle

    t = _Throttle(FetchConfig(jobs=16, min_jobs=2))
    seen = [t.limit]
    t.throttled()
    seen.append(t.limit)
    t._last_cut = 0.0
    t.throttled()
    seen.append(t.limit)
    for _ in range(200):
        t.succeeded()
    seen.append(t.limit)
    assert seen == [16, 8, 4, 16]


# --- budget ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "pin", "plan"])
def test_warm_stays_within_the_budget(remote: Remote, tmp_path: Path, policy) -> None:
    budget = sum(map(len, remote.files.values())) // 2
    report = warm(
        remote.url,
        cache_dir=str(tmp_path),
        storage_options=remote.storage_options,
        max_bytes=budget,
        budget_counts="entries",
        policy=policy,
        progress=False,
    )
    with Cache(tmp_path, budget_counts="entries") as cache:
        assert cache.used_bytes() <= budget
        assert report.fetched + report.skipped == len(remote.files)
        for entry in cache.entries():
            assert checksum_bytes(cache.location_of(entry).read()) == entry.checksum


# --- many processes, and processes killed mid-warm -----------------------------------------

WARM_SCRIPT = """
import sys
from fastload.warm import warm
warm(sys.argv[1], cache_dir=sys.argv[2], progress=False)
"""


def _warm_process(url: str, cache_dir: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", WARM_SCRIPT, url, str(cache_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_eight_processes_warming_one_cache_fetch_each_object_once(tmp_path: Path) -> None:
    with open_remote("http", tmp_path, count=60) as remote:
        remote.server.set_behavior(latency_s=0.02)
        cache_dir = tmp_path / "cache"
        procs = [_warm_process(remote.url, cache_dir) for _ in range(8)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
        assert {k: remote.gets(k) for k in remote.files} == dict.fromkeys(remote.files, 1)
        assert_all_cached_and_right(cache_dir, remote)


@pytest.mark.slow
def test_warm_killed_at_random_points_resumes_without_refetching(tmp_path: Path) -> None:
    rng = random.Random(1)
    with open_remote("http", tmp_path, count=40) as remote:
        remote.server.set_behavior(latency_s=0.01, bandwidth_bytes_per_s=4e6)
        cache_dir = tmp_path / "cache"
        for run in range(20):
            proc = _warm_process(remote.url, cache_dir)
            time.sleep(rng.uniform(0.2, 1.2))
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=30)
            with Cache(cache_dir) as cache:
                # Whatever the index holds is whole and right; nothing partial is visible.
                assert cache.verify(repair=False) == [], f"run {run}"
                done = {e.url for e in cache.entries()}
                # What the killed writer appended but never recorded was cut off on open.
                on_disk = {n: os.path.getsize(p) for n, p in cache.storage.segment_files()}
                assert on_disk == cache.index.segment_sizes(), f"run {run}"
            counts = {k: remote.gets(k) for k in remote.files}
            finish = _warm_process(remote.url, cache_dir)
            _, err = finish.communicate(timeout=120)
            assert finish.returncode == 0, err.decode()
            for key in remote.files:
                url = f"{remote.url.rstrip('/')}/{key}"
                if url in done:
                    assert remote.gets(key) == counts[key], f"{key} refetched after run {run}"
            assert_all_cached_and_right(cache_dir, remote)
            if run % 2 == 0:
                with Cache(cache_dir) as cache:
                    cache.clear()  # start over half the time, so kills land in fresh fetches
            assert not list((cache_dir / "tmp").iterdir())


# --- command line -----------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "fastload")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, check=False)


def test_cli_warm_json_report_then_cache_commands(tmp_path: Path) -> None:
    with open_remote("http", tmp_path) as remote:
        cache_dir = str(tmp_path / "cache")
        dry = run_cli("warm", remote.url, "--cache-dir", cache_dir, "--dry-run", "--json")
        assert dry.returncode == 0, dry.stderr
        assert json.loads(dry.stdout)["bytes"] == sum(map(len, remote.files.values()))
        out = run_cli("warm", remote.url, "--cache-dir", cache_dir, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["fetched"] == len(remote.files)
        assert set(report) >= {"objects", "bytes", "fetched", "already_cached", "failed", "seconds"}

        du = json.loads(run_cli("cache", "du", "--cache-dir", cache_dir, "--json").stdout)
        assert du["bytes"] == sum(map(len, remote.files.values()))
        ls = json.loads(run_cli("cache", "ls", "--cache-dir", cache_dir, "--json").stdout)
        assert len(ls) == len(remote.files)

        with Cache(cache_dir) as cache:
            victim = next(cache.location_of(e) for e in cache.entries() if e.size)
        with open(victim.path, "r+b") as f:
            f.seek(victim.offset)
            f.write(b"\0" * victim.size)
        verify = run_cli("cache", "verify", "--cache-dir", cache_dir, "--json")
        assert verify.returncode == 1
        assert len(json.loads(verify.stdout)["problems"]) == 1
        again = json.loads(run_cli("warm", remote.url, "--cache-dir", cache_dir, "--json").stdout)
        assert again["fetched"] == 1  # the dropped object is refetched, nothing else
        assert run_cli("cache", "verify", "--cache-dir", cache_dir).returncode == 0

        # evict's --max-bytes counts what the budget counts: everything on disk
        counted = json.loads(run_cli("cache", "du", "--cache-dir", cache_dir, "--json").stdout)
        keep = counted["bytes_on_disk"] - 100_000
        evict = run_cli(
            "cache", "evict", "--cache-dir", cache_dir, "--max-bytes", str(keep), "--json"
        )
        assert json.loads(evict.stdout)["evicted"] > 0
        assert json.loads(evict.stdout)["bytes"] <= keep
        clear = run_cli("cache", "clear", "--cache-dir", cache_dir, "--json")
        assert clear.returncode == 0
        assert (
            json.loads(run_cli("cache", "du", "--cache-dir", cache_dir, "--json").stdout)["objects"]
            == 0
        )


def test_cli_warm_failure_exits_1_with_one_line(tmp_path: Path) -> None:
    out = run_cli("warm", str(tmp_path / "nothing-here"), "--cache-dir", str(tmp_path / "c"))
    assert out.returncode == 1
    assert "nothing-here" in out.stderr
    assert out.stderr.count("\n") == 1


# --- large objects, full disks, one-object datasets, progress --------------------------------


def test_large_objects_are_fetched_as_parallel_ranges(served: Remote, tmp_path: Path) -> None:
    big = bytes(range(256)) * 4000  # 1 MB
    served.replace("big/blob.bin", big)
    config = FetchConfig(range_threshold_bytes=200_000, range_bytes=100_000)
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=["big/blob.bin"],
        fetch=config,
        progress=False,
    )
    assert report.fetched == 1
    assert served.gets("big/blob.bin") >= 10  # one GET per range
    assert cached_bytes(tmp_path, served)["big/blob.bin"] == big


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_is_a_clear_error_and_leaves_no_corrupt_entry(
    tmp_path: Path, tiny_disk: Path
) -> None:
    with open_remote("local", tmp_path, count=40) as remote:  # about 3 MB
        with pytest.raises(CacheError, match="no space left") as info:
            warm(remote.url, cache_dir=str(tiny_disk), progress=False)
        assert isinstance(info.value, OSError)
        with Cache(tiny_disk) as cache:
            assert cache.verify(repair=False) == []
            assert cache.entries()  # what fitted stays cached
        assert list((tiny_disk / "tmp").iterdir()) == []


def test_a_url_naming_one_object_is_a_one_object_dataset(remote: Remote, tmp_path: Path) -> None:
    key = sorted(remote.files)[2]
    url = f"{remote.url.rstrip('/')}/{key}"
    if remote.kind == "http":
        url = remote.server.url_for(f"ds/{key}")
    report = warm(
        url, cache_dir=str(tmp_path), storage_options=remote.storage_options, progress=False
    )
    assert (report.objects, report.fetched) == (1, 1)
    assert report.bytes == len(remote.files[key])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_rate_and_eta_on_a_terminal_only() -> None:
    from fastload.progress import Progress, ProgressBar

    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        bar = ProgressBar(2, 2_000_000, stream=stream)
        bar(Progress(objects_done=1, bytes_done=1_000_000, fetched_bytes=1_000_000))
        bar(Progress(objects_done=2, bytes_done=2_000_000, fetched_bytes=2_000_000))
    assert "2/2 objects" in terminal.getvalue()
    assert "MB/s" in terminal.getvalue()
    assert "ETA" in terminal.getvalue()
    assert pipe.getvalue() == ""


@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_random_faults_at_a_rate_still_give_every_byte_right(
    served: Remote, tmp_path: Path, rate
) -> None:
    warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        keys=[],
        progress=False,
    )  # list cleanly; the faults are for the objects
    served.server.set_fault_rate(rate, seed=3)
    config = FetchConfig(jobs=8, retries=20, backoff_s=0.005, backoff_max_s=0.02, timeout_s=10)
    report = warm(
        served.url,
        cache_dir=str(tmp_path),
        storage_options=served.storage_options,
        fetch=config,
        progress=False,
    )
    assert report.ok, report.failures
    assert served.server.stats().faults_injected >= 3
    assert_all_cached_and_right(tmp_path, served)


# --- one node's share -------------------------------------------------------------------------


def _sampler_keys(remote: Remote, cache_dir: Path, ranks, world_size: int, epochs) -> list[str]:
    """The keys the training job's samplers read, in the order a node first needs them."""
    from fastload import ShardedSampler, open_dataset

    ds = open_dataset(
        remote.url, format="files", cache_dir=str(cache_dir), storage_options=remote.storage_options
    )
    streams = {}
    for rank in ranks:
        sampler = ShardedSampler(ds, rank=rank, world_size=world_size, seed=7)
        per_epoch = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            per_epoch.append(list(sampler))
        streams[rank] = per_epoch
    order = []
    for e in range(len(epochs)):
        for step in range(len(streams[ranks[0]][e])):
            order += [ds.keys[streams[r][e][step]] for r in ranks]
    return list(dict.fromkeys(order))


@pytest.mark.parametrize(("ranks", "world_size"), [((0,), 2), ((1, 2), 4), ((0,), 1)])
def test_warming_a_node_share_stages_exactly_what_its_ranks_read(
    served: Remote, tmp_path: Path, ranks, world_size
) -> None:
    from fastload.warm import NodeShare

    expected = _sampler_keys(served, tmp_path / "probe", ranks, world_size, (0, 1))
    share = NodeShare(ranks=ranks, world_size=world_size, epochs=(0, 1), format="files", seed=7)
    staging = share.staging(
        served.url, cache_dir=str(tmp_path / "probe"), storage_options=served.storage_options
    )
    assert staging.keys == expected  # the order they will first be read in
    assert staging.ranges == []
    assert staging.accesses is not None
    assert len(staging.accesses) >= len(expected)
    report = warm(
        served.url,
        cache_dir=str(tmp_path / "c"),
        storage_options=served.storage_options,
        share=share,
        policy="plan",
        progress=False,
    )
    assert report.fetched == len(expected)
    assert {k for k in served.files if served.gets(k)} == set(expected)


def test_cli_warms_a_node_share(tmp_path: Path) -> None:
    with open_remote("http", tmp_path, count=40) as remote:
        expected = _sampler_keys(remote, tmp_path / "probe", (0,), 4, (0,))
        out = run_cli(
            "warm",
            remote.url,
            "--cache-dir",
            str(tmp_path / "c"),
            "--format",
            "files",
            "--rank",
            "0",
            "--world-size",
            "4",
            "--epochs",
            "0",
            "--seed",
            "7",
            "--json",
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["fetched"] == len(expected)
        assert {k for k in remote.files if remote.gets(k)} == set(expected)


def test_a_missing_package_fails_at_once_naming_the_url_and_the_extra(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ImportError from the transport is not a network hiccup: no retries (a bare
    install's warm once retried `No module named 'aiohttp'` six times)."""
    import fastload.staging.stager as stage

    calls = []

    class NeedsAPackage:
        def get(
            self, path: str, start: int | None = None, end: int | None = None, pin: object = None
        ) -> bytes:
            calls.append(path)
            raise ModuleNotFoundError("No module named 'aiohttp'")

        def find(self, root: str) -> None:
            return None

    monkeypatch.setattr(stage, "transport_for", lambda *a, **k: NeedsAPackage())
    key = sorted(remote.files)[0]
    with pytest.raises(MissingBackendError, match=r"(?s)aiohttp.*fastload\[s3\]") as raised:
        warm(
            remote.url,
            cache_dir=str(tmp_path / "cache"),
            storage_options=remote.storage_options,
            keys=[key],
            # In this process, where the transport is replaced.
            fetch=dataclasses.replace(QUICK_RETRIES, staging_process=False),
            progress=False,
        )
    assert key.split("/")[-1] in str(raised.value)
    assert len(calls) == 1
