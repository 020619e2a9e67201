"""A dataset twice the cache's budget from a 20 ms remote: steady epochs against all cached (P13).

Command (full size: 2,000 JPEGs of ~105 KB, 4 epochs, the first untimed)::

    .venv/bin/python benchmarks/benchmark_budget.py --out fastload-bench

Add ``--quick`` for 600 images. Writes ``budget.json`` into ``--out`` and prints a table:
steady-epoch samples/s of ``pin`` with turned-away objects fetched ahead into memory, of
``pin`` reading them when needed (as before), and of ``lru``, each as a ratio to the same
dataset all cached; the server's GETs per sample and the holding area's peak.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastload.bench.components import budget_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    settings = budget_bench.BudgetBenchConfig
    config = settings.quick() if args.quick else settings()
    report = budget_bench.run(Path(args.out) / "data" / "budget", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
