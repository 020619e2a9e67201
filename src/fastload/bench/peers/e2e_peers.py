"""The systems of the end-to-end benchmark: fastload and the peers users would pick instead.

Each is an :data:`Opener`: ``(spec, saved state or None) -> Loader``, a loader whose
``batches(epoch)`` yields, for each batch, what identifies its samples (a list; the
loader's ``delivers`` says what it holds: sample ids, or labels where the system's batches
carry nothing else), or only its sample count. :mod:`fastload.bench.e2e.e2e_child` runs one of
them in a process of its own and measures it (the resume check compares those lists).

The peers decode as their users do without torchvision: simplejpeg, then torch ops for
RandomResizedCrop + flip + normalize (``decode_bench.TorchOps``; the fastest non-fastload
CPU path of the decode benchmark), in ``workers`` DataLoader processes. The peer libraries
are imported only when their system runs (mosaicml-streaming, litdata and Hugging Face
``datasets`` live in ``.venv-peers``). The Parquet layout's peers are
:mod:`fastload.bench.peers.parquet_peers`' (shared with the Parquet component benchmark), read
from the S3 URL here.

This module is the table (:data:`SYSTEMS`, :data:`IMPORTS`) and the Parquet openers; each
system's code is in a module of its own: :mod:`.fastload_peer`, :mod:`.torch_peers`,
:mod:`.dali_peer`, :mod:`.streaming_peers`, :mod:`.e2e_s3_peers`, all on :mod:`.spec`
(whose names this module also gives the child and the tests).
"""

from __future__ import annotations

import os
import time
from typing import Any

from fastload.bench.peers import e2e_s3_peers, parquet_peers
from fastload.bench.peers.dali_peer import DALILoader
from fastload.bench.peers.fastload_peer import FastloadLoader
from fastload.bench.peers.spdl_peer import SPDL, SPDLLoader
from fastload.bench.peers.spec import (
    LABELS_IN_ORDER,
    SAMPLE_IDS,
    Delivered,
    Loader,
    Opener,
    RunSpec,
    ensure_dir,
)
from fastload.bench.peers.streaming_peers import open_litdata, open_mosaic
from fastload.bench.peers.torch_peers import TorchLoader, _open_read, get_object, torch_peer


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
        loader = TorchLoader(rows, spec, map_style=True)
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
            cache_dir=ensure_dir(os.path.join(spec.work_dir, "hf-cache")),
            storage_options=spec.storage_options,
        )
        collate = parquet_peers.DecodeRows(spec.size, spec.seed, with_ids=True)
        samples = spec.samples if streaming else None
        loader = TorchLoader(ds, spec, not streaming, collate_fn=collate, samples=samples)
        if not streaming:
            loader.extra["load_dataset_s"] = seconds
        return loader

    return open_loader


# The I/O-bound peers at the concurrency their documentation recommends, beside the same
# peers at the run's (equal) worker count: s3torchconnector's own data-loading benchmark
# runs S3MapDataset with ``num_workers: 8`` (and sweeps 1-64), fsspec among the loaders it
# compares at that setting:
# https://github.com/awslabs/s3-connector-for-pytorch/blob/main/s3torchbenchmarking/conf/dataloader/s3mapdataset.yaml
# https://github.com/awslabs/s3-connector-for-pytorch/blob/main/s3torchbenchmarking/conf/dataset.yaml
FSSPEC_DOCS = "torch DataLoader + fsspec, 8 workers"
DOCS_WORKERS: dict[str, int] = {e2e_s3_peers.S3TORCH_DOCS: 8, FSSPEC_DOCS: 8}

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
    e2e_s3_peers.S3TORCH_DOCS: ("fastload.bench.peers.e2e_s3_peers", "s3torchconnector"),
    FSSPEC_DOCS: ("fsspec", "s3fs"),
    SPDL: ("s3fs", "spdl.io", "spdl.pipeline"),
    "s5cmd + DALI reader + CPU pipeline": ("fastload.bench.peers.e2e_s3_peers", "nvidia.dali"),
    parquet_peers.ARROW_SIMPLEJPEG: ("pyarrow", "pyarrow.dataset", "pyarrow.fs"),
    parquet_peers.ARROW_FASTLOAD_DECODER: ("pyarrow", "pyarrow.dataset", "pyarrow.fs"),
    parquet_peers.HF_MAP: ("datasets", "pyarrow", "fsspec", "s3fs"),
    parquet_peers.HF_STREAMING: ("datasets", "pyarrow", "fsspec", "s3fs"),
}
LAYOUT_IMPORTS: dict[str, tuple[str, ...]] = {"parquet": ("pyarrow", "pyarrow.parquet")}

SYSTEMS: dict[str, Opener] = {
    "fastload": FastloadLoader,
    "torch DataLoader + fsspec": torch_peer(cached=False, read=get_object),
    # The folder read as first written: fs.open(path).read(), a HEAD before each GET.
    "torch DataLoader + fsspec (fs.open)": torch_peer(cached=False, read=_open_read),
    "torch DataLoader + fsspec filecache::": torch_peer(cached=True),
    "DALI reader + CPU pipeline": DALILoader,
    "mosaicml-streaming": open_mosaic,
    "litdata": open_litdata,
    "s3torchconnector": e2e_s3_peers.open_s3torchconnector,
    # The same two at the worker count the connector's own benchmark runs (DOCS_WORKERS).
    e2e_s3_peers.S3TORCH_DOCS: e2e_s3_peers.open_s3torchconnector,
    FSSPEC_DOCS: torch_peer(cached=False, read=get_object),
    SPDL: SPDLLoader,
    "s5cmd + DALI reader + CPU pipeline": e2e_s3_peers.open_s5cmd_dali,
    parquet_peers.ARROW_SIMPLEJPEG: _arrow_peer("simplejpeg"),
    parquet_peers.ARROW_FASTLOAD_DECODER: _arrow_peer("fastload"),
    parquet_peers.HF_MAP: _hf_peer(streaming=False),
    parquet_peers.HF_STREAMING: _hf_peer(streaming=True),
}

__all__ = [
    "DOCS_WORKERS",
    "FSSPEC_DOCS",
    "IMPORTS",
    "LABELS_IN_ORDER",
    "LAYOUT_IMPORTS",
    "SAMPLE_IDS",
    "SYSTEMS",
    "Delivered",
    "Loader",
    "Opener",
    "RunSpec",
    "_open_read",
    "get_object",
]
