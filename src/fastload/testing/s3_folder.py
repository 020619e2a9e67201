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

Listings cost O(page), not O(bucket): each folder's sorted entries are kept between
requests and scanned again only when the folder changed (its mtime or ctime moved, or
the server wrote into it), so a page stats the folders it walks through and the files
it returns. Files that tests write straight into ``root`` show up in the next listing.

Synthetic buckets (``synthetic=``, or a spec file in ``root``: see
:mod:`fastload.testing.synthetic`) hold objects computed from an index, never stored:
ImageNet-sized image folders or 69 GB of tar shards at no disk cost. They are read-only
(writes are answered ``403 AccessDenied``).

Counting: ``stats()`` (every request by method and URL path, bytes sent in all; see
``RemoteControls``) and ``read_stats()`` (answered listings, GETs and HEADs by S3
operation, and GET body bytes per object). For a server in its own process,
``S3FolderProcess`` has both.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import enum
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ElementTree
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple, Protocol, TypeVar
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

from fastload.testing.faults import Fault, RemoteBehavior, logger
from fastload.testing.http_server import (
    ControlledHandler,
    LoopbackServer,
    Unsatisfiable,
    parse_range,
)
from fastload.testing.process import HTTPServerProcess
from fastload.testing.s3_server import REGION, _s3_error, storage_options_for
from fastload.testing.synthetic import LAST_MODIFIED_S, SyntheticLayout, read_spec, write_spec

if TYPE_CHECKING:
    from _typeshed import SupportsLenAndGetItem

__all__ = ["ReadStats", "S3FolderProcess", "S3FolderServer"]

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
# Where a server in another process answers ``read_stats()`` (beside RemoteControls' paths).
READ_STATS_PATH = "/__fastload_testing__/s3-read-stats"
# A folder changed less than this long before it was scanned may change again within the
# same tick of the filesystem's clock, keeping its timestamps: its scan is not kept.
_SETTLE_NS = 2 * 10**9


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


def _read_only(bucket: str) -> _S3Error:
    return _S3Error(403, "AccessDenied", f"bucket {bucket} is synthetic, hence read-only")


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


# -- listings -------------------------------------------------------------------------------


class _Start(enum.Enum):
    """Where a listing starts, relative to a bound string."""

    AT = "at"  # the first key >= bound
    AFTER = "after"  # the first key > bound
    PAST = "past"  # the first key > bound that does not start with it (skips a common prefix)


def _first_index(items: SupportsLenAndGetItem[str], bound: str, start: _Start) -> int:
    """Where ``start`` from ``bound`` falls in the sorted ``items``."""
    if start is _Start.AT:
        return bisect.bisect_left(items, bound)
    if start is _Start.AFTER:
        return bisect.bisect_right(items, bound)
    return bisect.bisect_left(
        items, True, key=lambda item: item > bound and not item.startswith(bound)
    )


class _ObjectInfo(NamedTuple):
    size: int
    etag: str  # hex, unquoted
    mtime_s: float


_Ref = TypeVar("_Ref")


class _Listing(Protocol[_Ref]):
    """One bucket's objects in key order, for one request."""

    def keys_from(self, bound: str, start: _Start) -> Iterator[tuple[str, _Ref]]:
        """(key, what ``describe`` takes) of every object from ``start`` on, in key order."""
        ...

    def describe(self, ref: _Ref) -> _ObjectInfo | None:
        """Size, ETag and mtime; None if the object went away meanwhile."""
        ...


def _scan_directory(directory: str) -> list[str]:
    """The sorted entries of a folder that listings see; subfolders end with "/" (which
    makes this order the order of the keys below them: "a-b" < "a/" < "a0")."""
    names = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith(_TEMP_PREFIX):
                continue
            if entry.is_dir():
                names.append(entry.name + "/")
            elif entry.is_file():
                names.append(entry.name)
    names.sort()
    return names


class _FolderScan(NamedTuple):
    stamp: tuple[int, int, int]  # (inode, mtime_ns, ctime_ns) of the folder when scanned
    names: list[str]


class _DirectoryIndex:
    """Sorted entries of the folders below root, each scanned again only when it changed.

    Adding, removing or renaming an entry moves the folder's mtime and ctime, so one
    ``stat`` tells whether a kept scan still holds. A folder that changed within
    ``_SETTLE_NS`` of its scan could change again within one tick of the filesystem's
    clock and keep its timestamps, so that scan is not kept. The server's own writes
    ``forget`` the folders they touched.
    """

    def __init__(self) -> None:
        self._scans: dict[str, _FolderScan] = {}
        self._lock = threading.Lock()

    def names(self, directory: str, seen: dict[str, list[str]]) -> list[str]:
        """``directory``'s entries, checked once per request (``seen``)."""
        names = seen.get(directory)
        if names is not None:
            return names
        started_ns = time.time_ns()
        try:
            st = os.stat(directory)
        except OSError:
            st = None
        if st is None or not stat.S_ISDIR(st.st_mode):
            names = []  # missing, or a file where the bound wants a folder
        else:
            stamp = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            with self._lock:
                kept = self._scans.get(directory)
            if kept is not None and kept.stamp == stamp:
                names = kept.names
            else:
                try:
                    names = _scan_directory(directory)
                except OSError:
                    names = []
                settled = started_ns - max(st.st_mtime_ns, st.st_ctime_ns) > _SETTLE_NS
                with self._lock:
                    if settled:
                        self._scans[directory] = _FolderScan(stamp, names)
                    else:
                        self._scans.pop(directory, None)
        seen[directory] = names
        return names

    def files(
        self, directory: str, base: str, bound: str, start: _Start, seen: dict[str, list[str]]
    ) -> Iterator[tuple[str, str]]:
        """(key, path) of the files below ``directory``, whose keys begin with ``base`` (a
        prefix of ``bound``), in key order from ``start`` at ``bound`` on: the walk bisects
        its way down the bound's folders, then yields as far as the caller reads."""
        names = self.names(directory, seen)
        rest = bound[len(base) :]
        slash = rest.find("/")
        if slash < 0:
            first = _first_index(names, rest, start)
        else:  # the bound lies in a subfolder, if there is one of that name
            folder = rest[: slash + 1]
            first = bisect.bisect_left(names, folder)
            if first < len(names) and names[first] == folder:
                path = os.path.join(directory, folder[:-1])
                yield from self.files(path, base + folder, bound, start, seen)
                first += 1
        for i in range(first, len(names)):
            name = names[i]
            if name.endswith("/"):  # past the bound: all of it
                path = os.path.join(directory, name[:-1])
                yield from self.files(path, base + name, base + name, _Start.AT, seen)
            else:
                yield base + name, os.path.join(directory, name)

    def forget(self, directory: Path, up_to: Path) -> None:
        """Drop the scans of ``directory`` and of its parents up to ``up_to``."""
        with self._lock:
            while True:
                self._scans.pop(str(directory), None)
                if directory == up_to or directory == directory.parent:
                    return
                directory = directory.parent

    def forget_below(self, folder: Path) -> None:
        below = f"{folder}{os.sep}"
        with self._lock:
            for directory in [d for d in self._scans if d == str(folder) or d.startswith(below)]:
                del self._scans[directory]


class _FolderListing:
    """A folder bucket's files; ``describe`` stats one (and computes its MD5 once)."""

    def __init__(self, server: S3FolderServer, folder: Path) -> None:
        self._server, self._folder = server, str(folder)
        self._seen: dict[str, list[str]] = {}

    def keys_from(self, bound: str, start: _Start) -> Iterator[tuple[str, str]]:
        return self._server._directories.files(self._folder, "", bound, start, self._seen)

    def describe(self, path: str) -> _ObjectInfo | None:
        try:
            st = os.stat(path)
            return _ObjectInfo(st.st_size, self._server._etag(Path(path), st), st.st_mtime)
        except OSError:
            return None


class _SyntheticListing:
    """A synthetic bucket's objects, by index: bisections over the computed keys."""

    def __init__(self, layout: SyntheticLayout) -> None:
        self._layout = layout

    def keys_from(self, bound: str, start: _Start) -> Iterator[tuple[str, int]]:
        layout = self._layout
        for index in range(_first_index(layout.keys, bound, start), layout.count):
            yield layout.key(index), index

    def describe(self, index: int) -> _ObjectInfo:
        layout = self._layout
        return _ObjectInfo(layout.size(index), layout.etag(index), LAST_MODIFIED_S)


def _listed(
    listing: _Listing[_Ref], prefix: str, delimiter: str, marker: str
) -> Iterator[tuple[str, _Ref | None]]:
    """A listing's entries after ``marker``, in order: (key, ref) for each object,
    (common prefix, None) once for all the keys the delimiter rolls up into it."""
    bound, start = (marker, _Start.AFTER) if marker >= prefix else (prefix, _Start.AT)
    while True:
        for key, ref in listing.keys_from(bound, start):
            if not key.startswith(prefix):
                return
            at = key.find(delimiter, len(prefix)) if delimiter else -1
            if at < 0:
                yield key, ref
                continue
            common = key[: at + len(delimiter)]
            yield common, None
            bound, start = common, _Start.PAST  # the keys below it are rolled up: skip them
            break
        else:
            return


@dataclass(frozen=True)
class ReadStats:
    """What an S3FolderServer answered to reads, counted as it answered them.

    ``operations``: (S3 operation, path) -> answers, for ListObjects and ListObjectsV2
    (path ``/bucket``, a request per page), GetObject (each ranged GET one) and
    HeadObject (path ``/bucket/key``). Requests that an injected fault or an S3 error
    answered instead are not here (``stats()`` counts every request).
    ``body_bytes``: ``/bucket/key`` -> GetObject body bytes sent (half of a body that a
    truncate fault cut short).
    """

    operations: Mapping[tuple[str, str], int]
    body_bytes: Mapping[str, int]

    def count(self, operation: str, path: str | None = None) -> int:
        """Answers of ``operation`` (for ``path`` only, unless None)."""
        return sum(
            n
            for (op, p), n in self.operations.items()
            if op == operation and (path is None or p == path)
        )

    @property
    def listings(self) -> int:
        """ListObjects and ListObjectsV2 pages, all buckets."""
        return self.count("ListObjects") + self.count("ListObjectsV2")

    def to_json(self) -> dict[str, Any]:
        return {
            "operations": [[op, p, n] for (op, p), n in self.operations.items()],
            "body_bytes": dict(self.body_bytes),
        }

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> ReadStats:
        return ReadStats(
            operations=MappingProxyType({(op, p): n for op, p, n in data["operations"]}),
            body_bytes=MappingProxyType(dict(data["body_bytes"])),
        )


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

    def _answer_control(self, path: str) -> bool:
        if path != READ_STATS_PATH:
            return super()._answer_control(path)
        body = json.dumps(self._controls.read_stats().to_json()).encode()
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        return True

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
            layout = controls._synthetic.get(bucket)
            if layout is not None:
                return self._get_synthetic_object(layout, bucket, key, b, truncate)
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
            controls._check_bucket(bucket)
            return self._send_empty(200, {"x-amz-bucket-region": REGION})
        if method == "GET" and subresources == {"location"}:
            controls._check_bucket(bucket)
            location = f'{_XML_DECL}<LocationConstraint xmlns="{_XMLNS}"></LocationConstraint>'
            return self._send_xml(200, location.encode(), b, truncate=truncate)
        if method == "GET" and subresources <= {"list-type"}:
            version = args.get("list-type", "1")
            if version not in ("1", "2"):
                raise _S3Error(400, "InvalidArgument", f"list-type={version}")
            body = controls._list_objects_xml(bucket, args, v2=version == "2")
            controls._count_read("ListObjectsV2" if version == "2" else "ListObjects", f"/{bucket}")
            return self._send_xml(200, body, b, truncate=truncate)
        if method == "PUT" and not subresources:
            for _ in self._body():
                pass  # CreateBucketConfiguration: the region does not matter here
            if not _valid_bucket_name(bucket):
                raise _S3Error(400, "InvalidBucketName", "The specified bucket is not valid.")
            if bucket not in controls._synthetic:  # which exists already, as S3 allows
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

    def _check_if_match(self, etag: str) -> None:
        """S3's If-Match: 412 PreconditionFailed unless the object's ETag is the one named."""
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() not in ("*", f'"{etag}"', etag):
            raise _S3Error(
                412,
                "PreconditionFailed",
                "At least one of the pre-conditions you specified did not hold",
            )

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
            etag = controls._etag(path, st, f)
            self._check_if_match(etag)
            headers = _object_headers(etag, st.st_mtime)
            byte_range = self._byte_range(size)
            self._count_object_read(bucket, key, size, byte_range, truncate)
            self._send_open_file(
                f,
                size,
                byte_range,
                headers,
                send_body=self.command == "GET",
                truncate=truncate,
                b=b,
            )

    def _get_synthetic_object(
        self, layout: SyntheticLayout, bucket: str, key: str, b: RemoteBehavior, truncate: bool
    ) -> None:
        index = layout.index(key)
        if index is None:
            raise _no_such_key()
        size = layout.size(index)
        self._check_if_match(layout.etag(index))
        byte_range = self._byte_range(size)
        start, end = byte_range or (0, size)
        self._count_object_read(bucket, key, size, byte_range, truncate)
        if byte_range is None:
            self.send_response(HTTPStatus.OK)
        else:
            self.send_response(HTTPStatus.PARTIAL_CONTENT)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.send_header("Content-Length", str(end - start))
        for name, value in _object_headers(layout.etag(index), LAST_MODIFIED_S).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "GET":
            self._send_body(
                lambda n: layout.read(index, start, start + n), end - start, truncate, b
            )

    def _byte_range(self, size: int) -> tuple[int, int] | None:
        """The Range header's [start, end), None for the whole object; raises InvalidRange."""
        range_header = self.headers.get("Range")
        if range_header is None:
            return None
        try:
            return parse_range(range_header, size)
        except Unsatisfiable:
            raise _S3Error(416, "InvalidRange", "The requested range is not satisfiable") from None

    def _count_object_read(
        self, bucket: str, key: str, size: int, byte_range: tuple[int, int] | None, truncate: bool
    ) -> None:
        path = f"/{bucket}/{key}"
        if self.command == "HEAD":
            self._controls._count_read("HeadObject", path)
            return
        start, end = byte_range or (0, size)
        self._controls._count_read(
            "GetObject", path, (end - start) // 2 if truncate else end - start
        )


def _object_headers(etag: str, mtime_s: float) -> dict[str, str]:
    return {
        "Accept-Ranges": "bytes",
        "ETag": f'"{etag}"',
        "Last-Modified": formatdate(mtime_s, usegmt=True),
        "Content-Type": "binary/octet-stream",
    }


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

    ``synthetic`` maps bucket names to layouts of computed objects
    (:mod:`fastload.testing.synthetic`), served read-only beside the folder buckets, as
    are those declared in ``root``'s spec file (``synthetic.write_spec``). A folder of a
    synthetic bucket's name must not exist.

    Sets ``AWS_DEFAULT_REGION=us-east-1`` in ``os.environ``, as ``S3Server`` does.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        behavior: RemoteBehavior | None = None,
        tls: bool = False,
        synthetic: Mapping[str, SyntheticLayout] | None = None,
    ) -> None:
        self._owns_root = root is None
        if root is None:
            root = tempfile.mkdtemp(prefix="fastload-s3folder-")
        Path(root).mkdir(parents=True, exist_ok=True)
        self._root = Path(root).resolve(strict=True)
        self._synthetic = {**read_spec(self._root), **(synthetic or {})}
        for name in self._synthetic:
            if not _valid_bucket_name(name) or (self._root / name).exists():
                raise ValueError(
                    f"synthetic bucket {name!r}: not a bucket name, or {self._root / name} "
                    "exists (a folder bucket of that name)"
                )
        self._directories = _DirectoryIndex()
        self._etags: dict[str, tuple[int, int, str]] = {}  # path -> (size, mtime_ns, md5)
        self._etags_lock = threading.Lock()
        self._uploads: dict[str, _Upload] = {}
        self._uploads_lock = threading.Lock()
        self._reads: Counter[tuple[str, str]] = Counter()  # (operation, path) -> answers
        self._body_bytes: Counter[str] = Counter()  # path -> GetObject body bytes
        self._reads_lock = threading.Lock()
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

    @property
    def synthetic(self) -> Mapping[str, SyntheticLayout]:
        """The synthetic buckets' layouts, by bucket name."""
        return MappingProxyType(self._synthetic)

    # -- counters -------------------------------------------------------------------------

    def read_stats(self) -> ReadStats:
        """A snapshot of the answered listings, GETs and HEADs and GET body bytes."""
        with self._reads_lock:
            return ReadStats(
                operations=MappingProxyType(dict(self._reads)),
                body_bytes=MappingProxyType(dict(self._body_bytes)),
            )

    def reset_stats(self) -> None:
        """Zero the counters, ``read_stats()``'s too (queued faults and behavior stay)."""
        super().reset_stats()
        with self._reads_lock:
            self._reads.clear()
            self._body_bytes.clear()

    def _count_read(self, operation: str, path: str, body_bytes: int = 0) -> None:
        with self._reads_lock:
            self._reads[(operation, path)] += 1
            if body_bytes:
                self._body_bytes[path] += body_bytes

    # -- helpers (straight to the folder: no knobs, faults or counters) -------------------

    def create_bucket(self, name: str) -> None:
        """Create bucket ``name``; fine if it already exists."""
        if not _valid_bucket_name(name) or name in self._synthetic:
            raise ValueError(f"not a bucket name this server can create: {name!r}")
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
            self._directories.forget(dest.parent, up_to=self._root)
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
        """The folder of an existing folder bucket; raises NoSuchBucket, or AccessDenied
        for a synthetic bucket (which has no folder to read or write)."""
        if bucket in self._synthetic:
            raise _read_only(bucket)
        if not _valid_bucket_name(bucket):
            raise _no_such_bucket()
        folder = self._root / bucket
        if not folder.is_dir():
            raise _no_such_bucket()
        return folder

    def _check_bucket(self, bucket: str) -> None:
        """Raises NoSuchBucket unless ``bucket`` exists (in a folder or synthetic)."""
        if bucket not in self._synthetic:
            self._bucket_dir(bucket)

    def _listing(self, bucket: str) -> _Listing[Any]:
        layout = self._synthetic.get(bucket)
        if layout is not None:
            return _SyntheticListing(layout)
        return _FolderListing(self, self._bucket_dir(bucket))

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
            self._directories.forget(folder / key, up_to=folder)
            return _EMPTY_MD5
        dest = self._object_path(bucket, key)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            md5 = _write_atomically(dest, body)
        except (NotADirectoryError, FileExistsError, IsADirectoryError):
            raise _S3Error(
                409, "KeyConflict", f"{key}: a folder cannot hold both this key and its prefix"
            ) from None
        finally:
            # The server's own writes need no timestamps to show in the next listing.
            self._directories.forget(dest.parent, up_to=folder)
        self._remember_etag(dest, md5)
        return md5

    def _copy_object(self, bucket: str, key: str, copy_source: str) -> bytes:
        source = unquote(copy_source.split("?", 1)[0]).lstrip("/")
        source_bucket, _, source_key = source.partition("/")
        layout = self._synthetic.get(source_bucket)
        pieces: Iterator[bytes]
        if layout is not None:
            index = layout.index(source_key)
            if index is None:
                raise _no_such_key()
            pieces = layout.read(index, 0, layout.size(index))
        else:
            self._bucket_dir(source_bucket)
            source_path = self._object_path(source_bucket, source_key)
            if not source_path.is_file():
                raise _no_such_key()
            pieces = _file_pieces(source_path)
        md5 = self._put_object(bucket, key, pieces)
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
        self._directories.forget(path.parent, up_to=self._root / bucket)
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
        if next(_FolderListing(self, folder).keys_from("", _Start.AT), None) is not None:
            raise _S3Error(409, "BucketNotEmpty", "The bucket you tried to delete is not empty")
        shutil.rmtree(folder, ignore_errors=True)
        self._directories.forget_below(folder)

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
        created = {
            entry.name: entry.stat().st_mtime
            for entry in os.scandir(self._root)
            if entry.is_dir() and not entry.name.startswith(".")
        }
        created.update(dict.fromkeys(self._synthetic, LAST_MODIFIED_S))
        buckets = [
            f"<Bucket><Name>{escape(name)}</Name>"
            f"<CreationDate>{_iso8601(mtime)}</CreationDate></Bucket>"
            for name, mtime in sorted(created.items())
        ]
        return (
            f'{_XML_DECL}<ListAllMyBucketsResult xmlns="{_XMLNS}"><Owner><ID>fastload</ID>'
            f"<DisplayName>fastload</DisplayName></Owner><Buckets>{''.join(buckets)}</Buckets>"
            "</ListAllMyBucketsResult>"
        ).encode()

    def _list_objects_xml(self, bucket: str, args: dict[str, str], *, v2: bool) -> bytes:
        listing = self._listing(bucket)
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
        contents: list[tuple[str, Any]] = []
        prefixes: list[str] = []
        truncated = False
        last = ""
        for key, ref in _listed(listing, prefix, delimiter, marker):
            if ref is None and key == marker:
                continue  # the common prefix a page ended with: returned on that page
            if len(contents) + len(prefixes) >= max_keys:
                truncated = True
                break
            if ref is None:
                prefixes.append(key)
            else:
                contents.append((key, ref))
            last = key
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
        for key, ref in contents:
            info = listing.describe(ref)
            if info is None:
                continue  # deleted since the walk
            out.append(
                f"<Contents><Key>{encode(key)}</Key><LastModified>{_iso8601(info.mtime_s)}"
                f"</LastModified><ETag>&quot;{info.etag}&quot;</ETag><Size>{info.size}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        out.extend(
            f"<CommonPrefixes><Prefix>{encode(p)}</Prefix></CommonPrefixes>" for p in prefixes
        )
        out.append("</ListBucketResult>")
        return "".join(out).encode()


class S3FolderProcess(HTTPServerProcess):
    """An :class:`S3FolderServer` in a process of its own (so its work does not share the
    client's GIL), serving ``root`` (a temporary folder if None, removed on ``close()``)
    and the ``synthetic`` buckets.

    Everything of :class:`~fastload.testing.HTTPServerProcess` (``url``,
    ``storage_options``, ``stats()``, ``reset_stats()``, ``close()``), plus
    ``read_stats()``. The layouts reach the server through a spec file in ``root``
    (``synthetic.write_spec``), deleted on ``close()``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        synthetic: Mapping[str, SyntheticLayout] | None = None,
        behavior: RemoteBehavior | None = None,
        tls: bool = False,
    ) -> None:
        self._owned_root = tempfile.mkdtemp(prefix="fastload-s3folder-") if root is None else None
        served = Path(self._owned_root or root or ".")
        self._spec = write_spec(served, synthetic) if synthetic else None
        try:
            super().__init__(served, s3=True, behavior=behavior, tls=tls)
        except BaseException:
            self._remove_files()
            raise

    def read_stats(self) -> ReadStats:
        """The server's ``S3FolderServer.read_stats()``."""
        return ReadStats.from_json(json.loads(self._helper(READ_STATS_PATH)))

    def close(self) -> None:
        super().close()
        self._remove_files()

    def _remove_files(self) -> None:
        if self._spec is not None:
            self._spec.unlink(missing_ok=True)
        if self._owned_root is not None:
            shutil.rmtree(self._owned_root, ignore_errors=True)
