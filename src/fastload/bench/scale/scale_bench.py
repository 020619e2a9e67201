"""Scale: opening an ImageNet-sized dataset, and what it costs each process (P11).

Two synthetic buckets (:mod:`fastload.testing.synthetic`, computed, never stored) served by
one :class:`~fastload.testing.S3FolderProcess` in a process of its own, ``latency_s`` (20
ms) per request:

* an **ImageFolder** of ``objects`` (1,281,167) images in ``classes`` (1,000) class
  folders, each object one of 8 payloads of ``object_bytes`` random bytes (the first batch
  is taken with ``decode=None``: it measures the data path, not a decoder);
* **tar shards**: ``shards`` (1,024) WebDataset shards of ``shard_samples`` (1,250)
  samples of ``sample_bytes`` (52,000: 67 MB a shard, so a first batch that needs whole
  shards shows it), with wids' ``shardindex.json``.

Every fastload figure comes from a fresh process (``python -m fastload.bench.scale.scale_bench
child SPEC``) that imports first, says "ready", and is timed from "go": wall time, its
CPU (``getrusage``: every thread of the process, obstore's included) and its private
memory (USS, ``/proc/self/smaps_rollup``) before and after; the server's CPU and its
count of answered requests (``read_stats()``: listing pages, GETs, body bytes) around it.
Cases, on each bucket:

* **first open**: ``fl.open_dataset`` on an empty cache (it lists the bucket and writes
  the manifest; tar: reads ``shardindex.json``, no shard). ``CPU us/obj`` is the opening
  process's CPU per object listed; ``list reqs`` the listing pages it took.
* **cached open**: a fresh process, manifest cached (median of ``repeats``).
  ``USS B/sample``: the process's private memory after the open less before, per sample;
  ``pickled KB``: ``pickle.dumps(dataset)``, what each DataLoader worker receives.
* **N processes open at once** (``processes``; empty cache, then manifest cached): a
  node's ranks. ``list reqs`` must be one listing's (one lister per node, the others map
  its file); ``PSS MB`` is the sum of the processes' proportional set size gained by the
  open (shared pages split among their users), beside P11's bound: N x 100 B a sample +
  one shared copy (the manifest files).
* **first batch after a cached open**: ``fl.DataLoader(batch_size, num_workers threads,
  decode=None)``, from building the loader to its first batch; the objects' cache is empty.
* **torch DataLoader worker processes** (ImageFolder; ``spawn``, ``workers`` of them):
  each worker's USS after its first batch, and that less a worker of a bare dataset
  (nothing but ``__len__``), so what the unpickled dataset and its reads cost a worker.
* **node share** (tar): ``fl.warm(share=NodeShare(ranks 0..ranks_per_node-1 of
  node_share x ranks_per_node))``, from an empty cache: the bytes fetched against the
  planned shards' bytes and the whole dataset's.
* **plan one epoch**: rank 0 of ``world_size``, the plan built each time, over the opened
  dataset's shards, beside ``torch.utils.data.DistributedSampler``.
* **fastload's own index** (tar; with ``fastload_index``, ``--fastload-index``): ``fl.write_index``
  into the cache (the bucket is read-only; every shard is read once), then a fresh
  process's open and first batch with it (a batch reads a large shard it needs few samples
  of by byte range; with wids' ``shardindex.json`` the shard's members are read from it,
  so it is staged whole first).
* **peers' index load** (tar case, same sample count): mosaicml-streaming's
  ``StreamingDataset`` and litdata's ``StreamingDataset`` over an ``index.json`` of
  ``shards`` shards / chunks of ``shard_samples`` samples each, made from the index their
  own writers produce for a few samples (the shards themselves are never written: loading
  the index reads none), from S3 on the same server, in ``.venv-peers`` (``make
  bench-peers``; skipped with the reason when absent).

P11's targets (at 1.28 M samples, 2 cores, 20 ms per request) are checked in
``report.params["targets"]``; :func:`target_lines` prints them.

Command (full size; ~6 min on a 2-core VM, most of it listing 1.28 M objects)::

    .venv/bin/python benchmarks/benchmark_scale.py --out fastload-bench
    fastload bench --scale --out fastload-bench            # the same

The parts: :mod:`.config` (settings, case names, P11's bounds), :mod:`.data` (the buckets and
their server), :mod:`.child` (the measured process), :mod:`.process` (the parent's side of
it), :mod:`.cases`, :mod:`.targets`; this module runs them and names what callers use.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from fastload.bench.runner import Report
from fastload.bench.scale.cases import (
    Case,
    Scratch,
    fastload_index_cases,
    first_batch_case,
    listed_shard_sizes,
    node_share_case,
    open_cases,
    peer_cases,
    plan_rows,
    workers_case,
)
from fastload.bench.scale.child import child_main, rollup
from fastload.bench.scale.config import (
    CACHED_OPEN,
    FIRST_BATCH,
    FIRST_OPEN,
    FOLDER_BUCKET,
    NODE_SHARE,
    PEER_BUCKETS,
    PLAN_PEER,
    TAR_BUCKET,
    TARGET_PICKLED_BYTES,
    WORKERS,
    ScaleBenchConfig,
)
from fastload.bench.scale.data import (
    _scaled_index,
    layouts,
    peer_indexes,
    peers_python,
    serve_buckets,
)
from fastload.bench.scale.targets import checked_targets, target_lines


def run(data_dir: str | os.PathLike[str], config: ScaleBenchConfig | None = None) -> Report:
    config = config or ScaleBenchConfig()
    data_dir = Path(data_dir)
    root = data_dir / "remote"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    scratch = Scratch(data_dir / "scratch")
    python, skipped = peers_python() if config.peers else (None, {})
    if config.peers and python is not None:
        skipped.update(peer_indexes(root, config, python))
    found = layouts(config)
    tar_layout = found[TAR_BUCKET]
    ms = config.latency_s * 1e3
    folder = Case(
        f"ImageFolder: {config.objects:,} objects in {config.classes:,} classes, "
        f"{ms:g} ms per request",
        config.objects,
    )
    tar = Case(
        f"tar: {config.shards:,} shards of {tar_layout.shard_bytes / 1e6:.1f} MB, "
        f"{config.tar_samples:,} samples, shardindex.json",
        config.tar_samples,
    )
    with ExitStack() as stack:
        server = stack.enter_context(serve_buckets(root, config))
        cache = open_cases(folder, server, FOLDER_BUCKET, scratch, config, config.objects)
        first_batch_case(folder, server, FOLDER_BUCKET, cache, config)
        workers_case(folder, server, FOLDER_BUCKET, cache, config)
        plan_rows(folder, listed_shard_sizes(server, FOLDER_BUCKET, cache), config)
        # The tar bucket lists config.shards + 1 objects.
        cache = open_cases(tar, server, TAR_BUCKET, scratch, config, config.shards + 1)
        first_batch_case(tar, server, TAR_BUCKET, cache, config)
        node_share_case(tar, server, scratch, config, tar_layout)
        plan_rows(tar, listed_shard_sizes(server, TAR_BUCKET, cache), config)
        if config.fastload_index:
            fastload_index_cases(tar, server, scratch, config)
        if config.peers:
            peer_cases(tar, server, scratch, config, python, skipped)
    shutil.rmtree(scratch.root, ignore_errors=True)
    params: dict[str, Any] = {
        **config.__dict__,
        "tar_samples": config.tar_samples,
        "shard_bytes": tar_layout.shard_bytes,
        "server": "S3FolderProcess (synthetic buckets) in its own process",
        "figures": {"folder": folder.figures, "tar": tar.figures},
        "targets": checked_targets(folder, tar, config),
    }
    return Report(name="scale", rows=[*folder.rows, *tar.rows], params=params)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "child":
        child_main(json.loads(args[1]))
        return
    raise SystemExit("usage: python -m fastload.bench.scale.scale_bench child SPEC (the parent's)")


if __name__ == "__main__":
    main()

__all__ = [
    "CACHED_OPEN",
    "FIRST_BATCH",
    "FIRST_OPEN",
    "NODE_SHARE",
    "PEER_BUCKETS",
    "PLAN_PEER",
    "TARGET_PICKLED_BYTES",
    "WORKERS",
    "ScaleBenchConfig",
    "_scaled_index",
    "main",
    "rollup",
    "run",
    "target_lines",
]
