"""A loopback HTTP server in a process of its own, for benchmarks.

In the client's process the server's request handling competes for the GIL with the
code being measured; on a 2-core machine that skews every figure. This runs
``python -m fastload.testing`` and reads its counters over HTTP.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any
from urllib.parse import quote

from fastload.testing.faults import RequestStats
from fastload.testing.http_server import RESET_PATH, STATS_PATH
from fastload.testing.s3_server import storage_options_for

_START_TIMEOUT_S = 30.0


class HTTPServerProcess:
    """``RangeHTTPServer`` serving ``root`` from a child process; ``close()`` stops it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        s3: bool = False,
    ) -> None:
        """With ``s3``, an :class:`~fastload.testing.S3FolderServer` (each subfolder of
        root a bucket; ``storage_options`` reach it)."""
        cmd = [sys.executable, "-m", "fastload.testing", str(Path(root).resolve())]
        if s3:
            cmd.append("--s3")
        cmd += ["--latency-s", str(latency_s)]
        if bandwidth_bytes_per_s is not None:
            cmd += ["--bandwidth-bytes-per-s", str(bandwidth_bytes_per_s)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            ready = sel.select(_START_TIMEOUT_S)
        line = self._proc.stdout.readline().strip() if ready else ""
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"the test HTTP server did not start within {_START_TIMEOUT_S}s")
        self.url = line

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs keyword arguments that reach an ``s3=True`` server."""
        return storage_options_for(self.url)

    def pid(self) -> int:
        return self._proc.pid

    def url_for(self, relpath: str = "") -> str:
        rel = relpath.lstrip("/")
        return f"{self.url}/{quote(rel)}" if rel else f"{self.url}/"

    def stats(self) -> RequestStats:
        with urllib.request.urlopen(self.url + STATS_PATH, timeout=30) as response:
            data = json.loads(response.read())
        return RequestStats(
            requests=MappingProxyType({(m, p): n for m, p, n in data["requests"]}),
            bytes_sent=data["bytes_sent"],
            faults_injected=data["faults_injected"],
        )

    def reset_stats(self) -> None:
        with urllib.request.urlopen(self.url + RESET_PATH, timeout=30) as response:
            response.read()

    def close(self) -> None:
        """Stops the server (closing its stdin), waiting a bounded time; idempotent."""
        proc = self._proc
        if proc.poll() is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()

    def __enter__(self) -> HTTPServerProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
