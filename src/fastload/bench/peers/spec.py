"""What the end-to-end benchmark hands a system and gets back: the run's :class:`RunSpec`, the
:class:`Loader` a system opens, what its batches identify; shared by every peer module."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fastload.decode.params import TrainPreset

IMAGE_SUFFIXES = (".jpg", ".jpeg")

Sample = tuple[torch.Tensor, int, int]  # image, label, sample id
RawSample = tuple[bytes, int, str]  # a tar sample: image bytes, label, WebDataset key
Delivered = int | list[int]  # what batches() yields per batch: identities, or a count

# What a loader's lists hold (its ``delivers``), strongest first:
SAMPLE_IDS = "sample ids"  # one id per sample: the resume check compares multisets
LABELS_IN_ORDER = "labels in order"  # a deterministic epoch: compared in order
LABELS = "labels"  # only the label multiset (a replay and a drop of one class pass)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the parent asks one child to measure (written as JSON)."""

    system: str
    layout: str  # folder | tar | zarr | parquet | mds | litdata
    url: str  # the layout's root on the remote, s3://bucket/prefix
    storage_options: dict[str, Any]  # s3fs keyword arguments
    endpoint_url: str | None  # for peers that configure boto3 themselves
    work_dir: str  # caches and downloads of this run
    batch_size: int
    workers: int
    epochs: int
    step_s: float
    epoch_budget_s: float
    cold_budget_s: float | None  # None: the cold epoch runs to its end
    size: int
    seed: int
    resume: bool
    step: str = "sleep"  # the training step: sleep, or gil (runner.TrainingStep)
    step_iterations: int | None = None  # the gil step's work (None: measured in the child)
    samples: int | None = None  # known size of the dataset (None: the system finds out)
    min_warm_s: float = 0.0  # more warm epochs until they have run this long together
    labels: dict[str, int] = field(default_factory=dict)  # class folder -> index


class Loader(Protocol):
    """One system set up to iterate: ``batches(epoch)`` yields, per batch, its samples'
    identities (a list, of what ``delivers`` says; optional attribute) or their count
    (``epoch=None`` continues where a loaded state left off)."""

    samples: int  # per epoch
    extra: dict[str, float]  # figures of the set-up (e.g. download seconds)
    no_resume: str  # why the system cannot resume mid-epoch; "" where it can

    def batches(self, epoch: int | None) -> Iterator[Delivered]: ...

    def state_dict(self) -> Any: ...

    def close(self) -> None: ...


Opener = Callable[[RunSpec, Any], Loader]  # (spec, saved state or None) -> loader


def train_preset(spec: RunSpec) -> TrainPreset:
    """The train preset every system applies, at the run's size."""
    return TrainPreset(size=spec.size)


def remote_fs(spec: RunSpec) -> tuple[Any, str]:
    """(fsspec filesystem, root path) of the layout's URL."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(spec.url, **spec.storage_options)
    return fs, str(root).rstrip("/")


def ensure_dir(path: str) -> str:
    """``path``, made if missing: a run's cache or download folder."""
    os.makedirs(path, exist_ok=True)
    return path


def aws_env(spec: RunSpec) -> dict[str, str]:
    """AWS_* variables for peers that configure their own S3 client, from the run's options."""
    options = spec.storage_options
    env = {
        "AWS_ACCESS_KEY_ID": str(options.get("key", "")),
        "AWS_SECRET_ACCESS_KEY": str(options.get("secret", "")),
        "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    if spec.endpoint_url:
        env["S3_ENDPOINT_URL"] = spec.endpoint_url
    return env
