"""Credentials in a URL (``scheme://user:password@host/...``) are refused before anything
is listed, fetched, logged or cached: one line saying where credentials go, no retry, and
the secret nowhere (error, stderr, the cache directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fastload as fl
from fastload.errors import CredentialsInURLError, FastloadError
from fastload.testing import RangeHTTPServer, S3FolderServer

FASTLOAD = str(Path(sys.executable).parent / "fastload")
SECRET = "s3cr3t-Pa55-ü"

URLS = {
    "s3": "s3://AKIDKEY:{secret}@data/ds",
    "http": "http://user:{secret}@{http}/ds",
    "user-only": "http://{secret}@{http}/ds",
    "chained": "simplecache::s3://AKIDKEY:{secret}@data/ds",
}


@pytest.fixture
def served(tmp_path: Path) -> S3FolderServer:
    (tmp_path / "buckets" / "data" / "ds").mkdir(parents=True)
    (tmp_path / "buckets" / "data" / "ds" / "a.bin").write_bytes(b"x" * 10)
    return S3FolderServer(tmp_path / "buckets")


def _no_secret_below(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


@pytest.mark.parametrize("kind", sorted(URLS))
def test_the_python_api_refuses_credentials_in_a_url(
    kind: str, tmp_path: Path, served: S3FolderServer
) -> None:
    with served, RangeHTTPServer(tmp_path / "buckets" / "data") as http:
        url = URLS[kind].format(secret=SECRET, http=http.url.partition("://")[2])
        options = {"client_kwargs": {"endpoint_url": served.endpoint_url}}
        for call in (
            lambda: fl.open_dataset(url, cache_dir=str(tmp_path / "c"), storage_options=options),
            lambda: fl.warm(url, cache_dir=str(tmp_path / "c"), storage_options=options),
        ):
            with pytest.raises(CredentialsInURLError) as caught:
                call()
            assert isinstance(caught.value, FastloadError)
            assert isinstance(caught.value, ValueError)
            text = str(caught.value)
            assert SECRET not in text
            assert "storage_options" in text
            assert "environment" in text
        # refused before any request: nothing listed, nothing fetched
        assert sum(served.stats().requests.values()) == 0
        assert sum(http.stats().requests.values()) == 0
    _no_secret_below(tmp_path / "c")


def test_the_command_refuses_credentials_in_a_url_in_one_line(
    tmp_path: Path, served: S3FolderServer
) -> None:
    with served:
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": served.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
            "FASTLOAD_CACHE_DIR": str(tmp_path / "c"),
        }
        out = subprocess.run(
            [FASTLOAD, "warm", f"s3://KEY:{SECRET}@data/ds", "--cache-dir", str(tmp_path / "c")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert sum(served.stats().requests.values()) == 0  # not tried, so never retried
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "credentials" in lines[0]
    assert "s3://data/ds" in lines[0]
    assert SECRET not in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    _no_secret_below(tmp_path / "c")


@pytest.mark.parametrize(
    "url",
    [
        "hf://datasets/org/ds@main/train",  # the Hub's @ names a revision
        "s3://bucket/key@2x.png",  # an @ in a key, not in the authority
        "/local/a@b/folder",
    ],
)
def test_an_at_sign_that_is_not_userinfo_is_not_refused(url: str) -> None:
    from fastload.remote import refuse_credentials

    refuse_credentials(url)
