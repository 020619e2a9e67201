"""The systems of the end-to-end benchmark: fastload and the peers users would pick instead.

Each is an :data:`Opener`: ``(spec, saved state or None) -> Loader``, a loader whose
``batches(epoch)`` yields, for each batch, what identifies its samples (a list; the
loader's ``delivers`` says what it holds: sample ids, or labels where the system's batches
carry nothing else), or only its sample count. :mod:`fastload.bench.e2e.e2e_child` runs one of
them in a process of its own and measures it (the resume check compares those lists).

The peers decode as their users do without torchvision: simplejpeg, then torch ops for
RandomResizedCrop + flip + normalize (``decode_bench.TorchOps``; the fastest non-fastload
CPU path of the decode benchmark), in ``workers`` DataLoader processes. The peer libraries
are imported here only, when their system runs (mosaicml-streaming, litdata and Hugging
Face ``datasets`` live in ``.venv-peers``). The Parquet layout's peers are
:mod:`fastload.bench.peers.parquet_peers`' (shared with the Parquet component benchmark), read
from the S3 URL here.
"""

from __future__ import annotations

import base64
import gc
import glob
import hashlib
import importlib
import json
import math
import os
import random
import tarfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data as tud

from fastload.bench.components.decode_bench import TorchOps, dali_train_ops
from fastload.bench.peers import parquet_peers
from fastload.decode.cpu import decode_rgb
from fastload.decode.params import TrainPreset

IMAGE_SUFFIXES = (".jpg", ".jpeg")

Sample = tuple[torch.Tensor, int, int]  # image, label, sample id
RawSample = tuple[bytes, int, str]  # a tar sample: image bytes, label, WebDataset key
Delivered = int | list[int]  # what batches() yields per batch: identities, or a count

# What a loader's lists hold (its ``delivers``), strongest first:
SAMPLE_IDS = "sample ids"  # one id per sample: the resume check compares multisets
LABELS_IN_ORDER = "labels in order"  # a deterministic epoch: compared in order
LABELS = "labels"  # only the label multiset (a replay and a drop of one class pass)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the parent asks one child to measure (written as JSON)."""

    system: str
    layout: str  # folder | tar | zarr | parquet | mds | litdata
    url: str  # the layout's root on the remote, s3://bucket/prefix
    storage_options: dict[str, Any]  # s3fs keyword arguments
    endpoint_url: str | None  # for peers that configure boto3 themselves
    work_dir: str  # caches and downloads of this run
    batch_size: int
    workers: int
    epochs: int
    step_s: float
    epoch_budget_s: float
    cold_budget_s: float | None  # None: the cold epoch runs to its end
    size: int
    seed: int
    resume: bool
    step: str = "sleep"  # the training step: sleep, or gil (runner.TrainingStep)
    step_iterations: int | None = None  # the gil step's work (None: measured in the child)
    samples: int | None = None  # known size of the dataset (None: the system finds out)
    labels: dict[str, int] = field(default_factory=dict)  # class folder -> index


class Loader(Protocol):
    """One system set up to iterate: ``batches(epoch)`` yields, per batch, its samples'
    identities (a list, of what ``delivers`` says; optional attribute) or their count
    (``epoch=None`` continues where a loaded state left off)."""

    samples: int  # per epoch
    extra: dict[str, float]  # figures of the set-up (e.g. download seconds)
    no_resume: str  # why the system cannot resume mid-epoch; "" where it can

    def batches(self, epoch: int | None) -> Iterator[Delivered]: ...

    def state_dict(self) -> Any: ...

    def close(self) -> None: ...


Opener = Callable[[RunSpec, Any], Loader]  # (spec, saved state or None) -> loader


def _preset(spec: RunSpec) -> TrainPreset:
    return TrainPreset(size=spec.size)


def _remote(spec: RunSpec) -> tuple[Any, str]:
    """(fsspec filesystem, root path) of the layout's URL."""
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(spec.url, **spec.storage_options)
    return fs, str(root).rstrip("/")


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


# --- fastload -----------------------------------------------------------------------------


class _FastloadLoader:
    def __init__(self, spec: RunSpec, state: Any) -> None:
        import fastload as fl

        ds = fl.open_dataset(
            spec.url,
            cache_dir=_mkdir(os.path.join(spec.work_dir, "cache")),
            storage_options=spec.storage_options,
        )
        self.samples = len(ds)
        self.extra: dict[str, float] = {}
        self.no_resume = ""
        # Its batches are (images, labels); an epoch's order is a pure function of (seed,
        # epoch), so the resume check compares the labels in order.
        self.delivers = LABELS_IN_ORDER
        self.stats: dict[str, Any] | None = None
        options: dict[str, Any] = {"decode": "cpu", "transform": _preset(spec)}
        if ds.format == "zarr":
            # fastload's decode takes encoded images; Zarr rows are pixels already, so the
            # train preset's torch ops run in collate_fn, on fastload's threads.
            options = {"collate_fn": _PixelBatch(_preset(spec), spec.seed)}
        self.loader = fl.DataLoader(
            ds,
            batch_size=spec.batch_size,
            shuffle=True,
            num_workers=spec.workers,
            seed=spec.seed,
            **options,
        )
        if state is not None:
            self.loader.load_state_dict(state)

    def batches(self, epoch: int | None) -> Iterator[Delivered]:
        if epoch is not None:
            self.loader.set_epoch(epoch)
        for batch in self.loader:
            yield [int(label) for label in batch[1]]

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def close(self) -> None:
        if self.stats is None:  # per-stage busy/wait seconds, for the JSON
            self.stats = self.loader.stats()
        self.loader.close()


class _PixelBatch:
    """collate_fn for Zarr rows of HWC uint8 pixels: the train preset's torch ops, stacked."""

    def __init__(self, preset: TrainPreset, seed: int) -> None:
        self.ops = TorchOps(preset, seed)

    def __call__(self, rows: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        images = torch.stack([self.ops(np.asarray(r["images"])) for r in rows])
        return images, torch.tensor([int(r["labels"]) for r in rows])


# --- torch DataLoader peers over fsspec ---------------------------------------------------


class _PerProcess:
    """Something opened lazily once per process (DataLoader workers fork; clients do not)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._pid = -1
        self._value: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_value": None}

    def get(self) -> Any:
        if self._pid != os.getpid():
            self._value, self._pid = self._make(), os.getpid()
        return self._value


def _filesystem(spec: RunSpec, cached: bool) -> Callable[[], Any]:
    """The URL's filesystem (s3fs), or it under fsspec's ``filecache::`` (whole files kept
    on local disk)."""

    def make() -> Any:
        import fsspec

        fs, _ = _remote(spec)
        if not cached:
            return fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return fsspec.filesystem(
            "filecache",
            target_protocol=protocol,
            target_options=spec.storage_options,
            cache_storage=_mkdir(os.path.join(spec.work_dir, "filecache")),
        )

    return make


def _open_read(fs: Any, path: str) -> bytes:
    """``fs.open(path).read()``: s3fs's file object HEADs the object for its size (a worker's
    fresh filesystem has no listing cached), then GETs it: two requests per object."""
    with fs.open(path, "rb") as f:
        data: bytes = f.read()
    return data


def get_object(fs: Any, path: str) -> bytes:
    """The whole object in one GET, as a careful user reads it: ``fs.cat_file(path)``.
    s3fs's ``cat_file`` first HEADs an object whose size it has not listed, to split a big
    one into concurrent ranged GETs (``max_concurrency``); for objects of one image that is
    a wasted round trip, so s3fs gets ``max_concurrency=1`` (one plain GET)."""
    protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "s3" in protocol:  # s3fs itself (filecache:: over it says "filecache")
        data: bytes = fs.cat_file(path, max_concurrency=1)
    else:
        data = fs.cat_file(path)
    return data


class FolderFiles(tud.Dataset[Sample]):
    """ImageFolder over fsspec: one object read per sample (``read(fs, path)``), decoded in
    the worker; each sample carries its index, so the harness can check what was delivered."""

    def __init__(
        self,
        spec: RunSpec,
        paths: list[str],
        labels: list[int],
        cached: bool,
        read: Callable[[Any, str], bytes] = get_object,
    ) -> None:
        self.paths, self.labels = paths, labels
        self.fs = _PerProcess(_filesystem(spec, cached))
        self.ops = TorchOps(_preset(spec), spec.seed)
        self.read = read

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Sample:
        data = self.read(self.fs.get(), self.paths[i])
        return self.ops(decode_rgb(data)), self.labels[i], i


class TarStream(tud.IterableDataset[Sample]):
    """WebDataset-style streaming: each worker reads whole shards in turn (a fresh shuffle
    of the shards each epoch, split across workers) through a shuffle buffer."""

    def __init__(self, spec: RunSpec, shards: list[str], samples: int, cached: bool) -> None:
        self.shards, self.samples = shards, samples
        self.fs = _PerProcess(_filesystem(spec, cached))
        self.ops = TorchOps(_preset(spec), spec.seed)
        self.seed = spec.seed
        self.buffer = 4 * spec.batch_size
        self.epoch = 0  # set before each epoch's workers start

    def __len__(self) -> int:
        return self.samples

    def _raw(self, shards: list[str]) -> Iterator[RawSample]:
        """(image bytes, label, key) of each sample of these shards, in order: a streaming
        open of each whole shard (one HEAD for its size, one GET)."""
        fs = self.fs.get()
        for shard in shards:
            with fs.open(shard, "rb") as f:
                yield from tar_samples(f)

    def __iter__(self) -> Iterator[Sample]:
        info = tud.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        shards = rng.sample(self.shards, len(self.shards))[worker::workers]
        rng = random.Random(rng.random() + worker)
        buffer: list[RawSample] = []
        for item in self._raw(shards):
            buffer.append(item)
            if len(buffer) >= self.buffer:
                yield self._sample(buffer.pop(rng.randrange(len(buffer))))
        rng.shuffle(buffer)
        for item in buffer:
            yield self._sample(item)

    def _sample(self, item: RawSample) -> Sample:
        return self.ops(decode_rgb(item[0])), item[1], key_id(item[2])


def key_id(key: str) -> int:
    """A WebDataset key as a sample id: the number it is, else a 62-bit hash of it."""
    if key.isdigit() and len(key) < 18:
        return int(key)
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest()) >> 2


class ZarrRows(tud.Dataset[Sample]):
    """zarr-python over fsspec, a row per sample (the chunk holding it is read each time)."""

    def __init__(self, spec: RunSpec, rows: int, cached: bool) -> None:
        self.rows = rows
        self.ops = TorchOps(_preset(spec), spec.seed)
        make_fs = _filesystem(spec, cached)
        _, root = _remote(spec)

        def open_arrays() -> tuple[Any, npt.NDArray[np.int64]]:
            import zarr
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = make_fs()
            if not getattr(fs, "async_impl", False):
                fs = AsyncFileSystemWrapper(fs)  # zarr's store wants an async filesystem
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "not created with asynchronous=True"
                store = zarr.storage.FsspecStore(fs=fs, path=root, read_only=True)
                group: Any = zarr.open_group(store=store, mode="r")
            return group["images"], np.asarray(group["labels"][:])  # labels once, as users do

        self.arrays = _PerProcess(open_arrays)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> Sample:
        images, labels = self.arrays.get()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.ops(np.asarray(images[i])), int(labels[i]), i


def tar_samples(stream: Any) -> Iterator[RawSample]:
    """(image bytes, label, key) of each sample of one tar shard read as a stream: members
    grouped by key as WebDataset does (``KEY.jpg`` + ``KEY.cls``; label -1 where a sample
    has no ``.cls``)."""
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        key, image, label = None, None, -1
        for member in tar:
            data = tar.extractfile(member)
            if data is None:
                continue
            base = member.name.rsplit("/", 1)[-1]
            stem, _, suffix = base.partition(".")
            if stem != key:
                if image is not None and key is not None:
                    yield image, label, key
                key, image, label = stem, None, -1
            if suffix.lower() in ("jpg", "jpeg"):
                image = data.read()
            elif suffix == "cls":
                label = int(data.read())
        if image is not None and key is not None:
            yield image, label, key


def _zarr_rows(spec: RunSpec) -> int:
    fs, root = _remote(spec)
    for name, key in (("zarr.json", "shape"), (".zarray", "shape")):
        path = f"{root}/images/{name}"
        if fs.exists(path):
            return int(json.loads(fs.cat_file(path))[key][0])
    raise FileNotFoundError(f"no Zarr array 'images' under {spec.url}")


class _TorchLoader:
    """torch's DataLoader with ``workers`` worker processes, started each epoch (torch's
    default; persistent workers would finish the batches in flight of an epoch cut at the
    time budget before starting the next one). ``samples``: an epoch's, where the dataset
    has no ``len`` (a stream)."""

    def __init__(
        self,
        dataset: tud.Dataset[Any],
        spec: RunSpec,
        map_style: bool,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        samples: int | None = None,
    ) -> None:
        self.samples = len(dataset) if samples is None else samples  # type: ignore[arg-type]
        self.extra: dict[str, float] = {}
        self.no_resume = "torch's DataLoader has no state_dict"
        self.delivers = SAMPLE_IDS  # its datasets give each sample its id (third element)
        self.loader = tud.DataLoader(
            dataset,
            batch_size=spec.batch_size,
            shuffle=map_style,
            num_workers=spec.workers,
            collate_fn=collate_fn,
        )

    def batches(self, epoch: int | None) -> Iterator[Delivered]:
        if isinstance(self.loader.dataset, TarStream) and epoch is not None:
            self.loader.dataset.epoch = epoch  # the workers fork with it
        iterator = iter(self.loader)
        try:
            for batch in iterator:
                yield batch[2].tolist()  # every peer dataset's samples carry their id
        finally:
            _stop_workers(iterator)

    def state_dict(self) -> Any:
        raise NotImplementedError(self.no_resume)

    def close(self) -> None:
        pass  # each epoch's workers stop with it


def _stop_workers(iterator: Any) -> None:
    """Ends an epoch's DataLoader workers now. torch's own shutdown waits (up to 5 s) for
    each worker to finish the batch it is making, which only an epoch cut at the time
    budget leaves behind; that wait is the harness's, not the peer's."""
    for worker in getattr(iterator, "_workers", []):
        if worker.is_alive():
            worker.terminate()
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _torch_peer(cached: bool, read: Callable[[Any, str], bytes] = get_object) -> Opener:
    """torch's DataLoader over fsspec (``cached``: through ``filecache::``); folder files
    read with ``read(fs, path)``."""

    def open_loader(spec: RunSpec, state: Any) -> Loader:
        fs, root = _remote(spec)
        if spec.layout == "folder":
            paths = sorted(p for p in fs.find(root) if p.lower().endswith(IMAGE_SUFFIXES))
            labels = _folder_labels(spec, [p[len(root) + 1 :] for p in paths])
            data: tud.Dataset[Sample]
            data = FolderFiles(spec, paths, labels, cached, read)
        elif spec.layout == "tar":
            shards = sorted(p for p in fs.find(root) if p.endswith(".tar"))
            data = TarStream(spec, shards, spec.samples or 0, cached)
        elif spec.layout == "zarr":
            data = ZarrRows(spec, _zarr_rows(spec), cached)
        else:
            raise ValueError(f"torch peers read folder, tar or zarr, not {spec.layout!r}")
        return _TorchLoader(data, spec, map_style=spec.layout != "tar")

    return open_loader


def _folder_labels(spec: RunSpec, keys: list[str]) -> list[int]:
    """Class index of each key: torchvision's ImageFolder order (sorted class folders)."""
    classes = spec.labels or {c: i for i, c in enumerate(sorted({k.split("/")[0] for k in keys}))}
    return [classes[k.split("/")[0]] for k in keys]


# --- Parquet: pyarrow.dataset and Hugging Face datasets (parquet_peers) --------------------


def _arrow_peer(decoder: str) -> Opener:
    """torch's DataLoader over ``pyarrow.dataset``: the whole table read from the URL once,
    at open (pyarrow's own S3 client; the cold epoch includes it), in this process, so each
    epoch's forked workers share it; a batch's rows per ``__getitems__``, decoded with
    ``decoder`` (:func:`fastload.bench.peers.parquet_peers.decoder`)."""

    def open_loader(spec: RunSpec, state: Any) -> Loader:
        if spec.layout != "parquet":
            raise ValueError(f"the pyarrow.dataset peer reads parquet, not {spec.layout!r}")
        if spec.samples is None:
            raise ValueError("the pyarrow.dataset peer needs the dataset's samples in its spec")
        start = time.perf_counter()
        rows = parquet_peers.ArrowRows(
            spec.url,
            spec.samples,
            spec.size,
            spec.seed,
            decoder,
            storage_options=spec.storage_options,
            with_ids=True,  # each sample's row index
        ).load()
        loader = _TorchLoader(rows, spec, map_style=True)
        loader.extra["table_read_s"] = time.perf_counter() - start
        return loader

    return open_loader


def _hf_peer(streaming: bool) -> Opener:
    """Hugging Face ``datasets`` on the URL's ``*.parquet`` files (the storage options
    passed through to fsspec, as its documentation has it), in torch's DataLoader whose
    ``collate_fn`` decodes: map-style (``load_dataset`` downloads and converts to Arrow
    files in the run's cache, in the cold epoch; shuffled), or ``streaming=True`` (every
    epoch from the remote, the files split between the workers; unshuffled, its best case:
    see :func:`fastload.bench.peers.parquet_peers.hf_dataset`)."""

    def open_loader(spec: RunSpec, state: Any) -> Loader:
        if spec.layout != "parquet":
            raise ValueError(f"the datasets peers read parquet, not {spec.layout!r}")
        ds, seconds = parquet_peers.hf_dataset(
            spec.url.rstrip("/") + "/*.parquet",
            streaming=streaming,
            cache_dir=_mkdir(os.path.join(spec.work_dir, "hf-cache")),
            storage_options=spec.storage_options,
        )
        collate = parquet_peers.DecodeRows(spec.size, spec.seed, with_ids=True)
        samples = spec.samples if streaming else None
        loader = _TorchLoader(ds, spec, not streaming, collate_fn=collate, samples=samples)
        if not streaming:
            loader.extra["load_dataset_s"] = seconds
        return loader

    return open_loader


# --- NVIDIA DALI's own reader and CPU pipeline (on a local copy) ---------------------------


def fsspec_download(spec: RunSpec, local: str) -> None:
    """The layout's files into the folder ``local`` with fsspec's ``get``."""
    fs, root = _remote(spec)
    fs.get(root + "/", local + "/", recursive=True)


class _DALILoader:
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
        preset = _preset(spec)
        if spec.layout == "folder":
            files = sorted(glob.glob(os.path.join(local, "*", "*.jpg")))
        elif spec.layout == "tar":
            files = sorted(glob.glob(os.path.join(local, "*.tar")))
        else:
            raise ValueError(f"DALI reads folder or tar layouts, not {spec.layout!r}")

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


# --- mosaicml-streaming and litdata (after their conversion step) --------------------------


def _peer_loader(loader: Any, samples: int) -> Any:
    class PeerLoader:
        def __init__(self) -> None:
            self.samples = samples
            self.extra: dict[str, float] = {}
            self.no_resume = ""
            self.delivers = SAMPLE_IDS  # each sample's global index in the peer's dataset
            self.loader = loader

        def batches(self, epoch: int | None) -> Iterator[Delivered]:
            iterator = iter(self.loader)
            try:
                for _, _, ids in iterator:
                    yield ids.tolist()
            finally:
                shutdown = getattr(iterator, "_shutdown_workers", None)
                if shutdown is not None:  # torch's own, gentle: these peers share memory
                    shutdown()

        def state_dict(self) -> Any:
            return self.loader.state_dict()

        def close(self) -> None:
            self.loader = None
            gc.collect()

    return PeerLoader()


def _mosaic(spec: RunSpec, state: Any) -> Loader:
    streaming: Any = importlib.import_module("streaming")
    ops = TorchOps(_preset(spec), spec.seed)

    class Images(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: int) -> Sample:
            row = super().__getitem__(i)
            return ops(decode_rgb(row["jpg"])), int(row["cls"]), int(i)

    # mosaicml-streaming reads S3 through boto3 configured from the environment only.
    os.environ.update(_aws_env(spec))
    # Its documented set-up: stale shared memory of earlier runs cleared first; a local
    # cache folder of this run's own (never shared with another dataset or a previous
    # conversion), the per-device batch size, predownload at its default (8 batches).
    streaming.base.util.clean_stale_shared_memory()
    dataset = Images(
        remote=spec.url,
        local=_mkdir(os.path.join(spec.work_dir, "cache")),
        shuffle=True,
        shuffle_seed=spec.seed,
        batch_size=spec.batch_size,
        predownload=8 * spec.batch_size,
    )
    # The dataset fetched index.json here with a boto3 client that the DataLoader's forked
    # workers would inherit, keep-alive socket and all: two processes then read one socket,
    # each getting parts of the other's responses. Over a plain-http endpoint nothing
    # notices, and a shard lands shifted by a few KB ("IndexError: Relative sample index
    # 62 is not present in the shard.00002.mds file", or a 60 s read timeout first). Each
    # process must open its own client: dropped here, the workers make theirs.
    for stream in getattr(dataset, "streams", []):
        downloader = getattr(stream, "_downloader", None)
        if downloader is not None:
            downloader.clean_up()
    loader = streaming.StreamingDataLoader(
        dataset,
        batch_size=spec.batch_size,
        num_workers=spec.workers,
    )
    if state is not None:
        loader.load_state_dict(state)
    return _peer_loader(loader, len(dataset))  # type: ignore[no-any-return]


def _litdata(spec: RunSpec, state: Any) -> Loader:
    litdata: Any = importlib.import_module("litdata")
    downloader: Any = importlib.import_module("litdata.streaming.downloader")
    # litdata fetches chunks with obstore, which refuses plain http unless told; the
    # loopback endpoint is http (real S3 is https). Set before the workers fork.
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": True}
    ops = TorchOps(_preset(spec), spec.seed)

    class Images(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: Any) -> Sample:
            row = super().__getitem__(i)
            return ops(decode_rgb(row["jpg"])), int(row["cls"]), int(getattr(i, "index", i))

    env = _aws_env(spec)
    # batch_decode="all" (documented: deserialize a chunk's items together once it is
    # local). Its "auto" picks windows of ~16 MB for ~100 KB byte items, and a chunk that
    # two workers share (one straddling their split of the epoch: most of the 64 MB
    # chunks when there are few) is not memory-mapped, so each window re-reads the whole
    # chunk file: ~4 ms of CPU per sample, 147 samples/s at 95% wait on 2 cores.
    dataset = Images(
        input_dir=spec.url,
        cache_dir=_mkdir(os.path.join(spec.work_dir, "cache")),
        shuffle=True,
        seed=spec.seed,
        batch_decode="all",
        storage_options={
            "endpoint_url": spec.endpoint_url,
            "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        },
    )
    loader = litdata.StreamingDataLoader(
        dataset, batch_size=spec.batch_size, num_workers=spec.workers
    )
    if state is not None:
        loader.load_state_dict(state)
    return _peer_loader(loader, len(dataset))  # type: ignore[no-any-return]


def _aws_env(spec: RunSpec) -> dict[str, str]:
    options = spec.storage_options
    env = {
        "AWS_ACCESS_KEY_ID": str(options.get("key", "")),
        "AWS_SECRET_ACCESS_KEY": str(options.get("secret", "")),
        "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    if spec.endpoint_url:
        env["S3_ENDPOINT_URL"] = spec.endpoint_url
    return env


def _s3_peer(name: str) -> Opener:
    """An opener of :mod:`fastload.bench.peers.e2e_s3_peers` (s3torchconnector, s5cmd + DALI),
    imported when it runs."""

    def open_loader(spec: RunSpec, state: Any) -> Loader:
        module = importlib.import_module("fastload.bench.peers.e2e_s3_peers")
        loader: Loader = getattr(module, name)(spec, state)
        return loader

    return open_loader


# Imported before any timer starts (an import is no part of a loader's start-up).
IMPORTS: dict[str, tuple[str, ...]] = {
    "fastload": ("fastload", "fastload.loader", "s3fs"),  # s3fs: as the peers have it
    "torch DataLoader + fsspec": ("fsspec", "s3fs", "zarr"),
    "torch DataLoader + fsspec (fs.open)": ("fsspec", "s3fs"),
    "torch DataLoader + fsspec filecache::": ("fsspec", "s3fs", "zarr"),
    "DALI reader + CPU pipeline": ("fsspec", "s3fs", "nvidia.dali"),
    "mosaicml-streaming": ("streaming",),
    "litdata": ("litdata", "litdata.streaming.downloader"),
    "s3torchconnector": ("fastload.bench.peers.e2e_s3_peers", "s3torchconnector"),
    "s5cmd + DALI reader + CPU pipeline": ("fastload.bench.peers.e2e_s3_peers", "nvidia.dali"),
    parquet_peers.ARROW_SIMPLEJPEG: ("pyarrow", "pyarrow.dataset", "pyarrow.fs"),
    parquet_peers.ARROW_FASTLOAD_DECODER: ("pyarrow", "pyarrow.dataset", "pyarrow.fs"),
    parquet_peers.HF_MAP: ("datasets", "pyarrow", "fsspec", "s3fs"),
    parquet_peers.HF_STREAMING: ("datasets", "pyarrow", "fsspec", "s3fs"),
}
LAYOUT_IMPORTS: dict[str, tuple[str, ...]] = {"parquet": ("pyarrow", "pyarrow.parquet")}

SYSTEMS: dict[str, Opener] = {
    "fastload": _FastloadLoader,
    "torch DataLoader + fsspec": _torch_peer(cached=False),
    # The folder read as first written: fs.open(path).read(), a HEAD before each GET.
    "torch DataLoader + fsspec (fs.open)": _torch_peer(cached=False, read=_open_read),
    "torch DataLoader + fsspec filecache::": _torch_peer(cached=True),
    "DALI reader + CPU pipeline": _DALILoader,
    "mosaicml-streaming": _mosaic,
    "litdata": _litdata,
    "s3torchconnector": _s3_peer("open_s3torchconnector"),
    "s5cmd + DALI reader + CPU pipeline": _s3_peer("open_s5cmd_dali"),
    parquet_peers.ARROW_SIMPLEJPEG: _arrow_peer("simplejpeg"),
    parquet_peers.ARROW_FASTLOAD_DECODER: _arrow_peer("fastload"),
    parquet_peers.HF_MAP: _hf_peer(streaming=False),
    parquet_peers.HF_STREAMING: _hf_peer(streaming=True),
}
