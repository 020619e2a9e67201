"""The DALI decode backend: one DALI pipeline in the main process, fed encoded bytes per batch.

Two graphs, chosen once at construction:

- GPU (``device_id`` given, or ``config.device`` is ``cuda[:k]``): ``mixed`` decoding (nvJPEG
  and, where the GPU has one, the hardware JPEG decoder), resize and normalize on the GPU; the
  result is copied on the pipeline's side stream into torch's memory (see
  :mod:`fastload.decode.dali_feed` for why) and the caller's stream waits on an event.
- CPU (``device_id=None`` and ``config.device="cpu"``): the same operators on DALI's CPU
  threads.

The crop box and flip of every sample come from :func:`fastload.decode.params.augment_for`
(never from DALI's own random operators), fed in through ``external_source``, so this backend
and the CPU backend produce the same batches. The box needs the image size before decoding;
:func:`image_size` reads it from the header (JPEG and PNG natively, other formats through
Pillow when it is installed).

The pipeline is driven by :class:`~fastload.decode.dali_feed.DALIFeeder` with a prefetch
queue of ``prefetch_depth`` (>= 2): every thread calling :meth:`DALIDecoder.decode` hands its
batch to the driver, which feeds and schedules the next batches before taking a batch's
outputs, so DALI works on batch N+1 while batch N's caller collates it (a decoder that ran one
batch at a time made a loader's 16 threads wait ~45 ms a step on it, and ran at 0.58x DALI's
own pipeline on an H200).

DALI fails a whole batch when one sample is bad and then declares its pipeline invalid. To
name the sample (and to honour ``on_error="skip"``) headers are checked up front, and when
DALI still fails the batch is split in halves on a second, synchronous pipeline (built on
the first failure) until the bad samples are found; that costs a pipeline rebuild per failed
run and happens only when a batch has one.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from fastload.decode.base import (
    BackendUnavailableError,
    DecodeConfig,
    DecodedBatch,
    DecodeError,
    sample_name,
)
from fastload.decode.dali_feed import DALIFeeder, PipelineFailed, shutdown_pipeline
from fastload.decode.jpeg_scans import missing_scans
from fastload.decode.limits import DEFAULT_MAX_PIXELS, oversize
from fastload.decode.params import EvalPreset, TrainPreset, augments

__all__ = ["INSTALL_HINT", "DALIDecoder", "image_format", "image_size"]

INSTALL_HINT = (
    "pip install nvidia-dali-cuda130 (or nvidia-dali-cuda120, matching your CUDA version; "
    "the extra is fastload[dali])"
)

# JPEG frame headers (SOF0-SOF15 less DHT C4, JPG C8 and DAC CC): they carry the image size.
_JPEG_SOF = frozenset(
    {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
)
_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_JP2_MAGIC = b"\x00\x00\x00\x0cjP  \r\n\x87\n"


def image_format(data: bytes | memoryview) -> str | None:
    """The image format the first bytes announce, among those DALI decodes; None if none.

    Only the magic number is looked at: this is the cheap first check, not a validation.
    """
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == _PNG_MAGIC:
        return "png"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "tiff"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head == _JP2_MAGIC or head[:4] == b"\xff\x4f\xff\x51":
        return "jpeg2000"
    if len(head) >= 3 and head[:1] == b"P" and head[1] in b"123456" and head[2] in b" \t\r\n":
        return "pnm"
    return None


def image_size(data: bytes | memoryview) -> tuple[int, int]:
    """(height, width) of an encoded image, read from its header without decoding.

    JPEG (the first SOF segment) and PNG (IHDR) are parsed here; other formats DALI reads
    (BMP, TIFF, WebP, JPEG 2000, PNM) go through Pillow, which also does not decode. Sizes are
    of the stored pixels: EXIF orientation is not applied (the decoders here do not apply it
    either, as ``torchvision.io.decode_jpeg`` by default). Raises ``ValueError`` saying why
    when the data is empty, not a known image, or its header is truncated or corrupt.
    """
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) == 0:
        raise ValueError("the data is empty (zero bytes)")
    fmt = image_format(view)
    if fmt is None:
        raise ValueError(f"not an image DALI reads (starts with {bytes(view[:8])!r})")
    if fmt == "jpeg":
        return _jpeg_size(view)
    if fmt == "png":
        if len(view) < 24 or view[12:16].tobytes() != b"IHDR":
            raise ValueError(f"truncated or corrupt PNG header ({len(view)} bytes)")
        width, height = struct.unpack(">II", view[16:24])
        if width == 0 or height == 0:
            raise ValueError(f"the PNG header gives a size of {width}x{height}")
        return height, width
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(
            f"reading the size of a {fmt} image needs Pillow (pip install pillow); "
            "JPEG and PNG need nothing"
        ) from None
    try:
        with Image.open(io.BytesIO(view.tobytes())) as im:
            width, height = im.size
    except Exception as e:  # Pillow raises many types for bad headers
        raise ValueError(f"unreadable {fmt} header ({e})") from None
    return height, width


def _jpeg_size(view: memoryview) -> tuple[int, int]:
    """Walk the marker segments after SOI up to the first frame header."""
    n = len(view)
    i = 2
    while True:
        if i + 1 >= n:
            raise ValueError(f"truncated JPEG: no frame header (SOF) in its {n} bytes")
        if view[i] != 0xFF:
            raise ValueError(f"corrupt JPEG header: no marker at byte {i}")
        marker = view[i + 1]
        i += 2
        if marker == 0xFF:  # a fill byte before the marker
            i -= 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a segment
            continue
        if marker in (0xD9, 0xDA):
            raise ValueError("corrupt JPEG header: image data (SOS) or its end before any SOF")
        if i + 2 > n:
            raise ValueError(f"truncated JPEG header ({n} bytes)")
        length = (view[i] << 8) | view[i + 1]
        if length < 2:
            raise ValueError(f"corrupt JPEG header: segment length {length} at byte {i}")
        if marker in _JPEG_SOF:
            if i + 7 > n:
                raise ValueError(f"truncated JPEG frame header ({n} bytes)")
            height = (view[i + 3] << 8) | view[i + 4]
            width = (view[i + 5] << 8) | view[i + 6]
            if height == 0 or width == 0:
                raise ValueError(f"the JPEG frame header gives a size of {width}x{height}")
            return height, width
        i += length


def _check_header(
    data: bytes | memoryview, *, need_size: bool, max_pixels: int = DEFAULT_MAX_PIXELS
) -> tuple[int, int] | None:
    """The cheap up-front check: (height, width) when asked for or when it costs nothing
    (JPEG, PNG), checked against ``max_pixels`` and, for a JPEG, its bytes and scans (as
    the CPU backend checks them); otherwise only the magic number is checked. Raises
    ValueError saying why."""
    fmt = image_format(data) if len(data) else None
    if not (need_size or fmt in ("jpeg", "png") or fmt is None):
        return None
    size = image_size(data)
    nbytes = memoryview(data).nbytes
    why = oversize(*size, nbytes, max_pixels=max_pixels, jpeg=fmt == "jpeg")
    if why is not None:
        raise ValueError(why)
    if fmt == "jpeg" and (missing := missing_scans(data)) is not None:
        raise ValueError(f"truncated JPEG: {missing}")
    return size


def _import_dali() -> tuple[Any, Any, Any]:
    """nvidia.dali, its fn and types modules, imported only when a DALI decoder is made."""
    try:
        dali = importlib.import_module("nvidia.dali")
        fn = importlib.import_module("nvidia.dali.fn")
        types = importlib.import_module("nvidia.dali.types")
    except (ImportError, OSError) as e:  # OSError: a wheel whose shared libraries do not load
        raise BackendUnavailableError(
            f"decode='dali' needs NVIDIA DALI, which could not be imported ({e}); {INSTALL_HINT}"
        ) from e
    return dali, fn, types


def _resolve_device(device: str, device_id: int | None, dali: Any) -> torch.device:
    """Where decoding runs and batches land: the CPU, or ``cuda:<device_id>``."""
    want = torch.device(device)
    if want.type not in ("cpu", "cuda"):
        raise ValueError(f"the DALI backend decodes to 'cpu' or 'cuda[:k]', got device={device!r}")
    if device_id is None:
        if want.type == "cpu":
            return want
        # Plain "cuda" means torch's current device.
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device_id = want.index if want.index is not None else current
    elif want.type == "cpu":
        raise ValueError(
            f"device_id={device_id} asks for GPU decoding but config.device is 'cpu'; "
            f"set config.device='cuda:{device_id}', or device_id=None for DALI's CPU pipeline"
        )
    elif want.index is not None and want.index != device_id:
        raise ValueError(f"device_id={device_id} contradicts config.device={device!r}")
    if device_id < 0:
        raise ValueError(f"device_id must be >= 0, got {device_id}")
    dali_gpus = int(dali.backend.GetCUDADeviceCount())
    torch_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if min(dali_gpus, torch_gpus) <= device_id:
        raise BackendUnavailableError(
            f"DALI GPU decoding on cuda:{device_id} needs that CUDA device, but DALI sees "
            f"{dali_gpus} and torch sees {torch_gpus} (torch {torch.__version__}). Use "
            "device_id=None with config.device='cpu' for DALI's CPU pipeline, or on a GPU "
            f"machine install a CUDA build of torch and {INSTALL_HINT}"
        )
    return torch.device("cuda", device_id)


def _dali_reason(error: BaseException) -> str:
    """The informative line of a DALI pipeline error (they run to a dozen lines)."""
    # DALI's "sample #k" counts within its own run, which would mislead next to our names.
    text = re.sub(r"\s*sample #\d+", "", str(error))
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if "no longer valid" not in ln and "Critical error" not in ln]
    if "encountered:" in lines:
        after = lines[lines.index("encountered:") + 1 :]
        if after:
            return after[0].rstrip(" :")
    return lines[-1].rstrip(" :") if lines else type(error).__name__


def _is_data_error(error: BaseException) -> bool:
    """Whether a failed run can be blamed on the samples (not on memory or the device)."""
    text = str(error).lower()
    return not any(s in text for s in ("out of memory", "cuda error", "cudaerror", "cuda_error"))


class DALIDecoder:
    """Decodes batches of encoded images with NVIDIA DALI (see the module docstring).

    ``device_id``: the GPU to decode on (None: ``config.device`` decides; "cpu" gives DALI's
    CPU pipeline). ``batch_size_hint``: the pipeline's maximum batch; smaller batches are fed
    as they are, larger ones in several runs. ``prefetch_depth``: runs in DALI's queue (>= 2).
    ``thread_nice``: the pipeline's threads run this many steps below the constructing
    thread's CPU priority (a loader's ``thread_nice``). The remaining arguments tune the ``mixed``
    decoder and are ignored by the CPU pipeline: ``hw_decoder_load`` (share of JPEGs sent to
    the hardware decoder), ``device_memory_padding`` / ``host_memory_padding`` (bytes
    preallocated per thread for nvJPEG, which avoids reallocations on large images) and
    ``preallocate_width_hint`` / ``preallocate_height_hint`` (for the hardware decoder).

    Make one per process, in the main process (a DALI pipeline owns threads and, on the GPU,
    device memory; never one per DataLoader worker). ``decode`` may be called from several
    threads at once: their batches queue for the one pipeline (``prefetch_depth`` runs in
    DALI's queue) and each caller gets its own.
    """

    backend = "dali"

    def __init__(
        self,
        config: DecodeConfig,
        *,
        device_id: int | None = None,
        hw_decoder_load: float = 0.65,
        batch_size_hint: int = 256,
        device_memory_padding: int = 16 << 20,
        host_memory_padding: int = 8 << 20,
        preallocate_width_hint: int = 0,
        preallocate_height_hint: int = 0,
        prefetch_depth: int = 2,
        thread_nice: int = 0,
    ) -> None:
        if prefetch_depth < 2:
            raise ValueError(f"prefetch_depth must be >= 2, got {prefetch_depth}")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise ValueError(f"hw_decoder_load must be within [0, 1], got {hw_decoder_load}")
        if batch_size_hint < 1:
            raise ValueError(f"batch_size_hint must be >= 1, got {batch_size_hint}")
        for name, value in (
            ("device_memory_padding", device_memory_padding),
            ("host_memory_padding", host_memory_padding),
            ("preallocate_width_hint", preallocate_width_hint),
            ("preallocate_height_hint", preallocate_height_hint),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.config = config
        self._dali, self._fn, self._types = _import_dali()
        self.device = _resolve_device(config.device, device_id, self._dali)
        self.max_batch_size = batch_size_hint
        transform = config.transform
        self._preset: TrainPreset | EvalPreset | None = (
            transform if isinstance(transform, TrainPreset | EvalPreset) else None
        )
        self._callable: Callable[[torch.Tensor], torch.Tensor] | None = (
            None if transform is None or self._preset is not None else transform
        )
        self._mixed_options = {  # GPU-only: the CPU decoder has no such settings
            "hw_decoder_load": hw_decoder_load,
            "device_memory_padding": device_memory_padding,
            "host_memory_padding": host_memory_padding,
            "preallocate_width_hint": preallocate_width_hint,
            "preallocate_height_hint": preallocate_height_hint,
            # nvJPEG upsamples chroma differently from libjpeg-turbo unless asked; this keeps
            # GPU output close to the CPU backends'.
            "jpeg_fancy_upsampling": True,
        }
        self.prefetch_depth = prefetch_depth
        self._lock = threading.Lock()  # the synchronous pipeline that isolates bad samples
        self._pid = os.getpid()
        self._pipe: Any = None  # that pipeline, built on the first failed run
        self._closed = False
        stream = None
        if self._gpu:
            cuda: Any = torch.cuda  # its Stream constructor is untyped
            stream = cuda.Stream(device=self.device)
        self._feeder = DALIFeeder(
            lambda: self._build(self.prefetch_depth),
            self._to_torch,
            depth=prefetch_depth,
            stream=stream,
            name="fastload-dali-feed",
            nice=thread_nice,
        )

    # -- the pipeline ------------------------------------------------------------------------

    @property
    def _gpu(self) -> bool:
        return self.device.type == "cuda"

    def _build(self, depth: int = 1) -> Any:
        pipe, _ = self._define(self.device, depth)
        pipe.build()
        return pipe

    def _define(self, device: torch.device, depth: int = 1) -> tuple[Any, Any]:
        """The pipeline for ``device``, not yet built, and its output node.

        Inputs are named external sources fed per batch. Kept apart from the build so that
        the GPU graph can be checked against DALI's operator schemas on a machine without GPU.
        """
        dali, fn, types = self._dali, self._fn, self._types
        gpu = device.type == "cuda"
        pipe = dali.Pipeline(
            batch_size=self.max_batch_size,
            num_threads=self.config.num_threads,
            device_id=device.index if gpu else None,
            seed=self.config.seed,  # nothing random in the graph; set for reproducibility
            prefetch_queue_depth=depth,  # the feeder's queue; 1 for the isolating pipeline
            # The default executor allocates outputs per run and keeps them alive while they
            # are referenced, so CPU outputs go to torch through DLPack without a copy.
            exec_dynamic=True,
        )
        decoder: dict[str, Any] = {
            "output_type": types.RGB,  # grayscale, CMYK, alpha -> 3 channels
            "adjust_orientation": False,  # boxes are in stored pixels (see image_size)
        }
        if gpu:
            decoder.update(device="mixed", **self._mixed_options)  # GPU-only
        else:
            decoder.update(device="cpu")
        with pipe:
            encoded = fn.external_source(name="encoded", device="cpu", dtype=types.UINT8, ndim=1)
            if self._preset is None:
                images = fn.decoders.image(encoded, **decoder)
                if self.config.layout == "NCHW" or self._callable is not None:
                    images = fn.transpose(images, perm=[2, 0, 1], output_layout="CHW")
            else:
                preset = self._preset
                anchor = fn.external_source(name="anchor", dtype=types.INT32, ndim=1)
                shape = fn.external_source(name="shape", dtype=types.INT32, ndim=1)
                mirror = fn.external_source(name="mirror", dtype=types.INT32, ndim=0)
                # Decodes only the box where the format allows (ROI decoding): measured as
                # fast as or faster than decode + fn.slice on the CPU, with identical pixels.
                images = fn.decoders.image_slice(encoded, anchor, shape, axis_names="HW", **decoder)
                # Float output keeps resize from rounding to uint8 before normalizing, which
                # keeps it within ~0.01 of torch's antialiased bilinear on average.
                images = fn.resize(
                    images,
                    resize_x=preset.size,
                    resize_y=preset.size,
                    interp_type=types.INTERP_LINEAR,
                    antialias=True,
                    dtype=types.FLOAT,
                )
                images = fn.crop_mirror_normalize(
                    images,
                    mirror=mirror,
                    mean=[m * 255.0 for m in preset.mean],
                    std=[s * 255.0 for s in preset.std],
                    dtype=types.FLOAT,
                    output_layout="CHW" if self.config.layout == "NCHW" else "HWC",
                )
            pipe.set_outputs(images)
        return pipe, images

    def _rebuild(self) -> None:
        """After a failed run DALI declares the pipeline invalid: replace it."""
        old, self._pipe = self._pipe, None
        _shutdown(old)
        self._pipe = self._build()

    def _inputs(self, arrays: list[np.ndarray], boxes: np.ndarray) -> dict[str, Any]:
        """One run's external-source batches. ``arrays``: views of the encoded bytes (DALI
        copies them once, in C++, when fed); ``boxes``: (n, 5) int32 rows of top, left,
        crop_h, crop_w, flip (with a preset)."""
        inputs: dict[str, Any] = {"encoded": arrays}
        if self._preset is not None:
            inputs["anchor"] = np.ascontiguousarray(boxes[:, 0:2])
            inputs["shape"] = np.ascontiguousarray(boxes[:, 2:4])
            inputs["mirror"] = np.ascontiguousarray(boxes[:, 4])
        return inputs

    def _to_torch(self, outputs: Any) -> Any:
        """One run's output as torch: a batch tensor with a preset, else a list. On the CPU
        DALI's memory itself (DLPack); on a GPU a copy into torch's memory, on the current
        stream (the feeder's), which DALI's outputs are ordered on."""
        (out,) = outputs
        if self._preset is None:
            images = [from_dlpack(out[i]) for i in range(len(out))]
            return [t.clone() for t in images] if self._gpu else images
        if out.is_dense_tensor():
            batch = from_dlpack(out.as_tensor())
            return batch.clone() if self._gpu else batch
        return torch.stack([from_dlpack(out[i]) for i in range(len(out))])

    def _run(self, arrays: list[np.ndarray], boxes: np.ndarray) -> Any:
        """One run on the synchronous pipeline (isolating bad samples); the output as torch.
        Rare, so simple: on a GPU the host waits for the copy out of DALI's memory."""
        if self._pipe is None:  # the first failure, or a rebuild after one failed
            self._pipe = self._build()
        pipe = self._pipe
        for name, data in self._inputs(arrays, boxes).items():
            pipe.feed_input(name, data)
        outputs = pipe.run()
        images = self._to_torch(outputs)
        if self._gpu:
            torch.cuda.current_stream(self.device).synchronize()
        return images

    def _run_isolating(
        self,
        positions: list[int],
        arrays: list[np.ndarray],
        boxes: np.ndarray,
        fail: Callable[[int, str], None],
    ) -> list[tuple[list[int], Any]]:
        """Runs ``positions``; if DALI fails, halves the batch until each bad one is found.

        Returns the decoded pieces in input order as (positions, output); ``fail`` is told of
        each bad sample (it raises under ``on_error="raise"``).
        """
        try:
            return [(positions, self._run(arrays, boxes))]
        except RuntimeError as e:
            if not _is_data_error(e):
                self._rebuild()
                raise
            self._rebuild()
            if len(positions) == 1:
                fail(positions[0], f"DALI could not decode it ({_dali_reason(e)})")
                return []
        half = len(positions) // 2
        return self._run_isolating(
            positions[:half], arrays[:half], boxes[:half], fail
        ) + self._run_isolating(positions[half:], arrays[half:], boxes[half:], fail)

    def _boxes(self, sizes: list[tuple[int, int]], indices: list[int], epoch: int) -> np.ndarray:
        """(n, 5) int32 rows of top, left, crop_h, crop_w, flip: what ``augment_for`` gives each
        sample, drawn for the whole batch at once (per sample it cost ~10 us of Python)."""
        if self._preset is None or not indices:
            return np.zeros((len(indices), 5), np.int32)
        heights, widths = zip(*sizes, strict=True)
        table = augments(
            self._preset, heights, widths, seed=self.config.seed, epoch=epoch, indices=indices
        )
        columns = (table.top, table.left, table.crop_h, table.crop_w, table.flip)
        return np.stack([np.asarray(c, dtype=np.int32) for c in columns], axis=1)

    # -- the Decoder protocol -----------------------------------------------------------------

    def decode(
        self,
        encoded: Sequence[bytes | memoryview],
        *,
        indices: Sequence[int],
        epoch: int = 0,
        names: Sequence[str] | None = None,
    ) -> DecodedBatch:
        """Decodes one batch (any size; see ``batch_size_hint``).

        Presets give one float32 tensor (N, 3, size, size) (NHWC with ``layout="NHWC"``);
        ``transform=None`` a list of uint8 (3, H, W) tensors ((H, W, 3) with NHWC); a callable
        transform a list of what it returns for each uint8 (3, H, W) image. Images are on
        ``self.device``. Bad samples raise :class:`DecodeError` naming them, or are left out
        and listed in ``skipped`` with ``on_error="skip"``.
        """
        n = len(encoded)
        if len(indices) != n:
            raise ValueError(f"got {n} samples but {len(indices)} indices")
        if names is not None and len(names) != n:
            raise ValueError(f"got {n} samples but {len(names)} names")
        skipped: list[tuple[int, str]] = []

        def fail(i: int, reason: str) -> None:
            if self.config.on_error == "raise":
                raise DecodeError(
                    f"{sample_name(names, indices, i)} cannot be decoded: {reason}. Check or "
                    "re-fetch that file, or pass on_error='skip' to leave such samples out"
                )
            skipped.append((i, reason))

        # Headers and boxes before taking the lock: a loader's other threads prepare their
        # batches while this one runs the pipeline.
        positions: list[int] = []
        arrays: list[np.ndarray] = []
        sizes: list[tuple[int, int]] = []
        for i, data in enumerate(encoded):
            try:
                size = _check_header(
                    data, need_size=self._preset is not None, max_pixels=self.config.max_pixels
                )
            except ValueError as e:
                fail(i, str(e))
                continue
            positions.append(i)
            arrays.append(np.frombuffer(data, dtype=np.uint8))
            if size is not None:
                sizes.append(size)
        boxes = self._boxes(sizes, [int(indices[i]) for i in positions], epoch)
        if self._closed:
            raise ValueError("this DALIDecoder is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"this DALIDecoder was made in process {self._pid} and cannot run in a "
                f"forked child ({os.getpid()}, e.g. a DataLoader worker): its pipeline's "
                "threads did not survive the fork. Decode in the main process"
            )
        step = self.max_batch_size
        chunks = [slice(a, a + step) for a in range(0, len(positions), step)]
        # Every run of the batch queued at once: DALI works on the next while one is taken.
        futures = [self._feeder.submit(self._inputs(arrays[c], boxes[c])) for c in chunks]
        pieces: list[tuple[list[int], Any]] = []
        for c, future in zip(chunks, futures, strict=True):
            try:
                fed = future.result()
            except PipelineFailed as e:
                if not _is_data_error(e.error):
                    raise e.error from None
                with self._lock:  # find the bad samples on the synchronous pipeline
                    pieces += self._run_isolating(positions[c], arrays[c], boxes[c], fail)
                continue
            if fed.ready is not None:  # the caller's stream waits for the copy, not the host
                caller = torch.cuda.current_stream(self.device)
                caller.wait_event(fed.ready)
                # Made on the feeder's stream: not reused while the caller's stream reads it.
                for t in fed.value if isinstance(fed.value, list) else [fed.value]:
                    t.record_stream(caller)
            pieces.append((positions[c], fed.value))
        skipped.sort()
        kept = [p for piece_positions, _ in pieces for p in piece_positions]
        if self._preset is not None:
            outputs = [out for _, out in pieces]
            if len(outputs) == 1:
                images: Any = outputs[0]
            elif outputs:
                images = torch.cat(outputs)
            else:
                side = self._preset.size
                shape = (0, 3, side, side) if self.config.layout == "NCHW" else (0, side, side, 3)
                images = torch.empty(shape, dtype=torch.float32, device=self.device)
            return DecodedBatch(images=images, kept=kept, skipped=skipped)
        image_list: list[torch.Tensor] = [img for _, out in pieces for img in out]
        if self._callable is not None:
            image_list = [self._callable(img) for img in image_list]
        return DecodedBatch(images=image_list, kept=kept, skipped=skipped)

    def close(self) -> None:
        """Stops the pipeline's threads and frees its buffers; safe to call twice.

        Tensors already returned stay valid (they hold their own reference to the memory).
        """
        with self._lock:
            self._closed = True
            pipe, self._pipe = self._pipe, None
        if os.getpid() != self._pid:
            # A forked child: shutting down (even garbage-collecting) the parent's pipeline
            # waits forever on threads that were not copied. Keep it alive, untouched.
            _INHERITED.extend((pipe, self._feeder))
            return
        self._feeder.close()
        _shutdown(pipe)

    def __getstate__(self) -> object:
        raise TypeError(
            "a DALIDecoder cannot be sent to another process: make it in the process that "
            "decodes (the main one, never a DataLoader worker)"
        )

    def __enter__(self) -> DALIDecoder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"max_batch_size={self.max_batch_size}"
        return f"DALIDecoder(device={str(self.device)!r}, {state})"


_INHERITED: list[Any] = []  # pipelines (and feeders) a forked child must never shut down
_shutdown = shutdown_pipeline
