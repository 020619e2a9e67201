"""fastload's exceptions: one base; each subclass also inherits the builtin a caller would catch."""

from __future__ import annotations


class FastloadError(Exception):
    """Base of every error fastload raises on purpose."""


class InvalidDestinationError(FastloadError, ValueError):
    """A read destination is not a writable, C-contiguous byte buffer large enough for the read."""


class ReadError(FastloadError, OSError):
    """Reading a local file failed; ``filename`` names it and ``errno`` says why."""


class ShortReadError(ReadError):
    """A read that had to be exact reached the end of the file early."""


class NotYetAvailableError(FastloadError, NotImplementedError):
    """A documented feature whose work is still open in the issue tracker."""
