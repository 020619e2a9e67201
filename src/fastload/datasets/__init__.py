"""Datasets over what users already have: file folders, tar shards, Zarr arrays, Parquet.

``open_dataset(url, format="auto")`` decides the format from the listing and says what it
decided (``dataset.format``, ``dataset.format_reason``, and a log line).
:func:`register_format` adds a format of one's own: a :class:`ShardedDataset` subclass that
``open_dataset(format=name)``, ``fl.warm`` and ``fastload warm --format name`` open (by
name only: ``"auto"`` never picks it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fastload.cache import BudgetCounts, Policy
from fastload.datasets.base import DatasetError, ShardedDataset
from fastload.datasets.columns import ends_with, key_tails, slashes
from fastload.datasets.folder import (
    IMAGE_EXTENSIONS,
    FileDataset,
    ImageFolderDataset,
    with_extension,
)
from fastload.datasets.tar import INDEX_NAME, WIDS_INDEX_NAME
from fastload.manifest import Manifest, RemoteObject
from fastload.staging import FetchConfig
from fastload.store import CachedStore, StoreConfig

log = logging.getLogger(__name__)

FORMATS = ("auto", "imagefolder", "files", "tar", "zarr", "parquet")  # the built-in ones
_NOTE_SUFFIXES = (b".md", b".json", b".txt", b".yaml", b".yml", b"tributes", b"LICENSE")


# Formats added by register_format: name -> opener(store, **format_options).
_REGISTERED: dict[str, Callable[..., ShardedDataset]] = {}


def register_format(name: str, opener: Callable[..., ShardedDataset]) -> None:
    """Adds format ``name``: ``opener(store, **format_options)`` (a :class:`ShardedDataset`
    subclass, or a function returning one) opens a :class:`~fastload.store.CachedStore`
    as that format. Registering a name again replaces its opener; a built-in name is
    refused. The format is then one of :func:`formats` (``fastload warm --format``'s
    choices, in this process)."""
    if not isinstance(name, str) or not name or name in FORMATS:
        raise ValueError(
            f"a format's name must be a non-empty string other than the built-in "
            f"{', '.join(FORMATS)}; got {name!r}"
        )
    if not callable(opener):
        raise TypeError(f"opener must be callable (store, **options) -> dataset, got {opener!r}")
    _REGISTERED[name] = opener


def formats() -> tuple[str, ...]:
    """Every format :func:`open_dataset` opens: the built-in ``FORMATS``, then the
    registered ones."""
    return FORMATS + tuple(_REGISTERED)


def _opener(fmt: str) -> Callable[..., ShardedDataset]:
    if fmt in _REGISTERED:
        return _REGISTERED[fmt]
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
    if fmt == "parquet":
        from fastload.datasets.parquet import ParquetDataset

        return ParquetDataset
    raise ValueError(f"format must be one of {', '.join(formats())}, got {fmt!r}")


def detect_format(keys: Sequence[str] | Manifest) -> tuple[str, str]:
    """(format, why) from the keys of a listing (or the listing itself)."""
    manifest = keys if isinstance(keys, Manifest) else Manifest("", _objects(keys))
    found = manifest.derived(
        "format", lambda: dict(zip(("format", "reason"), _detect(manifest), strict=True))
    )
    return str(found["format"]), str(found["reason"])


def _detect(manifest: Manifest) -> tuple[str, str]:
    tails = key_tails(manifest)
    first, _ = slashes(manifest)
    meta = np.flatnonzero(ends_with(tails, [b".zarray", b".zgroup", b"arr.json"]))
    names = (manifest.key(int(i)).rsplit("/", 1)[-1] for i in meta)
    if any(n in (".zarray", ".zgroup", "zarr.json") for n in names):
        return "zarr", "the listing holds Zarr metadata (.zarray/.zgroup/zarr.json)"
    tars = int(ends_with(tails, [b".tar"]).sum())
    # A tar dataset's own index files beside its shards are not objects of another kind.
    indexes = sum(manifest.index_of(name) >= 0 for name in (INDEX_NAME, WIDS_INDEX_NAME))
    if tars and tars * 2 >= len(manifest) - indexes:
        return "tar", f"{tars} of {len(manifest)} objects are .tar shards"
    parquets = int(ends_with(tails, [b".parquet"]).sum())
    # A Hub dataset's README.md, .gitattributes and JSON beside its files are not samples.
    notes = int(ends_with(tails, _NOTE_SUFFIXES).sum())
    if parquets and parquets * 2 >= len(manifest) - notes:
        return "parquet", f"{parquets} of {len(manifest)} objects are .parquet files"
    if len(manifest) == 1 and manifest.key(0) == "" and manifest.url.endswith(".parquet"):
        return "parquet", "the URL names a .parquet file"
    images = with_extension(manifest, IMAGE_EXTENSIONS)
    if images.any() and (first[images] >= 0).all():
        return "imagefolder", "images sit in class folders one level or more below the root"
    return "files", "no Zarr metadata, tar shards, Parquet files or class folders of images"


def _objects(keys: Iterable[str]) -> list[RemoteObject]:
    return [RemoteObject(k, None, None) for k in keys]


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
    verify_reads: bool = True,
    budget_counts: BudgetCounts = "disk",
    **format_options: Any,
) -> ShardedDataset:
    """A map-style dataset over url whose samples are read through the local cache.

    ``format_options`` go to the format's class (e.g. ``arrays=["images", "labels"]`` for
    Zarr). The dataset knows its shards (``shard_sizes``, ``shard_keys``).
    ``verify_reads=False`` trusts cached bytes instead of checking each read against the
    checksum recorded at publish (a few % of a decoding epoch; more where nothing else is
    done with the bytes: see the README). ``max_bytes`` counts everything the cache puts
    on disk; ``budget_counts="entries"`` counts the entries' bytes only (tests, toys).
    """
    if format not in formats():
        raise ValueError(f"format must be one of {', '.join(formats())}, got {format!r}")
    store = CachedStore(
        StoreConfig(
            url=url,
            cache_dir=cache_dir,
            storage_options=dict(storage_options or {}),
            max_bytes=max_bytes,
            policy=policy,
            budget_counts=budget_counts,
            refresh=refresh,
            ttl_s=ttl_s,
            fetch=fetch or FetchConfig(),
            verify_reads=verify_reads,
        )
    )
    reason = "asked for"
    if format == "auto":
        format, reason = _detected(store)
    if _stages_many_objects(format):
        # Before the listing (a named format), which hides its start-up; after it (a
        # detected one), overlapping the format's opening and the first batch.
        store.start_staging_process()
    return _opened(store, format, reason, format_options)


def open_on(store: CachedStore, *, format: str = "auto", **format_options: Any) -> ShardedDataset:
    """The dataset of ``format`` (``"auto"`` detects it) over ``store``, as
    :func:`open_dataset` opens it, but without starting the store's staging process ahead
    (``fl.warm``: its one round starts it where it will be used)."""
    reason = "asked for"
    if format == "auto":
        format, reason = _detected(store)
    return _opened(store, format, reason, format_options)


def _detected(store: CachedStore) -> tuple[str, str]:
    format, reason = detect_format(store.manifest)
    log.info("fastload: %s opened as format=%r: %s", store.url, format, reason)
    return format, reason


def _opened(
    store: CachedStore, format: str, reason: str, format_options: dict[str, Any]
) -> ShardedDataset:
    dataset = _opener(format)(store, **format_options)
    dataset.format_reason = reason
    return dataset


def _stages_many_objects(format: str) -> bool:
    """Whether the format says its rounds stage many small objects
    (``ShardedDataset.stages_many_objects``; an opener that is not a class says nothing)."""
    return bool(getattr(_opener(format), "stages_many_objects", False))


__all__ = [
    "FORMATS",
    "DatasetError",
    "FileDataset",
    "ImageFolderDataset",
    "ShardedDataset",
    "detect_format",
    "formats",
    "open_dataset",
    "open_on",
    "register_format",
]
