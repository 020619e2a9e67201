"""Loopback servers that stand in for remote object storage in tests and benchmarks.

``RangeHTTPServer`` serves a local directory over HTTP with byte ranges;
``S3Server`` runs moto's S3 (needs ``pip install "moto[server]"``, imported only when
an ``S3Server`` is created). Both take the same knobs (``RemoteBehavior``), fault
injection (``fail_next``/``truncate_next``/``reset_next``) and counters (``stats()``)
from ``RemoteControls``.
"""

from __future__ import annotations

from fastload.testing.faults import (
    Fault,
    FaultKind,
    RemoteBehavior,
    RemoteControls,
    RequestStats,
)
from fastload.testing.http_server import RangeHTTPServer
from fastload.testing.process import HTTPServerProcess
from fastload.testing.s3_server import S3Server

__all__ = [
    "Fault",
    "FaultKind",
    "HTTPServerProcess",
    "RangeHTTPServer",
    "RemoteBehavior",
    "RemoteControls",
    "RequestStats",
    "S3Server",
]
