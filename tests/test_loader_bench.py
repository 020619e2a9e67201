"""The loader benchmark at toy sizes: every case, every system, every figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from fastload.bench import runner
from fastload.bench.components import loader_bench
from fastload.bench.components.loader_bench_setup import FASTLOAD, SYSTEMS, LoaderBenchConfig

TINY = LoaderBenchConfig(
    batch_size=16,
    epochs=2,
    repeats=1,
    step_ms=1.0,
    memory_samples=48,
    memory_shape=(3, 8, 8),
    images=24,
    size=32,
    zarr_rows=40,
    zarr_row_shape=(8, 8, 3),
    zarr_chunk_rows=16,
    memory_interval_s=0.01,
    timeout_s=300,
)


@pytest.fixture(scope="module")
def report_and_json(tmp_path_factory: pytest.TempPathFactory) -> tuple[loader_bench.Report, dict]:
    out = tmp_path_factory.mktemp("loader-bench")
    report = loader_bench.run(out / "data", TINY)
    return report, json.loads(report.write_json(out).read_text())


def test_every_case_measures_every_system_against_its_torch_peer(
    report_and_json: tuple[loader_bench.Report, dict],
) -> None:
    report, _ = report_and_json
    by_case: dict[str, list[str]] = {}
    for r in report.rows:
        by_case.setdefault(r.case, []).append(r.system)
    assert sorted(by_case.values()) == sorted(list(s) for s in SYSTEMS.values())
    peers = {loader_bench._case_title(case, TINY): SYSTEMS[case][0] for case in SYSTEMS}
    for r in report.rows:
        assert r.reference == peers[r.case]
        assert r.ratio is not None
        assert r.ratio > 0
        assert r.items in (TINY.memory_samples, TINY.images, TINY.zarr_rows)
        assert len(r.repeats) == TINY.repeats
        assert r.nbytes > 0


def test_every_row_reports_waits_and_memory_per_epoch(
    report_and_json: tuple[loader_bench.Report, dict],
) -> None:
    report, _ = report_and_json
    for r in report.rows:
        assert 0 <= r.extra["wait_frac"] <= 1
        assert r.extra["step_ms"] >= TINY.step_ms
        # The whole process tree: at least the interpreter with torch loaded.
        assert r.extra["peak_rss_mb"] > 50
        assert r.extra["peak_pss_mb"] > 50
        assert "rss_growth" in r.extra
        assert r.extra["step_samples_per_s"] > 0
        # The GIL-holding step, beside the configured one, for every system.
        assert r.extra["gil_samples_per_s"] > 0
        assert r.extra["gil_vs_step"] > 0
        assert 0 <= r.extra["gil_wait_frac"] <= 1
        assert 0 <= r.extra["gil_step_lost"] < 1
        assert 0 <= r.extra["step_lost"] < 1  # the sleeping step: time past its sleep
        assert r.extra["gil_ratio"] > 0
        if r.system == r.reference:
            assert r.extra["gil_ratio"] == 1.0
        assert r.extra["cpu_us_per_sample"] >= 0
        if "JPEG" in r.case:  # milliseconds a sample: CPU time to see even at toy size
            assert r.extra["cpu_us_per_sample"] > 0
        per_epoch = r.note.rsplit("RSS MB by epoch ", 1)[1].split("/")
        assert len(per_epoch) == TINY.epochs
        assert all(int(mb) > 50 for mb in per_epoch)
        # stats() exists on fastload's loader only, and agrees on what a fraction is.
        if r.system.startswith(FASTLOAD):
            assert 0 <= r.extra["stats_wait_frac"] <= 1
        else:
            assert "stats_wait_frac" not in r.extra
    assert "stats_wait_frac" in report.table()
    assert "gil_step_lost" in report.table()


def test_json_keeps_each_systems_epochs_and_fastloads_stats(
    report_and_json: tuple[loader_bench.Report, dict],
) -> None:
    _, payload = report_and_json
    details = payload["params"]["details"]
    assert set(details) == set(loader_bench.CASES)
    for case, systems in details.items():
        assert set(systems) == set(SYSTEMS[case])
        for system, d in systems.items():
            assert len(d["epochs"]) == TINY.epochs
            assert len(d["gil_epochs"]) == TINY.epochs
            assert len(d["plain"]) == TINY.repeats
            assert all(0 < e["step_s"] < e["seconds"] for e in d["epochs"] + d["gil_epochs"])
            assert all(e["step_s"] == 0 for e in d["plain"])
            assert all(e["peak_rss"] > 0 for e in d["epochs"])
            if system.startswith(FASTLOAD):
                stats = d["plain"][-1]["stats"]
                assert stats["batches"] > 0
                # The fast path reads from the cache warmed before timing: no fetches.
                if case != "memory":
                    assert stats["path"] == "fastload"
                    assert stats["counts"].get("cache_misses", 0) == 0
                else:
                    assert stats["path"] == "torch"
    jpeg = details["jpeg"][f"{FASTLOAD}, decode='cpu'"]["plain"][-1]["stats"]
    assert jpeg["decode_backend"] == "cpu"
    assert jpeg["samples"] == TINY.images * (2 * TINY.epochs + TINY.repeats)


def test_the_memory_sampler_counts_child_processes() -> None:
    """A DataLoader's worker processes are part of what a system costs."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; b = bytes(range(256)) * (1 << 18); time.sleep(60)"]
    )
    sampler = loader_bench.MemorySampler(interval_s=0.01)
    sampler.begin()
    try:
        own = sampler._rss(os.getpid())
        assert child.pid in runner.process_tree(os.getpid())
        deadline = time.monotonic() + 30
        while sampler.peak_rss < own + (64 << 20):  # the child's 64 MiB, counted too
            assert time.monotonic() < deadline, "the sampler never saw the child's memory"
            time.sleep(0.05)
        assert sampler.end() >= own + (64 << 20)  # the epoch's peak
        assert sampler.peak_pss > 0
    finally:
        sampler.close()
        child.kill()
        child.wait(timeout=10)


def test_a_failing_system_names_itself_and_shows_its_error(tmp_path: Path) -> None:
    spec = {
        "case": "zarr",
        "system": "torch DataLoader + zarr-python",
        "config": asdict(TINY),
        "data": {"zarr_dir": str(tmp_path / "missing"), "cache_dir": str(tmp_path)},
    }
    child = loader_bench._Child(spec, timeout_s=120)
    try:
        child.ask(None)  # the loader is made; the dataset opens in the workers
        with pytest.raises(RuntimeError, match=r"zarr-python \(zarr\) exited early") as raised:
            child.ask({"do": "epoch", "step": None})
    finally:
        child.close()
    assert "missing" in str(raised.value)  # the child's own error, with the path


@pytest.mark.parametrize(
    ("field", "value"),
    [("epochs", 0), ("workers", -1), ("step", "nap"), ("step_ms", 0.0), ("cases", ("tar",))],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LoaderBenchConfig(**{field: value})  # type: ignore[arg-type]


def test_a_matmul_step_runs_the_count_the_parent_measured() -> None:
    count = loader_bench.matmuls_for(step_ms=2.0)
    assert count >= 1
    step = loader_bench._training_step(replace(TINY, step="matmul"), count)
    step()  # runs: the same work in every system's process


def test_quick_leaves_the_gil_step_to_the_full_run() -> None:
    assert LoaderBenchConfig().step_holds_gil
    assert not LoaderBenchConfig.quick().step_holds_gil
    asked = loader_bench.configured(LoaderBenchConfig.quick(), step_holds_gil=True)
    assert asked.step_holds_gil
