"""The transport: fsspec filesystems for a URL, and what a failure from one of them means.

fsspec is the transport only. This module turns a dataset URL into a filesystem and a root,
strips credentials from URLs before they are shown or stored, and sorts backend exceptions
into transient ones (worth a retry) and permanent ones (fail fast, naming the URL).
"""

from __future__ import annotations

import asyncio
import errno
import random
import re
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import fsspec

from fastload.errors import (
    MissingBackendError,
    RemoteAccessError,
    RemoteError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    UnknownProtocolError,
)

T = TypeVar("T")
_THROTTLE_PATTERN = re.compile(r"SlowDown|Throttl|TooManyRequests|RequestLimitExceeded|\b429\b")
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId"}
# What to install for a protocol whose fsspec backend is missing (a bare `pip install
# fastload` has only local files).
_S3_EXTRA = 'pip install "fastload[s3]"'
_HTTP_EXTRA = 'pip install "fastload[http]"'
_BACKEND_INSTALL = {
    "s3": _S3_EXTRA,
    "s3a": _S3_EXTRA,
    "http": _HTTP_EXTRA,
    "https": _HTTP_EXTRA,
    "gs": "pip install gcsfs",
    "gcs": "pip install gcsfs",
    "az": "pip install adlfs",
    "abfs": "pip install adlfs",
    "abfss": "pip install adlfs",
    "adl": "pip install adlfs",
    "hf": "pip install huggingface_hub",
}


def open_filesystem(
    url: str, storage_options: dict[str, Any] | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem for url and the dataset root path in that filesystem's terms.

    Raises UnknownProtocolError for a protocol fsspec does not know, MissingBackendError
    (naming the package) where its backend is not installed.
    """
    check_protocols(url)
    options = dict(storage_options or {})
    if fsspec.core.split_protocol(url)[0] in ("s3", "s3a"):
        # s3fs sends a HEAD before every whole-object GET to decide whether to split it,
        # doubling requests, latency and client CPU; the stager splits large objects itself.
        options.setdefault("max_concurrency", 1)
    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root.rstrip("/") if root not in ("/", "") else root


def check_protocols(url: str) -> None:
    """Raises unless every protocol of url (``a::b://...`` chains too) can be opened here."""
    for part in url.split("::"):
        protocol = fsspec.core.split_protocol(part)[0] or "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            hint = _BACKEND_INSTALL.get(protocol, f"fsspec says: {exc}")
            raise MissingBackendError(
                f"{protocol}:// URLs need a package that is not installed: {hint}"
            ) from None
        except ValueError:
            raise UnknownProtocolError(
                f"unknown protocol {protocol}:// in {public_url(url)}; fastload reads local "
                "paths and what fsspec knows (s3://, gs://, az://, http(s)://, hf://, ...)"
            ) from None


def public_url(url: str) -> str:
    """url without user:password or query-string secrets, safe to log and store."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or parts.scheme == "file":
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def remote_url(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """A path of fs as a URL a user recognises (s3://bucket/key, http://host/x, /local/x)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local") or "://" in path:
        return public_url(path)
    return f"{protocol}://{path}"


def is_http(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in ("http", "https") for p in protocols)


def key_of(fs: fsspec.AbstractFileSystem, root: str, name: str) -> str:
    """The key of a listed path below root: ``/``-separated, percent-decoded for HTTP."""
    name = name.rstrip("/")
    if name == root.rstrip("/"):
        return ""
    prefix = root.rstrip("/") + "/"
    if not name.startswith(prefix):
        raise RemoteError(errno.EIO, f"listing of {root} returned {name}, which is not below it")
    key = name[len(prefix) :]
    return urllib.parse.unquote(key) if is_http(fs) else key


def path_of(fs: fsspec.AbstractFileSystem, root: str, key: str) -> str:
    """The filesystem path of key below root (the inverse of key_of)."""
    if key == "":
        return root
    return f"{root.rstrip('/')}/{urllib.parse.quote(key) if is_http(fs) else key}"


def _status(exc: BaseException) -> int | None:
    for attr in ("status", "status_code", "code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(value, int):
            return value
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def is_throttling(exc: BaseException) -> bool:
    """The remote asked us to slow down (S3 503 SlowDown, HTTP 429 or 503)."""
    return any(_status(e) in (429, 503) or _THROTTLE_PATTERN.search(str(e)) for e in _chain(exc))


def classify(exc: BaseException, url: str) -> RemoteError:
    """A fastload error for a backend exception: permanent ones are subclasses that name why.

    Anything not known to be permanent is treated as transient (a plain RemoteError), so a
    new kind of network hiccup is retried rather than failing a long warm.
    """
    if isinstance(exc, RemoteError):
        return exc
    chain = _chain(exc)
    for e in chain:
        status = _status(e)
        name = type(e).__name__
        if isinstance(e, FileNotFoundError) or status in (404, 410) or "NoSuchKey" in str(e):
            return RemoteNotFoundError(
                errno.ENOENT, f"{url} does not exist on the remote; check the URL", url
            )
        if (
            isinstance(e, PermissionError)
            or status in (401, 403)
            or name in _PERMANENT_NAMES
            or "AccessDenied" in str(e)
        ):
            return RemoteAccessError(
                errno.EACCES,
                f"access to {url} was refused ({e}); check credentials and storage_options",
                url,
            )
    detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return RemoteError(errno.EIO, f"fetching {url} failed: {detail}", url)


def is_transient(error: RemoteError) -> bool:
    return not isinstance(error, (RemoteNotFoundError, RemoteAccessError))


def backoff_s(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff with jitter: the wait before retry number attempt (1-based)."""
    cap = min(max_s, base_s * 2 ** (attempt - 1))
    return random.uniform(cap / 2, cap)


def with_retries(fn: Callable[[], T], url: str, *, retries: int = 5, base_s: float = 0.1) -> T:
    """fn(), retried on transient failures; a permanent one raises at once, naming url."""
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:
            error = classify(exc, url)
            attempt += 1
            if not is_transient(error) or attempt > retries:
                raise error from exc
            time.sleep(backoff_s(attempt, base_s, 5.0))


def integrity_error(url: str, what: str) -> RemoteIntegrityError:
    return RemoteIntegrityError(errno.EIO, f"{url}: {what} (a truncated or altered body)", url)


TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)
