"""The cache's CPU per publish and per evicted object at 10k, 100k and 1.28 M cached entries.

Command (lru, pin and plan; budget half the data; synthetic entries, no remote)::

    .venv/bin/python benchmarks/benchmark_cache_scale.py --out fastload-bench

``--scales 10000,100000`` picks the scales (``--quick``: those two, fewer accesses),
``--policies lru,plan`` the policies.
Writes ``cache_scale.json`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from fastload.bench import cache_scale_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scales", help="comma-separated numbers of cached entries")
    parser.add_argument("--accesses", type=int, default=None)
    parser.add_argument("--policies", help="comma-separated: some of lru,pin,plan")
    args = parser.parse_args()
    config = (
        cache_scale_bench.CacheScaleBenchConfig.quick()
        if args.quick
        else cache_scale_bench.CacheScaleBenchConfig()
    )
    if args.scales:
        config = dataclasses.replace(config, scales=tuple(int(s) for s in args.scales.split(",")))
    if args.policies:
        config = dataclasses.replace(config, policies=tuple(args.policies.split(",")))
    if args.accesses:
        config = dataclasses.replace(config, accesses=args.accesses)
    report = cache_scale_bench.run(Path(args.out) / "data" / "cache_scale", config)
    print(report.table())
    print("\n".join(cache_scale_bench.target_lines(report)))
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
