"""What runs in a measured process of the scale benchmark: it imports, says "ready", waits
for "go", opens (or reads a batch, or loads a peer's index) and reports its wall time, CPU
and memory (USS, PSS from ``/proc/<pid>/smaps_rollup``) as JSON lines."""

from __future__ import annotations

import gc
import json
import os
import pickle
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fastload.bench.scale.config import PEER_MODULES


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


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
        start, cpu = time.perf_counter(), process_cpu_s()
        report = fl.warm(
            spec["url"],
            cache_dir=spec["cache"],
            storage_options=spec["storage_options"],
            share=_node_share(spec),
            progress=False,
        )
        result = {
            "seconds": time.perf_counter() - start,
            "cpu_s": process_cpu_s() - cpu,
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

    start, cpu = time.perf_counter(), process_cpu_s()
    dataset = fl.open_dataset(
        spec["url"], cache_dir=spec["cache"], storage_options=spec["storage_options"]
    )
    result: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_s": process_cpu_s() - cpu,
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

    start, cpu = time.perf_counter(), process_cpu_s()
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
        "first_batch_cpu_s": process_cpu_s() - cpu,
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
    start, cpu = time.perf_counter(), process_cpu_s()
    dataset = load(spec["url"], spec["cache"])
    samples = len(dataset)
    result: dict[str, Any] = {
        "seconds": time.perf_counter() - start,
        "cpu_s": process_cpu_s() - cpu,
        "opened": rollup(),
        "samples": samples,
    }
    try:
        result["pickled_bytes"] = len(pickle.dumps(dataset))
    except Exception as exc:  # a peer's dataset that does not pickle: say so
        result["pickle_error"] = f"{type(exc).__name__}: {exc}"[:200]
    _say(result)
    _wait("end")
