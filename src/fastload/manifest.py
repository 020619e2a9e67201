"""The source stage: one listing of a dataset root, kept in the cache as a manifest.

A manifest records, for every object under the root, its key (the path below the root,
``/``-separated), its size and its version (ETag, version id, mtime, whatever the backend
gives), so later stages never list the remote again unless asked to (``refresh``) or the
listing is older than its time-to-live.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from fastload.errors import RemoteError
from fastload.remote import is_http, key_of, open_filesystem, public_url, remote_url, with_retries
from fastload.transport import transport_for

_VERSION_FIELDS = (
    "VersionId",
    "ETag",
    "etag",
    "md5Hash",
    "generation",
    "LastModified",
    "Last-Modified",
    "last_modified",
    "mtime",
    "updated",
    "created",
)
_HEAD_CONCURRENCY = 64
_HEAD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class RemoteObject:
    """One object of a dataset: ``key`` is its path below the dataset root."""

    key: str
    size: int | None
    version: str | None


@dataclass(frozen=True)
class Manifest:
    url: str  # the dataset root, credentials removed
    objects: tuple[RemoteObject, ...]
    listed_at: float

    @property
    def dataset_id(self) -> str:
        return hashlib.sha256(self.url.encode()).hexdigest()[:24]

    @property
    def total_bytes(self) -> int:
        return sum(o.size or 0 for o in self.objects)

    def object_url(self, obj: RemoteObject) -> str:
        return self.url if obj.key == "" else f"{self.url.rstrip('/')}/{obj.key}"

    def __iter__(self) -> Iterator[RemoteObject]:
        return iter(self.objects)

    def __len__(self) -> int:
        return len(self.objects)

    def to_json(self) -> str:
        return json.dumps(
            {
                "url": self.url,
                "listed_at": self.listed_at,
                "objects": [[o.key, o.size, o.version] for o in self.objects],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(
            url=data["url"],
            listed_at=float(data["listed_at"]),
            objects=tuple(RemoteObject(k, s, v) for k, s, v in data["objects"]),
        )


def _version(info: dict[str, Any]) -> str | None:
    parts = [f"{f}={info[f]}" for f in _VERSION_FIELDS if info.get(f) not in (None, "")]
    return ";".join(parts)[:512] if parts else None


def _crawl_pages(fs: fsspec.AbstractFileSystem, root: str) -> dict[str, dict[str, Any]]:
    """Lists an HTTP tree of directory pages: every page and every HEAD concurrently.

    fsspec's own find walks pages one after another and gives no sizes; at 20 ms a request
    that costs seconds for a few thousand files in a hundred folders.
    """
    prefix = root.rstrip("/") + "/"

    async def crawl() -> dict[str, dict[str, Any]]:
        gate = asyncio.Semaphore(_HEAD_CONCURRENCY)
        found: dict[str, dict[str, Any]] = {}

        async def head(name: str) -> None:
            async with gate:
                found[name] = await asyncio.wait_for(fs._info(name), _HEAD_TIMEOUT_S)

        async def page(path: str) -> None:
            async with gate:
                entries = await asyncio.wait_for(fs._ls(path, detail=True), _HEAD_TIMEOUT_S)
            work = []
            for entry in entries:
                name = entry["name"]
                if not name.startswith(prefix) or name.rstrip("/") == path.rstrip("/"):
                    continue  # links out of the tree, or back to this page
                if entry.get("type") == "directory" or name.endswith("/"):
                    work.append(page(name))
                elif entry.get("size") is None:
                    work.append(head(name))
                else:
                    found[name] = entry
            await asyncio.gather(*work)

        await page(root)
        return found

    return fsspec.asyn.sync(fs.loop, crawl)  # type: ignore[no-any-return]


def list_dataset(url: str, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Lists every object under url (or the one object url names)."""
    fs, root = open_filesystem(url, storage_options)
    shown = public_url(url)

    def listing() -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] | None = None
        found = _crawl_pages(fs, root) if is_http(fs) else transport_for(fs).find(root)
        if found is None:
            found = fs.find(root, detail=True, withdirs=False)
        if not found and fs.isfile(root):
            found = {root: fs.info(root)}
        return found

    found = with_retries(listing, shown)
    if not found:
        raise RemoteError(
            2, f"{shown} lists no objects; check the URL (and storage_options for credentials)"
        )
    objects = sorted(
        (
            RemoteObject(
                key=key_of(fs, root, str(info.get("name", name))),
                size=None if info.get("size") is None else int(info["size"]),
                version=_version(info),
            )
            for name, info in found.items()
            if not str(info.get("name", name)).endswith("/")  # a folder marker, no object
        ),
        key=lambda o: o.key,
    )
    root_url = remote_url(fs, root)
    return Manifest(url=root_url, objects=tuple(objects), listed_at=time.time())


def manifest_path(cache_dir: Path, url: str) -> Path:
    return (
        cache_dir
        / "manifests"
        / (hashlib.sha256(public_url(url).encode()).hexdigest()[:24] + ".json")
    )


def load_manifest(
    url: str,
    cache_dir: Path,
    storage_options: dict[str, Any] | None = None,
    *,
    refresh: bool = False,
    ttl_s: float | None = None,
) -> Manifest:
    """The cached listing of url, or a fresh one (kept for next time) when asked or stale."""
    path = manifest_path(cache_dir, url)
    if not refresh:
        try:
            manifest = Manifest.from_json(path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing or unreadable: list again
        else:
            if ttl_s is None or time.time() - manifest.listed_at <= ttl_s:
                return manifest
    manifest = list_dataset(url, storage_options)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)
    return manifest
