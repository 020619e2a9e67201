"""Tar shards in WebDataset layout, read at random through a per-shard member index.

- :mod:`.dataset`: :class:`TarDataset`, its shards and samples
- :mod:`.members`: the tar format itself (listing members, names, header checks)
- :mod:`.index`: fastload's index file (``fastload.flidx``): its format, read and checked
- :mod:`.sources`: where an index comes from (beside the shards, the cache, wids, a scan)
- :mod:`.writer`: :func:`write_index`, what ``fastload index`` runs
"""

from __future__ import annotations

import importlib
from typing import Any

from fastload.datasets.tar.dataset import IMAGE_FIELDS, LABEL_FIELDS, TarDataset
from fastload.datasets.tar.index import INDEX_NAME, IndexFile, index_path
from fastload.datasets.tar.members import count_samples, is_header_of, scan_tar, split_name
from fastload.datasets.tar.sources import WIDS_INDEX_NAME
from fastload.datasets.tar.writer import INDEX_JOBS, IndexReport, write_index

# Names of classes that moved, for pickles made before the split: (module, name).
_MOVED = {
    "_Entry": "fastload.datasets.tar.index",
    "_Promise": "fastload.datasets.tar.sources",
    "_Shard": "fastload.datasets.tar.dataset",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "IMAGE_FIELDS",
    "INDEX_JOBS",
    "INDEX_NAME",
    "LABEL_FIELDS",
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
