"""Small things the console script must get right: a closed pipe, an empty URL, and what
``fastload warm --json`` counts when opening the dataset already fetched the shards."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

FASTLOAD = str(Path(sys.executable).parent / "fastload")


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [FASTLOAD, *args], capture_output=True, text=True, timeout=300, check=False, env=env
    )


def test_a_reader_that_leaves_early_ends_the_output_quietly(tmp_path: Path) -> None:
    """`fastload cache ls --json | head -1`: the output (~200 kB) is more than a pipe holds,
    so the writer is still writing when the reader closes its end."""
    data = tmp_path / "dätä"
    data.mkdir()
    for i in range(1500):
        (data / f"ü-{i:04d}.bin").write_bytes(b"x")
    cache = str(tmp_path / "cache")
    assert run("warm", str(data), "--cache-dir", cache).returncode == 0
    proc = subprocess.Popen(
        [FASTLOAD, "cache", "ls", "--json", "--cache-dir", cache],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    assert proc.stdout.readline().strip() == b"["
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    assert stderr == b""  # not "fastload: Broken pipe", no traceback
    assert proc.returncode == 141  # as a Unix tool killed by SIGPIPE (128 + 13)


@pytest.mark.parametrize(
    "args",
    [("warm", ""), ("warm", "  "), ("index", ""), ("bench", ""), ("doctor", "")],
    ids=["warm", "warm blank", "index", "bench", "doctor"],
)
def test_an_empty_url_is_a_usage_error(args: tuple[str, ...], tmp_path: Path) -> None:
    """`fastload warm ''` warmed the current folder."""
    env = {**os.environ, "FASTLOAD_CACHE_DIR": str(tmp_path / "cache")}
    paths = env.get("PYTHONPATH", "").split(os.pathsep)  # run from tmp_path: made absolute
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in paths if p)
    out = subprocess.run(
        [FASTLOAD, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
        cwd=tmp_path,
    )
    assert out.returncode == 2, out.stderr
    assert "the URL is empty" in out.stderr
    assert not (tmp_path / "cache").exists()


def write_shard(path: Path, first: int, count: int) -> int:
    with tarfile.open(path, "w") as tar:
        for i in range(first, first + count):
            for ext, data in (("jpg", os.urandom(300)), ("cls", str(i % 3).encode())):
                info = tarfile.TarInfo(f"sämple{i:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path.stat().st_size


def test_warm_json_counts_the_shards_the_open_fetched(tmp_path: Path) -> None:
    """Without an index, opening tar shards reads each through the cache; the report said
    fetched 0 (all 'already cached') after downloading every one."""
    data = tmp_path / "shards"
    data.mkdir()
    sizes = [write_shard(data / f"shard-{k}.tar", 10 * k, 10) for k in range(3)]
    cache = str(tmp_path / "cache")
    out = run("warm", str(data), "--format", "tar", "--json", "--cache-dir", cache)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["fetched"], report["already_cached"]) == (3, 0), report
    assert report["fetched_bytes"] == sum(sizes)
    again = json.loads(
        run("warm", str(data), "--format", "tar", "--json", "--cache-dir", cache).stdout
    )
    assert (again["fetched"], again["already_cached"]) == (0, 3), again
