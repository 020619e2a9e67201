"""``autotune=True`` against hand-tuned settings (#35, P17).

Data: the bench's generated ImageFolder (600 JPEGs of about 105 KB,
:mod:`fastload.bench.e2e.e2e_data`) read from a warm local cache, batches of 8 decoded to
``TrainPreset(224)``, a simulated training step per batch (a sleep, or a busy loop holding
the GIL). Per configuration:

* **hand-tuned**: one epoch at each of ``num_workers`` 1..``max_workers`` x
  ``prefetch_batches`` {1, 2, 8}; the best epoch's samples/s is the bar.
* **cores**: ``num_workers`` = the cores (the rule of thumb), prefetch 2 per thread.
* **autotune**: from ``num_workers=1, prefetch_batches=1``, two epochs: the first (tuning
  as it runs) and the second (starting from what the first chose); the settings chosen
  and the log of moves.

Figures: each epoch's samples/s over the best hand-tuned; the target is >= 0.9x by the
end of the first epoch (the second epoch's rate, which runs on the settings the first
chose) and, where a step holds the GIL, above ``num_workers`` = cores.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.resources import usable_cpus

STEPS = ("sleep", "gil")
PREFETCH = (1, 2, 8)


@dataclass(frozen=True, kw_only=True)
class AutotuneBenchConfig:
    samples: int = 600
    batch_size: int = 8
    step_ms: float = 10.0
    steps: tuple[str, ...] = STEPS
    max_workers: int = 4


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


def run(out_dir: str | os.PathLike[str], config: AutotuneBenchConfig) -> dict[str, Any]:
    import fastload as fl
    from fastload.bench.e2e.e2e_data import DataConfig, generate
    from fastload.decode import TrainPreset

    out = Path(out_dir)
    data = generate(out / "data" / f"e2e-{config.samples}", DataConfig(samples=config.samples))
    cache = out / "data" / "autotune-cache"
    shutil.rmtree(cache, ignore_errors=True)
    assert fl.warm(str(data.folder), cache_dir=str(cache), progress=False).ok
    cores = usable_cpus()
    step_s = config.step_ms / 1000
    records: dict[str, Any] = {"cores": cores, "load1_start": os.getloadavg()[0]}
    moves: list[str] = []
    handler = _Collect(moves)
    logging.getLogger("fastload.autotune").addHandler(handler)
    logging.getLogger("fastload.autotune").setLevel(logging.INFO)

    def loader(**kwargs: Any) -> Any:
        return fl.DataLoader(
            str(data.folder),
            batch_size=config.batch_size,
            shuffle=True,
            decode="cpu",
            transform=TrainPreset(224),
            cache_dir=str(cache),
            **kwargs,
        )

    try:
        for kind in config.steps:
            hand: dict[str, float] = {}
            for workers in range(1, config.max_workers + 1):
                for prefetch in PREFETCH:
                    with loader(num_workers=workers, prefetch_batches=prefetch) as dl:
                        hand[f"{workers}x{prefetch}"] = round(_epoch(dl, kind, step_s), 1)
            with loader(num_workers=cores, prefetch_batches=2 * (cores or 1)) as dl:
                at_cores = _epoch(dl, kind, step_s)
            moves.clear()
            bounds = {"max_workers": config.max_workers}
            with loader(num_workers=1, prefetch_batches=1, autotune=bounds) as dl:
                first = _epoch(dl, kind, step_s)
                chosen = {k: v for k, v in dl.stats()["autotune"].items() if k != "changes"}
                second = _epoch(dl, kind, step_s)
            best_name = max(hand, key=lambda k: hand[k])
            best = hand[best_name]
            records[kind] = {
                "hand_tuned": hand,
                "best": best_name,
                "best_samples_per_s": best,
                "cores_samples_per_s": round(at_cores, 1),
                "autotune_epoch1": round(first, 1),
                "autotune_epoch2": round(second, 1),
                "epoch1_of_best": round(first / best, 3),
                "epoch2_of_best": round(second / best, 3),
                "above_cores": second > at_cores,
                "chosen": chosen,
                "log": list(moves),
                "load1": os.getloadavg()[0],
            }
    finally:
        logging.getLogger("fastload.autotune").removeHandler(handler)
    return records


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def lines(records: dict[str, Any]) -> list[str]:
    out = [f"{records['cores']} cores, load {records['load1_start']:.1f} at the start"]
    for kind in STEPS:
        r = records.get(kind)
        if r is None:
            continue
        out.append(
            f"{kind} step: best hand-tuned {r['best']} (workers x prefetch) "
            f"{r['best_samples_per_s']:,.0f}/s; num_workers=cores {r['cores_samples_per_s']:,.0f}"
            f"/s; autotune epoch 1 {r['autotune_epoch1']:,.0f}/s ({r['epoch1_of_best']:.2f}x),"
            f" epoch 2 {r['autotune_epoch2']:,.0f}/s ({r['epoch2_of_best']:.2f}x); chose "
            f"workers={r['chosen']['num_workers']} prefetch={r['chosen']['prefetch_batches']};"
            f" load {r['load1']:.1f}"
        )
        out += [f"    {m}" for m in r["log"]]
    return out
