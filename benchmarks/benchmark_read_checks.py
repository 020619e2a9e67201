"""Checksums checked on read: a warm epoch with the checks vs without, in one run.

Command::

    .venv/bin/python benchmarks/benchmark_read_checks.py --out fastload-bench [--quick]

Writes ``read_checks.json`` into ``--out`` and prints, per case (raw bytes of whole files,
JPEGs decoded on the CPU, tar shards), the median warm-epoch seconds with and without the
checks and their ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from fastload.bench.components import read_checks_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    config = (
        read_checks_bench.ReadChecksConfig.quick()
        if args.quick
        else read_checks_bench.ReadChecksConfig()
    )
    with tempfile.TemporaryDirectory(prefix="fastload-read-checks-") as work:
        rows = read_checks_bench.run(Path(work), config)
    print(read_checks_bench.table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_checks.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {out / 'read_checks.json'}")


if __name__ == "__main__":
    main()
