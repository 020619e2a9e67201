"""The DALI decode backend on DALI's CPU pipeline (a real pipeline; the GPU graph is marked gpu).

Images are generated here: smooth random fields plus noise, saved by Pillow at quality 90,
so they compress like photographs. References are Pillow decodes plus the shared
``augment_for`` box applied with plain torch ops.
"""

from __future__ import annotations

import gc
import io
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip(
    "nvidia.dali", reason="NVIDIA DALI is not installed (pip install nvidia-dali-cuda130)"
)

from fastload.decode.base import BackendUnavailableError, DecodeConfig, DecodeError
from fastload.decode.dali import DALIDecoder, image_format, image_size
from fastload.decode.params import Augment, EvalPreset, TrainPreset, augment_for

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
HAS_CUDA = torch.cuda.is_available()


def encode(pixels: np.ndarray, fmt: str = "JPEG", mode: str | None = None, **options: int) -> bytes:
    img = Image.fromarray(pixels)
    if mode is not None:
        img = img.convert(mode)
    out = io.BytesIO()
    img.save(out, format=fmt, **options)
    return out.getvalue()


def photo(seed: int, height: int, width: int) -> np.ndarray:
    """Smooth fields plus noise, (height, width, 3) uint8."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    channels = [
        127 + 80 * np.sin(a * yy + b * xx + p) + rng.normal(0, 8, (height, width))
        for a, b, p in rng.uniform((0.01, 0.01, 0), (0.05, 0.05, 6), (3, 3))
    ]
    return np.clip(np.stack(channels, -1), 0, 255).astype(np.uint8)


def jpeg(seed: int, height: int, width: int, **options: int) -> bytes:
    return encode(photo(seed, height, width), quality=90, **options)


def pillow_rgb(data: bytes) -> torch.Tensor:
    """Pillow's decode as uint8 CHW (copied: Pillow's array is read-only)."""
    with Image.open(io.BytesIO(data)) as im:
        return torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1)


def reference(data: bytes, a: Augment) -> torch.Tensor:
    """Crop, antialiased bilinear resize, flip, normalize: float32 CHW."""
    crop = pillow_rgb(data)[:, a.top : a.top + a.crop_h, a.left : a.left + a.crop_w].float()
    out = torch.nn.functional.interpolate(
        crop[None], size=(a.out_h, a.out_w), mode="bilinear", antialias=True, align_corners=False
    )[0]
    if a.flip:
        out = out.flip(-1)
    return (out / 255 - MEAN) / STD


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture(scope="module")
def images() -> list[bytes]:
    sizes = [(150, 200), (200, 160), (131, 177), (180, 180), (97, 250), (220, 120), (160, 161)]
    return [jpeg(i, h, w) for i, (h, w) in enumerate(sizes)]


@pytest.fixture(scope="module")
def odd() -> dict[str, bytes]:
    """Grayscale and CMYK JPEGs, a progressive JPEG, PNGs with alpha / palette / 16 bits."""
    pixels = photo(42, 70, 90)
    rgba = np.concatenate([pixels, np.full((70, 90, 1), 128, np.uint8)], -1)
    return {
        "gray": encode(pixels, mode="L", quality=90),
        "cmyk": encode(pixels, mode="CMYK", quality=90),
        "progressive": encode(pixels, quality=90, progressive=1),
        "png_rgba": encode(rgba, "PNG"),
        "png_palette": encode(pixels, "PNG", mode="P"),
        "png_gray16": encode((pixels[..., 0].astype(np.uint16) * 257), "PNG"),
    }


def decoder_for(transform: object, *, batch_size_hint: int, on_error: str = "raise"):
    config = DecodeConfig(transform=transform, seed=3, num_threads=2, on_error=on_error)
    with DALIDecoder(config, batch_size_hint=batch_size_hint) as decoder:
        yield decoder


# One pipeline per configuration for the whole module: building one costs milliseconds on
# the CPU, but they add up and these are the configurations users run.
@pytest.fixture(scope="module")
def raw() -> Iterator[DALIDecoder]:
    yield from decoder_for(None, batch_size_hint=8)


@pytest.fixture(scope="module")
def evaluation() -> Iterator[DALIDecoder]:
    yield from decoder_for(EvalPreset(resize=146, size=128), batch_size_hint=8)


@pytest.fixture(scope="module")
def train() -> Iterator[DALIDecoder]:
    yield from decoder_for(TrainPreset(size=96), batch_size_hint=4)


@pytest.fixture(scope="module")
def skipping() -> Iterator[DALIDecoder]:
    yield from decoder_for(TrainPreset(size=64), batch_size_hint=8, on_error="skip")


def positions(n: int) -> list[int]:
    return list(range(n))


# -- headers -----------------------------------------------------------------------------


def test_image_size_reads_headers_without_decoding(images, odd) -> None:
    assert image_size(images[0]) == (150, 200)
    assert image_size(memoryview(images[4])) == (97, 250)
    for name, data in odd.items():
        assert image_size(data) == (70, 90), name
    assert image_format(odd["png_rgba"]) == "png"
    bmp = encode(photo(1, 20, 30), "BMP")
    assert image_format(bmp) == "bmp"
    assert image_size(bmp) == (20, 30)  # through Pillow


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"", "empty"),
        (b"GIF89a\x01\x00\x01\x00", "not an image DALI reads"),
        (b"hello, world", "not an image DALI reads"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "truncated JPEG"),
        (b"\xff\xd8\xff\xda\x00\x08", "before any SOF"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "truncated or corrupt PNG"),
    ],
)
def test_image_size_says_what_is_wrong(data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        image_size(data)


def test_truncated_jpeg_header_is_caught(images) -> None:
    with pytest.raises(ValueError, match="truncated JPEG"):
        image_size(images[0][:120])


# -- decoding ------------------------------------------------------------------------------


def test_no_transform_gives_pillows_pixels_as_uint8_chw(raw, images) -> None:
    batch = raw.decode(images, indices=positions(len(images)))
    assert batch.kept == positions(len(images))
    assert batch.skipped == []
    assert isinstance(batch.images, list)
    for data, img in zip(images, batch.images, strict=True):
        want = pillow_rgb(data)
        assert img.dtype == torch.uint8
        assert img.device.type == "cpu"
        assert img.shape == want.shape
        assert img.is_contiguous()
        # Both are libjpeg-turbo with the same IDCT: identical here; 1 allows other builds.
        assert int((img.int() - want.int()).abs().max()) <= 1


def test_grayscale_cmyk_progressive_and_png_become_rgb(raw, odd) -> None:
    batch = raw.decode(list(odd.values()), indices=positions(len(odd)))
    for (name, data), img in zip(odd.items(), batch.images, strict=True):
        assert img.shape == (3, 70, 90), name
        if name == "png_gray16":  # Pillow clips 16-bit gray to 255; DALI scales v*257 to v
            gray = torch.from_numpy(photo(42, 70, 90)[..., 0])
            assert torch.equal(img, gray.expand(3, 70, 90)), name
        elif name.startswith("png"):
            assert torch.equal(img, pillow_rgb(data)), name  # lossless: exactly Pillow's pixels
        else:
            assert int((img.int() - pillow_rgb(data).int()).abs().max()) <= 1, name


def test_presets_on_grayscale_cmyk_and_png(evaluation, odd) -> None:
    batch = evaluation.decode(list(odd.values()), indices=positions(len(odd)))
    assert batch.images.shape == (len(odd), 3, 128, 128)
    for i, (name, data) in enumerate(odd.items()):
        if name == "png_gray16":
            continue  # Pillow's reference is wrong for it (see above)
        a = augment_for(evaluation.config.transform, 70, 90, seed=3, epoch=0, index=i)
        err = ((batch.images[i] - reference(data, a)) * STD * 255).abs()
        assert float(err.mean()) < 0.1, name


@pytest.mark.parametrize("kind", ["eval", "train"])
def test_presets_match_a_pillow_and_torch_reference(kind, evaluation, train, images) -> None:
    decoder = evaluation if kind == "eval" else train
    preset = decoder.config.transform
    indices = [10 * i + 1 for i in range(len(images))]  # sample ids, not batch positions
    batch = decoder.decode(images, indices=indices, epoch=2)  # 7 images, max batch 4 (train)
    side = preset.size
    assert batch.images.shape == (len(images), 3, side, side)
    assert batch.images.dtype == torch.float32
    assert batch.kept == positions(len(images))
    flips = 0
    for i, data in enumerate(images):
        h, w = image_size(data)
        a = augment_for(preset, h, w, seed=3, epoch=2, index=indices[i])
        flips += a.flip
        # Compared in gray levels (0-255). The decode is the same libjpeg-turbo; the only
        # difference is the resize: DALI's antialiased linear filter (float output) against
        # torch's, which differ in weights at the crop's edges and in float rounding.
        # Measured here: mean <= 0.01, max <= 1 (about 4 on 500 px photos); exact where the
        # box is upscaled. A box moved by 3 px or a missed flip gives a mean of 6.8 or more.
        err = ((batch.images[i] - reference(data, a)) * STD * 255).abs()
        assert float(err.mean()) < 0.1, f"image {i}: mean error {float(err.mean()):.3f}"
        assert float(err.max()) < 8, f"image {i}: max error {float(err.max()):.1f}"
    if kind == "train":
        assert 0 < flips < len(images)  # both branches of the flip were checked


def test_a_wrong_box_would_fail_the_reference_check(train, images) -> None:
    """The tolerance above is tight enough to catch a crop off by a few pixels."""
    preset = train.config.transform
    batch = train.decode(images[:1], indices=[5])
    a = augment_for(preset, *image_size(images[0]), seed=3, epoch=0, index=5)
    moved = Augment(a.top + 3, a.left + 3, a.crop_h, a.crop_w, a.out_h, a.out_w, a.flip)
    assert float(((batch.images[0] - reference(images[0], moved)) * STD * 255).abs().mean()) > 1


def test_same_input_same_output_and_order_does_not_matter(train, images) -> None:
    idx = positions(len(images))
    a = train.decode(images, indices=idx, epoch=1).images
    b = train.decode(images, indices=idx, epoch=1).images
    c = train.decode(images[::-1], indices=idx[::-1], epoch=1).images
    d = train.decode(images, indices=idx, epoch=4).images
    assert torch.equal(a, b)
    assert torch.equal(a, c.flip(0))
    assert not torch.allclose(a, d)  # another epoch draws other boxes


def test_short_batches_and_batches_above_the_hint(train, images) -> None:
    assert train.max_batch_size == 4
    full = train.decode(images, indices=positions(7)).images  # 4 + 3
    short = train.decode(images[4:], indices=[4, 5, 6]).images
    one = train.decode(images[6:], indices=[6]).images
    assert torch.equal(full[4:], short)
    assert torch.equal(full[6:], one)
    empty = train.decode([], indices=[])
    assert empty.images.shape == (0, 3, 96, 96)
    assert empty.kept == []


def test_nhwc_layout(images) -> None:
    idx = positions(3)
    with DALIDecoder(DecodeConfig(transform=EvalPreset(), num_threads=2, layout="NHWC")) as d:
        nhwc = d.decode(images[:3], indices=idx).images
        assert nhwc.shape == (3, 224, 224, 3)
    with DALIDecoder(DecodeConfig(transform=EvalPreset(), num_threads=2)) as d:
        nchw = d.decode(images[:3], indices=idx).images
    assert torch.equal(nhwc.permute(0, 3, 1, 2), nchw)
    with DALIDecoder(DecodeConfig(layout="NHWC", num_threads=2)) as d:
        hwc = d.decode(images[:1], indices=[0]).images[0]
    assert torch.equal(hwc, pillow_rgb(images[0]).permute(1, 2, 0))


def test_a_callable_transform_gets_each_uint8_chw_image(images) -> None:
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def gray(img: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(img.shape), img.dtype))
        return img.float().mean(0, keepdim=True)

    with DALIDecoder(DecodeConfig(transform=gray, num_threads=2, layout="NHWC")) as d:
        batch = d.decode(images[:3], indices=positions(3))
    assert seen == [(tuple(pillow_rgb(x).shape), torch.uint8) for x in images[:3]]
    for data, out in zip(images, batch.images, strict=False):
        assert torch.allclose(out, pillow_rgb(data).float().mean(0, keepdim=True))


# -- bad input ------------------------------------------------------------------------------


def bad_batch(images: list[bytes]) -> tuple[list[bytes], list[str]]:
    """Good samples around each kind of bad one; the cut one passes the header check."""
    data = [
        images[0],
        b"",
        images[1],
        b"<html>404 not found</html>",
        images[2][:100],  # header cut short
        images[3][: len(images[3]) // 2],  # body cut short: only DALI notices
        images[4],
    ]
    names = ["ok0", "empty", "ok2", "html", "cut_header", "cut_body", "ok6"]
    return data, [f"s3://bucket/{n}.jpg" for n in names]


@pytest.mark.parametrize(
    ("position", "why"),
    [
        (1, "empty"),
        (3, "not an image DALI reads"),
        (4, "truncated JPEG"),
        (5, "DALI could not decode it"),
    ],
)
def test_bad_sample_raises_naming_it(train, images, position, why) -> None:
    data, names = bad_batch(images)
    keep = [0, position, 6]
    with pytest.raises(DecodeError, match=rf"sample {position + 100} \(.*{why}") as info:
        train.decode(
            [data[k] for k in keep],
            indices=[k + 100 for k in keep],
            names=[names[k] for k in keep],
        )
    assert names[position] in str(info.value)
    assert "on_error='skip'" in str(info.value)
    # Without names the index is the name; and the pipeline still works afterwards.
    with pytest.raises(DecodeError, match=rf"^sample {position} cannot be decoded"):
        train.decode([data[k] for k in keep], indices=keep)
    assert train.decode(images[:2], indices=[0, 1]).images.shape[0] == 2


def test_skip_leaves_bad_samples_out_and_keeps_the_rest_exact(skipping, images) -> None:
    data, names = bad_batch(images)
    batch = skipping.decode(data, indices=positions(len(data)), names=names, epoch=1)
    assert batch.kept == [0, 2, 6]
    assert [i for i, _ in batch.skipped] == [1, 3, 4, 5]
    assert "DALI could not decode it" in dict(batch.skipped)[5]
    good = skipping.decode([data[i] for i in (0, 2, 6)], indices=[0, 2, 6], epoch=1).images
    assert torch.equal(batch.images, good)
    everything_bad = skipping.decode(data[1:2] + data[5:6], indices=[1, 5])
    assert everything_bad.images.shape == (0, 3, 64, 64)
    assert [i for i, _ in everything_bad.skipped] == [0, 1]


def test_bad_samples_in_a_no_transform_batch(raw, images) -> None:
    data, _ = bad_batch(images)
    with pytest.raises(DecodeError, match="sample 5"):
        raw.decode(data[5:], indices=[5, 6])
    with DALIDecoder(DecodeConfig(on_error="skip", num_threads=2), batch_size_hint=4) as d:
        batch = d.decode(data, indices=positions(len(data)))
    assert batch.kept == [0, 2, 6]
    assert [tuple(img.shape) for img in batch.images] == [
        tuple(pillow_rgb(images[i]).shape) for i in (0, 1, 4)
    ]


# -- life cycle and set-up errors -------------------------------------------------------------


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_close_is_idempotent_and_leaves_no_threads(images) -> None:
    with DALIDecoder(DecodeConfig(num_threads=2)) as warm:  # DALI starts a global thread once
        warm.decode(images[:1], indices=[0])
    torch.ones(512, 512).sum()  # torch's own thread pool, started before counting
    gc.collect()
    before = os_threads()
    decoder = DALIDecoder(DecodeConfig(transform=TrainPreset(size=32), num_threads=2))
    assert os_threads() > before  # the pipeline's own threads
    out = decoder.decode(images[:3], indices=[0, 1, 2]).images
    bad, _ = bad_batch(images)
    with pytest.raises(DecodeError):
        decoder.decode(bad[5:6], indices=[5])  # rebuilds the pipeline
    kept = out.clone()
    decoder.close()
    decoder.close()
    gc.collect()
    assert os_threads() == before
    assert torch.equal(out, kept)  # returned tensors outlive the pipeline
    with pytest.raises(ValueError, match="closed"):
        decoder.decode(images[:1], indices=[0])
    assert "closed" in repr(decoder)


@pytest.mark.filterwarnings("ignore:.*fork.*:DeprecationWarning")
def test_a_forked_child_gets_an_error_not_a_hang(images) -> None:
    """DALI's threads do not survive fork: a DataLoader worker must not decode or close."""
    decoder = DALIDecoder(DecodeConfig(num_threads=2))
    decoder.decode(images[:1], indices=[0])
    with pytest.raises(TypeError, match="cannot be sent to another process"):
        pickle.dumps(decoder)
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code, never return into pytest
        code = 1
        try:
            decoder.decode(images[:1], indices=[0])
        except RuntimeError as e:
            code = 0 if "forked child" in str(e) else 2
        decoder.close()  # must return, not wait on the parent's threads
        os._exit(code)
    for _ in range(300):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(decoder.decode(images[:1], indices=[0]).images) == 1  # the parent's still works
    decoder.close()


def test_arguments_are_checked(images) -> None:
    config = DecodeConfig(num_threads=1)
    with pytest.raises(ValueError, match="hw_decoder_load"):
        DALIDecoder(config, hw_decoder_load=1.5)
    with pytest.raises(ValueError, match="batch_size_hint"):
        DALIDecoder(config, batch_size_hint=0)
    with pytest.raises(ValueError, match="device_memory_padding"):
        DALIDecoder(config, device_memory_padding=-1)
    with pytest.raises(ValueError, match=r"config\.device is 'cpu'"):
        DALIDecoder(config, device_id=0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        DALIDecoder(DecodeConfig(device="meta"))
    with DALIDecoder(config, batch_size_hint=2) as d:
        with pytest.raises(ValueError, match="indices"):
            d.decode(images[:2], indices=[0])
        with pytest.raises(ValueError, match="names"):
            d.decode(images[:2], indices=[0, 1], names=["a"])


@pytest.mark.skipif(HAS_CUDA, reason="checks the error given when there is no CUDA device")
def test_gpu_without_a_cuda_device_says_what_to_do() -> None:
    with pytest.raises(BackendUnavailableError, match="nvidia-dali-cuda130") as info:
        DALIDecoder(DecodeConfig(device="cuda"))
    assert "device_id=None" in str(info.value)
    with pytest.raises(BackendUnavailableError, match="cuda:1"):
        DALIDecoder(DecodeConfig(device="cuda:1"), device_id=1)


def test_missing_dali_names_the_package(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # what an absent package looks like
    with pytest.raises(BackendUnavailableError, match=r"pip install nvidia-dali-cuda130"):
        DALIDecoder(DecodeConfig())


def test_importing_the_module_does_not_import_dali() -> None:
    code = "import sys, fastload.decode.dali; print('nvidia.dali' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- GPU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "transform", [None, TrainPreset(), lambda x: x], ids=["none", "preset", "callable"]
)
def test_the_gpu_graph_is_valid_dali_without_a_gpu(transform) -> None:
    """Defining the GPU graph checks every GPU-only argument against DALI's operator schemas
    and places the operators; only building and running it needs a GPU."""
    with DALIDecoder(DecodeConfig(transform=transform, num_threads=1), batch_size_hint=2) as d:
        pipe, output = d._define(torch.device("cuda", 0))
        assert output.device == "gpu"
        del pipe


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
# DALI warns (category Warning) at a GPU pipeline's build when NPP or cuFFT are not installed;
# neither is used here.
@pytest.mark.filterwarnings("ignore:nvidia-dali-cuda.* is no longer shipped:Warning")
def test_gpu_pipeline_matches_the_cpu_pipeline(images) -> None:
    for preset in (EvalPreset(), TrainPreset()):
        outs = {}
        for device in ("cpu", "cuda:0"):
            config = DecodeConfig(transform=preset, seed=1, device=device, num_threads=2)
            with DALIDecoder(config, batch_size_hint=4) as d:
                outs[device] = d.decode(images, indices=positions(7), epoch=1).images
        assert outs["cuda:0"].device == torch.device("cuda", 0)
        # nvJPEG's IDCT differs from libjpeg-turbo's by a level or so.
        err = ((outs["cuda:0"].cpu() - outs["cpu"]) * STD * 255).abs()
        assert float(err.mean()) < 1.0
    with DALIDecoder(DecodeConfig(device="cuda", num_threads=2)) as d:
        batch = d.decode(images[:2], indices=[0, 1])
    for data, img in zip(images, batch.images, strict=False):
        assert img.device.type == "cuda"
        assert float((img.cpu().float() - pillow_rgb(data).float()).abs().mean()) < 1.0


def test_decode_benchmark_runs_the_dali_peers(tmp_path: Path) -> None:
    from fastload.bench.components import decode_bench

    peers = ("fastload DALI backend, CPU graph", "DALI's own CPU pipeline")
    config = decode_bench.DecodeBenchConfig(
        images=10, batch_size=4, size=32, repeats=1, decoders=False, systems=peers
    )
    report = decode_bench.run(tmp_path, config)
    assert {(r.case.split()[0], r.system) for r in report.rows} == {
        (preset, peer) for preset in ("train", "eval") for peer in peers
    }
    assert all(r.items == 10 for r in report.rows)
