"""A dataset twice the cache's budget, read epoch after epoch from a 20 ms remote (P13).

Case: N generated JPEGs (natural-image-like, about 105 KB at the default size) in an
ImageFolder layout in a bucket of :class:`~fastload.testing.S3FolderServer`, run in a
process of its own (``HTTPServerProcess(s3=True)``) that waits ``latency_s`` before
answering each request. ``fl.DataLoader`` reads it, decoding on the CPU to 224 px
(``EvalPreset``), with a cache whose ``max_bytes`` is half the dataset's bytes. Under
``pin`` half the samples are cached after the first epoch and the other half come from
the remote on every epoch; under ``lru`` a shuffled epoch evicts what the next one needs.

Systems (each with its own cache folder and loader, in this process; each runs its first
epoch, untimed, then they take turns epoch by epoch, so drift on a shared machine hits
them alike; samples/s is the median over the steady epochs):

* ``all cached``: no budget, the whole dataset staged before the first epoch. The
  reference of every ratio (the target: ``pin`` >= 0.7x of it).
* ``pin, fetched ahead into memory``: what the cache turns away is fetched ahead with the
  staged objects and read from memory (``FetchConfig.hold_bytes`` default).
* ``pin, read when needed``: ``hold_bytes=0``, as before: each turned-away sample is a
  synchronous GET on a loader thread when its batch is read.
* ``lru``: the same budget, ``lru`` policy.

Figures: ``GET/sample`` (the server's GETs over the steady epochs' samples: about 0.5 for
``pin``, the share it does not keep), ``held MB`` (the peak of the holding area).

Command (full size: 2,000 images, 20 ms, 4 epochs: 3 steady)::

    .venv/bin/python benchmarks/benchmark_budget.py --out fastload-bench
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import fastload as fl
from fastload.bench.e2e.e2e_data import natural_image
from fastload.bench.runner import Measurement, Report, relate
from fastload.staging import FetchConfig
from fastload.testing import HTTPServerProcess

BUCKET = "budget"
PREFIX = "folder"
ALL_CACHED = "all cached"
PIN_HELD = "pin, fetched ahead into memory"
PIN_UNHELD = "pin, read when needed"
LRU = "lru"


@dataclass(frozen=True, kw_only=True)
class BudgetBenchConfig:
    samples: int = 2_000
    classes: int = 100
    min_side: int = 350  # image sides are drawn in [min_side, min_side * 10 // 7]
    budget_fraction: float = 0.5  # the cache's max_bytes, of the dataset's bytes
    latency_s: float = 0.02
    epochs: int = 4  # the first fills the cache and is not timed
    batch_size: int = 32
    num_workers: int = 4
    image_side: int = 224

    def __post_init__(self) -> None:
        for name in ("samples", "classes", "min_side", "batch_size", "num_workers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.epochs < 2:
            raise ValueError(f"epochs must be >= 2 (the first only fills), got {self.epochs}")
        if not 0 < self.budget_fraction < 1:
            raise ValueError(f"budget_fraction must be in (0, 1), got {self.budget_fraction}")

    @classmethod
    def quick(cls) -> BudgetBenchConfig:
        return cls(samples=600, epochs=3)


def generate(root: Path, config: BudgetBenchConfig) -> int:
    """The JPEGs under root/BUCKET/PREFIX (kept while the parameters match); their bytes."""
    folder = root / BUCKET / PREFIX
    stamp = root / f"{BUCKET}.json"
    params = {"samples": config.samples, "classes": config.classes, "side": config.min_side}
    if not (stamp.exists() and json.loads(stamp.read_text()) == params):
        from PIL import Image

        shutil.rmtree(folder, ignore_errors=True)
        for i in range(config.samples):
            rng = np.random.default_rng([i, 13])
            sides = rng.integers(config.min_side, config.min_side * 10 // 7 + 1, 2)
            out = io.BytesIO()
            Image.fromarray(natural_image(rng, int(sides[0]), int(sides[1]))).save(
                out, "JPEG", quality=90
            )
            path = folder / f"class_{i % config.classes:03d}" / f"{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(out.getvalue())
        stamp.write_text(json.dumps(params))
    return sum(p.stat().st_size for p in folder.rglob("*.jpg"))


class _System:
    """One system's dataset and loader; its first epoch (untimed) runs on creation."""

    def __init__(
        self,
        server: HTTPServerProcess,
        cache: Path,
        config: BudgetBenchConfig,
        settings: dict[str, Any],
    ) -> None:
        from fastload.decode import EvalPreset

        self.server = server
        self.dataset = fl.open_dataset(
            f"s3://{BUCKET}/{PREFIX}",
            cache_dir=str(cache),
            storage_options=server.storage_options,
            **settings,
        )
        if "max_bytes" not in settings:
            self.dataset.warm()
        self.loader = fl.DataLoader(
            self.dataset,
            batch_size=config.batch_size,
            shuffle=True,
            num_workers=config.num_workers,
            decode="cpu",
            transform=EvalPreset(config.image_side),
        )
        self.seconds: list[float] = []  # per steady epoch
        self.samples = 0  # over the steady epochs
        self.gets = 0  # the server's GETs over the steady epochs
        self._epoch()

    def _epoch(self) -> tuple[int, float]:
        start = time.perf_counter()
        samples = sum(len(labels) for _, labels in self.loader)
        return samples, time.perf_counter() - start

    def steady_epoch(self) -> None:
        before = self.server.stats().count(method="GET")
        samples, seconds = self._epoch()
        self.gets += self.server.stats().count(method="GET") - before
        self.samples += samples
        self.seconds.append(seconds)

    def close(self) -> int:
        """Closes it; the holding area's peak bytes."""
        held = self.loader.stats().get("held", {})
        self.loader.close()
        self.dataset.close()
        return int(held.get("peak_bytes", 0))


def run(data_dir: str | os.PathLike[str], config: BudgetBenchConfig | None = None) -> Report:
    config = config or BudgetBenchConfig()
    data_dir = Path(data_dir)
    root = data_dir / "remote"
    nbytes = generate(root, config)
    # A share of the data's bytes: the budget counts the entries (the metadata aside).
    budget = {"max_bytes": int(nbytes * config.budget_fraction), "budget_counts": "entries"}
    systems: dict[str, dict[str, Any]] = {
        ALL_CACHED: {},
        PIN_HELD: {**budget, "policy": "pin"},
        PIN_UNHELD: {**budget, "policy": "pin", "fetch": FetchConfig(hold_bytes=0)},
        LRU: {**budget, "policy": "lru"},
    }
    rows = []
    case = (
        f"{config.samples} JPEGs ({nbytes / 1e6:.0f} MB) from S3 at "
        f"{config.latency_s * 1000:.0f} ms, cache {config.budget_fraction:g} of them"
    )
    with HTTPServerProcess(root, s3=True, latency_s=config.latency_s) as server:
        running: dict[str, _System] = {}
        try:
            for name, settings in systems.items():
                cache = data_dir / "caches" / name.replace(" ", "_").replace(",", "")
                shutil.rmtree(cache, ignore_errors=True)
                running[name] = _System(server, cache, config, settings)
            for _ in range(config.epochs - 1):
                for system in running.values():  # turns: drift on the machine hits all alike
                    system.steady_epoch()
        finally:
            held_peak_bytes = {name: system.close() for name, system in running.items()}
    for name, system in running.items():
        per_epoch = system.samples // len(system.seconds)
        rows.append(
            Measurement(
                benchmark="budget",
                case=case,
                system=name,
                seconds=statistics.median(system.seconds),
                repeats=system.seconds,
                items=per_epoch,
                nbytes=int(nbytes * per_epoch / config.samples),
                extra={
                    "GET/sample": system.gets / system.samples,
                    "held MB": held_peak_bytes[name] / 1e6,
                },
            )
        )
    return Report(
        name="budget",
        rows=relate(rows, ALL_CACHED),
        params={
            **asdict(config),
            "dataset_bytes": nbytes,
            "max_bytes": budget["max_bytes"],
            "budget_counts": "entries",
            "server": "S3FolderServer in its own process",
        },
    )
