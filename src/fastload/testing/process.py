"""A loopback HTTP server in a process of its own, for benchmarks.

In the client's process the server's request handling competes for the GIL with the
code being measured; on a 2-core machine that skews every figure. This runs
``python -m fastload.testing`` and reads its counters over HTTP(S).
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Self
from urllib.parse import quote

from fastload.testing.faults import RemoteBehavior, RequestStats
from fastload.testing.http_server import RESET_PATH, STATS_PATH
from fastload.testing.s3_server import storage_options_for

_START_TIMEOUT_S = 30.0
_HELPER_TIMEOUT_S = 30.0


class ChildServer:
    """A server in a process of its own: its command prints one JSON line once it serves,
    and it stops when its stdin closes (``close()``, or the ``with`` block's end)."""

    _proc: subprocess.Popen[str]

    def _launch(
        self, cmd: list[str], what: str, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Starts ``cmd``; returns the JSON line it printed (``what`` names it in the error
        raised when none comes within the start timeout)."""
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            ready = sel.select(_START_TIMEOUT_S)
        line = self._proc.stdout.readline().strip() if ready else ""
        try:
            return dict(json.loads(line))
        except json.JSONDecodeError:
            self.close()
            raise RuntimeError(f"{what} did not start within {_START_TIMEOUT_S}s") from None

    def pid(self) -> int:
        return self._proc.pid

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

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class HTTPServerProcess(ChildServer):
    """``RangeHTTPServer`` serving ``root`` from a child process; ``close()`` stops it."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        latency_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        behavior: RemoteBehavior | None = None,
        s3: bool = False,
        tls: bool = False,
    ) -> None:
        """With ``s3``, an :class:`~fastload.testing.S3FolderServer` (each subfolder of
        root a bucket; ``storage_options`` reach it). ``behavior`` sets every knob at once
        (``latency_s`` and ``bandwidth_bytes_per_s`` are shortcuts); ``tls`` serves https,
        trusted through ``ca_file`` (``storage_options`` carry it)."""
        if behavior is None:
            behavior = RemoteBehavior(
                latency_s=latency_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s
            )
        elif latency_s or bandwidth_bytes_per_s is not None:
            raise ValueError("give behavior, or latency_s / bandwidth_bytes_per_s, not both")
        self.behavior = behavior
        cmd = [sys.executable, "-m", "fastload.testing", str(Path(root).resolve())]
        cmd += ["--behavior", json.dumps(dataclasses.asdict(behavior))]
        cmd += ["--s3"] * s3 + ["--tls"] * tls
        started = self._launch(cmd, "the test HTTP server")
        self.url: str = started["url"]
        # The authority to trust for https (None for http), deleted when the server stops.
        self.ca_file: str | None = started["ca_file"]
        self._context = (
            None if self.ca_file is None else ssl.create_default_context(cafile=self.ca_file)
        )

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs keyword arguments that reach an ``s3=True`` server (and trust it)."""
        return storage_options_for(self.url, self.ca_file)

    def url_for(self, relpath: str = "") -> str:
        rel = relpath.lstrip("/")
        return f"{self.url}/{quote(rel)}" if rel else f"{self.url}/"

    def _helper(self, path: str) -> bytes:
        with urllib.request.urlopen(
            self.url + path, timeout=_HELPER_TIMEOUT_S, context=self._context
        ) as response:
            return bytes(response.read())

    def stats(self) -> RequestStats:
        data = json.loads(self._helper(STATS_PATH))
        return RequestStats(
            requests=MappingProxyType({(m, p): n for m, p, n in data["requests"]}),
            bytes_sent=data["bytes_sent"],
            faults_injected=data["faults_injected"],
        )

    def reset_stats(self) -> None:
        self._helper(RESET_PATH)
