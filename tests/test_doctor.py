"""``fl.doctor`` / ``fastload doctor`` on real stages slowed for real: a loopback S3 server
with latency in its own process, a real decode load on the machine's cores, sleeping and
GIL-holding steps. Verdicts and the fixes' structure are asserted; how fast anything ran
is not (figures live in benchmarks/benchmark_doctor.py)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import fastload as fl
from fastload.cache import Cache
from fastload.decode import TrainPreset
from fastload.diagnosis.prices import GPU_PRICES, UnknownGPUError, price_for
from fastload.diagnosis.report import BOTTLENECKS
from fastload.testing import RemoteBehavior, S3FolderProcess

FASTLOAD = str(Path(sys.executable).parent / "fastload")
SAMPLES = 192
BATCH = 32
QUICK = {"phase_s": 1.2, "batch_size": BATCH, "progress": False}


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder of SAMPLES noisy JPEGs (noise: decoding costs what photos cost)."""
    root = tmp_path_factory.mktemp("doctor") / "folder"
    rng = np.random.default_rng(0)
    for i in range(SAMPLES):
        pixels = rng.integers(0, 256, (int(rng.integers(200, 260)), 280, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=85)
        path = root / f"class_{i % 4}" / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root


@pytest.fixture
def warm_cache(jpegs: Path, tmp_path: Path) -> str:
    """A cache that holds the whole folder already: the doctor skips the cold phase."""
    cache_dir = str(tmp_path / "cache")
    assert fl.warm(str(jpegs), cache_dir=cache_dir, progress=False).ok
    return cache_dir


def small_preset() -> TrainPreset:
    return TrainPreset(96)


def test_a_slow_remote_with_a_cold_cache_waits_on_fetching_and_the_fix_is_warming(
    jpegs: Path, tmp_path: Path
) -> None:
    cache_dir = tmp_path / "cache"
    shutil.copytree(jpegs, tmp_path / "remote" / "data" / "ds")
    with S3FolderProcess(tmp_path / "remote", behavior=RemoteBehavior(latency_s=1.0)) as server:
        report = fl.doctor(
            "s3://data/ds",
            storage_options=server.storage_options,
            cache_dir=str(cache_dir),
            step_ms=5,
            num_workers=2,
            transform=small_preset(),
            gpu="T4",
            max_bytes=9_000_000,  # the metadata (~8.5 MB) and a small share of the 9.6 MB data
            **QUICK,
        )
        secrets = [str(v) for k, v in _flat(server.storage_options) if "secret" in k or "key" in k]
    assert report.bottleneck == "fetch"
    assert report.verdict.basis == "cold"
    top = report.fixes[0]
    assert top.name == "warm"
    assert top.applicable
    assert top.command is not None
    assert top.command.startswith("fastload warm s3://data/ds")
    assert "--rank 0 --world-size 1 --epochs 0" in top.command
    assert top.predicted_samples_per_s == pytest.approx(report.phases["train"].samples_per_s)
    budget = next(f for f in report.fixes if f.name == "max_bytes")
    assert budget.change == {"max_bytes": report.dataset["bytes"]}  # one node: all of it
    assert budget.applicable  # --apply measures an epoch after the first with it
    assert "cache budget (9.0 MB)" in budget.why
    assert report.phases["budget"].hit_rate is not None
    # The cold phase reads the bytes of the samples it measures, no more.
    measured = sorted(jpegs.rglob("*.jpg"))[: report.dataset["measured_samples"]]
    assert report.dataset["measured_samples"] == SAMPLES  # 6 batches: all of them
    assert 0 < report.phases["cold"].bytes_fetched <= sum(p.stat().st_size for p in measured)
    # The user's cache is left as it was (the phases ran on temporary ones, now gone).
    with Cache(str(cache_dir)) as cache:
        assert cache.entries() == []
    assert not list(tmp_path.glob("fastload-doctor-*"))
    text = report.to_json()
    assert json.loads(text)["bottleneck"] == "fetch"
    for secret in secrets:
        assert secret not in text


def _flat(options: dict[str, object], prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for key, value in options.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}".lower(), value))
    return out


def test_a_warm_cache_and_a_1ms_step_waits_on_decoding_with_a_cores_recommendation(
    jpegs: Path, warm_cache: str
) -> None:
    report = fl.doctor(
        str(jpegs), cache_dir=warm_cache, step_ms=1, num_workers=2, gpu="A100", **QUICK
    )
    assert report.phases["cold"].skipped is not None  # the cache held the samples
    assert report.dataset["cached_fraction"] == 1.0
    assert report.verdict.basis == "train"
    assert report.bottleneck == "decode"
    names = [f.name for f in report.fixes]
    cores = report.node["cores"]
    if cores <= 2:  # the threads have every core already: more cores is what is left
        fix = report.fixes[names.index("cores")]
        assert not fix.applicable
        assert fix.change["cores"] > cores
        assert "samples/s per core" in fix.why
    else:
        assert "num_workers" in names or "cores" in names
    assert any("decode='dali'" in note for note in report.notes)  # no GPU here to measure
    assert report.verdict.utilization < 0.95
    assert report.verdict.lost_usd_per_epoch is not None
    assert report.verdict.lost_usd_per_epoch > 0


def test_a_500ms_step_is_the_bottleneck_and_nothing_is_lost(jpegs: Path, warm_cache: str) -> None:
    report = fl.doctor(
        str(jpegs),
        cache_dir=warm_cache,
        step_ms=500,
        num_workers=2,
        gpu="H100",
        apply=True,
        **QUICK,
    )
    assert report.bottleneck == "none"
    assert report.fixes == []
    assert report.applied is None
    assert "--apply: no fix to apply here" in report.notes
    assert report.verdict.utilization >= 0.95
    v = report.verdict
    assert v.epoch_usd is not None
    assert v.lost_usd_per_epoch is not None
    assert v.lost_usd_per_epoch <= 0.05 * v.epoch_usd
    assert report.price["usd_per_gpu_hour"] == pytest.approx(GPU_PRICES["H100"][0], rel=1e-3)
    data = json.loads(report.to_json())
    assert data["schema"] == 1
    assert data["bottleneck"] in BOTTLENECKS
    assert set(data["phases"]) == {"cold", "prep", "ceiling", "train", "h2d"}
    assert data["phases"]["h2d"]["skipped"]  # no GPU


def test_too_few_threads_get_the_thread_fix_and_apply_measures_it(
    jpegs: Path, warm_cache: str
) -> None:
    report = fl.doctor(
        str(jpegs),
        cache_dir=warm_cache,
        step_ms=5,
        num_workers=1,
        transform=small_preset(),
        apply=True,
        **QUICK,
    )
    assert report.bottleneck == "decode"
    assert report.verdict.epoch_usd is None  # no GPU, no price: no money figures
    assert report.price["usd_per_gpu_hour"] is None
    fixes = [f for f in report.fixes if f.applicable]
    if report.node["others_cores"] <= 0.5:
        fix = fixes[0]
        assert fix.name == "num_workers"
        assert fix.change == {"num_workers": max(2, int(report.node["cores"]))}
        assert fix.gain >= 1.3  # one thread on two cores or more: the model doubles it at least
    # else other jobs took the core a thread would use: the thread fix is smaller or absent
    # (its size is then a measurement of their load), but --apply still keeps its contract.
    applied = report.applied
    if not fixes:
        assert applied is None
        return
    assert applied is not None
    assert applied.fix == fixes[0].name
    assert applied.predicted_samples_per_s == fixes[0].predicted_samples_per_s
    assert applied.phase is not None
    assert applied.phase.batches >= 1
    assert applied.measured_samples_per_s == applied.phase.samples_per_s
    assert applied.error == pytest.approx(
        applied.measured_samples_per_s / applied.predicted_samples_per_s - 1, abs=1e-3
    )
    kept = json.loads(report.to_json())["applied"]
    assert kept["predicted_samples_per_s"]
    assert kept["measured_samples_per_s"]


def test_a_step_holding_the_gil_leaves_the_loader_the_cores_it_does_not_take(
    jpegs: Path, warm_cache: str
) -> None:
    report = fl.doctor(
        str(jpegs),
        cache_dir=warm_cache,
        step_ms=10,
        step_holds_gil=True,
        num_workers=1,
        transform=small_preset(),
        **QUICK,
    )
    assert report.step["kind"] == "gil"
    assert report.step["holds_gil"]
    assert report.step["cores"] > 0  # measured; how much of a core depends on the load
    cores = report.node["cores"]
    # What the step keeps busy is not the loader's (how much of a core it got under the
    # machine's load is a measurement; the GIL term's effect is test_doctor_held_out's).
    assert report.node["loader_cores_beside_step"] == pytest.approx(
        max(0.0, cores - report.step["cores"]), abs=2e-3
    )
    threads = [f for f in report.fixes if f.name == "num_workers"]
    if threads:
        assert "holding the GIL" in threads[0].why
    assert report.bottleneck in ("decode", "gil", "read")


def test_doctor_diagnoses_a_loader_the_job_is_running(jpegs: Path, warm_cache: str) -> None:
    ds = fl.open_dataset(str(jpegs), cache_dir=warm_cache)
    loader = fl.DataLoader(
        ds, batch_size=BATCH, num_workers=2, decode="cpu", transform=small_preset()
    )
    for i, _ in enumerate(loader):
        time.sleep(0.015)  # the job's step
        if i == 3:
            break
    stats = loader.stats()
    assert stats["step_s_mean"] is not None
    assert stats["step_s_mean"] >= 0.015
    assert stats["wait_s_mean"] is not None
    assert stats["cpu_cores"] > 0
    report = fl.doctor(loader, phase_s=1.0, progress=False)
    assert report.step["kind"] == "sleep"
    assert report.step["ms"] == pytest.approx(stats["step_s_mean"] * 1000, rel=0.01)
    assert any("as it ran in this loader" in note for note in report.notes)
    assert report.loader["num_workers"] == 2
    assert report.loader["batch_size"] == BATCH
    assert report.loader["transform"] == "train(96)"
    calls = []
    report = fl.doctor(loader, step=calls.append, phase_s=0.5, progress=False)
    assert report.step["kind"] == "callable"
    assert calls
    assert isinstance(calls[0], list | tuple)
    loader.close()


def test_prices_per_gpu_hour() -> None:
    assert price_for("A100").usd_per_gpu_hour == pytest.approx(2.05, abs=0.01)
    assert price_for("nvidia-h100-80gb").usd_per_gpu_hour == pytest.approx(10.42, abs=0.01)
    assert price_for("T4", spot=True).usd_per_gpu_hour == pytest.approx(0.35 * 0.35)
    assert price_for("Z9000", 4.0).usd_per_gpu_hour == 4.0
    assert price_for(None).usd_per_gpu_hour is None
    with pytest.raises(UnknownGPUError, match="--price"):
        price_for("Z9000")


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=600, check=False, cwd=cwd
    )


def test_the_command_writes_json_and_a_chart(jpegs: Path, warm_cache: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = run(
        "doctor", str(jpegs), "--cache-dir", warm_cache, "--step-ms", "5", "--size", "96",
        "--batch-size", str(BATCH), "--phase-s", "1", "--gpu", "A10", "--json", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["bottleneck"] in BOTTLENECKS
    assert json.loads((out / "doctor.json").read_text())["bottleneck"] == printed["bottleneck"]
    assert (out / "doctor.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--gpu", "Z9000"], 2, "--price"),
        (["--step-ms", "-5"], 2, "0 or more"),
        (["--model", "alexnet9"], 2, "unknown model"),
        (["--spot-discount", "1.5", "--gpu", "T4", "--spot"], 2, "discount"),
    ],
)
def test_bad_settings_are_one_line_usage_errors(
    jpegs: Path, warm_cache: str, args: list[str], code: int, says: str
) -> None:
    done = run("doctor", str(jpegs), "--cache-dir", warm_cache, "--phase-s", "0.5", *args)
    assert done.returncode == code, done.stderr
    assert says in done.stderr
    assert done.stderr.count("\n") == 1
    assert "Traceback" not in done.stderr


def test_nothing_to_read_or_no_remote_is_a_one_line_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for url in (str(empty), "http://127.0.0.1:9/nothing/"):
        done = run("doctor", url, "--cache-dir", str(tmp_path / "c"), "--step-ms", "5")
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("fastload: ")
        assert done.stderr.count("\n") == 1
        assert "Traceback" not in done.stderr


def test_ranks_sharing_the_node_get_their_share_of_the_cores(jpegs: Path, warm_cache: str) -> None:
    report = fl.doctor(
        str(jpegs),
        cache_dir=warm_cache,
        step_ms=1,
        num_workers=2,
        local_world_size=2,
        world_size=2,
        measure_ranks=False,  # the prediction alone (test_doctor_ranks measures the ranks)
        transform=small_preset(),
        **QUICK,
    )
    cores = report.node["cores"]
    assert report.node["cores_per_rank"] == cores / 2
    assert report.node["world_size"] == 2
    assert any("each has" in note for note in report.notes)
    # The rank's figures are for its share: at most what one core's worth of the loader's
    # measured CPU per sample allows (the train phase, run alone, had every core).
    assert report.bottleneck == "decode"
    prep = report.phases["prep"]
    per_core = prep.samples_per_s / prep.cpu_cores
    assert report.verdict.samples_per_s <= per_core * report.node["cores_per_rank"] * 1.01
    assert report.verdict.samples_per_s <= report.phases["train"].samples_per_s
    assert report.dataset["measured_samples"] == SAMPLES // 2  # rank 0's half
