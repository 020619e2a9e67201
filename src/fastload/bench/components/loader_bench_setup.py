"""The loader benchmark's settings (:class:`LoaderBenchConfig`), its cases and their systems,
and the data the parent makes before any system runs (:func:`prepare`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.utils.data

from fastload.bench.components import decode_bench, zarr_bench

CASES = ("memory", "jpeg", "zarr")
FASTLOAD = "fastload DataLoader"
SAME_DECODER = "torch DataLoader + fastload's decoder"
# Each case's systems, the reference (a torch DataLoader peer) first.
SYSTEMS: dict[str, tuple[str, ...]] = {
    "memory": ("torch DataLoader", FASTLOAD),
    "jpeg": (
        "torch DataLoader + Pillow",
        "torch DataLoader + simplejpeg",
        SAME_DECODER,
        f"{FASTLOAD}, decode='cpu'",
    ),
    "zarr": ("torch DataLoader + zarr-python", FASTLOAD),
}
NOTES = {
    ("memory", "torch DataLoader"): "processes",
    ("memory", FASTLOAD): "hands it to torch: processes",
    ("jpeg", "torch DataLoader + Pillow"): "processes, float32 torch ops",
    ("jpeg", "torch DataLoader + simplejpeg"): "processes, float32 torch ops",
    ("jpeg", SAME_DECODER): "processes, a batch per __getitems__, 1 decode thread each",
    ("jpeg", f"{FASTLOAD}, decode='cpu'"): "threads, from its cache",
    ("zarr", "torch DataLoader + zarr-python"): "processes",
    ("zarr", FASTLOAD): "threads, from its cache",
}
MEMORY_CLASSES = 100
MB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class LoaderBenchConfig:
    batch_size: int = 64
    workers: int = 2  # processes for torch, threads for fastload's fast path
    epochs: int = 5  # epochs with the training step: wait fraction and memory per epoch
    repeats: int = 3  # epochs without a step after those: samples/s (median)
    step: Literal["sleep", "matmul"] = "sleep"
    step_ms: float = 20.0  # the simulated training step per batch
    step_holds_gil: bool = True  # also `epochs` epochs with a step that holds the GIL
    cases: tuple[str, ...] = CASES
    memory_samples: int = 8192
    memory_shape: tuple[int, ...] = (3, 64, 64)
    images: int = 3000
    size: int = 224
    zarr_rows: int = 8192
    zarr_row_shape: tuple[int, ...] = (64, 64, 3)
    zarr_chunk_rows: int = 64
    seed: int = 0
    memory_interval_s: float = 0.05  # RSS sampling period (PSS every fifth sample)
    timeout_s: float = 600.0  # for each answer of a system's process (an epoch, its start)

    def __post_init__(self) -> None:
        for name in (
            "batch_size",
            "epochs",
            "repeats",
            "memory_samples",
            "images",
            "size",
            "zarr_rows",
            "zarr_chunk_rows",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.step not in ("sleep", "matmul"):
            raise ValueError(f"step must be 'sleep' or 'matmul', got {self.step!r}")
        if self.step_ms <= 0 or self.memory_interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError("step_ms, memory_interval_s and timeout_s must be > 0")
        unknown = set(self.cases) - set(CASES)
        if unknown or not self.cases:
            raise ValueError(f"cases must be among {CASES}, got {self.cases}")
        if any(n <= 0 for n in (*self.memory_shape, *self.zarr_row_shape)):
            raise ValueError("every length of memory_shape and zarr_row_shape must be > 0")

    @classmethod
    def quick(cls) -> LoaderBenchConfig:
        """Small sizes, the configured step only (the GIL-holding one is in the full run)."""
        return cls(memory_samples=2048, images=320, zarr_rows=1024, step_holds_gil=False)


def prepare(data_dir: Path, config: LoaderBenchConfig) -> dict[str, Any]:
    """Generates each case's data once (kept between runs) and warms fastload's cache."""
    from fastload.datasets import open_dataset

    root = data_dir / "loader"
    cache = root / "cache"
    data: dict[str, Any] = {"cache_dir": str(cache), "nbytes": {}}
    if "memory" in config.cases:
        data["nbytes"]["memory"] = config.memory_samples * int(np.prod(config.memory_shape))
    if "jpeg" in config.cases:
        folder = root / f"jpeg-{config.images}"  # its own folder: a listing sees only these
        paths = decode_bench.generate(folder, decode_bench.DecodeBenchConfig(images=config.images))
        data["jpeg_dir"] = str(folder)
        data["nbytes"]["jpeg"] = sum(p.stat().st_size for p in paths)
        with open_dataset(str(folder), format="imagefolder", cache_dir=str(cache)) as ds:
            ds.warm()
    if "zarr" in config.cases:
        shape = "x".join(map(str, config.zarr_row_shape))
        where = root / f"zarr-{config.zarr_rows}-{shape}-{config.zarr_chunk_rows}"
        path = zarr_bench.generate(
            where,
            zarr_bench.ZarrBenchConfig(
                rows=config.zarr_rows,
                row_shape=config.zarr_row_shape,
                chunk_rows=config.zarr_chunk_rows,
                sample_rows=1,
                seed=config.seed,
            ),
        )
        data["zarr_dir"] = str(path)
        data["nbytes"]["zarr"] = config.zarr_rows * (int(np.prod(config.zarr_row_shape)) + 8)
        with open_dataset(str(path), format="zarr", cache_dir=str(cache)) as ds:
            ds.warm()
            _check_zarr_rows(ds, path)
    return data


def _check_zarr_rows(ds: Any, path: Path) -> None:
    """fastload's loader and zarr-python must agree on the rows before speed means anything."""
    import zarr

    from fastload.loader import DataLoader

    group: Any = zarr.open_group(str(path), mode="r")
    rows = min(8, len(ds))
    loader = DataLoader(ds, batch_size=rows, shuffle=False, num_workers=0)
    with loader:
        batch = next(iter(loader))
    for name in ("images", "labels"):
        want = torch.from_numpy(np.asarray(group[name][:rows]))
        if not torch.equal(batch[name], want):
            raise AssertionError(f"fl.DataLoader and zarr-python disagree on {name} of {path}")


def configured(base: LoaderBenchConfig, **overrides: Any) -> LoaderBenchConfig:
    """``base`` with the given fields replaced, skipping those given as None."""
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
