"""Reading cached bytes: fastload's native reader vs Python readinto vs os.preadv threads vs cat.

Command (full size: one 1 GiB file in 4 MiB blocks, 20,000 files of 100 KB)::

    .venv/bin/python benchmarks/benchmark_read.py --out fastload-bench

Add ``--quick`` for 256 MiB and 2,000 files. Writes ``read.json`` into ``--out`` and prints
a table with each system's throughput as a ratio to ``cat > /dev/null`` (the ceiling).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastload.bench.components import read_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    base = read_bench.ReadBenchConfig.quick() if args.quick else read_bench.ReadBenchConfig()
    config = read_bench.ReadBenchConfig(**{**base.__dict__, "num_threads": args.threads})
    report = read_bench.run(Path(args.out) / "data", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
