"""The Parquet peers: what users would pick to read Parquet images into a torch DataLoader.

Shared by the Parquet component benchmark (:mod:`fastload.bench.components.parquet_bench`, on local
files) and the end-to-end benchmark's Parquet layout (:mod:`fastload.bench.peers.e2e_peers`,
from S3). The data is ``e2e_data.write_parquet``'s: an ``image`` struct ``{bytes, path}``
(the Hugging Face ``Image`` feature) and an int64 ``label``.

* :class:`ArrowRows`: a map-style torch dataset over ``pyarrow.dataset``: the whole table
  read once (``to_table``; pyarrow's own S3 client for ``s3://``, see
  :func:`arrow_source`), a batch's rows taken per ``__getitems__`` call, each image decoded
  with simplejpeg then torch ops (``decode_bench.TorchOps``, the decode benchmark's fastest
  non-fastload CPU path) or with fastload's CPU decoder (one thread per worker).
* :func:`hf_dataset`: Hugging Face ``datasets``: ``load_dataset("parquet", data_files=...)``
  (map-style: its download and conversion to Arrow files, once; or ``streaming=True``), the
  image column cast to ``Image(decode=False)`` so the bytes reach the same decoder,
  ``.with_format("torch")``; :class:`DecodeRows` is the DataLoader's ``collate_fn`` that
  decodes them (simplejpeg then torch ops).

pyarrow and ``datasets`` are imported when a peer runs (``datasets`` lives in
``.venv-peers``, which ``make bench-peers`` builds).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.data

from fastload.decode.params import TrainPreset

# The peers' names, in both benchmarks' tables.
ARROW_SIMPLEJPEG = "torch DataLoader + pyarrow.dataset + simplejpeg"
ARROW_FASTLOAD_DECODER = "torch DataLoader + pyarrow.dataset + fastload's decoder"
HF_MAP = "HF datasets (map-style, torch format)"
HF_STREAMING = "HF datasets (streaming)"

IMAGE, LABEL = "image", "label"
DECODERS = ("simplejpeg", "fastload")

Decode = Callable[[list[bytes], list[int]], list[torch.Tensor]]


def decoder(kind: str, size: int, seed: int) -> Decode:
    """``decode(list of JPEG bytes, indices) -> list of CHW float32 tensors``, the train
    preset at ``size`` px: simplejpeg then torch ops (``"simplejpeg"``), or fastload's CPU
    decoder with one thread (``"fastload"``). Make it in the process that uses it."""
    preset = TrainPreset(size)
    if kind == "fastload":
        from fastload.decode.base import DecodeConfig
        from fastload.decode.cpu import CPUDecoder

        cpu = CPUDecoder(DecodeConfig(transform=preset, seed=seed, num_threads=1))

        def fastload_decode(data: list[bytes], indices: list[int]) -> list[torch.Tensor]:
            return list(cpu.decode(data, indices=indices).images)

        return fastload_decode
    if kind != "simplejpeg":
        raise ValueError(f"decoder must be one of {DECODERS}, got {kind!r}")
    from fastload.bench.peers.peer_decoders import TorchOps
    from fastload.decode.cpu import decode_rgb

    ops = TorchOps(preset, seed=seed + os.getpid())

    def simplejpeg_decode(data: list[bytes], indices: list[int]) -> list[torch.Tensor]:
        return [ops(decode_rgb(d)) for d in data]

    return simplejpeg_decode


class _PerProcessDecoder:
    """A :func:`decoder` made lazily in each process that calls it (DataLoader workers
    fork: each gets its own, with its own random stream)."""

    def __init__(self, kind: str, size: int, seed: int) -> None:
        if kind not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {kind!r}")
        self.kind, self.size, self.seed = kind, size, seed
        self._pid = -1
        self._decode: Decode | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_pid": -1, "_decode": None}

    def __call__(self, data: list[bytes], indices: list[int]) -> list[torch.Tensor]:
        if self._decode is None or self._pid != os.getpid():
            self._decode, self._pid = decoder(self.kind, self.size, self.seed), os.getpid()
        return self._decode(data, indices)


def arrow_source(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(pyarrow filesystem or None for a local path, path in it) for a folder of Parquet
    files, as a careful pyarrow user opens it: ``s3://`` through pyarrow's own S3 client
    (C++, many requests at once), given the endpoint and keys of s3fs-style
    ``storage_options``; another fsspec URL through its fsspec filesystem."""
    if "://" not in url:
        return None, url
    protocol, _, path = url.partition("://")
    options = dict(storage_options or {})
    if protocol in ("s3", "s3a"):
        fs: Any = importlib.import_module("pyarrow.fs")
        endpoint = options.get("endpoint_url") or options.get("client_kwargs", {}).get(
            "endpoint_url"
        )
        kwargs: dict[str, Any] = {
            "access_key": options.get("key"),
            "secret_key": options.get("secret"),
            "region": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        }
        if endpoint:
            scheme, _, host = str(endpoint).partition("://")
            kwargs.update(endpoint_override=host.rstrip("/"), scheme=scheme)
        return fs.S3FileSystem(**{k: v for k, v in kwargs.items() if v is not None}), path
    from fsspec.core import url_to_fs

    filesystem, root = url_to_fs(url, **options)
    return filesystem, str(root)


def read_table(url: str, storage_options: dict[str, Any] | None = None) -> Any:
    """The image and label columns of every Parquet file under ``url``, as one table."""
    pds: Any = importlib.import_module("pyarrow.dataset")
    filesystem, path = arrow_source(url, storage_options)
    return pds.dataset(path, format="parquet", filesystem=filesystem).to_table(
        columns=[IMAGE, LABEL]
    )


class ArrowRows(torch.utils.data.Dataset[tuple[Any, ...]]):
    """Rows of the Parquet files under ``url`` through ``pyarrow.dataset``, decoded with
    ``decoder`` (:func:`decoder`). The table is read once: by :meth:`load` (then forked
    workers share it), else by each process on first use (never inherited through fork).
    Each ``__getitems__`` takes a batch's rows; an item is ``(image, label)``, or
    ``(image, label, row index)`` with ``with_ids``."""

    def __init__(
        self,
        url: str,
        rows: int,
        size: int,
        seed: int,
        decoder: str,
        *,
        storage_options: dict[str, Any] | None = None,
        with_ids: bool = False,
    ) -> None:
        self.url, self.rows = url, rows
        self.storage_options = storage_options
        self.with_ids = with_ids
        self.decode = _PerProcessDecoder(decoder, size, seed)
        self._table: Any = None
        self._pid = -1

    def load(self) -> ArrowRows:
        """Reads the table now, in this process (forked workers then share its memory)."""
        # pyarrow.dataset over the URL, read as its docs show
        # (https://arrow.apache.org/docs/python/dataset.html, dataset(...).to_table()).
        self._table, self._pid = read_table(self.url, self.storage_options), -1
        if self._table.num_rows != self.rows:
            raise ValueError(f"{self.url} holds {self._table.num_rows} rows, not {self.rows}")
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None}

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, ...]]:
        if self._table is None or (self._pid not in (-1, os.getpid())):
            self._table, self._pid = read_table(self.url, self.storage_options), os.getpid()
        rows = self._table.take(indices)
        images = rows.column(IMAGE).combine_chunks().field("bytes").to_pylist()
        labels = rows.column(LABEL).to_pylist()
        decoded = self.decode(images, indices)
        if self.with_ids:
            return list(zip(decoded, labels, indices, strict=True))
        return list(zip(decoded, labels, strict=True))


def path_id(path: str | None) -> int:
    """A sample id from its image's ``path`` (``000412.jpg`` -> 412; -1 without one)."""
    if not path:
        return -1
    stem = os.path.basename(path).split(".", 1)[0]
    return int(stem) if stem.isdigit() and len(stem) < 18 else -1


class DecodeRows:
    """A ``collate_fn`` for Hugging Face rows (``{"image": {"bytes", "path"}, "label"}``):
    each image through simplejpeg then torch ops, stacked with the labels (and, with
    ``with_ids``, each sample's id from its image's path: :func:`path_id`)."""

    def __init__(self, size: int, seed: int, *, with_ids: bool = False) -> None:
        self.decode = _PerProcessDecoder("simplejpeg", size, seed)
        self.with_ids = with_ids

    def __call__(self, rows: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
        images = self.decode([r[IMAGE]["bytes"] for r in rows], [])
        labels = torch.as_tensor([int(r[LABEL]) for r in rows])
        if not self.with_ids:
            return torch.stack(images), labels
        ids = torch.as_tensor([path_id(r[IMAGE].get("path")) for r in rows])
        return torch.stack(images), labels, ids


def hf_dataset(
    data_files: str | Sequence[str],
    *,
    streaming: bool,
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[Any, float]:
    """(dataset, seconds it took) from Hugging Face ``datasets``: ``load_dataset("parquet",
    data_files=..., split="train")`` (map-style: downloads and converts to Arrow files in
    ``cache_dir``; ``streaming``: reads the files as it goes), the image column cast to
    ``Image(decode=False)`` (its bytes, for :class:`DecodeRows`), ``.with_format("torch")``.
    No ``.shuffle(buffer_size=...)`` on the stream: in datasets 5.0 it leaves a Parquet
    stream one shard, so one DataLoader worker ("Too many dataloader workers")."""
    # As datasets documents it: https://huggingface.co/docs/datasets/en/loading#parquet and
    # https://huggingface.co/docs/datasets/en/filesystems (storage_options to fsspec),
    # https://huggingface.co/docs/datasets/en/use_with_pytorch (with_format("torch")).
    datasets: Any = importlib.import_module("datasets")
    datasets.disable_progress_bars()
    files = data_files if isinstance(data_files, str) else list(data_files)
    start = time.perf_counter()
    options: dict[str, Any] = {"split": "train"}
    if storage_options:
        options["storage_options"] = storage_options
    if streaming:
        ds = datasets.load_dataset("parquet", data_files=files, streaming=True, **options)
    else:
        ds = datasets.load_dataset("parquet", data_files=files, cache_dir=cache_dir, **options)
    ds = ds.cast_column(IMAGE, datasets.Image(decode=False)).with_format("torch")
    return ds, time.perf_counter() - start
