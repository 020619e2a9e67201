"""``fl.DataLoader`` when things go wrong: errors reach the training loop naming what failed,
and nothing hangs or stays behind (threads, worker processes, a broken cache, a process that
cannot exit). Every wait here is bounded; none of the bounds is a performance claim.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_loader import (
    SIZE,
    TOTAL,
    Source,
    raw_indices,
    served,
    write_source,
)
from torch.utils.data import Dataset

import fastload as fl
from fastload.cache import Cache
from fastload.decode import DecodeError, EvalPreset, TrainPreset
from fastload.errors import RemoteError
from fastload.staging import FetchConfig
from fastload.testing import RangeHTTPServer

# Bounds for waits that must end (threads finishing the sample in hand, a process exiting).
SETTLE_S = 30.0
SUBPROCESS_S = 120.0
CORRUPT = 25  # the truncated image of the corrupt source (class_1/img_05.jpg)


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = SETTLE_S) -> None:
    """Polls ``done`` until it holds; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"still waiting after {timeout_s:.0f}s for {what}")
        time.sleep(0.02)


# Threads of the process, not of a loader: the stager's GET threads and the range pool are
# kept across staging calls and loaders (their start costs a GIL hand-off each), and grow to
# what the largest round asked, so a test may see them start and never end.
PROCESS_POOLS = ("fastload-get", "fastload-range")


def threads_now() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if t.name.startswith("fastload") and not t.name.startswith(PROCESS_POOLS)
    }


def children_now() -> set[Any]:
    return set(multiprocessing.active_children())


def threads_end(before: set[threading.Thread]) -> None:
    """Waits until the fastload threads started since ``before`` have ended."""

    def left() -> list[str]:
        return sorted(t.name for t in threads_now() - before)

    wait_until(lambda: not left(), f"fastload threads to end: {left()}")


def children_end(before: set[Any], timeout_s: float = SETTLE_S) -> None:
    """Waits until the worker processes started since ``before`` have ended."""

    def left() -> list[Any]:
        return list(children_now() - before)

    wait_until(lambda: not left(), f"worker processes to end: {left()}", timeout_s)


@pytest.fixture(autouse=True)
def _no_thread_left_behind() -> Iterator[None]:
    """No test leaves a loader thread of its own behind (those of an earlier, failed test,
    which its traceback may keep alive, are not this test's). Worker processes are checked
    where a test is about them: after an error in a worker, torch's own loader takes ~10 s
    to reap its workers, and fl.DataLoader, which delegates to it, the same."""
    threads = threads_now()
    yield
    gc.collect()
    threads_end(threads)


def consume(batches: Iterable[Any], into: list[Any] | None = None) -> None:
    """Iterates to the end (inside pytest.raises: the error must come out of here)."""
    for batch in batches:
        if into is not None:
            into.append(batch)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    return write_source(tmp_path_factory.mktemp("jpegs"), seed=2)


@pytest.fixture(scope="module")
def corrupt_source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    return write_source(tmp_path_factory.mktemp("corrupt"), seed=3, corrupt=CORRUPT)


# ---------------------------------------------------------------------------------------------
# Errors in a stage reach the loop
# ---------------------------------------------------------------------------------------------


class Faulty(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 13:
            raise ValueError(f"sample {index} is broken")
        return torch.tensor(index)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_getitem_of_a_plain_dataset_reaches_the_loop(workers: int) -> None:
    loader = fl.DataLoader(Faulty(), batch_size=4, num_workers=workers)
    for _ in range(2):  # and again on the next pass: the loader is still usable
        seen: list[torch.Tensor] = []
        with pytest.raises(ValueError, match="sample 13 is broken"):
            consume(loader, into=seen)
        assert torch.cat(seen).tolist() == list(range(12))  # the batches before, in order
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_an_error_in_collate_on_the_fast_path_names_the_stage_and_batch(
    source: Source, tmp_path: Path, workers: int
) -> None:
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))

    def collate(samples: list[Any]) -> list[Any]:
        if any(label == 2 for _, label in samples):
            raise KeyError("no class 2 here")
        return samples

    loader = fl.DataLoader(dataset, batch_size=10, num_workers=workers, collate_fn=collate)
    with pytest.raises(KeyError, match="no class 2 here") as caught:
        consume(loader)
    assert "fastload: raised in the collate stage, batch 4" in caught.value.__notes__
    del caught
    loader.close()


@pytest.mark.parametrize("kind", ["local", "http"])
@pytest.mark.parametrize("layout", ["folder", "tars"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_jpeg_raises_a_decode_error_naming_its_url(
    corrupt_source: Source, tmp_path: Path, kind: str, layout: str, workers: int
) -> None:
    with served(kind, corrupt_source) as where:
        dataset = where.open(layout, tmp_path / "cache")
        loader = fl.DataLoader(
            dataset,
            batch_size=8,
            shuffle=True,
            num_workers=workers,
            decode="cpu",
            transform=EvalPreset(SIZE),
        )
        with pytest.raises(DecodeError) as caught:
            consume(loader)
        loader.close()
    message = str(caught.value)
    if layout == "folder":
        assert f"{where.url('folder')}/class_1/img_05.jpg" in message
    else:  # the sample's key, in the shard that holds it
        assert f"sample{CORRUPT:04d} in {where.url('tars')}/shard-" in message
    assert "truncated or corrupt JPEG" in message
    assert "on_error='skip'" in message  # what to do about it


@pytest.mark.parametrize("layout", ["folder", "tars"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_jpeg_is_skipped_with_full_batches_and_counted(
    corrupt_source: Source, tmp_path: Path, layout: str, workers: int
) -> None:
    dataset = fl.open_dataset(str(corrupt_source.root / layout), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=workers,
        decode="cpu",
        transform=TrainPreset(SIZE),
        on_error="skip",
    )
    for epoch in range(2):
        batches = list(loader)
        assert [len(labels) for _, labels in batches] == [8] * 7 + [4]  # full-sized
        assert all(images.shape[0] == len(labels) for images, labels in batches)
        assert all(torch.isfinite(images).all() for images, _ in batches)
        stats = loader.stats()
        assert stats["skipped_samples"] == epoch + 1
        assert stats["samples"] == TOTAL * (epoch + 1)
    assert len(stats["skipped_examples"]) == 2
    assert all("img_05.jpg" in e or f"sample{CORRUPT:04d}" in e for e in stats["skipped_examples"])
    loader.close()


# ---------------------------------------------------------------------------------------------
# The remote stops answering
# ---------------------------------------------------------------------------------------------


def _stalling_loader(dataset: Any, workers: int, **extra: Any) -> Any:
    """A loader that stages little ahead, so most fetches happen after the stall."""
    return fl.DataLoader(
        dataset,
        batch_size=4,
        num_workers=workers,
        decode="cpu",
        transform=EvalPreset(SIZE),
        prefetch_batches=1,
        lookahead_bytes=0,
        **extra,
    )


FAST_FAILING = FetchConfig(timeout_s=0.5, retries=1, backoff_s=0.01)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_remote_that_stops_answering_mid_epoch_is_an_error_naming_the_url(
    source: Source, tmp_path: Path, kind: str, workers: int
) -> None:
    before = threads_now()
    with served(kind, source) as where:
        assert where.server is not None
        dataset = where.open("folder", tmp_path / "cache", fetch=FAST_FAILING)
        loader = _stalling_loader(dataset, workers)
        it = iter(loader)
        next(it)
        where.server.set_behavior(latency_s=3600)  # every request from now on hangs
        with pytest.raises(RemoteError) as caught:
            consume(it)
        message = str(caught.value)
        del caught, it
        loader.close()
        threads_end(before)  # the stuck fetches time out; their threads end
        where.server.set_behavior(latency_s=0)
    assert where.url("folder") in message
    assert "could not be fetched" in message


def test_the_loaders_timeout_ends_a_wait_on_a_stalled_remote(
    source: Source, tmp_path: Path
) -> None:
    """The fetch timeout is long here (60 s): the loader's own ``timeout`` bounds the wait."""
    before = threads_now()
    with served("http", source) as where:
        assert where.server is not None
        patient = FetchConfig(timeout_s=60, retries=1, backoff_s=0.01)
        dataset = where.open("folder", tmp_path / "cache", fetch=patient)
        loader = _stalling_loader(dataset, 2, timeout=1)
        it = iter(loader)
        next(it)
        where.server.set_behavior(latency_s=3600)
        with pytest.raises(RuntimeError, match="timed out after 1"):
            consume(it)
        del it
        loader.close()
        where.server.close()  # the hanging requests fail now, and the threads end
        threads_end(before)


def test_a_server_that_goes_away_mid_epoch_is_an_error_not_a_hang(
    source: Source, tmp_path: Path
) -> None:
    with served("http", source) as where:
        assert isinstance(where.server, RangeHTTPServer)
        dataset = where.open("folder", tmp_path / "cache", fetch=FAST_FAILING)
        loader = _stalling_loader(dataset, 2)
        it = iter(loader)
        next(it)
        where.server.close()
        with pytest.raises(RemoteError, match=r"127\.0\.0\.1"):
            consume(it)
        del it
        loader.close()


# ---------------------------------------------------------------------------------------------
# Leaving a loop early; dead workers
# ---------------------------------------------------------------------------------------------


class _Interrupt(Exception):
    """Stands in for KeyboardInterrupt (which pytest itself would act on)."""


@pytest.mark.parametrize("how", ["break", "exception"])
def test_leaving_the_loop_early_and_dropping_the_loader_leaves_no_thread(
    source: Source, tmp_path: Path, how: str
) -> None:
    before = threads_now()
    dataset = fl.open_dataset(str(source.root / "tars"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        num_workers=2,
        decode="cpu",
        transform=TrainPreset(SIZE),
    )
    try:
        for step, _ in enumerate(loader):
            assert threads_now() - before  # the pipeline is running
            if step == 2:
                if how == "break":
                    break
                raise _Interrupt
    except _Interrupt:
        pass
    del loader  # no close(), no gc.collect(): dropping it must be enough
    threads_end(before)


@pytest.mark.parametrize("how", ["break", "exception"])
def test_leaving_the_loop_early_on_the_torch_path_leaves_no_worker(how: str) -> None:
    before = children_now()
    loader = fl.DataLoader(Faulty(), batch_size=2, num_workers=2)
    try:
        for step, _ in enumerate(loader):
            assert children_now() - before
            if step == 2:
                if how == "break":
                    break
                raise _Interrupt
    except _Interrupt:
        pass
    del loader
    children_end(before)


def test_close_stops_the_worker_processes_of_a_pass_in_progress() -> None:
    """close() "stops every thread and worker of this loader", also while the training loop
    still holds the iterator (e.g. in a local variable of a frame being unwound)."""
    before = children_now()
    loader = fl.DataLoader(Faulty(), batch_size=2, num_workers=2)
    it = iter(loader)
    next(it)
    assert len(children_now() - before) == 2
    loader.close()
    try:
        children_end(before, timeout_s=10)  # torch's shutdown takes well under a second
        # The pass ends (torch may still hand out the batches it had received), no hang.
        rest: list[torch.Tensor] = []
        reader = threading.Thread(target=consume, args=(it, rest), daemon=True)
        reader.start()
        reader.join(SETTLE_S)
        assert not reader.is_alive(), "iterating a closed loader's pass hangs"
        assert len(rest) <= 2 * 2  # prefetch_factor x num_workers at most
    finally:
        del it


class Suicidal(Dataset[torch.Tensor]):
    """Kills its own worker process with SIGKILL at one sample, or records worker pids."""

    def __init__(self, kill_at: int | None, pid_dir: Path | None = None) -> None:
        self.kill_at = kill_at
        self.pid_dir = pid_dir

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.pid_dir is not None:
            (self.pid_dir / str(os.getpid())).touch()
            time.sleep(0.02)  # slow enough that the test kills a worker mid-epoch
        return torch.tensor(index)


# torch reports a dead worker in more than one way, depending on when it notices.
WORKER_DIED = (RuntimeError, OSError, EOFError)


def _drain(loader: Any) -> str:
    """Iterates to the end, expecting the error a dead worker causes; returns its text."""
    it = iter(loader)
    try:
        with pytest.raises(WORKER_DIED) as caught:
            consume(it)
        return f"{type(caught.value).__name__}: {caught.value}"
    finally:
        # Drop every reference to torch's iterator now, so that it shuts its workers down
        # and its SIGCHLD handler stops watching the dead one.
        del it
        loader.close()
        gc.collect()


def test_a_worker_killed_by_sigkill_from_the_dataset_is_an_error() -> None:
    loader = fl.DataLoader(Suicidal(kill_at=21), batch_size=4, num_workers=2)
    assert _drain(loader)


def test_a_worker_killed_by_sigkill_from_outside_is_an_error(tmp_path: Path) -> None:
    loader = fl.DataLoader(Suicidal(None, tmp_path), batch_size=4, num_workers=2)
    it = iter(loader)
    next(it)
    wait_until(lambda: any(tmp_path.iterdir()), "a worker to record its pid")
    victim = int(next(tmp_path.iterdir()).name)

    def kill_and_go_on(batches: Iterator[Any]) -> None:
        # torch's SIGCHLD handler may raise as soon as the worker is gone: from here on.
        os.kill(victim, signal.SIGKILL)
        consume(batches)

    try:
        with pytest.raises(WORKER_DIED):
            kill_and_go_on(it)
    finally:
        del it
        loader.close()
        gc.collect()


# ---------------------------------------------------------------------------------------------
# Whole processes: killed mid-epoch, exiting without close()
# ---------------------------------------------------------------------------------------------


TRAINING_SCRIPT = """
import sys
import fastload as fl
from fastload.staging import FetchConfig

url, cache = sys.argv[1], sys.argv[2]
# Two fetches at a time and little staged ahead: the epoch takes a while to fetch.
dataset = fl.open_dataset(url, cache_dir=cache, fetch=FetchConfig(jobs=2, min_jobs=1))
loader = fl.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=2, collate_fn=list,
                       prefetch_batches=1, lookahead_bytes=0)
for step, batch in enumerate(loader):
    print(f"step {step}", flush=True)
print("finished", flush=True)
"""


def _read_line_until(proc: subprocess.Popen[str], wanted: str, timeout_s: float) -> None:
    """Reads the child's stdout until a line equals ``wanted``; bounded by ``timeout_s``."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == wanted:
                found.set()
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not found.wait(timeout_s):
        proc.kill()
        proc.wait(SUBPROCESS_S)
        pytest.fail(f"the child never printed {wanted!r}; it printed {lines}")


def test_a_training_process_killed_mid_epoch_leaves_the_cache_usable(
    source: Source, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT)
    cache = tmp_path / "cache"
    with served("http", source) as where:
        assert where.server is not None
        # Slow bodies: when the child dies, many fetches are half-way through.
        where.server.set_behavior(bandwidth_bytes_per_s=4000)
        with subprocess.Popen(
            [sys.executable, str(script), where.url("folder"), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as proc:
            _read_line_until(proc, "step 0", SUBPROCESS_S)
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(SUBPROCESS_S) == -signal.SIGKILL

        with Cache(str(cache)) as survivor:
            assert survivor.verify(repair=False) == []  # nothing partial was published
            cached = len(survivor.entries())
        assert 8 <= cached < TOTAL  # killed mid-epoch: some fetched, some not
        where.server.set_behavior(bandwidth_bytes_per_s=None)
        where.server.reset_stats()

        # The next run (here, in this process) uses what is cached and fetches the rest.
        loader = fl.DataLoader(
            where.url("folder"),
            batch_size=8,
            shuffle=True,
            num_workers=2,
            collate_fn=list,
            cache_dir=str(cache),
        )
        seen = [i for batch in loader for i in raw_indices(source, batch)]
        loader.close()
        image_gets = sum(
            n for (m, p), n in where.server.stats().requests.items() if p.endswith(".jpg")
        )
    assert sorted(seen) == list(range(TOTAL))  # every byte as the source has it
    assert image_gets == TOTAL - cached
    with Cache(str(cache)) as after:
        assert after.verify(repair=False) == []
        assert len(after.entries()) == TOTAL


EXITING_SCRIPT = """
import sys, time
import torch
import fastload as fl
from fastload.testing import RangeHTTPServer

path, cache, kind = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "fastload":
    server = RangeHTTPServer(path)
    loader = fl.DataLoader(server.url_for("folder"), batch_size=4, shuffle=True, num_workers=2,
                           decode="cpu", transform=fl.decode.TrainPreset(32), cache_dir=cache,
                           prefetch_batches=1, lookahead_bytes=0)
else:
    loader = fl.DataLoader(torch.utils.data.TensorDataset(torch.arange(1000)), batch_size=4,
                           shuffle=True, num_workers=2, persistent_workers=kind == "persistent")
ITERATOR = iter(loader)
next(ITERATOR)
next(ITERATOR)
if kind == "fastload":
    server.set_behavior(latency_s=3600)  # the loader's threads now wait on the remote
    time.sleep(0.5)
print("leaving without close()", flush=True)
"""


@pytest.mark.parametrize("kind", ["fastload", "torch", "persistent"])
def test_a_process_that_exits_without_closing_its_loader_exits_promptly(
    source: Source, tmp_path: Path, kind: str
) -> None:
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent(EXITING_SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(source.root), str(tmp_path / "cache"), kind],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_S,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leaving without close()"
    assert "Traceback" not in done.stderr, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "leaked" not in done.stderr, done.stderr  # nanobind's report of live native objects


# ---------------------------------------------------------------------------------------------
# Memory across epochs
# ---------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_memory_and_open_files_stay_flat_across_epochs(source: Source, tmp_path: Path) -> None:
    """After a warm-up, 12 more epochs, measured after each: what a loader keeps per epoch
    would add up (a batch here is 96 KiB of pixels, an epoch makes 8 and opens its threads
    anew). Python objects (tracemalloc), file descriptors and resident memory. A trend, not
    a total: the median growth from one epoch to the next (what a leak adds every epoch)
    must be near nothing; allocator noise and caches that fill up once on a busy machine
    (62 KB once broke a 48 KB bound on the total) move a few epochs, not the median."""
    dataset = fl.open_dataset(str(source.root / "folder"), cache_dir=str(tmp_path))
    loader = fl.DataLoader(
        dataset,
        batch_size=8,
        shuffle=True,
        num_workers=2,
        decode="cpu",
        transform=TrainPreset(SIZE),
    )

    def epoch() -> None:
        for images, _ in loader:
            assert images.shape == (len(images), 3, SIZE, SIZE)

    def measure() -> tuple[int, int, int]:
        gc.collect()
        return tracemalloc.get_traced_memory()[0], _open_files(), _rss_bytes()

    tracemalloc.start()
    samples = []
    try:
        for _ in range(3):
            epoch()
        samples.append(measure())
        for _ in range(12):
            epoch()
            samples.append(measure())
    finally:
        tracemalloc.stop()
        loader.close()
    python, files, rss = (np.array(column, dtype=np.int64) for column in zip(*samples, strict=True))
    assert files.max() - files[0] <= 2, f"open files after each epoch: {files.tolist()}"
    heap_step = int(np.median(np.diff(python)))
    assert heap_step < 4 << 10, f"Python heap grows {heap_step} B an epoch: {python.tolist()}"
    rss_step = int(np.median(np.diff(rss)))
    assert rss_step < 512 << 10, f"resident memory grows {rss_step} B an epoch: {rss.tolist()}"
