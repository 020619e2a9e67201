"""Where a tar dataset's shards get their sample counts and members, first found first.

Tar has no table of contents:

1. ``fastload.flidx`` next to the shards, written once by ``fastload index URL``
   (:func:`~fastload.datasets.tar.write_index`): per shard its size, version and sample
   count, and its members in a compressed section read when the shard is first used.
   Opening reads only this file; an entry whose shard changed since (size or version) is
   ignored, and the shard is indexed as in 4.
2. ``<cache dir>/indexes/``: a file per shard, keyed by its URL, version and size, kept
   when a shard was indexed before (4), or written there by ``fastload index`` where the
   dataset's folder is not writable (HTTP, a read-only bucket).
3. wids' ``shardindex.json`` at the dataset root gives sample counts only (enough for the
   plan and ``len()``); a shard's members are read from the shard when it is first used
   (it is staged to read a sample anyway) and must add up to that count.
4. Without any of these, opening reads every shard once to list its members.
"""

from __future__ import annotations

import io
import json
import logging
import posixpath
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastload.datasets.base import (
    DatasetError,
    StoreFile,
    keys_ending,
)
from fastload.datasets.tar.index import INDEX_NAME, IndexFile, index_path, write_atomically
from fastload.datasets.tar.members import BLOCK, SCAN_READ_BYTES, Member, count_samples, scan_tar
from fastload.store import CachedStore

log = logging.getLogger("fastload.datasets.tar")

WIDS_INDEX_NAME = "shardindex.json"
_WIDS_KIND = "wids-shard-index-v1"
# Shards staged per round while indexing: bounds what must stay cached until it is parsed
# (a cache smaller than the dataset would otherwise evict shards before they are indexed).
_STAGE_ROUND = 16
_INDEX_THREADS = 4


@dataclass(frozen=True)
class _Promise:
    """A shard whose sample count an index gives; its members are read on first use."""

    samples: int
    index: IndexFile | None  # holds its members; None: list them from the shard (wids)
    name: str  # the shard's name in that index
    source: str  # the index, as errors name it


def list_shards(store: CachedStore) -> list[str]:
    shards = keys_ending(store, ".tar")
    if not shards:
        keys = store.object_keys()
        compressed = [k for k in keys if k.endswith((".tar.gz", ".tgz", ".tar.zst", ".tar.xz"))]
        hint = (
            f"; compressed shards such as {compressed[0]!r} cannot be read at random: "
            "decompress them to .tar"
            if compressed
            else "; pick another format= (files, imagefolder, parquet, zarr)"
        )
        raise DatasetError(
            f"{store.url} holds no .tar shards ({len(keys)} objects, e.g. {keys[:3]}){hint}"
        )
    return shards


def promised_shards(store: CachedStore, shard_keys: list[str]) -> dict[str, _Promise]:
    """The shards whose sample counts an index gives (see the module docstring)."""
    listed = set(store.object_keys())
    promised: dict[str, _Promise] = {}
    if INDEX_NAME in listed:
        index = _dataset_index(store)
        for key in shard_keys:
            obj = store.object(key)
            entry = index.current(key, obj.size, obj.version)
            if entry is not None:
                if entry.samples == 0 and entry.members:  # checked now: never read later
                    _check_empty(index, key, store.object_url(key))
                promised[key] = _Promise(entry.samples, index, key, index.source)
        left = len(shard_keys) - len(promised)
        if left:
            log.warning(
                "fastload: %d of the %d tar shards of %s are new or changed since %s was "
                "written; they are indexed now: run `fastload index %s` again",
                left,
                len(shard_keys),
                store.url,
                index.source,
                store.url,
            )
    for key in shard_keys:
        if key not in promised and (cached := _cached_index(store, key)) is not None:
            url = store.object_url(key)
            entry = cached.entries[url]
            if entry.samples == 0 and entry.members:
                _check_empty(cached, url, url)
            promised[key] = _Promise(entry.samples, cached, url, cached.source)
    if WIDS_INDEX_NAME in listed:
        counts = _wids_counts(store, [k for k in shard_keys if k not in promised])
        source = store.object_url(WIDS_INDEX_NAME)
        promised.update((k, _Promise(n, None, k, source)) for k, n in counts.items())
    return promised


def _check_empty(index: IndexFile, name: str, url: str) -> None:
    """A shard an index says holds no samples is never read: its members (a section of the
    index) must say so too, or the shard's samples would be dropped without a word."""
    found = count_samples(index.members(name, url))
    if found:
        raise DatasetError(
            f"{url}: {index.source} says it holds no samples but lists members of {found}; "
            "the index is damaged: run `fastload index` on the dataset again"
        )


def _dataset_index(store: CachedStore) -> IndexFile:
    source = store.object_url(INDEX_NAME)
    try:
        return IndexFile(store.read(INDEX_NAME), source, reread=(store, INDEX_NAME))
    except (ValueError, KeyError, TypeError) as exc:
        raise DatasetError(
            f"{source} is not a readable fastload index ({exc}); run `fastload index "
            f"{store.url}` again to rewrite it, or delete it"
        ) from None


def _cached_index(store: CachedStore, key: str) -> IndexFile | None:
    """The cache's index of shard key, or None when missing, unreadable or implausible."""
    path = index_path(store, key)
    try:
        index = IndexFile(path.read_bytes(), str(path), reread=path)
        obj = store.object(key)
        if index.current(store.object_url(key), obj.size, obj.version) is None:
            raise ValueError("it is for another shard")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("fastload: rebuilding the damaged tar index %s: %s", path, exc)
        return None
    return index


def _wids_counts(store: CachedStore, keys: list[str]) -> dict[str, int]:
    """Sample counts of keys from wids' shardindex.json (those it lists for their size)."""
    source = store.object_url(WIDS_INDEX_NAME)
    try:
        data = json.loads(store.read(WIDS_INDEX_NAME))
        if data.get("__kind__") != _WIDS_KIND:
            raise ValueError(f"its __kind__ is {data.get('__kind__')!r}, not {_WIDS_KIND!r}")
        listed: dict[str, dict[str, Any]] = {}
        for shard in data["shardlist"]:
            key = _key_of(store.url, str(shard["url"]))
            if key is not None:
                listed[key] = shard
        counts = {}
        for key in keys:
            shard = listed.get(key)
            size = store.object(key).size
            if shard is None or shard.get("filesize", size) != size:
                continue  # not in it, or changed since: indexed from the shard
            n = shard["nsamples"]
            most = (size // BLOCK) if size is not None else 1 << 40  # a sample: a member
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= most:
                raise ValueError(f"nsamples of {key} is {n!r}, expected a count to {most}")
            if n > 0:  # a shard said to be empty is read at open: never dropped unread
                counts[key] = n
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("fastload: ignoring %s, which is not a wids shard index: %s", source, exc)
        return {}
    return counts


def _key_of(root: str, url: str) -> str | None:
    """The key below root of a shard URL of a wids index at root (relative, or absolute)."""
    if "://" in url or url.startswith("/"):
        prefix = root.rstrip("/") + "/"
        return url[len(prefix) :] if url.startswith(prefix) else None
    key = posixpath.normpath(url)
    return None if key == ".." or key.startswith("../") else key


def index_shards(store: CachedStore, keys: list[str]) -> dict[str, list[Member]]:
    """The members of shards no index knows, read from the shards now (and kept in the cache).

    They are staged a round at a time (concurrently, by the stager) and read on a few
    threads while the next round downloads.
    """
    if not keys:
        return {}
    total = sum(store.object(k).size or 0 for k in keys)
    log.warning(
        "fastload: opening %s reads %d tar shard(s) (%.1f MB) to find their samples; run "
        "`fastload index %s` once and opening it reads only an index",
        store.url,
        len(keys),
        total / 1e6,
        store.url,
    )
    started = time.monotonic()
    found: dict[str, list[Member]] = {}
    with ThreadPoolExecutor(_INDEX_THREADS, thread_name_prefix="fastload-tar-index") as pool:
        futures: dict[str, Future[list[Member]]] = {}
        try:
            for r in range(0, len(keys), _STAGE_ROUND):
                round_keys = keys[r : r + _STAGE_ROUND]
                store.stage(round_keys)  # a failure is raised by the read that needs it
                futures.update((k, pool.submit(scan_shard, store, k)) for k in round_keys)
                for f in futures.values():  # fail early, not after the last download
                    if f.done():
                        f.result()
            found.update((k, f.result()) for k, f in futures.items())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    log.info(
        "fastload: indexed %d tar shards of %s in %.1f s",
        len(keys),
        store.url,
        time.monotonic() - started,
    )
    return found


def scan_shard(store: CachedStore, key: str) -> list[Member]:
    """The members of shard key, read through the cache, kept in the cache's indexes."""
    url = store.object_url(key)
    obj = store.object(key)
    raw = StoreFile(store, key, obj.size)
    with io.BufferedReader(raw, SCAN_READ_BYTES) as f:
        members = scan_tar(f, url, obj.size)
    _save(index_path(store, key), IndexFile.encode([(url, obj.size, obj.version, members)]))
    return members


def _save(path: Path, data: bytes) -> None:
    """Writes a cache index atomically (a temporary file beside it, then os.replace)."""
    try:
        write_atomically(path, data)
    except OSError as exc:  # the index only saves time: the dataset still opens without it
        log.warning(
            "fastload: cannot save the tar index %s (%s); it is rebuilt next time", path, exc
        )
