"""Opening a 1.28 M-sample dataset: first and cached open, memory per process and per worker,
pickled size, first batch, listing requests; a tar set's node share; peers' index load (P11).

Command (full size: 1,281,167 images in 1,000 class folders and 1,024 tar shards of 67 MB,
synthetic buckets served over S3 with 20 ms per request; ~6 min on a 2-core VM)::

    .venv/bin/python benchmarks/benchmark_scale.py --out fastload-bench

Add ``--quick`` for 50,000 images and 64 shards of 4 MB (about 1.5 min), ``--processes
0`` to leave out the cases of a node's processes opening at once, ``--no-peers`` to leave
out mosaicml-streaming's and litdata's index load (they run from ``.venv-peers``, ``make
bench-peers``), ``--fastload-index`` to also write fastload's own tar index (reads every
shard once: ~4 more min at full size) and open and take a first batch with it. Writes
``scale.json`` into ``--out`` and prints a table and P11's targets, each met or missed.
``fastload bench --scale [--quick]`` runs the default cases.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastload.bench.scale import scale_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--processes", type=int, help="processes opening at once (default 8)")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument(
        "--fastload-index",
        action="store_true",
        help="also write fastload's tar index (every shard read once: ~4 min at full size)",
    )
    args = parser.parse_args()
    settings = scale_bench.ScaleBenchConfig
    config = settings.quick() if args.quick else settings()
    changes = {"peers": not args.no_peers, "fastload_index": args.fastload_index}
    if args.processes is not None:
        changes["processes"] = args.processes
    config = dataclasses.replace(config, **changes)
    report = scale_bench.run(Path(args.out) / "data" / "scale", config)
    print(report.table())
    print("\n".join(scale_bench.target_lines(report)))
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
