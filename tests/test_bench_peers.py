"""The benchmark's peers as their maintainers set them up (SPDL's pipeline, the I/O-bound
peers at their documented concurrency) and the quick run's longer warm measurement: real S3
server, real child processes, real SPDL where it and FFmpeg's libraries are installed."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.bench.e2e import e2e_bench, e2e_report
from fastload.bench.e2e.e2e_data import DataConfig, generate
from fastload.bench.peers import spdl_peer
from fastload.decode.params import EvalPreset, TrainPreset

TINY = DataConfig(samples=24, classes=3, shard_samples=8, zarr_side=32, zarr_chunk_rows=4)
SPDL_MISSING = spdl_peer.spdl_missing()
needs_spdl = pytest.mark.skipif(bool(SPDL_MISSING), reason=SPDL_MISSING or "spdl runs")


def tiny(**changes: object) -> e2e_bench.E2EConfig:
    settings: dict[str, object] = {
        "data": TINY,
        "batch_size": 8,
        "workers": 1,
        "epochs": 2,
        "step_s": 0.0,
        "latency_s": 0.005,
        "epoch_budget_s": 60.0,
        "run_timeout_s": 120.0,
        "layouts": ("folder",),
        "repeats": 1,
        "steps": ("sleep",),
        "peers_python": "/nonexistent/.venv-peers/bin/python",
        **changes,
    }
    return e2e_bench.E2EConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.slow
@needs_spdl
def test_the_spdl_peer_reads_each_sample_once_an_epoch_from_folder_and_tar(
    tmp_path: Path,
) -> None:
    config = tiny(systems=(e2e_bench.SPDL,), layouts=("folder", "tar"))
    report = e2e_bench.run(tmp_path, config)
    runs = {r["layout"]: r for r in report.params["runs"] if r["system"] == e2e_bench.SPDL}
    assert set(runs) == {"folder", "tar"}
    for run in runs.values():
        assert run["status"] == "ok", run["note"]
        # Every sample once per epoch: its batches carry the samples' ids.
        assert [(e["samples"], e["distinct"]) for e in run["epochs"]] == [(24, 24), (24, 24)]
        assert run["delivers"] == "sample ids"
        assert "resume n/a: SPDL's Pipeline has no state_dict" in run["note"]
    # No cache: a GET per image (folder) or per shard (tar) every epoch, no HEAD before it.
    folder_gets = runs["folder"]["figures"]["remote_requests"]
    assert 2 * TINY.samples <= folder_gets <= 2 * TINY.samples + 4
    shards = TINY.samples // TINY.shard_samples
    assert 2 * shards <= runs["tar"]["figures"]["remote_requests"] <= 2 * shards + 4


@needs_spdl
def test_spdl_batches_are_the_presets_normalized_chw_floats(tmp_path: Path) -> None:
    from fastload.bench.peers.peer_decoders import TorchOps

    data = generate(tmp_path, TINY)
    paths = sorted(str(p) for p in data.folder.rglob("*.jpg"))[:4]
    for preset in (TrainPreset(size=64), EvalPreset(resize=72, size=64)):
        images = spdl_peer.SPDLImages(preset, seed=0)
        batch = images.collate([images.decode(p) for p in paths])
        assert batch.shape == (4, 3, 64, 64)
        assert batch.dtype == torch.float32
        assert batch.is_contiguous()
        if isinstance(preset, EvalPreset):  # no randomness: the same picture as torch ops
            from fastload.decode.cpu import decode_rgb

            want = torch.stack([TorchOps(preset)(decode_rgb(Path(p).read_bytes())) for p in paths])
            # FFmpeg's bilinear scale against torch's antialiased one: the same image,
            # not the same rounding.
            assert (batch - want).abs().mean() < 0.15
            assert np.corrcoef(batch.flatten(), want.flatten())[0, 1] > 0.97


def test_spdl_missing_says_what_to_install(tmp_path: Path) -> None:
    # A Python that sees no site-packages: spdl is not there.
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(bare.stat().st_mode | stat.S_IEXEC)
    assert spdl_peer.spdl_missing(str(bare)) == "not installed: pip install spdl"
    if not SPDL_MISSING:
        assert spdl_peer.spdl_missing() == ""


def test_spdl_is_skipped_with_its_reason_where_it_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e2e_bench._spdl_missing.cache_clear()
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(bare.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(bare))
    try:
        data = generate(tmp_path / "data", TINY)
        reason = e2e_bench._skip_reason(tiny(), e2e_bench.SPDL, data, None, {})
    finally:
        e2e_bench._spdl_missing.cache_clear()
    assert reason == "not installed: pip install spdl"


def test_the_io_bound_peers_also_run_at_the_concurrency_their_docs_recommend() -> None:
    config = tiny()
    spec = {
        system: e2e_bench._spec(config, system, "folder", "sleep", "s3://b/folder")
        for system in (
            e2e_bench.FSSPEC,
            e2e_bench.S3TORCH,
            e2e_bench.FSSPEC_DOCS,
            e2e_bench.S3TORCH_DOCS,
            e2e_bench.SPDL,
        )
    }
    assert spec[e2e_bench.FSSPEC]["workers"] == spec[e2e_bench.S3TORCH]["workers"] == 1
    # s3torchconnector's own benchmark configuration: num_workers 8.
    assert spec[e2e_bench.FSSPEC_DOCS]["workers"] == spec[e2e_bench.S3TORCH_DOCS]["workers"] == 8
    assert spec[e2e_bench.SPDL]["workers"] == 1  # its CPU stage; its I/O stage is its own
    # Both settings are measured by default, on the layouts the peer reads.
    wanted = e2e_bench._wanted(config)
    for system in (e2e_bench.FSSPEC, e2e_bench.FSSPEC_DOCS, e2e_bench.S3TORCH_DOCS):
        assert system in wanted
    assert e2e_bench.PLAN[e2e_bench.FSSPEC_DOCS] == e2e_bench.PLAN[e2e_bench.S3TORCH_DOCS]


@pytest.mark.slow
def test_the_fsspec_peer_runs_its_documented_worker_count(tmp_path: Path) -> None:
    report = e2e_bench.run(tmp_path, tiny(systems=(e2e_bench.FSSPEC_DOCS,)))
    (run,) = report.params["runs"]
    assert run["status"] == "ok", run["note"]
    assert [(e["samples"], e["distinct"]) for e in run["epochs"]] == [(24, 24), (24, 24)]
    log = (tmp_path / "work" / "e2e").rglob("spec.json")
    assert not list(log)  # the spec (with credentials) is gone with its child


def test_warm_epochs_repeat_until_they_have_run_min_warm_s(tmp_path: Path) -> None:
    report = e2e_bench.run(tmp_path, tiny(systems=(e2e_bench.FASTLOAD,), min_warm_s=1.0))
    (run,) = report.params["runs"]
    assert run["status"] == "ok", run["note"]
    warm = run["epochs"][1:]
    assert len(warm) > 1  # 24 samples take well under a second an epoch
    assert sum(e["seconds"] for e in warm) >= 1.0
    assert all(e["samples"] == TINY.samples for e in warm)
    # The resume check still compares against the configured last epoch's order.
    assert run["resume"]["resume_exact"] is True
    # The table says how loaded the machine was, before and after.
    before, after = report.params["load_average"]["before"], report.params["load_average"]["after"]
    assert len(before) == len(after) == 3
    text = e2e_report.summary(report)
    assert f"load average (1 min) {before[0]:.2f} before, {after[0]:.2f} after" in text
    assert f"on {os.cpu_count()} cores" in text


def test_quick_measures_warm_epochs_for_seconds_and_leaves_out_the_slowest_peers(
    tmp_path: Path,
) -> None:
    quick = e2e_bench.E2EConfig.quick()
    assert quick.min_warm_s >= 3.0
    assert quick.resume is False
    data = generate(tmp_path, TINY)
    for system in (e2e_bench.FSSPEC, e2e_bench.FILECACHE, e2e_bench.S3TORCH):
        reason = e2e_bench._skip_reason(quick, system, data, None, {})
        assert "left out of --quick" in reason, system
        named = dataclasses.replace(quick, systems=(system,))
        assert "left out" not in e2e_bench._skip_reason(named, system, data, None, {})
    for system in (e2e_bench.FSSPEC_DOCS, e2e_bench.S3TORCH_DOCS, e2e_bench.FASTLOAD):
        assert "left out" not in e2e_bench._skip_reason(quick, system, data, None, {})


def test_the_load_line_says_busy_when_the_machine_was_loaded_before_the_run() -> None:
    cores = os.cpu_count() or 1
    assert "quiet" in e2e_bench.load_line((0.0, 0.0, 0.0), (float(cores), 0.0, 0.0))
    busy = e2e_bench.load_line((cores + 1.0, 0.0, 0.0), (cores + 1.0, 0.0, 0.0))
    assert "BUSY machine" in busy


@needs_spdl
def test_the_decode_benchmark_measures_spdls_image_decode(tmp_path: Path) -> None:
    from fastload.bench.components import decode_bench

    systems = (decode_bench.SPDL_SYSTEM,)
    config = decode_bench.DecodeBenchConfig(
        images=6, batch_size=4, size=32, repeats=1, systems=systems
    )
    report = decode_bench.run(tmp_path, config)
    pipeline = [r for r in report.rows if r.system == decode_bench.SPDL_SYSTEM]
    assert len(pipeline) == 2  # train and eval presets
    assert all(r.items == 6 and r.seconds > 0 for r in pipeline)
    assert "SPDL (FFmpeg)" in {r.system for r in report.rows}  # among the decoders alone
