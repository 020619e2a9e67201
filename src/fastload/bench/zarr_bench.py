"""Random rows of a Zarr dataset: fastload from its cache vs zarr-python over HTTP.

One Zarr group (``images`` uint8 rows plus ``labels`` int64, chunked along axis 0) written
by zarr-python and served by the loopback HTTP server with a fixed latency per request
(the time to first byte of object storage). Every system reads the same random rows, one
``dataset[i]`` at a time as a map-style dataset's ``__getitem__`` does:

* zarr-python straight from the HTTP server (the reference: what users do today);
* zarr-python on the local directory (the same data copied to local disk by hand);
* fastload after ``dataset.warm()`` (untimed, as ``fastload warm`` would), with its
  per-process LRU of decoded chunk-rows, and with that LRU off (every row decodes its
  chunk). The LRU is emptied before each timed pass, so it only helps where the sampled
  rows share a chunk.

zarr-python's imports happen when the benchmark runs (``pip install zarr``).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fastload.bench.runner import Measurement, Report, measure, relate
from fastload.datasets import open_dataset
from fastload.datasets.zarr import ZarrDataset
from fastload.testing import RangeHTTPServer, RemoteBehavior

REFERENCE = "zarr-python over HTTP"


@dataclass(frozen=True, kw_only=True)
class ZarrBenchConfig:
    rows: int = 20_000
    row_shape: tuple[int, ...] = (32, 32, 3)
    chunk_rows: int = 64
    sample_rows: int = 300  # random rows read per timed pass
    zarr_format: Literal[2, 3] = 3
    latency_s: float = 0.02
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rows", "chunk_rows", "sample_rows", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.sample_rows > self.rows:
            raise ValueError(f"sample_rows ({self.sample_rows}) must be <= rows ({self.rows})")
        if self.zarr_format not in (2, 3):
            raise ValueError(f"zarr_format must be 2 or 3, got {self.zarr_format}")
        if self.latency_s < 0 or any(n <= 0 for n in self.row_shape):
            raise ValueError("latency_s must be >= 0 and every row_shape length > 0")

    @classmethod
    def quick(cls) -> ZarrBenchConfig:
        return cls(rows=4_000, sample_rows=60)


def generate(root: Path, config: ZarrBenchConfig) -> Path:
    """The Zarr group under root/ds (kept when it was written with the same settings)."""
    import zarr

    path = root / "ds"
    stamp = root / "params.json"
    params = json.dumps(
        {k: getattr(config, k) for k in ("rows", "row_shape", "chunk_rows", "zarr_format")}
    )
    if stamp.exists() and stamp.read_text() == params:
        return path
    group = zarr.group(str(path), zarr_format=config.zarr_format, overwrite=True)
    images = group.create_array(
        "images",
        shape=(config.rows, *config.row_shape),
        chunks=(config.chunk_rows, *config.row_shape),
        dtype="uint8",
    )
    labels = group.create_array(
        "labels", shape=(config.rows,), chunks=(config.chunk_rows,), dtype="int64"
    )
    rng = np.random.default_rng(config.seed)
    step = config.chunk_rows * 64
    for start in range(0, config.rows, step):  # bounded memory for large row counts
        stop = min(config.rows, start + step)
        # Smooth-ish content (like pixels) so the compressor has something to do.
        base = rng.integers(0, 256, (stop - start, 1, *config.row_shape[1:]), dtype=np.uint8)
        noise = rng.integers(0, 8, (stop - start, *config.row_shape), dtype=np.uint8)
        images[start:stop] = base + noise
        labels[start:stop] = rng.integers(0, 1000, stop - start)
    stamp.write_text(params)
    return path


def _read_zarr(group: Any, rows: npt.NDArray[np.int64]) -> list[dict[str, Any]]:
    images, labels = group["images"], group["labels"]
    return [{"images": images[int(i)], "labels": labels[int(i)]} for i in rows]


def _read_fastload(ds: ZarrDataset, rows: npt.NDArray[np.int64]) -> list[Any]:
    ds.decoded.clear()  # a cold decoded cache each pass: only rows sharing a chunk gain
    return [ds[int(i)] for i in rows]


def run(data_dir: str | os.PathLike[str], config: ZarrBenchConfig | None = None) -> Report:
    import zarr

    config = config or ZarrBenchConfig()
    root = Path(data_dir) / "zarr"
    path = generate(root, config)
    report = Report(name="zarr", params={**asdict(config), "data_dir": str(data_dir)})
    rows = np.random.default_rng(config.seed + 1).permutation(config.rows)[: config.sample_rows]
    row_bytes = int(np.prod(config.row_shape)) + 8
    case = (
        f"{config.sample_rows} random rows of {config.rows:,} "
        f"({'x'.join(map(str, config.row_shape))} uint8 + int64 label; "
        f"{config.chunk_rows}-row chunks; Zarr v{config.zarr_format})"
    )
    behavior = RemoteBehavior(latency_s=config.latency_s)
    measurements: list[Measurement] = []
    with RangeHTTPServer(root, behavior=behavior) as server:
        url = server.url_for("ds")
        cache = root / "cache"
        opened = {
            "decoded-chunk LRU": open_dataset(url, format="zarr", cache_dir=str(cache)),
            "LRU off": open_dataset(url, format="zarr", cache_dir=str(cache), chunk_cache_bytes=0),
        }
        datasets = {k: v for k, v in opened.items() if isinstance(v, ZarrDataset)}
        next(iter(datasets.values())).warm()  # untimed, as `fastload warm` would
        remote = zarr.open_group(url, mode="r")
        local = zarr.open_group(str(path), mode="r")
        systems: dict[str, Callable[[], object]] = {
            f"{REFERENCE} ({config.latency_s * 1000:g} ms)": lambda: _read_zarr(remote, rows),
            "zarr-python, local copy": lambda: _read_zarr(local, rows),
        }
        for what, ds in datasets.items():
            systems[f"fastload, cached, {what}"] = functools.partial(_read_fastload, ds, rows)
        _check_same_rows(
            _read_zarr(local, rows[:20]), _read_fastload(datasets["LRU off"], rows[:20])
        )
        for system, fn in systems.items():
            measurements.append(
                measure(
                    fn,
                    benchmark="zarr",
                    case=case,
                    system=system,
                    items=config.sample_rows,
                    nbytes=config.sample_rows * row_bytes,
                    repeats=config.repeats,
                )
            )
        for ds in datasets.values():
            ds.store.close()
    reference = measurements[0].system
    report.rows = relate(measurements, reference)
    return report


def _check_same_rows(want: list[dict[str, Any]], got: list[Any]) -> None:
    """The systems must agree before their speed means anything."""
    for w, g in zip(want, got, strict=True):
        for name in ("images", "labels"):
            if not np.array_equal(w[name], g[name]):
                raise AssertionError(f"fastload and zarr-python disagree on {name}")
