"""fastload: stage datasets from anywhere fsspec reaches onto local NVMe; feed GPUs without waiting.

Each stage of the data path lives in a package of its own; the README's "Layout" lists them.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from fastload import decode, pickled_names
from fastload.datasets import open_dataset
from fastload.datasets.tar import write_index
from fastload.errors import (
    FastloadError,
    InvalidDestinationError,
    NotYetAvailableError,
    ReadError,
    ShortReadError,
)
from fastload.plan import Plan, PlanError, ResumeState, ResumeStateError, ShardFuture
from fastload.reader import (
    BatchReader,
    ReadRequest,
    aligned_empty,
    native_available,
    native_status,
)
from fastload.staging.lifetime import exit_with_parent as _exit_with_parent
from fastload.warm import NodeShare, WarmReport, warm

# A process a fastload process started (a staging process, a benchmark's child) ends with
# its parent, however the parent ends (fastload.staging.lifetime); nothing otherwise.
_exit_with_parent()

if TYPE_CHECKING:
    from fastload.diagnosis.diagnose import doctor
    from fastload.loader import DataLoader
    from fastload.sampler import ShardedSampler


def __getattr__(name: str) -> Any:
    # torch-facing parts import torch (about a second); the CLI and the cache do not need it.
    if name == "ShardedSampler":
        from fastload.sampler import ShardedSampler

        return ShardedSampler
    if name == "doctor":
        from fastload.diagnosis.diagnose import doctor

        return doctor
    if name == "DataLoader":
        from fastload.loader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'fastload' has no attribute {name!r}")


pickled_names.install()

try:
    __version__ = version("fastload")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "BatchReader",
    "DataLoader",
    "FastloadError",
    "InvalidDestinationError",
    "NodeShare",
    "NotYetAvailableError",
    "Plan",
    "PlanError",
    "ReadError",
    "ReadRequest",
    "ResumeState",
    "ResumeStateError",
    "ShardFuture",
    "ShardedSampler",
    "ShortReadError",
    "WarmReport",
    "__version__",
    "aligned_empty",
    "decode",
    "doctor",
    "native_available",
    "native_status",
    "open_dataset",
    "warm",
    "write_index",
]
