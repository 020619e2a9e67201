"""Spot-proof input: the loader's state written on SIGTERM (chained to the script's own
handler), the state of any recent step, a restart that lists nothing, and a replacement
node warmed from the saved state with exactly what the resumed epoch reads."""

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
from types import FrameType

import pytest
from conftest import Remote, open_remote

import fastload as fl
from fastload.warm import warm_from_state

TRAIN = r"""
import hashlib, json, signal, sys, time
import fastload as fl

url, options, cache, state_path, log_path, resume = sys.argv[1:7]
stop = False

def checkpoint(signum, frame):  # the script's own handler: checkpoint after this step
    global stop
    stop = True
    open(log_path + ".checkpointed", "w").close()

signal.signal(signal.SIGTERM, checkpoint)
ds = fl.open_dataset(url, format="files", cache_dir=cache, storage_options=json.loads(options))
loader = fl.DataLoader(ds, batch_size=2, shuffle=True, seed=3, num_workers=2, on_preempt=state_path)
if resume != "-":
    with open(resume) as f:
        loader.load_state_dict(json.load(f))
with open(log_path, "a") as log:
    for batch in loader:
        if stop:
            break  # not trained on: the saved state has it still to come
        time.sleep(0.05)  # the step
        log.write("".join(hashlib.sha1(s).hexdigest() + "\n" for s in batch))
        log.flush()
"""


def _digests(files: dict[str, bytes]) -> Counter[str]:
    return Counter(hashlib.sha1(data).hexdigest() for data in files.values())


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[Remote]:
    with open_remote("s3", tmp_path) as remote:
        yield remote


def _lists(remote: Remote) -> int:
    """LIST requests the server answered: GETs of the bucket, not of an object."""
    assert remote.server is not None
    requests = remote.server.stats().requests
    return sum(
        n
        for (method, path), n in requests.items()
        if method == "GET" and path in ("/data", "/data/")
    )


def _train(
    remote: Remote, tmp_path: Path, cache: Path, name: str, resume: str
) -> subprocess.Popen[bytes]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    args = [remote.url, json.dumps(remote.storage_options), str(cache)]
    args += [str(tmp_path / f"{name}.state.json"), str(tmp_path / f"{name}.log"), resume]
    return subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path)


def test_sigterm_writes_the_state_and_a_restart_delivers_every_sample_once(
    s3: Remote, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    first = _train(s3, tmp_path, cache, "first", "-")
    try:
        deadline = time.monotonic() + 120
        while len(_lines(tmp_path / "first.log")) < 6:  # a few steps trained
            assert first.poll() is None, "the training script ended before its SIGTERM"
            assert time.monotonic() < deadline, "the training script made no progress"
            time.sleep(0.02)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
    assert (tmp_path / "first.log.checkpointed").exists()  # the script's handler ran too
    state = json.loads((tmp_path / "first.state.json").read_text())
    trained = _lines(tmp_path / "first.log")
    assert state["step"] * 2 >= len(trained)  # delivered, at least what was trained
    lists = _lists(s3)
    second = _train(s3, tmp_path, cache, "second", str(tmp_path / "first.state.json"))
    assert second.wait(timeout=300) == 0
    assert _lists(s3) == lists  # the restart on the same node listed nothing
    delivered = Counter(trained + _lines(tmp_path / "second.log"))
    assert delivered == _digests(s3.files)  # every sample of the epoch exactly once


def _loader(remote: Remote, cache: Path, **options: object) -> fl.DataLoader:
    ds = fl.open_dataset(
        remote.url, format="files", cache_dir=str(cache), storage_options=remote.storage_options
    )
    return fl.DataLoader(ds, batch_size=3, shuffle=True, seed=1, **options)  # type: ignore[arg-type]


def _digest_batches(batches: list[list[bytes]]) -> list[list[str]]:
    return [[hashlib.sha1(s).hexdigest() for s in b] for b in batches]


def test_the_state_of_a_recent_step_resumes_right_after_it(tmp_path: Path) -> None:
    with open_remote("local", tmp_path) as remote:
        whole = _digest_batches(list(_loader(remote, tmp_path / "c")))
        loader = _loader(remote, tmp_path / "c", state_steps=4)
        it = iter(loader)
        for _ in range(6):
            next(it)
        assert loader.step == 6
        with pytest.raises(ValueError, match=r"last 4 steps .*steps 3\.\.6"):
            loader.state_dict(step=2)
        state = json.loads(json.dumps(loader.state_dict(step=4)))  # plain JSON
        resumed = _loader(remote, tmp_path / "c")
        resumed.load_state_dict(state)
        assert _digest_batches(list(resumed)) == whole[4:]
        assert resumed.step == len(whole)


def test_the_handler_writes_the_state_then_calls_the_scripts_own(tmp_path: Path) -> None:
    called: list[int] = []

    def own(signum: int, frame: FrameType | None) -> None:
        called.append(signum)

    previous = signal.signal(signal.SIGTERM, own)
    try:
        with open_remote("local", tmp_path) as remote:
            path = tmp_path / "ckpt" / "loader.json"
            loader = _loader(remote, tmp_path / "c", on_preempt=path)
            it = iter(loader)
            next(it)
            next(it)
            os.kill(os.getpid(), signal.SIGTERM)
            assert called == [signal.SIGTERM]
            state = json.loads(path.read_text())
            assert state["step"] == 2
            assert state["dataset"]["format"] == "files"
            assert (path.parent / state["dataset"]["manifest"]["file"]).exists()
            next(it)  # the loader goes on: nothing of it was stopped
            loader.close()
            assert signal.getsignal(signal.SIGTERM) == own  # put back on close
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_empty_node_warmed_from_the_state_lists_nothing_and_fetches_only_the_rest(
    s3: Remote, tmp_path: Path
) -> None:
    loader = _loader(s3, tmp_path / "node-a", on_preempt=tmp_path / "ckpt" / "state.json")
    it = iter(loader)
    seen = [hashlib.sha1(s).hexdigest() for _ in range(4) for s in next(it)]
    loader._preemption.write()  # type: ignore[union-attr]  # as SIGTERM would
    loader.close()
    lists, gets = _lists(s3), s3.total_gets()
    report = warm_from_state(
        tmp_path / "ckpt" / "state.json",
        cache_dir=str(tmp_path / "node-b"),
        storage_options=s3.storage_options,
    )
    assert report.ok
    assert _lists(s3) == lists  # the listing came from the snapshot beside the state
    rest = _digests(s3.files) - Counter(seen)
    staged = s3.total_gets() - gets
    assert staged == len(rest)  # the resumed epoch's objects, not those already trained on
    resumed = _loader(s3, tmp_path / "node-b")
    resumed.load_state_dict(json.loads((tmp_path / "ckpt" / "state.json").read_text()))
    delivered = [hashlib.sha1(s).hexdigest() for b in resumed for s in b]
    assert Counter(delivered) == rest
    assert s3.total_gets() - gets == staged  # every read from node b's cache
    assert _lists(s3) == lists


def test_warm_from_state_with_a_bound_stages_the_next_batches_only(
    s3: Remote, tmp_path: Path
) -> None:
    loader = _loader(s3, tmp_path / "node-a", on_preempt=tmp_path / "ckpt" / "state.json")
    it = iter(loader)
    for _ in range(2):
        next(it)
    loader._preemption.write()  # type: ignore[union-attr]  # as SIGTERM would
    loader.close()
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["batch_size"] == 3
    resumed = _loader(s3, tmp_path / "reference")
    resumed.load_state_dict(state)
    by_digest = {hashlib.sha1(data).hexdigest(): key for key, data in s3.files.items()}
    following = [by_digest[hashlib.sha1(s).hexdigest()] for b in resumed for s in b]
    before = {key: s3.gets(key) for key in s3.files}
    report = warm_from_state(
        tmp_path / "ckpt" / "state.json",
        cache_dir=str(tmp_path / "node-b"),
        storage_options=s3.storage_options,
        batches=2,
    )
    assert report.ok
    staged = {key for key in s3.files if s3.gets(key) > before[key]}
    assert staged == set(following[:6])  # the next two batches of three, nothing further
