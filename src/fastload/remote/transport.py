"""The transport: GETs and listings of one remote behind one small, blocking interface, and
its fsspec implementation, which serves every filesystem and which the faster transports
(:mod:`fastload.remote.obstore`, :mod:`fastload.remote.hub`) fall back to."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import fsspec

from fastload.remote.lazy_s3 import real_filesystem
from fastload.remote.listing import Listing
from fastload.remote.versions import Pin, VersionMismatch, check_total, strong_etag

Buffer = bytes | memoryview

log = logging.getLogger(__name__)


class Transport(Protocol):
    """GETs (blocking; the GIL is released while waiting where the backend allows it)."""

    def get(
        self, path: str, start: int | None = None, end: int | None = None, pin: Pin | None = None
    ) -> Buffer:
        """Bytes [start, end) of the object at path (a path of the fsspec filesystem), of
        the version ``pin`` names where the remote can say (the ETag sent as ``If-Match``,
        S3's version id, the object's size checked on the answer; a mismatch raises
        :class:`fastload.remote.versions.VersionMismatch`); raises what
        :func:`fastload.remote.classify` sorts, never text with a secret."""
        ...

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        """Every object below root as columns (keys relative to root), without a dict per
        object kept; None where this transport does not list (fsspec's find does then).
        ``progress`` is called with the number of objects of each page listed."""
        ...


class FsspecTransport:
    """GETs through the fsspec filesystem itself (any protocol)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, timeout_s: float) -> None:
        self._fs = fs  # a lazy s3:// one is made at the first GET that needs it
        self.timeout_s = timeout_s

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return real_filesystem(self._fs)

    def get(
        self, path: str, start: int | None = None, end: int | None = None, pin: Pin | None = None
    ) -> Buffer:
        fs: Any = self.fs
        if getattr(fs, "async_impl", False):
            pinned = _pinned_get(fs, pin)
            get = fs._cat_file if pinned is None else pinned
            try:
                data = fsspec.asyn.sync(
                    fs.loop, get, path, start=start, end=end, timeout=self.timeout_s
                )
            except fsspec.asyn.FSTimeoutError:
                raise TimeoutError(f"no complete answer within {self.timeout_s:g}s") from None
        else:
            data = fs.cat_file(path, start=start, end=end)
        return range_of_answer(data, start, end, path, lambda: self._size(path))

    def _size(self, path: str) -> int | None:
        try:
            size = self.fs.size(path)
        except (OSError, ValueError):
            return None
        return int(size) if size is not None else None

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        return None


def _pinned_get(fs: Any, pin: Pin | None) -> Callable[..., Any] | None:
    """A coroutine function (path, start, end) that GETs from fs at pin's version where fs
    is s3fs, fsspec's HTTP filesystem or gcsfs (what fsspec's ``_cat_file`` cannot send);
    None for other filesystems, or with nothing to pin."""
    if pin is None or (
        pin.etag is None and pin.version_id is None and pin.size is None and pin.generation is None
    ):
        return None
    name = type(fs).__name__
    if name == "S3FileSystem" and hasattr(fs, "_call_s3"):

        async def s3_get(path: str, start: int | None, end: int | None) -> bytes:
            bucket, key, listed_version = fs.split_path(path)
            request: dict[str, Any] = {"Bucket": bucket, "Key": key}
            version_id = pin.version_id or listed_version
            etag = strong_etag(pin)
            if version_id:
                request["VersionId"] = version_id
            elif etag is not None:
                request["IfMatch"] = etag
            ranged = start is not None or end is not None
            if ranged:
                request["Range"] = await fs._process_limits(path, start, end)
            answer = await fs._call_s3("get_object", **request)
            try:
                _check_answer(pin, answer.get("ETag"), _object_size(answer, ranged))
                return bytes(await answer["Body"].read())
            finally:
                answer["Body"].close()

        return s3_get
    if name == "HTTPFileSystem" and hasattr(fs, "set_session"):

        async def http_get(path: str, start: int | None, end: int | None) -> bytes:
            if start is not None and start == end:
                return b""
            kw = dict(fs.kwargs)
            headers = dict(kw.pop("headers", None) or {})
            etag = strong_etag(pin)
            if etag is not None:
                headers["If-Match"] = etag  # whole or ranged: 412 if it changed
            ranged = start is not None or end is not None
            if ranged:
                headers["Range"] = await fs._process_limits(path, start, end)
            session = await fs.set_session()
            async with session.get(fs.encode_url(path), headers=headers, **kw) as r:
                if r.status == 412:
                    raise VersionMismatch("the remote answered 412 Precondition Failed")
                fs._raise_not_found_for_status(r, path)
                _check_answer(pin, r.headers.get("ETag"), _http_size(r.headers, ranged))
                return bytes(await r.read())

        return http_get
    if name in ("GCSFileSystem", "ExtendedGcsFileSystem") and hasattr(fs, "_call"):
        return _gcs_get(fs, pin)
    return None


def _gcs_get(fs: Any, pin: Pin) -> Callable[..., Any]:
    """gcsfs's GET pinned at the listed generation (``ifGenerationMatch``: 412 if the object
    was rewritten), the answer's size checked against the listed one."""

    async def gcs_get(path: str, start: int | None, end: int | None) -> bytes:
        if start is not None and start == end:
            return b""
        ranged = start is not None or end is not None
        headers = {"Range": await fs._process_limits(path, start, end)} if ranged else {}
        try:
            answer, body = await fs._call(
                "GET", fs.url(path), headers=headers, ifGenerationMatch=pin.generation
            )
        except FileExistsError:  # how gcsfs raises a 412
            raise VersionMismatch("the remote answered 412 Precondition Failed") from None
        generation = answer.get("x-goog-generation")
        if pin.generation is not None and generation and generation != pin.generation:
            raise VersionMismatch(f"its generation is now {generation}")
        _check_answer(pin, None, _http_size(answer, ranged))
        return bytes(body)

    return gcs_get


_CONTENT_RANGE = re.compile(r"bytes\s+(?:\d+-\d+|\*)/(\d+)")


def total_of(content_range: str | None) -> int | None:
    """The object's size a Content-Range header gives (``bytes 0-9/1234`` -> 1234)."""
    match = _CONTENT_RANGE.match(content_range or "")
    return int(match.group(1)) if match else None


def _object_size(answer: Mapping[str, Any], ranged: bool) -> int | None:
    """The whole object's size a botocore GetObject answer gives."""
    if ranged:
        return total_of(answer.get("ContentRange"))
    length = answer.get("ContentLength")
    return length if isinstance(length, int) else None


def _http_size(headers: Mapping[str, str], ranged: bool) -> int | None:
    """The whole object's size an HTTP answer gives (none for an encoded body)."""
    if headers.get("Content-Encoding") not in (None, "identity"):
        return None
    if ranged:
        return total_of(headers.get("Content-Range"))
    try:
        return int(headers.get("Content-Length") or "")
    except ValueError:
        return None


def _check_answer(pin: Pin, etag: str | None, total: int | None) -> None:
    """Raises VersionMismatch where an answer is not of the listed version: another
    strong ETag (a server that ignored If-Match), or another size."""
    listed = strong_etag(pin)
    if listed is not None and etag and not etag.startswith("W/") and etag != listed:
        raise VersionMismatch(f"its ETag is now {etag}")
    why = check_total(pin, total)
    if why is not None:
        raise VersionMismatch(why)


_ignoring_range: set[str] = set()  # hosts already named in the log


def range_of_answer(
    data: Buffer,
    start: int | None,
    end: int | None,
    path: str,
    size_of: Callable[[], int | None] = lambda: None,
) -> Buffer:
    """Bytes [start, end) of an answer to a ranged GET. A server that ignores ``Range``
    (Python's http.server, many simple file servers) answers 200 with the whole object: the
    range is cut out of it. An answer longer than the range asked for can only be that (a
    206 is never longer); where the range's length depends on the object's size (no end, a
    negative end), ``size_of()`` gives the size, and an answer of exactly that many bytes is
    the whole object."""
    if start is None and end is None:
        return data
    if start is not None and start < 0 and end is None:
        wanted: int | None = -start  # the last -start bytes
    elif start is not None and end is not None and start >= 0 and end >= 0:
        wanted = max(end - start, 0)
    else:
        wanted = None
    if wanted is not None:
        if len(data) <= wanted:
            return data
    else:
        size = size_of()
        whole = slice(start, end).indices(size) if size is not None else (0, 0, 1)
        if size is None or len(data) != size or whole[:2] == (0, size):
            return data
    host = path.split("://", 1)[-1].split("/", 1)[0]
    if host not in _ignoring_range:
        _ignoring_range.add(host)
        log.warning(
            "%s ignores Range requests (it sends whole objects): every byte range read from "
            "it downloads its whole object; a server that honours Range is much faster",
            host,
        )
    return memoryview(data)[start:end]
