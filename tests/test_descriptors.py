"""A long-lived process does not collect descriptors: a loader nobody closed leaves none of
its cache's files open once it is gone, and the code that waits on a child's pipe works
when that pipe's descriptor is past 1023 (``select.select`` refuses those; a training
process, or a long test run, can hold that many)."""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest
from image_folders import jpeg_folder

import fastload as fl
from fastload.bench.components import loader_bench
from fastload.bench.components.loader_bench_setup import LoaderBenchConfig
from fastload.decode import TrainPreset
from fastload.diagnosis.node_ranks import _Child as RankChild

HIGH_FD = 1100


def _open_under(folder: Path) -> list[str]:
    """This process's descriptors of files under folder."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


@pytest.fixture
def jpegs(tmp_path: Path) -> Path:
    return jpeg_folder(tmp_path / "images", 24, size=32, class_name="clåss")  # UTF-8 names


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_nobody_closed_leaves_no_cache_file_open(
    jpegs: Path, tmp_path: Path, workers: int
) -> None:
    """The loader stages into its cache (a segment being appended, the fetch-lock file,
    the index) and is then dropped without ``close()``, as most scripts do: nothing of the
    cache stays open. Before, an idle GET thread kept the last round it served, and with it
    the cache; a dropped cache kept its segment's descriptor; the fetch-lock file stayed
    open for the life of the process, one per cache ever used."""
    cache = tmp_path / "cache"
    loader = fl.DataLoader(
        str(jpegs),
        batch_size=4,
        num_workers=workers,
        decode="cpu",
        transform=TrainPreset(16),
        cache_dir=str(cache),
    )
    assert sum(len(labels) for _, labels in loader) == 24
    assert any(cache.glob("segments/*.seg"))  # it did stage
    del loader
    deadline = time.monotonic() + 60  # worker processes and threads wind down on their own
    while (left := _open_under(cache)) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert left == []


@pytest.fixture
def descriptors_past_1023() -> Iterator[None]:
    """Holds descriptors until the next one opened is past HIGH_FD."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < HIGH_FD + 100:
        if hard != resource.RLIM_INFINITY and hard < HIGH_FD + 100:
            pytest.skip(f"this process may open only {hard} files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (HIGH_FD + 100, hard))
    held = []
    try:
        while not held or held[-1] < HIGH_FD:
            held.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("descriptors_past_1023")
def test_the_loader_benchmark_reads_its_child_past_descriptor_1023(tmp_path: Path) -> None:
    spec = {
        "case": "zarr",
        "system": "torch DataLoader + zarr-python",
        "config": asdict(LoaderBenchConfig()),
        "data": {"zarr_dir": str(tmp_path / "missing"), "cache_dir": str(tmp_path)},
    }
    child = loader_bench._Child(spec, timeout_s=120)
    try:
        assert child._proc.stdout is not None
        assert child._proc.stdout.fileno() > 1023
        child.ask(None)  # select.select raised "filedescriptor out of range" here
    finally:
        child.close()


@pytest.mark.usefixtures("descriptors_past_1023")
def test_the_doctor_reads_a_rank_process_past_descriptor_1023() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", "print('noise'); print('ready', flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    with tempfile.TemporaryFile() as errors:
        try:
            assert process.stdout is not None
            assert process.stdout.fileno() > 1023
            child = RankChild(process, errors, rank=0)
            assert child.expect("ready", time.monotonic() + 60)
        finally:
            process.kill()
            process.wait(timeout=30)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    pipe.close()
