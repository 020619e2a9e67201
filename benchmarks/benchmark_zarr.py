"""Random Zarr rows: fastload from its cache vs zarr-python over HTTP with 20 ms latency.

Command (full size: 20,000 rows of 32x32x3 uint8 + an int64 label, 300 random rows)::

    .venv/bin/python benchmarks/benchmark_zarr.py --out fastload-bench

Add ``--quick`` for 4,000 rows and 60 random rows, ``--zarr-format 2`` for Zarr v2. Needs
``pip install zarr numcodecs aiohttp``. Writes ``zarr.json`` into ``--out`` and prints a
table with each system's rows/s as a ratio to zarr-python reading over HTTP.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from fastload.bench.components import zarr_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--zarr-format", type=int, choices=(2, 3), default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    base = zarr_bench.ZarrBenchConfig.quick() if args.quick else zarr_bench.ZarrBenchConfig()
    config = replace(base, zarr_format=args.zarr_format, latency_s=args.latency_ms / 1000)
    report = zarr_bench.run(Path(args.out) / "data", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
