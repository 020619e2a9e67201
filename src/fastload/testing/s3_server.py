"""A loopback S3 endpoint (moto in server mode) with knobs and fault injection, for tests.

moto's ``ThreadedMotoServer`` builds its WSGI app inside its serving thread and offers
no hook to wrap it, so this module runs the same pieces itself (moto's
``DomainDispatcherApplication`` and ``MotoRequestHandler`` under werkzeug's threaded
server) with a small WSGI middleware in front that applies ``RemoteControls``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar
from xml.sax.saxutils import escape

from fastload.testing.faults import (
    ConnectionTrackingMixin,
    Fault,
    FaultKind,
    RemoteBehavior,
    RemoteControls,
    logger,
)

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = ["S3Server"]

# moto accepts any credentials; these are the ones its docs use.
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"

# Requests with this header (the helpers' own) skip knobs, faults and counters.
_CONTROL_HEADER = "X-Fastload-Testing-Control"
_CONTROL_ENVIRON = "HTTP_" + _CONTROL_HEADER.upper().replace("-", "_")
_RESET_ENVIRON = "fastload.testing.reset"
_HELPER_TIMEOUT_S = 30.0

_S3_ERRORS: dict[int, tuple[str, str]] = {
    400: ("InvalidRequest", "Invalid Request"),
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    429: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def storage_options_for(
    endpoint_url: str, ca_file: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """s3fs keyword arguments for a loopback S3 endpoint that takes any credentials; for
    https, ``ca_file`` is the authority to trust (as ``verify``, where a user puts it)."""
    client_kwargs: dict[str, Any] = {"endpoint_url": endpoint_url}
    if ca_file is not None:
        client_kwargs["verify"] = str(ca_file)
    return {"key": ACCESS_KEY, "secret": SECRET_KEY, "client_kwargs": client_kwargs}


def _s3_error(fault: Fault, path: str) -> tuple[str, bytes]:
    """The status line and XML body S3 sends for an error."""
    phrase = HTTPStatus(fault.status).phrase
    default_code, message = _S3_ERRORS.get(fault.status, (phrase.replace(" ", ""), phrase))
    code = fault.code or default_code
    if fault.code is not None and fault.code != default_code:
        message = f"Injected {code}."
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(path)}</Resource><RequestId>{uuid.uuid4().hex[:16].upper()}"
        "</RequestId></Error>"
    )
    return f"{fault.status} {phrase}", body.encode()


def _wsgi_path(environ: WSGIEnvironment) -> str:
    # WSGI hands the percent-decoded path over as latin-1; recover the real text.
    raw: str = environ.get("PATH_INFO", "") or "/"
    return raw.encode("latin-1").decode("utf-8", "replace")


def _without_server_header(start_response: StartResponse) -> StartResponse:
    """Drop moto's ``Server: amazon.com``: werkzeug adds its own, and aiohttp in strict
    mode (asyncio debug, e.g. ``python -X dev``) rejects a response with two."""

    def wrapped(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        kept = [(k, v) for k, v in headers if k.lower() != "server"]
        return start_response(status, kept, exc_info)

    return wrapped


class _FaultMiddleware:
    """Applies latency, bandwidth, faults and counting in front of moto's app."""

    def __init__(self, app: WSGIApplication, controls: RemoteControls) -> None:
        self._app = app
        self._controls = controls

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        start_response = _without_server_header(start_response)
        path = _wsgi_path(environ)
        if environ.get(_CONTROL_ENVIRON) or path.startswith("/moto-api/"):
            return self._app(environ, start_response)
        method = str(environ["REQUEST_METHOD"])
        behavior, fault, latency_s = self._controls._on_request(method, path)
        if not self._controls._sleep(latency_s):
            # werkzeug treats ConnectionError as "client went away": nothing is sent.
            raise ConnectionAbortedError("server is closing")
        if fault is not None and fault.kind is FaultKind.RESET:
            environ[_RESET_ENVIRON] = True  # the handler turns this into a TCP RST
            raise ConnectionAbortedError("injected connection reset")
        if fault is not None and fault.kind is FaultKind.STATUS:
            status, body = _s3_error(fault, path)
            if method == "HEAD":
                body = b""  # S3 sends HEAD errors without a body; botocore uses the status
            start_response(
                status,
                [
                    ("Content-Type", "application/xml"),
                    ("Content-Length", str(len(body))),
                    ("x-amz-request-id", uuid.uuid4().hex[:16].upper()),
                ],
            )
            return self._controls._paced([body], behavior)
        if fault is not None and fault.kind is FaultKind.TRUNCATE:
            return self._truncated(environ, start_response, behavior)
        return self._stream(self._app(environ, start_response), behavior)

    def _stream(self, app_iter: Iterable[bytes], behavior: RemoteBehavior) -> Iterator[bytes]:
        try:
            yield from self._controls._paced(app_iter, behavior)
        finally:
            close: Callable[[], object] | None = getattr(app_iter, "close", None)
            if close is not None:
                close()

    def _truncated(
        self, environ: WSGIEnvironment, start_response: StartResponse, behavior: RemoteBehavior
    ) -> Iterator[bytes]:
        captured: list[Any] = []
        written: list[bytes] = []

        def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            captured[:] = [status, headers]
            return written.append

        app_iter = self._app(environ, capture)
        try:
            body = b"".join(written) + b"".join(app_iter)
        finally:
            close: Callable[[], object] | None = getattr(app_iter, "close", None)
            if close is not None:
                close()
        status, headers = captured
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        # werkzeug closes every connection after its response, so the client is left
        # with fewer bytes than Content-Length promised.
        return self._controls._paced([body[: len(body) // 2]], behavior)


def _make_server(controls: RemoteControls) -> ConnectionTrackingMixin:
    """Build the werkzeug server around moto's app (imports moto only now)."""
    try:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import ThreadedWSGIServer
    except ImportError as exc:
        raise ImportError(
            f'S3Server needs moto in server mode: pip install "moto[server]" ({exc})'
        ) from exc

    class Server(ConnectionTrackingMixin, ThreadedWSGIServer):
        def log(self, type: str, message: str, *args: Any) -> None:
            # werkzeug would print to stderr; keep errors visible, the rest quiet.
            level = logging.WARNING if type == "error" else logging.DEBUG
            logger.log(level, "s3 " + message, *args)

    class Handler(MotoRequestHandler):
        server: Server
        disable_nagle_algorithm = True  # see the note in http_server._Handler

        def run_wsgi(self) -> None:
            super().run_wsgi()
            if getattr(self, "environ", {}).get(_RESET_ENVIRON):
                self.close_connection = True
                self.server.reset_connection(self.connection)

        def log(self, type: str, message: str, *args: Any) -> None:
            self.server.log(type, message, *args)

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # werkzeug's version adds ANSI colours; logs want plain text.
            logger.debug('s3 "%s" %s %s', self.requestline, code, size)

    app = _FaultMiddleware(DomainDispatcherApplication(create_backend_app), controls)
    return Server("127.0.0.1", 0, app, Handler)


_session_lock = threading.Lock()
_session: Any = None


def _botocore_session() -> Any:
    """One botocore session for all helper clients: building one costs ~50 ms."""
    global _session
    import botocore.session  # type: ignore[import-untyped]

    with _session_lock:
        if _session is None:
            _session = botocore.session.Session()
        return _session


class S3Server(RemoteControls):
    """moto's S3 on ``http://127.0.0.1:<free port>``, with knobs, faults and counters.

    Starts on construction; use it as a context manager or call ``close()``. Hand
    ``storage_options`` to s3fs/fsspec. moto keeps its buckets in process-global state,
    so every S3Server in a process sees the same buckets; the state is wiped when the
    last open S3Server closes (or on ``reset_state()``). Counters see path-style paths,
    ``/bucket/key``; requests made by the helpers below are not counted.

    Sets ``AWS_DEFAULT_REGION=us-east-1`` in ``os.environ`` so botocore-based clients
    sign for the region moto creates buckets in without a LocationConstraint.
    """

    _live_lock: ClassVar[threading.Lock] = threading.Lock()
    _live: ClassVar[int] = 0

    def __init__(self, *, behavior: RemoteBehavior | None = None) -> None:
        super().__init__(behavior)
        os.environ["AWS_DEFAULT_REGION"] = REGION
        self._close_lock = threading.Lock()
        self._closed = False
        self._client: Any = None
        self._server = _make_server(self)
        self._port = int(self._server.socket.getsockname()[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"S3Server:{self.port}",
            daemon=True,
        )
        self._thread.start()
        with S3Server._live_lock:
            S3Server._live += 1

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``, for ``endpoint_url=`` of boto clients."""
        return f"http://127.0.0.1:{self.port}"

    url = endpoint_url

    @property
    def storage_options(self) -> dict[str, Any]:
        """A fresh dict of s3fs keyword arguments that reach this server."""
        return storage_options_for(self.endpoint_url)

    # -- helpers (they bypass knobs, faults and counters) -------------------------------

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; fine if it already exists."""
        client = self._boto_client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Store one object."""
        self._boto_client().put_object(Bucket=bucket, Key=key, Body=data)

    def upload_dir(
        self, local_dir: str | os.PathLike[str], bucket: str, prefix: str = ""
    ) -> list[str]:
        """Upload every file under ``local_dir`` to ``bucket``/``prefix``; returns the keys.

        Keys are ``prefix`` + "/" + the POSIX path relative to ``local_dir``. The bucket is
        created if missing.
        """
        root = Path(local_dir)
        if not root.is_dir():
            raise NotADirectoryError(root)
        self.create_bucket(bucket)
        client = self._boto_client()
        head = prefix.strip("/")
        keys = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            key = f"{head}/{rel}" if head else rel
            with path.open("rb") as f:
                client.put_object(Bucket=bucket, Key=key, Body=f)
            keys.append(key)
        return keys

    def reset_state(self) -> None:
        """Wipe all of moto's state in this process (every bucket of every S3Server)."""
        request = urllib.request.Request(
            f"{self.endpoint_url}/moto-api/reset",
            method="POST",
            headers={_CONTROL_HEADER: "1"},
        )
        # No proxies: a proxy from the environment cannot reach our loopback port.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=_HELPER_TIMEOUT_S) as response:
            response.read()

    def _boto_client(self) -> Any:
        with self._close_lock:
            if self._closed:
                raise RuntimeError("S3Server is closed")
            if self._client is None:
                self._client = self._new_boto_client()
            return self._client

    def _new_boto_client(self) -> Any:
        import botocore.config  # type: ignore[import-untyped]

        def mark_as_control(request: Any, **kwargs: Any) -> None:
            request.headers[_CONTROL_HEADER] = "1"

        client = _botocore_session().create_client(
            "s3",
            region_name=REGION,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=botocore.config.Config(
                connect_timeout=_HELPER_TIMEOUT_S,
                read_timeout=_HELPER_TIMEOUT_S,
                retries={"max_attempts": 2, "mode": "standard"},
            ),
        )
        client.meta.events.register("before-sign.s3", mark_as_control)
        return client

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving and drop open connections; idempotent and bounded in time."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        with S3Server._live_lock:
            S3Server._live -= 1
            last = S3Server._live == 0
        try:
            if last and self._thread.is_alive():
                self.reset_state()
        except OSError:
            logger.warning("could not reset moto state", exc_info=True)
        finally:
            if client is not None:
                client.close()
            self._stop_serving(self._server, self._thread)

    def __enter__(self) -> S3Server:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"S3Server(endpoint_url={self.endpoint_url!r})"
