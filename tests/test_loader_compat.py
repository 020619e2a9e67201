"""``fastload.DataLoader`` as a drop-in for ``torch.utils.data.DataLoader`` on plain torch datasets.

Every scenario runs through torch's own loader (the reference) and through the candidate, and
the two outcomes are compared batch by batch: the same types and structure, ``torch.equal``
tensors, the same ``len()``, the same warnings, the same state of the global RNGs and of the
given generators afterwards, and the same exception type with torch's message kept. The
candidate is parametrized: ``torch`` runs the reference against itself, which checks that each
scenario is deterministic (the test is right); ``fastload`` is the loader under test.

Workers are forked processes (Linux default) except in the one ``spawn`` case; datasets are
small and defined at module level so that workers (and spawn) can pickle them.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    ConcatDataset,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
    default_convert,
    get_worker_info,
)
from torch.utils.data import DataLoader as TorchDataLoader

LoaderFactory = Callable[..., Any]
Kwargs = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Datasets, samplers, collate and worker_init functions (module level: workers pickle them)
# ---------------------------------------------------------------------------------------------


class Point(NamedTuple):
    x: int
    y: float


class PairDataset(Dataset[tuple[torch.Tensor, int]]):
    """The common case: (features, label)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((2, 3), float(index)), index % 3


class RichDataset(Dataset[dict[str, Any]]):
    """Every kind of value default_collate / default_convert handle, nested."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "tensor": torch.arange(3, dtype=torch.float32) + index,
            "array": np.full((2,), index, dtype=np.int16),
            "name": f"sample-{index}",
            "pair": (index, index / 2),
            "point": Point(index, index * 0.5),
            "flag": index % 2 == 0,
            "scalar": np.float64(index) / 3,
            "nested": [torch.tensor(index), {"deep": np.int64(index)}],
        }


class RandomDataset(Dataset[dict[str, Any]]):
    """Samples drawn from the global RNGs of torch, numpy and random, plus the worker's seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = get_worker_info()
        return {
            "index": index,
            "torch": torch.rand(2),
            "numpy": np.random.rand(),
            "python": random.random(),
            "worker": -1 if info is None else info.id,
            "worker_seed": -1 if info is None else info.seed,
        }


class WorkerInfoDataset(Dataset[tuple[int, int, int, int, bool]]):
    """What get_worker_info says inside a worker, and what worker_init_fn changed there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offset = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int, int, int, bool]:
        info = get_worker_info()
        if info is None:
            return index, -1, 0, self.offset, False
        return index, info.id, info.num_workers, self.offset, info.dataset is self


class PidDataset(Dataset[tuple[int, int]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


class FailingDataset(Dataset[int]):
    """Raises ``error`` for one index."""

    def __init__(self, n: int, bad_index: int, error: type[Exception]) -> None:
        self.n = n
        self.bad_index = bad_index
        self.error = error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad_index:
            raise self.error(f"sample {index} is broken")
        return index


class SlowFirstDataset(Dataset[int]):
    """Index 0 takes longer than the loader's timeout."""

    def __init__(self, n: int, delay_s: float) -> None:
        self.n = n
        self.delay_s = delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == 0:
            time.sleep(self.delay_s)
        return index


class RaggedDataset(Dataset[torch.Tensor]):
    """Tensors of different lengths: default_collate cannot stack them."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.zeros(index + 1)


class NoneDataset(Dataset[None]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> None:
        return None


class BatchedFetchDataset(Dataset[dict[str, Any]]):
    """Defines ``__getitems__``: torch fetches a whole batch with one call."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "fetched": "one"}

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        return [{"index": i, "fetched": f"batch of {len(indices)}"} for i in indices]


class ShardedIterable(IterableDataset[dict[str, Any]]):
    """Splits its range between workers by get_worker_info, as torch's docs show."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"index": i, "value": torch.tensor([i, -i]), "name": f"item-{i}"}


class UnshardedIterable(IterableDataset[int]):
    """Ignores workers: every worker yields everything (torch duplicates it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class SizedIterable(IterableDataset[int]):
    """Reports ``reported`` as its length and yields ``n`` items."""

    def __init__(self, n: int, reported: int) -> None:
        self.n = n
        self.reported = reported

    def __len__(self) -> int:
        return self.reported

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class RandomIterable(IterableDataset[dict[str, Any]]):
    """Sharded; each item draws from the worker's global RNGs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"index": i, "torch": torch.randint(0, 1 << 30, (1,)), "numpy": np.random.rand()}


class FailingIterable(IterableDataset[int]):
    def __init__(self, n: int, bad_item: int) -> None:
        self.n = n
        self.bad_item = bad_item

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            if i == self.bad_item:
                raise ValueError(f"item {i} is broken")
            yield i


class ParityBatchSampler(Sampler[list[int]]):
    """A custom batch sampler: even indices in pairs, then odd indices in threes."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        evens = list(range(0, self.n, 2))
        odds = list(range(1, self.n, 2))
        yield from (evens[i : i + 2] for i in range(0, len(evens), 2))
        yield from (odds[i : i + 3] for i in range(0, len(odds), 3))

    def __len__(self) -> int:
        evens, odds = (self.n + 1) // 2, self.n // 2
        return -(-evens // 2) + -(-odds // 3)


class UnsizedSampler:
    """Any re-iterable of indices works as a sampler; this one has no ``__len__``."""

    def __init__(self, indices: list[Any]) -> None:
        self.indices = indices

    def __iter__(self) -> Iterator[Any]:
        return iter(self.indices)


class EndlessSampler(Sampler[int]):
    """Cycles over the dataset without end, as iteration-based training does. It gives up
    long after any loop here stops, so a loader that drains its sampler fails, not hangs."""

    def __init__(self, n: int, limit: int = 10_000) -> None:
        self.n = n
        self.limit = limit

    def __iter__(self) -> Iterator[int]:
        for i in range(self.limit):
            yield (i * 7) % self.n
        raise RuntimeError("EndlessSampler drained: the loader read far ahead of its batches")


class CollatedBatch:
    """A user's own batch type, returned by a custom collate_fn."""

    def __init__(self, indices: list[int], total: torch.Tensor) -> None:
        self.indices = indices
        self.total = total


def collate_to_object(batch: list[tuple[torch.Tensor, int]]) -> CollatedBatch:
    return CollatedBatch(
        [int(x[0, 0]) for x, _ in batch], torch.stack([x for x, _ in batch]).sum(0)
    )


def collate_keep_list(batch: list[Any]) -> list[Any]:
    return list(batch)


def init_set_offset(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.offset = 100 * (worker_id + 1)  # type: ignore[union-attr]


def init_seed_numpy(worker_id: int) -> None:
    np.random.seed(1000 + worker_id)


def init_refuses(worker_id: int) -> None:
    raise RuntimeError(f"worker_init_fn refused worker {worker_id}")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def args(**kwargs: Any) -> Kwargs:
    return kwargs


# ---------------------------------------------------------------------------------------------
# Running one scenario through one loader, and comparing two outcomes
# ---------------------------------------------------------------------------------------------

ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def normalized(message: str) -> str:
    """Object reprs carry memory addresses, which differ between two runs."""
    return ADDRESS.sub("0x?", message)


@dataclass
class Outcome:
    """What a training loop can observe from one loader over some epochs."""

    epochs: list[list[Any]] = field(default_factory=list)
    length: int | None = None
    error: BaseException | None = None
    warnings: list[tuple[type[Warning], str]] = field(default_factory=list)
    torch_rng_after: torch.Tensor | None = None
    numpy_rng_after: np.ndarray | None = None
    python_rng_after: Any = None
    generator_states_after: list[torch.Tensor] = field(default_factory=list)


def given_generators(kwargs: Kwargs) -> list[torch.Generator]:
    """The generators the user handed over: the loader's and its samplers' own."""
    found = [kwargs.get("generator")]
    for name in ("sampler", "batch_sampler"):
        sampler = kwargs.get(name)
        found.append(getattr(sampler, "generator", None))
        found.append(getattr(getattr(sampler, "sampler", None), "generator", None))
    return [g for g in found if isinstance(g, torch.Generator)]


def close(loader: Any) -> None:
    closer = getattr(loader, "close", None)  # fastload's loader has one; torch's does not
    if callable(closer):
        closer()


def run(
    make_loader: LoaderFactory,
    make_args: Callable[[], Kwargs],
    *,
    epochs: int = 1,
    call_len: bool = False,
    before_epoch: Callable[[int], None] | None = None,
    drive: Callable[[Any], list[list[Any]]] | None = None,
    seed: int = 1234,
) -> Outcome:
    """Builds a loader from fresh arguments (new generator, sampler, dataset) and iterates it.

    The global RNGs are seeded first and restored afterwards, so two runs start from the same
    state and the test leaves no trace; their state after the run is part of the outcome.
    ``drive`` replaces the plain loop over ``epochs``: it gets the loader and returns what
    it saw, one list per pass.
    """
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    outcome = Outcome()
    loader = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kwargs = make_args()
            try:
                loader = make_loader(**kwargs)
                if call_len:
                    outcome.length = len(loader)
                if drive is not None:
                    outcome.epochs = drive(loader)
                for epoch in range(0 if drive else epochs):
                    if before_epoch is not None:
                        before_epoch(epoch)
                    batches: list[Any] = []
                    outcome.epochs.append(batches)
                    batches.extend(loader)  # keeps the batches before an error
            except Exception as error:
                # Without the traceback the frames (and a multiprocessing iterator) go now.
                outcome.error = error.with_traceback(None)
            finally:
                if loader is not None:
                    close(loader)
                del loader
        outcome.warnings = [(w.category, normalized(str(w.message))) for w in caught]
        outcome.torch_rng_after = torch.get_rng_state()
        outcome.numpy_rng_after = np.random.get_state()[1].copy()  # type: ignore[index]
        outcome.python_rng_after = random.getstate()
        outcome.generator_states_after = [g.get_state() for g in given_generators(kwargs)]
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])
    return outcome


def assert_same_data(expected: Any, actual: Any, where: str = "batch") -> None:
    """Same types all the way down, same keys in the same order, equal tensors and arrays."""
    assert type(actual) is type(expected), (
        f"{where}: torch gives {type(expected).__name__}, got {type(actual).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert (actual.dtype, actual.shape, actual.device) == (
            expected.dtype,
            expected.shape,
            expected.device,
        ), f"{where}: torch gives {expected.dtype} {tuple(expected.shape)}, got {actual!r}"
        assert torch.equal(actual, expected), f"{where}: torch gives {expected}, got {actual}"
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert np.array_equal(actual, expected), f"{where}: torch gives {expected}, got {actual}"
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same_data(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_data(e, a, f"{where}[{i}]")
    elif hasattr(expected, "__dict__"):
        assert_same_data(vars(expected), vars(actual), f"{where}.__dict__")
    else:
        assert actual == expected, f"{where}: torch gives {expected!r}, got {actual!r}"


def assert_same_error(
    expected: BaseException | None, actual: BaseException | None, contains: str | None = None
) -> None:
    """Same type; the message keeps torch's (or, for worker errors whose message carries a
    traceback, both name the original error)."""
    if expected is None:
        assert actual is None, f"torch raises nothing here, got {type(actual).__name__}: {actual}"
        return
    assert actual is not None, f"torch raises {type(expected).__name__}: {expected}; got nothing"
    assert type(actual) is type(expected), (
        f"torch raises {type(expected).__name__}: {expected}\ngot {type(actual).__name__}: {actual}"
    )
    if contains is None:
        assert normalized(str(expected)) in normalized(str(actual)), (
            f"torch says: {expected}\ngot: {actual}"
        )
    else:
        assert contains in str(expected), f"the test expects torch to say {contains!r}: {expected}"
        assert contains in str(actual), f"the message must name the original error: {actual}"


def assert_same_outcome(expected: Outcome, actual: Outcome, contains: str | None = None) -> None:
    assert_same_error(expected.error, actual.error, contains)
    assert actual.length == expected.length, f"len(): torch {expected.length}, got {actual.length}"
    assert len(actual.epochs) == len(expected.epochs), "a different number of epochs ran"
    for epoch, (want, got) in enumerate(zip(expected.epochs, actual.epochs, strict=True)):
        assert len(got) == len(want), (
            f"epoch {epoch}: torch gives {len(want)} batches, got {len(got)}"
        )
        for i, (e, a) in enumerate(zip(want, got, strict=True)):
            assert_same_data(e, a, f"epoch {epoch} batch {i}")
    assert actual.warnings == expected.warnings, "the warnings differ from torch's"
    assert torch.equal(actual.torch_rng_after, expected.torch_rng_after), (  # type: ignore[arg-type]
        "the global torch RNG was consumed differently from torch's loader"
    )
    assert np.array_equal(actual.numpy_rng_after, expected.numpy_rng_after), (  # type: ignore[arg-type]
        "the global numpy RNG was changed differently"
    )
    assert actual.python_rng_after == expected.python_rng_after, "the python RNG was changed"
    assert len(actual.generator_states_after) == len(expected.generator_states_after)
    for want_state, got_state in zip(
        expected.generator_states_after, actual.generator_states_after, strict=True
    ):
        assert torch.equal(got_state, want_state), (
            "a given torch.Generator was left in a different state than torch's loader leaves it"
        )


@pytest.fixture(params=["torch", "fastload"])
def candidate(request: pytest.FixtureRequest) -> LoaderFactory:
    """``torch`` checks each scenario against itself; ``fastload`` is the loader under test."""
    if request.param == "torch":
        return TorchDataLoader
    import fastload

    return fastload.DataLoader  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------------
# Scenarios whose outcomes must match batch by batch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    id: str
    make_args: Callable[[], Kwargs]
    epochs: int = 1
    call_len: bool = True
    before_epoch: Callable[[int], None] | None = None
    error_contains: str | None = None  # worker errors: what both messages must say

    def outcome(self, make_loader: LoaderFactory) -> Outcome:
        return run(
            make_loader,
            self.make_args,
            epochs=self.epochs,
            call_len=self.call_len,
            before_epoch=self.before_epoch,
        )


def reseed_before_epoch(epoch: int) -> None:
    torch.manual_seed(100 + epoch)


MAP_STYLE = [
    Scenario("default-args", lambda: args(dataset=PairDataset(5))),
    Scenario("rich-samples-batch-4", lambda: args(dataset=RichDataset(10), batch_size=4)),
    Scenario(
        "drop-last",
        lambda: args(dataset=RichDataset(10), batch_size=4, drop_last=True),
    ),
    Scenario(
        "shuffle-generator-two-epochs",
        lambda: args(dataset=PairDataset(12), batch_size=5, shuffle=True, generator=gen(7)),
        epochs=2,
    ),
    Scenario(
        "shuffle-global-seed-before-iter",
        lambda: args(dataset=PairDataset(12), batch_size=5, shuffle=True),
        epochs=2,
        before_epoch=reseed_before_epoch,
    ),
    Scenario(
        "shuffle-global-seed-at-start",
        lambda: args(dataset=RichDataset(9), batch_size=2, shuffle=True, drop_last=True),
        epochs=2,
    ),
    Scenario(
        "shuffle-false-explicit",
        lambda: args(dataset=PairDataset(7), batch_size=3, shuffle=False),
    ),
    Scenario(
        "subset-random-sampler",
        lambda: args(
            dataset=PairDataset(20),
            batch_size=3,
            sampler=SubsetRandomSampler([1, 4, 5, 9, 13, 17, 19], generator=gen(3)),
        ),
        epochs=2,
    ),
    Scenario(
        "weighted-random-sampler-generator",
        lambda: args(
            dataset=PairDataset(6),
            batch_size=4,
            sampler=WeightedRandomSampler([0.1, 5, 1, 0, 2, 3], 14, generator=gen(11)),
        ),
        epochs=2,
    ),
    Scenario(
        "weighted-random-sampler-global-rng",
        lambda: args(
            dataset=PairDataset(6),
            batch_size=2,
            sampler=WeightedRandomSampler([1, 2, 3, 4, 5, 6], 6, replacement=False),
        ),
    ),
    Scenario(
        "sampler-as-list",
        lambda: args(dataset=PairDataset(8), batch_size=3, sampler=[7, 3, 3, 0, 5]),
    ),
    Scenario(
        "custom-batch-sampler",
        lambda: args(dataset=RichDataset(9), batch_sampler=ParityBatchSampler(9)),
    ),
    Scenario(
        "batch-sampler-as-list",
        lambda: args(dataset=PairDataset(8), batch_sampler=[[0, 1], [5], [2, 3, 4], [7, 6]]),
        epochs=2,
    ),
    Scenario(
        "batch-sampler-over-random-sampler",
        lambda: args(
            dataset=PairDataset(10),
            batch_sampler=BatchSampler(RandomSampler(range(10), generator=gen(5)), 3, False),
        ),
        epochs=2,
    ),
    Scenario("no-auto-batching", lambda: args(dataset=RichDataset(4), batch_size=None)),
    Scenario(
        "no-auto-batching-shuffled",
        lambda: args(dataset=PairDataset(6), batch_size=None, shuffle=True, generator=gen(2)),
    ),
    Scenario(
        "no-auto-batching-sampler",
        lambda: args(dataset=RichDataset(6), batch_size=None, sampler=[5, 0, 2]),
    ),
    Scenario(
        "collate-to-user-object",
        lambda: args(dataset=PairDataset(7), batch_size=3, collate_fn=collate_to_object),
    ),
    Scenario(
        "collate-keep-list",
        lambda: args(dataset=RichDataset(5), batch_size=2, collate_fn=collate_keep_list),
    ),
    Scenario(
        "default-collate-explicit",
        lambda: args(dataset=RichDataset(5), batch_size=2, collate_fn=default_collate),
    ),
    Scenario(
        "default-convert-with-batches",
        lambda: args(dataset=RichDataset(5), batch_size=2, collate_fn=default_convert),
    ),
    Scenario(
        "tensor-dataset-shuffled",
        lambda: args(
            dataset=TensorDataset(torch.arange(20).view(10, 2), torch.arange(10) % 2),
            batch_size=4,
            shuffle=True,
            generator=gen(9),
        ),
    ),
    Scenario("getitems-batch-fetch", lambda: args(dataset=BatchedFetchDataset(7), batch_size=3)),
    Scenario(
        "main-process-rng-draws",
        lambda: args(dataset=RandomDataset(6), batch_size=2),
        epochs=2,
    ),
    Scenario(
        "main-process-rng-draws-generator",
        lambda: args(dataset=RandomDataset(6), batch_size=2, shuffle=True, generator=gen(4)),
    ),
    Scenario(
        "pin-memory",  # on CPU torch warns that nothing is pinned; the warning is compared
        lambda: args(dataset=RichDataset(5), batch_size=2, pin_memory=True),
    ),
    Scenario(
        "pin-memory-device-deprecated",  # torch warns that pin_memory_device is ignored
        lambda: args(dataset=PairDataset(3), pin_memory=True, pin_memory_device="cpu"),
    ),
    Scenario(
        "plain-list-as-dataset",
        lambda: args(dataset=[(i, f"s{i}") for i in range(7)], batch_size=3, shuffle=True),
    ),
    Scenario(
        "concat-of-subsets",
        lambda: args(
            dataset=ConcatDataset([Subset(PairDataset(10), [9, 2, 4]), PairDataset(3)]),
            batch_size=2,
            shuffle=True,
            generator=gen(17),
        ),
    ),
    Scenario(
        "sampler-without-len",
        lambda: args(dataset=PairDataset(6), batch_size=2, sampler=UnsizedSampler([4, 1, 1, 5])),
        call_len=False,
    ),
    Scenario(
        "batch-sampler-without-len",
        lambda: args(dataset=PairDataset(6), batch_sampler=UnsizedSampler([[4, 1], [0]])),
        call_len=False,
    ),
    Scenario(
        "string-keys",  # a dict is a map-style dataset for torch: any key the sampler yields
        lambda: args(
            dataset={"cat": torch.ones(2), "dog": torch.zeros(2), "emu": torch.full((2,), 7.0)},
            batch_size=2,
            sampler=["emu", "cat", "dog"],
        ),
    ),
    Scenario(
        "tuple-keys-no-auto-batching",
        lambda: args(
            dataset={(0, "a"): 1, (1, "b"): 2}, batch_size=None, sampler=[(1, "b"), (0, "a")]
        ),
    ),
    Scenario(
        "generator-without-shuffle",  # torch still draws the workers' base seed from it
        lambda: args(dataset=RandomDataset(6), batch_size=2, num_workers=2, generator=gen(19)),
    ),
]

WORKERS = [
    Scenario(
        "two-workers-in-order",
        lambda: args(dataset=RichDataset(11), batch_size=3, num_workers=2),
        epochs=2,
    ),
    Scenario(
        "two-workers-shuffle-generator",
        lambda: args(
            dataset=PairDataset(13), batch_size=2, shuffle=True, generator=gen(21), num_workers=2
        ),
        epochs=2,
    ),
    Scenario(
        "two-workers-drop-last",
        lambda: args(dataset=PairDataset(11), batch_size=3, drop_last=True, num_workers=2),
    ),
    Scenario(
        "two-workers-no-auto-batching",
        lambda: args(dataset=RichDataset(5), batch_size=None, num_workers=2),
    ),
    Scenario(
        "two-workers-custom-batch-sampler",
        lambda: args(dataset=PairDataset(9), batch_sampler=ParityBatchSampler(9), num_workers=2),
    ),
    Scenario(
        "two-workers-collate-to-user-object",
        lambda: args(
            dataset=PairDataset(7), batch_size=3, collate_fn=collate_to_object, num_workers=2
        ),
    ),
    Scenario(
        "worker-rng-seeded-from-generator",
        lambda: args(dataset=RandomDataset(8), batch_size=2, num_workers=2, generator=gen(5)),
        epochs=2,
    ),
    Scenario(
        "worker-rng-seeded-from-global-rng",
        lambda: args(dataset=RandomDataset(8), batch_size=2, num_workers=2),
        epochs=2,
        before_epoch=reseed_before_epoch,
    ),
    Scenario(
        "worker-init-fn-sets-dataset-attribute",
        lambda: args(
            dataset=WorkerInfoDataset(7),
            batch_size=2,
            num_workers=2,
            worker_init_fn=init_set_offset,
        ),
    ),
    Scenario(
        "worker-init-fn-seeds-numpy",
        lambda: args(
            dataset=RandomDataset(6), batch_size=3, num_workers=2, worker_init_fn=init_seed_numpy
        ),
    ),
    Scenario(
        "prefetch-factor-1",
        lambda: args(dataset=PairDataset(9), batch_size=2, num_workers=2, prefetch_factor=1),
    ),
    Scenario(
        "prefetch-factor-4",
        lambda: args(dataset=PairDataset(9), batch_size=2, num_workers=2, prefetch_factor=4),
    ),
    Scenario(
        "persistent-workers-two-epochs",
        lambda: args(
            dataset=RandomDataset(8),
            batch_size=3,
            shuffle=True,
            generator=gen(8),
            num_workers=2,
            persistent_workers=True,
        ),
        epochs=2,
    ),
    Scenario(
        "timeout-not-reached",
        lambda: args(dataset=PairDataset(6), batch_size=2, num_workers=2, timeout=30),
    ),
    Scenario(
        "pin-memory-two-workers",
        lambda: args(dataset=PairDataset(6), batch_size=2, num_workers=2, pin_memory=True),
    ),
    Scenario(
        "context-object-fork",
        lambda: args(
            dataset=PairDataset(6),
            batch_size=2,
            num_workers=2,
            multiprocessing_context=multiprocessing.get_context("fork"),
        ),
    ),
    Scenario(
        "context-spawn",  # the one spawn case: slow, so one worker and few samples
        lambda: args(
            dataset=RichDataset(4),
            batch_size=2,
            num_workers=1,
            multiprocessing_context="spawn",
            generator=gen(1),
        ),
    ),
]

ITERABLE = [
    Scenario(
        "iterable-no-workers",
        lambda: args(dataset=ShardedIterable(10), batch_size=4),
        call_len=False,
    ),
    Scenario(
        "iterable-two-workers-sharded",
        lambda: args(dataset=ShardedIterable(11), batch_size=3, num_workers=2),
        call_len=False,
        epochs=2,
    ),
    Scenario(
        "iterable-two-workers-drop-last",
        lambda: args(dataset=ShardedIterable(11), batch_size=2, drop_last=True, num_workers=2),
        call_len=False,
    ),
    Scenario(
        "iterable-two-workers-unsharded-duplicates",
        lambda: args(dataset=UnshardedIterable(5), batch_size=2, num_workers=2),
        call_len=False,
    ),
    Scenario(
        "iterable-shuffle-false-accepted",
        lambda: args(dataset=UnshardedIterable(5), batch_size=2, shuffle=False),
        call_len=False,
    ),
    Scenario("iterable-len", lambda: args(dataset=SizedIterable(10, 10), batch_size=4)),
    Scenario(
        "iterable-len-drop-last",
        lambda: args(dataset=SizedIterable(10, 10), batch_size=4, drop_last=True),
    ),
    Scenario(
        "iterable-len-no-auto-batching",
        lambda: args(dataset=SizedIterable(6, 6), batch_size=None),
    ),
    Scenario(
        "iterable-yields-more-than-len",  # torch warns once len() was asked and exceeded
        lambda: args(dataset=SizedIterable(7, 4), batch_size=None),
    ),
    Scenario(
        "iterable-no-auto-batching",
        lambda: args(dataset=ShardedIterable(5), batch_size=None),
        call_len=False,
    ),
    Scenario(
        "iterable-no-auto-batching-two-workers",
        lambda: args(dataset=ShardedIterable(5), batch_size=None, num_workers=2),
        call_len=False,
    ),
    Scenario(
        "iterable-worker-rng-from-generator",
        lambda: args(dataset=RandomIterable(8), batch_size=2, num_workers=2, generator=gen(6)),
        call_len=False,
    ),
]

ERRORS = [
    Scenario(
        "getitem-error-no-workers",
        lambda: args(dataset=FailingDataset(10, 5, ValueError), batch_size=2),
    ),
    Scenario(
        "getitem-error-two-workers",
        lambda: args(dataset=FailingDataset(10, 5, ValueError), batch_size=2, num_workers=2),
        error_contains="sample 5 is broken",
    ),
    Scenario(
        "getitem-keyerror-two-workers",
        lambda: args(dataset=FailingDataset(10, 6, KeyError), batch_size=2, num_workers=2),
        error_contains="sample 6 is broken",
    ),
    Scenario(
        "getitem-error-no-auto-batching-two-workers",
        lambda: args(dataset=FailingDataset(6, 3, TypeError), batch_size=None, num_workers=2),
        error_contains="sample 3 is broken",
    ),
    Scenario(
        "iterable-error-no-workers",
        lambda: args(dataset=FailingIterable(10, 6), batch_size=2),
        call_len=False,
    ),
    Scenario(
        "iterable-error-two-workers",
        lambda: args(dataset=FailingIterable(10, 7), batch_size=2, num_workers=2),
        call_len=False,
        error_contains="item 7 is broken",
    ),
    Scenario(
        "worker-init-fn-error",
        lambda: args(dataset=PairDataset(4), num_workers=1, worker_init_fn=init_refuses),
        error_contains="worker_init_fn refused worker 0",
    ),
    Scenario(
        "collate-cannot-stack-no-workers",
        lambda: args(dataset=RaggedDataset(), batch_size=2),
    ),
    Scenario(
        "collate-cannot-stack-two-workers",
        lambda: args(dataset=RaggedDataset(), batch_size=2, num_workers=2),
        error_contains="stack expects each tensor to be equal size",
    ),
    Scenario("collate-none", lambda: args(dataset=NoneDataset(), batch_size=2)),
    Scenario(
        "timeout-reached",  # the worker sleeps past the timeout on index 0
        lambda: args(dataset=SlowFirstDataset(4, 1.0), num_workers=1, timeout=0.25),
    ),
    Scenario(
        "timeout-without-workers",  # torch refuses at iter() time
        lambda: args(dataset=PairDataset(4), timeout=1),
    ),
    Scenario(
        "len-of-unsized-iterable",
        lambda: args(dataset=ShardedIterable(4), batch_size=2),
    ),
]


@pytest.mark.parametrize("scenario", MAP_STYLE + WORKERS + ITERABLE + ERRORS, ids=lambda s: s.id)
def test_same_batches_as_torch(scenario: Scenario, candidate: LoaderFactory) -> None:
    expected = scenario.outcome(TorchDataLoader)
    assert (expected.error is not None) == (scenario in ERRORS), "the scenario's premise"
    actual = scenario.outcome(candidate)
    assert_same_outcome(expected, actual, scenario.error_contains)


# ---------------------------------------------------------------------------------------------
# Argument validation: the same exception type, torch's message kept
# ---------------------------------------------------------------------------------------------

VALIDATION = {
    "negative-num-workers": lambda: args(dataset=PairDataset(4), num_workers=-1),
    "negative-timeout": lambda: args(dataset=PairDataset(4), timeout=-1),
    "num-workers-checked-before-timeout": lambda: args(
        dataset=PairDataset(4), num_workers=-2, timeout=-1
    ),
    "prefetch-factor-without-workers": lambda: args(dataset=PairDataset(4), prefetch_factor=2),
    "negative-prefetch-factor": lambda: args(
        dataset=PairDataset(4), num_workers=2, prefetch_factor=-1
    ),
    "persistent-workers-without-workers": lambda: args(
        dataset=PairDataset(4), persistent_workers=True
    ),
    "sampler-with-shuffle": lambda: args(
        dataset=PairDataset(4), sampler=SequentialSampler(range(4)), shuffle=True
    ),
    "batch-sampler-with-batch-size": lambda: args(
        dataset=PairDataset(4), batch_sampler=[[0, 1]], batch_size=2
    ),
    "batch-sampler-with-shuffle": lambda: args(
        dataset=PairDataset(4), batch_sampler=[[0, 1]], shuffle=True
    ),
    "batch-sampler-with-sampler": lambda: args(
        dataset=PairDataset(4), batch_sampler=[[0, 1]], sampler=[0, 1]
    ),
    "batch-sampler-with-drop-last": lambda: args(
        dataset=PairDataset(4), batch_sampler=[[0, 1]], drop_last=True
    ),
    "batch-sampler-with-shuffle-and-sampler": lambda: args(
        dataset=PairDataset(4), batch_sampler=[[0, 1]], sampler=[0, 1], shuffle=True
    ),
    "no-auto-batching-with-drop-last": lambda: args(
        dataset=PairDataset(4), batch_size=None, drop_last=True
    ),
    "zero-batch-size": lambda: args(dataset=PairDataset(4), batch_size=0),
    "negative-batch-size": lambda: args(dataset=PairDataset(4), batch_size=-3),
    "bool-batch-size": lambda: args(dataset=PairDataset(4), batch_size=True),
    "non-bool-drop-last": lambda: args(dataset=PairDataset(4), batch_size=2, drop_last="yes"),
    "iterable-with-shuffle": lambda: args(dataset=ShardedIterable(4), shuffle=True),
    "iterable-with-sampler": lambda: args(dataset=ShardedIterable(4), sampler=[0, 1]),
    "iterable-with-batch-sampler": lambda: args(dataset=ShardedIterable(4), batch_sampler=[[0]]),
    "iterable-shuffle-checked-before-sampler": lambda: args(
        dataset=ShardedIterable(4), shuffle=True, sampler=[0]
    ),
    "unknown-start-method": lambda: args(
        dataset=PairDataset(4), num_workers=2, multiprocessing_context="teleport"
    ),
    "context-of-wrong-type": lambda: args(
        dataset=PairDataset(4), num_workers=2, multiprocessing_context=5
    ),
    "context-without-workers": lambda: args(dataset=PairDataset(4), multiprocessing_context="fork"),
}


@pytest.mark.parametrize("make_args", VALIDATION.values(), ids=VALIDATION.keys())
def test_same_validation_errors(make_args: Callable[[], Kwargs], candidate: LoaderFactory) -> None:
    expected = run(TorchDataLoader, make_args)
    assert isinstance(expected.error, ValueError | TypeError), "torch must refuse these arguments"
    assert expected.epochs == [], "torch refuses these in the constructor"
    actual = run(candidate, make_args)
    assert_same_error(expected.error, actual.error)
    assert actual.epochs == [], "the constructor must refuse them, not the first iteration"


@pytest.mark.parametrize(
    "attribute",
    ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"],
)
def test_attributes_torch_freezes_after_init(attribute: str, candidate: LoaderFactory) -> None:
    errors = []
    for make_loader in (TorchDataLoader, candidate):
        loader = make_loader(PairDataset(4), batch_size=2)
        with pytest.raises(ValueError, match="should not be set after") as raised:
            setattr(loader, attribute, getattr(loader, attribute))
        errors.append(str(raised.value))
        close(loader)
    assert errors[1] == errors[0]


def test_positional_arguments_in_torch_order(candidate: LoaderFactory) -> None:
    """dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, collate_fn,
    pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context, generator."""

    def positional(make_loader: LoaderFactory) -> Callable[..., Any]:
        def build(**_: Any) -> Any:
            return make_loader(
                RichDataset(9), 4, True, None, None, 0, collate_keep_list, False, True, 0, None,
                None, gen(12),
            )  # fmt: skip

        return build

    expected = run(positional(TorchDataLoader), dict, call_len=True)
    actual = run(positional(candidate), dict, call_len=True)
    assert_same_outcome(expected, actual)


# ---------------------------------------------------------------------------------------------
# Attributes users read
# ---------------------------------------------------------------------------------------------


def describe(loader: Any, given: Kwargs) -> dict[str, Any]:
    """The loader's public attributes, with objects the user passed compared by identity and
    objects the loader made described by type and settings."""
    plain = [
        "batch_size",
        "drop_last",
        "num_workers",
        "pin_memory",
        "timeout",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    ]
    seen: dict[str, Any] = {name: getattr(loader, name) for name in plain}
    seen["dataset is given"] = loader.dataset is given["dataset"]
    for name in ("sampler", "batch_sampler", "collate_fn", "generator", "worker_init_fn"):
        value = getattr(loader, name)
        if name in given:
            seen[name] = ("the given object", value is given[name])
        else:
            seen[name] = type(value).__name__
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler | SequentialSampler) and "sampler" not in given:
        seen["sampler data_source is dataset"] = sampler.data_source is given["dataset"]
    if isinstance(sampler, RandomSampler) and "sampler" not in given:
        seen["sampler generator is given"] = sampler.generator is given.get("generator")
    batch_sampler = loader.batch_sampler
    if isinstance(batch_sampler, BatchSampler) and "batch_sampler" not in given:
        seen["batch_sampler settings"] = (
            batch_sampler.sampler is loader.sampler,
            batch_sampler.batch_size,
            batch_sampler.drop_last,
        )
    if "collate_fn" not in given:
        seen["collate_fn is"] = (
            "default_collate"
            if loader.collate_fn is default_collate
            else "default_convert"
            if loader.collate_fn is default_convert
            else repr(loader.collate_fn)
        )
    context = loader.multiprocessing_context
    seen["multiprocessing_context"] = (
        None if context is None else (type(context).__name__, context.get_start_method())
    )
    if isinstance(given.get("multiprocessing_context"), multiprocessing.context.BaseContext):
        seen["context is given"] = context is given["multiprocessing_context"]
    return seen


ATTRIBUTES = {
    "defaults": lambda: args(dataset=PairDataset(5)),
    "everything-set": lambda: args(
        dataset=PairDataset(9),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=collate_to_object,
        pin_memory=True,
        drop_last=True,
        timeout=5.0,
        worker_init_fn=init_seed_numpy,
        multiprocessing_context="spawn",
        generator=gen(3),
        prefetch_factor=3,
        persistent_workers=True,
        pin_memory_device="",
        in_order=False,
    ),
    "workers-default-prefetch": lambda: args(dataset=PairDataset(9), num_workers=1),
    "shuffle-default-generator": lambda: args(dataset=PairDataset(9), shuffle=True),
    "given-sampler-no-auto-batching": lambda: args(
        dataset=PairDataset(9), sampler=SequentialSampler(range(9)), batch_size=None
    ),
    "given-batch-sampler": lambda: args(
        dataset=PairDataset(9), batch_sampler=ParityBatchSampler(9)
    ),
    "context-object": lambda: args(
        dataset=PairDataset(9),
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
    ),
    "iterable": lambda: args(dataset=ShardedIterable(9), batch_size=4),
    "iterable-no-auto-batching": lambda: args(dataset=ShardedIterable(9), batch_size=None),
}


@pytest.mark.parametrize("make_args", ATTRIBUTES.values(), ids=ATTRIBUTES.keys())
def test_same_attributes(make_args: Callable[[], Kwargs], candidate: LoaderFactory) -> None:
    seen = []
    for make_loader in (TorchDataLoader, candidate):
        given = make_args()
        loader = make_loader(**given)
        seen.append(describe(loader, given))
        close(loader)
    assert seen[1] == seen[0]


# ---------------------------------------------------------------------------------------------
# Behaviours compared through a property rather than batch equality
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "not-persistent"])
def test_persistent_workers_keep_their_processes(
    persistent: bool, candidate: LoaderFactory
) -> None:
    """With persistent_workers the second epoch runs in the same worker processes; without,
    in new ones. Apart from the pids, the batches match torch's."""

    def make_args() -> Kwargs:
        return args(
            dataset=PidDataset(6), batch_size=2, num_workers=2, persistent_workers=persistent
        )

    def split(outcome: Outcome) -> tuple[list[list[torch.Tensor]], bool]:
        assert outcome.error is None, outcome.error
        indices = [[batch[0] for batch in epoch] for epoch in outcome.epochs]
        pids = [{int(p) for batch in epoch for p in batch[1]} for epoch in outcome.epochs]
        assert os.getpid() not in pids[0] | pids[1], "samples must come from worker processes"
        assert len(pids[0]) == 2, "two workers share the epoch"
        return indices, pids[0] == pids[1]

    expected_indices, expected_same = split(run(TorchDataLoader, make_args, epochs=2))
    actual_indices, actual_same = split(run(candidate, make_args, epochs=2))
    assert expected_same is persistent, "the test's premise about torch"
    assert actual_same is persistent, "workers kept (or not) across epochs as torch does"
    assert_same_data(expected_indices, actual_indices, "indices")


def test_unordered_results_hold_the_same_batches(candidate: LoaderFactory) -> None:
    """in_order=False may reorder batches, never change them."""

    def make_args() -> Kwargs:
        return args(dataset=PairDataset(10), batch_size=2, num_workers=2, in_order=False)

    def as_set(outcome: Outcome) -> set[tuple[int, ...]]:
        assert outcome.error is None, outcome.error
        return {
            (int(batch[0][0, 0, 0]), *(int(v) for v in batch[1])) for batch in outcome.epochs[0]
        }

    expected = run(TorchDataLoader, make_args)
    actual = run(candidate, make_args)
    assert len(actual.epochs[0]) == len(expected.epochs[0]) == 5
    assert as_set(actual) == as_set(expected)


def break_after_two_then_full_pass(loader: Any) -> list[list[Any]]:
    first = []
    for i, batch in enumerate(loader):
        first.append(batch)
        if i == 1:
            break
    return [first, list(loader)]


def two_iterators_at_once(loader: Any) -> list[list[Any]]:
    return [list(zip(loader, loader, strict=True))]


def iterator_protocol(loader: Any) -> list[list[Any]]:
    iterator = iter(loader)
    seen: list[Any] = [iter(iterator) is iterator, len(loader), len(iterator), next(iterator)]
    seen.extend(iterator)
    for _ in range(2):  # exhausted stays exhausted
        with pytest.raises(StopIteration):
            next(iterator)
    return [seen]


def error_then_next_pass(loader: Any) -> list[list[Any]]:
    """Catches the error of each pass and starts another, as a forgiving training loop does."""
    passes = []
    for _ in range(2):
        seen: list[Any] = []
        try:
            seen.extend(loader)
        except ValueError as error:
            seen.append(("raised", type(error), "sample 5 is broken" in str(error)))
            # torch's re-raise leaves a cycle (exception -> traceback -> frame -> exception)
            # holding the iterator; cut it so the old workers go before new ones fork.
            error.with_traceback(None)
        passes.append(seen)
    return passes


def take_three(loader: Any) -> list[list[Any]]:
    iterator = iter(loader)
    return [[next(iterator) for _ in range(3)]]


def set_sampler_epoch_each_pass(loader: Any) -> list[list[Any]]:
    passes = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        passes.append(list(loader))
    return passes


DRIVES = {
    "endless-sampler-take-three": (
        take_three,
        lambda: args(dataset=PairDataset(5), batch_size=2, sampler=EndlessSampler(5)),
    ),
    "endless-sampler-take-three-workers": (
        take_three,
        lambda: args(
            dataset=PairDataset(5), batch_size=2, sampler=EndlessSampler(5), num_workers=2
        ),
    ),
    "endless-batch-sampler-take-three": (
        take_three,
        lambda: args(
            dataset=PairDataset(5), batch_sampler=BatchSampler(EndlessSampler(5), 2, False)
        ),
    ),
    "distributed-sampler-set-epoch": (
        set_sampler_epoch_each_pass,
        lambda: args(
            dataset=PairDataset(11),
            batch_size=2,
            sampler=DistributedSampler(PairDataset(11), num_replicas=2, rank=1, seed=3),
        ),
    ),
    "break-then-full-pass": (
        break_after_two_then_full_pass,
        lambda: args(
            dataset=PairDataset(12), batch_size=2, shuffle=True, generator=gen(13), num_workers=2
        ),
    ),
    "break-then-full-pass-persistent": (
        break_after_two_then_full_pass,
        lambda: args(
            dataset=PairDataset(12),
            batch_size=2,
            shuffle=True,
            num_workers=2,
            persistent_workers=True,
        ),
    ),
    "two-iterators-at-once": (
        two_iterators_at_once,
        lambda: args(dataset=PairDataset(7), batch_size=2, shuffle=True, generator=gen(14)),
    ),
    "two-iterators-at-once-workers": (
        two_iterators_at_once,
        lambda: args(dataset=RandomDataset(6), batch_size=2, shuffle=True, num_workers=1),
    ),
    "iterator-protocol": (
        iterator_protocol,
        lambda: args(dataset=PairDataset(7), batch_size=3, shuffle=True),
    ),
    "iterator-protocol-workers": (
        iterator_protocol,
        lambda: args(dataset=PairDataset(7), batch_size=3, num_workers=2),
    ),
    "error-then-next-pass": (
        error_then_next_pass,
        lambda: args(dataset=FailingDataset(8, 5, ValueError), batch_size=2),
    ),
    "error-then-next-pass-workers": (
        error_then_next_pass,
        lambda: args(dataset=FailingDataset(8, 5, ValueError), batch_size=2, num_workers=2),
    ),
    "error-then-next-pass-persistent": (
        error_then_next_pass,
        lambda: args(
            dataset=FailingDataset(8, 5, ValueError),
            batch_size=2,
            num_workers=2,
            persistent_workers=True,
        ),
    ),
}


@pytest.mark.parametrize(("drive", "make_args"), DRIVES.values(), ids=DRIVES.keys())
def test_same_batches_when_iterated_unusually(
    drive: Callable[[Any], list[list[Any]]],
    make_args: Callable[[], Kwargs],
    candidate: LoaderFactory,
) -> None:
    """Loops left early, two live iterators, the iterator protocol, a pass after an error."""
    expected = run(TorchDataLoader, make_args, drive=drive)
    assert expected.error is None, expected.error
    actual = run(candidate, make_args, drive=drive)
    assert_same_outcome(expected, actual)


def test_too_many_workers_warns_as_torch_does(candidate: LoaderFactory) -> None:
    """torch warns at construction when num_workers exceeds the usable CPUs (no process
    starts: the loader is never iterated)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    caught = []
    for make_loader in (TorchDataLoader, candidate):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loader = make_loader(PairDataset(4), num_workers=(cpus or 1) + 1)
            close(loader)
        caught.append([(w.category, normalized(str(w.message))) for w in seen])
    assert caught[0], "the test's premise: torch warns"
    assert caught[1] == caught[0]


def test_pinned_batches_with_cuda(candidate: LoaderFactory) -> None:
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA; the pin-memory scenarios check batches on CPU")
    for make_loader in (TorchDataLoader, candidate):
        loader = make_loader(PairDataset(6), batch_size=2, num_workers=2, pin_memory=True)
        for features, labels in loader:
            assert features.is_pinned()
            assert labels.is_pinned()
        close(loader)


# ---------------------------------------------------------------------------------------------
# fastload's extras do not change what a plain dataset's batches hold
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_device_cpu_extra_keeps_batches(device: str | torch.device) -> None:
    import fastload

    def make_args() -> Kwargs:
        return args(dataset=RichDataset(7), batch_size=3, shuffle=True, generator=gen(3))

    expected = run(TorchDataLoader, make_args, call_len=True)
    actual = run(functools.partial(fastload.DataLoader, device=device), make_args, call_len=True)
    assert_same_outcome(expected, actual)


def test_is_a_torch_dataloader(candidate: LoaderFactory) -> None:
    """Libraries check ``isinstance(x, torch.utils.data.DataLoader)`` before using a loader."""
    loader = candidate(PairDataset(3))
    assert isinstance(loader, TorchDataLoader)
    close(loader)
