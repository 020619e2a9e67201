"""Loopback servers that stand in for remote object storage in tests and benchmarks.

``RangeHTTPServer`` serves a local directory over HTTP with byte ranges;
``S3FolderServer`` speaks S3's REST protocol over a local folder (each subfolder a
bucket) with little CPU per request, for benchmarks and most S3 tests; ``S3Server`` runs
moto's S3 (needs ``pip install "moto[server]"``, imported only when an ``S3Server`` is
created), which spends milliseconds of CPU per request. All take the same knobs
(``RemoteBehavior``), fault injection (``fail_next``/``truncate_next``/``reset_next``)
and counters (``stats()``) from ``RemoteControls``. ``S3FolderProcess`` runs an
``S3FolderServer`` in a process of its own, also serving *synthetic* buckets
(``fastload.testing.synthetic``: ImageNet-sized folders and tar shard sets computed from
(key, seed), never stored), and counts what it answered (``read_stats()``).
``HubServerProcess`` serves a local folder as a Hugging Face Hub dataset repository
(``hf://`` URLs, ``fastload.testing.hf_hub``) from a process of its own.
"""

from __future__ import annotations

from fastload.testing.faults import (
    Fault,
    FaultKind,
    RemoteBehavior,
    RemoteControls,
    RequestStats,
)
from fastload.testing.hf_hub import HubServer, HubServerProcess
from fastload.testing.http_server import RangeHTTPServer
from fastload.testing.process import HTTPServerProcess
from fastload.testing.s3_folder import ReadStats, S3FolderProcess, S3FolderServer
from fastload.testing.s3_server import S3Server

__all__ = [
    "Fault",
    "FaultKind",
    "HTTPServerProcess",
    "HubServer",
    "HubServerProcess",
    "RangeHTTPServer",
    "ReadStats",
    "RemoteBehavior",
    "RemoteControls",
    "RequestStats",
    "S3FolderProcess",
    "S3FolderServer",
    "S3Server",
]
