"""``fl.DataLoader(autotune=...)``: the tuner's decisions on rates it is fed (climbs only,
never retries an undone move, stays in its bounds), and a real loader retuned while its
pass runs: the batches bitwise those of an untuned loader, the threads really changed,
the settings carried by the state dict. How fast anything ran is not asserted (the
figures are in benchmarks/benchmark_autotune.py)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fastload as fl
from fastload.decode import TrainPreset
from fastload.loader.autotune import Autotuner, Bounds, Knobs

IMAGES = 96
BATCH = 4
# Every window one batch, no time floor, any rate kept: a move every few batches.
RESTLESS = {
    "window_batches": 1,
    "window_s": 0.0,
    "gain": 1.0,
    "keeps_pace": 0.0,
    "max_workers": 3,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("autotune") / "folder"
    rng = np.random.default_rng(0)
    for i in range(IMAGES):
        pixels = rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=90)
        path = root / f"class_{i % 3}" / f"{i:03d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
    return root


def _loader(folder: Path, cache: Path, **kwargs: object) -> fl.DataLoader:
    return fl.DataLoader(
        str(folder),
        batch_size=BATCH,
        shuffle=True,
        seed=3,
        decode="cpu",
        transform=TrainPreset(32),
        cache_dir=str(cache),
        **kwargs,  # type: ignore[arg-type]
    )


def _epoch(loader: fl.DataLoader, pause_s: float = 0.0) -> tuple[list[torch.Tensor], set[str]]:
    """The pass's batches (copies), and the loader's worker threads seen while it ran."""
    batches, seen = [], set()
    for images, labels in loader:
        batches += [images.clone(), labels.clone()]
        seen |= {t.name for t in threading.enumerate() if t.name.startswith("fastload-worker")}
        time.sleep(pause_s)
    return batches, seen


def test_batches_are_bitwise_those_of_an_untuned_loader_while_threads_change(
    folder: Path, tmp_path: Path
) -> None:
    with _loader(folder, tmp_path / "a", num_workers=1) as plain:
        expected = [_epoch(plain)[0] for _ in range(2)]
    with _loader(
        folder, tmp_path / "b", num_workers=1, prefetch_batches=1, autotune=RESTLESS
    ) as tuned:
        got, seen = [], []
        for _ in range(2):
            batches, threads = _epoch(tuned, pause_s=0.002)
            got.append(batches)
            seen.append(threads)
        report = tuned.stats()["autotune"]
    assert report["changes"], "the tuner made no move: the test would prove nothing"
    # The first pass, started with one thread, was retuned while it ran.
    assert "fastload-worker-1" in seen[0]
    for epoch_expected, epoch_got in zip(expected, got, strict=True):
        assert len(epoch_expected) == len(epoch_got)
        for a, b in zip(epoch_expected, epoch_got, strict=True):
            assert torch.equal(a, b)


def test_the_state_dict_carries_the_tuned_settings(folder: Path, tmp_path: Path) -> None:
    with _loader(folder, tmp_path / "c", num_workers=1, prefetch_batches=1, autotune=RESTLESS) as a:
        for i, _ in enumerate(a):
            if i == 15:
                break
        state = a.state_dict()
        tuned = a.stats()["autotune"]
    assert state["autotune"]["changes"]
    kept = state["autotune"]
    resume = {"max_workers": RESTLESS["max_workers"]}  # the same bounds as the saved job's
    with _loader(folder, tmp_path / "c", num_workers=1, prefetch_batches=1, autotune=resume) as b:
        b.load_state_dict(state)
        resumed = b.stats()
        assert resumed["num_workers"] == kept["num_workers"]
        assert resumed["autotune"]["prefetch_batches"] == kept["prefetch_batches"]
        assert resumed["autotune"]["changes"] == kept["changes"]
        assert b.prefetch_batches == kept["prefetch_batches"]
    assert tuned["num_workers"] >= kept["num_workers"]  # a move under trial is not kept


def test_autotune_needs_a_fastload_dataset_and_known_bounds(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fastload dataset"):
        fl.DataLoader(list(range(8)), batch_size=2, autotune=True)
    with pytest.raises(ValueError, match="max_threads"):
        _loader(folder, tmp_path / "d", autotune={"max_threads": 2})


# --- the tuner on rates it is fed ------------------------------------------------------------


def _drive(
    tuner: Autotuner, rate: object, windows: int, noise: float = 0.0, seed: int = 0
) -> list[Knobs]:
    """Feeds ``windows`` windows of batches at ``rate(knobs)`` batches/s (times the noise),
    with the step waiting a tenth of each period; returns the knobs after each window."""
    rng = np.random.default_rng(seed)
    tuner.new_pass()
    now, seen = 0.0, []
    for _ in range(windows * (tuner.bounds.window_batches + 40)):
        period = 1 / (rate(tuner.knobs) * (1 + noise * rng.uniform(-1, 1)))  # type: ignore[operator]
        asked = now + 0.9 * period
        now += period
        tuner.observe(asked, now)
        if not seen or seen[-1] != tuner.knobs:
            seen.append(tuner.knobs)
        if tuner.converged:
            break
    return seen


def _tuner(**bounds: object) -> Autotuner:
    settings = {"max_workers": 8, "window_batches": 4, "window_s": 0.0, **bounds}
    return Autotuner(
        Bounds(**settings),  # type: ignore[arg-type]
        Knobs(num_workers=1, prefetch_batches=1, lookahead_bytes=1 << 20),
        batch_bytes=1 << 16,
        batch_size=16,
    )


def test_the_tuner_climbs_to_the_knee_and_stops_without_oscillating() -> None:
    def rate(k: Knobs) -> float:  # more threads pay up to 3, nothing else does
        return 10.0 * min(k.num_workers, 3)

    tuner = _tuner()
    seen = _drive(tuner, rate, windows=200, noise=0.03)
    assert tuner.converged
    assert tuner.knobs.num_workers == 3
    tried = [(c["setting"], c["to"]) for c in tuner.changes]
    assert len(tried) == len(set(tried)), f"a move was tried twice: {tried}"
    undone = [c["setting"] for c in tuner.changes if not c["kept"]]
    assert sorted(undone) == sorted(set(undone))  # each knob stops once
    # Never back to a setting it left for good: the workers only climb, then one undo.
    workers = [k.num_workers for k in seen]
    assert max(workers) <= 4
    assert workers.count(4) == 1


def test_a_step_that_more_threads_slow_keeps_one_thread() -> None:
    def rate(k: Knobs) -> float:  # a step holding the GIL: each thread more costs it
        return 10.0 / (1 + 0.2 * (k.num_workers - 1))

    tuner = _tuner()
    _drive(tuner, rate, windows=100, noise=0.03)
    assert tuner.converged
    assert tuner.knobs.num_workers == 1
    assert tuner.spent >= {"num_workers"}


def test_the_bounds_hold() -> None:
    def rate(k: Knobs) -> float:  # everything pays, without end
        return float(k.num_workers * k.prefetch_batches * k.lookahead_bytes)

    tuner = _tuner(max_workers=2, max_memory_bytes=(8 + 2) * (1 << 16) + (1 << 20))
    _drive(tuner, rate, windows=100)
    assert tuner.converged
    assert tuner.knobs.num_workers == 2
    k = tuner.knobs
    in_flight = (k.prefetch_batches + k.num_workers) * (1 << 16) + k.lookahead_bytes
    assert in_flight <= tuner.bounds.max_memory_bytes  # type: ignore[operator]


def test_a_loader_that_keeps_pace_is_left_alone() -> None:
    tuner = _tuner()
    tuner.new_pass()
    now = 0.0
    for _ in range(50):
        now += 0.1
        tuner.observe(now - 1e-5, now)  # the step never waits
    assert tuner.converged
    assert tuner.changes == []


def test_a_thread_more_brings_the_prefetch_depth_it_needs() -> None:
    """At prefetch 1 only one batch may be loading: a second thread would wait idle, and
    the tuner, judging it on an unchanged rate, would undo the very move that pays."""

    def rate(k: Knobs) -> float:  # threads pay up to 3, as far as each has a batch to load
        return 10.0 * min(k.num_workers, k.prefetch_batches, 3)

    tuner = _tuner()
    _drive(tuner, rate, windows=200, noise=0.03)
    assert tuner.converged
    assert tuner.knobs.num_workers == 3
    assert tuner.knobs.prefetch_batches >= 3


def test_a_faster_window_whose_wait_did_not_shrink_keeps_no_move() -> None:
    """The step itself ran faster while a move was measured (a quieter machine): the rate
    rose, the wait for batches did not, so the move is not credited with it."""
    tuner = _tuner(gain=1.05)
    tuner.new_pass()
    now = 0.0

    def window(step_s: float, wait_s: float) -> None:
        nonlocal now
        for _ in range(tuner.bounds.window_batches + 8):
            asked = now + step_s
            now = asked + wait_s
            tuner.observe(asked, now)

    window(0.010, 0.002)  # the kept settings
    assert tuner.trial is not None
    assert tuner.trial[0] == "num_workers"
    while tuner.trial is not None:
        window(0.007, 0.002)  # 25% faster: the step alone
    assert tuner.changes[0]["setting"] == "num_workers"
    assert tuner.changes[0]["kept"] is False
    assert tuner.changes[0]["samples_per_s_after"] > 1.05 * tuner.changes[0]["samples_per_s_before"]
    assert tuner.knobs.num_workers == 1


def test_the_memory_bound_counts_decoded_batches() -> None:
    """The bytes in flight are the delivered batches' (decoded), not only their encoded
    bytes: a bound that the encoded bytes alone would meet stops the climb."""
    encoded, decoded = 1 << 16, 4 * 3 * 64 * 64 * 4 + 4 * 4
    # The start (a thread, a batch prefetched) and one encoded batch more: counted encoded
    # only, the bound would take 8 batches in flight.
    tuner = _tuner(max_memory_bytes=(1 << 20) + 2 * (encoded + decoded) + encoded)
    tuner.learn_batch((torch.zeros(4, 3, 64, 64), torch.zeros(4)))
    assert tuner.decoded_bytes == decoded

    def rate(k: Knobs) -> float:  # everything pays
        return float(k.num_workers * k.prefetch_batches)

    _drive(tuner, rate, windows=100)
    assert tuner.in_flight_bytes(tuner.knobs) <= tuner.bounds.max_memory_bytes  # type: ignore[operator]
    assert tuner.knobs == Knobs(num_workers=1, prefetch_batches=1, lookahead_bytes=1 << 20)


def test_the_lookahead_is_tried_first_while_fetching_and_never_on_a_warm_cache() -> None:
    """A step waiting on the remote waits for staging: the look-ahead is the move that pays
    (threads do not), and is tried first; once nothing is fetched it is not tried at all."""

    def rate(k: Knobs) -> float:  # fetch-bound: the look-ahead pays up to 8 MiB
        return 10.0 * min(k.lookahead_bytes, 8 << 20) / (1 << 20)

    fetched = 0

    def counter() -> int:
        nonlocal fetched
        fetched += 1 << 20  # every look: another MiB came from the remote
        return fetched

    cold = _tuner()
    cold.fetched = counter
    _drive(cold, rate, windows=200, noise=0.03)
    assert cold.changes[0]["setting"] == "lookahead_bytes"
    assert cold.knobs.lookahead_bytes == 8 << 20

    warm = _tuner()
    warm.fetched = lambda: 0  # a warm cache: nothing fetched
    _drive(warm, rate, windows=200, noise=0.03)
    assert warm.converged
    assert all(c["setting"] != "lookahead_bytes" for c in warm.changes)


def test_a_move_is_judged_on_more_than_one_window() -> None:
    """A move's first window ran slow (the machine's noise), its second fast: judged on
    both, the move that pays on the whole is kept, not undone on one window's luck."""
    tuner = _tuner(gain=1.05)
    tuner.new_pass()
    now = 0.0
    while not tuner.changes:
        if tuner.trial is None:
            step_s, wait_s = 0.010, 0.010  # the kept settings: 20 ms a batch
        elif not tuner.trial_measured:
            step_s, wait_s = 0.010, 0.014  # the move's first window: slower (24 ms)
        else:
            step_s, wait_s = 0.010, 0.002  # its second: much faster (12 ms)
        asked = now + step_s
        now = asked + wait_s
        tuner.observe(asked, now)
    assert tuner.changes[0]["setting"] == "num_workers"
    assert tuner.changes[0]["kept"] is True
    assert tuner.changes[0]["to"] == 2
