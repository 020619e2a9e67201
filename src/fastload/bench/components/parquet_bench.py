"""Parquet images through a loader: fastload (cold from S3, warm from its cache) vs peers.

The data: ``e2e_data``'s generated JPEGs (natural-image-like, ~105 KB, label ``i % 100``)
written once as Parquet the way the Hugging Face Hub stores an image dataset: an ``image``
struct ``{bytes, path}`` (the ``Image`` feature, named in the schema's ``huggingface``
metadata) and an int64 ``label``, rows in a seeded shuffled order, ``row_group_rows`` rows
per row group, ``files`` files (pyarrow's default snappy compression; written by
``e2e_data.write_parquet``, as the end-to-end benchmark's Parquet layout is)::

    parquet-3000-4-100/remote/fastload-parquet/train/train-00000-of-00004.parquet ...

Every system delivers batches of ``batch_size`` ``(images, labels)``, shuffled, the train
preset (RandomResizedCrop + flip + normalize) at ``size`` px, with ``workers`` workers
(fastload: threads; the peers: torch DataLoader worker processes, ``persistent_workers``),
and no training step: figures are the loader's throughput, images/s, the median of
``repeats`` epochs after an untimed one (:mod:`fastload.bench.peers.parquet_peers` has the peers'
datasets, which the end-to-end benchmark's Parquet layout runs from S3 too):

* fastload: ``fl.DataLoader(ds, decode="cpu", transform=TrainPreset(size))`` over
  ``fl.open_dataset("s3://...", format="parquet")`` served by a loopback S3 server in a
  process of its own (``S3FolderProcess``, ``latency_s`` per request). Cold: each epoch
  with a fresh cache and a fresh dataset (opening it, i.e. reading the footers, is timed
  apart as ``open_s``); warm: further epochs of the last cold epoch's loader, from its cache.
  ``gets_per_epoch`` counts the server's GETs during each.
* torch DataLoader over ``pyarrow.dataset`` (the local copy of the same files): a map-style
  dataset that reads the whole table into each worker once (the peer's best case; the
  untimed epoch pays it) and takes a batch's rows per ``__getitems__`` call, decoding each
  image with simplejpeg then torch ops (``decode_bench.TorchOps``, loader_bench's torch
  peer), and, as a second peer, with fastload's CPU decoder (one thread per worker).
* Hugging Face ``datasets`` (only where the peers' Python imports it: ``.venv-peers``, which
  ``make bench-peers`` builds): ``load_dataset("parquet", data_files=..., split="train")``
  (its conversion to Arrow files, once, timed apart as ``prepare_s``), the image column cast
  to ``Image(decode=False)`` so the bytes reach the same decoder, ``.with_format("torch")``,
  in a torch DataLoader whose ``collate_fn`` decodes with simplejpeg then torch ops; and
  ``streaming=True`` (files split between the workers), unshuffled: its best case, since
  ``.shuffle(buffer_size=...)`` leaves datasets 5.0's Parquet stream one shard (one
  worker; torch warns "Too many dataloader workers").

The peers read local files; fastload's warm epoch reads its cache (local files too), its
cold epoch the S3 server. Each system runs in a Python process of its own
(``python -m fastload.bench.components.parquet_bench SPEC RESULT``), one after another; the peers of
``datasets`` with the peers' Python (``e2e_process.default_peers_python``), importing this
same fastload through ``PYTHONPATH``.

Targets (issue 17): fastload's warm epoch >= 1.3x the best peer's; its cold epoch >= 0.8x
its warm one. :func:`targets` says which are met.

Command (3,000 images, 4 files of ~100-row row groups; ``--quick``: 320 images)::

    .venv/bin/python benchmarks/benchmark_parquet.py --out fastload-bench
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.utils.data

from fastload.bench.e2e.e2e_report import TARGETS
from fastload.bench.peers.parquet_peers import (
    ARROW_FASTLOAD_DECODER,
    ARROW_SIMPLEJPEG,
    HF_MAP,
    HF_STREAMING,
    ArrowRows,
    DecodeRows,
    hf_dataset,
)
from fastload.bench.runner import Measurement, Report, cpu_seconds, process_tree, relate

BUCKET = "fastload-parquet"
PREFIX = "train"
FASTLOAD = "fastload"
COLD = f"{FASTLOAD}, cold epoch (S3)"
WARM = f"{FASTLOAD}, warm epoch (cache)"
SYSTEMS = (COLD, WARM, ARROW_SIMPLEJPEG, ARROW_FASTLOAD_DECODER, HF_MAP, HF_STREAMING)
PEERS = (ARROW_SIMPLEJPEG, ARROW_FASTLOAD_DECODER, HF_MAP, HF_STREAMING)
HF_PEERS = (HF_MAP, HF_STREAMING)
NOTES = {
    COLD: "threads; fresh cache, from the S3 server",
    WARM: "threads; from its cache (epochs after the cold one)",
    ARROW_SIMPLEJPEG: "processes; local files, whole table per worker, a batch per take()",
    ARROW_FASTLOAD_DECODER: "processes; local files, whole table per worker, 1 decode thread each",
    HF_MAP: "processes; local files as HF's Arrow cache, Image(decode=False), collate decodes",
    HF_STREAMING: "processes; local files, a file per worker at a time, unshuffled",
}
# fastload's warm epoch over the best peer's; its cold epoch over its warm one (issue 17's,
# which the end-to-end benchmark's Parquet layout checks too).
WARM_TARGET, COLD_TARGET = TARGETS["parquet"]


@dataclass(frozen=True, kw_only=True)
class ParquetBenchConfig:
    samples: int = 3000
    files: int = 4
    row_group_rows: int = 100
    batch_size: int = 64
    workers: int = 2  # threads for fastload, worker processes for the peers
    size: int = 224
    repeats: int = 3
    latency_s: float = 0.02
    seed: int = 0
    systems: tuple[str, ...] = SYSTEMS
    peers_python: str | None = None  # for the HF peers; None: e2e_process.default_peers_python
    timeout_s: float = 1200.0  # per system's process

    def __post_init__(self) -> None:
        for name in ("samples", "files", "row_group_rows", "batch_size", "size", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.files > self.samples:
            raise ValueError(f"files ({self.files}) must be <= samples ({self.samples})")
        if self.workers < 0 or self.latency_s < 0 or self.timeout_s <= 0:
            raise ValueError("workers and latency_s must be >= 0, timeout_s > 0")
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"systems must be among {SYSTEMS}, got {self.systems}")
        if WARM in self.systems and COLD not in self.systems:
            raise ValueError("the warm epochs follow the cold ones: list both, or the cold one")

    @classmethod
    def quick(cls) -> ParquetBenchConfig:
        return cls(samples=320, repeats=2)


# --- data -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParquetData:
    root: Path  # what the S3 server serves: a folder per bucket
    local_dir: Path  # the Parquet files (the peers read them here)
    files: list[Path]
    samples: int
    nbytes: int

    @property
    def key(self) -> str:
        return f"{BUCKET}/{PREFIX}"


def generate(data_dir: Path, config: ParquetBenchConfig) -> ParquetData:
    """The Parquet layout of ``e2e_data``'s JPEGs (kept when written with the same settings)."""
    from fastload.bench.e2e import e2e_data

    data = e2e_data.generate(
        data_dir / f"e2e-{config.samples}", e2e_data.DataConfig(samples=config.samples)
    )
    root = data_dir / f"parquet-{config.samples}-{config.files}-{config.row_group_rows}"
    remote = root / "remote"
    local = remote / BUCKET / PREFIX
    stamp = root / "params.json"
    params = json.dumps(
        {
            "data": str(data.root),
            "samples": config.samples,
            "files": config.files,
            "row_group_rows": config.row_group_rows,
            "seed": config.seed,
            "version": 1,
        }
    )
    if not (stamp.exists() and stamp.read_text() == params):
        shutil.rmtree(root, ignore_errors=True)
        local.mkdir(parents=True)
        order = e2e_data.tar_order(e2e_data.DataConfig(samples=config.samples, seed=config.seed))
        e2e_data.write_parquet(
            local,
            data.folder,
            order,
            classes=data.classes,
            files=config.files,
            row_group_rows=config.row_group_rows,
            prefix=PREFIX,
        )
        stamp.write_text(params)
    files = sorted(local.glob("*.parquet"))
    return ParquetData(
        root=remote,
        local_dir=local,
        files=files,
        samples=config.samples,
        nbytes=sum(p.stat().st_size for p in files),
    )


def _check_same_rows(data: ParquetData, cache_dir: Path) -> None:
    """fastload's reader and pyarrow must agree on the rows before speed means anything."""
    pds = importlib.import_module("pyarrow.dataset")

    from fastload.datasets import open_dataset

    table = pds.dataset(str(data.local_dir), format="parquet").to_table()
    with open_dataset(str(data.local_dir), format="parquet", cache_dir=str(cache_dir)) as ds:
        if len(ds) != table.num_rows:
            raise AssertionError(f"fastload sees {len(ds)} rows, pyarrow {table.num_rows}")
        for i in sorted({0, len(ds) // 2, len(ds) - 1}):
            row = table.slice(i, 1).to_pylist()[0]
            got = ds[i]
            if got["image"] != row["image"]["bytes"] or got["label"] != row["label"]:
                raise AssertionError(f"fastload and pyarrow disagree on row {i}")


# --- one system, in its own process -----------------------------------------------------------


def _epoch(loader: Iterable[Any], expected: int, size: int) -> dict[str, float]:
    """One pass: seconds, the first batch's, samples and CPU seconds of this process tree."""
    samples, first_s = 0, 0.0
    cpu_before = cpu_seconds(process_tree(os.getpid()))
    start = time.perf_counter()
    for images, labels in loader:
        if not samples:
            first_s = time.perf_counter() - start
        n = len(labels)
        if tuple(images.shape) != (n, 3, size, size):
            raise AssertionError(f"a batch of {n} has images of shape {tuple(images.shape)}")
        samples += n
    seconds = time.perf_counter() - start
    cpu_after = cpu_seconds(process_tree(os.getpid()))
    if samples != expected:
        raise AssertionError(f"{samples} samples in an epoch, not {expected}")
    return {
        "seconds": seconds,
        "first_batch_s": first_s,
        "samples": samples,
        "cpu_s": sum(t - cpu_before.get(pid, 0.0) for pid, t in cpu_after.items()),
        "load_avg_1m": os.getloadavg()[0],
    }


def _torch_loader(dataset: Any, config: ParquetBenchConfig, **kwargs: Any) -> Any:
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=config.batch_size,
        num_workers=config.workers,
        persistent_workers=config.workers > 0,
        **kwargs,
    )


def _run_fastload(spec: dict[str, Any], config: ParquetBenchConfig) -> dict[str, Any]:
    """Cold epochs (a fresh cache and dataset each, from the S3 server this process runs),
    then warm epochs of the last cold epoch's loader; GETs counted during each."""
    import fastload as fl
    from fastload.decode.params import TrainPreset
    from fastload.testing import RemoteBehavior, S3FolderProcess

    root, samples = Path(spec["root"]), config.samples
    work = Path(spec["work"])
    result: dict[str, Any] = {"cold": [], "warm": [], "open_s": []}
    behavior = RemoteBehavior(latency_s=config.latency_s)
    server = S3FolderProcess(root, behavior=behavior)
    with server:
        url = f"s3://{BUCKET}/{PREFIX}"
        loader: Any = None
        ds: Any = None
        for r in range(config.repeats + 1):  # the first cold epoch is untimed
            if loader is not None:
                loader.close()
                ds.close()
            cache = work / f"cache-{r}"
            shutil.rmtree(work / f"cache-{r - 1}", ignore_errors=True)
            server.reset_stats()
            start = time.perf_counter()
            ds = fl.open_dataset(
                url,
                format="parquet",
                cache_dir=str(cache),
                storage_options=server.storage_options,
            )
            open_s = time.perf_counter() - start
            loader = fl.DataLoader(
                ds,
                batch_size=config.batch_size,
                shuffle=True,
                num_workers=config.workers,
                decode="cpu",
                transform=TrainPreset(config.size),
                seed=config.seed,
            )
            opened = server.read_stats().count("GetObject")
            epoch = _epoch(loader, samples, config.size)
            epoch["gets"] = server.read_stats().count("GetObject") - opened
            epoch["open_gets"] = opened
            if r:
                result["cold"].append(epoch)
                result["open_s"].append(open_s)
        for _ in range(config.repeats):
            server.reset_stats()
            epoch = _epoch(loader, samples, config.size)
            epoch["gets"] = server.read_stats().count("GetObject")
            result["warm"].append(epoch)
        result["stats"] = loader.stats()
        loader.close()
        ds.close()
    return result


def _run_peer(spec: dict[str, Any], config: ParquetBenchConfig) -> dict[str, Any]:
    system, local = spec["system"], spec["local_dir"]
    result: dict[str, Any] = {"warm": []}
    loader: Any
    if system in (ARROW_SIMPLEJPEG, ARROW_FASTLOAD_DECODER):
        decoder = "simplejpeg" if system == ARROW_SIMPLEJPEG else "fastload"
        dataset = ArrowRows(local, config.samples, config.size, config.seed, decoder)
        loader = _torch_loader(dataset, config, shuffle=True)
    else:
        loader = _hf_loader(spec, config, result)
    rounds = config.repeats + 1  # the first epoch is untimed
    for r in range(rounds):
        epoch = _epoch(loader, config.samples, config.size)
        if r:
            result["warm"].append(epoch)
    iterator = getattr(loader, "_iterator", None)  # persistent workers
    if iterator is not None:
        iterator._shutdown_workers()
    return result


def _hf_loader(spec: dict[str, Any], config: ParquetBenchConfig, result: dict[str, Any]) -> Any:
    files = sorted(glob.glob(os.path.join(spec["local_dir"], "*.parquet")))
    collate = DecodeRows(config.size, config.seed)
    if spec["system"] == HF_MAP:
        ds, result["prepare_s"] = hf_dataset(files, streaming=False, cache_dir=spec["hf_cache"])
        return _torch_loader(ds, config, shuffle=True, collate_fn=collate)
    stream, result["prepare_s"] = hf_dataset(files, streaming=True)
    return _torch_loader(stream, config, collate_fn=collate)


def child_main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    config = ParquetBenchConfig(**_tuples(spec["config"]))
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    measure_system = _run_fastload if spec["system"] == COLD else _run_peer
    result = measure_system(spec, config)
    result["total_s"] = time.perf_counter() - start
    Path(result_path).write_text(json.dumps(result, default=str))


def _tuples(config: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


# --- the parent -------------------------------------------------------------------------------


def _peers_python(config: ParquetBenchConfig) -> str | None:
    if config.peers_python is not None:
        return config.peers_python
    from fastload.bench.e2e.e2e_process import default_peers_python

    return default_peers_python()


def _hf_skip_reason(python: str | None, work: Path) -> str | None:
    """Why the Hugging Face peers cannot run, or None where they can."""
    if python is None:
        return (
            "no peers' Python (.venv-peers, or $FASTLOAD_PEERS_PYTHON): `make bench-peers` "
            "builds it with datasets"
        )
    from fastload.bench.e2e.e2e_process import probe_python

    found = probe_python(python, ["datasets", "torch", "simplejpeg"], work)
    missing = [name for name, v in found.items() if v is None]
    if missing:
        return (
            f"{', '.join(missing)} not importable by {python}: `make bench-peers` installs "
            "datasets into .venv-peers"
        )
    return None


def _run_child(python: str, spec: dict[str, Any], work: Path, timeout_s: float) -> dict[str, Any]:
    """Runs one system in a process of its own with ``python``; its result, or
    ``{"failed": why}``."""
    from fastload.bench.e2e.e2e_process import child_env

    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=work))
    spec = {**spec, "work": str(run_dir)}
    spec_path, result_path = run_dir / "spec.json", run_dir / "result.json"
    spec_path.write_text(json.dumps(spec))
    log = run_dir / "log.txt"
    code = (
        "import sys; from fastload.bench.components.parquet_bench import child_main; "
        "child_main(*sys.argv[1:])"
    )
    try:
        with open(log, "wb") as out:
            proc = subprocess.run(
                [python, "-c", code, str(spec_path), str(result_path)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(work),
                timeout=timeout_s,
                check=False,
            )
        failed = None if proc.returncode == 0 and result_path.exists() else str(proc.returncode)
    except subprocess.TimeoutExpired:
        failed = f"timed out after {timeout_s:g} s"
    if failed is not None:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return {"failed": f"exit {failed}: {tail[0][:300]} (log: {log})"}
    result: dict[str, Any] = json.loads(result_path.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    return result


def _row(
    case: str, system: str, epochs: list[dict[str, Any]], nbytes: int, extra: dict[str, float]
) -> Measurement:
    times = [e["seconds"] for e in epochs]
    samples = epochs[0]["samples"]
    cpu_s = statistics.median(e["cpu_s"] for e in epochs)
    load = max(e["load_avg_1m"] for e in epochs)
    return Measurement(
        benchmark="parquet",
        case=case,
        system=system,
        seconds=statistics.median(times),
        repeats=times,
        items=samples,
        nbytes=nbytes,
        note=f"{NOTES[system]}; load avg up to {load:.1f}",
        extra={
            "cpu_us_per_sample": round(cpu_s / samples * 1e6, 1),
            "first_batch_s": round(statistics.median(e["first_batch_s"] for e in epochs), 3),
            **extra,
        },
    )


def _skipped(case: str, system: str, why: str) -> Measurement:
    return Measurement(
        benchmark="parquet",
        case=case,
        system=system,
        seconds=0.0,
        repeats=[],
        note=f"skipped: {why}",
    )


def case_title(config: ParquetBenchConfig) -> str:
    return (
        f"{config.samples:,} JPEGs in Parquet ({config.files} files, {config.row_group_rows}-row "
        f"groups), train {config.size} px, batch {config.batch_size}, {config.workers} workers"
    )


def run(data_dir: str | os.PathLike[str], config: ParquetBenchConfig | None = None) -> Report:
    config = config or ParquetBenchConfig()
    base = Path(data_dir)
    data = generate(base, config)
    bench_dir = base / "parquet-bench"
    work = bench_dir / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _check_same_rows(data, work / "check-cache")
    report = Report(name="parquet", params={**asdict(config), "data_dir": str(data_dir)})
    case = case_title(config)
    spec_base = {
        "config": asdict(config),
        "root": str(data.root),
        "local_dir": str(data.local_dir),
        "hf_cache": str(bench_dir / "hf-cache"),
    }
    peers_python = _peers_python(config)
    hf_skip = None
    if any(s in config.systems for s in HF_PEERS):
        hf_skip = _hf_skip_reason(peers_python, work)
    rows: list[Measurement] = []
    details: dict[str, Any] = {}
    for system in config.systems:
        if system == WARM:
            continue  # measured with the cold epochs, by the same process
        if system in HF_PEERS and hf_skip is not None:
            rows.append(_skipped(case, system, hf_skip))
            continue
        python = peers_python if system in HF_PEERS else sys.executable
        assert python is not None
        result = _run_child(python, {**spec_base, "system": system}, work, config.timeout_s)
        details[system] = result
        if "failed" in result:
            rows.append(_skipped(case, system, f"failed: {result['failed']}"))
            if system == COLD and WARM in config.systems:
                rows.append(_skipped(case, WARM, "its cold epochs failed"))
            continue
        if system == COLD:
            cold, warm = result["cold"], result["warm"]
            cold_extra = {
                "open_s": round(statistics.median(result["open_s"]), 3),
                "gets_per_epoch": statistics.median(e["gets"] for e in cold),
                "open_gets": statistics.median(e["open_gets"] for e in cold),
            }
            rows.append(_row(case, COLD, cold, data.nbytes, cold_extra))
            if WARM in config.systems:
                warm_extra = {"gets_per_epoch": statistics.median(e["gets"] for e in warm)}
                rows.append(_row(case, WARM, warm, data.nbytes, warm_extra))
            continue
        extra = {"prepare_s": round(result["prepare_s"], 3)} if "prepare_s" in result else {}
        rows.append(_row(case, system, result["warm"], data.nbytes, extra))
    best = best_peer(rows)
    if best is not None:
        rows = relate(rows, best.system)
    by_system = {r.system: r for r in rows}
    cold_row, warm_row = by_system.get(COLD), by_system.get(WARM)
    if cold_row is not None and warm_row is not None and cold_row.items and warm_row.items:
        vs_warm = round(cold_row.items_per_s / warm_row.items_per_s, 3)
        rows[rows.index(cold_row)] = replace(cold_row, extra={**cold_row.extra, "vs_warm": vs_warm})
    report.rows = rows
    report.params.update(
        details=details,
        nbytes=data.nbytes,
        peers_python=peers_python,
        best_peer=best.system if best else None,
        targets=targets(rows),
    )
    shutil.rmtree(work, ignore_errors=True)
    return report


def best_peer(rows: list[Measurement]) -> Measurement | None:
    """The peer row with the most images/s (None if no peer ran)."""
    measured = [r for r in rows if r.system in PEERS and r.items and r.seconds > 0]
    return max(measured, key=lambda r: r.items_per_s, default=None)


def targets(rows: list[Measurement]) -> list[str]:
    """Issue 17's targets, each as a line saying met or missed (or why not measured)."""
    by_system = {r.system: r for r in rows}
    best = best_peer(rows)
    cold, warm = by_system.get(COLD), by_system.get(WARM)
    lines = []
    if warm is None or not warm.items or best is None:
        lines.append(f"warm epoch >= {WARM_TARGET}x the best peer: not measured")
    else:
        ratio = warm.items_per_s / best.items_per_s
        verdict = "met" if ratio >= WARM_TARGET else "missed"
        lines.append(
            f"warm epoch >= {WARM_TARGET}x the best peer ({best.system}, "
            f"{best.items_per_s:,.0f} images/s): {warm.items_per_s:,.0f} images/s, "
            f"{ratio:.2f}x: {verdict}"
        )
    if cold is None or warm is None or not cold.items or not warm.items:
        lines.append(f"cold epoch >= {COLD_TARGET}x warm: not measured")
    else:
        ratio = cold.items_per_s / warm.items_per_s
        verdict = "met" if ratio >= COLD_TARGET else "missed"
        lines.append(
            f"cold epoch >= {COLD_TARGET}x warm: {cold.items_per_s:,.0f} vs "
            f"{warm.items_per_s:,.0f} images/s, {ratio:.2f}x: {verdict}"
        )
    return lines


def systems_named(names: Iterable[str]) -> Iterator[str]:
    """The systems whose names start with one of ``names`` (case-insensitive)."""
    for system in SYSTEMS:
        if any(system.lower().startswith(n.lower()) for n in names):
            yield system
