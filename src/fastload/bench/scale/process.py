"""The parent's side of the scale benchmark's children: start them, read their lines with a
timeout (a hung child is killed), release them together, and sum their memory and the
server's counters around the measured part."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fastload.bench.runner import cpu_seconds
from fastload.bench.scale.child import rollup
from fastload.staging.lifetime import env_for_child

# A child that neither reports nor exits within this long has hung: it is killed.
_CHILD_TIMEOUT_S = 1800.0


def _readline(stream: IO[str], what: str) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(_CHILD_TIMEOUT_S):
            raise RuntimeError(f"{what}: no answer within {_CHILD_TIMEOUT_S:g}s")
    line = stream.readline()
    if not line:
        raise RuntimeError(f"{what} ended without answering (see its stderr above)")
    return line


class _Child:
    """A measured process: ``ready`` holds its first line, ``result()`` its report."""

    def __init__(self, spec: dict[str, Any], python: str | None = None) -> None:
        env = None
        if python is not None:  # the peers' venv: this fastload through a link folder
            from fastload.bench.e2e.e2e_process import child_env

            env = child_env(Path(spec["work"]))
        self.what = f"the {spec['kind']} child"
        self.proc = subprocess.Popen(
            [
                python or sys.executable,
                "-m",
                "fastload.bench.scale.scale_bench",
                "child",
                json.dumps(spec),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env_for_child(env),  # ends with this process
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        self.ready = json.loads(_readline(self._stdout, self.what))["ready"]

    def say(self, word: str) -> None:
        self._stdin.write(word + "\n")
        self._stdin.flush()

    def result(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(_readline(self._stdout, self.what))
        return found

    def close(self) -> None:
        """Lets the child exit, or kills it after a bounded wait; idempotent."""
        if self.proc.poll() is None:
            try:
                self.say("end")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)
        self._stdin.close()
        self._stdout.close()


@dataclass
class _Run:
    """What N children did together, from "go" to the last report."""

    results: list[dict[str, Any]]
    ready: list[dict[str, int]]
    done: list[dict[str, int]]  # each child's memory, read from here after every report
    seconds: float
    server_cpu_s: float
    listings: int
    gets: int
    body_bytes: dict[str, int]


def run_children(server: Any, specs: Sequence[dict[str, Any]], python: str | None = None) -> _Run:
    children: list[_Child] = []
    try:
        children = [_Child(spec, python) for spec in specs]
        for child in children:
            child.wait_ready()
        ready = [rollup(child.proc.pid) for child in children]
        stats0, server0 = server.read_stats(), cpu_seconds([server.pid()])
        start = time.perf_counter()
        for child in children:
            child.say("go")
        results = [child.result() for child in children]
        seconds = time.perf_counter() - start
        stats1, server1 = server.read_stats(), cpu_seconds([server.pid()])
        done = [rollup(child.proc.pid) for child in children]
    finally:
        for child in children:
            child.close()
    body = {
        path: n - stats0.body_bytes.get(path, 0)
        for path, n in stats1.body_bytes.items()
        if n > stats0.body_bytes.get(path, 0)
    }
    return _Run(
        results=results,
        ready=ready,
        done=done,
        seconds=seconds,
        server_cpu_s=sum(server1.values()) - sum(server0.values()),
        listings=stats1.listings - stats0.listings,
        gets=stats1.count("GetObject") - stats0.count("GetObject"),
        body_bytes=body,
    )
