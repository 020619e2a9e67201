"""``fastload doctor --local-world-size N``: a real loader process per rank of the node, run
at once, each measured against the one-process model's prediction for its share of the
cores. What is asserted is that every rank ran and the report carries both figures, never
how fast anything ran."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from proc_tree import alive

import fastload as fl
from fastload.decode import TrainPreset

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


# A doctor that starts a rank process, lets its phase begin (a minute long: it would not end
# by itself), then dies by SIGKILL, running no cleanup. Prints the rank process's pid first.
DOCTOR_DIES = """
import os, signal, sys, time
import fastload as fl
from fastload.decode import TrainPreset
from fastload.diagnosis.node_ranks import RankJob, _Child

folder, cache = sys.argv[1], sys.argv[2]
dataset = fl.open_dataset(folder, cache_dir=cache)
settings = {"batch_size": 8, "num_workers": 1, "decode": "cpu", "transform": TrainPreset(64)}
job = RankJob(rank=0, world_size=2, local_rank=0, local_world_size=2, dataset=dataset,
              indices=list(range(len(dataset))) * 50, settings=settings, step=("sleep", 0.5),
              phase_s=60.0)
child = _Child.start(job)
assert child.expect("ready", time.monotonic() + 120)
child.send(b"go\\n")
print(child.process.pid, flush=True)
time.sleep(1.0)  # its phase under way
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_rank_process_dies_with_the_doctor(jpegs: Path, tmp_path: Path) -> None:
    """Killed mid-phase with SIGKILL, the doctor runs no cleanup and its pipes say nothing
    to a rank process busy measuring: the rank process ends anyway (it is tied to its
    parent's life, staging.lifetime), long before its minute-long phase would."""
    cache = str(tmp_path / "cache")
    assert fl.warm(str(jpegs), cache_dir=cache, progress=False).ok
    doctor = subprocess.run(
        [sys.executable, "-c", DOCTOR_DIES, str(jpegs), cache],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert doctor.returncode == -9, doctor.stderr
    rank = int(doctor.stdout.split()[0])
    try:
        deadline = time.monotonic() + 20  # a third of its phase: it did not end by itself
        while alive([rank]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive([rank]), "the rank process outlived the doctor"
    finally:
        if alive([rank]):
            os.kill(rank, signal.SIGKILL)
