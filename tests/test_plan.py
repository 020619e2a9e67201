"""The plan as a pure function, over a large grid of datasets, worlds, workers and resumes.

Each property is checked against a deliberately plain model of the specification (lists of
``(position, is_padding)`` entries) as well as through the guarantees users rely on.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import plan as plan_module
from fastload.errors import FastloadError
from fastload.plan import (
    Plan,
    PlanError,
    ResumeState,
    ResumeStateError,
    num_batches,
    worker_batches,
)

shard_sizes = st.lists(st.integers(1, 30), min_size=1, max_size=50)
with_empty_shards = st.lists(st.integers(0, 30), min_size=1, max_size=50).filter(any)
worlds = st.integers(1, 8)
windows = st.integers(1, 8)
seeds = st.integers(0, 2**32 - 1)
epochs = st.integers(0, 100)

# ------------------------------------------------------------------------------------------
# The model: the specification written as plainly as possible.
# ------------------------------------------------------------------------------------------

Entry = tuple[int, bool]  # (epoch-order position, is padding)


def model_layout(
    entries: list[Entry], world: int, drop_last: bool
) -> tuple[list[Entry], list[Entry]]:
    """(assigned, tail): pad by repeating the real entries from the start, or truncate."""
    if drop_last:
        keep = len(entries) // world * world
        return entries[:keep], entries[keep:]
    real = [e for e in entries if not e[1]]
    pad = -len(entries) % world
    return entries + [(real[i % len(real)][0], True) for i in range(pad)], []


def model_streams(
    order: np.ndarray, segments: list[tuple[int, int]], world: int, drop_last: bool
) -> list[list[int]]:
    """Every rank's samples at ``world`` after the resume ``segments``."""
    entries: list[Entry] = [(p, False) for p in range(len(order))]
    prev = None
    # A segment that consumed nothing changes nothing (not even the padding).
    for w, consumed in [*(s for s in segments if s[1] > 0), (world, -1)]:
        if not drop_last and prev is not None and prev != w:
            entries = [e for e in entries if not e[1]]
        assigned, tail = model_layout(entries, w, drop_last)
        n = len(assigned) // w
        if consumed < 0:
            return [[int(order[p]) for p, _ in assigned[r * n : (r + 1) * n]] for r in range(w)]
        entries = [e for r in range(w) for e in assigned[r * n + consumed : (r + 1) * n]] + tail
        prev = w
    raise AssertionError("unreachable")


def streams(
    plan: Plan, epoch: int, world: int, resume: ResumeState | None = None
) -> list[list[int]]:
    return [
        plan.rank_order(epoch, world_size=world, rank=r, resume=resume).tolist()
        for r in range(world)
    ]


# ------------------------------------------------------------------------------------------
# The drawing in the module docstring
# ------------------------------------------------------------------------------------------


def test_docstring_drawing_unshuffled() -> None:
    plan = Plan([3, 3, 3, 2], shuffle=False, window_shards=2)
    assert streams(plan, 0, 2) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 0]]
    assert plan.shard_of([6, 7, 8, 9, 10, 0]).tolist() == [2, 2, 2, 3, 3, 0]


def test_docstring_drawing_shuffled() -> None:
    plan = Plan([3, 3, 3, 2], seed=0, window_shards=2)
    assert plan.shard_permutation(0).tolist() == [2, 0, 1, 3]
    assert plan.epoch_order(0).tolist() == [7, 6, 0, 1, 8, 2, 5, 10, 3, 4, 9]
    assert streams(plan, 0, 2) == [[7, 6, 0, 1, 8, 2], [5, 10, 3, 4, 9, 7]]
    assert [sorted(set(plan.shard_of(s).tolist())) for s in streams(plan, 0, 2)] == [
        [0, 2],
        [1, 2, 3],
    ]
    dropped = Plan([3, 3, 3, 2], seed=0, window_shards=2, drop_last=True)
    assert streams(dropped, 0, 2) == [[7, 6, 0, 1, 8], [2, 5, 10, 3, 4]]


def test_docstring_drawing_resume() -> None:
    plan = Plan([3, 3, 3, 2], seed=0, window_shards=2)
    state = plan.resume_state(0, [(2, 2)])
    assert streams(plan, 0, 3, state) == [[0, 1, 8], [2, 3, 4], [9, 0, 1]]


# ------------------------------------------------------------------------------------------
# One epoch
# ------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=400)
@given(
    sizes=with_empty_shards,
    shuffle=st.booleans(),
    window=windows,
    seed=seeds,
    epoch=epochs,
)
def test_epoch_order_is_a_permutation_shuffled_only_within_windows(
    sizes: list[int], shuffle: bool, window: int, seed: int, epoch: int
) -> None:
    plan = Plan(sizes, seed=seed, shuffle=shuffle, window_shards=window)
    order = plan.epoch_order(epoch)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    assert np.array_equal(
        order, Plan(sizes, seed=seed, shuffle=shuffle, window_shards=window).epoch_order(epoch)
    )
    if not shuffle:
        assert order.tolist() == list(range(sum(sizes)))
        return
    perm = plan.shard_permutation(epoch)
    assert sorted(perm.tolist()) == list(range(len(sizes)))
    shards_of_order = plan.shard_of(order)
    at = 0
    for w in range(0, len(perm), window):
        members = perm[w : w + window]
        count = sum(sizes[s] for s in members)
        assert set(shards_of_order[at : at + count].tolist()) <= set(members.tolist())
        at += count
    assert at == len(order)


@settings(deadline=None, max_examples=600)
@given(
    sizes=shard_sizes,
    world=worlds,
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=windows,
    seed=seeds,
    epoch=epochs,
)
def test_ranks_take_contiguous_equal_slices_of_the_epoch(
    sizes: list[int],
    world: int,
    shuffle: bool,
    drop_last: bool,
    window: int,
    seed: int,
    epoch: int,
) -> None:
    plan = Plan(sizes, seed=seed, shuffle=shuffle, drop_last=drop_last, window_shards=window)
    total = sum(sizes)
    order = plan.epoch_order(epoch)
    got = streams(plan, epoch, world)
    assert got == model_streams(order, [], world, drop_last)
    lengths = {len(s) for s in got}
    assert lengths == {plan.rank_length(world_size=world)}
    flat = [i for s in got for i in s]
    if drop_last:
        # Exactly the truncation: the epoch order's first (total // world) * world samples.
        assert flat == order[: total // world * world].tolist()
    else:
        # Every sample once, then padding repeated from the start of the order.
        assert flat == order[np.arange(len(flat)) % total].tolist()
        assert len(flat) - total < world
        assert Counter(flat).keys() == set(range(total))


@settings(deadline=None, max_examples=200)
@given(sizes=shard_sizes, window=windows, seed=seeds, epoch=epochs, drop_last=st.booleans())
def test_global_order_does_not_depend_on_the_world_size(
    sizes: list[int], window: int, seed: int, epoch: int, drop_last: bool
) -> None:
    plan = Plan(sizes, seed=seed, window_shards=window, drop_last=drop_last)
    order = plan.epoch_order(epoch).tolist()
    for world in range(1, 9):
        flat = [i for s in streams(plan, epoch, world) for i in s]
        common = min(len(flat), len(order))
        assert flat[:common] == order[:common]


@settings(deadline=None, max_examples=400)
@given(
    sizes=shard_sizes,
    world=worlds,
    batch_size=st.integers(1, 16),
    window=windows,
    seed=seeds,
    data=st.data(),
)
def test_workers_read_round_robin_batches_and_the_rank_order_is_the_same_for_any_count(
    sizes: list[int], world: int, batch_size: int, window: int, seed: int, data: st.DataObject
) -> None:
    plan = Plan(sizes, seed=seed, window_shards=window)
    rank = data.draw(st.integers(0, world - 1))
    order = plan.rank_order(0, world_size=world, rank=rank)
    for num_workers in range(5):
        per_worker = [
            worker_batches(order, batch_size=batch_size, num_workers=num_workers, worker=k)
            for k in range(max(1, num_workers))
        ]
        # DataLoader's order: batch b comes from worker b % K, its (b // K)-th batch.
        batches = [
            per_worker[b % len(per_worker)][b // len(per_worker)]
            for b in range(num_batches(len(order), batch_size))
        ]
        assert sum(len(w) for w in per_worker) == num_batches(len(order), batch_size)
        assert np.array_equal(np.concatenate(batches) if batches else order, order)
        assert all(len(b) == batch_size for b in batches[:-1])


@settings(deadline=None, max_examples=400)
@given(
    num_shards=st.integers(1, 50),
    size=st.integers(1, 30),
    world=worlds,
    window=windows,
    seed=seeds,
    drop_last=st.booleans(),
)
def test_each_rank_reads_about_shards_over_world_of_the_shards(
    num_shards: int, size: int, world: int, window: int, seed: int, drop_last: bool
) -> None:
    plan = Plan([size] * num_shards, seed=seed, window_shards=window, drop_last=drop_last)
    touched = [set(plan.shard_of(s).tolist()) for s in streams(plan, 3, world)]
    for shards in touched:
        assert len(shards) <= num_shards / world + 2 * window + 1
    assert sum(len(s) for s in touched) <= num_shards + (2 * world + 1) * window


@settings(deadline=None, max_examples=100)
@given(sizes=shard_sizes, world=worlds, window=windows, seed=seeds)
def test_locality_with_uneven_shards(sizes: list[int], world: int, window: int, seed: int) -> None:
    plan = Plan(sizes, seed=seed, window_shards=window)
    per_rank = plan.rank_length(world_size=world)
    touched = [set(plan.shard_of(s).tolist()) for s in streams(plan, 0, world)]
    for shards in touched:
        # Whole windows inside a slice hold at most per_rank samples; 2 partial windows.
        assert len(shards) <= per_rank / min(sizes) + 2 * window + 1
    assert sum(len(s) for s in touched) <= len(sizes) + (2 * world + 1) * window


def test_a_global_sample_shuffle_would_touch_nearly_every_shard() -> None:
    # What the contiguous slices buy: 100 shards of 100, 8 ranks.
    plan = Plan([100] * 100, seed=1)
    touched = len(set(plan.shard_of(plan.rank_order(0, world_size=8, rank=3)).tolist()))
    strided = np.random.default_rng(1).permutation(10_000)[3::8]
    assert touched <= 100 / 8 + 2 * 8 + 1
    assert len(set(plan.shard_of(strided).tolist())) > 90


@settings(deadline=None, max_examples=100)
@given(sizes=with_empty_shards, window=windows, seed=seeds, data=st.data())
def test_a_windows_order_does_not_depend_on_which_windows_are_computed_with_it(
    sizes: list[int], window: int, seed: int, data: st.DataObject
) -> None:
    plan = Plan(sizes, seed=seed, window_shards=window)
    whole = plan.epoch_order(0)
    begin = data.draw(st.integers(0, len(whole) - 1))
    end = data.draw(st.integers(begin + 1, len(whole)))
    with pytest.MonkeyPatch.context() as mp:
        # Tiny chunks: every window sorted alone, or two at a time.
        mp.setattr(plan_module, "_CHUNK_SAMPLES", data.draw(st.integers(1, 40)))
        mp.setattr(plan_module, "_MAX_WINDOWS_PER_SORT", data.draw(st.integers(1, 3)))
        fresh = Plan(sizes, seed=seed, window_shards=window)
        assert np.array_equal(fresh.epoch_order(0), whole)
        assert np.array_equal(fresh._order(0).take(begin, end), whole[begin:end])


def test_epochs_and_seeds_change_the_order_and_nothing_else_does() -> None:
    plan = Plan([10] * 20, seed=5)
    assert not np.array_equal(plan.epoch_order(0), plan.epoch_order(1))
    assert not np.array_equal(plan.epoch_order(0), Plan([10] * 20, seed=6).epoch_order(0))
    again = Plan(np.array([10] * 20, dtype=np.int32), seed=5)
    assert np.array_equal(plan.epoch_order(7), again.epoch_order(7))


def test_large_plans_compute_only_the_ranks_share() -> None:
    plan = Plan(np.full(1000, 1000), seed=3)  # a million samples
    order = plan.rank_order(2, world_size=8, rank=7)
    assert len(order) == 125_000
    assert np.array_equal(order, plan.epoch_order(2)[7 * 125_000 :])
    assert len(np.unique(order)) == len(order)


# ------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=1000)
@given(
    sizes=shard_sizes,
    old_world=worlds,
    new_world=worlds,
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=windows,
    seed=seeds,
    data=st.data(),
)
def test_resume_delivers_every_unconsumed_sample_once_and_nothing_consumed(
    sizes: list[int],
    old_world: int,
    new_world: int,
    shuffle: bool,
    drop_last: bool,
    window: int,
    seed: int,
    data: st.DataObject,
) -> None:
    plan = Plan(sizes, seed=seed, shuffle=shuffle, drop_last=drop_last, window_shards=window)
    total, epoch = sum(sizes), 4
    before = streams(plan, epoch, old_world)
    per_rank = len(before[0])
    consumed = data.draw(st.integers(0, per_rank), label="consumed")
    state = ResumeState.from_dict(
        json.loads(json.dumps(plan.resume_state(epoch, [(old_world, consumed)]).to_dict()))
    )
    after = streams(plan, epoch, new_world, state)
    order = plan.epoch_order(epoch)

    assert after == model_streams(order, [(old_world, consumed)], new_world, drop_last)
    assert len({len(s) for s in after}) == 1
    if new_world == old_world:
        assert after == [s[consumed:] for s in before]  # identical to the uninterrupted run

    # The real (not padding) samples each old rank consumed: positions < total in the
    # concatenation of the old slices.
    taken = {
        int(order[r * per_rank + j])
        for r in range(old_world)
        for j in range(consumed)
        if r * per_rank + j < total
    }
    left = set(range(total)) - taken
    delivered = Counter(i for s in after for i in s)
    if drop_last:
        assert max(delivered.values(), default=1) == 1
        assert set(delivered) <= left
        assert len(left) - len(delivered) < new_world  # only the new truncation is lost
    else:
        assert left <= set(delivered)  # every unconsumed sample, once, plus padding
        assert sum(delivered.values()) - len(left) < max(old_world, new_world)
        if new_world != old_world:
            assert set(delivered) == left  # padding repeats unconsumed samples only
            assert sum(delivered.values()) - len(left) < new_world


@settings(deadline=None, max_examples=400)
@given(
    sizes=with_empty_shards,
    worlds_=st.lists(worlds, min_size=2, max_size=4),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    window=windows,
    seed=seeds,
    data=st.data(),
)
def test_nested_resumes_follow_the_model_and_lose_nothing(
    sizes: list[int],
    worlds_: list[int],
    shuffle: bool,
    drop_last: bool,
    window: int,
    seed: int,
    data: st.DataObject,
) -> None:
    plan = Plan(sizes, seed=seed, shuffle=shuffle, drop_last=drop_last, window_shards=window)
    epoch, total = 1, sum(sizes)
    order = plan.epoch_order(epoch)
    segments: list[tuple[int, int]] = []
    delivered: Counter[int] = Counter()
    for world in worlds_[:-1]:
        state = plan.resume_state(epoch, segments)
        now = streams(plan, epoch, world, state)
        consumed = data.draw(st.integers(0, len(now[0])))
        delivered.update(i for s in now for i in s[:consumed])
        segments.append((world, consumed))
    final = streams(plan, epoch, worlds_[-1], plan.resume_state(epoch, segments))
    assert final == model_streams(order, segments, worlds_[-1], drop_last)
    delivered.update(i for s in final for i in s)
    if drop_last:
        assert max(delivered.values(), default=1) == 1
        assert total - len(delivered) < worlds_[-1]
    else:
        assert set(delivered) == set(range(total))
        assert sum(delivered.values()) - total < sum(worlds_)


def test_resume_state_round_trips_through_json_and_rejects_another_plan() -> None:
    plan = Plan([5, 7, 3], seed=9, window_shards=2)
    state = plan.resume_state(2, [(4, 1), (3, 2), (2, 0)])
    assert [(s.world_size, s.consumed) for s in state.segments] == [(4, 1), (3, 2)]
    payload = json.loads(json.dumps(state.to_dict()))
    assert ResumeState.from_dict(payload) == state
    plan.check_state(ResumeState.from_dict(payload))
    with pytest.raises(ResumeStateError, match="seed: state 9, plan 1"):
        Plan([5, 7, 3], seed=1, window_shards=2).check_state(state)
    with pytest.raises(ResumeStateError, match="num_samples"):
        Plan([5, 7, 4], seed=9, window_shards=2).check_state(state)
    with pytest.raises(ResumeStateError, match="epoch 2, not epoch 3"):
        plan.rank_order(3, world_size=2, rank=0, resume=state)
    with pytest.raises(ResumeStateError, match="version"):
        ResumeState.from_dict({**payload, "version": 99})
    with pytest.raises(ResumeStateError, match="malformed"):
        ResumeState.from_dict({k: v for k, v in payload.items() if k != "segments"})
    with pytest.raises(ResumeStateError, match="malformed"):
        ResumeState.from_dict({**payload, "segments": [[0, 1]]})
    with pytest.raises(ResumeStateError, match="must be a dict"):
        ResumeState.from_dict([1, 2])  # type: ignore[arg-type]


def test_a_state_that_consumed_more_than_a_rank_had_is_refused() -> None:
    plan = Plan([5, 5])
    with pytest.raises(ResumeStateError, match="consumed 6 samples, but each had only 5"):
        plan.resume_state(0, [(2, 6)])
    with pytest.raises(ResumeStateError, match="segment 1"):
        plan.resume_state(0, [(2, 1), (4, 3)])  # 8 left over 4 ranks: 2 each


def test_a_finished_epoch_resumes_to_nothing() -> None:
    plan = Plan([4, 4, 4])
    state = plan.resume_state(0, [(3, 4)])
    assert streams(plan, 0, 2, state) == [[], []]
    assert plan.rank_length(world_size=5, resume=state) == 0


# ------------------------------------------------------------------------------------------
# The future
# ------------------------------------------------------------------------------------------


@settings(deadline=None, max_examples=200)
@given(sizes=shard_sizes, world=worlds, window=windows, seed=seeds, data=st.data())
def test_future_is_the_nodes_exact_shard_sequence(
    sizes: list[int], world: int, window: int, seed: int, data: st.DataObject
) -> None:
    plan = Plan(sizes, seed=seed, window_shards=window)
    ranks = data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
    future = plan.future(range(3), world_size=world, ranks=ranks)
    expected = []
    for epoch in range(3):
        per_rank = [plan.rank_order(epoch, world_size=world, rank=r) for r in ranks]
        # Ranks step in lockstep: step 0 of every rank, then step 1, ...
        expected += [
            int(plan.shard_of([o[i]])[0]) for i in range(len(per_rank[0])) for o in per_rank
        ]
    assert future.sample_shards.tolist() == expected
    assert future.epoch_starts.tolist() == [i * len(expected) // 3 for i in range(4)]
    first = list(dict.fromkeys(expected))
    assert future.first_needed.tolist() == first
    collapsed = [s for i, s in enumerate(expected) if i == 0 or expected[i - 1] != s]
    assert future.accesses().tolist() == collapsed


def test_future_starts_from_the_resume_point_of_its_epoch() -> None:
    plan = Plan([10] * 12, seed=2, window_shards=3)
    state = plan.resume_state(1, [(4, 20)])
    future = plan.future([1, 2], world_size=2, ranks=[1], resume=state)
    rest = plan.rank_order(1, world_size=2, rank=1, resume=state)
    nxt = plan.rank_order(2, world_size=2, rank=1)
    assert future.sample_shards.tolist() == plan.shard_of(np.concatenate([rest, nxt])).tolist()
    assert future.epoch_starts.tolist() == [0, len(rest), len(rest) + len(nxt)]


# ------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ([], "empty: shard_sizes has no shards"),
        ([0, 0], "empty: its 2 shards hold no samples"),
        ([3, -1], "shard 1 has a negative sample count"),
        ([[1, 2]], "flat sequence of integers"),
        ([1.5], "flat sequence of integers"),
    ],
)
def test_bad_datasets_are_refused(sizes: list[int], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        Plan(sizes)


def test_bad_arguments_are_refused_with_the_value_and_the_range() -> None:
    plan = Plan([3, 3])
    assert issubclass(PlanError, FastloadError)
    assert issubclass(PlanError, ValueError)
    with pytest.raises(PlanError, match="world_size must be >= 1, got 0"):
        plan.rank_order(0, world_size=0, rank=0)
    with pytest.raises(
        PlanError, match=r"rank 2 is out of range for world_size 2: ranks are 0\.\.1"
    ):
        plan.rank_order(0, world_size=2, rank=2)
    with pytest.raises(PlanError, match="rank must be >= 0"):
        plan.rank_order(0, world_size=2, rank=-1)
    with pytest.raises(PlanError, match="epoch must be >= 0"):
        plan.epoch_order(-1)
    with pytest.raises(PlanError, match="seed must be >= 0"):
        Plan([1], seed=-3)
    with pytest.raises(PlanError, match="window_shards must be >= 1"):
        Plan([1], window_shards=0)
    with pytest.raises(PlanError, match="must be an integer"):
        Plan([1], seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="worker 2 is out of range for num_workers=2"):
        worker_batches([1, 2, 3], batch_size=1, num_workers=2, worker=2)
    with pytest.raises(PlanError, match="batch_size must be >= 1"):
        worker_batches([1], batch_size=0, num_workers=0, worker=0)
    with pytest.raises(PlanError, match="ranks is empty"):
        plan.future([0], world_size=2, ranks=[])
    with pytest.raises(PlanError, match="distinct"):
        plan.future([0], world_size=2, ranks=[1, 1])
    with pytest.raises(PlanError, match=r"sample indices must be in 0\.\.5"):
        plan.shard_of([6])


def test_drop_last_with_more_ranks_than_samples_gives_everyone_nothing() -> None:
    plan = Plan([2, 1], drop_last=True)
    assert streams(plan, 0, 4) == [[], [], [], []]
    padded = Plan([2, 1], shuffle=False)
    assert streams(padded, 0, 7) == [[0], [1], [2], [0], [1], [2], [0]]


def test_plan_benchmark_measures_every_case_at_toy_size() -> None:
    from fastload.bench.components import plan_bench

    config = plan_bench.PlanBenchConfig(
        num_shards=40, shard_samples=10, world_size=4, window_shards=2, resume_samples=200
    )
    report = plan_bench.run(config)
    systems = {(r.case.split(":")[0].split(" (")[0], r.system) for r in report.rows}
    assert len(systems) == len(report.rows) == 9
    shards = {
        r.system: r.extra["shards"] for r in report.rows if r.case.startswith("distinct shards")
    }
    assert shards["fastload plan"] <= 40 / 4 + 2 * 2 + 1 < shards[plan_bench.PEER]
    assert all(r.ratio is not None for r in report.rows if r.system != "fastload Plan.epoch_order")
    with pytest.raises(ValueError, match="resume_samples must be >= 2 \\* world_size"):
        plan_bench.PlanBenchConfig(resume_samples=3)


@pytest.mark.parametrize("samples", [1, 5, 13, 14, 40])
def test_a_future_bounded_by_samples_is_the_unbounded_futures_first_samples(samples: int) -> None:
    """``future(samples=k)`` computes only each rank's first k samples (a warm of the next
    batches on 1.28 M samples must not compute the whole epoch), and they are exactly the
    start of the unbounded future, across an epoch boundary too."""
    plan = Plan([4, 7, 2, 9, 5], seed=3, window_shards=2)
    resume = plan.resume_state(0, [(2, 3)])
    full = plan.future((0, 1), world_size=3, ranks=(0, 2), resume=resume)
    cut = plan.future((0, 1), world_size=3, ranks=(0, 2), resume=resume, samples=samples)
    assert cut.sample_shards.tolist() == full.sample_shards[: samples * 2].tolist()
    assert len(cut.epoch_starts) == len(full.epoch_starts)
    assert cut.epoch_starts.tolist() == np.minimum(full.epoch_starts, samples * 2).tolist()
