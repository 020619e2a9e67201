"""gcp-storage-emulator (``pip install gcp-storage-emulator``) on loopback, in a process of
its own, for the ``gs://`` tests: gcsfs lists and reads through it as through Google Cloud
Storage. It answers ranges and sizes as GCS does; it ignores ``ifGenerationMatch`` and
sends no generation header, so only a change of size shows on it (real GCS answers a
rewritten object's pinned GET with 412)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

# gcsfs's experimental zonal/HNS layer (on by default since 2025.x) asks a gRPC endpoint
# for each bucket's type, which an emulator does not serve (60 s per bucket). Set before
# gcsfs is first imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

_START_TIMEOUT_S = 30.0


def missing() -> str | None:
    """What is not installed for the gs:// tests, or None."""
    for module, package in (("gcp_storage_emulator", "gcp-storage-emulator"), ("gcsfs", "gcsfs")):
        if importlib.util.find_spec(module) is None:
            return f"needs {package} (pip install {package})"
    return None


class GCSEmulator:
    """The emulator serving bucket ``bucket`` (created empty) at ``endpoint``."""

    def __init__(self, bucket: str = "data") -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.bucket = bucket
        self.endpoint = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "gcp_storage_emulator", "start", "--quiet"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--in-memory"]
        self._proc = subprocess.Popen(
            [*command, "--default-bucket", bucket],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket}", timeout=1)
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("gcp-storage-emulator did not start") from None
                time.sleep(0.05)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def put(self, key: str, data: bytes) -> None:
        """Writes object key (a new generation where it exists)."""
        name = urllib.parse.quote(key, safe="")
        url = f"{self.endpoint}/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name={name}"
        request = urllib.request.Request(url, data=data, method="POST")
        request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()

    def close(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(timeout=10)


@contextlib.contextmanager
def gcs_emulator(bucket: str = "data") -> Iterator[GCSEmulator]:
    server = GCSEmulator(bucket)
    try:
        yield server
    finally:
        server.close()
