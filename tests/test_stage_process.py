"""Staging in a process of its own (fastload.staging.process): real child processes, a real
S3 server (moto) and HTTP server, SIGKILL for the crash cases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Remote, open_remote

from fastload.bench.runner import process_tree
from fastload.cache import Cache
from fastload.errors import CacheError, RemoteNotFoundError
from fastload.manifest import RemoteObject
from fastload.staging import FetchConfig
from fastload.staging import process as stage_process
from fastload.staging.process import close_all
from fastload.store import CachedStore

QUICK = FetchConfig(
    jobs=8, retries=2, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10, staging_process=True
)


@pytest.fixture(autouse=True)
def _staging_processes_closed() -> Iterator[None]:
    """A staging process lives as long as the process that started it (every store of its
    settings reuses it); a test's are closed at its end, as they are at exit."""
    yield
    close_all()


@pytest.fixture(params=["s3", "http"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    with open_remote(request.param, tmp_path) as r:
        yield r


def staging_children() -> list[int]:
    """This process's staging processes, alive now."""
    found = []
    for pid in process_tree(os.getpid())[1:]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"fastload.staging.process_main" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def open_store(remote: Remote, cache_dir: Path) -> CachedStore:
    return CachedStore.open(
        remote.url, cache_dir=str(cache_dir), storage_options=remote.storage_options, fetch=QUICK
    )


def test_objects_are_staged_by_a_child_process_once_each(served: Remote, tmp_path: Path) -> None:
    before = set(staging_children())
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    results = store.stage(keys)
    assert {r.outcome for r in results} == {"fetched"}
    assert [r.url for r in results] == [store.object_url(k) for k in keys]
    assert set(staging_children()) - before, "no staging process ran the round"
    assert all(served.gets(k) == 1 for k in keys)
    with Cache(tmp_path / "cache") as cache:
        for key in keys:
            path = cache.lookup(store.object_url(key))
            assert path is not None
            assert path.read_bytes() == served.files[key]
    again = store.stage(keys)  # the same process answers, from the cache
    assert {r.outcome for r in again} == {"cached"}
    assert all(served.gets(k) == 1 for k in keys)


def test_a_permanent_failure_is_raised_here_as_the_same_error(
    served: Remote, tmp_path: Path
) -> None:
    store = open_store(served, tmp_path / "cache")
    store.object_keys()
    gone = RemoteObject("no/such/object.bin", 10, None)
    with pytest.raises(RemoteNotFoundError, match=r"no/such/object\.bin") as info:
        store.stager.stage([gone])
    assert info.value.filename is not None
    # The process lives on and serves the next round.
    (result,) = store.stage([sorted(served.files)[0]])
    assert result.outcome == "fetched"


def _round_in_thread(store: CachedStore, keys: list[str]) -> tuple[Any, list[Any]]:
    outcome: list[Any] = []

    def round_() -> None:
        try:
            outcome.append(store.stage(keys))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=round_)
    thread.start()
    return thread, outcome


def test_a_staging_process_killed_mid_round_is_replaced_and_the_round_completes(
    served: Remote, tmp_path: Path
) -> None:
    before = set(staging_children())
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    store.stage(keys[:1])
    (child,) = set(staging_children()) - before
    assert served.server is not None
    served.server.set_behavior(latency_s=0.3)  # a round in flight for a while
    thread, outcome = _round_in_thread(store, keys[1:])
    time.sleep(0.15)
    os.kill(child, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    (results,) = outcome
    assert [r.url for r in results] == [store.object_url(k) for k in keys[1:]]
    assert {r.outcome for r in results} <= {"fetched", "cached"}
    with Cache(tmp_path / "cache") as cache:
        assert cache.verify(repair=False) == []
        for key in keys:
            path = cache.lookup(store.object_url(key))
            assert path is not None
            assert path.read_bytes() == served.files[key]


def test_a_staging_process_that_keeps_dying_fails_the_round_clearly(
    served: Remote, tmp_path: Path
) -> None:
    before = set(staging_children())
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    assert served.server is not None
    served.server.set_behavior(latency_s=0.3)
    thread, outcome = _round_in_thread(store, keys)
    killed: set[int] = set()
    while thread.is_alive():  # kill every staging process the round starts
        for pid in set(staging_children()) - before - killed:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        time.sleep(0.02)
    (error,) = outcome
    assert isinstance(error, CacheError)
    assert "ended twice during one round" in str(error)
    # Two per round, and the one started at the listing where it died before the round.
    assert 2 <= len(killed) <= 3


def test_progress_reaches_the_callback_with_exact_totals(served: Remote, tmp_path: Path) -> None:
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    seen: list[tuple[int, int]] = []
    store.stager.stage(
        [store.object(k) for k in keys],
        progress=lambda p: seen.append((p.objects_done, p.fetched_bytes)),
    )
    assert seen[-1] == (len(keys), sum(len(v) for v in served.files.values()))


def test_the_staging_process_dies_with_its_parent(served: Remote, tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, sys, time
            from fastload.staging import FetchConfig
            from fastload.store import CachedStore
            store = CachedStore.open({served.url!r}, cache_dir={str(tmp_path / "cache")!r},
                                     storage_options={served.storage_options!r},
                                     fetch=FetchConfig(staging_process=True))
            store.stage(store.object_keys()[:2])
            print("staged", flush=True)
            time.sleep(600)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "staged"
        children = [
            pid
            for pid in process_tree(parent.pid)[1:]
            if b"fastload.staging.process_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        assert children, "the parent staged without a staging process"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        alive = children
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [pid for pid in children if _alive(pid)]
        assert alive == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, only not reaped (its parent was the test's child)


def test_a_forked_child_stages_in_its_own_threads(served: Remote, tmp_path: Path) -> None:
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    store.stage(keys[:1])  # this process has a staging process now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what a DataLoader worker does on a miss
        try:
            before = set(staging_children())
            ok = store.stage(keys[1:3])[0].outcome == "fetched"
            ok = ok and set(staging_children()) == before
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        assert f.read() == b"1"
    assert os.waitstatus_to_exitcode(status) == 0


def test_processes_are_closed_at_exit_of_the_parent(tmp_path: Path) -> None:
    """The atexit hook ends every staging process this process started."""
    with open_remote("http", tmp_path) as served:
        store = open_store(served, tmp_path / "cache")
        store.stage(store.object_keys()[:1])
        children = staging_children()
        assert children
        stage_process.close_all()
        assert not [pid for pid in children if _alive(pid)]


def test_a_process_started_ahead_says_when_it_is_ready_and_then_stages(
    served: Remote, tmp_path: Path
) -> None:
    """Started at the listing, the process is ready once started up (staging goes on here
    until then); a round then goes to it."""
    before = set(staging_children())
    store = open_store(served, tmp_path / "cache")
    keys = store.object_keys()
    (child,) = set(staging_children()) - before  # started by the listing
    process = stage_process.for_stager(
        store.stager.fs, store.stager.root, store.cache.config, store.config.fetch
    )
    deadline = time.monotonic() + 120
    while not process.ready():
        assert time.monotonic() < deadline, "the staging process never said it was ready"
        time.sleep(0.05)
    results = store.stager.stage(store.objects(keys))
    assert {r.outcome for r in results} == {"fetched"}
    assert set(staging_children()) - before == {child}  # the same process did the round


def test_readiness_is_read_on_a_descriptor_past_1023(served: Remote, tmp_path: Path) -> None:
    """A training process may hold over a thousand open files: the staging process's pipe
    then gets a descriptor select() refuses (CI's pytest process reached it)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"the open-file limit ({soft}) is below the descriptors this needs")
    filler = []
    try:
        while not filler or filler[-1] < 1100:  # the pipes opened next get higher numbers
            filler.append(os.open(os.devnull, os.O_RDONLY))
        store = open_store(served, tmp_path / "cache")
        keys = store.object_keys()
        process = stage_process.for_stager(
            store.stager.fs, store.stager.root, store.cache.config, store.config.fetch
        )
        deadline = time.monotonic() + 120
        while not process.ready():
            assert time.monotonic() < deadline, "the staging process never said it was ready"
            time.sleep(0.05)
        results = store.stager.stage(store.objects(keys))
        assert {r.outcome for r in results} == {"fetched"}
    finally:
        for fd in filler:
            os.close(fd)
