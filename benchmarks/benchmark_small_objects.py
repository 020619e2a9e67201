"""Staging 20,000 objects of 512 B from S3: client CPU per object, fastload against s5cmd (P10).

Command (full size, median of 3)::

    .venv/bin/python benchmarks/benchmark_small_objects.py --out fastload-bench

Add ``--quick`` for 2,000 objects and one repeat. Writes ``small_objects.json`` into
``--out`` and prints a table: objects/s as a ratio to ``fastload warm``'s, client and
server CPU per object, and the GIL time a busy Python thread lost per staged object.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastload.bench import small_objects_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    settings = small_objects_bench.SmallObjectsBenchConfig
    config = settings.quick() if args.quick else settings()
    report = small_objects_bench.run(Path(args.out) / "data" / "small_objects", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
