"""Staging remote objects into local files: ``fastload warm`` against what users do with fsspec.

One case: N objects of 90-130 KB (random bytes, so nothing compresses) behind a loopback
:class:`~fastload.testing.RangeHTTPServer` that waits ``latency_s`` before answering each
request, as object storage does. The server runs on threads of the benchmark's own process,
so it shares the interpreter with every system alike. Every system starts each repeat from
an empty, fresh destination, after the previous one's writes reached the disk (``os.sync``);
systems take turns within each repeat, so drift on a shared machine hits them alike. Median
of repeats.

Systems:

* ``fastload warm`` end to end: it lists the dataset first (over HTTP one directory page
  plus one HEAD per object, since the page carries no sizes), then fetches ``jobs``
  objects at a time into its cache. This is the reference of every ratio.
* ``fastload warm, listing given``: the same with the listing of an earlier run placed in
  the fresh cache, so it gets what the fsspec peers get for free: the list of URLs.
* ``fsspec fs.get(urls, dir)``: fsspec's concurrent batch copy, given the URLs; it submits
  them all at once and aiohttp's default pool keeps up to 100 connections (fastload: 64).
* ``fsspec simplecache::`` and ``filecache::``: ``with fsspec.open(url) as f: f.read()``
  over the objects one after another, which is how people use them. Sequential at
  ``latency_s`` per request is slow, so they run over the first ``sequential_objects`` only;
  every ratio compares objects per second, never seconds. Over HTTP both send two GETs per
  object: ``_open`` asks ``HTTPFileSystem.exists``, which GETs the object, then downloads it.
* the ceiling, computed, not measured: ``ceil(N / jobs) * latency_s`` plus the bytes at
  ``loopback_bytes_per_s``. It leaves out creating N files, which costs about 0.4 ms a
  file on some disks whatever the concurrency; the report's params hold this disk's figure.

Ratios are each system's objects/s over ``fastload warm``'s (end to end: what a user
typing ``fastload warm URL`` gets, the conservative choice), so a peer at 0.25x is four
times slower than fastload and the ceiling's ratio says how far fastload is from it; the
``of ceiling`` column is each system's objects/s over the ceiling's. ``GET/obj`` and
``HEAD/obj`` are the server's counts of requests for the objects (listing pages aside).

Not measured against S3: the loopback S3 server (moto) is Python and serves about 160 such
objects a second on two cores at zero latency, so every system would measure moto.

Command (full size: 2,000 objects, 20 ms, median of 3)::

    .venv/bin/python benchmarks/benchmark_stage.py --out fastload-bench
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np

from fastload.bench.runner import Measurement, Report, relate
from fastload.manifest import list_dataset, manifest_path
from fastload.testing import HTTPServerProcess, RequestStats
from fastload.warm import warm

FASTLOAD = "fastload warm"
FASTLOAD_LISTED = "fastload warm, listing given"
FS_GET = "fsspec fs.get(urls, dir)"
SIMPLECACHE = "fsspec simplecache:: loop"
FILECACHE = "fsspec filecache:: loop"
CEILING = "ceiling"
DATASET = "objects"  # the dataset's folder below the server's root


@dataclass(frozen=True, kw_only=True)
class StageBenchConfig:
    objects: int = 2_000
    min_object_bytes: int = 90_000
    max_object_bytes: int = 130_000
    latency_s: float = 0.02  # per request, before the first byte
    jobs: int = 64  # fastload's requests in flight
    sequential_objects: int = 200  # the sequential peers fetch this many at most
    loopback_bytes_per_s: float = 2.7e9  # for the ceiling
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("objects", "min_object_bytes", "jobs", "sequential_objects", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_object_bytes < self.min_object_bytes:
            raise ValueError("max_object_bytes must be >= min_object_bytes")
        if self.latency_s < 0 or self.loopback_bytes_per_s <= 0:
            raise ValueError("latency_s must be >= 0 and loopback_bytes_per_s > 0")

    @classmethod
    def quick(cls) -> StageBenchConfig:
        return cls(objects=500, sequential_objects=100, repeats=1)


def ceiling_seconds(config: StageBenchConfig, total_bytes: int) -> float:
    """The least time N requests at ``jobs`` in flight can take, and the bytes on loopback."""
    waves = math.ceil(config.objects / config.jobs)
    return waves * config.latency_s + total_bytes / config.loopback_bytes_per_s


def generate(data_dir: Path, config: StageBenchConfig) -> list[Path]:
    """The objects under data_dir/objects; right-sized leftovers stay, others go."""
    folder = data_dir / DATASET
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sizes = rng.integers(config.min_object_bytes, config.max_object_bytes + 1, config.objects)
    paths = [folder / f"{i:06d}.bin" for i in range(config.objects)]
    wanted = {p.name for p in paths}
    for stale in folder.iterdir():  # a larger earlier run would add to the listing
        if stale.name not in wanted:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    for path, size in zip(paths, sizes, strict=True):
        if not path.exists() or path.stat().st_size != size:
            path.write_bytes(rng.integers(0, 256, int(size), dtype=np.uint8).tobytes())
    return paths


def file_create_seconds(directory: Path, count: int = 200) -> float:
    """What creating one empty file costs on directory's disk (part of every system's time)."""
    scratch = Path(tempfile.mkdtemp(dir=directory))
    try:
        start = time.perf_counter()
        for i in range(count):
            os.close(os.open(scratch / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return (time.perf_counter() - start) / count
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass(frozen=True)
class _System:
    fn: Callable[[Path], None]  # timed: fetch into the fresh destination
    items: int  # objects it fetches
    note: str
    prepare: Callable[[Path], None] | None = None  # untimed, before fn


def _object_requests(stats: RequestStats, object_paths: set[str], method: str) -> int:
    return sum(n for (m, p), n in stats.requests.items() if m == method and p in object_paths)


def _check_files(dest: Path, expected: int, system: str) -> None:
    found = sum(1 for p in dest.rglob("*") if p.is_file())
    if found < expected:
        raise RuntimeError(f"{system} left {found} files, expected at least {expected}")


def run(data_dir: str | os.PathLike[str], config: StageBenchConfig | None = None) -> Report:
    config = config or StageBenchConfig()
    data_dir = Path(data_dir)
    paths = generate(data_dir, config)
    sizes = [p.stat().st_size for p in paths]
    total = sum(sizes)
    sequential = min(config.sequential_objects, config.objects)
    scratch = data_dir / "scratch"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    create_s = file_create_seconds(scratch)
    report = Report(
        name="stage",
        params={
            **config.__dict__,
            "data_dir": str(data_dir),
            "total_bytes": total,
            "file_create_s": create_s,
        },
    )
    # The server runs in its own process: in ours it would compete for the GIL with the
    # systems being measured.
    with HTTPServerProcess(data_dir, latency_s=config.latency_s) as server:
        url = server.url_for(DATASET)
        urls = [f"{url}/{p.name}" for p in paths]
        object_paths = {f"/{DATASET}/{p.name}" for p in paths}
        fs = fsspec.filesystem("http")
        fs.cat_file(urls[0])  # untimed: starts fsspec's event loop and an HTTP session
        listing = list_dataset(url)

        def fastload(dest: Path) -> None:
            result = warm(url, cache_dir=str(dest), jobs=config.jobs, progress=False)
            if result.fetched != config.objects or not result.ok:
                raise RuntimeError(f"{FASTLOAD} fetched {result.fetched} of {config.objects}")

        def place_listing(dest: Path) -> None:
            listing.save(manifest_path(dest, url))

        def fs_get(dest: Path) -> None:
            fs.get(urls, f"{dest}/")
            _check_files(dest, config.objects, FS_GET)

        def cached_loop(protocol: str) -> Callable[[Path], None]:
            def read_all(dest: Path) -> None:
                options = {protocol: {"cache_storage": str(dest)}}
                for u, size in zip(urls[:sequential], sizes[:sequential], strict=True):
                    with fsspec.open(f"{protocol}::{u}", "rb", **options) as f:
                        if len(f.read()) != size:
                            raise RuntimeError(f"{protocol}:: read a short {u}")

            return read_all

        first = f"sequential, first {sequential:,} objects"
        systems = {
            FASTLOAD: _System(fastload, config.objects, "lists first: 1 page + 1 HEAD/object"),
            FASTLOAD_LISTED: _System(
                fastload, config.objects, "URLs given, as to fsspec", prepare=place_listing
            ),
            FS_GET: _System(fs_get, config.objects, "URLs given; up to 100 in flight (aiohttp)"),
            SIMPLECACHE: _System(cached_loop("simplecache"), sequential, first),
            FILECACHE: _System(cached_loop("filecache"), sequential, first),
        }
        times: dict[str, list[float]] = {s: [] for s in systems}
        requests: dict[str, RequestStats] = {}
        for _ in range(config.repeats):
            for name, system in systems.items():
                dest = Path(tempfile.mkdtemp(dir=scratch))
                try:
                    if system.prepare is not None:
                        system.prepare(dest)
                    os.sync()  # the previous system's writes are not flushed on our time
                    server.reset_stats()
                    start = time.perf_counter()
                    system.fn(dest)
                    times[name].append(time.perf_counter() - start)
                    requests[name] = server.stats()
                finally:
                    shutil.rmtree(dest, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)

    case = (
        f"{config.objects:,} objects of {config.min_object_bytes // 1000}-"
        f"{config.max_object_bytes // 1000} KB over HTTP, {config.latency_s * 1000:g} ms latency"
    )
    ceiling = ceiling_seconds(config, total)
    ceiling_rate = config.objects / ceiling
    rows: list[Measurement] = []
    for name, system in systems.items():
        median = statistics.median(times[name])
        stats, items = requests[name], system.items
        rows.append(
            Measurement(
                benchmark="stage",
                case=case,
                system=name,
                seconds=median,
                repeats=times[name],
                items=items,
                nbytes=sum(sizes[:items]),
                note=system.note,
                extra={
                    "of ceiling": items / median / ceiling_rate,
                    "GET/obj": _object_requests(stats, object_paths, "GET") / items,
                    "HEAD/obj": _object_requests(stats, object_paths, "HEAD") / items,
                },
            )
        )
    rows.append(
        Measurement(
            benchmark="stage",
            case=case,
            system=CEILING,
            seconds=ceiling,
            repeats=[],
            items=config.objects,
            nbytes=total,
            note=(
                f"computed, not measured: ceil(N/{config.jobs}) x {config.latency_s:g} s "
                f"+ bytes / {config.loopback_bytes_per_s:.2g} B/s"
            ),
            extra={"of ceiling": 1.0},
        )
    )
    report.rows = relate(rows, FASTLOAD)
    return report


def fastload_vs_peers(report: Report) -> list[str]:
    """A line per fsspec peer (fastload's objects/s over theirs) and one for the ceiling."""
    fastload = next(r for r in report.rows if r.system == FASTLOAD)
    lines = [
        f"fastload warm vs {r.system}: {fastload.items_per_s / r.items_per_s:.2f}x the objects/s"
        for r in report.rows
        if r.system.startswith("fsspec") and r.items
    ]
    ceiling = next(r for r in report.rows if r.system == CEILING)
    lines.append(
        f"fastload warm reaches {fastload.items_per_s / ceiling.items_per_s:.0%} of the ceiling"
    )
    return lines
