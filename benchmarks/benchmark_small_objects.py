"""Staging 20,000 objects of 512 B from S3: client CPU per object, fastload against s5cmd (P10).

Command (full size, median of 3, the plain and the realistic server)::

    .venv/bin/python benchmarks/benchmark_small_objects.py --out fastload-bench

Add ``--quick`` for 2,000 objects and one repeat, ``--server plain`` or ``--server
realistic`` for one server only (realistic: https, lognormal latency of 20 ms median and
200 ms p99, bursts of 503 SlowDown), ``--node-processes 0`` to leave out the node case (8
processes warming one cache at once). Writes ``small_objects.json`` into ``--out`` and
prints a table: objects/s as a ratio to ``fastload warm``'s on the same server, client and
server CPU per object, the GIL time a busy Python thread lost per staged object, and the
node case's downloads per object (the server's count; 1 is right).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastload.bench.components import small_objects_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--server", choices=[*small_objects_bench.SERVERS, "both"], default="both")
    parser.add_argument("--node-processes", type=int, default=8)
    args = parser.parse_args()
    servers = small_objects_bench.SERVERS if args.server == "both" else (args.server,)
    settings = small_objects_bench.SmallObjectsBenchConfig
    config = settings.quick() if args.quick else settings()
    config = dataclasses.replace(config, servers=servers, node_processes=args.node_processes)
    report = small_objects_bench.run(Path(args.out) / "data" / "small_objects", config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
