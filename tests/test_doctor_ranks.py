"""``fastload doctor --local-world-size N``: a real loader process per rank of the node, run
at once, each measured against the one-process model's prediction for its share of the
cores. What is asserted is that every rank ran and the report carries both figures, never
how fast anything ran."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from proc_tree import alive, descendants

import fastload as fl
from fastload.decode import TrainPreset

FASTLOAD = str(Path(sys.executable).parent / "fastload")
SAMPLES = 96
BATCH = 8


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated ImageFolder of SAMPLES noisy JPEGs (noise: decoding costs what photos do)."""
    root = tmp_path_factory.mktemp("ranks") / "folder"
    rng = np.random.default_rng(1)
    for i in range(SAMPLES):
        pixels = rng.integers(0, 256, (int(rng.integers(150, 200)), 200, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=85)
        path = root / f"class_{i % 3}" / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root


def test_each_rank_of_the_node_runs_its_own_loader_and_is_measured(
    jpegs: Path, tmp_path: Path
) -> None:
    report = fl.doctor(
        str(jpegs),
        cache_dir=str(tmp_path / "cache"),
        step_ms=5,
        num_workers=1,
        local_world_size=2,
        batch_size=BATCH,
        transform=TrainPreset(64),
        phase_s=1.0,
        progress=False,
    )
    ranks = report.ranks
    assert ranks is not None
    assert ranks.skipped is None, ranks.skipped
    assert ranks.ranks == [0, 1]
    assert ranks.local_world_size == 2
    assert ranks.cores_per_rank == pytest.approx(report.node["cores"] / 2, rel=1e-3)
    assert len(ranks.measured_samples_per_s) == 2
    assert all(rate > 0 for rate in ranks.measured_samples_per_s)
    assert ranks.predicted_samples_per_s > 0
    # Each rank's phase ran in its own process, over its own half of epoch 0.
    assert [p.name for p in ranks.phases] == ["rank 0", "rank 1"]
    assert all(p.batches > 0 and p.step_s is not None for p in ranks.phases)
    mean = sum(ranks.measured_samples_per_s) / 2
    assert ranks.error == pytest.approx(mean / ranks.predicted_samples_per_s - 1, abs=1e-3)
    carried = json.loads(report.to_json())["ranks"]
    assert carried["predicted_samples_per_s"] == ranks.predicted_samples_per_s
    assert carried["measured_samples_per_s"] == ranks.measured_samples_per_s
    assert any("2 ranks measured at once" in note for note in report.notes)
    # The user's cache is left as it was: the ranks read a temporary one, removed.
    assert not list(tmp_path.glob("fastload-doctor-*"))


def test_ranks_from_the_environment_are_predicted_not_started(
    jpegs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank of a running job reads LOCAL_WORLD_SIZE: starting N more processes from
    each would measure N x N; only an explicit local_world_size starts them."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    report = fl.doctor(
        str(jpegs),
        cache_dir=str(tmp_path / "cache"),
        step_ms=5,
        num_workers=1,
        batch_size=BATCH,
        transform=TrainPreset(64),
        phase_s=0.5,
        progress=False,
    )
    assert report.node["local_world_size"] == 2
    assert report.ranks is None


@pytest.mark.slow
def test_the_rank_processes_die_with_the_doctor(jpegs: Path, tmp_path: Path) -> None:
    """A doctor killed with SIGKILL runs no cleanup: its rank processes end anyway."""
    args = [
        FASTLOAD, "doctor", str(jpegs), "--cache-dir", str(tmp_path / "cache"),
        "--local-world-size", "2", "--workers", "1", "--step-ms", "5", "--size", "64",
        "--batch-size", str(BATCH), "--phase-s", "1", "--no-chart", "--json",
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    doctor = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ranks = _rank_processes(doctor.pid, wait_s=600)
        assert len(ranks) == 2
    finally:
        doctor.kill()
        doctor.wait()
    deadline = time.monotonic() + 10
    while alive(ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(ranks)


def _rank_processes(pid: int, *, wait_s: float) -> set[int]:
    """The rank processes under ``pid``, once both run (the doctor's phases come first)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        found = set()
        for child in descendants(pid):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"fastload.diagnosis.rank_process" in cmd:
                found.add(child)
        if len(found) == 2:
            return found
        time.sleep(0.2)
    raise AssertionError("the doctor did not start its rank processes")
