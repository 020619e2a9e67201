"""A lean S3 endpoint over a local folder, with knobs and fault injection, for benchmarks.

moto (``S3Server``) spends milliseconds of CPU per request (werkzeug dispatch, Flask,
an MD5 of the object per GET) on the cores the code under test runs on; real object
storage spends none of ours. This server answers S3's REST protocol with path-style
addressing (``http://127.0.0.1:<port>/<bucket>/<key>``) straight from a directory: each
top-level subdirectory of ``root`` is a bucket, every file below it an object whose key
is its POSIX path relative to the bucket. Bodies go from the page cache to the socket
(``sendfile`` when unpaced). ETags are the objects' MD5s, computed once per
(path, size, mtime) and cached. It runs on the machinery of ``RangeHTTPServer``
(HTTP/1.1 keep-alive, Nagle off, ``RemoteControls`` knobs, faults and counters).

Operations: GET/HEAD object (single ranges), PUT object (plain, HTTP-chunked and
``aws-chunked`` bodies; signatures and checksums are ignored), CopyObject, DELETE object,
DeleteObjects, multipart uploads, ListObjectsV2 and ListObjects, HEAD/PUT/DELETE bucket,
GetBucketLocation, ListBuckets. Anything else is answered with an S3 error (501
NotImplemented). Symbolic links below ``root`` are followed; keys cannot climb out of it.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterable, Iterator
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from typing import Any, BinaryIO, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from fastload.testing.faults import Fault, RemoteBehavior, logger
from fastload.testing.http_server import (
    ControlledHandler,
    LoopbackServer,
    Unsatisfiable,
    parse_range,
)
from fastload.testing.s3_server import REGION, _s3_error, storage_options_for

__all__ = ["S3FolderServer"]

_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
_XML_DECL = '<?xml version="1.0" encoding="UTF-8"?>\n'
# Files being written are named so; listings and reads never see them.
_TEMP_PREFIX = ".s3folder-tmp-"
# Parts of multipart uploads wait here (bucket names cannot start with ".").
_UPLOADS_DIR = ".s3folder-uploads"
_MAX_KEYS = 1000
_MAX_LINE = 64 * 1024  # a chunk-size or trailer line of a chunked body
_PIECE = 1 << 20
_EMPTY_MD5 = hashlib.md5(b"").hexdigest()
# Query parameters of listings, and the bucket subresources this server answers.
_LIST_PARAMETERS = {
    "prefix", "delimiter", "max-keys", "marker", "continuation-token", "start-after",
    "fetch-owner", "encoding-type",
}  # fmt: skip
_BUCKET_SUBRESOURCES = {"location", "list-type", "delete"}
_OBJECT_PARAMETERS = {"uploadId", "partNumber", "uploads", "versionId"}
# Presigned URLs' authentication (SigV2 and SigV4's X-Amz-*); signatures are not checked.
_SIGV2_PARAMETERS = {"AWSAccessKeyId", "Expires", "Signature"}


def _ignored(parameter: str) -> bool:
    """Query parameters with no effect here: authentication, botocore's ``x-id``, and
    ``response-*`` header overrides."""
    lowered = parameter.lower()
    return (
        parameter in _SIGV2_PARAMETERS
        or lowered.startswith("x-amz-")
        or lowered == "x-id"
        or lowered.startswith("response-")
    )


class _S3Error(Exception):
    """An S3 error response: status, code and message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


def _no_such_bucket() -> _S3Error:
    return _S3Error(404, "NoSuchBucket", "The specified bucket does not exist")


def _no_such_key() -> _S3Error:
    return _S3Error(404, "NoSuchKey", "The specified key does not exist.")


def _not_implemented(what: str) -> _S3Error:
    return _S3Error(501, "NotImplemented", f"{what} is not implemented by S3FolderServer")


def _error_xml(code: str, message: str, resource: str) -> bytes:
    return (
        f"{_XML_DECL}<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<Resource>{escape(resource)}</Resource>"
        f"<RequestId>{uuid.uuid4().hex[:16].upper()}</RequestId></Error>"
    ).encode()


def _iso8601(mtime: float) -> str:
    """S3's LastModified form: 2024-05-01T12:34:56.789Z."""
    whole = int(mtime)
    millis = int((mtime - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def _local_name(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _valid_bucket_name(name: str) -> bool:
    # Real S3 is stricter; this only keeps names that a folder can stand for and that
    # cannot reach outside root or into the uploads folder.
    return bool(name) and not name.startswith(".") and "/" not in name and "\x00" not in name


def _url_encode(text: str) -> str:
    return quote(text, safe="/")


# -- request bodies ------------------------------------------------------------------------


class _Readable(Protocol):
    def read(self, n: int, /) -> bytes: ...

    def readline(self, limit: int, /) -> bytes: ...


class _BadBody(Exception):
    pass


class _PieceReader:
    """``read``/``readline`` over an iterator of byte strings (to nest chunked decoders)."""

    def __init__(self, pieces: Iterable[bytes]) -> None:
        self._pieces = iter(pieces)
        self._buffer = bytearray()

    def _fill(self) -> bool:
        piece = next(self._pieces, None)
        if piece is None:
            return False
        self._buffer += piece
        return True

    def read(self, n: int, /) -> bytes:
        while len(self._buffer) < n and self._fill():
            pass
        out = bytes(self._buffer[:n])
        del self._buffer[:n]
        return out

    def readline(self, limit: int, /) -> bytes:
        while True:
            newline = self._buffer.find(b"\n", 0, limit)
            if newline >= 0 or len(self._buffer) >= limit or not self._fill():
                cut = newline + 1 if newline >= 0 else limit
                out = bytes(self._buffer[:cut])
                del self._buffer[:cut]
                return out


def _length_pieces(source: _Readable, length: int) -> Iterator[bytes]:
    while length > 0:
        piece = source.read(min(length, _PIECE))
        if not piece:
            raise _BadBody("the body ended before its Content-Length")
        length -= len(piece)
        yield piece


def _chunked_pieces(source: _Readable) -> Iterator[bytes]:
    """Decode a chunked body: HTTP/1.1's, or S3's aws-chunked, which has the same framing
    plus ``;chunk-signature=...`` extensions and checksum trailers (both ignored)."""
    while True:
        line = source.readline(_MAX_LINE)
        if not line.endswith(b"\n"):
            raise _BadBody("a chunk-size line is cut short")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _BadBody(f"bad chunk-size line {line[:40]!r}") from None
        if size == 0:
            while source.readline(_MAX_LINE).strip():
                pass  # trailers (x-amz-checksum-crc32: ...) up to the blank line
            return
        remaining = size
        while remaining:
            piece = source.read(min(remaining, _PIECE))
            if not piece:
                raise _BadBody("the body ended inside a chunk")
            remaining -= len(piece)
            yield piece
        if source.readline(_MAX_LINE).strip():
            raise _BadBody("a chunk is longer than its size says")


# -- files ------------------------------------------------------------------------------------


def _md5_file(f: BinaryIO) -> str:
    digest = hashlib.md5()
    f.seek(0)
    buffer = bytearray(_PIECE)
    view = memoryview(buffer)
    while n := f.readinto(buffer):  # type: ignore[attr-defined]
        digest.update(view[:n])
    return digest.hexdigest()


def _write_atomically(dest: Path, pieces: Iterable[bytes]) -> str:
    """Write ``pieces`` to a temporary file beside ``dest``, then rename it over ``dest``,
    so readers see the old object or the new one, never half of one; returns the MD5."""
    tmp = dest.parent / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
    digest = hashlib.md5()
    try:
        with tmp.open("wb") as out:
            for piece in pieces:
                digest.update(piece)
                out.write(piece)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return digest.hexdigest()


def _file_pieces(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while piece := f.read(_PIECE):
            yield piece


def _has_objects(directory: str) -> bool:
    """Whether any object lies below ``directory`` (an empty folder is no S3 prefix)."""
    stack = [directory]
    while stack:
        try:
            scan = os.scandir(stack.pop())
        except OSError:
            continue
        with scan:
            for entry in scan:
                if entry.name.startswith(_TEMP_PREFIX):
                    continue
                if entry.is_dir():
                    stack.append(entry.path)
                elif entry.is_file():
                    return True
    return False


# -- the handler ------------------------------------------------------------------------------


class _Handler(ControlledHandler):
    server_version = "fastload-s3folder"

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    @property
    def _controls(self) -> S3FolderServer:
        controls = self.server.controls
        assert isinstance(controls, S3FolderServer)
        return controls

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (unknown method, malformed request) as S3 XML.
        self.close_connection = True
        phrase = HTTPStatus(code).phrase
        body = _error_xml(phrase.replace(" ", ""), message or phrase, getattr(self, "path", ""))
        self.send_response(code)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if getattr(self, "command", None) != "HEAD" and code >= 200:
            self.server.controls._count_sent(len(body))
            self.wfile.write(body)

    def _handle(self) -> None:
        split = urlsplit(self.path)
        path = unquote(split.path)
        if self._answer_control(path):
            return
        # Until the body is read the connection cannot carry another request.
        self._body_pending = "Transfer-Encoding" in self.headers or (
            self.headers.get("Content-Length", "0") not in ("", "0")
        )
        begun = self._begin(path)
        try:
            if begun is not None:
                behavior, truncate = begun
                query = parse_qs(split.query, keep_blank_values=True)
                args = {name: values[0] for name, values in query.items() if not _ignored(name)}
                try:
                    self._route(path, args, behavior, truncate)
                except _S3Error as e:
                    self._send_error(e, path, behavior)
                except _BadBody as e:
                    self._body_pending = True  # we lost our place in the stream
                    self._send_error(_S3Error(400, "IncompleteBody", str(e)), path, behavior)
        except (ConnectionError, TimeoutError):
            self.close_connection = True  # client went away, or the server is closing
        except Exception as e:  # a bug here must still answer, not leave the client waiting
            logger.warning("S3FolderServer: %s %s failed", self.command, path, exc_info=True)
            self.close_connection = True
            error = _S3Error(500, "InternalError", f"{type(e).__name__}: {e}")
            with contextlib.suppress(OSError):
                self._send_error(error, path, RemoteBehavior())
        if self._body_pending:
            self.close_connection = True

    # -- responses ------------------------------------------------------------------------

    def _send_fault_status(self, fault: Fault, path: str) -> None:
        _, body = _s3_error(fault, path)
        self._send_xml(fault.status, body, self._controls.behavior, request_id=True)

    def _send_error(self, error: _S3Error, path: str, b: RemoteBehavior) -> None:
        body = _error_xml(error.code, error.message, path)
        self._send_xml(error.status, body, b, request_id=True)

    def _send_xml(
        self,
        status: int,
        body: bytes,
        b: RemoteBehavior,
        *,
        truncate: bool = False,
        headers: dict[str, str] | None = None,
        request_id: bool = False,
    ) -> None:
        if self.command == "HEAD":
            body = b""  # S3 answers HEAD errors without a body; botocore uses the status
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if request_id:
            self.send_header("x-amz-request-id", uuid.uuid4().hex[:16].upper())
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self._send_body(lambda n: iter([body[:n]]), len(body), truncate, b)

    def _send_empty(self, status: int, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        if status != HTTPStatus.NO_CONTENT:
            self.send_header("Content-Length", "0")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()

    # -- routing --------------------------------------------------------------------------

    def _route(self, path: str, args: dict[str, str], b: RemoteBehavior, truncate: bool) -> None:
        bucket, _, key = path.lstrip("/").partition("/")
        method = self.command
        controls = self._controls
        if not bucket:
            if method == "GET" and not args:
                return self._send_xml(200, controls._list_buckets_xml(), b, truncate=truncate)
            raise _not_implemented(f"{method} /")
        if not key:
            return self._route_bucket(bucket, args, b, truncate)
        unknown = set(args) - _OBJECT_PARAMETERS
        if unknown:
            raise _not_implemented(f"{method} ?{'&'.join(sorted(unknown))}")
        if method in ("GET", "HEAD"):
            if "uploadId" in args or "uploads" in args:
                raise _not_implemented("ListParts")
            return self._get_object(bucket, key, b, truncate)
        if method == "PUT" and "uploadId" in args:
            etag = controls._upload_part(args["uploadId"], args.get("partNumber", ""), self._body())
            return self._send_empty(200, {"ETag": f'"{etag}"'})
        if method == "PUT" and "x-amz-copy-source" in self.headers:
            body = controls._copy_object(bucket, key, self.headers["x-amz-copy-source"])
            return self._send_xml(200, body, b, truncate=truncate)
        if method == "PUT":
            etag = controls._put_object(bucket, key, self._body())
            return self._send_empty(200, {"ETag": f'"{etag}"'})
        if method == "POST" and "uploads" in args:
            body = controls._create_multipart_upload(bucket, key)
            return self._send_xml(200, body, b, truncate=truncate)
        if method == "POST" and "uploadId" in args:
            request = b"".join(self._body())
            body = controls._complete_multipart_upload(bucket, key, args["uploadId"], request)
            return self._send_xml(200, body, b, truncate=truncate)
        if method == "DELETE" and "uploadId" in args:
            controls._abort_multipart_upload(args["uploadId"])
            return self._send_empty(204)
        if method == "DELETE":
            controls._delete_object(bucket, key)
            return self._send_empty(204)
        raise _not_implemented(f"{method} on an object")

    def _route_bucket(
        self, bucket: str, args: dict[str, str], b: RemoteBehavior, truncate: bool
    ) -> None:
        method = self.command
        controls = self._controls
        subresources = set(args) - _LIST_PARAMETERS
        unknown = subresources - _BUCKET_SUBRESOURCES
        if unknown:
            raise _not_implemented(f"{method} /{bucket}?{'&'.join(sorted(unknown))}")
        if method == "HEAD" and not subresources:
            controls._bucket_dir(bucket)
            return self._send_empty(200, {"x-amz-bucket-region": REGION})
        if method == "GET" and subresources == {"location"}:
            controls._bucket_dir(bucket)
            location = f'{_XML_DECL}<LocationConstraint xmlns="{_XMLNS}"></LocationConstraint>'
            return self._send_xml(200, location.encode(), b, truncate=truncate)
        if method == "GET" and subresources <= {"list-type"}:
            version = args.get("list-type", "1")
            if version not in ("1", "2"):
                raise _S3Error(400, "InvalidArgument", f"list-type={version}")
            body = controls._list_objects_xml(bucket, args, v2=version == "2")
            return self._send_xml(200, body, b, truncate=truncate)
        if method == "PUT" and not subresources:
            for _ in self._body():
                pass  # CreateBucketConfiguration: the region does not matter here
            if not _valid_bucket_name(bucket):
                raise _S3Error(400, "InvalidBucketName", "The specified bucket is not valid.")
            controls.create_bucket(bucket)
            return self._send_empty(200, {"Location": f"/{bucket}"})
        if method == "DELETE" and not subresources:
            controls._delete_bucket(bucket)
            return self._send_empty(204)
        if method == "POST" and subresources == {"delete"}:
            body = controls._delete_objects(bucket, b"".join(self._body()))
            return self._send_xml(200, body, b, truncate=truncate)
        raise _not_implemented(f"{method} /{bucket}?{'&'.join(sorted(subresources))}")

    def _body(self) -> Iterator[bytes]:
        """The request body, de-chunked (HTTP chunked, then aws-chunked) as it arrives."""
        framed: Iterator[bytes]
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            framed = _chunked_pieces(self.rfile)
        else:
            framed = _length_pieces(self.rfile, int(self.headers.get("Content-Length") or 0))
        if "aws-chunked" in self.headers.get("Content-Encoding", "").lower():
            yield from _chunked_pieces(_PieceReader(framed))
            for _ in framed:
                pass  # up to the end of the HTTP framing, so the next request starts clean
        else:
            yield from framed
        self._body_pending = False

    def _get_object(self, bucket: str, key: str, b: RemoteBehavior, truncate: bool) -> None:
        controls = self._controls
        path = controls._object_path(bucket, key)
        try:
            f = open(path, "rb")  # noqa: SIM115  (closed below, after the body went out)
        except OSError:  # missing, a folder, or a file where the key wants a folder
            controls._bucket_dir(bucket)
            raise _no_such_key() from None
        with f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise _no_such_key()
            size = st.st_size
            headers = {
                "Accept-Ranges": "bytes",
                "ETag": f'"{controls._etag(path, st, f)}"',
                "Last-Modified": formatdate(st.st_mtime, usegmt=True),
                "Content-Type": "binary/octet-stream",
            }
            byte_range = None
            range_header = self.headers.get("Range")
            if range_header is not None:
                try:
                    byte_range = parse_range(range_header, size)
                except Unsatisfiable:
                    raise _S3Error(
                        416, "InvalidRange", "The requested range is not satisfiable"
                    ) from None
            self._send_open_file(
                f,
                size,
                byte_range,
                headers,
                send_body=self.command == "GET",
                truncate=truncate,
                b=b,
            )


# -- the server -------------------------------------------------------------------------------


class _Upload:
    def __init__(self, bucket: str, key: str, folder: Path) -> None:
        self.bucket, self.key, self.folder = bucket, key, folder
        self.etags: dict[int, str] = {}


class S3FolderServer(LoopbackServer):
    """S3 over the folder ``root`` on ``http://127.0.0.1:<free port>``, with knobs, faults
    and counters (see the module docstring for what it answers).

    Starts on construction; use it as a context manager or call ``close()``. Without a
    ``root`` it serves a temporary folder that ``close()`` removes. Hand
    ``storage_options`` to s3fs/fsspec, or ``endpoint_url`` to boto3. Counters see
    path-style paths, ``/bucket/key``; the helpers (``create_bucket``, ``put``,
    ``upload_dir``) write to the folder directly and are not counted.

    With ``tls`` it serves ``https://`` (see ``LoopbackServer``), and ``storage_options``
    tell s3fs to trust its authority (``client_kwargs["verify"]``), as a user would for a
    private endpoint; ``RemoteBehavior.realistic()`` adds S3's latency tail and bursts of
    ``503 SlowDown``.

    Sets ``AWS_DEFAULT_REGION=us-east-1`` in ``os.environ``, as ``S3Server`` does.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        behavior: RemoteBehavior | None = None,
        tls: bool = False,
    ) -> None:
        self._owns_root = root is None
        if root is None:
            root = tempfile.mkdtemp(prefix="fastload-s3folder-")
        Path(root).mkdir(parents=True, exist_ok=True)
        self._root = Path(root).resolve(strict=True)
        self._etags: dict[str, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, md5)
        self._etags_lock = threading.Lock()
        self._uploads: dict[str, _Upload] = {}
        self._uploads_lock = threading.Lock()
        os.environ["AWS_DEFAULT_REGION"] = REGION
        super().__init__(_Handler, behavior=behavior, tls=tls)

    @property
    def root(self) -> Path:
        return self._root

    @property
    def endpoint_url(self) -> str:
        """``http(s)://127.0.0.1:PORT``, for ``endpoint_url=`` of boto clients."""
        return self.url

    @property
    def storage_options(self) -> dict[str, Any]:
        """A fresh dict of s3fs keyword arguments that reach this server (and trust it)."""
        return storage_options_for(self.endpoint_url, self.ca_file)

    # -- helpers (straight to the folder: no knobs, faults or counters) -------------------

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; fine if it already exists."""
        if not _valid_bucket_name(name):
            raise ValueError(f"not a bucket name this server can serve: {name!r}")
        (self._root / name).mkdir(exist_ok=True)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """Store one object (the bucket must exist)."""
        try:
            self._put_object(bucket, key, [data])
        except _S3Error as e:
            error = FileNotFoundError if e.status == 404 else ValueError
            raise error(f"{bucket}/{key}: {e.code}: {e.message}") from None

    def upload_dir(
        self,
        local_dir: str | os.PathLike[str],
        bucket: str,
        prefix: str = "",
        *,
        hard_link: bool = True,
    ) -> list[str]:
        """Put every file under ``local_dir`` into ``bucket``/``prefix``; returns the keys.

        Keys are ``prefix`` + "/" + the POSIX path relative to ``local_dir``. The bucket is
        created if missing. Files are hard-linked where the filesystem allows it (so do
        not rewrite the originals in place while serving), else copied; their ETags are
        computed now, so that the first listing does not pay for them.
        """
        source = Path(local_dir)
        if not source.is_dir():
            raise NotADirectoryError(source)
        self.create_bucket(bucket)
        head = prefix.strip("/")
        keys = []
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            rel = path.relative_to(source).as_posix()
            key = f"{head}/{rel}" if head else rel
            dest = self._object_path(bucket, key)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if hard_link and self._link(path, dest):
                with dest.open("rb") as f:
                    self._etag(dest, os.fstat(f.fileno()), f)
            else:
                self._remember_etag(dest, _write_atomically(dest, _file_pieces(path)))
            keys.append(key)
        return keys

    @staticmethod
    def _link(source: Path, dest: Path) -> bool:
        tmp = dest.parent / f"{_TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            os.link(source, tmp)
        except OSError:  # another filesystem, or links not allowed
            return False
        os.replace(tmp, dest)
        return True

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving and drop open connections; idempotent and bounded in time. Parts
        of unfinished multipart uploads are deleted, and so is a temporary root."""
        if self.closed:
            return
        super().close()
        shutil.rmtree(self._root / _UPLOADS_DIR, ignore_errors=True)
        if self._owns_root:
            shutil.rmtree(self._root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"S3FolderServer({str(self._root)!r}, endpoint_url={self.endpoint_url!r})"

    # -- paths and ETags ------------------------------------------------------------------

    def _bucket_dir(self, bucket: str) -> Path:
        """The folder of an existing bucket; raises NoSuchBucket."""
        if not _valid_bucket_name(bucket):
            raise _no_such_bucket()
        folder = self._root / bucket
        if not folder.is_dir():
            raise _no_such_bucket()
        return folder

    def _object_path(self, bucket: str, key: str) -> Path:
        """Where ``key`` lives; raises NoSuchKey for keys no file can stand for."""
        parts = key.split("/")
        if (
            not _valid_bucket_name(bucket)
            or "\x00" in key
            or any(p in ("", ".", "..") or p.startswith(_TEMP_PREFIX) for p in parts)
        ):
            raise _no_such_key()
        return self._root / bucket / key

    def _etag(self, path: Path, st: os.stat_result, f: BinaryIO | None = None) -> str:
        """The object's MD5 hex, computed once per (path, size, mtime_ns)."""
        name = str(path)
        with self._etags_lock:
            known = self._etags.get(name)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            return known[2]
        if f is None:
            with open(path, "rb") as opened:
                md5 = _md5_file(opened)
        else:
            md5 = _md5_file(f)
        with self._etags_lock:
            self._etags[name] = (st.st_size, st.st_mtime_ns, md5)
        return md5

    def _remember_etag(self, path: Path, md5: str) -> None:
        st = path.stat()
        with self._etags_lock:
            self._etags[str(path)] = (st.st_size, st.st_mtime_ns, md5)

    # -- operations (called by the handler) -----------------------------------------------

    def _put_object(self, bucket: str, key: str, body: Iterable[bytes]) -> str:
        folder = self._bucket_dir(bucket)
        if key.endswith("/"):  # a "folder" marker: folders need no object here
            if any(body):
                raise _S3Error(400, "InvalidArgument", "a key ending in / must be empty")
            (folder / key).mkdir(parents=True, exist_ok=True)
            return _EMPTY_MD5
        dest = self._object_path(bucket, key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            md5 = _write_atomically(dest, body)
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            raise _S3Error(
                409, "KeyConflict", f"{key}: a folder cannot hold both this key and its prefix"
            ) from None
        self._remember_etag(dest, md5)
        return md5

    def _copy_object(self, bucket: str, key: str, copy_source: str) -> bytes:
        source = unquote(copy_source.split("?", 1)[0]).lstrip("/")
        source_bucket, _, source_key = source.partition("/")
        self._bucket_dir(source_bucket)
        source_path = self._object_path(source_bucket, source_key)
        if not source_path.is_file():
            raise _no_such_key()
        md5 = self._put_object(bucket, key, _file_pieces(source_path))
        mtime = self._object_path(bucket, key).stat().st_mtime
        return (
            f'{_XML_DECL}<CopyObjectResult xmlns="{_XMLNS}"><LastModified>{_iso8601(mtime)}'
            f"</LastModified><ETag>&quot;{md5}&quot;</ETag></CopyObjectResult>"
        ).encode()

    def _delete_object(self, bucket: str, key: str) -> None:
        self._bucket_dir(bucket)
        try:
            path = self._object_path(bucket, key)
        except _S3Error:
            return  # S3 deletes missing keys without complaint
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, IsADirectoryError):
            path.unlink()
        with self._etags_lock:
            self._etags.pop(str(path), None)

    def _delete_objects(self, bucket: str, request: bytes) -> bytes:
        self._bucket_dir(bucket)
        try:
            document = ElementTree.fromstring(request)
        except ElementTree.ParseError:
            raise _S3Error(
                400, "MalformedXML", "The XML you provided was not well-formed"
            ) from None
        quiet = any(
            _local_name(e.tag) == "Quiet" and (e.text or "").strip() == "true" for e in document
        )
        deleted = []
        for element in document:
            if _local_name(element.tag) != "Object":
                continue
            key = next((c.text or "" for c in element if _local_name(c.tag) == "Key"), "")
            with contextlib.suppress(_S3Error):
                self._delete_object(bucket, key)
            if not quiet:
                deleted.append(f"<Deleted><Key>{escape(key)}</Key></Deleted>")
        body = f'{_XML_DECL}<DeleteResult xmlns="{_XMLNS}">{"".join(deleted)}</DeleteResult>'
        return body.encode()

    def _delete_bucket(self, bucket: str) -> None:
        folder = self._bucket_dir(bucket)
        if _has_objects(str(folder)):
            raise _S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty")
        shutil.rmtree(folder, ignore_errors=True)

    def _create_multipart_upload(self, bucket: str, key: str) -> bytes:
        self._bucket_dir(bucket)
        self._object_path(bucket, key)
        upload_id = uuid.uuid4().hex
        folder = self._root / _UPLOADS_DIR / upload_id
        folder.mkdir(parents=True)
        with self._uploads_lock:
            self._uploads[upload_id] = _Upload(bucket, key, folder)
        return (
            f'{_XML_DECL}<InitiateMultipartUploadResult xmlns="{_XMLNS}"><Bucket>'
            f"{escape(bucket)}</Bucket><Key>{escape(key)}</Key><UploadId>{upload_id}"
            "</UploadId></InitiateMultipartUploadResult>"
        ).encode()

    def _upload(self, upload_id: str) -> _Upload:
        with self._uploads_lock:
            upload = self._uploads.get(upload_id)
        if upload is None:
            raise _S3Error(404, "NoSuchUpload", "The specified upload does not exist.")
        return upload

    def _upload_part(self, upload_id: str, part_number: str, body: Iterable[bytes]) -> str:
        upload = self._upload(upload_id)
        if not part_number.isdigit() or not 1 <= int(part_number) <= 10_000:
            raise _S3Error(400, "InvalidArgument", f"partNumber={part_number}")
        md5 = _write_atomically(upload.folder / part_number, body)
        with self._uploads_lock:
            upload.etags[int(part_number)] = md5
        return md5

    def _complete_multipart_upload(
        self, bucket: str, key: str, upload_id: str, request: bytes
    ) -> bytes:
        upload = self._upload(upload_id)
        if (upload.bucket, upload.key) != (bucket, key):
            raise _S3Error(404, "NoSuchUpload", "The upload is for another key.")
        try:
            document = ElementTree.fromstring(request)
        except ElementTree.ParseError:
            raise _S3Error(
                400, "MalformedXML", "The XML you provided was not well-formed"
            ) from None
        numbers = []
        for part in document:
            fields = {_local_name(c.tag): (c.text or "").strip() for c in part}
            number = fields.get("PartNumber", "")
            with self._uploads_lock:
                known = upload.etags.get(int(number)) if number.isdigit() else None
            if known is None or fields.get("ETag", "").strip('"') != known:
                raise _S3Error(400, "InvalidPart", f"part {number} was not uploaded as listed")
            numbers.append(number)
        if not numbers or numbers != sorted(numbers, key=int):
            raise _S3Error(400, "InvalidPartOrder", "Parts must be listed in ascending order.")

        def concatenated() -> Iterator[bytes]:
            for number in numbers:
                yield from _file_pieces(upload.folder / number)

        md5 = self._put_object(bucket, key, concatenated())
        with self._uploads_lock:
            self._uploads.pop(upload_id, None)
        shutil.rmtree(upload.folder, ignore_errors=True)
        return (
            f'{_XML_DECL}<CompleteMultipartUploadResult xmlns="{_XMLNS}"><Location>'
            f"{escape(self.endpoint_url)}/{escape(bucket)}/{escape(key)}</Location><Bucket>"
            f"{escape(bucket)}</Bucket><Key>{escape(key)}</Key><ETag>&quot;{md5}&quot;</ETag>"
            "</CompleteMultipartUploadResult>"
        ).encode()

    def _abort_multipart_upload(self, upload_id: str) -> None:
        with self._uploads_lock:
            upload = self._uploads.pop(upload_id, None)
        if upload is None:
            raise _S3Error(404, "NoSuchUpload", "The specified upload does not exist.")
        shutil.rmtree(upload.folder, ignore_errors=True)

    # -- listings -------------------------------------------------------------------------

    def _list_buckets_xml(self) -> bytes:
        buckets = []
        for entry in sorted(os.scandir(self._root), key=lambda e: e.name):
            if entry.is_dir() and not entry.name.startswith("."):
                created = _iso8601(entry.stat().st_mtime)
                buckets.append(
                    f"<Bucket><Name>{escape(entry.name)}</Name>"
                    f"<CreationDate>{created}</CreationDate></Bucket>"
                )
        return (
            f'{_XML_DECL}<ListAllMyBucketsResult xmlns="{_XMLNS}"><Owner><ID>fastload</ID>'
            f"<DisplayName>fastload</DisplayName></Owner><Buckets>{''.join(buckets)}</Buckets>"
            "</ListAllMyBucketsResult>"
        ).encode()

    def _candidates(
        self, folder: Path, prefix: str, folders_as_prefixes: bool
    ) -> list[tuple[str, str, bool]]:
        """Sorted (key, filesystem path, is_folder) below ``folder`` whose keys start with
        ``prefix``. With ``folders_as_prefixes`` (delimiter "/"), folders past the prefix
        are not walked: each stands for its common prefix, key ``name/``."""
        head = prefix.rpartition("/")[0]
        start = os.path.join(folder, head) if head else str(folder)
        found: list[tuple[str, str, bool]] = []
        stack = [(start, head + "/" if head else "")]
        while stack:
            directory, base = stack.pop()
            try:
                scan = os.scandir(directory)
            except OSError:  # missing, or a file where the prefix wants a folder
                continue
            with scan:
                for entry in scan:
                    if entry.name.startswith(_TEMP_PREFIX):
                        continue
                    key = base + entry.name
                    if entry.is_dir():
                        sub = key + "/"
                        if not (sub.startswith(prefix) or prefix.startswith(sub)):
                            continue
                        if folders_as_prefixes and sub.startswith(prefix):
                            found.append((sub, entry.path, True))
                        else:
                            stack.append((entry.path, sub))
                    elif key.startswith(prefix) and entry.is_file():
                        found.append((key, entry.path, False))
        found.sort()
        return found

    def _list_objects_xml(self, bucket: str, args: dict[str, str], *, v2: bool) -> bytes:
        folder = self._bucket_dir(bucket)
        prefix = args.get("prefix", "")
        delimiter = args.get("delimiter", "")
        try:
            max_keys = min(int(args.get("max-keys", _MAX_KEYS)), _MAX_KEYS)
        except ValueError:
            raise _S3Error(400, "InvalidArgument", "max-keys must be an integer") from None
        token = args.get("continuation-token") if v2 else None
        if token is not None:
            try:
                marker = base64.urlsafe_b64decode(token.encode()).decode()
            except (binascii.Error, UnicodeDecodeError):
                raise _S3Error(
                    400, "InvalidArgument", "The continuation token provided is incorrect"
                ) from None
        else:
            marker = args.get("start-after" if v2 else "marker", "")
        candidates = self._candidates(folder, prefix, delimiter == "/")
        start = bisect.bisect_right(candidates, marker, key=lambda c: c[0]) if marker else 0
        if start and candidates[start - 1][2] and marker.startswith(candidates[start - 1][0]):
            start -= 1  # the marker lies inside a folder rolled up into a common prefix
        contents: list[tuple[str, str]] = []
        prefixes: list[str] = []
        truncated = False
        last = ""
        for key, path, is_folder in candidates[start:]:
            common: str | None = None
            if is_folder:
                common = key
            elif delimiter and (at := key.find(delimiter, len(prefix))) >= 0:
                common = key[: at + len(delimiter)]
            if common is not None and (common == marker or (prefixes and prefixes[-1] == common)):
                continue  # returned already (on this page or the one before)
            if is_folder and not _has_objects(path):
                continue
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            if common is not None:
                prefixes.append(common)
            else:
                contents.append((key, path))
            last = common or key
        encode: Callable[[str], str] = _url_encode if args.get("encoding-type") == "url" else escape
        out = [f'{_XML_DECL}<ListBucketResult xmlns="{_XMLNS}"><Name>{escape(bucket)}</Name>']
        out.append(f"<Prefix>{encode(prefix)}</Prefix>")
        if v2:
            out.append(f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount>")
            if token is not None:
                out.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
            if "start-after" in args:
                out.append(f"<StartAfter>{encode(args['start-after'])}</StartAfter>")
        else:
            out.append(f"<Marker>{encode(marker)}</Marker>")
        out.append(f"<MaxKeys>{max_keys}</MaxKeys>")
        if delimiter:
            out.append(f"<Delimiter>{encode(delimiter)}</Delimiter>")
        if "encoding-type" in args:
            out.append(f"<EncodingType>{escape(args['encoding-type'])}</EncodingType>")
        out.append(f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>")
        if truncated and v2:
            next_token = base64.urlsafe_b64encode(last.encode()).decode()
            out.append(f"<NextContinuationToken>{next_token}</NextContinuationToken>")
        elif truncated:
            out.append(f"<NextMarker>{encode(last)}</NextMarker>")
        for key, path in contents:
            try:
                st = os.stat(path)
                etag = self._etag(Path(path), st)
            except OSError:
                continue  # deleted since the walk
            out.append(
                f"<Contents><Key>{encode(key)}</Key><LastModified>{_iso8601(st.st_mtime)}"
                f"</LastModified><ETag>&quot;{etag}&quot;</ETag><Size>{st.st_size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        out.extend(
            f"<CommonPrefixes><Prefix>{encode(p)}</Prefix></CommonPrefixes>" for p in prefixes
        )
        out.append("</ListBucketResult>")
        return "".join(out).encode()
