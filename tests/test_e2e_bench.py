"""The end-to-end benchmark at toy sizes: real S3 server, real child processes, real peers."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from fastload.bench.e2e import e2e_bench, e2e_report
from fastload.bench.e2e.e2e_data import (
    DataConfig,
    folder_key,
    generate,
    jpegs_line,
    label_of,
    tar_order,
    with_parquet,
    zarr_pixels,
)
from fastload.bench.peers import e2e_peers
from fastload.bench.runner import TrainingStep

TINY = DataConfig(
    samples=24,
    classes=3,
    shard_samples=8,
    zarr_side=32,
    zarr_chunk_rows=4,
    parquet_files=2,
    parquet_row_group_rows=5,
)


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


def test_the_parquet_layout_holds_the_same_images_and_labels_as_hub_images(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    data = with_parquet(generate(tmp_path / "data", TINY), TINY)
    assert data.parquet is not None
    files = sorted(data.parquet.glob("*.parquet"))
    assert [f.name for f in files] == [
        "train-00000-of-00002.parquet",
        "train-00001-of-00002.parquet",
    ]
    assert data.nbytes["parquet"] == sum(f.stat().st_size for f in files)
    schema = pq.read_schema(files[0])
    assert schema.field("image").type.get_field_index("bytes") >= 0
    assert str(schema.field("label").type) == "int64"
    assert b'"Image"' in schema.metadata[b"huggingface"]  # datasets sees an Image feature
    assert [pq.read_metadata(files[0]).row_group(g).num_rows for g in range(3)] == [5, 5, 2]
    rows = [row for f in files for row in pq.read_table(f).to_pylist()]
    assert [int(r["image"]["path"].split(".")[0]) for r in rows] == tar_order(TINY)
    for row in rows:
        i = int(row["image"]["path"].split(".")[0])
        assert row["image"]["bytes"] == (data.folder / folder_key(i, TINY.classes)).read_bytes()
        assert row["label"] == label_of(i, TINY.classes)
    written = files[0].stat().st_mtime_ns
    again = with_parquet(generate(tmp_path / "data", TINY), TINY)  # kept: the same settings
    assert again.parquet == data.parquet
    assert files[0].stat().st_mtime_ns == written
    fewer = dataclasses.replace(TINY, parquet_files=1)
    images = (data.folder / folder_key(0, TINY.classes)).stat().st_mtime_ns
    one = with_parquet(generate(tmp_path / "data", fewer), fewer)  # only Parquet rewritten
    assert one.parquet is not None
    assert len(list(one.parquet.glob("*.parquet"))) == 1
    assert (data.folder / folder_key(0, TINY.classes)).stat().st_mtime_ns == images


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
    # One GET per image and epoch (no HEAD before each), plus a listing or two.
    assert 2 * TINY.samples <= peer["figures"]["remote_requests"] <= 2 * TINY.samples + 4
    assert fast["resume"]["resume_exact"] is True
    assert fast["resume"]["resume_check"] == "labels in order"  # its batches carry no ids
    assert peer["repeats_measured"] == 1
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
def test_the_parquet_layout_runs_fastload_and_its_peers(tmp_path: Path) -> None:
    """fastload and the pyarrow.dataset peer read the Parquet layout from S3; the datasets
    peers, without .venv-peers, are skipped saying why; the targets are reported."""
    pytest.importorskip("pyarrow")
    parquet_systems = (e2e_bench.ARROW, e2e_bench.HF_MAP, e2e_bench.HF_STREAMING)
    config = tiny(
        systems=(e2e_bench.FASTLOAD, *parquet_systems, e2e_bench.FSSPEC, e2e_bench.MOSAIC),
        layouts=("parquet",),
    )
    report = e2e_bench.run(tmp_path, config)
    runs = {(r["system"], r["layout"]): r for r in report.params["runs"]}
    # The folder's peers (and the conversions of the folder) are not measured without it.
    assert set(runs) == {(s, "parquet") for s in (e2e_bench.FASTLOAD, *parquet_systems)}
    dataset = report.params["dataset"]
    assert dataset["bytes"]["parquet"] > dataset["bytes"]["folder"] // 2
    assert "parquet" in dataset["layouts"]
    for system in (e2e_bench.FASTLOAD, e2e_bench.ARROW):
        run = runs[(system, "parquet")]
        assert run["status"] == "ok", run["note"]
        assert [e["samples"] for e in run["epochs"]] == [TINY.samples, TINY.samples]
        assert run["figures"]["warm_samples_per_s"] > 0
        assert run["figures"]["cold_samples_per_s"] > 0
        assert run["figures"]["remote_requests"] > 0
    peer = runs[(e2e_bench.ARROW, "parquet")]
    assert [e["distinct"] for e in peer["epochs"]] == [TINY.samples] * 2  # each row once
    assert "cold epoch includes reading the whole table" in peer["note"]
    # The table is read once, at open: the warm epoch fetches nothing.
    marks = {m["mark"]: m["remote_bytes"] for m in peer["marks"]}
    assert marks["epoch 1"] == marks["epoch 0"] > 0
    fast = runs[(e2e_bench.FASTLOAD, "parquet")]
    assert fast["resume"]["resume_exact"] is True
    for system in (e2e_bench.HF_MAP, e2e_bench.HF_STREAMING):
        skipped = runs[(system, "parquet")]
        assert skipped["status"] == "skipped"
        assert "make bench-peers" in skipped["note"]
        assert "datasets" in skipped["note"]
    (ratio,) = report.params["ratios"]
    assert (ratio["peer"], ratio["layout"]) == (e2e_bench.ARROW, "parquet")
    text = e2e_report.summary(report)
    assert f"fastload vs {e2e_bench.ARROW} (parquet): warm" in text
    targets = e2e_report.target_lines(report)
    assert len(targets) == 2
    assert f"best peer ({e2e_bench.ARROW}" in targets[0]
    assert all(line.endswith((": met", ": missed")) for line in targets)
    assert all(line in text for line in targets)


@pytest.mark.slow
def test_the_datasets_peers_read_the_parquet_layout_from_s3(tmp_path: Path) -> None:
    """Where .venv-peers has Hugging Face datasets (`make bench-peers`; not in CI)."""
    from fastload.bench.e2e.e2e_process import default_peers_python, probe_python

    python = default_peers_python()
    if python is None or not probe_python(python, ["datasets"], tmp_path).get("datasets"):
        pytest.skip("no .venv-peers with datasets (make bench-peers)")
    config = tiny(systems=(e2e_bench.HF_MAP, e2e_bench.HF_STREAMING), layouts=("parquet",),
                  peers_python=python, resume=False)  # fmt: skip
    report = e2e_bench.run(tmp_path, config)
    runs = {r["system"]: r for r in report.params["runs"]}
    assert set(runs) == {e2e_bench.HF_MAP, e2e_bench.HF_STREAMING}
    for run in runs.values():
        assert run["status"] == "ok", run["note"]
        assert [e["samples"] for e in run["epochs"]] == [TINY.samples, TINY.samples]
        assert [e["distinct"] for e in run["epochs"]] == [TINY.samples] * 2  # ids from paths
    assert "load_dataset's download and conversion" in runs[e2e_bench.HF_MAP]["note"]
    assert report.machine["peers_environment"]["modules"]["datasets"]


def test_the_parquet_layout_is_selected_by_name_and_its_peers_only_read_it() -> None:
    from fastload import cli

    args = cli.build_parser().parse_args(["bench", "--quick", "--layout", "parquet"])
    config = cli.bench_config(args)
    assert config.layouts == ("parquet",)
    assert config.data.samples == e2e_bench.E2EConfig.quick().data.samples
    assert "parquet" not in e2e_bench.E2EConfig.quick().layouts  # --quick: folder and tar
    assert "parquet" in e2e_bench.E2EConfig().layouts
    assert e2e_bench._measured(config, e2e_bench.HF_MAP)
    assert not e2e_bench._measured(config, e2e_bench.FSSPEC)
    named = dataclasses.replace(config, systems=(e2e_bench.MOSAIC,))
    assert not e2e_bench._measured(named, e2e_bench.MOSAIC)  # converted from the folder
    assert e2e_bench._peers_modules(config, e2e_bench._wanted(config)) == [
        "torch",
        "fsspec",
        "datasets",
    ]
    assert e2e_bench.ARROW_FASTLOAD_DECODER not in e2e_bench._wanted(config)  # opt-in


@pytest.mark.slow
def test_every_system_runs_with_the_sleeping_and_the_gil_holding_step(tmp_path: Path) -> None:
    config = tiny(
        systems=(e2e_bench.FASTLOAD, e2e_bench.FSSPEC), steps=("sleep", "gil"), step_s=0.01
    )
    report = e2e_bench.run(tmp_path, config)
    runs = {(r["system"], r["step"]): r for r in report.params["runs"]}
    systems = (e2e_bench.FASTLOAD, e2e_bench.FSSPEC)
    assert set(runs) == {(system, step) for system in systems for step in ("sleep", "gil")}
    for (_, step), run in runs.items():
        assert run["status"] == "ok", run["note"]
        assert [e["samples"] for e in run["epochs"]] == [TINY.samples, TINY.samples]
        assert run["figures"]["step_lost_warm"] is not None
        assert run["training_step"]["kind"] == step
        # The busy step's work was measured in the child, alone, before the loader opened.
        assert (run["training_step"]["iterations"] > 0) is (step == "gil")
    # The same work in every system's busy step: measured once, by the parent.
    assert len({runs[(s, "gil")]["training_step"]["iterations"] for s in systems}) == 1
    fast_gil = runs[(e2e_bench.FASTLOAD, "gil")]
    assert fast_gil["resume"]["resume_s"] is None  # measured once, with the sleeping step
    assert "resume measured with the sleeping step" in fast_gil["note"]
    assert runs[(e2e_bench.FASTLOAD, "sleep")]["resume"]["resume_exact"] is True
    assert {(e["step"], e["peer"]) for e in report.params["ratios"]} == {
        ("sleep", e2e_bench.FSSPEC),
        ("gil", e2e_bench.FSSPEC),
    }
    against = {e["system"]: e for e in report.params["gil_vs_sleep"]}
    assert set(against) == {e2e_bench.FASTLOAD, e2e_bench.FSSPEC}
    assert all(e["warm_samples_per_s"] > 0 for e in against.values())
    cases = {(r.case, r.system) for r in report.rows}
    assert ("folder, GIL-holding step", e2e_bench.FASTLOAD) in cases
    assert ("folder", e2e_bench.FASTLOAD) in cases
    text = e2e_report.summary(report)
    assert "With the GIL-holding step, each system's rates over its own" in text
    assert "  fastload (folder): warm" in text
    assert f"fastload vs {e2e_bench.FSSPEC} (folder, GIL-holding step): warm" in text
    assert "step per batch: sleeping, and holding the GIL" in text
    assert "step lost %" in text


def test_an_epoch_counts_what_its_steps_took_and_waited() -> None:
    """Each epoch of the child records its steps' wall time and the part of it in which
    the step could not run; the report makes the share lost of them."""
    from fastload.bench.e2e import e2e_child

    loader = FakeLoader(None, "", e2e_peers.SAMPLE_IDS)
    step = TrainingStep("gil", 0.002)
    epoch = e2e_child._epoch(loader, 0, step, 0.0, None)
    assert epoch["batches"] == 5 == step.calls
    assert epoch["step_s"] == pytest.approx(step.spent_s)
    assert 0 <= epoch["step_waited_s"] <= epoch["step_s"]
    assert step.record()["alone_rate"] > 0
    run = e2e_report.Run(e2e_bench.FSSPEC, "folder", step="gil",
                         result={"epochs": [epoch, epoch], "step": step.record()})  # fmt: skip
    assert 0 <= e2e_report.figures(run)["step_lost_warm"] < 1


def test_the_report_sets_each_systems_gil_step_against_its_sleeping_step() -> None:
    def one(system: str, step: str, warm_s: float, step_s: float) -> e2e_report.Run:
        epoch = {"samples": 24, "wait_s": 0.1, "first_batch_s": 0.1, "partial": False,
                 "batches": 3, "step_s": step_s, "step_waited_s": step_s - 0.03}  # fmt: skip
        epochs = [{**epoch, "seconds": 2.0}, {**epoch, "seconds": warm_s}]
        result = {"epochs": epochs, "step": {"kind": step}}
        return e2e_report.Run(system, "folder", result=result, step=step)

    runs = [
        one(e2e_bench.FASTLOAD, "sleep", 1.0, 0.03),
        one(e2e_bench.FASTLOAD, "gil", 2.0, 0.06),  # half the rate, the step took twice
        one(e2e_bench.FSSPEC, "sleep", 2.0, 0.03),
        one(e2e_bench.FSSPEC, "gil", 2.0, 0.03),
    ]
    report = e2e_report.build({"batch_size": 8}, "t", None, runs, None)
    (fast, peer) = report.params["gil_vs_sleep"]
    assert fast["warm_samples_per_s"] == pytest.approx(0.5)
    assert fast["step_lost_warm"] == pytest.approx(0.5)
    assert peer["warm_samples_per_s"] == pytest.approx(1.0)
    assert peer["step_lost_warm"] == pytest.approx(0.0)
    ratios = {e["step"]: e["warm_samples_per_s"] for e in report.params["ratios"]}
    assert ratios == {"sleep": pytest.approx(2.0), "gil": pytest.approx(1.0)}
    table = e2e_report.table(report)
    assert [r["step"] for r in report.params["runs"]] == ["sleep", "gil"] * 2
    assert sum(" GIL " in line for line in table.splitlines()) == 2
    assert sum(" sleep " in line for line in table.splitlines()) == 2
    assert "took 50% of the step's time" in e2e_report.summary(report)


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


def test_the_repeats_of_a_run_give_medians_and_the_json_keeps_each(tmp_path: Path) -> None:
    def one(repeat: int, warm_s: float, exact: bool) -> e2e_report.Run:
        epoch = {"samples": 24, "wait_s": 0.1, "first_batch_s": 0.1, "partial": False}
        epochs = [{**epoch, "seconds": 2.0}, {**epoch, "seconds": warm_s}]
        result = {"epochs": epochs, "cpu_s": float(repeat + 1), "resume_s": 0.1,
                  "resume_exact": exact, "resume_check": "sample ids"}  # fmt: skip
        return e2e_report.Run(e2e_bench.FSSPEC, "folder", result=result, repeat=repeat)

    runs = [one(0, 1.0, True), one(1, 3.0, True), one(2, 2.0, False)]
    report = e2e_report.build({"batch_size": 8}, "t", None, runs, None)
    (row,) = report.params["runs"]
    assert row["figures"]["warm_samples_per_s"] == 12.0  # the median of 24, 8 and 12
    assert row["figures"]["cpu_s"] == 2.0
    assert row["figures"]["resume_exact"] is False  # one repeat was not exact: not exact
    assert row["repeats_measured"] == 3
    assert [r["figures"]["warm_samples_per_s"] for r in row["repeats"]] == [24.0, 8.0, 12.0]
    (measured,) = report.rows
    assert measured.items_per_s == pytest.approx(12.0)
    assert measured.repeats == [1.0, 3.0, 2.0]
    assert "the median of 3 runs" in e2e_report.table(report)
    assert "resume did not deliver exactly" in row["note"]
    single = e2e_report.build({"batch_size": 8}, "t", None, [one(0, 1.0, True)], None)
    assert "the median of 1 run " in e2e_report.table(single)
    labels = one(0, 1.0, True)
    labels.result["resume_check"] = e2e_peers.LABELS_IN_ORDER
    report = e2e_report.build({"batch_size": 8}, "t", None, [labels], None)
    assert "resume checked by labels in order" in report.params["runs"][0]["note"]


def _spec(**changes: object) -> e2e_peers.RunSpec:
    settings: dict[str, object] = {
        "system": "fake", "layout": "folder", "url": "s3://b/x", "storage_options": {},
        "endpoint_url": None, "work_dir": "/nonexistent", "batch_size": 4, "workers": 0,
        "epochs": 2, "step_s": 0.0, "epoch_budget_s": 60.0, "cold_budget_s": None,
        "size": 8, "seed": 0, "resume": True, **changes,
    }  # fmt: skip
    return e2e_peers.RunSpec(**settings)  # type: ignore[arg-type]


class FakeLoader:
    """Yields sample ids in a seeded order per epoch; resumes from a position, after which
    it replays (``fault="replay"``), drops (``"drop"``) or repeats one under another id's
    place (``"swap"``) as a broken loader would."""

    def __init__(self, state: dict[str, int] | None, fault: str, delivers: str) -> None:
        self.samples, self.extra, self.no_resume = 20, {}, ""
        self.delivers, self.fault = delivers, fault
        self.epoch, self.position = (0, 0) if state is None else (state["epoch"], state["at"])
        self.resumed = state is not None

    def order(self) -> list[int]:
        return list(np.random.default_rng(self.epoch).permutation(self.samples))

    def batches(self, epoch: int | None) -> Iterator[e2e_peers.Delivered]:
        if epoch is not None:
            self.epoch, self.position = epoch, 0
        order = self.order()
        if self.resumed and self.fault == "replay":
            self.position -= 3
        if self.resumed and self.fault == "drop":
            self.position += 2
        if self.resumed and self.fault == "swap":
            order[-1] = order[self.position]
        while self.position < len(order):
            batch = [int(i) for i in order[self.position : self.position + 4]]
            self.position += len(batch)
            yield batch if self.delivers != "counts" else len(batch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "at": self.position}

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("fault", "delivers", "exact"),
    [
        ("", e2e_peers.SAMPLE_IDS, True),
        ("replay", e2e_peers.SAMPLE_IDS, False),
        ("drop", e2e_peers.SAMPLE_IDS, False),
        ("swap", e2e_peers.SAMPLE_IDS, False),  # right count, one sample twice, one never
        ("swap", "counts", True),  # what a count cannot see
        ("", e2e_peers.LABELS_IN_ORDER, True),
        ("swap", e2e_peers.LABELS_IN_ORDER, False),
    ],
)
def test_the_resume_check_compares_what_was_delivered_with_an_uninterrupted_epoch(
    fault: str, delivers: str, exact: bool
) -> None:
    from fastload.bench.e2e import e2e_child

    spec = _spec()
    loader = FakeLoader(None, fault, delivers)
    step = TrainingStep("sleep", spec.step_s)
    epochs = [e2e_child._epoch(loader, e, step, 0.0, None) for e in range(spec.epochs)]
    assert epochs[-1]["ids"] is None if delivers == "counts" else sorted(epochs[-1]["ids"])

    def reopen(spec: e2e_peers.RunSpec, state: Any) -> e2e_peers.Loader:
        return FakeLoader(state, fault, delivers)

    result = e2e_child._resume(reopen, spec, loader, epochs[-1])
    assert result["resume_exact"] is exact, result
    if delivers == "counts":
        assert result["resume_check"].startswith("sample count only")
    else:
        assert result["resume_check"] == delivers
    if fault == "replay" and delivers == e2e_peers.SAMPLE_IDS:
        assert (result["resume_replayed"], result["resume_dropped"]) == (3, 0)
    if fault == "drop":
        assert (result["resume_replayed"], result["resume_dropped"]) == (0, 2)


def test_the_fsspec_peer_gets_each_image_in_one_request(tmp_path: Path) -> None:
    from fsspec.core import url_to_fs

    from fastload.testing import S3FolderServer

    with S3FolderServer(tmp_path / "s3") as server:
        server.create_bucket("b")
        for i in range(3):
            server.put("b", f"f/c/{i}.jpg", bytes([i]) * 5000)
        for read, heads in ((e2e_peers.get_object, 0), (e2e_peers._open_read, 3)):
            fs, _ = url_to_fs("s3://b/f", skip_instance_cache=True, **server.storage_options)
            server.reset_stats()  # a fresh filesystem, as in each DataLoader worker
            assert [read(fs, f"b/f/c/{i}.jpg") for i in range(3)] == [
                bytes([i]) * 5000 for i in range(3)
            ]
            assert dict(server.stats().by_method) == {
                "GET": 3,
                **({"HEAD": heads} if heads else {}),
            }


def test_the_old_fsspec_read_runs_only_when_asked_for() -> None:
    assert e2e_bench.FSSPEC_OPEN not in e2e_bench._wanted(tiny())
    assert e2e_bench.FSSPEC in e2e_bench._wanted(tiny())
    assert e2e_bench._wanted(tiny(systems=(e2e_bench.FSSPEC_OPEN,))) == [e2e_bench.FSSPEC_OPEN]


def test_quick_runs_a_conversion_peer_that_is_asked_for_by_name(tmp_path: Path) -> None:
    quick = e2e_bench.E2EConfig.quick()
    assert quick.repeats == 1
    data = generate(tmp_path, TINY)
    left_out = e2e_bench._skip_reason(quick, e2e_bench.MOSAIC, data, "/x/python", {})
    assert "left out of --quick" in left_out
    named = dataclasses.replace(quick, systems=(e2e_bench.MOSAIC,))
    reason = e2e_bench._skip_reason(named, e2e_bench.MOSAIC, data, "/x/python", {})
    assert "does not import" in reason  # it is measured where .venv-peers has it


def test_bench_url_refuses_a_conversion_peer_by_name(tmp_path: Path) -> None:
    from fastload.errors import NotYetAvailableError

    config = tiny(systems=(e2e_bench.FASTLOAD, e2e_bench.LITDATA))
    with pytest.raises(NotYetAvailableError, match="does not run litdata: it reads only after"):
        e2e_bench.run_url(str(tmp_path / "nothing-read"), tmp_path / "out", config)
    assert not (tmp_path / "out").exists()


def test_a_runs_spec_with_credentials_does_not_outlive_its_child(tmp_path: Path) -> None:
    """`fastload bench URL` hands the user's storage_options to each child in its spec file;
    nothing left in the output folder afterwards may hold them (here the child fails at once:
    the spec lacks fields, as a crash would leave it)."""
    import sys

    from fastload.bench.e2e.e2e_process import run_child

    secret = "s3cr3t-FASTLOAD-bench-spec"
    spec = {"system": "fastload", "layout": "folder", "storage_options": {"secret": secret}}
    run = run_child(sys.executable, spec, tmp_path / "run", None, 60.0)
    assert run.status == "failed"
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert [p.name for p in files] == ["log.txt"]
    assert all(secret not in p.read_text() for p in files)


def test_repeated_pictures_are_byte_copies_in_their_own_objects_with_their_labels(
    tmp_path: Path,
) -> None:
    config = DataConfig(
        samples=12, classes=2, images=4, shard_samples=4, zarr_side=16, zarr_chunk_rows=4
    )
    data = generate(tmp_path, config)
    files = sorted(data.folder.rglob("*.jpg"))
    assert len(files) == 12
    assert len({f.stat().st_ino for f in files}) == 12
    for i in range(12):
        copy = (data.folder / folder_key(i, 2)).read_bytes()
        assert copy == (data.folder / folder_key(i % 4, 2)).read_bytes()
    assert len({(data.folder / folder_key(i, 2)).read_bytes() for i in range(4)}) == 4
    with tarfile.open(next(data.tar.glob("*.tar"))) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".cls"):
                i = int(member.name.split(".")[0])
                assert tar.extractfile(member).read() == str(i % 2).encode()  # type: ignore[union-attr]
    assert "4 pictures" in jpegs_line(config)
    assert "12 JPEGs" in jpegs_line(config)
    for images in (3, 0, 14):  # not a multiple of the classes, none, more than the samples
        with pytest.raises(ValueError, match="images must be a multiple of classes"):
            dataclasses.replace(config, images=images)
