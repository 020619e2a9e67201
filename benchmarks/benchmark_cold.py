"""Cold epochs against warm ones, fastload alone, with each epoch's CPU by process.

Command (the three layouts of P6, both steps, alternated; ``--boost`` on a busy machine)::

    .venv/bin/python benchmarks/benchmark_cold.py --layout folder --layout tar \
        --layout parquet --step-holds-gil --repeats 2 --boost

See ``fastload.bench.e2e.cold_bench``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastload.bench.e2e import cold_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--layout", action="append", choices=["folder", "tar", "zarr", "parquet"])
    parser.add_argument("--step-holds-gil", action="store_true", help="also the GIL-holding step")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--boost", action="store_true", help="nice -20 autogroups (root)")
    args = parser.parse_args()
    rows = cold_bench.run(
        args.out,
        layouts=tuple(args.layout or ("folder", "tar", "parquet")),
        steps=("sleep", "gil") if args.step_holds_gil else ("sleep",),
        repeats=args.repeats,
        boost=args.boost,
    )
    path = Path(args.out) / "cold.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))
    print(path)


if __name__ == "__main__":  # the data generator starts processes (forkserver)
    main()
