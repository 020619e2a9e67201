"""Listing 200,000 objects with 2% of listing pages answered 503: pages and time vs a clean listing.

Command (a synthetic bucket on a loopback S3 server; ``--quick``: 20,000 objects)::

    .venv/bin/python benchmarks/benchmark_listing.py --out fastload-bench

Writes ``listing.json`` into ``--out`` and prints the table (see
``fastload.bench.components.listing_bench``).
"""

from __future__ import annotations

import argparse

from fastload.bench.components import listing_bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fastload-bench")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    bench = listing_bench.ListingBenchConfig
    config = bench.quick() if args.quick else bench()
    report = listing_bench.run(config)
    print(report.table())
    print(f"wrote {report.write_json(args.out)}")


if __name__ == "__main__":
    main()
