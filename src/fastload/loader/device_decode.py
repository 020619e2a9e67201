"""How a loader's decoder feeds its device path: which decoder writes batches on the host
straight into the ring's slots, and what DALI's backend is told of the loader's threads.

A CPU decoder bound for CUDA used to transform on the GPU, sample by sample (a pageable
copy and small kernels per image), or to write into its own buffers that the ring then
packed into a pinned slot (the pack bound the ring at 0.37x a pinned copy on an H200). With
a preset the batch's shape is known before decoding, so the decoder writes it into a lent
slot (:meth:`DeviceRing.empty <fastload.loader.ring.DeviceRing.empty>`) on the host and the
ring copies that slot as it is.
"""

from __future__ import annotations

from typing import Any

import torch

from fastload.decode import choose_backend
from fastload.decode.params import EvalPreset, TrainPreset

__all__ = ["dali_options", "decodes_into_slots"]


def decodes_into_slots(
    decode: str, transform: Any, device: torch.device | None, *, through_ring: bool
) -> bool:
    """Whether a loader's CPU decoder writes its batches on the host straight into the ring's
    slots (pinned on CUDA: one copy per batch, no pack) rather than into its own buffers, or
    transforming on the GPU: a preset (a batch tensor of known shape) on fastload's CPU
    backend, for batches that go through the ring."""
    if device is None or not through_ring or not isinstance(transform, TrainPreset | EvalPreset):
        return False
    backend, _ = choose_backend(decode, str(device))  # type: ignore[arg-type]
    return backend == "cpu"


def dali_options(decode: str, target: str, thread_nice: int) -> dict[str, Any]:
    """What a loader passes DALI's backend beyond the common settings: its threads' nice
    (DALI builds its threads on the decoder's driver thread, not on the loader's threads)."""
    backend, _ = choose_backend(decode, target)  # type: ignore[arg-type]
    return {"thread_nice": thread_nice} if backend == "dali" else {}
