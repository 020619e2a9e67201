"""The doctor's verdict under noise (#35): a slow phase is not measured as its prefetch
queue draining, and a ratio within its measured noise of a line gives the stable verdict
with a low confidence instead of flipping."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from doctor_phases import B, phase

from fastload.diagnosis import measure, predict
from fastload.diagnosis.measure import PhaseProgress
from fastload.diagnosis.report import Phase
from fastload.diagnosis.steps import Step


class _BurstyLoader:
    """A slow remote behind a prefetch queue: every ``gap_s`` three batches are ready at
    once (fetched together), then none until the next gap."""

    def __init__(self, gap_s: float, batches: int = 30) -> None:
        self.gap_s, self.batches, self.closed = gap_s, batches, False

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.batches):
            if i % 3 == 0:
                time.sleep(self.gap_s)
            yield torch.zeros(B, 1)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        self.closed = True


def test_a_slow_phase_is_not_measured_as_its_queue_draining() -> None:
    """Three batches a gap, a 5 ms step: a phase that stopped at its hard stop with three
    batches measured the last two at the step's pace (the step-alone rate, 12,800
    samples/s); it runs on for more batches, and one that still has too few says so."""
    measure.batch_samples(torch.zeros(B, 1))  # its first call imports the loader
    step = Step("sleep", 0.005)
    loader = _BurstyLoader(gap_s=0.5)
    phase, _ = measure.run_loader(
        "budget", "bursty", loader, step=step, budget_s=0.15, progress=PhaseProgress(False)
    )
    assert loader.closed
    step_alone = B / 0.005
    # Not the step-alone rate, and four batches by its hard stop: marked as deciding no
    # verdict.
    assert phase.samples_per_s < 0.2 * step_alone
    assert phase.too_few is not None


def _phase(name: str, rate: float, se: float | None, *, step_ms: float | None = None) -> Phase:
    return phase(name, rate, step_ms=step_ms, rate_se=se)


def _cold(cold_rate: float, se: float) -> predict.Measured:
    """One decode thread (500 samples/s alone, the warm train phase the same), a 20 ms
    sleeping step, a cold first epoch at ``cold_rate``; each rate with ``se``."""
    return predict.Measured(
        batch_size=B,
        workers=1,
        prefetch=2,
        cores=2.0,
        cores_per_rank=2.0,
        prep=_phase("prep", 500.0, se),
        ceiling=_phase("ceiling", B / 0.02, 0.01, step_ms=20.0),
        train=_phase("train", 500.0, se, step_ms=20.0),
        cold=_phase("cold", cold_rate, se, step_ms=20.0),
        cached_fraction=0.0,
        dataset_samples=6400,
        share_bytes=64 << 20,
        lookahead_bytes=256 << 20,
        bytes_per_sample=100_000,
    )


def _judge(m: predict.Measured) -> tuple[str, Any]:
    model = predict.Model(m)
    basis = predict.basis_phase(m)
    neck = predict.bottleneck(m, model, basis)
    return neck, predict.verdict(m, model, basis, neck, usd_per_gpu_hour=None, epochs_per_day=None)


def test_near_the_fetch_line_with_a_wide_spread_the_verdict_is_the_stable_part() -> None:
    """Cold rates on both sides of the line (400: 0.8 of the warm 500), each rate's windows
    spread 15% (the ratio's log ±21%): every one names what binds once warm (decode), and
    the summary says fetching may bind now."""
    for cold_rate in (300.0, 340.0, 370.0, 400.0, 430.0, 460.0):
        neck, verdict = _judge(_cold(cold_rate, 0.15))
        assert neck == "decode", cold_rate
        assert verdict.once_warm == "decode"
        assert "fetching may bind now" in verdict.summary
        # On the line, two errors from where the verdict would change: sure of it.
        if cold_rate == 400.0:
            assert verdict.confidence > 0.95


def test_near_where_the_verdict_changes_the_confidence_is_low() -> None:
    """Two standard errors below the line (400 * exp(-2 * 0.212) = 262) repeated runs
    name fetch or decode about as often: either verdict says so."""
    for cold_rate in (250.0, 270.0):
        neck, verdict = _judge(_cold(cold_rate, 0.15))
        assert neck == ("fetch" if cold_rate < 262 else "decode")
        assert verdict.confidence < 0.65, (cold_rate, verdict.confidence)


def test_far_from_the_fetch_line_or_with_a_narrow_spread_it_decides() -> None:
    # Far below the line: fetch now, decode once warm, and sure of it.
    neck, verdict = _judge(_cold(150.0, 0.15))
    assert neck == "fetch"
    assert "fetch now, decode once warm" in verdict.summary
    assert verdict.confidence > 0.99
    # Far above it: decode, sure of it.
    neck, verdict = _judge(_cold(490.0 * 2, 0.05))
    assert (neck, verdict.confidence > 0.99) == ("decode", True)
    # The same 340 as above, 15% below the line, measured with a 2% spread: fetch.
    neck, verdict = _judge(_cold(340.0, 0.02))
    assert neck == "fetch"
    assert verdict.confidence > 0.99


def test_a_phase_with_too_few_batches_decides_no_verdict() -> None:
    m = _cold(150.0, 0.05)
    assert m.cold is not None
    m.cold.too_few = "2 measured batches (fewer than 4) by the hard stop"
    neck, verdict = _judge(m)
    assert verdict.basis == "train"
    assert neck == "decode"


def test_the_rate_spread_is_measured_from_the_phase_windows() -> None:
    even = measure.Timeline([0.1 * i for i in range(20)], [0.0] * 20, [B] * 20, [], [])
    gaps = [0.3, 0.02, 0.02, 0.02, 0.3, 0.3, 0.02, 0.02, 0.3, 0.02] * 2
    uneven = measure.Timeline(
        [sum(gaps[:i]) for i in range(20)],
        [0.0] * 20,
        [B] * 20,
        [],
        [],
    )
    assert even.rate_se() == 0.0
    assert (uneven.rate_se() or 0.0) > 0.0
