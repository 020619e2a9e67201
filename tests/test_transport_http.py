"""http(s):// objects staged through obstore's HTTPStore (fastload.remote.obstore), against the
loopback HTTP server, with fsspec (aiohttp) as the fallback for what obstore does not carry."""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fsspec
import pytest

pytest.importorskip("obstore")
pytest.importorskip("aiohttp")

import obstore

import fastload.remote.obstore as transport
from fastload.cache import Cache
from fastload.errors import (
    CredentialsInURLError,
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
)
from fastload.manifest import RemoteObject
from fastload.remote import HTTPResponseError
from fastload.remote.connect import transport_for
from fastload.remote.transport import FsspecTransport
from fastload.remote.versions import etag_of
from fastload.staging import FetchConfig
from fastload.store import CachedStore
from fastload.testing import RangeHTTPServer
from fastload.testing import http_server as http_server_module
from fastload.warm import warm

# In this process: these tests watch the transport from here.
QUICK = FetchConfig(
    jobs=8, retries=4, backoff_s=0.01, backoff_max_s=0.05, timeout_s=10, staging_process=False
)
NAMES = {
    "a/one.bin": 1000,
    "a/two.bin": 3000,
    "b/three.bin": 20_000,
    "with space.bin": 500,
    "ünïcødé ✓.bin": 700,
}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[RangeHTTPServer, dict[str, bytes]]]:
    root = tmp_path / "source"
    files = {}
    for i, (name, size) in enumerate(sorted(NAMES.items())):
        data = bytes((i * 7 + j) % 251 for j in range(size))
        path = root / "ds" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files[name] = data
    with RangeHTTPServer(root) as server:
        yield server, files


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[tuple[Any, ...]]]:
    """What each transport was asked: "obstore" (location, options) for every GET obstore
    sent, "fsspec" (path, start, end) for every GET left to fsspec."""
    seen: dict[str, list[tuple[Any, ...]]] = {"obstore": [], "fsspec": []}
    real_get = obstore.get
    real_fallback = FsspecTransport.get

    def get(store: Any, location: str, *, options: Any = None) -> Any:
        seen["obstore"].append((location, dict(options or {})))
        return real_get(store, location, options=options)

    def fallback(self: FsspecTransport, *args: Any) -> Any:
        seen["fsspec"].append(args)
        return real_fallback(self, *args)

    monkeypatch.setattr(obstore, "get", get)
    monkeypatch.setattr(FsspecTransport, "get", fallback)
    return seen


def open_store(url: str, cache_dir: Path, **storage_options: Any) -> CachedStore:
    return CachedStore.open(
        url, cache_dir=str(cache_dir), storage_options=storage_options, fetch=QUICK
    )


def cached(cache_dir: Path, url: str, files: dict[str, bytes]) -> dict[str, bytes]:
    with Cache(cache_dir) as cache:
        found = {k: cache.lookup(f"{url.rstrip('/')}/{k}") for k in files}
        return {k: p.read_bytes() for k, p in found.items() if p is not None}


def test_warm_of_an_http_folder_gets_every_object_once_through_obstore(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
) -> None:
    server, files = served
    url = server.url_for("ds")
    report = warm(url, cache_dir=str(tmp_path / "cache"), fetch=QUICK, progress=False)
    assert report.ok
    assert report.fetched == len(files)
    assert cached(tmp_path / "cache", url, files) == files
    # The space and the unicode names too: obstore requested the URL aiohttp would have.
    assert calls["fsspec"] == []
    assert sorted(location for location, _ in calls["obstore"]) == sorted(
        f"ds/{name}" for name in files
    )
    assert server.stats().count(method="GET", path="/ds/with space.bin") == 1
    assert server.stats().count(method="GET", path="/ds/ünïcødé ✓.bin") == 1


def test_a_ranged_read_comes_in_one_ranged_get(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
) -> None:
    server, files = served
    store = open_store(server.url_for("ds"), tmp_path / "cache")
    assert store.read_range("b/three.bin", 1234, 5000) == files["b/three.bin"][1234:6234]
    etag = etag_of(store.object("b/three.bin").version)
    assert etag is not None  # the range GET carries the listed version
    assert calls["obstore"] == [("ds/b/three.bin", {"range": (1234, 6234), "if_match": etag})]
    assert isinstance(store.stager.transport, transport.ObjectStoreHTTPTransport)
    assert (
        bytes(store.stager.transport.get(server.url_for("ds/a/one.bin"), 990))
        == (files["a/one.bin"][990:])
    )
    assert store.stager.transport.get(server.url_for("ds/a/one.bin"), 5, 5) == b""


def test_a_server_answering_a_range_whole_is_left_to_fsspec(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(bytes(range(100)))

    class Plain(SimpleHTTPRequestHandler):  # no Range support: 200 and the whole file
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/f.bin"
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        made = transport_for(fs, 10)
        assert isinstance(made, transport.ObjectStoreHTTPTransport)
        assert bytes(made.get(url)) == bytes(range(100))
        # object_store refuses a 200 to a range; through fsspec the range is cut out of it.
        assert bytes(made.get(url, 2, 5)) == bytes(range(2, 5))
        assert made._declined == {url.rsplit("/", 1)[0]}
    finally:
        server.shutdown()
        server.server_close()


def test_a_missing_object_fails_fast_naming_its_url(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
) -> None:
    server, _ = served
    store = open_store(server.url_for("ds"), tmp_path / "cache")
    gone = RemoteObject("no/such object.bin", 10, None)
    with pytest.raises(
        RemoteNotFoundError, match=r"http://127\.0\.0\.1:\d+/ds/no/such object\.bin"
    ):
        store.stager.stage([gone])
    assert server.stats().count(method="GET", path="/ds/no/such object.bin") == 1
    assert calls["fsspec"] == []


@pytest.mark.parametrize("status", [503, 429, 500])
def test_transient_statuses_are_retried_by_fastload_alone(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
    status: int,
) -> None:
    server, files = served
    store = open_store(server.url_for("ds"), tmp_path / "cache")
    server.fail_next(2, status, path_contains="two.bin", methods=["GET"])
    (result,) = store.stage(["a/two.bin"])
    assert result.outcome == "fetched"
    assert result.attempts == 3  # obstore's own retries are off
    assert server.stats().count(method="GET", path="/ds/a/two.bin") == 3
    assert store.read("a/two.bin") == files["a/two.bin"]
    assert calls["fsspec"] == []


def test_errors_from_obstore_read_as_fsspecs_do(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
) -> None:
    server, _ = served
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    made = transport_for(fs, 10)
    assert isinstance(made, transport.ObjectStoreHTTPTransport)
    with pytest.raises(FileNotFoundError):
        made.get(server.url_for("ds/missing.bin"))
    server.fail_next(1, 503, methods=["GET"])
    with pytest.raises(HTTPResponseError) as caught:
        made.get(server.url_for("ds/a/one.bin"))
    assert caught.value.status == 503
    server.fail_next(1, 403, methods=["GET"])
    with pytest.raises(HTTPResponseError, match="403"):
        made.get(server.url_for("ds/a/one.bin"))
    dead = f"http://127.0.0.1:{_free_port()}/x.bin"
    with pytest.raises(ConnectionError) as refused:
        made.get(dead)
    assert "127.0.0.1" not in str(refused.value)


def test_a_response_slower_than_the_timeout_is_a_timeout(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
) -> None:
    from fastload.testing import RemoteBehavior

    server, _ = served
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    made = transport_for(fs, 0.3)
    assert isinstance(made, transport.ObjectStoreHTTPTransport)
    server.set_behavior(RemoteBehavior(latency_s=1.0))
    with pytest.raises(TimeoutError):
        made.get(server.url_for("ds/a/one.bin"))


def test_an_untrusted_certificate_is_refused_unless_verification_is_off(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "x.bin").write_bytes(b"x" * 100)
    with RangeHTTPServer(tmp_path, tls=True) as server:
        url = server.url_for("ds/x.bin")
        fs = fsspec.filesystem("http", skip_instance_cache=True)
        made = transport_for(fs, 10)
        assert isinstance(made, transport.ObjectStoreHTTPTransport)
        with pytest.raises(ssl_error()):
            made.get(url)
        store = open_store(server.url_for("ds"), tmp_path / "cache")
        with pytest.raises(RemoteAccessError, match="certificate"):
            store.read("x.bin")
        off = fsspec.filesystem("http", ssl=False, skip_instance_cache=True)
        unverified = transport_for(off, 10)
        assert isinstance(unverified, transport.ObjectStoreHTTPTransport)
        assert bytes(unverified.get(url)) == b"x" * 100


def ssl_error() -> type[BaseException]:
    import ssl

    return ssl.SSLCertVerificationError


def test_names_obstore_would_encode_otherwise_go_to_fsspec(
    tmp_path: Path, calls: dict[str, list[tuple[Any, ...]]]
) -> None:
    names = ["a+b.bin", "c[1].bin", "plain.bin", "100%.bin", "x y é.bin"]
    for name in names:
        (tmp_path / "ds").mkdir(exist_ok=True)
        (tmp_path / "ds" / name).write_bytes(name.encode() * 10)
    with RangeHTTPServer(tmp_path) as server:
        url = server.url_for("ds")
        report = warm(url, cache_dir=str(tmp_path / "cache"), fetch=QUICK, progress=False)
        assert report.ok
        assert report.fetched == len(names)
        files = {n: n.encode() * 10 for n in names}
        assert cached(tmp_path / "cache", url, files) == files
        by_obstore = {location for location, _ in calls["obstore"]}
        assert {"ds/plain.bin", "ds/100%.bin", "ds/x y é.bin"} <= by_obstore
        assert {"ds/a+b.bin", "ds/c[1].bin"}.isdisjoint(by_obstore)
        for name in names:  # one GET each, whoever sent it
            assert server.stats().count(method="GET", path=f"/ds/{name}") == 1


def test_http_target_is_the_url_aiohttp_requests() -> None:
    target = transport._http_target
    assert target("http://h:8/d/a%20b/%C3%A9", False) == ("http://h:8", "d/a b/é")
    assert target("https://h/d/a b", False) == ("https://h", "d/a b")
    assert target("https://h:443/d/x", False) == ("https://h", "d/x")
    for refused in (
        "http://u:p@h/d/x",  # aiohttp sends basic auth
        "http://h/d/x?X-Amz-Signature=s",
        "http://h/d/x#frag",
        "http://h/d//x",
        "http://h/d/a%2Fb",
        "http://h/",
        "http://h/d/a%01b",
        "http://h/d/a%2Bb",  # yarl keeps %2B, obstore would send +
    ):
        assert target(refused, False) is None, refused


# --- settings obstore does not carry -------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    "options",
    [
        {"client_kwargs": {"auth": "aiohttp.BasicAuth"}},
        {"client_kwargs": {"headers": {"Accept-Encoding": "gzip"}}},
        {"headers": {"Range": "bytes=0-1"}},
        {"client_kwargs": {"trust_env": True}},
        {"cookies": {"a": "b"}},
        {"ssl": "context"},
        {"client_kwargs": {"headers": {"X-Bytes": b"raw"}}},
    ],
    ids=["auth", "accept-encoding", "range", "trust_env", "cookies", "ssl-context", "bytes"],
)
def test_settings_obstore_cannot_carry_leave_the_gets_to_fsspec(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
    options: dict[str, Any],
) -> None:
    import ssl

    import aiohttp

    readable = (
        "auth" not in str(options) and "Range" not in str(options) and "X-Bytes" not in str(options)
    )
    if options.get("client_kwargs", {}).get("auth"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            options = {"client_kwargs": {"auth": aiohttp.BasicAuth("user", "pass")}}
    if options.get("ssl"):
        options = {"ssl": ssl.create_default_context()}
    server, files = served
    fs = fsspec.filesystem("http", skip_instance_cache=True, **options)
    assert isinstance(transport_for(fs, 10), FsspecTransport)
    if readable:  # and fsspec reads with them
        store = open_store(server.url_for("ds"), tmp_path / "cache", **options)
        assert store.read("a/one.bin") == files["a/one.bin"]
        assert calls["obstore"] == []


def test_a_proxy_in_the_environment_leaves_the_gets_to_fsspec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert isinstance(transport_for(fs, 10), FsspecTransport)


def test_plain_headers_are_sent_by_obstore(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, files = served
    received: list[dict[str, str]] = []
    real_do_get = http_server_module._Handler.do_GET

    def do_get(handler: Any) -> None:
        if handler.path.endswith("/one.bin"):
            received.append({k.lower(): v for k, v in handler.headers.items()})
        real_do_get(handler)

    monkeypatch.setattr(http_server_module._Handler, "do_GET", do_get)
    store = open_store(
        server.url_for("ds"),
        tmp_path / "cache",
        client_kwargs={"headers": {"X-Team": "a", "User-Agent": "mine/1"}},
        headers={"X-Team": "b", "Authorization": "Bearer t0k"},
    )
    assert store.read("a/one.bin") == files["a/one.bin"]
    assert len(calls["obstore"]) == 1
    (sent,) = received
    assert (sent["x-team"], sent["user-agent"], sent["authorization"]) == (
        "b",
        "mine/1",
        "Bearer t0k",
    )


# --- fork ------------------------------------------------------------------------------------


def test_a_forked_child_of_a_process_that_used_obstore_gets_through_fsspec(
    served: tuple[RangeHTTPServer, dict[str, bytes]], tmp_path: Path
) -> None:
    server, files = served
    store = open_store(server.url_for("ds"), tmp_path / "cache")
    assert store.read("a/one.bin") == files["a/one.bin"]  # the parent's runtime is up now
    parent_transport = store.stager.transport
    assert isinstance(parent_transport, transport.ObjectStoreHTTPTransport)
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            fresh = transport_for(fsspec.filesystem("http", skip_instance_cache=True))
            url = server.url_for("ds/a/two.bin")
            if (
                isinstance(fresh, FsspecTransport)
                and isinstance(store.stager.transport, FsspecTransport)
                and parent_transport._forked()  # its GETs would go to its fallback
                and bytes(fresh.get(url)) == files["a/two.bin"]
                and store.read("b/three.bin") == files["b/three.bin"]
            ):
                code = 0
        except BaseException:
            traceback.print_exc()
        os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung (obstore's runtime after fork?)")


# --- no secrets in what the user sees ---------------------------------------------------------

SECRETS = ("sekrit", "X-Amz-Signature", "hunter2", "t0p-s3cret")


def assert_clean(exc: BaseException) -> None:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or (
            None if current.__suppress_context__ else current.__context__
        )
    texts = [str(e) for e in chain] + [repr(e) for e in chain]
    texts.append("".join(traceback.format_exception(exc)))
    for text in texts:
        for secret in SECRETS:
            assert secret.lower() not in text.lower(), f"{secret!r} in:\n{text}"


@pytest.mark.parametrize(
    "make_url",
    [
        lambda s: s.url_for("ds/no-such.bin") + "?X-Amz-Signature=sekrit",
        lambda s: s.url.replace("://", "://user:hunter2@") + "/ds/no-such.bin",
    ],
    ids=["query", "userinfo"],
)
def test_no_url_credentials_in_errors(
    served: tuple[RangeHTTPServer, dict[str, bytes]], tmp_path: Path, make_url: Any
) -> None:
    server, _ = served
    # userinfo is refused before any request (CredentialsInURLError), a query fails clean
    with pytest.raises((RemoteError, CredentialsInURLError)) as caught:
        warm(make_url(server), cache_dir=str(tmp_path / "cache"), fetch=QUICK, progress=False)
    assert_clean(caught.value)


def test_no_header_secret_in_errors_from_obstore(
    served: tuple[RangeHTTPServer, dict[str, bytes]],
    tmp_path: Path,
    calls: dict[str, list[tuple[Any, ...]]],
) -> None:
    server, _ = served
    store = open_store(
        server.url_for("ds"),
        tmp_path / "cache",
        client_kwargs={"headers": {"Authorization": "Bearer t0p-s3cret"}},
    )
    store.object_keys()  # listed
    server.fail_next(10, 503, path_contains="one.bin", methods=["GET"])
    with pytest.raises(RemoteError) as caught:
        store.read("a/one.bin")
    assert calls["obstore"]
    assert not calls["fsspec"]
    assert_clean(caught.value)
    with pytest.raises(RemoteNotFoundError) as missing:
        store.stager.stage([RemoteObject("missing.bin", 1, None)])
    assert_clean(missing.value)


def test_a_local_filesystem_never_imports_the_http_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bare install has no aiohttp, which fsspec's http module imports: choosing the
    transport of a local folder must not import it (the bare-install check found
    `fastload warm` of a local folder failing with ModuleNotFoundError)."""
    import sys

    monkeypatch.setitem(sys.modules, "aiohttp", None)  # importing it raises ImportError
    monkeypatch.delitem(sys.modules, "fsspec.implementations.http", raising=False)
    made = transport_for(fsspec.filesystem("file", skip_instance_cache=True), 10)
    assert isinstance(made, FsspecTransport)
