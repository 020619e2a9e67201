"""The CPU decode backend: a native batch transform for JPEGs, simplejpeg (libjpeg-turbo) +
torch ops on a pool of threads for the rest.

With a preset and results on the CPU, a batch's JPEGs go through
``fastload.decode.native_jpeg`` where it was built: one call reads every header, numpy
draws every box (``params.augments``), one call decodes, crops, resizes, flips and
normalizes every sample on C++ threads with the GIL released (on 2 cores as fast as the
Python path; on 16, 4.8x it: the Python path was bound by the GIL). What it cannot do
(other formats, CMYK, corrupt data) takes the Python path below, which decodes it or names
it in the error. The Python path, per sample, on a worker thread:

1. read the size from the header (no decoding) and ask
   :func:`fastload.decode.params.augment_for` for the crop box and flip, as every backend does;
2. decode, DCT-scaled where the preset allows it: libjpeg-turbo can decode at 1/2, 1/4 or 1/8
   size for less work, and the largest reduction that still leaves the crop box at least the
   output size is taken (the result is a downscale of the box anyway);
3. crop (a slice), resize to the output size with ``interpolate(mode="bilinear",
   antialias=True)``, flip, normalize into the batch's row, on ``config.device``.

Choices, each measured on a 2-core VM (see ``fastload.bench.components.decode_bench``):

* simplejpeg decodes these JPEGs (~105 KB, quality 90) 1.17x as fast as Pillow and level
  with OpenCV (all three are libjpeg-turbo underneath); it also reads the size from the
  header without decoding, which the crop box needs first, and is a small wheel. Pillow
  handles every other format and the JPEGs simplejpeg cannot read.
* Threads, not processes: simplejpeg and torch release the GIL for nearly all of the work, so
  two threads run about 1.85x one thread; the same decoder with one thread in each of two
  DataLoader worker processes, which move the pixels between processes, made 0.75x the
  images per second.
* On the CPU the resize runs on uint8 (torch's vectorized path, 4x the float32 one) and rounds
  to uint8 as DALI's resize does; on a GPU it runs on float32 and rounds the same way. The two
  differ by at most one level of 255.
* Truncated or corrupt JPEGs are errors (``DecodeError``, or skipped with
  ``on_error="skip"``): libjpeg would "decode" them, filling missing rows with gray or
  garbage after losing sync, and such an image silently poisons training. Its "corrupt
  data" warning is the same for harmless stray bytes before the end marker as for data that
  lost sync mid-image, so every such warning is an error. A JPEG lacking only its final
  end-of-image marker (all its pixel data present) is accepted; one cut between two scans
  (progressive, multi-scan) is not (``fastload.decode.jpeg_scans``, on both paths).
* Every path checks the size a header claims before decoding (``DecodeConfig.max_pixels``
  and the bytes a JPEG has, ``fastload.decode.limits``): a few bytes may claim 65,500².
* JPEGs simplejpeg cannot read (4:1:0, 3x1 and other unusual subsamplings) go to Pillow,
  DCT-scaled as simplejpeg and the native transform scale them (``draft``), so every path
  decodes a sample at the same scale.
"""

from __future__ import annotations

import functools
import importlib
import io
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from fastload.decode.base import (
    BackendUnavailableError,
    DecodeConfig,
    DecodedBatch,
    DecodeError,
    sample_name,
)
from fastload.decode.jpeg_scans import missing_scans
from fastload.decode.limits import DEFAULT_MAX_PIXELS, JPEG_MAX_PIXELS_PER_BYTE, oversize
from fastload.decode.native_jpeg import (
    jpeg_transform,
    native_jpeg_available,
    native_jpeg_status,
    warn_missing_once,
)
from fastload.decode.params import Augment, EvalPreset, TrainPreset, augment_for, augments

__all__ = ["MAX_PIXELS", "CPUDecoder", "decode_rgb"]

MAX_PIXELS = DEFAULT_MAX_PIXELS  # the default of DecodeConfig.max_pixels
_REDUCTIONS = (8, 4, 2)  # the DCT scalings libjpeg-turbo runs with SIMD, largest first
_EOI = b"\xff\xd9"
_KEEP_BUFFERS = 4  # batch buffers kept for reuse (a loader holds a few batches at once)
_SKIP_HINT = "pass on_error='skip' to leave such samples out of the batch"

RGBArray = npt.NDArray[np.uint8]


class _BadInput(Exception):
    """Internal: what was wrong with one sample, before it is given the sample's name."""


@functools.cache
def _simplejpeg() -> Any:
    try:  # import_module: simplejpeg ships no type information
        return importlib.import_module("simplejpeg")
    except ImportError as e:
        raise BackendUnavailableError(
            f"the CPU decode backend needs simplejpeg ({e}): pip install simplejpeg"
        ) from e


@functools.cache
def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as e:
        raise BackendUnavailableError(
            f"the CPU decode backend needs Pillow for non-JPEG images ({e}): pip install pillow"
        ) from e
    return Image


def _as_buffer(data: bytes | memoryview) -> bytes | memoryview:
    if isinstance(data, bytes):
        return data
    view = memoryview(data)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


class _Encoded:
    """One encoded image: its size from the header, then decoded (possibly DCT-scaled).

    JPEGs go to simplejpeg; anything else, and JPEGs whose header simplejpeg cannot read or
    whose colour conversion it does not support, go to Pillow.
    """

    def __init__(self, data: bytes | memoryview, max_pixels: int = MAX_PIXELS) -> None:
        self.data = _as_buffer(data)
        if len(self.data) == 0:
            raise _BadInput("the data is empty (0 bytes)")
        self._pil: Any = None
        self._jpeg_error = ""
        self.is_jpeg = bytes(self.data[:3]) == b"\xff\xd8\xff"
        jpeg_bytes = self.is_jpeg  # a JPEG, whichever library decodes it
        if self.is_jpeg:
            try:
                self.height, self.width, _, _ = _simplejpeg().decode_jpeg_header(self.data)
            except ValueError as e:  # perhaps a JPEG variant only Pillow reads
                self._jpeg_error = f"corrupt JPEG header (simplejpeg: {e}"
                self.is_jpeg = False
        if not self.is_jpeg:
            self._open_pillow()
        why = oversize(
            self.height, self.width, len(self.data), max_pixels=max_pixels, jpeg=jpeg_bytes
        )
        if why is None and jpeg_bytes and (missing := missing_scans(self.data)) is not None:
            why = (
                f"truncated JPEG: {missing}; it would decode without the missing part, so "
                "it is not used: re-fetch or remove the file"
            )
        if why is not None:
            self._close_pillow()
            raise _BadInput(why)

    def _close_pillow(self) -> None:
        if self._pil is not None:
            self._pil.close()

    def _open_pillow(self) -> None:
        image = _pillow()
        try:
            self._pil = image.open(io.BytesIO(self.data))
            self.width, self.height = self._pil.size
        except Exception as e:  # Pillow raises many types (OSError, SyntaxError, ...)
            if self._jpeg_error:
                raise _BadInput(f"{self._jpeg_error}; Pillow: {e})") from None
            why = "no image format recognised" if "cannot identify" in str(e) else str(e)
            raise _BadInput(
                f"not a decodable image ({len(self.data)} bytes starting "
                f"{bytes(self.data[:8])!r}: {why}); is it an image file (JPEG, PNG, ...)?"
            ) from None

    def _pillow_jpeg(self) -> bool:
        return self._pil is not None and self._pil.format == "JPEG"

    def reduction_for(self, box: Augment) -> int:
        """The DCT reduction for ``box`` (see :func:`_reduction`); 1 for other formats."""
        return _reduction(box) if self.is_jpeg or self._pillow_jpeg() else 1

    def decode(self, reduce: int = 1) -> RGBArray:
        """(H, W, 3) uint8 RGB, of ceil(height / reduce) x ceil(width / reduce) for JPEGs."""
        out_h, out_w = -(-self.height // reduce), -(-self.width // reduce)
        if self.is_jpeg:
            try:
                return self._decode_jpeg(out_h, out_w, reduce)
            except _UnsupportedJpeg as e:
                self._jpeg_error = f"unsupported JPEG (simplejpeg: {e}"
                self._open_pillow()
        if reduce > 1 and self._pillow_jpeg():
            # libjpeg's DCT scaling, as simplejpeg and the native transform use it: Pillow
            # takes the largest scale leaving at least this size, ceil(size / reduce).
            self._pil.draft("RGB", (self.width // reduce, self.height // reduce))
        return self._decode_pillow()

    def _decode_jpeg(self, out_h: int, out_w: int, reduce: int) -> RGBArray:
        sj = _simplejpeg()
        size = {"min_height": out_h, "min_width": out_w} if reduce > 1 else {}
        try:
            array: RGBArray = sj.decode_jpeg(self.data, colorspace="RGB", **size)
            return array
        except ValueError as e:
            message = str(e)
        if "Premature end" in message and bytes(self.data[-2:]) != _EOI:
            # All pixel data present and only the end marker missing decodes strictly with it.
            try:
                array = sj.decode_jpeg(bytes(self.data) + _EOI, colorspace="RGB", **size)
                return array
            except ValueError:
                pass
        if "Premature end" in message or "Corrupt JPEG data" in message:
            raise _BadInput(
                f"truncated or corrupt JPEG (libjpeg: {message}); it would come back with the "
                "damaged part filled in (gray or garbage), so it is not used: re-fetch or "
                "remove the file"
            )
        if "color conversion" in message or "nsupported" in message:
            raise _UnsupportedJpeg(message)
        raise _BadInput(f"undecodable JPEG ({message})")

    def _decode_pillow(self) -> RGBArray:
        im = self._pil
        try:
            im.load()
            if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
                # 16-bit grayscale: keep the top 8 bits (convert("RGB") would clip at 255).
                wide = np.asarray(im).astype(np.int64).clip(0, 65535) >> 8
                return np.repeat(wide.astype(np.uint8)[:, :, None], 3, axis=2)
            rgb = im if im.mode == "RGB" else im.convert("RGB")  # drops alpha, expands L/P/CMYK
            return np.array(rgb)  # a writable copy: torch refuses read-only arrays
        except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, ...
            fmt = im.format or "image"
            raise _BadInput(f"undecodable {fmt} ({type(e).__name__}: {e})") from None
        finally:
            im.close()


class _UnsupportedJpeg(Exception):
    """Internal: simplejpeg cannot convert this JPEG's colours; Pillow is tried instead."""


def decode_rgb(data: bytes | memoryview, reduce: int = 1) -> npt.NDArray[np.uint8]:
    """One image as (H, W, 3) uint8 RGB, as the CPU backend decodes it. ``reduce`` (2, 4, 8)
    decodes a JPEG DCT-scaled to ceil(size / reduce); other formats ignore it. Raises
    ``DecodeError`` saying what was wrong."""
    if reduce not in (1, *_REDUCTIONS):
        raise ValueError(f"reduce must be 1, 2, 4 or 8, got {reduce}")
    try:
        return _Encoded(data).decode(reduce)
    except _BadInput as e:
        raise DecodeError(str(e)) from None


def _reduction(box: Augment) -> int:
    """The largest DCT reduction (8, 4, 2, else 1) keeping ``box`` >= the output size."""
    for f in _REDUCTIONS:
        if box.crop_h >= f * box.out_h and box.crop_w >= f * box.out_w:
            return f
    return 1


def _scaled_box(
    box: Augment, height: int, width: int, h: int, w: int, reduce: int
) -> tuple[int, int, int, int]:
    """The crop box (top, bottom, left, right) in the pixels of the image of ``height`` x
    ``width`` decoded at 1/``reduce`` into ``h`` x ``w``."""
    if reduce == 1 or (h, w) == (height, width):
        return box.top, box.top + box.crop_h, box.left, box.left + box.crop_w
    sy, sx = h / height, w / width
    if (h, w) == (-(-height // reduce), -(-width // reduce)):
        sy = sx = 1 / reduce  # libjpeg maps each 8x8 block onto a (8 / reduce)^2 one exactly
    top, left = round(box.top * sy), round(box.left * sx)
    bottom = max(top + 1, min(h, round((box.top + box.crop_h) * sy)))
    right = max(left + 1, min(w, round((box.left + box.crop_w) * sx)))
    return top, bottom, left, right


@dataclass(frozen=True)
class _Job:
    """One batch: its inputs and where each sample's result goes."""

    encoded: Sequence[bytes | memoryview]
    indices: Sequence[int]
    epoch: int
    out: torch.Tensor | None  # presets: (N, 3, H, W) or (N, H, W, 3) float32
    images: list[torch.Tensor | None]  # no transform or a callable: uint8 per sample
    errors: list[str | None]


class CPUDecoder:
    """Decodes batches on the CPU (see the module docstring); results on ``config.device``.

    With a preset and results on the CPU, JPEGs go through the native batch transform
    (``fastload.decode.native_jpeg``) where it loads: ``native=None`` (the default) uses it
    then, ``True`` requires it, ``False`` keeps the Python path (for comparison). Samples it
    cannot do (other formats, CMYK, corrupt data) take the Python path, which decodes them
    or names them in the error. ``dct_scaling=False`` always decodes at full size (for
    comparison; results differ only within the resize tolerance). Threads start on first use
    and stay across batches; ``close()`` stops them. After a fork the child starts its own.
    """

    backend = "cpu"

    def __init__(
        self, config: DecodeConfig, *, dct_scaling: bool = True, native: bool | None = None
    ) -> None:
        _simplejpeg()  # fail at construction, naming the package, not on the first batch
        self.config = config
        self.dct_scaling = dct_scaling
        self.device = torch.device(config.device)
        if native and not native_jpeg_available():
            raise BackendUnavailableError(
                f"native=True, but the native JPEG transform is not available: "
                f"{native_jpeg_status()}"
            )
        preset = config.transform
        self._preset: TrainPreset | EvalPreset | None = (
            preset if isinstance(preset, TrainPreset | EvalPreset) else None
        )
        self._callable: Callable[[torch.Tensor], torch.Tensor] | None = (
            None if preset is None or self._preset is not None else preset
        )
        self._mean = self._std = torch.empty(0)
        if self._preset is not None:
            shape = (3, 1, 1) if config.layout == "NCHW" else (3,)
            # On 0-255 values: (x - 255 mean) / (255 std) == (x / 255 - mean) / std.
            mean = torch.tensor(self._preset.mean, dtype=torch.float64) * 255
            std = torch.tensor(self._preset.std, dtype=torch.float64) * 255
            self._mean = mean.to(torch.float32).reshape(shape).to(self.device)
            self._std = std.to(torch.float32).reshape(shape).to(self.device)
        self.native = (
            native is not False
            and native_jpeg_available()
            and self._preset is not None
            and self.device.type == "cpu"
        )
        self._mean_values = self._mean.flatten().tolist()  # float32 values, as torch uses them
        self._std_values = self._std.flatten().tolist()
        self._jpeg: Any = None  # the native transform, made per process on first use
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[npt.NDArray[np.float32]] = []
        self._allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
        self._pid = -1
        self._lock = threading.Lock()  # the next sample of a batch
        self._state_lock = threading.Lock()  # the pool and the buffers, if decode() races
        self._closed = False

    def write_into(
        self, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None
    ) -> None:
        """Preset batches on the CPU are written into ``allocate(shape, dtype)`` (a
        :meth:`DeviceRing.empty <fastload.loader.ring.DeviceRing.empty>` slot, pinned: the
        copy to the GPU then needs no pack) rather than the decoder's own buffers; called on
        the thread that calls ``decode``. None: back to its own."""
        self._allocate = allocate

    def _executor(self) -> ThreadPoolExecutor:
        if self._pid not in (-1, os.getpid()):
            # A forked child: a parent thread may have held a lock at the fork, for good.
            self._lock, self._state_lock = threading.Lock(), threading.Lock()
        with self._state_lock:
            if self._closed:
                raise ValueError("decode on a closed CPUDecoder; make a new one")
            if self._pid != os.getpid():  # first use, or first use in a forked child
                if self.native:
                    self._jpeg = jpeg_transform(self.config.num_threads)
                elif self._preset is not None and self.device.type == "cpu":
                    warn_missing_once()
                self._pool = ThreadPoolExecutor(
                    self.config.num_threads,
                    thread_name_prefix="fastload-decode",
                    initializer=torch.set_num_threads,  # per thread: the pool is the parallelism
                    initargs=(1,),
                )
                self._pid = os.getpid()
            assert self._pool is not None
            return self._pool

    def decode(
        self,
        encoded: Sequence[bytes | memoryview],
        *,
        indices: Sequence[int],
        epoch: int = 0,
        names: Sequence[str] | None = None,
    ) -> DecodedBatch:
        """Decodes one batch; ``indices[i]`` is sample i's global index (its augmentation
        depends on (seed, epoch, index) only). Raises ``DecodeError`` naming the first bad
        sample, unless ``on_error="skip"``."""
        n = len(encoded)
        if len(indices) != n:
            raise ValueError(f"got {n} encoded samples but {len(indices)} indices")
        if names is not None and len(names) != n:
            raise ValueError(f"got {n} encoded samples but {len(names)} names")
        pool = self._executor()
        out = None
        if self._preset is not None:
            size = self._preset.size
            shape = (n, 3, size, size) if self.config.layout == "NCHW" else (n, size, size, 3)
            out = self._output(shape)
        job = _Job(encoded, indices, epoch, out, [None] * n, [None] * n)
        todo: Sequence[int] = range(n)
        if n and self.native:
            todo = self._decode_native(job)
        if todo:
            order = iter(todo)
            workers = min(len(todo), self.config.num_threads)
            futures: list[Future[None]] = [
                pool.submit(self._drain, job, order) for _ in range(workers)
            ]
            for future in futures:
                future.result()  # re-raises what was not a bad-input error (a bug, MemoryError)
        return self._collect(job, names)

    def _decode_native(self, job: _Job) -> list[int]:
        """The batch's JPEGs through the native transform: two calls that release the GIL and
        numpy on the whole batch in between (no Python work per sample). Returns the samples
        left to the Python path (not JPEG, too large, or not done natively)."""
        preset, out = self._preset, job.out
        assert preset is not None
        assert out is not None
        assert self._jpeg is not None
        images = job.encoded if isinstance(job.encoded, list) else list(job.encoded)
        sizes = self._jpeg.sizes(images)
        height, width = sizes[:, 0].astype(np.int64), sizes[:, 1].astype(np.int64)
        jpeg = height > 0
        table = augments(
            preset,
            np.where(jpeg, height, 1),
            np.where(jpeg, width, 1),
            seed=self.config.seed,
            epoch=job.epoch,
            indices=np.asarray(job.indices, dtype=np.int64),
        )
        reduce = np.ones(len(images), dtype=np.int64)
        if self.dct_scaling:  # the largest of 8, 4, 2 that keeps the box >= the output
            for f in reversed(_REDUCTIONS):
                fits = (table.crop_h >= f * table.out_h) & (table.crop_w >= f * table.out_w)
                reduce[fits] = f
        h, w = -(-height // reduce), -(-width // reduce)
        # What the Python path refuses before decoding, it names: too large a claim for the
        # limit or for the bytes (limits.oversize), or no end marker (jpeg_scans).
        nbytes = np.fromiter((memoryview(x).nbytes for x in images), np.int64, len(images))
        pixels = height * width
        jpeg &= pixels <= self.config.max_pixels
        jpeg &= (pixels <= 1 << 24) | (pixels <= JPEG_MAX_PIXELS_PER_BYTE * nbytes)
        for i in np.flatnonzero(jpeg):
            jpeg[i] = missing_scans(images[i]) is None  # at once when it ends with EOI
        # _scaled_box for every sample: libjpeg maps an 8x8 block onto (8 / reduce)^2 exactly.
        top = np.rint(table.top / reduce).astype(np.int64)
        left = np.rint(table.left / reduce).astype(np.int64)
        bottom = np.maximum(top + 1, np.minimum(h, np.rint((table.top + table.crop_h) / reduce)))
        right = np.maximum(left + 1, np.minimum(w, np.rint((table.left + table.crop_w) / reduce)))
        boxes = np.stack([reduce, top, bottom, left, right, table.flip], axis=1).astype(np.int32)
        boxes[~jpeg, 0] = 0  # reduce 0: the native side refuses it, the Python path takes it
        failed = self._jpeg.run(
            images,
            boxes,
            out.numpy(),
            preset.size,
            preset.size,
            self.config.layout == "NHWC",
            self._mean_values,
            self._std_values,
        )
        return [i for i, _ in failed]

    def _output(self, shape: tuple[int, int, int, int]) -> torch.Tensor:
        """A float32 batch tensor; on the CPU, memory of a batch nobody holds any more.

        Fresh memory costs a page fault per 4 KiB on first write: on the 2-core VM, ~220 us an
        image, twice the normalizing itself. A returned batch that the caller has dropped (no
        tensor, view or array refers to it any more) is written over instead.
        """
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=torch.float32, device=self.device)
        if self._allocate is not None:
            return self._allocate(shape, torch.float32)
        count = shape[0] * shape[1] * shape[2] * shape[3]
        with self._state_lock:
            buffers = self._buffers
            # Held by the list and getrefcount's argument only (no name is bound to it here).
            free = [k for k in range(len(buffers)) if sys.getrefcount(buffers[k]) == 2]
            k = next((k for k in free if buffers[k].size >= count), -1)
            if k < 0:
                if len(buffers) >= _KEEP_BUFFERS:
                    buffers.pop(free[0] if free else 0)
                buffers.append(np.empty(count, dtype=np.float32))
                k = len(buffers) - 1
            return torch.from_numpy(buffers[k][:count]).view(shape)

    def _drain(self, job: _Job, order: Any) -> None:
        """Takes the next sample until none is left; the threads share ``order``."""
        while True:
            with self._lock:
                i = next(order, None)
            if i is None:
                return
            try:
                self._one(job, i)
            except _BadInput as e:
                job.errors[i] = str(e)

    def _one(self, job: _Job, i: int) -> None:
        enc = _Encoded(job.encoded[i], self.config.max_pixels)
        preset = self._preset
        if preset is None:
            image = torch.from_numpy(enc.decode())
            if self.config.layout == "NCHW" or self._callable is not None:
                image = image.permute(2, 0, 1).contiguous()
            job.images[i] = image.to(self.device)
            return
        box = augment_for(
            preset,
            enc.height,
            enc.width,
            seed=self.config.seed,
            epoch=job.epoch,
            index=int(job.indices[i]),
        )
        reduce = enc.reduction_for(box) if self.dct_scaling else 1
        decoded = enc.decode(reduce)
        h, w = decoded.shape[:2]
        top, bottom, left, right = _scaled_box(box, enc.height, enc.width, h, w, reduce)
        crop = torch.from_numpy(decoded[top:bottom, left:right]).permute(2, 0, 1).unsqueeze(0)
        assert job.out is not None
        self._finish(crop, box, job.out[i])

    def _finish(self, crop: torch.Tensor, box: Augment, dest: torch.Tensor) -> None:
        """Resize (1, 3, h, w) uint8 to the output size, flip, normalize into ``dest``."""
        size = (box.out_h, box.out_w)
        if self.device.type == "cpu":
            # uint8 in, uint8 out (rounded): torch's vectorized path, 4x the float one; it
            # runs a third faster again on a channels-last copy than on the strided slice.
            resized = crop
            if tuple(crop.shape[2:]) != size:
                resized = F.interpolate(
                    crop.contiguous(memory_format=torch.channels_last),
                    size=size,
                    mode="bilinear",
                    antialias=True,
                    align_corners=False,
                )
        else:
            resized = crop.to(self.device).float()
            if tuple(crop.shape[2:]) != size:
                resized = F.interpolate(
                    resized, size=size, mode="bilinear", antialias=True, align_corners=False
                )
            resized = resized.round_().clamp_(0, 255)  # as the CPU path and DALI round
        image = resized[0]
        if box.flip:
            image = image.flip(-1)
        if self.config.layout == "NHWC":
            image = image.permute(1, 2, 0)
        # A contiguous uint8 copy first: converting while transposing is slower on this scale.
        dest.copy_(image.contiguous())
        dest.sub_(self._mean).div_(self._std)

    def _collect(self, job: _Job, names: Sequence[str] | None) -> DecodedBatch:
        kept: list[int] = []
        skipped: list[tuple[int, str]] = []
        for i, error in enumerate(job.errors):
            if error is None:
                kept.append(i)
                continue
            message = f"{sample_name(names, job.indices, i)}: {error}"
            if self.config.on_error == "raise":
                raise DecodeError(f"{message}; {_SKIP_HINT}")
            skipped.append((i, message))
        if job.out is not None:
            images: Any = job.out if not skipped else job.out[kept]
            return DecodedBatch(images, kept, skipped)
        tensors = [t for t in job.images if t is not None]
        if self._callable is None:  # each image at its own size, always a list
            return DecodedBatch(tensors, kept, skipped)
        tensors = [self._apply(t, i, job, names) for t, i in zip(tensors, kept, strict=True)]
        if tensors and all(t.shape == tensors[0].shape for t in tensors):
            return DecodedBatch(torch.stack(tensors), kept, skipped)
        return DecodedBatch(tensors, kept, skipped)

    def _apply(
        self, image: torch.Tensor, i: int, job: _Job, names: Sequence[str] | None
    ) -> torch.Tensor:
        """The user's callable, in the calling thread and in input order (its own randomness,
        if any, stays reproducible); NHWC layout permutes its (C, H, W) result."""
        assert self._callable is not None
        try:
            result = self._callable(image)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"fastload: in the transform of {sample_name(names, job.indices, i)}")
            raise
        if self.config.layout == "NHWC" and result.dim() == 3:
            result = result.permute(1, 2, 0)
        return result

    def close(self) -> None:
        """Stops the threads; idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            self._buffers, self._jpeg = [], None
        if pool is not None and self._pid == os.getpid():
            pool.shutdown(wait=True)

    def __enter__(self) -> CPUDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
