"""What every decode backend shares: its settings, its output, and how it reports bad input."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from fastload.decode.limits import DEFAULT_MAX_PIXELS
from fastload.decode.params import EvalPreset, TrainPreset
from fastload.errors import DecodeError as DecodeError  # defined below the formats
from fastload.errors import FastloadError
from fastload.resources import usable_cpus

if TYPE_CHECKING:
    import torch

Backend: TypeAlias = Literal["auto", "dali", "cpu"]
Transform: TypeAlias = "TrainPreset | EvalPreset | Callable[[torch.Tensor], torch.Tensor] | None"


class BackendUnavailableError(FastloadError, ImportError):
    """The asked-for decode backend cannot run here; the message says what to install."""


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode a batch. ``transform``: a preset, a torch callable applied to each uint8
    CHW image, or None (uint8 CHW images of their own sizes, as torchvision.io.decode_jpeg).
    ``max_pixels``: the largest image (height x width, as its header claims) decoded; larger
    ones are bad samples (see ``fastload.decode.limits``)."""

    transform: Any = None  # Transform; Any keeps the dataclass free of a torch import
    seed: int = 0
    device: str = "cpu"
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    on_error: Literal["raise", "skip"] = "raise"
    num_threads: int = field(default_factory=usable_cpus)  # the container's CPUs, not the host's
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.layout not in ("NCHW", "NHWC"):
            raise ValueError(f"layout must be 'NCHW' or 'NHWC', got {self.layout!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels must be >= 1, got {self.max_pixels}")
        t = self.transform
        if not (t is None or isinstance(t, TrainPreset | EvalPreset) or callable(t)):
            raise TypeError(f"transform must be a preset, a callable or None, got {t!r}")


@dataclass(frozen=True)
class DecodedBatch:
    """A decoded batch. ``images`` is one tensor (N, C, H, W) (or NHWC) when every image has
    the same size (presets), else a list of tensors. ``kept[i]`` is the input position of
    image i; with ``on_error="skip"`` the positions of bad samples are missing from ``kept``
    and listed with the reason in ``skipped``."""

    images: Any  # torch.Tensor | list[torch.Tensor]
    kept: list[int]
    skipped: list[tuple[int, str]] = field(default_factory=list)


class Decoder(Protocol):
    """A decode backend. ``decode`` takes encoded images and each one's global sample index
    (the augmentation randomness comes from (seed, epoch, index)) and optional names (URLs
    or keys) for error messages."""

    backend: str
    config: DecodeConfig

    def decode(
        self,
        encoded: Sequence[bytes | memoryview],
        *,
        indices: Sequence[int],
        epoch: int = 0,
        names: Sequence[str] | None = None,
    ) -> DecodedBatch: ...

    def close(self) -> None: ...

    def __enter__(self) -> Decoder: ...

    def __exit__(self, *exc: object) -> None: ...


def sample_name(names: Sequence[str] | None, indices: Sequence[int], i: int) -> str:
    """How an error names input i: its URL or key when known, else its sample index."""
    if names is not None:
        return f"sample {indices[i]} ({names[i]})"
    return f"sample {indices[i]}"
