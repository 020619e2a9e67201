"""A loopback HTTP/1.1 server with byte ranges, knobs and fault injection, for tests.

It serves a local directory read-only in the way fsspec's ``HTTPFileSystem`` expects
from a static file server: HEAD for sizes, single ``Range`` requests for reads, and
directory pages of ``<a href>`` links for ``ls``/``find``.

The machinery under it (``TrackedHTTPServer``, ``ControlledHandler``, ``LoopbackServer``:
keep-alive, Nagle off, TLS, knobs, faults, counters, paced bodies, files served by range)
is shared with :class:`~fastload.testing.S3FolderServer`.
"""

from __future__ import annotations

import functools
import html
import json
import mimetypes
import os
import re
import shutil
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, TypeVar
from urllib.parse import quote, unquote, urlsplit

from fastload.testing.faults import (
    ConnectionTrackingMixin,
    Fault,
    FaultKind,
    RemoteBehavior,
    RemoteControls,
    logger,
)
from fastload.testing.tls import LoopbackCertificate

__all__ = ["RangeHTTPServer"]

_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")
# An idle keep-alive connection is dropped after this long, so its thread ends.
_IDLE_TIMEOUT_S = 60.0
# Unpaced file bodies go to the socket with sendfile(2) in pieces of this size, each
# counted before it is sent (as ``RemoteControls._paced`` counts its pieces).
_SENDFILE_PIECE = 1 << 20


class Unsatisfiable(Exception):
    """A byte range that starts past the end of the object (HTTP 416)."""


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Parse a single byte range into [start, end); None means serve the whole file.

    Malformed and multi-range headers are ignored (RFC 9110 allows that), which fsspec
    never sends anyway. Raises Unsatisfiable for ranges entirely past the end.
    """
    match = _RANGE_RE.fullmatch(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if first:
        start = int(first)
        if last and int(last) < start:
            return None
        if start >= size:
            raise Unsatisfiable
        end = size if not last else min(int(last) + 1, size)
        return start, end
    if last:  # suffix range: the final N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise Unsatisfiable
        return max(0, size - n), size
    return None  # "bytes=-"


def read_chunks(f: BinaryIO, start: int, length: int) -> Iterator[bytes]:
    f.seek(start)
    while length > 0:
        chunk = f.read(min(length, 1 << 20))
        if not chunk:
            return  # the file shrank under us; the client sees a short body
        length -= len(chunk)
        yield chunk


STATS_PATH = "/__fastload_testing__/stats"
RESET_PATH = "/__fastload_testing__/reset-stats"


class TrackedHTTPServer(ConnectionTrackingMixin, ThreadingHTTPServer):
    """A threaded HTTP server that can drop its connections; ``controls`` is its owner."""

    controls: RemoteControls
    # Set for https: connections are wrapped as they are accepted and shake hands on their
    # handler's thread, so a slow client never holds up the accepting loop.
    ssl_context: ssl.SSLContext | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._cpu_lock = threading.Lock()
        self.handler_cpu_s = 0.0
        super().__init__(*args, **kwargs)

    def add_handler_cpu(self, seconds: float) -> None:
        with self._cpu_lock:
            self.handler_cpu_s += seconds

    def get_request(self) -> tuple[Any, Any]:
        sock, address = super().get_request()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(
                sock, server_side=True, do_handshake_on_connect=False
            )
        return sock, address


class ControlledHandler(BaseHTTPRequestHandler):
    """A keep-alive request handler that applies its server's ``RemoteControls``.

    Subclasses call ``_begin`` first (count, latency, RESET/STATUS faults), then answer
    with ``_send_body`` or ``_send_open_file`` so that bodies are paced, counted and
    truncated the same way in every server.
    """

    server: TrackedHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive; every response carries a Content-Length
    server_version = "fastload-testing"
    timeout = _IDLE_TIMEOUT_S
    # Headers and body go out in separate writes; with Nagle on, the body waits for the
    # client's delayed ACK (~40 ms a request). Latency is the knob's job, not TCP's.
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("http %s - " + format, self.address_string(), *args)

    def setup(self) -> None:
        super().setup()  # sets the idle timeout, which bounds the handshake too
        if isinstance(self.connection, ssl.SSLSocket):
            started = time.thread_time()
            try:
                self.connection.do_handshake()
            finally:
                self.server.add_handler_cpu(time.thread_time() - started)

    def _answer_control(self, path: str) -> bool:
        """Answer the counters' own requests (for a server in another process: not
        counted, no knobs); False for every other path."""
        controls = self.server.controls
        if path == RESET_PATH:
            controls.reset_stats()
            body = b"{}"
        elif path == STATS_PATH:
            stats = controls.stats()
            body = json.dumps(
                {
                    "requests": [[m, p, n] for (m, p), n in stats.requests.items()],
                    "bytes_sent": stats.bytes_sent,
                    "faults_injected": stats.faults_injected,
                }
            ).encode()
        else:
            return False
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return True

    def handle_one_request(self) -> None:
        # Thread CPU time: waits for the client, latency and pacing cost nothing.
        started = time.thread_time()
        try:
            super().handle_one_request()
        finally:
            self.server.add_handler_cpu(time.thread_time() - started)

    def _url_path(self) -> str:
        return unquote(urlsplit(self.path).path)

    def _begin(self, path: str) -> tuple[RemoteBehavior, bool] | None:
        """Count the request, wait out the latency and apply RESET/STATUS faults.

        Returns the behavior for the response and whether to truncate its body, or None
        when the request is already dealt with (dropped, reset, or failed as injected).
        """
        controls = self.server.controls
        behavior, fault, latency_s = controls._on_request(self.command, path)
        if not controls._sleep(latency_s):
            self.close_connection = True  # server closing
            return None
        if fault is not None and fault.kind is FaultKind.RESET:
            self.close_connection = True
            self.server.reset_connection(self.connection)
            return None
        if fault is not None and fault.kind is FaultKind.STATUS:
            self._send_fault_status(fault, path)
            return None
        return behavior, fault is not None and fault.kind is FaultKind.TRUNCATE

    def _send_fault_status(self, fault: Fault, path: str) -> None:
        raise NotImplementedError

    def _send_body(
        self, read: Callable[[int], Iterator[bytes]], length: int, truncate: bool, b: RemoteBehavior
    ) -> None:
        """Send ``length`` body bytes from ``read(n)``, or only half of them when truncating."""
        if truncate:
            # Content-Length already promised `length` bytes; stop halfway and hang up.
            length //= 2
            self.close_connection = True
        for piece in self.server.controls._paced(read(length), b):
            self.wfile.write(piece)

    def _send_open_file(
        self,
        f: BinaryIO,
        size: int,
        byte_range: tuple[int, int] | None,
        headers: dict[str, str],
        *,
        send_body: bool,
        truncate: bool,
        b: RemoteBehavior,
    ) -> None:
        """Answer 200 with all of ``f`` or 206 with ``byte_range``, plus ``headers``."""
        if byte_range is None:
            start, end = 0, size
            self.send_response(HTTPStatus.OK)
        else:
            start, end = byte_range
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(end - start))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not send_body:
            return
        if b.bandwidth_bytes_per_s is None and not truncate:
            self._sendfile(f, start, end - start)
        else:
            self._send_body(functools.partial(read_chunks, f, start), end - start, truncate, b)

    def _sendfile(self, f: BinaryIO, start: int, length: int) -> None:
        """The unpaced body from the page cache to the socket, never through Python."""
        controls = self.server.controls
        offset, end = start, start + length
        while offset < end:
            piece = min(_SENDFILE_PIECE, end - offset)
            controls._count_sent(piece)
            sent = self.connection.sendfile(f, offset, piece)
            if sent < piece:  # the file shrank under us; the client sees a short body
                self.close_connection = True
                return
            offset += sent


class _Handler(ControlledHandler):
    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)

    def _refuse_method(self) -> None:
        # Read-only. Close afterwards: we do not read the request body.
        self.server.controls._on_request(self.command, self._url_path())
        self.close_connection = True
        self._send_simple(
            HTTPStatus.METHOD_NOT_ALLOWED, b"read-only server\n", {"Allow": "GET, HEAD"}
        )

    do_PUT = do_POST = do_DELETE = do_PATCH = _refuse_method

    @property
    def _controls(self) -> RangeHTTPServer:
        controls = self.server.controls
        assert isinstance(controls, RangeHTTPServer)
        return controls

    def _serve(self, *, send_body: bool) -> None:
        controls = self._controls
        path = self._url_path()
        if self._answer_control(path):
            return
        begun = self._begin(path)
        if begun is None:
            return
        behavior, truncate = begun
        try:
            target = controls._resolve(path)
            if target is None:
                self._send_simple(HTTPStatus.NOT_FOUND, b"not found\n")
            elif target.is_dir():
                self._send_listing(path, target, send_body, truncate, behavior)
            else:
                self._send_file(target, send_body, truncate, behavior)
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # client went away, or the server is closing

    def _send_simple(
        self, status: HTTPStatus | int, body: bytes, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.server.controls._count_sent(len(body))
            self.wfile.write(body)

    def _send_fault_status(self, fault: Fault, path: str) -> None:
        reason = fault.code or HTTPStatus(fault.status).phrase
        self._send_simple(fault.status, f"injected fault: {reason}\n".encode())

    def _send_listing(
        self, url_path: str, directory: Path, send_body: bool, truncate: bool, b: RemoteBehavior
    ) -> None:
        body = self._controls._listing(url_path, directory)
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self._send_body(lambda n: iter([body[:n]]), len(body), truncate, b)

    def _send_file(self, target: Path, send_body: bool, truncate: bool, b: RemoteBehavior) -> None:
        try:
            f = target.open("rb")
        except OSError:
            self._send_simple(HTTPStatus.NOT_FOUND, b"not found\n")
            return
        with f:
            st = os.fstat(f.fileno())
            size = st.st_size
            etag = f'"{size:x}-{st.st_mtime_ns:x}"'
            last_modified = formatdate(st.st_mtime, usegmt=True)
            headers = {
                "Accept-Ranges": "bytes",
                "ETag": etag,
                "Last-Modified": last_modified,
                "Content-Type": mimetypes.guess_type(target.name)[0] or "application/octet-stream",
            }
            if_match = self.headers.get("If-Match")
            if if_match is not None and if_match.strip() not in ("*", etag):
                # The client wants the version it listed, and this is another one.
                self._send_simple(HTTPStatus.PRECONDITION_FAILED, b"precondition failed\n")
                return
            byte_range: tuple[int, int] | None = None
            range_header = self.headers.get("Range")
            if_range = self.headers.get("If-Range")
            # If-Range: the range only applies to the version the client already has.
            if range_header is not None and if_range in (None, etag, last_modified):
                try:
                    byte_range = parse_range(range_header, size)
                except Unsatisfiable:
                    self._send_simple(
                        HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                        b"",
                        {"Content-Range": f"bytes */{size}"},
                    )
                    return
            self._send_open_file(
                f, size, byte_range, headers, send_body=send_body, truncate=truncate, b=b
            )


_Self = TypeVar("_Self", bound="LoopbackServer")


class LoopbackServer(RemoteControls):
    """Runs ``handler`` on ``http://127.0.0.1:<free port>`` from daemon threads.

    Starts on construction; use it as a context manager or call ``close()``. Subclasses
    set up whatever the handler reads before calling ``__init__``. With ``tls`` it serves
    ``https://`` with a certificate of a fresh private authority, whose PEM file
    (``ca_file``) clients must be told to trust; it is deleted on ``close()``.
    """

    def __init__(
        self,
        handler: type[ControlledHandler],
        *,
        behavior: RemoteBehavior | None = None,
        tls: bool = False,
    ) -> None:
        super().__init__(behavior)
        self._close_lock = threading.Lock()
        self._closed = False
        self._certificate: LoopbackCertificate | None = None
        if tls:
            self._certificate = LoopbackCertificate(tempfile.mkdtemp(prefix="fastload-tls-"))
        self._server = TrackedHTTPServer(("127.0.0.1", 0), handler)
        self._server.controls = self
        if self._certificate is not None:
            self._server.ssl_context = self._certificate.server_context()
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{type(self).__name__}:{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with TLS), without a trailing slash."""
        scheme = "http" if self._certificate is None else "https"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path | None:
        """The PEM file of the authority behind the server's certificate (None: no TLS)."""
        return None if self._certificate is None else self._certificate.ca_file

    @property
    def cpu_s(self) -> float:
        """CPU seconds the server has spent answering requests (in its handler threads;
        sleeps for latency and bandwidth are not CPU). For benchmarks whose server shares
        the cores with the code being measured."""
        with self._server._cpu_lock:
            return self._server.handler_cpu_s

    @property
    def closed(self) -> bool:
        with self._close_lock:
            return self._closed

    def close(self) -> None:
        """Stop serving and drop open connections; idempotent and bounded in time."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._stop_serving(self._server, self._thread)
        if self._certificate is not None:
            shutil.rmtree(self._certificate.ca_file.parent, ignore_errors=True)

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RangeHTTPServer(LoopbackServer):
    """Serve ``root`` read-only on ``http://127.0.0.1:<free port>`` from daemon threads.

    Starts on construction; use it as a context manager or call ``close()``. Supports
    GET/HEAD, single byte ranges (206/416), ETag/Last-Modified (If-Match: 412 when the
    file's ETag differs; If-Range), keep-alive, and HTML
    directory pages fsspec's ``HTTPFileSystem.ls``/``find`` can follow (subdirectory
    links end in ``/``). Knobs, faults and counters come from ``RemoteControls``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        behavior: RemoteBehavior | None = None,
        tls: bool = False,
    ):
        self._root = Path(root).resolve(strict=True)
        if not self._root.is_dir():
            raise NotADirectoryError(self._root)
        super().__init__(_Handler, behavior=behavior, tls=tls)

    @property
    def root(self) -> Path:
        return self._root

    def url_for(self, relpath: str | os.PathLike[str] = "") -> str:
        """The URL of a path relative to ``root`` (percent-encoded; "" is the root page)."""
        rel = Path(relpath).as_posix().lstrip("/")
        return f"{self.url}/{quote(rel)}" if rel not in ("", ".") else f"{self.url}/"

    def __repr__(self) -> str:
        return f"RangeHTTPServer({str(self._root)!r}, url={self.url!r})"

    # -- used by the handler ------------------------------------------------------------

    def _resolve(self, url_path: str) -> Path | None:
        """The existing file or directory for a URL path, or None (missing or outside root)."""
        if "\x00" in url_path:
            return None
        try:
            target = (self._root / url_path.lstrip("/")).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        return target if target.is_relative_to(self._root) else None

    def _listing(self, url_path: str, directory: Path) -> bytes:
        # Links are absolute paths: fsspec turns "/x" into "http://host:port/x" and keeps
        # those under the listed URL; a trailing "/" is how it tells directories apart.
        # No full "http://" URLs appear in the text, since fsspec would collect those too.
        base = "/" + url_path.strip("/")
        base = base if base == "/" else base + "/"
        items = []
        for entry in sorted(directory.iterdir(), key=lambda p: p.name):
            target = self._resolve(base + entry.name)
            if target is None:
                continue  # dangling, or a symlink out of root: not served, so not listed
            suffix = "/" if target.is_dir() else ""
            href = quote(base + entry.name + suffix)
            items.append(f'<li><a href="{href}">{html.escape(entry.name + suffix)}</a></li>')
        title = html.escape(f"Index of {base}")
        page = (
            f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title></head>\n'
            f"<body><h1>{title}</h1>\n<ul>\n" + "\n".join(items) + "\n</ul></body></html>\n"
        )
        return page.encode("utf-8")
