"""Every rank trains on the same dataset: at a loader's first iteration under
``torch.distributed``, the ranks all-gather their dataset's fingerprint (a digest of its
listing: keys, sizes, versions) and refuse to go on if any differs. A node whose manifest is
older than another's would otherwise make another plan, silently: samples missed or seen
twice. Where they differ is told from digests of 64 runs of the listing, gathered with it."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from fastload.datasets.base import ShardedDataset
from fastload.errors import DatasetMismatchError

_RUNS = 64  # digests of runs of the listing, to tell where two listings first differ


def summary(dataset: ShardedDataset) -> dict[str, Any]:
    """What a rank gathers of its dataset: the fingerprint, the count of objects, and the
    digest and first key of each of up to 64 runs of the listing."""
    manifest = dataset.store.manifest
    n = len(manifest)
    bounds = np.unique(np.linspace(0, n, min(_RUNS, n) + 1).astype(np.int64)).tolist()
    return {
        "url": dataset.store.url,
        "fingerprint": manifest.fingerprint,
        "objects": n,
        "runs": [
            (start, manifest.fingerprint_of(start, end), manifest.key(start))
            for start, end in itertools.pairwise(bounds)
        ],
    }


def check_same_dataset(dataset: Any) -> None:
    """Raises DatasetMismatchError, on every rank, unless all ranks of the default process
    group see a dataset with the same fingerprint; nothing without torch.distributed."""
    if not isinstance(dataset, ShardedDataset):
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary(dataset))
    message = mismatch(gathered)
    if message is not None:
        raise DatasetMismatchError(message)


def mismatch(summaries: list[dict[str, Any]]) -> str | None:
    """What differs between the ranks' summaries (rank i's at i), or None."""
    groups: dict[str, list[int]] = {}
    for rank, s in enumerate(summaries):
        groups.setdefault(s["fingerprint"], []).append(rank)
    if len(groups) < 2:
        return None
    (_, ranks), *others = groups.items()
    ours = summaries[ranks[0]]
    parts = [f"{_ranks(ranks)} {ours['objects']:,} objects"]
    where = ""
    for _, other_ranks in others:
        theirs = summaries[other_ranks[0]]
        parts.append(f"{_ranks(other_ranks)} {theirs['objects']:,}")
        if not where:
            where = _first_difference(ours, theirs, ranks[0], other_ranks[0])
    return (
        f"the ranks see different datasets at {ours['url']}: {'; '.join(parts)}{where}. "
        "A node's listing (manifest) is older than another's: open the dataset with "
        "refresh=True on every node (or with the same cache directory), so that all ranks "
        "list the same objects and make the same plan"
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown} list{'' if len(ranks) > 1 else 's'}"


def _first_difference(ours: dict[str, Any], theirs: dict[str, Any], a: int, b: int) -> str:
    for (start, digest, key), (other_start, other_digest, other_key) in zip(
        ours["runs"], theirs["runs"], strict=False
    ):
        if (start, digest) != (other_start, other_digest):
            return (
                f"; they first differ in the objects from #{start:,} on "
                f"({key!r} on rank {a}, {other_key!r} on rank {b})"
            )
    shorter = min(len(ours["runs"]), len(theirs["runs"]))
    return f"; they first differ after run {shorter} of the listing" if shorter else ""
