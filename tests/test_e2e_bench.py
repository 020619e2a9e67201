"""The end-to-end benchmark at toy sizes: real S3 server, real child processes, real peers."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload.bench import e2e_bench, e2e_report
from fastload.bench.e2e_data import DataConfig, folder_key, generate, label_of, zarr_pixels

TINY = DataConfig(samples=24, classes=3, shard_samples=8, zarr_side=32, zarr_chunk_rows=4)


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
        "peers_python": "/nonexistent/.venv-peers/bin/python",
        **changes,
    }
    return e2e_bench.E2EConfig(**settings)  # type: ignore[arg-type]


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def test_the_layouts_hold_the_same_images_and_labels(tmp_path: Path) -> None:
    import zarr

    data = generate(tmp_path / "data", TINY)
    folder = {
        i: (data.folder / folder_key(i, TINY.classes)).read_bytes() for i in range(TINY.samples)
    }
    assert sorted(p.parent.name for p in data.folder.rglob("*.jpg"))[0] == "class_000"
    in_tar: dict[int, tuple[bytes, int]] = {}
    order: list[int] = []
    for shard in sorted(data.tar.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar}  # type: ignore[union-attr]
        assert len(members) == 2 * TINY.shard_samples
        for name in sorted(members, key=list(members).index):
            key, ext = name.split(".")
            if ext == "jpg":
                order.append(int(key))
                in_tar[int(key)] = (members[name], int(members[f"{key}.cls"]))
    assert sorted(order) == list(range(TINY.samples))  # each sample once
    assert order != sorted(order)  # shuffled, so a shard mixes classes
    group = zarr.open_group(str(data.zarr), mode="r")
    labels = np.asarray(group["labels"][:])
    for i, jpeg in folder.items():
        tar_jpeg, tar_label = in_tar[i]
        assert np.array_equal(pixels(tar_jpeg), pixels(jpeg))
        assert tar_label == labels[i] == label_of(i, TINY.classes)
        assert np.array_equal(np.asarray(group["images"][i]), zarr_pixels(jpeg, TINY.zarr_side))
    sizes = [len(b) for b in folder.values()]
    assert 40_000 < np.mean(sizes) < 200_000  # natural-image-like, ImageNet-like sizes


def test_generated_data_is_kept_and_rebuilt_when_the_parameters_change(tmp_path: Path) -> None:
    small = DataConfig(samples=4, classes=2, shard_samples=2, zarr_side=16, zarr_chunk_rows=2)
    first = generate(tmp_path, small)
    stamp = (first.folder / folder_key(3, 2)).stat().st_mtime_ns
    again = generate(tmp_path, small)
    assert (again.folder / folder_key(3, 2)).stat().st_mtime_ns == stamp
    bigger = generate(tmp_path, DataConfig(**{**small.__dict__, "samples": 6}))
    assert len(list(bigger.folder.rglob("*.jpg"))) == 6
    assert len(list(bigger.tar.glob("*.tar"))) == 3


@pytest.mark.slow
def test_fastload_and_the_fsspec_peer_end_to_end_with_skipped_peers(tmp_path: Path) -> None:
    config = tiny(systems=(e2e_bench.FASTLOAD, e2e_bench.FSSPEC, e2e_bench.MOSAIC))
    report = e2e_bench.run(tmp_path, config)
    lines = e2e_report.write(report, tmp_path)
    payload = json.loads((tmp_path / "e2e.json").read_text())
    assert any("e2e.json" in line for line in lines)
    assert payload["machine"]["cores"] >= 1
    assert {"torch", "fsspec", "s3fs"} <= set(payload["machine"]["libraries"])
    runs = {(r["system"], r["layout"]): r for r in payload["params"]["runs"]}
    assert set(runs) == {
        (e2e_bench.FASTLOAD, "folder"),
        (e2e_bench.FSSPEC, "folder"),
        (e2e_bench.MOSAIC, "mds"),
    }
    fast, peer = runs[(e2e_bench.FASTLOAD, "folder")], runs[(e2e_bench.FSSPEC, "folder")]
    for run in (fast, peer):
        assert run["status"] == "ok", run["note"]
        assert [e["samples"] for e in run["epochs"]] == [TINY.samples, TINY.samples]
        f = run["figures"]
        for key in ("cold_samples_per_s", "warm_samples_per_s", "first_batch_s", "cpu_s"):
            assert f[key] > 0, key
        assert 0 <= f["wait_fraction_warm"] <= 1
        assert f["peak_rss_bytes"] > 10 << 20
        assert f["remote_requests"] > 0
        assert 0 < f["server_cpu_s"] < f["cpu_s"]  # the server's threads only: a lean server
    folder_bytes = payload["params"]["dataset"]["bytes"]["folder"]
    # fastload fetches every image once (then reads its cache); the peer once per epoch.
    assert folder_bytes <= fast["figures"]["remote_bytes"] < 1.5 * folder_bytes
    assert peer["figures"]["remote_bytes"] >= 2 * folder_bytes
    assert fast["resume"]["resume_exact"] is True
    assert fast["figures"]["resume_s"] > 0
    assert peer["figures"]["resume_s"] is None
    assert "resume n/a" in peer["note"]
    skipped = runs[(e2e_bench.MOSAIC, "mds")]
    assert skipped["status"] == "skipped"
    assert "does not import" in skipped["note"]
    assert "make bench-peers" in skipped["note"]
    (ratio,) = payload["params"]["ratios"]
    assert ratio["peer"] == e2e_bench.FSSPEC
    assert ratio["warm_samples_per_s"] > 0
    text = e2e_report.summary(report)
    assert "skipped: " in text
    assert f"fastload vs {e2e_bench.FSSPEC} (folder): warm" in text


@pytest.mark.slow
def test_bench_url_measures_a_users_folder_read_only(tmp_path: Path) -> None:
    data = generate(tmp_path / "data", TINY)
    before = {p: p.stat().st_mtime_ns for p in data.folder.rglob("*")}
    config = tiny(systems=(e2e_bench.FASTLOAD, e2e_bench.FSSPEC, e2e_bench.DALI), resume=False)
    report = e2e_bench.run_url(str(data.folder), tmp_path / "out", config)
    runs = {r["system"]: r for r in report.params["runs"]}
    assert runs[e2e_bench.FASTLOAD]["status"] == "ok", runs[e2e_bench.FASTLOAD]["note"]
    assert runs[e2e_bench.FSSPEC]["status"] == "ok", runs[e2e_bench.FSSPEC]["note"]
    assert runs[e2e_bench.DALI]["status"] == "skipped"  # it would need a full local copy
    assert runs[e2e_bench.FASTLOAD]["epochs"][0]["samples"] == TINY.samples
    assert {p: p.stat().st_mtime_ns for p in data.folder.rglob("*")} == before


def test_a_failing_system_is_reported_with_its_log_not_raised(tmp_path: Path) -> None:
    run = e2e_report.Run(e2e_bench.FSSPEC, "folder", "failed", "exit 1: boom (log: /x)")
    ok = e2e_report.Run(e2e_bench.FASTLOAD, "folder", result={"epochs": []})
    report = e2e_report.build({"batch_size": 8}, "t", None, [run, ok], None)
    assert report.params["runs"][0]["note"] == "failed: exit 1: boom (log: /x)"
    assert report.params["ratios"] == []  # nothing to compare with a failed peer
    assert "failed: exit 1: boom" in e2e_report.table(report)


@pytest.mark.parametrize(
    ("field", "value"),
    [("epochs", 0), ("batch_size", 0), ("layouts", ("csv",)), ("systems", ("nope",))],
)
def test_config_refuses_nonsense(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        tiny(**{field: value})
