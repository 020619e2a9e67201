"""Every process fastload or its benchmarks start ends with its parent, and only then.

Each test starts the real thing in a parent process of its own, SIGKILLs that parent (no
cleanup runs) and checks, through /proc, that every descendant is gone; the deadline only
keeps a broken build from hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Remote, open_remote
from proc_tree import alive, command, descendants, wait_gone

GONE_DEADLINE_S = 60.0  # torch's workers look for their parent every 5 s


@pytest.fixture
def http(tmp_path: Path) -> Iterator[Remote]:
    with open_remote("http", tmp_path, count=6) as remote:
        yield remote


class Parent:
    """A Python script in a process of its own; lines it prints are read one at a time."""

    def __init__(self, script: str, tmp_path: Path) -> None:
        path = tmp_path / "parent.py"
        path.write_text(textwrap.dedent(script))
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # signals to "the job" go to its group, not to pytest's
        )
        self.tree: set[int] = set()

    def line(self) -> str:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline().strip()
        assert text, f"the parent exited early (code {self.proc.wait(60)})"
        return text

    def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill_and_check_descendants_go(self) -> None:
        self.tree = descendants(self.proc.pid)
        assert self.tree, "the parent started no process"
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        left = wait_gone(self.tree, GONE_DEADLINE_S)
        assert not left, "still running after their parent was killed: " + "; ".join(
            f"{pid}: {command(pid)}" for pid in sorted(left)
        )

    def close(self) -> None:
        # Only when a check above failed: no test leaves a process behind.
        for pid in alive(self.tree | descendants(self.proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def test_a_staging_process_started_from_a_thread_lives_as_long_as_the_parent(
    http: Remote, tmp_path: Path
) -> None:
    """Started by a loader's thread that then ends, the staging process stays (the kernel's
    parent-death signal follows the starting thread, not the process); it ignores the
    SIGINT and SIGTERM sent to the whole job (the parent decides); it dies with the parent."""
    parent = Parent(
        f"""
        import signal, sys, threading
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the job's Ctrl-C: this parent goes on
        from fastload.staging import FetchConfig
        from fastload.store import CachedStore
        store = CachedStore.open({http.url!r}, cache_dir={str(tmp_path / "cache")!r},
                                 fetch=FetchConfig(staging_process=True))
        keys = store.object_keys()
        thread = threading.Thread(target=store.stage, args=(keys[:2],))
        thread.start()
        thread.join()  # the thread that started the staging process is gone
        print("staged", flush=True)
        sys.stdin.readline()
        store.stage(keys[2:4])  # the same staging process, after the job's signals
        print("staged again", flush=True)
        sys.stdin.readline()
        """,
        tmp_path,
    )
    try:
        assert parent.line() == "staged"
        staging = [p for p in descendants(parent.proc.pid) if "process_main" in command(p)]
        assert len(staging) == 1, [command(p) for p in descendants(parent.proc.pid)]
        os.killpg(parent.proc.pid, signal.SIGINT)  # Ctrl-C: the parent ignores it below
        parent.say("go")
        assert parent.line() == "staged again"
        assert staging == [p for p in descendants(parent.proc.pid) if "process_main" in command(p)]
        os.kill(staging[0], signal.SIGTERM)
        parent.say("go")  # the parent now waits on stdin: it is alive while we look
        assert staging[0] in descendants(parent.proc.pid), "SIGTERM ended the staging process"
        parent.kill_and_check_descendants_go()
    finally:
        parent.close()


@pytest.mark.slow
def test_a_busy_loader_benchmark_child_and_its_workers_end_with_the_benchmark(
    tmp_path: Path,
) -> None:
    """`fastload bench`'s loader child, mid-epoch, reads no command until the epoch ends:
    a killed benchmark left it and torch's workers running for the rest of the epoch (here
    minutes: each step sleeps 60 s)."""
    parent = Parent(
        f"""
        import threading
        from dataclasses import asdict
        from pathlib import Path
        from fastload.bench.components import loader_bench
        from fastload.bench.components.loader_bench_setup import LoaderBenchConfig, prepare
        config = LoaderBenchConfig(batch_size=8, epochs=1, repeats=1, step_ms=60_000.0,
            memory_samples=32, memory_shape=(3, 8, 8), images=8, size=16, zarr_rows=16,
            zarr_row_shape=(4, 4, 3), zarr_chunk_rows=8, memory_interval_s=0.05,
            timeout_s=600, workers=2, cases=("memory",))
        data = prepare(Path({str(tmp_path / "data")!r}), config)
        spec = {{"case": "memory", "system": "torch DataLoader", "config": asdict(config),
                 "data": data}}
        child = loader_bench._Child(spec, timeout_s=600)
        child.ask(None)
        epoch = {{"do": "epoch", "step": "sleep"}}
        threading.Thread(target=child.ask, args=(epoch,), daemon=True).start()
        print("epoch started", flush=True)
        input()
        """,
        tmp_path,
    )
    try:
        assert parent.line() == "epoch started"
        deadline = time.monotonic() + GONE_DEADLINE_S
        while len(tree := descendants(parent.proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(tree) >= 3, [command(p) for p in tree]  # the child and its two workers
        parent.kill_and_check_descendants_go()
    finally:
        parent.close()
