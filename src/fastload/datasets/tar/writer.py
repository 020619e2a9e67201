"""``fastload index``: reads each shard once and writes its index next to the shards or
into the cache, so that opening the dataset reads only the index."""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from fastload.datasets.base import (
    DatasetError,
)
from fastload.datasets.tar.index import INDEX_NAME, IndexFile, index_path, write_atomically
from fastload.datasets.tar.members import SCAN_READ_BYTES, Member, count_samples, scan_tar
from fastload.datasets.tar.sources import list_shards
from fastload.errors import RemoteAccessError
from fastload.progress import Progress, ProgressBar
from fastload.remote import (
    classify,
    clean_cause,
    is_http,
    open_filesystem,
    path_of,
    remote_url,
)
from fastload.remote.hub import is_hf
from fastload.store import CachedStore, StoreConfig

INDEX_JOBS = 8

Where = Literal["auto", "dataset", "cache"]


@dataclass(frozen=True, kw_only=True)
class IndexReport:
    """What :func:`write_index` did; ``to_dict()`` is what ``fastload index --json`` prints."""

    url: str
    written_to: str  # the index file next to the shards, or the cache's index folder
    in_cache: bool
    why_in_cache: str  # empty when written next to the shards
    shards: int
    samples: int
    shard_bytes: int  # the shards' size, each read once
    index_bytes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_index(
    url: str,
    *,
    cache_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
    jobs: int = INDEX_JOBS,
    to: Where = "auto",
    progress: bool | Callable[[Progress], None] | None = None,
) -> IndexReport:
    """Reads each tar shard at url once (streamed, ``jobs`` at a time, not cached) and
    writes fastload's index of them, so that opening the dataset reads only the index.

    ``to="dataset"`` writes ``fastload.flidx`` next to the shards (a local folder, a bucket
    with write access; never a Hugging Face repository, where it would be a commit);
    ``"cache"`` writes a file per shard into ``<cache dir>/indexes/``, which serves opens
    that use this cache directory; ``"auto"`` writes next to the shards of a local folder
    (where it can), into the cache otherwise: fastload writes to a remote only when asked.
    The listing in the cache is refreshed, so the next open sees the index.
    ``progress=None`` shows a bar when stderr is a terminal.
    """
    if to not in ("auto", "dataset", "cache"):
        raise ValueError(f"to must be 'auto', 'dataset' or 'cache', got {to!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be 1 or more, got {jobs}")
    started = time.monotonic()
    config = StoreConfig(
        url=url, cache_dir=cache_dir, storage_options=dict(storage_options or {}), refresh=True
    )
    store = CachedStore(config)  # listed afresh: the index is of the shards there now
    try:
        keys = list_shards(store)
        fs, root = open_filesystem(url, config.storage_options)
        if to == "dataset" and is_hf(fs):  # refused before a shard is read
            raise DatasetError(
                f"cannot write an index next to the shards of {store.url}: fastload never "
                "commits to a Hugging Face repository; index into the cache (--to cache)"
            )
        why = "asked for" if to == "cache" else _why_not_beside(fs, keys, to)
        if to == "dataset" and why:
            raise DatasetError(f"cannot write an index next to the shards of {store.url}: {why}")
        objects = [store.object(k) for k in keys]
        urls = [store.object_url(k) for k in keys]
        members = _stream_members(
            store, list(zip(keys, urls, [o.size for o in objects], strict=True)), jobs, progress
        )
        if not why:
            data = IndexFile.encode(
                (k, o.size, o.version, m) for k, o, m in zip(keys, objects, members, strict=True)
            )
            try:
                written = _write_beside(fs, root, data)
            except _NotWritable as exc:
                if to == "dataset":
                    raise DatasetError(
                        f"cannot write an index next to the shards of {store.url}: {exc}"
                    ) from None
                why = str(exc)
            else:
                index_bytes = len(data)
                relisted = CachedStore(config)  # so that opens with this cache see the file
                try:
                    relisted.object_keys()
                finally:
                    relisted.close()
        if why:
            written = str(store.cache.dir / "indexes")
            index_bytes = 0
            for key, obj, m in zip(keys, objects, members, strict=True):
                data = IndexFile.encode([(store.object_url(key), obj.size, obj.version, m)])
                write_atomically(index_path(store, key), data)
                index_bytes += len(data)
        return IndexReport(
            url=store.url,
            written_to=written,
            in_cache=bool(why),
            why_in_cache=why,
            shards=len(keys),
            samples=sum(count_samples(m) for m in members),
            shard_bytes=sum(o.size or 0 for o in objects),
            index_bytes=index_bytes,
            seconds=time.monotonic() - started,
        )
    finally:
        store.close()


def _stream_members(
    store: CachedStore,
    shards: list[tuple[str, str, int | None]],
    jobs: int,
    progress: bool | Callable[[Progress], None] | None,
) -> list[list[Member]]:
    """The members of each (key, URL, size) shard, ``jobs`` shards streamed at a time."""
    callback = progress if callable(progress) else None
    if progress is None or progress is True:
        callback = ProgressBar(len(shards), sum(size or 0 for _, _, size in shards))
    counts = Progress(callback=callback)
    found: list[list[Member]] = [[] for _ in shards]
    assert store.stager is not None  # made here, once, before the threads share it
    with ThreadPoolExecutor(jobs, thread_name_prefix="fastload-tar-index") as pool:
        futures = {pool.submit(_stream_scan, store, *shard): i for i, shard in enumerate(shards)}
        try:
            for future in as_completed(futures):
                i = futures[future]
                found[i] = future.result()
                counts.add(shards[i][2] or 0, fetched=True)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return found


def _stream_scan(store: CachedStore, key: str, url: str, size: int | None) -> list[Member]:
    """The members of one shard, streamed in large reads, not cached: each read is a GET
    pinned at the listed version (an hf:// shard at the listed commit), retried on its own;
    a shard rewritten since the listing is an error naming it, never indexed as the old one.
    """
    with store.stream(key, SCAN_READ_BYTES) as f:
        return scan_tar(f, url, size)  # type: ignore[arg-type]


class _NotWritable(Exception):
    """The dataset's folder does not take an index file; the message says why."""


def _why_not_beside(fs: Any, keys: list[str], to: Where) -> str:
    """Why an index cannot go next to the shards, or "" if it may."""
    if keys == [""]:
        return "the URL names one shard, not a folder"
    if is_http(fs):
        return "HTTP servers take no uploads"
    if is_hf(fs):
        return "fastload never commits to a Hugging Face repository"
    if to == "auto" and not _is_local(fs):
        return "fastload writes to a remote only when asked: --to dataset"
    return ""


def _is_local(fs: Any) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(p in ("file", "local") for p in protocols)


def _write_beside(fs: Any, root: str, data: bytes) -> str:
    """Writes fastload.flidx next to the shards; its URL. Raises _NotWritable if refused."""
    path = path_of(fs, root, INDEX_NAME)
    shown = remote_url(fs, path)
    try:
        if _is_local(fs):
            write_atomically(Path(path), data)
        else:
            fs.pipe_file(path, data)  # one PUT: an object appears whole or not at all
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _NotWritable(f"{shown} is not writable ({exc.strerror})") from None
        error = classify(exc, shown)
        if isinstance(error, RemoteAccessError):
            raise _NotWritable(f"writing {shown} was refused ({error.reason})") from None
        raise error from clean_cause(exc)
    return shown
