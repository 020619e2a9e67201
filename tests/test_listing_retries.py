"""A listing survives a throttling remote (remote/obstore.py): each page is asked for again
on its own, inside the remote's AIMD throttle (remote/throttle.py), so a few 503s cost a
few requests, not a second listing of the bucket; a page that keeps failing names its
prefix and its number."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from fastload.errors import RemoteError
from fastload.manifest import list_dataset
from fastload.remote import open_filesystem
from fastload.remote.connect import transport_for
from fastload.remote.throttle import throttle_of
from fastload.testing import S3FolderServer
from fastload.testing.faults import Fault, FaultKind

FOLDERS, PER_FOLDER = 3, 10_000  # 10 pages of 1,000 keys per folder


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("s3")
    for c in range(FOLDERS):
        folder = root / "data" / "ds" / f"c{c}"
        folder.mkdir(parents=True)
        for i in range(PER_FOLDER):
            (folder / f"{i:05d}.bin").write_bytes(b"x")
    return root


def list_requests(server: S3FolderServer) -> int:
    return server.stats().count(path="/data", method="GET")


def test_a_listing_with_503s_is_exact_and_asks_for_few_more_pages(bucket: Path) -> None:
    with S3FolderServer(bucket) as server:
        clean = list_dataset("s3://data/ds", server.storage_options)
        clean_pages = list_requests(server)
        server.reset_stats()
        fs, _ = open_filesystem("s3://data/ds", server.storage_options)
        staging = throttle_of(transport_for(fs), 8, 1)  # the GETs' throttle of this remote
        server.set_fault_rate(
            0.05, [Fault(kind=FaultKind.STATUS, status=503)], methods=["GET"], seed=3
        )
        try:
            throttled = list_dataset("s3://data/ds", server.storage_options)
        finally:
            server.clear_faults()
        faults = server.stats().faults_injected
        pages = list_requests(server)
    assert [(o.key, o.size, o.version) for o in throttled] == [
        (o.key, o.size, o.version) for o in clean
    ]
    assert len(clean) == FOLDERS * PER_FOLDER
    assert clean_pages >= FOLDERS * 10
    assert faults >= 1
    assert pages == clean_pages + faults  # one more request per refused page, no more
    assert pages <= 1.1 * clean_pages
    assert staging.limit < 8  # the listing's 503s halved the throttle the GETs use


def test_a_page_that_keeps_failing_names_the_prefix_and_the_page(
    bucket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fastload.remote.obstore as obstore_transport

    monkeypatch.setattr(obstore_transport, "backoff_s", lambda *a: 0.0)
    with S3FolderServer(bucket) as server:
        stop = threading.Event()

        def fail_pages_once_listing_began() -> None:  # after the folders' own request
            while not stop.is_set() and list_requests(server) < 3:
                time.sleep(0.0005)
            server.fail_next(10_000, 503, path_contains="/data", methods=["GET"])

        arming = threading.Thread(target=fail_pages_once_listing_began)
        arming.start()
        try:
            with pytest.raises(RemoteError) as raised:
                list_dataset("s3://data/ds", server.storage_options)
        finally:
            stop.set()
            arming.join()
            server.clear_faults()
    message = str(raised.value)
    assert "503" in message
    assert re.search(r"s3://data/ds/c\d/? \(listing page \d+\)", message), message
