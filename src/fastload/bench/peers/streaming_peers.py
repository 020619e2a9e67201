"""The peers with a format of their own: mosaicml-streaming (MDS) and litdata, each reading
its converted copy of the dataset from S3 through its own downloader."""

from __future__ import annotations

import gc
import importlib
import os
from collections.abc import Iterator
from typing import Any

from fastload.bench.peers.peer_decoders import TorchOps
from fastload.bench.peers.spec import (
    SAMPLE_IDS,
    Delivered,
    Loader,
    RunSpec,
    Sample,
    aws_env,
    ensure_dir,
    train_preset,
)
from fastload.decode.cpu import decode_rgb


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


def open_mosaic(spec: RunSpec, state: Any) -> Loader:
    streaming: Any = importlib.import_module("streaming")
    ops = TorchOps(train_preset(spec), spec.seed)

    class Images(streaming.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: int) -> Sample:
            row = super().__getitem__(i)
            return ops(decode_rgb(row["jpg"])), int(row["cls"]), int(i)

    # Set up as its "Quick Start" and StreamingDataset docs have it
    # (https://docs.mosaicml.com/projects/streaming/en/stable/getting_started/quick_start.html):
    # StreamingDataset(remote, local, shuffle, batch_size) in its StreamingDataLoader.
    # mosaicml-streaming reads S3 through boto3 configured from the environment only.
    os.environ.update(aws_env(spec))
    # Its documented set-up: stale shared memory of earlier runs cleared first; a local
    # cache folder of this run's own (never shared with another dataset or a previous
    # conversion), the per-device batch size, predownload at its default (8 batches).
    streaming.base.util.clean_stale_shared_memory()
    dataset = Images(
        remote=spec.url,
        local=ensure_dir(os.path.join(spec.work_dir, "cache")),
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


def open_litdata(spec: RunSpec, state: Any) -> Loader:
    litdata: Any = importlib.import_module("litdata")
    downloader: Any = importlib.import_module("litdata.streaming.downloader")
    # litdata fetches chunks with obstore, which refuses plain http unless told; the
    # loopback endpoint is http (real S3 is https). Set before the workers fork.
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": True}
    ops = TorchOps(train_preset(spec), spec.seed)

    class Images(litdata.StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: Any) -> Sample:
            row = super().__getitem__(i)
            return ops(decode_rgb(row["jpg"])), int(row["cls"]), int(getattr(i, "index", i))

    env = aws_env(spec)
    # As litdata's README writes it (https://github.com/Lightning-AI/litData#readme):
    # optimize(...) once, then StreamingDataset(input_dir, storage_options=...) in its
    # StreamingDataLoader.
    # batch_decode="all" (documented: deserialize a chunk's items together once it is
    # local). Its "auto" picks windows of ~16 MB for ~100 KB byte items, and a chunk that
    # two workers share (one straddling their split of the epoch: most of the 64 MB
    # chunks when there are few) is not memory-mapped, so each window re-reads the whole
    # chunk file: ~4 ms of CPU per sample, 147 samples/s at 95% wait on 2 cores.
    dataset = Images(
        input_dir=spec.url,
        cache_dir=ensure_dir(os.path.join(spec.work_dir, "cache")),
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
