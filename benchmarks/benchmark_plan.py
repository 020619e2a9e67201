"""The plan: one rank's epoch order, shards per rank and mid-epoch resume vs DistributedSampler.

Command (full size: 10,000 shards x 1,000 samples = 10 million, world size 8; resume at
1 million samples)::

    .venv/bin/python benchmarks/benchmark_plan.py --out fastload-bench

Add ``--quick`` for 1 million samples (resume stays at 1 million). Writes ``plan.json``
into ``--out`` and prints a table with each system's figures as ratios to
``torch.utils.data.DistributedSampler``.
"""

from __future__ import annotations

import argparse

from fastload.bench.components import plan_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=None)
    args = parser.parse_args()
    config = plan_bench.PlanBenchConfig.quick() if args.quick else plan_bench.PlanBenchConfig()
    if args.world_size is not None:
        config = plan_bench.PlanBenchConfig(**{**config.__dict__, "world_size": args.world_size})
    report = plan_bench.run(config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
