"""The Python time of a cached, decoded batch's read: the general path against columns.

A generated ImageFolder (``--files`` files of ~100 KB in 8 classes), warmed into a cache;
``--batches`` shuffled batches of ``--batch-size`` read by ``BatchBuilder``'s general path
(``_read`` then ``_split``: what main did for every decoded batch) and by
``ColumnarRead.read``, alternated in one process, three rounds each. Printed per sample:
wall time, and wall time less the calls that release the GIL (the native read, the
checksums, the index query): the time the reading thread holds the GIL, which a training
step that holds it too waits for. The images are not decoded (the decoder's share is the
same on both paths). Command::

    .venv/bin/python benchmarks/benchmark_columnar_read.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import fastload as fl
import fastload.cache.index as index_module
import fastload.loader.columnar_read as columnar_module
import fastload.loader.entry_checks as checks_module
import fastload.reader as reader_module
from fastload.decode import make_decoder
from fastload.loader.batches import BatchBuilder, _ReadContext
from fastload.loader.stats import LoaderStats

_released = [0.0]  # seconds spent in calls that release the GIL


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _released[0] += time.perf_counter() - start

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1280)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    reader_module.BatchReader.read_spans = _timed(reader_module.BatchReader.read_spans)  # type: ignore[method-assign]
    columnar_module.xxh3_spans = _timed(columnar_module.xxh3_spans)
    checks_module.xxh3_spans = _timed(checks_module.xxh3_spans)
    index_module.Index.placements_of = _timed(index_module.Index.placements_of)  # type: ignore[method-assign]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="fastload-columnar-") as tmp:
        root = Path(tmp) / "ds"
        for i in range(args.files):
            path = root / f"class{i % 8}" / f"{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(rng.integers(0, 256, int(rng.integers(60_000, 140_000)), np.uint8))
        cache = str(Path(tmp) / "cache")
        fl.warm(str(root), cache_dir=cache, progress=False)
        ds = fl.open_dataset(str(root), format="imagefolder", cache_dir=cache)
        with make_decoder("cpu") as decoder:
            builder = BatchBuilder(
                ds, collate_fn=list, batched=True, decoder=decoder, stats=LoaderStats()
            )
            columnar = builder._columnar
            assert columnar is not None
            context = _ReadContext()
            batches = [
                rng.permutation(len(ds))[: args.batch_size].tolist() for _ in range(args.batches)
            ]

            def general(batch: list[int]) -> Any:
                return builder._split(batch, builder._read(batch, context))

            def columns(batch: list[int]) -> Any:
                return columnar.read(batch, context)

            print(f"load average before: {os.getloadavg()}")
            for _ in range(3):
                for name, read in (("general", general), ("columns", columns)):
                    read(batches[0])
                    _released[0] = 0.0
                    start = time.perf_counter()
                    for batch in batches:
                        read(batch)
                    wall = time.perf_counter() - start
                    n = len(batches) * args.batch_size
                    print(
                        f"{name:8s} wall {wall / n * 1e6:6.1f} us/sample, "
                        f"GIL held {(wall - _released[0]) / n * 1e6:5.1f} us/sample"
                    )
            print(f"load average after: {os.getloadavg()}")
        ds.close()


if __name__ == "__main__":
    main()
