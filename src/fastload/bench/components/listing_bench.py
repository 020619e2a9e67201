"""Listing under throttling: the pages a listing of a large bucket asks for when 2% of
listing requests are answered ``503 SlowDown``, against a clean listing of the same bucket.

The bucket is synthetic (``fastload.testing.synthetic``: 200,000 keys in 200 class folders
computed from their index, nothing on disk) on a loopback S3 server in this process (its
seeded fault injection lives here; a server of its own process has none), so wall times
include the server's share of the GIL: compare them within one run. Each refused page is
asked for again on its own (``remote/obstore.py``), inside the remote's AIMD throttle, so
the target is pages ≤ 1.1x the clean listing's, and the listing completes, exact.

Command::

    .venv/bin/python benchmarks/benchmark_listing.py --out fastload-bench

Writes ``listing.json`` into ``--out`` and prints pages, refused pages and seconds per case.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastload.bench.runner import Measurement, Report
from fastload.manifest import Manifest, list_dataset
from fastload.testing import Fault, FaultKind, S3FolderServer
from fastload.testing.synthetic import ImageFolderLayout, random_payloads

BUCKET = "listing"


@dataclass(frozen=True, kw_only=True)
class ListingBenchConfig:
    objects: int = 200_000
    classes: int = 200
    fault_rate: float = 0.02  # of listing requests, answered 503
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objects < 1 or self.classes < 1:
            raise ValueError(
                f"objects and classes must be >= 1, got {self.objects} and {self.classes}"
            )
        if not 0 <= self.fault_rate < 1:
            raise ValueError(f"fault_rate must be in [0, 1), got {self.fault_rate}")

    @classmethod
    def quick(cls) -> ListingBenchConfig:
        return cls(objects=20_000, classes=20)


def _list(server: S3FolderServer) -> tuple[Manifest, int, int, float]:
    """(the listing, its pages, the refused ones among them, seconds)."""
    server.reset_stats()
    start = time.perf_counter()
    manifest = list_dataset(f"s3://{BUCKET}/ds", server.storage_options)
    seconds = time.perf_counter() - start
    stats = server.stats()
    return manifest, stats.count(path=f"/{BUCKET}", method="GET"), stats.faults_injected, seconds


def run(config: ListingBenchConfig | None = None) -> Report:
    config = config or ListingBenchConfig()
    layout = ImageFolderLayout(
        objects=config.objects,
        classes=config.classes,
        payloads=random_payloads(4, 64, seed=config.seed),
        seed=config.seed,
        prefix="ds/",
    )
    report = Report(name="listing", params=dict(config.__dict__))
    with S3FolderServer(synthetic={BUCKET: layout}) as server:
        clean, clean_pages, _, clean_s = _list(server)
        server.set_fault_rate(
            config.fault_rate,
            [Fault(kind=FaultKind.STATUS, status=503)],
            methods=["GET"],
            seed=config.seed,
        )
        try:
            throttled, pages, refused, throttled_s = _list(server)
        finally:
            server.clear_faults()
    exact = [(o.key, o.size, o.version) for o in throttled] == [
        (o.key, o.size, o.version) for o in clean
    ]
    if len(clean) != config.objects or not exact:
        raise AssertionError(
            f"the throttled listing differs from the clean one ({len(throttled)} vs "
            f"{len(clean)} objects; {config.objects} expected)"
        )
    for case, n, bad, seconds in (
        ("clean", clean_pages, 0, clean_s),
        (f"{config.fault_rate:.0%} 503s", pages, refused, throttled_s),
    ):
        report.rows.append(
            Measurement(
                benchmark="listing",
                case=case,
                system="fastload",
                seconds=seconds,
                repeats=[seconds],
                items=config.objects,
                extra={"pages": n, "refused": bad, "of clean pages": n / clean_pages},
            )
        )
    return report
