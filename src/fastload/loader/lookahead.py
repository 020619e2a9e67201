"""How far ahead of the reads staging may run: the look-ahead the user (or the autotuner)
asked for, cut to what the cache's budget can keep until those reads.

Under an evicting policy (``lru``, and ``plan`` without a plan, which orders as ``lru``)
what staging publishes is evicted once enough newer bytes follow it. A look-ahead larger
than the budget therefore evicts what it staged before the batch reads it: every such
object is fetched twice, and what the previous epoch left in the cache is pushed out by
objects staged for far later batches (the doctor's grid measured ``lru`` at 0% hits with a
1 GB look-ahead and a 30 MB budget). ``pin`` evicts nothing (what it turns away is held in
memory, bounded by the holding area), so its look-ahead is left as asked.
"""

from __future__ import annotations

from fastload.cache.config import Policy

# Of the budget, the share staged objects not read yet may take: the rest keeps what earlier
# epochs left for the reads ahead (a larger share costs lru hits; a smaller one hides less
# latency).
LOOKAHEAD_BUDGET_SHARE = 0.25


def lookahead_within_budget(lookahead_bytes: int, max_bytes: int | None, policy: Policy) -> int:
    """The look-ahead in bytes that staging may run at under this cache budget and policy."""
    if max_bytes is None or policy == "pin":
        return lookahead_bytes
    return min(lookahead_bytes, int(max_bytes * LOOKAHEAD_BUDGET_SHARE))


def batches_ahead(
    lookahead_bytes: int, batch_bytes: int, max_bytes: int | None, policy: Policy
) -> int:
    """Batches staged ahead of the reads (0: none): the look-ahead within the budget, in
    whole batches of ``batch_bytes``."""
    return lookahead_within_budget(lookahead_bytes, max_bytes, policy) // max(1, batch_bytes)
