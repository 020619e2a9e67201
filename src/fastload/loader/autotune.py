"""``fl.DataLoader(..., autotune=True)``: the loader tunes its threads, prefetch depth and
look-ahead while the job runs, from the times it already measures.

Each window of batches (at least ``window_batches`` and ``window_s`` of the training loop's
time) gives a rate: batches over the loop's wall time (the step's time plus the wait for
the next batch). From the settings it was given, the tuner tries one move at a time — a
thread more, twice the prefetch depth, twice the look-ahead — and keeps it only where the
rate of its next ``trial_windows`` windows beats the kept settings' by ``gain``
(hysteresis: noise does not keep a move) *and* the step waited less for its batches: a
loader setting can speed the loop only by shortening that wait, so windows whose rate rose
while the wait did not (the step itself ran faster: a quieter machine) are noise, not the
move's doing. A thread costs what it takes from the step too (a step holding the GIL runs
longer beside more threads): the rate counts it. The kept settings' rate is the mean of
their last windows, not one window. A thread more comes with the prefetch depth it needs
(at least a batch per thread: a thread with no batch it may load waits idle). The
look-ahead is tried only where a window fetched bytes from the remote (on a warm cache it can
only add noise and memory), and first there: a step waiting on the remote waits for
staging, which threads do not speed. A move that does not pay is undone and never tried
again, so the settings only climb, each knob stops once, and the tuner never oscillates; it
stops when every move is spent or when the step no longer waits (the loader keeps pace).
Moves stay within the bounds: threads at most the cores (or ``max_workers``), and the bytes
in flight (batches prefetched or in a thread's hands, decoded and encoded, and those staged
ahead) within ``max_memory_bytes``.

Only the schedule moves: batches, their order and their augmentations depend on the seed,
the epoch and the sample, never on the threads, so a tuned job's batches are bitwise those
of an untuned one. The settings chosen, and the log of each move with its measured effect,
are in ``loader.stats()["autotune"]``; ``state_dict()`` carries them, so a resumed job
starts where the tuning ended.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fastload.loader import prefetch_memory
from fastload.resources import usable_cpus

log = logging.getLogger("fastload.autotune")

MOVES = ("num_workers", "prefetch_batches", "lookahead_bytes")
# Where the window fetched from the remote: staging ahead first.
FETCHING_MOVES = ("lookahead_bytes", "num_workers", "prefetch_batches")
# Windows of the kept settings their rate is the mean of (older ones may predate a change
# of the machine's load).
BASE_WINDOWS = 3
# Of the loop's time, below this share spent waiting the loader keeps pace: nothing to tune.
KEEPS_PACE = 0.02


@dataclass(frozen=True)
class Bounds:
    """What the tuner may use, and how it measures."""

    max_workers: int  # loader threads (default: the cores this process may run on)
    max_prefetch: int = 32
    max_lookahead_bytes: int = 4 << 30
    max_memory_bytes: int | None = None  # batches in flight and bytes staged ahead
    # Batches prefetched and the one the step holds (from_setting's default: the share of the
    # cgroup's memory.max that the untuned depth fits, prefetch_memory; None: no limit).
    max_prefetch_bytes: int | None = None
    window_batches: int = 8  # batches per measured window, at least
    window_s: float = 0.5  # seconds of the loop per window, at least
    gain: float = 1.05  # a move is kept where the rate improves by this factor
    trial_windows: int = 2  # windows a move is judged on (one window's rate is noisy)
    keeps_pace: float = KEEPS_PACE  # below this share of the loop waiting, tuning stops

    @classmethod
    def from_setting(cls, setting: bool | Mapping[str, Any]) -> Bounds:
        given = dict(setting) if isinstance(setting, Mapping) else {}
        unknown = set(given) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"autotune takes True or a dict of {sorted(cls.__dataclass_fields__)}; "
                f"got {sorted(unknown)}"
            )
        given.setdefault("max_workers", usable_cpus())  # the container's
        given.setdefault("max_prefetch_bytes", prefetch_memory.memory_share_bytes())
        bounds = cls(**given)
        counts = (bounds.max_workers, bounds.max_prefetch, bounds.window_batches)
        if min(counts) < 1 or bounds.trial_windows < 1:
            raise ValueError(
                "autotune's max_workers, max_prefetch, window_batches and trial_windows are >= 1"
            )
        if bounds.gain < 1:
            raise ValueError(f"autotune's gain must be >= 1, got {bounds.gain}")
        return bounds


@dataclass(frozen=True)
class Knobs:
    num_workers: int
    prefetch_batches: int
    lookahead_bytes: int


@dataclass
class _Window:
    batches: int = 0
    seconds: float = 0.0
    waited: float = 0.0
    fetched: int = 0  # bytes the loader fetched from the remote meanwhile

    @property
    def rate(self) -> float:
        """Batches per second of the loop."""
        return self.batches / max(self.seconds, 1e-9)

    @property
    def wait_s(self) -> float:
        """The step's mean wait for a batch."""
        return self.waited / max(self.batches, 1)

    @property
    def step_s(self) -> float:
        """The loop's mean time per batch outside the wait: the step."""
        return (self.seconds - self.waited) / max(self.batches, 1)

    @classmethod
    def total(cls, windows: Any) -> _Window:
        out = cls()
        for w in windows:
            out.batches += w.batches
            out.seconds += w.seconds
            out.waited += w.waited
            out.fetched += w.fetched
        return out


@dataclass
class Autotuner:
    """The tuning of one loader, across its passes."""

    bounds: Bounds
    knobs: Knobs
    batch_bytes: int  # a batch's encoded bytes (read, and staged ahead)
    batch_size: int
    decoded_bytes: int | None = None  # a delivered batch's bytes, learnt from the first
    fetched: Callable[[], int] | None = None  # the loader's bytes fetched so far
    spent: set[str] = field(default_factory=set)  # moves that did not pay
    converged: bool = False
    trial: tuple[str, Knobs] | None = None  # (move, the knobs before it) while measured
    trial_measured: list[_Window] = field(default_factory=list)  # its windows so far
    base: deque[_Window] = field(default_factory=lambda: deque(maxlen=BASE_WINDOWS))
    changes: list[dict[str, Any]] = field(default_factory=list)
    _window: _Window = field(default_factory=_Window)
    _settle: int = 0  # batches to skip after a move (the queue refills)
    _last: float | None = None
    _batches: int = 0
    _fetched_mark: int = 0

    # --- measuring ---------------------------------------------------------------------------

    def new_pass(self) -> None:
        """A pass starts: its first batches (threads starting, queue filling) are not timed."""
        self._last = None
        self._window = _Window()
        self._settle = self.knobs.prefetch_batches
        self._fetched_mark = self.fetched() if self.fetched is not None else 0

    def observe(self, asked: float, delivered: float) -> Knobs | None:
        """A batch was asked for at ``asked`` and handed over at ``delivered``
        (perf_counter). Returns the knobs to run with where they change."""
        self._batches += 1
        last, self._last = self._last, delivered
        if self.converged or last is None:
            return None
        if self._settle > 0:
            self._settle -= 1
            return None
        w = self._window
        w.batches += 1
        w.seconds += delivered - last
        w.waited += delivered - asked
        if w.batches < self.bounds.window_batches or w.seconds < self.bounds.window_s:
            return None
        self._window = _Window()
        if self.fetched is not None:
            mark, self._fetched_mark = self._fetched_mark, self.fetched()
            w.fetched = self._fetched_mark - mark
        return self._decide(w)

    @property
    def base_rate(self) -> float | None:
        """Batches/s with the kept knobs (the mean of their last windows)."""
        return _Window.total(self.base).rate if self.base else None

    # --- deciding ----------------------------------------------------------------------------

    def _decide(self, w: _Window) -> Knobs | None:
        if self.trial is not None:
            self.trial_measured.append(w)
            if len(self.trial_measured) < self.bounds.trial_windows:
                return None
            move, before = self.trial
            self.trial = None
            w = _Window.total(self.trial_measured)
            self.trial_measured = []
            base = _Window.total(self.base)
            kept = w.rate >= base.rate * self.bounds.gain and w.wait_s < base.wait_s
            self._record(move, before, self.knobs, base, w, kept)
            if kept:
                self.base.clear()
            else:
                self.spent.add(move)
                self._apply(before)
                return self.knobs
        self.base.append(w)
        if w.waited / max(w.seconds, 1e-9) < self.bounds.keeps_pace:
            self._converge("the step no longer waits for the loader")
            return None
        for move in FETCHING_MOVES if w.fetched > 0 else MOVES:
            if move in self.spent or (move == "lookahead_bytes" and w.fetched <= 0):
                continue
            nxt = self._moved(move)
            if nxt is None:
                self.spent.add(move)
                continue
            self.trial = (move, self.knobs)
            self._apply(nxt)
            return self.knobs
        self._converge("every move that can pay here is spent")
        return None

    def _moved(self, move: str) -> Knobs | None:
        """The knobs with ``move`` made, or None where the bounds forbid it."""
        k, b = self.knobs, self.bounds
        if move == "num_workers":
            workers = k.num_workers + 1
            prefetch = min(max(k.prefetch_batches, workers), b.max_prefetch)
            nxt = replace(k, num_workers=workers, prefetch_batches=prefetch)
            ok = workers <= b.max_workers
        elif move == "prefetch_batches":
            nxt = replace(k, prefetch_batches=min(2 * k.prefetch_batches, b.max_prefetch))
            ok = nxt.prefetch_batches > k.prefetch_batches
        else:
            if k.lookahead_bytes <= 0:  # staging ahead is off: not this tuner's to turn on
                return None
            nxt = replace(k, lookahead_bytes=min(2 * k.lookahead_bytes, b.max_lookahead_bytes))
            ok = nxt.lookahead_bytes > k.lookahead_bytes
        return nxt if ok and self._fits(nxt) else None

    def _fits(self, k: Knobs) -> bool:
        if self.bounds.max_memory_bytes is None:
            return True
        return self.in_flight_bytes(k) <= self.bounds.max_memory_bytes

    def in_flight_bytes(self, k: Knobs) -> int:
        """Memory the knobs hold: each batch prefetched or in a thread's hands, encoded and
        decoded, and the look-ahead's bytes (held in memory where the cache turns them away)."""
        per_batch = self.batch_bytes + (self.decoded_bytes or 0)
        return (k.prefetch_batches + k.num_workers) * per_batch + k.lookahead_bytes

    def learn_batch(self, batch: Any) -> None:
        """The bytes of a delivered batch (its tensors and arrays), from the first one."""
        if self.decoded_bytes is None:
            self.decoded_bytes = _nbytes(batch)

    def _apply(self, knobs: Knobs) -> None:
        self.knobs = knobs
        self._settle = knobs.prefetch_batches + knobs.num_workers

    def _converge(self, why: str) -> None:
        self.converged = True
        log.info("fastload autotune: settled on %s (%s)", _label(self.knobs), why)

    def _record(
        self, move: str, before: Knobs, after: Knobs, was: _Window, now: _Window, kept: bool
    ) -> None:
        entry = {
            "batch": self._batches,
            "time": round(time.time(), 3),
            "setting": move,
            "from": getattr(before, move),
            "to": getattr(after, move),
            "samples_per_s_before": round(was.rate * self.batch_size, 1),
            "samples_per_s_after": round(now.rate * self.batch_size, 1),
            # Where the loop's time per batch went: the step's wait, and the step itself.
            "wait_ms_before": round(was.wait_s * 1000, 2),
            "wait_ms_after": round(now.wait_s * 1000, 2),
            "step_ms_before": round(was.step_s * 1000, 2),
            "step_ms_after": round(now.step_s * 1000, 2),
            "kept": kept,
        }
        if after.prefetch_batches != before.prefetch_batches and move != "prefetch_batches":
            entry["prefetch_batches"] = after.prefetch_batches  # (a thread's own batch)
        self.changes.append(entry)
        log.info(
            "fastload autotune: %s %s -> %s: %.0f -> %.0f samples/s (%+.0f%%; wait %.1f -> "
            "%.1f ms, step %.1f -> %.1f ms a batch), %s",
            move,
            entry["from"],
            entry["to"],
            entry["samples_per_s_before"],
            entry["samples_per_s_after"],
            (now.rate / max(was.rate, 1e-9) - 1) * 100,
            entry["wait_ms_before"],
            entry["wait_ms_after"],
            entry["step_ms_before"],
            entry["step_ms_after"],
            "kept" if kept else "undone",
        )

    # --- reporting and state -----------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        return {
            **asdict(self.knobs),
            "converged": self.converged,
            "trying": None if self.trial is None else self.trial[0],
            "in_flight_bytes": self.in_flight_bytes(self.knobs),
            "bounds": asdict(self.bounds),
            "changes": list(self.changes),
        }

    def state_dict(self) -> dict[str, Any]:
        """The kept settings (a move under trial is not kept yet) and what is spent."""
        knobs = self.knobs if self.trial is None else self.trial[1]
        return {
            **asdict(knobs),
            "spent": sorted(self.spent),
            "converged": self.converged,
            "changes": list(self.changes),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.knobs = Knobs(
            num_workers=min(int(state["num_workers"]), self.bounds.max_workers),
            prefetch_batches=min(int(state["prefetch_batches"]), self.bounds.max_prefetch),
            lookahead_bytes=int(state["lookahead_bytes"]),
        )
        self.spent = set(state.get("spent", ()))
        self.converged = bool(state.get("converged", False))
        self.changes = list(state.get("changes", ()))
        self.trial = None
        self.trial_measured = []
        self.base.clear()


def _nbytes(batch: Any) -> int:
    if isinstance(batch, dict):
        return sum(_nbytes(v) for v in batch.values())
    if isinstance(batch, list | tuple):
        return sum(_nbytes(v) for v in batch)
    nbytes = getattr(batch, "nbytes", None)  # numpy arrays, torch tensors
    if isinstance(nbytes, int):
        return nbytes
    size, numel = getattr(batch, "element_size", None), getattr(batch, "numel", None)
    return int(size() * numel()) if callable(size) and callable(numel) else 0


def _label(k: Knobs) -> str:
    return ", ".join(f"{name}={value}" for name, value in asdict(k).items())


def make(setting: bool | Mapping[str, Any], loader: Any) -> Autotuner | None:
    """The tuner for ``fl.DataLoader(autotune=setting)``, None where off. Starts from the
    loader's settings (at least one thread: a pass without threads cannot be retuned)."""
    if setting is False or setting is None:
        return None
    bounds = Bounds.from_setting(setting)
    loader.num_workers = min(max(1, loader.num_workers), bounds.max_workers)
    per_sample = max(1, loader._bytes_per_sample())
    knobs = Knobs(
        num_workers=loader.num_workers,
        prefetch_batches=min(loader._prefetch_depth(), bounds.max_prefetch),
        lookahead_bytes=int(loader.lookahead_bytes),
    )
    batch = loader.batch_size or 1
    stats = loader._stats
    return Autotuner(
        bounds,
        knobs,
        batch_bytes=per_sample * batch,
        batch_size=batch,
        fetched=lambda: stats.counted("bytes_fetched"),
    )


def fit_memory(tuner: Autotuner, batch_bytes: int, floor: int = 1) -> None:
    """``max_prefetch_bytes`` for batches of ``batch_bytes`` (an estimate, then what a pass's
    first batch held: it only grows): the deepest prefetch becomes the depth whose batches,
    and the one the step holds, fit it (``prefetch_memory.depth_within``), never below
    ``floor`` (a depth the user gave); knobs above it come down to it."""
    b = tuner.bounds
    deepest = max(
        floor, prefetch_memory.depth_within(b.max_prefetch, batch_bytes, b.max_prefetch_bytes)
    )
    if deepest >= b.max_prefetch:
        return
    tuner.bounds = replace(b, max_prefetch=deepest)

    def lowered(k: Knobs) -> Knobs:
        return replace(k, prefetch_batches=min(k.prefetch_batches, deepest))

    tuner.knobs = lowered(tuner.knobs)
    if tuner.trial is not None:
        tuner.trial = (tuner.trial[0], lowered(tuner.trial[1]))


def resume(tuner: Autotuner, loader: Any, state: Mapping[str, Any]) -> None:
    """``load_state_dict``: the tuner and the loader take the saved settings."""
    tuner.load_state_dict(state)
    loader.num_workers = tuner.knobs.num_workers
    loader.prefetch_batches = tuner.knobs.prefetch_batches
    loader.lookahead_bytes = tuner.knobs.lookahead_bytes


def follow(
    tuner: Autotuner,
    loader: Any,
    source: Any,
    asked: float,
    delivered: float,
    batch: Any = None,
) -> None:
    """The hook the loader's iteration calls per batch: measures, and where the knobs move,
    retunes the running pass and the loader (its next pass starts from them)."""
    if batch is not None:
        tuner.learn_batch(batch)
    knobs = tuner.observe(asked, delivered)
    if knobs is None:
        return
    loader.num_workers = knobs.num_workers
    loader.prefetch_batches = knobs.prefetch_batches
    loader.lookahead_bytes = knobs.lookahead_bytes
    retune = getattr(source, "retune", None)
    if callable(retune):
        per_batch = max(1, tuner.batch_bytes)
        # Memory for the objects staged ahead grows with the look-ahead.
        ahead = loader._batches_ahead(knobs.lookahead_bytes, per_batch)
        loader._size_holding(ahead, loader._prefetch_depth())
        retune(workers=knobs.num_workers, prefetch=loader._prefetch_depth(), lookahead=ahead)
