"""``gs://`` against gcp-storage-emulator on loopback (its own process) through gcsfs:
listing, staging (``fl.warm``), a loader epoch of exact samples with non-ASCII names, and
reads pinned at the listed version (a grown object is an error naming it). Skipped where
the emulator or gcsfs is not installed (the test extra installs both)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gcs_emulator import GCSEmulator, gcs_emulator, missing

import fastload as fl
from fastload.cache import Cache
from fastload.errors import RemoteChangedError

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

FILES = {f"ds/cläss {i % 3}/n+{i:02d} é%.bin": f"sample {i} ".encode() * (20 + i) for i in range(9)}


@pytest.fixture
def gcs() -> Iterator[GCSEmulator]:
    with gcs_emulator() as server:
        for key, data in FILES.items():
            server.put(key, data)
        yield server


def open_it(gcs: GCSEmulator, cache: Path) -> fl.ShardedDataset:
    return fl.open_dataset(
        "gs://data/ds", format="files", cache_dir=str(cache), storage_options=gcs.storage_options
    )


def test_a_gs_dataset_lists_stages_and_loads_exact_samples(
    gcs: GCSEmulator, tmp_path: Path
) -> None:
    cache = tmp_path / "c"
    report = fl.warm("gs://data/ds", cache_dir=str(cache), storage_options=gcs.storage_options)
    assert report.objects == len(FILES)
    with Cache(cache, create=False) as c:
        assert {e.url for e in c.entries()} == {f"gs://data/{k}" for k in FILES}
    ds = open_it(gcs, cache)
    assert sorted(ds.keys) == sorted(k[len("ds/") :] for k in FILES)
    loader = fl.DataLoader(ds, batch_size=4, shuffle=True, collate_fn=list, seed=3)
    got = [s for batch in loader for s in batch]
    assert sorted(got) == sorted(FILES.values())
    assert loader.stats()["counts"].get("cache_misses", 0) == 0  # all staged by the warm


def test_a_gs_object_rewritten_after_listing_is_never_read_as_listed(
    gcs: GCSEmulator, tmp_path: Path
) -> None:
    ds = open_it(gcs, tmp_path / "c")
    key = sorted(FILES)[4]
    gcs.put(key, b"a new version, longer " * 40)
    with pytest.raises(RemoteChangedError, match="changed on the remote") as caught:
        ds.store.read_range(key[len("ds/") :], 0, 10)
    assert "refresh=True" in str(caught.value)
