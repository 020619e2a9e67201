"""A Spot preemption, end to end: a training script in a subprocess over a loopback S3
remote, SIGTERM at a random step, then a restart on the same node and on an empty one.

Per case (a dataset of real files with unique contents, or the synthetic 1.28 M-object
ImageFolder of ``fastload.testing.synthetic``):

- ``SIGTERM → state written``: from the signal to the state file's mtime
  (``fl.DataLoader(on_preempt=...)``; the script's own handler runs after it);
- ``restart, warm node``: a new process on the same cache, from its spawn to its first
  batch, with the LIST and GET requests it sent and where the time went (the interpreter,
  the script's ``import torch``, ``import fastload``, the open, the resume, the batch);
- ``restart, empty node``: ``fastload warm --from-state --batches 8`` into an empty cache
  (in this process), then the job, from the warm's start to the job's first batch, with
  their LISTs and GETs;
- whether every sample was delivered exactly once across the restart (where samples are
  unique; the synthetic objects repeat eight payloads, so it is not asked there).

Every training script must exit 0 with nothing like "terminate called" on its stderr.

Targets (issue 34): state ≤ 100 ms after SIGTERM; warm node first batch ≤ 2 s at 1.28 M
samples with zero LISTs and zero GETs for cached objects; empty node first batch ≤ 5 s
after its warm starts.

Command (3,000 files, then 1.28 M synthetic objects; ``--quick``: 600, then 100,000)::

    .venv/bin/python benchmarks/benchmark_preemption.py --out fastload-bench
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.bench.runner import Measurement, Report

# A training script gets this long to end (the 3,000 files' restart reads the rest of the epoch).
_CHILD_TIMEOUT_S = 3600.0

# The training script: argv[1] is its settings as JSON. It logs one JSON line per event.
TRAIN = r"""
import json, sys, time
started = time.time()
import hashlib, signal
import torch  # a training script's own import, timed apart from fastload's
imported_torch = time.time()
import fastload as fl
imported = time.time()

c = json.loads(sys.argv[1])
stop = False

def checkpoint(signum, frame):
    global stop
    stop = True

signal.signal(signal.SIGTERM, checkpoint)
log = open(c["log"], "a")
def note(**event):
    log.write(json.dumps(event) + "\n")
    log.flush()

note(event="start", t=started, spawned=c["spawned"], torch=imported_torch, fastload=imported)
ds = fl.open_dataset(c["url"], format="imagefolder", cache_dir=c["cache"],
                     storage_options=c["storage_options"])
opened = time.time()
loader = fl.DataLoader(ds, batch_size=c["batch_size"], shuffle=True, seed=0, num_workers=2,
                       on_preempt=c["state"])
if c["resume"]:
    with open(c["resume"]) as f:
        loader.load_state_dict(json.load(f))
note(event="resumed", opened=opened, t=time.time())
for step, (images, labels) in enumerate(loader):
    if stop:
        break
    if step == 0:
        note(event="first_batch", t=time.time())
    time.sleep(c["step_s"])
    digests = [hashlib.sha1(i).hexdigest() for i in images] if c["digests"] else []
    note(event="step", samples=len(labels), digests=digests)
    if step + 1 == c["max_steps"]:
        break
"""


@dataclass(frozen=True, kw_only=True)
class PreemptionBenchConfig:
    files: int = 3_000  # real files of unique bytes (exactly-once is checked on these)
    file_bytes: int = 16_384
    synthetic_objects: int = 1_281_167  # ImageNet's train set, computed by the server
    classes: int = 1_000
    batch_size: int = 64
    step_s: float = 0.02
    latency_s: float = 0.005
    seed: int = 0  # draws the step SIGTERM arrives at
    # Batches per rank the empty node's `warm --from-state` stages before the job starts: its
    # first batch then measures the restart, not the download of the rest of the epoch.
    warm_batches: int = 8

    @classmethod
    def quick(cls) -> PreemptionBenchConfig:
        return cls(files=600, synthetic_objects=100_000, classes=100)


def run(data_dir: str | os.PathLike[str], config: PreemptionBenchConfig | None = None) -> Report:
    from fastload.testing import RemoteBehavior, S3FolderProcess
    from fastload.testing.synthetic import ImageFolderLayout, random_payloads

    config = config or PreemptionBenchConfig()
    root = Path(data_dir)
    served = root / "remote"
    _write_files(served / "files", config)
    synthetic = ImageFolderLayout(
        objects=config.synthetic_objects,
        classes=config.classes,
        payloads=random_payloads(8, config.file_bytes),
    )
    report = Report("preemption", params={"config": config.__dict__})
    rng = random.Random(config.seed)
    behavior = RemoteBehavior(latency_s=config.latency_s)
    with S3FolderProcess(served, synthetic={"synthetic": synthetic}, behavior=behavior) as server:
        for case, url, unique in (
            (f"{config.files:,} files", "s3://files/train", True),
            (f"{config.synthetic_objects:,} synthetic", "s3://synthetic", False),
        ):
            work = root / case.replace(",", "").replace(" ", "-")
            report.rows += _case(server, case, url, unique, work, config, rng)
    return report


def _write_files(folder: Path, config: PreemptionBenchConfig) -> None:
    stamp = folder / f".written-{config.files}-{config.file_bytes}"
    if stamp.exists():
        return
    for i in range(config.files):
        path = folder / "train" / f"c{i % 10:02d}" / f"{i:06d}.jpg"  # bytes, not decoded
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(hashlib.sha256(str(i).encode()).digest() * (config.file_bytes // 32))
    stamp.touch()


def _case(
    server: Any,
    case: str,
    url: str,
    unique: bool,
    work: Path,
    config: PreemptionBenchConfig,
    rng: random.Random,
) -> list[Measurement]:
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*"):
        if old.is_file():
            old.unlink()
    settings = {
        "url": url,
        "storage_options": server.storage_options,
        "batch_size": config.batch_size,
        "step_s": config.step_s,
        "digests": unique,
        "max_steps": 0,  # 0: until SIGTERM, or the end of the epoch
    }
    # A restart reads the rest of the epoch where samples are checked, else a few batches.
    restart = {**settings, "max_steps": 0 if unique else 5}
    stop_at = rng.randint(5, 20)
    first = _start(work, {**settings, "cache": str(work / "node-a"), "resume": None}, "first")
    while _count(work / "first.log", "step") < stop_at:
        if first.poll() is not None:
            raise RuntimeError(f"{case}: the training script ended before step {stop_at}")
        time.sleep(0.005)
    state = work / "first.state.json"
    signalled = time.time()
    first.send_signal(signal.SIGTERM)
    _wait_clean(first, work, "first", case)
    to_state = state.stat().st_mtime - signalled
    rows = [_row(case, "SIGTERM -> state written", to_state, {"step": stop_at})]

    before = server.stats()
    second = _start(
        work, {**restart, "cache": str(work / "node-a"), "resume": str(state)}, "second"
    )
    _wait_clean(second, work, "second", case)
    rows.append(_restart_row(case, "restart, warm node", work / "second.log", 0.0, server, before))

    from fastload.warm import warm_from_state

    before = server.stats()
    began = time.time()
    warm_from_state(
        state,
        cache_dir=str(work / "node-b"),
        storage_options=server.storage_options,
        batches=config.warm_batches,
        progress=False,
    )
    warmed = time.time()
    third = _start(work, {**restart, "cache": str(work / "node-b"), "resume": str(state)}, "third")
    _wait_clean(third, work, "third", case)
    rows.append(
        _restart_row(
            case, "restart, empty node (--from-state)", work / "third.log", began, server, before
        )
    )
    rows[-1].extra["warm s"] = warmed - began
    if unique:
        delivered = Counter(_digests(work / "first.log") + _digests(work / "second.log"))
        once = delivered == Counter(_digests_of_files(work.parent / "remote" / "files"))
        rows[1].extra["exactly once"] = float(once)
    return rows


def _start(work: Path, settings: dict[str, Any], name: str) -> subprocess.Popen[bytes]:
    settings = {
        **settings,
        "state": str(work / f"{name}.state.json"),
        "log": str(work / f"{name}.log"),
        "spawned": time.time(),
    }
    # As where fastload is installed: its bytecode cached, not compiled again at every start
    # (~0.2 s of ~100 modules) because this environment says not to write it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with open(work / f"{name}.err", "wb") as stderr:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-c", TRAIN, json.dumps(settings)], stderr=stderr, env=env
        )


def _wait_clean(process: subprocess.Popen[bytes], work: Path, name: str, case: str) -> None:
    """Waits for a training script, which must exit 0 with no C++ abort on its stderr
    ("terminate called": a native thread ended mid-call at exit, its staging process's too)."""
    try:
        code = process.wait(timeout=_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise RuntimeError(
            f"{case}: the {name} training script was still running after "
            f"{_CHILD_TIMEOUT_S:.0f} s; killed it (its stderr: {work / f'{name}.err'})"
        ) from None
    stderr = (work / f"{name}.err").read_text(errors="replace")
    if code != 0 or "terminate called" in stderr:
        raise RuntimeError(
            f"{case}: the {name} training script ended with exit code {code}; its stderr "
            f"ends: {stderr[-2000:]}"
        )


def _events(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def _count(log: Path, event: str) -> int:
    return sum(e["event"] == event for e in _events(log))


def _digests(log: Path) -> list[str]:
    return [d for e in _events(log) if e["event"] == "step" for d in e["digests"]]


def _digests_of_files(folder: Path) -> list[str]:
    return [hashlib.sha1(p.read_bytes()).hexdigest() for p in folder.rglob("*.jpg")]


def _row(case: str, system: str, seconds: float, extra: dict[str, float]) -> Measurement:
    return Measurement(
        benchmark="preemption",
        case=case,
        system=system,
        seconds=seconds,
        repeats=[seconds],
        extra=extra,
    )


def _restart_row(
    case: str, system: str, log: Path, began: float, server: Any, before: Any
) -> Measurement:
    events = {e["event"]: e for e in _events(log) if e["event"] != "step"}
    start, resumed = events["start"], events["resumed"]
    first = events["first_batch"]["t"]
    # Where the restart's time went, in order: the new interpreter, the script's own
    # `import torch`, `import fastload`, opening the dataset (the cached listing), the
    # loader made and its state loaded, then its first batch.
    parts = {
        "interpreter s": start["t"] - start["spawned"],
        "import torch s": start["torch"] - start["t"],
        "import fastload s": start["fastload"] - start["torch"],
        "open s": resumed["opened"] - start["fastload"],
        "resume s": resumed["t"] - resumed["opened"],
        "first batch s": first - resumed["t"],
    }
    after = server.stats()
    lists = gets = 0
    for (method, path), n in after.requests.items():
        if method != "GET":
            continue
        n -= before.requests.get((method, path), 0)
        if path.count("/") <= 1 or path.endswith("/"):
            lists += n  # a bucket's listing
        else:
            gets += n
    seconds = first - (began or start["spawned"])
    return _row(case, system, seconds, {"LISTs": lists, "GETs": gets, **parts})
