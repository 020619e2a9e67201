"""``ShardedSampler``: one rank's share of the plan, in ``DistributedSampler``'s shape.

The plan (``fastload.plan``) decides the order; this module only finds the rank and world
size, counts what it has yielded, and turns that count into a resume state::

    sampler = fl.ShardedSampler(dataset, seed=0, shuffle=True)   # rank/world from torchrun
    loader = torch.utils.data.DataLoader(dataset, batch_size=256, sampler=sampler)
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            ...
    state = sampler.state_dict()   # JSON-serializable; load it at any world size

It counts the indices it has *yielded*, as torchdata's stateful samplers do: a DataLoader
that prefetches makes that count run ahead of the training step, so a loader that knows
what was consumed (``fl.DataLoader``) should save its own count rather than this one.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.distributed as dist
from torch.utils.data import Sampler

from fastload.plan import (
    DEFAULT_WINDOW_SHARDS,
    Plan,
    PlanError,
    ResumeState,
    ShardFuture,
    num_batches,
)


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise PlanError(
            f"environment variable {name}={text!r} is not an integer; torchrun sets it to one, "
            f"so unset it or pass {name.lower()}= to the sampler"
        ) from None


def _as_int(value: object) -> int | None:
    """``value`` as a plain int if it is an integer (numpy's too), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def resolve_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the arguments, else an initialized ``torch.distributed`` group,
    else torchrun's ``RANK``/``WORLD_SIZE``, else a single process (0, 1)."""
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
        else:
            env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
            rank = (env_rank if env_rank is not None else 0) if rank is None else rank
            world_size = (
                (env_world if env_world is not None else 1) if world_size is None else world_size
            )
    world, rank_ = _as_int(world_size), _as_int(rank)
    if world is None or world < 1:
        raise PlanError(f"world_size must be an integer >= 1, got {world_size!r}")
    if rank_ is None or not 0 <= rank_ < world:
        raise PlanError(
            f"rank {rank!r} is out of range for world_size {world_size}: "
            f"ranks are 0..{world - 1}; check RANK/WORLD_SIZE or the arguments"
        )
    return rank_, world


def dataset_shard_sizes(dataset: object) -> npt.NDArray[np.int64]:
    """Samples per shard: ``dataset.shard_sizes``, else one shard per sample of a sized dataset."""
    sizes = getattr(dataset, "shard_sizes", None)
    if sizes is not None:
        arr = np.asarray(sizes)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise PlanError(
                f"{type(dataset).__name__}.shard_sizes must be a flat sequence of integers "
                f"(samples per shard), got {arr.dtype} of shape {arr.shape}"
            )
        if isinstance(dataset, Sized) and int(arr.sum()) != len(dataset):
            raise PlanError(
                f"{type(dataset).__name__}.shard_sizes add up to {int(arr.sum())} samples but "
                f"len(dataset) is {len(dataset)}; they must agree"
            )
        return arr.astype(np.int64)
    if not isinstance(dataset, Sized):
        raise PlanError(
            f"ShardedSampler needs a dataset with shard_sizes or a length; "
            f"{type(dataset).__name__} has neither (an iterable dataset shards itself)"
        )
    return np.ones(len(dataset), dtype=np.int64)


class ShardedSampler(Sampler[int]):
    """This rank's sample indices for each epoch: a contiguous share of a shard-aware shuffle.

    ``dataset`` is an object with ``shard_sizes`` (fastload datasets) or any sized dataset
    (each sample is then a shard of its own). ``rank``/``world_size`` (``num_replicas`` is an
    alias) default to the initialized process group, else torchrun's environment, else 0/1.
    ``window_shards`` shards are mixed at a time (see ``fastload.plan``); ``batch_size``,
    when given, is only checked and reported (``num_batches``): every rank reads the same
    number of samples, hence of batches.
    """

    def __init__(
        self,
        dataset: object,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_replicas: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        window_shards: int = DEFAULT_WINDOW_SHARDS,
        batch_size: int | None = None,
    ) -> None:
        super().__init__()
        if num_replicas is not None:
            if world_size is not None and world_size != num_replicas:
                raise PlanError(
                    f"world_size={world_size} and num_replicas={num_replicas} disagree; "
                    "num_replicas is an alias, pass one of them"
                )
            world_size = num_replicas
        if batch_size is not None:
            value = _as_int(batch_size)
            if value is None or value < 1:
                raise PlanError(f"batch_size must be an integer >= 1 or None, got {batch_size!r}")
            batch_size = value
        self.rank, self.world_size = resolve_world(rank, world_size)
        self.plan = Plan(
            dataset_shard_sizes(dataset),
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
            window_shards=window_shards,
        )
        self.batch_size = batch_size
        self.epoch = 0
        self._base = self.plan.resume_state(0)  # where the current iteration started
        self._pending: ResumeState | None = None  # loaded, for the next iteration
        self._yielded = 0
        self._iteration: object | None = None  # token of the live iterator, while it runs

    @property
    def seed(self) -> int:
        return self.plan.seed

    @property
    def shuffle(self) -> bool:
        return self.plan.shuffle

    @property
    def drop_last(self) -> bool:
        return self.plan.drop_last

    @property
    def num_replicas(self) -> int:
        return self.world_size

    @property
    def num_samples(self) -> int:
        """Samples per rank in a whole epoch (``DistributedSampler``'s attribute)."""
        return self.plan.rank_length(world_size=self.world_size)

    @property
    def total_size(self) -> int:
        return self.num_samples * self.world_size

    @property
    def num_batches(self) -> int:
        """Batches of ``batch_size`` in ``len(self)`` (the last one may be short)."""
        if self.batch_size is None:
            raise PlanError("num_batches needs a batch_size; pass batch_size= to the sampler")
        return num_batches(len(self), self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's order. A loaded state for the same epoch is kept (so calling
        ``set_epoch(start_epoch)`` after ``load_state_dict`` resumes); another epoch starts
        from its beginning."""
        value = _as_int(epoch)
        if value is None or value < 0:
            raise PlanError(f"epoch must be an integer >= 0, got {epoch!r}")
        epoch = value
        if epoch != self.epoch:
            self.epoch = epoch
            self._pending = None
            self._base = self.plan.resume_state(epoch)
            self._yielded = 0
            self._iteration = None

    def _next_start(self) -> ResumeState:
        """Where the running iteration started, else where the next one will."""
        if self._pending is None and self._iteration is not None:
            return self._base
        return self.upcoming_state()

    def upcoming_state(self) -> ResumeState:
        """Where the next ``iter()`` starts: the loaded state, else the epoch's beginning."""
        return self._pending if self._pending is not None else self.plan.resume_state(self.epoch)

    def __len__(self) -> int:
        """Indices the current iteration yields in all, or the next one if none is running."""
        start = self._next_start()
        return self.plan.rank_length(
            world_size=self.world_size, epoch=self.epoch, resume=start if start.segments else None
        )

    def __iter__(self) -> Iterator[int]:
        start = self.upcoming_state()
        self._pending = None
        chunks = self.plan.rank_chunks(
            self.epoch,
            world_size=self.world_size,
            rank=self.rank,
            resume=start if start.segments else None,
        )
        token = object()
        self._base, self._yielded, self._iteration = start, 0, token
        return self._count(chunks, token)

    def _count(self, chunks: Iterator[npt.NDArray[np.int64]], token: object) -> Iterator[int]:
        for chunk in chunks:
            for index in chunk.tolist():
                if self._iteration is token:  # an abandoned iterator no longer moves the state
                    self._yielded += 1
                yield index
        if self._iteration is token:
            self._iteration = None

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is in the epoch, as plain JSON-serializable values."""
        if self._pending is not None:
            return self._pending.to_dict()
        return self._base.then(self.world_size, self._yielded).to_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resumes at ``state`` on the next ``iter()``, at this sampler's world size and rank."""
        resume = ResumeState.from_dict(state)
        self.plan.check_state(resume)
        # Validates every segment against the dataset now rather than at the first batch.
        self.plan.rank_length(world_size=self.world_size, epoch=resume.epoch, resume=resume)
        self.epoch = resume.epoch
        self._pending = resume
        self._base = resume
        self._yielded = 0
        self._iteration = None

    def future_shards(
        self, epochs: Iterable[int] | None = None, ranks: Iterable[int] | None = None
    ) -> ShardFuture:
        """The shards ``ranks`` (default: this rank) will read in ``epochs`` (default: the
        current one), in order; see ``Plan.future``. The current epoch starts where this rank
        is now: mid-iteration, at the loaded state, else at the start of the next iteration."""
        here = self._next_start()
        if self._iteration is not None and self._pending is None:
            here = here.then(self.world_size, self._yielded)
        return self.plan.future(
            (self.epoch,) if epochs is None else epochs,
            world_size=self.world_size,
            ranks=(self.rank,) if ranks is None else ranks,
            resume=here if here.segments else None,
        )

    def __repr__(self) -> str:
        return (
            f"ShardedSampler(rank={self.rank}, world_size={self.world_size}, epoch={self.epoch}, "
            f"{self.plan!r})"
        )
