"""An ``s3://`` filesystem made only where something needs it.

Where obstore serves a bucket (:mod:`fastload.remote.obstore`), listing and GETs need
nothing of s3fs but its paths and storage options, and importing s3fs (with aiobotocore
and botocore) costs a cold start ~0.3 s of the GIL. :class:`LazyS3Filesystem` answers
``protocol``, ``split_path`` and ``storage_options`` itself and makes the s3fs filesystem
(fsspec's cached instance, as ``fsspec.core.url_to_fs`` would) at the first other attribute
asked for: an fsspec fallback, a listing obstore declines, settings only botocore resolves.
It pickles to its options, so a staging process stays as lazy as its parent.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import Any

import fsspec
import fsspec.utils


class LazyS3Filesystem:
    """s3fs's filesystem for these storage options, made at first need (see the module
    docstring); one per options and process, as fsspec caches its instances."""

    protocol = ("s3", "s3a")

    def __init__(self, storage_options: dict[str, Any]) -> None:
        self.storage_options = storage_options
        self._fs: fsspec.AbstractFileSystem | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def materialize(self) -> fsspec.AbstractFileSystem:
        """The s3fs filesystem itself (made now if it was not; anew in a forked child,
        whose copy of the parent's event loop does not run)."""
        with self._lock:
            if self._fs is None or self._pid != os.getpid():
                from fastload.remote.scrub import redact_transport_logs

                self._fs = fsspec.filesystem("s3", **self.storage_options)
                self._pid = os.getpid()
                redact_transport_logs()  # s3fs's modules (and their loggers) exist now
            return self._fs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_fs", "_pid", "_lock", "storage_options"):
            raise AttributeError(name)  # (copy and pickle probe these before __init__)
        return getattr(self.materialize(), name)

    def split_path(self, path: str) -> tuple[str, str, str | None]:
        """(bucket, key, None) as s3fs splits a path of a bucket named plainly (no access
        point ARN: ``lazy_s3_root`` leaves those to s3fs) without ``version_aware``."""
        trail = path[len(path.rstrip("/")) :]
        path = _strip_protocol(path).lstrip("/")
        if "/" not in path:
            return path, "", None
        bucket, _, key = path.partition("/")
        key, _, _version = key.partition("?versionId=")
        return bucket, key + trail, None

    def __reduce__(self) -> tuple[Any, ...]:
        return (lazy_s3_filesystem, (self.storage_options,))

    def __repr__(self) -> str:
        return "LazyS3Filesystem()"  # never the options: they may carry a secret


def _strip_protocol(path: str) -> str:
    """fsspec's ``AbstractFileSystem._strip_protocol`` for s3fs's protocols."""
    for protocol in LazyS3Filesystem.protocol:
        if path.startswith(protocol + "://"):
            path = path[len(protocol) + 3 :]
        elif path.startswith(protocol + "::"):
            path = path[len(protocol) + 2 :]
    return path.rstrip("/")


def lazy_s3_root(url: str) -> str | None:
    """The dataset root of a plain ``s3://bucket/prefix`` URL as s3fs names it, or None
    where only s3fs can say (a chained URL, a query string such as ``?versionId=``, an
    access point ARN) or s3fs is not installed (fsspec's error says what to install)."""
    protocol, _ = fsspec.core.split_protocol(url)
    if protocol not in LazyS3Filesystem.protocol or "::" in url or "?" in url:
        return None
    root = _strip_protocol(url)
    if root.startswith("arn:") or importlib.util.find_spec("s3fs") is None:
        return None
    return root


_instances: dict[tuple[int, str], LazyS3Filesystem] = {}
_instances_lock = threading.Lock()


def lazy_s3_filesystem(storage_options: dict[str, Any]) -> LazyS3Filesystem:
    """The process's lazy filesystem for these options: the same object every time, as
    fsspec's instance cache gives (a transport and a staging process are kept per
    filesystem)."""
    key = (os.getpid(), fsspec.utils.tokenize(storage_options))
    with _instances_lock:
        fs = _instances.get(key)
        if fs is None:
            fs = _instances[key] = LazyS3Filesystem(dict(storage_options))
        return fs


def real_filesystem(fs: Any) -> Any:
    """fs itself, or the s3fs filesystem a lazy one stands for."""
    return fs.materialize() if isinstance(fs, LazyS3Filesystem) else fs
