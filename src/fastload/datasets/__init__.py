"""Datasets over what users already have: file folders, tar shards, Zarr arrays.

``open_dataset(url, format="auto")`` decides the format from the listing and says what it
decided (``dataset.format``, ``dataset.format_reason``, and a log line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastload.cache import Policy
from fastload.datasets.base import DatasetError, ShardedDataset
from fastload.datasets.folder import IMAGE_EXTENSIONS, FileDataset, ImageFolderDataset
from fastload.stage import FetchConfig
from fastload.store import CachedStore, StoreConfig

log = logging.getLogger(__name__)

FORMATS = ("auto", "imagefolder", "files", "tar", "zarr")


def _opener(fmt: str) -> Callable[..., ShardedDataset]:
    if fmt == "imagefolder":
        return ImageFolderDataset
    if fmt == "files":
        return FileDataset
    if fmt == "tar":
        from fastload.datasets.tar import TarDataset

        return TarDataset
    if fmt == "zarr":
        from fastload.datasets.zarr import ZarrDataset

        return ZarrDataset
    raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def detect_format(keys: list[str]) -> tuple[str, str]:
    """(format, why) from the keys of a listing."""
    names = [k.rsplit("/", 1)[-1] for k in keys]
    if any(n in (".zarray", ".zgroup", "zarr.json") for n in names):
        return "zarr", "the listing holds Zarr metadata (.zarray/.zgroup/zarr.json)"
    tars = [k for k in keys if k.endswith(".tar")]
    if tars and len(tars) * 2 >= len(keys):
        return "tar", f"{len(tars)} of {len(keys)} objects are .tar shards"
    images = [k for k in keys if k.lower().endswith(IMAGE_EXTENSIONS)]
    if images and all("/" in k for k in images):
        return "imagefolder", "images sit in class folders one level or more below the root"
    return "files", "no Zarr metadata, tar shards or class folders of images"


def open_dataset(
    url: str,
    *,
    format: str = "auto",
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    max_bytes: int | None = None,
    policy: Policy = "lru",
    refresh: bool = False,
    ttl_s: float | None = None,
    fetch: FetchConfig | None = None,
    **format_options: Any,
) -> ShardedDataset:
    """A map-style dataset over url whose samples are read through the local cache.

    ``format_options`` go to the format's class (e.g. ``arrays=["images", "labels"]`` for
    Zarr). The dataset knows its shards (``shard_sizes``, ``shard_keys``).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    store = CachedStore(
        StoreConfig(
            url=url,
            cache_dir=cache_dir,
            storage_options=dict(storage_options or {}),
            max_bytes=max_bytes,
            policy=policy,
            refresh=refresh,
            ttl_s=ttl_s,
            fetch=fetch or FetchConfig(),
        )
    )
    reason = "asked for"
    if format == "auto":
        format, reason = detect_format(store.object_keys())
        log.info("fastload: %s opened as format=%r: %s", store.url, format, reason)
    dataset = _opener(format)(store, **format_options)
    dataset.format_reason = reason
    return dataset


__all__ = [
    "FORMATS",
    "DatasetError",
    "FileDataset",
    "ImageFolderDataset",
    "ShardedDataset",
    "detect_format",
    "open_dataset",
]
