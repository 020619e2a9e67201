"""Decoding JPEGs into training batches on the CPU: fastload's CPU backend against its peers.

Data: ``images`` JPEGs like TARGETS.md's (400-500 x 350-500 px, quality 90, about 105 KB,
natural-image-like content: smooth random fields at a few scales plus fine noise), in 100
ImageFolder class folders, generated once into the data directory and kept. Two cases, at
``size`` px, ``batch_size`` per batch, ``workers`` threads or processes:

* train preset: RandomResizedCrop(size, scale=(0.08, 1)) + horizontal flip + normalize;
* eval preset: resize the shorter side to ``size * 8 / 7`` (256 for 224) + center crop +
  normalize.

Every system reads the files itself (from the page cache after the warm-up) and delivers
float32 (N, 3, size, size) batches. Systems take turns within each repeat, so drift on a
shared machine hits them alike; each figure is the median of the repeats, after one
untimed warm-up epoch (which also starts worker processes). A turn ends when the
process's threads have gone quiet (:func:`settled`), not when its epoch returns: work a
pipeline goes on doing in the background (DALI's prefetch) is charged to it, not to the
system after it.

Systems (:func:`systems`; a peer joins by adding an entry there):

* ``fastload CPU``: :class:`fastload.decode.cpu.CPUDecoder`, its defaults: simplejpeg with
  DCT-scaled decoding, torch ops, ``workers`` threads in the calling process.
* ``fastload CPU, DCT scaling off``: the same, always decoding at full size.
* ``fastload CPU in DataLoader processes``: the same decoder with one thread in each of
  ``workers`` torch DataLoader worker processes, a batch per task: threads vs processes.
* ``torch DataLoader + Pillow`` (the reference of every ratio): ``workers`` DataLoader
  processes, Pillow decoding, and hand-written torch equivalents (:class:`TorchOps`) of
  RandomResizedCrop (torchvision's parameter draw), flip and normalize, or Resize +
  CenterCrop with torchvision's rounding, ordered as torchvision's v2 transforms on a uint8
  tensor: crop, resize and flip on uint8, then only the output to normalized float32.
  torchvision itself cannot be used here (no torchvision build works with this
  environment's torch 2.13), so this stands in for the canonical
  ``torchvision.datasets.ImageFolder`` + transforms pipeline.
* ``simplejpeg + torch ops, DataLoader``: the same torch ops after simplejpeg's decode, in
  ``workers`` DataLoader processes (TARGETS.md's "simplejpeg + torch ops" peer).
* ``simplejpeg + torch ops, plain loop``: the same in the calling thread, one image at a time.

Where NVIDIA DALI is installed, two more: ``fastload DALI backend, CPU graph`` (fastload's
DALI decoder on the CPU, slicing fastload's own crop boxes) and ``DALI's own CPU pipeline``
(``readers.file`` + ``decoders.image_random_crop`` + ``resize`` + ``crop_mirror_normalize``,
as DALI's users write it). DataLoader workers start from a forkserver, not forked from this
process (whose other systems' threads may be running).

Where ``spdl`` and FFmpeg's libraries are installed, ``SPDL pipeline, FFmpeg decode``:
SPDL's thread pipeline as its documentation writes image loading (``demux_image`` +
``decode_packets`` with the preset's geometry as an FFmpeg filter, ``convert_frames``,
normalized as a batch; :mod:`fastload.bench.peers.spdl_peer` cites the pages), and
``SPDL (FFmpeg)`` among the decoders alone.

A third case times the JPEG decoders alone on one thread, over 500 of the files in memory
(ratios to Pillow): Pillow, Pillow with ``draft()`` at 1/2, simplejpeg, simplejpeg at 1/2,
and, where ``opencv-python-headless`` is installed, ``cv2.imdecode`` full and
``IMREAD_REDUCED_COLOR_2``. It is why the CPU backend decodes with simplejpeg.

Command (full size: 3,000 images, median of 3)::

    .venv/bin/python benchmarks/benchmark_decode.py --out fastload-bench
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import io
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
import torch.utils.data

from fastload.bench.peers import spdl_peer
from fastload.bench.peers.peer_decoders import TorchOps, dali_train_ops
from fastload.bench.peers.spdl_peer import SPDLImages
from fastload.bench.runner import Measurement, Report, relate
from fastload.decode.base import DecodeConfig, Decoder
from fastload.decode.cpu import CPUDecoder, decode_rgb
from fastload.decode.native_jpeg import native_jpeg_status
from fastload.decode.params import EvalPreset, TrainPreset

REFERENCE = "torch DataLoader + Pillow"
CLASSES = 100

Preset = TrainPreset | EvalPreset
EpochFn = Callable[[int], int]  # (epoch) -> images delivered


@dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    images: int = 3000
    batch_size: int = 64
    workers: int = 2  # threads for fastload, processes for DataLoader peers
    size: int = 224
    repeats: int = 3
    presets: tuple[str, ...] = ("train", "eval")
    systems: tuple[str, ...] | None = None  # names from systems(); None: all
    decoders: bool = True  # also time the JPEG decoders alone, on one thread

    def __post_init__(self) -> None:
        for name in ("images", "batch_size", "workers", "size", "repeats"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        unknown = set(self.presets) - {"train", "eval"}
        if unknown or not self.presets:
            raise ValueError(f"presets must be among 'train', 'eval', got {self.presets}")

    @classmethod
    def quick(cls) -> DecodeBenchConfig:
        return cls(images=300)


# --- data -------------------------------------------------------------------------------------


def natural_image(rng: np.random.Generator, height: int, width: int) -> npt.NDArray[np.uint8]:
    """Natural-image-like content: smooth random fields at four scales plus fine noise, which
    at quality 90 compresses to TARGETS.md's ~0.5 bytes a pixel (about 105 KB at 450 x 425)."""
    img = np.full((3, height, width), 128.0, dtype=np.float32)
    for cells, amp in ((4, 60.0), (16, 30.0), (64, 20.0), (160, 12.0)):
        grid = torch.from_numpy(rng.normal(0, 1, (1, 3, cells, cells)).astype(np.float32))
        up = F.interpolate(grid, size=(height, width), mode="bicubic", align_corners=False)
        img += amp * up[0].numpy()
    img += rng.normal(0, 14.0, (1, height, width)) + rng.normal(0, 14.0 / 3, (3, height, width))
    return np.ascontiguousarray(np.clip(img, 0, 255).astype(np.uint8).transpose(1, 2, 0))


def generate(data_dir: Path, config: DecodeBenchConfig) -> list[Path]:
    """``images`` JPEGs in ImageFolder layout (``class_NNN/NNNNNN.jpg``); existing ones stay."""
    from PIL import Image

    paths = []
    for i in range(config.images):
        path = data_dir / f"class_{i % CLASSES:03d}" / f"{i:06d}.jpg"
        paths.append(path)
        if path.exists():
            continue
        rng = np.random.default_rng([i, 105])
        height, width = int(rng.integers(350, 501)), int(rng.integers(400, 501))
        path.parent.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        Image.fromarray(natural_image(rng, height, width)).save(buf, "JPEG", quality=90)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(buf.getvalue())
        os.replace(tmp, path)
    return paths


def pillow_rgb(path: Path) -> npt.NDArray[np.uint8]:
    from PIL import Image

    with Image.open(path) as im:
        return np.array(im.convert("RGB"))


def simplejpeg_rgb(path: Path) -> npt.NDArray[np.uint8]:
    return decode_rgb(path.read_bytes())


class ImageFiles(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """An ImageFolder-like dataset: decode with ``decode``, then the torch ops."""

    def __init__(
        self, paths: Sequence[Path], preset: Preset, decode: Callable[[Path], Any]
    ) -> None:
        self.paths = list(paths)
        self.decode = decode
        self.ops = TorchOps(preset, seed=torch.initial_seed() % 2**32)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.paths[i]
        return self.ops(self.decode(path)), int(path.parent.name.split("_")[1])


class FastloadBatches(torch.utils.data.Dataset[torch.Tensor]):
    """Whole batches through a one-thread CPUDecoder in each DataLoader worker process."""

    def __init__(self, paths: Sequence[Path], preset: Preset, batch_size: int) -> None:
        self.paths = list(paths)
        self.preset = preset
        self.batch_size = batch_size
        self.epoch = 0
        self._decoder: CPUDecoder | None = None

    def __len__(self) -> int:
        return -(-len(self.paths) // self.batch_size)

    def __getitem__(self, b: int) -> torch.Tensor:
        if self._decoder is None:  # one per worker process, made there
            self._decoder = CPUDecoder(DecodeConfig(transform=self.preset, num_threads=1))
        indices = range(b * self.batch_size, min(len(self.paths), (b + 1) * self.batch_size))
        data = [self.paths[i].read_bytes() for i in indices]
        images: torch.Tensor = self._decoder.decode(data, indices=indices).images
        return images


# --- systems ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    paths: list[Path]
    preset: Preset
    batch_size: int
    workers: int


@dataclass(frozen=True)
class System:
    """A system under test: ``open(workload)`` sets it up (threads, worker processes) and
    yields a function that runs one epoch over every image and returns how many it made."""

    name: str
    open: Callable[[Workload], AbstractContextManager[EpochFn]]
    note: str = ""


def _decoder_epochs(work: Workload, decoder: Decoder) -> EpochFn:
    """One epoch through a fastload decoder: read a batch's files, decode them."""

    def epoch(e: int) -> int:
        done = 0
        for start in range(0, len(work.paths), work.batch_size):
            chunk = work.paths[start : start + work.batch_size]
            data = [p.read_bytes() for p in chunk]
            indices = range(start, start + len(chunk))
            done += len(decoder.decode(data, indices=indices, epoch=e).images)
        return done

    return epoch


@contextmanager
def _fastload_threads(
    work: Workload, *, dct_scaling: bool = True, native: bool | None = None
) -> Iterator[EpochFn]:
    config = DecodeConfig(transform=work.preset, num_threads=work.workers)
    with CPUDecoder(config, dct_scaling=dct_scaling, native=native) as decoder:
        yield _decoder_epochs(work, decoder)


def _fastload_no_dct(work: Workload) -> AbstractContextManager[EpochFn]:
    return _fastload_threads(work, dct_scaling=False)


def _fastload_python_path(work: Workload) -> AbstractContextManager[EpochFn]:
    return _fastload_threads(work, native=False)


@contextmanager
def _dataloader(
    dataset: torch.utils.data.Dataset[Any], workers: int, batch_size: int | None
) -> Iterator[EpochFn]:
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        persistent_workers=True,
        multiprocessing_context="forkserver",  # see the module docstring
    )
    try:

        def epoch(e: int) -> int:
            done = 0
            for batch in loader:
                done += len(batch[0] if isinstance(batch, list | tuple) else batch)
            return done

        yield epoch
    finally:
        iterator = loader._iterator  # persistent workers: stop them now, not at exit
        if iterator is not None:
            iterator._shutdown_workers()  # type: ignore[attr-defined]


def _fastload_processes(work: Workload) -> AbstractContextManager[EpochFn]:
    dataset = FastloadBatches(work.paths, work.preset, work.batch_size)
    return _dataloader(dataset, work.workers, None)


def _dataloader_pillow(work: Workload) -> AbstractContextManager[EpochFn]:
    dataset = ImageFiles(work.paths, work.preset, pillow_rgb)
    return _dataloader(dataset, work.workers, work.batch_size)


def _dataloader_simplejpeg(work: Workload) -> AbstractContextManager[EpochFn]:
    dataset = ImageFiles(work.paths, work.preset, simplejpeg_rgb)
    return _dataloader(dataset, work.workers, work.batch_size)


@contextmanager
def _plain_loop(work: Workload) -> Iterator[EpochFn]:
    ops = TorchOps(work.preset)

    def epoch(e: int) -> int:
        done = 0
        for start in range(0, len(work.paths), work.batch_size):
            chunk = work.paths[start : start + work.batch_size]
            done += len(torch.stack([ops(simplejpeg_rgb(p)) for p in chunk]))
        return done

    yield epoch


@contextmanager
def _fastload_dali(work: Workload) -> Iterator[EpochFn]:
    from fastload.decode.dali import DALIDecoder

    config = DecodeConfig(transform=work.preset, num_threads=work.workers)
    with DALIDecoder(config, batch_size_hint=work.batch_size) as decoder:
        yield _decoder_epochs(work, decoder)


@contextmanager
def _dali_own_pipeline(work: Workload) -> Iterator[EpochFn]:
    """DALI as its users write it: its file reader, its random crop, its resize."""
    dali: Any = importlib.import_module("nvidia.dali")  # untyped at this boundary
    fn, types = dali.fn, dali.types

    preset = work.preset

    @dali.pipeline_def  # type: ignore[untyped-decorator]
    def pipeline() -> Any:
        jpegs, _ = fn.readers.file(files=[str(p) for p in work.paths], name="reader")
        if isinstance(preset, TrainPreset):
            return dali_train_ops(dali, jpegs, preset)
        images = fn.decoders.image(jpegs, device="cpu")
        images = fn.resize(images, resize_shorter=preset.resize)
        return fn.crop_mirror_normalize(
            images,
            dtype=types.FLOAT,
            output_layout="CHW",
            crop=(preset.size, preset.size),
            mean=[255 * m for m in preset.mean],
            std=[255 * s for s in preset.std],
        )

    pipe = pipeline(batch_size=work.batch_size, num_threads=work.workers, device_id=None, seed=0)
    pipe.build()
    iterations = -(-len(work.paths) // work.batch_size)

    def epoch(e: int) -> int:
        done = 0
        for _ in range(iterations):
            (out,) = pipe.run()
            done += len(out)
        return min(done, len(work.paths))  # the reader pads its last batch

    yield epoch


@contextmanager
def _spdl_pipeline(work: Workload) -> Iterator[EpochFn]:
    """SPDL as its documentation writes image loading (``spdl_peer``'s decode and batching,
    which cite the pages): its pipeline over the files, ``workers`` decode threads,
    ``demux_image(path)`` + ``decode_packets`` with the preset's geometry in FFmpeg's filter,
    ``convert_frames`` + ``to_torch``, normalized as a batch."""
    builder_mod: Any = importlib.import_module("spdl.pipeline")
    images = SPDLImages(work.preset, seed=0)
    paths = [str(p) for p in work.paths]

    def decode(i: int) -> Any:
        return images.decode(paths[i])

    def epoch(e: int) -> int:
        pipeline = (
            builder_mod.PipelineBuilder()
            .add_source(range(len(paths)))
            .pipe(decode, concurrency=work.workers, output_order="input")
            .aggregate(work.batch_size)
            .pipe(images.collate)
            .add_sink(spdl_peer.BUFFER_SIZE)
            .build(num_threads=work.workers)
        )
        done = 0
        with pipeline.auto_stop():
            for batch in pipeline:
                done += len(batch)
        return done

    yield epoch


def systems() -> list[System]:
    """Every system measured, fastload first; a peer joins by appending here."""
    found = [
        System("fastload CPU", _fastload_threads, f"native transform: {native_jpeg_status()}"),
        System("fastload CPU, Python path", _fastload_python_path, "simplejpeg + torch, threads"),
        System("fastload CPU, DCT scaling off", _fastload_no_dct, "threads"),
        System("fastload CPU in DataLoader processes", _fastload_processes, "1 thread each"),
        System(REFERENCE, _dataloader_pillow, "uint8 crop + resize torch ops"),
        System("simplejpeg + torch ops, DataLoader", _dataloader_simplejpeg, "uint8 torch ops"),
        System("simplejpeg + torch ops, plain loop", _plain_loop, "1 process"),
    ]
    if importlib.util.find_spec("nvidia") and importlib.util.find_spec("nvidia.dali"):
        found += [
            System("fastload DALI backend, CPU graph", _fastload_dali, "image_slice of our boxes"),
            System("DALI's own CPU pipeline", _dali_own_pipeline, "readers.file + its random crop"),
        ]
    if not _spdl_missing():
        found.append(System(SPDL_SYSTEM, _spdl_pipeline, "FFmpeg decode + filter, threads"))
    return found


SPDL_SYSTEM = "SPDL pipeline, FFmpeg decode"


@functools.cache
def _spdl_missing() -> str:
    return spdl_peer.spdl_missing()


# --- run --------------------------------------------------------------------------------------


def _preset(name: str, size: int) -> Preset:
    if name == "train":
        return TrainPreset(size=size)
    return EvalPreset(resize=round(size * 8 / 7), size=size)


def run(data_dir: str | os.PathLike[str], config: DecodeBenchConfig | None = None) -> Report:
    config = config or DecodeBenchConfig()
    paths = generate(Path(data_dir), config)
    nbytes = sum(p.stat().st_size for p in paths)
    chosen = [s for s in systems() if config.systems is None or s.name in config.systems]
    if config.systems is not None and len(chosen) != len(config.systems):
        known = [s.name for s in systems()]
        raise ValueError(f"systems must be among {known}, got {config.systems}")
    report = Report(
        name="decode",
        params={
            **config.__dict__,
            "data_dir": str(data_dir),
            "mean_file_bytes": nbytes // len(paths),
        },
    )
    rows: list[Measurement] = []
    for preset_name in config.presets:
        preset = _preset(preset_name, config.size)
        work = Workload(paths, preset, config.batch_size, config.workers)
        case = f"{preset_name} preset, {config.size} px, batch {config.batch_size}"
        rows += measure_case(case, work, chosen, config.repeats, nbytes)
    rows = relate(rows, REFERENCE)
    if config.decoders:
        rows += relate(_measure_decoders(paths, config.repeats), DECODER_REFERENCE)
    report.rows = rows
    return report


def measure_case(
    case: str, work: Workload, chosen: list[System], repeats: int, nbytes: int
) -> list[Measurement]:
    """Opens every system, warms each up, then times them in turns, ``repeats`` rounds."""
    times: dict[str, list[float]] = {s.name: [] for s in chosen}
    with ExitStack() as opened:
        epochs = {s.name: opened.enter_context(s.open(work)) for s in chosen}
        for name, epoch in epochs.items():
            made = epoch(0)
            settled()
            if made != len(work.paths):
                raise RuntimeError(f"{name} made {made} images of {len(work.paths)}")
        for r in range(repeats):
            for name, epoch in epochs.items():
                start = time.perf_counter()
                epoch(1 + r)
                times[name].append(settled() - start)
    return [
        Measurement(
            benchmark="decode",
            case=case,
            system=s.name,
            seconds=statistics.median(times[s.name]),
            repeats=times[s.name],
            items=len(work.paths),
            nbytes=nbytes,
            note=s.note,
        )
        for s in chosen
    ]


QUIET_WINDOW_S = 0.05
QUIET_CPU_SHARE = 0.1  # of one core: the bench's own sampling and idle threads' wake-ups
SETTLE_LIMIT_S = 10.0


def settled() -> float:
    """When this process's threads went quiet (``time.perf_counter``), waiting until they
    have. A system's turn ends there, not when its epoch returns: DALI's pipeline goes on
    filling its prefetch queue with the next epoch's batches after the last ``run()``, and
    that work fell inside the next system's timed epoch (a fastload epoch right after a
    DALI one ran at 0.6-0.8x of one after an idle second). Charged to the system that does
    it, each turn pays for as many images as it delivers: its epoch starts with the
    batches its last tail made, and its own tail makes as many for the next."""
    began = time.perf_counter()
    while True:
        wall, cpu = time.perf_counter(), time.process_time()  # every thread of the process
        time.sleep(QUIET_WINDOW_S)
        if time.process_time() - cpu < QUIET_CPU_SHARE * (time.perf_counter() - wall):
            return wall
        if wall - began > SETTLE_LIMIT_S:  # never quiet: charge the wait and go on
            return time.perf_counter()


# --- the JPEG decoders alone ------------------------------------------------------------------

DECODER_REFERENCE = "Pillow"


def decoders() -> dict[str, Callable[[bytes], object]]:
    """JPEG bytes -> RGB pixels, full size and at 1/2 (DCT scaling); OpenCV where installed."""
    from PIL import Image

    def pillow(data: bytes, reduce: int = 1) -> object:
        with Image.open(io.BytesIO(data)) as im:
            if reduce > 1:
                im.draft("RGB", (im.width // reduce, im.height // reduce))
            return np.asarray(im if im.mode == "RGB" else im.convert("RGB"))

    found: dict[str, Callable[[bytes], object]] = {
        DECODER_REFERENCE: pillow,
        "Pillow draft 1/2": lambda d: pillow(d, 2),
        "simplejpeg": decode_rgb,
        "simplejpeg 1/2": lambda d: decode_rgb(d, 2),
    }
    if not _spdl_missing():
        found["SPDL (FFmpeg)"] = _spdl_rgb
    try:
        cv2: Any = importlib.import_module("cv2")
    except ImportError:
        return found
    cv2.setNumThreads(1)

    # OpenCV 4.10+ decodes straight to RGB; older ones give BGR, converted after.
    rgb_flag = getattr(cv2, "IMREAD_COLOR_RGB", None)

    def opencv(data: bytes, flag: int) -> object:
        if rgb_flag is not None:
            rgb = (flag & ~cv2.IMREAD_COLOR) | rgb_flag  # the REDUCED flags include BGR's bit
            return cv2.imdecode(np.frombuffer(data, np.uint8), rgb)
        return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), flag), cv2.COLOR_BGR2RGB)

    found["OpenCV"] = lambda d: opencv(d, cv2.IMREAD_COLOR)
    found["OpenCV IMREAD_REDUCED 1/2"] = lambda d: opencv(d, cv2.IMREAD_REDUCED_COLOR_2)
    return found


def _spdl_rgb(data: bytes) -> object:
    """SPDL's image decode to RGB pixels (FFmpeg's decoder, its rgb24 conversion)."""
    spdl_io: Any = importlib.import_module("spdl.io")
    frames = spdl_io.decode_packets(
        spdl_io.demux_image(data), filter_desc=spdl_io.get_video_filter_desc(pix_fmt="rgb24")
    )
    return spdl_io.to_numpy(spdl_io.convert_frames(frames))


def _measure_decoders(paths: Sequence[Path], repeats: int) -> list[Measurement]:
    """Each decoder over the same encoded bytes (in memory), one thread, in turns."""
    data = [p.read_bytes() for p in paths[:500]]
    nbytes = sum(map(len, data))
    found = decoders()
    times: dict[str, list[float]] = {name: [] for name in found}
    for fn in found.values():  # warm-up
        for d in data[:20]:
            fn(d)
    for _ in range(repeats):
        for name, fn in found.items():
            start = time.perf_counter()
            for d in data:
                fn(d)
            times[name].append(time.perf_counter() - start)
    case = f"JPEG decode alone, 1 thread, {len(data)} images"
    return [
        Measurement(
            benchmark="decode",
            case=case,
            system=name,
            seconds=statistics.median(t),
            repeats=t,
            items=len(data),
            nbytes=nbytes,
        )
        for name, t in times.items()
    ]
