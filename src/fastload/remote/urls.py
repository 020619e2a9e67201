"""Dataset URLs: the fsspec filesystem and root of one, the protocols it needs, a key's path
and a path's key, and the URL shown to users (no credentials, no query string)."""

from __future__ import annotations

import errno
import re
import urllib.parse
from typing import Any

import fsspec

from fastload.errors import (
    CredentialsInURLError,
    MissingBackendError,
    RemoteError,
    UnknownProtocolError,
)
from fastload.remote.hub import hf_commit, hf_pinned, is_hf
from fastload.remote.lazy_s3 import lazy_s3_filesystem, lazy_s3_root
from fastload.remote.scrub import public_url, redact_transport_logs

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
    """The filesystem for url and the dataset root path in that filesystem's terms. A plain
    ``s3://bucket/prefix`` gets a :class:`~fastload.remote.lazy_s3.LazyS3Filesystem`: s3fs
    is imported where something needs it, not where obstore serves the bucket.

    Raises UnknownProtocolError for a protocol fsspec does not know, MissingBackendError
    (naming the package) where its backend is not installed.
    """
    refuse_credentials(url)
    options = dict(storage_options or {})
    if fsspec.core.split_protocol(url)[0] in ("s3", "s3a"):
        # s3fs sends a HEAD before every whole-object GET to decide whether to split it,
        # doubling requests, latency and client CPU; the stager splits large objects itself.
        options.setdefault("max_concurrency", 1)
        lazy_root = lazy_s3_root(url)
        if lazy_root is not None:  # s3fs imported only where something needs it
            return lazy_s3_filesystem(options), lazy_root
    check_protocols(url)
    fs, root = fsspec.core.url_to_fs(url, **options)
    redact_transport_logs()  # the backend's modules (and their loggers) are imported now
    return fs, root.rstrip("/") if root not in ("/", "") else root


def refuse_credentials(url: str) -> None:
    """Raises CredentialsInURLError where url (any part of a ``a::b://...`` chain) carries
    userinfo (``s3://KEY:SECRET@bucket/x``): a URL is printed, logged and kept in the cache's
    listings, and a backend's error would carry it, so it is refused before anything else
    sees it. ``hf://`` is exempt: its ``@`` names a revision (``hf://datasets/org/ds@main``)."""
    for part in url.split("::"):
        scheme, sep, rest = part.partition("://")
        if not sep or scheme.lower() == "hf":
            continue
        authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
        if "@" in authority:
            raise CredentialsInURLError(
                f"{public_url(part)}: the URL carries credentials (user:password@), which "
                "fastload refuses there; pass them in storage_options or the environment "
                "(for s3://: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )


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
