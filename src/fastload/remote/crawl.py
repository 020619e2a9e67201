"""Listing a remote: every object under a dataset root with its size and version, as
columns (:class:`fastload.remote.listing.Listing`). S3 through obstore lists class folders
concurrently; HTTP trees are crawled page by page; ``hf://`` at one commit; the rest
through fsspec's ``find``."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import fsspec

from fastload.errors import RemoteError
from fastload.remote.connect import transport_for
from fastload.remote.errors import classify, with_retries
from fastload.remote.hub import is_hf, list_hub
from fastload.remote.listing import Listing
from fastload.remote.scrub import clean_cause, public_url
from fastload.remote.urls import is_http, key_of, open_filesystem, remote_url

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


def list_remote(
    url: str, storage_options: dict[str, Any] | None = None, *, progress: bool = False
) -> tuple[str, Listing]:
    """(the root's URL, every object under url or the one object url names).

    S3 (through obstore) lists class folders and other common prefixes concurrently and
    builds the columns without a Python dict per object; other backends go through fsspec.
    ``progress`` shows a count on stderr while listing.
    """
    fs, root = open_filesystem(url, storage_options)
    shown = public_url(url)
    root_url = remote_url(fs, root)
    counter = _ListingProgress(shown) if progress else None
    transport = transport_for(fs)
    columns: Listing | None = None
    if is_hf(fs):
        columns = with_retries(lambda: list_hub(fs, root, counter), shown)
    elif not is_http(fs):
        # Its pages retry themselves (remote/obstore.py): a failure here is final, and
        # retrying it would list the whole bucket again; it is said as any remote's is.
        try:
            columns = transport.list_columns(root, counter)
        except RemoteError:
            raise
        except Exception as exc:
            raise classify(exc, shown) from clean_cause(exc)
    if columns is not None and len(columns):
        if counter is not None:
            counter.done(len(columns))
        return root_url, columns

    def listing() -> dict[str, dict[str, Any]]:
        if is_http(fs):
            found = _crawl_pages(fs, root)
        else:
            found = fs.find(root, detail=True, withdirs=False)
        if not found and fs.isfile(root):
            found = {root: fs.info(root)}
        return found

    found = with_retries(listing, shown)
    if not found:
        raise RemoteError(
            2, f"{shown} lists no objects; check the URL (and storage_options for credentials)"
        )
    names = [str(info.get("name", name)) for name, info in found.items()]
    infos = [
        info for name, info in zip(names, found.values(), strict=True) if not name.endswith("/")
    ]  # a name ending in / is a folder marker, no object
    columns = Listing.of(
        [key_of(fs, root, name) for name in names if not name.endswith("/")],
        [None if info.get("size") is None else int(info["size"]) for info in infos],
        [_version(info) for info in infos],
    )
    if counter is not None:
        counter.done(len(columns))
    return root_url, columns


class _ListingProgress:
    """Objects listed so far, on one rewritten line of a terminal (nothing elsewhere)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.count = 0
        self._shown = 0.0
        self._tty = sys.stderr.isatty()

    def __call__(self, listed: int) -> None:
        self.count += listed
        now = time.monotonic()
        if self._tty and now - self._shown > 0.2:
            self._shown = now
            sys.stderr.write(f"\rlisting {self.url}: {self.count:,} objects")
            sys.stderr.flush()

    def done(self, count: int) -> None:
        if self._tty:
            sys.stderr.write(f"\rlisted {self.url}: {count:,} objects\n")
            sys.stderr.flush()
