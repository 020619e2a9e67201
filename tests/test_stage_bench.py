"""The staging and cache-policy benchmarks, at toy sizes; and ``fastload bench`` running all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_loader_bench import TINY

from fastload import cli
from fastload.bench.components import (
    decode_bench,
    loader_bench,
    parquet_bench,
    policy_bench,
    read_bench,
    stage_bench,
)
from fastload.bench.runner import Measurement, Report, relate

TOY_STAGE = stage_bench.StageBenchConfig(
    objects=20,
    min_object_bytes=2_000,
    max_object_bytes=6_000,
    latency_s=0.005,
    sequential_objects=5,
    repeats=1,
)
TOY_POLICY = policy_bench.PolicyBenchConfig(objects=60, object_bytes=512)


@pytest.fixture(scope="module")
def stage_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    data_dir = tmp_path_factory.mktemp("stage")
    return stage_bench.run(data_dir, TOY_STAGE), data_dir


def by_system(report: Report) -> dict[str, Measurement]:
    return {r.system: r for r in report.rows}


def test_stage_benchmark_measures_every_system_on_the_same_data(
    stage_report: tuple[Report, Path],
) -> None:
    report, _ = stage_report
    rows = by_system(report)
    assert set(rows) == {
        stage_bench.FASTLOAD,
        stage_bench.FASTLOAD_LISTED,
        stage_bench.FS_GET,
        stage_bench.SIMPLECACHE,
        stage_bench.FILECACHE,
        stage_bench.CEILING,
    }
    assert len({r.case for r in report.rows}) == 1
    assert all(r.ratio is not None and r.ratio > 0 for r in report.rows)
    assert rows[stage_bench.FASTLOAD].ratio == 1.0
    assert rows[stage_bench.SIMPLECACHE].items == 5  # the sequential peers run on a subset
    assert rows[stage_bench.FS_GET].items == 20


def test_fastload_fetches_each_object_exactly_once(stage_report: tuple[Report, Path]) -> None:
    rows = by_system(stage_report[0])
    for system in (stage_bench.FASTLOAD, stage_bench.FASTLOAD_LISTED):
        assert rows[system].extra["GET/obj"] * rows[system].items == 20
    assert rows[stage_bench.FASTLOAD].extra["HEAD/obj"] == 1.0  # it listed: sizes by HEAD
    assert rows[stage_bench.FASTLOAD_LISTED].extra["HEAD/obj"] == 0.0
    assert rows[stage_bench.FS_GET].extra["GET/obj"] == 1.0


def test_the_ceiling_row_is_computed_from_the_formula(stage_report: tuple[Report, Path]) -> None:
    report, data_dir = stage_report
    total = sum(p.stat().st_size for p in (data_dir / stage_bench.DATASET).iterdir())
    ceiling = by_system(report)[stage_bench.CEILING]
    assert ceiling.seconds == pytest.approx(math.ceil(20 / 64) * 0.005 + total / 2.7e9)
    assert ceiling.nbytes == total
    assert ceiling.repeats == []
    assert "computed, not measured" in ceiling.note
    fastload = by_system(report)[stage_bench.FASTLOAD]
    expected = fastload.items_per_s / ceiling.items_per_s
    assert fastload.extra["of ceiling"] == pytest.approx(expected)


def test_stage_report_writes_json_and_names_every_peer(
    stage_report: tuple[Report, Path], tmp_path: Path
) -> None:
    report, _ = stage_report
    payload = json.loads(report.write_json(tmp_path).read_text())
    assert {r["system"] for r in payload["rows"]} == set(by_system(report))
    assert all("GET/obj" in r["extra"] for r in payload["rows"] if r["system"] != "ceiling")
    lines = stage_bench.fastload_vs_peers(report)
    assert len(lines) == 4  # three fsspec peers and the ceiling
    assert "GET/obj" in report.table()


def test_stage_data_drops_objects_left_by_a_larger_run(tmp_path: Path) -> None:
    stage_bench.generate(tmp_path, TOY_STAGE)
    smaller = stage_bench.StageBenchConfig(
        objects=3, min_object_bytes=2_000, max_object_bytes=6_000
    )
    paths = stage_bench.generate(tmp_path, smaller)
    assert sorted((tmp_path / stage_bench.DATASET).iterdir()) == paths
    assert all(2_000 <= p.stat().st_size <= 6_000 for p in paths)


@pytest.fixture(scope="module")
def policy_report(tmp_path_factory: pytest.TempPathFactory) -> Report:
    return policy_bench.run(tmp_path_factory.mktemp("policy"), TOY_POLICY)


def hit_rate(report: Report, case: str, system: str) -> float:
    (row,) = [r for r in report.rows if r.case == case and r.system == system]
    return row.extra["hit rate"]


def test_policy_benchmark_reports_every_policy_in_epochs_2_and_3(policy_report: Report) -> None:
    assert {(r.case, r.system) for r in policy_report.rows} == {
        (f"epoch {e}", s) for e in (2, 3) for s in ("lru", "pin", "plan", policy_bench.OPTIMUM)
    }
    for r in policy_report.rows:
        assert 0.0 <= r.extra["hit rate"] <= 1.0
    assert hit_rate(policy_report, "epoch 2", policy_bench.OPTIMUM) == 0.5


def test_plan_is_near_pin_and_beats_lru(policy_report: Report) -> None:
    for epoch in ("epoch 2", "epoch 3"):
        plan = hit_rate(policy_report, epoch, "plan")
        assert plan >= hit_rate(policy_report, epoch, "pin") - 0.05
        assert plan > hit_rate(policy_report, epoch, "lru")


def test_misses_are_what_was_fetched(policy_report: Report) -> None:
    for r in policy_report.rows:
        if r.system != policy_bench.OPTIMUM:
            misses = round((1 - r.extra["hit rate"]) * 60)
            assert r.extra["MB fetched"] == pytest.approx(misses * 512 / 1e6)


def test_relate_compares_objects_per_second_when_a_peer_ran_on_a_subset() -> None:
    def row(system: str, seconds: float, items: int) -> Measurement:
        return Measurement(
            benchmark="b", case="c", system=system, seconds=seconds, repeats=[], items=items
        )

    ref, subset = relate([row("ref", 1.0, 100), row("subset", 1.0, 10)], "ref")
    assert ref.ratio == 1.0
    assert subset.ratio == pytest.approx(0.1)


def test_extra_figures_are_table_columns_only_when_a_row_has_them() -> None:
    plain = Measurement(benchmark="b", case="c", system="s", seconds=1.0, repeats=[1.0])
    assert "hit rate" not in Report(name="t", rows=[plain], machine={}).table()
    rich = Measurement(
        benchmark="b", case="c", system="s", seconds=1.0, repeats=[1.0], extra={"hit rate": 0.25}
    )
    table = Report(name="t", rows=[plain, rich], machine={}).table()
    assert "hit rate" in table.splitlines()[0]
    assert "0.250" in table.splitlines()[3]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (lambda: stage_bench.StageBenchConfig(objects=0), "objects"),
        (lambda: stage_bench.StageBenchConfig(jobs=0), "jobs"),
        (lambda: policy_bench.PolicyBenchConfig(epochs=1), "epochs"),
        (lambda: policy_bench.PolicyBenchConfig(budget_fraction=0), "budget_fraction"),
    ],
)
def test_configs_refuse_nonsense(config, field) -> None:
    with pytest.raises(ValueError, match=field):
        config()


def test_fastload_bench_runs_every_benchmark_and_writes_each_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    toy_read = read_bench.ReadBenchConfig(
        large_file_bytes=1 << 20, block_bytes=1 << 18, small_files=10, small_file_bytes=1000
    )
    monkeypatch.setattr(read_bench.ReadBenchConfig, "quick", classmethod(lambda cls: toy_read))
    monkeypatch.setattr(stage_bench.StageBenchConfig, "quick", classmethod(lambda cls: TOY_STAGE))
    monkeypatch.setattr(
        policy_bench.PolicyBenchConfig, "quick", classmethod(lambda cls: TOY_POLICY)
    )
    toy_decode = decode_bench.DecodeBenchConfig(
        images=24, batch_size=8, size=32, repeats=1, decoders=False
    )
    monkeypatch.setattr(
        decode_bench.DecodeBenchConfig, "quick", classmethod(lambda cls: toy_decode)
    )
    monkeypatch.setattr(loader_bench.LoaderBenchConfig, "quick", classmethod(lambda cls: TINY))
    toy_parquet = parquet_bench.ParquetBenchConfig(
        samples=32, files=1, row_group_rows=16, batch_size=16, repeats=1, latency_s=0.001,
        systems=(parquet_bench.COLD, parquet_bench.WARM, parquet_bench.ARROW_FASTLOAD_DECODER),
    )  # fmt: skip
    monkeypatch.setattr(
        parquet_bench.ParquetBenchConfig, "quick", classmethod(lambda cls: toy_parquet)
    )
    assert cli.main(["bench", "--components", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("read", "stage", "policy", "decode", "loader", "parquet"):
        assert json.loads((tmp_path / f"{name}.json").read_text())["benchmark"] == name
    assert "target: warm epoch" in out
    assert "fastload warm vs fsspec simplecache:: loop" in out
    assert "hit rate" in out
