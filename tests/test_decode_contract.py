"""One contract, every decode backend that runs here: same shapes, same crops, same pixels.

DALI's CPU pipeline runs wherever DALI installs (it does on these machines); its GPU
pipeline needs a GPU (``gpu`` marker). Tolerances allow for different resize kernels and
rounding at crop edges, not for a different crop: a crop off by a few pixels or a missed
flip moves the mean error far beyond them.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from fastload.decode import (
    DecodeError,
    EvalPreset,
    TrainPreset,
    augment_for,
    available_backends,
    make_decoder,
)

BACKENDS = available_backends()
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def natural_jpeg(seed: int, height: int, width: int, quality: int = 90) -> bytes:
    """Smooth random fields plus noise: compresses like a photograph, not like noise."""
    rng = np.random.default_rng(seed)
    small = rng.uniform(0, 255, (height // 16 + 2, width // 16 + 2, 3)).astype(np.float32)
    field = (
        torch.nn.functional.interpolate(
            torch.from_numpy(small).permute(2, 0, 1)[None], size=(height, width), mode="bicubic"
        )[0]
        .permute(1, 2, 0)
        .numpy()
    )
    pixels = np.clip(field + rng.normal(0, 6, field.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return out.getvalue()


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    sizes = [(375, 500), (500, 400), (333, 500), (480, 480), (360, 430), (500, 350)]
    return [natural_jpeg(i, h, w) for i, (h, w) in enumerate(sizes)]


def reference(data: bytes, preset: TrainPreset | EvalPreset, index: int, seed: int, epoch: int):
    """Pillow decode, then the shared Augment applied with plain torch ops."""
    img = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB"))).permute(2, 0, 1)
    a = augment_for(preset, img.shape[1], img.shape[2], seed=seed, epoch=epoch, index=index)
    crop = img[:, a.top : a.top + a.crop_h, a.left : a.left + a.crop_w].float()
    out = torch.nn.functional.interpolate(
        crop[None], size=(a.out_h, a.out_w), mode="bilinear", antialias=True, align_corners=False
    )[0]
    if a.flip:
        out = out.flip(-1)
    return (out / 255 - MEAN) / STD


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def decode(backend: str, images: list[bytes], preset, *, seed=0, epoch=0, **options):
    with make_decoder(backend, transform=preset, seed=seed, **options) as decoder:
        return decoder.decode(images, indices=list(range(len(images))), epoch=epoch)


@pytest.mark.parametrize("preset", [EvalPreset(), TrainPreset()], ids=["eval", "train"])
def test_presets_match_the_shared_reference(backend, images, preset) -> None:
    batch = decode(backend, images, preset, seed=3, epoch=2)
    assert batch.kept == list(range(len(images)))
    assert batch.images.shape == (len(images), 3, 224, 224)
    assert batch.images.dtype == torch.float32
    for i, data in enumerate(images):
        want = reference(data, preset, i, 3, 2)
        err = (batch.images[i] - want).abs()
        # Normalized units: 0.05 is about 3 gray levels on average.
        assert float(err.mean()) < 0.05, f"image {i}: mean error {float(err.mean()):.3f}"


def test_backends_agree_with_each_other(images) -> None:
    if len(BACKENDS) < 2:
        pytest.skip(f"only {BACKENDS} can run here")
    for preset in (EvalPreset(), TrainPreset()):
        outs = [decode(b, images, preset, seed=1, epoch=5).images for b in BACKENDS]
        for other in outs[1:]:
            assert float((outs[0] - other).abs().mean()) < 0.05


def test_augmentation_depends_on_seed_epoch_and_index_only(backend, images) -> None:
    a = decode(backend, images, TrainPreset(), seed=4, epoch=1).images
    b = decode(backend, images[::-1], TrainPreset(), seed=4, epoch=1)
    with make_decoder(backend, transform=TrainPreset(), seed=4) as decoder:
        b = decoder.decode(images[::-1], indices=list(range(len(images)))[::-1], epoch=1).images
        c = decoder.decode(images, indices=list(range(len(images))), epoch=2).images
    assert torch.equal(a, b.flip(0))  # order in the batch does not matter
    assert not torch.allclose(a, c)  # another epoch, other crops


def test_nhwc_layout(backend, images) -> None:
    nchw = decode(backend, images, EvalPreset()).images
    nhwc = decode(backend, images, EvalPreset(), layout="NHWC").images
    assert nhwc.shape == (len(images), 224, 224, 3)
    assert torch.allclose(nhwc.permute(0, 3, 1, 2), nchw)


def test_no_transform_gives_uint8_chw_like_a_plain_decode(backend, images) -> None:
    batch = decode(backend, images, None)
    for data, img in zip(images, batch.images, strict=True):
        want = torch.from_numpy(np.array(Image.open(io.BytesIO(data)).convert("RGB")))
        assert img.dtype == torch.uint8
        assert img.shape == want.permute(2, 0, 1).shape
        assert float((img.permute(1, 2, 0).float() - want.float()).abs().mean()) < 1.0


def test_bad_input_is_named_or_skipped(backend, images) -> None:
    bad = [images[0], b"", b"not an image at all", images[1][: len(images[1]) // 3], images[2]]
    names = [
        "s3://b/ok0.jpg",
        "s3://b/empty.jpg",
        "s3://b/text.jpg",
        "s3://b/cut.jpg",
        "s3://b/ok2.jpg",
    ]
    with (
        make_decoder(backend, transform=EvalPreset()) as decoder,
        pytest.raises(DecodeError, match=r"s3://b/(empty|text|cut)\.jpg"),
    ):
        decoder.decode(bad, indices=list(range(5)), names=names)
    with make_decoder(backend, transform=EvalPreset(), on_error="skip") as decoder:
        batch = decoder.decode(bad, indices=list(range(5)), names=names)
    assert batch.kept[0] == 0
    assert batch.kept[-1] == 4
    assert {1, 2} <= {i for i, _ in batch.skipped}
    assert batch.images.shape[0] == len(batch.kept)


@pytest.fixture
def odd_images() -> dict[str, bytes]:
    rng = np.random.default_rng(9)
    out = {}
    for mode in ("L", "CMYK", "RGBA"):
        arr = rng.integers(0, 255, (64, 80, len(mode)), dtype=np.uint8)
        img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
        buf = io.BytesIO()
        img.save(buf, format="PNG" if mode == "RGBA" else "JPEG", quality=90)
        out[mode] = buf.getvalue()
    return out


def test_grayscale_cmyk_and_alpha_become_three_channels(backend, odd_images) -> None:
    batch = decode(backend, list(odd_images.values()), None)
    for img in batch.images:
        assert img.shape == (3, 64, 80)
    preset = decode(backend, list(odd_images.values()), EvalPreset()).images
    assert preset.shape == (3, 3, 224, 224)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# DALI warns (category Warning) at its first GPU pipeline's build in a process when NPP or
# cuFFT are not installed; neither is used here, and this may be that first build.
@pytest.mark.filterwarnings("ignore:nvidia-dali-cuda.* is no longer shipped:Warning")
def test_gpu_batches_match_the_cpu_ones(images) -> None:
    cpu = decode("cpu", images, EvalPreset()).images
    gpu = decode("auto", images, EvalPreset(), device="cuda").images
    assert gpu.device.type == "cuda"
    assert float((gpu.cpu() - cpu).abs().mean()) < 0.05
