"""CPU decode + train/eval presets: fastload's CPU backend vs a torch DataLoader with Pillow.

Command (full size: 3,000 generated JPEGs of ~105 KB, batch 64, 2 threads or worker
processes, median of 3)::

    .venv/bin/python benchmarks/benchmark_decode.py --out fastload-bench

Add ``--quick`` for 300 images. The JPEGs are generated once into ``--out``/data/decode and
kept. Writes ``decode.json`` into ``--out`` and prints a table with each system's images/s
as a ratio to ``torch DataLoader + Pillow``. See ``fastload.bench.components.decode_bench``
for what each system does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastload.bench.components import decode_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=None, help="threads or processes (2)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--system", action="append", help="measure only this system (repeatable; by name)"
    )
    args = parser.parse_args()
    base = (
        decode_bench.DecodeBenchConfig.quick() if args.quick else decode_bench.DecodeBenchConfig()
    )
    overrides = {
        "workers": args.workers,
        "repeats": args.repeats,
        "systems": tuple(args.system) if args.system else None,
    }
    config = decode_bench.DecodeBenchConfig(
        **{**base.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    )
    report = decode_bench.run(Path(args.out) / "data" / "decode", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
