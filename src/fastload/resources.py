"""What this process may use, as a container sees it: CPUs (its affinity, and the cgroup's
``cpu.max`` or v1 ``cpu.cfs_quota_us``) and memory (the cgroup's ``memory.max`` or v1
``memory.limit_in_bytes``). ``os.cpu_count()`` is the host's count: in a pod limited to 4
CPUs of a 96-core node it would start 96 decode threads that the quota then throttles.

Defaults that scale with the machine (thread counts, in-memory caches, the holding area)
read this module; ``loader.stats()["resources"]`` and ``fastload doctor`` report what it read.

``FASTLOAD_CGROUP_ROOT`` points the reading at another directory laid out as the process's
own cgroup: ``cpu.max`` and ``memory.max`` (v2), or ``cpu/cpu.cfs_quota_us``,
``cpu/cpu.cfs_period_us`` and ``memory/memory.limit_in_bytes`` (v1). Tests use it; so can a
user whose runtime mounts the cgroup somewhere unusual.

And how a loader's threads yield the CPU to the training step: :func:`lower_thread_priority`.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

CGROUP_ROOT_ENV = "FASTLOAD_CGROUP_ROOT"
_SYSTEM_ROOT = "/sys/fs/cgroup"
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value.
_UNLIMITED_BYTES = 1 << 60


@dataclass(frozen=True)
class Resources:
    """``cpus``: the CPUs this process may use (at least 1): its affinity, lowered to the
    cgroup's quota rounded up. ``memory_limit_bytes``: the cgroup's memory limit, None
    where none is set. ``cgroup``: where the limits were read (a directory, with v1 or v2)."""

    cpus: int
    affinity_cpus: int
    cgroup_cpus: float | None
    memory_limit_bytes: int | None
    cgroup: str | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_paths() -> dict[str, str]:
    """The process's cgroup path per v1 controller ("" for the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in (_read(Path("/proc/self/cgroup")) or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths[""] = path
        for name in controllers.split(","):
            paths[name] = path
    return paths


def _levels(mount: Path, own: str | None) -> list[Path]:
    """The process's cgroup directory under ``mount`` and its parents up to ``mount``: a
    parent's limit binds its children too. Inside a cgroup namespace the own path is "/"."""
    if own is None:
        return [mount]
    leaf = mount / own.lstrip("/")
    if not leaf.is_dir():  # the path names a hierarchy this mount namespace does not show
        return [mount]
    levels = [leaf]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def _cpu_quota_v2(text: str | None) -> float | None:
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    return int(quota) / int(period)


def _cpu_quota_v1(quota: str | None, period: str | None) -> float | None:
    if not quota or not period or int(quota) <= 0 or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _memory_bytes(text: str | None) -> int | None:
    if not text or text == "max":
        return None
    value = int(text)
    return None if value >= _UNLIMITED_BYTES else value


def _smallest(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return min(known) if known else None


def _read_cgroup(root: Path, own: dict[str, str]) -> tuple[float | None, int | None, str | None]:
    """(CPU quota in CPUs, memory limit in bytes, what was read) under ``root``."""
    try:
        if (root / "cgroup.controllers").exists() or (root / "cpu.max").exists():
            levels = _levels(root, own.get(""))
            cpus = _smallest([_cpu_quota_v2(_read(d / "cpu.max")) for d in levels])
            memory = _smallest([_memory_bytes(_read(d / "memory.max")) for d in levels])
            return cpus, None if memory is None else int(memory), f"{levels[0]} (v2)"
        if not (root / "cpu").is_dir() and not (root / "memory").is_dir():
            return None, None, None
        cpu_levels = _levels(root / "cpu", own.get("cpu"))
        memory_levels = _levels(root / "memory", own.get("memory"))
        cpus = _smallest(
            [
                _cpu_quota_v1(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us"))
                for d in cpu_levels
            ]
        )
        limits = [_memory_bytes(_read(d / "memory.limit_in_bytes")) for d in memory_levels]
        memory = _smallest(list(limits))
        return cpus, None if memory is None else int(memory), f"{root} (v1)"
    except ValueError:  # a file that does not hold what the kernel writes there: no limit read
        return None, None, None


@lru_cache(maxsize=4)
def _read_resources(override: str | None) -> Resources:
    if override:
        cpus, memory, where = _read_cgroup(Path(override), {})
    else:
        cpus, memory, where = _read_cgroup(Path(_SYSTEM_ROOT), _own_paths())
    affinity = _affinity()
    usable = affinity if cpus is None else max(1, min(affinity, math.ceil(cpus)))
    return Resources(usable, affinity, cpus, memory, where)


def resources() -> Resources:
    """What this process may use (read once per ``FASTLOAD_CGROUP_ROOT`` value)."""
    return _read_resources(os.environ.get(CGROUP_ROOT_ENV))


def usable_cpus() -> int:
    """The CPUs this process may use: the default for thread counts, not ``os.cpu_count()``."""
    return resources().cpus


def container_note() -> str | None:
    """One line for reports where the process may use less than the host has, else None."""
    r = resources()
    limits = []
    if r.cpus < (os.cpu_count() or r.cpus):
        quota = "" if r.cgroup_cpus is None else f", cgroup quota {r.cgroup_cpus:g}"
        host = os.cpu_count()
        limits.append(f"{r.cpus} of the host's {host} CPUs (affinity {r.affinity_cpus}{quota})")
    if r.memory_limit_bytes is not None:
        limits.append(f"a memory limit of {r.memory_limit_bytes / (1 << 20):,.0f} MiB")
    if not limits:
        return None
    given = " and ".join(limits)
    return f"the container gives this process {given}, read from {r.cgroup}; defaults follow it"


def memory_share(default_bytes: int, fraction: float) -> int:
    """``default_bytes``, lowered to ``fraction`` of the cgroup's memory limit where one is
    set: an in-memory cache's default must not by itself push a small pod to its OOM kill."""
    limit = resources().memory_limit_bytes
    if limit is None:
        return default_bytes
    return max(1 << 20, min(default_bytes, int(limit * fraction)))


__all__ = [
    "CGROUP_ROOT_ENV",
    "Resources",
    "container_note",
    "memory_share",
    "resources",
    "usable_cpus",
]


def lower_thread_priority(nice: int) -> None:
    """Runs the calling thread ``nice`` steps below its CPU priority, where the OS allows it
    per thread (Linux); threads it starts afterwards, native ones included (DALI's), inherit
    that. Without a spare core the training step then keeps its core and the loader takes
    what is left (on 2 cores beside an 80 ms GIL-holding step, nice 10 against 0: the step
    lost 9-10% of its time to the loader instead of 22-28%, and the loader delivered
    1.05-1.12x)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # not permitted (a sandbox): run at the same priority
        pass
