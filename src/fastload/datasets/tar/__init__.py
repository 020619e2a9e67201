"""Tar shards in WebDataset layout (see :mod:`fastload.datasets.tar.dataset`)."""

from __future__ import annotations

from typing import Any

from fastload.datasets.tar import dataset as _dataset
from fastload.datasets.tar.dataset import (
    INDEX_JOBS,
    INDEX_NAME,
    WIDS_INDEX_NAME,
    IndexFile,
    IndexReport,
    TarDataset,
    count_samples,
    index_path,
    is_header_of,
    scan_tar,
    split_name,
    write_index,
)

# Names of classes that moved, for pickles made before the split.
_MOVED = {"_Entry", "_Promise", "_Shard"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(_dataset, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INDEX_JOBS",
    "INDEX_NAME",
    "WIDS_INDEX_NAME",
    "IndexFile",
    "IndexReport",
    "TarDataset",
    "count_samples",
    "index_path",
    "is_header_of",
    "scan_tar",
    "split_name",
    "write_index",
]
