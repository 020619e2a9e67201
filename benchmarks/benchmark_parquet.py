"""Parquet images: fastload cold (S3, 20 ms) and warm vs torch + pyarrow and HF datasets.

Command (full size: 3,000 generated JPEGs of ~105 KB in 4 Parquet files of 100-row row
groups; train preset at 224 px, batch 64, 2 workers; 3 timed epochs each)::

    .venv/bin/python benchmarks/benchmark_parquet.py --out fastload-bench

Add ``--quick`` for 320 images and 2 timed epochs. The Hugging Face ``datasets`` peers run
with the peers' Python (``.venv-peers``, built by ``make bench-peers``; ``--peers-python``
names another) and are reported as skipped, with the reason, where it does not import
datasets. Data is generated once into ``--out``/data and kept. Writes ``parquet.json`` into
``--out`` and prints a table (images/s per system, the ratio to the best peer, fastload's
cold epoch over its warm one, GETs per epoch) and issue 17's targets as met or missed.
See ``fastload.bench.components.parquet_bench`` for what each system does.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from fastload.bench.components import parquet_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="timed epochs per system")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--latency-ms", type=float, default=None)
    parser.add_argument("--peers-python", default=None)
    parser.add_argument(
        "--system",
        action="append",
        help="systems whose names start with this (repeatable; default: all)",
    )
    args = parser.parse_args()
    config = (
        parquet_bench.ParquetBenchConfig.quick()
        if args.quick
        else parquet_bench.ParquetBenchConfig()
    )
    overrides = {
        "samples": args.samples,
        "repeats": args.repeats,
        "workers": args.workers,
        "latency_s": None if args.latency_ms is None else args.latency_ms / 1000,
        "peers_python": args.peers_python,
        "systems": tuple(parquet_bench.systems_named(args.system)) if args.system else None,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    report = parquet_bench.run(Path(args.out) / "data", config)
    print(report.table())
    for line in report.params["targets"]:
        print(f"target: {line}")
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
