"""The transport: fsspec filesystems for a URL, and what a failure from one of them means.

fsspec is the transport only. This module turns a dataset URL into a filesystem and a root,
strips credentials from URLs before they are shown or stored, and sorts backend exceptions
into transient ones (worth a retry) and permanent ones (fail fast, naming the URL).

No credential reaches what fastload shows. Errors are written from structured fields (the
public URL, the HTTP status, the remote's error code and message, the attempts made), never
from a backend exception's text alone: aiohttp's text of a presigned GET carries the whole
URL, key id, signature and session token included. :func:`scrub` is the last line of
defence on any text that still comes from a backend; :func:`clean_cause` keeps such text
out of the exception chain a traceback prints; and the DEBUG loggers of the transports
(botocore logs what it signs, headers and session token included) get a filter that
redacts the same things (:func:`redact_transport_logs`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import http
import logging
import random
import re
import ssl
import time
import urllib.parse
import xml.etree.ElementTree as ElementTree
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
E = TypeVar("E", bound=RemoteError)
_THROTTLE_PATTERN = re.compile(r"SlowDown|Throttl|TooManyRequests|RequestLimitExceeded|\b429\b")
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId"}
# What to install for a protocol whose fsspec backend is missing (a bare `pip install
# fastload` has only local files).
_S3_EXTRA = 'pip install "fastload[s3]"'
_HTTP_EXTRA = 'pip install "fastload[http]"'
_HF_EXTRA = 'pip install "fastload[hf]"'
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
    "hf": _HF_EXTRA,
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
    redact_transport_logs()  # the backend's modules (and their loggers) are imported now
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


def path_of(fs: fsspec.AbstractFileSystem, root: str, key: str, version: str | None = None) -> str:
    """The filesystem path of key below root (the inverse of key_of). An ``hf://`` object's
    path is pinned at the commit its version names (``hf_commit``): a GET reads the bytes the
    manifest listed, not what a branch points to since."""
    commit = hf_commit(version) if is_hf(fs) else None
    if commit is not None:
        root = hf_pinned(root, commit)
    if key == "":
        return root
    return f"{root.rstrip('/')}/{urllib.parse.quote(key) if is_http(fs) else key}"


# --- hf:// (the Hugging Face Hub) ------------------------------------------------------------


def is_hf(fs: fsspec.AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "hf" in protocols


def hf_commit(version: str | None) -> str | None:
    """The commit an ``hf://`` object's version names (``commit=<sha>;oid=...``), if any."""
    for part in (version or "").split(";"):
        name, _, value = part.partition("=")
        if name == "commit" and value:
            return value
    return None


@dataclasses.dataclass(frozen=True)
class HubPath:
    """An HfFileSystem path's parts: ``type`` ("dataset", "model", "space", ...),
    ``repo_id``, ``revision`` (None: the default branch), ``path_in_repo``; ``is_repo`` is
    False for a bucket (``buckets/...``), which has no commits."""

    type: str
    repo_id: str
    revision: str | None
    path_in_repo: str
    is_repo: bool = True


_SPECIAL_REF = re.compile(r"^(refs/convert/[^/]+|refs/pr/\d+)(?:/|$)")
_HUB_TYPES = {"datasets": "dataset", "spaces": "space", "models": "model"}


def hf_parse(path: str) -> HubPath:
    """The parts of an HfFileSystem path (``datasets/org/name[@rev]/sub``): huggingface_hub's
    own parser where it has one (1.x), the same grammar for repositories otherwise."""
    import huggingface_hub

    parse_hf_uri: Any = getattr(huggingface_hub, "parse_hf_uri", None)
    if parse_hf_uri is not None:
        p = parse_hf_uri(f"hf://{path}")
        return HubPath(p.type, p.id, p.revision, p.path_in_repo, bool(p.is_repo))
    head, _, rest = path.strip("/").partition("/")
    if head == "buckets":
        return HubPath("bucket", "/".join(rest.split("/")[:2]), None, "", is_repo=False)
    kind = _HUB_TYPES.get(head)
    if kind is None:
        kind, rest = "model", path.strip("/")
    org, _, rest = rest.partition("/")
    name, _, rest = rest.partition("/")
    revision = None
    if "@" in name:
        name, _, revision = name.partition("@")
        special = _SPECIAL_REF.match(f"refs/{rest}") if revision == "refs" else None
        if special is not None:  # refs/pr/3, refs/convert/parquet: slashes of the revision
            revision = special.group(1)
            rest = f"refs/{rest}"[len(revision) :]
        revision = urllib.parse.unquote(revision)
    return HubPath(kind, f"{org}/{name}", revision, rest.strip("/"))


def hf_pinned(path: str, commit: str) -> str:
    """An HfFileSystem path (``datasets/org/name[@rev]/sub``) at revision commit instead."""
    parsed = hf_parse(path)
    prefix = {"dataset": "datasets/", "space": "spaces/"}.get(parsed.type, "")
    if parsed.type not in ("dataset", "space", "model"):
        prefix = f"{parsed.type}s/"
    pinned = f"{prefix}{parsed.repo_id}@{commit}"
    return f"{pinned}/{parsed.path_in_repo}" if parsed.path_in_repo else pinned


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
    value = getattr(response, "status_code", None)  # httpx's (huggingface_hub's HfHubHTTPError)
    if isinstance(value, int) and 100 <= value < 600:
        return value
    return None


def _code_and_message(exc: BaseException) -> tuple[str | None, str | None]:
    """The remote's error code and message (S3's ``<Code>`` and ``<Message>``), if exc has them."""
    if isinstance(exc, HTTPResponseError):
        return exc.error_code, exc.error_message
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        error = response.get("Error") or {}
        return error.get("Code") or None, error.get("Message") or None
    headers = getattr(response, "headers", None)  # the Hub's (huggingface_hub over httpx)
    if headers is not None and hasattr(headers, "get"):
        code, message = headers.get("X-Error-Code"), headers.get("X-Error-Message")
        return (code or None), (message or None)
    return None, None


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


class HTTPResponseError(Exception):
    """A remote answered a request with an error status: the status and the remote's error
    code and message, parsed from its body, and nothing of the request (no URL: a presigned
    one carries the credentials). ``str()`` is ``503 SlowDown (Please reduce your request
    rate.)``."""

    def __init__(self, status: int, error_code: str | None, error_message: str | None) -> None:
        self.status = status
        self.error_code = error_code
        self.error_message = error_message
        super().__init__(_describe_status(status, error_code, error_message))

    @classmethod
    def from_body(cls, status: int, body: bytes) -> HTTPResponseError:
        """From an S3 error body (``<Error><Code>..</Code><Message>..</Message></Error>``);
        a body that is not one leaves code and message out."""
        code = message = None
        try:
            root = ElementTree.fromstring(body)
        except ElementTree.ParseError:
            pass
        else:
            code = (root.findtext("Code") or "").strip() or None
            message = (root.findtext("Message") or "").strip() or None
        return cls(status, code, message)


def _describe_status(status: int, code: str | None, message: str | None) -> str:
    if code is None:
        try:
            code = http.HTTPStatus(status).phrase
        except ValueError:
            code = "error"
    text = f"{status} {scrub(code)}"
    return f"{text} ({scrub(message)})" if message else text


def describe(exc: BaseException) -> tuple[str, int | None, str | None]:
    """What went wrong, for a user, without the URL: ``(reason, status, code)``, e.g.
    ``("503 SlowDown (Please reduce your request rate.)", 503, "SlowDown")``, or
    ``("ClientOSError: [Errno 104] Connection reset by peer", None, None)`` for a failure
    without an answer. Built from the exception's fields where it has them, its scrubbed
    text where not."""
    chain = _chain(exc)
    status = next((s for e in chain if (s := _status(e)) is not None), None)
    code = message = None
    for e in chain:
        code, message = _code_and_message(e)
        if code or message:
            break
    if status is not None:
        return _describe_status(status, code, message), status, code
    if code is not None:
        return (f"{scrub(code)} ({scrub(message)})" if message else scrub(code)), None, code
    text = scrub(" ".join(str(exc).split()))
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__), None, None


def classify(exc: BaseException, url: str, *, attempts: int | None = None) -> RemoteError:
    """A fastload error for a backend exception: permanent ones are subclasses that name why.

    Anything not known to be permanent is treated as transient (a plain RemoteError), so a
    new kind of network hiccup is retried rather than failing a long warm. The message
    names url (shown as :func:`public_url`), the status, the remote's error code and
    message, and the attempts made when given; the error's ``status``, ``code`` and
    ``reason`` (the message without the URL) carry them for reports.
    """
    if isinstance(exc, RemoteError):
        return exc
    url = public_url(url)
    reason, status, code = describe(exc)
    for e in _chain(exc):
        if _untrusted_certificate(e):
            return _remote_error(
                RemoteAccessError,
                errno.EACCES,
                f"the TLS certificate of {url} is not trusted ({scrub(str(e))[:120]}); trust "
                "its certificate authority with storage_options={'client_kwargs': {'verify': "
                "'/path/to/ca.pem'}} or $AWS_CA_BUNDLE",
                url,
                "TLS certificate not trusted",
                None,
                None,
            )
        e_status = _status(e)
        name = type(e).__name__
        e_code = _code_and_message(e)[0]
        if (
            isinstance(e, FileNotFoundError)
            or e_status in (404, 410)
            or e_code in ("NoSuchKey", "NoSuchBucket")
            or "NoSuchKey" in str(e)
        ):
            return _remote_error(
                RemoteNotFoundError,
                errno.ENOENT,
                f"{url} does not exist on the remote: {reason}; check the URL",
                url,
                reason,
                status,
                code,
            )
        if (
            isinstance(e, PermissionError)
            or e_status in (401, 403)
            or name in _PERMANENT_NAMES
            or e_code in ("AccessDenied", *_PERMANENT_NAMES)
            or "AccessDenied" in str(e)
        ):
            return _remote_error(
                RemoteAccessError,
                errno.EACCES,
                f"access to {url} was refused: {reason}; check credentials and storage_options",
                url,
                reason,
                status,
                code,
            )
    if attempts is not None:
        reason = f"{reason} after {attempts} attempt{'s' if attempts != 1 else ''}"
    timed_out = any(isinstance(e, TIMEOUT_ERRORS) for e in _chain(exc))
    return _remote_error(
        RemoteError,
        errno.ETIMEDOUT if timed_out else errno.EIO,
        f"fetching {url} failed: {reason}",
        url,
        reason,
        status,
        code,
    )


def _remote_error(
    cls: type[E],
    err: int,
    message: str,
    url: str,
    reason: str,
    status: int | None,
    code: str | None,
) -> E:
    error = cls(err, message, url)
    error.reason, error.status, error.code = reason, status, code
    return error


# --- keeping credentials out of text --------------------------------------------------------

_REDACTED = "<redacted>"
# Names whose value is a credential, in a query string (``Signature=...``), a header
# (``x-amz-security-token:...``, ``'X-Amz-Security-Token': b'...'``) or a log line
# (botocore's ``Signature:\n<hex>``). ``key`` only in lower case (s3fs's option), not S3's
# ``Key`` (an object's name).
_SECRET_NAMES = (
    r"x-amz-(?:security-token|signature|credential)|x-goog-(?:signature|credential)"
    r"|awsaccesskeyid|signature|credential|sig|(?:access|session|security|refresh|id)[-_]?token"
    r"|token|secret(?:[-_]?access)?(?:[-_]?key)?|sse-?customer-?key|password|passwd|(?-i:key)"
)
_VALUE = r"""(?:b?'[^']*'|b?"[^"]*"|[^\s&,;'"<>)]+)"""
_SECRETS = re.compile(
    # A URL first, whole: secrets go with its query string; its path stays as it is.
    r"""(?P<url>\b[a-z][a-z0-9+.-]*://[^\s'"<>]+)"""
    # An Authorization header: its value runs to its closing quote or the end of the line.
    r"""|(?P<auth>(?<![\w-])(?:proxy-)?authorization['"]?\s*[:=]\s*+)"""
    r"""(?!<redacted>)(?:b?'[^']*'|b?"[^"]*"|[^\n]+)"""
    rf"""|(?P<name>(?<![\w-])(?:{_SECRET_NAMES})['"]?\s*[:=]\s*){_VALUE}""",
    re.IGNORECASE,
)
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|ANPA|AGPA)[A-Z0-9]{12,}\b")
# A Hugging Face access token (``hf_`` and 30-odd letters and digits), wherever it shows.
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def scrub(text: str) -> str:
    """text without credentials: URLs lose their query string, fragment and user:password
    (``https://u:p@host/x?X-Amz-Signature=...`` -> ``https://host/x``), and the values of
    ``Authorization`` headers, of signature, credential, token, secret and key fields, and
    AWS key ids become ``<redacted>``. For any text from a backend on its way into an error,
    a report or a log; idempotent."""
    return _HF_TOKEN.sub(_REDACTED, _AWS_KEY_ID.sub(_REDACTED, _SECRETS.sub(_redact, text)))


def _redact(match: re.Match[str]) -> str:
    if match["url"]:
        return _without_secrets(match["url"])
    return (match["auth"] or match["name"]) + _REDACTED


def _without_secrets(url: str) -> str:
    """url (found in some text) with no userinfo, query string or fragment."""
    head = re.split(r"[?#]", url, maxsplit=1)[0]
    scheme, sep, rest = head.partition("://")
    authority, slash, path = rest.partition("/")
    return f"{scheme}{sep}{authority.rpartition('@')[2]}{slash}{path}"


class _Redacted(Exception):
    """Stands in, in an exception chain, for a backend exception whose text carried a
    credential: its type's name and its scrubbed text, raised where it was."""


def clean_cause(exc: BaseException | None) -> BaseException | None:
    """What to chain under a fastload error (``raise error from clean_cause(exc)``): exc
    itself when nothing a traceback prints of its chain carries a credential, else
    stand-ins with the same types' names, scrubbed texts and tracebacks."""
    if exc is None or not _needs_scrubbing(exc):
        return exc
    text = " ".join(str(exc).split())
    stand_in = _Redacted(f"{type(exc).__module__}.{type(exc).__qualname__}: {scrub(text)}")
    stand_in.__traceback__ = exc.__traceback__
    stand_in.__cause__ = clean_cause(_printed_next(exc))
    return stand_in


def _needs_scrubbing(exc: BaseException) -> bool:
    for e in _printed_chain(exc):
        text = str(e)
        if scrub(text) != text or any(scrub(n) != n for n in getattr(e, "__notes__", ())):
            return True
    return False


def _printed_chain(exc: BaseException) -> list[BaseException]:
    """exc and the exceptions a traceback of it prints: causes, and contexts not suppressed."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = _printed_next(current)
    return seen


def _printed_next(exc: BaseException) -> BaseException | None:
    if exc.__cause__ is not None or exc.__suppress_context__:
        return exc.__cause__
    return exc.__context__


class RedactingFilter(logging.Filter):
    """A logging filter that passes every record with :func:`scrub` applied to its message
    and traceback text. fastload puts one on the loggers of the transports it drives (see
    :func:`redact_transport_logs`); add one to a handler of your own for anything else."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it, not us
            return True
        clean = scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = scrub(logging.Formatter().formatException(record.exc_info))
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


# Loggers of the transports fastload drives that write credentials at DEBUG: botocore's
# signer (the string it signs, with the session token, and the signature) and endpoint (the
# request's headers: Authorization, X-Amz-Security-Token), and s3fs's call log (the
# arguments of each call: an SSE-C key in s3_additional_kwargs). Every logger already made
# below these namespaces gets the filter too.
_TRANSPORT_LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint", "s3fs")
_TRANSPORT_NAMESPACES = (
    "botocore",
    "aiobotocore",
    "s3fs",
    "aiohttp",
    "fsspec",
    "urllib3",
    "huggingface_hub",
    "httpx",  # huggingface_hub 1.x's HTTP client
    "httpcore",
    "httpx2",  # huggingface_hub 2.x's
    "httpcore2",
)
_FILTER = RedactingFilter()


def redact_transport_logs() -> None:
    """Puts :class:`RedactingFilter` on the transports' loggers (idempotent). A filter on
    the logger a record is made on applies before any handler sees the record, a user's
    handlers included, and costs nothing while the level is off."""
    names = set(_TRANSPORT_LOGGERS)
    names.update(
        name
        for name in list(logging.Logger.manager.loggerDict)
        if name.split(".", 1)[0] in _TRANSPORT_NAMESPACES
    )
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


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
                if error is exc:
                    raise
                if is_transient(error):
                    error = classify(exc, url, attempts=attempt)
                raise error from clean_cause(exc)
            time.sleep(backoff_s(attempt, base_s, 5.0))


def _untrusted_certificate(e: BaseException) -> bool:
    """A TLS handshake refused the server's certificate: retrying cannot help."""
    return isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e)


def integrity_error(url: str, what: str) -> RemoteIntegrityError:
    reason = f"{what} (a truncated or altered body)"
    return _remote_error(
        RemoteIntegrityError, errno.EIO, f"{url}: {reason}", url, reason, None, None
    )


TIMEOUT_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, asyncio.TimeoutError)
