"""Remotes: URLs and protocols (:mod:`.urls`), what a failure means (:mod:`.errors`),
keeping credentials out of text (:mod:`.scrub`), one module per transport (:mod:`.transport`
with its fsspec implementation, :mod:`.obstore` for S3 and HTTP, :mod:`.hub` for ``hf://``;
:mod:`.connect` picks one), and listing a remote (:mod:`.crawl` into :mod:`.listing`'s
columns). An ``s3://`` filesystem is made only where something needs s3fs
(:mod:`.lazy_s3`; obstore's settings from :mod:`.s3_session` where botocore is not needed).

fsspec is the transport only: the cache, its locks, its budget and its index are fastload's.
The names below are what the layers above use most; the rest is in the submodules.
"""

from __future__ import annotations

from fastload.remote.errors import (
    HTTPResponseError,
    backoff_s,
    classify,
    integrity_error,
    is_throttling,
    is_transient,
    with_retries,
)
from fastload.remote.scrub import clean_cause, public_url, redact_transport_logs, scrub
from fastload.remote.urls import (
    check_protocols,
    is_http,
    key_of,
    open_filesystem,
    path_of,
    refuse_credentials,
    remote_url,
)

__all__ = [
    "HTTPResponseError",
    "backoff_s",
    "check_protocols",
    "classify",
    "clean_cause",
    "integrity_error",
    "is_http",
    "is_throttling",
    "is_transient",
    "key_of",
    "open_filesystem",
    "path_of",
    "public_url",
    "redact_transport_logs",
    "refuse_credentials",
    "remote_url",
    "scrub",
    "with_retries",
]
