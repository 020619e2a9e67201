"""The Parquet benchmark at toy size: every system's row carries its figures, and the Hugging
Face peers, without ``datasets`` in the peers' Python, are skipped saying why. No timing is
asserted (speed is the benchmark's to report, not the tests')."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fastload.bench.components import parquet_bench
from fastload.bench.runner import Report

TINY = parquet_bench.ParquetBenchConfig(
    samples=64,
    files=2,
    row_group_rows=16,
    batch_size=16,
    repeats=1,
    latency_s=0.005,
    peers_python=sys.executable,  # .venv: no datasets there
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, Path]:
    pytest.importorskip("pyarrow")
    pytest.importorskip("s3fs")
    out = tmp_path_factory.mktemp("parquet")
    return parquet_bench.run(out / "data", TINY), out


def test_layout_is_the_hubs_image_feature(report: tuple[Report, Path]) -> None:
    import pyarrow.parquet as pq

    _, out = report
    data = parquet_bench.generate(out / "data", TINY)  # kept: the same settings
    assert len(data.files) == 2
    schema = pq.read_schema(data.files[0])
    assert schema.field("image").type.get_field_index("bytes") >= 0
    assert str(schema.field("label").type) == "int64"
    assert b"Image" in schema.metadata[b"huggingface"]
    md = pq.read_metadata(data.files[0])
    assert md.num_rows == 32
    assert md.row_group(0).num_rows == 16


def test_rows_carry_their_figures(report: tuple[Report, Path]) -> None:
    rep, out = report
    rows = {r.system: r for r in rep.rows}
    assert set(rows) == set(parquet_bench.SYSTEMS)
    measured = [
        parquet_bench.COLD,
        parquet_bench.WARM,
        parquet_bench.ARROW_SIMPLEJPEG,
        parquet_bench.ARROW_FASTLOAD_DECODER,
    ]
    for system in measured:
        row = rows[system]
        assert row.items == 64, system
        assert row.seconds > 0
        assert len(row.repeats) == 1
        assert row.ratio is not None
        assert row.reference == rep.params["best_peer"]
        assert {"cpu_us_per_sample", "first_batch_s"} <= set(row.extra)
    cold = rows[parquet_bench.COLD].extra
    assert cold["gets_per_epoch"] >= 2  # the two files, at least
    assert cold["open_gets"] == 4  # each file's tail, then its footer
    assert {"open_s", "vs_warm"} <= set(cold)
    assert rows[parquet_bench.WARM].extra["gets_per_epoch"] == 0  # from the cache
    assert rep.params["best_peer"] in parquet_bench.PEERS
    targets = rep.params["targets"]
    assert len(targets) == 2
    assert all(line.endswith((": met", ": missed")) for line in targets)
    written = json.loads(rep.write_json(out).read_text())
    assert len(written["rows"]) == len(parquet_bench.SYSTEMS)
    assert "case" in rep.table().splitlines()[0]


def test_hf_peers_skipped_without_datasets_say_why(report: tuple[Report, Path]) -> None:
    rep, _ = report
    for row in rep.rows:
        if row.system in parquet_bench.HF_PEERS:
            assert row.note.startswith("skipped: ")
            assert "datasets" in row.note
            assert "make bench-peers" in row.note
            assert row.items == 0
            assert row.ratio is None


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="samples"):
        parquet_bench.ParquetBenchConfig(samples=0)
    with pytest.raises(ValueError, match="warm epochs follow the cold"):
        parquet_bench.ParquetBenchConfig(systems=(parquet_bench.WARM,))
    assert list(parquet_bench.systems_named(["torch"])) == [
        parquet_bench.ARROW_SIMPLEJPEG,
        parquet_bench.ARROW_FASTLOAD_DECODER,
    ]
