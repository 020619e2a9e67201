"""What a failure from a remote means: backend exceptions sorted into transient ones (worth
a retry, with backoff) and permanent ones (fail fast, naming the URL), as fastload's own
errors.

No credential reaches what fastload shows. Errors are written from structured fields (the
public URL, the HTTP status, the remote's error code and message, the attempts made), never
from a backend exception's text alone: aiohttp's text of a presigned GET carries the whole
URL, key id, signature and session token included (:mod:`fastload.remote.scrub` is the last
line of defence on any text that still comes from a backend).
"""

from __future__ import annotations

import asyncio
import errno
import http
import random
import re
import ssl
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from typing import TypeVar

from fastload.errors import (
    RemoteAccessError,
    RemoteChangedError,
    RemoteError,
    RemoteIntegrityError,
    RemoteNotFoundError,
)
from fastload.remote.scrub import clean_cause, public_url, scrub
from fastload.remote.versions import Pin, VersionMismatch, changed_error

T = TypeVar("T")
E = TypeVar("E", bound=RemoteError)
_THROTTLE_PATTERN = re.compile(r"SlowDown|Throttl|TooManyRequests|RequestLimitExceeded|\b429\b")
_TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}
_PERMANENT_NAMES = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId"}


# --- hf:// (the Hugging Face Hub) ------------------------------------------------------------


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


class NotFoundResponse(HTTPResponseError, FileNotFoundError):
    """A 404: a FileNotFoundError (as fsspec raises for one) that keeps the status and the
    remote's error code and message."""


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
        if isinstance(e, VersionMismatch):
            return changed_error(url, Pin(), str(e))
        if _status(e) == 412 or _code_and_message(e)[0] == "PreconditionFailed":
            return changed_error(url, Pin(), "the remote answered 412 Precondition Failed")
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


def is_transient(error: RemoteError) -> bool:
    return not isinstance(error, (RemoteNotFoundError, RemoteAccessError, RemoteChangedError))


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
