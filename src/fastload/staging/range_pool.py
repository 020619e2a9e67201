"""This process's threads for byte-range reads and stages (a loader's ranged samples and
look-ahead, a warm's ranges): one pool per process, its threads started as needed, so a
range costs no thread start and a node's ranges share one bound. A forked child makes its
own (threads do not survive fork).

The parts of one large object a staging thread fetches have a pool of their own
(``stager``): that thread holds a slot of the remote's AIMD limit while it waits for its
parts, and range reads here wait for such slots, so sharing one pool could deadlock.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

RANGE_THREADS = 64  # at most; FetchConfig.jobs (and the AIMD limit) bound requests in flight

_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def range_pool() -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None:
            pool = _pools[os.getpid()] = ThreadPoolExecutor(
                RANGE_THREADS, thread_name_prefix="fastload-range"
            )
        return pool
