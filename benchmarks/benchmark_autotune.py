"""fl.DataLoader(autotune=True) from num_workers=1, prefetch_batches=1 against the best
hand-tuned setting and num_workers = cores, with a sleeping and a GIL-holding step (#35).

Command (~2-4 min on a 2-core VM: 12 hand-tuned epochs and 3 more per step kind)::

    .venv/bin/python benchmarks/benchmark_autotune.py --out fastload-bench

Writes ``autotune.json`` into ``--out`` and prints a line per step kind with the tuner's
log of moves (each with its measured effect).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fastload.bench.components import autotune_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-workers", type=int, default=4)
    args = parser.parse_args()
    config = autotune_bench.AutotuneBenchConfig(step_ms=args.step_ms, max_workers=args.max_workers)
    records = autotune_bench.run(args.out, config)
    print("\n".join(autotune_bench.lines(records)))
    path = Path(args.out) / "autotune.json"
    path.write_text(json.dumps(records, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
