"""A plain HTTP file server that ignores ``Range`` (Python's own http.server, as many simple
file servers do): it answers a ranged GET with 200 and the whole object. Parquet and
sharded Zarr, which read byte ranges, failed on it ("received 1494876 bytes, expected 8")."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from fastload.datasets import open_dataset
from fastload.remote.connect import transport_for

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zarr = pytest.importorskip("zarr")


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_Handler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.mark.parametrize("fsspec_only", [True, False], ids=["fsspec", "obstore"])
def test_a_range_answered_with_the_whole_object_is_cut_to_the_range(
    server: tuple[str, Path], fsspec_only: bool
) -> None:
    url, root = server
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    (root / "blöb.bin").write_bytes(data)
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    transport = transport_for(fs, 30.0, fsspec_only=fsspec_only)
    path = f"{url}/bl%C3%B6b.bin"
    for start, end in [(10, 20), (0, 8), (4990, 5000), (-8, None), (4000, None), (0, None)]:
        assert bytes(transport.get(path, start, end)) == data[start:end], (start, end)
    assert bytes(transport.get(path)) == data


def test_parquet_row_groups_read_by_range_from_such_a_server(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    url, root = server
    (root / "pq").mkdir()
    table = pa.table({"x": np.arange(1000), "name": [f"ü{i}" for i in range(1000)]})
    pq.write_table(table, root / "pq" / "part-0.parquet", row_group_size=100)
    ds = open_dataset(f"{url}/pq/", format="parquet", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 1000
    for i in (0, 5, 399, 999):
        assert ds[i] == {"x": i, "name": f"ü{i}"}


def test_sharded_zarr_read_by_range_from_such_a_server(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    url, root = server
    values = np.arange(40 * 6, dtype=np.int32).reshape(40, 6)
    array = zarr.create_array(
        str(root / "z"), shape=(40, 6), chunks=(2, 6), shards=(10, 6), dtype="int32"
    )
    array[:] = values
    ds = open_dataset(f"{url}/z/", format="zarr", cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 40
    for i in (0, 5, 11, 37):
        np.testing.assert_array_equal(ds[i], values[i])
