"""The torch DataLoader peers over fsspec: the folder (a GET per image), tar shards streamed
through a shuffle buffer, Zarr rows; decoded with simplejpeg + ``decode_bench.TorchOps``
in ``workers`` DataLoader processes."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tarfile
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch.utils.data as tud

from fastload.bench.peers.peer_decoders import TorchOps
from fastload.bench.peers.spec import (
    IMAGE_SUFFIXES,
    SAMPLE_IDS,
    Delivered,
    Loader,
    Opener,
    RawSample,
    RunSpec,
    Sample,
    ensure_dir,
    remote_fs,
    train_preset,
)
from fastload.decode.cpu import decode_rgb


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

        fs, _ = remote_fs(spec)
        if not cached:
            return fs
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        return fsspec.filesystem(
            "filecache",
            target_protocol=protocol,
            target_options=spec.storage_options,
            cache_storage=ensure_dir(os.path.join(spec.work_dir, "filecache")),
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
        self.ops = TorchOps(train_preset(spec), spec.seed)
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
        self.ops = TorchOps(train_preset(spec), spec.seed)
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
        self.ops = TorchOps(train_preset(spec), spec.seed)
        make_fs = _filesystem(spec, cached)
        _, root = remote_fs(spec)

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
    fs, root = remote_fs(spec)
    for name, key in (("zarr.json", "shape"), (".zarray", "shape")):
        path = f"{root}/images/{name}"
        if fs.exists(path):
            return int(json.loads(fs.cat_file(path))[key][0])
    raise FileNotFoundError(f"no Zarr array 'images' under {spec.url}")


class TorchLoader:
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


def torch_peer(cached: bool, read: Callable[[Any, str], bytes] = get_object) -> Opener:
    """torch's DataLoader over fsspec (``cached``: through ``filecache::``); folder files
    read with ``read(fs, path)``."""
    # Set up as documented: a map-style Dataset in torch's DataLoader with num_workers
    # processes (https://pytorch.org/docs/stable/data.html#single-and-multi-process-data-loading),
    # s3fs's whole-object read (https://s3fs.readthedocs.io/en/latest/api.html, cat_file),
    # filecache:: as fsspec describes it
    # (https://filesystem-spec.readthedocs.io/en/latest/features.html#caching-files-locally),
    # tar shards streamed through a shuffle buffer as WebDataset's README writes it
    # (https://github.com/webdataset/webdataset#readme: shards split across workers, .shuffle).

    def open_loader(spec: RunSpec, state: Any) -> Loader:
        fs, root = remote_fs(spec)
        if spec.layout == "folder":
            paths = sorted(p for p in fs.find(root) if p.lower().endswith(IMAGE_SUFFIXES))
            labels = folder_labels(spec, [p[len(root) + 1 :] for p in paths])
            data: tud.Dataset[Sample]
            data = FolderFiles(spec, paths, labels, cached, read)
        elif spec.layout == "tar":
            shards = sorted(p for p in fs.find(root) if p.endswith(".tar"))
            data = TarStream(spec, shards, spec.samples or 0, cached)
        elif spec.layout == "zarr":
            data = ZarrRows(spec, _zarr_rows(spec), cached)
        else:
            raise ValueError(f"torch peers read folder, tar or zarr, not {spec.layout!r}")
        return TorchLoader(data, spec, map_style=spec.layout != "tar")

    return open_loader


def folder_labels(spec: RunSpec, keys: list[str]) -> list[int]:
    """Class index of each key: torchvision's ImageFolder order (sorted class folders)."""
    classes = spec.labels or {c: i for i, c in enumerate(sorted({k.split("/")[0] for k in keys}))}
    return [classes[k.split("/")[0]] for k in keys]
