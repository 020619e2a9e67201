from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from proc_tree import parents

from fastload.reader import BatchReader, native_available
from fastload.staging.process import close_all
from fastload.testing import RangeHTTPServer, RemoteControls, S3Server


@pytest.fixture(params=["native", "python"])
def reader(request: pytest.FixtureRequest) -> Iterator[BatchReader]:
    """A reader of each backend; the native one must exist unless FASTLOAD_NATIVE=0 says not."""
    if request.param == "native" and not native_available():
        if os.environ.get("FASTLOAD_NATIVE") == "0":
            pytest.skip("native backend disabled by FASTLOAD_NATIVE=0")
        pytest.fail("the native extension did not load; see fastload.native_status()")
    with BatchReader(num_threads=4, backend=request.param) as r:
        yield r


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A 1 MiB file of random bytes (odd size, so blocks do not line up with its end)."""
    content = np.random.default_rng(0).integers(0, 256, (1 << 20) + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(content)
    return path, content


@dataclass
class Remote:
    """A dataset on one kind of remote, with the server's own request counts where it has one."""

    kind: str
    url: str
    storage_options: dict[str, Any]
    server: RemoteControls | None
    files: dict[str, bytes]
    source_dir: Path
    _path_prefix: str = ""

    def gets(self, key: str) -> int:
        """GET requests the server saw for key (ranged GETs count one each)."""
        assert self.server is not None, "a local dataset has no server to count requests"
        return self.server.stats().count(path=f"{self._path_prefix}/{key}", method="GET")

    def total_gets(self) -> int:
        assert self.server is not None
        return self.server.stats().count(method="GET")

    def replace(self, key: str, data: bytes) -> None:
        """Changes an object on the remote (a new version)."""
        self.files[key] = data
        if self.kind == "s3":
            assert isinstance(self.server, S3Server)
            self.server.put("data", f"ds/{key}", data)
        else:
            path = self.source_dir / "ds" / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            os.utime(path, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))


def make_files(root: Path, count: int = 30, seed: int = 0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(count):
        key = f"class_{i % 3}/img {i:03d}.bin" if i % 5 else f"deep/a/b/{i:03d}.bin"
        size = 0 if i == 7 else int(rng.integers(1, 150_000))
        files[key] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(files[key])
    return files


@contextlib.contextmanager
def open_remote(kind: str, base: Path, count: int = 30) -> Iterator[Remote]:
    source = base / "source"
    files = make_files(source / "ds", count)
    if kind == "local":
        yield Remote(kind, str(source / "ds"), {}, None, files, source)
    elif kind == "http":
        with RangeHTTPServer(source) as server:
            yield Remote(kind, server.url_for("ds"), {}, server, files, source, "/ds")
    else:
        with S3Server() as server:
            server.upload_dir(source / "ds", "data", prefix="ds")
            yield Remote(
                kind, "s3://data/ds", server.storage_options, server, files, source, "/data/ds"
            )


@pytest.fixture(params=["local", "http", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    """The same small dataset on each kind of remote: local files, HTTP, S3 (moto)."""
    with open_remote(request.param, tmp_path) as r:
        yield r


@pytest.fixture(params=["http", "s3"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    """The dataset behind a loopback server that can inject faults and count requests."""
    with open_remote(request.param, tmp_path) as r:
        yield r


def private_s3fs(
    storage_options: dict[str, Any], *, timeout_s: float, retries: int = 1, session: Any = None
) -> Any:
    """An s3fs filesystem of its own (not fsspec's cached instance) that gives up within
    timeout_s and retries only ``retries`` times in s3fs's own loop (1 means never)."""
    import aiobotocore.session  # s3fs's dependency
    import s3fs

    fs = s3fs.S3FileSystem(
        **storage_options,
        session=session or aiobotocore.session.AioSession(),
        skip_instance_cache=True,
        config_kwargs={
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            # botocore's own retries back off for seconds; leave retrying to s3fs.
            "retries": {"total_max_attempts": 1, "mode": "standard"},
        },
    )
    fs.retries = retries  # s3fs's retry loop (SlowDown, payload errors)
    return fs


# --- no test leaves a process behind -------------------------------------------------------

# Per-interpreter helpers of multiprocessing that live, by design, until this interpreter
# exits: started by the first test that needs them, reused by every later one.
_INTERPRETER_HELPERS = (
    b"from multiprocessing.forkserver import main",
    b"from multiprocessing.resource_tracker import main",
)
_CHILD_EXIT_GRACE_S = 15.0  # a child told to stop may take a moment (a busy machine)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "leaves_processes(reason): the test's children outlive it on purpose (say why)",
    )


def _children() -> dict[int, bytes]:
    """This process's running children: pid -> command line."""
    me = os.getpid()
    found: dict[int, bytes] = {}
    for pid, parent in parents().items():
        if parent != me:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if stat[stat.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X"):  # zombies are done
            found[pid] = cmdline
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test that leaves a child process of this one running (and ends those
    children, so the next test starts clean). Children that a wider-scoped fixture started
    (a module's S3 server) exist before the test and are not its own."""
    if request.node.get_closest_marker("leaves_processes") is not None:
        yield
        return
    before = set(_children())
    yield
    close_all()  # staging processes live as long as this interpreter, by design: a test's end
    deadline = time.monotonic() + _CHILD_EXIT_GRACE_S
    while True:
        left = {
            pid: cmd
            for pid, cmd in _children().items()
            if pid not in before and not any(h in cmd for h in _INTERPRETER_HELPERS)
        }
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, "the test left child processes running (now killed): " + "; ".join(
        f"{pid}: {cmd.decode(errors='replace')[:160]}" for pid, cmd in sorted(left.items())
    )
