"""``ShardedSampler`` in real ``torch.distributed`` (gloo) process groups on loopback.

Each group is a set of fresh Python processes running this file as a script; every wait
has a timeout and every process is reaped, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import process_group
import pytest

SIZES = [11, 4, 9, 16, 7, 13, 2, 10, 8, 5, 12, 3]  # 100 samples in 12 shards
TOTAL = sum(SIZES)
GROUP_TIMEOUT_S = 60


class ShardedDataset:
    def __init__(self, shard_sizes: list[int]) -> None:
        self.shard_sizes = shard_sizes

    def __len__(self) -> int:
        return sum(self.shard_sizes)


def run_group(world_size: int, out: Path, args: list[str]) -> list[dict[str, Any]]:
    """Runs this file as ``world_size`` ranks of one gloo group; returns each rank's result."""
    return process_group.run_group(
        __file__, world_size, out, args, timeout_s=GROUP_TIMEOUT_S, env={"PYTHONWARNINGS": "error"}
    )


@pytest.mark.dist
def test_ranks_read_the_epoch_exactly_once_and_resume_at_another_world_size(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    old_world, new_world = 4, 3
    per_rank = TOTAL // old_world  # 100 is a multiple of 4: no padding, no truncation
    stop = rng.randrange(1, per_rank)
    state_dir = tmp_path / "states"
    state_dir.mkdir()

    first = run_group(old_world, tmp_path / "a", ["--stop", str(stop), "--states", str(state_dir)])
    second = run_group(new_world, tmp_path / "b", ["--resume", "--states", str(state_dir)])
    for variant in VARIANTS:
        # Epoch 0 read whole: every rank saw the same gather; it is the epoch exactly once.
        gathered = first[0][variant]["epoch0"]
        assert all(r[variant]["epoch0"] == gathered for r in first)
        assert [len(g) for g in gathered] == [per_rank] * old_world
        assert sorted(i for g in gathered for i in g) == list(range(TOTAL))
        # Contiguous slices: each rank touches about 12 / 4 shards, plus two windows of 2.
        assert all(n <= 12 / old_world + 2 * 2 + 1 for n in first[0][variant]["shards"])

        # Epoch 1 stopped after `stop` steps, rank 0 saved its state, resumed at new_world.
        consumed = [i for g in first[0][variant]["epoch1"] for i in g]
        assert len(consumed) == len(set(consumed)) == stop * old_world
        rest = second[0][variant]["epoch1"]
        assert all(r[variant]["epoch1"] == rest for r in second)
        assert len({len(g) for g in rest}) == 1
        delivered = Counter(i for g in rest for i in g)
        left = set(range(TOTAL)) - set(consumed)
        assert not set(delivered) & set(consumed), variant  # nothing consumed comes back
        if variant == "drop_last":
            assert max(delivered.values()) == 1
            assert len(left) - len(delivered) < new_world
        else:
            assert set(delivered) == left  # every unconsumed sample, plus padding from the rest
            assert sum(delivered.values()) - len(left) < new_world


VARIANTS = ("pad", "drop_last")


def _rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--states", required=True)
    parser.add_argument("--stop", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from fastload.sampler import ShardedSampler

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    # From here on the rank and world size can only come from the process group.
    del os.environ["RANK"], os.environ["WORLD_SIZE"]
    try:
        result: dict[str, Any] = {}

        def gather(indices: list[int]) -> list[list[int]]:
            out: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(out, indices)
            return out

        for variant in VARIANTS:
            mine: dict[str, Any] = {}
            state_file = Path(args.states) / f"{variant}.json"
            sampler = ShardedSampler(
                ShardedDataset(SIZES), seed=11, window_shards=2, drop_last=variant == "drop_last"
            )
            assert (sampler.rank, sampler.world_size) == (dist.get_rank(), dist.get_world_size())
            if args.resume:
                sampler.load_state_dict(json.loads(state_file.read_text()))
                sampler.set_epoch(1)  # the training loop restarts at the saved epoch
                mine["epoch1"] = gather(list(sampler))
            else:
                whole = list(sampler)
                mine["epoch0"] = gather(whole)
                touched = len(set(sampler.plan.shard_of(whole).tolist()))
                mine["shards"] = [n[0] for n in gather([touched])]
                sampler.set_epoch(1)
                it = iter(sampler)
                mine["epoch1"] = gather([next(it) for _ in range(args.stop)])
                if dist.get_rank() == 0:
                    state_file.write_text(json.dumps(sampler.state_dict()))
            result[variant] = mine
        Path(args.out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
