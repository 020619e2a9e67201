"""The loopback servers in fastload.testing, exercised through the real clients.

RangeHTTPServer is read through fsspec's HTTPFileSystem (aiohttp) and S3Server through
s3fs (aiobotocore), because what matters is that those clients see a faithful remote.
"""

from __future__ import annotations

import errno
import http.client
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import private_s3fs

from fastload.testing import (
    Fault,
    FaultKind,
    RangeHTTPServer,
    RemoteBehavior,
    RemoteControls,
    S3Server,
)

aiohttp = pytest.importorskip("aiohttp")
from fsspec.implementations.http import HTTPFileSystem  # noqa: E402  (needs aiohttp)

# Generous bounds on client calls: they only matter if something hangs.
CLIENT_TIMEOUT_S = 10.0
BUCKET = "fastload-test"

FILES = {
    "a.txt": b"hello world",
    "sub/b.bin": np.random.default_rng(1).integers(0, 256, 64 * 1024 + 7, np.uint8).tobytes(),
    "sub/deeper/c d.txt": b"a name with a space\n",
    "sub/deeper/e.bin": bytes(range(256)) * 4,
}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A nested directory of FILES plus an empty subdirectory."""
    root = tmp_path / "root"
    for rel, data in FILES.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (root / "empty").mkdir()
    return root


# -- shared knobs and fault queue ---------------------------------------------------------


def test_behavior_validates_and_set_behavior_changes_single_fields() -> None:
    with pytest.raises(ValueError, match="latency_s"):
        RemoteBehavior(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth"):
        RemoteBehavior(bandwidth_bytes_per_s=0)
    controls = RemoteControls(RemoteBehavior(latency_s=0.5, bandwidth_bytes_per_s=1e6))
    assert controls.set_behavior(latency_s=0.0) == RemoteBehavior(bandwidth_bytes_per_s=1e6)
    assert controls.set_behavior(bandwidth_bytes_per_s=None) == RemoteBehavior()
    assert controls.set_behavior(RemoteBehavior(latency_s=2)).latency_s == 2


def test_lognormal_latency_has_the_median_and_p99_asked_for_and_follows_its_seed() -> None:
    with pytest.raises(ValueError, match="latency_p99_s"):
        RemoteBehavior(latency_s=0.0, latency_p99_s=0.1)
    with pytest.raises(ValueError, match="latency_p99_s"):
        RemoteBehavior(latency_s=0.2, latency_p99_s=0.1)
    behavior = RemoteBehavior(latency_s=0.020, latency_p99_s=0.200, seed=3)
    assert behavior.latency_sigma == pytest.approx(np.log(10) / 2.326, rel=1e-3)
    draws = np.array(behavior.latency_draws(50_000))
    assert np.median(draws) == pytest.approx(0.020, rel=0.03)
    assert np.quantile(draws, 0.99) == pytest.approx(0.200, rel=0.08)
    assert behavior.latency_draws(100) == list(draws[:100])
    assert RemoteBehavior(latency_s=0.020, latency_p99_s=0.200, seed=4).latency_draws(100) != list(
        draws[:100]
    )
    assert RemoteBehavior(latency_s=0.02).latency_draws(3) == [0.02] * 3


def test_server_sleeps_the_latencies_its_seed_draws(tree: Path) -> None:
    behavior = RemoteBehavior(latency_s=1e-4, latency_p99_s=1e-3, seed=5)
    with RangeHTTPServer(tree, behavior=behavior) as server:

        def heads(n: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
            try:
                for _ in range(n):
                    conn.request("HEAD", "/a.txt")
                    conn.getresponse().read()
            finally:
                conn.close()

        heads(200)
        assert server.latency_draws() == behavior.latency_draws(200)
        server.set_behavior(behavior)  # starts the draws over
        heads(20)
        assert server.latency_draws() == behavior.latency_draws(20)


def test_slowdown_bursts_answer_every_request_503_then_end() -> None:
    with pytest.raises(ValueError, match="slowdown"):
        RemoteBehavior(slowdown_every_s=1.0, slowdown_for_s=2.0)
    controls = RemoteControls(RemoteBehavior(slowdown_every_s=3600.0, slowdown_for_s=0.05))
    slowdown = Fault(kind=FaultKind.STATUS, status=503, code="SlowDown")
    assert controls._on_request("GET", "/a").fault == slowdown  # the burst starts here
    assert controls._on_request("HEAD", "/b").fault == slowdown
    time.sleep(0.1)  # past the burst's 50 ms, far from the next one
    assert controls._on_request("GET", "/a").fault is None
    assert controls.stats().faults_injected == 2


def test_faults_are_consumed_in_order_by_matching_requests() -> None:
    controls = RemoteControls()
    controls.fail_next(2, 503, path_contains="/b")
    controls.truncate_next()  # GET only by default
    controls.reset_next(methods=["HEAD"])
    assert controls.pending_faults == 4

    assert controls._on_request("GET", "/a")[1] == Fault(kind=FaultKind.TRUNCATE)
    assert controls._on_request("HEAD", "/a")[1] == Fault(kind=FaultKind.RESET)
    assert controls._on_request("GET", "/a")[1] is None
    assert controls._on_request("get", "/b")[1] == Fault(kind=FaultKind.STATUS, status=503)
    assert controls._on_request("GET", "/b")[1] == Fault(kind=FaultKind.STATUS, status=503)
    assert controls._on_request("GET", "/b")[1] is None
    assert controls.pending_faults == 0

    stats = controls.stats()
    assert stats.total == 6
    assert stats.faults_injected == 4
    assert stats.by_path == {"/a": 3, "/b": 3}
    assert stats.by_method == {"GET": 5, "HEAD": 1}
    assert stats.count("/a", "GET") == 2
    controls.reset_stats()
    assert controls.stats().total == 0

    with pytest.raises(ValueError, match="4xx or 5xx"):
        controls.fail_next(status=200)
    with pytest.raises(ValueError, match="count"):
        controls.reset_next(0)


# -- RangeHTTPServer ------------------------------------------------------------------------


@pytest.fixture
def http_server(tree: Path) -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(tree) as server:
        yield server


@pytest.fixture
def http_fs() -> HTTPFileSystem:
    # A private instance: fsspec's cache would otherwise share one session across tests.
    return HTTPFileSystem(
        skip_instance_cache=True,
        client_kwargs={"timeout": aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)},
    )


def test_http_ls_and_find_follow_directory_pages(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    listing = http_fs.ls(http_server.url_for(""), detail=True)
    assert {(e["name"], e["type"]) for e in listing} == {
        (http_server.url_for("a.txt"), "file"),
        (http_server.url_for("empty") + "/", "directory"),
        (http_server.url_for("sub") + "/", "directory"),
    }
    assert http_fs.find(http_server.url_for("")) == sorted(http_server.url_for(r) for r in FILES)
    assert http_fs.find(http_server.url_for("sub/deeper/")) == sorted(
        http_server.url_for(r) for r in FILES if r.startswith("sub/deeper/")
    )


def test_http_cat_file_ranges_and_info(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    url = http_server.url_for("sub/b.bin")
    data = FILES["sub/b.bin"]
    assert http_fs.cat_file(url) == data
    assert http_fs.cat_file(url, start=10, end=20) == data[10:20]
    assert http_fs.cat_file(url, start=1000) == data[1000:]
    assert http_fs.cat_file(url, start=-7) == data[-7:]
    assert http_fs.cat_file(url, start=len(data) - 3, end=len(data) + 100) == data[-3:]
    assert (
        http_fs.cat_file(http_server.url_for("sub/deeper/c d.txt")) == FILES["sub/deeper/c d.txt"]
    )

    info = http_fs.info(url)
    assert info["size"] == len(data)
    assert info["ETag"].startswith('"')
    assert "Last-Modified" in info
    with pytest.raises(FileNotFoundError):
        http_fs.cat_file(http_server.url_for("missing.bin"))


def _raw_request(
    conn: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn.request(method, path, headers=headers or {})
    response = conn.getresponse()
    body = response.read()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, body


def test_http_protocol_details(http_server: RangeHTTPServer, tmp_path: Path) -> None:
    """Range edge cases, HEAD, keep-alive and refusals, on one raw connection."""
    (tmp_path / "outside.txt").write_bytes(b"outside the served root")
    size = len(FILES["a.txt"])
    conn = http.client.HTTPConnection("127.0.0.1", http_server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        status, headers, body = _raw_request(conn, "HEAD", "/a.txt")
        assert (status, headers["content-length"], body) == (200, str(size), b"")
        assert headers["accept-ranges"] == "bytes"
        etag = headers["etag"]
        first_socket = conn.sock

        status, headers, body = _raw_request(conn, "GET", "/a.txt", {"Range": "bytes=6-"})
        assert (status, headers["content-range"], body) == (206, f"bytes 6-10/{size}", b"world")
        status, _, body = _raw_request(conn, "GET", "/a.txt", {"Range": "bytes=-5"})
        assert (status, body) == (206, b"world")
        status, headers, _ = _raw_request(conn, "GET", "/a.txt", {"Range": f"bytes={size}-"})
        assert (status, headers["content-range"]) == (416, f"bytes */{size}")
        # Multi-range and stale If-Range are answered with the whole file.
        status, _, body = _raw_request(conn, "GET", "/a.txt", {"Range": "bytes=0-1,3-4"})
        assert (status, body) == (200, FILES["a.txt"])
        status, _, body = _raw_request(
            conn, "GET", "/a.txt", {"Range": "bytes=0-1", "If-Range": '"stale"'}
        )
        assert (status, body) == (200, FILES["a.txt"])
        status, _, body = _raw_request(
            conn, "GET", "/a.txt", {"Range": "bytes=0-1", "If-Range": etag}
        )
        assert (status, body) == (206, b"he")

        for escape in ("/../outside.txt", "/sub/../../outside.txt", "/%2e%2e/outside.txt", "/%00"):
            assert _raw_request(conn, "GET", escape)[0] == 404, escape
        assert conn.sock is first_socket, "keep-alive: all of the above used one connection"
        status, headers, _ = _raw_request(conn, "POST", "/a.txt")
        assert (status, headers["allow"]) == (405, "GET, HEAD")
    finally:
        conn.close()
    assert http_server.stats().total == 12


def test_http_symlink_out_of_root_is_refused(tree: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not for you")
    try:
        (tree / "link.txt").symlink_to(secret)
    except OSError:
        pytest.skip("cannot create symlinks here")
    with RangeHTTPServer(tree) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
        try:
            assert _raw_request(conn, "GET", "/link.txt")[0] == 404
            assert b"link.txt" not in _raw_request(conn, "GET", "/")[2]
        finally:
            conn.close()


def test_http_latency_knob(http_server: RangeHTTPServer, http_fs: HTTPFileSystem) -> None:
    http_server.set_behavior(latency_s=0.2)
    started = time.monotonic()
    assert http_fs.cat_file(http_server.url_for("a.txt")) == FILES["a.txt"]
    assert time.monotonic() - started >= 0.2


def test_http_bandwidth_knob_and_bytes_sent(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    data = FILES["sub/b.bin"]
    http_server.set_behavior(bandwidth_bytes_per_s=len(data) / 0.25)
    started = time.monotonic()
    assert http_fs.cat_file(http_server.url_for("sub/b.bin")) == data
    assert time.monotonic() - started >= 0.2  # 0.25 s at the cap, less one pacing chunk
    assert http_server.stats().bytes_sent == len(data)


def test_http_injected_503_then_success(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    url = http_server.url_for("a.txt")
    http_server.fail_next(1, 503)
    with pytest.raises(aiohttp.ClientResponseError) as excinfo:
        http_fs.cat_file(url)
    assert excinfo.value.status == 503
    assert http_fs.cat_file(url) == FILES["a.txt"]
    stats = http_server.stats()
    assert stats.count("/a.txt", "GET") == 2
    assert stats.faults_injected == 1

    http_server.fail_next(1, 404)
    with pytest.raises(FileNotFoundError):
        http_fs.cat_file(url)


def test_http_truncated_body_is_detected(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    url = http_server.url_for("sub/b.bin")
    http_server.truncate_next()
    with pytest.raises(aiohttp.ClientPayloadError):
        http_fs.cat_file(url)
    assert http_fs.cat_file(url) == FILES["sub/b.bin"]
    assert http_server.stats().bytes_sent == len(FILES["sub/b.bin"]) * 3 // 2


def test_http_connection_reset(http_server: RangeHTTPServer, http_fs: HTTPFileSystem) -> None:
    url = http_server.url_for("a.txt")
    # aiohttp retries an idempotent request once when its connection drops before the
    # response, so it takes two resets in a row for the caller to see one.
    http_server.reset_next(2)
    with pytest.raises(aiohttp.ClientOSError):
        http_fs.cat_file(url)
    assert http_server.pending_faults == 0
    assert http_fs.cat_file(url) == FILES["a.txt"]


def test_http_counters_show_each_object_fetched_once(
    http_server: RangeHTTPServer, http_fs: HTTPFileSystem
) -> None:
    http_server.fail_next(1, 500, path_contains="e.bin")
    urls = [http_server.url_for(r) for r in FILES]
    results = http_fs.cat(urls, on_error="return")
    assert isinstance(results[http_server.url_for("sub/deeper/e.bin")], aiohttp.ClientResponseError)
    assert http_fs.cat_file(http_server.url_for("sub/deeper/e.bin")) == FILES["sub/deeper/e.bin"]

    stats = http_server.stats()
    for rel in FILES:
        expected = 2 if rel.endswith("e.bin") else 1
        assert stats.count("/" + rel, "GET") == expected, rel
    assert stats.by_method == {"GET": len(FILES) + 1}


def test_http_close_is_prompt_with_requests_in_flight(tree: Path) -> None:
    server = RangeHTTPServer(tree, behavior=RemoteBehavior(latency_s=60))
    outcome: list[BaseException | int] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
        try:
            outcome.append(_raw_request(conn, "GET", "/a.txt")[0])
        except (OSError, http.client.HTTPException) as exc:
            outcome.append(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while server.stats().total == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    closer = threading.Thread(target=server.close, daemon=True)
    closer.start()
    closer.join(CLIENT_TIMEOUT_S)
    assert not closer.is_alive(), "close() hung"
    server.close()  # idempotent
    thread.join(CLIENT_TIMEOUT_S)
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert not isinstance(outcome[0], int), "the sleeping request should have been dropped"


# -- S3Server ---------------------------------------------------------------------------------


@pytest.fixture
def s3_server(tree: Path) -> Iterator[S3Server]:
    pytest.importorskip("moto.server", reason='needs pip install "moto[server]"')
    pytest.importorskip("s3fs")
    with S3Server() as server:
        server.upload_dir(tree, BUCKET, prefix="data")
        yield server


MakeS3fs = Callable[..., Any]


@pytest.fixture(scope="module")
def make_s3fs() -> MakeS3fs:
    """Builds s3fs filesystems for a server: private instances with tight timeouts."""
    pytest.importorskip("s3fs")
    import aiobotocore.session  # s3fs's dependency

    session = aiobotocore.session.AioSession()  # shared: building one costs ~0.1 s

    def make(server: S3Server, retries: int = 1) -> Any:
        return private_s3fs(
            server.storage_options, timeout_s=CLIENT_TIMEOUT_S, retries=retries, session=session
        )

    return make


def test_s3_upload_ls_find_and_helpers_are_not_counted(
    s3_server: S3Server, make_s3fs: MakeS3fs
) -> None:
    fs = make_s3fs(s3_server)
    keys = sorted(f"{BUCKET}/data/{r}" for r in FILES)
    assert fs.find(BUCKET) == keys
    assert sorted(fs.ls(f"{BUCKET}/data")) == [
        f"{BUCKET}/data/a.txt",
        f"{BUCKET}/data/sub",
    ]
    assert fs.info(f"{BUCKET}/data/sub/b.bin")["size"] == len(FILES["sub/b.bin"])

    s3_server.create_bucket(BUCKET)  # already there: fine
    s3_server.put(BUCKET, "extra/x.bin", b"xyz")
    assert fs.cat_file(f"{BUCKET}/extra/x.bin") == b"xyz"
    stats = s3_server.stats()
    assert "PUT" not in stats.by_method  # the helpers bypass the counters
    assert stats.bytes_sent >= 3


def test_s3_cat_file_ranges(s3_server: S3Server, make_s3fs: MakeS3fs) -> None:
    fs = make_s3fs(s3_server)
    path = f"{BUCKET}/data/sub/b.bin"
    data = FILES["sub/b.bin"]
    assert fs.cat_file(path) == data
    assert fs.cat_file(path, start=10, end=20) == data[10:20]
    assert fs.cat_file(path, start=1000) == data[1000:]
    assert fs.cat_file(f"{BUCKET}/data/sub/deeper/c d.txt") == FILES["sub/deeper/c d.txt"]


def test_s3_injected_slowdown_is_visible_and_retried(
    s3_server: S3Server, make_s3fs: MakeS3fs
) -> None:
    path = f"{BUCKET}/data/a.txt"
    key_path = f"/{path}"
    # Ranged reads are a single GET (a whole-file read may HEAD first).
    s3_server.fail_next(1, 503, methods=["GET"])
    with pytest.raises(OSError, match="reduce your request rate") as excinfo:
        make_s3fs(s3_server).cat_file(path, start=0)
    assert excinfo.value.errno == errno.EBUSY

    s3_server.reset_stats()
    s3_server.fail_next(1, 503, methods=["GET"])
    assert make_s3fs(s3_server, retries=2).cat_file(path, start=0) == FILES["a.txt"]
    stats = s3_server.stats()
    assert stats.count(key_path, "GET") == 2
    assert stats.faults_injected == 1


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (403, None, PermissionError),
        (404, None, FileNotFoundError),
        (500, None, OSError),
        (503, "InternalError", OSError),
    ],
)
def test_s3_error_statuses(
    s3_server: S3Server, make_s3fs: MakeS3fs, status: int, code: str | None, error: type[Exception]
) -> None:
    s3_server.fail_next(1, status, code=code, path_contains="a.txt")
    with pytest.raises(error):
        make_s3fs(s3_server).cat_file(f"{BUCKET}/data/a.txt", start=0)


def test_s3_truncated_body_and_reset(s3_server: S3Server, make_s3fs: MakeS3fs) -> None:
    from botocore.exceptions import EndpointConnectionError  # s3fs's dependency

    fs = make_s3fs(s3_server)
    path = f"{BUCKET}/data/sub/b.bin"
    s3_server.truncate_next()
    with pytest.raises(aiohttp.ClientPayloadError):
        fs.cat_file(path, start=0)
    s3_server.reset_next(2)  # two: see test_http_connection_reset
    with pytest.raises(EndpointConnectionError):
        fs.cat_file(path, start=0)
    assert fs.cat_file(path, start=0) == FILES["sub/b.bin"]


def test_s3_latency_knob_and_counters(s3_server: S3Server, make_s3fs: MakeS3fs) -> None:
    fs = make_s3fs(s3_server)
    paths = [f"{BUCKET}/data/{r}" for r in FILES]
    s3_server.reset_stats()
    s3_server.set_behavior(latency_s=0.2)
    started = time.monotonic()
    results = fs.cat_ranges(paths, [0] * len(paths), [None] * len(paths))
    assert time.monotonic() - started >= 0.2
    assert results == list(FILES.values())
    stats = s3_server.stats()
    for path in paths:
        assert stats.count("/" + path, "GET") == 1, path
    assert stats.total == len(paths)
    assert stats.bytes_sent == sum(len(d) for d in FILES.values())


def test_s3_state_is_wiped_when_the_last_server_closes(make_s3fs: MakeS3fs) -> None:
    pytest.importorskip("moto.server", reason='needs pip install "moto[server]"')
    with S3Server() as first:
        first.create_bucket(BUCKET)
        first.put(BUCKET, "k", b"v")
        with S3Server() as second:  # moto's state is process-global: same buckets
            assert make_s3fs(second).cat_file(f"{BUCKET}/k") == b"v"
        assert make_s3fs(first).cat_file(f"{BUCKET}/k") == b"v"
    with S3Server() as third:
        assert not make_s3fs(third).exists(f"{BUCKET}/k")
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1"


def test_server_in_its_own_process_serves_counts_and_stops(tmp_path: Path) -> None:
    from fastload.testing import HTTPServerProcess

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(b"0123456789")
    with HTTPServerProcess(tmp_path, latency_s=0.001) as server:
        with urllib.request.urlopen(server.url_for("d/x.bin"), timeout=10) as response:
            assert response.read() == b"0123456789"
        assert server.stats().count(path="/d/x.bin", method="GET") == 1
        server.reset_stats()
        assert server.stats().total == 0
        proc = server._proc
    assert proc.poll() is not None  # the child is gone after close
