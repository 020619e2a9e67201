"""The cold-epoch benchmark at toy size: real S3 server, real child and staging processes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from test_e2e_bench import tiny

from fastload.bench.e2e import cold_bench


@pytest.mark.slow
def test_cold_and_warm_rates_and_each_epochs_cpu_by_process(tmp_path: Path) -> None:
    config = dataclasses.replace(tiny(), epochs=3)
    (row,) = cold_bench.run(tmp_path, layouts=("folder",), config=config)
    assert "failed" not in row, row.get("failed")
    assert row["cold_per_s"] > 0
    assert row["warm_per_s"] > 0
    assert row["ratio"] == pytest.approx(row["cold_per_s"] / row["warm_per_s"])
    assert row["requests"] >= config.data.samples  # a GET per image, in the cold epoch only
    cold, *warm = row["cpu_by_epoch"]
    assert len(warm) == 2
    # The training process's start-up and cold epoch, then warm epochs that use CPU too;
    # the staging process (the default for a remote dataset) is counted apart.
    assert cold["training"] > 0
    assert all(w["training"] > 0 for w in warm)
    assert any("staging" in epoch for epoch in row["cpu_by_epoch"])
    assert "ratio" in cold_bench.line(row)
