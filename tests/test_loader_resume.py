"""Exact resume of ``fl.DataLoader``: ``state_dict()`` mid-epoch, a new loader,
``load_state_dict()``, and the rest of the epoch.

- fastload datasets (the plan): the same world size gives the uninterrupted run's batches,
  pixels included (augmentation is part of the state), with any number of workers; another
  world size delivers exactly the samples not yet consumed, each once, across all new ranks,
  in-process (``rank=``/``world_size=``) and in real gloo process groups.
- plain torch datasets: the rest equals the uninterrupted run (replayed sampler RNG).

Every state goes through ``json.dumps``/``json.loads`` first: it must survive a checkpoint.
This file also runs as a script: one rank of a gloo group (see ``_rank_main``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import process_group
import pytest
import torch
from test_loader import SIZE, TOTAL, Source, raw_indices, write_source
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import fastload as fl

GROUP_TIMEOUT_S = 90


def through_json(state: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(state)
    back: dict[str, Any] = json.loads(text)
    return back


def same_batches(a: list[Any], b: list[Any]) -> bool:
    """Batches equal element for element: tensors, lists, tuples, dicts of them."""

    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
        if isinstance(x, list | tuple):
            return type(x) is type(y) and len(x) == len(y) and all(map(equal, x, y))
        if isinstance(x, dict):
            return (
                isinstance(y, dict) and x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
            )
        return bool(x == y)

    return len(a) == len(b) and all(map(equal, a, b))


def copied(batch: Any) -> Any:
    """A batch detached from the loader's memory (decoded batches reuse theirs)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, list | tuple):
        return type(batch)(copied(x) for x in batch)
    if isinstance(batch, dict):
        return {k: copied(v) for k, v in batch.items()}
    return batch


def take(loader: Any, count: int) -> tuple[list[Any], dict[str, Any]]:
    """The first ``count`` batches of a pass, then the state (the pass is left open)."""
    it = iter(loader)
    got = [copied(next(it)) for _ in range(count)]
    state = through_json(loader.state_dict())
    return got, state


def check_resume(
    make_saving: Callable[[], Any],
    make_resuming: Callable[[], Any],
    stops: list[int],
    *,
    before: Callable[[Any], None] = lambda loader: None,
) -> None:
    """The shared helper: for every stop, save there, resume in a fresh loader, and compare the
    rest with the uninterrupted pass. ``before`` prepares a loader for the pass (set_epoch)."""
    reference = make_saving()
    before(reference)
    full = [copied(b) for b in reference]
    if hasattr(reference, "close"):
        reference.close()
    assert len(full) > max(stops) - 1, "a stop past the end of the pass"
    for stop in stops:
        saving = make_saving()
        before(saving)
        first, state = take(saving, stop)
        assert same_batches(first, full[:stop])
        saving.close()
        resuming = make_resuming()
        resuming.load_state_dict(state)
        rest = [copied(b) for b in resuming]
        resuming.close()
        assert len(rest) == len(full) - stop, f"stopped after {stop}"
        assert same_batches(rest, full[stop:]), f"stopped after {stop}"


# ---------------------------------------------------------------------------------------------
# fastload datasets, the same world size
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Source:
    return write_source(tmp_path_factory.mktemp("jpegs"), seed=1)


def _open(source: Source, layout: str, tmp_path: Path) -> Any:
    return fl.open_dataset(str(source.root / layout), cache_dir=str(tmp_path / "cache"))


def _decoding(dataset: Any, workers: int, **extra: Any) -> Callable[[], Any]:
    def make() -> Any:
        return fl.DataLoader(
            dataset,
            batch_size=7,
            shuffle=True,
            num_workers=workers,
            seed=21,
            decode="cpu",
            transform=fl.decode.TrainPreset(SIZE),
            **extra,
        )

    return make


@pytest.mark.parametrize(("saving", "resuming"), [(0, 2), (2, 0), (1, 1)])
@pytest.mark.parametrize("layout", ["folder", "tars"])
def test_resume_gives_the_uninterrupted_batches_and_pixels(
    source: Source, tmp_path: Path, layout: str, saving: int, resuming: int
) -> None:
    """9 batches of 7 (the last of 4): stops at the start, after one, mid-way, before the
    last, after the last. TrainPreset pixels are compared, so augmentation is restored."""
    dataset = _open(source, layout, tmp_path)
    check_resume(_decoding(dataset, saving), _decoding(dataset, resuming), [0, 1, 4, 8, 9])


@pytest.mark.parametrize(("drop_last", "epoch"), [(False, 9), (True, 8)])
def test_len_is_the_whole_epoch_after_a_resume(
    source: Source, tmp_path: Path, drop_last: bool, epoch: int
) -> None:
    """As torch's loader and torchdata's StatefulDataLoader count after load_state_dict:
    Lightning counts a resumed epoch's batches on from the checkpoint's up to len(), so a
    len() of the rest would end the epoch early."""
    dataset = _open(source, "folder", tmp_path)
    make = _decoding(dataset, 2, drop_last=drop_last)
    saving = make()
    assert len(saving) == epoch
    _, state = take(saving, 4)
    saving.close()
    resumed = make()
    resumed.load_state_dict(state)
    assert len(resumed) == epoch
    iterator = iter(resumed)
    assert len(iterator) == epoch
    assert len(list(iterator)) == epoch - 4
    assert len(resumed) == epoch  # the next epoch
    resumed.close()


def test_resume_in_a_later_epoch_continues_that_epoch_and_the_ones_after(
    source: Source, tmp_path: Path
) -> None:
    dataset = _open(source, "folder", tmp_path)
    make = _decoding(dataset, 2)
    reference = make()
    epochs = [[copied(b) for b in reference] for _ in range(3)]
    reference.close()

    # Stop in epoch 1 (reached without set_epoch), resume in a new loader.
    saving = make()
    assert same_batches([copied(b) for b in saving], epochs[0])
    first, state = take(saving, 3)
    saving.close()
    assert same_batches(first, epochs[1][:3])
    assert state["epoch"] == 1
    resuming = _decoding(dataset, 1)()
    resuming.load_state_dict(state)
    assert resuming.epoch == 1
    assert same_batches([copied(b) for b in resuming], epochs[1][3:])
    assert same_batches([copied(b) for b in resuming], epochs[2])  # then on as before
    resuming.close()

    # A state saved between passes starts the next epoch from its beginning.
    between = make()
    list(between)
    state = through_json(between.state_dict())
    between.close()
    fresh = make()
    fresh.load_state_dict(state)
    assert fresh.epoch == 1
    assert same_batches([copied(b) for b in fresh], epochs[1])
    fresh.close()


def test_resume_after_set_epoch_and_a_second_resume(source: Source, tmp_path: Path) -> None:
    dataset = _open(source, "tars", tmp_path)
    make = _decoding(dataset, 2)

    def at_epoch_4(loader: Any) -> None:
        loader.set_epoch(4)

    check_resume(make, make, [2, 6], before=at_epoch_4)

    # Save, resume, save again partway through the rest, resume again: still the same stream.
    reference = make()
    reference.set_epoch(4)
    full = [copied(b) for b in reference]
    reference.close()
    one = make()
    one.set_epoch(4)
    _, state = take(one, 2)
    one.close()
    two = _decoding(dataset, 0)()
    two.load_state_dict(state)
    middle, state = take(two, 3)
    two.close()
    three = make()
    three.load_state_dict(state)
    rest = [copied(b) for b in three]
    three.close()
    assert same_batches(middle, full[2:5])
    assert same_batches(rest, full[5:])


# ---------------------------------------------------------------------------------------------
# fastload datasets, another world size (in-process ranks)
# ---------------------------------------------------------------------------------------------


def _raw_loader(dataset: Any, rank: int, world: int, workers: int = 1) -> Any:
    return fl.DataLoader(
        dataset,
        batch_size=4,
        shuffle=True,
        seed=13,
        num_workers=workers,
        rank=rank,
        world_size=world,
        collate_fn=list,
    )


def _indices(source: Source, batch: list[Any]) -> list[int]:
    return raw_indices(source, batch)


@pytest.mark.parametrize(
    ("old_world", "steps", "new_worlds"),
    [
        (2, 3, [1, 3, 4]),  # 60 - 2*3*4 = 36 left: 36, 12, 9 a rank
        (3, 2, [2, 6, 4]),  # 60 - 3*2*4 = 36 left
        (1, 5, [2, 5]),  # 60 - 20 = 40 left
    ],
)
def test_another_world_size_delivers_exactly_the_unconsumed_samples(
    source: Source, tmp_path: Path, old_world: int, steps: int, new_worlds: list[int]
) -> None:
    dataset = _open(source, "tars", tmp_path)
    old = [_raw_loader(dataset, r, old_world) for r in range(old_world)]
    iterators = [iter(loader) for loader in old]
    consumed: list[int] = []
    for _ in range(steps):  # ranks step in lockstep, as DDP makes them
        for it in iterators:
            consumed += _indices(source, next(it))
    states = [through_json(loader.state_dict()) for loader in old]
    for loader in old:
        loader.close()
    assert all(s == states[0] for s in states)  # every rank saves the same state
    assert len(set(consumed)) == len(consumed) == old_world * steps * 4

    left = set(range(TOTAL)) - set(consumed)
    for new_world in new_worlds:
        assert len(left) % new_world == 0  # so no padding: each exactly once
        delivered: Counter[int] = Counter()
        per_rank = []
        for rank in range(new_world):
            loader = _raw_loader(dataset, rank, new_world, workers=rank % 3)
            loader.load_state_dict(states[0])
            mine = [i for batch in loader for i in _indices(source, batch)]
            loader.close()
            per_rank.append(len(mine))
            delivered.update(mine)
        assert set(delivered) == left, new_world
        assert max(delivered.values()) == 1, new_world
        assert per_rank == [len(left) // new_world] * new_world


def test_a_world_size_change_can_happen_twice(source: Source, tmp_path: Path) -> None:
    dataset = _open(source, "folder", tmp_path)
    consumed: list[int] = []

    def step(loaders: list[Any], steps: int, state: dict[str, Any] | None) -> dict[str, Any]:
        iterators = []
        for loader in loaders:
            if state is not None:
                loader.load_state_dict(state)
            iterators.append(iter(loader))
        for _ in range(steps):
            for it in iterators:
                consumed.extend(_indices(source, next(it)))
        saved = [through_json(loader.state_dict()) for loader in loaders]
        for loader in loaders:
            loader.close()
        assert all(s == saved[0] for s in saved)
        return saved[0]

    state = step([_raw_loader(dataset, r, 4) for r in range(4)], 1, None)  # 16 consumed
    state = step([_raw_loader(dataset, r, 2) for r in range(2)], 2, state)  # 16 more
    rest: list[int] = []
    for rank in range(7):  # 28 left: 4 a rank
        loader = _raw_loader(dataset, rank, 7, workers=0)
        loader.load_state_dict(state)
        rest += [i for batch in loader for i in _indices(source, batch)]
        loader.close()
    assert len(consumed) == len(set(consumed)) == 32
    assert sorted(rest + consumed) == list(range(TOTAL))


# ---------------------------------------------------------------------------------------------
# fastload datasets in real gloo process groups
# ---------------------------------------------------------------------------------------------


def _run_group(world_size: int, out: Path, args: list[str]) -> list[dict[str, Any]]:
    """Runs this file as ``world_size`` ranks of one gloo group; returns each rank's result."""
    return process_group.run_group(__file__, world_size, out, args, timeout_s=GROUP_TIMEOUT_S)


@pytest.mark.dist
def test_gloo_ranks_resume_at_another_world_size_with_each_unconsumed_sample_once(
    source: Source, tmp_path: Path
) -> None:
    """Two ranks (in this process, rank=/world_size= given) read 3 batches of 4 and save;
    three gloo ranks resume from rank 0's checkpoint, finding their rank and world size in
    the process group (no arguments), and each delivers its share of the rest once."""
    dataset = _open(source, "folder", tmp_path)
    old = [_raw_loader(dataset, r, 2, workers=2) for r in range(2)]
    iterators = [iter(loader) for loader in old]
    consumed = [i for _ in range(3) for it in iterators for i in _indices(source, next(it))]
    state = tmp_path / "state.json"
    state.write_text(json.dumps(old[0].state_dict()))
    for loader in old:
        loader.close()

    args = ["--data", str(source.root / "folder"), "--cache", str(tmp_path / "cache")]
    ranks = _run_group(3, tmp_path / "group", [*args, "--resume", str(state)])
    assert [r["world"] for r in ranks] == [[0, 3], [1, 3], [2, 3]]
    rest = [source.by_digest[d] for r in ranks for d in r["digests"]]
    assert len(consumed) == len(set(consumed)) == 2 * 3 * 4
    assert [len(r["digests"]) for r in ranks] == [(TOTAL - 24) // 3] * 3
    assert len(rest) == len(set(rest))  # each once
    assert sorted(consumed + rest) == list(range(TOTAL))


def _digests(batch: list[tuple[bytes, int]]) -> list[str]:
    return [hashlib.md5(image).hexdigest() for image, _ in batch]


def _rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--resume", required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    # From here on the rank and world size can only come from the process group.
    del os.environ["RANK"], os.environ["WORLD_SIZE"]
    try:
        # The same loader as _raw_loader, but from the URL and without rank/world_size.
        with fl.DataLoader(
            args.data,
            batch_size=4,
            shuffle=True,
            seed=13,
            num_workers=1,
            collate_fn=_digests,
            cache_dir=args.cache,
        ) as loader:
            sampler = loader.sampler
            loader.load_state_dict(json.loads(Path(args.resume).read_text()))
            digests = [d for batch in loader for d in batch]
        result = {"world": [sampler.rank, sampler.world_size], "digests": digests}
        Path(args.out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Plain torch datasets
# ---------------------------------------------------------------------------------------------


class Squares(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 45

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, index * index])


class Counting(IterableDataset[torch.Tensor]):
    """Splits itself between workers; the random part comes from each worker's seed."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        g = torch.Generator().manual_seed(0 if info is None else info.seed)
        for i in range(worker, 38, workers):
            yield torch.tensor([i, int(torch.randint(0, 10**6, (), generator=g))])


def _seeded(make: Callable[[], Any], seed: int) -> Callable[[], Any]:
    """``make`` with torch's global RNG seeded first (a script that calls manual_seed)."""

    def seeded_make() -> Any:
        torch.manual_seed(seed)
        return make()

    return seeded_make


STOPS = [0, 1, 5, 11]  # 12 batches of 4 (the last of 1), 10 of 4 (iterable, 38 samples)


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataset_shuffled_with_a_generator(workers: int) -> None:
    def make() -> Any:
        return fl.DataLoader(
            Squares(),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(7),
        )

    check_resume(make, make, STOPS)


@pytest.mark.parametrize("workers", [0, 2])
def test_plain_dataset_shuffled_by_the_global_seed(workers: int) -> None:
    """No generator: the order comes from torch's global RNG, seeded once by the script. The
    resumed loader is created after another seed: the state alone must restore the order, and
    leave the script's own random stream as it was."""

    def make() -> Any:
        return fl.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=workers)

    check_resume(_seeded(make, 11), _seeded(make, 11), [0])  # the seed alone decides
    for stop in (1, 6, 11):
        torch.manual_seed(11)
        full = list(make())
        torch.manual_seed(11)
        first, state = take(make(), stop)
        assert same_batches(first, full[:stop])
        torch.manual_seed(1000 + stop)
        resuming = make()
        resuming.load_state_dict(state)
        rest = list(resuming)
        after_resume = torch.rand(3)
        torch.manual_seed(1000 + stop)
        assert same_batches(rest, full[stop:]), stop
        if workers == 0:
            # Without workers nothing else draws: the resume left the script's stream alone.
            assert torch.equal(after_resume, torch.rand(3))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset(workers: int) -> None:
    def make() -> Any:
        return fl.DataLoader(
            Counting(),
            batch_size=4,
            num_workers=workers,
            generator=torch.Generator().manual_seed(5),
        )

    check_resume(make, make, [0, 1, 4, 9])


def test_a_state_from_one_kind_of_loader_is_refused_by_another(
    source: Source, tmp_path: Path
) -> None:
    dataset = _open(source, "folder", tmp_path)
    planned = fl.DataLoader(dataset, batch_size=4, shuffle=True, collate_fn=list)
    plain = fl.DataLoader(Squares(), batch_size=4, shuffle=True)
    _, plan_state = take(planned, 2)
    _, plain_state = take(plain, 2)
    with pytest.raises(ValueError, match="fastload's plan"):
        plain.load_state_dict(plan_state)
    with pytest.raises(ValueError, match="without fastload's plan"):
        planned.load_state_dict(plain_state)
    with pytest.raises(ValueError, match="not a fastload DataLoader state"):
        planned.load_state_dict({"epoch": 0})
    planned.close()
    plain.close()


if __name__ == "__main__":
    _rank_main(sys.argv[1:])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_checkpoint_after_a_loop_left_with_break_continues_after_its_last_batch(
    source: Source, tmp_path: Path, workers: int
) -> None:
    """`for batch in loader: ... break` then `loader.state_dict()` (a SIGTERM handler's
    pattern): the state is after the last delivered batch, not the epoch's start again."""
    dataset = _open(source, "folder", tmp_path)
    make = _decoding(dataset, workers)
    uninterrupted = make()
    full = [copied(b) for b in uninterrupted]
    uninterrupted.close()
    saving = make()
    for i, _ in enumerate(saving):
        if i == 3:
            break  # the pass is dropped here, after 4 batches were delivered
    state = saving.state_dict()
    saving.close()
    assert state["step"] == 4
    resuming = make()
    resuming.load_state_dict(state)
    rest = [copied(b) for b in resuming]
    resuming.close()
    assert same_batches(rest, full[4:])
