"""The small-object staging benchmark runs every system on the same objects and reports
CPU per object (tiny sizes: figures belong to benchmarks, not tests)."""

from __future__ import annotations

from pathlib import Path

from fastload.bench import small_objects_bench as bench


def test_every_system_stages_every_object_and_reports_its_cpu(tmp_path: Path) -> None:
    config = bench.SmallObjectsBenchConfig(objects=60, folders=3, gil_objects=10, repeats=1)
    report = bench.run(tmp_path, config)
    rows = {r.system: r for r in report.rows}
    assert bench.FASTLOAD in rows
    assert bench.FASTLOAD_S3FS in rows
    assert rows[bench.FASTLOAD].ratio == 1.0
    assert rows[bench.FASTLOAD_GIL].items == 10
    assert rows[bench.FASTLOAD].items == 60
    for row in rows.values():
        assert row.extra["client CPU ms/obj"] > 0
    assert 0 <= rows[bench.FASTLOAD_GIL].extra["busy thread lost"] <= 1
