"""The shared benchmark runner and the read benchmark, at toy sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastload.bench import read_bench
from fastload.bench.runner import Measurement, Report, measure, relate


def row(case: str, system: str, seconds: float) -> Measurement:
    return Measurement(
        benchmark="b", case=case, system=system, seconds=seconds, repeats=[seconds], items=10
    )


def test_relate_gives_throughput_ratios_within_each_case() -> None:
    rows = relate(
        [row("a", "ref", 2.0), row("a", "x", 1.0), row("b", "ref", 1.0), row("b", "x", 4.0)],
        "ref",
    )
    ratios = {(r.case, r.system): r.ratio for r in rows}
    assert ratios == {("a", "ref"): 1.0, ("a", "x"): 2.0, ("b", "ref"): 1.0, ("b", "x"): 0.25}


def test_relate_leaves_cases_without_the_reference_unrated() -> None:
    (only,) = relate([row("a", "x", 1.0)], "ref")
    assert only.ratio is None
    assert only.reference is None


def test_measure_takes_the_median_of_the_timed_repeats() -> None:
    calls = []
    m = measure(lambda: calls.append(1), benchmark="b", case="c", system="s", repeats=5, warmup=2)
    assert len(calls) == 7
    assert len(m.repeats) == 5
    assert m.seconds == sorted(m.repeats)[2]


def test_report_writes_json_with_the_machine_and_prints_every_row(tmp_path: Path) -> None:
    report = Report(name="toy", rows=relate([row("a", "ref", 2.0), row("a", "x", 1.0)], "ref"))
    payload = json.loads(report.write_json(tmp_path).read_text())
    assert payload["machine"]["cores"] >= 1
    assert "python" in payload["machine"]
    assert [r["ratio"] for r in payload["rows"]] == [1.0, 2.0]
    assert payload["rows"][0]["gb_per_s"] is None  # no bytes recorded: no figure
    table = report.table()
    assert "2.00x ref" in table
    assert len(table.splitlines()) == 4


def test_read_benchmark_measures_every_system_in_both_cases(tmp_path: Path) -> None:
    config = read_bench.ReadBenchConfig(
        large_file_bytes=3 << 20,
        block_bytes=1 << 20,
        small_files=30,
        small_file_bytes=5000,
        batch_files=8,
        repeats=1,
    )
    report = read_bench.run(tmp_path, config)
    cases = {r.case for r in report.rows}
    assert len(cases) == 2
    for case in cases:
        systems = {r.system for r in report.rows if r.case == case}
        assert systems == {
            read_bench.CEILING,
            "fastload native reader",
            "os.preadv threads (fastload fallback)",
            "Python readinto loop",
        }
    assert all(r.ratio is not None and r.ratio > 0 for r in report.rows)
    small_rows = [r for r in report.rows if r.items == 30]
    assert all(r.nbytes == 30 * 5000 for r in small_rows)


def test_generated_data_is_reused_when_it_has_the_right_size(tmp_path: Path) -> None:
    config = read_bench.ReadBenchConfig(large_file_bytes=1000, small_files=3, small_file_bytes=10)
    large, small = read_bench.generate(tmp_path, config)
    stamps = [p.stat().st_mtime_ns for p in (large, *small)]
    read_bench.generate(tmp_path, config)
    assert [p.stat().st_mtime_ns for p in (large, *small)] == stamps
    small[0].write_bytes(b"short")
    read_bench.generate(tmp_path, config)
    assert small[0].stat().st_size == 10  # a wrong-sized leftover is rewritten


@pytest.mark.parametrize("field", ["large_file_bytes", "small_files", "batch_files", "repeats"])
def test_config_refuses_non_positive_sizes(field) -> None:
    with pytest.raises(ValueError, match=f"{field} must be > 0"):
        read_bench.ReadBenchConfig(**{field: 0})
