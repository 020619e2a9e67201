"""The training step ``fastload doctor`` runs after each batch, and the step alone (the ceiling).

- ``sleep``: ``--step-ms`` as a sleep, the GIL free: a step that waits on its GPU kernels.
- ``gil``: ``--step-ms --step-holds-gil``: a busy Python loop of that length, as a real
  step's dispatch, optimizer and logging hold the GIL and compete with loader threads.
- ``model``: ``--model NAME``: a real forward/backward/optimizer step on the device.
- ``callable``: ``fl.doctor(loader, step=fn)``: the user's own step, called with the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

_CHUNK = 2_000  # busy-loop iterations between looks at the clock (~50 us)


def busy_loop(iterations: int) -> int:
    """Small pure-Python arithmetic, ``iterations`` times: it holds the GIL throughout, as a
    real training step's kernel dispatch, optimizer and logging do, giving it up only when
    the interpreter's switch interval forces a hand-off to a thread that asks for it.
    (The bench's GIL-holding step runs the same loop, so the two steps load a core alike.)"""
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


class Step:
    """One training step, timed: ``spent_s`` is its wall time, ``ran_s`` the part of it this
    thread ran (CPU time, for steps that hold the GIL: the rest it waited for a core or the
    GIL, which the loader's threads held)."""

    def __init__(
        self,
        kind: str,
        seconds: float = 0.0,
        *,
        fn: Callable[[Any], object] | None = None,
        description: str | None = None,
    ) -> None:
        if kind not in ("sleep", "gil", "model", "callable"):
            raise ValueError(f"unknown step kind {kind!r}")
        if seconds < 0:
            raise ValueError(f"the step's time must be >= 0 ms, got {seconds * 1000:g}")
        self.kind, self.seconds, self.fn = kind, seconds, fn
        self.description = description or self._describe()
        self.reset()

    def _describe(self) -> str:
        ms = f"{self.seconds * 1000:g} ms"
        if self.kind == "sleep":
            return f"{ms} sleep (the GIL free, as a step waiting on its GPU)"
        if self.kind == "gil":
            return f"{ms} busy Python loop (holds the GIL, as a real step's Python does)"
        return "the given step"

    def reset(self) -> None:
        self.spent_s = 0.0
        self.ran_s = 0.0
        self.calls = 0

    def __call__(self, batch: Any) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        if self.kind == "sleep":
            time.sleep(self.seconds)
        elif self.kind == "gil":
            # Python work until this thread has run for the step's time: the same work
            # whatever else runs, and its wall time shows what the loader took from it.
            while time.thread_time() - cpu < self.seconds:
                busy_loop(_CHUNK)
        else:
            assert self.fn is not None
            self.fn(batch)
        wall = time.perf_counter() - start
        self.spent_s += wall
        self.ran_s += time.thread_time() - cpu if self.kind == "gil" else wall
        self.calls += 1

    @property
    def mean_s(self) -> float:
        return self.spent_s / self.calls if self.calls else 0.0

    @property
    def holds_gil(self) -> bool:
        return self.kind == "gil"

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ms": round(self.seconds * 1000, 3) if self.kind in ("sleep", "gil") else None,
            "holds_gil": self.holds_gil,
            "description": self.description,
        }


def model_step(name: str, *, batch_size: int, device: str, image_size: int) -> Step:
    """A real model's training step on ``device`` (fastload.diagnosis.models)."""
    from fastload.diagnosis.models import ModelStep

    run = ModelStep(name, batch_size=batch_size, device=device, image_size=image_size)
    return Step("model", fn=run, description=run.describe())
