"""fastload's exceptions: one base; each subclass also inherits the builtin a caller would catch."""

from __future__ import annotations


class FastloadError(Exception):
    """Base of every error fastload raises on purpose."""


class DecodeError(FastloadError, ValueError):
    """A sample could not be decoded; the message names it (URL or key) and says why.

    Here, not in :mod:`fastload.decode`, so that a dataset format (below the decoders) can
    say its sample holds no image; ``fastload.decode.DecodeError`` is this class."""


class InvalidDestinationError(FastloadError, ValueError):
    """A read destination is not a writable, C-contiguous byte buffer large enough for the read."""


class ReadError(FastloadError, OSError):
    """Reading a local file failed; ``filename`` names it and ``errno`` says why."""


class ShortReadError(ReadError):
    """A read that had to be exact reached the end of the file early."""


class NotYetAvailableError(FastloadError, NotImplementedError):
    """A documented feature whose work is still open in the issue tracker."""


class RemoteError(FastloadError, OSError):
    """Fetching or listing a remote object failed; the message names the URL (``filename``).

    Where the remote answered, ``status`` is the HTTP status and ``code`` the remote's error
    code (S3's ``SlowDown``, ``AccessDenied``); ``reason`` is the message without the URL,
    for reports that list URLs apart. None of them ever holds a credential."""

    status: int | None = None
    code: str | None = None
    reason: str = ""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The remote object or dataset root does not exist (HTTP 404, S3 NoSuchKey)."""


class RemoteAccessError(RemoteError, PermissionError):
    """The remote refused access (HTTP 401/403, S3 AccessDenied, missing credentials)."""


class RemoteChangedError(RemoteError):
    """The object changed on the remote since the dataset was listed (another ETag, version
    or size): its bytes would mix versions, so none are used. Permanent: a retry reads the
    same new version; opening the dataset again with ``refresh=True`` lists it anew.
    ``what`` says how the change showed (a 412 to ``If-Match``, another ETag or size)."""

    what: str = ""


class CredentialsInURLError(FastloadError, ValueError):
    """A URL carries ``user:password@``: credentials go in storage_options or the
    environment, where nothing prints them."""


class DatasetMismatchError(FastloadError, ValueError):
    """Ranks of one job, or a saved state and a loader, see different datasets (another
    listing: objects added, removed or changed); the message says which and how."""


class UnsafeCachePathError(FastloadError, OSError):
    """A path fastload owns in its cache directory is a symbolic link (or not what fastload
    made): writing through it could land anywhere, so nothing is written."""


class RemoteIntegrityError(RemoteError):
    """The bytes received do not match the size or checksum the remote advertised."""


class CacheError(FastloadError, OSError):
    """The local cache cannot do what was asked (full disk, a stuck lock, a broken index)."""


class CacheCorruptError(CacheError):
    """A cached file no longer matches its recorded size or checksum."""


class UnknownProtocolError(FastloadError, ValueError):
    """A URL whose protocol no fsspec filesystem handles (a typo, or an unsupported scheme)."""


class MissingBackendError(FastloadError, ImportError):
    """The fsspec backend for a URL's protocol is not installed; the message says what to
    ``pip install``."""
