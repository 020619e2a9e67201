"""The listed version of an object, pinned on every GET: what to send (S3's ``If-Match``
with the ETag, or its ``versionId``; HTTP's ``If-Match``/``If-Range``) and what to check of
the answer (its size), so that an object rewritten after the listing is never read as a mix
of versions. A mismatch is a :class:`fastload.errors.RemoteChangedError` (permanent: a retry
reads the same new version).

The manifest's version strings are ``;``-joined ``Field=value`` pairs as the listing gave
them (``VersionId=...;ETag="..."``, ``LastModified=...``; :mod:`fastload.remote.crawl`,
:mod:`fastload.remote.obstore`); an ``hf://`` object is pinned at its commit instead
(:func:`fastload.remote.path_of`)."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from fastload.errors import RemoteChangedError


class VersionMismatch(Exception):
    """A transport's answer is not of the listed version (a 412 to ``If-Match``, another
    ETag or size); the text says how it shows, :func:`fastload.remote.classify` turns it
    into a :class:`RemoteChangedError` naming the URL."""


@dataclass(frozen=True, slots=True)
class Pin:
    """What a GET of one listed object must match: its ETag (quoted, as the remote sent
    it), its S3 version id, its size in bytes. Any may be unknown (None)."""

    etag: str | None = None
    version_id: str | None = None
    size: int | None = None
    generation: str | None = None  # a GCS object's generation (sent as ifGenerationMatch)


def _fields(version: str | None) -> dict[str, str]:
    found: dict[str, str] = {}
    for part in (version or "").split(";"):
        name, sep, value = part.partition("=")
        if sep and value:
            found.setdefault(name.strip().lower(), value.strip())
    return found


def etag_of(version: str | None) -> str | None:
    """The ETag a listed version names (``ETag="abc"`` -> ``"abc"``), quoted as HTTP sends
    it; None when the listing gave none."""
    etag = _fields(version).get("etag")
    if not etag:
        return None
    if etag.startswith('W/"') or (etag.startswith('"') and etag.endswith('"') and len(etag) > 1):
        return etag
    return f'"{etag}"'


def pin_of(version: str | None, size: int | None) -> Pin:
    """The pin of a listed object (its manifest version and size)."""
    fields = _fields(version)
    version_id = fields.get("versionid")
    generation = fields.get("generation")
    return Pin(
        etag=etag_of(version),
        version_id=version_id if version_id and version_id != "null" else None,
        size=size,
        generation=generation if generation and generation.isdigit() else None,
    )


def strong_etag(pin: Pin | None) -> str | None:
    """The ETag to send in ``If-Match``/``If-Range`` (weak ETags never match there)."""
    if pin is None or pin.etag is None or pin.etag.startswith("W/"):
        return None
    return pin.etag


def changed_error(url: str, pin: Pin, what: str) -> RemoteChangedError:
    """The error for an object that changed since the listing; what says how it shows."""
    listed = ", ".join(
        f"{name} {value}"
        for name, value in (("ETag", pin.etag), ("version", pin.version_id), ("size", pin.size))
        if value is not None
    )
    reason = f"changed on the remote since it was listed ({what}; listed {listed or 'no version'})"
    error = RemoteChangedError(
        errno.ESTALE,
        f"{url} {reason}; open the dataset again with refresh=True to read the new version",
        url,
    )
    error.reason, error.what = reason, what
    error.code = "PreconditionFailed" if "412" in what else None
    return error


def check_total(pin: Pin | None, total: int | None) -> str | None:
    """Why an answer whose object has ``total`` bytes is not the listed version, or None."""
    if pin is None or pin.size is None or total is None or total == pin.size:
        return None
    return f"it now has {total} bytes, listed {pin.size}"
