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
    n = len(oids)
    files: dict[str, int] = {}
    file_ids = np.full(n, -1, dtype=np.int64)
    offsets = np.zeros(n, dtype=np.int64)
    checksums = np.zeros(n, dtype=np.uint64)
    has_checksum = np.zeros(n, dtype=np.bool_)
    for i, (oid, version, size) in enumerate(zip(oids, versions, sizes, strict=True)):
        at = found_rows.get(oid)
        if (
            at is None
            or (version is not None and at.version != version)
            or (size is not None and at.size != size)
        ):
            continue
        if at.segment is None:
            path, offsets[i] = storage.object_path(oid), 0
        else:
            path, offsets[i] = storage.segment_path(at.segment), at.position
        file_ids[i] = files.setdefault(path, len(files))
        value = checksum_value(at.checksum)
        if value is not None:
            checksums[i], has_checksum[i] = value, True
    return Placed(file_ids >= 0, list(files), file_ids, offsets, checksums, has_checksum)
