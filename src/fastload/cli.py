"""The ``fastload`` command: parses arguments, calls the library, prints. No logic lives here.

Exit codes: 0 success, 1 the work failed (one-line reason on stderr), 2 bad usage or a
command whose work is still open.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import fastload
from fastload.errors import FastloadError, NotYetAvailableError

# Commands of DESIGN.md whose implementation is tracked by an open issue.
_PENDING = {
    "warm": "staging into the cache (issue #3; a node's share: issue #4)",
    "cache": "cache inspection and maintenance (issue #3)",
    "doctor": "finding where the training step waits (a later issue)",
}


def _pending(command: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise NotYetAvailableError(
            f"'fastload {command}' is not available yet: {_PENDING[command]}"
        )

    return run


def _bench(args: argparse.Namespace) -> int:
    if args.url is not None:
        raise NotYetAvailableError(
            "'fastload bench URL' (a user's own dataset) is not available yet (issue #7); "
            "run 'fastload bench' without a URL for the built-in benchmark"
        )
    from fastload.bench import read_bench

    config = read_bench.ReadBenchConfig.quick() if args.quick else read_bench.ReadBenchConfig()
    out = Path(args.out)
    print(f"fastload {fastload.__version__} bench: reading cached bytes (data in {out / 'data'})")
    report = read_bench.run(out / "data", config)
    print(report.table())
    print(f"\nwrote {report.write_json(out)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastload",
        description="Stage datasets onto local NVMe and feed GPUs without waiting.",
    )
    parser.add_argument("--version", action="version", version=f"fastload {fastload.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    warm = sub.add_parser("warm", help="stage a dataset (or one node's share of it) into the cache")
    warm.add_argument("url")
    warm.add_argument("--cache-dir")
    warm.add_argument("--format", default="auto")
    warm.add_argument("--jobs", type=int)
    warm.add_argument("--max-bytes")
    warm.add_argument("--rank", type=int)
    warm.add_argument("--world-size", type=int)
    warm.add_argument("--epochs", help="E..F, inclusive")
    warm.add_argument("--dry-run", action="store_true")
    warm.add_argument("--json", action="store_true")
    warm.set_defaults(run=_pending("warm"))

    cache = sub.add_parser("cache", help="inspect and maintain the local cache")
    cache.add_argument("action", choices=["ls", "du", "verify", "evict", "clear"])
    cache.add_argument("--cache-dir")
    cache.add_argument("--json", action="store_true")
    cache.set_defaults(run=_pending("cache"))

    bench = sub.add_parser("bench", help="measure fastload against its peers on the same data")
    bench.add_argument("url", nargs="?", help="a dataset to measure (default: a generated one)")
    bench.add_argument("--quick", action="store_true", help="small sizes: a minute or two")
    bench.add_argument("--out", default="fastload-bench", help="results and generated data")
    bench.set_defaults(run=_bench)

    doctor = sub.add_parser("doctor", help="where does the training step wait, and what it costs")
    doctor.set_defaults(run=_pending("doctor"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except NotYetAvailableError as exc:
        print(f"fastload: {exc}", file=sys.stderr)
        return 2
    except FastloadError as exc:
        print(f"fastload: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastload: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
