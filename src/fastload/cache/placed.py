"""Where a batch's whole objects are cached, as columns (one index query, no ``Location``
per object): what the loader's native read of a batch takes (``Cache.placed``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload.cache.index import Placement
from fastload.cache.read_checks import checksum_value
from fastload.cache.storage import Storage


@dataclass(frozen=True)
class Placed:
    """Per asked object: whether it is cached (current version and size) and where."""

    found: npt.NDArray[np.bool_]
    files: list[str]  # the distinct files holding them
    file_ids: npt.NDArray[np.int64]  # per object, into files (-1: not found)
    offsets: npt.NDArray[np.int64]  # where its bytes start in that file
    checksums: npt.NDArray[np.uint64]  # xxh3 as recorded (0 where has_checksum is False)
    has_checksum: npt.NDArray[np.bool_]


def placed_columns(
    storage: Storage,
    oids: Sequence[str],
    found_rows: dict[str, Placement],
    versions: Sequence[str | None],
    sizes: Sequence[int | None],
) -> Placed:
    """The columns of ``oids`` from the index's rows of them (``Index.placements_of``); a
    stale version or size is not found (the caller's fallback fetches it again), as in
    ``Cache.lookup_many``."""
    files: dict[str, int] = {}
    segments: dict[int, int] = {}  # segment -> its file's id (a batch shares a few)
    file_ids: list[int] = []
    offsets: list[int] = []
    sums: list[str | None] = []
    for oid, version, size in zip(oids, versions, sizes, strict=True):
        at = found_rows.get(oid)
        if at is None or not at.holds(version, size):
            file_ids.append(-1)
            offsets.append(0)
            sums.append(None)
            continue
        if at.segment is None:
            file_ids.append(files.setdefault(storage.object_path(oid), len(files)))
            offsets.append(0)
        else:
            file = segments.get(at.segment)
            if file is None:
                path = storage.segment_path(at.segment)
                file = segments[at.segment] = files.setdefault(path, len(files))
            file_ids.append(file)
            offsets.append(at.position)
        sums.append(at.checksum)
    values = [checksum_value(c) for c in sums]
    ids = np.array(file_ids, dtype=np.int64)
    return Placed(
        ids >= 0,
        list(files),
        ids,
        np.array(offsets, dtype=np.int64),
        np.array([0 if v is None else v for v in values], dtype=np.uint64),
        np.array([v is not None for v in values], dtype=np.bool_),
    )
