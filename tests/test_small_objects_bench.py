"""The small-object staging benchmark runs every system on the same objects, behind the
plain and the realistic server, and reports CPU per object (tiny sizes: figures belong to
benchmarks, not tests); a node's racing processes download each object once."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastload.bench.components import small_objects_bench as bench


@pytest.mark.slow
def test_every_system_stages_every_object_on_both_servers(tmp_path: Path) -> None:
    config = bench.SmallObjectsBenchConfig(
        objects=60, folders=3, gil_objects=10, repeats=1, node_processes=2
    )
    report = bench.run(tmp_path, config)
    cases = {r.case for r in report.rows}
    assert len(cases) == 2
    assert any("realistic" in case and "https" in case for case in cases)
    for case in cases:
        rows = {r.system: r for r in report.rows if r.case == case}
        assert rows[bench.FASTLOAD].ratio == 1.0
        # Each fastload system stages its first object untimed (it starts the staging
        # process); the node's processes stage all of them, each object once.
        assert rows[bench.FASTLOAD].items == 59
        assert rows[bench.FASTLOAD_PROCESS].items == 59
        assert rows[bench.FASTLOAD_LISTING].items == 60
        assert rows[bench.FASTLOAD_S3FS].items == 59
        assert rows[bench.FASTLOAD_GIL].items == 9
        assert rows[bench.FASTLOAD_GIL_PROCESS].items == 59
        assert rows[bench.FASTLOAD_NODE].items == 60
        assert rows[bench.FASTLOAD_NODE].extra["GETs/obj"] == 1.0
        if bench.S5CMD in rows:  # over https too, trusting the CA through AWS_CA_BUNDLE
            assert rows[bench.S5CMD].items == 60
        for row in rows.values():
            assert row.extra["client CPU ms/obj"] > 0
        for name in (bench.FASTLOAD_GIL, bench.FASTLOAD_GIL_PROCESS):
            # A share of a rate, noisy at this size (below 0 when the machine got quieter).
            assert rows[name].extra["busy thread lost"] <= 1


@pytest.mark.slow
def test_eight_racing_processes_download_each_object_once(tmp_path: Path) -> None:
    """The guard over S3 (obstore's GETs, the server in its own process): eight processes
    warm one cache at once, and the server's counters see one GET per object. (Over
    HTTP: tests/test_warm.py.)"""
    config = bench.SmallObjectsBenchConfig(objects=300, folders=6)
    remote = tmp_path / "remote"
    bench.generate(remote, config)
    with bench.start_server(remote, "plain") as server:
        before = server.stats()
        run = bench.stage_on_node(server, tmp_path / "cache", processes=8)
        after = server.stats()
    assert run.objects == 300  # what the eight fetched, together
    assert bench.object_downloads(before, after) == run.downloads == 300
    gets = {p: n for (m, p), n in after.requests.items() if m == "GET" and p.endswith(".bin")}
    objects = [f"/{f.relative_to(remote).as_posix()}" for f in remote.rglob("*.bin")]
    assert gets == dict.fromkeys(objects, 1)
