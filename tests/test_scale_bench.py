"""The scale benchmark at its quick size: every case reports, the counts are right (one
listing per node, nothing listed on a cached open, a node share fetches exactly its planned
shards), pickled datasets stay small. Figures belong to the benchmark, not to tests: no
timing is asserted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fastload import cli
from fastload.bench.runner import Measurement, Report
from fastload.bench.scale import scale_bench as bench


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    out = tmp_path_factory.mktemp("scale")
    config = dataclasses.replace(bench.ScaleBenchConfig.quick(), fastload_index=True)
    return bench.run(out / "data", config), out


def _rows(report: Report, case_start: str) -> dict[str, Measurement]:
    return {r.system: r for r in report.rows if r.case.startswith(case_start)}


def _one(rows: dict[str, Measurement], system_start: str) -> Measurement:
    if system_start in rows:
        return rows[system_start]
    found = [r for name, r in rows.items() if name.startswith(system_start)]
    assert len(found) == 1, f"{system_start!r} in {sorted(rows)}"
    return found[0]


@pytest.mark.slow
def test_the_folder_case_lists_once_per_node_and_pickles_small(
    quick_report: tuple[Report, Path],
) -> None:
    report, _ = quick_report
    config = bench.ScaleBenchConfig.quick()
    rows = _rows(report, "ImageFolder")
    first = _one(rows, bench.FIRST_OPEN)
    # A listing page per class folder (50 objects each), and the page that finds them.
    assert first.extra["list reqs"] == config.classes + 1
    assert first.items == config.objects
    cached = _one(rows, bench.CACHED_OPEN)
    assert cached.extra["list reqs"] == 0
    assert cached.extra["GETs"] == 0
    assert len(cached.repeats) == config.repeats
    for row in (first, cached):
        assert 0 < row.extra["pickled KB"] * 1e3 <= bench.TARGET_PICKLED_BYTES
        assert row.extra["CPU us/obj"] > 0
    # Eight processes opening at once on an empty cache: one of them lists, the others
    # map its manifest.
    cold = _one(rows, f"{config.processes} processes open at once, empty cache")
    assert cold.extra["list reqs"] == first.extra["list reqs"]
    warm = _one(rows, f"{config.processes} processes open at once, manifest cached")
    assert warm.extra["list reqs"] == 0
    assert cold.extra["PSS MB"] > 0
    batch = _one(rows, bench.FIRST_BATCH)
    assert batch.items == config.batch_size
    assert batch.extra["GETs"] >= config.batch_size  # the batch's objects, then look-ahead
    workers = _one(rows, f"{config.workers} {bench.WORKERS}")
    assert workers.extra["PSS MB"] > 0
    plan = _rows(report, f"plan: rank 0 of {config.world_size}, one epoch of {config.objects:,}")
    assert {r.system for r in plan.values()} == {bench.PLAN_PEER, "fastload Plan.rank_order"}
    assert all(r.items == -(-config.objects // config.world_size) for r in plan.values())


@pytest.mark.slow
def test_the_tar_case_reads_the_index_and_a_node_share_fetches_its_shards(
    quick_report: tuple[Report, Path],
) -> None:
    report, _ = quick_report
    config = bench.ScaleBenchConfig.quick()
    rows = _rows(report, "tar")
    first = _one(rows, bench.FIRST_OPEN)
    assert first.items == config.tar_samples
    assert first.extra["list reqs"] == 1  # 65 objects: one page
    assert first.extra["GETs"] == 1  # shardindex.json, no shard
    assert first.extra["pickled KB"] * 1e3 <= bench.TARGET_PICKLED_BYTES
    assert _one(rows, bench.CACHED_OPEN).extra["list reqs"] == 0
    cold = _one(rows, f"{config.processes} processes open at once, empty cache")
    assert cold.extra["list reqs"] == 1
    assert cold.extra["GETs"] == 1  # one process read the index for the node
    assert _one(rows, f"{bench.FIRST_BATCH} ({config.workers} threads)").items == config.batch_size
    figures = report.params["figures"]["tar"]
    # The node's share: exactly the planned shards' bytes, nothing else but index files.
    assert figures["share_bytes"] == figures["share_planned_bytes"] > 0
    assert figures["share_other_bytes"] < 1e5
    assert 0 < figures["share_shards"] < config.shards
    share = _one(rows, bench.NODE_SHARE)
    assert share.extra["shards"] == figures["share_shards"]
    # fastload's own index, written into the cache: the open lists nothing and reads no
    # shard (only shardindex.json, which the index's writer left uncached).
    assert _one(rows, "fastload index").extra["GETs"] >= config.shards
    flidx = _one(rows, f"{bench.CACHED_OPEN}, fastload's index")
    assert flidx.extra["list reqs"] == 0
    assert flidx.extra["GETs"] <= 1
    assert _one(rows, f"{bench.FIRST_BATCH} ({config.workers} threads, fastload").items == 64
    for peer in bench.PEER_BUCKETS:
        row = _one(rows, f"{peer} index load")
        if not row.note.startswith(("skipped", "failed")):
            assert row.items == config.tar_samples
            assert row.extra["GETs"] >= 1  # its index.json


@pytest.mark.slow
def test_the_report_holds_every_target_and_writes_json(
    quick_report: tuple[Report, Path],
) -> None:
    report, out = quick_report
    targets = report.params["targets"]
    assert len(targets) >= 15
    for target in targets:
        assert target["measured"] is not None, target
        assert target["met"] in (True, False)
    lines = bench.target_lines(report)
    assert len(lines) == len(targets) + 1
    table = report.table()
    assert bench.FIRST_OPEN in table
    assert "USS B/sample" in table
    written = json.loads(report.write_json(out).read_text())
    assert written["benchmark"] == "scale"
    assert len(written["rows"]) == len(report.rows)


def test_peer_indexes_are_scaled_from_their_writers_output() -> None:
    mds = {
        "version": 2,
        "shards": [
            {
                "column_names": ["cls", "jpg"],
                "raw_data": {"basename": "shard.00000.mds", "bytes": 3243, "hashes": {}},
                "samples": 3,
            }
        ],
    }
    scaled = bench._scaled_index("mosaicml-streaming", mds, 4, 1250, 10_000)
    assert [s["raw_data"]["basename"] for s in scaled["shards"]] == [
        f"shard.{i:05d}.mds" for i in range(4)
    ]
    assert sum(s["samples"] for s in scaled["shards"]) == 5000
    assert mds["shards"][0]["samples"] == 3  # the template is left alone
    lit = {
        "chunks": [
            {"chunk_bytes": 3068, "chunk_size": 3, "dim": None, "filename": "chunk-0-0.bin"}
        ],
        "config": {"chunk_size": 3},
    }
    scaled = bench._scaled_index("litdata", lit, 3, 7, 100)
    assert [c["filename"] for c in scaled["chunks"]] == [f"chunk-0-{i}.bin" for i in range(3)]
    assert sum(c["chunk_size"] for c in scaled["chunks"]) == 21
    assert scaled["config"]["chunk_size"] == 7


def test_config_is_checked_on_construction() -> None:
    with pytest.raises(ValueError, match="objects must be > 0"):
        bench.ScaleBenchConfig(objects=0)
    with pytest.raises(ValueError, match="classes"):
        bench.ScaleBenchConfig(objects=10, classes=20)
    quick = bench.ScaleBenchConfig.quick()
    assert quick.tar_samples == quick.shards * quick.shard_samples


def test_rollup_reads_this_process() -> None:
    memory = bench.rollup()
    assert memory["rss"] >= memory["pss"] >= memory["uss"] >= memory["anon"] > 0
    assert set(bench.rollup(2**22 + 1).values()) == {0}  # no such process


@pytest.mark.parametrize(
    "args",
    [
        ["bench", "--scale", "--components"],
        ["bench", "s3://bucket/train", "--scale"],
    ],
)
def test_bench_scale_refuses_what_does_not_fit(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    assert "--scale" in capsys.readouterr().err


def test_the_child_refuses_a_wrong_command_line() -> None:
    with pytest.raises(SystemExit, match="usage"):
        bench.main(["nothing"])
