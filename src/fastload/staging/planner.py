"""What to fetch, and how: whole objects or byte ranges of them, and what to hold in memory.

One rule decides between the two everywhere fastload stages or reads: **a read that needs
half of an object or more fetches it whole** (one request, for at most twice the bytes),
and a read that needs less fetches its byte ranges (a Parquet row group of a file, an inner
chunk of a Zarr shard, a few samples of a large tar shard). "Half" is counted in whatever
the caller knows of the object: its bytes (ranges of a file), its samples (a shard's reads
in a batch), its inner chunks (a Zarr shard). The same rule decides what a loader holds in
memory when a full cache turns an object away: only objects whose reads are at least half
of their shard's samples are worth fetching whole into memory.

Pure functions of plain values: no cache, no remote, no threads (the stager, the store,
the loader and the formats ask; ``tests/test_planner.py`` checks the rule over a grid).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# (object key, offset, length): a byte range of an object, as datasets and the store name one
Range = tuple[str, int, int]

# Objects at least this large that a batch reads a few samples of are read by range rather
# than waited for whole (a 150 MB tar shard for one sample would hold a batch for seconds).
RANGED_MIN_BYTES = 16 << 20


def fetch_whole(needed: int, total: int | None) -> bool:
    """Whether a read needing ``needed`` of an object's ``total`` (bytes, samples or chunks)
    fetches it whole: half of it or more. An object of unknown size is read by range."""
    return total is not None and 2 * needed >= total


def whole_or_ranges(
    ranges: Iterable[Range], sizes: Mapping[str, int | None]
) -> tuple[list[str], list[Range]]:
    """Ranges to stage, first needed first, as (objects to fetch whole, the ranges left):
    an object whose ranges here come to half its size or more is fetched whole instead."""
    wanted: dict[str, int] = {}
    ordered = list(dict.fromkeys(ranges))
    for key, _, length in ordered:
        wanted[key] = wanted.get(key, 0) + length
    whole = {k for k, n in wanted.items() if fetch_whole(n, sizes[k])}
    keys = list(dict.fromkeys(key for key, _, _ in ordered if key in whole))
    return keys, [r for r in ordered if r[0] not in whole]


def hold_reads(reads: Mapping[str, int], shard_samples: Mapping[str, int]) -> dict[str, int]:
    """The reads to stage each object with, for a loader that holds what the cache turns
    away: its reads where they are half its shard's samples or more (fetching it whole into
    memory pays), else 0 (not fetched into memory: a few samples of a large shard are read
    as ranges from the remote)."""
    return {k: n if fetch_whole(n, shard_samples[k]) else 0 for k, n in reads.items()}


def read_by_range(size: int | None, reads: int, shard_samples: int) -> bool:
    """Whether a batch that needs ``reads`` samples of an uncached object of ``size`` bytes
    (its shard holds ``shard_samples``) reads their byte ranges rather than waiting for the
    object whole: a large object of which it needs less than half."""
    return (size or 0) >= RANGED_MIN_BYTES and not fetch_whole(reads, shard_samples)
