"""The budget benchmark (P13) runs every system over the same images and reports ratios to
the all-cached run (tiny sizes: figures belong to benchmarks, not tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.bench.components import budget_bench as bench


def test_every_system_reads_every_steady_epoch_and_pin_fetches_half(tmp_path: Path) -> None:
    config = bench.BudgetBenchConfig(
        samples=48,
        classes=4,
        min_side=32,
        latency_s=0.005,
        epochs=2,
        batch_size=8,
        num_workers=2,
        image_side=16,
    )
    report = bench.run(tmp_path, config)
    rows = {r.system: r for r in report.rows}
    assert list(rows) == [bench.ALL_CACHED, bench.PIN_HELD, bench.PIN_UNHELD, bench.LRU]
    assert rows[bench.ALL_CACHED].ratio == 1.0
    for row in rows.values():
        assert row.items == 48
        assert row.ratio is not None
        assert row.ratio > 0
    assert rows[bench.ALL_CACHED].extra["GET/sample"] == 0
    # pin keeps what fits and fetches the rest once per epoch, held or not.
    for name in (bench.PIN_HELD, bench.PIN_UNHELD):
        assert 0 < rows[name].extra["GET/sample"] < 1
    assert rows[bench.PIN_HELD].extra["held MB"] > 0
    assert rows[bench.PIN_UNHELD].extra["held MB"] == 0
    assert "max_bytes" in report.params


def test_a_config_that_measures_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="epochs"):
        bench.BudgetBenchConfig(epochs=1)
