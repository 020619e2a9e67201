"""The doctor benchmark runs its scenarios through fl.doctor(apply=True) and records, per
scenario, what was named, predicted and measured, and saves each whole report (two short
scenarios: figures belong to the benchmark, not to tests)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fastload.bench.components import doctor_bench as bench

pytest.importorskip("s3fs")

FIELDS = (
    "bottleneck",
    "expected_bottleneck",
    "top_fix",
    "applied_fix",
    "predicted_gain",
    "predicted_samples_per_s",
    "measured_samples_per_s",
    "error",
    "measured_gain",
    "within_15",
    "gain_13",
    "basis_samples_per_s",
)


@pytest.mark.slow
def test_scenarios_record_predicted_and_measured_figures(tmp_path: Path) -> None:
    config = dataclasses.replace(
        bench.DoctorBenchConfig.quick(), scenarios=("threads", "none"), phase_s=1.5, whole=False
    )
    report = bench.run(tmp_path, config)

    assert [r.case for r in report.rows] == ["threads", "none"]
    records = {r["scenario"]: r for r in report.params["scenarios"]}
    assert set(records) == {"threads", "none"}
    for record in records.values():
        assert set(FIELDS) <= set(record)
        assert record["basis_samples_per_s"] > 0
        saved = json.loads((tmp_path / "doctor" / f"{record['scenario']}.json").read_text())
        assert saved["bottleneck"] == record["bottleneck"]
        assert saved["verdict"]["samples_per_s"] == record["basis_samples_per_s"]

    threads = records["threads"]
    row = next(r for r in report.rows if r.case == "threads")
    assert row.system == bench.SYSTEM
    assert row.seconds > 0
    assert row.note.startswith(threads["bottleneck"])
    saved_threads = json.loads((tmp_path / "doctor" / "threads.json").read_text())
    if threads["applied_fix"] is not None:  # one loader thread on a machine of two or more
        if saved_threads["node"]["others_cores"] < 0.5:  # (others' jobs left it the core)
            assert threads["applied_fix"] == "num_workers"
        assert threads["predicted_samples_per_s"] > 0
        assert threads["measured_samples_per_s"] > 0
        assert threads["error"] == pytest.approx(
            threads["measured_samples_per_s"] / threads["predicted_samples_per_s"] - 1, abs=1e-3
        )
        assert isinstance(threads["within_15"], bool)
        assert isinstance(threads["gain_13"], bool)
        assert {"predicted/s", "measured/s", "error", "pred gain", "meas gain"} <= set(row.extra)

    # A 500 ms step keeps the GPU busy whatever the loader does: nothing to fix or apply.
    none = records["none"]
    assert none["applied_fix"] is None
    assert none["error"] is None
    assert none["within_15"] is None

    lines = bench.target_lines(report)
    assert lines[0].startswith("threads")
    assert any(line.startswith("P12:") for line in lines)
    targets = {t["target"]: t for t in report.params["targets"]}
    whole = targets["a whole diagnosis without the cold phase, seconds"]
    assert whole["met"] is None  # not run
    assert (tmp_path / "doctor.json").exists() is False
    written = report.write_json(tmp_path)
    payload = json.loads(written.read_text())
    assert payload["benchmark"] == "doctor"
    assert [r["case"] for r in payload["rows"]] == ["threads", "none"]


def test_config_refuses_unknown_scenarios() -> None:
    with pytest.raises(ValueError, match="scenarios"):
        bench.DoctorBenchConfig(scenarios=("fetch", "nope"))
    with pytest.raises(ValueError, match="phase_s"):
        bench.DoctorBenchConfig(phase_s=0)
    assert bench.DoctorBenchConfig.quick().phase_s < bench.DoctorBenchConfig().phase_s
