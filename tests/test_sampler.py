"""``ShardedSampler`` against the plan: rank detection, epochs, state round trips, DataLoader."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import fastload.sampler as sampler_module
from fastload.plan import Plan, PlanError, ResumeStateError
from fastload.sampler import ShardedSampler


class ShardedDataset(Dataset[int]):
    """A map-style dataset that knows its shards, as fastload's datasets do."""

    def __init__(self, shard_sizes: Sequence[int]) -> None:
        self.shard_sizes = list(shard_sizes)

    def __len__(self) -> int:
        return sum(self.shard_sizes)

    def __getitem__(self, index: int) -> int:
        return index


SIZES = [7, 3, 12, 5, 9, 1, 8, 6, 10, 4]  # 65 samples in 10 shards


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def run_test_save_load_state(
    make: Callable[[int, int], ShardedSampler],
    *,
    world_size: int,
    stop_after: int,
    new_world_size: int,
) -> tuple[list[list[int]], list[list[int]]]:
    """Stops ``world_size`` samplers after ``stop_after`` indices each, saves rank 0's state
    through JSON, loads it into fresh samplers at ``new_world_size`` and returns
    (what each old rank read, what each new rank reads after the resume). With the same
    world size it also checks that the rest is identical to an uninterrupted run.
    (torchdata's ``run_test_save_load_state``, for ranks in lockstep.)"""
    old = [make(r, world_size) for r in range(world_size)]
    iterators = [iter(s) for s in old]
    consumed = [[next(it) for _ in range(stop_after)] for it in iterators]
    states = [json.loads(json.dumps(s.state_dict())) for s in old]
    assert all(state == states[0] for state in states), "lockstep ranks share one state"
    resumed = []
    for r in range(new_world_size):
        fresh = make(r, new_world_size)
        fresh.load_state_dict(states[0])
        assert fresh.state_dict() == states[0]  # a loaded, unused state saves unchanged
        expected_len = len(fresh)
        rest = list(fresh)
        assert len(rest) == expected_len
        resumed.append(rest)
    if new_world_size == world_size:
        uninterrupted = [list(make(r, world_size)) for r in range(world_size)]
        for r in range(world_size):
            assert consumed[r] + resumed[r] == uninterrupted[r]
    return consumed, resumed


def sampler(rank: int, world: int, **kwargs: object) -> ShardedSampler:
    s = ShardedSampler(ShardedDataset(SIZES), rank=rank, world_size=world, seed=4, **kwargs)  # type: ignore[arg-type]
    s.set_epoch(2)
    return s


def test_each_rank_yields_its_plan_share_for_the_epoch() -> None:
    plan = Plan(SIZES, seed=4)
    for world in (1, 3, 4):
        for rank in range(world):
            s = ShardedSampler(ShardedDataset(SIZES), rank=rank, world_size=world, seed=4)
            for epoch in (0, 1, 5):
                s.set_epoch(epoch)
                expected = plan.rank_order(epoch, world_size=world, rank=rank).tolist()
                assert list(s) == expected
                assert len(s) == len(expected) == s.num_samples
                assert s.total_size == s.num_samples * world


def test_numpy_integers_are_accepted_where_ints_are() -> None:
    s = ShardedSampler(
        ShardedDataset(SIZES), rank=np.int64(1), world_size=np.int32(2), batch_size=np.int64(4)
    )
    s.set_epoch(np.int64(3))
    assert (s.rank, s.world_size, s.epoch, s.batch_size) == (1, 2, 3, 4)
    assert json.dumps(s.state_dict())


def test_a_sized_dataset_without_shards_is_one_shard_per_sample() -> None:
    s = ShardedSampler(range(10), rank=1, world_size=3, shuffle=False)
    assert list(s) == [4, 5, 6, 7]
    assert s.plan.num_shards == 10


def test_iterating_again_restarts_the_epoch_like_distributed_sampler() -> None:
    s = sampler(0, 2)
    first = list(s)
    assert list(s) == first
    it = iter(s)
    next(it)
    assert list(s) == first  # a new iterator starts over; the abandoned one stops counting
    next(it)
    assert s.state_dict()["segments"] == [[2, len(first)]]


@pytest.mark.parametrize(
    ("world", "stop", "new_world"), [(2, 5, 2), (3, 4, 2), (2, 9, 4), (4, 0, 3), (3, 21, 1)]
)
@pytest.mark.parametrize("drop_last", [False, True])
def test_save_and_load_mid_epoch(world: int, stop: int, new_world: int, drop_last: bool) -> None:
    def make(rank: int, size: int) -> ShardedSampler:
        return sampler(rank, size, drop_last=drop_last)

    consumed, resumed = run_test_save_load_state(
        make, world_size=world, stop_after=stop, new_world_size=new_world
    )
    assert len({len(r) for r in resumed}) == 1
    plan = Plan(SIZES, seed=4, drop_last=drop_last)
    everything = [i for r in consumed for i in r] + [i for r in resumed for i in r]
    if drop_last:
        assert len(everything) == len(set(everything))
        assert 65 - len(everything) < max(world, new_world)
    else:
        assert set(everything) == set(range(65))
        assert len(everything) - 65 < world + new_world
    state = plan.resume_state(2, [(world, stop)])
    assert resumed == [
        plan.rank_order(2, world_size=new_world, rank=r, resume=state).tolist()
        for r in range(new_world)
    ]


def test_nested_resume_through_three_world_sizes() -> None:
    seen: list[int] = []
    state = None
    for world, steps in ((4, 3), (2, 7), (3, None)):
        samplers = [sampler(r, world) for r in range(world)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(state)
        iterators = [iter(s) for s in samplers]
        for it in iterators:
            seen += list(it) if steps is None else [next(it) for _ in range(steps)]
        state = json.loads(json.dumps(samplers[0].state_dict()))
    assert set(seen) == set(range(65))
    assert len(seen) - 65 < 4 + 2 + 3
    assert [s[0] for s in state["segments"]] == [4, 2, 3]


def test_set_epoch_after_load_keeps_the_resume_point_only_for_that_epoch() -> None:
    s = sampler(1, 2)
    it = iter(s)
    head = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["epoch"] == 2
    resumed = sampler(1, 2)
    resumed.set_epoch(0)
    resumed.load_state_dict(state)
    assert resumed.epoch == 2
    resumed.set_epoch(2)  # what a training loop does when it restarts at the saved epoch
    assert len(resumed) == len(list(sampler(1, 2))) - 4
    assert head + list(resumed) == list(sampler(1, 2))
    assert list(resumed) == list(sampler(1, 2))  # the next iteration is a whole epoch again
    other = sampler(1, 2)
    other.load_state_dict(state)
    other.set_epoch(3)
    assert len(list(other)) == other.num_samples


def test_state_dict_is_plain_json_and_counts_what_was_yielded() -> None:
    s = sampler(0, 3)
    assert s.state_dict()["segments"] == []
    it = iter(s)
    for _ in range(6):
        next(it)
    state = s.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "version": 1,
        "epoch": 2,
        "seed": 4,
        "shuffle": True,
        "drop_last": False,
        "window_shards": s.plan.window_shards,
        "num_samples": 65,
        "num_shards": 10,
        "segments": [[3, 6]],
    }


def test_load_refuses_a_state_from_another_plan_or_dataset() -> None:
    state = sampler(0, 2).state_dict()
    with pytest.raises(ResumeStateError, match="seed: state 4, plan 5"):
        ShardedSampler(ShardedDataset(SIZES), rank=0, world_size=2, seed=5).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="num_samples: state 65, plan 66"):
        ShardedSampler(ShardedDataset([*SIZES, 1]), rank=0, world_size=2, seed=4).load_state_dict(
            state
        )
    bad = {**state, "segments": [[2, 40]]}
    with pytest.raises(ResumeStateError, match="consumed 40 samples, but each had only 33"):
        sampler(0, 2).load_state_dict(bad)


def test_rank_and_world_size_come_from_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    s = ShardedSampler(ShardedDataset(SIZES), seed=4)
    assert (s.rank, s.world_size) == (2, 3)
    assert list(s) == Plan(SIZES, seed=4).rank_order(0, world_size=3, rank=2).tolist()
    assert ShardedSampler(ShardedDataset(SIZES), rank=0).rank == 0  # arguments win
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(PlanError, match="RANK='two' is not an integer"):
        ShardedSampler(ShardedDataset(SIZES))
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(PlanError, match="rank 3 is out of range for world_size 3"):
        ShardedSampler(ShardedDataset(SIZES))


def test_without_torchrun_or_a_process_group_it_is_a_single_process() -> None:
    s = ShardedSampler(ShardedDataset(SIZES))
    assert (s.rank, s.world_size) == (0, 1)
    assert sorted(s) == list(range(65))


def test_num_replicas_is_an_alias_of_world_size() -> None:
    s = ShardedSampler(ShardedDataset(SIZES), num_replicas=4, rank=3)
    assert s.world_size == s.num_replicas == 4
    assert ShardedSampler(ShardedDataset(SIZES), num_replicas=4, world_size=4, rank=0)
    with pytest.raises(PlanError, match="world_size=2 and num_replicas=4 disagree"):
        ShardedSampler(ShardedDataset(SIZES), num_replicas=4, world_size=2, rank=0)


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(PlanError, match="world_size must be an integer >= 1, got 0"):
        ShardedSampler(ShardedDataset(SIZES), world_size=0, rank=0)
    with pytest.raises(PlanError, match="batch_size must be an integer >= 1 or None, got 0"):
        ShardedSampler(ShardedDataset(SIZES), batch_size=0)
    with pytest.raises(PlanError, match="epoch must be an integer >= 0, got -1"):
        ShardedSampler(ShardedDataset(SIZES)).set_epoch(-1)
    with pytest.raises(PlanError, match="add up to 65 samples but len"):
        ShardedSampler(type("D", (ShardedDataset,), {"__len__": lambda self: 64})(SIZES))
    with pytest.raises(PlanError, match="neither"):
        ShardedSampler(object())
    with pytest.raises(PlanError, match="empty"):
        ShardedSampler([])
    with pytest.raises(PlanError, match="num_batches needs a batch_size"):
        _ = ShardedSampler(ShardedDataset(SIZES)).num_batches


def test_every_rank_has_the_same_number_of_batches() -> None:
    counts = {
        ShardedSampler(ShardedDataset(SIZES), rank=r, world_size=4, batch_size=4).num_batches
        for r in range(4)
    }
    assert counts == {5}  # 65 padded to 68: 17 per rank, batches of 4 -> 5


def test_future_shards_follow_this_rank_from_where_it_is() -> None:
    s = sampler(1, 3)
    order = list(s)
    plan = s.plan
    future = s.future_shards()
    assert future.sample_shards.tolist() == plan.shard_of(order).tolist()
    it = iter(s)
    for _ in range(5):
        next(it)
    assert s.future_shards().sample_shards.tolist() == plan.shard_of(order[5:]).tolist()
    node = s.future_shards(epochs=[3, 4], ranks=[0, 1, 2])
    assert node.epochs == (3, 4)
    assert set(node.first_needed.tolist()) == set(range(10))


def test_a_torch_dataloader_reads_the_planned_order_in_batches() -> None:
    ds = ShardedDataset(SIZES)
    s = ShardedSampler(ds, rank=1, world_size=2, seed=4, batch_size=8)
    loader = DataLoader(ds, batch_size=8, sampler=s)
    batches = [b.tolist() for b in loader]
    assert len(batches) == len(loader) == s.num_batches
    assert [i for b in batches for i in b] == Plan(SIZES, seed=4).rank_order(
        0, world_size=2, rank=1
    ).tolist()


def test_rank_detection_prefers_an_initialized_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(sampler_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(sampler_module.dist, "get_world_size", lambda: 6)
    s = ShardedSampler(ShardedDataset(SIZES))
    assert (s.rank, s.world_size) == (5, 6)
    assert np.array_equal(list(s), Plan(SIZES).rank_order(0, world_size=6, rank=5))
