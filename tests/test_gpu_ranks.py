"""The multi-rank GPU harness, run on the CPU: N rank processes as torchrun starts them, each
its own loader on its share, timed together; per-rank images/s and cores per device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fastload.bench.gpu import ranks
from fastload.bench.gpu.images import generate


@pytest.mark.slow
def test_one_and_two_ranks_run_as_torchrun_starts_them_and_report_per_rank(tmp_path: Path) -> None:
    data = tmp_path / "data"
    generate(data, 24, threads=2)
    config = ranks.RankConfig(
        data=str(data),
        cache_dir=str(tmp_path / "cache"),
        device="cpu",
        decode="cpu",
        batch_size=4,
        size=32,
        batches=3,
        threads=1,
    )
    for n in (1, 2):
        node = ranks.run_node(config, n, tmp_path)
        assert node["ranks"] == n
        assert sorted(r["rank"] for r in node["per_rank"]) == list(range(n))
        assert all(r["images"] == 12 and r["images_per_s"] > 0 for r in node["per_rank"])
        assert all(r["threads"] == 1 and r["decode_backend"] == "cpu" for r in node["per_rank"])
        assert node["gpus"] == 1  # the host stands for the device
        assert node["cores_per_gpu"] == pytest.approx(node["cores_used"])
        assert len(node["per_rank_images_per_s"]) == n


def test_a_failing_rank_is_named_with_its_error(tmp_path: Path) -> None:
    config = ranks.RankConfig(
        data=str(tmp_path / "missing"), cache_dir=str(tmp_path / "c"), device="cpu"
    )
    with pytest.raises(RuntimeError, match="rank 0 exited"):
        ranks.run_node(config, 1, tmp_path)


def test_n_is_a_rank_per_gpu_and_at_least_two() -> None:
    assert ranks.default_ranks("cpu") == 2
    assert ranks.default_ranks("cuda") >= 2


def test_the_command_needs_its_data(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fastload.bench.gpu.ranks"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "--data and --out are required" in done.stderr


def test_the_doctor_figures_are_read_from_its_json() -> None:
    from fastload.bench.gpu.doctor_check import summarize_doctor

    report = {
        "phases": {"h2d": {"step_s": 0.004}, "train": {"samples_per_s": 900.0}},
        "fixes": [{"name": "dali", "predicted_samples_per_s": 12000.0}],
        "applied": {"predicted_samples_per_s": 12000.0, "measured_samples_per_s": 11000.0},
    }
    assert summarize_doctor(report) == {
        "h2d ms": 4.0,
        "img/s": 900.0,
        "DALI probe img/s": 12000.0,
        "apply predicted": 12000.0,
        "apply measured": 11000.0,
    }


@pytest.mark.slow
def test_the_check_runs_fastload_doctor_as_a_user_does(tmp_path: Path) -> None:
    """The doctor section's command line, on the CPU (the check itself passes cuda)."""
    import json

    from fastload.bench.gpu.config import GpuCheckConfig
    from fastload.bench.gpu.doctor_check import doctor_command, summarize_doctor

    generate(tmp_path / "data", 32, threads=2)
    command = doctor_command(
        tmp_path / "data", tmp_path / "out", GpuCheckConfig.quick(threads=2), ["--step-ms", "20"]
    )
    command[command.index("--device") + 1] = "cpu"
    command[command.index("--batch-size") + 1] = "8"
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = summarize_doctor(json.loads(done.stdout))
    assert figures["img/s"] > 0


def test_the_fed_steps_profile_is_written(tmp_path: Path) -> None:
    """The overlap section's profile, on the CPU: every op of the steps, ranked."""
    import contextlib

    import torch

    from fastload.bench.gpu.overlap import profile_fed_steps

    @contextlib.contextmanager
    def batches():
        yield ((torch.ones(64, 64),) for _ in range(10))

    path = profile_fed_steps(batches, lambda x: (x @ x).sum(), 4, tmp_path, "cpu")
    text = path.read_text()
    assert path.name == "profile-cpu.txt"
    assert "4 fed steps" in text
    assert "aten::mm" in text
