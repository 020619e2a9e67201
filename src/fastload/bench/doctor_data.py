"""The dataset ``fastload doctor`` diagnoses when given no URL: the bench's generated JPEGs
(``bench.e2e.e2e_data``, an ImageFolder of 600 by default) served over S3 from a loopback
server in a process of its own, with the bench's latency and bandwidth per connection.

It lives in bench, not diagnosis, because it needs the harness (generated data, a loopback
server) that shipped diagnosis code must not import; the CLI wires it into the doctor.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastload.errors import MissingBackendError

BUCKET = "fastload-doctor"
SAMPLES = 600


@contextlib.contextmanager
def builtin_remote(
    out: Path, *, samples: int = SAMPLES, latency_s: float = 0.02, bandwidth: float | None = 100e6
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(URL, storage_options) of the generated dataset on a loopback S3 server, while open."""
    if importlib.util.find_spec("s3fs") is None and importlib.util.find_spec("obstore") is None:
        raise MissingBackendError(
            "fastload doctor without a URL serves a generated dataset over S3, which needs "
            "s3fs: pip install 'fastload[bench]' (or give a URL of your own)"
        )
    from fastload.bench.e2e.e2e_data import DataConfig, generate
    from fastload.testing import RemoteBehavior, S3FolderProcess

    data = generate(out / "data" / f"e2e-{samples}", DataConfig(samples=samples))
    root = out / "remote"
    served = root / BUCKET / "folder"
    stamp = out / f".remote-{samples}"
    if not stamp.exists():  # a fresh copy (hard links where it can) of the generated folder
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(data.folder, served, copy_function=_link_or_copy)
        stamp.touch()
    behavior = RemoteBehavior(latency_s=latency_s, bandwidth_bytes_per_s=bandwidth)
    with S3FolderProcess(root, behavior=behavior) as server:
        yield f"s3://{BUCKET}/folder", server.storage_options


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
