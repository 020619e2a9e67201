"""The cache's budget and eviction policy for a node: its free disk, its share of the
dataset and whether the job's read order is known decide them.

Each epoch of a shuffled job reads every sample of the share once, in a new order. A cache
that holds the whole share serves every epoch after the first (hit rate 1). One that holds
a part ``b`` of a share ``S`` can at best serve ``b / S`` of each epoch: ``pin`` keeps the
first ``b`` bytes admitted and never evicts (exactly ``b / S``), ``plan`` evicts what the
known order reads last (the same, and it can change its mind between epochs), while
``lru`` under a shuffled order evicts what the next epoch wants about as often as not, and
under a repeated order evicts every object just before it is read again (a hit rate near
0): the advice never leaves ``lru`` on a share larger than the cache.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Of the disk's free space, the share a cache may take (the rest for the job's checkpoints
# and logs, and for the filesystem's own headroom).
DISK_SHARE = 0.9


@dataclass(frozen=True)
class CacheAdvice:
    """A budget and policy, and what each epoch after the first then reads."""

    max_bytes: int
    policy: str  # lru | pin | plan
    hit_rate: float  # of each epoch after the first, read from the cache
    remote_bytes_per_epoch: int
    usd_per_epoch: float | None  # at the remote's price per GB, when given
    free_bytes: int  # on the cache's disk, its current entries counted as free
    share_bytes: int
    why: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def free_bytes(cache_dir: str | Path, cached_bytes: int = 0) -> int:
    """Free bytes on the disk that holds ``cache_dir`` (or its nearest existing parent),
    with what the cache holds now counted as free (it may be evicted for the share)."""
    where = Path(cache_dir)
    while not where.exists() and where != where.parent:
        where = where.parent
    return int(shutil.disk_usage(where).free) + max(0, cached_bytes)


def hit_rate(policy: str, budget: int | None, share_bytes: int) -> float:
    """Of each epoch after the first, the share read from a cache of ``budget`` bytes."""
    if budget is None or share_bytes <= budget:
        return 1.0
    held = max(0.0, budget / max(share_bytes, 1))
    # lru: a guess of half (not measured here; the doctor's budget phase measures the
    # cache's own policy: a shuffled dataset twice the budget read 0.15-0.25 from it once
    # the look-ahead was cut to a share of the budget, 0 before)
    return held if policy in ("pin", "plan") else held / 2


def advise(
    *,
    share_bytes: int,
    free: int,
    budget: int | None,
    policy: str,
    order_known: bool,
    usd_per_gb: float | None = None,
) -> CacheAdvice:
    """The budget and policy for a node with ``free`` bytes (its cache's entries counted)
    and a share of ``share_bytes``; ``budget`` and ``policy`` are the cache's now."""
    room = int(free * DISK_SHARE)
    if share_bytes <= room:
        max_bytes, chosen = share_bytes, policy
        why = (
            f"the disk has room for this node's share ({_size(share_bytes)} of "
            f"{_size(free)} free): a budget of the share keeps every epoch after the first "
            "off the remote"
        )
    else:
        max_bytes = room
        chosen = "plan" if order_known else "pin"
        why = (
            f"this node's share ({_size(share_bytes)}) is larger than {DISK_SHARE:.0%} of the "
            f"disk's free space ({_size(free)}): "
            + (
                "policy='plan' evicts what the job's known order reads last"
                if order_known
                else "policy='pin' keeps what it admitted (lru under a shuffled order "
                "evicts what the next epoch reads)"
            )
        )
    hit = hit_rate(chosen, max_bytes, share_bytes)
    remote = round((1 - hit) * share_bytes)
    usd = None if usd_per_gb is None else round(remote / 1e9 * usd_per_gb, 6)
    if usd is not None:
        why += f"; the remote's {_size(remote)} an epoch cost ${usd:,.2f} at ${usd_per_gb:g}/GB"
    return CacheAdvice(
        max_bytes=int(max_bytes),
        policy=chosen,
        hit_rate=round(hit, 4),
        remote_bytes_per_epoch=int(remote),
        usd_per_epoch=usd,
        free_bytes=int(free),
        share_bytes=int(share_bytes),
        why=why,
    )


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{int(nbytes)} B"
