"""``autotune=True`` against hand-tuned settings and ``num_workers = cores`` (#35, P17).

Data: the bench's generated ImageFolder (600 JPEGs of about 105 KB,
:mod:`fastload.bench.e2e.e2e_data`), batches of 8 decoded to ``TrainPreset(224)``, a
simulated training step per batch (a sleep, or a busy loop holding the GIL). The
configurations, three of them where the most threads is wrong:

* ``sleep`` / ``gil``: a warm local cache, a sleeping / GIL-holding step.
* ``memory``: a warm cache, a sleeping step, and a memory bound (``autotune``'s
  ``max_memory_bytes``) of the look-ahead and ``MEMORY_BATCHES`` batches in flight
  (decoded and encoded): settings over it do not count as hand-tuned candidates, and
  ``num_workers = cores`` (with torch's prefetch of 2 a thread) is over it.
* ``remote``: every epoch from an empty cache, the dataset on a loopback S3 server in its
  own process answering each request after ``remote_latency_ms``, a sleeping step: the
  look-ahead, not threads, is what pays.

Every configuration starts from ``num_workers=1, prefetch_batches=1`` and a look-ahead of
``START_LOOKAHEAD`` (a small one: staging ahead is among what is tuned). Per
configuration:

* **hand-tuned**: one epoch per setting of a grid (threads x prefetch, and look-ahead for
  ``remote``); the best is the one with the most samples/s within the bounds.
* **autotune epoch 1**: from the start settings, tuning as it runs; the settings it chose.
* **re-measured**, ``repeats`` rounds of one epoch each, in turn: the best hand-tuned
  setting, ``num_workers = cores`` (the start settings with the threads at the cores and
  prefetch 2 a thread), and the settings autotune chose by the end of epoch 1 (what epoch
  2 runs). A sweep's best is the maximum of a dozen noisy epochs (on a busy machine its
  figure is its luck as much as its setting): the ratios are taken between these
  re-measured medians, measured side by side in the same rounds.

The target: autotune's settings >= 0.9x the best hand-tuned by the end of epoch 1, and
above ``num_workers = cores`` where the most threads is wrong.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastload.resources import usable_cpus

CONFIGS = ("sleep", "gil", "memory", "remote")
PREFETCH = (1, 2, 8)
START_LOOKAHEAD = 1 << 20
# The memory configuration's bound: the start look-ahead and this many batches in flight.
MEMORY_BATCHES = 3
# The remote configuration's hand-tuned look-aheads (bytes).
REMOTE_LOOKAHEADS = (START_LOOKAHEAD, 16 << 20, 256 << 20)


@dataclass(frozen=True, kw_only=True)
class AutotuneBenchConfig:
    samples: int = 600
    batch_size: int = 8
    step_ms: float = 10.0
    configs: tuple[str, ...] = CONFIGS
    max_workers: int = 4
    repeats: int = 2  # rounds of the side-by-side re-measure
    remote_latency_ms: float = 150.0


@dataclass(frozen=True)
class Setting:
    num_workers: int
    prefetch_batches: int
    lookahead_bytes: int = START_LOOKAHEAD

    @property
    def name(self) -> str:
        ahead = "" if self.lookahead_bytes == START_LOOKAHEAD else f"/{self.lookahead_bytes >> 20}M"
        return f"{self.num_workers}x{self.prefetch_batches}{ahead}"

    def kwargs(self) -> dict[str, int]:
        return {
            "num_workers": self.num_workers,
            "prefetch_batches": self.prefetch_batches,
            "lookahead_bytes": self.lookahead_bytes,
        }


@dataclass
class _Case:
    """One configuration: its step, how loaders are made, the bounds."""

    name: str
    step: str  # sleep | gil
    cold: bool  # every epoch from an empty cache
    bounds: dict[str, Any] = field(default_factory=dict)
    grid: list[Setting] = field(default_factory=list)


def _step(kind: str, seconds: float) -> None:
    if kind == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # holds the GIL
        pass


def _epoch(loader: Any, kind: str, step_s: float) -> float:
    """One epoch with the step: samples/s."""
    start, samples = time.perf_counter(), 0
    for images, _ in loader:
        samples += len(images)
        _step(kind, step_s)
    return samples / (time.perf_counter() - start)


def in_flight_bytes(setting: Setting, per_batch: int) -> int:
    """The memory a setting holds, as the tuner counts it (autotune.Autotuner.in_flight_bytes)."""
    return (setting.prefetch_batches + setting.num_workers) * per_batch + setting.lookahead_bytes


def run(out_dir: str | os.PathLike[str], config: AutotuneBenchConfig) -> dict[str, Any]:
    import fastload as fl
    from fastload.bench.doctor_data import builtin_remote
    from fastload.bench.e2e.e2e_data import DataConfig, generate
    from fastload.decode import TrainPreset

    out = Path(out_dir)
    data = generate(out / "data" / f"e2e-{config.samples}", DataConfig(samples=config.samples))
    work = out / "data" / "autotune"
    shutil.rmtree(work, ignore_errors=True)
    warm_cache = work / "warm-cache"
    assert fl.warm(str(data.folder), cache_dir=str(warm_cache), progress=False).ok
    cores = usable_cpus()  # the container's
    step_s = config.step_ms / 1000
    records: dict[str, Any] = {"cores": cores, "load1_start": os.getloadavg()[0], "configs": {}}
    moves: list[str] = []
    handler = _Collect(moves)
    logger = logging.getLogger("fastload.autotune")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    fresh = iter(range(1 << 30))

    @contextlib.contextmanager
    def source(case: _Case) -> Iterator[Any]:
        """A function making the configuration's loaders (each cold one on a new cache)."""
        with contextlib.ExitStack() as stack:
            url, options = str(data.folder), None
            if case.cold:
                url, options = stack.enter_context(
                    builtin_remote(
                        out, samples=config.samples, latency_s=config.remote_latency_ms / 1000
                    )
                )

            def make(**kwargs: Any) -> Any:
                cache = work / f"cold-{next(fresh)}" if case.cold else warm_cache
                return fl.DataLoader(
                    url,
                    batch_size=config.batch_size,
                    shuffle=True,
                    decode="cpu",
                    transform=TrainPreset(224),
                    cache_dir=str(cache),
                    storage_options=options,
                    **kwargs,
                )

            yield make

    def epoch(make: Any, setting: Setting, kind: str) -> float:
        with make(**setting.kwargs()) as dl:
            return _epoch(dl, kind, step_s)

    per_batch = _batch_bytes(fl, data.folder, warm_cache, config.batch_size)
    records["batch_bytes"] = per_batch
    try:
        for name in config.configs:
            case = _case(name, config, per_batch)
            with source(case) as make:
                hand = {s.name: round(epoch(make, s, case.step), 1) for s in case.grid}
                allowed = [s for s in case.grid if _allowed(s, case, per_batch)]
                best = max(allowed, key=lambda s: hand[s.name])
                at_cores = Setting(cores, 2 * cores)
                moves.clear()
                bounds = {"max_workers": config.max_workers, **case.bounds}
                start = Setting(1, 1)
                with make(**start.kwargs(), autotune=bounds) as dl:
                    first = _epoch(dl, case.step, step_s)
                    tuned = dl.stats()["autotune"]
                chosen = Setting(
                    tuned["num_workers"], tuned["prefetch_batches"], tuned["lookahead_bytes"]
                )
                side_by_side: dict[str, list[float]] = {"best": [], "cores": [], "autotune": []}
                peers = {"best": best, "cores": at_cores, "autotune": chosen}
                order = list(peers)
                for round_ in range(config.repeats):
                    for key in order[round_ % 3 :] + order[: round_ % 3]:
                        side_by_side[key].append(epoch(make, peers[key], case.step))
            med = {k: statistics.median(v) for k, v in side_by_side.items()}
            records["configs"][name] = {
                "step": case.step,
                "cold": case.cold,
                "bounds": bounds,
                "hand_tuned": hand,
                "over_bound": sorted(s.name for s in case.grid if s not in allowed),
                "best": best.name,
                "best_sweep_samples_per_s": hand[best.name],
                "cores_setting": at_cores.name,
                "cores_within_bound": _allowed(at_cores, case, per_batch),
                "autotune_epoch1": round(first, 1),
                "chosen": chosen.name,
                "in_flight_bytes": tuned.get("in_flight_bytes"),
                "remeasured": {k: [round(x, 1) for x in v] for k, v in side_by_side.items()},
                "best_samples_per_s": round(med["best"], 1),
                "cores_samples_per_s": round(med["cores"], 1),
                "autotune_samples_per_s": round(med["autotune"], 1),
                "epoch1_of_best": round(first / med["best"], 3),
                "autotune_of_best": round(med["autotune"] / med["best"], 3),
                "cores_of_best": round(med["cores"] / med["best"], 3),
                "above_cores": med["autotune"] > med["cores"],
                "log": list(moves),
                "load1": os.getloadavg()[0],
            }
            print("\n".join(_lines(name, records["configs"][name])), flush=True)
    finally:
        logger.removeHandler(handler)
        shutil.rmtree(work, ignore_errors=True)
    return records


def _case(name: str, config: AutotuneBenchConfig, per_batch: int) -> _Case:
    threads = range(1, config.max_workers + 1)
    grid = [Setting(w, p) for w in threads for p in PREFETCH]
    if name in ("sleep", "gil"):
        return _Case(name, name, cold=False, grid=grid)
    if name == "memory":
        bound = START_LOOKAHEAD + MEMORY_BATCHES * per_batch
        return _Case(name, "sleep", cold=False, bounds={"max_memory_bytes": bound}, grid=grid)
    if name == "remote":
        ahead = [
            Setting(w, p, a)
            for w in sorted({1, 2, config.max_workers})
            for p in (2, 8)
            for a in REMOTE_LOOKAHEADS
        ]
        return _Case(name, "sleep", cold=True, grid=ahead)
    raise ValueError(f"unknown configuration {name!r}: one of {CONFIGS}")


def _allowed(setting: Setting, case: _Case, per_batch: int) -> bool:
    bound = case.bounds.get("max_memory_bytes")
    return bound is None or in_flight_bytes(setting, per_batch) <= bound


def _batch_bytes(fl: Any, folder: Path, cache: Path, batch_size: int) -> int:
    """A batch's bytes as the tuner counts them: encoded (the dataset's mean) and decoded."""
    from fastload.decode import TrainPreset

    with fl.DataLoader(
        str(folder),
        batch_size=batch_size,
        decode="cpu",
        transform=TrainPreset(224),
        cache_dir=str(cache),
        num_workers=1,
    ) as dl:
        images, labels = next(iter(dl))
        decoded = images.nbytes + labels.nbytes
        encoded = dl.dataset.store.manifest.total_bytes // len(dl.dataset) * batch_size
    return int(decoded + encoded)


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def _lines(name: str, r: dict[str, Any]) -> list[str]:
    bound = "" if r["cores_within_bound"] else " (over the bound)"
    out = [
        f"{name} ({r['step']} step{', cold' if r['cold'] else ''}): best hand-tuned "
        f"{r['best']} {r['best_samples_per_s']:,.0f}/s (sweep {r['best_sweep_samples_per_s']:,.0f}"
        f"); num_workers=cores {r['cores_setting']} {r['cores_samples_per_s']:,.0f}/s "
        f"({r['cores_of_best']:.2f}x){bound}; autotune epoch 1 {r['autotune_epoch1']:,.0f}/s "
        f"({r['epoch1_of_best']:.2f}x), chose {r['chosen']}: {r['autotune_samples_per_s']:,.0f}"
        f"/s ({r['autotune_of_best']:.2f}x); load {r['load1']:.1f}"
    ]
    return out + [f"    {m}" for m in r["log"]]


def lines(records: dict[str, Any]) -> list[str]:
    out = [
        f"{records['cores']} cores, load {records['load1_start']:.1f} at the start; a batch "
        f"holds {records['batch_bytes']:,} bytes (decoded and encoded)"
    ]
    for name, r in records["configs"].items():
        out += _lines(name, r)
    return out
