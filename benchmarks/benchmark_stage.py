"""Staging over HTTP: fastload warm vs fsspec fs.get, simplecache:: and filecache:: vs a ceiling.

Command (full size: 2,000 objects of 90-130 KB, 20 ms latency per request, median of 3)::

    .venv/bin/python benchmarks/benchmark_stage.py --out fastload-bench

Add ``--quick`` for 500 objects and one repeat, ``--latency 0.05`` for another latency.
Writes ``stage.json`` into ``--out`` and prints a table with each system's objects/s as a
ratio to ``fastload warm``'s, and a line per fsspec peer saying how fastload compares.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastload.bench.components import stage_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency", type=float, default=None, help="seconds per request")
    args = parser.parse_args()
    config = stage_bench.StageBenchConfig.quick() if args.quick else stage_bench.StageBenchConfig()
    if args.latency is not None:
        config = dataclasses.replace(config, latency_s=args.latency)
    report = stage_bench.run(Path(args.out) / "data" / "stage", config)
    print(report.table())
    print("\n".join(stage_bench.fastload_vs_peers(report)))
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
