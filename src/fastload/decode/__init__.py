"""The decode stage: encoded images to tensors, on DALI or on the CPU with the same results.

``make_decoder(backend="auto")`` picks DALI's GPU pipeline when DALI and a CUDA device are
present, else fastload's CPU path, and logs the choice once. Augmentations come from
``params.augment_for`` on every backend, so a sample's crop and flip depend only on
(seed, epoch, sample index), never on the backend, the worker or a resume.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from fastload.decode.base import (
    Backend,
    BackendUnavailableError,
    DecodeConfig,
    DecodedBatch,
    DecodeError,
    Decoder,
)
from fastload.decode.params import (
    Augment,
    AugmentTable,
    EvalPreset,
    TrainPreset,
    augment_for,
    augments,
)

log = logging.getLogger(__name__)
_announced: set[str] = set()

DALI_PACKAGE = "nvidia-dali-cuda130"


def dali_installed() -> bool:
    return importlib.util.find_spec("nvidia") is not None and (
        importlib.util.find_spec("nvidia.dali") is not None
    )


def cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def available_backends() -> list[str]:
    """The backends that can run here, in the order ``auto`` prefers them."""
    backends = ["cpu"]
    if dali_installed():
        backends.insert(0, "dali")
    return backends


def choose_backend(backend: Backend, device: str) -> tuple[str, str]:
    """(backend, why) for a requested backend and target device."""
    if backend == "cpu":
        return "cpu", "asked for"
    if backend == "dali":
        if not dali_installed():
            raise BackendUnavailableError(
                f"decode='dali' needs NVIDIA DALI: pip install {DALI_PACKAGE} "
                "(or nvidia-dali-cuda120, matching your CUDA), or use decode='cpu'"
            )
        return "dali", "asked for"
    if backend != "auto":
        raise ValueError(f"decode must be 'auto', 'dali' or 'cpu', got {backend!r}")
    if device.startswith("cuda") and dali_installed() and cuda_available():
        return "dali", "DALI and a CUDA device are present: decoding on the GPU"
    if device.startswith("cuda") and not dali_installed():
        return "cpu", (
            f"no DALI ({DALI_PACKAGE}): decoding and transforming on the CPU, straight into "
            "the pinned slots the device copies from"
        )
    from fastload.decode.native_jpeg import native_jpeg_status

    return (
        "cpu",
        f"no CUDA device: fastload's CPU path (native JPEG transform: {native_jpeg_status()})",
    )


def make_decoder(
    backend: Backend = "auto",
    *,
    transform: Any = None,
    seed: int = 0,
    device: str = "cpu",
    layout: str = "NCHW",
    on_error: str = "raise",
    num_threads: int | None = None,
    max_pixels: int | None = None,
    **backend_options: Any,
) -> Decoder:
    """A decoder for the backend (``auto``: see the module docstring); the choice is logged
    once per process and kept in ``decoder.backend``."""
    settings: dict[str, Any] = {
        "transform": transform,
        "seed": seed,
        "device": device,
        "layout": layout,
        "on_error": on_error,
    }
    if num_threads is not None:
        settings["num_threads"] = num_threads
    if max_pixels is not None:
        settings["max_pixels"] = max_pixels
    config = DecodeConfig(**settings)
    chosen, why = choose_backend(backend, device)
    if why not in _announced:
        _announced.add(why)
        log.info("fastload decode: backend=%s (%s)", chosen, why)
    if chosen == "dali":
        from fastload.decode.dali import DALIDecoder

        return DALIDecoder(config, **backend_options)
    from fastload.decode.cpu import CPUDecoder

    return CPUDecoder(config, **backend_options)


__all__ = [
    "Augment",
    "AugmentTable",
    "BackendUnavailableError",
    "DecodeConfig",
    "DecodeError",
    "DecodedBatch",
    "Decoder",
    "EvalPreset",
    "TrainPreset",
    "augment_for",
    "augments",
    "available_backends",
    "choose_backend",
    "make_decoder",
]
