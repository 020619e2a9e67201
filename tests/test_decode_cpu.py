"""The CPU decode backend against independent references: Pillow decodes, torch resizes.

Images are generated here (smooth random fields plus noise, saved by Pillow at quality 90),
so the tests need no network and no torchvision. References are computed in the tests from
Pillow's decode and plain torch ops, never through the backend's own helpers.
"""

from __future__ import annotations

import io
import multiprocessing
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from fastload.decode.base import DecodeConfig, DecodeError
from fastload.decode.cpu import CPUDecoder, decode_rgb
from fastload.decode.native_jpeg import native_jpeg_available, native_jpeg_status
from fastload.decode.params import EvalPreset, TrainPreset, augment_for

U8 = npt.NDArray[np.uint8]
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
ONE_LEVEL = 1 / 255 / 0.225  # one uint8 step after normalizing (the largest 1/std)


def natural(seed: int, h: int, w: int, *, noise: float = 12.0) -> U8:
    """A natural-looking RGB image: smooth random fields at a few scales plus fine noise."""
    rng = np.random.default_rng(seed)
    img = np.full((3, h, w), 128.0, dtype=np.float32)
    for cells, amp in ((3, 60.0), (12, 30.0), (48, 18.0)):
        grid = torch.from_numpy(rng.normal(0, 1, (1, 3, cells, cells)).astype(np.float32))
        img += amp * F.interpolate(grid, size=(h, w), mode="bicubic")[0].numpy()
    img += rng.normal(0, noise, (1, h, w)) + rng.normal(0, noise / 3, (3, h, w))
    return np.clip(img, 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()


def encode(array: U8, fmt: str = "JPEG", mode: str | None = None, **kw: Any) -> bytes:
    out = io.BytesIO()
    im = Image.fromarray(array)
    if mode is not None:
        im = im.convert(mode)
    im.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}) | kw)
    return out.getvalue()


def pillow_rgb(data: bytes) -> U8:
    return np.array(Image.open(io.BytesIO(data)).convert("RGB"))


def normalize(x: torch.Tensor) -> torch.Tensor:
    return (x / 255 - MEAN) / STD


def resize(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(3, h, w) float -> (3, *size), the resize every backend uses, on float."""
    out = F.interpolate(x[None], size=size, mode="bilinear", antialias=True, align_corners=False)
    return out[0]


def chw(array: U8) -> torch.Tensor:
    return torch.from_numpy(array).permute(2, 0, 1).float()


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    """Twelve JPEGs of assorted sizes and aspect ratios, larger than the 224 output."""
    sizes = [(240, 320), (300, 260), (257, 257), (380, 250), (250, 400), (320, 240)] * 2
    return [encode(natural(i, h, w)) for i, (h, w) in enumerate(sizes)]


@pytest.fixture(scope="module")
def large_photos() -> list[bytes]:
    """Images large enough that most train crops allow a 1/2, 1/4 or 1/8 DCT-scaled decode."""
    return [encode(natural(100 + i, 1000 + 40 * i, 1200 - 30 * i)) for i in range(6)]


_native_path = [True]  # set per test by the jpeg_path fixture


@pytest.fixture(autouse=True, params=["native", "python"])
def jpeg_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test runs on both paths: the native JPEG transform and simplejpeg + torch."""
    if request.param == "native" and not native_jpeg_available():
        if "disabled" in native_jpeg_status():
            pytest.skip(native_jpeg_status())
        pytest.fail(f"the native JPEG transform did not load: {native_jpeg_status()}")
    _native_path[0] = request.param == "native"
    yield request.param
    _native_path[0] = True


def decoder(transform: Any = None, **kw: Any) -> CPUDecoder:
    options = {"dct_scaling": kw.pop("dct_scaling")} if "dct_scaling" in kw else {}
    config = DecodeConfig(transform=transform, seed=kw.pop("seed", 7), **kw)
    return CPUDecoder(config, native=_native_path[0], **options)


def decode(dec: CPUDecoder, data: list[bytes], start: int = 0, **kw: Any) -> Any:
    return dec.decode(data, indices=list(range(start, start + len(data))), **kw)


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("fastload-decode")]
    assert not alive, f"decode threads left running: {alive}"


# --- shapes, layouts, types -----------------------------------------------------------------


@pytest.mark.parametrize("preset", [TrainPreset(), EvalPreset(resize=160, size=128)])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_presets_give_a_float32_batch_in_the_layout(
    photos: list[bytes], preset: Any, layout: str
) -> None:
    with decoder(preset, layout=layout) as dec:
        batch = decode(dec, photos[:5])
    s = preset.size
    assert batch.images.shape == ((5, 3, s, s) if layout == "NCHW" else (5, s, s, 3))
    assert batch.images.dtype == torch.float32
    assert batch.images.device == torch.device("cpu")
    assert batch.kept == [0, 1, 2, 3, 4]
    assert batch.skipped == []
    assert dec.backend == "cpu"


def test_nhwc_is_the_nchw_batch_permuted(photos: list[bytes]) -> None:
    with decoder(TrainPreset()) as a, decoder(TrainPreset(), layout="NHWC") as b:
        nchw, nhwc = decode(a, photos[:4]).images, decode(b, photos[:4]).images
    assert torch.equal(nchw.permute(0, 2, 3, 1), nhwc)


def test_no_transform_gives_each_image_at_its_own_size_exactly_as_pillow_decodes(
    photos: list[bytes],
) -> None:
    data = [*photos[:4], encode(natural(50, 31, 17))]
    with decoder() as dec, decoder(layout="NHWC") as hwc:
        batch, batch_hwc = decode(dec, data), decode(hwc, data)
    assert isinstance(batch.images, list)
    for image, image_hwc, raw in zip(batch.images, batch_hwc.images, data, strict=True):
        want = torch.from_numpy(pillow_rgb(raw))
        assert image.dtype == torch.uint8
        assert image.is_contiguous()
        assert torch.equal(image, want.permute(2, 0, 1))
        assert torch.equal(image_hwc, want)
    assert np.array_equal(decode_rgb(data[0]), pillow_rgb(data[0]))


def test_no_transform_gives_a_list_even_when_sizes_agree(photos: list[bytes]) -> None:
    with decoder() as dec:
        images = decode(dec, [photos[0], photos[0]]).images
    assert isinstance(images, list)
    assert len(images) == 2


def test_a_callable_gets_uint8_chw_and_its_results_are_stacked(photos: list[bytes]) -> None:
    seen: list[tuple[torch.dtype, int]] = []

    def crop8(x: torch.Tensor) -> torch.Tensor:
        seen.append((x.dtype, x.shape[0]))
        return x[:, :8, :8].float() / 255

    with decoder(crop8) as dec, decoder(crop8, layout="NHWC") as hwc:
        batch, batch_hwc = decode(dec, photos[:3]), decode(hwc, photos[:3])
    assert seen == [(torch.uint8, 3)] * 6
    assert batch.images.shape == (3, 3, 8, 8)
    assert batch_hwc.images.shape == (3, 8, 8, 3)
    want = torch.from_numpy(pillow_rgb(photos[1])[:8, :8]).permute(2, 0, 1).float() / 255
    assert torch.equal(batch.images[1], want)


def test_a_callable_with_uneven_results_gives_a_list(photos: list[bytes]) -> None:
    with decoder(lambda x: x[:, :5]) as dec:
        images = decode(dec, photos[:2]).images
    assert isinstance(images, list)
    assert [tuple(t.shape) for t in images] == [(3, 5, 320), (3, 5, 260)]


def test_an_error_in_the_callable_propagates_naming_the_sample(photos: list[bytes]) -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with decoder(broken) as dec, pytest.raises(RuntimeError, match="boom") as info:
        dec.decode(photos[:1], indices=[41], names=["s3://b/x.jpg"])
    if hasattr(info.value, "__notes__"):
        assert "sample 41 (s3://b/x.jpg)" in info.value.__notes__[0]


# --- the presets against independent references ---------------------------------------------


def torchvision_eval(raw: bytes, resize_to: int, size: int) -> torch.Tensor:
    """Resize(resize_to) then CenterCrop(size) with torchvision's rounding, on float."""
    x = chw(pillow_rgb(raw))
    h, w = x.shape[1:]
    short, long = min(h, w), max(h, w)
    new_long = int(resize_to * long / short)
    new_h, new_w = (resize_to, new_long) if h <= w else (new_long, resize_to)
    x = resize(x, (new_h, new_w))
    top, left = round((new_h - size) / 2.0), round((new_w - size) / 2.0)
    return normalize(x[:, top : top + size, left : left + size])


def box_reference(raw: bytes, preset: Any, index: int, seed: int = 7) -> torch.Tensor:
    """Full Pillow decode, the augment_for box, float resize, flip, normalize."""
    x = chw(pillow_rgb(raw))
    a = augment_for(preset, x.shape[1], x.shape[2], seed=seed, epoch=0, index=index)
    x = resize(x[:, a.top : a.top + a.crop_h, a.left : a.left + a.crop_w], (a.out_h, a.out_w))
    return normalize(x.flip(-1) if a.flip else x)


def test_eval_matches_resize_then_center_crop(photos: list[bytes]) -> None:
    preset = EvalPreset()
    with decoder(preset) as dec:
        got = decode(dec, photos).images
    for i, (image, raw) in enumerate(zip(got, photos, strict=True)):
        # The box augment_for gives, resized on float: equal up to the uint8 rounding.
        assert (image - box_reference(raw, preset, i)).abs().max() <= 1.01 * ONE_LEVEL
        diff = (image - torchvision_eval(raw, 256, 224)).abs()
        # torchvision resizes, then crops; the box is in whole source pixels, so its edges sit
        # up to half a pixel off: ~5 levels on average on this per-pixel noise (~2 on smooth
        # content), nowhere near a wrong crop (tens of levels).
        assert diff.mean() < 0.12, diff.mean()
        assert diff.median() < 0.1, diff.median()


def test_train_crops_and_flips_are_augment_for_s(photos: list[bytes]) -> None:
    preset = TrainPreset()
    flips = {
        augment_for(preset, *pillow_rgb(raw).shape[:2], seed=7, epoch=0, index=i).flip
        for i, raw in enumerate(photos)
    }
    assert flips == {True, False}  # the data exercises both
    with decoder(preset, dct_scaling=False) as dec:
        got = decode(dec, photos).images
    for i, (image, raw) in enumerate(zip(got, photos, strict=True)):
        diff = (image - box_reference(raw, preset, i)).abs()
        # Only the uint8 rounding of the resize differs: a shifted box or a missed flip would
        # differ by tens of levels on this noise.
        assert diff.max() <= 1.01 * ONE_LEVEL, (i, diff.max())


def test_train_box_positions_on_a_coordinate_image() -> None:
    """Pixels that encode their own row and column: the output's corners tell the box."""
    h, w = 256, 240
    rows, cols = np.mgrid[0:h, 0:w]
    array = np.stack([rows, cols, np.zeros_like(rows)], axis=-1).astype(np.uint8)
    png = encode(array, "PNG")
    preset = TrainPreset(size=16, mean=(0, 0, 0), std=(1 / 255,) * 3)  # output = pixel value
    with decoder(preset) as dec:
        got = decode(dec, [png] * 8, start=100).images
    flips = {augment_for(preset, h, w, seed=7, epoch=0, index=100 + k).flip for k in range(8)}
    assert flips == {True, False}
    for k, image in enumerate(got):
        a = augment_for(preset, h, w, seed=7, epoch=0, index=100 + k)
        # Output pixel j samples source position top + (j + 0.5) * crop / out - 0.5; on a
        # linear ramp the (symmetric) filter returns exactly that, away from the box's edges.
        j = torch.arange(4, 12, dtype=torch.float32)
        want_rows = a.top + (j + 0.5) * a.crop_h / 16 - 0.5
        want_cols = a.left + (j + 0.5) * a.crop_w / 16 - 0.5
        cols = image[1, 8, 4:12]
        if a.flip:
            cols = image[1, 8].flip(0)[4:12]
        assert (image[0, 4:12, 8] - want_rows).abs().max() <= 0.6, k
        assert (cols - want_cols).abs().max() <= 0.6, (k, a.flip)


def test_dct_scaled_decode_stays_within_the_resize_tolerance(large_photos: list[bytes]) -> None:
    preset = TrainPreset()
    sizes = [pillow_rgb(raw).shape[:2] for raw in large_photos]
    boxes = [augment_for(preset, h, w, seed=7, epoch=0, index=i) for i, (h, w) in enumerate(sizes)]
    assert sum(min(b.crop_h, b.crop_w) >= 2 * b.out_h for b in boxes) >= 3  # scaling is used
    with decoder(preset) as scaled, decoder(preset, dct_scaling=False) as full:
        fast, slow = decode(scaled, large_photos).images, decode(full, large_photos).images
    for i in range(len(large_photos)):
        diff = (fast[i] - slow[i]).abs()
        # Decoding at 1/f and rounding the box to whole decoded pixels moves each box edge by
        # under half an output pixel; on this noisy content that stays small on average.
        assert diff.mean() < 0.06, (i, diff.mean())  # measured: at most 0.04 (2 levels)
        assert diff.max() < 0.5, (i, diff.max())
        assert torch.corrcoef(torch.stack([fast[i].ravel(), slow[i].ravel()]))[0, 1] > 0.995


def test_eval_on_a_large_image_uses_scaling_and_stays_close(large_photos: list[bytes]) -> None:
    preset = EvalPreset()
    with decoder(preset) as dec:
        got = decode(dec, large_photos[:2]).images
    for image, raw in zip(got, large_photos[:2], strict=True):
        assert (image - torchvision_eval(raw, 256, 224)).abs().mean() < 0.12  # as above


# --- determinism ------------------------------------------------------------------------------


def test_same_batches_across_calls_thread_counts_and_batch_splits(photos: list[bytes]) -> None:
    preset = TrainPreset()
    with decoder(preset, num_threads=1) as one, decoder(preset, num_threads=3) as three:
        whole = decode(one, photos, epoch=2).images.clone()
        again = decode(one, photos, epoch=2).images
        threaded = decode(three, photos, epoch=2).images
        split = torch.cat(
            [
                decode(three, photos[:5], epoch=2).images,
                decode(three, photos[5:], 5, epoch=2).images,
            ]
        )
        other_epoch = decode(one, photos, epoch=3).images
    assert torch.equal(whole, again)
    assert torch.equal(whole, threaded)
    assert torch.equal(whole, split)
    assert not torch.equal(whole, other_epoch)


def test_a_held_batch_is_never_overwritten(photos: list[bytes]) -> None:
    with decoder(TrainPreset()) as dec:
        first = decode(dec, photos[:4]).images
        kept = first.clone()
        for start in range(1, 7):  # more batches than the decoder keeps buffers for
            decode(dec, photos[start : start + 4])
        view = first[1:3]
        del first
        decode(dec, photos[4:8])
        assert torch.equal(view, kept[1:3])


# --- bad and unusual input --------------------------------------------------------------------


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def scrambled(data: bytes) -> bytes:
    """Entropy-coded bytes overwritten mid-file: libjpeg loses sync and warns at the end."""
    out = bytearray(data)
    middle = len(out) // 2
    out[middle : middle + 100] = bytes((b * 7 + 13) % 255 for b in out[middle : middle + 100])
    return bytes(out)


def bad_cases(photo: bytes) -> dict[str, tuple[bytes, str]]:
    return {
        "truncated JPEG": (truncated(photo), "truncated or corrupt JPEG"),
        "corrupt JPEG data": (scrambled(photo), "truncated or corrupt JPEG"),
        "cut in the header": (photo[:60], "corrupt JPEG header"),
        "not an image": (b"this is a text file, not an image" * 10, "not a decodable image"),
        "empty": (b"", "empty"),
        "corrupt PNG": (encode(natural(1, 20, 20), "PNG")[:-40], "undecodable PNG"),
    }


@pytest.mark.parametrize("transform", [None, TrainPreset(size=32)])
@pytest.mark.parametrize(
    "case",
    [
        "truncated JPEG",
        "corrupt JPEG data",
        "cut in the header",
        "not an image",
        "empty",
        "corrupt PNG",
    ],
)
def test_bad_input_raises_naming_the_sample_and_the_problem(
    photos: list[bytes], case: str, transform: Any
) -> None:
    data, reason = bad_cases(photos[0])[case]
    with decoder(transform) as dec, pytest.raises(DecodeError) as info:
        dec.decode([photos[1], data], indices=[10, 11], names=["a.jpg", "dir/b.jpg"])
    message = str(info.value)
    assert message.startswith("sample 11 (dir/b.jpg): ")
    assert reason in message
    assert "on_error='skip'" in message
    with decoder(transform) as dec, pytest.raises(DecodeError, match=r"^sample 11: "):
        dec.decode([photos[1], data], indices=[10, 11])


def test_skip_leaves_bad_samples_out_and_keeps_the_rest(photos: list[bytes]) -> None:
    cases = bad_cases(photos[0])
    data = [photos[2], cases["truncated JPEG"][0], photos[3], cases["empty"][0], photos[4]]
    preset = TrainPreset()
    with decoder(preset, on_error="skip") as dec, decoder(preset) as strict:
        batch = dec.decode(data, indices=[0, 1, 2, 3, 4], names=list("abcde"))
        alone = strict.decode([data[0], data[2], data[4]], indices=[0, 2, 4]).images
    assert batch.kept == [0, 2, 4]
    assert [pos for pos, _ in batch.skipped] == [1, 3]
    assert "sample 1 (b)" in batch.skipped[0][1]
    assert "truncated" in batch.skipped[0][1]
    assert "empty" in batch.skipped[1][1]
    assert torch.equal(batch.images, alone)


def test_skip_of_every_sample_gives_an_empty_batch() -> None:
    with decoder(TrainPreset(), on_error="skip") as dec, decoder(on_error="skip") as raw:
        batch = dec.decode([b"", b"x"], indices=[0, 1])
        assert batch.images.shape == (0, 3, 224, 224)
        assert raw.decode([b""], indices=[0]).images == []
        assert batch.kept == []


def test_a_jpeg_missing_only_its_end_marker_decodes(photos: list[bytes]) -> None:
    raw = photos[0]
    assert raw.endswith(b"\xff\xd9")
    with decoder() as dec:
        (image,) = decode(dec, [raw[:-2]]).images
    assert torch.equal(image, torch.from_numpy(pillow_rgb(raw)).permute(2, 0, 1))


def test_grayscale_jpeg_becomes_three_equal_channels() -> None:
    raw = encode(natural(3, 40, 50), mode="L")
    with decoder() as dec:
        (image,) = decode(dec, [raw]).images
    gray = torch.from_numpy(np.array(Image.open(io.BytesIO(raw))))
    assert image.shape == (3, 40, 50)
    for c in range(3):
        assert torch.equal(image[c], gray)


def test_cmyk_jpeg_becomes_rgb() -> None:
    rgb = natural(4, 48, 64)
    raw = encode(rgb, mode="CMYK", quality=95)
    assert Image.open(io.BytesIO(raw)).mode == "CMYK"
    with decoder() as dec:
        (image,) = decode(dec, [raw]).images
    want = chw(pillow_rgb(raw))
    assert image.shape == (3, 48, 64)
    assert (image.float() - want).abs().mean() < 3
    assert (image.float() - chw(rgb)).abs().mean() < 5  # close to the original colours


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L"])
def test_png_modes_become_rgb_without_alpha(mode: str) -> None:
    rgb = natural(5, 30, 20)
    im = Image.fromarray(rgb)
    if mode in ("RGBA", "LA"):
        im = im.convert(mode)
        alpha = Image.fromarray(np.linspace(0, 255, 600).astype(np.uint8).reshape(30, 20))
        im.putalpha(alpha)
    else:
        im = im.convert(mode)
    out = io.BytesIO()
    im.save(out, "PNG")
    with decoder() as dec:
        (image,) = decode(dec, [out.getvalue()]).images
    assert image.shape == (3, 30, 20)
    assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(np.array(im.convert("RGB"))))
    if mode == "RGBA":  # alpha is dropped, the colour kept as stored
        assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(rgb))


def test_sixteen_bit_png_keeps_its_top_eight_bits() -> None:
    wide = (np.arange(12 * 10, dtype=np.uint16).reshape(12, 10) * 500).astype(np.uint16)
    out = io.BytesIO()
    Image.fromarray(wide).save(out, "PNG")
    with decoder() as dec:
        (image,) = decode(dec, [out.getvalue()]).images
    want = torch.from_numpy((wide >> 8).astype(np.uint8))
    assert all(torch.equal(image[c], want) for c in range(3))


@pytest.mark.parametrize("size", [(1, 1), (7, 5), (5, 7)])
def test_tiny_images(size: tuple[int, int]) -> None:
    raw = encode(natural(6, *size))
    with decoder() as dec, decoder(TrainPreset()) as train, decoder(EvalPreset()) as ev:
        (image,) = decode(dec, [raw]).images
        assert image.shape == (3, *size)
        assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(pillow_rgb(raw)))
        for d in (train, ev):
            out = decode(d, [raw] * 3).images
            assert out.shape == (3, 3, 224, 224)
            assert torch.isfinite(out).all()


def test_a_very_large_image() -> None:
    """6000 x 4000: the presets decode it DCT-scaled; the result matches a full decode."""
    small = natural(8, 400, 600, noise=0)
    big = np.asarray(Image.fromarray(small).resize((6000, 4000), Image.Resampling.BILINEAR))
    raw = encode(big)
    with decoder(EvalPreset()) as dec:
        image = decode(dec, [raw]).images[0]
    assert image.shape == (3, 224, 224)
    want = torchvision_eval(encode(small), 256, 224)  # same content, 1/10 the size
    assert (image - want).abs().mean() < 0.05


def test_a_header_claiming_too_many_pixels_is_refused(photos: list[bytes]) -> None:
    raw = bytearray(encode(natural(9, 16, 16)))
    sof = raw.index(b"\xff\xc0")
    raw[sof + 5 : sof + 9] = struct.pack(">HH", 60000, 60000)
    with decoder() as dec, pytest.raises(DecodeError, match="over max_pixels"):
        decode(dec, [bytes(raw)])


def test_memoryview_and_bytearray_inputs(photos: list[bytes]) -> None:
    with decoder() as dec:
        images = dec.decode(
            [memoryview(photos[0]), bytearray(photos[1])],  # type: ignore[list-item]
            indices=[0, 1],
        ).images
    assert torch.equal(images[0], torch.from_numpy(pillow_rgb(photos[0])).permute(2, 0, 1))
    assert images[1].shape == (3, 300, 260)


# --- lifecycle and arguments ------------------------------------------------------------------


def test_close_is_idempotent_and_stops_the_threads(photos: list[bytes]) -> None:
    dec = decoder(TrainPreset(), num_threads=3)
    png = encode(natural(5, 40, 50), "PNG")  # a PNG takes the Python threads on either path
    decode(dec, [*photos[:6], png])
    assert any(t.name.startswith("fastload-decode") for t in threading.enumerate())
    dec.close()
    dec.close()
    with pytest.raises(ValueError, match="closed"):
        decode(dec, photos[:1])


def _child_decode(dec: CPUDecoder, data: list[bytes], conn: Any) -> None:
    # As DataLoader workers do: torch's OpenMP pool does not survive fork either.
    torch.set_num_threads(1)
    conn.send(decode(dec, data).images.numpy().copy())
    dec.close()


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_decodes_on_threads_of_its_own(photos: list[bytes]) -> None:
    """DataLoader workers fork; the parent's threads do not exist in the child."""
    with decoder(TrainPreset(), num_threads=2) as dec:
        want = decode(dec, photos[:4]).images.clone()  # the parent's threads are running
        ctx = multiprocessing.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_decode, args=(dec, photos[:4], child))
        proc.start()
        try:
            assert parent.poll(60), "the child did not answer"
            assert torch.equal(torch.from_numpy(parent.recv()), want)
        finally:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
            parent.close()
            child.close()
        assert proc.exitcode == 0
        assert torch.equal(decode(dec, photos[:4]).images, want)  # the parent is unaffected


def test_mismatched_arguments_are_refused(photos: list[bytes]) -> None:
    with decoder() as dec:
        with pytest.raises(ValueError, match="2 encoded samples but 1 indices"):
            dec.decode(photos[:2], indices=[0])
        with pytest.raises(ValueError, match="names"):
            dec.decode(photos[:2], indices=[0, 1], names=["a"])
        assert dec.decode([], indices=[]).images == []


@pytest.mark.gpu
def test_cuda_device_matches_the_cpu_path(photos: list[bytes]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    preset = TrainPreset()
    with decoder(preset, device="cuda") as gpu, decoder(preset) as cpu:
        on_gpu, on_cpu = decode(gpu, photos).images, decode(cpu, photos).images
    assert on_gpu.device.type == "cuda"
    assert (on_gpu.cpu() - on_cpu).abs().max() <= 1.01 * ONE_LEVEL


# --- the benchmark, at toy size ---------------------------------------------------------------


def test_decode_bench_runs_at_toy_size(tmp_path: Path) -> None:
    from fastload.bench.components import decode_bench

    systems = ("fastload CPU", "simplejpeg + torch ops, plain loop")
    config = decode_bench.DecodeBenchConfig(
        images=6, batch_size=4, size=32, repeats=1, systems=systems
    )
    report = decode_bench.run(tmp_path, config)
    cases = {r.case for r in report.rows}
    assert len(cases) == 3  # train, eval, the decoders alone
    assert {r.system for r in report.rows} >= {*systems, "Pillow", "simplejpeg"}
    assert all(r.items == 6 and r.seconds > 0 for r in report.rows)
    sizes = []
    for path in sorted(tmp_path.rglob("*.jpg")):
        with Image.open(path) as im:
            sizes.append(im.size)
    assert len(sizes) == 6
    assert all(400 <= w <= 500 and 350 <= h <= 500 for w, h in sizes)
    with pytest.raises(ValueError, match="systems must be among"):
        decode_bench.run(tmp_path, decode_bench.DecodeBenchConfig(images=6, systems=("x",)))


def test_a_systems_background_work_after_its_epoch_is_charged_to_its_turn(tmp_path: Path) -> None:
    """A pipeline that goes on working after its epoch returns (DALI filling its prefetch
    queue) has that work timed in its own turn, not in the next system's."""
    from contextlib import contextmanager

    from fastload.bench.components import decode_bench

    burn_s = 0.3
    threads: list[threading.Thread] = []

    def burn() -> None:  # CPU of this thread, not wall time: a busy machine only adds
        start = time.thread_time()
        while time.thread_time() - start < burn_s:
            pass

    @contextmanager
    def prefetching(work: decode_bench.Workload) -> Iterator[Any]:
        def epoch(e: int) -> int:
            threads.append(threading.Thread(target=burn))
            threads[-1].start()
            return len(work.paths)  # returns at once; its work goes on

        try:
            yield epoch
        finally:
            for thread in threads:
                thread.join()

    work = decode_bench.Workload([tmp_path / "a.jpg"], TrainPreset(size=32), 1, 1)
    system = decode_bench.System("prefetching", prefetching)
    (row,) = decode_bench.measure_case("case", work, [system], 2, 1)
    assert all(seconds >= burn_s for seconds in row.repeats)


def test_the_benchmark_peers_torch_ops_match_the_references(photos: list[bytes]) -> None:
    from fastload.bench.peers.peer_decoders import TorchOps

    rgb = pillow_rgb(photos[3])
    got = TorchOps(EvalPreset())(rgb)
    # Resized on uint8 (as torchvision v2 does), the float reference's up to the rounding.
    assert (got - torchvision_eval(photos[3], 256, 224)).abs().max() <= 1.05 * ONE_LEVEL
    assert got.is_contiguous()
    float_first = TorchOps(EvalPreset(), float_first=True)(rgb)
    assert torch.allclose(float_first, torchvision_eval(photos[3], 256, 224), atol=1e-5)
    uint8_ops, float_ops = (
        TorchOps(TrainPreset(), seed=5),
        TorchOps(TrainPreset(), seed=5, float_first=True),
    )
    for raw in photos:  # the same boxes and flips; the crop resized on uint8, then float
        image = pillow_rgb(raw)
        train, reference = uint8_ops(image), float_ops(image)
        assert train.shape == (3, 224, 224)
        assert train.dtype == torch.float32
        assert train.is_contiguous()
        assert (train - reference).abs().max() <= 1.05 * ONE_LEVEL


# --- the native JPEG transform ----------------------------------------------------------------


def test_native_and_python_paths_agree_on_a_mixed_batch(photos: list[bytes]) -> None:
    """JPEGs natively, the rest (PNG, CMYK, progressive and grayscale JPEGs natively too) by
    whichever path takes them: one batch, the same pixels as the Python path's."""
    if not native_jpeg_available():
        pytest.skip(native_jpeg_status())
    batch = [
        *photos[:4],
        encode(natural(20, 300, 280), "PNG"),
        encode(natural(21, 260, 300), mode="CMYK", quality=95),
        encode(natural(22, 280, 260), progressive=True),
        encode(natural(23, 250, 330)[:, :, 0], mode="L"),
        encode(natural(24, 1500, 1100)),  # DCT-scaled
    ]
    for preset in (TrainPreset(), EvalPreset()):
        results = []
        for native in (True, False):
            config = DecodeConfig(transform=preset, seed=5, layout="NHWC")
            with CPUDecoder(config, native=native) as dec:
                assert dec.native is native
                results.append(decode(dec, batch, start=40, epoch=3).images.clone())
        levels = (results[0] - results[1]).abs() * torch.tensor([0.229, 0.224, 0.225]) * 255
        # The resizes round differently (the native one may shrink rows first): one level at
        # most, and rarely; a box off by a pixel or a missed flip moves tens of levels.
        assert levels.max() <= 1.01
        assert levels.mean() < 0.25


def test_the_native_transform_releases_the_gil_while_a_batch_decodes(
    large_photos: list[bytes],
) -> None:
    """A Python thread keeps running while a batch decodes: it makes progress inside the
    decode's span (with the GIL held it could not run there at all). Counted, not timed: a
    busy machine slows both threads, it does not stop the Python one."""
    if not native_jpeg_available():
        pytest.skip(native_jpeg_status())
    spans: list[tuple[float, float]] = []
    with CPUDecoder(DecodeConfig(transform=EvalPreset(), num_threads=1), native=True) as dec:
        batch = large_photos * 6
        decode(dec, batch[:2])  # warm: pool and buffers exist

        def run() -> None:
            start = time.perf_counter()
            decode(dec, batch)
            spans.append((start, time.perf_counter()))

        ticks: list[float] = []
        worker = threading.Thread(target=run)
        worker.start()
        while worker.is_alive():
            ticks.append(time.perf_counter())
        worker.join()
    start, end = spans[0]
    inside = sum(start < t < end for t in ticks)
    assert inside >= 100, f"the Python thread ran {inside} times during the decode"
