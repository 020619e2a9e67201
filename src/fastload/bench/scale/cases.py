"""The scale benchmark's cases (first and cached open, N processes, first batch, workers'
memory, node share, fastload's own index, the peers' index load, planning an epoch), each
adding its rows and figures to a :class:`Case`."""

from __future__ import annotations

import dataclasses
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastload.bench.runner import Measurement, cpu_seconds, measure, relate
from fastload.bench.scale.child import process_cpu_s
from fastload.bench.scale.config import (
    CACHED_OPEN,
    FIRST_BATCH,
    FIRST_OPEN,
    NODE_SHARE,
    PEER_BUCKETS,
    PLAN_PEER,
    TAR_BUCKET,
    TARGET_USS_PER_SAMPLE,
    WORKERS,
    ScaleBenchConfig,
)
from fastload.bench.scale.data import WARMUP_SUFFIX
from fastload.bench.scale.process import run_children


class Scratch:
    """Fresh cache folders under one root, each emptied before use."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def fresh(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path


def _spec(
    server: Any, bucket: str, cache: Path, config: ScaleBenchConfig, **more: Any
) -> dict[str, Any]:
    return {
        "kind": "open",
        "url": f"s3://{bucket}",
        "cache": str(cache),
        "storage_options": server.storage_options,
        "batch_size": config.batch_size,
        "workers": config.workers,
        "warmup_url": f"s3://{bucket}{WARMUP_SUFFIX}",
        "warmup_cache": str(cache.parent / "warmup"),
        **more,
    }


def _uss_per_sample(result: Mapping[str, Any], ready: Mapping[str, int]) -> float:
    gained: int = result["opened"]["uss"] - ready["uss"]
    return gained / max(int(result["samples"]), 1)


def _gained(result: Mapping[str, Any], ready: Mapping[str, int], field: str) -> str:
    """What the open added to one of the process's figures, in MB, as text."""
    return f"{(result['opened'][field] - ready[field]) / 1e6:+.0f} MB"


def _shared_copy_bytes(cache: Path) -> int:
    """The manifest files a node's processes map together (and their derived layouts)."""
    return sum(p.stat().st_size for p in (cache / "manifests").glob("*") if p.is_file())


# The table's extra columns, by the keyword that Case.add takes for each.
_COLUMNS = {
    "cpu_us": "CPU us/obj",
    "server_cpu_s": "server CPU s",
    "list_reqs": "list reqs",
    "gets": "GETs",
    "mb_fetched": "MB fetched",
    "uss": "USS B/sample",
    "pss_mb": "PSS MB",
    "pickled_kb": "pickled KB",
    "shards": "shards",
    "share": "share of bytes",
}


class Case:
    """Rows of one dataset's case and the figures its targets read."""

    def __init__(self, name: str, samples: int) -> None:
        self.name, self.samples = name, samples
        self.rows: list[Measurement] = []
        self.figures: dict[str, float] = {}

    def add(
        self,
        system: str,
        seconds: Sequence[float],
        *,
        note: str = "",
        items: int | None = None,
        **extra: float | None,
    ) -> None:
        self.rows.append(
            Measurement(
                benchmark="scale",
                case=self.name,
                system=system,
                seconds=statistics.median(seconds) if seconds else 0.0,
                repeats=list(seconds),
                items=self.samples if items is None else items,
                note=note,
                extra={_COLUMNS[k]: v for k, v in extra.items() if v is not None},
            )
        )


def open_cases(
    case: Case,
    server: Any,
    bucket: str,
    scratch: Scratch,
    config: ScaleBenchConfig,
    objects: int,
) -> Path:
    """First open, cached opens, N processes; returns the cache with a warm manifest."""
    cache = scratch.fresh(f"{bucket}-open")
    first = run_children(server, [_spec(server, bucket, cache, config)])
    result = first.results[0]
    if result["samples"] != case.samples:
        raise RuntimeError(f"{bucket}: opened {result['samples']} samples, not {case.samples}")
    case.figures["first_open_s"] = result["seconds"]
    case.figures["first_open_cpu_us"] = 1e6 * result["cpu_s"] / objects
    case.figures["listings"] = first.listings
    case.figures["first_open_uss_per_sample"] = _uss_per_sample(result, first.ready[0])
    case.add(
        FIRST_OPEN,
        [result["seconds"]],
        cpu_us=1e6 * result["cpu_s"] / objects,
        server_cpu_s=first.server_cpu_s,
        list_reqs=first.listings,
        gets=first.gets,
        mb_fetched=sum(first.body_bytes.values()) / 1e6,
        uss=case.figures["first_open_uss_per_sample"],
        pickled_kb=result["pickled_bytes"] / 1e3,
        note=f"{objects:,} objects listed; heap {_gained(result, first.ready[0], 'anon')}",
    )
    cached = [
        run_children(server, [_spec(server, bucket, cache, config)]) for _ in range(config.repeats)
    ]
    results = [run.results[0] for run in cached]
    uss = statistics.median(
        _uss_per_sample(r, run.ready[0]) for r, run in zip(results, cached, strict=True)
    )
    case.figures["cached_open_s"] = statistics.median(r["seconds"] for r in results)
    case.figures["uss_per_sample"] = uss
    case.figures["pickled_bytes"] = max(r["pickled_bytes"] for r in results)
    case.figures["listings_cached"] = sum(run.listings for run in cached)
    case.add(
        CACHED_OPEN,
        [r["seconds"] for r in results],
        cpu_us=1e6 * statistics.median(r["cpu_s"] for r in results) / objects,
        list_reqs=sum(run.listings for run in cached),
        gets=sum(run.gets for run in cached),
        uss=uss,
        pss_mb=statistics.median(r["opened"]["pss"] for r in results) / 1e6,
        pickled_kb=case.figures["pickled_bytes"] / 1e3,
        note=f"unpickled in {1e3 * statistics.median(r['unpickle_s'] for r in results):.1f} ms",
    )
    if config.processes:
        node_cases(case, server, bucket, scratch, config, warm_cache=cache)
    return cache


def node_cases(
    case: Case,
    server: Any,
    bucket: str,
    scratch: Scratch,
    config: ScaleBenchConfig,
    *,
    warm_cache: Path,
) -> None:
    n = config.processes
    for label, cache in (
        ("empty cache", scratch.fresh(f"{bucket}-node")),
        ("manifest cached", warm_cache),
    ):
        run = run_children(server, [_spec(server, bucket, cache, config)] * n)
        pss = sum(d["pss"] - r["pss"] for d, r in zip(run.done, run.ready, strict=True))
        uss = max(_uss_per_sample(res, r) for res, r in zip(run.results, run.ready, strict=True))
        shared = _shared_copy_bytes(cache)
        bound = n * TARGET_USS_PER_SAMPLE * case.samples + shared
        key = "cold" if label == "empty cache" else "warm"
        case.figures[f"node_{key}_listings"] = run.listings
        case.figures[f"node_{key}_pss"] = pss
        case.figures[f"node_{key}_pss_bound"] = bound
        case.add(
            f"{n} processes open at once, {label}",
            [run.seconds],
            list_reqs=run.listings,
            gets=run.gets,
            uss=uss,
            pss_mb=pss / 1e6,
            note=f"PSS: all {n} gained; P11: <= {bound / 1e6:.1f} MB, {shared / 1e6:.1f} shared",
        )


def first_batch_case(
    case: Case,
    server: Any,
    bucket: str,
    cache: Path,
    config: ScaleBenchConfig,
    *,
    label: str = "",
    figure: str = "first_batch_s",
) -> None:
    """A fresh process, manifest cached, objects not: open, then the first batch."""
    run = run_children(server, [_spec(server, bucket, cache, config, loader=True)])
    result = run.results[0]
    if result["batch_samples"] != config.batch_size:
        raise RuntimeError(f"{bucket}: a first batch of {result['batch_samples']} samples")
    case.figures[figure] = result["first_batch_s"]
    case.add(
        f"{FIRST_BATCH} ({config.workers} threads{label and ', ' + label})",
        [result["first_batch_s"]],
        items=config.batch_size,
        cpu_us=None,
        gets=run.gets,
        mb_fetched=sum(run.body_bytes.values()) / 1e6,
        uss=(result["after_batch"]["uss"] - run.ready[0]["uss"]) / case.samples,
        note=f"decode=None; after an open of {result['seconds']:.2f} s; look-ahead in GETs",
    )


def workers_case(
    case: Case, server: Any, bucket: str, cache: Path, config: ScaleBenchConfig
) -> None:
    run = run_children(server, [_spec(server, bucket, cache, config, workers_memory=True)])
    workers = run.results[0]["workers"]
    small = statistics.median(w["uss"] for w in workers["small"])
    real = [w["uss"] for w in workers["dataset"]]
    extra = max(real) - small
    case.figures["worker_uss"] = max(real)
    case.figures["worker_uss_per_sample"] = extra / case.samples
    case.add(
        f"{config.workers} {WORKERS}, after a batch",
        [],
        items=0,
        uss=extra / case.samples,
        pss_mb=max(w["pss"] for w in workers["dataset"]) / 1e6,
        note=f"USS {max(real) / 1e6:.0f} MB, {extra / 1e6:+.1f} MB on a small dataset's",
    )


def node_share_case(
    case: Case, server: Any, scratch: Scratch, config: ScaleBenchConfig, layout: Any
) -> None:
    cache = scratch.fresh("share")
    spec = _spec(
        server,
        TAR_BUCKET,
        cache,
        config,
        kind="warm",
        node_share=config.node_share,
        ranks_per_node=config.ranks_per_node,
    )
    run = run_children(server, [spec])
    result = run.results[0]
    if result["failed"]:
        raise RuntimeError(f"the node share's warm failed on {result['failed']} objects")
    planned = result["planned"]
    shard_bytes = sum(n for p, n in run.body_bytes.items() if p.endswith(".tar"))
    other_bytes = sum(run.body_bytes.values()) - shard_bytes
    planned_bytes = len(planned) * layout.shard_bytes
    total = config.shards * layout.shard_bytes
    case.figures["share_bytes"] = shard_bytes
    case.figures["share_other_bytes"] = other_bytes
    case.figures["share_planned_bytes"] = planned_bytes
    case.figures["share_fraction"] = shard_bytes / total
    case.figures["share_shards"] = len(planned)
    world = config.node_share * config.ranks_per_node
    case.add(
        f"{NODE_SHARE}: ranks 0-{config.ranks_per_node - 1} of {world}",
        [result["seconds"]],
        items=len(planned),
        gets=run.gets,
        mb_fetched=(shard_bytes + other_bytes) / 1e6,
        shards=len(planned),
        share=shard_bytes / total,
        note=(
            f"epoch 0: {len(planned)} of {config.shards} shards planned, "
            f"{planned_bytes / 1e6:,.0f} of {total / 1e6:,.0f} MB"
        ),
    )
    shutil.rmtree(cache, ignore_errors=True)  # the shards: GBs at full size


def fastload_index_cases(
    case: Case, server: Any, scratch: Scratch, config: ScaleBenchConfig
) -> None:
    """``fl.write_index`` into a fresh cache (the bucket is read-only: a file per shard),
    then a fresh process's open and first batch with that index."""
    import fastload as fl

    cache = scratch.fresh(f"{TAR_BUCKET}-flidx")
    stats0, server0 = server.read_stats(), cpu_seconds([server.pid()])
    start, cpu = time.perf_counter(), process_cpu_s()
    report = fl.write_index(
        f"s3://{TAR_BUCKET}",
        cache_dir=str(cache),
        storage_options=server.storage_options,
        to="cache",
        progress=False,
    )
    seconds, cpu_s = time.perf_counter() - start, process_cpu_s() - cpu
    stats1, server1 = server.read_stats(), cpu_seconds([server.pid()])
    read = sum(stats1.body_bytes.values()) - sum(stats0.body_bytes.values())
    case.add(
        "fastload index (each shard read once; indexes into the cache)",
        [seconds],
        cpu_us=1e6 * cpu_s / case.samples,
        server_cpu_s=sum(server1.values()) - sum(server0.values()),
        gets=stats1.count("GetObject") - stats0.count("GetObject"),
        mb_fetched=read / 1e6,
        note=f"{report.shard_bytes / seconds / 1e6:,.0f} MB/s; CPU per sample",
    )
    run = run_children(server, [_spec(server, TAR_BUCKET, cache, config)])
    result = run.results[0]
    case.figures["cached_open_s_fastload_index"] = result["seconds"]
    case.figures["pickled_bytes_fastload_index"] = result["pickled_bytes"]
    case.add(
        f"{CACHED_OPEN}, fastload's index",
        [result["seconds"]],
        cpu_us=1e6 * result["cpu_s"] / (config.shards + 1),
        list_reqs=run.listings,
        gets=run.gets,
        uss=_uss_per_sample(result, run.ready[0]),
        pickled_kb=result["pickled_bytes"] / 1e3,
    )
    first_batch_case(
        case,
        server,
        TAR_BUCKET,
        cache,
        config,
        label="fastload's index",
        figure="first_batch_s_fastload_index",
    )
    shutil.rmtree(cache, ignore_errors=True)


def peer_cases(
    case: Case,
    server: Any,
    scratch: Scratch,
    config: ScaleBenchConfig,
    python: str | None,
    skipped: dict[str, str],
) -> None:
    for system, bucket in PEER_BUCKETS.items():
        name = f"{system} index load"
        if system in skipped or python is None:
            case.add(name, [], items=0, note=f"skipped: {skipped.get(system, 'no peers venv')}")
            continue
        cache = scratch.fresh(f"peer-{bucket}")
        spec = {
            "kind": "peer",
            "system": system,
            "url": f"s3://{bucket}",
            "cache": str(cache),
            "work": str(scratch.root),
            "storage_options": server.storage_options,
            "batch_size": config.batch_size,
            "warmup_url": f"s3://{bucket}{WARMUP_SUFFIX}",
            "warmup_cache": str(scratch.fresh(f"peer-{bucket}{WARMUP_SUFFIX}")),
        }
        try:
            run = run_children(server, [spec], python=python)
        except RuntimeError as exc:
            case.add(name, [], items=0, note=f"failed: {exc}"[:300])
            continue
        result = run.results[0]
        if result["samples"] != case.samples:
            case.add(name, [], items=0, note=f"read {result['samples']:,} samples: wrong")
            continue
        case.figures[f"peer {system}"] = result["seconds"]
        case.add(
            name,
            [result["seconds"]],
            cpu_us=1e6 * result["cpu_s"] / config.shards,
            server_cpu_s=run.server_cpu_s,
            list_reqs=run.listings,
            gets=run.gets,
            mb_fetched=sum(run.body_bytes.values()) / 1e6,
            uss=_uss_per_sample(result, run.ready[0]),
            pickled_kb=result["pickled_bytes"] / 1e3 if "pickled_bytes" in result else None,
            note=result.get("pickle_error", "") or f"index.json of {config.shards:,} shards",
        )


def plan_rows(case: Case, shard_sizes: Any, config: ScaleBenchConfig) -> None:
    """One rank's epoch (rank 0 of world_size), the plan built each time, beside
    DistributedSampler's global shuffle."""
    from torch.utils.data import DistributedSampler

    from fastload.plan import Plan

    n, w = int(sum(shard_sizes)), config.world_size

    class Sized:
        def __len__(self) -> int:
            return n

    def peer() -> object:
        return list(DistributedSampler(Sized(), num_replicas=w, rank=0, seed=0))  # type: ignore[arg-type]

    def ours() -> object:
        return Plan(shard_sizes, seed=0).rank_order(0, world_size=w, rank=0)

    name = f"plan: rank 0 of {w}, one epoch of {n:,} samples in {len(shard_sizes):,} shards"
    rows = [
        measure(peer, benchmark="scale", case=name, system=PLAN_PEER, repeats=config.repeats),
        measure(
            ours,
            benchmark="scale",
            case=name,
            system="fastload Plan.rank_order",
            repeats=config.repeats,
            note="plan built each time",
        ),
    ]
    per_rank = -(-n // w)
    rows = [dataclasses.replace(row, items=per_rank) for row in rows]
    case.figures["plan_s"] = rows[1].seconds
    case.rows += relate(rows, PLAN_PEER)


def listed_shard_sizes(server: Any, bucket: str, cache: Path) -> Any:
    """The opened dataset's shard sizes (manifest cached: no request)."""
    from fastload.datasets import open_dataset

    with open_dataset(
        f"s3://{bucket}", cache_dir=str(cache), storage_options=server.storage_options
    ) as dataset:
        return dataset.shard_sizes
