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
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pickle
import resource
import selectors
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fastload.bench.runner import Measurement, Report, cpu_seconds, measure, relate

FOLDER_BUCKET = "imagenet"
TAR_BUCKET = "shards"
PEER_BUCKETS = {"mosaicml-streaming": "mds", "litdata": "litdata"}
PEER_MODULES = {"mosaicml-streaming": "streaming", "litdata": "litdata"}
PLAN_PEER = "torch DistributedSampler"
FIRST_OPEN = "fastload first open (empty cache)"
CACHED_OPEN = "fastload cached open (fresh process)"
FIRST_BATCH = "fastload first batch after a cached open"
WORKERS = "torch DataLoader workers (spawn)"
NODE_SHARE = "fastload warm of a node's share"
# P11's bounds.
TARGET_FIRST_OPEN_S = 10.0
TARGET_CPU_US_PER_OBJECT = 5.0
TARGET_CACHED_OPEN_S = 0.5
TARGET_USS_PER_SAMPLE = 100.0
TARGET_PICKLED_BYTES = 1 << 20
TARGET_FIRST_BATCH_S = 1.0
TARGET_PLAN_S = 0.1
_PAYLOADS = 8
# The small buckets each child opens first (bucket name + this).
_WARMUP = "-warmup"
# A child that neither reports nor exits within this long has hung: it is killed.
_CHILD_TIMEOUT_S = 1800.0


@dataclass(frozen=True, kw_only=True)
class ScaleBenchConfig:
    objects: int = 1_281_167
    classes: int = 1000
    object_bytes: int = 110_000
    shards: int = 1024
    shard_samples: int = 1250
    sample_bytes: int = 52_000
    latency_s: float = 0.02
    # Processes of the node cases (0 leaves them out).
    processes: int = 8
    # The node share: ranks 0..ranks_per_node-1 of node_share * ranks_per_node.
    node_share: int = 16
    ranks_per_node: int = 8
    world_size: int = 8  # of the plan case
    batch_size: int = 64
    workers: int = 2
    repeats: int = 3  # cached opens and plans; a first open runs once
    peers: bool = True
    # Also write fastload's own index of the tar shards (``fl.write_index``: reads every
    # shard once, ~4 min at full size) and open and take a first batch with it.
    fastload_index: bool = False

    def __post_init__(self) -> None:
        for name in (
            "objects",
            "classes",
            "object_bytes",
            "shards",
            "shard_samples",
            "sample_bytes",
            "node_share",
            "ranks_per_node",
            "world_size",
            "batch_size",
            "workers",
            "repeats",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.latency_s < 0 or self.processes < 0:
            raise ValueError(
                f"latency_s and processes must be >= 0, got {self.latency_s}, {self.processes}"
            )
        if self.classes > self.objects:
            raise ValueError(f"classes ({self.classes}) must be <= objects ({self.objects})")

    @classmethod
    def quick(cls) -> ScaleBenchConfig:
        """50,000 images; 64 shards of 4 MB (6,400 samples): about 1.5 min."""
        return cls(objects=50_000, shards=64, shard_samples=100, sample_bytes=40_000, repeats=1)

    @property
    def tar_samples(self) -> int:
        return self.shards * self.shard_samples


# --- memory ----------------------------------------------------------------------------------


def rollup(pid: int | str = "self") -> dict[str, int]:
    """A process's RSS, PSS, USS (private clean + dirty) and anonymous memory (its heap)
    in bytes, from ``/proc/<pid>/smaps_rollup``; zeros
    if it ended or the kernel does not say. USS counts a mapped file's pages that only this
    process maps (a manifest no other process has mapped yet)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    fields[name] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return {
        "rss": fields.get("Rss", 0),
        "pss": fields.get("Pss", 0),
        "uss": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
        "anon": fields.get("Anonymous", 0),
    }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- the child ---------------------------------------------------------------------------------


def _say(payload: Mapping[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def _wait(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"scale child: expected {word!r}, got {line!r}")


def child_main(spec: dict[str, Any]) -> None:
    """One measured process: prepares, says ``{"ready": ...}``, works on "go", reports one
    JSON line, exits on "end"."""
    kind = spec["kind"]
    if kind == "peer":
        _peer_child(spec)
        return
    import fastload as fl

    if spec.get("loader") or spec.get("workers_memory"):
        import fastload.loader  # torch: imported before the clock starts
    warmup = _warm_up(spec)
    share_keys: list[str] | None = None
    if kind == "warm":
        share = _node_share(spec)
        share_keys = share.staging(
            spec["url"], cache_dir=spec["cache"], storage_options=spec["storage_options"]
        ).keys
    gc.collect()
    _say({"ready": rollup()})
    _wait("go")
    result: dict[str, Any] = {}
    if kind == "warm":
        start, cpu = time.perf_counter(), _cpu_s()
        report = fl.warm(
            spec["url"],
            cache_dir=spec["cache"],
            storage_options=spec["storage_options"],
            share=_node_share(spec),
            progress=False,
        )
        result = {
            "seconds": time.perf_counter() - start,
            "cpu_s": _cpu_s() - cpu,
            "fetched": report.fetched,
            "fetched_bytes": report.fetched_bytes,
            "failed": report.failed,
            "planned": share_keys,
        }
    else:
        result = _open_child(spec, warmup)
    _say(result)
    _wait("end")


def _warm_up(spec: dict[str, Any]) -> Any:
    """Opens the small dataset of the same format first (from a cache of this process's
    own): the modules, clients and threads an open starts once are in the baseline, so the
    measured open's memory and CPU are what its samples cost. Returns the dataset."""
    if not spec.get("warmup_url"):
        return None
    import fastload as fl

    dataset = fl.open_dataset(
        spec["warmup_url"],
        cache_dir=str(Path(spec["warmup_cache"]) / str(os.getpid())),
        storage_options=spec["storage_options"],
    )
    pickle.loads(pickle.dumps(dataset))
    return dataset


def _node_share(spec: dict[str, Any]) -> Any:
    from fastload.warm import NodeShare

    return NodeShare(
        ranks=tuple(range(spec["ranks_per_node"])),
        world_size=spec["node_share"] * spec["ranks_per_node"],
        epochs=(0,),
    )


def _open_child(spec: dict[str, Any], warmup: Any) -> dict[str, Any]:
    import fastload as fl

    start, cpu = time.perf_counter(), _cpu_s()
    dataset = fl.open_dataset(
        spec["url"], cache_dir=spec["cache"], storage_options=spec["storage_options"]
    )
    result: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_s": _cpu_s() - cpu,
        "opened": rollup(),
        "samples": len(dataset),
        "format": dataset.format,
    }
    pickled = pickle.dumps(dataset)
    result["pickled_bytes"] = len(pickled)
    start = time.perf_counter()
    pickle.loads(pickled)
    result["unpickle_s"] = time.perf_counter() - start
    del pickled
    if spec.get("loader"):
        result.update(_first_batch(dataset, spec))
    if spec.get("workers_memory"):
        result["workers"] = _workers_memory(dataset, warmup, spec)
    return result


def _first_batch(dataset: Any, spec: dict[str, Any]) -> dict[str, Any]:
    import fastload as fl

    start, cpu = time.perf_counter(), _cpu_s()
    loader = fl.DataLoader(
        dataset,
        batch_size=spec["batch_size"],
        num_workers=spec["workers"],
        decode=None,
        rank=0,
        world_size=1,
    )
    iteration = iter(loader)
    batch = next(iteration)
    found = {
        "first_batch_s": time.perf_counter() - start,
        "first_batch_cpu_s": _cpu_s() - cpu,
        "batch_samples": _batch_len(batch),
        "after_batch": rollup(),
    }
    iteration.close()
    return found


def _batch_len(batch: Any) -> int:
    if isinstance(batch, Mapping):
        batch = next(iter(batch.values()))
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple)):
        batch = batch[0]
    return len(batch)


def worker_memory(samples: Sequence[Any]) -> dict[str, Any]:
    """A collate function that reports the worker's memory instead of a batch."""
    return {"pid": os.getpid(), "samples": len(samples), **rollup()}


def _workers_memory(dataset: Any, small: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Each spawned worker's memory after its first batch: over the small dataset of the
    same format (the baseline: everything but the samples) and over ``dataset``."""
    import torch.utils.data as tud

    found: dict[str, Any] = {}
    # A process's first spawned workers take ~30 MB more each than later ones (measured):
    # a first round over the small dataset is left out.
    for name, source in (("first", small), ("small", small), ("dataset", dataset)):
        loader: Any = tud.DataLoader(
            source,
            batch_size=min(spec["batch_size"], len(source) // spec["workers"]),
            num_workers=spec["workers"],
            multiprocessing_context="spawn",
            collate_fn=worker_memory,
        )
        iterator = iter(loader)
        try:
            found[name] = [next(iterator) for _ in range(spec["workers"])]
        finally:
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    return found


def _peer_child(spec: dict[str, Any]) -> None:
    """A peer's index load: import, load a one-shard index (the warm-up: its clients and
    modules), "ready", then construct its dataset from S3 and take its length (which reads
    its index.json and no shard)."""
    import importlib

    system = spec["system"]
    module: Any = importlib.import_module(PEER_MODULES[system])
    options = spec["storage_options"]
    endpoint = options["client_kwargs"]["endpoint_url"]
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": options["key"],
            "AWS_SECRET_ACCESS_KEY": options["secret"],
            "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
            "S3_ENDPOINT_URL": endpoint,  # mosaicml-streaming's boto3 reads it
        }
    )
    if system == "mosaicml-streaming":
        module.base.util.clean_stale_shared_memory()

    def load(url: str, cache: str) -> Any:
        if system == "mosaicml-streaming":
            return module.StreamingDataset(
                remote=url, local=cache, batch_size=spec["batch_size"], shuffle=True
            )
        return module.StreamingDataset(
            input_dir=url,
            cache_dir=cache,
            shuffle=True,
            storage_options={
                "endpoint_url": endpoint,
                "aws_access_key_id": options["key"],
                "aws_secret_access_key": options["secret"],
            },
        )

    small = load(spec["warmup_url"], spec["warmup_cache"])
    len(small)
    gc.collect()
    _say({"ready": rollup()})
    _wait("go")
    start, cpu = time.perf_counter(), _cpu_s()
    dataset = load(spec["url"], spec["cache"])
    samples = len(dataset)
    result: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_s": _cpu_s() - cpu,
        "opened": rollup(),
        "samples": samples,
    }
    try:
        result["pickled_bytes"] = len(pickle.dumps(dataset))
    except Exception as exc:  # a peer's dataset that does not pickle: say so
        result["pickle_error"] = f"{type(exc).__name__}: {exc}"[:200]
    _say(result)
    _wait("end")


# --- the parent: children, servers, data -------------------------------------------------


def _readline(stream: IO[str], what: str) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(_CHILD_TIMEOUT_S):
            raise RuntimeError(f"{what}: no answer within {_CHILD_TIMEOUT_S:g}s")
    line = stream.readline()
    if not line:
        raise RuntimeError(f"{what} ended without answering (see its stderr above)")
    return line


class _Child:
    """A measured process: ``ready`` holds its first line, ``result()`` its report."""

    def __init__(self, spec: dict[str, Any], python: str | None = None) -> None:
        env = None
        if python is not None:  # the peers' venv: this fastload through a link folder
            from fastload.bench.e2e.e2e_process import child_env

            env = child_env(Path(spec["work"]))
        self.what = f"the {spec['kind']} child"
        self.proc = subprocess.Popen(
            [
                python or sys.executable,
                "-m",
                "fastload.bench.scale.scale_bench",
                "child",
                json.dumps(spec),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        self.ready = json.loads(_readline(self._stdout, self.what))["ready"]

    def say(self, word: str) -> None:
        self._stdin.write(word + "\n")
        self._stdin.flush()

    def result(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(_readline(self._stdout, self.what))
        return found

    def close(self) -> None:
        """Lets the child exit, or kills it after a bounded wait; idempotent."""
        if self.proc.poll() is None:
            try:
                self.say("end")
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=60)
        self._stdin.close()
        self._stdout.close()


@dataclass
class _Run:
    """What N children did together, from "go" to the last report."""

    results: list[dict[str, Any]]
    ready: list[dict[str, int]]
    done: list[dict[str, int]]  # each child's memory, read from here after every report
    seconds: float
    server_cpu_s: float
    listings: int
    gets: int
    body_bytes: dict[str, int]


def _run_children(server: Any, specs: Sequence[dict[str, Any]], python: str | None = None) -> _Run:
    children: list[_Child] = []
    try:
        children = [_Child(spec, python) for spec in specs]
        for child in children:
            child.wait_ready()
        ready = [rollup(child.proc.pid) for child in children]
        stats0, server0 = server.read_stats(), cpu_seconds([server.pid()])
        start = time.perf_counter()
        for child in children:
            child.say("go")
        results = [child.result() for child in children]
        seconds = time.perf_counter() - start
        stats1, server1 = server.read_stats(), cpu_seconds([server.pid()])
        done = [rollup(child.proc.pid) for child in children]
    finally:
        for child in children:
            child.close()
    body = {
        path: n - stats0.body_bytes.get(path, 0)
        for path, n in stats1.body_bytes.items()
        if n > stats0.body_bytes.get(path, 0)
    }
    return _Run(
        results=results,
        ready=ready,
        done=done,
        seconds=seconds,
        server_cpu_s=sum(server1.values()) - sum(server0.values()),
        listings=stats1.listings - stats0.listings,
        gets=stats1.count("GetObject") - stats0.count("GetObject"),
        body_bytes=body,
    )


def layouts(config: ScaleBenchConfig) -> dict[str, Any]:
    """The synthetic buckets by name: the two of the cases, and a small one of each
    format that children open first (``_warm_up``)."""
    from fastload.testing.synthetic import ImageFolderLayout, TarShardsLayout, random_payloads

    small = random_payloads(2, 1000, seed=2)
    return {
        f"{FOLDER_BUCKET}{_WARMUP}": ImageFolderLayout(objects=20, classes=2, payloads=small),
        f"{TAR_BUCKET}{_WARMUP}": TarShardsLayout(
            shards=2, samples_per_shard=10, payloads=small, shard_index=True
        ),
        FOLDER_BUCKET: ImageFolderLayout(
            objects=config.objects,
            classes=config.classes,
            payloads=random_payloads(_PAYLOADS, config.object_bytes),
        ),
        TAR_BUCKET: TarShardsLayout(
            shards=config.shards,
            samples_per_shard=config.shard_samples,
            payloads=random_payloads(_PAYLOADS, config.sample_bytes, seed=1),
            shard_index=True,
        ),
    }


def peer_indexes(root: Path, config: ScaleBenchConfig, python: str) -> dict[str, str]:
    """Writes each peer's ``index.json`` for the tar case's shards and samples into bucket
    folders under root (from the index its own writer makes for a few samples); returns the
    peers it could not write for, with the reason."""
    work = root.parent / "peer-template"
    script = (
        "import json, os, sys\n"
        "out, which = sys.argv[1], sys.argv[2]\n"
        "rows = [{'jpg': os.urandom(100), 'cls': i} for i in range(3)]\n"
        "if which == 'mosaicml-streaming':\n"
        "    import streaming\n"
        "    with streaming.MDSWriter(out=out, columns={'jpg': 'bytes', 'cls': 'int'}) as w:\n"
        "        for row in rows: w.write(row)\n"
        "else:\n"
        "    from litdata.streaming.writer import BinaryWriter\n"
        "    w = BinaryWriter(out, chunk_size=len(rows))\n"
        "    for i, row in enumerate(rows): w[i] = row\n"
        "    w.done(); w.merge()\n"
    )
    skipped = {}
    span = 3 * 512 + -(-config.sample_bytes // 512) * 512  # a tar sample's bytes, roughly
    for system, bucket in PEER_BUCKETS.items():
        out = work / bucket
        shutil.rmtree(out, ignore_errors=True)
        made = subprocess.run(
            [python, "-c", script, str(out), system],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if made.returncode != 0 or not (out / "index.json").exists():
            tail = (made.stderr.strip().splitlines() or ["no output"])[-1]
            skipped[system] = f"its writer failed: {tail[:200]}"
            continue
        template = json.loads((out / "index.json").read_text())
        bytes_per_shard = config.shard_samples * span
        for name, shards in ((bucket, config.shards), (f"{bucket}{_WARMUP}", 1)):
            index = _scaled_index(system, template, shards, config.shard_samples, bytes_per_shard)
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / "index.json").write_text(json.dumps(index))
    return skipped


def _scaled_index(
    system: str, template: dict[str, Any], shards: int, samples: int, shard_bytes: int
) -> dict[str, Any]:
    """A peer's index.json for ``shards`` shards of ``samples`` samples each, every entry
    a copy of the first in ``template`` (what its writer made) with its name and counts."""
    index: dict[str, Any] = json.loads(json.dumps(template))
    if system == "mosaicml-streaming":
        first = index["shards"][0]
        index["shards"] = [
            {
                **first,
                "samples": samples,
                "raw_data": {
                    **first["raw_data"],
                    "basename": f"shard.{s:05d}.mds",
                    "bytes": shard_bytes,
                },
            }
            for s in range(shards)
        ]
    else:
        first = index["chunks"][0]
        index["chunks"] = [
            {
                **first,
                "chunk_bytes": shard_bytes,
                "chunk_size": samples,
                "filename": f"chunk-0-{s}.bin",
            }
            for s in range(shards)
        ]
        index["config"]["chunk_size"] = samples
    return index


def _peers_python() -> tuple[str | None, dict[str, str]]:
    """The peers' Python and, per peer, why it is skipped (nothing when it imports)."""
    from fastload.bench.e2e.e2e_process import default_peers_python

    python = default_peers_python()
    if python is None:
        reason = "no .venv-peers (make bench-peers) and no $FASTLOAD_PEERS_PYTHON"
        return None, dict.fromkeys(PEER_MODULES, reason)
    return python, {}


@contextmanager
def _server(root: Path, config: ScaleBenchConfig) -> Iterator[Any]:
    from fastload.testing import RemoteBehavior
    from fastload.testing.s3_folder import S3FolderProcess

    with S3FolderProcess(
        root, synthetic=layouts(config), behavior=RemoteBehavior(latency_s=config.latency_s)
    ) as server:
        yield server


# --- the cases -------------------------------------------------------------------------------


class _Scratch:
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
        "warmup_url": f"s3://{bucket}{_WARMUP}",
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


# The table's extra columns, by the keyword that _Case.add takes for each.
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


class _Case:
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


def _open_cases(
    case: _Case,
    server: Any,
    bucket: str,
    scratch: _Scratch,
    config: ScaleBenchConfig,
    objects: int,
) -> Path:
    """First open, cached opens, N processes; returns the cache with a warm manifest."""
    cache = scratch.fresh(f"{bucket}-open")
    first = _run_children(server, [_spec(server, bucket, cache, config)])
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
        _run_children(server, [_spec(server, bucket, cache, config)]) for _ in range(config.repeats)
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
        _node_cases(case, server, bucket, scratch, config, warm_cache=cache)
    return cache


def _node_cases(
    case: _Case,
    server: Any,
    bucket: str,
    scratch: _Scratch,
    config: ScaleBenchConfig,
    *,
    warm_cache: Path,
) -> None:
    n = config.processes
    for label, cache in (
        ("empty cache", scratch.fresh(f"{bucket}-node")),
        ("manifest cached", warm_cache),
    ):
        run = _run_children(server, [_spec(server, bucket, cache, config)] * n)
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


def _first_batch_case(
    case: _Case,
    server: Any,
    bucket: str,
    cache: Path,
    config: ScaleBenchConfig,
    *,
    label: str = "",
    figure: str = "first_batch_s",
) -> None:
    """A fresh process, manifest cached, objects not: open, then the first batch."""
    run = _run_children(server, [_spec(server, bucket, cache, config, loader=True)])
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


def _workers_case(
    case: _Case, server: Any, bucket: str, cache: Path, config: ScaleBenchConfig
) -> None:
    run = _run_children(server, [_spec(server, bucket, cache, config, workers_memory=True)])
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


def _node_share_case(
    case: _Case, server: Any, scratch: _Scratch, config: ScaleBenchConfig, layout: Any
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
    run = _run_children(server, [spec])
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


def _fastload_index_cases(
    case: _Case, server: Any, scratch: _Scratch, config: ScaleBenchConfig
) -> None:
    """``fl.write_index`` into a fresh cache (the bucket is read-only: a file per shard),
    then a fresh process's open and first batch with that index."""
    import fastload as fl

    cache = scratch.fresh(f"{TAR_BUCKET}-flidx")
    stats0, server0 = server.read_stats(), cpu_seconds([server.pid()])
    start, cpu = time.perf_counter(), _cpu_s()
    report = fl.write_index(
        f"s3://{TAR_BUCKET}",
        cache_dir=str(cache),
        storage_options=server.storage_options,
        to="cache",
        progress=False,
    )
    seconds, cpu_s = time.perf_counter() - start, _cpu_s() - cpu
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
    run = _run_children(server, [_spec(server, TAR_BUCKET, cache, config)])
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
    _first_batch_case(
        case,
        server,
        TAR_BUCKET,
        cache,
        config,
        label="fastload's index",
        figure="first_batch_s_fastload_index",
    )
    shutil.rmtree(cache, ignore_errors=True)


def _peer_cases(
    case: _Case,
    server: Any,
    scratch: _Scratch,
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
            "warmup_url": f"s3://{bucket}{_WARMUP}",
            "warmup_cache": str(scratch.fresh(f"peer-{bucket}{_WARMUP}")),
        }
        try:
            run = _run_children(server, [spec], python=python)
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


def _plan_rows(case: _Case, shard_sizes: Any, config: ScaleBenchConfig) -> None:
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


def _shard_sizes(server: Any, bucket: str, cache: Path) -> Any:
    """The opened dataset's shard sizes (manifest cached: no request)."""
    from fastload.datasets import open_dataset

    with open_dataset(
        f"s3://{bucket}", cache_dir=str(cache), storage_options=server.storage_options
    ) as dataset:
        return dataset.shard_sizes


# --- targets ---------------------------------------------------------------------------------


def _targets(folder: _Case, tar: _Case, config: ScaleBenchConfig) -> list[dict[str, Any]]:
    """P11's targets against the figures: each {target, bound, measured, met}."""
    f, t = folder.figures, tar.figures
    rows: list[tuple[str, float | None, float, str]] = [
        ("folder first open s", f.get("first_open_s"), TARGET_FIRST_OPEN_S, "<="),
        (
            "folder first open client CPU us/object",
            f.get("first_open_cpu_us"),
            TARGET_CPU_US_PER_OBJECT,
            "<=",
        ),
        ("folder cached open s", f.get("cached_open_s"), TARGET_CACHED_OPEN_S, "<="),
        ("folder USS B/sample per process", f.get("uss_per_sample"), TARGET_USS_PER_SAMPLE, "<="),
        (
            "folder USS B/sample of the process that listed",
            f.get("first_open_uss_per_sample"),
            TARGET_USS_PER_SAMPLE,
            "<=",
        ),
        ("folder pickled bytes", f.get("pickled_bytes"), TARGET_PICKLED_BYTES, "<="),
        (
            "folder USS B/sample per DataLoader worker process",
            f.get("worker_uss_per_sample"),
            TARGET_USS_PER_SAMPLE,
            "<=",
        ),
        (
            "folder first batch s after a cached open",
            f.get("first_batch_s"),
            TARGET_FIRST_BATCH_S,
            "<=",
        ),
        ("folder plan s per rank-epoch", f.get("plan_s"), TARGET_PLAN_S, "<="),
        ("tar first open s (shardindex.json)", t.get("first_open_s"), TARGET_FIRST_OPEN_S, "<="),
        ("tar cached open s", t.get("cached_open_s"), TARGET_CACHED_OPEN_S, "<="),
        ("tar pickled bytes", t.get("pickled_bytes"), TARGET_PICKLED_BYTES, "<="),
        ("tar first batch s after open", t.get("first_batch_s"), TARGET_FIRST_BATCH_S, "<="),
        ("tar plan s per rank-epoch", t.get("plan_s"), TARGET_PLAN_S, "<="),
        *(
            [
                (
                    "tar first batch s after open, fastload's index",
                    t.get("first_batch_s_fastload_index"),
                    TARGET_FIRST_BATCH_S,
                    "<=",
                ),
                (
                    "tar pickled bytes, fastload's index",
                    t.get("pickled_bytes_fastload_index"),
                    TARGET_PICKLED_BYTES,
                    "<=",
                ),
            ]
            if config.fastload_index
            else []
        ),
        (
            f"tar node share: fraction of shard bytes fetched (1/{config.node_share})",
            t.get("share_fraction"),
            1 / config.node_share,
            "<=",
        ),
    ]
    if "node_cold_listings" in f:
        rows += [
            (
                f"folder: {config.processes} processes list once (pages, vs one process's)",
                f["node_cold_listings"],
                f["listings"],
                "==",
            ),
            (
                f"folder: {config.processes} processes' PSS MB",
                f["node_cold_pss"] / 1e6,
                f["node_cold_pss_bound"] / 1e6,
                "<=",
            ),
        ]
    found = []
    for name, measured, bound, op in rows:
        met = None if measured is None else (measured == bound if op == "==" else measured <= bound)
        found.append({"target": name, "op": op, "bound": bound, "measured": measured, "met": met})
    return found


def target_lines(report: Report) -> list[str]:
    """P11's targets, one line each: measured, bound, met or missed."""
    lines = [f"P11 at {report.params.get('objects', 0):,} objects:"]
    for t in report.params.get("targets", []):
        measured = "n/a" if t["measured"] is None else _short(t["measured"])
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        lines.append(f"  {t['target']}: {measured} ({t['op']} {_short(t['bound'])}) {verdict}")
    return lines


def _short(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"


# --- the run ---------------------------------------------------------------------------------


def run(data_dir: str | os.PathLike[str], config: ScaleBenchConfig | None = None) -> Report:
    config = config or ScaleBenchConfig()
    data_dir = Path(data_dir)
    root = data_dir / "remote"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    scratch = _Scratch(data_dir / "scratch")
    python, skipped = _peers_python() if config.peers else (None, {})
    if config.peers and python is not None:
        skipped.update(peer_indexes(root, config, python))
    found = layouts(config)
    tar_layout = found[TAR_BUCKET]
    ms = config.latency_s * 1e3
    folder = _Case(
        f"ImageFolder: {config.objects:,} objects in {config.classes:,} classes, "
        f"{ms:g} ms per request",
        config.objects,
    )
    tar = _Case(
        f"tar: {config.shards:,} shards of {tar_layout.shard_bytes / 1e6:.1f} MB, "
        f"{config.tar_samples:,} samples, shardindex.json",
        config.tar_samples,
    )
    with ExitStack() as stack:
        server = stack.enter_context(_server(root, config))
        cache = _open_cases(folder, server, FOLDER_BUCKET, scratch, config, config.objects)
        _first_batch_case(folder, server, FOLDER_BUCKET, cache, config)
        _workers_case(folder, server, FOLDER_BUCKET, cache, config)
        _plan_rows(folder, _shard_sizes(server, FOLDER_BUCKET, cache), config)
        # The tar bucket lists config.shards + 1 objects.
        cache = _open_cases(tar, server, TAR_BUCKET, scratch, config, config.shards + 1)
        _first_batch_case(tar, server, TAR_BUCKET, cache, config)
        _node_share_case(tar, server, scratch, config, tar_layout)
        _plan_rows(tar, _shard_sizes(server, TAR_BUCKET, cache), config)
        if config.fastload_index:
            _fastload_index_cases(tar, server, scratch, config)
        if config.peers:
            _peer_cases(tar, server, scratch, config, python, skipped)
    shutil.rmtree(scratch.root, ignore_errors=True)
    params: dict[str, Any] = {
        **config.__dict__,
        "tar_samples": config.tar_samples,
        "shard_bytes": tar_layout.shard_bytes,
        "server": "S3FolderProcess (synthetic buckets) in its own process",
        "figures": {"folder": folder.figures, "tar": tar.figures},
        "targets": _targets(folder, tar, config),
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
