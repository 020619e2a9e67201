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
    # Each fastload system stages its first object untimed (it starts the staging process).
    assert rows[bench.FASTLOAD].items == 59
    assert rows[bench.FASTLOAD_PROCESS].items == 59
    assert rows[bench.FASTLOAD_LISTING].items == 60
    assert rows[bench.FASTLOAD_GIL].items == 9
    assert rows[bench.FASTLOAD_GIL_PROCESS].items == 59
    for row in rows.values():
        assert row.extra["client CPU ms/obj"] > 0
    for name in (bench.FASTLOAD_GIL, bench.FASTLOAD_GIL_PROCESS):
        # A share of a rate, noisy at this size (below 0 when the machine got quieter).
        assert rows[name].extra["busy thread lost"] <= 1
