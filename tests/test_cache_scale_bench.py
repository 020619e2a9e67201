"""The cache-scale benchmark runs at toy size and reports every policy's figures."""

from __future__ import annotations

from pathlib import Path

from fastload.bench import cache_scale_bench


def test_the_cache_scale_benchmark_reports_each_policy(tmp_path: Path) -> None:
    config = cache_scale_bench.CacheScaleBenchConfig(scales=(2_000,), accesses=600, check_every=200)
    report = cache_scale_bench.run(tmp_path, config)
    assert {r.system for r in report.rows} == {"lru", "pin", "plan"}
    for row in report.rows:
        assert row.extra["du<=max"] == 1.0
        assert 0 < row.extra["hit rate"] < 1
        assert row.extra["index MB"] > 0
        if row.system != "pin":
            assert row.extra["evicted"] > 0
        else:
            assert row.extra["evicted"] == 0  # pin gives nothing up
    assert list(tmp_path.iterdir()) == []  # its caches are removed
