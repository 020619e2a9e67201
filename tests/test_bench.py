"""The shared benchmark runner and the read benchmark, at toy sizes."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from fastload.bench.components import read_bench
from fastload.bench.runner import Measurement, Report, TrainingStep, measure, relate, step_lost


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


def test_the_gil_step_holds_the_gil_and_the_sleeping_step_lets_a_thread_run() -> None:
    """A Python thread counts while each step runs; the interpreter may force a hand-off
    only after half a second, so a 20 ms step that holds the GIL lets it count nothing,
    and one that sleeps lets it count throughout. Counts are compared, not times."""
    steps = [TrainingStep("sleep", 0.02), TrainingStep("gil", 0.02)]
    assert steps[1].iterations > 0
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    advanced = {"sleep": 0, "gil": 0}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    try:
        for step in steps * 3:
            before = counted[0]
            step()
            advanced[step.kind] += counted[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join(10)
    assert advanced["sleep"] > 1000
    assert advanced["gil"] * 10 < advanced["sleep"]
    assert [s.calls for s in steps] == [3, 3]


def test_a_step_counts_what_it_took_and_what_was_lost() -> None:
    step = TrainingStep("gil", 0.01, iterations=1000, alone_rate=1e6)
    step()
    assert step.calls == 1
    assert 0 <= step.waited_s <= step.spent_s
    assert step.record()["iterations"] == 1000
    sleeping = TrainingStep("sleep", 0.01)
    sleeping()
    assert sleeping.spent_s >= 0.01
    assert sleeping.waited_s == pytest.approx(sleeping.spent_s - 0.01)
    assert step_lost(0.01, 0.05) == pytest.approx(0.2)  # a fifth of its time taken
    assert step_lost(0.0, 0.0) is None
    with pytest.raises(ValueError, match="step must be one of"):
        TrainingStep("nap", 0.01)
