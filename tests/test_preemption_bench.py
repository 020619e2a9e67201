"""The preemption benchmark runs end to end at toy size: every row, and every sample of the
epoch delivered exactly once across the SIGTERM and the restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.bench.components import preemption_bench


@pytest.mark.slow
def test_the_preemption_benchmark_measures_both_restarts(tmp_path: Path) -> None:
    config = preemption_bench.PreemptionBenchConfig(
        files=400, file_bytes=1024, synthetic_objects=3000, classes=10, batch_size=16
    )
    report = preemption_bench.run(tmp_path, config)
    systems = [(r.case, r.system) for r in report.rows]
    assert len(systems) == 6
    for row in report.rows:
        assert row.seconds >= 0, row
        if row.system.startswith("restart"):
            assert row.extra["LISTs"] == 0, row  # neither restart lists the remote
    assert report.rows[1].extra["exactly once"] == 1.0
