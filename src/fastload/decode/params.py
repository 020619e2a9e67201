"""Augmentation parameters as a pure function of (seed, epoch, sample index, image size).

Every decode backend asks this module for the crop box and flip of each sample, so the same
sample gets the same augmentation on DALI and on the CPU path, after a resume, and with any
number of workers. A batch is drawn at once (:func:`augments`): each sample's draws come
from a counter-based stream (splitmix64 of seed, epoch, index and draw number), so a batch
of 64 costs a few numpy operations, not 64 generators (~25 us each: the GIL they held
was the loader's largest per-sample cost). The stream changed with that (fastload 0.1.0,
issue 14): a resume across the change gets other crops than the first run would have.
The train preset follows torchvision's RandomResizedCrop (scale
(0.08, 1), ratio (3/4, 4/3), ten tries then a center crop) and RandomHorizontalFlip; the
eval preset is Resize(shorter side) then CenterCrop.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

import numpy as np
import numpy.typing as npt

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


# --- the random stream: counter-based, so a whole batch draws in a few numpy operations ----

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 2**64 - 1


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finalizer: a bijection of uint64 that scrambles every bit (wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _sample_keys(seed: int, epoch: int, indices: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Each sample's key: its draws are _mix(key + (draw + 1) * golden)."""
    index = np.asarray(indices, dtype=np.int64).reshape(-1).astype(np.uint64)
    words = np.array([seed & _MASK, epoch & _MASK], dtype=np.uint64)
    key = _mix(_mix(words[:1] + np.uint64(_GOLDEN)) ^ words[1:])  # (1,)
    return _mix(key ^ _mix(index + np.uint64(_GOLDEN)))


def _uniform(keys: npt.NDArray[np.uint64], j: int) -> npt.NDArray[np.float64]:
    """Draw j of each key, in [0, 1). One column at a time: numpy operations on a batch's
    few dozen values keep the GIL, where a (batch, draws) table would release and retake it
    (a wait each for a training step holding it)."""
    bits = _mix(keys + np.uint64((j + 1) * _GOLDEN & _MASK))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def sample_uniforms(
    seed: int, epoch: int, indices: npt.ArrayLike, count: int
) -> npt.NDArray[np.float64]:
    """(len(indices), count) uniforms in [0, 1): draw j of sample i depends on (seed,
    epoch, indices[i], j) only, never on the batch, its order or the worker."""
    keys = _sample_keys(seed, epoch, indices)
    return np.stack([_uniform(keys, j) for j in range(count)], axis=1).reshape(len(keys), count)


@dataclass(frozen=True)
class AugmentTable:
    """The augmentation of a batch of samples, one array per field of :class:`Augment`."""

    top: npt.NDArray[np.int64]
    left: npt.NDArray[np.int64]
    crop_h: npt.NDArray[np.int64]
    crop_w: npt.NDArray[np.int64]
    flip: npt.NDArray[np.bool_]
    out_h: int
    out_w: int

    def __len__(self) -> int:
        return len(self.top)

    def row(self, i: int) -> Augment:
        return Augment(
            int(self.top[i]),
            int(self.left[i]),
            int(self.crop_h[i]),
            int(self.crop_w[i]),
            self.out_h,
            self.out_w,
            bool(self.flip[i]),
        )


def train_augments(
    preset: TrainPreset,
    heights: npt.ArrayLike,
    widths: npt.ArrayLike,
    *,
    seed: int,
    epoch: int,
    indices: npt.ArrayLike,
) -> AugmentTable:
    """torchvision's RandomResizedCrop.get_params for a batch: per sample, up to ten tries of
    an area in ``scale`` and a log-uniform aspect ratio in ``ratio``, the first that fits
    wins; else a center crop of the allowed ratio. Then a flip with ``flip_p``."""
    h = np.asarray(heights, dtype=np.int64).reshape(-1)
    w = np.asarray(widths, dtype=np.int64).reshape(-1)
    keys = _sample_keys(seed, epoch, indices)
    lo, hi = preset.scale
    log_lo, log_hi = math.log(preset.ratio[0]), math.log(preset.ratio[1])
    crop_h, crop_w = np.zeros(len(h), dtype=np.int64), np.zeros(len(h), dtype=np.int64)
    pending = np.arange(len(h))  # the samples no try has fitted yet
    for t in range(10):
        if not len(pending):
            break
        ph, pw, pk = h[pending], w[pending], keys[pending]
        target = ph * pw * (lo + (hi - lo) * _uniform(pk, 2 * t))
        aspect = np.exp(log_lo + (log_hi - log_lo) * _uniform(pk, 2 * t + 1))
        tw = np.rint(np.sqrt(target * aspect)).astype(np.int64)  # rint: Python's round
        th = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        fits = (tw > 0) & (tw <= pw) & (th > 0) & (th <= ph)
        crop_w[pending[fits]], crop_h[pending[fits]] = tw[fits], th[fits]
        pending = pending[~fits]
    top = (_uniform(keys, 20) * (h - crop_h + 1)).astype(np.int64)  # uniform over 0 .. h - crop_h
    left = (_uniform(keys, 21) * (w - crop_w + 1)).astype(np.int64)
    if len(pending):  # a center crop of the allowed aspect ratio
        missed = pending
        mh, mw = h[missed], w[missed]
        in_ratio = mw / mh
        narrow, wide = in_ratio < preset.ratio[0], in_ratio > preset.ratio[1]
        cw = np.where(narrow, mw, np.where(wide, np.rint(mh * preset.ratio[1]), mw))
        ch = np.where(narrow, np.rint(mw / preset.ratio[0]), mh)
        cw, ch = np.maximum(cw.astype(np.int64), 1), np.maximum(ch.astype(np.int64), 1)
        crop_w[missed], crop_h[missed] = cw, ch
        top[missed], left[missed] = (mh - ch) // 2, (mw - cw) // 2
    flip = _uniform(keys, 22) < preset.flip_p
    return AugmentTable(top, left, crop_h, crop_w, flip, preset.size, preset.size)


def eval_augments(
    preset: EvalPreset, heights: npt.ArrayLike, widths: npt.ArrayLike
) -> AugmentTable:
    """Resize(shorter side) + CenterCrop as one source box per sample resized to the output
    size (see :class:`Augment`)."""
    h = np.asarray(heights, dtype=np.int64).reshape(-1)
    w = np.asarray(widths, dtype=np.int64).reshape(-1)
    short, long = np.minimum(h, w), np.maximum(h, w)
    new_long = (preset.resize * long / short).astype(np.int64)  # torchvision truncates
    tall = h > w
    new_h = np.where(tall, new_long, preset.resize)
    new_w = np.where(tall, preset.resize, new_long)
    size = preset.size
    sy, sx = h / new_h, w / new_w  # the crop in the resized image, mapped back to the source
    top = np.rint(np.rint((new_h - size) / 2.0) * sy).astype(np.int64)
    left = np.rint(np.rint((new_w - size) / 2.0) * sx).astype(np.int64)
    crop_h = np.minimum(h - top, np.maximum(1, np.rint(size * sy).astype(np.int64)))
    crop_w = np.minimum(w - left, np.maximum(1, np.rint(size * sx).astype(np.int64)))
    return AugmentTable(top, left, crop_h, crop_w, np.zeros(len(h), bool), size, size)


def augments(
    preset: Preset,
    heights: npt.ArrayLike,
    widths: npt.ArrayLike,
    *,
    seed: int,
    epoch: int,
    indices: npt.ArrayLike,
) -> AugmentTable:
    """The augmentation of a batch: what :func:`augment_for` gives each sample."""
    if isinstance(preset, TrainPreset):
        return train_augments(preset, heights, widths, seed=seed, epoch=epoch, indices=indices)
    return eval_augments(preset, heights, widths)


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python integer (a numpy call costs more than this)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _sample_key(seed: int, epoch: int, index: int) -> int:
    key = _mix_int(_mix_int((seed + _GOLDEN) & _MASK) ^ (epoch & _MASK))
    return _mix_int(key ^ _mix_int((index + _GOLDEN) & _MASK))


def _draw(key: int, j: int) -> float:
    """Draw j of the sample whose key is ``key``, as :func:`sample_uniforms` gives it."""
    return (_mix_int((key + (j + 1) * _GOLDEN) & _MASK) >> 11) * 2.0**-53


def augment_for(
    preset: Preset, height: int, width: int, *, seed: int, epoch: int, index: int
) -> Augment:
    """One sample's crop box and flip: the row :func:`augments` gives it in any batch."""
    if not isinstance(preset, TrainPreset):
        return eval_augments(preset, height, width).row(0)
    key = _sample_key(seed, epoch, index)
    lo, hi = preset.scale
    log_lo, log_hi = math.log(preset.ratio[0]), math.log(preset.ratio[1])
    for t in range(10):  # the same arithmetic as train_augments, one try at a time
        target = height * width * (lo + (hi - lo) * _draw(key, 2 * t))
        aspect = float(np.exp(np.array([log_lo + (log_hi - log_lo) * _draw(key, 2 * t + 1)]))[0])
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(_draw(key, 20) * (height - h + 1))
            left = int(_draw(key, 21) * (width - w + 1))
            flip = _draw(key, 22) < preset.flip_p
            return Augment(top, left, h, w, preset.size, preset.size, flip)
    return train_augments(preset, height, width, seed=seed, epoch=epoch, indices=index).row(
        0
    )  # the rare center-crop fallback
