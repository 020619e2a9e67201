"""Augmentation parameters as a pure function of (seed, epoch, sample index, image size).

Every decode backend asks this module for the crop box and flip of each sample, so the same
sample gets the same augmentation on DALI and on the CPU path, after a resume, and with any
number of workers. The train preset follows torchvision's RandomResizedCrop (scale
(0.08, 1), ratio (3/4, 4/3), ten tries then a center crop) and RandomHorizontalFlip; the
eval preset is Resize(shorter side) then CenterCrop.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class TrainPreset:
    """RandomResizedCrop(size, scale, ratio) + horizontal flip + normalize, to float32."""

    size: int = 224
    _: KW_ONLY
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"size must be > 0, got {self.size}")
        if not 0 < self.scale[0] <= self.scale[1] <= 1:
            raise ValueError(f"scale must satisfy 0 < low <= high <= 1, got {self.scale}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise ValueError(f"ratio must satisfy 0 < low <= high, got {self.ratio}")
        if not 0 <= self.flip_p <= 1:
            raise ValueError(f"flip_p must be within [0, 1], got {self.flip_p}")


@dataclass(frozen=True)
class EvalPreset:
    """Resize the shorter side to ``resize`` (0, the default: 8/7 of size, torchvision's 256
    for 224), center crop ``size``, normalize, to float32."""

    size: int = 224
    resize: int = 0  # 0: round(size * 8 / 7)
    _: KW_ONLY
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def __post_init__(self) -> None:
        if self.resize == 0:
            object.__setattr__(self, "resize", round(self.size * 8 / 7))
        if not 0 < self.size <= self.resize:
            raise ValueError(f"need 0 < size <= resize, got size={self.size}, resize={self.resize}")


Preset = TrainPreset | EvalPreset


@dataclass(frozen=True, slots=True)
class Augment:
    """What to do to one decoded image of ``height`` x ``width``.

    Take the box (``top``, ``left``, ``crop_h``, ``crop_w``) in source pixels, resize it to
    (``out_h``, ``out_w``), then flip it horizontally if ``flip``. For the eval preset the
    box is the center crop mapped back onto the source image, so one crop-then-resize does
    what torchvision's resize-then-crop does (up to rounding at the box's edges).
    """

    top: int
    left: int
    crop_h: int
    crop_w: int
    out_h: int
    out_w: int
    flip: bool


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random stream of one sample in one epoch: independent of order and workers."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, 0xA5])))


def train_augment(
    preset: TrainPreset, height: int, width: int, *, seed: int, epoch: int, index: int
) -> Augment:
    """torchvision's RandomResizedCrop.get_params, drawn from this sample's own stream."""
    rng = sample_rng(seed, epoch, index)
    area = height * width
    log_ratio = (math.log(preset.ratio[0]), math.log(preset.ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(preset.scale[0], preset.scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            break
    else:  # fall back to a center crop of the allowed aspect ratio
        in_ratio = width / height
        if in_ratio < preset.ratio[0]:
            w, h = width, round(width / preset.ratio[0])
        elif in_ratio > preset.ratio[1]:
            h, w = height, round(height * preset.ratio[1])
        else:
            w, h = width, height
        top, left = (height - h) // 2, (width - w) // 2
    flip = bool(rng.random() < preset.flip_p)
    return Augment(top, left, h, w, preset.size, preset.size, flip)


def eval_augment(preset: EvalPreset, height: int, width: int) -> Augment:
    """Resize(shorter side) + CenterCrop as one source box resized to the output size."""
    short, long = (height, width) if height <= width else (width, height)
    new_long = int(preset.resize * long / short)  # torchvision truncates
    new_h, new_w = (preset.resize, new_long) if height <= width else (new_long, preset.resize)
    size = preset.size
    top_r = round((new_h - size) / 2.0)
    left_r = round((new_w - size) / 2.0)
    # Map the crop in the resized image back to source pixels.
    sy, sx = height / new_h, width / new_w
    top, left = round(top_r * sy), round(left_r * sx)
    crop_h = min(height - top, max(1, round(size * sy)))
    crop_w = min(width - left, max(1, round(size * sx)))
    return Augment(top, left, crop_h, crop_w, size, size, False)


def augment_for(
    preset: Preset, height: int, width: int, *, seed: int, epoch: int, index: int
) -> Augment:
    if isinstance(preset, TrainPreset):
        return train_augment(preset, height, width, seed=seed, epoch=epoch, index=index)
    return eval_augment(preset, height, width)
