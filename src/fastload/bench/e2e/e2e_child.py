"""One (system, layout) of the end-to-end benchmark, measured in this process.

``python -m fastload.bench.e2e.e2e_child run SPEC.json RESULT.json`` opens one system
(:mod:`fastload.bench.peers.e2e_peers`) on one layout of a dataset behind an S3 endpoint, runs
its epochs as a training loop would (a simulated step after every batch: a sleep, or a
busy Python loop that holds the GIL, ``runner.TrainingStep``, of the work the parent
measured), then, where the system offers it, saves its position mid-epoch and measures how
long a fresh loader takes to deliver the next batch. The parent
(:mod:`fastload.bench.e2e.e2e_bench`) counts the bytes its server sends at each mark this
prints and samples memory; this process reports times, samples, CPU seconds and its peak
RSS.

``python -m fastload.bench.e2e.e2e_child convert mds|litdata FOLDER OUT WORKERS`` runs a
peer's own conversion of an ImageFolder (mosaicml-streaming's ``MDSWriter``, litdata's
``optimize``) and prints the seconds it took.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib
import json
import math
import os
import resource
import shutil
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastload.bench.peers.e2e_peers import (
    IMPORTS,
    LABELS_IN_ORDER,
    LAYOUT_IMPORTS,
    SAMPLE_IDS,
    SYSTEMS,
    Delivered,
    Loader,
    Opener,
    RunSpec,
)
from fastload.bench.runner import TrainingStep

MARK = "@@fastload-e2e-mark "  # a line the parent snapshots the server's counters on
MAX_EPOCHS = 50  # min_warm_s adds warm epochs up to this many in all


def mark(name: str) -> None:
    print(MARK + name, flush=True)


def delivered(loader: Loader) -> str:
    """What a loader's batches identify their samples by (``e2e_peers.SAMPLE_IDS`` ...)."""
    return str(getattr(loader, "delivers", SAMPLE_IDS))


class _Tally:
    """What a run of batches delivered: ``samples``, and ``ids``, the samples' identities in
    order (None once a batch gave only its count)."""

    def __init__(self) -> None:
        self.samples = 0
        self.ids: list[int] | None = []

    def add(self, batch: Delivered) -> None:
        if isinstance(batch, int):
            self.samples += batch
            self.ids = None
            return
        self.samples += len(batch)
        if self.ids is not None:
            self.ids.extend(batch)


def _epoch(
    loader: Loader,
    epoch: int | None,
    step: TrainingStep,
    start: float,
    budget_s: float | None,
) -> dict[str, Any]:
    """Iterate as training does: wait for a batch, then the simulated ``step``. An epoch
    past ``budget_s`` (None: no budget) stops after its current batch. ``"ids"`` holds
    what the batches identified their samples by (None where they gave counts);
    ``"step_s"`` what the steps took, ``"step_waited_s"`` the part of it in which they
    could not run (the loader had the GIL or the core)."""
    batches = loader.batches(epoch)
    stepped, waited = step.spent_s, step.waited_s
    tally = _Tally()
    count = 0
    wait_s = 0.0
    first: float | None = None
    partial = False
    try:
        while True:
            asked = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            now = time.perf_counter()
            wait_s += now - asked
            first = now - start if first is None else first
            tally.add(batch)
            count += 1
            step()
            if budget_s is not None and time.perf_counter() - start > budget_s:
                partial = True
                break
        seconds = time.perf_counter() - start  # stopping a cut epoch's loader is not counted
    finally:
        _close(batches)
    return {
        "seconds": seconds,
        "samples": tally.samples,
        "batches": count,
        "wait_s": wait_s,
        "step_s": step.spent_s - stepped,
        "step_waited_s": step.waited_s - waited,
        "first_batch_s": first,
        "partial": partial,
        "ids": tally.ids,
    }


def _resume(
    open_loader: Opener, spec: RunSpec, loader: Loader, reference: dict[str, Any] | None
) -> dict[str, Any]:
    """The last measured epoch again: half of it (or what ``epoch_budget_s`` allows), the
    state, a fresh loader from it; the time to its first batch, and whether what the two
    delivered together is exactly one uninterrupted epoch (``reference``, that epoch as
    measured): the same multiset of sample ids, or of labels (in order where the loader's
    epochs are a pure function of the seed and the epoch number), or, where the batches
    identify nothing, the same count. Checked where the rest fits the budget too."""
    if loader.no_resume:
        return {"resume_s": None, "resume_note": f"resume n/a: {loader.no_resume}"}
    batches = loader.batches(spec.epochs - 1)
    before = _Tally()
    half = math.ceil(loader.samples / spec.batch_size) // 2
    start = time.perf_counter()
    for _ in range(half):
        before.add(next(batches))
        if time.perf_counter() - start > spec.epoch_budget_s:
            break
    state = json.loads(json.dumps(loader.state_dict(), default=_jsonable))  # as checkpointed
    _close(batches)
    loader.close()
    start = time.perf_counter()
    fresh = open_loader(spec, state)
    rest = fresh.batches(None)
    after = _Tally()
    after.add(next(rest))
    resume_s = time.perf_counter() - start
    complete = True
    for batch in rest:
        after.add(batch)
        if time.perf_counter() - start > spec.epoch_budget_s:
            complete = False
            break
    _close(rest)
    fresh.close()
    result: dict[str, Any] = {
        "resume_s": resume_s,
        "resume_consumed": before.samples,
        "resume_remaining": after.samples,
    }
    result.update(resume_check(delivered(loader), before.ids, after.ids, reference))
    if "resume_exact" not in result:  # counts are all there is to compare
        result["resume_exact"] = before.samples + after.samples == loader.samples
    if not complete:
        result["resume_exact"] = None
    return result


def resume_check(
    kind: str,
    before: list[int] | None,
    after: list[int] | None,
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    """``resume_exact``: whether ``before`` + ``after`` (what a loader delivered up to its
    saved state, and what a fresh one delivered from it) is exactly the uninterrupted
    ``reference`` epoch (``kind``: what the lists hold); ``resume_check`` says what was
    compared, ``resume_replayed`` and ``resume_dropped`` count the differences (samples,
    or labels). Without identities (or a reference) only ``resume_check`` is set."""
    ref = None if reference is None or reference.get("partial") else reference.get("ids")
    if before is None or after is None:
        return {"resume_check": "sample count only: its batches identify no samples"}
    if ref is None:
        return {"resume_check": "sample count only: no uninterrupted epoch to compare with"}
    delivered_ids = before + after
    extra = Counter(delivered_ids) - Counter(ref)
    missing = Counter(ref) - Counter(delivered_ids)
    exact = not extra and not missing
    if kind == LABELS_IN_ORDER:
        exact = delivered_ids == ref
    return {
        "resume_check": kind,
        "resume_exact": exact,
        "resume_replayed": sum(extra.values()),
        "resume_dropped": sum(missing.values()),
    }


def _close(batches: Iterator[Delivered]) -> None:
    close = getattr(batches, "close", None)  # a generator: stops its loader's iteration
    if close is not None:
        close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, torch.Tensor):
        return value.tolist()
    raise TypeError(f"cannot save {type(value).__name__} in a checkpoint")


def _cpu_s() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # worker processes, once reaped
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def peak_rss_bytes() -> int | None:
    """This process's peak RSS: ``VmHWM``, which starts afresh at exec. (``ru_maxrss``
    does not: Linux carries it over from the parent across fork and exec, and the parent
    here holds the whole dataset in its S3 server.)"""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def measure(spec: RunSpec) -> dict[str, Any]:
    """Every figure of one (system, layout) run; see the module docstring."""
    open_loader = SYSTEMS[spec.system]
    for module in (*IMPORTS[spec.system], *LAYOUT_IMPORTS.get(spec.layout, ())):
        with contextlib.suppress(ImportError):  # the system's own import says what is missing
            importlib.import_module(module)
    # A busy step's work as the parent measured it, and its rate alone in this interpreter
    # (for the JSON), measured before any loader runs.
    step = TrainingStep(spec.step, spec.step_s, iterations=spec.step_iterations)
    cpu_self, cpu_kids = _cpu_s()
    start = time.perf_counter()
    loader = open_loader(spec, None)
    open_s = time.perf_counter() - start
    epochs = [_epoch(loader, 0, step, start, spec.cold_budget_s)]
    epochs[0]["wait_s"] += open_s  # the training loop waits for the set-up too
    mark("epoch 0")
    e = 1
    # The configured epochs, then more warm ones (the same samples again) until the warm
    # epochs have run min_warm_s together: a short dataset's epoch of a second says little.
    while e < spec.epochs or (
        sum(one["seconds"] for one in epochs[1:]) < spec.min_warm_s and e < MAX_EPOCHS
    ):
        epochs.append(_epoch(loader, e, step, time.perf_counter(), spec.epoch_budget_s))
        mark(f"epoch {e}")
        e += 1
    result: dict[str, Any] = {
        "open_s": open_s,
        "epochs": epochs,
        "samples": loader.samples,
        "step": step.record(),
    }
    if spec.resume:
        result.update(_resume(open_loader, spec, loader, dict(epochs[spec.epochs - 1])))
        mark("resume")
    else:
        result.update(resume_s=None, resume_note="not measured")
    result["delivers"] = delivered(loader)
    for one in epochs:  # the JSON keeps how many distinct identities, not the lists
        ids = one.pop("ids")
        one["distinct"] = None if ids is None else len(set(ids))
    loader.close()
    gc.collect()
    end_self, end_kids = _cpu_s()
    result.update(
        extra=loader.extra,
        loader_stats=getattr(loader, "stats", None),
        cpu_s=(end_self - cpu_self) + (end_kids - cpu_kids),
        peak_rss_bytes=peak_rss_bytes(),
    )
    return result


# --- conversions (run in the peers' environment) --------------------------------------------


def _folder_sample(path: str) -> dict[str, Any]:
    """One ImageFolder file as a peer's record: the JPEG bytes and the class index."""
    with open(path, "rb") as f:
        data = f.read()
    return {"jpg": data, "cls": int(Path(path).parent.name.rsplit("_", 1)[-1])}


def convert(kind: str, folder: str, out: str, workers: int) -> float:
    """A peer's own conversion of the generated ImageFolder; returns its seconds."""
    files = sorted(glob.glob(os.path.join(folder, "*", "*.jpg")))
    shutil.rmtree(out, ignore_errors=True)
    if kind == "mds":
        streaming: Any = importlib.import_module("streaming")
        start = time.perf_counter()
        with streaming.MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}) as writer:
            for path in files:
                writer.write(_folder_sample(path))
        return time.perf_counter() - start
    if kind == "litdata":
        litdata: Any = importlib.import_module("litdata")
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # its progress lines
            litdata.optimize(
                fn=_folder_sample,
                inputs=files,
                output_dir=out,
                chunk_bytes="64MB",
                num_workers=workers,
                mode="overwrite",
            )
        return time.perf_counter() - start
    raise ValueError(f"conversion must be 'mds' or 'litdata', got {kind!r}")


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "run":
        spec = RunSpec(**json.loads(Path(argv[1]).read_text()))
        result = measure(spec)
        Path(argv[2]).write_text(json.dumps(result, default=_jsonable))
        return 0
    if len(argv) == 5 and argv[0] == "convert":
        print(json.dumps({"seconds": convert(argv[1], argv[2], argv[3], int(argv[4]))}))
        return 0
    print(
        "usage: python -m fastload.bench.e2e.e2e_child run SPEC RESULT | "
        "convert mds|litdata FOLDER OUT WORKERS",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
