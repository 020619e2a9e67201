"""Staging with no FetchConfig at all, as a user who sets nothing gets it: remote objects go
through a staging process, so a training step that holds the GIL keeps it, started only
where it will be used (a file folder's open starts it while the dataset is listed; a round
missing more than a chunk of objects otherwise; never for tar shards, Parquet files, a plan
cache's loader, a cached warm). Each case runs in a fresh interpreter (this one has the GET
threads of earlier tests), against a real S3 (moto, or the S3 folder server) or HTTP
server; its staging processes are counted as its children."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Remote, open_remote
from test_dataset_tar import serve, webdataset_shards

from fastload.staging.lifetime import env_for_child

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import fastload as fl
    from fastload.staging import FetchConfig
    from fastload.staging.process import for_stager
    from fastload.store import CachedStore

    url, cache, options, what = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]

    def staging_processes():
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except (OSError, ValueError):
                continue
            if parent == os.getpid() and b"fastload.staging.process_main" in cmdline:
                found.append(int(pid))
        return found

    report = got = format = None
    if what.startswith("warm"):
        store = CachedStore.open(url, cache_dir=cache, storage_options=options)
        store.manifest  # the listing
        at_listing = staging_processes()
        if what == "warm-when-ready":  # started as open_dataset starts a file folder's
            store.start_staging_process()
            fetch = store.stager.config
            process = for_stager(store.stager.fs, store.stager.root, store.cache.config, fetch)
            while not process.ready():
                time.sleep(0.05)
        elif what == "warm-cached":  # everything cached first, by a warm in this process
            here = FetchConfig(staging_process=False)
            fl.warm(url, cache_dir=cache, storage_options=options, progress=False, fetch=here)
            fl.warm(url, cache_dir=cache, storage_options=options, dry_run=True, progress=False)
        report = fl.warm(url, cache_dir=cache, storage_options=options, progress=False)
    else:  # "loader FORMAT POLICY": an epoch of a loader that stages ahead
        _, format, policy = what.split()
        budget = {"policy": "plan", "max_bytes": 1 << 30} if policy == "plan" else {}
        ds = fl.open_dataset(
            url, format=format, cache_dir=cache, storage_options=options, **budget
        )
        at_listing = staging_processes()
        with fl.DataLoader(
            ds, batch_size=4, shuffle=True, collate_fn=list, num_workers=2
        ) as dl:
            got = [s for batch in dl for s in batch]
    print(json.dumps({
        "at_listing": len(at_listing),
        "at_end": len(staging_processes()),
        "get_threads": sum(t.name == "fastload-get" for t in threading.enumerate()),
        "fetched": report.fetched if report else None,
        "cached": report.already_cached if report else None,
        "failed": report.failed if report else None,
        "count": None if got is None else len(got),
        "samples": None if got is None or isinstance(got[0], dict) else [
            bytes(s).hex() for s in got
        ],
    }), flush=True)
    """
)


@pytest.fixture(params=["s3", "http"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    with open_remote(request.param, tmp_path) as r:
        yield r


def run_defaults(served: Remote, cache: Path, what: str) -> dict[str, object]:
    args = [served.url, str(cache), json.dumps(served.storage_options), what]
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env_for_child(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_default_warm_stages_in_the_started_process(served: Remote, tmp_path: Path) -> None:
    """Once started (as open_dataset starts a file folder's) and ready, the default stages
    there: not one GET from the training process."""
    result = run_defaults(served, tmp_path / "cache", "warm-when-ready")
    assert result["at_listing"] == 0  # a plain store's listing starts nothing
    assert result["at_end"] == 1
    assert result["fetched"] == len(served.files)
    assert result["failed"] == 0
    assert result["get_threads"] == 0  # not one object was fetched in the training process
    assert all(served.gets(key) == 1 for key in served.files)


def test_a_default_warm_of_many_objects_starts_the_process_and_does_not_wait_for_it(
    tmp_path: Path,
) -> None:
    """More missing objects than a chunk: the warm's round starts the process, and stages
    here a chunk at a time while it starts up (there once it is ready): each object once,
    whichever staged it."""
    with serve("s3", tmp_path, small_objects(300), s3_folder=True) as remote:
        result = run_defaults(remote, tmp_path / "cache", "warm")
        assert result["at_listing"] == 0  # not started by the listing
        assert result["at_end"] == 1  # but by the round
        assert result["fetched"] == len(remote.files)
        assert result["failed"] == 0
        assert all(remote.gets(key) == 1 for key in remote.files)


def test_a_default_warm_of_a_few_objects_stages_them_here(served: Remote, tmp_path: Path) -> None:
    """30 objects: all staged here before a process would have started up; none starts."""
    result = run_defaults(served, tmp_path / "cache", "warm")
    assert result["at_listing"] == result["at_end"] == 0
    assert result["fetched"] == len(served.files)
    assert all(served.gets(key) == 1 for key in served.files)


def test_a_cached_warm_and_a_dry_run_start_no_process(tmp_path: Path) -> None:
    """Everything cached (more than a chunk of objects, so a miss would start it): the
    default warm and the dry run look the objects up and start nothing."""
    with serve("s3", tmp_path, small_objects(300), s3_folder=True) as remote:
        result = run_defaults(remote, tmp_path / "cache", "warm-cached")
        assert result["cached"] == len(remote.files)
        assert result["fetched"] == 0
        assert result["at_listing"] == result["at_end"] == 0
        assert all(remote.gets(key) == 1 for key in remote.files)


@pytest.mark.parametrize("format", ["files", "auto"])
def test_a_default_loader_of_a_file_folder_stages_ahead_in_the_staging_process(
    served: Remote, tmp_path: Path, format: str
) -> None:
    """Started before the listing (a named file format) or once the format is detected."""
    result = run_defaults(served, tmp_path / "cache", f"loader {format} lru")
    assert result["at_listing"] == 1
    samples = result["samples"]
    assert isinstance(samples, list)
    assert sorted(samples) == sorted(data.hex() for data in served.files.values())
    assert all(served.gets(key) == 1 for key in served.files)


@pytest.mark.parametrize(
    ("format", "policy"), [("tar", "lru"), ("auto", "lru"), ("parquet", "lru"), ("files", "plan")]
)
def test_opens_whose_staging_stays_here_start_no_process(
    tmp_path: Path, format: str, policy: str
) -> None:
    """Tar shards and Parquet files (a few large objects: staged here before a process
    would be ready), and a plan cache (its loader's plan keeps staging here): an open and
    an epoch of a loader staging ahead start no staging process."""
    if format == "parquet":
        objects = parquet_files()
    elif format == "files":
        objects = small_objects(40)
    else:
        objects = webdataset_shards()
    with serve("s3", tmp_path, objects, s3_folder=True) as remote:
        result = run_defaults(remote, tmp_path / "cache", f"loader {format} {policy}")
        assert result["at_listing"] == result["at_end"] == 0
        assert isinstance(result["count"], int)
        assert result["count"] > 0


def small_objects(count: int) -> dict[str, bytes]:
    return {f"part-{i % 7}/{i:04d}.bin": i.to_bytes(4, "big") * 25 for i in range(count)}


def parquet_files() -> dict[str, bytes]:
    pytest.importorskip("pyarrow")
    from test_dataset_parquet import parquet_bytes, table

    return {f"part-{i}.parquet": parquet_bytes(table(40, 40 * i), 10) for i in range(3)}
