"""A Spot preemption end to end: SIGTERM at a random step, restarts on a warm and an empty node.

Command (3,000 files, then 1.28 M synthetic objects)::

    .venv/bin/python benchmarks/benchmark_preemption.py --out fastload-bench

Add ``--quick`` for 600 files and 100,000 synthetic objects. Writes ``preemption.json``.
"""

from __future__ import annotations

import argparse

from fastload.bench.components import preemption_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    config = (
        preemption_bench.PreemptionBenchConfig.quick()
        if args.quick
        else preemption_bench.PreemptionBenchConfig()
    )
    report = preemption_bench.run(f"{args.out}/data/preemption", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
