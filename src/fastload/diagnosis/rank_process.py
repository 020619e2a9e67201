"""One rank's loader process of ``fastload doctor --local-world-size N`` (see
:mod:`fastload.diagnosis.node_ranks`): ``python -m fastload.diagnosis.rank_process``.

Reads its job from stdin (a length line, then the pickled job), builds the rank's loader,
prints ``ready``, waits for ``go``, runs one train phase and prints the phase as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from dataclasses import asdict
from typing import Any


def build_step(spec: tuple[Any, ...]) -> Any:
    """The step from its spec: ("sleep" | "gil", seconds), ("model", name, batch_size,
    device, image_size) or ("callable", fn)."""
    from fastload.diagnosis.steps import Step, model_step

    kind = spec[0]
    if kind in ("sleep", "gil"):
        return Step(kind, float(spec[1]))
    if kind == "model":
        _, name, batch_size, device, image_size = spec
        return model_step(name, batch_size=batch_size, device=device, image_size=image_size)
    return Step("callable", fn=spec[1])


def main() -> int:
    # (Importing fastload, before this module ran, tied this process to the doctor's life:
    # the doctor puts staging.lifetime's variable in its environment.)
    stdin = sys.stdin.buffer
    size = int(stdin.readline())
    job = pickle.loads(stdin.read(size))
    os.environ.update(
        RANK=str(job.rank),
        WORLD_SIZE=str(job.world_size),
        LOCAL_RANK=str(job.local_rank),
        LOCAL_WORLD_SIZE=str(job.local_world_size),
    )
    from fastload.diagnosis import measure
    from fastload.loader import DataLoader

    step = build_step(job.step)
    loader = DataLoader(job.dataset, sampler=job.indices, **job.settings)
    print("ready", flush=True)
    if stdin.readline().strip() != b"go":
        return 1  # the parent gave up on the ranks
    start = time.time()
    phase, _ = measure.run_loader(
        f"rank {job.rank}",
        f"rank {job.rank} of the node's {job.local_world_size}: loader + step from a warm "
        "cache, beside the node's other ranks",
        loader,
        step=step,
        budget_s=job.phase_s,
        progress=measure.PhaseProgress(False),
    )
    print(json.dumps({"phase": asdict(phase), "start": start, "end": time.time()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
