"""End to end: a remote dataset to augmented batches, fastload against its peers.

Command (full size: 3,000 generated JPEGs of ~105 KB in four layouts, served over S3 with
20 ms per request and 100 MB/s per connection, 3 epochs, 2 workers, batch 64)::

    .venv/bin/python benchmarks/benchmark_e2e.py --out fastload-bench

``--quick`` takes 600 images, folder and tar only, 2 epochs, the sleeping training step
only (the full run also runs every system with a step that holds the GIL;
``--step-holds-gil`` / ``--no-step-holds-gil`` say otherwise). ``--layout`` picks layouts
(folder, tar, zarr, parquet; repeatable), e.g. the Parquet layout alone, full size::

    .venv/bin/python benchmarks/benchmark_e2e.py --out fastload-bench --layout parquet

mosaicml-streaming and litdata (and the Parquet layout's Hugging Face ``datasets`` peers) run
when ``make bench-peers`` has built ``.venv-peers``. Writes ``e2e.json`` (every figure, the
machine) and ``e2e.png`` into ``--out`` and prints the table, fastload's ratio to each peer
and the targets it meets or misses. ``fastload bench`` runs the same; see
``fastload.bench.e2e.e2e_bench``.
"""

from __future__ import annotations

import argparse
import dataclasses

from fastload.bench.e2e import e2e_bench, e2e_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--latency-ms", type=float, default=None)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--step-ms", type=float, default=None, help="training step (20)")
    parser.add_argument(
        "--step-holds-gil",
        action=argparse.BooleanOptionalAction,
        help="also a step that holds the GIL (default: full run yes, --quick no)",
    )
    parser.add_argument("--system", action="append", help="only this system (repeatable)")
    parser.add_argument(
        "--layout",
        action="append",
        choices=e2e_bench.LAYOUTS,
        help="only this layout (repeatable; default: all, --quick: folder and tar)",
    )
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    config = e2e_bench.E2EConfig.quick() if args.quick else e2e_bench.E2EConfig()
    changes = {
        "latency_s": None if args.latency_ms is None else args.latency_ms / 1000,
        "workers": args.workers,
        "epochs": args.epochs,
        "step_s": None if args.step_ms is None else args.step_ms / 1000,
        "steps": e2e_bench.steps_option(args.step_holds_gil),
        "systems": tuple(args.system) if args.system else None,
        "layouts": tuple(args.layout) if args.layout else None,
        "repeats": args.repeats,
    }
    config = dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    report = e2e_bench.run(args.out, config)
    print(e2e_report.summary(report))
    print("\n".join(e2e_report.write(report, args.out)))


if __name__ == "__main__":  # the data generator starts processes (forkserver)
    main()
