"""The peers' own image pipelines, as their users write them: torchvision's v2 transforms in
plain torch on uint8 (for the torch DataLoader peers and the decode benchmark's
simplejpeg + torch ops), and DALI's train graph (a random-crop decode)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from fastload.decode.params import Preset, TrainPreset


def random_resized_crop_box(
    height: int, width: int, rng: random.Random, scale: tuple[float, float] = (0.08, 1.0)
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, round(width / (3 / 4))
    elif ratio > 4 / 3:
        h, w = height, round(height * (4 / 3))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TorchOps:
    """RandomResizedCrop + flip + normalize, or Resize + CenterCrop + normalize, as
    torchvision's v2 transforms do them on a uint8 tensor, written in plain torch: crop,
    antialiased bilinear resize and flip on uint8 (torch's fast uint8 kernel, channels-last
    as a decoded HWC image already is), then only the output converted to normalized float32
    CHW. The old order, the whole image to float32 first, made a peer pay for converting
    pixels it then cropped away (``float_first=True`` keeps it, for comparison)."""

    def __init__(self, preset: Preset, seed: int = 0, *, float_first: bool = False) -> None:
        self.preset = preset
        self.rng = random.Random(seed)
        self.float_first = float_first
        self.mean = torch.tensor(preset.mean).view(3, 1, 1)
        self.std = torch.tensor(preset.std).view(3, 1, 1)

    def __call__(self, rgb: npt.NDArray[np.uint8]) -> torch.Tensor:
        x = torch.from_numpy(rgb).permute(2, 0, 1)  # CHW view of HWC: channels-last in memory
        if self.float_first:
            x = x.float().div_(255)
        h, w = x.shape[1:]
        p = self.preset
        if isinstance(p, TrainPreset):
            top, left, ch, cw = random_resized_crop_box(h, w, self.rng, p.scale)
            x = self._resize(x[:, top : top + ch, left : left + cw], (p.size, p.size))
            if self.rng.random() < p.flip_p:
                x = x.flip(-1)
        else:
            short, long = (h, w) if h <= w else (w, h)
            new_long = int(p.resize * long / short)
            new_h, new_w = (p.resize, new_long) if h <= w else (new_long, p.resize)
            x = self._resize(x, (new_h, new_w))
            top, left = round((new_h - p.size) / 2.0), round((new_w - p.size) / 2.0)
            x = x[:, top : top + p.size, left : left + p.size]
        if x.dtype == torch.uint8:
            x = x.to(torch.float32, memory_format=torch.contiguous_format).div_(255)
        return x.sub_(self.mean).div_(self.std)

    @staticmethod
    def _resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        if x.dtype == torch.uint8:  # the uint8 kernel wants channels-last rows
            x = x[None].contiguous(memory_format=torch.channels_last)
        else:
            x = x[None]
        return F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def dali_train_ops(
    dali: Any, jpegs: Any, preset: TrainPreset, *, device: str = "cpu", **decoder_options: Any
) -> Any:
    """DALI's train graph as its users write it: a random-crop decode (only the crop is
    decoded), resize, random flip, normalize to float CHW."""
    fn, types = dali.fn, dali.types
    images = fn.decoders.image_random_crop(
        jpegs,
        device=device,
        random_area=list(preset.scale),
        random_aspect_ratio=list(preset.ratio),
        **decoder_options,
    )
    images = fn.resize(images, resize_x=preset.size, resize_y=preset.size)
    return fn.crop_mirror_normalize(
        images,
        dtype=types.FLOAT,
        output_layout="CHW",
        mean=[255 * m for m in preset.mean],
        std=[255 * s for s in preset.std],
        mirror=fn.random.coin_flip(probability=preset.flip_p),
    )
