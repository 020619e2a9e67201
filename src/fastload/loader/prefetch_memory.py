"""How many batches the loader holds ahead of the training step where the container caps its
memory: the prefetched batches (and the ring slots that carry them to the device) take at
most a share of the cgroup's ``memory.max``, as the holding area does.

Why: the default depth is ``prefetch_factor x num_workers`` batches, whatever they weigh. In
a pod of 8 GiB with 8 threads and batches of 256 train-preset images (3 x 224 x 224 float32,
154 MB each) that is 16 batches plus the one the step holds: 2.6 GB, a third of the pod,
before the model has any. Without a limit nothing changes.

A batch's bytes are known exactly before any is loaded where a preset fixes the output
(float32, 3 x size x size a sample); otherwise the estimate is the encoded bytes (a lower
bound) until a pass's first batch says what a batch really holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fastload.decode.params import EvalPreset, TrainPreset
from fastload.resources import resources

# Of the cgroup's memory limit, what the batches loaded ahead may hold (the holding area's is
# another 1/8; the in-memory caches take 1/16 each).
PREFETCH_MEMORY_FRACTION = 1 / 8
# How deep into a nested batch its bytes are counted (a batch is a few levels at most).
_MAX_NESTING = 8


def estimated_batch_bytes(transform: Any, batch_size: int, encoded_per_sample: int) -> int:
    """A batch's bytes before one was loaded: a preset's output exactly, else the samples'
    encoded bytes (raw samples as they are; images decoded at their own sizes weigh more,
    which the first loaded batch then tells)."""
    if isinstance(transform, TrainPreset | EvalPreset):
        return batch_size * 3 * transform.size * transform.size * 4
    return batch_size * encoded_per_sample


def batch_nbytes(batch: Any, depth: int = 0) -> int:
    """The host bytes a loaded batch holds: its CPU tensors, arrays and byte strings, nested
    in tuples, lists and dicts (a list of samples counts each). A batch already on the GPU
    holds none (its pinned ring slot is the preset's estimate)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size() if batch.device.type == "cpu" else 0
    if isinstance(batch, np.ndarray):
        return int(batch.nbytes)
    if isinstance(batch, bytes | bytearray | memoryview):
        return len(batch)
    if depth >= _MAX_NESTING:
        return 0
    if isinstance(batch, Mapping):
        return sum(batch_nbytes(v, depth + 1) for v in batch.values())
    if isinstance(batch, list | tuple):
        return sum(batch_nbytes(v, depth + 1) for v in batch)
    return 0


def memory_share_bytes() -> int | None:
    """What the batches loaded ahead may hold in all; None where no memory limit is set."""
    limit = resources().memory_limit_bytes
    return None if limit is None else int(limit * PREFETCH_MEMORY_FRACTION)


def depth_within(depth: int, batch_bytes: int, share_bytes: int | None) -> int:
    """The rule: ``depth`` batches ahead, lowered (to 1 at least) so that they and the batch
    the step holds fit ``share_bytes``; ``depth`` itself where there is no share. The default
    depth and autotune's deepest prefetch (``fastload.loader.autotune``) both follow it."""
    if share_bytes is None or batch_bytes <= 0:
        return depth
    return max(1, min(depth, share_bytes // batch_bytes - 1))


def bounded_depth(depth: int, batch_bytes: int) -> int:
    """``depth`` within the container's memory share (:func:`depth_within`)."""
    return depth_within(depth, batch_bytes, memory_share_bytes())


__all__ = [
    "PREFETCH_MEMORY_FRACTION",
    "batch_nbytes",
    "bounded_depth",
    "depth_within",
    "estimated_batch_bytes",
    "memory_share_bytes",
]
