"""The doctor's plain-torch models: the parameter counts prove the architectures match
torchvision's (timm's for vit_s16), and one small step proves backward and SGD run."""

from __future__ import annotations

import math

import pytest
import torch

from fastload.diagnosis.models import MODELS, ModelStep, build, count_parameters

# torchvision's resnet18, resnet50, vit_b_16; timm's vit_small_patch16_224.
EXPECTED_PARAMETERS = {
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "vit_b16": 86_567_656,
    "vit_s16": 22_050_664,
}


def test_every_model_has_a_known_count() -> None:
    assert set(MODELS) == set(EXPECTED_PARAMETERS)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMETERS))
def test_parameter_count_matches_reference(name: str) -> None:
    assert count_parameters(build(name)) == EXPECTED_PARAMETERS[name]


@pytest.mark.parametrize(("name", "classes", "delta"), [("resnet50", 10, 990 * 2049)])
def test_num_classes_sizes_the_head(name: str, classes: int, delta: int) -> None:
    assert count_parameters(build(name, num_classes=classes)) == EXPECTED_PARAMETERS[name] - delta


def test_vit_runs_a_tiny_batch() -> None:
    """The attention's reshapes are right (a small ViT: 32x32 images, 5 tokens)."""
    model = build("vit_s16", num_classes=7, image_size=32)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)
    with pytest.raises(ValueError, match="32x32"):
        model(torch.randn(1, 3, 48, 48))


def test_unknown_name_raises_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: resnet18, resnet50, vit_b16, vit_s16"):
        build("alexnet")
    with pytest.raises(ValueError, match="unknown model 'alexnet'"):
        ModelStep("alexnet", batch_size=1)


@pytest.fixture(scope="module")
def step() -> ModelStep:
    return ModelStep("resnet18", batch_size=2, image_size=64, num_classes=10)


def _snapshot(step: ModelStep) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


def test_step_trains_every_parameter(step: ModelStep) -> None:
    before = _snapshot(step)
    step()
    after = _snapshot(step)
    changed = [not torch.equal(b, a) for b, a in zip(before, after, strict=True)]
    assert all(changed), f"{changed.count(False)} of {len(changed)} parameters did not change"
    assert all(p.grad is None for p in step.model.parameters())  # zero_grad(set_to_none=True)


def test_step_on_cpu_defaults_to_fp32(step: ModelStep) -> None:
    assert not step.amp
    assert not step.channels_last
    assert step.images.dtype == torch.float32
    assert step.images.shape == (2, 3, 64, 64)
    assert step.labels.dtype == torch.int64
    assert step.describe() == "resnet18 forward+backward+SGD, batch 2, 64x64, on cpu (fp32)"


def test_uint8_chw_batch_is_accepted(step: ModelStep) -> None:
    """A fastload loader's (uint8 NCHW, int labels) batch: normalized, labels folded into
    the classes; NHWC and a list of CHW tensors give the same images."""
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=generator)
    labels = torch.tensor([3, 14], dtype=torch.int32)
    images, prepared_labels = step.prepare((pixels, labels))
    assert images.dtype == torch.float32
    assert images.shape == (2, 3, 64, 64)
    mean = torch.tensor([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).reshape(1, 3, 1, 1)
    torch.testing.assert_close(images, (pixels / 255 - mean) / std)
    assert prepared_labels.tolist() == [3, 4]
    assert prepared_labels.dtype == torch.int64

    nhwc, _ = step.prepare((pixels.permute(0, 2, 3, 1).contiguous(), labels))
    as_list, _ = step.prepare((list(pixels), labels))
    torch.testing.assert_close(nhwc, images)
    torch.testing.assert_close(as_list, images)

    before = _snapshot(step)
    step((pixels, labels))
    assert not torch.equal(before[0], next(step.model.parameters()))


def test_float_batch_and_images_alone(step: ModelStep) -> None:
    images = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    prepared, labels = step.prepare(images)  # a folder without classes yields images alone
    assert prepared.dtype == torch.float32
    assert labels.shape == (2,)
    step(images)


def test_bad_batches_raise(step: ModelStep) -> None:
    with pytest.raises(ValueError, match="differ in shape"):
        step.prepare(([torch.zeros(3, 64, 64), torch.zeros(3, 32, 64)], torch.tensor([0, 1])))
    with pytest.raises(TypeError, match="images, labels"):
        step.prepare({"images": torch.zeros(1, 3, 64, 64)})


def test_seconds_per_step(step: ModelStep) -> None:
    seconds = step.seconds_per_step(repeats=1, warmup=0)
    assert 0 < seconds < math.inf  # a duration; how long is the benchmarks' business


def test_gpu_settings_run_on_cpu_too() -> None:
    """bf16 autocast and channels_last (the CUDA defaults) take the same path on CPU."""
    step = ModelStep(
        "resnet18", batch_size=2, image_size=32, num_classes=10, amp=True, channels_last=True
    )
    assert step.images.is_contiguous(memory_format=torch.channels_last)
    before = _snapshot(step)
    step(torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8))
    assert not torch.equal(before[0], next(step.model.parameters()))
    assert step.describe().endswith("on cpu (bf16 autocast, channels_last)")
