"""Which transport serves a filesystem in this process: obstore for S3 and plain HTTP where
it sends what fsspec would, the Hub's for ``hf://``, fsspec for everything else. One per
filesystem and process, so connections are reused across staging calls."""

from __future__ import annotations

import os
import threading

import fsspec

from fastload.remote.hub import HubTransport
from fastload.remote.obstore import ObjectStoreHTTPTransport, ObjectStoreTransport
from fastload.remote.transport import FsspecTransport, Transport

_by_fs: dict[tuple[int, int, float, bool], Transport] = {}


_by_fs_lock = threading.Lock()


def transport_for(
    fs: fsspec.AbstractFileSystem, timeout_s: float = 60.0, *, fsspec_only: bool = False
) -> Transport:
    """The transport for fs in this process (one per filesystem and process, so its
    connections are reused across staging calls)."""
    key = (os.getpid(), id(fs), timeout_s, fsspec_only)
    with _by_fs_lock:
        transport = _by_fs.get(key)
    if transport is None:
        made: Transport | None = None
        if not fsspec_only:
            made = ObjectStoreTransport.from_s3fs(fs, timeout_s)
            made = made or ObjectStoreHTTPTransport.from_http(fs, timeout_s)
            made = made or HubTransport.from_hf(fs, timeout_s)
        transport = made if made is not None else FsspecTransport(fs, timeout_s)
        with _by_fs_lock:
            transport = _by_fs.setdefault(key, transport)
    return transport
