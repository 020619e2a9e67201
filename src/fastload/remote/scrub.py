"""Keeping credentials out of text: URLs, messages, exception chains and the transports'
DEBUG logs. The last line of defence: errors are written from structured fields first
(:mod:`fastload.remote.errors`)."""

from __future__ import annotations

import logging
import re
import urllib.parse

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


def public_url(url: str) -> str:
    """url without user:password or query-string secrets, safe to log and store."""
    parts = urllib.parse.urlsplit(url)
    if not parts.scheme or parts.scheme == "file":
        return url
    netloc = parts.hostname or ""
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
