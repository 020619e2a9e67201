"""Bad input to the installed ``fastload`` script: one line on stderr, the right exit code.

Exit code 2: the command line cannot work as given (a bad value, an unknown protocol, a
backend package that is not installed). Exit code 1: the work was tried and failed (no
objects, no cache there, the remote refused). Never a traceback.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastload.testing import S3FolderServer

FASTLOAD = str(Path(sys.executable).parent / "fastload")


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]  # {data}, {empty}, {cache}, {file} are filled in per test
    code: int
    says: str  # a piece of the one line on stderr
    needs_missing: str | None = None  # a package that must not be installed for the case


CASES = {
    "unknown protocol": Case(("warm", "foo://bar/x"), 2, "unknown protocol foo://"),
    "gs without gcsfs": Case(("warm", "gs://bucket/x"), 2, "pip install gcsfs", "gcsfs"),
    "az without adlfs": Case(("warm", "az://container/x"), 2, "pip install adlfs", "adlfs"),
    "bad size": Case(("warm", "{data}", "--max-bytes", "12Q"), 2, "not a size: '12Q'"),
    "rank beyond world": Case(
        ("warm", "{data}", "--rank", "5", "--world-size", "4", "--epochs", "0"),
        2,
        "ranks must be in [0, 4)",
    ),
    "epochs backwards": Case(
        ("warm", "{data}", "--rank", "0", "--world-size", "4", "--epochs", "3..1"), 2, "3..1"
    ),
    "negative rank": Case(
        ("warm", "{data}", "--rank", "-1", "--world-size", "4", "--epochs", "0"),
        2,
        "must not be negative",
    ),
    "negative epoch": Case(
        ("warm", "{data}", "--rank", "0", "--world-size", "4", "--epochs", "-2"),
        2,
        "must not be negative",
    ),
    "world size 0": Case(
        ("warm", "{data}", "--rank", "0", "--world-size", "0", "--epochs", "0"),
        2,
        "must be 1 or more",
    ),
    "no jobs": Case(("warm", "{data}", "--jobs", "0"), 2, "must be 1 or more"),
    "unknown format": Case(("warm", "{data}", "--format", "csv"), 2, "invalid choice"),
    "unknown command": Case(("frobnicate",), 2, "invalid choice"),
    "no cache there": Case(
        ("cache", "ls", "--cache-dir", "{cache}/missing"), 1, "no fastload cache"
    ),
    "cache dir is a file": Case(("warm", "{data}", "--cache-dir", "{file}"), 1, "cannot use"),
    "empty folder": Case(("warm", "{empty}"), 1, "lists no objects"),
    "missing folder": Case(("warm", "{data}/missing"), 1, "lists no objects"),
    "not that format": Case(("warm", "{data}", "--format", "zarr"), 1, "zarr.json"),
}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def assert_one_line(out: subprocess.CompletedProcess[str], code: int, says: str) -> None:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr
    assert len(lines) == 1, out.stderr
    assert says in lines[0], lines[0]


@pytest.fixture
def places(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "data" / "a" / "1.bin").write_bytes(b"one")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_bytes(b"not a folder")
    (tmp_path / "cache").mkdir()
    return {k: str(tmp_path / k) for k in ("data", "empty", "cache", "file")}


@pytest.fixture
def env(places: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "FASTLOAD_CACHE_DIR": places["cache"]}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_gets_one_line_and_its_exit_code(
    case: Case, places: dict[str, str], env: dict[str, str]
) -> None:
    if case.needs_missing and importlib.util.find_spec(case.needs_missing) is not None:
        pytest.skip(f"{case.needs_missing} is installed here")
    out = run([a.format(**places) for a in case.args], env)
    assert_one_line(out, case.code, case.says)


def test_the_same_input_done_right_works(places: dict[str, str], env: dict[str, str]) -> None:
    """The cases above fail for the reason they name, not for something they share."""
    share = ["--rank", "0", "--world-size", "4", "--epochs", "0..1"]
    for args in (["warm", places["data"], "--format", "files"], ["warm", places["data"], *share]):
        out = run(args, env)
        assert out.returncode == 0, out.stderr
    out = run(["cache", "ls", "--cache-dir", places["cache"]], env)
    assert out.returncode == 0, out.stderr
    assert "1.bin" in out.stdout


def test_refused_credentials_get_one_line(places: dict[str, str], env: dict[str, str]) -> None:
    pytest.importorskip("s3fs")
    with S3FolderServer() as server:
        server.upload_dir(Path(places["data"]), "bucket", "ds")
        # The loopback server takes any key; S3 answers a wrong one like this.
        server.fail_next(1000, 403, code="InvalidAccessKeyId")
        creds = {
            "AWS_ACCESS_KEY_ID": "wrong",
            "AWS_SECRET_ACCESS_KEY": "wrong-secret",
            "AWS_ENDPOINT_URL": server.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        out = run(["warm", "s3://bucket/ds"], {**env, **creds})
    assert_one_line(out, 1, "refused")
    assert "wrong-secret" not in out.stderr
