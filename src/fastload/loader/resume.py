"""What makes an iteration resumable: the random state it started from and what to skip.

torch's samplers draw their randomness when iterated (``RandomSampler`` takes a seed from
the loader's generator, or from torch's global generator when there is none). Recording the
generator's state at that moment and replaying it on resume gives the same order; skipping
the index batches already consumed then gives exactly the rest of the epoch, without
loading a single skipped sample.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def rng_state(generator: torch.Generator | None) -> str:
    """The generator's state (torch's global CPU generator for None), as JSON-safe text."""
    state = torch.get_rng_state() if generator is None else generator.get_state()
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _as_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def set_rng_state(generator: torch.Generator, state: str) -> None:
    generator.set_state(_as_tensor(state))


@contextlib.contextmanager
def replaying(generator: torch.Generator | None, state: str | None) -> Iterator[None]:
    """Runs the block with the generator set to ``state``. A private generator keeps going
    from there (as it did the first time); torch's global one is restored afterwards, so a
    resume does not change the training script's own random stream."""
    if state is None:
        yield
    elif generator is not None:
        set_rng_state(generator, state)
        yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(_as_tensor(state))
            yield


class ResumableIndex:
    """The loader's index sampler (its batch sampler, or its sampler without batching) with
    a record of the random state each pass started from.

    While ``resuming(skip, replay)`` is active, every ``iter()`` replays the random state and
    drops ``skip`` items: torch's iterators call ``iter()`` on the sampler more than once
    while they start, and each call must give the same resumed sequence.
    """

    def __init__(self, inner: Iterable[Any], generator: torch.Generator | None) -> None:
        self.inner = inner
        self.generator = generator
        self._skip = 0
        self._replay: str | None = None
        self.current: _Pass | None = None  # the pass torch's iterator reads from

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    @contextlib.contextmanager
    def resuming(self, skip: int, replay: str | None) -> Iterator[None]:
        self._skip, self._replay = skip, replay
        try:
            yield
        finally:
            self._skip, self._replay = 0, None

    def __iter__(self) -> Iterator[Any]:
        self.current = _Pass(self.inner, self.generator, self._skip, self._replay)
        return self.current


class _Pass:
    """One pass over the sampler. The random state is taken at the first ``next()``, where
    samplers draw their seed (after torch's iterator drew its base seed), and a resume
    replays it there."""

    def __init__(
        self, inner: Iterable[Any], generator: torch.Generator | None, skip: int, replay: str | None
    ) -> None:
        self._inner = inner
        self._generator = generator
        self._skip = skip
        self._replay = replay
        self._items: Iterator[Any] | None = None
        self.started_from: str | None = None

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self._items is None:
            self._items = self._start()
        return next(self._items)

    def _start(self) -> Iterator[Any]:
        replay = self._replay
        self.started_from = replay if replay is not None else rng_state(self._generator)
        if replay is None and self._skip == 0:
            return iter(self._inner)
        with replaying(self._generator, replay):
            items = iter(self._inner)
            for _ in range(self._skip):
                if next(items, _END) is _END:
                    return iter(())
            first = next(items, _END)  # the sampler draws its seed here: inside the replay
        return iter(()) if first is _END else itertools.chain([first], items)


_END = object()
