"""The native JPEG batch transform (``fastload._native_jpeg``), where it was built and loads.

One call per batch reads every JPEG header, and one more decodes (libjpeg-turbo, DCT-scaled,
only the crop's columns and rows transformed), resizes, flips and normalizes every sample
into the batch, on C++ threads with the GIL released. The crop boxes still come from
``fastload.decode.params``, so the results are those of the Python path within the resize
tolerance. It is a separate module from ``fastload._native`` because it links
libjpeg-turbo: a build without it, or a machine without its library, keeps the rest of the
extension and decodes JPEGs with simplejpeg instead.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

NATIVE_JPEG_ENV = "FASTLOAD_NATIVE_JPEG"
"""Set to ``0`` to decode with the Python path (simplejpeg + torch) instead."""

_INSTALL = (
    "install libjpeg-turbo's development files (Debian/Ubuntu: apt install "
    "libjpeg-turbo8-dev or libjpeg62-turbo-dev; Fedora: dnf install libjpeg-turbo-devel) "
    "and reinstall fastload"
)


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get(NATIVE_JPEG_ENV, "1") == "0" or os.environ.get("FASTLOAD_NATIVE") == "0":
        return None, f"disabled by {NATIVE_JPEG_ENV}=0 (or FASTLOAD_NATIVE=0)"
    try:
        module = importlib.import_module("fastload._native_jpeg")
    except ModuleNotFoundError:
        return None, f"fastload was built without libjpeg-turbo; {_INSTALL}"
    except ImportError as e:  # built, but its libjpeg does not load here
        log.warning("fastload's native JPEG transform does not load (%s)", e)
        return None, f"failed to load ({e}): install libjpeg-turbo's library (libjpeg.so.62)"
    return module, "loaded"


_module, _status = _load()
if _module is not None and hasattr(_module, "prepare_exit"):  # not on an older build
    # As fastload.reader does for its reads: a transform in flight at the interpreter's
    # finalization parks its thread instead of aborting the process (native/gil_release.hpp).
    atexit.register(_module.prepare_exit)
_warned = False


def warn_missing_once() -> None:
    """At the first decode that could have used the native transform, says once per process
    that it is missing and how to get it: a source install without libjpeg-turbo's headers
    otherwise decodes several times slower without a word. Not when it was turned off."""
    global _warned
    if _module is not None or _warned or _status.startswith("disabled"):
        return
    _warned = True
    log.warning(
        "fastload decodes JPEGs on its slower Python path: the native JPEG transform is "
        "missing (%s). The prebuilt wheel (pip install --only-binary fastload fastload) "
        "carries it.",
        _status,
    )


def native_jpeg_available() -> bool:
    return _module is not None


def native_jpeg_status() -> str:
    """Why the native JPEG transform is or is not used, for logs and error messages."""
    return _status


def jpeg_transform(num_threads: int) -> Any:
    """A ``JpegTransform`` with ``num_threads`` threads (the caller's among them)."""
    if _module is None:
        raise RuntimeError(f"the native JPEG transform is not available: {_status}")
    return _module.JpegTransform(num_threads)
