"""fl.DataLoader(autotune=True) from num_workers=1, prefetch_batches=1 against the best
hand-tuned setting and num_workers = cores: a sleeping and a GIL-holding step, a memory
bound, a slow remote (#35).

Command (~6-10 min on a 2-core VM: per configuration a dozen hand-tuned epochs, the
autotuned one, and 2 rounds of the three side by side)::

    .venv/bin/python benchmarks/benchmark_autotune.py --out fastload-bench

``--configs sleep,gil`` only those; ``--repeats R`` rounds of the side-by-side
re-measure; ``--remote-latency-ms`` the slow remote's latency per request. Writes
``autotune.json`` into ``--out`` and prints a line per configuration with the tuner's log
of moves (each with its measured effect).
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
    parser.add_argument("--configs", default=",".join(autotune_bench.CONFIGS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--remote-latency-ms", type=float, default=150.0)
    args = parser.parse_args()
    config = autotune_bench.AutotuneBenchConfig(
        step_ms=args.step_ms,
        max_workers=args.max_workers,
        configs=tuple(c for c in args.configs.split(",") if c),
        repeats=args.repeats,
        remote_latency_ms=args.remote_latency_ms,
    )
    records = autotune_bench.run(args.out, config)
    path = Path(args.out) / "autotune.json"
    path.write_text(json.dumps(records, indent=2))
    print("\n".join(autotune_bench.lines(records)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
