"""The SPDL peer (Meta's ``spdl``: a pipeline of thread/async stages in the training
process, images decoded by FFmpeg in native code without the GIL), set up as its
documentation writes a training loader.

It follows two of SPDL's own pages, frozen here (spdl 0.8):

* the loader's shape: "Migrating from PyTorch DataLoader", ``build_data_pipeline``
  (https://facebookresearch.github.io/spdl/main/getting_started/pytorch.html): a sampler
  as the source, an I/O stage at high concurrency with ``output_order="completion"``
  ("start with 16-32"; its ``num_io_workers`` defaults to 16), a CPU stage at the number
  of cores with ``output_order="input"``, ``aggregate(batch_size)``, a collate stage,
  ``add_sink(buffer_size)``, a fresh pipeline built for each epoch; I/O as an ``async``
  function passed as it is ("do not wrap async functions in synchronous wrappers");
* the decode: the ``multi_thread_preprocessing`` example and "Data Augmentation with
  Filters" (https://facebookresearch.github.io/spdl/main/io/filtering.html):
  ``demux_image`` + ``decode_packets(filter_desc=...)`` with the augmentation in the FFmpeg
  filter (here RandomResizedCrop's box as ``crop``, a bilinear ``scale`` to the preset's
  size, ``hflip``), frames batched by ``convert_frames`` + ``to_torch`` (no per-image
  tensor: its "Best Practices"), then normalized as a batch.

The folder: a GET per image (s3fs's async ``_cat_file`` on the pipeline's event loop,
as the other fsspec peers read it). The tar layout: a GET per shard, split into samples by
``spdl.io.iter_tarfile`` (its own TAR parser), each shard's samples in shard order (SPDL
has no shuffle buffer; the shards are shuffled each epoch). SPDL keeps no cache: every
epoch reads from the remote again, and its pipeline has no ``state_dict``.

SPDL needs FFmpeg's shared libraries (Debian: ``libavcodec59 libavformat59 libavutil57
libswscale6 libavfilter8 libavdevice59``); :func:`spdl_missing` says what is missing, and
the benchmarks skip it then.
"""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import torch

from fastload.bench.peers.peer_decoders import random_resized_crop_box
from fastload.bench.peers.spec import (
    IMAGE_SUFFIXES,
    SAMPLE_IDS,
    Delivered,
    RunSpec,
    remote_fs,
    train_preset,
)
from fastload.bench.peers.torch_peers import folder_labels, key_id
from fastload.decode.params import Preset, TrainPreset

SPDL = "SPDL pipeline (FFmpeg decode)"
# SPDL's "Tune Concurrency Levels": "Start with high concurrency for I/O operations
# (16-32 workers)"; its build_data_pipeline's num_io_workers defaults to 16.
IO_CONCURRENCY = 16
BUFFER_SIZE = 3  # add_sink's default; "does not affect pipeline performance" (its docs)
FFMPEG_PACKAGES = "libavcodec59 libavformat59 libavutil57 libswscale6 libavfilter8 libavdevice59"


def spdl_missing(python: str | None = None) -> str:
    """Why the SPDL peer cannot run ("" when it can): spdl not installed, or FFmpeg's
    libraries not found. Checked in a child process (``python``, else this one's), so that
    loading FFmpeg never touches the caller."""
    code = "import spdl.io.utils as u; u.get_ffmpeg_versions()"
    try:
        out = subprocess.run(
            [python or sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"spdl could not be checked: {e}"
    if out.returncode == 0:
        return ""
    if "No module named 'spdl" in out.stderr:
        return "not installed: pip install spdl"
    return f"spdl found no FFmpeg libraries: apt-get install {FFMPEG_PACKAGES}"


def filter_desc(spdl_io: Any, preset: Preset, width: int, height: int, rng: random.Random) -> str:
    """The FFmpeg filter that does the preset's geometry on one image of ``width`` x
    ``height``: RandomResizedCrop (torchvision's box) + bilinear scale + flip for train,
    shorter side to ``resize`` + centre crop for eval; RGB out."""
    if isinstance(preset, TrainPreset):
        top, left, h, w = random_resized_crop_box(height, width, rng, preset.scale)
        geometry = f"crop={w}:{h}:{left}:{top},scale=w={preset.size}:h={preset.size}"
        geometry += ":flags=bilinear"
        if rng.random() < preset.flip_p:
            geometry += ",hflip"
    else:
        short, long = (height, width) if height <= width else (width, height)
        new_long = int(preset.resize * long / short)
        new_h, new_w = (preset.resize, new_long) if height <= width else (new_long, preset.resize)
        geometry = f"scale=w={new_w}:h={new_h}:flags=bilinear,crop={preset.size}:{preset.size}"
    desc: str = spdl_io.get_video_filter_desc(filter_desc=geometry, pix_fmt="rgb24")
    return desc


class SPDLImages:
    """SPDL's decode of one image and its batching, for one preset: ``decode(bytes or
    path)`` -> FFmpeg frames (the geometry done in FFmpeg's filter), ``collate(frames)`` ->
    a normalized float32 (N, 3, size, size) tensor."""

    def __init__(self, preset: Preset, seed: int) -> None:
        self.io: Any = importlib.import_module("spdl.io")
        self.preset = preset
        self.rng = random.Random(seed)
        # Normalization on 0-255 values: the /255 folded into mean and std (one pass fewer).
        self.mean = torch.tensor(preset.mean).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(preset.std).view(1, 3, 1, 1) * 255

    def decode(self, src: bytes | memoryview | str) -> Any:
        packets = self.io.demux_image(src)
        desc = filter_desc(self.io, self.preset, packets.width, packets.height, self.rng)
        return self.io.decode_packets(packets, filter_desc=desc)

    def collate(self, frames: list[Any]) -> torch.Tensor:
        batch: torch.Tensor = self.io.to_torch(self.io.convert_frames(frames))
        batch = batch.permute(0, 3, 1, 2)
        out = batch.to(torch.float32, memory_format=torch.contiguous_format)  # NCHW, as the peers'
        return out.sub_(self.mean).div_(self.std)


class SPDLLoader:
    """SPDL's pipeline over the layout's URL (see the module docstring): ``workers``
    decode threads, :data:`IO_CONCURRENCY` GETs in flight."""

    def __init__(self, spec: RunSpec, state: Any) -> None:
        self.pipeline_mod: Any = importlib.import_module("spdl.pipeline")
        self.spec = spec
        self.images = SPDLImages(train_preset(spec), spec.seed)
        self.extra: dict[str, float] = {}
        self.no_resume = "SPDL's Pipeline has no state_dict"
        self.delivers = SAMPLE_IDS
        fs, root = remote_fs(spec)
        if spec.layout == "folder":
            paths = sorted(p for p in fs.find(root) if p.lower().endswith(IMAGE_SUFFIXES))
            self.items = paths
            self.labels = folder_labels(spec, [p[len(root) + 1 :] for p in paths])
            self.samples = len(paths)
        elif spec.layout == "tar":
            self.items = sorted(p for p in fs.find(root) if p.endswith(".tar"))
            self.samples = spec.samples or 0
        else:
            raise ValueError(f"the SPDL peer reads folder or tar, not {spec.layout!r}")
        self._fs: Any = None  # s3fs, asynchronous, made on the first pipeline's event loop
        self._loop: Any = None
        self._left = 0  # GETs left in this epoch

    async def _get(self, path: str) -> bytes:
        """One GET on the pipeline's event loop (a new loop each epoch gets its own
        session: s3fs's asynchronous client belongs to the loop that made it)."""
        import asyncio

        loop = asyncio.get_running_loop()
        if self._fs is None or self._loop is not loop:
            import s3fs

            self._fs = s3fs.S3FileSystem(
                asynchronous=True, skip_instance_cache=True, **self.spec.storage_options
            )
            await self._fs.set_session()
            self._loop = loop
        data: bytes = await self._fs._cat_file(path, max_concurrency=1)  # no HEAD first
        self._left -= 1
        if self._left == 0:  # the epoch's last GET: its client ends with its event loop
            await self._fs._s3.close()
            self._fs = None
        return data

    async def _load_image(self, i: int) -> tuple[bytes, int, int]:
        return await self._get(self.items[i]), self.labels[i], i

    async def _load_shard(self, i: int) -> AsyncIterator[tuple[bytes | memoryview, int, int]]:
        """One shard's samples (image bytes, label, id), as WebDataset groups them."""
        data = await self._get(self.items[i])
        key, image, label = None, None, -1
        for name, content in self.images.io.iter_tarfile(data):
            stem, _, suffix = name.rsplit("/", 1)[-1].partition(".")
            if stem != key:
                if image is not None and key is not None:
                    yield image, label, key_id(key)
                key, image, label = stem, None, -1
            if suffix.lower() in ("jpg", "jpeg"):
                image = content
            elif suffix == "cls":
                label = int(bytes(content))
        if image is not None and key is not None:
            yield image, label, key_id(key)

    def _decode(self, item: tuple[bytes | memoryview, int, int]) -> tuple[Any, int, int]:
        return self.images.decode(item[0]), item[1], item[2]

    def _collate(self, items: list[tuple[Any, int, int]]) -> tuple[torch.Tensor, list[int]]:
        frames, _, ids = zip(*items, strict=True)
        return self.images.collate(list(frames)), list(ids)

    def _pipeline(self, epoch: int) -> Any:
        order = np.random.default_rng([self.spec.seed, epoch]).permutation(len(self.items))
        self._left = len(self.items)
        load = self._load_image if self.spec.layout == "folder" else self._load_shard
        builder = (
            self.pipeline_mod.PipelineBuilder()
            .add_source(order.tolist())
            .pipe(load, concurrency=IO_CONCURRENCY, output_order="completion")
            .pipe(self._decode, concurrency=max(1, self.spec.workers), output_order="input")
            .aggregate(self.spec.batch_size)
            .pipe(self._collate)
            .add_sink(BUFFER_SIZE)
        )
        return builder.build(num_threads=max(1, self.spec.workers))

    def batches(self, epoch: int | None) -> Iterator[Delivered]:
        pipeline = self._pipeline(0 if epoch is None else epoch)
        try:
            with pipeline.auto_stop():
                for _, ids in pipeline:
                    yield ids
        finally:
            self._close_session()

    def _close_session(self) -> None:
        """Closes the s3fs client of an epoch cut short (its event loop, the pipeline's,
        has ended: only its sockets can be closed)."""
        if self._fs is not None:
            import s3fs

            s3fs.S3FileSystem.close_session(None, self._fs._s3)  # no loop: closes its sockets
            self._fs = None

    def state_dict(self) -> Any:
        raise NotImplementedError(self.no_resume)

    def close(self) -> None:
        self._close_session()
