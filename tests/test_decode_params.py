"""The augmentation parameters: one stream per (seed, epoch, index), a batch drawn at once.

The loader draws a whole batch with ``augments`` (numpy, no Python work per sample); the
Python decode path and DALI ask ``augment_for`` one sample at a time. Both must give every
sample the same box and flip, whatever batch it is in.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.decode.params import (
    Augment,
    EvalPreset,
    TrainPreset,
    augment_for,
    augments,
    sample_uniforms,
)

sides = st.integers(1, 4000)


@settings(max_examples=300, deadline=None)
@given(
    height=sides,
    width=sides,
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 10**6),
    index=st.integers(0, 2**40),
    scale_lo=st.floats(0.01, 1.0),
    ratio=st.sampled_from([(3 / 4, 4 / 3), (1.0, 1.0), (2.0, 3.0), (0.2, 0.5)]),
)
def test_one_sample_gets_its_row_of_any_batch(
    height: int, width: int, seed: int, epoch: int, index: int, scale_lo: float, ratio: tuple
) -> None:
    preset = TrainPreset(scale=(scale_lo, 1.0), ratio=ratio)
    one = augment_for(preset, height, width, seed=seed, epoch=epoch, index=index)
    batch = augments(
        preset,
        [17, height, 900],
        [33, width, 120],
        seed=seed,
        epoch=epoch,
        indices=[index + 1, index, index + 2],
    )
    assert batch.row(1) == one
    assert one.top >= 0
    assert one.left >= 0
    assert one.top + one.crop_h <= height
    assert one.left + one.crop_w <= width
    assert min(one.crop_h, one.crop_w) >= 1


def test_draws_depend_on_seed_epoch_and_index_only() -> None:
    u = sample_uniforms(7, 2, [5, 6, 7], 23)
    again = sample_uniforms(7, 2, [7, 100, 5], 23)
    assert np.array_equal(u[0], again[2])
    assert np.array_equal(u[2], again[0])
    assert not np.array_equal(u[0], u[1])
    assert not np.array_equal(u, sample_uniforms(8, 2, [5, 6, 7], 23))
    assert not np.array_equal(u, sample_uniforms(7, 3, [5, 6, 7], 23))
    many = sample_uniforms(0, 0, np.arange(20_000), 4)
    assert many.min() >= 0.0
    assert many.max() < 1.0
    assert abs(many.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(many[:, 0], many[:, 1])[0, 1]) < 0.03


def test_train_boxes_follow_random_resized_crop() -> None:
    """torchvision's RandomResizedCrop: area in scale, aspect ratio in ratio (up to the
    rounding of each side), position uniform, flip with flip_p."""
    preset = TrainPreset()
    n, h, w = 20_000, 500, 500  # square: no side rejects more tall than wide tries
    table = augments(preset, [h] * n, [w] * n, seed=1, epoch=0, indices=np.arange(n))
    area = table.crop_h * table.crop_w / (h * w)
    aspect = table.crop_w / table.crop_h
    assert area.min() >= 0.08 * 0.97
    assert area.max() <= 1.0
    assert aspect.min() >= 0.75 * 0.97
    assert aspect.max() <= 4 / 3 * 1.03
    # log-uniform aspect ratios: as many wide as tall crops
    assert abs((aspect > 1).mean() - 0.5) < 0.02
    room = h - table.crop_h
    spread = table.top[room > 0] / room[room > 0]
    assert abs(spread.mean() - 0.5) < 0.02
    assert abs(table.flip.mean() - 0.5) < 0.02
    never = TrainPreset(flip_p=0.0)
    assert not augments(never, [h] * 500, [w] * 500, seed=1, epoch=0, indices=range(500)).flip.any()


def test_a_sample_that_fits_no_try_gets_a_center_crop_of_the_allowed_ratio() -> None:
    preset = TrainPreset()
    for height, width in [(10, 1000), (1000, 10), (1, 1), (2, 3000)]:
        box = augment_for(preset, height, width, seed=0, epoch=0, index=3)
        assert min(box.crop_h, box.crop_w) >= 1
        assert box.top + box.crop_h <= height
        assert box.left + box.crop_w <= width
        if width > height * 4 / 3:  # too wide: full height, the widest allowed ratio
            assert box.crop_h == height
            assert box.crop_w == max(1, round(height * 4 / 3))
            assert box.left == (width - box.crop_w) // 2


def test_the_stream_is_pinned() -> None:
    """Changing the stream changes every run's crops and breaks resumes across versions: it
    must be deliberate (and said in the README), not a side effect."""
    preset = TrainPreset()
    got = [augment_for(preset, 375, 500, seed=0, epoch=0, index=i) for i in range(3)]
    assert got == [
        Augment(89, 238, 171, 165, 224, 224, True),
        Augment(86, 226, 188, 188, 224, 224, True),
        Augment(32, 0, 292, 356, 224, 224, True),
    ]
    assert augment_for(preset, 480, 640, seed=12345, epoch=3, index=10**9) == Augment(
        34, 77, 430, 453, 224, 224, False
    )


def _eval_reference(preset: EvalPreset, height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision Resize(shorter side) + CenterCrop, the crop mapped back to the source."""
    short, long = min(height, width), max(height, width)
    new_long = int(preset.resize * long / short)
    new_h, new_w = (preset.resize, new_long) if height <= width else (new_long, preset.resize)
    sy, sx = height / new_h, width / new_w
    top = round(round((new_h - preset.size) / 2.0) * sy)
    left = round(round((new_w - preset.size) / 2.0) * sx)
    crop_h = min(height - top, max(1, round(preset.size * sy)))
    crop_w = min(width - left, max(1, round(preset.size * sx)))
    return top, left, crop_h, crop_w


@pytest.mark.parametrize("preset", [EvalPreset(), EvalPreset(size=128, resize=160)])
def test_eval_boxes_are_resize_then_center_crop(preset: EvalPreset) -> None:
    rng = np.random.default_rng(0)
    heights, widths = rng.integers(1, 3000, 500), rng.integers(1, 3000, 500)
    table = augments(preset, heights, widths, seed=0, epoch=0, indices=np.arange(500))
    for i, (h, w) in enumerate(zip(heights.tolist(), widths.tolist(), strict=True)):
        box = table.row(i)
        assert (box.top, box.left, box.crop_h, box.crop_w) == _eval_reference(preset, h, w)
        assert not box.flip
        assert augment_for(preset, h, w, seed=0, epoch=0, index=i) == box
    # a 4:3 photo: the central 7/8 of its shorter side, centered
    box = augment_for(preset, 375, 500, seed=0, epoch=0, index=0)
    assert math.isclose(box.crop_h, 375 * preset.size / preset.resize, abs_tol=1)
