"""A node, not a GPU: ``fl.DataLoader`` in 1 and in N rank processes at once, as torchrun
starts them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), each on its
share of the node's cores, reporting each rank's images/s and the CPU cores used per GPU.

N is the GPUs torch sees, at least 2 (two processes share one GPU where there is only one).
Rank r decodes onto ``cuda:(r mod GPUs)``; with ``device="cpu"`` the same harness runs
without a GPU (how it is tested). Every rank reads the same generated JPEG folder through one
cache directory; the first epoch (which stages the cache) is not timed, then the ranks meet
at a barrier (a file per rank) and time ``batches`` batches each::

    python -m fastload.bench.gpu.ranks --data DIR --out DIR [--ranks N] [--device cuda]

prints one JSON object: per run (1 rank, N ranks) each rank's images/s, CPU seconds and
cores, the node's images/s and the cores used per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastload.resources import usable_cpus

_BARRIER_S = 300.0  # ranks that have not all arrived by then: one of them failed


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    data: str  # an ImageFolder of JPEGs
    cache_dir: str
    device: str = "cuda"
    decode: str = "auto"
    batch_size: int = 256
    size: int = 224
    batches: int = 20  # timed per rank
    threads: int = 0  # loader threads per rank; 0: the node's cores / ranks

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.batches < 1 or self.size < 1 or self.threads < 0:
            raise ValueError(f"batch_size, batches, size must be >= 1, threads >= 0: {self}")


def gpus_for(device: str) -> int:
    """GPUs the ranks spread over: torch's count on CUDA, 1 (the host) on the CPU."""
    if not device.startswith("cuda"):
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def default_ranks(device: str) -> int:
    """N: a rank per GPU, at least two (sharing one GPU if only one exists)."""
    return max(2, gpus_for(device)) if device.startswith("cuda") else 2


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread, native ones too
    return usage.ru_utime + usage.ru_stime


def run_rank(config: RankConfig, barrier: Path) -> dict[str, Any]:
    """One rank's loop (in its own process): an untimed epoch, the barrier, timed batches."""
    import torch

    import fastload as fl
    from fastload.decode.params import TrainPreset

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    device = config.device
    if device.startswith("cuda"):
        device = f"cuda:{local_rank % gpus_for(device)}"
        torch.cuda.set_device(torch.device(device))
    threads = config.threads or max(1, usable_cpus() // ranks)
    dataset = fl.open_dataset(config.data, cache_dir=config.cache_dir)
    loader = fl.DataLoader(
        dataset,
        batch_size=config.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=threads,
        device=device,
        decode=config.decode,
        transform=TrainPreset(size=config.size),
    )
    try:
        for _ in loader:  # stages the cache, builds pipelines, pins slots: not timed
            pass
        _meet(barrier, rank, ranks)
        done, epoch = 0, 1
        start, cpu_start = time.perf_counter(), _cpu_s()
        while done < config.batches:
            loader.set_epoch(epoch)
            for images, _labels in loader:
                images.sum()  # a consumer of the batch on its device (ordered after it)
                done += 1
                if done == config.batches:
                    break
            epoch += 1
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds, cpu = time.perf_counter() - start, _cpu_s() - cpu_start
        backend = loader.stats().get("decode_backend")
    finally:
        loader.close()
    images = done * config.batch_size
    return {
        "rank": rank,
        "device": device,
        "threads": threads,
        "decode_backend": backend,
        "images": images,
        "seconds": seconds,
        "images_per_s": images / seconds,
        "cpu_s": cpu,
        "cores": cpu / seconds,
    }


def _meet(barrier: Path, rank: int, ranks: int) -> None:
    (barrier / f"ready.{rank}").touch()
    deadline = time.monotonic() + _BARRIER_S
    while sum((barrier / f"ready.{r}").exists() for r in range(ranks)) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the other ranks did not arrive in {_BARRIER_S} s")
        time.sleep(0.01)


def run_node(config: RankConfig, ranks: int, work_dir: Path) -> dict[str, Any]:
    """``ranks`` rank processes at once; their results and the node's totals."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    barrier = work_dir / f"barrier-{ranks}-{time.monotonic_ns()}"
    barrier.mkdir(parents=True)
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(ranks),
        }
        command = [
            sys.executable,
            "-m",
            "fastload.bench.gpu.ranks",
            "--rank-of",
            json.dumps(asdict(config)),
            "--barrier",
            str(barrier),
        ]
        procs.append(
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results, errors = [], []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=_BARRIER_S + 600)
            if proc.returncode != 0:
                errors.append(f"rank {rank} exited {proc.returncode}: {err.strip()[-800:]}")
                continue
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if errors:
        raise RuntimeError("; ".join(errors))
    gpus = min(ranks, gpus_for(config.device))
    seconds = max(r["seconds"] for r in results)
    images = sum(r["images"] for r in results)
    cores = sum(r["cpu_s"] for r in results) / seconds
    return {
        "ranks": ranks,
        "gpus": gpus,
        "per_rank": results,
        "images_per_s": images / seconds,
        "per_rank_images_per_s": [round(r["images_per_s"], 1) for r in results],
        "cores_used": cores,
        "cores_per_gpu": cores / gpus,
        "usable_cores": usable_cpus(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ranks", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--data", help="an ImageFolder of JPEGs")
    parser.add_argument("--out", help="the cache and the barrier files go here")
    parser.add_argument("--ranks", type=int, default=None, help="N (default: GPUs, >= 2)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--decode", default="auto")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # a rank process's config
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        print(json.dumps(run_rank(RankConfig(**json.loads(args.rank_of)), Path(args.barrier))))
        return 0
    if not args.data or not args.out:
        parser.error("--data and --out are required")
    out = Path(args.out)
    config = RankConfig(
        data=args.data,
        cache_dir=str(out / "cache"),
        device=args.device,
        decode=args.decode,
        batch_size=args.batch_size,
        size=args.size,
        batches=args.batches,
    )
    n = args.ranks or default_ranks(args.device)
    runs = [run_node(config, ranks, out) for ranks in dict.fromkeys((1, n))]
    print(json.dumps({"config": asdict(config), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
