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

Then, for Zarr v3 (``sharded``), the same case's array written twice more, unsharded and
sharded (``shard_chunks`` inner chunks of ``chunk_rows`` rows per shard object, labels
alike), both served by a loopback S3 server in a process of its own (``S3FolderProcess``,
the same latency), each read by fastload:

* a cold epoch (a fresh cache) through ``fl.DataLoader`` (batch ``epoch_batch``,
  ``epoch_workers`` threads, shuffled): its GETs as the server counts them (``GetObject``;
  ``data_gets`` those of chunk or shard objects), against the shard objects it touches
  (``objects``; ``inner_chunks`` the chunks inside them): the target is one GET a shard;
* from the cache that epoch filled: whole epochs through the same loader (rows/s) and the
  random rows above, one ``dataset[i]`` at a time, the decoded-chunk LRU emptied before
  each pass (rows/s); the target is the sharded array within 10% of the unsharded one
  (``ratio`` >= 0.9).

zarr-python's imports happen when the benchmark runs (``pip install zarr``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from fastload.bench.runner import Measurement, Report, measure, relate
from fastload.datasets import open_dataset
from fastload.datasets.zarr import ZarrArray, ZarrDataset
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
    sharded: bool = True  # the sharded vs unsharded case (Zarr v3)
    shard_chunks: int = 16  # inner chunks per shard along axis 0
    epoch_batch: int = 64
    epoch_workers: int = 2

    def __post_init__(self) -> None:
        for name in ("rows", "chunk_rows", "sample_rows", "repeats", "shard_chunks", "epoch_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.sample_rows > self.rows:
            raise ValueError(f"sample_rows ({self.sample_rows}) must be <= rows ({self.rows})")
        if self.zarr_format not in (2, 3):
            raise ValueError(f"zarr_format must be 2 or 3, got {self.zarr_format}")
        if self.epoch_workers < 0:
            raise ValueError(f"epoch_workers must be >= 0, got {self.epoch_workers}")
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
    if config.sharded:
        report.rows += _sharding_case(root, config, rows)
    return report


def _check_same_rows(want: list[dict[str, Any]], got: list[Any]) -> None:
    """The systems must agree before their speed means anything."""
    for w, g in zip(want, got, strict=True):
        for name in ("images", "labels"):
            if not np.array_equal(w[name], g[name]):
                raise AssertionError(f"fastload and zarr-python disagree on {name}")


# --- sharded vs unsharded -----------------------------------------------------------------------

SHARDING_BUCKET = "zarr-bench"
UNSHARDED = "fastload, unsharded"
SHARD_TARGET = 0.9  # the sharded array's rows/s over the unsharded one's, from the cache


def sharded_system(config: ZarrBenchConfig) -> str:
    return f"fastload, sharded ({config.shard_chunks} chunks a shard)"


def generate_sharded(root: Path, config: ZarrBenchConfig) -> dict[str, Path]:
    """The case's group as Zarr v3 twice under root/<bucket>: ``unsharded/ds`` (chunks of
    ``chunk_rows`` rows) and ``sharded/ds`` (the same rows and inner chunks, in shards of
    ``shard_chunks`` chunks), each kept when written with the same settings."""
    import zarr

    bucket = root / SHARDING_BUCKET
    plain = generate(bucket / "unsharded", replace(config, zarr_format=3))
    where = bucket / "sharded"
    stamp = where / "params.json"
    params = json.dumps(
        {k: getattr(config, k) for k in ("rows", "row_shape", "chunk_rows", "shard_chunks", "seed")}
    )
    path = where / "ds"
    if not (stamp.exists() and stamp.read_text() == params):
        source = zarr.open_group(str(plain), mode="r")
        group = zarr.group(str(path), zarr_format=3, overwrite=True)
        shard_rows = config.chunk_rows * config.shard_chunks
        for name in ("images", "labels"):
            array: Any = source[name]
            rest = tuple(array.shape[1:])
            out = group.create_array(
                name,
                shape=array.shape,
                chunks=(config.chunk_rows, *rest),
                shards=(shard_rows, *rest),
                dtype=array.dtype,
            )
            for start in range(0, config.rows, shard_rows):  # whole shards, bounded memory
                stop = min(config.rows, start + shard_rows)
                out[start:stop] = array[start:stop]
        stamp.write_text(params)
    return {UNSHARDED: plain, sharded_system(config): path}


def _loader_epoch(loader: Any, rows: int) -> int:
    n = 0
    for batch in loader:
        n += len(batch["labels"])
    if n != rows:
        raise AssertionError(f"{n} rows in an epoch, not {rows}")
    return n


def _sharding_case(
    root: Path, config: ZarrBenchConfig, sample: npt.NDArray[np.int64]
) -> list[Measurement]:
    """Sharded vs unsharded, each read by fastload from a loopback S3 server: a cold epoch's
    GETs, then rows/s from the cache (whole epochs, random rows)."""
    import fastload as fl
    from fastload.testing import S3FolderProcess

    served = root / "sharding"
    layouts = generate_sharded(served, config)
    shape = "x".join(map(str, config.row_shape))
    what = (
        f"{config.rows:,} rows ({shape} uint8 + int64 label; {config.chunk_rows}-row chunks; "
        "Zarr v3)"
    )
    remote = f"S3 at {config.latency_s * 1000:g} ms"
    cases = {
        "cold": f"sharding: cold epoch from {remote}, fl.DataLoader, "
        f"{config.epoch_workers} threads, {what}",
        "epoch": f"sharding: cached epoch, fl.DataLoader, {config.epoch_workers} threads, {what}",
        "rows": f"sharding: {config.sample_rows} random rows, cached, LRU emptied per pass, {what}",
    }
    row_bytes = int(np.prod(config.row_shape)) + 8
    measurements: list[Measurement] = []
    behavior = RemoteBehavior(latency_s=config.latency_s)
    server = S3FolderProcess(served, behavior=behavior)
    with server:
        for system, path in layouts.items():
            cache = served / "cache" / path.parent.name
            shutil.rmtree(cache, ignore_errors=True)
            url = f"s3://{SHARDING_BUCKET}/{path.parent.name}/ds"
            ds = fl.open_dataset(
                url,
                format="zarr",
                cache_dir=str(cache),
                storage_options=server.storage_options,
            )
            assert isinstance(ds, ZarrDataset)
            objects = sorted({k for keys in ds.shard_keys for k in keys})
            inner = sum(
                math.prod(-(-s // c) for s, c in zip(a.shape, a.chunks, strict=True))
                for a in ds.arrays.values()
                if isinstance(a, ZarrArray)
            )
            loader = fl.DataLoader(
                ds,
                batch_size=config.epoch_batch,
                shuffle=True,
                num_workers=config.epoch_workers,
                seed=config.seed,
            )
            server.reset_stats()
            start = time.perf_counter()
            _loader_epoch(loader, config.rows)
            cold_s = time.perf_counter() - start
            stats = server.read_stats()
            data_gets = sum(
                n
                for (op, p), n in stats.operations.items()
                if op == "GetObject" and not p.endswith(("zarr.json", ".zarray", ".zattrs"))
            )
            gets = {
                "gets_per_epoch": stats.count("GetObject"),
                "data_gets": data_gets,
                "objects": len(objects),
                "inner_chunks": inner,
            }
            note = f"GETs = objects touched: {'met' if data_gets == len(objects) else 'missed'}"
            measurements.append(
                Measurement(
                    benchmark="zarr",
                    case=cases["cold"],
                    system=system,
                    seconds=cold_s,
                    repeats=[cold_s],
                    items=config.rows,
                    nbytes=config.rows * row_bytes,
                    note=note,
                    extra=dict(gets),
                )
            )
            server.reset_stats()
            measurements.append(
                measure(
                    functools.partial(_loader_epoch, loader, config.rows),
                    benchmark="zarr",
                    case=cases["epoch"],
                    system=system,
                    items=config.rows,
                    nbytes=config.rows * row_bytes,
                    repeats=config.repeats,
                )
            )
            measurements.append(
                measure(
                    functools.partial(_read_fastload, ds, sample),
                    benchmark="zarr",
                    case=cases["rows"],
                    system=system,
                    items=config.sample_rows,
                    nbytes=config.sample_rows * row_bytes,
                    repeats=config.repeats,
                )
            )
            warm_gets = server.read_stats().count("GetObject")
            if warm_gets:  # from the cache: the server should hear nothing
                measurements[-1] = replace(
                    measurements[-1], note=f"{warm_gets} GETs from the cache"
                )
            loader.close()
            ds.close()
    related = relate(measurements, UNSHARDED)
    out = []
    for m in related:
        if m.system != UNSHARDED and m.case != cases["cold"] and m.ratio is not None:
            verdict = "met" if m.ratio >= SHARD_TARGET else "missed"
            note = f"rows/s within 10% of unsharded: {verdict}"
            m = replace(m, note="; ".join(x for x in (m.note, note) if x))
        out.append(m)
    return out
