"""The plan: which samples every rank (and every worker) reads, in which order, each epoch.

A pure function of (shard sizes, seed, epoch, world size, rank): no I/O, no
``torch.distributed``, nothing global, numpy-vectorized (10 million samples in a fraction of
a second; a rank computes only its own share).

A dataset is a list of shards (the unit of caching); shard ``s`` holds the ``N_s`` samples
with the contiguous global indices ``[offsets[s], offsets[s] + N_s)``. Three steps:

1. **Epoch order**, the same for every world size and worker count. With ``shuffle``: the
   shards are permuted (seeded by ``(seed, epoch)``), the permuted sequence is cut into
   windows of ``window_shards`` shards, and the samples inside each window are shuffled
   (seeded by ``(seed, epoch, window)``). A sample therefore moves at most one window away
   from its shard's slot, so a reader needs only about one window of shards at a time.
   Without ``shuffle``: the identity.
2. **Ranks take contiguous slices** of it (not strided), so each rank reads about
   ``shards / world_size`` of the shards per epoch. ``drop_last=False`` pads the order by
   repeating it from its start to a multiple of ``world_size`` (as ``DistributedSampler``
   does); ``drop_last=True`` drops its tail instead. Every rank gets the same count.
3. **Workers**: a rank's order is cut into batches; worker ``k`` of ``K`` reads batches
   ``k, k+K, k+2K, ...`` (how ``torch.utils.data.DataLoader`` hands out batches), so the
   rank's output order is the same for any ``num_workers``.

11 samples in 4 shards (sizes 3, 3, 3, 2), ``world_size=2``, ``window_shards=2``,
``seed=0``, ``epoch=0``, ``drop_last=False``::

    shards           s0: 0 1 2 | s1: 3 4 5 | s2: 6 7 8 | s3: 9 10

    shuffle=False
    position          0  1  2  3  4  5 | 6  7  8  9 10 11
    sample            0  1  2  3  4  5 | 6  7  8  9 10  0   <- 11 is padding (from the start)
    rank              0  0  0  0  0  0 | 1  1  1  1  1  1
    shards per rank   rank 0: s0 s1          rank 1: s2 s3 (+ s0 for the padding)

    shuffle=True      shards permuted: s2 s0 | s1 s3  (windows of 2 shards), then the
                      samples shuffled inside each window
    position          0  1  2  3  4  5 | 6  7  8  9 10 11
    sample            7  6  0  1  8  2 | 5 10  3  4  9  7   <- 11 is padding
    rank              0  0  0  0  0  0 | 1  1  1  1  1  1
    shards per rank   rank 0: s2 s0          rank 1: s1 s3 (+ s2 for the padding)

    drop_last=True    rank 0: 7 6 0 1 8      rank 1: 2 5 10 3 4      (9 is dropped)

**Resume** (elastic and exact). Ranks step in lockstep (DDP), so "rank ``r`` consumed ``c``
samples" is the same ``c`` for every rank. A :class:`ResumeState` holds the plan's
parameters and the history of ``(world_size, consumed per rank)`` segments of one epoch.
After a segment, the rest of the epoch is each old rank's unconsumed slice, in rank order
(then the entries ``drop_last`` left unassigned); it is split contiguously among the new
world size with the same padding/truncation rules, and a second resume nests (a segment
that consumed nothing changes nothing). So:

* every sample of the epoch not yet consumed is delivered exactly once, except that
  ``drop_last=True`` drops fewer than ``world_size`` entries from the end of the rest;
* with ``drop_last=False`` and a new world size, the old padding is dropped and fewer than
  ``world_size`` padding entries are added, repeated from the start of the rest: never a
  consumed sample;
* with the same world size the rest of every rank's stream is identical to the
  uninterrupted run (old padding included).

Above (shuffled), after every rank consumed 2 samples, resumed with ``world_size=3``::

    rest              rank 0: 0 1 8 2 | rank 1: 3 4 9 (7 is old padding: dropped)
    new split         rank 0: 0 1 8   | rank 1: 2 3 4   | rank 2: 9 0 1  (0 1 pad it)

Why not a ``numpy.random.Generator`` per window: building one costs ~20 µs, which is
seconds per epoch for a dataset of many tiny shards (a plain sized dataset has one sample
per shard). Each window instead gets its own SplitMix64 stream, keyed by a value drawn from
``SeedSequence([seed, epoch, 1])`` and the window's index; every window's order is still a
function of ``(seed, epoch, window)`` alone, computed for all windows at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from fastload.errors import FastloadError

DEFAULT_WINDOW_SHARDS = 8
STATE_VERSION = 1

IndexArray: TypeAlias = npt.NDArray[np.int64]

# Stream tags in the SeedSequence entropy, so the shard permutation and the window keys of
# one (seed, epoch) never share random bits.
_SHARD_STREAM = 0
_WINDOW_STREAM = 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# The within-window sort key: the window (relative to the first one computed) in the high
# bits, the top 40 bits of the sample's hash below it; a stable sort breaks hash ties by
# position, so a window's order does not depend on which other windows are computed with it.
_KEY_BITS = 40
_MAX_WINDOWS_PER_SORT = 1 << (64 - _KEY_BITS - 1)
_CHUNK_SAMPLES = 1 << 16


class PlanError(FastloadError, ValueError):
    """The plan's arguments are invalid (an empty dataset, a rank out of range, ...)."""


class ResumeStateError(PlanError):
    """A resume state is malformed or belongs to another dataset or plan."""


def _mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer, in place (uint64 arrays wrap without warnings)."""
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PlanError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PlanError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_world(world_size: int, rank: int | None = None) -> None:
    _check_int("world_size", world_size, minimum=1)
    if rank is not None:
        _check_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise PlanError(
                f"rank {rank} is out of range for world_size {world_size}: "
                f"ranks are 0..{world_size - 1}"
            )


# --------------------------------------------------------------------------------------
# Runs: an epoch's sequence as a few [start, stop) ranges of epoch-order positions.
# After resumes the sequence is a concatenation of pieces of the previous one, so it stays
# a short list of ranges (O(sum of the world sizes)) however large the dataset.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Run:
    start: int
    stop: int
    padding: bool = False

    def __len__(self) -> int:
        return self.stop - self.start


def _length(runs: Sequence[_Run]) -> int:
    return sum(len(r) for r in runs)


def _slice(runs: Sequence[_Run], begin: int, end: int) -> list[_Run]:
    """Entries [begin, end) of the concatenated runs."""
    out = []
    at = 0
    for run in runs:
        lo, hi = max(begin, at), min(end, at + len(run))
        if lo < hi:
            out.append(_Run(run.start + lo - at, run.start + hi - at, run.padding))
        at += len(run)
        if at >= end:
            break
    return out


def _repeat_from_start(runs: Sequence[_Run], count: int) -> list[_Run]:
    """The first ``count`` entries, cycling if needed, marked as padding."""
    total = _length(runs)
    out: list[_Run] = []
    while count > 0 and total > 0:
        piece = _slice(runs, 0, min(count, total))
        out += [_Run(r.start, r.stop, True) for r in piece]
        count -= min(count, total)
    return out


@dataclass(frozen=True)
class _Layout:
    """One segment of an epoch: rank r reads assigned[r*per_rank : (r+1)*per_rank]."""

    world_size: int
    assigned: tuple[_Run, ...]
    tail: tuple[_Run, ...]  # what drop_last left to no rank (fewer than world_size entries)

    @property
    def per_rank(self) -> int:
        return _length(self.assigned) // self.world_size

    def rank_runs(self, rank: int) -> list[_Run]:
        n = self.per_rank
        return _slice(self.assigned, rank * n, (rank + 1) * n)

    def rest(self, consumed: int) -> list[_Run]:
        """What is left after every rank consumed ``consumed``: slices in rank order, then tail."""
        n = self.per_rank
        out: list[_Run] = []
        for rank in range(self.world_size):
            out += _slice(self.assigned, rank * n + consumed, (rank + 1) * n)
        return out + list(self.tail)


def _layout(entries: Sequence[_Run], world_size: int, drop_last: bool) -> _Layout:
    total = _length(entries)
    if drop_last:
        keep = total // world_size * world_size
        return _Layout(
            world_size, tuple(_slice(entries, 0, keep)), tuple(_slice(entries, keep, total))
        )
    real = [r for r in entries if not r.padding]
    pad = -total % world_size
    return _Layout(world_size, tuple(entries) + tuple(_repeat_from_start(real, pad)), ())


# --------------------------------------------------------------------------------------
# Resume state
# --------------------------------------------------------------------------------------


# What a resume state records besides its segments; all must match the plan resuming it.
_PARAM_FIELDS = (
    "epoch",
    "seed",
    "shuffle",
    "drop_last",
    "window_shards",
    "num_samples",
    "num_shards",
)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A stretch of an epoch run at one world size; every rank consumed ``consumed`` samples."""

    world_size: int
    consumed: int

    def __post_init__(self) -> None:
        # Plain ints, so the state stays JSON-serializable whatever integers it was given.
        object.__setattr__(self, "world_size", _check_int("world_size", self.world_size, minimum=1))
        object.__setattr__(self, "consumed", _check_int("consumed", self.consumed, minimum=0))


@dataclass(frozen=True, kw_only=True)
class ResumeState:
    """Where an epoch stopped: the plan's parameters and the segments run so far.

    JSON-serializable through :meth:`to_dict` / :meth:`from_dict`; it does not name a rank,
    because in lockstep every rank's state is the same.
    """

    epoch: int
    seed: int
    shuffle: bool
    drop_last: bool
    window_shards: int
    num_samples: int
    num_shards: int
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        minimums = {"epoch": 0, "seed": 0, "window_shards": 1, "num_samples": 1, "num_shards": 1}
        for name, minimum in minimums.items():
            object.__setattr__(self, name, _check_int(name, getattr(self, name), minimum=minimum))
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise PlanError(f"{name} must be true or false, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))
        if not all(isinstance(s, Segment) for s in self.segments):
            raise PlanError(f"segments must be Segment objects, got {self.segments!r}")
        object.__setattr__(self, "segments", tuple(self.segments))

    def then(self, world_size: int, consumed: int) -> ResumeState:
        """This state plus one more segment (a segment that consumed nothing changes nothing)."""
        if consumed == 0:
            return self
        segment = Segment(world_size=world_size, consumed=consumed)
        return ResumeState(**{**self._fields(), "segments": (*self.segments, segment)})

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _PARAM_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            **self._fields(),
            "segments": [[s.world_size, s.consumed] for s in self.segments],
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ResumeState:
        if not isinstance(state, Mapping):
            raise ResumeStateError(
                f"a resume state must be a dict (from state_dict()), got {type(state).__name__}"
            )
        if state.get("version") != STATE_VERSION:
            raise ResumeStateError(
                f"resume state version {state.get('version')!r} is not supported "
                f"(this fastload reads version {STATE_VERSION}); save it again with this version"
            )
        try:
            fields = {k: state[k] for k in _PARAM_FIELDS}
            segments = tuple(Segment(world_size=w, consumed=c) for w, c in state["segments"])
            return cls(**fields, segments=segments)
        except (KeyError, TypeError, ValueError) as exc:
            raise ResumeStateError(
                f"malformed resume state {json.dumps(state, default=str)[:200]}: {exc}"
            ) from exc


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShardFuture:
    """The shards a set of ranks will read, for some epochs, in the order they read them.

    ``sample_shards`` has one shard id per sample read: epoch by epoch (from the resume
    point where one applies), and within an epoch step by step (ranks in lockstep), rank by
    rank within a step. ``epoch_starts[i]`` is where epoch ``epochs[i]`` begins in it.
    """

    epochs: tuple[int, ...]
    ranks: tuple[int, ...]
    world_size: int
    sample_shards: npt.NDArray[np.int64]
    epoch_starts: npt.NDArray[np.int64]

    @property
    def first_needed(self) -> npt.NDArray[np.int64]:
        """Distinct shard ids in the order they are first needed (what to stage first)."""
        _, first = np.unique(self.sample_shards, return_index=True)
        return self.sample_shards[np.sort(first)]

    def accesses(self) -> npt.NDArray[np.int64]:
        """``sample_shards`` with consecutive repeats collapsed: the order a cache sees."""
        seq = self.sample_shards
        if len(seq) == 0:
            return seq
        keep = np.empty(len(seq), dtype=bool)
        keep[0] = True
        np.not_equal(seq[1:], seq[:-1], out=keep[1:])
        return seq[keep]


@dataclass(frozen=True)
class _EpochOrder:
    """One epoch's global order; :meth:`take` computes any range of it, window by window."""

    shuffle: bool
    shard_perm: IndexArray  # permuted shard ids (the identity without shuffle)
    shard_sizes: IndexArray  # the plan's, by shard id
    shard_offsets: IndexArray
    window_starts: IndexArray  # epoch position of each window's first sample, then the total
    window_key: np.uint64  # window w's stream is keyed by mix(window_key + (w + 1) * golden)
    window_shards: int

    def take(self, begin: int, end: int) -> IndexArray:
        """Sample indices at epoch positions [begin, end)."""
        if begin >= end:
            return np.empty(0, dtype=np.int64)
        if not self.shuffle:
            return np.arange(begin, end, dtype=np.int64)
        starts = self.window_starts
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        last = int(np.searchsorted(starts, end, side="left"))  # windows that start before end
        out = np.empty(end - begin, dtype=np.int64)
        lo = first
        while lo < last:
            # Whole windows, about _CHUNK_SAMPLES at a time: small arrays stay in the CPU cache.
            hi = int(np.searchsorted(starts, starts[lo] + _CHUNK_SAMPLES, side="right")) - 1
            hi = min(max(hi, lo + 1), lo + _MAX_WINDOWS_PER_SORT, last)
            block = self._windows(lo, hi)
            at = int(starts[lo])
            a, b = max(begin, at), min(end, at + len(block))
            out[a - begin : b - begin] = block[a - at : b - at]
            lo = hi
        return out

    def _windows(self, lo: int, hi: int) -> IndexArray:
        """The shuffled samples of windows [lo, hi), concatenated."""
        ws = self.window_shards
        shards = self.shard_perm[lo * ws : hi * ws]
        sizes = self.shard_sizes[shards]
        starts = self.window_starts
        total = int(starts[hi] - starts[lo])
        # Concatenated ranges: each shard's samples in place, then shuffled within windows.
        pos = np.arange(total, dtype=np.int64)
        shard_first = np.cumsum(sizes) - sizes
        samples = pos + np.repeat(self.shard_offsets[shards] - shard_first, sizes)
        window_sizes = np.diff(starts[lo : hi + 1])
        local_window = np.repeat(np.arange(hi - lo, dtype=np.uint64), window_sizes)
        in_window = pos - np.repeat(starts[lo:hi] - starts[lo], window_sizes)
        keys = self.window_key + np.arange(lo + 1, hi + 1, dtype=np.uint64) * _GOLDEN
        h = _mix64(keys)[local_window.astype(np.intp)]
        h += (in_window.astype(np.uint64) + np.uint64(1)) * _GOLDEN
        _mix64(h)
        h >>= np.uint64(64 - _KEY_BITS)
        h |= local_window << np.uint64(_KEY_BITS)
        shuffled: IndexArray = samples[np.argsort(h, kind="stable")]
        return shuffled


class Plan:
    """The read order of one dataset for every epoch, world size, rank and worker.

    ``shard_sizes[s]`` is how many samples shard ``s`` holds (zero is allowed; the total
    must not be). Only the parameters that shape the epoch order live here; the world size,
    rank and resume point are arguments of each query, so one plan serves every rank.
    """

    def __init__(
        self,
        shard_sizes: Sequence[int] | npt.ArrayLike,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        window_shards: int = DEFAULT_WINDOW_SHARDS,
    ) -> None:
        sizes = np.asarray(shard_sizes)
        if sizes.ndim != 1 or (sizes.size and not np.issubdtype(sizes.dtype, np.integer)):
            raise PlanError(
                f"shard_sizes must be a flat sequence of integers (samples per shard), "
                f"got {np.asarray(shard_sizes).dtype} of shape {sizes.shape}"
            )
        sizes = sizes.astype(np.int64, copy=True)
        if sizes.size == 0:
            raise PlanError("the dataset is empty: shard_sizes has no shards; check its listing")
        if (sizes < 0).any():
            bad = int(np.flatnonzero(sizes < 0)[0])
            raise PlanError(
                f"shard {bad} has a negative sample count ({int(sizes[bad])}); "
                "every shard holds 0 or more samples"
            )
        total = int(sizes.sum())
        if total == 0:
            raise PlanError(
                f"the dataset is empty: its {sizes.size} shards hold no samples; check its listing"
            )
        self.seed = _check_int("seed", seed, minimum=0)
        self.window_shards = _check_int("window_shards", window_shards, minimum=1)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        sizes.flags.writeable = False
        self.shard_sizes: IndexArray = sizes
        ends = np.cumsum(sizes)
        ends.flags.writeable = False
        self._shard_ends = ends
        offsets: IndexArray = ends - sizes
        offsets.flags.writeable = False
        self._shard_offsets = offsets
        self._uniform_size = int(sizes[0]) if (sizes == sizes[0]).all() else None
        self.num_samples = total
        self.num_shards = int(sizes.size)
        # Every rank of a node, and every query of one epoch, shares the shard permutation.
        self._cached_order: tuple[int, _EpochOrder] | None = None

    def __repr__(self) -> str:
        return (
            f"Plan(num_shards={self.num_shards}, num_samples={self.num_samples}, "
            f"seed={self.seed}, shuffle={self.shuffle}, drop_last={self.drop_last}, "
            f"window_shards={self.window_shards})"
        )

    @property
    def shard_offsets(self) -> IndexArray:
        """Global index of each shard's first sample (read-only)."""
        return self._shard_offsets

    # -- epoch order -------------------------------------------------------------------

    def _order(self, epoch: int) -> _EpochOrder:
        _check_int("epoch", epoch, minimum=0)
        cached = self._cached_order
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = self._compute_order(epoch)
        self._cached_order = (epoch, order)  # one tuple store: safe to share across threads
        return order

    def _compute_order(self, epoch: int) -> _EpochOrder:
        perm = np.arange(self.num_shards, dtype=np.int64)
        if not self.shuffle:
            return _EpochOrder(
                shuffle=False,
                shard_perm=perm,
                shard_sizes=self.shard_sizes,
                shard_offsets=self.shard_offsets,
                window_starts=np.array([0, self.num_samples], dtype=np.int64),
                window_key=np.uint64(0),
                window_shards=self.window_shards,
            )
        seq = np.random.SeedSequence([self.seed, epoch, _SHARD_STREAM])
        np.random.Generator(np.random.PCG64(seq)).shuffle(perm)
        ws = self.window_shards
        num_windows = -(-self.num_shards // ws)
        if self._uniform_size is not None:  # no gather over every shard: starts are arithmetic
            window_starts = np.arange(num_windows + 1, dtype=np.int64) * (ws * self._uniform_size)
            window_starts[-1] = self.num_samples
        else:
            bounds = np.concatenate(([0], np.cumsum(self.shard_sizes[perm])))
            window_starts = bounds[np.minimum(np.arange(num_windows + 1) * ws, self.num_shards)]
        key = np.random.SeedSequence([self.seed, epoch, _WINDOW_STREAM]).generate_state(
            1, np.uint64
        )[0]
        return _EpochOrder(
            shuffle=True,
            shard_perm=perm,
            shard_sizes=self.shard_sizes,
            shard_offsets=self.shard_offsets,
            window_starts=window_starts.astype(np.int64),
            window_key=key,
            window_shards=ws,
        )

    def epoch_order(self, epoch: int) -> IndexArray:
        """Every sample of the epoch once, in the global order (any world size reads this)."""
        return self._order(epoch).take(0, self.num_samples)

    def shard_permutation(self, epoch: int) -> IndexArray:
        """The epoch's shard order (windows are consecutive runs of ``window_shards``)."""
        return self._order(epoch).shard_perm.copy()

    def shard_of(self, samples: npt.ArrayLike) -> IndexArray:
        """The shard holding each sample index."""
        idx = np.asarray(samples, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise PlanError(
                f"sample indices must be in 0..{self.num_samples - 1}, "
                f"got values from {idx.min()} to {idx.max()}"
            )
        return np.searchsorted(self._shard_ends, idx, side="right").astype(np.int64)

    # -- ranks and resume --------------------------------------------------------------

    def resume_state(self, epoch: int, segments: Iterable[tuple[int, int]] = ()) -> ResumeState:
        """A resume state for this plan: ``segments`` are ``(world_size, consumed per rank)``."""
        state = ResumeState(
            epoch=_check_int("epoch", epoch, minimum=0),
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            window_shards=self.window_shards,
            num_samples=self.num_samples,
            num_shards=self.num_shards,
        )
        for world_size, consumed in segments:
            state = state.then(world_size, consumed)
        self._layout(state, 1)  # validates every segment now, not at the first read
        return state

    def check_state(self, state: ResumeState) -> None:
        """Raises :class:`ResumeStateError` unless ``state`` was made by an equal plan."""
        theirs = state._fields()
        mine = {**{k: getattr(self, k) for k in _PARAM_FIELDS[1:]}, "epoch": state.epoch}
        diff = [f"{k}: state {theirs[k]!r}, plan {mine[k]!r}" for k in mine if mine[k] != theirs[k]]
        if diff:
            raise ResumeStateError(
                "the resume state belongs to another dataset or plan ("
                + "; ".join(diff)
                + "); construct the sampler with the saved settings, over the same dataset"
            )

    def _layout(self, resume: ResumeState | None, world_size: int) -> _Layout:
        entries: list[_Run] = [_Run(0, self.num_samples)]
        prev: int | None = None
        for i, seg in enumerate(resume.segments if resume else ()):
            layout = self._next_layout(entries, prev, seg.world_size)
            if seg.consumed > layout.per_rank:
                raise ResumeStateError(
                    f"segment {i} of the resume state says each of {seg.world_size} ranks "
                    f"consumed {seg.consumed} samples, but each had only {layout.per_rank}; "
                    "the state belongs to another dataset or plan"
                )
            entries, prev = layout.rest(seg.consumed), seg.world_size
        return self._next_layout(entries, prev, world_size)

    def _next_layout(self, entries: list[_Run], prev: int | None, world_size: int) -> _Layout:
        if not self.drop_last and prev is not None and prev != world_size:
            # Old padding was for the old split; the new split pads from the rest's start.
            entries = [r for r in entries if not r.padding]
        return _layout(entries, world_size, self.drop_last)

    def _resolve(self, epoch: int, resume: ResumeState | None) -> ResumeState | None:
        if resume is None:
            return None
        self.check_state(resume)
        if resume.epoch != epoch:
            raise ResumeStateError(
                f"the resume state is for epoch {resume.epoch}, not epoch {epoch}; "
                "resume that epoch, or start the new one without a state"
            )
        return resume

    def rank_length(
        self, *, world_size: int, epoch: int = 0, resume: ResumeState | None = None
    ) -> int:
        """How many samples every rank reads (from the resume point, if given)."""
        _check_world(world_size)
        return self._layout(self._resolve(epoch, resume), world_size).per_rank

    def rank_order(
        self,
        epoch: int,
        *,
        world_size: int,
        rank: int,
        resume: ResumeState | None = None,
        limit: int | None = None,
    ) -> IndexArray:
        """The sample indices ``rank`` reads this epoch, in order, from the resume point
        (its first ``limit`` only, computed alone, where given)."""
        _check_world(world_size, rank)
        layout = self._layout(self._resolve(epoch, resume), world_size)
        order = self._order(epoch)
        pieces = []
        left = layout.per_rank if limit is None else limit
        for r in layout.rank_runs(rank):
            if left <= 0:
                break
            pieces.append(order.take(r.start, min(r.stop, r.start + left)))
            left -= len(pieces[-1])
        if not pieces:
            return np.empty(0, dtype=np.int64)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def rank_chunks(
        self,
        epoch: int,
        *,
        world_size: int,
        rank: int,
        resume: ResumeState | None = None,
    ) -> Iterator[IndexArray]:
        """``rank_order`` in pieces of about 65,536 samples (whole windows), each computed
        when it is asked for: an epoch's first batches do not wait for the order of all of
        it (1.28 M samples: ~0.1 s, and a list of them). Checked now, computed later."""
        _check_world(world_size, rank)
        layout = self._layout(self._resolve(epoch, resume), world_size)
        order = self._order(epoch)

        def pieces() -> Iterator[IndexArray]:
            starts = order.window_starts
            for r in layout.rank_runs(rank):
                begin = r.start
                while begin < r.stop:
                    end = begin + _CHUNK_SAMPLES
                    if order.shuffle:  # to the next window boundary: none computed twice
                        at = int(np.searchsorted(starts, end, side="left"))
                        end = int(starts[at]) if at < len(starts) else r.stop
                    end = min(r.stop, end)
                    yield order.take(begin, end)
                    begin = end

        return pieces()

    def future(
        self,
        epochs: Iterable[int],
        *,
        world_size: int,
        ranks: Iterable[int],
        resume: ResumeState | None = None,
        samples: int | None = None,
    ) -> ShardFuture:
        """The shards ``ranks`` (one node's) read in ``epochs``, in order; ``resume`` applies
        to its own epoch; ``samples``: the first that many of each rank only. For the
        cache's ``plan`` policy and for warming one node's share."""
        epochs_t = tuple(_check_int("epoch", e, minimum=0) for e in epochs)
        ranks_t = tuple(ranks)
        if not ranks_t:
            raise PlanError("ranks is empty: name at least one rank whose future to compute")
        for r in ranks_t:
            _check_world(world_size, r)
        if len(set(ranks_t)) != len(ranks_t):
            raise PlanError(f"ranks must be distinct, got {list(ranks_t)}")
        if resume is not None:
            self.check_state(resume)
        per_epoch = []
        left = samples
        for epoch in epochs_t:
            if left is not None and left <= 0:
                per_epoch.append(np.empty(0, dtype=np.int64))
                continue
            state = resume if resume is not None and resume.epoch == epoch else None
            orders = [
                self.rank_order(epoch, world_size=world_size, rank=r, resume=state, limit=left)
                for r in ranks_t
            ]
            per_epoch.append(self.shard_of(np.stack(orders, axis=1).ravel()))
            if left is not None:
                left -= len(orders[0])
        lengths = [len(p) for p in per_epoch]
        sample_shards = (
            np.concatenate(per_epoch) if per_epoch else np.empty(0, dtype=np.int64)
        ).astype(np.int64)
        return ShardFuture(
            epochs=epochs_t,
            ranks=ranks_t,
            world_size=world_size,
            sample_shards=sample_shards,
            epoch_starts=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        )


# --------------------------------------------------------------------------------------
# Workers
# --------------------------------------------------------------------------------------


def worker_batches(
    order: npt.ArrayLike, *, batch_size: int, num_workers: int, worker: int
) -> list[IndexArray]:
    """The batches ``worker`` reads: batches ``worker, worker + K, ...`` of ``order``.

    This is how ``torch.utils.data.DataLoader`` hands batches to its ``K`` workers and
    puts them back in order, so the rank's stream is the same for every ``num_workers``.
    ``num_workers=0`` means the main process reads everything (worker 0 of 1). The last
    batch may be short.
    """
    _check_int("batch_size", batch_size, minimum=1)
    workers = max(1, _check_int("num_workers", num_workers, minimum=0))
    _check_int("worker", worker, minimum=0)
    if worker >= workers:
        raise PlanError(
            f"worker {worker} is out of range for num_workers={num_workers}: "
            f"workers are 0..{workers - 1}"
        )
    arr = np.asarray(order, dtype=np.int64)
    return [
        arr[start : start + batch_size]
        for start in range(worker * batch_size, len(arr), workers * batch_size)
    ]


def num_batches(num_samples: int, batch_size: int, *, drop_last: bool = False) -> int:
    """Batches of ``batch_size`` in ``num_samples`` (the last one short unless dropped)."""
    _check_int("num_samples", num_samples, minimum=0)
    _check_int("batch_size", batch_size, minimum=1)
    return num_samples // batch_size if drop_last else -(-num_samples // batch_size)


__all__ = [
    "DEFAULT_WINDOW_SHARDS",
    "Plan",
    "PlanError",
    "ResumeState",
    "ResumeStateError",
    "Segment",
    "ShardFuture",
    "num_batches",
    "worker_batches",
]
