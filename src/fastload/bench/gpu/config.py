"""The GPU check's settings (:class:`GpuCheckConfig`), its sections and references, and the
:class:`Outcome` its sections add rows and failures to."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastload.bench.runner import Measurement
from fastload.resources import usable_cpus

SECTIONS = ("decode", "copy", "overlap", "ranks", "doctor")
DECODE_REFERENCE = "DALI's own mixed pipeline"
COPY_REFERENCE = "pinned tensor (torch)"
STEP_REFERENCE = "step alone (batch already on the GPU)"
CLASSES = 100
MAX_SIDE = 500  # the generated images' largest side: the hardware decoder's preallocation hint
# What fastload's DALIDecoder uses by default, given to DALI's own pipeline too.
MIXED_OPTIONS: dict[str, Any] = {
    "hw_decoder_load": 0.65,
    "device_memory_padding": 16 << 20,
    "host_memory_padding": 8 << 20,
    "preallocate_width_hint": MAX_SIDE,
    "preallocate_height_hint": MAX_SIDE,
}
WAIT_S = 120.0  # any single batch taking longer than this is a hang, not a slow run


class NoCudaError(RuntimeError):
    """There is no CUDA device to check."""


@dataclass(frozen=True, kw_only=True)
class GpuCheckConfig:
    files: int = 2048  # distinct JPEGs generated
    images: int = 4096  # images per decode epoch (the files, cycled)
    batch_size: int = 256
    size: int = 224
    repeats: int = 2
    threads: int = field(default_factory=usable_cpus)  # affinity and cgroup, not the host's
    copies: int = 8  # host->device copies of one batch per timed repeat
    ring_batches: int = 48
    steps: int = 30
    step_ms: float = 20.0
    rank_batches: int = 12  # timed batches per rank in the ranks section
    ranks: int = 0  # N in the ranks section; 0: a rank per GPU, at least 2
    doctor_phase_s: float = 1.5  # seconds per phase of each doctor run
    profile_steps: int = 8  # fed steps under torch.profiler per loader (0: no profile)
    sections: tuple[str, ...] = SECTIONS
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("files", "images", "batch_size", "size", "repeats", "threads", "copies"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0 (0: none), got {self.profile_steps}")
        if self.rank_batches < 1 or self.ranks < 0 or self.doctor_phase_s <= 0:
            raise ValueError(
                "rank_batches must be >= 1, ranks >= 0 (0: a rank per GPU) and "
                f"doctor_phase_s > 0, got {self.rank_batches}, {self.ranks}, {self.doctor_phase_s}"
            )
        for name in ("ring_batches", "steps"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.step_ms <= 0:
            raise ValueError(f"step_ms must be > 0, got {self.step_ms}")
        unknown = sorted(set(self.sections) - set(SECTIONS))
        if unknown or not self.sections:
            raise ValueError(f"sections must be among {', '.join(SECTIONS)}, got {self.sections}")
        if self.files < self.batch_size:
            raise ValueError(f"files ({self.files}) must be >= batch_size ({self.batch_size})")
        if not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'cuda' or 'cuda:k', got {self.device!r}")

    @classmethod
    def quick(cls, **overrides: Any) -> GpuCheckConfig:
        settings: dict[str, Any] = {
            "files": 256,
            "images": 512,
            "batch_size": 64,
            "repeats": 1,
            "copies": 2,
            "ring_batches": 8,
            "steps": 8,
            "step_ms": 10.0,
            "rank_batches": 2,
            "doctor_phase_s": 0.5,
            "profile_steps": 0,
        }
        return cls(**{**settings, **overrides})

    @property
    def batch_bytes(self) -> int:
        """Bytes of one float32 train batch: what the copy section moves."""
        return self.batch_size * 3 * self.size * self.size * 4


@dataclass
class Outcome:
    """What one run produced: rows, and what could not be measured (and why)."""

    rows: list[Measurement] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def attempt(self, name: str, measure: Callable[[], Measurement | None]) -> None:
        """Runs one measurement; an exception is recorded (and printed) instead of raised."""
        print(f"  {name} ...", file=sys.stderr, flush=True)
        try:
            row = measure()
        except Exception as e:
            self.failures[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            return
        if row is not None:
            self.rows.append(row)
