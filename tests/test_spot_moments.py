"""SIGTERM at chosen moments of a real training script (a subprocess on the loopback S3
remote): while the loader waits on a prefetch, while a staging process stages, while the
script writes its own checkpoint; and across a restart on another world size (real gloo
groups). Each time the state file is whole and valid, and the restart delivers every
sample of the epoch exactly once together with what was trained before the signal."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import process_group
import pytest
from conftest import Remote, open_remote

GROUP_TIMEOUT_S = 120

TRAIN = r"""
import hashlib, json, signal, sys, time
import fastload as fl
from fastload.staging import FetchConfig

cfg = json.loads(sys.argv[1])
stop = False

def own(signum, frame):  # the script's own handler: stop after this step
    global stop
    stop = True

def cue(what):
    with open(cfg["log"] + ".cue", "w") as f:
        f.write(what)

signal.signal(signal.SIGTERM, own)
ds = fl.open_dataset(cfg["url"], format="files", cache_dir=cfg["cache"],
                     storage_options=cfg["options"],
                     fetch=FetchConfig(staging_process=cfg["staging_process"]))
loader = fl.DataLoader(ds, batch_size=2, shuffle=True, seed=3, num_workers=2,
                       on_preempt=cfg["state"])
if cfg["resume"]:
    with open(cfg["resume"]) as f:
        loader.load_state_dict(json.load(f))
it = iter(loader)
with open(cfg["log"], "a") as log:
    while True:
        if cfg["moment"] in ("prefetch", "staging") and loader.step >= 2:
            cue("waiting")  # asks for a batch still being fetched (the remote is slow)
        batch = next(it, None)
        if batch is None or stop:
            break  # not trained on: the saved state has it still to come
        log.write("".join(hashlib.sha1(s).hexdigest() + "\n" for s in batch))
        log.flush()
        if cfg["moment"] == "checkpoint" and loader.step >= 3:
            # The script's own checkpoint, as slow as a model's: SIGTERM lands inside it.
            text = json.dumps({"loader": loader.state_dict(step=loader.step)})
            cue("checkpointing")
            with open(cfg["checkpoint"], "w") as f:
                for i in range(0, len(text), 64):
                    f.write(text[i : i + 64])
                    f.flush()
                    time.sleep(0.01)
"""


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _digests(files: dict[str, bytes]) -> Counter[str]:
    return Counter(hashlib.sha1(data).hexdigest() for data in files.values())


def _valid_state(path: Path) -> dict[str, Any]:
    """The state file parses whole, is a loader state, and no temporary is left beside it."""
    state: dict[str, Any] = json.loads(path.read_text())
    assert state["fastload_loader"] >= 1
    assert "plan" in state
    left = [p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")]
    assert not left, left
    return state


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[Remote]:
    with open_remote("s3", tmp_path, count=40) as remote:
        yield remote


def _run(
    remote: Remote, tmp_path: Path, name: str, moment: str, resume: Path | None, **more: Any
) -> subprocess.Popen[bytes]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cfg = {
        "url": remote.url,
        "options": remote.storage_options,
        "cache": str(tmp_path / "cache"),
        "state": str(tmp_path / "ckpt" / f"{name}.state.json"),
        "log": str(tmp_path / f"{name}.log"),
        "checkpoint": str(tmp_path / "ckpt" / f"{name}.own.json"),
        "resume": None if resume is None else str(resume),
        "moment": moment,
        "staging_process": False,
        **more,
    }
    return subprocess.Popen([sys.executable, str(script), json.dumps(cfg)], cwd=tmp_path)


def _wait_for(path: Path, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert proc.poll() is None, f"the training script ended before {what}"
        assert time.monotonic() < deadline, f"the training script never reached {what}"
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("moment", "staging_process", "latency_s"),
    [("prefetch", False, 0.3), ("staging", True, 0.3), ("checkpoint", False, 0.0)],
)
def test_sigterm_at_a_chosen_moment_then_a_restart_delivers_each_sample_once(
    s3: Remote, tmp_path: Path, moment: str, staging_process: bool, latency_s: float
) -> None:
    assert s3.server is not None
    s3.server.set_behavior(latency_s=latency_s)
    first = _run(s3, tmp_path, "first", moment, None, staging_process=staging_process)
    try:
        _wait_for(tmp_path / "first.log.cue", first, f"its {moment} moment")
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        first.wait()
    s3.server.set_behavior(latency_s=0.0)
    state = _valid_state(tmp_path / "ckpt" / "first.state.json")
    trained = _lines(tmp_path / "first.log")
    assert state["step"] * 2 >= len(trained) > 0
    if moment == "checkpoint":  # the script's own checkpoint went on and is whole
        own = json.loads((tmp_path / "ckpt" / "first.own.json").read_text())
        assert own["loader"]["plan"] == state["plan"]  # the step it was saving is the last
    second = _run(s3, tmp_path, "second", "none", tmp_path / "ckpt" / "first.state.json")
    assert second.wait(timeout=300) == 0
    delivered = Counter(trained + _lines(tmp_path / "second.log"))
    assert delivered == _digests(s3.files)  # every sample of the epoch exactly once


RANK = r"""
import argparse, hashlib, json, os, signal, time
from datetime import timedelta
import torch
import torch.distributed as dist
import fastload as fl

p = argparse.ArgumentParser()
for name in ("--out", "--cfg"):
    p.add_argument(name, required=True)
args = p.parse_args()
cfg = json.loads(args.cfg)
stop = False

def own(signum, frame):
    global stop
    stop = True

signal.signal(signal.SIGTERM, own)
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
try:
    ds = fl.open_dataset(cfg["url"], format="files", cache_dir=cfg["cache"],
                         storage_options=cfg["options"])
    loader = fl.DataLoader(ds, batch_size=3, shuffle=True, seed=5, num_workers=1,
                           on_preempt=os.path.join(cfg["dir"], f"rank{rank}.state.json"))
    if cfg["resume"]:
        with open(cfg["resume"]) as f:
            loader.load_state_dict(json.load(f))
    trained, done, stopped = [], loader.step, False
    for batch in loader:
        flag = torch.tensor([int(stop)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the ranks agree on the step to stop at
        if flag.item():
            stopped = True
            break
        time.sleep(cfg["step_s"])
        trained += [hashlib.sha1(s).hexdigest() for s in batch]
        done = loader.step
        with open(os.path.join(cfg["dir"], f"rank{rank}.log"), "a") as log:
            log.write(f"{done}\n")
    if stopped and rank == 0:  # the job's checkpoint: the loader at the step trained last
        with open(os.path.join(cfg["dir"], "checkpoint.json"), "w") as f:
            json.dump(loader.state_dict(step=done), f)
    with open(args.out, "w") as f:
        json.dump({"world": [rank, world], "trained": trained, "stopped": stopped}, f)
finally:
    dist.destroy_process_group()
"""


def _rank_cfg(remote: Remote, tmp_path: Path, where: Path, resume: Path | None) -> str:
    where.mkdir(parents=True, exist_ok=True)
    return json.dumps(
        {
            "url": remote.url,
            "options": remote.storage_options,
            "cache": str(tmp_path / "cache"),
            "dir": str(where),
            "resume": None if resume is None else str(resume),
            "step_s": 0.05,
        }
    )


def _sigterm_group(script: Path, world_size: int, out: Path, cfg: str) -> list[dict[str, Any]]:
    """Runs world_size ranks; after each has trained 2 steps, SIGTERMs them all (the node
    going away); returns each rank's result."""
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(process_group.free_port()),
        "WORLD_SIZE": str(world_size),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = []
    try:
        for rank in range(world_size):
            with open(out / f"rank{rank}.out", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(script),
                            "--out",
                            str(out / f"rank{rank}.json"),
                            "--cfg",
                            cfg,
                        ],
                        env={**env, "RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + GROUP_TIMEOUT_S
        while not all(len(_lines(out / f"rank{r}.log")) >= 2 for r in range(world_size)):
            assert all(p.poll() is None for p in procs), "a rank ended before its SIGTERM"
            assert time.monotonic() < deadline, "the ranks made no progress"
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for rank, p in enumerate(procs):
            code = p.wait(timeout=GROUP_TIMEOUT_S)
            assert code == 0, (out / f"rank{rank}.out").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("new_world", [3, 1])
def test_sigterm_on_two_gloo_ranks_then_another_world_size_sees_each_sample_once(
    tmp_path: Path, new_world: int
) -> None:
    with open_remote("s3", tmp_path, count=60) as s3:
        script = tmp_path / "rank.py"
        script.write_text(RANK)
        first = tmp_path / "first"
        ranks = _sigterm_group(script, 2, first, _rank_cfg(s3, tmp_path, first, None))
        assert all(r["stopped"] for r in ranks)
        for rank in range(2):  # each rank's SIGTERM state is whole and valid
            assert _valid_state(first / f"rank{rank}.state.json")["world_size"] == 2
        steps = [len(_lines(first / f"rank{r}.log")) for r in range(2)]
        assert steps[0] == steps[1]  # in lockstep: the same step trained last
        second = tmp_path / "second"
        cfg = _rank_cfg(s3, tmp_path, second, first / "checkpoint.json")
        rest = process_group.run_group(
            str(script), new_world, second, ["--cfg", cfg], timeout_s=GROUP_TIMEOUT_S
        )
        assert [r["world"] for r in rest] == [[r, new_world] for r in range(new_world)]
        delivered = Counter(d for r in ranks + rest for d in r["trained"])
        assert delivered == _digests(s3.files)  # the epoch's samples, each exactly once
