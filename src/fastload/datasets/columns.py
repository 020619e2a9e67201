"""Questions about every key of a manifest, answered in numpy over its key blob.

At 1.28 M keys a Python string per key costs ~0.3 s and ~80 bytes each in every process;
these answer what opening a dataset asks (which keys end with an image extension, where
their class folder ends) from the manifest's columns, a few array passes in all.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.manifest import Manifest

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
TAIL_BYTES = 8


def key_tails(manifest: Manifest, *, lower: bool = False) -> npt.NDArray[np.uint64]:
    """Each key's last 8 bytes as a big-endian integer, zero-padded on the left for shorter
    keys (ASCII lower-cased with ``lower``): ``ends_with`` compares a suffix in one step."""
    blob = np.frombuffer(manifest.key_blob, dtype=np.uint8)
    starts, ends = manifest.key_offsets[:-1], manifest.key_offsets[1:]
    tails = np.zeros(len(starts), dtype=np.uint64)
    if not len(blob):
        return tails
    for back in range(TAIL_BYTES, 0, -1):  # one byte of every key per pass
        at = ends - back
        byte = blob[np.maximum(at, 0)]
        byte[at < starts] = 0
        if lower:
            byte[(byte >= 65) & (byte <= 90)] += 32
        tails <<= np.uint64(8)
        tails |= byte
    return tails


def ends_with(tails: npt.NDArray[np.uint64], suffixes: Iterable[bytes]) -> Bools:
    """Which keys end with one of suffixes (each at most 8 bytes, no NUL), from key_tails."""
    hit = np.zeros(len(tails), dtype=bool)
    for suffix in suffixes:
        if not 0 < len(suffix) <= TAIL_BYTES or b"\0" in suffix:
            raise ValueError(f"suffix {suffix!r} must be 1 to {TAIL_BYTES} bytes, no NUL")
        mask = np.uint64((1 << (8 * len(suffix))) - 1)
        hit |= (tails & mask) == np.uint64(int.from_bytes(suffix, "big"))
    return hit


def slashes(manifest: Manifest) -> tuple[Int64s, Int64s]:
    """(first, last): the position of each key's first and last ``/`` within the key, -1
    where it has none."""
    blob = np.frombuffer(manifest.key_blob, dtype=np.uint8)
    starts, ends = manifest.key_offsets[:-1], manifest.key_offsets[1:]
    at = np.flatnonzero(blob == ord("/"))
    if not len(at):
        none = np.full(len(starts), -1, dtype=np.int64)
        return none, none.copy()
    i = np.searchsorted(at, starts)
    first = at[np.minimum(i, len(at) - 1)]
    first = np.where((i < len(at)) & (first < ends), first - starts, -1)
    j = np.searchsorted(at, ends) - 1
    last = at[np.maximum(j, 0)]
    last = np.where((j >= 0) & (last >= starts), last - starts, -1)
    return first.astype(np.int64), last.astype(np.int64)


class IndexRuns:
    """A sequence of manifest indices kept as runs of consecutive ones: a dataset's samples
    in their order (class by class, skipping what is not a sample) are a few runs of the
    manifest's key order, so a million samples cost a few arrays of the runs, not one
    integer each, in memory and in every pickle sent to a worker."""

    def __init__(self, order: Int64s) -> None:
        order = np.asarray(order, dtype=np.int64)
        breaks = np.flatnonzero(np.diff(order) != 1) + 1
        self.starts = order[np.concatenate([[0], breaks])] if len(order) else order[:0]
        self.offsets = np.concatenate([[0], breaks, [len(order)]]).astype(np.int64)
        self._lists: tuple[list[int], list[int]] | None = None

    @classmethod
    def whole(cls, n: int) -> IndexRuns:
        """0, 1, ..., n - 1."""
        if n == 0:
            return cls.of_runs(np.zeros(0, np.int64), np.zeros(1, np.int64))
        return cls.of_runs(np.zeros(1, np.int64), np.array([0, n], np.int64))

    @classmethod
    def of_runs(cls, starts: Int64s, offsets: Int64s) -> IndexRuns:
        """From ``starts`` and ``offsets`` as another IndexRuns has them."""
        self = cls.__new__(cls)
        self.starts, self.offsets = starts.astype(np.int64), offsets.astype(np.int64)
        self._lists = None
        return self

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> int:
        # Per sample, under the GIL: Python lists (as many items as runs, not samples).
        if self._lists is None:
            self._lists = (self.starts.tolist(), self.offsets.tolist())
        starts, offsets = self._lists
        run = bisect.bisect_right(offsets, i) - 1 if len(starts) > 1 else 0
        return starts[run] + i - offsets[run]

    def at(self, indices: Int64s) -> Int64s:
        """``self[i]`` of each of ``indices`` (a batch's), in numpy."""
        run = np.searchsorted(self.offsets, indices, side="right") - 1
        return self.starts[run] + indices - self.offsets[run]

    def __getstate__(self) -> dict[str, Any]:
        return {"starts": self.starts, "offsets": self.offsets}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.starts, self.offsets, self._lists = state["starts"], state["offsets"], None
