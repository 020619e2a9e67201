"""fastload: stage datasets from anywhere fsspec reaches onto local NVMe; feed GPUs without waiting.

See DESIGN.md for the data path; each stage lives in its own module.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastload.datasets import open_dataset
from fastload.errors import (
    FastloadError,
    InvalidDestinationError,
    NotYetAvailableError,
    ReadError,
    ShortReadError,
)
from fastload.reader import (
    BatchReader,
    ReadRequest,
    aligned_empty,
    native_available,
    native_status,
)
from fastload.warm import warm

try:
    __version__ = version("fastload")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BatchReader",
    "FastloadError",
    "InvalidDestinationError",
    "NotYetAvailableError",
    "ReadError",
    "ReadRequest",
    "ShortReadError",
    "__version__",
    "aligned_empty",
    "native_available",
    "native_status",
    "open_dataset",
    "warm",
]
