"""What fastload at 93b491a left behind still opens and reads unchanged: a cache directory
(segments, the SQLite index, manifests, a derived ImageFolder layout, a tar index beside the
shards) and a pickled dataset of each format. Made by ``fixtures/make_v93b491a.py``; the
local data and the cache name one fixed folder, so the test lays the copy out there again
with the recorded mtimes (a local object's version)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from make_v93b491a import CACHE, FIXTURE_ROOT, ROOT, digest

import fastload as fl

FIXTURES = Path(__file__).parent / "fixtures" / "v93b491a"
FORMATS = {"folder": "imagefolder", "tar": "tar", "zarr": "zarr", "parquet": "parquet"}


@pytest.fixture
def laid_out(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    root = Path(FIXTURE_ROOT)
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(FIXTURES, root)
    for path, mtime_ns in json.loads((root / "mtimes.json").read_text()).items():
        os.utime(root / path, ns=(mtime_ns, mtime_ns))
    monkeypatch.chdir(root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _entries(root: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(root / CACHE / "index.sqlite") as db:
        return sorted(db.execute("SELECT url, size FROM objects"))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_pickled_dataset_reads_the_same_samples_from_the_old_cache(
    laid_out: Path, name: str
) -> None:
    expected = json.loads((laid_out / "expected.json").read_text())[name]
    before = _entries(laid_out)
    with (laid_out / f"{name}.pickle").open("rb") as f:
        ds = pickle.load(f)
    with ds:
        assert len(ds) == expected["len"]
        assert digest([ds[i] for i in range(len(ds))]) == expected["digest"]
    # Served by the entries cached at 93b491a: nothing fetched again.
    assert _entries(laid_out) == before


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_old_cache_opens_each_dataset_again(laid_out: Path, name: str) -> None:
    expected = json.loads((laid_out / "expected.json").read_text())[name]
    url = {"folder": "folder", "tar": "tar", "zarr": "arrays.zarr", "parquet": "parquet"}[name]
    before = _entries(laid_out)
    with fl.open_dataset(f"{ROOT}/{url}", format=FORMATS[name], cache_dir=CACHE) as ds:
        assert digest([ds[i] for i in range(len(ds))]) == expected["digest"]
    assert _entries(laid_out) == before
