"""fl.DataLoader vs torch's DataLoader (2 workers, batch 64) under a simulated training step.

Command (full size: 8,192 in-memory samples, 3,000 generated JPEGs of ~105 KB with the
train preset at 224 px, 8,192 Zarr rows of 64x64x3 uint8; 5 epochs with a 20 ms step per
batch, 5 with a 20 ms step that holds the GIL, then 3 epochs without)::

    .venv/bin/python benchmarks/benchmark_loader.py --out fastload-bench

Add ``--quick`` for small sizes (under a minute; without the GIL-holding step unless
``--step-holds-gil``), ``--case jpeg`` (repeatable) for some of ``memory``, ``jpeg``,
``zarr`` only, ``--step matmul`` for a CPU-bound step instead of a sleep,
``--no-step-holds-gil`` to leave out the GIL-holding step. Data is generated once into
``--out``/data/loader and kept. Writes ``loader.json`` into ``--out`` and prints a table:
samples/s with the ratio to each case's torch DataLoader peer, the fraction of time the
step waited for data (and what ``fl.DataLoader.stats()`` says), the same with the
GIL-holding step and the share of its time the loader took from it, and the peak memory of
each system's process tree, overall and per epoch. See
``fastload.bench.components.loader_bench`` for what each system does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastload.bench.components import loader_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", action="append", choices=loader_bench.CASES)
    parser.add_argument("--workers", type=int, default=None, help="workers of every loader (2)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="epochs with the step (5)")
    parser.add_argument("--repeats", type=int, default=None, help="epochs without a step (3)")
    parser.add_argument("--step", choices=("sleep", "matmul"), default=None)
    parser.add_argument("--step-ms", type=float, default=None, help="step per batch (20)")
    parser.add_argument(
        "--step-holds-gil",
        action=argparse.BooleanOptionalAction,
        help="also epochs with a step that holds the GIL (default: yes; --quick: no)",
    )
    args = parser.parse_args()
    base = (
        loader_bench.LoaderBenchConfig.quick() if args.quick else loader_bench.LoaderBenchConfig()
    )
    config = loader_bench.configured(
        base,
        cases=tuple(args.case) if args.case else None,
        workers=args.workers,
        batch_size=args.batch_size,
        epochs=args.epochs,
        repeats=args.repeats,
        step=args.step,
        step_ms=args.step_ms,
        step_holds_gil=args.step_holds_gil,
    )
    report = loader_bench.run(Path(args.out) / "data", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
