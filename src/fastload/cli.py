"""The ``fastload`` command: parses arguments, calls the library, prints. No logic lives here.

Exit codes: 0 success; 1 the work failed (the remote refused or holds no objects, the
cache directory is missing or unusable, a fetch failed); 2 the command line cannot work as
given (a bad option or value, an unknown URL protocol, a backend package that is not
installed, a command whose work is still open). Either way stderr gets one line saying
what to do, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import fastload
from fastload.datasets import formats
from fastload.errors import (
    FastloadError,
    MissingBackendError,
    NotYetAvailableError,
    UnknownProtocolError,
)
from fastload.plan import DEFAULT_WINDOW_SHARDS
from fastload.remote import scrub
from fastload.warm import DEFAULT_STATE_BATCHES

# The step `fastload doctor` runs when told none: the bench's simulated step.
DEFAULT_DOCTOR_STEP_MS = 20.0

if TYPE_CHECKING:
    from fastload.bench.e2e.e2e_bench import E2EConfig
    from fastload.bench.runner import Report
    from fastload.warm import WarmReport

_SIZE_UNITS = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KI": 2**10,
    "MI": 2**20,
    "GI": 2**30,
    "TI": 2**40,
}


def parse_size(text: str) -> int:
    """'500M', '10GB', '2GiB', '1234' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 500M, 10G or 2GiB)")
    return int(float(match[1]) * _SIZE_UNITS[match[2] or ""])


def _print(payload: dict[str, Any] | list[Any], as_json: bool, text: str) -> None:
    print(json.dumps(payload, indent=2) if as_json else text)


def _url(text: str) -> str:
    """A dataset's URL or path; an empty one (``fastload warm ''``, an unset shell variable)
    would mean the current folder, which nobody asks for that way."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "the URL is empty: give a path or a URL such as s3://bucket/prefix"
        )
    return text


def parse_int_range(text: str) -> tuple[int, ...]:
    """'3' -> (3,); '0..2' -> (0, 1, 2) inclusive; '0,2,5' -> (0, 2, 5); none negative."""
    try:
        if ".." in text:
            first, last = (int(x) for x in text.split("..", 1))
            if last < first:
                raise ValueError
            values = tuple(range(first, last + 1))
        else:
            values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a number, list or range: {text!r} (try 0..2)"
        ) from None
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r} (try 0..2)")
    return values


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {low} or more, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _warm(args: argparse.Namespace) -> int:
    from fastload.warm import NodeShare, warm, warm_from_state

    if (args.url is None) == (args.from_state is None):
        raise UsageError("give the dataset's URL, or --from-state STATE (one of them)")
    settings: dict[str, Any] = {  # how to stage, whichever way the share is named
        "cache_dir": args.cache_dir,
        "jobs": args.jobs,
        "max_bytes": args.max_bytes,
        "policy": args.policy,
        "dry_run": args.dry_run,
        "progress": None if not args.json else False,
    }
    if args.from_state is not None:
        if args.epochs is not None or args.format is not None:
            raise UsageError("--from-state takes the epoch and format from the state")
        try:
            report = warm_from_state(
                args.from_state,
                ranks=args.rank,
                world_size=args.world_size,
                batches=args.batches or None,
                **settings,
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return _print_warm(report, args)
    share = None
    given = [args.rank is not None, args.world_size is not None, args.epochs is not None]
    if any(given):
        if not all(given):
            raise UsageError("--rank, --world-size and --epochs go together")
        try:
            share = NodeShare(
                ranks=args.rank,
                world_size=args.world_size,
                epochs=args.epochs,
                format=args.format or "auto",
                seed=args.seed,
                shuffle=not args.no_shuffle,
                drop_last=args.drop_last,
                window_shards=args.window_shards,
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    report = warm(
        args.url,
        refresh=args.refresh,
        share=share,
        format=args.format if share is None else None,
        **settings,
    )
    return _print_warm(report, args)


def _print_warm(report: WarmReport, args: argparse.Namespace) -> int:
    entries = _count(report.objects, "object")
    if report.ranges:  # a node's share of Parquet row groups: byte ranges of files
        entries += f" and {_count(report.ranges, 'byte range')}"
    if args.dry_run:
        text = (
            f"would fetch {report.objects + report.ranges - report.already_cached:,} of "
            f"{entries} ({report.bytes / 1e6:,.1f} MB); {report.already_cached:,} already cached"
        )
    else:
        text = (
            f"{entries}: fetched {report.fetched:,} "
            f"({report.fetched_bytes / 1e6:,.1f} MB), already cached "
            f"{report.already_cached:,}, over budget {report.skipped:,}, "
            f"failed {report.failed:,} in {report.seconds:.1f}s"
        )
    _print(report.to_dict(), args.json, text)
    for failure in report.failures[:5]:
        print(f"fastload: failed: {failure['url']}: {failure['error']}", file=sys.stderr)
    return 0 if report.ok else 1


def _index(args: argparse.Namespace) -> int:
    from fastload.datasets.tar import INDEX_JOBS, write_index

    report = write_index(
        args.url,
        cache_dir=args.cache_dir,
        jobs=args.jobs or INDEX_JOBS,
        to=args.to,
        progress=None if not args.json else False,
    )
    done = (
        f"indexed {report.shards:,} tar shards ({report.samples:,} samples, "
        f"{report.shard_bytes / 1e6:,.1f} MB read) in {report.seconds:.1f}s"
    )
    if report.in_cache:
        text = (
            f"{done}; wrote their indexes into {report.written_to}, not next to the shards "
            f"({report.why_in_cache}): opens with this cache directory read only them"
        )
    else:
        text = (
            f"{done}; wrote {report.written_to} ({report.index_bytes / 1e3:,.1f} kB): opening "
            "the dataset reads only it"
        )
    _print(report.to_dict(), args.json, text)
    return 0


def _cache(args: argparse.Namespace) -> int:
    from fastload.cache import Cache
    from fastload.cache.budget import allocated_under

    with Cache(args.cache_dir, create=False) as cache:
        if args.action == "ls":
            entries = cache.entries()
            _print(
                [{"url": e.url, "size": e.size, "last_use": e.last_use} for e in entries],
                args.json,
                "\n".join(f"{e.size:>12,}  {e.url}" for e in entries),
            )
        elif args.action == "du":
            entries = cache.entries()
            used, on_disk = sum(e.size for e in entries), cache.used_bytes()
            index = cache.index.file_bytes()
            allocated, counted = allocated_under(cache.dir), cache.disk_bytes()
            _print(
                {
                    "cache_dir": str(cache.dir),
                    "objects": len(entries),
                    "bytes": used,
                    "bytes_on_disk": on_disk,  # what the budget counts: dead bytes too
                    "index_bytes": index,
                    "disk_bytes": counted,  # all of it, as a budget counts it
                    "allocated_bytes": allocated,  # the file system's blocks, everything
                },
                args.json,
                f"{used / 1e6:,.1f} MB in {len(entries):,} entries under {cache.dir}; "
                f"{on_disk / 1e6:,.1f} MB counted by the budget, index {index / 1e6:,.1f} MB; "
                f"{counted / 1e6:,.1f} MB on disk by fastload's count, "
                f"{allocated / 1e6:,.1f} MB by the file system's",
            )
        elif args.action == "verify":
            problems = cache.verify(repair=True)
            _print(
                {
                    "checked": len(cache.entries()) + len(problems),
                    "problems": [{"url": u, "problem": p} for u, p in problems],
                },
                args.json,
                "\n".join(f"dropped (refetched on next use): {u}: {p}" for u, p in problems)
                or "all cached objects match their checksums",
            )
            return 1 if problems else 0
        elif args.action == "evict":
            removed = cache.evict(to_bytes=args.max_bytes or 0)
            _print(
                {"evicted": removed, "bytes": cache.used_bytes()},
                args.json,
                f"evicted {removed:,} objects; {cache.used_bytes() / 1e6:,.1f} MB remain",
            )
        elif args.action == "compact":
            rewritten, freed = cache.compact()
            _print(
                {"segments": rewritten, "freed_bytes": freed, "bytes": cache.used_bytes()},
                args.json,
                f"rewrote {rewritten:,} segments, freed {freed / 1e6:,.1f} MB; "
                f"{cache.used_bytes() / 1e6:,.1f} MB on disk",
            )
        else:  # clear
            removed = cache.clear()
            _print({"removed": removed}, args.json, f"removed {removed:,} objects")
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.components and args.scale:
        raise UsageError("give --components or --scale, not both")
    if args.components or args.scale:
        if args.url is not None:
            raise UsageError("--components and --scale run on generated data; leave out the URL")
        return _bench_scale(args) if args.scale else _bench_components(args)
    from fastload.bench.e2e import e2e_bench, e2e_data, e2e_report

    config = bench_config(args)
    out = Path(args.out)
    where = args.url or f"{e2e_data.jpegs_line(config.data)}, generated in {out / 'data'}"
    print(f"fastload {fastload.__version__} bench: end to end on {where}", flush=True)
    if args.url is None:
        report = e2e_bench.run(out, config)
    else:
        report = e2e_bench.run_url(args.url, out, config)
    print(e2e_report.summary(report))
    print("\n".join(e2e_report.write(report, out)), flush=True)
    return 0


def bench_config(args: argparse.Namespace) -> E2EConfig:
    """The end-to-end benchmark's configuration from ``fastload bench``'s arguments."""
    from fastload.bench.e2e import e2e_bench

    config = e2e_bench.E2EConfig.quick() if args.quick else e2e_bench.E2EConfig()
    changes: dict[str, Any] = {
        "latency_s": None if args.latency_ms is None else args.latency_ms / 1000,
        "workers": args.workers,
        "step_s": None if args.step_ms is None else args.step_ms / 1000,
        "epochs": args.epochs,
        "systems": tuple(args.system) if args.system else None,
        "layouts": tuple(args.layout) if args.layout else None,
        "repeats": args.repeats,
        "steps": e2e_bench.steps_option(args.step_holds_gil),
    }
    if args.bandwidth is not None:
        changes["bandwidth_bytes_per_s"] = args.bandwidth or None  # 0: no cap
    try:
        return dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})
    except ValueError as e:
        raise UsageError(str(e)) from None


def _bench_components(args: argparse.Namespace) -> int:
    from fastload.bench import cache_scale_bench
    from fastload.bench.components import (
        decode_bench,
        loader_bench,
        parquet_bench,
        policy_bench,
        preemption_bench,
        read_bench,
        stage_bench,
    )

    quick, out = args.quick, Path(args.out)
    data = out / "data"
    read = read_bench.ReadBenchConfig.quick() if quick else read_bench.ReadBenchConfig()
    stage = stage_bench.StageBenchConfig.quick() if quick else stage_bench.StageBenchConfig()
    policy = policy_bench.PolicyBenchConfig.quick() if quick else policy_bench.PolicyBenchConfig()
    decode = decode_bench.DecodeBenchConfig.quick() if quick else decode_bench.DecodeBenchConfig()
    loader = loader_bench.LoaderBenchConfig.quick() if quick else loader_bench.LoaderBenchConfig()
    loader = loader_bench.configured(loader, step_holds_gil=args.step_holds_gil)
    pq = parquet_bench.ParquetBenchConfig
    parquet = pq.quick() if quick else pq()
    cache_scale = cache_scale_bench.CacheScaleBenchConfig.components(quick)
    benchmarks: list[tuple[str, Path, Callable[[Path], Report]]] = [
        ("reading cached bytes", data, lambda d: read_bench.run(d, read)),
        ("staging from a remote over HTTP", data / "stage", lambda d: stage_bench.run(d, stage)),
        (
            "cache policies on a shuffled dataset twice the budget",
            data / "policy",
            lambda d: policy_bench.run(d, policy),
        ),
        (
            "the cache's CPU per publish and per eviction as it grows (full: scale benchmark)",
            data / "cache_scale",
            lambda d: cache_scale_bench.run(d, cache_scale),
        ),
        (
            "decoding JPEGs with the train and eval presets",
            data / "decode",
            lambda d: decode_bench.run(d, decode),
        ),
        (
            "fl.DataLoader against torch's DataLoader",
            data / "loader",
            lambda d: loader_bench.run(d, loader),
        ),
        (
            "Parquet against pyarrow.dataset and Hugging Face datasets",
            data / "parquet",
            lambda d: parquet_bench.run(d, parquet),
        ),
    ]
    if not quick:  # subprocesses restarted over a 1.28 M-object listing: minutes, not seconds
        benchmarks.append(
            (
                "a Spot preemption: SIGTERM, then restarts on a warm and an empty node",
                data / "preemption",
                lambda d: preemption_bench.run(d),
            )
        )
    for title, where, run in benchmarks:
        print(f"fastload {fastload.__version__} bench: {title} (data in {where})", flush=True)
        report = run(where)
        print(report.table())
        if report.name == "stage":
            print("\n".join(stage_bench.fastload_vs_peers(report)))
        if report.name == "cache_scale":
            print("\n".join(cache_scale_bench.target_lines(report)))
        for line in report.params.get("targets", []) if report.name == "parquet" else []:
            print(f"target: {line}")
        print(f"wrote {report.write_json(out)}\n", flush=True)
    return 0


def _bench_scale(args: argparse.Namespace) -> int:
    from fastload.bench.scale import scale_bench

    config = scale_bench.ScaleBenchConfig.quick() if args.quick else scale_bench.ScaleBenchConfig()
    out = Path(args.out)
    print(f"fastload {fastload.__version__} bench: opening a dataset at scale", flush=True)
    report = scale_bench.run(out / "data" / "scale", config)
    print(report.table())
    print("\n".join(scale_bench.target_lines(report)))
    print(f"wrote {report.write_json(out)}", flush=True)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from fastload.bench.doctor_data import builtin_remote
    from fastload.diagnosis import doctor, render
    from fastload.diagnosis.prices import UnknownGPUError

    out = Path(args.out)
    settings = doctor_settings(args)
    with contextlib.ExitStack() as stack:
        if args.url is None:
            print(f"fastload {fastload.__version__} doctor: a generated dataset", flush=True)
            url, options = stack.enter_context(
                builtin_remote(out, latency_s=args.latency_ms / 1000)
            )
            settings["storage_options"] = options
            if settings.get("cache_dir") is None:
                settings["cache_dir"] = str(out / "cache")
        else:
            url = args.url
        try:
            report = doctor(url, progress=None if not args.json else False, **settings)
        except UnknownGPUError as exc:  # bad usage: name a known GPU or give --price
            raise UsageError(str(exc)) from None
        except FastloadError:
            raise
        except ValueError as exc:  # settings that parse but do not fit together
            raise UsageError(str(exc)) from None
    lines = render.write(report, out, with_chart=not args.no_chart)
    if args.json:
        print(report.to_json())
    else:
        print(render.table(report))
        print("\n".join(lines))
    return 0


def doctor_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``fl.doctor``'s keyword arguments from ``fastload doctor``'s."""
    from fastload.decode import EvalPreset, TrainPreset

    transform = {"train": TrainPreset, "eval": EvalPreset}.get(args.transform)
    settings: dict[str, Any] = {
        "step_ms": args.step_ms,
        "step_holds_gil": args.step_holds_gil,
        "model": args.model,
        "gpu": args.gpu,
        "price": args.price,
        "spot": args.spot,
        "epochs_per_day": args.epochs_per_day,
        "cold": args.cold,
        "apply": args.apply,
        "phase_s": args.phase_s,
        "rank": args.rank,
        "world_size": args.world_size,
        "local_world_size": args.local_world_size,
        "format": args.format or "auto",
        "cache_dir": args.cache_dir,
        "max_bytes": args.max_bytes,
        "usd_per_gb": args.usd_per_gb,
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "decode": None if args.decode == "none" else args.decode,
        "transform": None if transform is None else transform(args.size),
        "device": args.device,
        "seed": args.seed,
        "prefetch_batches": args.prefetch_batches,
        "lookahead_bytes": args.lookahead_bytes,
    }
    if args.spot_discount is not None:
        settings["spot_discount"] = args.spot_discount
    if args.step_holds_gil and args.model is not None:
        raise UsageError("--step-holds-gil goes with --step-ms; a --model step is what it is")
    if args.step_ms is None and args.model is None:
        settings["step_ms"] = DEFAULT_DOCTOR_STEP_MS
    keep = {"cache_dir", "max_bytes", "rank", "world_size", "local_world_size", "price"}
    return {k: v for k, v in settings.items() if v is not None or k in keep}


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _bandwidth(text: str) -> int:
    """'100M' (bytes/s per connection), or 0/'none' for no cap."""
    return 0 if text.strip().lower() in ("0", "none", "off") else parse_size(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fastload",
        description="Stage datasets onto local NVMe and feed GPUs without waiting.",
    )
    parser.add_argument("--version", action="version", version=f"fastload {fastload.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    warm = sub.add_parser("warm", help="stage a dataset (or one node's share of it) into the cache")
    warm.add_argument("url", nargs="?", type=_url, help="the dataset (or --from-state)")
    warm.add_argument(
        "--from-state",
        metavar="STATE",
        help="stage what a job resuming from this saved loader state reads next (its dataset "
        "and plan from the state, the listing from the manifest snapshot beside it)",
    )
    warm.add_argument(
        "--batches",
        type=non_negative_int,
        default=DEFAULT_STATE_BATCHES,
        help="with --from-state: the next N batches of each rank, first batches first "
        f"(default {DEFAULT_STATE_BATCHES}; 0: the rest of the epoch)",
    )
    warm.add_argument("--cache-dir", help="default: $FASTLOAD_CACHE_DIR or ~/.cache/fastload")
    warm.add_argument(
        "--format",
        choices=formats(),  # the built-in formats and those registered in this process
        help="open the dataset in this format (auto: detect) and stage only what it reads",
    )
    warm.add_argument("--jobs", type=positive_int, help="requests in flight at most (default 64)")
    warm.add_argument("--max-bytes", type=parse_size, help="cache budget, e.g. 200G")
    warm.add_argument("--policy", choices=["lru", "pin", "plan"], default="lru")
    warm.add_argument("--refresh", action="store_true", help="list the remote again")
    warm.add_argument("--rank", type=parse_int_range, help="this node's ranks: R, R1,R2 or R1..R2")
    warm.add_argument("--world-size", type=positive_int)
    warm.add_argument("--epochs", type=parse_int_range, help="E, or E..F inclusive")
    warm.add_argument("--seed", type=int, default=0, help="the sampler's seed (with --rank)")
    warm.add_argument("--no-shuffle", action="store_true", help="the sampler does not shuffle")
    warm.add_argument("--drop-last", action="store_true", help="the sampler drops the tail")
    warm.add_argument("--window-shards", type=positive_int, default=DEFAULT_WINDOW_SHARDS)
    warm.add_argument("--dry-run", action="store_true")
    warm.add_argument("--json", action="store_true")
    warm.set_defaults(run=_warm)

    index = sub.add_parser(
        "index",
        help="write a tar dataset's index once, so that opening it reads only the index",
        description=(
            "Reads each .tar shard under URL once (streamed, not cached) and writes "
            "fastload's index of their samples: fastload.flidx next to the shards of a local "
            "folder, into the cache for a remote; next to a bucket's shards only with "
            "--to dataset (never into a Hugging Face repository)."
        ),
    )
    index.add_argument("url", type=_url)
    index.add_argument("--cache-dir", help="default: $FASTLOAD_CACHE_DIR or ~/.cache/fastload")
    index.add_argument(
        "--to",
        choices=["auto", "dataset", "cache"],
        default="auto",
        help="next to the shards (dataset; never hf://), into the cache, or auto: next to a "
        "local folder's shards, into the cache for a remote",
    )
    index.add_argument("--jobs", type=positive_int, help="shards read at once (default 8)")
    index.add_argument("--json", action="store_true")
    index.set_defaults(run=_index)

    cache = sub.add_parser("cache", help="inspect and maintain the local cache")
    cache.add_argument("action", choices=["ls", "du", "verify", "evict", "compact", "clear"])
    cache.add_argument("--cache-dir", help="default: $FASTLOAD_CACHE_DIR or ~/.cache/fastload")
    cache.add_argument("--max-bytes", type=parse_size, help="evict: keep at most this much")
    cache.add_argument("--json", action="store_true")
    cache.set_defaults(run=_cache)

    bench = sub.add_parser(
        "bench",
        help="measure fastload against its peers end to end, on the same data",
        description=(
            "Runs the main job end to end (remote -> cache -> decode -> batches) for fastload "
            "and the loaders users would pick instead, on a generated dataset served over S3 "
            "with latency (or read-only on URL), and prints a table of ratios; writes "
            "e2e.json and e2e.png to --out."
        ),
    )
    bench.add_argument(
        "url", nargs="?", type=_url, help="your dataset, read-only (default: a generated one)"
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="1,800 images (600 pictures), folder + tar, warm epochs repeated to 3 s: ~3 min",
    )
    bench.add_argument("--out", default="fastload-bench", help="results and generated data")
    bench.add_argument("--latency-ms", type=float, help="per request (default 20)")
    bench.add_argument(
        "--bandwidth", type=_bandwidth, help="per connection, e.g. 100M (default) or none"
    )
    bench.add_argument("--workers", type=int, help="threads or worker processes (default 2)")
    bench.add_argument("--step-ms", type=float, help="simulated training step (default 20)")
    bench.add_argument(
        "--step-holds-gil",
        action=argparse.BooleanOptionalAction,
        help="also run every system with a step that holds the GIL (a busy Python loop) "
        "beside the sleeping one (default: in the full run, not with --quick; with "
        "--components: in the loader benchmark)",
    )
    bench.add_argument("--epochs", type=int, help="the first is cold (default 3; --quick 2)")
    bench.add_argument(
        "--repeats",
        type=int,
        help="runs of each system and layout, medians shown (default 3; --quick 1)",
    )
    bench.add_argument("--system", action="append", help="only this system (repeatable)")
    bench.add_argument(
        "--layout",
        action="append",
        choices=["folder", "tar", "zarr", "parquet"],
        help="only this layout (repeatable; default: all, --quick: folder and tar)",
    )
    bench.add_argument(
        "--components",
        action="store_true",
        help="the component benchmarks instead (read, stage, cache policy, decode, loader, "
        "Parquet)",
    )
    bench.add_argument(
        "--scale",
        action="store_true",
        help="the scale benchmark instead: open, memory, pickled size and first batch of a "
        "1.28 M-sample ImageFolder and 1,024 tar shards (--quick: 50,000 and 64)",
    )
    bench.set_defaults(run=_bench)

    doctor = sub.add_parser(
        "doctor",
        help="where the training step waits for data, what it costs, and the fix",
        description=(
            "Measures the step alone, the loader alone from a warm cache, both together, "
            "the first epoch from the remote (when the cache does not hold the data) and "
            "the host to device copy; names the stage the step waits on, the GPU "
            "utilization and cost per epoch, and the settings that fix it ranked by "
            "predicted gain. --apply re-measures the top fix against its prediction. "
            "Without a URL it diagnoses a generated dataset served over loopback S3. "
            "Writes doctor.json and doctor.png to --out."
        ),
    )
    doctor.add_argument("url", nargs="?", type=_url, help="your dataset (default: a generated one)")
    doctor.add_argument("--out", default="fastload-doctor", help="doctor.json, doctor.png, data")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--no-chart", action="store_true", help="do not draw doctor.png")
    step = doctor.add_argument_group("the training step (default: a 20 ms sleep)")
    step.add_argument("--step-ms", type=_non_negative, help="the step's time, run as a sleep")
    step.add_argument(
        "--step-holds-gil",
        action="store_true",
        help="run the step as a busy Python loop: it holds the GIL, as a real step's Python does",
    )
    step.add_argument("--model", help="a real training step on --device: resnet50, vit_b16, ...")
    money = doctor.add_argument_group("money")
    money.add_argument("--gpu", help="H100, A100, A10, L4, V100, T4 (built-in prices)")
    money.add_argument("--price", type=_non_negative, help="USD per GPU-hour (on demand)")
    money.add_argument("--spot", action="store_true", help="Spot capacity: take its discount")
    money.add_argument("--spot-discount", type=float, help="default 0.65")
    money.add_argument("--epochs-per-day", type=_non_negative, help="for the cost per day")
    money.add_argument(
        "--usd-per-gb", type=_non_negative, help="the remote's price per GB read (cache advice)"
    )
    loader = doctor.add_argument_group("the loader (as fl.DataLoader takes them)")
    loader.add_argument("--batch-size", type=positive_int, default=64)
    loader.add_argument("--workers", type=int, default=2, help="num_workers: loader threads")
    loader.add_argument("--decode", choices=["auto", "cpu", "dali", "none"], default="auto")
    loader.add_argument("--transform", choices=["train", "eval", "none"], default="train")
    loader.add_argument("--size", type=positive_int, default=224, help="the preset's size")
    loader.add_argument("--device", help="cpu, cuda, cuda:1 (default: batches stay on the host)")
    loader.add_argument("--seed", type=int, default=0)
    loader.add_argument("--prefetch-batches", type=positive_int)
    loader.add_argument("--lookahead-bytes", type=parse_size, help="e.g. 1G")
    loader.add_argument("--cache-dir", help="default: $FASTLOAD_CACHE_DIR or ~/.cache/fastload")
    loader.add_argument("--max-bytes", type=parse_size, help="the cache budget, e.g. 200G")
    loader.add_argument("--format", choices=formats())
    run = doctor.add_argument_group("the diagnosis")
    run.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure a first epoch from the remote (default: when the cache lacks the data)",
    )
    run.add_argument("--apply", action="store_true", help="re-measure with each fix that runs here")
    run.add_argument("--phase-s", type=float, default=4.0, help="seconds per phase (default 4)")
    run.add_argument("--rank", type=int, help="this rank (default: torchrun's RANK, else 0)")
    run.add_argument("--world-size", type=positive_int, help="ranks in the job (GPUs paid for)")
    run.add_argument(
        "--local-world-size",
        type=positive_int,
        help="ranks on this node: a loader process each is run at once and measured against "
        "the prediction for the node's cores shared N ways",
    )
    run.add_argument(
        "--latency-ms", type=_non_negative, default=20.0, help="the generated dataset's remote"
    )
    doctor.set_defaults(run=_doctor)
    return parser


class UsageError(Exception):
    """Arguments that parse but do not fit together (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (the usage is under --help)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
    except BrokenPipeError:
        return _reader_gone()
    except UsageError as exc:
        parser.error(str(exc))
    except (NotYetAvailableError, UnknownProtocolError, MissingBackendError) as exc:
        print(f"fastload: {_one_line(exc)}", file=sys.stderr)
        return 2
    except FastloadError as exc:
        print(f"fastload: {_one_line(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # the machine said no (permissions, a full disk): not a bug here
        print(f"fastload: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastload: interrupted", file=sys.stderr)
        return 130
    return code


def _reader_gone() -> int:
    """The reader of our output left (``fastload cache ls | head -1``): stop quietly, as a
    Unix tool killed by SIGPIPE does, with its exit status (128 + 13)."""
    devnull = os.open(os.devnull, os.O_WRONLY)  # what is still buffered goes nowhere
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + int(signal.SIGPIPE)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:  # not "[Errno 2] ..."
        text = exc.strerror
        if exc.filename and not isinstance(exc, FastloadError):  # ours name it already
            text += f": {exc.filename}"
    else:
        text = str(exc)
    return scrub(" ".join(text.split()))  # a backend's text may hold a signed URL


if __name__ == "__main__":
    sys.exit(main())
