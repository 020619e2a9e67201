"""A cache's settings: where it lives, its budget and eviction policy, how long to wait for
another process's fetch, and how small entries are packed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeAlias

Policy: TypeAlias = Literal["lru", "pin", "plan"]


POLICIES: tuple[Policy, ...] = ("lru", "pin", "plan")

# What max_bytes counts (budget.py): "disk", everything the cache puts on disk (the default,
# at every size); "entries", the entries' bytes only: not the disk, for tests and toys.
BudgetCounts: TypeAlias = Literal["disk", "entries"]
BUDGET_COUNTS: tuple[BudgetCounts, ...] = ("disk", "entries")


CACHE_DIR_ENV = "FASTLOAD_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE_DIR``, else the per-user cache folder (``$XDG_CACHE_HOME/fastload``)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastload"


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    cache_dir: Path
    max_bytes: int | None = None
    policy: Policy = "lru"
    budget_counts: BudgetCounts = "disk"
    lock_timeout_s: float = 600.0
    fsync: bool = False  # survive power loss, not only process death, at a cost per file
    # Small entries are packed into segments of this many bytes (storage.py); None: 1/64 of
    # max_bytes, at most 64 MB, and no packing under a 64 MB budget; 0: never pack.
    segment_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {self.max_bytes}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.budget_counts not in BUDGET_COUNTS:
            choices = ", ".join(BUDGET_COUNTS)
            raise ValueError(f"budget_counts must be one of {choices}, got {self.budget_counts!r}")
        if self.lock_timeout_s <= 0:
            raise ValueError(f"lock_timeout_s must be > 0, got {self.lock_timeout_s}")
        if self.segment_bytes is not None and self.segment_bytes < 0:
            raise ValueError(f"segment_bytes must be >= 0 or None, got {self.segment_bytes}")
