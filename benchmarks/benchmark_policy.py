"""Cache policies: hit rates of lru, pin and plan over 3 shuffled epochs of a dataset 2x the budget.

Command (400 objects of 4 KB, budget half the bytes, seed 0)::

    .venv/bin/python benchmarks/benchmark_policy.py --out fastload-bench

Writes ``policy.json`` into ``--out`` and prints each policy's hit rate in epochs 2 and 3
next to the optimum, budget / dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastload.bench.components import policy_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    config = (
        policy_bench.PolicyBenchConfig.quick() if args.quick else policy_bench.PolicyBenchConfig()
    )
    if args.seed is not None:
        config = dataclasses.replace(config, seed=args.seed)
    report = policy_bench.run(Path(args.out) / "data" / "policy", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
