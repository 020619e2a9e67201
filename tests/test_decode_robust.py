"""Hostile and unusual JPEGs on every decode path: the native transform, simplejpeg/Pillow,
and DALI's up-front header check.

* a progressive or multi-scan JPEG cut exactly between two scans is an error (libjpeg
  decodes it without a word, with the later scans' detail or colour missing);
* a header claiming more pixels than ``max_pixels``, or far more than its bytes can hold,
  is refused before anything is allocated;
* JPEGs with subsamplings simplejpeg cannot read (4:1:0, 3x1) decode at the same DCT scale
  on both paths.

The files are generated here (Pillow) or committed under tests/fixtures/jpeg (made with
libjpeg-turbo's cjpeg and jpegtran: ``cjpeg -sample 4x2,1x1,1x1``, ``-sample 3x1,1x1,1x1``,
and ``jpegtran -scans`` with one scan per component).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from fastload.decode.base import DecodeConfig, DecodeError
from fastload.decode.cpu import CPUDecoder
from fastload.decode.dali import _check_header
from fastload.decode.native_jpeg import native_jpeg_available, native_jpeg_status
from fastload.decode.params import EvalPreset, TrainPreset

FIXTURES = Path(__file__).parent / "fixtures" / "jpeg"


@pytest.fixture(params=["native", "python"])
def native(request: pytest.FixtureRequest) -> bool:
    if request.param == "native" and not native_jpeg_available():
        if "disabled" in native_jpeg_status():
            pytest.skip(native_jpeg_status())
        pytest.fail(f"the native JPEG transform did not load: {native_jpeg_status()}")
    return bool(request.param == "native")


def image(seed: int, h: int, w: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack(
        [128 + 60 * np.sin(x / 9), 128 + 60 * np.cos(y / 7), 128 + 50 * np.sin((x + y) / 11)], -1
    )
    return (base + rng.normal(0, 8, base.shape)).clip(0, 255).astype(np.uint8)


def jpeg(h: int, w: int, **kw: Any) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image(h + w, h, w)).save(out, "JPEG", quality=90, **kw)
    return out.getvalue()


def scan_starts(data: bytes) -> list[int]:
    """Offsets of the SOS markers (0xFF 0xDA appears nowhere else: entropy data stuffs 0xFF)."""
    return [i for i in range(len(data) - 1) if data[i] == 0xFF and data[i + 1] == 0xDA]


def run(native: bool, data: list[bytes], transform: Any, **config: Any) -> Any:
    with CPUDecoder(DecodeConfig(transform=transform, **config), native=native) as dec:
        return dec.decode(data, indices=list(range(len(data))), names=[f"d/{i}.jpg" for i in data])


def run_named(native: bool, data: list[bytes], transform: Any, **config: Any) -> Any:
    names = [f"shard-ü/{i}.jpg" for i in range(len(data))]  # names are UTF-8
    with CPUDecoder(DecodeConfig(transform=transform, **config), native=native) as dec:
        return dec.decode(data, indices=list(range(len(data))), names=names)


TRANSFORMS = [None, EvalPreset(size=32, resize=36), TrainPreset(size=32)]


# --- cut between two scans ------------------------------------------------------------------


def cut_files() -> list[tuple[str, bytes]]:
    progressive = jpeg(96, 128, progressive=True)
    sequential = (FIXTURES / "sequential_three_scans.jpg").read_bytes()
    cuts = [(f"progressive@{at}", progressive[:at]) for at in scan_starts(progressive)[1:]]
    cuts += [(f"sequential@{at}", sequential[:at]) for at in scan_starts(sequential)[1:]]
    return cuts


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["none", "eval", "train"])
def test_a_jpeg_cut_between_two_scans_is_an_error_naming_the_sample(
    native: bool, transform: Any
) -> None:
    for what, data in cut_files():
        with pytest.raises(DecodeError) as info:
            run_named(native, [jpeg(40, 40), data], transform)
        message = str(info.value)
        assert message.startswith("sample 1 (shard-ü/1.jpg): truncated JPEG"), (what, message)
        assert "re-fetch or remove" in message


def test_with_skip_a_cut_jpeg_is_left_out_and_the_rest_kept(native: bool) -> None:
    good = [jpeg(60, 70), jpeg(64, 64, progressive=True)]
    cut = cut_files()[0][1]
    batch = run_named(native, [good[0], cut, good[1]], EvalPreset(size=32), on_error="skip")
    assert batch.kept == [0, 2]
    assert "truncated JPEG" in batch.skipped[0][1]
    alone = run_named(native, good, EvalPreset(size=32)).images
    assert torch.equal(batch.images, alone)


@pytest.mark.parametrize("name", ["progressive", "sequential"])
def test_a_multi_scan_jpeg_missing_only_its_end_marker_still_decodes(
    native: bool, name: str
) -> None:
    if name == "progressive":
        whole = jpeg(96, 128, progressive=True)
    else:
        whole = (FIXTURES / "sequential_three_scans.jpg").read_bytes()
    assert whole.endswith(b"\xff\xd9")
    got = run(native, [whole[:-2], whole], EvalPreset(size=32)).images
    assert torch.equal(got[0], got[1])


def test_dalis_header_check_refuses_the_same_cuts() -> None:
    for what, data in cut_files():
        with pytest.raises(ValueError, match="truncated JPEG"):
            _check_header(data, need_size=True)
        assert what
    whole = jpeg(96, 128, progressive=True)
    assert _check_header(whole[:-2], need_size=True) == (96, 128)


# --- headers claiming too much ----------------------------------------------------------------


def claiming(h: int, w: int, *, progressive: bool = True) -> bytes:
    """A small valid JPEG whose frame header is rewritten to claim h x w."""
    raw = bytearray(jpeg(16, 16, progressive=progressive))
    sof = raw.index(b"\xff\xc2" if progressive else b"\xff\xc0")
    raw[sof + 5 : sof + 9] = struct.pack(">HH", h, w)
    return bytes(raw)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["none", "eval", "train"])
@pytest.mark.parametrize("side", [65_500, 16_000])
def test_a_tiny_jpeg_claiming_a_huge_image_is_refused_before_decoding(
    native: bool, transform: Any, side: int
) -> None:
    """65,500² (4.3 G pixels) is over max_pixels; 16,000² is under it but claimed by a few
    hundred bytes: both refused from the header, on every path (the 1/8-scaled size of
    65,500² is under the limit, which is how the old check let it through)."""
    bomb = claiming(side, side)
    assert len(bomb) < 3000
    with pytest.raises(DecodeError, match=r"^sample 1 \(shard-ü/1.jpg\): its header claims"):
        run_named(native, [jpeg(40, 40), bomb], transform)
    batch = run_named(native, [jpeg(40, 40), bomb], transform, on_error="skip")
    assert batch.kept == [0]
    assert f"{side}x{side}" in batch.skipped[0][1]
    with pytest.raises(ValueError, match="its header claims"):
        _check_header(bomb, need_size=True)


def test_max_pixels_is_the_decoders_limit(native: bool) -> None:
    data = [jpeg(40, 50), jpeg(30, 30)]
    with pytest.raises(DecodeError, match=r"50x40 = 2,000 pixels, over max_pixels=1,000"):
        run(native, data, EvalPreset(size=16), max_pixels=1000)
    batch = run(native, data, EvalPreset(size=16), max_pixels=1000, on_error="skip")
    assert batch.kept == [1]
    assert run(native, data, None, max_pixels=2000).kept == [0, 1]
    with pytest.raises(ValueError, match="max_pixels"):
        DecodeConfig(max_pixels=0)


# --- unusual subsamplings -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["subsampling_4x2.jpg", "subsampling_3x1.jpg"])
def test_unusual_subsamplings_decode_at_the_same_scale_on_both_paths(name: str) -> None:
    """96 x 128 to an 8-pixel output: both paths decode at 1/8 (the Python path took such
    files at full size through Pillow: 21+ levels apart after the resize)."""
    if not native_jpeg_available():
        pytest.skip(native_jpeg_status())
    data = [(FIXTURES / name).read_bytes()] * 2
    transforms = (EvalPreset(size=8, resize=8), TrainPreset(size=8))
    results = [run(on, data, t).images for on in (True, False) for t in transforms]
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
    for a, b in ((results[0], results[2]), (results[1], results[3])):
        levels = (a - b).abs() * std
        assert levels.max() <= 1.01, levels.max()


def test_the_native_transform_itself_refuses_cuts_and_bombs() -> None:
    """Called directly (not through CPUDecoder, which refuses them first), the C++ transform
    checks the same: a cut between scans and a header claiming too much."""
    if not native_jpeg_available():
        pytest.skip(native_jpeg_status())
    from fastload.decode.native_jpeg import jpeg_transform

    samples = [data for _, data in cut_files()[:2]] + [claiming(65_500, 65_500)]
    samples += [claiming(16_000, 16_000), jpeg(96, 128, progressive=True)]
    boxes = np.array([[8, 0, 8, 0, 8, 0]] * len(samples), dtype=np.int32)
    out = np.zeros((len(samples), 8, 8, 3), dtype=np.float32)
    failed = dict(jpeg_transform(1).run(samples, boxes, out, 8, 8, True, [0.0] * 3, [1.0] * 3))
    assert sorted(failed) == [0, 1, 2, 3]
    assert all(failed[i].startswith("truncated JPEG") for i in (0, 1))
    assert "claims 65500x65500" in failed[2]
    assert "claims 16000x16000" in failed[3]
