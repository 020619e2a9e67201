"""GETs and listings through obstore (Rust's object_store), where it sends what fsspec would.

Two transports, chosen per filesystem by :func:`fastload.remote.connect.transport_for`
(beside :class:`fastload.remote.hub.HubTransport` and the fsspec fallback):

- :class:`ObjectStoreTransport` for ``s3://`` when obstore is installed (the ``s3`` extra):
  Rust's object_store signs and sends each GET with the GIL released, at a fraction of the
  CPU of botocore's request pipeline or of aiohttp, and zero-copy into a buffer. Its
  endpoint, region, addressing, TLS trust and credentials are those of the s3fs session
  fastload opened for the URL (botocore resolves them: storage_options, the environment,
  profiles, instance roles); obstore's own environment lookup is overridden key by key and
  its retries are off, so fastload's retries and AIMD throttle stay in charge.
- :class:`ObjectStoreHTTPTransport` for the GETs of ``http(s)://`` (fsspec's HTTPFileSystem)
  when obstore is installed (the ``http`` extra): one obstore HTTPStore per scheme, host
  and port instead of aiohttp on fsspec's event loop, which holds the GIL for most of a
  small object's GET. It sends the request aiohttp would: the same URL byte for byte (a
  path whose percent-encoding obstore would write differently, or that carries a query
  string, a fragment or user:password, is left to fsspec), the headers of
  ``client_kwargs``/request options, and TLS verification on unless ``ssl=False``. Any
  other session or request setting (auth, cookies, an SSL context, a custom client),
  ``trust_env`` or a proxy in the environment (which obstore would use and aiohttp does
  not) leaves the filesystem to fsspec; listings are fsspec's in any case.

Each falls back to :class:`fastload.remote.transport.FsspecTransport` for S3 settings obstore
does not carry (requester-pays, SSE-C keys, proxies, client certificates, virtual-host
addressing on a custom endpoint) or answers it cannot follow (a redirect to another region;
from an HTTP server: a body without Content-Length, a range answered whole).

obstore's runtime hangs in a forked child once the parent has used it; a forked process
(a DataLoader worker) therefore never gets an obstore transport, whatever its parent did.
Version strings (ETag and LastModified as s3fs lists them) are the same from both, so no
cached object is refetched because the transport changed.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import fsspec.asyn

from fastload.errors import RemoteError
from fastload.remote.errors import (
    HTTPResponseError,
    NotFoundResponse,
    backoff_s,
    classify,
    is_throttling,
    is_transient,
)
from fastload.remote.lazy_s3 import LazyS3Filesystem
from fastload.remote.listing import Listing, from_arrow
from fastload.remote.s3_session import S3Session, plain_session
from fastload.remote.scrub import scrub
from fastload.remote.throttle import Throttle, shared_throttle
from fastload.remote.transport import Buffer, FsspecTransport
from fastload.remote.urls import is_http
from fastload.remote.versions import Pin, VersionMismatch, check_total, strong_etag


class Declined(Exception):
    """The remote answered what only fsspec can follow (from S3: a redirect to another
    region, an authorization header for another region; from an HTTP server: a range
    answered whole, a body without Content-Length); that bucket or host goes back to
    fsspec (s3fs, aiohttp)."""


_STATUS = re.compile(r"returned non-2xx status code: (\d{3})")
_BODY = re.compile(r"<Error>.*?</Error>", re.DOTALL)
# botocore's default endpoints; obstore builds the same ones from the region.
_AWS_HOST = re.compile(r"^https://s3([.-][a-z0-9-]+)?\.amazonaws\.com(\.cn)?/?$")


class _ObstoreTransport:
    """What both obstore transports share: one store per key (a bucket, a host) made on
    first use, keys declined back to fsspec, the fork guard, ranged GETs and errors
    translated for :func:`fastload.remote.classify`."""

    def __init__(self, fallback: FsspecTransport, make_store: Callable[[str], Any]) -> None:
        self._fallback = fallback
        self._make_store = make_store
        self._stores: dict[str, Any] = {}
        self._declined: set[str] = set()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _forked(self) -> bool:
        """True in a forked child: obstore's runtime would hang there."""
        return os.getpid() != self._pid

    def _store(self, key: str) -> Any:
        with self._lock:
            store = self._stores.get(key)
            if store is None:
                global _runtime_used
                _runtime_used = True
                store = self._stores[key] = self._make_store(key)
            return store

    def _get(
        self,
        key: str,
        location: str,
        path: str,
        start: int | None,
        end: int | None,
        pin: Pin | None,
        version_id: bool,
    ) -> Buffer:
        """Bytes [start, end) of location in key's store, of pin's version (``If-Match``
        with its ETag, or S3's ``versionId`` where ``version_id``; the answer's object size
        checked); path (the fsspec path) goes to fsspec where the store declines."""
        import obstore

        options: dict[str, Any] = {}
        if start is not None or end is not None:
            if end is None:
                options["range"] = {"offset": start or 0}
            else:
                options["range"] = (start or 0, end)
        etag = strong_etag(pin)
        if version_id and pin is not None and pin.version_id is not None:
            options["version"] = pin.version_id
        elif etag is not None:
            options["if_match"] = etag
        try:
            answer = obstore.get(self._store(key), location, options=options)  # type: ignore[arg-type]
            meta = answer.meta
            data = memoryview(answer.bytes())
        except Exception as exc:
            error = _translate(exc, self._fallback.timeout_s)
            if isinstance(error, Declined):
                self._declined.add(key)
                return self._fallback.get(path, start, end, pin)
            raise error from None
        answered = meta.get("e_tag")
        if etag is not None and answered and not answered.startswith("W/") and answered != etag:
            raise VersionMismatch(f"its ETag is now {answered}")
        why = check_total(pin, meta.get("size"))
        if why is not None:
            raise VersionMismatch(why)
        return data


def _client_options(timeout_s: float, scheme: str, verify: bool | str | None) -> dict[str, Any]:
    """obstore's client options: timeouts from fastload's, connections kept for every
    staging thread, plain http only for an http:// endpoint, and TLS trust (verify: False
    trusts anything, a path adds that PEM's authorities to the system's)."""
    options: dict[str, Any] = {
        "timeout": f"{timeout_s:g}s",
        "connect_timeout": f"{min(timeout_s, 10.0):g}s",
        "pool_max_idle_per_host": "1024",
        "allow_http": scheme == "http",
    }
    if verify is False:
        options["allow_invalid_certificates"] = True
    elif scheme == "https" and isinstance(verify, str):
        options["root_certificate"] = _read_pem(verify)
    return options


# fastload retries (and throttles) itself: obstore's own retries would hide the failures.
_NO_RETRIES: dict[str, Any] = {"max_retries": 0, "retry_timeout": datetime.timedelta(seconds=0)}


class ObjectStoreTransport(_ObstoreTransport):
    """S3 GETs and listings through obstore, with s3fs's session (see the module docstring)."""

    def __init__(self, fs: Any, settings: dict[str, Any], fallback: FsspecTransport) -> None:
        super().__init__(fallback, self._bucket_store)
        self._fs = fs
        self._settings = settings

    def _bucket_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        return S3Store(bucket, **self._settings)

    @classmethod
    def from_s3fs(cls, fs: Any, timeout_s: float) -> ObjectStoreTransport | None:
        """The transport for an s3fs filesystem, or None where obstore cannot send the same
        requests s3fs would (or is not installed)."""
        if _runtime_inherited or not (isinstance(fs, LazyS3Filesystem) or _eligible(fs)):
            return None
        try:
            import obstore  # noqa: F401
        except ImportError:
            return None
        if isinstance(fs, LazyS3Filesystem):
            session = plain_session(fs.storage_options)
            if session is not None:  # said without botocore: s3fs is not even imported
                credentials = None if session.credentials is None else _Static(session)
                endpoint = session.endpoint_url or ""
                aws = not endpoint or bool(_AWS_HOST.match(endpoint))
                return cls._made(fs, timeout_s, session.region, endpoint, aws, session.verify,
                                 credentials)  # fmt: skip
            fs = fs.materialize()
            if not _eligible(fs):
                return None
        client = fsspec.asyn.sync(fs.loop, fs.set_session)
        config = client.meta.config
        if getattr(config, "proxies", None) or getattr(config, "client_cert", None):
            return None
        endpoint = client.meta.endpoint_url or ""
        addressing = (getattr(config, "s3", None) or {}).get("addressing_style")
        aws = bool(_AWS_HOST.match(endpoint))
        if not aws and addressing == "virtual":
            return None
        verify = (getattr(fs, "client_kwargs", None) or {}).get("verify")
        anon = bool(getattr(fs, "anon", False))
        region = client.meta.region_name or "us-east-1"
        botocore_keys = None if anon else _Credentials(fs, client)
        return cls._made(fs, timeout_s, region, endpoint, aws, verify, botocore_keys)

    @classmethod
    def _made(
        cls,
        fs: Any,
        timeout_s: float,
        region: str,
        endpoint: str,
        aws: bool,
        verify: Any,
        credentials: Callable[[], dict[str, Any]] | None,
    ) -> ObjectStoreTransport:
        """The transport for a session's region, endpoint (AWS's own, or another), TLS
        trust and credentials (None: anonymous)."""
        if verify is not False and not isinstance(verify, str):
            verify = os.environ.get("AWS_CA_BUNDLE")
        # A CA file is trusted beside the system's roots (botocore trusts it alone).
        options = _client_options(timeout_s, endpoint.partition("://")[0], verify)
        settings: dict[str, Any] = {
            "region": region,
            # Every key obstore would otherwise take from its own AWS_* environment.
            "virtual_hosted_style_request": False,
            "request_payer": False,
            "unsigned_payload": False,
            "skip_signature": credentials is None,
            "client_options": options,
            "retry_config": _NO_RETRIES,
        }
        if not aws:
            settings["endpoint"] = endpoint.rstrip("/")
        if credentials is not None:
            settings["credential_provider"] = credentials
        return cls(fs, settings, FsspecTransport(fs, timeout_s))

    def get(
        self, path: str, start: int | None = None, end: int | None = None, pin: Pin | None = None
    ) -> Buffer:
        if self._forked():
            return self._fallback.get(path, start, end, pin)
        bucket, key, version = self._fs.split_path(path)
        if version or bucket in self._declined:
            return self._fallback.get(path, start, end, pin)
        return self._get(bucket, key, path, start, end, pin, version_id=True)

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        """Every object below root, with s3fs's sizes, ETags and LastModified (so versions
        compare equal); None to let s3fs list.

        The folders below root (class folders, or those of its only folder) are listed
        concurrently, at most ``_LIST_THREADS`` at once (obstore releases the GIL while it
        waits); a flat folder is one chain of pages. object_store normalizes keys (``a/`` and ``a``
        are one path to it), so a listing with an empty object (a folder marker, or a key
        it may have rewritten) or a key it rejects is left to s3fs."""
        if self._forked():
            return None
        bucket, key, _ = self._fs.split_path(root)
        import obstore

        store = self._store(bucket)
        base = key.rstrip("/")
        cut = len(base.encode()) + 1 if base else 0  # keys are relative to root
        arrow = _has_arro3()

        throttle = shared_throttle(self, _LIST_THREADS)  # the GETs' AIMD, if staging made it
        where = f"s3://{bucket}/"
        timeout_s = self._fallback.timeout_s

        def level(prefix: str | None) -> tuple[list[str], list[Listing] | None]:
            found = _retried(
                lambda: obstore.list_with_delimiter(store, prefix=prefix),
                throttle,
                f"{where}{prefix or ''} (listing its folders)",
                timeout_s,
            )
            # "a-b/" sorts before "a/": order folders as their keys sort
            folders = sorted(found["common_prefixes"], key=lambda f: f + "/")
            # Objects beside folders sort between them ("a.txt" between "a-b/" and "a/"):
            # a part each, so that the parts still follow one another in key order.
            loose = _entries(found["objects"], cut, progress)
            return folders, loose if loose is None else loose.pieces()

        def whole(prefix: str, as_arrow: bool) -> Listing | None:
            """Every page below prefix. A failed page is asked for again on its own (a new
            request resuming after the last key listed), inside the remote's throttle."""
            pages: list[Listing] = []
            failures = 0
            while True:
                last = pages[-1].key(len(pages[-1]) - 1).decode() if pages else None
                after = None if last is None else (base + "/" if base else "") + last
                stream = iter(
                    obstore.list(
                        store, prefix=prefix, offset=after, chunk_size=1000, return_arrow=as_arrow
                    )
                )
                try:
                    while True:
                        where_page = f"{where}{prefix} (listing page {len(pages) + 1})"
                        page = _request(
                            functools.partial(next, stream, None), throttle, where_page, timeout_s
                        )
                        if page is None:
                            return Listing.joined(pages)
                        failures = 0
                        part = from_arrow(page, cut) if as_arrow else _entries(page, cut, progress)
                        if part is None:  # a page Arrow cannot carry: the folder, as dicts
                            return whole(prefix, False) if as_arrow else None
                        if as_arrow and progress is not None:
                            progress(len(part))
                        pages.append(part)
                except _PageFailed as failed:
                    failures += 1
                    if failures > _PAGE_RETRIES:
                        raise failed.error from None
                    time.sleep(backoff_s(failures, 0.05, 2.0))

        try:
            folders, top = level(base or None)
            loose = [top]
            while len(folders) == 1:  # root/train/<classes>: the classes are the split
                folders, objects = level(folders[0])
                loose.append(objects)
            with ThreadPoolExecutor(min(_LIST_THREADS, max(1, len(folders)))) as pool:
                parts: list[Listing | None] = list(pool.map(lambda f: whole(f, arrow), folders))
            if any(pieces is None for pieces in loose):
                return None
            parts += [piece for pieces in loose if pieces is not None for piece in pieces]
        except RemoteError:  # a page that kept failing: already retried, and named
            raise
        except Exception as exc:
            error = _translate(exc, self._fallback.timeout_s)
            if isinstance(error, (Declined, ConnectionError)):
                self._declined.add(bucket)  # ConnectionError: a key object_store rejects
                return None
            raise error from None
        if any(part is None for part in parts):
            return None
        return Listing.joined([p for p in parts if p is not None])


# Folders of a bucket listed at once (each a chain of 1,000-key pages), at most: the
# remote's throttle (remote/throttle.py) may allow fewer.
_LIST_THREADS = 16
_PAGE_RETRIES = 8  # tries of one listing page before the listing fails


class _PageFailed(Exception):
    """A listing request that failed in a way worth asking again for (a 5xx, 429,
    SlowDown, a timeout); ``error`` is what to raise if it keeps failing."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _request(fn: Callable[[], Any], throttle: Throttle, where: str, timeout_s: float) -> Any:
    """One listing request inside the remote's throttle; a throttling answer halves it.
    A transient failure raises _PageFailed, a permanent one the RemoteError naming where
    (the prefix and the page); others (declined, a connection obstore cannot make) pass
    unchanged to the caller's fallback."""
    try:
        with throttle:
            result = fn()
    except Exception as exc:
        error = _translate(exc, timeout_s)
        if not isinstance(error, (HTTPResponseError, TimeoutError)):
            raise
        if is_throttling(error):
            throttle.throttled()
        remote_error = classify(error, where)
        if isinstance(error, NotFoundResponse) or not is_transient(remote_error):
            raise remote_error from None
        raise _PageFailed(classify(error, where, attempts=_PAGE_RETRIES + 1)) from None
    throttle.succeeded()
    return result


def _retried(fn: Callable[[], Any], throttle: Throttle, where: str, timeout_s: float) -> Any:
    """_request, asked again with backoff while it fails transiently."""
    for attempt in range(1, _PAGE_RETRIES + 2):
        try:
            return _request(fn, throttle, where, timeout_s)
        except _PageFailed as failed:
            if attempt > _PAGE_RETRIES:
                raise failed.error from None
            time.sleep(backoff_s(attempt, 0.05, 2.0))
    raise AssertionError("unreachable")


def _entries(
    metas: Sequence[Any], cut: int, progress: Callable[[int], None] | None
) -> Listing | None:
    """obstore's entries (dicts) as a listing; None at an entry only s3fs lists right (an
    empty object)."""
    if progress is not None:
        progress(len(metas))
    keys, sizes, versions = [], [], []
    for meta in metas:
        size = meta["size"]
        if size == 0:
            return None
        keys.append(meta["path"].encode()[cut:].decode())
        sizes.append(size)
        etag = meta["e_tag"]
        # fastload.manifest's version of s3fs's entry {"ETag": ..., "LastModified": ...}
        version = f"LastModified={meta['last_modified']}"
        versions.append(f"ETag={etag};{version}"[:512] if etag else version[:512])
    return Listing.of(keys, sizes, versions)


@functools.cache
def _has_arro3() -> bool:
    """Whether obstore can answer listings as Arrow (it needs arro3-core, of the s3 extra)."""
    try:
        import arro3.core  # noqa: F401
    except ImportError:
        return False
    return True


class ObjectStoreHTTPTransport(_ObstoreTransport):
    """GETs of fsspec's HTTPFileSystem through obstore's HTTPStore (see the module
    docstring); listings stay fsspec's."""

    def __init__(self, settings: dict[str, Any], encoded: bool, fallback: FsspecTransport) -> None:
        super().__init__(fallback, self._host_store)
        self._settings = settings
        self._encoded = encoded

    def _host_store(self, origin: str) -> Any:
        from obstore.store import HTTPStore

        options = {**self._settings, "allow_http": origin.startswith("http://")}
        return HTTPStore(origin, client_options=options, retry_config=_NO_RETRIES)  # type: ignore[arg-type]

    @classmethod
    def from_http(cls, fs: Any, timeout_s: float) -> ObjectStoreHTTPTransport | None:
        """The transport for an HTTPFileSystem, or None where obstore cannot send the
        requests aiohttp would (or is not installed)."""
        if not _http_eligible(fs) or _runtime_inherited:
            return None
        try:
            import obstore  # noqa: F401
        except ImportError:
            return None
        session = dict(fs.client_kwargs or {})
        request = dict(fs.kwargs or {})
        if session.pop("trust_env", False) or any(os.environ.get(v) for v in _PROXY_ENV):
            return None  # aiohttp would use .netrc and the proxies only with trust_env
        verify: Any = request.pop("ssl", True)
        if request.pop("verify_ssl", True) is False:
            verify = False
        if verify not in (True, False, None):
            return None  # an SSLContext, a fingerprint: nothing obstore takes
        headers = _headers(session.pop("headers", None), request.pop("headers", None))
        if headers is None or session or request:
            return None  # auth, cookies, a proxy, a timeout, a connector...
        # allow_http is set per host's store; "https" here for the TLS options.
        settings = _client_options(timeout_s, "https", False if verify is False else None)
        user_agent = headers.pop("user-agent", None)
        if user_agent is not None:
            settings["user_agent"] = user_agent
        if headers:
            settings["default_headers"] = headers
        return cls(settings, bool(getattr(fs, "encoded", False)), FsspecTransport(fs, timeout_s))

    def get(
        self, path: str, start: int | None = None, end: int | None = None, pin: Pin | None = None
    ) -> Buffer:
        if start is not None and start == end:
            return b""  # as fsspec answers, without a request
        target = None if self._forked() else _http_target(path, self._encoded)
        if target is None or target[0] in self._declined:
            return self._fallback.get(path, start, end, pin)
        return self._get(target[0], target[1], path, start, end, pin, version_id=False)

    def list_columns(
        self, root: str, progress: Callable[[int], None] | None = None
    ) -> Listing | None:
        return None


# What reqwest takes from the environment (aiohttp without trust_env does not).
_PROXY_ENV = tuple(
    name for base in ("http_proxy", "https_proxy", "all_proxy") for name in (base, base.upper())
)
# Headers obstore writes itself, or whose answer it would not decode as aiohttp does.
_OWN_HEADERS = {
    "host", "range", "if-range", "content-length", "transfer-encoding", "connection",
    "keep-alive", "te", "upgrade", "expect", "accept-encoding",
}  # fmt: skip


def _headers(*layers: Any) -> dict[str, str] | None:
    """The session's headers updated by the request's (as aiohttp merges them), names in
    lower case; None where one is not a plain string or is one obstore cannot send."""
    merged: dict[str, str] = {}
    for layer in layers:
        if layer is None:
            continue
        if not isinstance(layer, Mapping):
            return None
        for name, value in layer.items():
            if not isinstance(name, str) or not isinstance(value, str):
                return None
            if name.lower() in _OWN_HEADERS:
                return None
            merged[name.lower()] = value
    return merged


def _http_eligible(fs: Any) -> bool:
    if not is_http(fs):  # before the import: fsspec's http module needs aiohttp (an extra)
        return False
    from fsspec.implementations import http

    return (
        isinstance(fs, http.HTTPFileSystem)
        and fs.get_client is http.get_client  # a custom client: who knows what it sends
    )


# What rust-url percent-encodes in a path segment (obstore's HTTPStore writes each segment
# of the path so), besides controls and non-ASCII.
_SEGMENT_QUOTED = frozenset(' "#<>?`{}/%\\')


def _quote_segment(segment: str) -> str:
    return "".join(
        urllib.parse.quote(ch, safe="") if ch in _SEGMENT_QUOTED or ord(ch) > 0x7E else ch
        for ch in segment
    )


def _http_target(url: str, encoded: bool) -> tuple[str, str] | None:
    """(scheme://host:port, path in its HTTPStore) for an fsspec HTTP path, when obstore
    requests exactly the URL aiohttp would (yarl's encoding of it); None where not: a query
    string, a fragment, user:password (aiohttp sends it as basic auth), an empty, ``.`` or
    ``..`` segment, an encoded ``/`` or a control character, or a segment percent-encoded
    otherwise."""
    import yarl

    try:
        parsed = yarl.URL(url, encoded=encoded)
        origin = str(parsed.origin())
    except (ValueError, TypeError):
        return None
    raw_path = parsed.raw_path
    if (
        parsed.scheme not in ("http", "https")
        or parsed.raw_user is not None
        or parsed.raw_password is not None
        or parsed.raw_query_string
        or parsed.raw_fragment
        or not raw_path.startswith("/")
    ):
        return None
    segments = []
    for raw in raw_path[1:].split("/"):
        try:
            segment = urllib.parse.unquote(raw, errors="strict")
        except UnicodeDecodeError:
            return None
        if (
            segment in ("", ".", "..")
            or "/" in segment  # obstore would split it
            or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in segment)
            or _quote_segment(segment) != raw
        ):
            return None
        segments.append(segment)
    return origin, "/".join(segments)


class _Credentials:
    """obstore's credential provider: the keys of s3fs's botocore session, refreshed as
    botocore refreshes them (an instance role's, an assumed role's)."""

    def __init__(self, fs: Any, client: Any) -> None:
        self._fs = fs
        self._credentials = client._request_signer._credentials

    def __call__(self) -> dict[str, Any]:
        credentials = self._credentials
        frozen = fsspec.asyn.sync(self._fs.loop, credentials.get_frozen_credentials)
        expiry = getattr(credentials, "_expiry_time", None)
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            # obstore asks again before this; botocore refreshes ahead of its own expiry.
            "expires_at": expiry - datetime.timedelta(minutes=5) if expiry else None,
        }


class _Static:
    """obstore's credential provider for keys given in storage options or the environment
    (botocore's would answer the same keys, never expiring)."""

    def __init__(self, session: S3Session) -> None:
        assert session.credentials is not None
        self._keys = session.credentials

    def __call__(self) -> dict[str, Any]:
        key, secret, token = self._keys
        return {"access_key_id": key, "secret_access_key": secret, "token": token,
                "expires_at": None}  # fmt: skip


def _translate(exc: BaseException, timeout_s: float) -> BaseException:
    """obstore's exception as one :func:`fastload.remote.classify` sorts, without its text
    (which carries the request's URL): the status and S3's code and message, or a
    connection error naming what failed."""
    text = str(exc)
    if type(exc).__name__ in ("PreconditionError", "NotModifiedError"):  # a 412 to If-Match
        return VersionMismatch("the remote answered 412 Precondition Failed")
    match = _STATUS.search(text)
    if match is None:
        if _UNFOLLOWED.search(text):
            return Declined(0)
        if type(exc).__name__ == "FileNotFoundError" or isinstance(exc, FileNotFoundError):
            return FileNotFoundError("not found")
        if "timed out" in text or "Timeout" in text:
            return TimeoutError(f"no complete answer within {timeout_s:g}s")
        certificate = _CERTIFICATE.search(text)
        if certificate is not None:  # rustls's words for a certificate nobody vouches for
            return ssl.SSLCertVerificationError(f"certificate not trusted: {certificate.group(1)}")
        head = text.split(" - ", 1)[-1].split("\n", 1)[0]
        return ConnectionError(scrub(head)[:200])
    status = int(match.group(1))
    body = _BODY.search(text)
    answer = NotFoundResponse if status == 404 else HTTPResponseError
    error = answer.from_body(status, body.group(0).encode() if body else b"")
    if 300 <= status < 400 or (status == 400 and error.error_code in _REGION_CODES):
        return Declined(status)
    return error


_CERTIFICATE = re.compile(r"InvalidCertificate\(\s*(\w+)")
# Answers object_store does not follow and fsspec does: a range answered with the whole
# object (200), a response without Content-Length (chunked) or with headers it cannot parse.
_UNFOLLOWED = re.compile(r"RangeNotSupported|Range request not supported|source: Header \{")
_REGION_CODES = {"AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}


@functools.cache
def _read_pem(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _eligible(fs: Any) -> bool:
    return (
        type(fs).__name__ == "S3FileSystem"
        and not getattr(fs, "s3_additional_kwargs", None)
        and not getattr(fs, "req_kw", None)  # requester-pays
        and hasattr(fs, "set_session")
        and hasattr(fs, "split_path")
    )


# obstore's runtime (its threads and connections) does not survive fork: a child of a
# process that used it hangs on its first request. Such a child uses fsspec instead.
_runtime_used = False
_runtime_inherited = False


def _after_fork_in_child() -> None:
    global _runtime_inherited
    _runtime_inherited = _runtime_inherited or _runtime_used


os.register_at_fork(after_in_child=_after_fork_in_child)
