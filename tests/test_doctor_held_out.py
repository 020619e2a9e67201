"""The doctor's model on measured phases given to it (its GIL terms, its verdict's stability
under noise, its cache advice), and ``--apply`` really running each fix on a real loader.
How close its predictions come is a benchmark's figure (benchmark_doctor_grid.py), not a
test's."""

from __future__ import annotations

import dataclasses
import io
import threading
from pathlib import Path

import numpy as np
import pytest
from doctor_phases import B
from doctor_phases import phase as _phase
from PIL import Image

import fastload as fl
from fastload.decode import TrainPreset
from fastload.diagnosis import cache_advice, predict
from fastload.diagnosis.diagnose import _Diagnosis
from fastload.diagnosis.measure import PhaseProgress
from fastload.diagnosis.prices import price_for
from fastload.diagnosis.report import Fix
from fastload.diagnosis.steps import Step


def _measured(
    *,
    step_cores: float,
    train_rate: float = 500.0,
    cold_rate: float | None = None,
    train_step_ms: float = 20.0,
) -> predict.Measured:
    """One loader thread on two cores: it decodes 500 samples/s alone on one core; a 20 ms
    step (sleeping: 0 cores; holding the GIL: 1)."""
    return predict.Measured(
        batch_size=B,
        workers=1,
        prefetch=2,
        cores=2.0,
        cores_per_rank=2.0,
        prep=_phase("prep", 500.0, cores=1.0),
        ceiling=_phase("ceiling", B / 0.02, cores=step_cores, step_ms=20.0),
        train=_phase("train", train_rate, cores=1.0 + step_cores, step_ms=train_step_ms),
        cold=None if cold_rate is None else _phase("cold", cold_rate, step_ms=20.0),
        cached_fraction=1.0 if cold_rate is None else 0.0,
        dataset_samples=6400,
        share_bytes=64 << 20,
        lookahead_bytes=256 << 20,
        bytes_per_sample=100_000,
    )


def _threads_fix(m: predict.Measured) -> float:
    model = predict.Model(m)
    fixes = predict.fixes(m, model, predict.basis_phase(m), usd_per_gpu_hour=None, warm_command="")
    return next(f for f in fixes if f.name == "num_workers").predicted_samples_per_s


def test_a_step_holding_the_gil_leaves_the_loader_only_the_cores_it_does_not_take() -> None:
    sleeping = _threads_fix(_measured(step_cores=0.0))
    holding = _threads_fix(_measured(step_cores=1.0))
    # Two threads decode 1,000 samples/s on two free cores, the step's 3,200 not binding.
    assert sleeping == pytest.approx(1000, rel=0.02)
    # Beside a step that keeps a core busy, the two threads share the one core left with
    # the step's 20 ms a batch: (64 * 2 ms + 20 ms) over 2 cores = 74 ms a batch.
    assert holding == pytest.approx(B / 0.074, rel=0.02)
    assert holding < 0.9 * sleeping


def test_the_verdict_does_not_flip_on_noise_near_the_fetch_line() -> None:
    """A cold first epoch that overlaps its fetches runs near the warm rate: 10% below it,
    each rate with 5% noise, named the same bottleneck in every run (a line at 0.9 of the
    warm rate named fetch in about half of them)."""
    rng = np.random.default_rng(1)
    named = set()
    for _ in range(200):
        noise = rng.uniform(-0.05, 0.05, 2)
        m = _measured(
            step_cores=0.0, train_rate=400 * (1 + noise[0]), cold_rate=360 * (1 + noise[1])
        )
        model = predict.Model(m)
        named.add(predict.bottleneck(m, model, predict.basis_phase(m)))
    assert named == {"decode"}


def test_a_fetch_bound_first_epoch_says_what_binds_once_warm_with_a_confidence() -> None:
    m = _measured(step_cores=0.0, cold_rate=150.0)
    model = predict.Model(m)
    basis = predict.basis_phase(m)
    neck = predict.bottleneck(m, model, basis)
    verdict = predict.verdict(m, model, basis, neck, usd_per_gpu_hour=None, epochs_per_day=None)
    assert neck == "fetch"
    assert verdict.once_warm == "decode"
    assert "fetch now, decode once warm" in verdict.summary
    assert verdict.confidence > 0.99  # 150 against the line at 320: far from it
    near = _measured(step_cores=0.0, cold_rate=0.8 * 500 * 0.98)
    model = predict.Model(near)
    basis = predict.basis_phase(near)
    neck = predict.bottleneck(near, model, basis)
    close = predict.verdict(near, model, basis, neck, usd_per_gpu_hour=None, epochs_per_day=None)
    # 2% below the line, within noise: the stable part (decode, once warm), named on
    # either side of the line, so named again in most runs.
    assert neck == "decode"
    assert close.confidence > 0.9


def test_cache_advice_follows_the_disk_and_the_order() -> None:
    gb = 10**9
    roomy = cache_advice.advise(
        share_bytes=100 * gb,
        free=500 * gb,
        budget=50 * gb,
        policy="lru",
        order_known=False,
        usd_per_gb=0.09,
    )
    assert roomy.max_bytes == 100 * gb
    assert roomy.hit_rate == 1.0
    assert roomy.remote_bytes_per_epoch == 0
    tight = cache_advice.advise(
        share_bytes=100 * gb,
        free=50 * gb,
        budget=None,
        policy="lru",
        order_known=False,
        usd_per_gb=0.09,
    )
    assert tight.policy == "pin"
    assert tight.max_bytes == 45 * gb  # 90% of the free space
    assert tight.hit_rate == pytest.approx(0.45)
    assert tight.remote_bytes_per_epoch == 55 * gb
    assert tight.usd_per_epoch == pytest.approx(55 * 0.09)
    planned = cache_advice.advise(
        share_bytes=100 * gb, free=50 * gb, budget=None, policy="lru", order_known=True
    )
    assert planned.policy == "plan"
    assert planned.usd_per_epoch is None
    # lru under a shuffled order keeps less of each epoch than pin does.
    assert cache_advice.hit_rate("lru", 45 * gb, 100 * gb) < tight.hit_rate


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("held-out") / "folder"
    rng = np.random.default_rng(0)
    for i in range(128):
        pixels = rng.integers(0, 256, (200, 240, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=85)
        path = root / f"class_{i % 4}" / f"{i:04d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root


def test_apply_runs_every_fix_with_its_settings(jpegs: Path, tmp_path: Path) -> None:
    """The step counts the loader threads alive at each batch: a thread fix applied runs
    its phase with more of them than the job's one (applied directly: which fixes the
    model lists depends on the machine's load, whether a fix runs with its settings not)."""
    alive: list[int] = []

    def step(batch: object) -> None:
        alive.append(sum(t.name.startswith("fastload-worker") for t in threading.enumerate()))

    dataset = fl.open_dataset(str(jpegs), cache_dir=str(tmp_path / "cache"))
    settings = {"batch_size": 32, "num_workers": 1, "decode": "cpu", "transform": TrainPreset(96)}
    the_step = Step("callable", fn=step)
    try:
        with _Diagnosis(
            dataset, settings, the_step, (0, 1, 1), 0.5, PhaseProgress(False), []
        ) as diagnosis:
            diagnosis.run_phases(cold=False)
            report = diagnosis.report(price_for(None, None), None)
            assert max(alive) == 1  # the job's one thread
            alive.clear()
            fix = Fix("num_workers", {"num_workers": 3}, "", 1.0, 1.0, 1.0, None, 1.0)
            applied = diagnosis.apply(report, fix)
            assert max(alive) == 3
            assert applied.phase is not None
            assert applied.measured_samples_per_s == applied.phase.samples_per_s
            # Every listed fix that runs here is applied, the top one first.
            report.fixes = [
                fix,
                dataclasses.replace(fix, change={"prefetch_batches": 8}, name="prefetch_batches"),
            ]
            assert [a.fix for a in diagnosis.apply_all(report)] == [
                "num_workers",
                "prefetch_batches",
            ]
    finally:
        dataset.close()
    assert report.cache is not None
    assert report.cache["share_bytes"] == report.dataset["bytes"]
    assert 0.5 <= report.verdict.confidence <= 1.0
