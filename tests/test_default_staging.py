"""Staging with no FetchConfig at all, as a user who sets nothing gets it: remote objects go
through a staging process started while the dataset is listed, so a training step that
holds the GIL keeps it. Each case runs in a fresh interpreter (this one has the GET threads
of earlier tests), against a real S3 (moto) or HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Remote, open_remote

from fastload.staging.lifetime import env_for_child

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import fastload as fl
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

    if what.startswith("warm"):
        store = CachedStore.open(url, cache_dir=cache, storage_options=options)
        store.manifest  # the listing
        at_listing = staging_processes()
        if what == "warm-when-ready":  # else the first chunks are staged here meanwhile
            fetch = store.stager.config
            process = for_stager(store.stager.fs, store.stager.root, store.cache.config, fetch)
            while not process.ready():
                time.sleep(0.05)
        report = fl.warm(url, cache_dir=cache, storage_options=options, progress=False)
        samples = None
    else:
        ds = fl.open_dataset(url, format="files", cache_dir=cache, storage_options=options)
        at_listing = staging_processes()
        with fl.DataLoader(ds, batch_size=4, shuffle=True, collate_fn=list) as dl:
            got = [bytes(s) for batch in dl for s in batch]
        report = None
    print(json.dumps({
        "at_listing": len(at_listing),
        "get_threads": sum(t.name == "fastload-get" for t in threading.enumerate()),
        "fetched": report.fetched if report else None,
        "failed": report.failed if report else None,
        "samples": None if report else [s.hex() for s in got],
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


def test_a_default_warm_stages_in_a_process_started_at_the_listing(
    served: Remote, tmp_path: Path
) -> None:
    result = run_defaults(served, tmp_path / "cache", "warm-when-ready")
    assert result["at_listing"] == 1  # started by the listing, before any round
    assert result["fetched"] == len(served.files)
    assert result["failed"] == 0
    assert result["get_threads"] == 0  # not one object was fetched in the training process
    assert all(served.gets(key) == 1 for key in served.files)


def test_a_default_warm_does_not_wait_for_the_process_to_start(
    served: Remote, tmp_path: Path
) -> None:
    """Staged here while the process starts (a chunk at a time), there once it is ready:
    each object once, whichever staged it."""
    result = run_defaults(served, tmp_path / "cache", "warm")
    assert result["at_listing"] == 1
    assert result["fetched"] == len(served.files)
    assert result["failed"] == 0
    assert all(served.gets(key) == 1 for key in served.files)


def test_a_default_loader_stages_ahead_in_the_staging_process(
    served: Remote, tmp_path: Path
) -> None:
    result = run_defaults(served, tmp_path / "cache", "loader")
    assert result["at_listing"] == 1
    samples = result["samples"]
    assert isinstance(samples, list)
    assert sorted(samples) == sorted(data.hex() for data in served.files.values())
    assert all(served.gets(key) == 1 for key in served.files)
